/* batch.c - the columnar batch codec (layout in ember/batch.h).
 *
 * The feed's client encodes straight into a socket's iovecs or a shared-memory
 * ring with the ember__batch_* pieces (feed_internal.h) instead of
 * ember_batch_encode, so they are shared, not static.
 */
#include "ember/batch.h"

#include <stdio.h>
#include <string.h>

#include "ember/error.h"
#include "ember/wire.h"
#include "feed_internal.h"


/* Decoded batches point straight into the received buffer (no copy), so
 * fixed-width columns and BYTES offsets are used in host byte order.  The wire
 * is little-endian; refuse to build where the two differ rather than silently
 * mis-read numbers. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libember's zero-copy batch codec requires a little-endian host"
#endif

#define BATCH_HDR_LEN 8u   /* u32 nrows, u32 ncols */
#define BATCH_DESC_LEN 16u /* u8 dtype, u8 name_len, u16 0, u32 width, u64 nbytes */

size_t ember_dtype_size(uint8_t dtype) {
  switch (dtype) {
    case EMBER_DT_F32: return 4;
    case EMBER_DT_F64: return 8;
    case EMBER_DT_I32: return 4;
    case EMBER_DT_I64: return 8;
    case EMBER_DT_U8: return 1;
    case EMBER_DT_BOOL: return 1;
    default: return 0; /* BYTES (variable) and unknown */
  }
}

static int dtype_known(uint8_t dtype) {
  return dtype == EMBER_DT_BYTES || ember_dtype_size(dtype) != 0;
}

/* Rounds up to a multiple of 8; *out overflow-checked. */
static int align8(uint64_t v, uint64_t *out) {
  if (v > UINT64_MAX - 7u) return -1;
  *out = (v + 7u) & ~(uint64_t)7u;
  return 0;
}

/* Column names come from the network: print at most 64 bytes, with anything
 * unprintable replaced, so an error message can never be garbled by them. */
static const char *printable_name(const char *name, size_t len, char *out, size_t cap) {
  size_t n = 0;
  if (name == NULL) len = 0;
  for (size_t i = 0; i < len && i < 64 && n + 1 < cap; i++) {
    unsigned char ch = (unsigned char)name[i];
    out[n++] = (ch >= 0x20 && ch < 0x7f && ch != '\'') ? (char)ch : '?';
  }
  if (len > 64 && n + 4 < cap) {
    memcpy(out + n, "...", 3);
    n += 3;
  }
  out[n] = '\0';
  return out;
}

/* Body bytes of one column, from its descriptor fields; -1 on overflow.
 * fixed: nrows * width * itemsize.  BYTES: 8 * (nrows + 1) + data_len. */
static int column_body_size(uint8_t dtype, uint32_t width, uint32_t nrows,
                            uint64_t data_len, uint64_t *out) {
  uint64_t n = 0;
  if (dtype == EMBER_DT_BYTES) {
    /* (nrows + 1) * 8 <= 2^35: cannot overflow u64; the add can. */
    n = ((uint64_t)nrows + 1u) * 8u;
    if (__builtin_add_overflow(n, data_len, &n)) return -1;
  } else {
    if (__builtin_mul_overflow((uint64_t)nrows, (uint64_t)width, &n)) return -1;
    if (__builtin_mul_overflow(n, (uint64_t)ember_dtype_size(dtype), &n)) return -1;
  }
  *out = n;
  return 0;
}

/* The checks of one column that read its data: BYTES offsets that start at 0,
 * never decrease and end at data_len; BOOL elements that are 0 or 1. */
