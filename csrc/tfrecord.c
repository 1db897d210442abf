/* tfrecord.c - TFRecord reader and writer (see ember/tfrecord.h).
 *
 * Reader layering: a raw source (fd, memory, or ember_read_fn) -> optional
 * zlib inflate -> one window buffer [start, end) of stream bytes -> framing.
 * Framing asks fill() for "at least n bytes from start"; fill grows the
 * window to the largest record seen (bounded by max_record, which is checked
 * before any allocation) and slides the unread tail to the front when the
 * free space runs out, so the steady state is one read() into the window and
 * one CRC pass per record, with no other copy.  An uncompressed memory
 * source is the window itself (zero copy). */
#include "ember/tfrecord.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "ember/crc32c.h"
#include "ember/error.h"

#define DEFAULT_CHUNK (1u << 20)
#define MIN_CHUNK 4096u
#define MAX_CHUNK (64u << 20)
#define NAME_MAX_LEN 1024u
#define MSG_CAP 1024u

static inline uint64_t get_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
static inline uint32_t get_le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void put_le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

void ember_tfr_encode_header(uint8_t out[EMBER_TFR_HEADER_LEN], uint64_t len) {
  put_le64(out, len);
  put_le32(out + 8, ember_crc32c_masked(out, 8));
}

void ember_tfr_encode_footer(uint8_t out[EMBER_TFR_FOOTER_LEN], const void *data,
                             size_t len) {
  put_le32(out, ember_crc32c_masked(data, len));
}

static char *dup_name(const char *name, const char *fallback) {
  const char *s = name != NULL ? name : fallback;
  size_t n = strnlen(s, NAME_MAX_LEN);
  char *d = malloc(n + 1);
  if (d != NULL) {
    memcpy(d, s, n);
    d[n] = '\0';
  }
  return d;
}

static int check_compression(int c) {
  if (c == EMBER_TFR_PLAIN || c == EMBER_TFR_GZIP || c == EMBER_TFR_ZLIB) return EMBER_OK;
  return ember__set_error(EMBER_EINVAL, "unknown TFRecord compression %d (0 plain, 1 gzip, 2 zlib)", c);
}

/* zlib windowBits: +16 selects the gzip wrapper. */
static int window_bits(int compression) { return compression == EMBER_TFR_GZIP ? 15 + 16 : 15; }

/* ================================================================ reader */

enum { SRC_FD = 1, SRC_MEM = 2, SRC_FN = 3 };

struct ember_tfr_reader {
  char *name;
  int src;
  int fd, own_fd;
  const uint8_t *mem;
  size_t mem_len, mem_pos;
  ember_read_fn fn;
  void *opaque;
  void (*release)(void *); /* owned opaque: freed at destroy */

  int compression;
  uint32_t flags;
  uint64_t max_record;
  size_t chunk;

  z_stream z;
  int z_inited;
  uint8_t *zin;       /* compressed input staging (not for memory sources) */
  uint64_t raw_read;  /* compressed bytes read from the source */
  int z_pending;      /* a zlib error met after producing output: reported
                         by the next call, so that the bytes before it are
                         delivered whatever the input chunking */
  char z_msg[MSG_CAP];

  int src_eof;        /* the (decompressed) stream has no more bytes */
  uint8_t *buf;       /* the window; == mem (not owned) when zero-copy */
  int own_buf;
  size_t cap, start, end;
  uint64_t base;      /* stream offset of buf[start] */

  uint64_t last_offset;
  ember_tfr_stats stats;
  int err;            /* sticky failure, with its message */
  char msg[MSG_CAP];
};

/* Records a sticky failure: code and the thread's current message. */
static int fail(ember_tfr_reader *r, int code) {
  r->err = code;
  snprintf(r->msg, sizeof r->msg, "%s", ember_last_error());
  return code;
}

static const char *stream_note(const ember_tfr_reader *r) {
  return r->compression == EMBER_TFR_PLAIN ? "" : " (of the decompressed stream)";
}

