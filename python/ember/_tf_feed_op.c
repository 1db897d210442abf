/* python/ember/_tf_feed_op.c - the TensorFlow op EmberFeedNext: the next
 * batch of a node's feed, read by TensorFlow's own threads (the op behind
 * ember.tf.feed_dataset).
 *
 * Written in C against TensorFlow's C kernel API (tensorflow/c/kernels.h,
 * ops.h), not its C++ one: the C API's symbols in libtensorflow_framework.so.2
 * keep their ABI across TensorFlow releases and compilers, where a C++ op
 * must be built with the exact compiler flags and headers of the installed
 * TensorFlow.  setup.py builds this file alone into ember/_ember_tf*.so
 * (only where TensorFlow is installed), linked with libtensorflow_framework
 * and NOT with libember: libember's symbols are private to ember._ember, and
 * a second copy here would have its own reader registry, empty.  So every
 * call on the feed goes through the ember_feed_reader_api table whose address
 * ember._ember hands out (ember/feed_reader.h); the ember headers are
 * included for their types and constants only.
 *
 * The table is attached to this library once per process, by ember.tf
 * through ember_tf_attach (ctypes), never carried in an attr: a graph that
 * holds the op may run in another process (ParameterServerStrategy traces
 * a worker's dataset_fn on the coordinator and runs it on the worker), where
 * ember._ember lies at another address.  For the same reason an attr reader
 * of 0 means "this process's node reader", which the node attaches.
 *
 * The .so is loaded by tf.load_op_library, never imported: the op is
 * registered by a constructor when the library is loaded, and TensorFlow's
 * loader collects only ops registered during its own dlopen, so a library
 * already loaded by something else (an `import ember._ember_tf`, which has
 * no module init to find anyway) would yield a Python module without the op.
 *
 * Op (attrs are fixed per dataset; the reader is named by id, so an op that
 * outlives its node fails cleanly instead of touching a freed reader):
 *
 *   EmberFeedNext(reader: int, batch_size: int >= 1,
 *                 dtypes: list({float, double, int32, int64, uint8, bool,
 *                               string}) >= 1,
 *                 widths: list(int), timeout_ms: int = -1)
 *     -> (more: bool, components: dtypes)
 *
 *   more == true: one batch of 1..batch_size rows; component i is
 *   [rows, widths[i]] (numeric) or [rows] (string).  more == false: the end
 *   of the sequence (one train() call's data); components are empty.
 *
 * Thread-safety: TensorFlow may run one kernel's Compute on several threads
 * at once (tf.data's parallel calls, concurrent steps); a reader wants one
 * consumer (wait, layout and take belong together), so each kernel holds its
 * own lock across a whole Compute.  Two kernels on one reader id are the
 * caller's mistake, as two consumers of one reader are in C.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EMBER_TF_UNIT feed_op
#include "_tf_kernel.h"
#include "tensorflow/c/tf_tstring.h"

#include "ember/batch.h"
#include "ember/error.h"
#include "ember/feed_reader.h"

#define OP_NAME "EmberFeedNext"

/* Each wait on the reader blocks at most this long; the op counts the total
 * against timeout_ms itself, so its DEADLINE_EXCEEDED can name feed_timeout. */
#define WAIT_SLICE_MS 200

/* One component of the dataset's element, as the attrs declare it. */
typedef struct {
  TF_DataType dtype;
  uint8_t ember_dtype; /* the column dtype that dtype reads */
  uint32_t width;      /* elements per row; 0 for strings (ignored) */
} component;

/* What ember_tf_attach set in this process (NULL/0 before). */
static const ember_feed_reader_api *_Atomic attached_api;
static _Atomic uint64_t attached_node_reader;

__attribute__((visibility("default"))) int ember_tf_attach(const void *table,
                                                           uint64_t node_reader);

/* Returns 0, or -1 when the table is of another build (nothing attached). */
int ember_tf_attach(const void *table, uint64_t node_reader) {
  const ember_feed_reader_api *api = table;
  if (api == NULL || api->abi != EMBER_FEED_READER_ABI ||
      api->size < sizeof(ember_feed_reader_api) || api->acquire == NULL ||
      api->release == NULL || api->wait == NULL || api->layout == NULL || api->take == NULL ||
      api->last_error == NULL)
    return -1;
  attached_api = api;
  if (node_reader != 0)
    attached_node_reader = node_reader;
  return 0;
}