static int column_content_ok(const ember_column *c, uint32_t i, uint32_t nrows) {
  char nm[80];
  printable_name(c->name, c->name_len, nm, sizeof nm);
  if (c->dtype == EMBER_DT_BYTES) {
    uint64_t prev = 0, cur = 0;
    /* memcpy: the caller's offsets may sit at any address (e.g. a decoded
     * batch in an unaligned buffer). */
    for (uint64_t r = 0; r <= nrows; r++) {
      memcpy(&cur, (const uint8_t *)c->offsets + r * 8u, 8);
      if ((r == 0 && cur != 0) || cur < prev)
        return ember__set_error(EMBER_EINVAL,
                                "batch column %u ('%s'): offset[%llu] = %llu (offsets must "
                                "start at 0 and never decrease)",
                                i, nm, (unsigned long long)r, (unsigned long long)cur);
      prev = cur;
    }
    if (cur != c->data_len)
      return ember__set_error(EMBER_EINVAL,
                              "batch column %u ('%s'): last offset %llu != data_len %llu", i, nm,
                              (unsigned long long)cur, (unsigned long long)c->data_len);
  } else if (c->dtype == EMBER_DT_BOOL) {
    const uint8_t *b = c->data;
    for (uint64_t k = 0; k < c->data_len; k++)
      if (b[k] > 1)
        return ember__set_error(EMBER_EINVAL, "batch column %u ('%s'): BOOL element %llu is %u",
                                i, nm, (unsigned long long)k, b[k]);
  }
  return EMBER_OK;
}

int ember__batch_check_content(const ember_column *cols, uint32_t ncols, uint32_t nrows) {
  int rc = EMBER_OK;
  for (uint32_t i = 0; i < ncols && rc == EMBER_OK; i++)
    rc = column_content_ok(&cols[i], i, nrows);
  return rc;
}

int ember__batch_shape_layout(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                              int with_pointers, size_t *desc_end, size_t *total) {
  char nm[80];
  uint64_t pos = BATCH_HDR_LEN, body = 0;
  int rc = EMBER_OK;

  if (ncols > 0 && cols == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "batch: %u columns but cols is NULL", ncols);
    goto cleanup;
  }
  if (ncols > EMBER_BATCH_MAX_COLS) {
    rc = ember__set_error(EMBER_EINVAL, "batch: %u columns exceeds the limit of %u",
                          ncols, EMBER_BATCH_MAX_COLS);
    goto cleanup;
  }
  for (uint32_t i = 0; i < ncols; i++) {
    const ember_column *c = &cols[i];
    printable_name(c->name, c->name_len, nm, sizeof nm);
    if (c->name_len > 0 && c->name == NULL) {
      rc = ember__set_error(EMBER_EINVAL, "batch column %u: name_len %u but name is NULL",
                            i, c->name_len);
      goto cleanup;
    }
    if (!dtype_known(c->dtype)) {
      rc = ember__set_error(EMBER_EINVAL, "batch column %u ('%s'): unknown dtype %u", i,
                            nm, c->dtype);
      goto cleanup;
    }
    if (with_pointers && c->data_len > 0 && c->data == NULL) {
      rc = ember__set_error(EMBER_EINVAL, "batch column %u ('%s'): data_len %llu but data is NULL",
                            i, nm, (unsigned long long)c->data_len);
      goto cleanup;
    }
    if (c->dtype == EMBER_DT_BYTES) {
      if (c->width != 0) {
        rc = ember__set_error(EMBER_EINVAL, "batch column %u ('%s'): BYTES width must be 0, not %u",
                              i, nm, c->width);
        goto cleanup;
      }
      if (with_pointers && c->offsets == NULL) {
        rc = ember__set_error(EMBER_EINVAL, "batch column %u ('%s'): BYTES column without offsets",
                              i, nm);
        goto cleanup;
      }
    } else {
      uint64_t want = 0;
      if (column_body_size(c->dtype, c->width, nrows, 0, &want) != 0) {
        rc = ember__set_error(EMBER_ETOOBIG, "batch column %u ('%s'): %u rows x width %u overflows",
                              i, nm, nrows, c->width);
        goto cleanup;
      }
      if (want != c->data_len) {
        rc = ember__set_error(EMBER_EINVAL,
                              "batch column %u ('%s'): data_len %llu, expected nrows %u x "
                              "width %u x %zu = %llu",
                              i, nm, (unsigned long long)c->data_len, nrows, c->width,
                              ember_dtype_size(c->dtype), (unsigned long long)want);
        goto cleanup;
      }
    }
    pos += BATCH_DESC_LEN + c->name_len; /* <= 8 + 1024 * 271: no overflow */
  }
  *desc_end = (size_t)pos;
  if (align8(pos, &pos) != 0) goto overflow;
  for (uint32_t i = 0; i < ncols; i++) {
    if (align8(pos, &pos) != 0) goto overflow;
    if (column_body_size(cols[i].dtype, cols[i].width, nrows, cols[i].data_len, &body) != 0)
      goto overflow;
    if (__builtin_add_overflow(pos, body, &pos)) goto overflow;
  }
  if (pos > SIZE_MAX) goto overflow;
  *total = (size_t)pos;
  goto cleanup;
