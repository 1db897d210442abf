/* wire.c - frame header codec, incremental stream parser, and the bounded
 * payload reader / growable writer.
 *
 * Nothing here trusts a length read from the network: the header's length is
 * checked against the receiver's limit before a byte of payload is buffered,
 * and every reader call checks bytes_left first (the nanopb discipline). */
#include "ember/wire.h"

#include <stdlib.h>
#include <string.h>

#include "ember/error.h"

void ember_wire_encode_header(uint8_t out[EMBER_WIRE_HEADER_LEN], uint16_t type,
                              uint32_t length) {
  ember_wire_put_u32(out, EMBER_WIRE_MAGIC);
  out[4] = (uint8_t)EMBER_WIRE_VERSION;
  out[5] = (uint8_t)(EMBER_WIRE_VERSION >> 8);
  out[6] = (uint8_t)type;
  out[7] = (uint8_t)(type >> 8);
  ember_wire_put_u32(out + 8, length);
}

int ember_wire_known_type(uint16_t type) {
  switch (type) {
  case EMBER_MSG_CHALLENGE:
  case EMBER_MSG_AUTH:
  case EMBER_MSG_AUTH_OK:
  case EMBER_MSG_REFUSED:
  case EMBER_MSG_REGISTER:
  case EMBER_MSG_SPEC:
  case EMBER_MSG_HEARTBEAT:
  case EMBER_MSG_REPORT:
  case EMBER_MSG_STOP:
  case EMBER_MSG_FEED_HELLO:
  case EMBER_MSG_BATCH:
  case EMBER_MSG_END_PARTITION:
  case EMBER_MSG_ACK:
  case EMBER_MSG_RESULTS:
  case EMBER_MSG_END_FEED:
  case EMBER_MSG_FEED_ERROR:
  case EMBER_MSG_FEED_SHM:
  case EMBER_MSG_FEED_SHM_REPLY:
  case EMBER_MSG_FEED_RESUME:
  case EMBER_MSG_COLL_HELLO:
  case EMBER_MSG_COLL_SHM:
  case EMBER_MSG_COLL_SHM_ACK:
  case EMBER_MSG_PS_HELLO:
  case EMBER_MSG_PS_DECLARE:
  case EMBER_MSG_PS_PULL:
  case EMBER_MSG_PS_PUSH:
  case EMBER_MSG_PS_CLOCK:
  case EMBER_MSG_PS_SAVE:
  case EMBER_MSG_PS_REPLY:
  case EMBER_MSG_PS_ASSIGN:
  case EMBER_MSG_PS_INIT:
  case EMBER_MSG_PS_SHM:
    return 1;
  default:
    return 0;
  }
}

const char *ember_wire_type_name(uint16_t type) {
  switch (type) {
  case EMBER_MSG_CHALLENGE: return "CHALLENGE";
  case EMBER_MSG_AUTH: return "AUTH";
  case EMBER_MSG_AUTH_OK: return "AUTH_OK";
  case EMBER_MSG_REFUSED: return "REFUSED";
  case EMBER_MSG_REGISTER: return "REGISTER";
  case EMBER_MSG_SPEC: return "SPEC";
  case EMBER_MSG_HEARTBEAT: return "HEARTBEAT";
  case EMBER_MSG_REPORT: return "REPORT";
  case EMBER_MSG_STOP: return "STOP";
  case EMBER_MSG_FEED_HELLO: return "FEED_HELLO";
  case EMBER_MSG_BATCH: return "BATCH";
  case EMBER_MSG_END_PARTITION: return "END_PARTITION";
  case EMBER_MSG_ACK: return "ACK";
  case EMBER_MSG_RESULTS: return "RESULTS";
  case EMBER_MSG_END_FEED: return "END_FEED";
  case EMBER_MSG_FEED_ERROR: return "FEED_ERROR";
  case EMBER_MSG_FEED_SHM: return "FEED_SHM";
  case EMBER_MSG_FEED_SHM_REPLY: return "FEED_SHM_REPLY";
  case EMBER_MSG_FEED_RESUME: return "FEED_RESUME";
  case EMBER_MSG_COLL_HELLO: return "COLL_HELLO";
  case EMBER_MSG_COLL_SHM: return "COLL_SHM";
  case EMBER_MSG_COLL_SHM_ACK: return "COLL_SHM_ACK";
  case EMBER_MSG_PS_HELLO: return "PS_HELLO";
  case EMBER_MSG_PS_DECLARE: return "PS_DECLARE";
  case EMBER_MSG_PS_PULL: return "PS_PULL";
  case EMBER_MSG_PS_PUSH: return "PS_PUSH";
  case EMBER_MSG_PS_CLOCK: return "PS_CLOCK";
  case EMBER_MSG_PS_SAVE: return "PS_SAVE";
  case EMBER_MSG_PS_REPLY: return "PS_REPLY";
  case EMBER_MSG_PS_ASSIGN: return "PS_ASSIGN";
  case EMBER_MSG_PS_INIT: return "PS_INIT";
  case EMBER_MSG_PS_SHM: return "PS_SHM";
  default: return "UNKNOWN";
  }
}

