/* feed.c - the data feed: batch codec, feed server (poll loop), feed client.
 *
 * Three parts, in file order:
 *   1. the batch codec (pure functions, see the layout in feed.h);
 *   2. the server: one thread runs a poll() loop over the listen socket, an
 *      eventfd for wake-ups and every producer connection; the consumer pops
 *      items from a byte-bounded queue under one mutex;
 *   3. the client: blocking calls with deadlines over net.h.
 *
 * Contract details beyond feed.h:
 *   - a negative timeout_ms means "no limit" (every call still takes one);
 *   - after ember_feed_server_terminate, next() returns END at once;
 *   - ember_feed_server_next, _send_results, _terminate and _stats may be
 *     called from any threads concurrently; _destroy must not race them.
 *     A client handle is for one thread at a time: send() also reads the
 *     socket (client_check_refused) and the handle's flags are unlocked.
 *   - BATCH frames are read with ember_wire_decode_header (bounded by
 *     max_frame) and the payload is received straight into the item's
 *     buffer, rather than through ember_wire_parser: the parser would copy
 *     every payload once more and hold a buffer up to max_frame per
 *     connection (invariant 5, the hot path).
 *
 * Shared memory: a producer's ring (see feed.h) is read by one thread per
 * ring, ring_reader, which waits for queue space, copies a batch out of the
 * ring into a malloc'd buffer, validates it there and queues it exactly as
 * the loop does with a TCP batch (queue_batch).  It never touches the
 * connection's socket or state: it reports END, an ERROR marker or a failure
 * in the connection's ring_* fields and wakes the loop, which acts on them.
 * The loop closes the ring (waking the reader) when it kills or refuses the
 * connection, and reaps the connection only after the reader has finished.
 *
 * Locking (server): s->mu guards the queue, the stats, the acknowledged set,
 * the connection list and each connection's out-queue and shared flags.  Only
 * the loop thread changes a connection's state, reads its socket, closes or
 * frees it; other threads set abort_req and wake the loop instead.  The loop
 * drops the lock around poll() and recv() only (recv writes into buffers that
 * belong to the loop), and writes with non-blocking sendmsg() under the lock,
 * because a queued RESULTS frame points at the consumer's buffer, which is
 * only guaranteed alive while that consumer waits under the same lock.
 */
#include "ember/feed.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ember/auth.h"
#include "ember/error.h"
#include "ember/net.h"
#include "ember/shm_ring.h"
#include "ember/wire.h"
#include "preauth.h"

/* Decoded batches point straight into the received buffer (no copy), so
 * fixed-width columns and BYTES offsets are used in host byte order.  The wire
 * is little-endian; refuse to build where the two differ rather than silently
 * mis-read numbers. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libember's zero-copy batch codec requires a little-endian host"
#endif

/* ======================================================================
 * 1. Batch codec
 * ====================================================================== */

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

/* Validates the caller's columns and computes the layout: *desc_end is the
 * offset just past the last descriptor, *total the encoded size. */
