/* python/ember/_ember_feed.c - FeedServer, FeedClient and FeedItem.
 *
 * A FeedItem owns one received batch (the C item or a RESULTS buffer) and
 * exports it through the buffer protocol, read-only, format "B", so
 * numpy.frombuffer(item, dtype, count, offset) views a column without a copy
 * and keeps the item alive.  The batch is decoded once, when it is received,
 * with the GIL still released; .columns lists each column's byte offsets.
 *
 * Thread-safety: every ember_feed_server_* call is thread-safe in C (one
 * mutex guards the queue and the connections), so FeedServer needs no lock of
 * its own: a consumer may sit in next() while another thread sends results,
 * terminates or reads stats.  The C feed client is not: send() peeks at the
 * socket for a REFUSED frame, so it reads the same fd as recv_results and
 * end_partition, and its state flags are unsynchronized.  FeedClient
 * therefore serializes all its calls with one per-object lock; a producer
 * that wants results interleaves send() and recv_results() on one thread
 * (results that arrive during end_partition are buffered by libember).
 */
#include "_ember.h"
#include "ember/feed_reader.h"

#include <stdlib.h>
#include <string.h>


enum { ITEM_BATCH = 1, ITEM_END = 2, ITEM_RESULTS = 3, ITEM_ERROR = 4, ITEM_START = 5,
       ITEM_PARTITION_END = 6, ITEM_CALL_END = 7 };

static PyObject *self_enter(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  return Py_NewRef(self);
}

static int check_u32(Py_ssize_t v, const char *what, uint32_t *out) {
  if (v < 0 || (unsigned long long)v > UINT32_MAX) {
    PyErr_Format(PyExc_ValueError, "%s must be in 0..%u, not %zd", what, UINT32_MAX, v);
    return -1;
  }
  *out = (uint32_t)v;
  return 0;
}

/* ================================================================ FeedItem */

typedef struct {
  PyObject_HEAD
  int kind;
  uint64_t source;
  uint64_t call;
  uint32_t partition;
  uint32_t flags;
  uint32_t nrows;
  PyObject *columns;      /* list of column tuples (empty for "end") */
  const uint8_t *data;    /* the encoded batch; NULL after release() */
  size_t len;
  ember_feed_item *item;  /* owner of data for server items, or NULL */
  uint8_t *raw;           /* owner of data for RESULTS from a client, or NULL */
  Py_ssize_t exports;     /* live buffer exports */
  int released;           /* release() was called */
} FeedItemObject;

/* Takes ownership of item / raw (exactly one non-NULL) whatever happens. */
static PyObject *FeedItem_create(ember_state *st, int kind, uint64_t source, uint64_t call,
                                 uint32_t partition, uint32_t flags,
                                 ember_feed_item *item, uint8_t *raw,
                                 const uint8_t *data, size_t len,
                                 const embpy_decoded *d) {
  FeedItemObject *self = NULL;
  PyObject *cols = d->cols ? embpy_decoded_to_list(data, d) : PyList_New(0);
  if (cols == NULL)
    goto err;
  self = (FeedItemObject *)st->FeedItem_Type->tp_alloc(st->FeedItem_Type, 0);
  if (self == NULL)
    goto err;
  self->kind = kind;
  self->source = source;
  self->call = call;
  self->partition = partition;
  self->flags = flags;
  self->nrows = d->nrows;
  self->columns = cols;
  self->data = data;
  self->len = len;
  self->item = item;
  self->raw = raw;
  self->exports = 0;
  self->released = 0;
  return (PyObject *)self;
err:
  Py_XDECREF(cols);
  ember_feed_item_free(item);
  free(raw);
  return NULL;
}

static void FeedItem_free_data(FeedItemObject *self) {
  ember_feed_item_free(self->item);
  free(self->raw);
  self->item = NULL;
  self->raw = NULL;
  self->data = NULL;
}

static int FeedItem_traverse(PyObject *op, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(((FeedItemObject *)op)->columns);
  return 0;
}

static int FeedItem_clear(PyObject *op) {
  Py_CLEAR(((FeedItemObject *)op)->columns);
  return 0;
}

static void FeedItem_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  FeedItem_clear(op);
  FeedItem_free_data((FeedItemObject *)op);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static int FeedItem_getbuffer(PyObject *op, Py_buffer *view, int flags) {
  FeedItemObject *self = (FeedItemObject *)op;
  static uint8_t empty[8]; /* a valid pointer for empty (END) items */
  if (self->released) {
    PyErr_SetString(PyExc_ValueError, "FeedItem has been released");
    view->obj = NULL;
    return -1;
  }
  void *buf = self->data != NULL ? (void *)self->data : (void *)empty;
  size_t len = self->data != NULL ? self->len : 0;
  if (PyBuffer_FillInfo(view, op, buf, (Py_ssize_t)len, 1, flags) < 0)
    return -1;
  self->exports++;
  return 0;
}

static void FeedItem_releasebuffer(PyObject *op, Py_buffer *view) {
  ((FeedItemObject *)op)->exports--;
}

PyDoc_STRVAR(FeedItem_release_doc,
             "release() -> None\n\n"
             "Frees the batch now instead of when the item is collected.  Raises\n"
             "BufferError while views of it (numpy arrays, memoryviews) are alive.");

static PyObject *FeedItem_release(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  FeedItemObject *self = (FeedItemObject *)op;
  if (self->exports > 0) {
    PyErr_Format(PyExc_BufferError,
                 "FeedItem cannot be released: %zd buffer view(s) of it (numpy "
                 "arrays, memoryviews) are alive",
                 self->exports);
    return NULL;
  }
  FeedItem_free_data(self);
  self->released = 1;
  Py_RETURN_NONE;
}

static const char *item_kind_name(int kind) {
  switch (kind) {
  case ITEM_BATCH: return "batch";
  case ITEM_END: return "end";
  case ITEM_RESULTS: return "results";
  case ITEM_ERROR: return "error";
  case ITEM_START: return "start";
  case ITEM_PARTITION_END: return "partition_end";
  case ITEM_CALL_END: return "call_end";
  default: return "unknown";
  }
}