static int reader_new(ember_tfr_reader **out, const char *name, const char *fallback,
                      const ember_tfr_options *opt) {
  *out = NULL;
  ember_tfr_options d = {0, 0, 0, 0};
  if (opt == NULL) opt = &d;
  int rc = check_compression(opt->compression);
  if (rc != EMBER_OK) return rc;
  if (opt->flags & ~(uint32_t)(EMBER_TFR_NO_CRC | EMBER_TFR_SKIP_CORRUPT))
    return ember__set_error(EMBER_EINVAL, "unknown TFRecord reader flags 0x%x",
                            (unsigned)opt->flags);
  if (opt->max_record > EMBER_TFR_ABSOLUTE_MAX_RECORD)
    return ember__set_error(EMBER_EINVAL, "max_record %llu exceeds the limit %llu",
                            (unsigned long long)opt->max_record,
                            (unsigned long long)EMBER_TFR_ABSOLUTE_MAX_RECORD);
  ember_tfr_reader *r = calloc(1, sizeof *r);
  if (r == NULL) return ember__set_error(EMBER_ENOMEM, "out of memory creating a TFRecord reader");
  r->name = dup_name(name, fallback);
  if (r->name == NULL) {
    free(r);
    return ember__set_error(EMBER_ENOMEM, "out of memory creating a TFRecord reader");
  }
  r->fd = -1;
  r->compression = opt->compression;
  r->flags = opt->flags;
  r->max_record = opt->max_record ? opt->max_record : EMBER_TFR_DEFAULT_MAX_RECORD;
  r->chunk = opt->chunk ? opt->chunk : DEFAULT_CHUNK;
  if (r->chunk < MIN_CHUNK) r->chunk = MIN_CHUNK;
  if (r->chunk > MAX_CHUNK) r->chunk = MAX_CHUNK;
  *out = r;
  return EMBER_OK;
}

/* Allocates the window (and the inflate state) for a non-zero-copy reader. */
static int reader_buffers(ember_tfr_reader *r) {
  r->cap = r->chunk;
  r->buf = malloc(r->cap);
  r->own_buf = 1;
  if (r->buf == NULL) return ember__set_error(EMBER_ENOMEM, "out of memory for a %zu-byte read buffer", r->cap);
  if (r->compression != EMBER_TFR_PLAIN) {
    if (r->src != SRC_MEM) {
      r->zin = malloc(r->chunk);
      if (r->zin == NULL) return ember__set_error(EMBER_ENOMEM, "out of memory for a read buffer");
    }
    memset(&r->z, 0, sizeof r->z);
    if (inflateInit2(&r->z, window_bits(r->compression)) != Z_OK)
      return ember__set_error(EMBER_ENOMEM, "%s: zlib inflateInit2 failed", r->name);
    r->z_inited = 1;
    if (r->src == SRC_MEM) {
      /* zlib's avail_in is a uInt: large buffers are fed in slices. */
      r->z.next_in = (Bytef *)r->mem;
      r->z.avail_in = 0;
    }
  }
  return EMBER_OK;
}

static int reader_finish_open(ember_tfr_reader **out, ember_tfr_reader *r) {
  int rc = reader_buffers(r);
  if (rc != EMBER_OK) {
    ember_tfr_reader_destroy(r);
    *out = NULL;
    return rc;
  }
  *out = r;
  return EMBER_OK;
}

int ember_tfr_reader_open_fd(ember_tfr_reader **out, int fd, const char *name,
                             const ember_tfr_options *opt) {
  if (out == NULL || fd < 0) return ember__set_error(EMBER_EINVAL, "TFRecord reader: bad fd %d", fd);
  ember_tfr_reader *r;
  char fb[32];
  snprintf(fb, sizeof fb, "fd %d", fd);
  int rc = reader_new(&r, name, fb, opt);
  if (rc != EMBER_OK) return rc;
  r->src = SRC_FD;
  r->fd = fd;
  return reader_finish_open(out, r);
}

int ember_tfr_reader_open_path(ember_tfr_reader **out, const char *path,
                               const ember_tfr_options *opt) {
  if (out == NULL || path == NULL) return ember__set_error(EMBER_EINVAL, "TFRecord reader: NULL path");
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ember__set_errno(errno == ENOENT ? EMBER_ENOTFOUND : EMBER_EIO, errno, "open %s", path);
#ifdef POSIX_FADV_SEQUENTIAL
  (void)posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
  ember_tfr_reader *r;
  int rc = reader_new(&r, path, path, opt);
  if (rc != EMBER_OK) {
    close(fd);
    return rc;
  }
  r->src = SRC_FD;
  r->fd = fd;
  r->own_fd = 1;
  return reader_finish_open(out, r);
}

