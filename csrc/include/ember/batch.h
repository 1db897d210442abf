/* ember/batch.h - the columnar batch: the payload of the feed's BATCH and
 * RESULTS frames (feed.h), encoded and decoded without a copy of the data.
 *
 * Pure functions, safe from any thread.  Decoding is for untrusted bytes
 * (fuzzed: tests/fuzz/fuzz_batch.c).
 */
#ifndef EMBER_BATCH_H
#define EMBER_BATCH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* An encoded batch (payload of BATCH and RESULTS):
 *   u32 nrows, u32 ncols, then ncols descriptors:
 *     u8 dtype, u8 name_len, u16 reserved(0), u32 width, u64 nbytes, name bytes
 *   then, at the next multiple of 8 from the start of the batch, each column's
 *   body in order, each starting 8-aligned:
 *     fixed dtypes: nrows * width elements (nbytes must equal that * itemsize)
 *     EMBER_DT_BYTES: (nrows + 1) u64 offsets, then nbytes - 8*(nrows+1) data
 *                     bytes; offsets start at 0, never decrease, end at the
 *                     data length.  width is 0.
 * Decoding checks every count, size (overflow-checked) and offset, so a hostile
 * payload yields EMBER_EPROTO with a message naming the column, never an
 * out-of-bounds read. */
typedef enum {
  EMBER_DT_F32 = 1,
  EMBER_DT_F64 = 2,
  EMBER_DT_I32 = 3,
  EMBER_DT_I64 = 4,
  EMBER_DT_U8 = 5,
  EMBER_DT_BYTES = 6, /* variable-length bytes per row (also UTF-8 strings) */
  EMBER_DT_BOOL = 7   /* one byte per element, 0 or 1 */
} ember_dtype;

#define EMBER_BATCH_MAX_COLS 1024u

typedef struct {
  uint8_t dtype;      /* ember_dtype */
  uint8_t name_len;   /* 0..255; name need not be NUL-terminated */
  const char *name;
  uint32_t width;     /* elements per row (fixed dtypes), 0 for BYTES */
  const void *data;   /* fixed: nrows*width elements; BYTES: the data bytes */
  uint64_t data_len;  /* bytes at data */
  const uint64_t *offsets; /* BYTES only: nrows + 1 offsets into data */
} ember_column;

/* Size in bytes of the element type; 0 for BYTES or unknown. */
size_t ember_dtype_size(uint8_t dtype);

/* Bytes ember_batch_encode will write, or a negative status (EMBER_EINVAL for
 * inconsistent columns, EMBER_ETOOBIG on overflow). */
int ember_batch_encoded_size(const ember_column *cols, uint32_t ncols,
                             uint32_t nrows, size_t *out_size);

/* Encodes into out[0..cap).  Fails with EMBER_EINVAL when a column's sizes do
 * not match nrows (message names the column). */
int ember_batch_encode(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                       uint8_t *out, size_t cap, size_t *written);

/* Decodes buf[0..len) in place: cols[i].data/offsets/name point into buf (no
 * copy; offsets are only 8-aligned relative to buf).  max_cols bounds ncols. */
int ember_batch_decode(const uint8_t *buf, size_t len, ember_column *cols,
                       uint32_t max_cols, uint32_t *ncols, uint32_t *nrows);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_BATCH_H */