static PyObject *FeedItem_get_kind(PyObject *op, void *c) {
  return PyUnicode_FromString(item_kind_name(((FeedItemObject *)op)->kind));
}
static PyObject *FeedItem_get_source(PyObject *op, void *c) {
  return PyLong_FromUnsignedLongLong(((FeedItemObject *)op)->source);
}
static PyObject *FeedItem_get_call(PyObject *op, void *c) {
  return PyLong_FromUnsignedLongLong(((FeedItemObject *)op)->call);
}
static PyObject *FeedItem_get_tag(PyObject *op, void *c) {
  FeedItemObject *self = (FeedItemObject *)op;
  if (self->kind != ITEM_START)
    Py_RETURN_NONE;
  return PyBytes_FromStringAndSize(self->data ? (const char *)self->data : "",
                                   self->data ? (Py_ssize_t)self->len : 0);
}
static PyObject *FeedItem_get_partition(PyObject *op, void *c) {
  return PyLong_FromUnsignedLong(((FeedItemObject *)op)->partition);
}
static PyObject *FeedItem_get_flags(PyObject *op, void *c) {
  return PyLong_FromUnsignedLong(((FeedItemObject *)op)->flags);
}
static PyObject *FeedItem_get_reason(PyObject *op, void *c) {
  FeedItemObject *self = (FeedItemObject *)op;
  if (self->kind != ITEM_ERROR || self->data == NULL)
    Py_RETURN_NONE;
  return PyUnicode_DecodeUTF8((const char *)self->data, (Py_ssize_t)self->len, "replace");
}
static PyObject *FeedItem_get_nrows(PyObject *op, void *c) {
  return PyLong_FromUnsignedLong(((FeedItemObject *)op)->nrows);
}
static PyObject *FeedItem_get_columns(PyObject *op, void *c) {
  PyObject *cols = ((FeedItemObject *)op)->columns;
  if (cols == NULL)
    return PyList_New(0);
  return PyList_GetSlice(cols, 0, PyList_GET_SIZE(cols)); /* a copy */
}

static PyObject *FeedItem_repr(PyObject *op) {
  FeedItemObject *self = (FeedItemObject *)op;
  return PyUnicode_FromFormat("<ember._ember.FeedItem kind=%s partition=%u nrows=%u "
                              "nbytes=%zu%s>",
                              item_kind_name(self->kind), (unsigned)self->partition,
                              (unsigned)self->nrows, self->len,
                              self->released ? " released" : "");
}

static PyMethodDef FeedItem_methods[] = {
    {"release", FeedItem_release, METH_NOARGS, FeedItem_release_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef FeedItem_getset[] = {
    {"kind", FeedItem_get_kind, NULL,
     "'batch', 'end', 'results', 'error' (a producer failed; see reason), or\n"
     "for a named call (call != 0) 'start' (a partition begins; see tag),\n"
     "'partition_end' (it was delivered whole) and 'call_end' (every\n"
     "partition of the call for this node ended).", NULL},
    {"call", FeedItem_get_call, NULL,
     "The call (64-bit id from the producer's FeedClient; 0: anonymous).", NULL},
    {"tag", FeedItem_get_tag, NULL,
     "For a 'start' item: the producer's description of its partition\n"
     "(bytes, FeedClient's tag).  None for other kinds.", NULL},
    {"reason", FeedItem_get_reason, NULL,
     "For an 'error' item: why its producer failed (the batches it sent before\n"
     "came first).  None for other kinds.",
     NULL},
    {"source", FeedItem_get_source, NULL,
     "The producer connection id (for FeedServer.send_results); 0 for results.", NULL},
    {"partition", FeedItem_get_partition, NULL, "The producer's partition id.", NULL},
    {"flags", FeedItem_get_flags, NULL, "The producer's FEED_HELLO flags.", NULL},
    {"nrows", FeedItem_get_nrows, NULL, "Rows in the batch (0 for 'end').", NULL},
    {"columns", FeedItem_get_columns, NULL,
     "[(name, dtype, width, offset, nbytes, offsets_offset), ...]: byte offsets\n"
     "into this item's buffer; offsets_offset is -1 unless dtype is DT_BYTES,\n"
     "whose nrows + 1 uint64 offsets index the nbytes data bytes at offset.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(FeedItem_doc,
             "One item received from the feed: a batch, the end of the feed, or a\n"
             "batch of results.  Exposes the encoded batch through the buffer\n"
             "protocol (read-only bytes), e.g.\n"
             "  name, dt, width, off, nbytes, _ = item.columns[0]\n"
             "  x = numpy.frombuffer(item, numpy.float32, item.nrows * width, off)\n"
             "Not constructible from Python.");

static PyType_Slot FeedItem_slots[] = {
    {Py_tp_doc, (void *)FeedItem_doc},
    {Py_tp_dealloc, FeedItem_dealloc},
    {Py_tp_traverse, FeedItem_traverse},
    {Py_tp_clear, FeedItem_clear},
    {Py_tp_repr, FeedItem_repr},
    {Py_tp_methods, FeedItem_methods},
    {Py_tp_getset, FeedItem_getset},
    {Py_bf_getbuffer, FeedItem_getbuffer},
    {Py_bf_releasebuffer, FeedItem_releasebuffer},
    {0, NULL},
};

static PyType_Spec FeedItem_spec = {
    .name = "ember._ember.FeedItem",
    .basicsize = sizeof(FeedItemObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = FeedItem_slots,
};

/* ================================================================ FeedServer */

typedef struct {
  PyObject_HEAD
  embpy_handle h; /* no lock: the C server is thread-safe */
  uint16_t port;
} FeedServerObject;

static void feed_server_destroy(void *p) { ember_feed_server_destroy(p); }

static PyObject *FeedServer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"secret",      "listen_fd", "host",          "port",
                           "queue_bytes", "max_frame", "io_timeout_ms", "shm",
                           "encrypt",     NULL};
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL)
    return NULL;
  Py_buffer secret;
  int listen_fd = -1;
  const char *host = "";
  uint16_t port = 0;
  Py_ssize_t queue_bytes = 0, max_frame = 0, io_ms = 0;
  int shm = 1, encrypt = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|$isO&nnnpp:FeedServer", kwlist,
                                   &secret, &listen_fd, &host, embpy_port_conv, &port,
                                   &queue_bytes, &max_frame, &io_ms, &shm, &encrypt))
    return NULL;
  FeedServerObject *self = NULL;
  ember_feed_server_config cfg;
  memset(&cfg, 0, sizeof cfg);
  if (queue_bytes < 0) {
    PyErr_Format(PyExc_ValueError, "queue_bytes must be >= 0, not %zd", queue_bytes);
    goto err;
  }
  if (check_u32(max_frame, "max_frame", &cfg.max_frame) < 0 ||
      check_u32(io_ms, "io_timeout_ms", &cfg.io_timeout_ms) < 0)
    goto err;
  cfg.secret = secret.buf;
  cfg.secret_len = (size_t)secret.len;
  cfg.listen_fd = listen_fd < 0 ? -1 : listen_fd;
  cfg.bind_host = host;
  cfg.port = port;
  cfg.queue_bytes = (size_t)queue_bytes;
  cfg.disable_shm = !shm;
  cfg.encrypt = encrypt;

  self = (FeedServerObject *)type->tp_alloc(type, 0);
  if (self == NULL)
    goto err;
  if (embpy_handle_init(&self->h, "FeedServer", feed_server_destroy, 0) < 0)
    goto err;
  ember_feed_server *s = NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_feed_server_create(&s, &cfg));
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto err;
  }
  self->port = ember_feed_server_port(s);
  self->h.ptr = s;
  PyBuffer_Release(&secret);
  return (PyObject *)self;