int ember_tfr_reader_open_mem(ember_tfr_reader **out, const void *buf, size_t len,
                              const char *name, const ember_tfr_options *opt) {
  if (out == NULL || (buf == NULL && len > 0))
    return ember__set_error(EMBER_EINVAL, "TFRecord reader: NULL buffer");
  ember_tfr_reader *r;
  int rc = reader_new(&r, name, "<memory>", opt);
  if (rc != EMBER_OK) return rc;
  r->src = SRC_MEM;
  r->mem = buf;
  r->mem_len = len;
  if (r->compression == EMBER_TFR_PLAIN) {
    static const uint8_t empty[1] = {0};
    r->buf = (uint8_t *)(len ? buf : empty); /* never written through */
    r->cap = r->end = len;
    r->src_eof = 1;
    *out = r;
    return EMBER_OK;
  }
  return reader_finish_open(out, r);
}

int ember_tfr_reader_open_fn(ember_tfr_reader **out, ember_read_fn fn, void *opaque,
                             const char *name, const ember_tfr_options *opt) {
  if (out == NULL || fn == NULL) return ember__set_error(EMBER_EINVAL, "TFRecord reader: NULL read function");
  ember_tfr_reader *r;
  int rc = reader_new(&r, name, "<stream>", opt);
  if (rc != EMBER_OK) return rc;
  r->src = SRC_FN;
  r->fn = fn;
  r->opaque = opaque;
  return reader_finish_open(out, r);
}

int ember_tfr_reader_open_owned(ember_tfr_reader **out, ember_read_fn fn, void *opaque,
                                void (*release)(void *), const char *name,
                                const ember_tfr_options *opt) {
  if (out == NULL || fn == NULL) {
    if (release) release(opaque);
    return ember__set_error(EMBER_EINVAL, "TFRecord reader: NULL read function");
  }
  ember_tfr_reader *r;
  int rc = reader_new(&r, name, "<stream>", opt);
  if (rc != EMBER_OK) {
    if (release) release(opaque);
    return rc;
  }
  r->src = SRC_FN;
  r->fn = fn;
  r->opaque = opaque;
  r->release = release; /* from here on, destroy (also in finish_open) releases */
  return reader_finish_open(out, r);
}

void ember_tfr_reader_destroy(ember_tfr_reader *r) {
  if (r == NULL) return;
  if (r->release) r->release(r->opaque);
  if (r->z_inited) inflateEnd(&r->z);
  if (r->own_fd && r->fd >= 0) close(r->fd);
  if (r->own_buf) free(r->buf);
  free(r->zin);
  free(r->name);
  free(r);
}

uint64_t ember_tfr_reader_offset(const ember_tfr_reader *r) { return r->last_offset; }
void ember_tfr_reader_stats(const ember_tfr_reader *r, ember_tfr_stats *out) { *out = r->stats; }
const char *ember_tfr_reader_name(const ember_tfr_reader *r) { return r->name; }

/* Reads up to n raw bytes from the source: count, 0 at end, or a status. */
static int64_t raw_read(ember_tfr_reader *r, uint8_t *dst, size_t n) {
  if (r->src == SRC_FD) {
    for (;;) {
      ssize_t got = read(r->fd, dst, n);
      if (got >= 0) return (int64_t)got;
      if (errno == EINTR) continue;
      return ember__set_errno(EMBER_EIO, errno, "read %s", r->name);
    }
  }
  /* SRC_FN: the source sets its own message. */
  ember_clear_error();
  int64_t got = r->fn(r->opaque, dst, n);
  if (got < 0) {
    int code = got < INT_MIN ? EMBER_EIO : (int)got;
    if (ember_last_error()[0] == '\0')
      ember__set_error(code, "read %s: %s", r->name, ember_strerror(code));
    else
      ember__set_error(code, "read %s: %s", r->name, ember_last_error());
    return code;
  }
  if ((uint64_t)got > n)
    return ember__set_error(EMBER_EIO, "read %s: source returned %lld bytes for a %zu-byte read",
                            r->name, (long long)got, n);
  return got;
}

/* Decompresses into dst[0..n): count (0 only at the end of the stream) or a
 * status. */
