/* ember/wire.h - the frame codec shared by every Ember TCP connection.
 *
 * A frame is a fixed 12-byte header followed by `length` payload bytes.
 * All integers on the wire are little-endian and fixed width.
 *
 *   offset  size  field
 *   0       4     magic    EMBER_WIRE_MAGIC ("EMBR" as bytes)
 *   4       2     version  EMBER_WIRE_VERSION
 *   6       2     type     one of ember_msg_type
 *   8       4     length   payload bytes that follow; <= the receiver's limit
 *
 * Decoding never trusts a length: ember_wire_decode_header checks magic,
 * version, type and the length limit before any payload is read, and the
 * ember_wire_reader functions bound every field read from a payload
 * (nanopb's bytes_left discipline).  Payload layouts of each message type are
 * documented where the type is defined.
 *
 * Thread-safety: all functions are pure (no shared state).
 */
#ifndef EMBER_WIRE_H
#define EMBER_WIRE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EMBER_WIRE_MAGIC 0x52424D45u /* bytes 'E' 'M' 'B' 'R' */
#define EMBER_WIRE_VERSION 1u
#define EMBER_WIRE_HEADER_LEN 12u
/* Default payload limit of control connections (rendezvous, auth). */
#define EMBER_WIRE_CONTROL_MAX (4u * 1024u * 1024u)
/* Hard upper bound on any payload, whatever a caller configures. */
#define EMBER_WIRE_ABSOLUTE_MAX (1024u * 1024u * 1024u)

typedef enum {
  /* auth (see auth.h) */
  EMBER_MSG_CHALLENGE = 1, /* server->client: 32-byte server nonce */
  EMBER_MSG_AUTH = 2,      /* client->server: 32-byte client nonce, 32-byte MAC */
  EMBER_MSG_AUTH_OK = 3,   /* server->client: 32-byte MAC proving the server */
  EMBER_MSG_REFUSED = 4,   /* either way: u32 status, string reason; then close */

  /* rendezvous / control channel (see rendezvous.h) */
  EMBER_MSG_REGISTER = 16,  /* node->server: ember_rdv_node fields */
  EMBER_MSG_SPEC = 17,      /* server->node: u32 your_index, node table */
  EMBER_MSG_HEARTBEAT = 18, /* node->server and server->node (echo): empty */
  EMBER_MSG_REPORT = 19,    /* node->server: u32 kind, i32 code, string text */
  EMBER_MSG_STOP = 20,      /* server->node: u32 grace_ms */

  /* data feed (see feed.h) */
  EMBER_MSG_FEED_HELLO = 32,    /* producer->node: u32 partition, u32 flags,
                                   u64 call, u32 call_partitions, u32 tag_len,
                                   tag (feed.h) */
  EMBER_MSG_BATCH = 33,         /* producer->node: an encoded batch */
  EMBER_MSG_END_PARTITION = 34, /* producer->node: u64 records sent */
  EMBER_MSG_ACK = 35,           /* node->producer: u32 status, string reason */
  EMBER_MSG_RESULTS = 36,       /* node->producer: an encoded batch */
  EMBER_MSG_END_FEED = 37,      /* driver->node: no more partitions will come */
  EMBER_MSG_FEED_ERROR = 38,    /* producer->node: string reason (bad partition) */
  EMBER_MSG_FEED_SHM = 39,      /* producer->node, before its first BATCH: 16-byte
                                   host id, i32 pid, i32 fd, u64 segment bytes,
                                   32-byte token (a shm ring to attach) */
  EMBER_MSG_FEED_SHM_REPLY = 40, /* node->producer: u32 status (0: attached, BATCH
                                   payloads now go through the ring), str reason */
  EMBER_MSG_FEED_RESUME = 41,   /* node->producer, answer to a FEED_HELLO with
                                   EMBER_FEED_RESUME: u32 delivered (1: the
                                   partition was acknowledged already), u64
                                   records of it the node already holds */

  /* collectives, set-up only (see collective.h; data flows unframed) */
  EMBER_MSG_COLL_HELLO = 48,  /* both ways: u32 rank, u32 size */
  EMBER_MSG_COLL_SHM = 49,    /* both ways: str inbox segment name ("" =
                                 none), its 32-byte token, then the ring
                                 for the receiver to send into: u32 pid,
                                 u32 fd, u64 bytes, 32-byte token */
  EMBER_MSG_COLL_SHM_ACK = 50, /* both ways: u32 1 if the segment was mapped */

  /* parameter server (see ps.h): worker->server requests, each answered PS_REPLY */
  EMBER_MSG_PS_HELLO = 64,   /* u32 worker, u32 num_workers, u32 shard, u32 num_shards */
  EMBER_MSG_PS_DECLARE = 65, /* a table spec */
  EMBER_MSG_PS_PULL = 66,    /* str table, u64 clock, u32 wait_ms, u8 whole, u32 n, rows */
  EMBER_MSG_PS_PUSH = 67,    /* str table, u8 whole, u32 n, u32 cols, rows, n x cols f32 */
  EMBER_MSG_PS_CLOCK = 68,   /* u64 steps done (UINT64_MAX: the worker finished) */
  EMBER_MSG_PS_SAVE = 69,    /* str directory */
  EMBER_MSG_PS_REPLY = 70,   /* server->worker: u32 status, str reason, body */
  EMBER_MSG_PS_ASSIGN = 71,  /* as PS_PUSH, values instead of gradients */
  EMBER_MSG_PS_INIT = 72,    /* as PS_ASSIGN, only to rows no push reached */
  EMBER_MSG_PS_SHM = 73      /* 16-byte host id, then the request ring's and the
                                reply ring's descriptors (u32 pid, u32 fd, u64
                                bytes, 32-byte token each): answered PS_REPLY,
                                status 0 when the shard attached both and every
                                later request and reply goes through them */
} ember_msg_type;