static int batch_layout(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                        size_t *desc_end, size_t *total) {
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
    if (c->data_len > 0 && c->data == NULL) {
      rc = ember__set_error(EMBER_EINVAL, "batch column %u ('%s'): data_len %llu but data is NULL",
                            i, nm, (unsigned long long)c->data_len);
      goto cleanup;
    }
    if (c->dtype == EMBER_DT_BYTES) {
      uint64_t prev = 0, cur = 0;
      if (c->width != 0) {
        rc = ember__set_error(EMBER_EINVAL, "batch column %u ('%s'): BYTES width must be 0, not %u",
                              i, nm, c->width);
        goto cleanup;
      }
      if (c->offsets == NULL) {
        rc = ember__set_error(EMBER_EINVAL, "batch column %u ('%s'): BYTES column without offsets",
                              i, nm);
        goto cleanup;
      }
      /* memcpy: the caller's offsets may sit at any address (e.g. a decoded
       * batch in an unaligned buffer). */
      for (uint64_t r = 0; r <= nrows; r++) {
        memcpy(&cur, (const uint8_t *)c->offsets + r * 8u, 8);
        if ((r == 0 && cur != 0) || cur < prev) {
          rc = ember__set_error(EMBER_EINVAL,
                                "batch column %u ('%s'): offset[%llu] = %llu (offsets must "
                                "start at 0 and never decrease)",
                                i, nm, (unsigned long long)r, (unsigned long long)cur);
          goto cleanup;
        }
        prev = cur;
      }
      if (cur != c->data_len) {
        rc = ember__set_error(EMBER_EINVAL,
                              "batch column %u ('%s'): last offset %llu != data_len %llu", i,
                              nm, (unsigned long long)cur, (unsigned long long)c->data_len);
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
      if (c->dtype == EMBER_DT_BOOL && want > 0) {
        const uint8_t *b = c->data;
        for (uint64_t k = 0; k < want; k++)
          if (b[k] > 1) {
            rc = ember__set_error(EMBER_EINVAL, "batch column %u ('%s'): BOOL element %llu is %u",
                                  i, nm, (unsigned long long)k, b[k]);
            goto cleanup;
          }
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

int ember_batch_encoded_size(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                             size_t *out_size) {
  size_t desc_end = 0, total = 0;
  int rc;
  if (out_size == NULL) return ember__set_error(EMBER_EINVAL, "batch: out_size is NULL");
  rc = batch_layout(cols, ncols, nrows, &desc_end, &total);
  if (rc == EMBER_OK) *out_size = total;
  return rc;
}

/* Writes the 8-byte header and the descriptors (not the padding) to out. */
static void write_descriptors(const ember_column *cols, uint32_t ncols, uint32_t nrows,
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

/* Writes a batch whose layout batch_layout has checked; returns its size. */
static size_t encode_checked(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                             size_t desc_end, uint8_t *out) {
  size_t pos;
  write_descriptors(cols, ncols, nrows, out);
  pos = desc_end;
  for (uint32_t i = 0; i < ncols; i++) {
    const ember_column *c = &cols[i];
    size_t start = (pos + 7u) & ~(size_t)7u; /* total fit, so no overflow */
    memset(out + pos, 0, start - pos);
    pos = start;
    if (c->dtype == EMBER_DT_BYTES) {
      size_t olen = ((size_t)nrows + 1u) * 8u;
      memcpy(out + pos, c->offsets, olen); /* host order == little-endian */
      pos += olen;
    }
    if (c->data_len) memcpy(out + pos, c->data, (size_t)c->data_len);
    pos += (size_t)c->data_len;
  }
  return pos;
}

int ember_batch_encode(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                       uint8_t *out, size_t cap, size_t *written) {
  size_t desc_end = 0, total = 0, pos;
  int rc = batch_layout(cols, ncols, nrows, &desc_end, &total);
  if (rc != EMBER_OK) goto cleanup;
  if (out == NULL || cap < total) {
    rc = ember__set_error(EMBER_ETOOBIG, "batch: needs %zu bytes, buffer has %zu", total,
                          out == NULL ? (size_t)0 : cap);
    goto cleanup;
  }
  pos = encode_checked(cols, ncols, nrows, desc_end, out);
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

/* ======================================================================
 * Shared helpers
 * ====================================================================== */

#define FEED_DEFAULT_QUEUE (64u * 1024u * 1024u)
#define FEED_DEFAULT_MAX_FRAME (256u * 1024u * 1024u)
#define FEED_DEFAULT_IO_MS 600000u
/* Payload limit of every frame but BATCH/RESULTS (HELLO, AUTH, ACK, ...). */
#define FEED_CTL_MAX 4096u
#define FEED_REASON_MAX 1024u

/* Absolute deadline; a negative timeout means "no limit". */
static int64_t feed_deadline(int64_t timeout_ms) {
  return timeout_ms < 0 ? INT64_MAX : ember_deadline_after(timeout_ms);
}

/* 1 if code is one of the EMBER_E* values (for statuses read off the wire). */
static int known_status(int32_t code) {
#define FEED__KNOWN(name, value, desc) if (code == (value)) return 1;
  EMBER_ERRNO_MAP(FEED__KNOWN)
#undef FEED__KNOWN
  return 0;
}

/* This host's identity for FEED_SHM: the kernel's boot id, mixed with the
 * network namespace's inode, 16 bytes; all zero when unknown.  Containers on
 * one kernel share the boot id; those with a network of their own are other
 * hosts to Spark (their own address), and their /dev/shm and /proc may be
 * too, so only a producer in this network namespace is offered the ring. */
static void feed_host_id(uint8_t out[16]) {
  char buf[64];
  size_t n = 0;
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  memset(out, 0, 16);
  if (f == NULL) return;
  if (fgets(buf, sizeof buf, f) != NULL) {
    for (const char *p = buf; *p && n < 32; p++) {
      int v = (*p >= '0' && *p <= '9') ? *p - '0'
              : (*p >= 'a' && *p <= 'f') ? *p - 'a' + 10
              : (*p >= 'A' && *p <= 'F') ? *p - 'A' + 10
                                         : -1;
      if (v < 0) continue;
      out[n / 2] = (uint8_t)(out[n / 2] | (n % 2 ? v : v << 4));
      n++;
    }
  }
  fclose(f);
  if (n != 32) {
    memset(out, 0, 16);
    return;
  }
  struct stat netns;
  if (stat("/proc/self/ns/net", &netns) == 0) {
    uint64_t ino = (uint64_t)netns.st_ino;
    for (int i = 0; i < 8; i++) out[8 + i] ^= (uint8_t)(ino >> (8 * i));
  }
}

/* EMBER_FEED_SHM=0 (or "false", "no", "off") turns shared memory off. */
static int feed_env_shm_enabled(void) {
  const char *v = getenv("EMBER_FEED_SHM");
  if (v == NULL) return 1;
  return !(strcmp(v, "0") == 0 || strcasecmp(v, "false") == 0 || strcasecmp(v, "no") == 0 ||
           strcasecmp(v, "off") == 0);
}

#define FEED_DEFAULT_RING (16u * 1024u * 1024u)

static size_t feed_env_ring_bytes(void) {
  const char *v = getenv("EMBER_FEED_SHM_BYTES");
  char *end = NULL;
  unsigned long long n;
  if (v == NULL || *v == '\0') return FEED_DEFAULT_RING;
  n = strtoull(v, &end, 10);
  if (*end != '\0' || n < EMBER_SHM_RING_MIN_BYTES || n > EMBER_SHM_RING_MAX_BYTES)
    return FEED_DEFAULT_RING;
  return (size_t)n;
}

/* ======================================================================
 * 2. Server
 * ====================================================================== */

#define FEED_STAGE_LEN 65536u
/* A body read with at least this much left goes straight into the batch
 * buffer, bypassing the staging buffer (no copy on the hot path). */
#define FEED_DIRECT_MIN 16384u
/* Bytes read from one connection per loop turn, so one fast producer cannot
 * starve the others (poll is level-triggered: the rest is read next turn). */
#define FEED_READ_BUDGET (4u * 1024u * 1024u)
/* Authenticated producers at once.  Unauthenticated connections have a pool
 * of their own (max_pending, see preauth.h), so strangers cannot use these up. */
#define FEED_MAX_CONNS 1024u
/* Accepts per loop turn: between batches the loop reads pending peers' AUTH,
 * so a burst of strangers cannot evict a real producer before it answered. */
#define FEED_ACCEPT_BATCH 64
/* Accepting pauses this long when the process is out of descriptors and no
 * stranger's connection can be given up (poll would report the listener
 * readable forever). */
#define FEED_ACCEPT_PAUSE_MS 100
/* After a REFUSED, keep reading (and discarding) this long before closing,
 * so the peer reads our reason instead of a connection reset. */
#define FEED_LINGER_MS 2000
/* Shared-memory producers at once (one reader thread each); more get TCP. */
#define FEED_MAX_RINGS 64u
/* FEED_SHM payload: host id, pid, fd, segment bytes, token */
#define FEED_SHM_REQ_LEN (16u + 4u + 4u + 8u + 32u)

enum { C_AUTH, C_HELLO, C_STREAM, C_ENDING, C_DONE, C_LINGER, C_DEAD };
enum { RX_HDR, RX_BODY };

/* One frame waiting to be written.  Frames the loop makes (challenge, ACK,
 * REFUSED) are owned: one malloc with the bytes after the struct.  A RESULTS
 * frame is borrowed: seg[1] is the consumer's buffer, which stays valid while
 * that consumer waits for done (under s->mu). */
typedef struct out_req {
  struct out_req *next;
  const uint8_t *seg[2];
  size_t seglen[2];
  size_t sent;
  int owned;
  int done, status;
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
} out_req;

struct ember_feed_server;

typedef struct feed_conn {
  struct feed_conn *next;
  struct ember_feed_server *srv;
  uint64_t id;
  int fd;
  int state;
  char peer[64];
  int64_t deadline; /* handshake / flush / linger deadline; 0 = none */
  ember_auth_pending auth;
  /* receive state: loop thread only */
  int rx;
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
  size_t hdr_have;
  ember_frame_header fh;
  uint8_t *body;
  size_t body_have;
  /* partition state */
  int helloed;
  uint32_t partition, flags;
  int dup;           /* partition already acknowledged: discard its data */
  int acked_ok;      /* ACK(EMBER_OK) queued: the partition is delivered */
  uint64_t batches;  /* BATCH frames queued for this partition */
  uint64_t records;  /* rows in them */
  uint64_t end_count;
  size_t outstanding; /* queued items not yet popped */
  int shm_asked;      /* FEED_SHM seen (once per connection) */
  int authed;         /* proved the secret: counted in nauthed, never evicted */
  ember__pool_link pool; /* in s->pool while unauthenticated (preauth.h) */
  int tcp_batch_seen; /* a BATCH came over TCP: too late for a ring */
  /* under s->mu, shared with other threads */
  out_req *outq, *outq_tail;
  int shut_after_flush;
  int abort_req; /* set by send_results on a half-written frame */
  /* shared-memory ring (NULL: batches come over TCP); the ring_* flags are
   * set by the reader thread and acted on by the loop, under s->mu */
  ember_shm_ring *ring;
  pthread_t ring_thread;
  int ring_thread_started;
  int ring_done;      /* the reader has finished */
  int ring_handled;   /* the loop has acted on how it finished */
  int ring_ended;     /* it read END: every batch before it is queued */
  int ring_failed;    /* the producer wrote an ERROR marker (as FEED_ERROR) */
  int ring_err;       /* the reader failed with this status (ring_why says why) */
  char ring_why[FEED_REASON_MAX];
} feed_conn;

typedef struct qnode {
  ember_feed_item item; /* first: ember_feed_item_free(&node->item) frees node */
  struct qnode *next;
  feed_conn *conn; /* NULL once that connection is gone */
} qnode;

struct ember_feed_server {
  pthread_mutex_t mu;
  pthread_cond_t item_cond; /* consumer: an item arrived, or terminate/END */
  pthread_cond_t out_cond;  /* send_results: a RESULTS frame was written */
  pthread_cond_t space_cond; /* ring readers: queue space, terminate, or stop */
  pthread_t thread;
  int thread_started;
  int listen_fd, wake_fd;
  uint16_t port;
  uint8_t *secret;
  size_t secret_len;
  size_t queue_limit;
  uint32_t max_frame;
  int64_t io_ms;
  int64_t pre_ms;         /* from accept to AUTH + FEED_HELLO */
  uint32_t max_pending;   /* unauthenticated connections kept at once */
  ember_log_fn log_fn;
  void *log_arg;
  int shm_enabled;
  uint8_t host_id[16];

  /* under mu */
  qnode *qhead, *qtail;
  size_t qbytes;
  int end_queued, end_returned, terminated, stopping;
  int fatal;
  char fatal_msg[256];
  feed_conn *conns;
  size_t nconns;
  uint64_t next_id;
  uint32_t *acked; /* sorted partition ids acknowledged OK */
  size_t nacked, acked_cap;
  /* records queued by connections that ended without an ACK, per partition
   * (what a resuming producer skips); sorted by partition */
  struct held_rows { uint32_t partition; uint64_t records; } *held;
  size_t nheld, held_cap;
  ember_feed_stats stats;
  size_t nrings;
  ember__pool pool; /* unauthenticated connections, oldest first */
  size_t nauthed;
  int64_t accept_paused_until;
  ember__reject_log rejects;

  /* loop thread only */
  struct pollfd *pfds;
  feed_conn **pconns;
  size_t pcap;
  uint8_t stage[FEED_STAGE_LEN];
  ember_column cols[EMBER_BATCH_MAX_COLS];
};

static void wake_loop(ember_feed_server *s) {
  uint64_t one = 1;
  /* EAGAIN means the counter is already non-zero: the loop will wake. */
  ssize_t n = write(s->wake_fd, &one, sizeof one);
  (void)n;
}

static int cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, int64_t deadline_ms) {
  struct timespec ts;
  if (deadline_ms == INT64_MAX) return pthread_cond_wait(cv, mu);
  ts.tv_sec = (time_t)(deadline_ms / 1000);
  ts.tv_nsec = (long)(deadline_ms % 1000) * 1000000L;
  return pthread_cond_timedwait(cv, mu, &ts);
}

/* --- acknowledged partitions: a sorted array (a few thousand at most) --- */
static int acked_find(const ember_feed_server *s, uint32_t p, size_t *at) {
  size_t lo = 0, hi = s->nacked;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (s->acked[mid] < p) lo = mid + 1;
    else hi = mid;
  }
  *at = lo;
  return lo < s->nacked && s->acked[lo] == p;
}

static size_t held_find(const ember_feed_server *s, uint32_t p, int *found) {
  size_t lo = 0, hi = s->nheld;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (s->held[mid].partition < p) lo = mid + 1;
    else hi = mid;
  }
  *found = lo < s->nheld && s->held[lo].partition == p;
  return lo;
}

static uint64_t held_records(const ember_feed_server *s, uint32_t p) {
  int found;
  size_t at = held_find(s, p, &found);
  return found ? s->held[at].records : 0;
}

/* Remembers records of p queued by a connection that ended without an ACK.
 * On ENOMEM the count is lost: a later resume re-sends them (duplicates),
 * the pre-resume behaviour, never a loss. */
static void held_add(ember_feed_server *s, uint32_t p, uint64_t records) {
  int found;
  size_t at = held_find(s, p, &found);
  if (!found) {
    if (s->nheld == s->held_cap) {
      size_t ncap = s->held_cap ? s->held_cap * 2 : 16;
      struct held_rows *n = realloc(s->held, ncap * sizeof *n);
      if (n == NULL) return;
      s->held = n;
      s->held_cap = ncap;
    }
    memmove(s->held + at + 1, s->held + at, (s->nheld - at) * sizeof *s->held);
    s->held[at].partition = p;
    s->held[at].records = 0;
    s->nheld++;
  }
  s->held[at].records += records;
}

static int acked_add(ember_feed_server *s, uint32_t p) {
  size_t at = 0;
  if (acked_find(s, p, &at)) return EMBER_OK;
  if (s->nacked == s->acked_cap) {
    size_t ncap = s->acked_cap ? s->acked_cap * 2 : 64;
    uint32_t *n = realloc(s->acked, ncap * sizeof *n);
    if (n == NULL) return EMBER_ENOMEM;
    s->acked = n;
    s->acked_cap = ncap;
  }
  memmove(s->acked + at + 1, s->acked + at, (s->nacked - at) * sizeof *s->acked);
  s->acked[at] = p;
  s->nacked++;
  return EMBER_OK;
}

/* --- out queue --- */
static void outq_push(feed_conn *c, out_req *r) {
  r->next = NULL;
  if (c->outq_tail) c->outq_tail->next = r;
  else c->outq = r;
  c->outq_tail = r;
}

static void outq_unlink(feed_conn *c, out_req *r) {
  out_req **pp = &c->outq, *prev = NULL;
  while (*pp && *pp != r) {
    prev = *pp;
    pp = &(*pp)->next;
  }
  if (*pp == NULL) return;
  *pp = r->next;
  if (c->outq_tail == r) c->outq_tail = prev;
}

/* Queues an owned copy of a whole frame (header included). */
static int queue_owned_frame(feed_conn *c, const uint8_t *frame, size_t len) {
  out_req *r = malloc(sizeof *r + len);
  if (r == NULL) return EMBER_ENOMEM;
  memset(r, 0, sizeof *r);
  memcpy(r + 1, frame, len);
  r->seg[0] = (const uint8_t *)(r + 1);
  r->seglen[0] = len;
  r->owned = 1;
  outq_push(c, r);
  return EMBER_OK;
}

/* Queues ACK or REFUSED: u32 status, str reason. */
static int queue_status_frame(feed_conn *c, uint16_t type, int status, const char *reason) {
  uint8_t buf[EMBER_WIRE_HEADER_LEN + 8 + FEED_REASON_MAX];
  size_t rlen = strlen(reason);
  if (rlen > FEED_REASON_MAX) rlen = FEED_REASON_MAX;
  ember_wire_encode_header(buf, type, (uint32_t)(8 + rlen));
  ember_wire_put_u32(buf + EMBER_WIRE_HEADER_LEN, (uint32_t)status);
  ember_wire_put_u32(buf + EMBER_WIRE_HEADER_LEN + 4, (uint32_t)rlen);
  memcpy(buf + EMBER_WIRE_HEADER_LEN + 8, reason, rlen);
  return queue_owned_frame(c, buf, EMBER_WIRE_HEADER_LEN + 8 + rlen);
}

/* Counts a stranger's rejected connection; the log gets a line at most once
 * per interval.  Under s->mu (the callback must not call the server). */
static void note_rejected(ember_feed_server *s, const feed_conn *c, const char *reason) {
  char line[768];
  if (ember__reject_note(&s->rejects, ember_now_ms(), c->peer, reason, line, sizeof line) > 0)
    s->log_fn(s->log_arg, line);
}

/* Writes as much of c's out-queue as the socket takes, without blocking.
 * Returns EMBER_OK (maybe with frames left) or an error (caller kills c). */
static int conn_flush(ember_feed_server *s, feed_conn *c) {
  while (c->outq && !c->abort_req && c->fd >= 0) {
    out_req *r = c->outq;
    struct iovec iov[2];
    struct msghdr mh;
    int n = 0;
    size_t skip = r->sent;
    ssize_t w;
    for (int k = 0; k < 2; k++) {
      if (skip >= r->seglen[k]) {
        skip -= r->seglen[k];
        continue;
      }
      iov[n].iov_base = (void *)(uintptr_t)(r->seg[k] + skip);
      iov[n].iov_len = r->seglen[k] - skip;
      skip = 0;
      n++;
    }
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov;
    mh.msg_iovlen = (size_t)n;
    w = n ? sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT) : 0;
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return ember__set_errno(EMBER_EIO, errno, "feed: send to producer %s", c->peer);
    }
    r->sent += (size_t)w;
    if (r->sent == r->seglen[0] + r->seglen[1]) {
      c->outq = r->next;
      if (c->outq == NULL) c->outq_tail = NULL;
      if (r->owned) {
        free(r);
      } else {
        r->done = 1;
        r->status = EMBER_OK;
        pthread_cond_broadcast(&s->out_cond);
      }
    }
  }
  return EMBER_OK;
}

static void conn_kill(ember_feed_server *s, feed_conn *c) {
  out_req *r = c->outq, *nx;
  if (c->state == C_DEAD) return;
  c->state = C_DEAD;
  ember__pool_unlink(&s->pool, &c->pool);
  if (c->authed) {
    c->authed = 0;
    s->nauthed--;
  }
  for (; r; r = nx) {
    nx = r->next;
    if (r->owned) {
      free(r);
    } else {
      r->done = 1;
      r->status = EMBER_ENOTFOUND;
    }
  }
  c->outq = c->outq_tail = NULL;
  pthread_cond_broadcast(&s->out_cond);
  free(c->body);
  c->body = NULL;
  ember_net_close(c->fd);
  c->fd = -1;
  if (c->ring) {
    /* Wakes the reader (and a producer blocked on a full ring). */
    ember_shm_ring_close(c->ring);
    pthread_cond_broadcast(&s->space_cond);
  }
}

/* Refuses c: queues REFUSED(code, reason), stops accepting its frames, and
 * closes it once the reason is flushed and read (lingering close). */
static void conn_refuse(ember_feed_server *s, feed_conn *c, int code, const char *reason) {
  s->stats.producers_rejected++;
  if (!c->authed) note_rejected(s, c, reason);
  if (queue_status_frame(c, EMBER_MSG_REFUSED, code, reason) != EMBER_OK) {
    conn_kill(s, c);
    return;
  }
  free(c->body);
  c->body = NULL;
  c->state = C_LINGER;
  c->shut_after_flush = 1;
  /* A stranger that does not read its REFUSED keeps its place no longer
   * than it could have kept it silently (it stays in the pool). */
  c->deadline = ember_now_ms() + (c->authed ? s->io_ms : s->pre_ms);
  if (c->ring) {
    /* The producer's ring wait fails at once; it then reads our reason. */
    ember_shm_ring_close(c->ring);
    pthread_cond_broadcast(&s->space_cond);
  }
}

/* Reading past back-pressure to find a FEED_SHM (see conn_wants_read). */
static int conn_probing(const ember_feed_server *s, const feed_conn *c) {
  return c->state == C_STREAM && !c->ring && !s->terminated && !c->dup &&
         s->qbytes >= s->queue_limit && !c->tcp_batch_seen &&
         (c->rx == RX_HDR || c->fh.type == EMBER_MSG_FEED_SHM);
}

static int conn_wants_read(const ember_feed_server *s, const feed_conn *c) {
  switch (c->state) {
    case C_DEAD: return 0;
    case C_STREAM:
      /* Back-pressure: while the queue is full, leave bytes in the socket so
       * TCP stops the producer.  Data that will be discarded (duplicate or
       * terminated feed) is always read, so such producers never block. */
      if (s->terminated || c->dup) return 1;
      /* With a ring, the socket carries only small control frames; the
       * ring's own back-pressure is in ring_reader. */
      if (c->ring) return 1;
      if (s->qbytes < s->queue_limit) return 1;
      /* Queue full: a producer that has sent no BATCH yet may be offering a
       * ring; its small FEED_SHM frame is read (frame by frame, see
       * conn_read_limit), a BATCH header stops the reading. */
      return conn_probing(s, c);
    default: return 1; /* handshake frames are small; EOF must be seen */
  }
}

static void queue_push(ember_feed_server *s, qnode *n) {
  n->next = NULL;
  if (s->qtail) s->qtail->next = n;
  else s->qhead = n;
  s->qtail = n;
  pthread_cond_signal(&s->item_cond);
}

static void handle_auth_frame(ember_feed_server *s, feed_conn *c) {
  uint8_t reply[EMBER_WIRE_HEADER_LEN + 8 + FEED_REASON_MAX];
  size_t rlen = 0;
  int rc = ember_auth_server_check(&c->auth, s->secret, s->secret_len, c->fh.type, c->body,
                                   c->fh.length, reply, sizeof reply, &rlen);
  if (rlen > 0 && queue_owned_frame(c, reply, rlen) != EMBER_OK) {
    conn_kill(s, c);
    return;
  }
  if (rc == EMBER_OK) {
    /* Authenticated: out of the pool, never evicted.  The pre-auth deadline
     * still covers FEED_HELLO, which a producer sends at once. */
    ember__pool_unlink(&s->pool, &c->pool);
    c->authed = 1;
    s->nauthed++;
    c->state = C_HELLO;
    if (s->nauthed > FEED_MAX_CONNS) {
      char why[128];
      snprintf(why, sizeof why, "feed: %u producers are connected already (the limit)",
               FEED_MAX_CONNS);
      conn_refuse(s, c, EMBER_ESTATE, why);
    }
    return;
  }
  s->stats.producers_rejected++;
  note_rejected(s, c, ember_last_error());
  if (rlen == 0) {
    conn_kill(s, c);
    return;
  }
  c->state = C_LINGER;
  c->shut_after_flush = 1;
  c->deadline = ember_now_ms() + s->pre_ms; /* still in the pool: evictable */
}

static void handle_hello(ember_feed_server *s, feed_conn *c) {
  char why[256];
  size_t at = 0;
  if (c->fh.length != 8) {
    snprintf(why, sizeof why, "feed: FEED_HELLO payload is %u bytes, expected 8", c->fh.length);
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  c->partition = ember_wire_get_u32(c->body);
  c->flags = ember_wire_get_u32(c->body + 4);
  if (c->flags & ~(EMBER_FEED_WANT_RESULTS | EMBER_FEED_RESUME)) {
    snprintf(why, sizeof why, "feed: FEED_HELLO has unknown flags 0x%x", c->flags);
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  if ((c->flags & EMBER_FEED_RESUME) && (c->flags & EMBER_FEED_WANT_RESULTS)) {
    snprintf(why, sizeof why, "feed: FEED_HELLO asks to resume partition %u with results "
             "(results of the skipped records are gone)", c->partition);
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  if (c->flags & EMBER_FEED_RESUME) {
    /* The count is only final once every earlier connection of the partition
     * has ended (and its ring reader stopped queueing). */
    for (feed_conn *o = s->conns; o; o = o->next)
      if (o != c && o->helloed && o->partition == c->partition && !o->dup && !o->acked_ok &&
          !(o->flags & EMBER_FEED_WANT_RESULTS)) {
        snprintf(why, sizeof why, "feed: partition %u is still being fed by another connection "
                 "(%s, an earlier attempt of this task?); retry once it has ended",
                 c->partition, o->peer);
        conn_refuse(s, c, EMBER_ESTATE, why);
        return;
      }
  }
  c->helloed = 1;
  if (acked_find(s, c->partition, &at)) {
    c->dup = 1;
    s->stats.duplicate_partitions++;
  }
  if (c->flags & EMBER_FEED_RESUME) {
    uint8_t frame[EMBER_WIRE_HEADER_LEN + 12];
    ember_wire_encode_header(frame, EMBER_MSG_FEED_RESUME, 12);
    ember_wire_put_u32(frame + EMBER_WIRE_HEADER_LEN, (uint32_t)c->dup);
    ember_wire_put_u64(frame + EMBER_WIRE_HEADER_LEN + 4,
                       c->dup ? 0 : held_records(s, c->partition));
    if (queue_owned_frame(c, frame, sizeof frame) != EMBER_OK) {
      conn_kill(s, c);
      return;
    }
  }
  c->state = C_STREAM;
  c->deadline = 0;
}

/* Queues a decoded batch of c (body: malloc'd, taken over).  Under s->mu. */
static int queue_batch(ember_feed_server *s, feed_conn *c, uint8_t *body, size_t len,
                       uint32_t nrows) {
  qnode *n = calloc(1, sizeof *n);
  if (n == NULL) {
    free(body);
    return EMBER_ENOMEM;
  }
  n->item.kind = EMBER_FEED_ITEM_BATCH;
  n->item.source = c->id;
  n->item.partition = c->partition;
  n->item.flags = c->flags;
  n->item.data = body;
  n->item.len = len;
  n->conn = c;
  c->outstanding++;
  c->batches++;
  c->records += nrows;
  s->qbytes += len;
  s->stats.batches_received++;
  s->stats.records_received += nrows;
  s->stats.bytes_received += len;
  queue_push(s, n);
  return EMBER_OK;
}

/* Queues an ERROR item for the consumer after the batches c already queued:
 * its producer failed, with this reason.  Under s->mu.  Best effort: without
 * memory the consumer just does not hear of it (the task's failure still
 * reaches the driver). */
static void queue_error(ember_feed_server *s, feed_conn *c, const char *reason) {
  size_t len = strlen(reason);
  qnode *n;
  if (s->terminated || c->dup) return;
  n = calloc(1, sizeof *n);
  if (n == NULL) return;
  n->item.data = malloc(len + 1);
  if (n->item.data == NULL) {
    free(n);
    return;
  }
  memcpy(n->item.data, reason, len + 1);
  n->item.kind = EMBER_FEED_ITEM_ERROR;
  n->item.source = c->id;
  n->item.partition = c->partition;
  n->item.flags = c->flags;
  n->item.len = len;
  s->qbytes += len;
  queue_push(s, n);
}

static void handle_batch(ember_feed_server *s, feed_conn *c) {
  char why[FEED_REASON_MAX];
  uint32_t nc = 0, nr = 0;
  uint8_t *body = c->body;
  c->body = NULL;
  if (body == NULL) return; /* read into the discard path */
  if (s->terminated || c->dup) {
    free(body);
    return;
  }
  if (ember_batch_decode(body, c->fh.length, s->cols, EMBER_BATCH_MAX_COLS, &nc, &nr) != EMBER_OK) {
    snprintf(why, sizeof why, "feed: partition %u, batch %llu rejected: %s", c->partition,
             (unsigned long long)c->batches + 1, ember_last_error());
    free(body);
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  if (queue_batch(s, c, body, c->fh.length, nr) != EMBER_OK)
    conn_refuse(s, c, EMBER_ENOMEM, "feed: out of memory queuing a batch");
}

/* ---- shared-memory rings ---- */

/* One per ring: copies batches out of the ring into the queue (see the
 * comment at the top of the file). */
static void *ring_reader(void *arg) {
  feed_conn *c = arg;
  ember_feed_server *s = c->srv;
  ember_column *cols = malloc(sizeof *cols * EMBER_BATCH_MAX_COLS);
  char why[FEED_REASON_MAX];
  int code = EMBER_OK;
  why[0] = '\0';
  pthread_mutex_lock(&s->mu);
  if (cols == NULL) {
    code = EMBER_ENOMEM;
    snprintf(why, sizeof why, "feed: out of memory starting a ring reader");
  }
  while (code == EMBER_OK) {
    ember_shm_msg m;
    uint8_t *body = NULL;
    uint32_t nc = 0, nr = 0;
    int discard, rc;
    m.kind = 0;
    /* Back-pressure: while the queue is full the ring stays full and the
     * producer blocks in its reserve. */
    while (c->state != C_DEAD && c->state != C_LINGER && !s->stopping && !s->terminated &&
           !c->dup && s->qbytes >= s->queue_limit)
      pthread_cond_wait(&s->space_cond, &s->mu);
    if (c->state == C_DEAD || c->state == C_LINGER || s->stopping) break;
    pthread_mutex_unlock(&s->mu);
    /* No deadline: the loop closes the ring to stop us, and the ring itself
     * notices a dead producer. */
    rc = ember_shm_ring_next(c->ring, &m, s->max_frame, -1);
    if (rc == EMBER_OK && m.kind == EMBER_SHM_MSG_DATA) {
      pthread_mutex_lock(&s->mu);
      discard = s->terminated || c->dup;
      pthread_mutex_unlock(&s->mu);
      if (discard) {
        rc = ember_shm_ring_release(c->ring, -1);
      } else {
        body = malloc(m.len ? m.len : 1); /* 8-aligned, as items promise */
        if (body == NULL) {
          rc = ember__set_error(EMBER_ENOMEM, "out of memory for a %zu-byte batch", m.len);
        } else {
          rc = ember_shm_ring_read(c->ring, body, m.len, -1);
          /* Validated in our copy: the producer cannot change it any more. */
          if (rc == EMBER_OK)
            rc = ember_batch_decode(body, m.len, cols, EMBER_BATCH_MAX_COLS, &nc, &nr);
        }
      }
    }
    pthread_mutex_lock(&s->mu);
    if (rc != EMBER_OK) {
      code = rc;
      snprintf(why, sizeof why, "feed: partition %u, batch %llu rejected: %s", c->partition,
               (unsigned long long)c->batches + 1, ember_last_error());
      free(body);
      break;
    }
    if (m.kind == EMBER_SHM_MSG_END) {
      c->ring_ended = 1;
      break;
    }
    if (m.kind == EMBER_SHM_MSG_ERROR) {
      c->ring_failed = 1;
      snprintf(why, sizeof why, "feed: the producer of partition %u failed: %s", c->partition,
               m.reason);
      queue_error(s, c, why); /* here: the connection may already be closing */
      break;
    }
    if (body == NULL) continue; /* discarded */
    if (s->terminated || c->dup || c->state == C_DEAD || c->state == C_LINGER) {
      free(body);
      continue;
    }
    if (queue_batch(s, c, body, m.len, nr) != EMBER_OK) {
      code = EMBER_ENOMEM;
      snprintf(why, sizeof why, "feed: out of memory queuing a batch");
    }
  }
  /* still under s->mu */
  if (code != EMBER_OK || c->ring_failed) {
    c->ring_err = code;
    memcpy(c->ring_why, why, sizeof c->ring_why);
  }
  c->ring_done = 1;
  pthread_mutex_unlock(&s->mu);
  wake_loop(s);
  free(cols);
  return NULL;
}

/* FEED_SHM: attach the producer's ring when it is on this host, and say
 * whether we did.  Declining is not an error: the producer uses TCP. */
static void handle_shm_request(ember_feed_server *s, feed_conn *c) {
  char why[FEED_REASON_MAX];
  ember_wire_reader r;
  const uint8_t *host = NULL, *token = NULL;
  ember_shm_ring_desc d;
  ember_shm_ring *ring = NULL;
  static const uint8_t zero[16] = {0};
  int st = EMBER_OK;
  why[0] = '\0';
  if (c->shm_asked || c->tcp_batch_seen) {
    snprintf(why, sizeof why, "feed: FEED_SHM %s", c->shm_asked ? "sent twice"
                                                                : "after a BATCH over TCP");
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  c->shm_asked = 1;
  memset(&d, 0, sizeof d);
  ember_wire_reader_init(&r, c->body, c->fh.length);
  ember_wire_read_raw(&r, &host, 16);
  d.pid = (int32_t)ember_wire_read_u32(&r);
  d.fd = (int32_t)ember_wire_read_u32(&r);
  d.size = ember_wire_read_u64(&r);
  ember_wire_read_raw(&r, &token, 32);
  if (ember_wire_reader_finish(&r, 1, "FEED_SHM") != EMBER_OK) {
    snprintf(why, sizeof why, "feed: %s", ember_last_error());
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  memcpy(d.token, token, sizeof d.token);
  if (!s->shm_enabled) {
    st = EMBER_ENOTFOUND;
    snprintf(why, sizeof why, "shared memory is disabled on this node");
  } else if (memcmp(host, zero, 16) != 0 && memcmp(s->host_id, zero, 16) != 0 &&
             memcmp(host, s->host_id, 16) != 0) {
    st = EMBER_ENOTFOUND;
    snprintf(why, sizeof why, "the producer runs on another host");
  } else if (s->nrings >= FEED_MAX_RINGS) {
    st = EMBER_ENOTFOUND;
    snprintf(why, sizeof why, "this node already reads %u shared-memory rings", FEED_MAX_RINGS);
  } else if ((st = ember_shm_ring_attach(&ring, &d, EMBER_SHM_CONSUMER)) != EMBER_OK) {
    snprintf(why, sizeof why, "%s", ember_last_error());
  } else {
    c->ring = ring;
    c->srv = s;
    if (pthread_create(&c->ring_thread, NULL, ring_reader, c) != 0) {
      c->ring = NULL;
      ember_shm_ring_destroy(ring);
      st = EMBER_ESYS;
      snprintf(why, sizeof why, "cannot start a ring reader thread");
    } else {
      c->ring_thread_started = 1;
      s->nrings++;
      s->stats.shm_producers++;
    }
  }
  if (queue_status_frame(c, EMBER_MSG_FEED_SHM_REPLY, st, why) != EMBER_OK) conn_kill(s, c);
}

static void handle_end_feed(ember_feed_server *s, feed_conn *c) {
  if (!s->end_queued && !s->end_returned) {
    qnode *n = calloc(1, sizeof *n);
    if (n == NULL) {
      conn_refuse(s, c, EMBER_ENOMEM, "feed: out of memory queuing END_FEED");
      return;
    }
    n->item.kind = EMBER_FEED_ITEM_END;
    n->item.source = c->id;
    n->item.partition = c->partition;
    n->item.flags = c->flags;
    s->end_queued = 1;
    queue_push(s, n);
    pthread_cond_broadcast(&s->item_cond);
  }
  /* ACK tells the driver END_FEED is queued, not merely sent. */
  if (queue_status_frame(c, EMBER_MSG_ACK, EMBER_OK, "") != EMBER_OK) conn_kill(s, c);
  else c->state = C_DONE;
}

/* A whole frame (c->fh, c->body) has arrived. */
static void conn_frame(ember_feed_server *s, feed_conn *c) {
  char why[256];
  c->rx = RX_HDR;
  c->hdr_have = 0;
  c->body_have = 0;
  switch (c->state) {
    case C_AUTH: handle_auth_frame(s, c); break;
    case C_HELLO: handle_hello(s, c); break;
    case C_STREAM:
      switch (c->fh.type) {
        case EMBER_MSG_BATCH: handle_batch(s, c); break;
        case EMBER_MSG_END_PARTITION:
          if (c->fh.length != 8) {
            snprintf(why, sizeof why, "feed: END_PARTITION payload is %u bytes, expected 8",
                     c->fh.length);
            conn_refuse(s, c, EMBER_EPROTO, why);
            break;
          }
          c->end_count = ember_wire_get_u64(c->body);
          c->state = C_ENDING; /* the ACK waits for the pops, see loop_progress */
          break;
        case EMBER_MSG_END_FEED: handle_end_feed(s, c); break;
        case EMBER_MSG_FEED_SHM: handle_shm_request(s, c); break;
        case EMBER_MSG_FEED_ERROR: {
          /* The producer could not read its partition and says so; it will
           * not send END_PARTITION.  Its queued batches stay (see
           * conn_eof), the consumer gets an ERROR item after them, and the
           * Spark task's failure reaches the driver. */
          char reason[FEED_REASON_MAX + 1], failed[FEED_REASON_MAX + 96];
          ember_wire_reader r;
          ember_wire_reader_init(&r, c->body, c->fh.length);
          ember_wire_read_str(&r, reason, sizeof reason);
          if (ember_wire_reader_finish(&r, 1, "FEED_ERROR") != EMBER_OK)
            snprintf(reason, sizeof reason, "(malformed FEED_ERROR)");
          snprintf(failed, sizeof failed, "feed: the producer of partition %u failed: %s",
                   c->partition, reason);
          queue_error(s, c, failed);
          conn_kill(s, c);
          break;
        }
        default: break; /* filtered in conn_header */
      }
      break;
    default: break;
  }
  free(c->body);
  c->body = NULL;
}

/* A 12-byte header has arrived: check it against what this state allows
 * before allocating anything for the payload. */
static void conn_header(ember_feed_server *s, feed_conn *c) {
  char why[FEED_REASON_MAX];
  /* In C_AUTH any header is accepted here: ember_auth_server_check refuses a
   * wrong type or length itself, without the payload being read. */
  uint32_t max = c->state == C_STREAM ? s->max_frame
                 : c->state == C_AUTH ? EMBER_WIRE_ABSOLUTE_MAX
                                      : FEED_CTL_MAX;
  int rc = ember_wire_decode_header(c->hdr, EMBER_WIRE_HEADER_LEN, max, &c->fh);
  if (rc != EMBER_OK) {
    snprintf(why, sizeof why, "feed: bad frame from %s: %s", c->peer, ember_last_error());
    conn_refuse(s, c, rc, why);
    return;
  }
  switch (c->state) {
    case C_AUTH:
      if (c->fh.type != EMBER_MSG_AUTH || c->fh.length != 2u * EMBER_NONCE_LEN) {
        c->body = NULL;
        handle_auth_frame(s, c); /* refuses on type/length alone */
        return;
      }
      break;
    case C_HELLO:
      if (c->fh.type != EMBER_MSG_FEED_HELLO) {
        snprintf(why, sizeof why, "feed: expected FEED_HELLO, got %s",
                 ember_wire_type_name(c->fh.type));
        conn_refuse(s, c, EMBER_EPROTO, why);
        return;
      }
      break;
    case C_STREAM:
      if (c->fh.type != EMBER_MSG_BATCH && c->fh.type != EMBER_MSG_END_PARTITION &&
          c->fh.type != EMBER_MSG_END_FEED && c->fh.type != EMBER_MSG_FEED_ERROR &&
          c->fh.type != EMBER_MSG_FEED_SHM) {
        snprintf(why, sizeof why, "feed: unexpected %s frame from a producer",
                 ember_wire_type_name(c->fh.type));
        conn_refuse(s, c, EMBER_EPROTO, why);
        return;
      }
      if (c->fh.type == EMBER_MSG_BATCH) {
        if (c->ring) {
          /* Mixing transports would reorder the partition. */
          snprintf(why, sizeof why, "feed: partition %u sent a BATCH over TCP after setting "
                   "up a shared-memory ring", c->partition);
          conn_refuse(s, c, EMBER_EPROTO, why);
          return;
        }
        c->tcp_batch_seen = 1;
      }
      if (c->fh.type != EMBER_MSG_BATCH && c->fh.length > FEED_CTL_MAX) {
        snprintf(why, sizeof why, "feed: %s payload of %u bytes exceeds %u",
                 ember_wire_type_name(c->fh.type), c->fh.length, FEED_CTL_MAX);
        conn_refuse(s, c, EMBER_ETOOBIG, why);
        return;
      }
      break;
    default:
      snprintf(why, sizeof why, "feed: unexpected %s frame after %s",
               ember_wire_type_name(c->fh.type),
               c->state == C_DONE ? "the final ACK" : "END_PARTITION");
      conn_refuse(s, c, EMBER_EPROTO, why);
      return;
  }
  c->body = NULL;
  c->body_have = 0;
  if (c->fh.length == 0) {
    conn_frame(s, c);
    return;
  }
  /* Batches that will be dropped are read into the discard path instead of
   * a buffer. */
  if (c->state == C_STREAM && c->fh.type == EMBER_MSG_BATCH && (s->terminated || c->dup)) {
    c->rx = RX_BODY;
    return;
  }
  c->body = malloc(c->fh.length); /* malloc alignment >= 8, as items promise */
  if (c->body == NULL) {
    snprintf(why, sizeof why, "feed: out of memory for a %u-byte %s frame", c->fh.length,
             ember_wire_type_name(c->fh.type));
    conn_refuse(s, c, EMBER_ENOMEM, why);
    return;
  }
  c->rx = RX_BODY;
}

/* Feeds bytes read from the socket through the frame state machine. */
static void conn_consume(ember_feed_server *s, feed_conn *c, const uint8_t *p, size_t n) {
  while (n > 0 && (c->state != C_LINGER && c->state != C_DEAD)) {
    size_t take;
    if (c->rx == RX_HDR) {
      take = EMBER_WIRE_HEADER_LEN - c->hdr_have;
      if (take > n) take = n;
      memcpy(c->hdr + c->hdr_have, p, take);
      c->hdr_have += take;
      if (c->hdr_have == EMBER_WIRE_HEADER_LEN) conn_header(s, c);
    } else {
      take = c->fh.length - c->body_have;
      if (take > n) take = n;
      if (c->body) memcpy(c->body + c->body_have, p, take);
      c->body_have += take;
      if (c->body_have == c->fh.length) conn_frame(s, c);
    }
    p += take;
    n -= take;
  }
}

/* The producer closed its end (or reset it). */
static void conn_eof(ember_feed_server *s, feed_conn *c) {
  /* A producer gone mid-partition gets no ACK; the batches it already had
   * queued stay queued and will be delivered.  Known limitation: a retried
   * task re-sends the partition from the start, so those rows can arrive
   * twice; the per-partition dedupe here only covers partitions that were
   * acknowledged whole.  Retries of half-sent partitions are handled a level
   * up (the driver decides what to re-feed). */
  if (c->state == C_AUTH || c->state == C_HELLO) s->stats.producers_rejected++;
  if (c->state == C_AUTH) note_rejected(s, c, "closed the connection before authenticating");
  conn_kill(s, c);
}

/* Reads what c's socket has (up to the fairness budget). */
static void conn_read(ember_feed_server *s, feed_conn *c) {
  size_t budget = FEED_READ_BUDGET;
  while (budget > 0 && conn_wants_read(s, c)) {
    int direct = c->rx == RX_BODY && c->body != NULL &&
                 c->fh.length - c->body_have >= FEED_DIRECT_MIN && c->state != C_LINGER;
    uint8_t *dst = direct ? c->body + c->body_have : s->stage;
    size_t cap = direct ? c->fh.length - c->body_have : FEED_STAGE_LEN;
    ssize_t n;
    int err;
    if (cap > budget) cap = budget;
    if (conn_probing(s, c)) { /* the rest of this frame only, no more */
      size_t rest = c->rx == RX_HDR ? EMBER_WIRE_HEADER_LEN - c->hdr_have
                                    : c->fh.length - c->body_have;
      if (cap > rest) cap = rest;
    }
    pthread_mutex_unlock(&s->mu);
    n = recv(c->fd, dst, cap, MSG_DONTWAIT);
    err = errno;
    pthread_mutex_lock(&s->mu);
    if (c->state == C_DEAD) break;
    if (n == 0) {
      conn_eof(s, c);
      break;
    }
    if (n < 0) {
      if (err == EINTR) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) break;
      conn_eof(s, c); /* ECONNRESET and friends: the producer is gone */
      break;
    }
    budget -= (size_t)n;
    if (c->state == C_LINGER) continue; /* discard */
    if (direct) {
      c->body_have += (size_t)n;
      if (c->body_have == c->fh.length) conn_frame(s, c);
    } else {
      conn_consume(s, c, s->stage, (size_t)n);
    }
  }
}

/* Ends the oldest unauthenticated connection to make room.  0 if none. */
static int evict_oldest(ember_feed_server *s, const char *why) {
  feed_conn *victim = ember__pool_oldest(&s->pool);
  if (victim == NULL) return 0;
  if (victim->state == C_AUTH) {
    char reason[192];
    snprintf(reason, sizeof reason, "evicted before authenticating: %s", why);
    s->stats.producers_rejected++;
    note_rejected(s, victim, reason);
  }
  conn_kill(s, victim); /* a refused one lingering (C_LINGER) was counted */
  return 1;
}

static void accept_new(ember_feed_server *s) {
  for (int k = 0; k < FEED_ACCEPT_BATCH; k++) {
    uint8_t chal[EMBER_WIRE_HEADER_LEN + EMBER_NONCE_LEN + 16];
    size_t clen = 0;
    feed_conn *c;
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) break;
      /* Out of descriptors (or memory): give up a stranger's connection and
       * retry at once, else pause accepting instead of spinning on a
       * listener that poll keeps reporting readable. */
      if ((err == EMFILE || err == ENFILE) &&
          evict_oldest(s, "the node is out of file descriptors"))
        continue;
      s->accept_paused_until = ember_now_ms() + FEED_ACCEPT_PAUSE_MS;
      break;
    }
    /* The pool is full: the oldest pending connection makes room, never the
     * new one.  A real producer answers its CHALLENGE within milliseconds,
     * so it is the newest or already authenticated. */
    if (s->pool.n >= s->max_pending) {
      char why[96];
      snprintf(why, sizeof why, "%zu connections were waiting to authenticate (limit %u)",
               s->pool.n, (unsigned)s->max_pending);
      evict_oldest(s, why);
    }
    c = calloc(1, sizeof *c);
    if (c == NULL || ember_auth_server_begin(&c->auth, chal, sizeof chal, &clen) != EMBER_OK ||
        queue_owned_frame(c, chal, clen) != EMBER_OK) {
      if (c) free(c->outq);
      free(c);
      ember_net_close(fd);
      continue;
    }
    (void)ember_net_tune(fd);
    c->fd = fd;
    c->srv = s;
    c->id = ++s->next_id;
    c->state = C_AUTH;
    c->rx = RX_HDR;
    c->deadline = ember_now_ms() + s->pre_ms; /* auth + FEED_HELLO */
    ember_net_peer_name(fd, c->peer, sizeof c->peer);
    c->next = s->conns;
    s->conns = c;
    s->nconns++;
    ember__pool_push(&s->pool, &c->pool, c);
    if (conn_flush(s, c) != EMBER_OK) conn_kill(s, c);
  }
}

/* State changes that do not come from the socket: ACKs that wait for the
 * consumer, deadlines, lingering closes, reaping. */
static void loop_progress(ember_feed_server *s) {
  int64_t now = ember_now_ms();
  feed_conn **pp = &s->conns;
  for (feed_conn *c = s->conns; c; c = c->next) {
    if (c->state == C_DEAD) continue;
    if (c->abort_req) {
      conn_kill(s, c);
      continue;
    }
    /* A refused connection (C_LINGER) closed its ring, which is why the
     * reader stopped: leave it lingering, its reason still has to reach the
     * producer. */
    if (c->ring_done && !c->ring_handled && c->state != C_LINGER) {
      c->ring_handled = 1;
      if (c->ring_failed) {
        conn_kill(s, c); /* as FEED_ERROR: queued batches stay, no ACK */
        continue;
      } else if (c->ring_err == EMBER_ECLOSED) {
        conn_eof(s, c); /* the producer went away (its socket says so too) */
        continue;
      } else if (c->ring_err != EMBER_OK) {
        conn_refuse(s, c, c->ring_err, c->ring_why);
        continue;
      }
    }
    if (c->state == C_ENDING) {
      char why[160];
      int st = EMBER_OK, ready = 1;
      why[0] = '\0';
      if (s->terminated) {
        st = EMBER_EABORTED;
        snprintf(why, sizeof why, "trainer terminated the feed");
      } else if (c->ring && !c->ring_ended) {
        ready = 0; /* the reader has not reached the ring's END marker yet */
      } else if (c->dup) {
        /* already delivered by an earlier connection; data discarded */
      } else if (c->outstanding > 0) {
        ready = 0;
      } else if (c->end_count != c->records) {
        st = EMBER_EPROTO;
        snprintf(why, sizeof why,
                 "partition %u: END_PARTITION says %llu records, the node received %llu",
                 c->partition, (unsigned long long)c->end_count,
                 (unsigned long long)c->records);
      } else if (acked_add(s, c->partition) != EMBER_OK) {
        st = EMBER_ENOMEM;
        snprintf(why, sizeof why, "out of memory recording partition %u", c->partition);
      } else {
        s->stats.partitions_acked++;
        c->acked_ok = 1;
      }
      if (ready) {
        if (queue_status_frame(c, EMBER_MSG_ACK, st, why) != EMBER_OK) {
          conn_kill(s, c);
          continue;
        }
        c->state = C_DONE;
      }
    }
    if (c->outq && conn_flush(s, c) != EMBER_OK) {
      conn_kill(s, c);
      continue;
    }
    if (c->shut_after_flush && c->outq == NULL) {
      shutdown(c->fd, SHUT_WR);
      c->shut_after_flush = 0;
      c->deadline = now + FEED_LINGER_MS;
    }
    if (c->deadline && now >= c->deadline) {
      if (c->state == C_AUTH || c->state == C_HELLO) s->stats.producers_rejected++;
      if (c->state == C_AUTH) {
        char why[96];
        snprintf(why, sizeof why, "handshake not completed within %lld ms",
                 (long long)s->pre_ms);
        note_rejected(s, c, why);
      }
      conn_kill(s, c);
    }
  }
  /* Reap: only here are connections freed, so pointers held across the
   * unlocked poll() stay valid. */
  while (*pp) {
    feed_conn *c = *pp;
    if (c->state != C_DEAD || (c->ring_thread_started && !c->ring_done)) {
      pp = &c->next; /* a ring reader still runs: it will wake the loop */
      continue;
    }
    if (c->ring_thread_started) {
      pthread_join(c->ring_thread, NULL); /* it has left s->mu for good */
      s->nrings--;
    }
    ember_shm_ring_destroy(c->ring);
    /* Its queued batches stay in the queue: a resumed attempt skips them. */
    if (c->helloed && !c->dup && !c->acked_ok && c->records > 0)
      held_add(s, c->partition, c->records);
    *pp = c->next;
    s->nconns--;
    if (c->outstanding)
      for (qnode *n = s->qhead; n; n = n->next)
        if (n->conn == c) n->conn = NULL;
    free(c);
  }
}

static void set_fatal(ember_feed_server *s, const char *what, int err) {
  if (s->fatal) return;
  s->fatal = EMBER_ESYS;
  snprintf(s->fatal_msg, sizeof s->fatal_msg, "feed server: %s: %s", what, strerror(err));
  pthread_cond_broadcast(&s->item_cond);
}

static void *feed_loop(void *arg) {
  ember_feed_server *s = arg;
  pthread_mutex_lock(&s->mu);
  while (!s->stopping) {
    size_t n = 0, need = s->nconns + 2;
    int64_t now = ember_now_ms(), next_deadline = INT64_MAX;
    int timeout, rc, err;
    if (need > s->pcap) {
      struct pollfd *pf = realloc(s->pfds, need * sizeof *pf);
      feed_conn **pc;
      if (pf) s->pfds = pf;
      pc = pf ? realloc(s->pconns, need * sizeof *pc) : NULL;
      if (pc == NULL) {
        set_fatal(s, "allocating the poll set", ENOMEM);
        break;
      }
      s->pconns = pc;
      s->pcap = need;
    }
    s->pfds[n++] = (struct pollfd){.fd = s->wake_fd, .events = POLLIN};
    /* Always accepting (new strangers evict old ones), except for a short
     * pause when out of descriptors. */
    s->pfds[n++] = (struct pollfd){.fd = now >= s->accept_paused_until ? s->listen_fd : -1,
                                   .events = POLLIN};
    if (s->accept_paused_until > now) next_deadline = s->accept_paused_until;
    if (ember__reject_due(&s->rejects) < next_deadline)
      next_deadline = ember__reject_due(&s->rejects);
    for (feed_conn *c = s->conns; c; c = c->next) {
      short ev = 0;
      if (c->state == C_DEAD) continue;
      if (conn_wants_read(s, c)) ev |= POLLIN;
      if (c->outq) ev |= POLLOUT;
      s->pconns[n] = c;
      s->pfds[n++] = (struct pollfd){.fd = c->fd, .events = ev};
      if (c->deadline && c->deadline < next_deadline) next_deadline = c->deadline;
    }
    if (next_deadline == INT64_MAX) timeout = -1;
    else if (next_deadline <= now) timeout = 0;
    else timeout = next_deadline - now > INT_MAX ? INT_MAX : (int)(next_deadline - now);
    pthread_mutex_unlock(&s->mu);
    rc = poll(s->pfds, (nfds_t)n, timeout);
    err = errno;
    pthread_mutex_lock(&s->mu);
    if (rc < 0 && err != EINTR) {
      set_fatal(s, "poll", err);
      break;
    }
    if (rc > 0) {
      if (s->pfds[0].revents) {
        uint64_t v;
        ssize_t r = read(s->wake_fd, &v, sizeof v);
        (void)r;
      }
      for (size_t i = 2; i < n; i++) {
        feed_conn *c = s->pconns[i];
        short re = s->pfds[i].revents;
        if (re == 0 || c->state == C_DEAD) continue;
        /* An error/hang-up on a connection we are not reading (paused by
         * back-pressure) would make poll return at once forever: the
         * producer is gone, drop it now. */
        if ((re & (POLLERR | POLLHUP)) && !conn_wants_read(s, c) && !c->outq) {
          conn_eof(s, c);
          continue;
        }
        if ((re & (POLLOUT | POLLERR | POLLHUP)) && c->outq && conn_flush(s, c) != EMBER_OK) {
          conn_kill(s, c);
          continue;
        }
        if (re & (POLLIN | POLLERR | POLLHUP)) conn_read(s, c);
      }
      if (s->pfds[1].revents & POLLIN) accept_new(s);
    }
    loop_progress(s);
    {
      char line[768];
      if (ember__reject_take(&s->rejects, ember_now_ms(), line, sizeof line) > 0)
        s->log_fn(s->log_arg, line);
    }
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static void free_queue(ember_feed_server *s) {
  qnode *n = s->qhead, *nx;
  for (; n; n = nx) {
    nx = n->next;
    if (n->conn) n->conn->outstanding--;
    free(n->item.data);
    free(n);
  }
  s->qhead = s->qtail = NULL;
  s->qbytes = 0;
}

void ember_feed_server_destroy(ember_feed_server *s) {
  feed_conn *c, *nx;
  if (s == NULL) return;
  if (s->thread_started) {
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    pthread_mutex_unlock(&s->mu);
    wake_loop(s);
    pthread_join(s->thread, NULL);
  }
  /* Ring readers may still run: kill under the lock (closing the rings
   * wakes them), then let them finish before anything is freed. */
  pthread_mutex_lock(&s->mu);
  s->stopping = 1;
  for (c = s->conns; c; c = c->next) conn_kill(s, c);
  pthread_cond_broadcast(&s->space_cond);
  pthread_mutex_unlock(&s->mu);
  for (c = s->conns; c; c = c->next)
    if (c->ring_thread_started) pthread_join(c->ring_thread, NULL);
  if (s->log_fn != NULL) { /* what the last interval counted, not to be lost */
    char line[768];
    if (ember__reject_flush(&s->rejects, ember_now_ms(), line, sizeof line) > 0)
      s->log_fn(s->log_arg, line);
  }
  for (c = s->conns; c; c = nx) {
    nx = c->next;
    ember_shm_ring_destroy(c->ring);
    free(c);
  }
  s->conns = NULL;
  for (qnode *n = s->qhead; n; n = n->next) n->conn = NULL;
  free_queue(s);
  ember_net_close(s->listen_fd);
  ember_net_close(s->wake_fd);
  pthread_cond_destroy(&s->item_cond);
  pthread_cond_destroy(&s->out_cond);
  pthread_cond_destroy(&s->space_cond);
  pthread_mutex_destroy(&s->mu);
  if (s->secret) memset(s->secret, 0, s->secret_len);
  free(s->secret);
  free(s->acked);
  free(s->held);
  free(s->pfds);
  free(s->pconns);
  free(s);
}

int ember_feed_server_create(ember_feed_server **out, const ember_feed_server_config *cfg) {
  ember_feed_server *s = NULL;
  pthread_condattr_t ca;
  int rc = EMBER_OK, fd = cfg ? cfg->listen_fd : -1, inited = 0;
  char host[64];

  if (out == NULL || cfg == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "feed server: NULL argument");
    goto cleanup;
  }
  *out = NULL;
  if (cfg->secret == NULL || cfg->secret_len < EMBER_SECRET_MIN_LEN) {
    rc = ember__set_error(EMBER_EINVAL, "feed server: secret must be at least %u bytes",
                          EMBER_SECRET_MIN_LEN);
    goto cleanup;
  }
  s = calloc(1, sizeof *s);
  if (s == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "feed server: out of memory");
    goto cleanup;
  }
  s->listen_fd = -1;
  s->wake_fd = -1;
  s->secret = malloc(cfg->secret_len);
  if (s->secret == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "feed server: out of memory");
    goto cleanup;
  }
  memcpy(s->secret, cfg->secret, cfg->secret_len);
  s->secret_len = cfg->secret_len;
  s->queue_limit = cfg->queue_bytes ? cfg->queue_bytes : FEED_DEFAULT_QUEUE;
  s->max_frame = cfg->max_frame ? cfg->max_frame : FEED_DEFAULT_MAX_FRAME;
  if (s->max_frame > EMBER_WIRE_ABSOLUTE_MAX) s->max_frame = EMBER_WIRE_ABSOLUTE_MAX;
  s->io_ms = cfg->io_timeout_ms ? cfg->io_timeout_ms : FEED_DEFAULT_IO_MS;
  /* Strangers get a short deadline, never longer than the I/O timeout. */
  s->pre_ms = ember__preauth_timeout_ms(cfg->preauth_timeout_ms);
  if (s->pre_ms > s->io_ms) s->pre_ms = s->io_ms;
  ember__raise_fd_limit();
  s->max_pending = ember__preauth_max_pending(cfg->max_pending);
  s->log_fn = cfg->log_fn ? cfg->log_fn : ember__log_stderr;
  s->log_arg = cfg->log_fn ? cfg->log_arg : NULL;
  s->shm_enabled = !cfg->disable_shm && feed_env_shm_enabled();
  feed_host_id(s->host_id);

  if (pthread_mutex_init(&s->mu, NULL) != 0) {
    rc = ember__set_error(EMBER_ESYS, "feed server: pthread_mutex_init failed");
    goto cleanup;
  }
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* deadlines use ember_now_ms() */
  pthread_cond_init(&s->item_cond, &ca);
  pthread_cond_init(&s->out_cond, &ca);
  pthread_cond_init(&s->space_cond, &ca);
  pthread_condattr_destroy(&ca);
  inited = 1;

  s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s->wake_fd < 0) {
    rc = ember__set_errno(EMBER_ESYS, errno, "feed server: eventfd");
    goto cleanup;
  }
  if (fd >= 0) {
    int fl;
    s->listen_fd = fd;
    fd = -1; /* owned by s now */
    /* A burst of strangers must not fill the accept queue: the kernel would
     * then drop real producers' SYNs for a second or more.  It caps the
     * backlog at net.core.somaxconn. */
    rc = ember_net_listen_fd(s->listen_fd, 4096);
    if (rc != EMBER_OK) goto cleanup;
    fl = fcntl(s->listen_fd, F_GETFL);
    if (fl < 0 || fcntl(s->listen_fd, F_SETFL, fl | O_NONBLOCK) < 0 ||
        fcntl(s->listen_fd, F_SETFD, FD_CLOEXEC) < 0) {
      rc = ember__set_errno(EMBER_ESYS, errno, "feed server: fcntl on the listen socket");
      goto cleanup;
    }
    ember_net_local_addr(s->listen_fd, host, sizeof host, &s->port);
  } else {
    rc = ember_net_bind(cfg->bind_host, cfg->port, 4096, 0, &s->listen_fd, &s->port);
    if (rc != EMBER_OK) goto cleanup;
  }
  ember__reject_log_init(&s->rejects, "feed server on :%u", (unsigned)s->port);
  if (pthread_create(&s->thread, NULL, feed_loop, s) != 0) {
    rc = ember__set_error(EMBER_ESYS, "feed server: cannot start its thread");
    goto cleanup;
  }
  s->thread_started = 1;
  *out = s;
  s = NULL;
cleanup:
  ember_net_close(fd); /* ownership of listen_fd was taken even on failure */
  if (s) {
    if (inited) {
      ember_feed_server_destroy(s);
    } else {
      ember_net_close(s->listen_fd);
      ember_net_close(s->wake_fd);
      free(s->secret);
      free(s);
    }
  }
  return rc;
}

uint16_t ember_feed_server_port(const ember_feed_server *s) { return s ? s->port : 0; }

int ember_feed_server_next(ember_feed_server *s, ember_feed_item **out, int64_t timeout_ms) {
  int64_t deadline = feed_deadline(timeout_ms);
  int rc = EMBER_OK, wake = 0;
  if (s == NULL || out == NULL) return ember__set_error(EMBER_EINVAL, "feed next: NULL argument");
  *out = NULL;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    qnode *n;
    if (s->fatal) {
      rc = ember__set_error(s->fatal, "%s", s->fatal_msg);
      break;
    }
    /* After END (or terminate: the consumer wants no more) every call gets
     * END at once. */
    if (s->end_returned || s->terminated) {
      n = calloc(1, sizeof *n);
      if (n == NULL) {
        rc = ember__set_error(EMBER_ENOMEM, "feed next: out of memory");
        break;
      }
      n->item.kind = EMBER_FEED_ITEM_END;
      *out = &n->item;
      break;
    }
    n = s->qhead;
    if (n) {
      int was_full = s->qbytes >= s->queue_limit;
      s->qhead = n->next;
      if (s->qhead == NULL) s->qtail = NULL;
      n->next = NULL;
      if (n->item.kind == EMBER_FEED_ITEM_END) {
        s->end_returned = 1;
        s->end_queued = 0;
      } else {
        feed_conn *c = n->conn;
        s->qbytes -= n->item.len;
        if (c && --c->outstanding == 0 && c->state == C_ENDING) wake = 1; /* ACK due */
        if (was_full && s->qbytes < s->queue_limit) {
          wake = 1; /* resume reading */
          pthread_cond_broadcast(&s->space_cond);
        }
      }
      n->conn = NULL;
      *out = &n->item;
      break;
    }
    if (s->stopping) {
      rc = ember__set_error(EMBER_ESTATE, "feed next: server is being destroyed");
      break;
    }
    if (cond_wait_until(&s->item_cond, &s->mu, deadline) == ETIMEDOUT) {
      rc = ember__set_error(EMBER_ETIMEDOUT, "feed next: no batch arrived within %lld ms",
                            (long long)timeout_ms);
      break;
    }
  }
  pthread_mutex_unlock(&s->mu);
  if (wake) wake_loop(s);
  return rc;
}

void ember_feed_item_free(ember_feed_item *item) {
  if (item == NULL) return;
  free(item->data);
  free(item); /* item is the first member of its qnode */
}

int ember_feed_server_send_results(ember_feed_server *s, uint64_t source, const uint8_t *batch,
                                   size_t len, int64_t timeout_ms) {
  int64_t deadline = feed_deadline(timeout_ms);
  out_req req;
  feed_conn *c;
  int rc = EMBER_OK;
  if (s == NULL || (batch == NULL && len > 0))
    return ember__set_error(EMBER_EINVAL, "feed send_results: NULL argument");
  if (len > EMBER_WIRE_ABSOLUTE_MAX)
    return ember__set_error(EMBER_ETOOBIG, "feed send_results: %zu bytes exceeds the %u limit",
                            len, EMBER_WIRE_ABSOLUTE_MAX);
  memset(&req, 0, sizeof req);
  ember_wire_encode_header(req.hdr, EMBER_MSG_RESULTS, (uint32_t)len);
  req.seg[0] = req.hdr;
  req.seglen[0] = EMBER_WIRE_HEADER_LEN;
  req.seg[1] = batch;
  req.seglen[1] = len;

  pthread_mutex_lock(&s->mu);
  for (c = s->conns; c; c = c->next)
    if (c->id == source) break;
  if (c == NULL || c->state == C_DEAD || c->state == C_LINGER || c->abort_req) {
    rc = ember__set_error(EMBER_ENOTFOUND, "feed send_results: producer %llu is gone",
                          (unsigned long long)source);
    goto cleanup;
  }
  if (!(c->flags & EMBER_FEED_WANT_RESULTS)) {
    rc = ember__set_error(EMBER_ESTATE,
                          "feed send_results: producer %llu (%s, partition %u) did not ask for "
                          "results",
                          (unsigned long long)source, c->peer, c->partition);
    goto cleanup;
  }
  outq_push(c, &req);
  /* Try at once (non-blocking, under the lock like every write); the loop
   * finishes what the socket does not take now. */
  if (conn_flush(s, c) != EMBER_OK) c->abort_req = 1;
  if (!req.done) wake_loop(s);
  while (!req.done) {
    if (cond_wait_until(&s->out_cond, &s->mu, deadline) == ETIMEDOUT && !req.done) {
      /* req not done => c is alive and req is still in its queue. */
      outq_unlink(c, &req);
      if (req.sent > 0) {
        /* Half a frame is on the wire; the stream cannot be resumed. */
        c->abort_req = 1;
        wake_loop(s);
        rc = ember__set_error(EMBER_ETIMEDOUT,
                              "feed send_results to %s (partition %u): timed out after %lld ms "
                              "mid-frame; connection closed",
                              c->peer, c->partition, (long long)timeout_ms);
      } else {
        rc = ember__set_error(EMBER_ETIMEDOUT,
                              "feed send_results to %s (partition %u): no socket space within "
                              "%lld ms",
                              c->peer, c->partition, (long long)timeout_ms);
      }
      goto cleanup;
    }
  }
  if (req.status != EMBER_OK)
    rc = ember__set_error(req.status, "feed send_results: producer %llu disconnected",
                          (unsigned long long)source);
cleanup:
  pthread_mutex_unlock(&s->mu);
  return rc;
}

int ember_feed_server_terminate(ember_feed_server *s) {
  if (s == NULL) return ember__set_error(EMBER_EINVAL, "feed terminate: NULL server");
  pthread_mutex_lock(&s->mu);
  if (!s->terminated) {
    s->terminated = 1;
    free_queue(s); /* also zeroes the connections' outstanding counts */
    s->end_queued = 0;
  }
  pthread_cond_broadcast(&s->item_cond);
  pthread_cond_broadcast(&s->space_cond); /* ring readers switch to discarding */
  pthread_mutex_unlock(&s->mu);
  wake_loop(s); /* pending END_PARTITIONs get EABORTED; reading resumes */
  return EMBER_OK;
}

/* Counters: batches/records/bytes_received count batches that were queued
 * for the consumer (duplicates and data after terminate are not counted);
 * producers_rejected counts connections refused for any reason (bad secret,
 * handshake timeout, protocol error, malformed batch). */
void ember_feed_server_stats(ember_feed_server *s, ember_feed_stats *out) {
  if (s == NULL || out == NULL) return;
  pthread_mutex_lock(&s->mu);
  *out = s->stats;
  pthread_mutex_unlock(&s->mu);
}

/* ======================================================================
 * 3. Client
 * ====================================================================== */

/* RESULTS frames the client accepts; results are trainer output, usually far
 * smaller than input, but bounded all the same. */
#define FEED_CLIENT_MAX_FRAME FEED_DEFAULT_MAX_FRAME
/* iovecs per writev: stays under IOV_MAX (1024). */
#define FEED_IOV_CHUNK 512

typedef struct pending_result {
  struct pending_result *next;
  uint8_t *data;
  size_t len;
} pending_result;

struct ember_feed_client {
  int fd;
  uint32_t partition, flags;
  uint64_t rows_sent;
  uint64_t resume_records; /* FEED_RESUME: records the node already holds */
  int resume_delivered;    /* FEED_RESUME: the partition was delivered whole */
  int broken; /* a send failed half-way or the server refused us */
  int ended;  /* END_PARTITION or END_FEED acknowledged */
  char peer[64];
  /* RESULTS that arrived while end_partition waited for the ACK; handed out
   * by recv_results first, in order. */
  pending_result *res_head, *res_tail;
  uint8_t *scratch; /* frame header + batch descriptors */
  size_t scratch_cap;
  struct iovec *iov;
  size_t iov_cap;
  /* shared memory: offered by the first send when shm_wanted */
  int shm_wanted;
  int shm_decided;
  size_t shm_bytes;
  ember_shm_ring *ring; /* non-NULL: batches go through it */
};

void ember_feed_client_destroy(ember_feed_client *c) {
  pending_result *p, *nx;
  if (c == NULL) return;
  /* The ring first: a server still reading it sees the producer close
   * (after any END already written), then the socket close. */
  ember_shm_ring_destroy(c->ring);
  ember_net_close(c->fd);
  for (p = c->res_head; p; p = nx) {
    nx = p->next;
    free(p->data);
    free(p);
  }
  free(c->scratch);
  free(c->iov);
  free(c);
}

int ember_feed_client_connect(ember_feed_client **out, const char *host, uint16_t port,
                              const uint8_t *secret, size_t secret_len, uint32_t partition,
                              uint32_t flags, int64_t timeout_ms) {
  return ember_feed_client_connect_ex(out, host, port, secret, secret_len, partition, flags,
                                      NULL, timeout_ms);
}

static int client_read_resume(ember_feed_client *c, int64_t deadline);

int ember_feed_client_connect_ex(ember_feed_client **out, const char *host, uint16_t port,
                                 const uint8_t *secret, size_t secret_len, uint32_t partition,
                                 uint32_t flags, const ember_feed_client_options *opts,
                                 int64_t timeout_ms) {
  int64_t deadline = feed_deadline(timeout_ms);
  ember_feed_client *c = NULL;
  uint8_t hello[8];
  int rc = EMBER_OK;
  if (out == NULL || host == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "feed connect: NULL argument");
    goto cleanup;
  }
  *out = NULL;
  if (flags & ~(EMBER_FEED_WANT_RESULTS | EMBER_FEED_RESUME)) {
    rc = ember__set_error(EMBER_EINVAL, "feed connect: unknown flags 0x%x", flags);
    goto cleanup;
  }
  if (opts != NULL && (opts->shm < EMBER_FEED_SHM_AUTO || opts->shm > EMBER_FEED_SHM_ON)) {
    rc = ember__set_error(EMBER_EINVAL, "feed connect: unknown shm mode %d", opts->shm);
    goto cleanup;
  }
  if (opts != NULL && opts->shm_bytes != 0 &&
      (opts->shm_bytes < EMBER_SHM_RING_MIN_BYTES || opts->shm_bytes > EMBER_SHM_RING_MAX_BYTES)) {
    rc = ember__set_error(EMBER_EINVAL, "feed connect: shm_bytes %zu is outside %u..%u",
                          opts->shm_bytes, EMBER_SHM_RING_MIN_BYTES, EMBER_SHM_RING_MAX_BYTES);
    goto cleanup;
  }
  c = calloc(1, sizeof *c);
  if (c == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "feed connect: out of memory");
    goto cleanup;
  }
  c->fd = -1;
  c->partition = partition;
  c->flags = flags;
  {
    int mode = opts ? opts->shm : EMBER_FEED_SHM_AUTO;
    c->shm_wanted = mode == EMBER_FEED_SHM_ON || (mode == EMBER_FEED_SHM_AUTO && feed_env_shm_enabled());
    c->shm_bytes = opts && opts->shm_bytes ? opts->shm_bytes : feed_env_ring_bytes();
  }
  rc = ember__connect_auth(host, port, secret, secret_len, deadline, &c->fd);
  if (rc != EMBER_OK) goto cleanup;
  (void)ember_net_tune(c->fd);
  ember_net_peer_name(c->fd, c->peer, sizeof c->peer);
  ember_wire_put_u32(hello, partition);
  ember_wire_put_u32(hello + 4, flags);
  rc = ember_net_send_frame(c->fd, EMBER_MSG_FEED_HELLO, hello, sizeof hello, deadline);
  if (rc != EMBER_OK) goto cleanup;
  if (flags & EMBER_FEED_RESUME) {
    rc = client_read_resume(c, deadline);
    if (rc != EMBER_OK) goto cleanup;
  }
  *out = c;
  c = NULL;