err:
  PyBuffer_Release(&secret);
  Py_XDECREF(self);
  return NULL;
}

static int Handle_traverse(PyObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  return 0;
}

static void FeedServer_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&((FeedServerObject *)op)->h);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static PyObject *FeedServer_port(PyObject *op, void *closure) {
  FeedServerObject *self = (FeedServerObject *)op;
  if (self->h.closed || self->h.ptr == NULL) {
    PyErr_SetString(PyExc_ValueError, "FeedServer is closed");
    return NULL;
  }
  return PyLong_FromLong(self->port);
}

/* next()'s wait: one slice pops one item (embpy_handle_wait).  A batch comes
 * decoded by the server (it validated it there): d borrows the item's
 * columns, nothing to free. */
typedef struct {
  ember_feed_server *s;
  ember_feed_item *item;
  embpy_decoded d;
} next_wait;

static int next_slice(void *arg, int64_t slice_ms) {
  next_wait *w = arg;
  int rc = ember_feed_server_next(w->s, &w->item, slice_ms);
  if (rc == EMBER_OK && w->item->kind == EMBER_FEED_ITEM_BATCH) {
    w->d.ncols = w->item->ncols;
    w->d.nrows = w->item->nrows;
    w->d.cols = w->item->cols;
  }
  return rc;
}

PyDoc_STRVAR(FeedServer_next_doc,
             "next(timeout_s) -> FeedItem or None\n\n"
             "Pops the next item ('batch' or 'end'), waiting up to timeout_s; None\n"
             "on timeout.  After 'end', every call returns another 'end' at once.");

static PyObject *FeedServer_next(PyObject *op, PyObject *arg) {
  FeedServerObject *self = (FeedServerObject *)op;
  int64_t ms;
  if (!embpy_timeout_conv(arg, &ms))
    return NULL;
  next_wait w;
  memset(&w, 0, sizeof w);
  w.s = self->h.ptr;
  int r = embpy_handle_wait(&self->h, Py_TYPE(op), ms, next_slice, &w);
  if (r < 0)
    return NULL;
  if (r > 0)
    Py_RETURN_NONE;
  ember_feed_item *item = w.item;
  ember_state *st = embpy_state_of_type(Py_TYPE(op));
  if (st == NULL) {
    ember_feed_item_free(item);
    return NULL;
  }
  int kind = item->kind == EMBER_FEED_ITEM_END               ? ITEM_END
             : item->kind == EMBER_FEED_ITEM_ERROR           ? ITEM_ERROR
             : item->kind == EMBER_FEED_ITEM_PARTITION_START ? ITEM_START
             : item->kind == EMBER_FEED_ITEM_PARTITION_END   ? ITEM_PARTITION_END
             : item->kind == EMBER_FEED_ITEM_CALL_END        ? ITEM_CALL_END
                                                             : ITEM_BATCH;
  PyObject *res = FeedItem_create(st, kind, item->source, item->call, item->partition,
                                  item->flags,
                                  item, NULL, item->data, item->len, &w.d);
  return res;
}

/* Converter for a producer id (uint64). */
static int source_conv(PyObject *obj, void *out) {
  unsigned long long v = PyLong_AsUnsignedLongLong(obj);
  if (v == (unsigned long long)-1 && PyErr_Occurred())
    return 0;
  *(uint64_t *)out = (uint64_t)v;
  return 1;
}

/* Encodes into a fresh buffer and sends it; runs without the GIL. */
static int encode_and_send(ember_feed_server *s, uint64_t source, const embpy_columns *cs,
                           int64_t ms) {
  size_t size = 0, written = 0;
  int rc = ember_batch_encoded_size(cs->cols, cs->ncols, cs->nrows, &size);
  if (rc != EMBER_OK)
    return rc;
  uint8_t *buf = malloc(size ? size : 1);
  if (buf == NULL)
    return ember__set_error(EMBER_ENOMEM, "send_results: cannot allocate %zu bytes", size);
  rc = ember_batch_encode(cs->cols, cs->ncols, cs->nrows, buf, size, &written);
  if (rc == EMBER_OK)
    rc = ember_feed_server_send_results(s, source, buf, written, ms);
  free(buf);
  return rc;
}

PyDoc_STRVAR(FeedServer_send_results_doc,
             "send_results(source, columns, nrows, timeout_s) -> None\n\n"
             "Encodes columns and sends them as one RESULTS batch to producer\n"
             "`source` (FeedItem.source).  EmberError EMBER_ENOTFOUND if it is gone.");

static PyObject *FeedServer_send_results(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"source", "columns", "nrows", "timeout_s", NULL};
  FeedServerObject *self = (FeedServerObject *)op;
  uint64_t source;
  PyObject *columns;
  Py_ssize_t nrows;
  int64_t ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&OnO&:send_results", kwlist,
                                   source_conv, &source, &columns, &nrows,
                                   embpy_timeout_conv, &ms))
    return NULL;
  embpy_columns cs;
  if (embpy_columns_parse(columns, nrows, &cs) < 0)
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), encode_and_send(self->h.ptr, source, &cs, ms));
  embpy_columns_release(&cs);
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(FeedServer_terminate_doc,
             "terminate() -> None\n\n"
             "The consumer will read no more: drops queued items; producers'\n"
             "end_partition then raises EmberAborted.  May be called from any thread.");

static PyObject *FeedServer_terminate(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  FeedServerObject *self = (FeedServerObject *)op;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), ember_feed_server_terminate(self->h.ptr));
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(FeedServer_stats_doc,
             "stats() -> dict\n\n"
             "Counters since creation: batches_received, records_received,\n"
             "bytes_received, partitions_acked, duplicate_partitions,\n"
             "producers_rejected, shm_producers (connections whose batches came\n"
             "through a shared-memory ring).");

