/* ember/shm_ring.h - a single-producer single-consumer ring of variable-size
 * messages in shared memory, between two processes (or threads) on one host.
 *
 * The segment.  One side creates the ring: a memfd (anonymous: it never has
 * a name in /dev/shm or anywhere else), mode 0600, sealed against shrinking
 * and growing (so a peer cannot truncate it under us and make our reads
 * fault).  The other side attaches with the descriptor the creator hands it
 * over an authenticated channel: it opens /proc/<creator pid>/fd/<fd> (the
 * kernel allows this to the same user only), checks owner, mode, size and
 * seals, maps it and compares the 32-byte random token in the header with
 * the one it was given.  The memory lives exactly as long as a mapping or an
 * fd of it does: when both processes exit or are killed, however they die,
 * the kernel frees it.  Nothing is ever left behind to clean up.
 *
 * Layout: a 4096-byte header page, then `capacity` data bytes (a multiple of
 * the page size).  The data pages are mapped twice, back to back, so every
 * record is contiguous in virtual memory even where it wraps around the end
 * of the ring: a reservation is one pointer, with no padding records.
 *   header: magic, version, capacity, token (written once by the creator);
 *           head (producer's published position) and the consumer's wake-up
 *           words on one cache line; tail (consumer's released position) and
 *           the producer's wake-up words on another; both sides' states.
 *   records: 16-byte header {u32 len, u16 type, u16 flags, u64 total}, then
 *           len payload bytes, the whole record padded to 16 bytes.
 *           type DATA (flag MORE: a fragment, more of the message follows;
 *           total is the whole message's size in every fragment), END, ERROR
 *           (payload: i32 code, then the reason's bytes).
 * Positions are free-running u64 byte counts; head - tail <= capacity.
 *
 * Large messages are SPLIT, not rejected: ember_shm_ring_send/_sendv cut a
 * message larger than half the ring into fragments and the consumer's
 * ember_shm_ring_read reassembles them into the caller's buffer, so a ring
 * of any size carries messages of any size (bounded by the consumer's
 * max_message).  The zero-copy producer API (reserve/commit) writes one
 * record in place and therefore rejects a message larger than
 * ember_shm_ring_max_record() with EMBER_ETOOBIG naming both sizes.
 *
 * Wake-ups.  A side that must wait (consumer: ring empty; producer: not
 * enough space) announces it in a shared "waiting" word and sleeps on a
 * shared futex word (FUTEX_WAIT on the MAP_SHARED page, not private, so it
 * works across processes); the other side, after publishing a new position,
 * bumps that word and calls FUTEX_WAKE only if the waiter announced itself.
 * So a flowing ring costs no system call at all, and a waiting side does not
 * spin.  A sleeper wakes up every EMBER_SHM_RING_SLICE_MS to check that its
 * peer is still alive: each side holds an OFD lock on one byte of the memfd
 * (byte 0 producer, byte 1 consumer), which the kernel drops when the
 * process dies, even by SIGKILL.  A dead peer is reported as EMBER_ECLOSED
 * ("the consumer process is gone") instead of a hang; so is a peer that
 * closed its side (ember_shm_ring_close / _destroy).
 *
 * Hostile peers.  Every value read from shared memory (positions, record
 * headers) is copied once and bounded before use; a peer that breaks the
 * format gets EMBER_ECORRUPT with a message naming the field, never an
 * out-of-bounds access.  The zero-copy view a consumer gets from next()
 * points into memory the producer can still write: callers that must
 * validate data against a hostile producer copy it out (read()) first.
 *
 * Thread-safety: one thread at a time drives the producer end and one the
 * consumer end; ember_shm_ring_close may be called from any thread at any
 * time (it only sets a flag and wakes the peer and our own sleeper);
 * ember_shm_ring_destroy must not race the other calls on the same handle.
 * Timeouts: a negative timeout_ms means no limit.
 *
 * Forking: a child that inherits a ring's fd keeps the parent's OFD lock
 * alive; children that do not use the ring should close it
 * (ember_shm_ring_fd, close-on-exec is set for exec'd children).
 */
#ifndef EMBER_SHM_RING_H
#define EMBER_SHM_RING_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EMBER_SHM_RING_MIN_BYTES (64u * 1024u)
#define EMBER_SHM_RING_MAX_BYTES (1024u * 1024u * 1024u)
#define EMBER_SHM_RING_RECORD_HDR 16u
#define EMBER_SHM_RING_REASON_MAX 512u
#define EMBER_SHM_RING_SLICE_MS 100