int ember_wire_decode_header(const uint8_t *buf, size_t len,
                             uint32_t max_payload, ember_frame_header *out) {
  if (len < EMBER_WIRE_HEADER_LEN) return EMBER_EAGAIN;
  uint32_t magic = ember_wire_get_u32(buf);
  if (magic != EMBER_WIRE_MAGIC)
    return ember__set_error(EMBER_EPROTO,
                            "bad frame magic 0x%08x (expected 0x%08x \"EMBR\"; "
                            "not an Ember peer?)",
                            (unsigned)magic, (unsigned)EMBER_WIRE_MAGIC);
  uint16_t version = (uint16_t)(buf[4] | buf[5] << 8);
  if (version != EMBER_WIRE_VERSION)
    return ember__set_error(EMBER_EPROTO,
                            "unsupported frame version %u (this build speaks %u)",
                            (unsigned)version, (unsigned)EMBER_WIRE_VERSION);
  uint16_t type = (uint16_t)(buf[6] | buf[7] << 8);
  if (!ember_wire_known_type(type))
    return ember__set_error(EMBER_EPROTO, "unknown frame type %u", (unsigned)type);
  uint32_t length = ember_wire_get_u32(buf + 8);
  uint32_t limit = max_payload < EMBER_WIRE_ABSOLUTE_MAX ? max_payload
                                                         : EMBER_WIRE_ABSOLUTE_MAX;
  if (length > limit)
    return ember__set_error(EMBER_ETOOBIG,
                            "%s frame length %u exceeds the limit of %u bytes",
                            ember_wire_type_name(type), (unsigned)length,
                            (unsigned)limit);
  if (out != NULL) {
    out->version = version;
    out->type = type;
    out->length = length;
  }
  return EMBER_OK;
}

/* ---------------------------------------------------------------- parser */

/* Layout of buf: [consumed | complete, validated frames | tail].
 *   start: first byte not yet popped by ember_wire_parser_next.
 *   scan:  end of the last complete frame whose header was validated.
 *   end:   end of the buffered bytes.
 * The tail [scan, end) is either < 12 bytes or a validated header with part of
 * its payload, so it is always smaller than max_payload + 12: that is all a
 * peer can make us hold between calls, provided the caller drains frames with
 * ember_wire_parser_next after each feed (every poll loop in Ember does). */
struct ember_wire_parser {
  uint8_t *buf;
  size_t cap, start, scan, end;
  uint32_t max_payload;
  int err; /* sticky first decode error */
};

/* Release a large buffer once drained so a peer that once sent a 1 GiB frame
 * does not pin that memory for the connection's lifetime. */
#define EMBER__PARSER_KEEP (256u * 1024u)

int ember_wire_parser_create(ember_wire_parser **out, uint32_t max_payload) {
  if (out == NULL) return ember__set_error(EMBER_EINVAL, "parser_create: out is NULL");
  *out = NULL;
  ember_wire_parser *p = calloc(1, sizeof *p);
  if (p == NULL) return ember__set_error(EMBER_ENOMEM, "parser_create: out of memory");
  p->max_payload =
      max_payload < EMBER_WIRE_ABSOLUTE_MAX ? max_payload : EMBER_WIRE_ABSOLUTE_MAX;
  *out = p;
  return EMBER_OK;
}

void ember_wire_parser_destroy(ember_wire_parser *p) {
  if (p == NULL) return;
  free(p->buf);
  free(p);
}