overflow:
  rc = ember__set_error(EMBER_ETOOBIG, "batch: encoded size overflows");
cleanup:
  return rc;
}

int ember__batch_layout(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                        size_t *desc_end, size_t *total) {
  int rc = ember__batch_shape_layout(cols, ncols, nrows, 1, desc_end, total);
  return rc == EMBER_OK ? ember__batch_check_content(cols, ncols, nrows) : rc;
}

int ember_batch_encoded_size(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                             size_t *out_size) {
  size_t desc_end = 0, total = 0;
  int rc;
  if (out_size == NULL) return ember__set_error(EMBER_EINVAL, "batch: out_size is NULL");
  rc = ember__batch_layout(cols, ncols, nrows, &desc_end, &total);
  if (rc == EMBER_OK) *out_size = total;
  return rc;
}

/* Writes the 8-byte header and the descriptors (not the padding) to out. */
void ember__batch_write_descriptors(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                              uint8_t *out) {
  size_t pos = BATCH_HDR_LEN;
  ember_wire_put_u32(out, nrows);
  ember_wire_put_u32(out + 4, ncols);
  for (uint32_t i = 0; i < ncols; i++) {
    const ember_column *c = &cols[i];
    uint64_t nbytes = 0;
    (void)column_body_size(c->dtype, c->width, nrows, c->data_len, &nbytes); /* checked */
    out[pos] = c->dtype;
    out[pos + 1] = c->name_len;
    out[pos + 2] = 0;
    out[pos + 3] = 0;
    ember_wire_put_u32(out + pos + 4, c->width);
    ember_wire_put_u64(out + pos + 8, nbytes);
    if (c->name_len) memcpy(out + pos + BATCH_DESC_LEN, c->name, c->name_len);
    pos += BATCH_DESC_LEN + c->name_len;
  }
}

size_t ember__batch_place_column(const ember_column *c, uint32_t nrows, uint8_t *out,
                                 size_t end, ember_batch_place *place) {
  size_t at = (end + 7u) & ~(size_t)7u; /* the layout fit, so no overflow */
  memset(out + end, 0, at - end);
  place->offsets = NULL;
  if (c->dtype == EMBER_DT_BYTES) {
    place->offsets = (uint64_t *)(void *)(out + at);
    at += ((size_t)nrows + 1u) * 8u;
  }
  place->data = out + at;
  return at + (size_t)c->data_len;
}

/* Writes a batch whose layout ember__batch_layout has checked; returns its size. */
size_t ember__batch_encode_checked(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                             size_t desc_end, uint8_t *out) {
  size_t pos = desc_end;
  ember__batch_write_descriptors(cols, ncols, nrows, out);
  for (uint32_t i = 0; i < ncols; i++) {
    const ember_column *c = &cols[i];
    ember_batch_place place;
    pos = ember__batch_place_column(c, nrows, out, pos, &place);
    if (place.offsets) /* host order == little-endian */
      memcpy(place.offsets, c->offsets, ((size_t)nrows + 1u) * 8u);
    if (c->data_len) memcpy(place.data, c->data, (size_t)c->data_len);
  }
  return pos;
}