typedef enum { EMBER_SHM_PRODUCER = 0, EMBER_SHM_CONSUMER = 1 } ember_shm_role;

typedef enum {
  EMBER_SHM_MSG_DATA = 1,
  EMBER_SHM_MSG_END = 2,  /* the producer is done; nothing follows */
  EMBER_SHM_MSG_ERROR = 3 /* the producer failed; code and reason say why */
} ember_shm_msg_kind;

typedef struct ember_shm_ring ember_shm_ring;

/* What the attaching side needs; travels over an authenticated channel. */
typedef struct {
  int32_t pid;        /* the creator's process id */
  int32_t fd;         /* the creator's fd of the memfd */
  uint64_t size;      /* segment bytes: 4096 + capacity */
  uint8_t token[32];  /* random, also in the segment's header */
} ember_shm_ring_desc;

/* Creates a ring whose data area holds `capacity` bytes (rounded up to the
 * page size; EMBER_SHM_RING_MIN_BYTES..EMBER_SHM_RING_MAX_BYTES) and maps it;
 * the caller is the `role` end.  EMBER_ESYS if the system has no memfd. */
int ember_shm_ring_create(ember_shm_ring **out, size_t capacity, ember_shm_role role);

/* The descriptor the peer passes to ember_shm_ring_attach. */
void ember_shm_ring_describe(const ember_shm_ring *r, ember_shm_ring_desc *out);

/* A descriptor as the feed (FEED_SHM) and the collectives (COLL_SHM) carry
 * it: u32 pid, u32 fd, u64 size, then the token, little-endian.  Decoding
 * only copies: ember_shm_ring_attach checks every field. */
#define EMBER_SHM_RING_DESC_WIRE_LEN 48u
void ember_shm_ring_desc_encode(const ember_shm_ring_desc *d,
                                uint8_t out[EMBER_SHM_RING_DESC_WIRE_LEN]);
void ember_shm_ring_desc_decode(const uint8_t in[EMBER_SHM_RING_DESC_WIRE_LEN],
                                ember_shm_ring_desc *d);

/* Attaches to a ring described by d, as the other end than its creator
 * (role must differ from the creator's).  EMBER_ENOTFOUND when the segment
 * cannot be opened or is not the one described (another host, another pid
 * namespace, a different user, a gone creator): the caller should fall back
 * to another transport.  EMBER_ESTATE if that end is already attached. */
int ember_shm_ring_attach(ember_shm_ring **out, const ember_shm_ring_desc *d,
                          ember_shm_role role);

/* Data capacity in bytes; the largest single record's payload
 * (capacity - 16, the limit of reserve); the memfd (for fstat in tests). */
size_t ember_shm_ring_capacity(const ember_shm_ring *r);
size_t ember_shm_ring_max_record(const ember_shm_ring *r);
int ember_shm_ring_fd(const ember_shm_ring *r);

/* 1 once both ends have mapped the ring. */
int ember_shm_ring_attached(const ember_shm_ring *r);

/* ---------------------------------------------------------------- producer */

/* Waits (up to timeout_ms) for room for a len-byte message and returns in
 * *out where to write it: 16-byte aligned, contiguous, in ring memory, so an
 * encoder writes straight into the ring.  Nothing is visible to the consumer
 * until commit.  A second reserve before commit replaces the first.
 * EMBER_ETOOBIG if len > ember_shm_ring_max_record (message names both);
 * EMBER_ETIMEDOUT when the ring stays full; EMBER_ECLOSED if the consumer
 * closed its end or died; EMBER_ESTATE after end/fail. */
int ember_shm_ring_reserve(ember_shm_ring *r, size_t len, void **out, int64_t timeout_ms);

/* Publishes the reserved message with its first len bytes (len <= the
 * reserved length) and wakes the consumer if it sleeps. */
int ember_shm_ring_commit(ember_shm_ring *r, size_t len);

/* Copies a message in (gathered from iov), splitting it into fragments when
 * it is larger than half the ring; blocks for space up to timeout_ms overall.
 * On failure part of a split message may be published: the consumer then
 * sees the producer close or end without the rest (its read fails), so a
 * producer whose send failed must not send more. */
int ember_shm_ring_sendv(ember_shm_ring *r, const struct iovec *iov, int iovcnt,
                         int64_t timeout_ms);
int ember_shm_ring_send(ember_shm_ring *r, const void *buf, size_t len, int64_t timeout_ms);