int ember_wire_parser_feed(ember_wire_parser *p, const uint8_t *data, size_t len) {
  if (p == NULL || (data == NULL && len > 0))
    return ember__set_error(EMBER_EINVAL, "parser_feed: NULL argument");
  if (p->err) return p->err;
  if (len == 0) return EMBER_OK;

  /* Compact: popped frames are dead once the caller feeds again (payload
   * pointers are documented valid only until the next feed). */
  if (p->start > 0) {
    size_t live = p->end - p->start;
    if (live > 0) memmove(p->buf, p->buf + p->start, live);
    p->scan -= p->start;
    p->end = live;
    p->start = 0;
  }
  if (p->end == 0 && p->cap > EMBER__PARSER_KEEP) {
    free(p->buf);
    p->buf = NULL;
    p->cap = 0;
  }
  if (len > SIZE_MAX - p->end) {
    p->err = ember__set_error(EMBER_ETOOBIG, "parser_feed: size overflow");
    return p->err;
  }
  size_t need = p->end + len;
  if (need > p->cap) {
    size_t ncap = p->cap ? p->cap : 4096;
    while (ncap < need) ncap = ncap > SIZE_MAX / 2 ? need : ncap * 2;
    uint8_t *nb = realloc(p->buf, ncap);
    if (nb == NULL) {
      p->err = ember__set_error(EMBER_ENOMEM, "parser_feed: out of memory (%zu bytes)",
                                ncap);
      return p->err;
    }
    p->buf = nb;
    p->cap = ncap;
  }
  memcpy(p->buf + p->end, data, len);
  p->end += len;

  /* Validate every header that is now complete, so garbage is rejected as
   * soon as 12 bytes of it arrive, before any payload is waited for. */
  while (p->end - p->scan >= EMBER_WIRE_HEADER_LEN) {
    ember_frame_header h;
    int rc = ember_wire_decode_header(p->buf + p->scan, p->end - p->scan,
                                      p->max_payload, &h);
    if (rc != EMBER_OK) {
      p->err = rc;
      return rc;
    }
    size_t frame = (size_t)EMBER_WIRE_HEADER_LEN + h.length;
    if (p->end - p->scan < frame) break;
    p->scan += frame;
  }
  return EMBER_OK;
}

int ember_wire_parser_next(ember_wire_parser *p, ember_frame_header *hdr,
                           const uint8_t **payload) {
  if (p == NULL || hdr == NULL || payload == NULL)
    return ember__set_error(EMBER_EINVAL, "parser_next: NULL argument");
  if (p->err) return p->err;
  if (p->start == p->scan) return 0;
  const uint8_t *h = p->buf + p->start;
  /* Already validated in feed; decode the fields directly. */
  hdr->version = (uint16_t)(h[4] | h[5] << 8);
  hdr->type = (uint16_t)(h[6] | h[7] << 8);
  hdr->length = ember_wire_get_u32(h + 8);
  *payload = h + EMBER_WIRE_HEADER_LEN;
  p->start += (size_t)EMBER_WIRE_HEADER_LEN + hdr->length;
  return 1;
}

/* ---------------------------------------------------------------- reader */

void ember_wire_reader_init(ember_wire_reader *r, const uint8_t *buf, size_t len) {
  r->p = buf;
  r->left = buf != NULL ? len : 0;
  r->err = EMBER_OK;
}

/* Returns a pointer to n bytes and advances, or NULL (and sets the sticky
 * error) if fewer than n remain. */
static const uint8_t *take(ember_wire_reader *r, size_t n) {
  if (r->err) return NULL;
  if (n > r->left) {
    r->err = ember__set_error(EMBER_EPROTO,
                              "truncated payload: field needs %zu bytes, %zu left",
                              n, r->left);
    return NULL;
  }
  const uint8_t *q = r->p;
  r->p += n;
  r->left -= n;
  return q;
}

uint8_t ember_wire_read_u8(ember_wire_reader *r) {
  const uint8_t *q = take(r, 1);
  return q ? q[0] : 0;
}

uint16_t ember_wire_read_u16(ember_wire_reader *r) {
  const uint8_t *q = take(r, 2);
  return q ? (uint16_t)(q[0] | q[1] << 8) : 0;
}

uint32_t ember_wire_read_u32(ember_wire_reader *r) {
  const uint8_t *q = take(r, 4);
  return q ? ember_wire_get_u32(q) : 0;
}

uint64_t ember_wire_read_u64(ember_wire_reader *r) {
  const uint8_t *q = take(r, 8);
  return q ? ember_wire_get_u64(q) : 0;
}