static PyObject *FeedServer_stats(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  FeedServerObject *self = (FeedServerObject *)op;
  ember_feed_stats fs;
  memset(&fs, 0, sizeof fs);
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    (ember_feed_server_stats(self->h.ptr, &fs), EMBER_OK));
  if (ok < 0)
    return NULL;
  return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "batches_received",
                       (unsigned long long)fs.batches_received, "records_received",
                       (unsigned long long)fs.records_received, "bytes_received",
                       (unsigned long long)fs.bytes_received, "partitions_acked",
                       (unsigned long long)fs.partitions_acked, "duplicate_partitions",
                       (unsigned long long)fs.duplicate_partitions,
                       "producers_rejected", (unsigned long long)fs.producers_rejected,
                       "shm_producers", (unsigned long long)fs.shm_producers);
}

static PyObject *FeedServer_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  embpy_handle_close(&((FeedServerObject *)op)->h);
  Py_RETURN_NONE;
}

static PyObject *FeedServer_exit(PyObject *op, PyObject *args) {
  embpy_handle_close(&((FeedServerObject *)op)->h);
  Py_RETURN_FALSE;
}

static PyMethodDef FeedServer_methods[] = {
    {"next", FeedServer_next, METH_O, FeedServer_next_doc},
    {"send_results", (PyCFunction)(void (*)(void))FeedServer_send_results,
     METH_VARARGS | METH_KEYWORDS, FeedServer_send_results_doc},
    {"terminate", FeedServer_terminate, METH_NOARGS, FeedServer_terminate_doc},
    {"stats", FeedServer_stats, METH_NOARGS, FeedServer_stats_doc},
    {"close", FeedServer_close, METH_NOARGS,
     "close() -> None\n\nStops the server thread and closes every connection.  "
     "Idempotent."},
    {"__enter__", self_enter, METH_NOARGS, NULL},
    {"__exit__", FeedServer_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef FeedServer_getset[] = {
    {"port", FeedServer_port, NULL, "The TCP port the server listens on.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(FeedServer_doc,
             "FeedServer(secret, *, listen_fd=-1, host='', port=0, queue_bytes=0,\n"
             "           max_frame=0, io_timeout_ms=0, shm=True, encrypt=False)\n\n"
             "encrypt=True: producers' TCP connections carry AES-256-GCM records\n"
             "(libember's secure.h); producers must pass encrypt=True too, and one\n"
             "that does not is refused (and vice versa).  Rings stay in clear.\n"
             "A node's feed endpoint.  listen_fd (e.g. from reserve_port) is taken\n"
             "over and closed by the server; otherwise it binds host:port.  0 picks\n"
             "libember's defaults (64 MiB queue, 256 MiB frames, 600 s I/O timeout).\n"
             "shm=True accepts the shared-memory rings that producers on this host\n"
             "offer (their batches then bypass TCP; one reader thread per ring);\n"
             "shm=False, or EMBER_FEED_SHM=0 in the environment, keeps every\n"
             "producer on TCP.  Items are the same either way.  Connections must\n"
             "authenticate and say hello within EMBER_PREAUTH_TIMEOUT_MS (3 s); at\n"
             "most EMBER_PREAUTH_MAX_PENDING (512) wait at once, the oldest evicted\n"
             "for a new one; rejected ones are logged to stderr, rate-limited.");

static PyType_Slot FeedServer_slots[] = {
    {Py_tp_doc, (void *)FeedServer_doc},
    {Py_tp_new, FeedServer_new},
    {Py_tp_dealloc, FeedServer_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_methods, FeedServer_methods},
    {Py_tp_getset, FeedServer_getset},
    {0, NULL},
};

static PyType_Spec FeedServer_spec = {
    .name = "ember._ember.FeedServer",
    .basicsize = sizeof(FeedServerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = FeedServer_slots,
};

/* ================================================================ FeedClient */

typedef struct {
  PyObject_HEAD
  embpy_handle h; /* h.lock serializes every call */
  uint32_t partition;
} FeedClientObject;

static void feed_client_destroy(void *p) { ember_feed_client_destroy(p); }

static PyObject *FeedClient_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"host",         "port",      "secret", "partition",
                           "want_results", "timeout_s", "shm",    "shm_bytes",
                           "resume",       "call",      "call_partitions", "tag",
                           "encrypt",      NULL};
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL)
    return NULL;
  const char *host;
  uint16_t port;
  Py_buffer secret;
  Py_ssize_t partition;
  int want_results = 0;
  int64_t ms = 60000;
  PyObject *shm = Py_None;
  Py_ssize_t shm_bytes = 0;
  int resume = 0;
  unsigned long long call = 0;
  Py_ssize_t call_partitions = 0;
  Py_buffer tag = {0};
  int encrypt = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sO&y*n|$pO&OnpKny*p:FeedClient", kwlist,
                                   &host, embpy_port_conv, &port, &secret, &partition,
                                   &want_results, embpy_timeout_conv, &ms, &shm,
                                   &shm_bytes, &resume, &call, &call_partitions, &tag,
                                   &encrypt))
    return NULL;
  FeedClientObject *self = NULL;
  uint32_t part;
  ember_feed_client_options opts;
  memset(&opts, 0, sizeof opts);
  if (check_u32(partition, "partition", &part) < 0 ||
      check_u32(call_partitions, "call_partitions", &opts.call_partitions) < 0)
    goto err;
  if (tag.buf != NULL && (size_t)tag.len > EMBER_FEED_TAG_MAX) {
    PyErr_Format(PyExc_ValueError, "tag is %zd bytes; at most %u", tag.len, EMBER_FEED_TAG_MAX);
    goto err;
  }
  opts.call = (uint64_t)call;
  opts.encrypt = encrypt;
  opts.tag = tag.buf;
  opts.tag_len = tag.buf != NULL ? (size_t)tag.len : 0;
  if (shm == Py_None) {
    opts.shm = EMBER_FEED_SHM_AUTO;
  } else {
    int on = PyObject_IsTrue(shm);
    if (on < 0)
      goto err;
    opts.shm = on ? EMBER_FEED_SHM_ON : EMBER_FEED_SHM_OFF;
  }
  if (shm_bytes < 0) {
    PyErr_Format(PyExc_ValueError, "shm_bytes must be >= 0, not %zd", shm_bytes);
    goto err;
  }
  opts.shm_bytes = (size_t)shm_bytes;
  self = (FeedClientObject *)type->tp_alloc(type, 0);
  if (self == NULL)
    goto err;
  if (embpy_handle_init(&self->h, "FeedClient", feed_client_destroy, 1) < 0)
    goto err;
  self->partition = part;
  ember_feed_client *c = NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL,
              ember_feed_client_connect_ex(&c, host, port, secret.buf, (size_t)secret.len,
                                           part,
                                           (want_results ? EMBER_FEED_WANT_RESULTS : 0u) |
                                               (resume ? EMBER_FEED_RESUME : 0u),
                                           &opts, ms));
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto err;
  }
  self->h.ptr = c;
  PyBuffer_Release(&secret);
  if (tag.obj != NULL)
    PyBuffer_Release(&tag);
  return (PyObject *)self;