typedef struct {
  uint64_t reader; /* 0: the process's node reader, looked up per Compute */
  uint32_t batch_size;
  int64_t timeout_ms; /* < 0: no limit */
  pthread_mutex_t mu; /* one Compute at a time (see the top of the file) */
  ember_column cols[EMBER_BATCH_MAX_COLS]; /* layout's answer, under mu */
  void *dests[EMBER_BATCH_MAX_COLS];      /* take's destinations, under mu */
  TF_Tensor *outs[EMBER_BATCH_MAX_COLS];  /* the components' handles, under mu */
  uint32_t ncomp;
  component comp[]; /* ncomp */
} feed_next;

/* ------------------------------------------------------------ helpers */

static TF_Code tf_code_of(int rc) {
  switch (rc) {
  case EMBER_ESCHEMA:
  case EMBER_EINVAL:
    return TF_INVALID_ARGUMENT; /* the data or the dataset's spec is wrong */
  case EMBER_EABORTED:
    return TF_CANCELLED; /* the reader is being closed */
  case EMBER_ENODE:
    return TF_ABORTED; /* a feeding task failed (fail_on_producer_error) */
  case EMBER_ENOMEM:
    return TF_RESOURCE_EXHAUSTED;
  default:
    return TF_INTERNAL;
  }
}

/* Fails Compute with the reader's message for rc.  Call right after the
 * failed call: last_error is the calling thread's. */
static void fail_ember(TF_OpKernelContext *ctx, const ember_feed_reader_api *api, int rc,
                       const char *what) {
  char op[64];
  snprintf(op, sizeof op, "feed reader %s", what);
  embtf_fail_ember(ctx, tf_code_of(rc), rc, api->last_error(), op);
}

/* "float32 x 784" or "string", into buf. */
static const char *describe(char *buf, size_t cap, uint8_t dtype, uint32_t width) {
  if (dtype == EMBER_DT_BYTES)
    snprintf(buf, cap, "string");
  else
    snprintf(buf, cap, "%s x %" PRIu32 " per row", embtf_dtype_name(dtype), width);
  return buf;
}

/* ------------------------------------------------------------ kernel: create */

static void feed_next_delete(void *p) {
  feed_next *k = p;
  if (k == NULL) /* create failed: TensorFlow still calls delete */
    return;
  pthread_mutex_destroy(&k->mu);
  free(k);
}

static int get_int(TF_OpKernelConstruction *ctx, const char *name, int64_t *out,
                   TF_Status *st) {
  TF_OpKernelConstruction_GetAttrInt64(ctx, name, out, st);
  return TF_GetCode(st) == TF_OK ? 0 : -1;
}

