/* fuzz_wire.c - libFuzzer harness for every decoder of control-channel bytes:
 * the frame header, the incremental stream parser (fed in chunk splits
 * derived from the input), the bounded payload reader, the server side of
 * the auth handshake, and the rendezvous payload codecs (REGISTER, SPEC,
 * REPORT, REFUSED).
 *
 * Besides "no crash, no out-of-bounds read" (ASan/UBSan), it checks two
 * properties: the parser yields the same frames however the stream is split,
 * and every payload a decoder accepts re-encodes to exactly the same bytes
 * (the encodings are canonical), so decoders cannot accept slack. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/rendezvous_codec.h"
#include "ember/auth.h"
#include "ember/error.h"
#include "ember/rendezvous.h"
#include "ember/wire.h"

#define MAX_PAYLOAD (1u << 16)

static void require(int cond) {
  if (!cond) abort();
}

/* Splits are pseudo-random but a pure function of the input, so a crash
 * reproduces from its file alone. */
static uint32_t next_rand(uint32_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 17;
  *s ^= *s << 5;
  return *s;
}

static void check_register(const uint8_t *p, size_t n) {
  ember_rdv_node node;
  if (ember__rdv_decode_register(p, n, &node) != EMBER_OK) return;
  ember_wire_writer w;
  ember_wire_writer_init(&w);
  require(ember__rdv_encode_register(&w, &node) == EMBER_OK);
  require(w.len == n && memcmp(w.buf, p, n) == 0);
  ember_wire_writer_free(&w);
}

static void check_spec(const uint8_t *p, size_t n) {
  ember_rdv_node *nodes = NULL;
  uint32_t count = 0, me = 0;
  if (ember__rdv_decode_spec(p, n, &me, &nodes, &count) != EMBER_OK) {
    require(nodes == NULL && count == 0);
    return;
  }
  require(count > 0 && me < count);
  ember_wire_writer w;
  ember_wire_writer_init(&w);
  ember_wire_write_u32(&w, me);
  require(ember__rdv_encode_spec_table(&w, nodes, count) == EMBER_OK);
  require(w.len == n && memcmp(w.buf, p, n) == 0);
  ember_wire_writer_free(&w);
  free(nodes);
}

static void check_report(const uint8_t *p, size_t n) {
  uint32_t kind;
  int32_t code;
  char *text = NULL;
  if (ember__rdv_decode_report(p, n, &kind, &code, &text) != EMBER_OK) {
    require(text == NULL);
    return;
  }
  ember_wire_writer w;
  ember_wire_writer_init(&w);
  size_t tl = text ? strlen(text) : 0;
  require(ember__rdv_encode_report(&w, kind, code, text, tl) == EMBER_OK);
  require(w.len == n && memcmp(w.buf, p, n) == 0);
  ember_wire_writer_free(&w);
  free(text);
}

static void check_refused(const uint8_t *p, size_t n) {
  char reason[EMBER__RDV_REASON_MAX + 1];
  int status = 0;
  if (ember__rdv_decode_refused(p, n, &status, reason, sizeof reason) == EMBER_OK)
    require(status < 0 && strlen(reason) <= EMBER__RDV_REASON_MAX);
}

/* The generic reader: a sequence of reads chosen by the payload's own bytes,
 * after which the accounting must still be consistent. */
static void check_reader(const uint8_t *p, size_t n) {
  ember_wire_reader r;
  char s[17];
  const uint8_t *raw;
  ember_wire_reader_init(&r, p, n);
  for (int i = 0; i < 16 && !r.err; i++) {
    size_t before = r.left;
    switch (ember_wire_read_u8(&r) % 6) {
    case 0: ember_wire_read_u16(&r); break;
    case 1: ember_wire_read_u32(&r); break;
    case 2: ember_wire_read_u64(&r); break;
    case 3: ember_wire_read_str(&r, s, sizeof s); break;
    case 4: ember_wire_read_raw(&r, &raw, r.left / 2); break;
    default: break;
    }
    require(r.left <= before);
    if (!r.err && r.p != NULL) require(r.p + r.left == p + n);
  }
  (void)ember_wire_reader_finish(&r, 1, "fuzz");
}