err:
  PyBuffer_Release(&secret);
  if (tag.obj != NULL)
    PyBuffer_Release(&tag);
  Py_XDECREF(self);
  return NULL;
}

static void FeedClient_dealloc(PyObject *op) {
  FeedClientObject *self = (FeedClientObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&self->h);
  tp->tp_free(op);
  Py_DECREF(tp);
}

PyDoc_STRVAR(FeedClient_send_doc,
             "send(columns, nrows, timeout_s) -> None\n\n"
             "Sends one BATCH; the column buffers are written to the socket, or\n"
             "encoded straight into the shared-memory ring, without another copy.\n"
             "Blocks (back-pressure) up to timeout_s.  The first send offers the\n"
             "node a ring when the client allows it (see FeedClient's shm).");

static PyObject *FeedClient_send(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"columns", "nrows", "timeout_s", NULL};
  FeedClientObject *self = (FeedClientObject *)op;
  PyObject *columns;
  Py_ssize_t nrows;
  int64_t ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnO&:send", kwlist, &columns, &nrows,
                                   embpy_timeout_conv, &ms))
    return NULL;
  embpy_columns cs;
  if (embpy_columns_parse(columns, nrows, &cs) < 0)
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_feed_client_send(self->h.ptr, cs.cols, cs.ncols, cs.nrows, ms));
  embpy_columns_release(&cs);
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

/* send_records' batch holds the client's lock from begin to commit (or
 * cancel): no other call may come between.  Both run without the GIL. */
static int begin_locked(FeedClientObject *self, const ember_column *cols, uint32_t ncols,
                        uint32_t nrows, ember_batch_place *places, int64_t ms) {
  embpy_lock(self->h.lock);
  int rc = ember_feed_client_begin_batch(self->h.ptr, cols, ncols, nrows, places, ms);
  if (rc != EMBER_OK)
    embpy_unlock(self->h.lock);
  return rc;
}

static int commit_unlock(FeedClientObject *self, int64_t ms) {
  int rc = ember_feed_client_commit_batch(self->h.ptr, ms);
  embpy_unlock(self->h.lock);
  return rc;
}

PyDoc_STRVAR(FeedClient_send_records_doc,
             "send_records(records, fields, refs, timeout_s) -> (refs, nbytes) or None\n\n"
             "Converts a chunk of records to columns and sends them as one BATCH,\n"
             "written straight into the shared-memory ring (or the client's buffer\n"
             "for TCP): records_to_columns() and send() without the copy between\n"
             "them.  The arguments and the refs returned (for the partition's next\n"
             "chunk) are records_to_columns()'s; nbytes: the bytes of its columns (see\n"
             "in_place_max).  Returns None, having sent nothing,\n"
             "when the chunk is not for the fast path: the caller then converts it\n"
             "with ember._columns and sends it with send().");

static PyObject *FeedClient_send_records(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"records", "fields", "refs", "timeout_s", NULL};
  FeedClientObject *self = (FeedClientObject *)op;
  PyObject *records, *fields, *refs, *result = NULL;
  int64_t ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO&:send_records", kwlist, &records,
                                   &fields, &refs, embpy_timeout_conv, &ms))
    return NULL;
  ember_state *st = embpy_state_of_type(Py_TYPE(op));
  if (st == NULL || embpy_handle_enter(&self->h) < 0)
    return NULL;
  embpy_records *r = NULL;
  ember_column *cols = NULL;
  ember_batch_place *places = NULL;
  int rc = embpy_records_plan(st, records, fields, refs, &r);
  if (rc != 0) {
    if (rc > 0) result = Py_NewRef(Py_None);
    goto done;
  }
  Py_ssize_t ncols = embpy_records_ncols(r);
  cols = PyMem_Calloc((size_t)(ncols ? ncols : 1), sizeof *cols);
  places = PyMem_Calloc((size_t)(ncols ? ncols : 1), sizeof *places);
  if (cols == NULL || places == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  if (embpy_records_columns(r, cols) != 0) {
    result = Py_NewRef(Py_None);
    goto done;
  }
  uint32_t nrows = (uint32_t)embpy_records_nrows(r); /* the plan bounds it */
  embpy_err e;
  EMBPY_NOGIL(rc, &e, NULL, begin_locked(self, cols, (uint32_t)ncols, nrows, places, ms));
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto done;
  }
  int wrc = embpy_records_write(r, places);
  if (wrc != 0) {
    ember_feed_client_cancel_batch(self->h.ptr);
    embpy_unlock(self->h.lock);
    if (wrc > 0) result = Py_NewRef(Py_None);
    goto done;
  }
  EMBPY_NOGIL(rc, &e, NULL, commit_unlock(self, ms));
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto done;
  }
  PyObject *refs_out = embpy_records_refs(r);
  if (refs_out != NULL) {
    result = Py_BuildValue("(Nn)", refs_out, embpy_records_bytes(r));
  }
done:
  PyMem_Free(cols);
  PyMem_Free(places);
  embpy_records_free(r);
  embpy_handle_leave(&self->h);
  return result;
}

/* Receives a RESULTS batch and decodes it, without the GIL; on failure
 * nothing is left to free. */
static int recv_decoded(ember_feed_client *c, uint8_t **batch, size_t *len, embpy_decoded *d,
                        int64_t ms) {
  int rc = ember_feed_client_recv_results(c, batch, len, ms);
  if (rc == EMBER_OK && (rc = embpy_decode(*batch, *len, d)) != EMBER_OK) {
    free(*batch);
    *batch = NULL;
  }
  return rc;
}