static int64_t inflate_some(ember_tfr_reader *r, uint8_t *dst, size_t n) {
  if (r->z_pending) return ember__set_error(r->z_pending, "%s", r->z_msg);
  if (n > UINT_MAX) n = UINT_MAX;
  r->z.next_out = dst;
  r->z.avail_out = (uInt)n;
  for (;;) {
    if (r->z.avail_in == 0) {
      if (r->src == SRC_MEM) {
        size_t left = r->mem_len - r->mem_pos;
        size_t take = left > (1u << 30) ? (1u << 30) : left;
        r->z.next_in = (Bytef *)(r->mem + r->mem_pos);
        r->z.avail_in = (uInt)take;
        r->mem_pos += take;
        r->raw_read += take;
      } else {
        int64_t got = raw_read(r, r->zin, r->chunk);
        if (got < 0) return got;
        r->z.next_in = r->zin;
        r->z.avail_in = (uInt)got;
        r->raw_read += (uint64_t)got;
      }
    }
    int have_input = r->z.avail_in > 0;
    uInt before = r->z.avail_out;
    int zr = inflate(&r->z, Z_NO_FLUSH);
    size_t produced = (size_t)(before - r->z.avail_out);
    if (zr == Z_STREAM_END) {
      /* Concatenated members (gzip allows them; zlib streams likewise):
       * continue with the next one if input remains. */
      if (r->z.avail_in == 0) {
        /* Probe for more input without losing it. */
        if (r->src == SRC_MEM) {
          if (r->mem_pos >= r->mem_len) return produced ? (int64_t)produced : 0;
        } else {
          int64_t got = raw_read(r, r->zin, r->chunk);
          if (got < 0) return got;
          if (got == 0) return produced ? (int64_t)produced : 0;
          r->z.next_in = r->zin;
          r->z.avail_in = (uInt)got;
          r->raw_read += (uint64_t)got;
        }
      }
      if (inflateReset(&r->z) != Z_OK)
        return ember__set_error(EMBER_EIO, "%s: zlib inflateReset failed", r->name);
      if (produced) return (int64_t)produced;
      continue;
    }
    if (zr == Z_DATA_ERROR || zr == Z_NEED_DICT || zr == Z_STREAM_ERROR || zr == Z_MEM_ERROR) {
      int code = zr == Z_MEM_ERROR ? EMBER_ENOMEM : EMBER_ECORRUPT;
      if (zr == Z_MEM_ERROR)
        ember__set_error(code, "%s: zlib out of memory", r->name);
      else
        ember__set_error(code, "%s: corrupt %s data near compressed byte offset %llu: %s", r->name,
                         r->compression == EMBER_TFR_GZIP ? "gzip" : "zlib",
                         (unsigned long long)(r->raw_read - r->z.avail_in),
                         r->z.msg ? r->z.msg : "data error");
      if (produced == 0) return code;
      r->z_pending = code;
      snprintf(r->z_msg, sizeof r->z_msg, "%s", ember_last_error());
      return (int64_t)produced;
    }
    if (produced) return (int64_t)produced;
    if (!have_input) {
      /* The source ended inside a compressed stream.  An empty input is an
       * empty file, not a truncated one. */
      if (r->raw_read == 0) return 0;
      return ember__set_error(EMBER_ETRUNCATED,
                              "%s: truncated %s stream: input ends after %llu compressed bytes "
                              "(decompressed byte offset %llu)",
                              r->name, r->compression == EMBER_TFR_GZIP ? "gzip" : "zlib",
                              (unsigned long long)r->raw_read,
                              (unsigned long long)(r->base + (r->end - r->start)));
    }
  }
}

/* Makes at least `need` bytes available at buf[start..end), unless the stream
 * ends first.  0 or a status. */
static int fill(ember_tfr_reader *r, size_t need) {
  while (r->end - r->start < need && !r->src_eof) {
    size_t have = r->end - r->start;
    if (r->cap - r->start < need) {
      /* Grow: the window must hold `need` bytes from start. */
      if (r->start > 0) {
        memmove(r->buf, r->buf + r->start, have);
        r->start = 0;
        r->end = have;
      }
      if (r->cap < need) {
        size_t ncap = r->cap;
        while (ncap < need) ncap = ncap > SIZE_MAX / 2 ? need : ncap * 2;
        uint8_t *nb = realloc(r->buf, ncap);
        if (nb == NULL) return ember__set_error(EMBER_ENOMEM, "%s: out of memory for a %zu-byte record buffer", r->name, ncap);
        r->buf = nb;
        r->cap = ncap;
      }
    } else if (r->cap - r->end < MIN_CHUNK && r->start > 0) {
      memmove(r->buf, r->buf + r->start, have);
      r->start = 0;
      r->end = have;
    }
    size_t room = r->cap - r->end;
    int64_t got = r->compression == EMBER_TFR_PLAIN ? raw_read(r, r->buf + r->end, room)
                                                     : inflate_some(r, r->buf + r->end, room);
    if (got < 0) return (int)got;
    if (got == 0) r->src_eof = 1;
    r->end += (size_t)got;
  }
  return EMBER_OK;
}

static void consume(ember_tfr_reader *r, size_t n) {
  r->start += n;
  r->base += n;
  r->stats.stream_bytes += n;
}

