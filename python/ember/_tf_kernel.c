/* python/ember/_tf_kernel.c - what Ember's TensorFlow ops share (_tf_kernel.h). */
#define EMBER_TF_UNIT kernel
#include "_tf_kernel.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include "ember/error.h"
#include "ember/feed.h"

static void set_statusv(TF_Status *st, TF_Code code, const char *fmt, va_list ap) {
  char msg[2048];
  vsnprintf(msg, sizeof msg, fmt, ap);
  TF_SetStatus(st, code, msg);
}

void embtf_set_status(TF_Status *st, TF_Code code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_statusv(st, code, fmt, ap);
  va_end(ap);
}

void embtf_fail(TF_OpKernelContext *ctx, TF_Code code, const char *fmt, ...) {
  TF_Status *st = TF_NewStatus();
  va_list ap;
  va_start(ap, fmt);
  set_statusv(st, code, fmt, ap);
  va_end(ap);
  TF_OpKernelContext_Failure(ctx, st);
  TF_DeleteStatus(st);
}

void embtf_fail_ember(TF_OpKernelContext *ctx, TF_Code code, int rc, const char *last_error,
                      const char *what) {
  if (last_error != NULL && last_error[0] != '\0')
    embtf_fail(ctx, code, "%s", last_error);
  else
    embtf_fail(ctx, code, "%s failed: %s", what, embtf_code_name(rc));
}

const char *embtf_code_name(int rc) {
  switch (rc) {
#define EMBER__TF_NAME(name, value, desc) \
  case value:                             \
    return "EMBER_" #name " (" desc ")";
    EMBER_ERRNO_MAP(EMBER__TF_NAME)
#undef EMBER__TF_NAME
  }
  return "an unknown ember status";
}

uint8_t embtf_ember_dtype(TF_DataType t) {
  switch (t) {
  case TF_FLOAT:
    return EMBER_DT_F32;
  case TF_DOUBLE:
    return EMBER_DT_F64;
  case TF_INT32:
    return EMBER_DT_I32;
  case TF_INT64:
    return EMBER_DT_I64;
  case TF_UINT8:
    return EMBER_DT_U8;
  case TF_BOOL:
    return EMBER_DT_BOOL;
  case TF_STRING:
    return EMBER_DT_BYTES;
  default:
    return 0;
  }
}

const char *embtf_dtype_name(uint8_t d) {
  switch (d) {
  case EMBER_DT_F32:
    return "float32";
  case EMBER_DT_F64:
    return "float64";
  case EMBER_DT_I32:
    return "int32";
  case EMBER_DT_I64:
    return "int64";
  case EMBER_DT_U8:
    return "uint8";
  case EMBER_DT_BYTES:
    return "string";
  case EMBER_DT_BOOL:
    return "bool";
  default:
    return "an unknown dtype";
  }
}

void embtf_register_op(const char *name, TF_OpDefinitionBuilder *b,
                       void *(*create)(TF_OpKernelConstruction *),
                       void (*compute)(void *, TF_OpKernelContext *), void (*destroy)(void *)) {
  TF_Status *st = TF_NewStatus();
  TF_RegisterOpDefinition(b, st); /* frees b */
  if (TF_GetCode(st) != TF_OK) {
    fprintf(stderr, "ember: registering the TensorFlow op %s failed: %s\n", name,
            TF_Message(st));
  } else {
    TF_KernelBuilder *kb = TF_NewKernelBuilder(name, "CPU", create, compute, destroy);
    TF_RegisterKernelBuilder(name, kb, st); /* takes kb */
    if (TF_GetCode(st) != TF_OK)
      fprintf(stderr, "ember: registering the TensorFlow op %s's CPU kernel failed: %s\n",
              name, TF_Message(st));
  }
  TF_DeleteStatus(st);
}

int64_t embtf_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}
