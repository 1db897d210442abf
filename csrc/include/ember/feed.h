/* ember/feed.h - the data feed: columnar batches from Spark tasks to a trainer.
 *
 * A node's trainer runs one feed server on its reserved feed port.  Feeding
 * tasks (producers) connect, authenticate with the job secret (auth.h), send
 * FEED_HELLO(partition, flags), then BATCH frames, then END_PARTITION(count).
 * The server's thread reads frames from any number of producers at once into a
 * bounded in-memory queue; when the queue is full it stops reading, so TCP
 * back-pressure blocks the producers (each send has a deadline).  The consumer
 * (the trainer) pops items with ember_feed_server_next.
 *
 * Delivery: END_PARTITION is answered with ACK only once every batch of that
 * connection has been popped by the consumer and the count matches, so a
 * producer that saw ACK(EMBER_OK) knows its partition was delivered whole.
 * A partition id that was already acknowledged in this server's life is
 * answered ACK(EMBER_OK) without being queued again (a retried task must not
 * duplicate data); its batches are discarded.
 * If the consumer called ember_feed_server_terminate, producers get
 * ACK(EMBER_EABORTED, "trainer terminated the feed") and their data is dropped
 * (TensorFlowOnSpark's terminate semantics).
 *
 * Results (inference): a producer that set EMBER_FEED_WANT_RESULTS receives
 * RESULTS frames, each an encoded batch, sent by the consumer with
 * ember_feed_server_send_results(item->source, ...), in the order sent.
 *
 * END_FEED (sent by the driver through a client with ember_feed_client_end_feed)
 * queues an EMBER_FEED_ITEM_END after everything already queued.
 *
 * Shared memory (same host).  Before its first BATCH a client offers the
 * server a shared-memory ring (shm_ring.h) over the authenticated connection:
 * FEED_SHM(host id, pid, fd, size, token).  The host id is the kernel's boot
 * id, so both ends agree they run on one host whatever address was dialled;
 * the server attaches (it opens the client's memfd through /proc, checks
 * owner, mode 0600, size, seals and the token) and answers FEED_SHM_REPLY:
 * status 0 means every BATCH payload of this connection now goes through the
 * ring, anything else (another host, another pid namespace, shared memory
 * disabled, too many rings) means TCP as before, with the reason.  The TCP
 * connection stays open for everything else: END_PARTITION, ACK, REFUSED,
 * RESULTS, END_FEED.  The client writes an END marker into the ring before
 * END_PARTITION, and the server acknowledges only after its ring reader has
 * queued every batch up to that marker, so delivery, dedup, terminate and
 * result semantics are the same on both transports.  One ring per producer
 * connection, read by its own server thread, so several producers feed one
 * node at once.  The consumer API is unchanged: the ring reader copies each
 * batch once out of the ring into a malloc'd item (the only copy on the
 * consumer side), which keeps item lifetimes independent of the ring and
 * means a batch is validated in memory the producer can no longer change.
 * The producer side makes no copy beyond the one into the ring: batches that
 * fit half the ring are encoded in place (reserve/commit), larger ones are
 * gathered from the caller's columns into split messages.
 * EMBER_FEED_SHM=0 in the environment turns shared memory off (the server
 * declines, clients do not offer); EMBER_FEED_SHM_BYTES sets the clients'
 * default ring size (16 MiB).  A producer that dies, a consumer that
 * terminates or a server that is destroyed is noticed through the ring at
 * once (no hang): see ember_feed_client_send.
 *
 * Strangers: the server reads AUTH from every new connection at once, in its
 * poll loop; a connection that has not authenticated and sent FEED_HELLO
 * within preauth_timeout_ms (3 s) is closed, at most max_pending of them are
 * kept (a new one evicts the oldest), and they never count against the
 * authenticated producers' limit; rejections are logged rate-limited (see
 * ember_log_fn).  A client whose pending connection was evicted reconnects.
 *
 * Timeouts: a negative timeout_ms means no limit.  Thread-safety: the codec is
 * pure; server calls other than destroy may run concurrently from any
 * threads; a client is used by one thread at a time (send also reads the
 * socket, to notice a REFUSED early).
 */
#ifndef EMBER_FEED_H
#define EMBER_FEED_H

#include <stddef.h>
#include <stdint.h>