typedef struct {
  uint16_t version;
  uint16_t type;
  uint32_t length;
} ember_frame_header;

/* Writes the 12-byte header for (type, length) into out. */
void ember_wire_encode_header(uint8_t out[EMBER_WIRE_HEADER_LEN], uint16_t type,
                              uint32_t length);

/* Decodes a header from buf[0..len).
 * Returns EMBER_OK and fills *out; EMBER_EAGAIN if len < 12; EMBER_EPROTO for a
 * bad magic, unsupported version or unknown type; EMBER_ETOOBIG if the payload
 * length exceeds max_payload (or EMBER_WIRE_ABSOLUTE_MAX).  The message names
 * the offending field and value. */
int ember_wire_decode_header(const uint8_t *buf, size_t len,
                             uint32_t max_payload, ember_frame_header *out);

/* Returns 1 if type is one of ember_msg_type, else 0. */
int ember_wire_known_type(uint16_t type);

/* Human name of a message type ("BATCH"); "UNKNOWN" for others. */
const char *ember_wire_type_name(uint16_t type);

/* Incremental stream parser: feeds arbitrary byte chunks, reports whole frames.
 * Used by poll loops that read whatever the socket has.  It owns a growable
 * buffer bounded by max_payload + 12. */
typedef struct ember_wire_parser ember_wire_parser;

int ember_wire_parser_create(ember_wire_parser **out, uint32_t max_payload);
void ember_wire_parser_destroy(ember_wire_parser *p); /* accepts NULL */

/* Appends bytes.  Returns EMBER_OK, or the first decode error (sticky: the
 * parser is then poisoned and the connection must be closed). */
int ember_wire_parser_feed(ember_wire_parser *p, const uint8_t *data, size_t len);

/* Pops the next complete frame, if any.  Returns 1 and fills *hdr and
 * *payload (valid until the next feed/next call) when a frame is ready, 0 when
 * more bytes are needed, or a negative error. */
int ember_wire_parser_next(ember_wire_parser *p, ember_frame_header *hdr,
                           const uint8_t **payload);

/* ---- bounded payload reader (every read checks bytes_left) ---- */
typedef struct {
  const uint8_t *p;
  size_t left;
  int err; /* first error (sticky); reads after an error return zeros */
} ember_wire_reader;

void ember_wire_reader_init(ember_wire_reader *r, const uint8_t *buf, size_t len);
uint8_t ember_wire_read_u8(ember_wire_reader *r);
uint16_t ember_wire_read_u16(ember_wire_reader *r);
uint32_t ember_wire_read_u32(ember_wire_reader *r);
uint64_t ember_wire_read_u64(ember_wire_reader *r);
/* A string is u32 length + bytes (not NUL-terminated on the wire).  Copies at
 * most cap-1 bytes into out and NUL-terminates; a string longer than cap-1, or
 * one containing a NUL byte, sets EMBER_EPROTO. */
void ember_wire_read_str(ember_wire_reader *r, char *out, size_t cap);
/* Points *out at n raw bytes inside the buffer (no copy). */
void ember_wire_read_raw(ember_wire_reader *r, const uint8_t **out, size_t n);
/* EMBER_OK if every read succeeded (and, if require_end, nothing is left). */
int ember_wire_reader_finish(const ember_wire_reader *r, int require_end,
                             const char *what);

/* ---- growable payload writer ---- */
typedef struct {
  uint8_t *buf;
  size_t len, cap;
  int err; /* EMBER_ENOMEM (sticky) */
} ember_wire_writer;

void ember_wire_writer_init(ember_wire_writer *w);
void ember_wire_writer_free(ember_wire_writer *w);
void ember_wire_write_u8(ember_wire_writer *w, uint8_t v);
void ember_wire_write_u16(ember_wire_writer *w, uint16_t v);
void ember_wire_write_u32(ember_wire_writer *w, uint32_t v);
void ember_wire_write_u64(ember_wire_writer *w, uint64_t v);
void ember_wire_write_str(ember_wire_writer *w, const char *s);
void ember_wire_write_raw(ember_wire_writer *w, const void *p, size_t n);

/* Little-endian helpers for fixed-layout codecs. */
static inline void ember_wire_put_u32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}
static inline uint32_t ember_wire_get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}
static inline void ember_wire_put_u64(uint8_t *p, uint64_t v) {
  ember_wire_put_u32(p, (uint32_t)v);
  ember_wire_put_u32(p + 4, (uint32_t)(v >> 32));
}
static inline uint64_t ember_wire_get_u64(const uint8_t *p) {
  return (uint64_t)ember_wire_get_u32(p) | (uint64_t)ember_wire_get_u32(p + 4) << 32;
}

#ifdef __cplusplus
}
#endif
#endif /* EMBER_WIRE_H */