PyDoc_STRVAR(FeedClient_recv_results_doc,
             "recv_results(timeout_s) -> FeedItem\n\n"
             "Receives the next RESULTS batch (a FeedItem of kind 'results').\n"
             "Raises EmberTimeout if none came in time.");

static PyObject *FeedClient_recv_results(PyObject *op, PyObject *arg) {
  FeedClientObject *self = (FeedClientObject *)op;
  int64_t ms;
  if (!embpy_timeout_conv(arg, &ms))
    return NULL;
  uint8_t *batch = NULL;
  size_t len = 0;
  embpy_decoded d;
  memset(&d, 0, sizeof d);
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), recv_decoded(self->h.ptr, &batch, &len, &d, ms));
  if (ok < 0)
    return NULL;
  ember_state *st = embpy_state_of_type(Py_TYPE(op));
  if (st == NULL) {
    free(batch);
    embpy_decoded_free(&d);
    return NULL;
  }
  PyObject *res = FeedItem_create(st, ITEM_RESULTS, 0, 0, self->partition, 0, NULL, batch,
                                  batch, len, &d);
  embpy_decoded_free(&d);
  return res;
}

/* end_partition (and its halves) / end_feed share this shape: fn(client, timeout). */
static PyObject *client_timed_call(PyObject *op, PyObject *arg,
                                   int (*fn)(ember_feed_client *, int64_t)) {
  FeedClientObject *self = (FeedClientObject *)op;
  int64_t ms;
  if (!embpy_timeout_conv(arg, &ms))
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), fn(self->h.ptr, ms));
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(FeedClient_end_partition_doc,
             "end_partition(timeout_s) -> None\n\n"
             "Sends END_PARTITION and waits until the trainer has consumed every\n"
             "batch.  Raises EmberAborted if the trainer terminated the feed.");
PyDoc_STRVAR(FeedClient_end_partition_send_doc,
             "end_partition_send(timeout_s) -> None\n\n"
             "The first half of end_partition: sends END_PARTITION without waiting.\n"
             "A producer feeds the node's next partition on another client, then\n"
             "calls end_partition_wait, so the node's queue never drains between\n"
             "its partitions.  The client takes nothing else until then.");
PyDoc_STRVAR(FeedClient_end_partition_wait_doc,
             "end_partition_wait(timeout_s) -> None\n\n"
             "The second half of end_partition: waits until the trainer has\n"
             "consumed every batch.  Raises EmberAborted if the trainer terminated\n"
             "the feed.");
PyDoc_STRVAR(FeedClient_end_feed_doc,
             "end_feed(timeout_s) -> None\n\n"
             "Sends END_FEED (driver only): the trainer's next() yields an 'end'\n"
             "item after everything already queued.");

static PyObject *FeedClient_end_partition(PyObject *op, PyObject *arg) {
  return client_timed_call(op, arg, ember_feed_client_end_partition);
}
static PyObject *FeedClient_end_partition_send(PyObject *op, PyObject *arg) {
  return client_timed_call(op, arg, ember_feed_client_end_partition_send);
}
static PyObject *FeedClient_end_partition_wait(PyObject *op, PyObject *arg) {
  return client_timed_call(op, arg, ember_feed_client_end_partition_wait);
}
static PyObject *FeedClient_end_feed(PyObject *op, PyObject *arg) {
  return client_timed_call(op, arg, ember_feed_client_end_feed);
}

PyDoc_STRVAR(FeedClient_fail_doc,
             "fail(reason, timeout_s) -> None\n\n"
             "The producer cannot finish its partition: tells the node (FEED_ERROR,\n"
             "or the ring's ERROR marker after the batches already in it).  The node\n"
             "keeps the batches sent before and drops the connection without an\n"
             "ACK; the client cannot be used afterwards.");

static PyObject *FeedClient_fail(PyObject *op, PyObject *args) {
  FeedClientObject *self = (FeedClientObject *)op;
  const char *reason;
  int64_t ms;
  if (!PyArg_ParseTuple(args, "sO&:fail", &reason, embpy_timeout_conv, &ms))
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), ember_feed_client_fail(self->h.ptr, reason, ms));
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

/* What the first send decided about the transport, read under the lock. */
static int client_transport(PyObject *op, int *uses_shm, size_t *in_place_max) {
  FeedClientObject *self = (FeedClientObject *)op;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    (*uses_shm = ember_feed_client_uses_shm(self->h.ptr),
                     *in_place_max = ember_feed_client_in_place_max(self->h.ptr), EMBER_OK));
  return ok;
}

static PyObject *FeedClient_uses_shm(PyObject *op, void *closure) {
  int shm = 0;
  size_t max = 0;
  return client_transport(op, &shm, &max) < 0 ? NULL : PyBool_FromLong(shm);
}

static PyObject *FeedClient_in_place_max(PyObject *op, void *closure) {
  int shm = 0;
  size_t max = 0;
  return client_transport(op, &shm, &max) < 0 ? NULL : PyLong_FromSize_t(max);
}

static PyObject *FeedClient_resume_point(PyObject *op, void *closure) {
  FeedClientObject *self = (FeedClientObject *)op;
  uint64_t records = 0;
  int delivered = 0;
  if (embpy_handle_enter(&self->h) < 0)
    return NULL;
  ember_feed_client_resume_point(self->h.ptr, &records, &delivered);
  embpy_handle_leave(&self->h);
  return Py_BuildValue("(KO)", (unsigned long long)records, delivered ? Py_True : Py_False);
}