static void *feed_next_create(TF_OpKernelConstruction *ctx) {
  TF_Status *st = TF_NewStatus();
  feed_next *k = NULL;
  TF_DataType *dtypes = NULL;
  int64_t *widths = NULL;
  int64_t reader, batch_size, timeout_ms;
  int32_t ndtypes, nwidths, total;

  if (get_int(ctx, "reader", &reader, st) || get_int(ctx, "batch_size", &batch_size, st) ||
      get_int(ctx, "timeout_ms", &timeout_ms, st))
    goto err;
  if (batch_size < 1 || batch_size > UINT32_MAX) {
    embtf_set_status(st, TF_INVALID_ARGUMENT, OP_NAME ": batch_size must be in 1..%" PRIu32
               ", not %" PRId64, UINT32_MAX, batch_size);
    goto err;
  }

  TF_OpKernelConstruction_GetAttrSize(ctx, "dtypes", &ndtypes, &total, st);
  if (TF_GetCode(st) != TF_OK)
    goto err;
  TF_OpKernelConstruction_GetAttrSize(ctx, "widths", &nwidths, &total, st);
  if (TF_GetCode(st) != TF_OK)
    goto err;
  if (ndtypes < 1 || (uint32_t)ndtypes > EMBER_BATCH_MAX_COLS) {
    embtf_set_status(st, TF_INVALID_ARGUMENT, OP_NAME ": %" PRId32 " dtypes; a feed batch has "
               "1..%u columns", ndtypes, EMBER_BATCH_MAX_COLS);
    goto err;
  }
  if (nwidths != ndtypes) {
    embtf_set_status(st, TF_INVALID_ARGUMENT, OP_NAME ": %" PRId32 " widths for %" PRId32
               " dtypes (one width per component)", nwidths, ndtypes);
    goto err;
  }
  dtypes = malloc((size_t)ndtypes * sizeof *dtypes);
  widths = malloc((size_t)ndtypes * sizeof *widths);
  k = calloc(1, sizeof *k + (size_t)ndtypes * sizeof k->comp[0]);
  if (dtypes == NULL || widths == NULL || k == NULL) {
    embtf_set_status(st, TF_RESOURCE_EXHAUSTED, OP_NAME ": out of memory");
    goto err;
  }
  TF_OpKernelConstruction_GetAttrTypeList(ctx, "dtypes", dtypes, ndtypes, st);
  if (TF_GetCode(st) != TF_OK)
    goto err;
  TF_OpKernelConstruction_GetAttrInt64List(ctx, "widths", widths, ndtypes, st);
  if (TF_GetCode(st) != TF_OK)
    goto err;

  for (int32_t i = 0; i < ndtypes; i++) {
    component *c = &k->comp[i];
    c->dtype = dtypes[i];
    c->ember_dtype = embtf_ember_dtype(dtypes[i]);
    if (c->ember_dtype == 0) { /* the op def restricts dtypes; this is a backstop */
      embtf_set_status(st, TF_INVALID_ARGUMENT, OP_NAME ": component %" PRId32 " has TensorFlow "
                 "dtype %d; the feed carries float32, float64, int32, int64, uint8, bool "
                 "and string", i, (int)dtypes[i]);
      goto err;
    }
    if (c->ember_dtype == EMBER_DT_BYTES) {
      c->width = 0; /* a string column is one string per row, whatever was declared */
      continue;
    }
    /* bounded here so that Compute's [rows, width] never overflows: TensorFlow
     * aborts the process on a shape of more than 2^63 - 1 elements */
    size_t elem = TF_DataTypeSize(c->dtype); /* the feed's element size for its dtype */
    int64_t bytes;
    if (widths[i] < 0 || widths[i] > UINT32_MAX || elem == 0 ||
        __builtin_mul_overflow(batch_size, widths[i], &bytes) ||
        __builtin_mul_overflow(bytes, (int64_t)elem, &bytes)) {
      embtf_set_status(st, TF_INVALID_ARGUMENT, OP_NAME ": component %" PRId32 " (%s): width %"
                 PRId64 " is out of range for batch_size %" PRId64, i,
                 embtf_dtype_name(c->ember_dtype), widths[i], batch_size);
      goto err;
    }
    c->width = (uint32_t)widths[i];
  }

  k->reader = (uint64_t)reader;
  k->batch_size = (uint32_t)batch_size;
  k->timeout_ms = timeout_ms;
  k->ncomp = (uint32_t)ndtypes;
  int e = pthread_mutex_init(&k->mu, NULL);
  if (e != 0) {
    embtf_set_status(st, TF_INTERNAL, OP_NAME ": pthread_mutex_init: %s", strerror(e));
    goto err;
  }
  free(dtypes);
  free(widths);
  TF_DeleteStatus(st);
  return k;

err:
  TF_OpKernelConstruction_Failure(ctx, st);
  TF_DeleteStatus(st);
  free(dtypes);
  free(widths);
  free(k); /* the mutex is initialised last: nothing else to undo */
  return NULL;
}

/* ------------------------------------------------------------ kernel: compute */

/* Allocates output i + 1 (component i) with `rows` rows; NULL after failing
 * ctx.  The caller deletes the handle. */
static TF_Tensor *allocate_component(TF_OpKernelContext *ctx, const feed_next *k, uint32_t i,
                                     uint32_t rows) {
  const component *c = &k->comp[i];
  int64_t dims[2] = {rows, c->width};
  int ndims = c->ember_dtype == EMBER_DT_BYTES ? 1 : 2;
  /* len is unused by TF_AllocateOutput (the shape and the op's dtype decide);
   * it is given right anyway.  No overflow: create bounded batch_size x width. */
  size_t elem = c->ember_dtype == EMBER_DT_BYTES ? sizeof(TF_TString)
                                                  : TF_DataTypeSize(c->dtype);
  size_t len = (size_t)rows * (ndims == 2 ? c->width : 1) * elem;
  TF_Status *st = TF_NewStatus();
  TF_Tensor *t = TF_AllocateOutput(ctx, (int)i + 1, c->dtype, dims, ndims, len, st);
  if (TF_GetCode(st) != TF_OK) {
    TF_OpKernelContext_Failure(ctx, st);
    t = NULL;
  }
  TF_DeleteStatus(st);
  return t;
}

/* Sets output 0, the scalar `more`; 0, or -1 after failing ctx. */
static int set_more(TF_OpKernelContext *ctx, bool more) {
  TF_Status *st = TF_NewStatus();
  TF_Tensor *t = TF_AllocateOutput(ctx, 0, TF_BOOL, NULL, 0, 1, st);
  int rc = 0;
  if (TF_GetCode(st) != TF_OK) {
    TF_OpKernelContext_Failure(ctx, st);
    rc = -1;
  } else {
    *(uint8_t *)TF_TensorData(t) = more; /* TF_BOOL is one byte, 0 or 1 */
    TF_DeleteTensor(t);
  }
  TF_DeleteStatus(st);
  return rc;
}