#include "ember/net.h" /* ember_log_fn */

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------ batch codec
 * An encoded batch (payload of BATCH and RESULTS):
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

/* ------------------------------------------------------------ server */

#define EMBER_FEED_WANT_RESULTS 1u
/* Resume a partition an earlier attempt fed part of (a retried Spark task).
 * The node keeps, per partition, the records it queued from connections that
 * ended without an ACK (those batches are still delivered to the trainer),
 * and answers this HELLO with FEED_RESUME: how many records of the partition
 * it already holds, or that the partition was delivered whole.  The producer
 * skips that many records of its (deterministic) partition and sends the
 * rest, so a task that failed half-way and is retried delivers every record
 * exactly once.  Only one connection at a time may feed a partition with
 * this flag: while an earlier one is still open the HELLO is refused with
 * EMBER_ESTATE (its task fails and Spark retries it later).  Not for
 * WANT_RESULTS: results of the skipped records went to the dead connection. */
#define EMBER_FEED_RESUME 2u

typedef enum {
  EMBER_FEED_ITEM_BATCH = 1, /* data = an encoded batch */
  EMBER_FEED_ITEM_END = 2,   /* END_FEED: no more data will come */
  EMBER_FEED_ITEM_ERROR = 3  /* a producer failed (FEED_ERROR or a ring ERROR
                                marker): data = its reason, NUL-terminated, len
                                without the NUL; after the batches it sent */
} ember_feed_item_kind;

typedef struct {
  int kind;
  uint64_t source;    /* producer connection id, for send_results */
  uint32_t partition; /* from the producer's FEED_HELLO */
  uint32_t flags;     /* the producer's FEED_HELLO flags */
  uint8_t *data;      /* encoded batch (8-aligned malloc), owned by the item */
  size_t len;
} ember_feed_item;

typedef struct {
  const uint8_t *secret;
  size_t secret_len;
  int listen_fd;        /* an already-bound socket to listen on (the reserved
                           feed port), or -1 to bind bind_host:port */
  const char *bind_host;
  uint16_t port;
  size_t queue_bytes;   /* queued payload bytes before back-pressure; 0 = 64 MiB */
  uint32_t max_frame;   /* largest BATCH accepted; 0 = 256 MiB */
  uint32_t io_timeout_ms; /* deadline for one blocked send/handshake; 0 = 600000 */
  int disable_shm;      /* 1: decline shared-memory rings (TCP only); 0: accept
                           them unless EMBER_FEED_SHM=0 in the environment */
  uint32_t preauth_timeout_ms; /* from accept to AUTH and FEED_HELLO (capped by
                           io_timeout_ms); 0 = EMBER_PREAUTH_TIMEOUT_MS or 3000 */
  uint32_t max_pending; /* unauthenticated connections kept at once; the oldest
                           is evicted for a new one; 0 = EMBER_PREAUTH_MAX_PENDING
                           or 512.  Authenticated producers are counted apart
                           (at most 1024) and never evicted. */
  ember_log_fn log_fn;  /* rejected strangers, rate-limited (net.h); NULL: stderr */
  void *log_arg;
} ember_feed_server_config;

typedef struct ember_feed_server ember_feed_server;

/* Takes ownership of cfg->listen_fd; starts the server thread. */
int ember_feed_server_create(ember_feed_server **out, const ember_feed_server_config *cfg);
uint16_t ember_feed_server_port(const ember_feed_server *s);

/* Pops the next item, waiting up to timeout_ms (EMBER_ETIMEDOUT if none).
 * The caller owns *out and frees it with ember_feed_item_free.  After an END
 * item has been returned, further calls return another END at once. */
int ember_feed_server_next(ember_feed_server *s, ember_feed_item **out, int64_t timeout_ms);
void ember_feed_item_free(ember_feed_item *item); /* accepts NULL */

/* Sends one RESULTS frame (an encoded batch) to producer `source`; blocks up
 * to timeout_ms for socket space.  EMBER_ENOTFOUND if that producer is gone. */
int ember_feed_server_send_results(ember_feed_server *s, uint64_t source,
                                   const uint8_t *batch, size_t len, int64_t timeout_ms);

/* The consumer will read no more: drops queued items and makes producers'
 * END_PARTITION answer EMBER_EABORTED. */
int ember_feed_server_terminate(ember_feed_server *s);

