/* python/ember/_tf_allreduce_op.c - the TensorFlow op EmberAllreduce: a
 * tensor reduced over the ranks of a node's collective (ember/collective.h),
 * inside TensorFlow's graph (the op behind ember.tf.allreduce).
 *
 * A training step that sums its gradients with ctx.allreduce leaves the
 * graph twice per step: the gradients are copied out to numpy, reduced, and
 * fed into a second function that applies them; each crossing costs an
 * eager dispatch from Python and a copy of every gradient.  With this op the
 * whole step (gradients, allreduce, apply) is one tf.function call, and the
 * reduction works on the tensor's own buffer.
 *
 * Built into ember/_ember_tf*.so beside EmberFeedNext, and like it reaches
 * libember only through a table of functions whose address ember._ember
 * hands out (ember._ember.COLLECTIVE_API; ember_comm_api in collective.h),
 * attached to this library once per process by ember.tf through
 * ember_tf_attach_collective (ctypes).  The communicator is named by id
 * (Communicator.id): an op that outlives its node's collective fails with
 * FAILED_PRECONDITION instead of touching a freed one, and closing the
 * collective aborts a call in flight here.
 *
 * Op:
 *
 *   EmberAllreduce(input: T, comm: int, op: {"sum", "avg", "min", "max"},
 *                  timeout_ms: int = -1) -> output: T
 *   T in {float, double, int32, int64}
 *
 *   output has input's shape; every rank gets the same bits (collective.h).
 *   Stateful: never constant-folded or pruned, and tf.function runs it in
 *   program order with the other stateful ops (every rank must make the same
 *   collective calls in the same order).  The input's buffer is reduced in
 *   place when TensorFlow can forward it (nothing else reads it), else it is
 *   copied once into the output.
 *
 * Errors: a dead or silent peer (ABORTED, or DEADLINE_EXCEEDED after
 * timeout_ms), the collective closed (FAILED_PRECONDITION), with libember's
 * message naming the rank; after one the communicator is broken for good.
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EMBER_TF_UNIT allreduce_op
#include "_tf_kernel.h"
#include "ember/collective.h"
#include "ember/error.h"

#define OP_NAME "EmberAllreduce"

/* More dimensions than any tensor a training step reduces. */
#define MAX_DIMS 32

static const ember_comm_api *_Atomic attached_api;

__attribute__((visibility("default"))) int ember_tf_attach_collective(const void *table);

/* Returns 0, or -1 when the table is of another build (nothing attached). */
int ember_tf_attach_collective(const void *table) {
  const ember_comm_api *api = table;
  if (api == NULL || api->abi != EMBER_COMM_ABI || api->size < sizeof(ember_comm_api) ||
      api->acquire == NULL || api->release == NULL || api->allreduce == NULL ||
      api->last_error == NULL)
    return -1;
  attached_api = api;
  return 0;
}

typedef struct {
  uint64_t comm;
  int op; /* ember_redop */
  int64_t timeout_ms;
} allreduce_kernel;

static int redop_of(const char *name, size_t len) {
  static const struct {
    const char *name;
    int op;
  } ops[] = {{"sum", EMBER_RED_SUM}, {"avg", EMBER_RED_AVG}, {"min", EMBER_RED_MIN},
             {"max", EMBER_RED_MAX}};
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
    if (strlen(ops[i].name) == len && memcmp(ops[i].name, name, len) == 0)
      return ops[i].op;
  return 0;
}

static void *allreduce_create(TF_OpKernelConstruction *ctx) {
  TF_Status *st = TF_NewStatus();
  allreduce_kernel *k = calloc(1, sizeof *k);
  int64_t comm = 0;
  char op[8] = "";
  if (k == NULL) {
    embtf_set_status(st, TF_RESOURCE_EXHAUSTED, OP_NAME ": out of memory");
    goto fail;
  }
  TF_OpKernelConstruction_GetAttrInt64(ctx, "comm", &comm, st);
  if (TF_GetCode(st) != TF_OK)
    goto fail;
  TF_OpKernelConstruction_GetAttrInt64(ctx, "timeout_ms", &k->timeout_ms, st);
  if (TF_GetCode(st) != TF_OK)
    goto fail;
  /* the attr's allowed values ("sum", "avg", "min", "max") fit op[] */
  TF_OpKernelConstruction_GetAttrString(ctx, "op", op, sizeof op - 1, st);
  if (TF_GetCode(st) != TF_OK)
    goto fail;
  k->op = redop_of(op, strnlen(op, sizeof op - 1));
  if (comm <= 0 || k->op == 0) {
    embtf_set_status(st, TF_INVALID_ARGUMENT, OP_NAME ": comm must name a communicator "
                     "(Communicator.id, > 0), got %" PRId64, comm);
    goto fail;
  }
  k->comm = (uint64_t)comm;
  TF_DeleteStatus(st);
  return k;
fail:
  TF_OpKernelConstruction_Failure(ctx, st);
  TF_DeleteStatus(st);
  free(k);
  return NULL;
}