static PyGetSetDef FeedClient_getset[] = {
    {"resume_point", FeedClient_resume_point, NULL,
     "(records, delivered) for a client made with resume=True: how many records\n"
     "of this partition the node already holds from an earlier attempt (skip\n"
     "them and send the rest), and whether it was delivered whole already.\n"
     "(0, False) without resume.",
     NULL},
    {"in_place_max", FeedClient_in_place_max, NULL,
     "The largest batch (bytes) send_records writes straight into the ring\n"
     "(half the ring less a record header); 0 over TCP, or before the first\n"
     "send decided the transport.",
     NULL},
    {"uses_shm", FeedClient_uses_shm, NULL,
     "True once this client's batches go through a shared-memory ring (decided\n"
     "by the first send); False for TCP.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *FeedClient_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  embpy_handle_close(&((FeedClientObject *)op)->h);
  Py_RETURN_NONE;
}

static PyObject *FeedClient_exit(PyObject *op, PyObject *args) {
  embpy_handle_close(&((FeedClientObject *)op)->h);
  Py_RETURN_FALSE;
}

static PyMethodDef FeedClient_methods[] = {
    {"send", (PyCFunction)(void (*)(void))FeedClient_send, METH_VARARGS | METH_KEYWORDS,
     FeedClient_send_doc},
    {"send_records", (PyCFunction)(void (*)(void))FeedClient_send_records,
     METH_VARARGS | METH_KEYWORDS, FeedClient_send_records_doc},
    {"recv_results", FeedClient_recv_results, METH_O, FeedClient_recv_results_doc},
    {"end_partition", FeedClient_end_partition, METH_O, FeedClient_end_partition_doc},
    {"end_partition_send", FeedClient_end_partition_send, METH_O,
     FeedClient_end_partition_send_doc},
    {"end_partition_wait", FeedClient_end_partition_wait, METH_O,
     FeedClient_end_partition_wait_doc},
    {"end_feed", FeedClient_end_feed, METH_O, FeedClient_end_feed_doc},
    {"fail", FeedClient_fail, METH_VARARGS, FeedClient_fail_doc},
    {"close", FeedClient_close, METH_NOARGS,
     "close() -> None\n\nCloses the connection.  Idempotent."},
    {"__enter__", self_enter, METH_NOARGS, NULL},
    {"__exit__", FeedClient_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(FeedClient_doc,
             "FeedClient(host, port, secret, partition, *, want_results=False,\n"
             "           timeout_s=60.0, shm=None, shm_bytes=0, resume=False,\n"
             "           call=0, call_partitions=0, tag=b'', encrypt=False)\n\n"
             "encrypt: the TCP connection carries AES-256-GCM records; must match\n"
             "the server's (a mismatch is refused with EmberAuthError).\n"
             "A producer's connection to a node's feed server; connects,\n"
             "authenticates and sends FEED_HELLO at once.  Calls are serialized\n"
             "by a per-object lock.\n"
             "shm: None (default) offers the node a shared-memory ring when it runs\n"
             "on this host, unless EMBER_FEED_SHM=0 is set; True offers it whatever\n"
             "the environment says; False keeps to TCP.  The node may decline (other\n"
             "host, shm disabled): TCP then, transparently.  shm_bytes: the ring's\n"
             "size (0: EMBER_FEED_SHM_BYTES, else 1 MiB); a batch larger than half\n"
             "the ring is split through it.  See uses_shm.\n"
             "resume: resume a partition an earlier attempt fed part of (see\n"
             "resume_point); refused with EmberError while that attempt's\n"
             "connection is still open.\n"
             "call: the 64-bit call this partition belongs to (0: anonymous); a\n"
             "named call's node gets 'start' (with tag, at most 1024 bytes) and\n"
             "'partition_end' items around the partition's batches, and\n"
             "'call_end' after the last of call_partitions partitions (0: not\n"
             "counted).  Partitions are delivered once per (call, partition).");

static PyType_Slot FeedClient_slots[] = {
    {Py_tp_doc, (void *)FeedClient_doc},
    {Py_tp_new, FeedClient_new},
    {Py_tp_dealloc, FeedClient_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_methods, FeedClient_methods},
    {Py_tp_getset, FeedClient_getset},
    {0, NULL},
};

static PyType_Spec FeedClient_spec = {
    .name = "ember._ember.FeedClient",
    .basicsize = sizeof(FeedClientObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = FeedClient_slots,
};

/* ================================================================ FeedReader */

/* What a reader's handle destroys: the reader, then its hold on the server
 * (the C server must outlive the reader, whoever closes it first). */
typedef struct {
  ember_feed_reader *reader;
  FeedServerObject *server;
} feed_reader_ref;

typedef struct {
  PyObject_HEAD
  embpy_handle h; /* h.ptr: a feed_reader_ref; the C reader locks itself */
  uint64_t id;
} FeedReaderObject;

/* Runs without the GIL (embpy handles destroy so): the reader's destroy
 * waits for TensorFlow's calls to leave; the server's hold needs the GIL. */
static void feed_reader_destroy(void *p) {
  feed_reader_ref *ref = p;
  ember_feed_reader_destroy(ref->reader);
  PyGILState_STATE gil = PyGILState_Ensure();
  embpy_handle_leave(&ref->server->h);
  Py_DECREF(ref->server);
  PyMem_Free(ref);
  PyGILState_Release(gil);
}

static PyObject *FeedReader_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"server", "fail_on_producer_error", NULL};
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL)
    return NULL;
  PyObject *server;
  int fail = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!|$p:FeedReader", kwlist,
                                   st->FeedServer_Type, &server, &fail))
    return NULL;
  FeedServerObject *so = (FeedServerObject *)server;
  FeedReaderObject *self = (FeedReaderObject *)type->tp_alloc(type, 0);
  if (self == NULL)
    return NULL;
  if (embpy_handle_init(&self->h, "FeedReader", feed_reader_destroy, 0) < 0) {
    Py_DECREF(self);
    return NULL;
  }
  feed_reader_ref *ref = PyMem_Calloc(1, sizeof *ref);
  if (ref == NULL) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  if (embpy_handle_enter(&so->h) < 0) { /* "FeedServer is closed" */
    PyMem_Free(ref);
    Py_DECREF(self);
    return NULL;
  }
  ember_feed_reader_options opts = {fail, NULL, NULL};
  embpy_err e;
  int rc;
  EMBPY_CALL(rc, &e, ember_feed_reader_create(&ref->reader, so->h.ptr, &opts));
  if (rc != EMBER_OK) {
    embpy_handle_leave(&so->h);
    PyMem_Free(ref);
    Py_DECREF(self);
    return embpy_raise(st, &e);
  }
  Py_INCREF(server);
  ref->server = so;
  self->id = ember_feed_reader_id(ref->reader);
  self->h.ptr = ref;
  return (PyObject *)self;
}

static void FeedReader_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&((FeedReaderObject *)op)->h);
  tp->tp_free(op);
  Py_DECREF(tp);
}

typedef struct {
  ember_feed_reader *reader;
  uint32_t batch_rows, rows;
} reader_wait;

static int reader_wait_slice(void *arg, int64_t slice_ms) {
  reader_wait *w = arg;
  return ember_feed_reader_wait(w->reader, w->batch_rows, slice_ms, &w->rows);
}

PyDoc_STRVAR(FeedReader_wait_doc,
             "wait(batch_rows, timeout_s) -> int or None\n\n"
             "Waits until the next batch is known and returns its rows (batch_rows,\n"
             "fewer where the data ends, 0 at the end of the sequence); None on\n"
             "timeout, the rows found so far kept for the next wait.");