/* Counters since creation (for progress and tests). */
typedef struct {
  uint64_t batches_received, records_received, bytes_received;
  uint64_t partitions_acked, duplicate_partitions, producers_rejected;
  uint64_t shm_producers; /* connections whose batches came through a ring */
} ember_feed_stats;
void ember_feed_server_stats(ember_feed_server *s, ember_feed_stats *out);

void ember_feed_server_destroy(ember_feed_server *s); /* accepts NULL */

/* ------------------------------------------------------------ client */

typedef struct ember_feed_client ember_feed_client;

/* Connects, authenticates, sends FEED_HELLO(partition, flags). */
int ember_feed_client_connect(ember_feed_client **out, const char *host, uint16_t port,
                              const uint8_t *secret, size_t secret_len,
                              uint32_t partition, uint32_t flags, int64_t timeout_ms);

typedef enum {
  EMBER_FEED_SHM_AUTO = 0, /* shared memory if the node is on this host, unless
                              the environment says EMBER_FEED_SHM=0 */
  EMBER_FEED_SHM_OFF = 1,  /* TCP only */
  EMBER_FEED_SHM_ON = 2    /* shared memory if the node is on this host,
                              whatever the environment says */
} ember_feed_shm_mode;

typedef struct {
  int shm;          /* ember_feed_shm_mode */
  size_t shm_bytes; /* ring capacity; 0 = EMBER_FEED_SHM_BYTES, else 16 MiB */
} ember_feed_client_options;

/* ember_feed_client_connect with options (opts NULL = defaults).  The ring is
 * negotiated lazily, by the first send, so a connection that only ends the
 * feed or an empty partition never creates one. */
int ember_feed_client_connect_ex(ember_feed_client **out, const char *host, uint16_t port,
                                 const uint8_t *secret, size_t secret_len,
                                 uint32_t partition, uint32_t flags,
                                 const ember_feed_client_options *opts, int64_t timeout_ms);

/* With EMBER_FEED_RESUME in the HELLO flags: the records of this partition
 * the node already holds (skip them), and whether the partition was already
 * delivered whole (*delivered = 1: send nothing, end_partition answers OK).
 * Both are 0 without the flag. */
void ember_feed_client_resume_point(const ember_feed_client *c, uint64_t *records,
                                    int *delivered);

/* Encodes and sends one BATCH.  Over TCP: header and columns in one writev
 * (no copy of the column data).  Over shared memory: encoded straight into
 * the ring (or gathered into it for batches over half the ring), blocking up
 * to timeout_ms for room (EMBER_ETIMEDOUT); if the node stops reading
 * (terminate, a refused batch, a destroyed server, a killed trainer) the
 * call fails at once with the node's reason (the REFUSED status when one
 * came, else EMBER_ECLOSED). */
int ember_feed_client_send(ember_feed_client *c, const ember_column *cols,
                           uint32_t ncols, uint32_t nrows, int64_t timeout_ms);

/* 1 once batches of this connection go through a shared-memory ring, 0 for
 * TCP (or before the first send decided). */
int ember_feed_client_uses_shm(const ember_feed_client *c);

/* The producer cannot finish its partition: sends FEED_ERROR(reason) (as a
 * ring ERROR marker after the batches already in the ring, when there is
 * one).  The node drops the connection without an ACK, keeping the batches
 * sent before; the client is unusable afterwards. */
int ember_feed_client_fail(ember_feed_client *c, const char *reason, int64_t timeout_ms);

/* Receives the next RESULTS frame; *batch is malloc'd (caller frees). */
int ember_feed_client_recv_results(ember_feed_client *c, uint8_t **batch, size_t *len,
                                   int64_t timeout_ms);

/* Sends END_PARTITION(records sent) and waits for the ACK.  EMBER_OK when the
 * whole partition was delivered; EMBER_EABORTED if the trainer terminated the
 * feed; EMBER_ECLOSED if the node went away. */
int ember_feed_client_end_partition(ember_feed_client *c, int64_t timeout_ms);

/* Sends END_FEED (driver only). */
int ember_feed_client_end_feed(ember_feed_client *c, int64_t timeout_ms);

void ember_feed_client_destroy(ember_feed_client *c); /* accepts NULL */

#ifdef __cplusplus
}
#endif
#endif /* EMBER_FEED_H */