static void skip_bytes(ember_tfr_reader *r, size_t n, int new_spot) {
  if (new_spot) r->stats.skipped++;
  r->stats.skipped_bytes += n;
  consume(r, n);
}

/* SKIP_CORRUPT after a bad length CRC: drops bytes one at a time until a
 * header whose length CRC holds (and whose length is acceptable) starts at
 * `start`, or the input ends.  0 or a status. */
static int resync(ember_tfr_reader *r) {
  skip_bytes(r, 1, 1);
  for (;;) {
    int rc = fill(r, EMBER_TFR_HEADER_LEN);
    if (rc != EMBER_OK) return rc;
    size_t avail = r->end - r->start;
    if (avail < EMBER_TFR_HEADER_LEN) {
      skip_bytes(r, avail, 0);
      return EMBER_OK;
    }
    const uint8_t *p = r->buf + r->start;
    if (get_le32(p + 8) == ember_crc32c_masked(p, 8) && get_le64(p) <= r->max_record)
      return EMBER_OK;
    skip_bytes(r, 1, 0);
  }
}

int ember_tfr_reader_next(ember_tfr_reader *r, const uint8_t **data, size_t *len) {
  if (r->err != 0) return ember__set_error(r->err, "%s", r->msg);
  const int skip = (r->flags & EMBER_TFR_SKIP_CORRUPT) != 0;
  const int crc = (r->flags & EMBER_TFR_NO_CRC) == 0;
  for (;;) {
    uint64_t off = r->base;
    int rc = fill(r, EMBER_TFR_HEADER_LEN);
    if (rc != EMBER_OK) return fail(r, rc);
    size_t avail = r->end - r->start;
    if (avail == 0) return 0;
    if (avail < EMBER_TFR_HEADER_LEN) {
      if (skip) {
        skip_bytes(r, avail, 1);
        return 0;
      }
      ember__set_error(EMBER_ETRUNCATED,
                       "%s: truncated record at byte offset %llu%s: the input ends %zu "
                       "bytes into the 12-byte record header",
                       r->name, (unsigned long long)off, stream_note(r), avail);
      return fail(r, EMBER_ETRUNCATED);
    }
    const uint8_t *p = r->buf + r->start;
    uint64_t n = get_le64(p);
    if (crc) {
      uint32_t stored = get_le32(p + 8), computed = ember_crc32c_masked(p, 8);
      if (stored != computed) {
        if (skip) {
          rc = resync(r);
          if (rc != EMBER_OK) return fail(r, rc);
          continue;
        }
        ember__set_error(EMBER_ECORRUPT,
                         "%s: corrupt record at byte offset %llu%s: length CRC mismatch "
                         "(stored 0x%08x, computed 0x%08x; length field reads %llu)",
                         r->name, (unsigned long long)off, stream_note(r), (unsigned)stored,
                         (unsigned)computed, (unsigned long long)n);
        return fail(r, EMBER_ECORRUPT);
      }
    }
    if (n > r->max_record) {
      if (skip) {
        rc = resync(r);
        if (rc != EMBER_OK) return fail(r, rc);
        continue;
      }
      ember__set_error(EMBER_ETOOBIG,
                       "%s: record at byte offset %llu%s is %llu bytes, more than the "
                       "limit of %llu (max_record)",
                       r->name, (unsigned long long)off, stream_note(r), (unsigned long long)n,
                       (unsigned long long)r->max_record);
      return fail(r, EMBER_ETOOBIG);
    }
    /* n <= 2^32, so this cannot overflow a 64-bit size_t. */
    size_t total = EMBER_TFR_HEADER_LEN + (size_t)n + EMBER_TFR_FOOTER_LEN;
    rc = fill(r, total);
    if (rc != EMBER_OK) return fail(r, rc);
    avail = r->end - r->start;
    if (avail < total) {
      if (skip) {
        skip_bytes(r, avail, 1);
        return 0;
      }
      ember__set_error(EMBER_ETRUNCATED,
                       "%s: truncated record at byte offset %llu%s: the header says %llu "
                       "data bytes (%zu with framing) but only %zu bytes remain",
                       r->name, (unsigned long long)off, stream_note(r), (unsigned long long)n,
                       total, avail);
      return fail(r, EMBER_ETRUNCATED);
    }
    p = r->buf + r->start;
    if (crc) {
      uint32_t stored = get_le32(p + EMBER_TFR_HEADER_LEN + n);
      uint32_t computed = ember_crc32c_masked(p + EMBER_TFR_HEADER_LEN, (size_t)n);
      if (stored != computed) {
        if (skip) {
          skip_bytes(r, total, 1);
          continue;
        }
        ember__set_error(EMBER_ECORRUPT,
                         "%s: corrupt record at byte offset %llu%s: data CRC mismatch "
                         "(stored 0x%08x, computed 0x%08x, %llu data bytes)",
                         r->name, (unsigned long long)off, stream_note(r), (unsigned)stored,
                         (unsigned)computed, (unsigned long long)n);
        return fail(r, EMBER_ECORRUPT);
      }
    }
    *data = p + EMBER_TFR_HEADER_LEN;
    *len = (size_t)n;
    r->last_offset = off;
    r->stats.records++;
    r->stats.data_bytes += n;
    consume(r, total);
    return 1;
  }
}