static void allreduce_delete(void *p) { free(p); }

static TF_Code tf_code_of(int rc) {
  switch (rc) {
  case EMBER_ETIMEDOUT:
    return TF_DEADLINE_EXCEEDED; /* a silent peer */
  case EMBER_EINVAL:
    return TF_INVALID_ARGUMENT;
  case EMBER_ESTATE:
  case EMBER_ENOTFOUND:
    return TF_FAILED_PRECONDITION; /* broken by an earlier failure, or closed */
  case EMBER_ENOMEM:
  case EMBER_ETOOBIG:
    return TF_RESOURCE_EXHAUSTED;
  default:
    return TF_ABORTED; /* a peer died or the call was aborted: the step cannot finish */
  }
}

static void allreduce_compute(void *p, TF_OpKernelContext *ctx) {
  allreduce_kernel *k = p;
  const ember_comm_api *api = attached_api;
  TF_Status *st = TF_NewStatus();
  TF_Tensor *in = NULL, *out = NULL;
  ember_comm *c = NULL;
  if (api == NULL) {
    embtf_fail(ctx, TF_FAILED_PRECONDITION, OP_NAME ": Ember's collective is not attached in "
               "this process: build the op with ember.tf.allreduce in the node's process");
    goto out;
  }
  TF_GetInput(ctx, 0, &in, st);
  if (TF_GetCode(st) != TF_OK) {
    TF_OpKernelContext_Failure(ctx, st);
    goto out;
  }
  TF_DataType dt = TF_TensorType(in);
  int ndims = TF_NumDims(in);
  int64_t dims[MAX_DIMS];
  if (ndims > MAX_DIMS) {
    embtf_fail(ctx, TF_INVALID_ARGUMENT, OP_NAME ": a tensor of %d dimensions (at most %d)",
               ndims, MAX_DIMS);
    goto out;
  }
  for (int i = 0; i < ndims; i++)
    dims[i] = TF_Dim(in, i);
  int forwarded = -1;
  int candidates[1] = {0};
  out = TF_ForwardInputOrAllocateOutput(ctx, candidates, 1, 0, dims, ndims, &forwarded, st);
  if (TF_GetCode(st) != TF_OK) {
    TF_OpKernelContext_Failure(ctx, st);
    goto out;
  }
  size_t nbytes = TF_TensorByteSize(in);
  if (forwarded != 0 && nbytes > 0)
    memcpy(TF_TensorData(out), TF_TensorData(in), nbytes);
  int rc = api->acquire(k->comm, &c);
  if (rc != EMBER_OK) {
    c = NULL;
    embtf_fail_ember(ctx, tf_code_of(rc), rc, api->last_error(), OP_NAME ": acquire");
    goto out;
  }
  size_t count = (size_t)TF_TensorElementCount(in);
  rc = api->allreduce(c, count > 0 ? TF_TensorData(out) : NULL, count,
                      embtf_ember_dtype(dt), k->op, k->timeout_ms);
  if (rc != EMBER_OK)
    embtf_fail_ember(ctx, tf_code_of(rc), rc, api->last_error(), OP_NAME);
out:
  if (c != NULL)
    api->release(c);
  TF_DeleteTensor(out);
  TF_DeleteTensor(in);
  TF_DeleteStatus(st);
}

/* ------------------------------------------------------------ registration */

/* output: input's shape */
static void allreduce_shape(TF_ShapeInferenceContext *ctx, TF_Status *status) {
  TF_ShapeHandle *shape = TF_NewShapeHandle();
  TF_ShapeInferenceContextGetInput(ctx, 0, shape, status);
  if (TF_GetCode(status) == TF_OK)
    TF_ShapeInferenceContextSetOutput(ctx, 0, shape, status);
  TF_DeleteShapeHandle(shape);
}

__attribute__((constructor)) static void register_allreduce(void) {
  TF_OpDefinitionBuilder *b = TF_NewOpDefinitionBuilder(OP_NAME);
  TF_OpDefinitionBuilderAddAttr(b, "T: {float, double, int32, int64}");
  TF_OpDefinitionBuilderAddAttr(b, "comm: int");
  TF_OpDefinitionBuilderAddAttr(b, "op: {'sum', 'avg', 'min', 'max'}");
  TF_OpDefinitionBuilderAddAttr(b, "timeout_ms: int = -1");
  TF_OpDefinitionBuilderAddInput(b, "input: T");
  TF_OpDefinitionBuilderAddOutput(b, "output: T");
  /* it talks to the other ranks: never folded or pruned, run in order */
  TF_OpDefinitionBuilderSetIsStateful(b, true);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(b, allreduce_shape);
  embtf_register_op(OP_NAME, b, allreduce_create, allreduce_compute, allreduce_delete);
}