cleanup:
  ember_feed_client_destroy(c);
  return rc;
}

/* Turns an ACK/REFUSED payload (u32 status, str reason) into a status code
 * and the thread's error message. */
static int client_status(ember_feed_client *c, uint16_t type, const uint8_t *p, uint32_t len) {
  ember_wire_reader r;
  char reason[FEED_REASON_MAX + 1];
  int32_t st;
  ember_wire_reader_init(&r, p, len);
  st = (int32_t)ember_wire_read_u32(&r);
  ember_wire_read_str(&r, reason, sizeof reason);
  if (ember_wire_reader_finish(&r, 1, ember_wire_type_name(type)) != EMBER_OK) {
    c->broken = 1;
    return EMBER_EPROTO; /* reader set the message */
  }
  if (type == EMBER_MSG_REFUSED) c->broken = 1;
  if (st == EMBER_OK && type == EMBER_MSG_ACK) return EMBER_OK;
  if (st >= 0 || !known_status(st)) st = EMBER_EPROTO;
  return ember__set_error(st, "feed server %s (partition %u) %s: %s", c->peer, c->partition,
                          type == EMBER_MSG_REFUSED ? "refused the producer" : "answered",
                          reason[0] ? reason : ember_strerror(st));
}

static int client_usable(ember_feed_client *c, const char *what) {
  if (c == NULL) return ember__set_error(EMBER_EINVAL, "feed %s: NULL client", what);
  if (c->broken)
    return ember__set_error(EMBER_ESTATE,
                            "feed %s: the connection to %s is unusable after an earlier error",
                            what, c->peer);
  return EMBER_OK;
}

