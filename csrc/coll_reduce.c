/* coll_reduce.c - the collective's reduction kernels (see coll_reduce.h). */
#include "coll_reduce.h"

#include <string.h>

#include "ember/collective.h"

typedef float v4f __attribute__((vector_size(16)));
typedef double v2d __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef int64_t v2l __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef uint64_t v2u __attribute__((vector_size(16)));

/* One 16-byte vector per iteration (the compiler unrolls), then scalars.
 * BODY sees VT a, b and leaves the result in a; SCALAR sees T x, y and leaves
 * it in x. */
#define DEF_KERNEL(NAME, T, VT, BODY, SCALAR)                \
  static void NAME(uint8_t *d, const uint8_t *s, size_t n) { \
    size_t i = 0;                                            \
    for (; i + 16 <= n; i += 16) {                           \
      VT a, b;                                               \
      memcpy(&a, d + i, 16);                                 \
      memcpy(&b, s + i, 16);                                 \
      BODY;                                                  \
      memcpy(d + i, &a, 16);                                 \
    }                                                        \
    for (; i + sizeof(T) <= n; i += sizeof(T)) {             \
      T x, y;                                                \
      memcpy(&x, d + i, sizeof x);                           \
      memcpy(&y, s + i, sizeof y);                           \
      SCALAR;                                                \
      memcpy(d + i, &x, sizeof x);                           \
    }                                                        \
  }

/* Floats: min/max return NaN if either input is NaN, in either order (so the
 * operation is commutative and every rank computes the same bits). */
#define FMIN_V(MT) { MT m_ = (MT)(a < b) | (MT)(a != a); a = (__typeof__(a))(((MT)a & m_) | ((MT)b & ~m_)); }
#define FMAX_V(MT) { MT m_ = (MT)(a > b) | (MT)(a != a); a = (__typeof__(a))(((MT)a & m_) | ((MT)b & ~m_)); }
#define IMIN_V { __typeof__(a) m_ = (__typeof__(a))(a < b); a = (a & m_) | (b & ~m_); }
#define IMAX_V { __typeof__(a) m_ = (__typeof__(a))(a > b); a = (a & m_) | (b & ~m_); }

DEF_KERNEL(sum_f32, float, v4f, a = a + b, x = x + y)
DEF_KERNEL(min_f32, float, v4f, FMIN_V(v4i), x = (x < y || x != x) ? x : y)
DEF_KERNEL(max_f32, float, v4f, FMAX_V(v4i), x = (x > y || x != x) ? x : y)
DEF_KERNEL(sum_f64, double, v2d, a = a + b, x = x + y)
DEF_KERNEL(min_f64, double, v2d, FMIN_V(v2l), x = (x < y || x != x) ? x : y)
DEF_KERNEL(max_f64, double, v2d, FMAX_V(v2l), x = (x > y || x != x) ? x : y)
/* Integer sums wrap: computed unsigned (signed overflow is undefined). */
DEF_KERNEL(sum_i32, int32_t, v4i, a = (v4i)((v4u)a + (v4u)b),
           x = (int32_t)((uint32_t)x + (uint32_t)y))
DEF_KERNEL(min_i32, int32_t, v4i, IMIN_V, x = x < y ? x : y)
DEF_KERNEL(max_i32, int32_t, v4i, IMAX_V, x = x > y ? x : y)
DEF_KERNEL(sum_i64, int64_t, v2l, a = (v2l)((v2u)a + (v2u)b),
           x = (int64_t)((uint64_t)x + (uint64_t)y))
DEF_KERNEL(min_i64, int64_t, v2l, IMIN_V, x = x < y ? x : y)
DEF_KERNEL(max_i64, int64_t, v2l, IMAX_V, x = x > y ? x : y)

ember__reduce_fn ember__coll_kernel(int dtype, int op) {
  int sum = op == EMBER_RED_SUM || op == EMBER_RED_AVG;
  switch (dtype) {
  case EMBER_DT_F32: return sum ? sum_f32 : op == EMBER_RED_MIN ? min_f32 : max_f32;
  case EMBER_DT_F64: return sum ? sum_f64 : op == EMBER_RED_MIN ? min_f64 : max_f64;
  case EMBER_DT_I32: return sum ? sum_i32 : op == EMBER_RED_MIN ? min_i32 : max_i32;
  case EMBER_DT_I64: return sum ? sum_i64 : op == EMBER_RED_MIN ? min_i64 : max_i64;
  default: return NULL;
  }
}

/* d[i] = d[i] / k over n bytes, as DEF_KERNEL loops (integers truncate
 * toward zero, as C division does). */
#define DEF_SCALE(NAME, T, VT)                               \
  static void NAME(uint8_t *d, size_t n, T k) {              \
    size_t i = 0;                                            \
    for (; i + 16 <= n; i += 16) {                           \
      VT a;                                                  \
      memcpy(&a, d + i, 16);                                 \
      a = a / k;                                             \
      memcpy(d + i, &a, 16);                                 \
    }                                                        \
    for (; i + sizeof(T) <= n; i += sizeof(T)) {             \
      T x;                                                   \
      memcpy(&x, d + i, sizeof x);                           \
      x = x / k;                                             \
      memcpy(d + i, &x, sizeof x);                           \
    }                                                        \
  }

DEF_SCALE(scale_f32, float, v4f)
DEF_SCALE(scale_f64, double, v2d)
DEF_SCALE(scale_i32, int32_t, v4i)
DEF_SCALE(scale_i64, int64_t, v2l)

void ember__coll_scale_avg(uint8_t *d, size_t n, int dtype, uint32_t ranks) {
  switch (dtype) {
  case EMBER_DT_F32: scale_f32(d, n, (float)ranks); break;
  case EMBER_DT_F64: scale_f64(d, n, (double)ranks); break;
  case EMBER_DT_I32: scale_i32(d, n, (int32_t)ranks); break;
  case EMBER_DT_I64: scale_i64(d, n, (int64_t)ranks); break;
  default: break;
  }
}

const char *ember__coll_dtype_str(int dtype) {
  switch (dtype) {
  case EMBER_DT_F32: return "float32";
  case EMBER_DT_F64: return "float64";
  case EMBER_DT_I32: return "int32";
  case EMBER_DT_I64: return "int64";
  default: return "bytes";
  }
}

const char *ember__coll_redop_str(int op) {
  switch (op) {
  case EMBER_RED_SUM: return "sum";
  case EMBER_RED_AVG: return "avg";
  case EMBER_RED_MIN: return "min";
  case EMBER_RED_MAX: return "max";
  default: return "?";
  }
}