int ember_batch_encode(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                       uint8_t *out, size_t cap, size_t *written) {
  size_t desc_end = 0, total = 0, pos;
  int rc = ember__batch_layout(cols, ncols, nrows, &desc_end, &total);
  if (rc != EMBER_OK) goto cleanup;
  if (out == NULL || cap < total) {
    rc = ember__set_error(EMBER_ETOOBIG, "batch: needs %zu bytes, buffer has %zu", total,
                          out == NULL ? (size_t)0 : cap);
    goto cleanup;
  }
  pos = ember__batch_encode_checked(cols, ncols, nrows, desc_end, out);
  if (written) *written = pos;
cleanup:
  return rc;
}

int ember_batch_decode(const uint8_t *buf, size_t len, ember_column *cols,
                       uint32_t max_cols, uint32_t *ncols_out, uint32_t *nrows_out) {
  char nm[80];
  uint32_t nrows = 0, ncols = 0;
  uint64_t pos = BATCH_HDR_LEN, end = 0;
  int rc = EMBER_OK;

  if ((buf == NULL && len > 0) || ncols_out == NULL || nrows_out == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "batch decode: NULL argument");
    goto cleanup;
  }
  if (len < BATCH_HDR_LEN) {
    rc = ember__set_error(EMBER_EPROTO, "batch: %zu bytes is shorter than the 8-byte header", len);
    goto cleanup;
  }
  nrows = ember_wire_get_u32(buf);
  ncols = ember_wire_get_u32(buf + 4);
  if (ncols > EMBER_BATCH_MAX_COLS || ncols > max_cols) {
    rc = ember__set_error(EMBER_EPROTO, "batch: %u columns exceeds the limit of %u", ncols,
                          max_cols < EMBER_BATCH_MAX_COLS ? max_cols : EMBER_BATCH_MAX_COLS);
    goto cleanup;
  }
  if (ncols > 0 && cols == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "batch decode: cols is NULL");
    goto cleanup;
  }

  /* Pass 1: descriptors.  nbytes is parked in data_len until pass 2. */
  for (uint32_t i = 0; i < ncols; i++) {
    ember_column *c = &cols[i];
    uint64_t nbytes, want = 0;
    uint16_t reserved;
    if (len - pos < BATCH_DESC_LEN) {
      rc = ember__set_error(EMBER_EPROTO,
                            "batch column %u: descriptor truncated (%zu bytes left at offset %llu)",
                            i, (size_t)(len - pos), (unsigned long long)pos);
      goto cleanup;
    }
    memset(c, 0, sizeof *c);
    c->dtype = buf[pos];
    c->name_len = buf[pos + 1];
    reserved = (uint16_t)(buf[pos + 2] | buf[pos + 3] << 8);
    c->width = ember_wire_get_u32(buf + pos + 4);
    nbytes = ember_wire_get_u64(buf + pos + 8);
    pos += BATCH_DESC_LEN;
    if (len - pos < c->name_len) {
      rc = ember__set_error(EMBER_EPROTO, "batch column %u: name of %u bytes truncated", i,
                            c->name_len);
      goto cleanup;
    }
    c->name = (const char *)(buf + pos);
    pos += c->name_len;
    printable_name(c->name, c->name_len, nm, sizeof nm);
    if (reserved != 0) {
      rc = ember__set_error(EMBER_EPROTO, "batch column %u ('%s'): reserved field is %u, not 0",
                            i, nm, reserved);
      goto cleanup;
    }
    if (!dtype_known(c->dtype)) {
      rc = ember__set_error(EMBER_EPROTO, "batch column %u ('%s'): unknown dtype %u", i, nm,
                            c->dtype);
      goto cleanup;
    }
    if (c->dtype == EMBER_DT_BYTES) {
      if (c->width != 0) {
        rc = ember__set_error(EMBER_EPROTO, "batch column %u ('%s'): BYTES width is %u, not 0",
                              i, nm, c->width);
        goto cleanup;
      }
      want = ((uint64_t)nrows + 1u) * 8u;
      if (nbytes < want) {
        rc = ember__set_error(EMBER_EPROTO,
                              "batch column %u ('%s'): nbytes %llu is less than the %llu bytes "
                              "of offsets for %u rows",
                              i, nm, (unsigned long long)nbytes, (unsigned long long)want, nrows);
        goto cleanup;
      }
    } else {
      if (column_body_size(c->dtype, c->width, nrows, 0, &want) != 0) {
        rc = ember__set_error(EMBER_EPROTO, "batch column %u ('%s'): %u rows x width %u overflows",
                              i, nm, nrows, c->width);
        goto cleanup;
      }
      if (nbytes != want) {
        rc = ember__set_error(EMBER_EPROTO,
                              "batch column %u ('%s'): nbytes %llu != nrows %u x width %u x "
                              "itemsize %zu",
                              i, nm, (unsigned long long)nbytes, nrows, c->width,
                              ember_dtype_size(c->dtype));
        goto cleanup;
      }
    }
    c->data_len = nbytes;
  }

  /* Pass 2: bodies, each 8-aligned from the start of the batch. */
  if (align8(pos, &pos) != 0) goto truncated_bodies; /* pos <= len: cannot happen */
  for (uint32_t i = 0; i < ncols; i++) {
    ember_column *c = &cols[i];
    uint64_t nbytes = c->data_len;
    printable_name(c->name, c->name_len, nm, sizeof nm);
    if (align8(pos, &pos) != 0 || pos > len || nbytes > len - pos) {
      rc = ember__set_error(EMBER_EPROTO,
                            "batch column %u ('%s'): body of %llu bytes at offset %llu runs past "
                            "the end of the %zu-byte batch",
                            i, nm, (unsigned long long)nbytes, (unsigned long long)pos, len);
      goto cleanup;
    }
    if (c->dtype == EMBER_DT_BYTES) {
      uint64_t olen = ((uint64_t)nrows + 1u) * 8u, dlen = nbytes - olen, prev = 0, cur = 0;
      const uint8_t *ob = buf + pos;
      for (uint64_t r = 0; r <= nrows; r++) {
        cur = ember_wire_get_u64(ob + r * 8u);
        if ((r == 0 && cur != 0) || cur < prev || cur > dlen) {
          rc = ember__set_error(EMBER_EPROTO,
                                "batch column %u ('%s'): bad offset[%llu] = %llu (previous %llu, "
                                "data length %llu)",
                                i, nm, (unsigned long long)r, (unsigned long long)cur,
                                (unsigned long long)prev, (unsigned long long)dlen);
          goto cleanup;
        }
        prev = cur;
      }
      if (cur != dlen) {
        rc = ember__set_error(EMBER_EPROTO,
                              "batch column %u ('%s'): last offset %llu != data length %llu", i,
                              nm, (unsigned long long)cur, (unsigned long long)dlen);
        goto cleanup;
      }
      /* Only 8-aligned relative to buf, as feed.h says; the cast creates no
       * access, callers with an aligned buf may read through it. */
      c->offsets = (const uint64_t *)(const void *)ob;
      c->data = buf + pos + olen;
      c->data_len = dlen;
    } else {
      c->data = buf + pos;
      c->data_len = nbytes;
      if (c->dtype == EMBER_DT_BOOL) {
        const uint8_t *b = buf + pos;
        for (uint64_t k = 0; k < nbytes; k++)
          if (b[k] > 1) {
            rc = ember__set_error(EMBER_EPROTO, "batch column %u ('%s'): BOOL element %llu is %u",
                                  i, nm, (unsigned long long)k, b[k]);
            goto cleanup;
          }
      }
    }
    pos += nbytes;
  }
  /* The encoder writes no trailing padding; a writer that pads every body to
   * 8 bytes is accepted too, but nothing beyond that word. */
  if (align8(pos, &end) != 0 || len < pos || len > end) {
    rc = ember__set_error(EMBER_EPROTO, "batch: %llu unexpected bytes after the last column",
                          (unsigned long long)(len - pos));
    goto cleanup;
  }
  *ncols_out = ncols;
  *nrows_out = nrows;
  goto cleanup;
truncated_bodies:
  rc = ember__set_error(EMBER_EPROTO, "batch: descriptors run past the end");
cleanup:
  return rc;
}
