/* python/ember/_tf_kernel.h - what Ember's TensorFlow ops share: TensorFlow's
 * C kernel API headers made to compile as C, failing a kernel with a
 * formatted message, libember's status codes by name, and the dtypes an op
 * and libember both know.
 *
 * The ops (_tf_feed_op.c: EmberFeedNext; _tf_allreduce_op.c: EmberAllreduce)
 * are built into one library, ember/_ember_tf*.so, which is linked with
 * libtensorflow_framework and not with libember (see _tf_feed_op.c): these
 * helpers use libember's headers for their constants only.
 */
#ifndef EMBER_TF_KERNEL_H
#define EMBER_TF_KERNEL_H

#include <stdint.h>

/* kernels.h defines a const size_t at file scope, which C (unlike C++) gives
 * external linkage: every file that includes it would define the symbol, and
 * the library's link fails.  Each file names it after itself (EMBER_TF_UNIT,
 * defined before this header). */
#ifndef EMBER_TF_UNIT
#error "define EMBER_TF_UNIT (a name of the file's own) before including _tf_kernel.h"
#endif
#define EMBER_TF_CAT2(a, b) a##_##b
#define EMBER_TF_CAT(a, b) EMBER_TF_CAT2(a, b)
#define TF_InputRange_Args_STRUCT_SIZE EMBER_TF_CAT(TF_InputRange_Args_STRUCT_SIZE, EMBER_TF_UNIT)

#include "tensorflow/c/kernels.h"
/* ops.h declares these as bare struct tags and then uses them without
 * `struct`: valid C++, not C.  The typedefs make it compile as C (a repeated
 * identical typedef is allowed in C11). */
typedef struct TF_OpDefinitionBuilder TF_OpDefinitionBuilder;
typedef struct TF_ShapeHandle TF_ShapeHandle;
typedef struct TF_ShapeInferenceContext TF_ShapeInferenceContext;
typedef struct TF_DimensionHandle TF_DimensionHandle;
#include "tensorflow/c/ops.h"

/* Sets st to code with a printf-style message. */
void embtf_set_status(TF_Status *st, TF_Code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Fails the running Compute with a printf-style message. */
void embtf_fail(TF_OpKernelContext *ctx, TF_Code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Fails the running Compute with libember's message for status rc (the
 * calling thread's last_error, read right after the failed call), else with
 * "<what> failed: <rc's name>". */
void embtf_fail_ember(TF_OpKernelContext *ctx, TF_Code code, int rc, const char *last_error,
                      const char *what);

/* "EMBER_ETIMEDOUT (timed out)", from error.h's table (libember's
 * ember_err_name is out of reach). */
const char *embtf_code_name(int rc);

/* The ember_dtype (feed.h) a TensorFlow dtype is stored as; 0 for one that
 * libember does not carry. */
uint8_t embtf_ember_dtype(TF_DataType t);

/* As numpy and tf.dtypes spell an ember_dtype, for messages. */
const char *embtf_dtype_name(uint8_t ember_dtype);

/* Registers the op that b defines (taking b) and its CPU kernel.  A
 * constructor cannot return an error: a failure is reported on stderr, and
 * tf.load_op_library's module then lacks the op. */
void embtf_register_op(const char *name, TF_OpDefinitionBuilder *b,
                       void *(*create)(TF_OpKernelConstruction *),
                       void (*compute)(void *, TF_OpKernelContext *), void (*destroy)(void *));

/* CLOCK_MONOTONIC in milliseconds. */
int64_t embtf_now_ms(void);

#endif /* EMBER_TF_KERNEL_H */