/* Receives the next frame; RESULTS are returned to the caller as-is. */
static int client_recv(ember_feed_client *c, ember_frame_header *fh, uint8_t **payload,
                       int64_t deadline, const char *what) {
  int rc = ember_net_recv_frame(c->fd, FEED_CLIENT_MAX_FRAME, fh, payload, deadline);
  if (rc != EMBER_OK && rc != EMBER_ETIMEDOUT) c->broken = 1;
  if (rc == EMBER_ECLOSED)
    rc = ember__set_error(EMBER_ECLOSED, "feed %s: node %s closed the connection (partition %u)",
                          what, c->peer, c->partition);
  return rc;
}

/* The answer to a resuming FEED_HELLO: FEED_RESUME, or REFUSED. */
static int client_read_resume(ember_feed_client *c, int64_t deadline) {
  ember_frame_header fh;
  uint8_t *payload = NULL;
  int rc = client_recv(c, &fh, &payload, deadline, "connect");
  if (rc != EMBER_OK) goto done;
  if (fh.type == EMBER_MSG_REFUSED) {
    rc = client_status(c, fh.type, payload, fh.length);
  } else if (fh.type != EMBER_MSG_FEED_RESUME || fh.length != 12) {
    c->broken = 1;
    rc = ember__set_error(EMBER_EPROTO, "feed connect: node %s answered a resuming FEED_HELLO "
                          "with %s (%u bytes), expected FEED_RESUME (12 bytes)", c->peer,
                          ember_wire_type_name(fh.type), fh.length);
  } else {
    c->resume_delivered = ember_wire_get_u32(payload) != 0;
    c->resume_records = ember_wire_get_u64(payload + 4);
  }
done:
  free(payload);
  return rc;
}