/* Waits for the next batch: 0 with *rows set, or -1 after failing ctx. */
static int wait_batch(TF_OpKernelContext *ctx, const feed_next *k,
                      const ember_feed_reader_api *api, ember_feed_reader *r, uint32_t *rows) {
  int64_t start = embtf_now_ms();
  for (;;) {
    int64_t slice = WAIT_SLICE_MS;
    if (k->timeout_ms >= 0) {
      int64_t left = k->timeout_ms - (embtf_now_ms() - start);
      if (left < slice)
        slice = left < 0 ? 0 : left;
    }
    int rc = api->wait(r, k->batch_size, slice, rows);
    if (rc == EMBER_OK)
      return 0;
    if (rc != EMBER_ETIMEDOUT) {
      fail_ember(ctx, api, rc, "wait");
      return -1;
    }
    if (k->timeout_ms >= 0 && embtf_now_ms() - start >= k->timeout_ms) {
      embtf_fail(ctx, TF_DEADLINE_EXCEEDED, "no data arrived on the feed for %g s (feed_timeout); "
           "is cluster.train() running?", (double)k->timeout_ms / 1000.0);
      return -1;
    }
  }
}

/* Checks the rows' columns against the declared components: 0, or -1 after
 * failing ctx with a message naming the first mismatch. */
static int check_layout(TF_OpKernelContext *ctx, const feed_next *k, uint32_t ncols) {
  if (ncols != k->ncomp) {
    char names[512] = "";
    size_t at = 0;
    for (uint32_t i = 0; i < ncols && at < sizeof names; i++) {
      int n = snprintf(names + at, sizeof names - at, "%s\"%.*s\"", i ? ", " : "",
                       (int)k->cols[i].name_len, k->cols[i].name);
      if (n < 0)
        break;
      at += (size_t)n;
    }
    embtf_fail(ctx, TF_INVALID_ARGUMENT, "the feed's rows have %" PRIu32 " columns (%s); the "
         "dataset declares %" PRIu32 " components", ncols, names, k->ncomp);
    return -1;
  }
  for (uint32_t i = 0; i < ncols; i++) {
    const ember_column *col = &k->cols[i];
    const component *c = &k->comp[i];
    bool same = col->dtype == c->ember_dtype &&
                (c->ember_dtype == EMBER_DT_BYTES || col->width == c->width);
    if (!same) {
      char want[64], got[64];
      embtf_fail(ctx, TF_INVALID_ARGUMENT, "feed column %" PRIu32 " (\"%.*s\"): the dataset "
           "declares %s, the rows received have %s", i, (int)col->name_len, col->name,
           describe(want, sizeof want, c->ember_dtype, c->width),
           describe(got, sizeof got, col->dtype, col->width));
      return -1;
    }
  }
  return 0;
}

