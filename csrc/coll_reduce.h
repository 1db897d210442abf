/* coll_reduce.h - internal: the collective's reduction kernels.
 *
 * A kernel computes d[i] = d[i] OP s[i] over n bytes of elements of one
 * dtype (n a multiple of the element size; a tail shorter than an element is
 * left alone).  Loads and stores go through memcpy, so neither pointer needs
 * alignment; GCC/clang vector extensions make the loops SSE2-wide whatever
 * the -O level.  Integer sums wrap (computed unsigned).  Float min/max return
 * NaN if either input is NaN, in either order: the operation is commutative,
 * so every rank computes the same bits whatever order its data arrives in.
 *
 * Pure functions: no state, no allocation, safe from any thread. */
#ifndef EMBER_COLL_REDUCE_H
#define EMBER_COLL_REDUCE_H

#include <stddef.h>
#include <stdint.h>

typedef void (*ember__reduce_fn)(uint8_t *d, const uint8_t *s, size_t n);

/* The kernel of EMBER_RED_SUM, _AVG (a sum; see ember__coll_scale_avg),
 * _MIN or _MAX on EMBER_DT_F32, _F64, _I32 or _I64; NULL for any other
 * dtype. */
ember__reduce_fn ember__coll_kernel(int dtype, int op);

/* avg's last step: divides n bytes of elements by the number of ranks
 * (integers truncate toward zero, as C division does). */
void ember__coll_scale_avg(uint8_t *d, size_t n, int dtype, uint32_t ranks);

/* "float32", ... ("bytes" for others) and "sum", ... ("?"), for messages. */
const char *ember__coll_dtype_str(int dtype);
const char *ember__coll_redop_str(int op);

#endif /* EMBER_COLL_REDUCE_H */