void ember_feed_client_resume_point(const ember_feed_client *c, uint64_t *records,
                                    int *delivered) {
  if (records) *records = c ? c->resume_records : 0;
  if (delivered) *delivered = c ? c->resume_delivered : 0;
}

/* Keeps a RESULTS payload that arrived while we waited for something else,
 * for recv_results (takes payload over). */
static int client_keep_result(ember_feed_client *c, uint8_t *payload, size_t len,
                              const char *what) {
  pending_result *pr = calloc(1, sizeof *pr);
  if (pr != NULL) pr->data = payload ? payload : malloc(1);
  if (pr == NULL || pr->data == NULL) {
    free(payload);
    free(pr);
    c->broken = 1;
    return ember__set_error(EMBER_ENOMEM, "feed %s: out of memory", what);
  }
  pr->len = len;
  if (c->res_tail) c->res_tail->next = pr;
  else c->res_head = pr;
  c->res_tail = pr;
  return EMBER_OK;
}

/* Milliseconds left until deadline, for calls that take a timeout. */
static int64_t ms_left(int64_t deadline) {
  int64_t left;
  if (deadline == INT64_MAX) return -1;
  left = deadline - ember_now_ms();
  return left > 0 ? left : 0;
}

/* How long a producer whose ring was closed waits for the node's reason. */
#define FEED_REASON_WAIT_MS 2000