static void feed_next_compute(void *p, TF_OpKernelContext *ctx) {
  feed_next *k = p;
  const ember_feed_reader_api *api = attached_api;
  uint64_t reader = k->reader != 0 ? k->reader : attached_node_reader;
  ember_feed_reader *r = NULL;
  ember_feed_reader_bytes *refs = NULL;
  uint32_t nouts = 0, rows = 0, ncols = 0;
  int rc;

  pthread_mutex_lock(&k->mu);
  if (api == NULL || reader == 0) {
    embtf_fail(ctx, TF_FAILED_PRECONDITION, OP_NAME ": no Ember feed reader in this process: the "
         "dataset reads the feed of an Ember node, so it must run in a node's process "
         "(ember.tf.feed_dataset, or ember.ps.tensorflow_server on a fed worker)");
    goto out;
  }
  if ((rc = api->acquire(reader, &r)) != EMBER_OK) {
    r = NULL;
    if (rc == EMBER_ENOTFOUND)
      embtf_fail(ctx, TF_FAILED_PRECONDITION,
           "the node's feed reader is closed (the node is shutting down)");
    else
      fail_ember(ctx, api, rc, "acquire");
    goto out;
  }
  if (wait_batch(ctx, k, api, r, &rows) != 0)
    goto out;

  if (rows == 0) { /* the end of the sequence: empty components, more = false */
    for (; nouts < k->ncomp; nouts++)
      if ((k->outs[nouts] = allocate_component(ctx, k, nouts, 0)) == NULL)
        goto out;
    set_more(ctx, false);
    goto out;
  }

  if ((rc = api->layout(r, k->cols, EMBER_BATCH_MAX_COLS, &ncols)) != EMBER_OK) {
    fail_ember(ctx, api, rc, "layout");
    goto out;
  }
  if (check_layout(ctx, k, ncols) != 0)
    goto out; /* the rows stay held: the next call meets the same mismatch */

  /* take copies straight into the outputs; strings come as references into
   * the reader's items, copied into the tensor's TF_TStrings after */
  size_t nstrings = 0;
  for (uint32_t i = 0; i < k->ncomp; i++)
    nstrings += k->comp[i].ember_dtype == EMBER_DT_BYTES;
  if (nstrings > 0 && (refs = malloc(nstrings * rows * sizeof *refs)) == NULL) {
    embtf_fail(ctx, TF_RESOURCE_EXHAUSTED, OP_NAME ": out of memory for %" PRIu32 " rows of %zu "
         "string columns", rows, nstrings);
    goto out;
  }
  static uint8_t nowhere; /* a dest for a 0-width column (no data pointer) */
  for (size_t s = 0; nouts < k->ncomp; nouts++) {
    if ((k->outs[nouts] = allocate_component(ctx, k, nouts, rows)) == NULL)
      goto out;
    if (k->comp[nouts].ember_dtype == EMBER_DT_BYTES) {
      k->dests[nouts] = refs + rows * s++;
    } else {
      void *data = TF_TensorData(k->outs[nouts]);
      k->dests[nouts] = data != NULL ? data : &nowhere;
    }
  }
  if ((rc = api->take(r, rows, k->dests, ncols)) != EMBER_OK) {
    fail_ember(ctx, api, rc, "take");
    goto out;
  }
  for (uint32_t i = 0; i < k->ncomp; i++) {
    if (k->comp[i].ember_dtype != EMBER_DT_BYTES)
      continue;
    TF_TString *ts = TF_TensorData(k->outs[i]);
    const ember_feed_reader_bytes *b = k->dests[i];
    for (uint32_t j = 0; j < rows; j++) {
      TF_TString_Init(&ts[j]); /* empty already (TensorFlow constructs them): no leak */
      if (b[j].len > 0)        /* len 0 may come with data NULL */
        TF_TString_Copy(&ts[j], (const char *)b[j].data, (size_t)b[j].len);
    }
  }
  set_more(ctx, true);

out:
  for (uint32_t i = 0; i < nouts; i++) /* the outputs live on in ctx */
    if (k->outs[i] != NULL)
      TF_DeleteTensor(k->outs[i]);
  free(refs);
  if (r != NULL)
    api->release(r);
  pthread_mutex_unlock(&k->mu);
}

/* ------------------------------------------------------------ registration */

/* `more` is a scalar.  The components' shapes ([?, width] or [?]) would need
 * the dtypes and widths lists, which the C shape-inference API cannot read;
 * they stay unknown here and ember.tf sets them on the dataset. */
static void feed_next_shape(TF_ShapeInferenceContext *ctx, TF_Status *status) {
  TF_ShapeInferenceContextSetUnknownShape(ctx, status);
  if (TF_GetCode(status) != TF_OK)
    return;
  TF_ShapeHandle *scalar = TF_ShapeInferenceContextScalar(ctx);
  TF_ShapeInferenceContextSetOutput(ctx, 0, scalar, status);
  TF_DeleteShapeHandle(scalar);
}

__attribute__((constructor)) static void register_feed_next(void) {
  TF_OpDefinitionBuilder *b = TF_NewOpDefinitionBuilder(OP_NAME);
  TF_OpDefinitionBuilderAddAttr(b, "reader: int");
  TF_OpDefinitionBuilderAddAttr(b, "batch_size: int >= 1");
  /* the dtypes a feed column can hold: any other fails where the op is made */
  TF_OpDefinitionBuilderAddAttr(
      b, "dtypes: list({float, double, int32, int64, uint8, bool, string}) >= 1");
  TF_OpDefinitionBuilderAddAttr(b, "widths: list(int)");
  TF_OpDefinitionBuilderAddAttr(b, "timeout_ms: int = -1");
  TF_OpDefinitionBuilderAddOutput(b, "more: bool");
  TF_OpDefinitionBuilderAddOutput(b, "components: dtypes");
  /* it pops a queue: never constant-folded, deduplicated or skipped */
  TF_OpDefinitionBuilderSetIsStateful(b, true);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(b, feed_next_shape);
  embtf_register_op(OP_NAME, b, feed_next_create, feed_next_compute, feed_next_delete);
}