/* Writes the END marker (after everything sent) and wakes the consumer. */
int ember_shm_ring_end(ember_shm_ring *r, int64_t timeout_ms);

/* Writes the ERROR marker: code (a negative EMBER_E*) and reason (cut to
 * EMBER_SHM_RING_REASON_MAX bytes).  The consumer's next() reports it after
 * the messages sent before it. */
int ember_shm_ring_fail(ember_shm_ring *r, int code, const char *reason, int64_t timeout_ms);

/* ---------------------------------------------------------------- consumer */

typedef struct {
  int kind;          /* ember_shm_msg_kind */
  size_t len;        /* DATA: the whole message's bytes */
  const void *data;  /* DATA in one record: its bytes in ring memory (valid
                        until release/read); NULL for a split message */
  int code;          /* ERROR: the producer's status code */
  char reason[EMBER_SHM_RING_REASON_MAX + 1]; /* ERROR: NUL-terminated */
} ember_shm_msg;

/* Waits up to timeout_ms for the next message and describes it in *m without
 * consuming it.  max_message bounds DATA sizes (0 = no bound beyond what
 * fits a size_t): a larger one is EMBER_ETOOBIG naming both sizes.  Calling
 * next again before read/release describes the same message.  END and ERROR
 * are final: every later call returns them again.  EMBER_ECLOSED when the
 * producer closed or died without END; EMBER_ECORRUPT on a malformed record. */
int ember_shm_ring_next(ember_shm_ring *r, ember_shm_msg *m, size_t max_message,
                        int64_t timeout_ms);

/* Copies the current DATA message (every fragment; waits for the producer to
 * write the rest, up to timeout_ms) into buf[0..cap) and consumes it. */
int ember_shm_ring_read(ember_shm_ring *r, void *buf, size_t cap, int64_t timeout_ms);

/* Consumes the current DATA message without copying it (for a split one,
 * waits for and skips every fragment). */
int ember_shm_ring_release(ember_shm_ring *r, int64_t timeout_ms);

/* ---------------------------------------------------------------- stream
 *
 * Non-blocking calls for a caller that moves a byte stream through the ring
 * and does its own waiting, such as the collectives: a rank drives one ring
 * to each neighbour from one loop and sleeps on one doorbell for all of
 * them, so no call here waits, and none writes the last-error message when
 * it only finds no room or no data.  Each record is one DATA message; a
 * consumer may take a record's bytes a few at a time.  Do not mix these
 * calls with the message calls above on one ring. */

/* Producer: reserves one record of as many bytes as fit now, at most max,
 * and returns where to write them in *out and how many in *room (0 when the
 * ring is full: nothing is reserved).  Publish with ember_shm_ring_commit
 * (any length up to *room).  EMBER_ECLOSED if the consumer closed its end;
 * EMBER_ECORRUPT if its position is impossible. */
int ember_shm_ring_try_reserve(ember_shm_ring *r, size_t max, void **out, size_t *room);

/* Consumer: the unconsumed bytes of the record at the read position, in
 * ring memory (*len 0 when nothing is published yet).  The view stays valid
 * until consume.  EMBER_ECLOSED at the producer's END; the producer's code
 * at its ERROR; EMBER_ECORRUPT on a malformed record. */
int ember_shm_ring_peek(ember_shm_ring *r, const void **data, size_t *len);

/* Consumer: marks n of the bytes peek returned as consumed; once a record's
 * last byte is, its space goes back to the producer. */
int ember_shm_ring_consume(ember_shm_ring *r, size_t n);

/* The peer's published position (a consumer sees the producer's head, a
 * producer the consumer's tail).  A caller reads it BEFORE peek or
 * try_reserve; when they find no data or no room, it waits until the
 * position differs from that value (one read after the look could already
 * include the change it waits for). */
uint64_t ember_shm_ring_peer_position(const ember_shm_ring *r);

/* ---------------------------------------------------------------- both */

/* This end will do no more: the peer's waits fail with EMBER_ECLOSED at once,
 * and so do this end's own (a thread blocked in next/reserve returns).  Safe
 * from any thread; idempotent. */
void ember_shm_ring_close(ember_shm_ring *r);

/* Closes (as above), unmaps and closes the fd.  Accepts NULL. */
void ember_shm_ring_destroy(ember_shm_ring *r);

/* Test hook (fuzzing): the mapping of header + data, to play a hostile
 * peer.  Not for production code. */
void *ember__shm_ring_raw(ember_shm_ring *r, size_t *len);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_SHM_RING_H */