/* A ring operation failed.  When the node closed the ring, the reason (a
 * REFUSED frame, or the connection's end) is on the socket: report that. */
static int client_ring_failed(ember_feed_client *c, int rc, int64_t deadline, const char *what) {
  char ringmsg[512];
  int64_t d = ember_deadline_after(FEED_REASON_WAIT_MS);
  c->broken = 1;
  snprintf(ringmsg, sizeof ringmsg, "%s", ember_last_error());
  if (rc != EMBER_ECLOSED)
    return ember__set_error(rc, "feed %s to %s (partition %u): %s", what, c->peer, c->partition,
                            ringmsg);
  if (d > deadline) d = deadline;
  for (;;) {
    ember_frame_header fh;
    uint8_t *payload = NULL;
    int r = ember_net_recv_frame(c->fd, FEED_CLIENT_MAX_FRAME, &fh, &payload, d);
    if (r == EMBER_ECLOSED)
      return ember__set_error(EMBER_ECLOSED, "feed %s: node %s closed the connection "
                              "(partition %u; %s)", what, c->peer, c->partition, ringmsg);
    if (r != EMBER_OK) break; /* no word from the node: the ring's reason stands */
    if (fh.type == EMBER_MSG_REFUSED) {
      r = client_status(c, fh.type, payload, fh.length);
      free(payload);
      return r;
    }
    if (fh.type == EMBER_MSG_RESULTS && (c->flags & EMBER_FEED_WANT_RESULTS)) {
      if (client_keep_result(c, payload, fh.length, what) != EMBER_OK) return EMBER_ENOMEM;
      continue;
    }
    free(payload);
  }
  return ember__set_error(EMBER_ECLOSED, "feed %s to %s (partition %u): %s", what, c->peer,
                          c->partition, ringmsg);
}