void ember_wire_read_str(ember_wire_reader *r, char *out, size_t cap) {
  if (out != NULL && cap > 0) out[0] = '\0';
  if (r->err) return;
  if (out == NULL || cap == 0) {
    r->err = ember__set_error(EMBER_EINVAL, "read_str: no output buffer");
    return;
  }
  uint32_t n = ember_wire_read_u32(r);
  if (r->err) return;
  /* Check against the caller's capacity before the bytes-left check so the
   * message says "too long" for a length that is absurd either way. */
  if ((size_t)n > cap - 1) {
    r->err = ember__set_error(EMBER_EPROTO,
                              "string of %u bytes exceeds the limit of %zu",
                              (unsigned)n, cap - 1);
    return;
  }
  const uint8_t *q = take(r, n);
  if (q == NULL) return;
  if (n > 0 && memchr(q, 0, n) != NULL) {
    r->err = ember__set_error(EMBER_EPROTO, "string contains a NUL byte");
    return;
  }
  if (n > 0) memcpy(out, q, n);
  out[n] = '\0';
}

void ember_wire_read_raw(ember_wire_reader *r, const uint8_t **out, size_t n) {
  const uint8_t *q = take(r, n);
  if (out != NULL) *out = q;
}

int ember_wire_reader_finish(const ember_wire_reader *r, int require_end,
                             const char *what) {
  if (what == NULL) what = "payload";
  if (r->err)
    return ember__set_error(r->err, "malformed %s: %s", what, ember_last_error());
  if (require_end && r->left != 0)
    return ember__set_error(EMBER_EPROTO, "malformed %s: %zu unexpected trailing bytes",
                            what, r->left);
  return EMBER_OK;
}

/* ---------------------------------------------------------------- writer */

void ember_wire_writer_init(ember_wire_writer *w) {
  w->buf = NULL;
  w->len = 0;
  w->cap = 0;
  w->err = EMBER_OK;
}

void ember_wire_writer_free(ember_wire_writer *w) {
  free(w->buf);
  ember_wire_writer_init(w);
}

/* Makes room for n more bytes; returns the write position or NULL (sticky). */
static uint8_t *reserve(ember_wire_writer *w, size_t n) {
  if (w->err) return NULL;
  if (n > SIZE_MAX - w->len) {
    w->err = ember__set_error(EMBER_ETOOBIG, "wire writer: size overflow");
    return NULL;
  }
  size_t need = w->len + n;
  if (need > w->cap) {
    size_t ncap = w->cap ? w->cap : 256;
    while (ncap < need) ncap = ncap > SIZE_MAX / 2 ? need : ncap * 2;
    uint8_t *nb = realloc(w->buf, ncap);
    if (nb == NULL) {
      w->err = ember__set_error(EMBER_ENOMEM, "wire writer: out of memory (%zu bytes)",
                                ncap);
      return NULL;
    }
    w->buf = nb;
    w->cap = ncap;
  }
  uint8_t *q = w->buf + w->len;
  w->len += n;
  return q;
}

void ember_wire_write_u8(ember_wire_writer *w, uint8_t v) {
  uint8_t *q = reserve(w, 1);
  if (q) q[0] = v;
}

void ember_wire_write_u16(ember_wire_writer *w, uint16_t v) {
  uint8_t *q = reserve(w, 2);
  if (q) {
    q[0] = (uint8_t)v;
    q[1] = (uint8_t)(v >> 8);
  }
}

void ember_wire_write_u32(ember_wire_writer *w, uint32_t v) {
  uint8_t *q = reserve(w, 4);
  if (q) ember_wire_put_u32(q, v);
}

void ember_wire_write_u64(ember_wire_writer *w, uint64_t v) {
  uint8_t *q = reserve(w, 8);
  if (q) ember_wire_put_u64(q, v);
}

void ember_wire_write_str(ember_wire_writer *w, const char *s) {
  if (s == NULL) s = "";
  size_t n = strlen(s);
  if (n > UINT32_MAX) {
    if (!w->err)
      w->err = ember__set_error(EMBER_ETOOBIG, "wire writer: string of %zu bytes", n);
    return;
  }
  ember_wire_write_u32(w, (uint32_t)n);
  ember_wire_write_raw(w, s, n);
}

void ember_wire_write_raw(ember_wire_writer *w, const void *p, size_t n) {
  if (n == 0) return;
  uint8_t *q = reserve(w, n);
  if (q) memcpy(q, p, n);
}