static void check_payload(uint16_t type, const uint8_t *p, size_t n) {
  /* Every decoder on every payload, whatever the frame type says: a hostile
   * peer picks the type too. */
  (void)type;
  check_register(p, n);
  check_spec(p, n);
  check_report(p, n);
  check_refused(p, n);
  check_reader(p, n);
  if (type == EMBER_MSG_AUTH) {
    static const uint8_t secret[32] = "fuzz-secret-fuzz-secret-fuzz-sec";
    ember_auth_pending st;
    uint8_t reply[EMBER_WIRE_HEADER_LEN + 300];
    size_t rl = 0;
    memset(&st, 0x5a, sizeof st);
    int rc = ember_auth_server_check(&st, secret, sizeof secret, type, p, (uint32_t)n,
                                     reply, sizeof reply, &rl);
    require(rc == EMBER_EAUTH && rl > 0 && rl <= sizeof reply);
  }
}

/* Frames as (type, length, hash) so two parses can be compared cheaply. */
typedef struct {
  uint16_t type;
  uint32_t length;
  uint32_t hash;
} frame_sig;

static uint32_t fnv(const uint8_t *p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
  return h;
}

/* Parses data in chunks; returns the number of frames (up to cap recorded)
 * and the final status (0 or the sticky error). */
static size_t parse(const uint8_t *data, size_t size, uint32_t seed, int inspect,
                    frame_sig *sig, size_t cap, int *status) {
  ember_wire_parser *p = NULL;
  size_t nframes = 0;
  *status = 0;
  require(ember_wire_parser_create(&p, MAX_PAYLOAD) == EMBER_OK);
  size_t off = 0;
  while (off < size) {
    size_t chunk = seed ? 1 + next_rand(&seed) % 97 : size - off;
    if (chunk > size - off) chunk = size - off;
    int rc = ember_wire_parser_feed(p, data + off, chunk);
    off += chunk;
    for (;;) {
      ember_frame_header h;
      const uint8_t *payload;
      int r = ember_wire_parser_next(p, &h, &payload);
      if (r <= 0) {
        require(r == 0 || r == rc);
        break;
      }
      require(h.length <= MAX_PAYLOAD && ember_wire_known_type(h.type));
      if (inspect) check_payload(h.type, payload, h.length);
      if (nframes < cap) {
        sig[nframes].type = h.type;
        sig[nframes].length = h.length;
        sig[nframes].hash = fnv(payload, h.length);
      }
      nframes++;
    }
    if (rc != EMBER_OK) {
      *status = rc;
      /* Sticky: more input changes nothing. */
      require(ember_wire_parser_feed(p, data, size) == rc);
      break;
    }
  }
  ember_wire_parser_destroy(p);
  return nframes;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  enum { CAP = 64 };
  frame_sig a[CAP], b[CAP];
  ember_frame_header h;

  /* Batch-free header path, with a limit taken from the input. */
  uint32_t limit = size > 0 ? (uint32_t)data[size - 1] << 8 : 0;
  int hr = ember_wire_decode_header(data, size, limit, &h);
  if (size < EMBER_WIRE_HEADER_LEN) require(hr == EMBER_EAGAIN);
  if (hr == EMBER_OK) require(h.length <= limit && ember_wire_known_type(h.type));

  /* The raw bytes as payloads, so decoders are reached without framing. */
  check_payload(0, data, size);

  /* The stream, whole and in random splits. */
  int sa, sb;
  uint32_t seed = (uint32_t)size * 2654435761u ^ (size ? data[0] : 0) ^ 0x9e3779b9u;
  if (seed == 0) seed = 1;
  size_t na = parse(data, size, 0, 1, a, CAP, &sa);
  size_t nb = parse(data, size, seed, 0, b, CAP, &sb);
  /* After an error, frames that arrived in an earlier chunk were already
   * popped, whereas one big feed reports the error first: the split parse
   * may see more frames, never different ones. */
  require(sa == sb);
  require(sa == 0 ? na == nb : na <= nb);
  for (size_t i = 0; i < na && i < CAP; i++)
    require(a[i].type == b[i].type && a[i].length == b[i].length && a[i].hash == b[i].hash);
  return 0;
}