/* Before sending more, looks (without blocking) for a REFUSED the server
 * sent because of an earlier batch, so the producer stops early with the
 * server's reason instead of streaming into a closing connection.  RESULTS
 * frames are left for recv_results. */
static int client_check_refused(ember_feed_client *c, int64_t deadline) {
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
  struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
  ember_frame_header fh;
  uint8_t *payload = NULL;
  ssize_t n;
  int rc = EMBER_OK;
  if (poll(&pfd, 1, 0) <= 0) goto cleanup;
  n = recv(c->fd, hdr, sizeof hdr, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) {
    c->broken = 1;
    rc = ember__set_error(EMBER_ECLOSED, "feed send to %s (partition %u): server closed the "
                          "connection", c->peer, c->partition);
    goto cleanup;
  }
  if (n < (ssize_t)sizeof hdr) goto cleanup; /* nothing whole yet, or an error send will see */
  /* Judge only the type here (a big RESULTS header is fine); a bad header is
   * left for recv_results or end_partition to report. */
  if (ember_wire_get_u32(hdr) != EMBER_WIRE_MAGIC) goto cleanup;
  fh.type = (uint16_t)(hdr[6] | hdr[7] << 8);
  if (fh.type != EMBER_MSG_REFUSED && fh.type != EMBER_MSG_ACK) goto cleanup;
  rc = ember_net_recv_frame(c->fd, FEED_CTL_MAX, &fh, &payload, deadline);
  if (rc != EMBER_OK) {
    c->broken = 1;
    goto cleanup;
  }
  rc = client_status(c, fh.type, payload, fh.length);
  if (rc == EMBER_OK) {
    /* An ACK nobody asked for is a protocol error too. */
    c->broken = 1;
    rc = ember__set_error(EMBER_EPROTO, "feed: unexpected ACK from %s", c->peer);
  }
cleanup:
  free(payload);
  return rc;
}

/* The first send offers a ring (feed.h).  EMBER_OK whether or not the node
 * took it (c->ring says); an error only if the connection failed. */
static int client_offer_shm(ember_feed_client *c, int64_t deadline) {
  uint8_t req[FEED_SHM_REQ_LEN];
  ember_shm_ring *ring = NULL;
  ember_shm_ring_desc d;
  int rc = EMBER_OK;
  c->shm_decided = 1;
  if (!c->shm_wanted) goto cleanup;
  if (ember_shm_ring_create(&ring, c->shm_bytes, EMBER_SHM_PRODUCER) != EMBER_OK)
    goto cleanup; /* no memfd here: TCP */
  ember_shm_ring_describe(ring, &d);
  feed_host_id(req);
  ember_wire_put_u32(req + 16, (uint32_t)d.pid);
  ember_wire_put_u32(req + 20, (uint32_t)d.fd);
  ember_wire_put_u64(req + 24, d.size);
  memcpy(req + 32, d.token, 32);
  rc = ember_net_send_frame(c->fd, EMBER_MSG_FEED_SHM, req, sizeof req, deadline);
  if (rc != EMBER_OK) {
    c->broken = 1;
    goto cleanup;
  }
  for (;;) {
    ember_frame_header fh;
    uint8_t *payload = NULL;
    rc = client_recv(c, &fh, &payload, deadline, "send");
    if (rc != EMBER_OK) {
      c->broken = 1; /* a late reply would be misread */
      goto cleanup;
    }
    if (fh.type == EMBER_MSG_FEED_SHM_REPLY) {
      ember_wire_reader r;
      char reason[FEED_REASON_MAX + 1];
      uint32_t st;
      ember_wire_reader_init(&r, payload, fh.length);
      st = ember_wire_read_u32(&r);
      ember_wire_read_str(&r, reason, sizeof reason);
      rc = ember_wire_reader_finish(&r, 1, "FEED_SHM_REPLY");
      free(payload);
      if (rc != EMBER_OK) {
        c->broken = 1;
        goto cleanup;
      }
      if (st == 0) { /* attached: the ring is ours to write */
        c->ring = ring;
        ring = NULL;
      }
      goto cleanup; /* declined (reason says why): TCP */
    }
    if (fh.type == EMBER_MSG_REFUSED) {
      rc = client_status(c, fh.type, payload, fh.length);
      free(payload);
      goto cleanup;
    }
    free(payload);
    c->broken = 1;
    rc = ember__set_error(EMBER_EPROTO, "feed send: expected FEED_SHM_REPLY from %s, got %s",
                          c->peer, ember_wire_type_name(fh.type));
    goto cleanup;
  }
cleanup:
  ember_shm_ring_destroy(ring);
  return rc;
}

int ember_feed_client_uses_shm(const ember_feed_client *c) { return c != NULL && c->ring != NULL; }