static PyObject *FeedReader_wait(PyObject *op, PyObject *args) {
  FeedReaderObject *self = (FeedReaderObject *)op;
  Py_ssize_t batch_rows;
  int64_t ms;
  if (!PyArg_ParseTuple(args, "nO&:wait", &batch_rows, embpy_timeout_conv, &ms))
    return NULL;
  if (batch_rows < 1 || (size_t)batch_rows > UINT32_MAX) {
    PyErr_Format(PyExc_ValueError, "batch_rows must be 1..%u, not %zd", UINT32_MAX, batch_rows);
    return NULL;
  }
  if (self->h.closed || self->h.ptr == NULL) {
    PyErr_SetString(PyExc_ValueError, "FeedReader is closed");
    return NULL;
  }
  reader_wait w = {((feed_reader_ref *)self->h.ptr)->reader, (uint32_t)batch_rows, 0};
  int r = embpy_handle_wait(&self->h, Py_TYPE(op), ms, reader_wait_slice, &w);
  if (r < 0)
    return NULL;
  if (r > 0)
    Py_RETURN_NONE;
  return PyLong_FromUnsignedLong(w.rows);
}

PyDoc_STRVAR(FeedReader_layout_doc,
             "layout() -> [(name, dtype, width), ...]\n\n"
             "The columns of the rows the last wait found (it returned > 0).");

static PyObject *FeedReader_layout(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  FeedReaderObject *self = (FeedReaderObject *)op;
  ember_column cols[EMBER_BATCH_MAX_COLS];
  uint32_t ncols = 0;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_feed_reader_layout(((feed_reader_ref *)self->h.ptr)->reader, cols,
                                             EMBER_BATCH_MAX_COLS, &ncols));
  if (ok < 0)
    return NULL;
  PyObject *out = PyList_New(ncols);
  if (out == NULL)
    return NULL;
  for (uint32_t i = 0; i < ncols; i++) {
    PyObject *t = Py_BuildValue("(s#iI)", cols[i].name, (Py_ssize_t)cols[i].name_len,
                                (int)cols[i].dtype, (unsigned)cols[i].width);
    if (t == NULL) {
      Py_DECREF(out);
      return NULL;
    }
    PyList_SET_ITEM(out, i, t);
  }
  return out;
}

PyDoc_STRVAR(FeedReader_stats_doc,
             "stats() -> dict\n\nrows and batches handed out, feed calls ended, and\n"
             "feeding tasks' failures seen.");

static PyObject *FeedReader_stats(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  FeedReaderObject *self = (FeedReaderObject *)op;
  ember_feed_reader_stats fs;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    (ember_feed_reader_stats_get(((feed_reader_ref *)self->h.ptr)->reader, &fs),
                     EMBER_OK));
  if (ok < 0)
    return NULL;
  return Py_BuildValue("{sKsKsKsK}", "rows", (unsigned long long)fs.rows, "batches",
                       (unsigned long long)fs.batches, "calls_ended",
                       (unsigned long long)fs.calls_ended, "producer_errors",
                       (unsigned long long)fs.producer_errors);
}

static PyObject *FeedReader_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  embpy_handle_close(&((FeedReaderObject *)op)->h);
  Py_RETURN_NONE;
}

static PyObject *FeedReader_id(PyObject *op, void *closure) {
  return PyLong_FromUnsignedLongLong(((FeedReaderObject *)op)->id);
}

static PyMethodDef FeedReader_methods[] = {
    {"wait", FeedReader_wait, METH_VARARGS, FeedReader_wait_doc},
    {"layout", FeedReader_layout, METH_NOARGS, FeedReader_layout_doc},
    {"stats", FeedReader_stats, METH_NOARGS, FeedReader_stats_doc},
    {"close", FeedReader_close, METH_NOARGS,
     "close() -> None\n\nEnds waits in flight (TensorFlow's included) and frees the reader;\n"
     "its id then names nothing.  Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef FeedReader_getset[] = {
    {"id", FeedReader_id, NULL, "The reader's id, by which the api table finds it.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(FeedReader_doc,
             "FeedReader(server, *, fail_on_producer_error=False)\n\n"
             "The feed of `server` read as batches of rows by code that runs without\n"
             "Python (ember/feed_reader.h): ember.tf.feed_dataset's TensorFlow op\n"
             "reaches it by id through the table at FEED_READER_API.  Holds the\n"
             "server open until closed.");

static PyType_Slot FeedReader_slots[] = {
    {Py_tp_doc, (void *)FeedReader_doc},
    {Py_tp_new, FeedReader_new},
    {Py_tp_dealloc, FeedReader_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_methods, FeedReader_methods},
    {Py_tp_getset, FeedReader_getset},
    {0, NULL},
};

static PyType_Spec FeedReader_spec = {
    .name = "ember._ember.FeedReader",
    .basicsize = sizeof(FeedReaderObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = FeedReader_slots,
};

/* ================================================================ exec */

int embpy_feed_exec(PyObject *m, ember_state *st) {
  st->FeedItem_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &FeedItem_spec, NULL);
  if (st->FeedItem_Type == NULL || PyModule_AddType(m, st->FeedItem_Type) < 0)
    return -1;
  st->FeedServer_Type =
      (PyTypeObject *)PyType_FromModuleAndSpec(m, &FeedServer_spec, NULL);
  if (st->FeedServer_Type == NULL || PyModule_AddType(m, st->FeedServer_Type) < 0)
    return -1;
  st->FeedClient_Type =
      (PyTypeObject *)PyType_FromModuleAndSpec(m, &FeedClient_spec, NULL);
  if (st->FeedClient_Type == NULL || PyModule_AddType(m, st->FeedClient_Type) < 0)
    return -1;
  PyTypeObject *reader = (PyTypeObject *)PyType_FromModuleAndSpec(m, &FeedReader_spec, NULL);
  int added = reader != NULL ? PyModule_AddType(m, reader) : -1;
  Py_XDECREF(reader);
  if (added < 0)
    return -1;
  /* the address of the static ember_feed_reader_api table, for the op */
  PyObject *api = PyLong_FromVoidPtr((void *)ember_feed_reader_api_table());
  if (api == NULL || PyModule_AddObject(m, "FEED_READER_API", api) < 0) {
    Py_XDECREF(api);
    return -1;
  }
  return 0;
}