/* ================================================================ writer */

enum { DST_FD = 1, DST_MEM = 2, DST_FN = 3 };

struct ember_tfr_writer {
  char *name;
  int dst;
  int fd, own_fd;
  ember_write_fn wfn; /* DST_FN sink */
  int (*finish)(void *);
  void (*release)(void *);
  void *opaque;
  int compression;
  z_stream z;
  int z_inited;
  uint8_t *buf; /* staging (plain) or deflate output (compressed); for memory
                   writers, the growing output itself */
  size_t cap, len;
  uint64_t records, bytes;
  int closed;
  int err;
  char msg[MSG_CAP];
};

static int wfail(ember_tfr_writer *w, int code) {
  w->err = code;
  snprintf(w->msg, sizeof w->msg, "%s", ember_last_error());
  return code;
}

static int writer_new(ember_tfr_writer **out, const char *name, int dst, int compression,
                      int level) {
  *out = NULL;
  int rc = check_compression(compression);
  if (rc != EMBER_OK) return rc;
  if (level < -1 || level > 9)
    return ember__set_error(EMBER_EINVAL, "zlib level must be -1..9, not %d", level);
  ember_tfr_writer *w = calloc(1, sizeof *w);
  if (w == NULL) return ember__set_error(EMBER_ENOMEM, "out of memory creating a TFRecord writer");
  w->fd = -1;
  w->dst = dst;
  w->compression = compression;
  w->name = dup_name(name, "<memory>");
  w->cap = DEFAULT_CHUNK;
  w->buf = malloc(w->cap);
  if (w->name == NULL || w->buf == NULL) {
    ember_tfr_writer_destroy(w);
    return ember__set_error(EMBER_ENOMEM, "out of memory creating a TFRecord writer");
  }
  if (compression != EMBER_TFR_PLAIN) {
    if (deflateInit2(&w->z, level, Z_DEFLATED, window_bits(compression), 8,
                     Z_DEFAULT_STRATEGY) != Z_OK) {
      ember_tfr_writer_destroy(w);
      return ember__set_error(EMBER_ENOMEM, "zlib deflateInit2 failed");
    }
    w->z_inited = 1;
  }
  *out = w;
  return EMBER_OK;
}

int ember_tfr_writer_open_fd(ember_tfr_writer **out, int fd, const char *name,
                             int compression, int level) {
  if (out == NULL || fd < 0) return ember__set_error(EMBER_EINVAL, "TFRecord writer: bad fd %d", fd);
  char fb[32];
  snprintf(fb, sizeof fb, "fd %d", fd);
  int rc = writer_new(out, name ? name : fb, DST_FD, compression, level);
  if (rc == EMBER_OK) (*out)->fd = fd;
  return rc;
}

int ember_tfr_writer_open_path(ember_tfr_writer **out, const char *path, int compression,
                               int level) {
  if (out == NULL || path == NULL) return ember__set_error(EMBER_EINVAL, "TFRecord writer: NULL path");
  *out = NULL;
  int rc = writer_new(out, path, DST_FD, compression, level);
  if (rc != EMBER_OK) return rc;
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    rc = ember__set_errno(errno == ENOENT ? EMBER_ENOTFOUND : EMBER_EIO, errno, "create %s", path);
    ember_tfr_writer_destroy(*out);
    *out = NULL;
    return rc;
  }
  (*out)->fd = fd;
  (*out)->own_fd = 1;
  return EMBER_OK;
}

int ember_tfr_writer_open_mem(ember_tfr_writer **out, int compression, int level) {
  if (out == NULL) return ember__set_error(EMBER_EINVAL, "TFRecord writer: NULL out");
  return writer_new(out, NULL, DST_MEM, compression, level);
}