int ember_feed_client_send(ember_feed_client *c, const ember_column *cols, uint32_t ncols,
                           uint32_t nrows, int64_t timeout_ms) {
  int64_t deadline = feed_deadline(timeout_ms);
  static const uint8_t zeros[8] = {0};
  size_t desc_end = 0, total = 0, hlen, pos, niov = 0;
  int rc = client_usable(c, "send");
  if (rc != EMBER_OK) goto cleanup;
  if (c->ended) {
    rc = ember__set_error(EMBER_ESTATE, "feed send: partition %u already ended", c->partition);
    goto cleanup;
  }
  rc = client_check_refused(c, deadline);
  if (rc != EMBER_OK) goto cleanup;
  rc = batch_layout(cols, ncols, nrows, &desc_end, &total);
  if (rc != EMBER_OK) goto cleanup;
  if (total > EMBER_WIRE_ABSOLUTE_MAX) {
    rc = ember__set_error(EMBER_ETOOBIG, "feed send: batch of %zu bytes exceeds the %u-byte "
                          "frame limit", total, EMBER_WIRE_ABSOLUTE_MAX);
    goto cleanup;
  }
  if (!c->shm_decided) {
    rc = client_offer_shm(c, deadline);
    if (rc != EMBER_OK) goto cleanup;
  }
  if (c->ring && total + EMBER_SHM_RING_RECORD_HDR <= ember_shm_ring_capacity(c->ring) / 2) {
    /* Encoded straight into ring memory: the only copy of the columns. */
    void *w = NULL;
    rc = ember_shm_ring_reserve(c->ring, total, &w, ms_left(deadline));
    if (rc == EMBER_OK) {
      encode_checked(cols, ncols, nrows, desc_end, w);
      rc = ember_shm_ring_commit(c->ring, total);
    }
    if (rc != EMBER_OK) {
      rc = client_ring_failed(c, rc, deadline, "send");
      goto cleanup;
    }
    c->rows_sent += nrows;
    goto cleanup;
  }
  /* Frame header, batch header, descriptors and the padding after them go
   * in one small buffer; column bodies are sent from the caller's memory. */
  hlen = EMBER_WIRE_HEADER_LEN + ((desc_end + 7u) & ~(size_t)7u);
  if (hlen > c->scratch_cap) {
    uint8_t *nb = realloc(c->scratch, hlen);
    if (nb == NULL) {
      rc = ember__set_error(EMBER_ENOMEM, "feed send: out of memory");
      goto cleanup;
    }
    c->scratch = nb;
    c->scratch_cap = hlen;
  }
  if ((size_t)ncols * 3u + 1u > c->iov_cap) {
    struct iovec *ni = realloc(c->iov, ((size_t)ncols * 3u + 1u) * sizeof *ni);
    if (ni == NULL) {
      rc = ember__set_error(EMBER_ENOMEM, "feed send: out of memory");
      goto cleanup;
    }
    c->iov = ni;
    c->iov_cap = (size_t)ncols * 3u + 1u;
  }
  ember_wire_encode_header(c->scratch, EMBER_MSG_BATCH, (uint32_t)total);
  write_descriptors(cols, ncols, nrows, c->scratch + EMBER_WIRE_HEADER_LEN);
  memset(c->scratch + EMBER_WIRE_HEADER_LEN + desc_end, 0,
         hlen - EMBER_WIRE_HEADER_LEN - desc_end);
  c->iov[niov++] = (struct iovec){c->scratch, hlen};
  pos = hlen - EMBER_WIRE_HEADER_LEN;
  for (uint32_t i = 0; i < ncols; i++) {
    const ember_column *col = &cols[i];
    size_t pad = ((pos + 7u) & ~(size_t)7u) - pos;
    if (pad) c->iov[niov++] = (struct iovec){(void *)(uintptr_t)zeros, pad};
    pos += pad;
    if (col->dtype == EMBER_DT_BYTES) {
      size_t olen = ((size_t)nrows + 1u) * 8u; /* offsets are little-endian in memory */
      c->iov[niov++] = (struct iovec){(void *)(uintptr_t)col->offsets, olen};
      pos += olen;
    }
    if (col->data_len) {
      c->iov[niov++] = (struct iovec){(void *)(uintptr_t)col->data, (size_t)col->data_len};
      pos += (size_t)col->data_len;
    }
  }
  if (c->ring) {
    /* Over half the ring: gathered from the columns into a split message
     * (the frame header stays out: the ring has its own framing). */
    c->iov[0].iov_base = c->scratch + EMBER_WIRE_HEADER_LEN;
    c->iov[0].iov_len = hlen - EMBER_WIRE_HEADER_LEN;
    rc = ember_shm_ring_sendv(c->ring, c->iov, (int)niov, ms_left(deadline));
    if (rc != EMBER_OK) {
      rc = client_ring_failed(c, rc, deadline, "send");
      goto cleanup;
    }
    c->rows_sent += nrows;
    goto cleanup;
  }
  for (size_t at = 0; at < niov; at += FEED_IOV_CHUNK) {
    size_t cnt = niov - at < FEED_IOV_CHUNK ? niov - at : FEED_IOV_CHUNK;
    rc = ember_net_sendv_all(c->fd, c->iov + at, (int)cnt, deadline);
    if (rc != EMBER_OK) {
      /* Part of a frame may be out: the stream cannot be resumed. */
      c->broken = 1;
      goto cleanup;
    }
  }
  c->rows_sent += nrows;
cleanup:
  return rc;
}

int ember_feed_client_recv_results(ember_feed_client *c, uint8_t **batch, size_t *len,
                                   int64_t timeout_ms) {
  int64_t deadline = feed_deadline(timeout_ms);
  ember_frame_header fh;
  uint8_t *payload = NULL;
  int rc = EMBER_OK;
  if (c == NULL || batch == NULL || len == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "feed recv_results: NULL argument");
    goto cleanup;
  }
  *batch = NULL;
  *len = 0;
  if (c->res_head) { /* buffered during end_partition; hand out even if broken */
    pending_result *p = c->res_head;
    c->res_head = p->next;
    if (c->res_head == NULL) c->res_tail = NULL;
    *batch = p->data;
    *len = p->len;
    free(p);
    goto cleanup;
  }
  rc = client_usable(c, "recv_results");
  if (rc != EMBER_OK) goto cleanup;
  if (!(c->flags & EMBER_FEED_WANT_RESULTS)) {
    rc = ember__set_error(EMBER_ESTATE, "feed recv_results: partition %u did not ask for results",
                          c->partition);
    goto cleanup;
  }
  rc = client_recv(c, &fh, &payload, deadline, "recv_results");
  if (rc != EMBER_OK) goto cleanup;
  if (fh.type == EMBER_MSG_RESULTS) {
    /* malloc(0) may be NULL: give the caller a real (empty) buffer. */
    *batch = payload ? payload : malloc(1);
    *len = fh.length;
    payload = NULL;
    if (*batch == NULL) rc = ember__set_error(EMBER_ENOMEM, "feed recv_results: out of memory");
    goto cleanup;
  }
  if (fh.type == EMBER_MSG_REFUSED) {
    rc = client_status(c, fh.type, payload, fh.length);
    goto cleanup;
  }
  c->broken = 1;
  rc = ember__set_error(EMBER_EPROTO, "feed recv_results: expected RESULTS from %s, got %s",
                        c->peer, ember_wire_type_name(fh.type));
cleanup:
  free(payload);
  return rc;
}

/* Sends a control frame and waits for its ACK; RESULTS arriving meanwhile
 * are kept for recv_results when the producer asked for them. */
static int client_request(ember_feed_client *c, uint16_t type, const uint8_t *p, uint32_t len,
                          int64_t timeout_ms, const char *what) {
  int64_t deadline = feed_deadline(timeout_ms);
  int rc = ember_net_send_frame(c->fd, type, p, len, deadline);
  if (rc != EMBER_OK) {
    c->broken = 1;
    goto cleanup;
  }
  for (;;) {
    ember_frame_header fh;
    uint8_t *payload = NULL;
    rc = client_recv(c, &fh, &payload, deadline, what);
    if (rc != EMBER_OK) {
      if (rc == EMBER_ETIMEDOUT) c->broken = 1; /* an ACK may still come: stream is ambiguous */
      goto cleanup;
    }
    if (fh.type == EMBER_MSG_RESULTS && (c->flags & EMBER_FEED_WANT_RESULTS)) {
      rc = client_keep_result(c, payload, fh.length, what);
      if (rc != EMBER_OK) goto cleanup;
      continue;
    }
    if (fh.type == EMBER_MSG_ACK || fh.type == EMBER_MSG_REFUSED) {
      rc = client_status(c, fh.type, payload, fh.length);
      free(payload);
      goto cleanup;
    }
    free(payload);
    c->broken = 1;
    rc = ember__set_error(EMBER_EPROTO, "feed %s: expected ACK from %s, got %s", what, c->peer,
                          ember_wire_type_name(fh.type));
    goto cleanup;
  }
cleanup:
  return rc;
}

int ember_feed_client_end_partition(ember_feed_client *c, int64_t timeout_ms) {
  uint8_t cnt[8];
  int rc = client_usable(c, "end_partition");
  if (rc != EMBER_OK) goto cleanup;
  if (c->ended) {
    rc = ember__set_error(EMBER_ESTATE, "feed end_partition: partition %u already ended",
                          c->partition);
    goto cleanup;
  }
  ember_wire_put_u64(cnt, c->rows_sent);
  if (c->ring) {
    /* The END marker goes after the last batch in the ring; the node ACKs
     * only once its reader has reached it. */
    int64_t deadline = feed_deadline(timeout_ms);
    rc = ember_shm_ring_end(c->ring, timeout_ms);
    if (rc != EMBER_OK) {
      rc = client_ring_failed(c, rc, deadline, "end_partition");
      goto cleanup;
    }
    timeout_ms = ms_left(deadline);
  }
  rc = client_request(c, EMBER_MSG_END_PARTITION, cnt, sizeof cnt, timeout_ms, "end_partition");
  /* Any answer ends the partition on this connection. */
  if (rc == EMBER_OK || !c->broken) c->ended = 1;
cleanup:
  return rc;
}

int ember_feed_client_end_feed(ember_feed_client *c, int64_t timeout_ms) {
  int rc = client_usable(c, "end_feed");
  if (rc != EMBER_OK) goto cleanup;
  if (c->ended) {
    rc = ember__set_error(EMBER_ESTATE, "feed end_feed: this connection already ended");
    goto cleanup;
  }
  if (c->ring) {
    int64_t deadline = feed_deadline(timeout_ms);
    rc = ember_shm_ring_end(c->ring, timeout_ms);
    if (rc != EMBER_OK) {
      rc = client_ring_failed(c, rc, deadline, "end_feed");
      goto cleanup;
    }
    timeout_ms = ms_left(deadline);
  }
  rc = client_request(c, EMBER_MSG_END_FEED, NULL, 0, timeout_ms, "end_feed");
  if (rc == EMBER_OK || !c->broken) c->ended = 1;
cleanup:
  return rc;
}

int ember_feed_client_fail(ember_feed_client *c, const char *reason, int64_t timeout_ms) {
  int64_t deadline = feed_deadline(timeout_ms);
  int rc = client_usable(c, "fail");
  if (rc != EMBER_OK) goto cleanup;
  if (c->ended) {
    rc = ember__set_error(EMBER_ESTATE, "feed fail: partition %u already ended", c->partition);
    goto cleanup;
  }
  if (reason == NULL) reason = "";
  if (c->ring) {
    rc = ember_shm_ring_fail(c->ring, EMBER_EIO, reason, timeout_ms);
    if (rc != EMBER_OK) {
      rc = client_ring_failed(c, rc, deadline, "fail");
    } else {
      /* Wait (up to the deadline) until the node has read the marker and
       * dropped the connection: closing at once would tear the ring down
       * before its reader reaches the marker, and the reason would be lost. */
      for (;;) {
        ember_frame_header fh;
        uint8_t *payload = NULL;
        int r = ember_net_recv_frame(c->fd, FEED_CLIENT_MAX_FRAME, &fh, &payload, deadline);
        free(payload);
        if (r != EMBER_OK) break;
      }
    }
  } else {
    ember_wire_writer w;
    char cut[FEED_REASON_MAX + 1];
    snprintf(cut, sizeof cut, "%s", reason);
    ember_wire_writer_init(&w);
    ember_wire_write_str(&w, cut);
    rc = w.err ? ember__set_error(w.err, "feed fail: out of memory")
               : ember_net_send_frame(c->fd, EMBER_MSG_FEED_ERROR, w.buf, (uint32_t)w.len,
                                      deadline);
    ember_wire_writer_free(&w);
  }
  /* Either way this connection is over: the node drops it. */
  c->broken = 1;
  c->ended = 1;
cleanup:
  return rc;
}