int ember_tfr_writer_open_fn(ember_tfr_writer **out, ember_write_fn write,
                             int (*finish)(void *), void (*release)(void *), void *opaque,
                             const char *name, int compression, int level) {
  if (out == NULL || write == NULL) {
    if (release) release(opaque);
    return ember__set_error(EMBER_EINVAL, "TFRecord writer: NULL write function");
  }
  int rc = writer_new(out, name ? name : "<sink>", DST_FN, compression, level);
  if (rc != EMBER_OK) {
    if (release) release(opaque);
    return rc;
  }
  (*out)->wfn = write;
  (*out)->finish = finish;
  (*out)->release = release;
  (*out)->opaque = opaque;
  return EMBER_OK;
}

void ember_tfr_writer_destroy(ember_tfr_writer *w) {
  if (w == NULL) return;
  if (w->release) w->release(w->opaque);
  if (w->z_inited) deflateEnd(&w->z);
  if (w->own_fd && w->fd >= 0) close(w->fd);
  free(w->buf);
  free(w->name);
  free(w);
}

uint64_t ember_tfr_writer_records(const ember_tfr_writer *w) { return w->records; }
uint64_t ember_tfr_writer_bytes(const ember_tfr_writer *w) { return w->bytes; }

static int write_all(ember_tfr_writer *w, const uint8_t *p, size_t n) {
  if (w->dst == DST_FN) {
    ember_clear_error();
    int rc = w->wfn(w->opaque, p, n);
    if (rc != EMBER_OK) {
      if (ember_last_error()[0] == '\0') ember__set_error(rc, "write %s: %s", w->name, ember_strerror(rc));
      return rc;
    }
    w->bytes += n;
    return EMBER_OK;
  }
  while (n > 0) {
    ssize_t k = write(w->fd, p, n > (1u << 30) ? (1u << 30) : n);
    if (k < 0) {
      if (errno == EINTR) continue;
      return ember__set_errno(EMBER_EIO, errno, "write %s", w->name);
    }
    p += k;
    n -= (size_t)k;
    w->bytes += (uint64_t)k;
  }
  return EMBER_OK;
}

/* Memory writers grow buf to hold everything. */
static int mem_reserve(ember_tfr_writer *w, size_t more) {
  if (w->cap - w->len >= more) return EMBER_OK;
  if (more > SIZE_MAX / 2 - w->len) return ember__set_error(EMBER_ETOOBIG, "TFRecord memory writer: output too large");
  size_t ncap = w->cap;
  while (ncap - w->len < more) ncap *= 2;
  uint8_t *nb = realloc(w->buf, ncap);
  if (nb == NULL) return ember__set_error(EMBER_ENOMEM, "TFRecord memory writer: out of memory for %zu bytes", ncap);
  w->buf = nb;
  w->cap = ncap;
  return EMBER_OK;
}

/* Hands staged bytes to the descriptor (memory writers keep them). */
static int drain(ember_tfr_writer *w) {
  if (w->dst == DST_MEM || w->len == 0) return EMBER_OK;
  int rc = write_all(w, w->buf, w->len);
  w->len = 0;
  return rc;
}

/* Runs deflate over in[0..n) (n may be 0), ending with `flush`, into buf.
 * zlib's contract: with Z_NO_FLUSH or Z_SYNC_FLUSH, call again while it
 * fills all the output space; with Z_FINISH, until Z_STREAM_END. */
static int deflate_into(ember_tfr_writer *w, const uint8_t *in, size_t n, int flush) {
  w->z.next_in = (Bytef *)in;
  size_t left = n;
  for (;;) {
    size_t step = left > (1u << 30) ? (1u << 30) : left;
    left -= step;
    w->z.avail_in = (uInt)step;
    int f = left == 0 ? flush : Z_NO_FLUSH;
    int zr;
    do {
      if (w->cap - w->len < 64) {
        int rc = w->dst == DST_MEM ? mem_reserve(w, w->cap) : drain(w);
        if (rc != EMBER_OK) return rc;
      }
      size_t room = w->cap - w->len;
      if (room > UINT_MAX) room = UINT_MAX;
      w->z.next_out = w->buf + w->len;
      w->z.avail_out = (uInt)room;
      zr = deflate(&w->z, f);
      if (zr == Z_STREAM_ERROR) return ember__set_error(EMBER_EIO, "%s: zlib deflate failed", w->name);
      w->len += room - w->z.avail_out;
    } while (w->z.avail_out == 0 || (f == Z_FINISH && zr != Z_STREAM_END));
    if (left == 0) break;
  }
  if (w->dst == DST_MEM) w->bytes = w->len;
  return EMBER_OK;
}

static int put(ember_tfr_writer *w, const uint8_t *p, size_t n) {
  if (w->compression != EMBER_TFR_PLAIN) return deflate_into(w, p, n, Z_NO_FLUSH);
  if (w->dst == DST_MEM) {
    int rc = mem_reserve(w, n);
    if (rc != EMBER_OK) return rc;
    memcpy(w->buf + w->len, p, n);
    w->len += n;
    w->bytes = w->len;
    return EMBER_OK;
  }
  if (w->cap - w->len < n) {
    int rc = drain(w);
    if (rc != EMBER_OK) return rc;
    if (n >= w->cap) return write_all(w, p, n); /* big: skip the staging copy */
  }
  memcpy(w->buf + w->len, p, n);
  w->len += n;
  return EMBER_OK;
}

int ember_tfr_writer_write(ember_tfr_writer *w, const void *data, size_t len) {
  if (w->err) return ember__set_error(w->err, "%s", w->msg);
  if (w->closed) return ember__set_error(EMBER_ESTATE, "%s: TFRecord writer is closed", w->name);
  if (data == NULL && len > 0) return ember__set_error(EMBER_EINVAL, "%s: NULL record data", w->name);
  if ((uint64_t)len > EMBER_TFR_ABSOLUTE_MAX_RECORD)
    return ember__set_error(EMBER_ETOOBIG, "%s: record of %zu bytes exceeds the limit %llu", w->name,
                            len, (unsigned long long)EMBER_TFR_ABSOLUTE_MAX_RECORD);
  uint8_t hdr[EMBER_TFR_HEADER_LEN], ftr[EMBER_TFR_FOOTER_LEN];
  ember_tfr_encode_header(hdr, len);
  ember_tfr_encode_footer(ftr, data, len);
  int rc = put(w, hdr, sizeof hdr);
  if (rc == EMBER_OK && len > 0) rc = put(w, data, len);
  if (rc == EMBER_OK) rc = put(w, ftr, sizeof ftr);
  if (rc != EMBER_OK) return wfail(w, rc);
  w->records++;
  return EMBER_OK;
}

int ember_tfr_writer_flush(ember_tfr_writer *w) {
  if (w->err) return ember__set_error(w->err, "%s", w->msg);
  if (w->closed) return EMBER_OK;
  int rc = EMBER_OK;
  if (w->compression != EMBER_TFR_PLAIN) rc = deflate_into(w, NULL, 0, Z_SYNC_FLUSH);
  if (rc == EMBER_OK) rc = drain(w);
  return rc == EMBER_OK ? EMBER_OK : wfail(w, rc);
}

int ember_tfr_writer_close(ember_tfr_writer *w) {
  if (w->err) return ember__set_error(w->err, "%s", w->msg);
  if (w->closed) return EMBER_OK;
  int rc = EMBER_OK;
  if (w->compression != EMBER_TFR_PLAIN) rc = deflate_into(w, NULL, 0, Z_FINISH);
  if (rc == EMBER_OK) rc = drain(w);
  if (rc == EMBER_OK && w->own_fd) {
    int fd = w->fd;
    w->fd = -1;
    if (close(fd) != 0 && errno != EINTR) rc = ember__set_errno(EMBER_EIO, errno, "close %s", w->name);
  }
  if (rc == EMBER_OK && w->dst == DST_FN) {
    /* the sink is finished (and no longer ours to release) whatever happens */
    int (*finish)(void *) = w->finish;
    void *opaque = w->opaque;
    w->release = NULL;
    w->finish = NULL;
    if (finish != NULL) {
      ember_clear_error();
      rc = finish(opaque);
      if (rc != EMBER_OK && ember_last_error()[0] == '\0')
        ember__set_error(rc, "close %s: %s", w->name, ember_strerror(rc));
    }
  }
  if (rc != EMBER_OK) return wfail(w, rc);
  w->closed = 1;
  return EMBER_OK;
}

int ember_tfr_writer_mem(const ember_tfr_writer *w, const uint8_t **data, size_t *len) {
  if (w->dst != DST_MEM) return ember__set_error(EMBER_EINVAL, "%s: not a memory writer", w->name);
  if (!w->closed) return ember__set_error(EMBER_ESTATE, "TFRecord memory writer: close it before taking its bytes");
  *data = w->buf;
  *len = w->len;
  return EMBER_OK;
}
