/* ember/feed.h - the data feed: columnar batches from Spark tasks to a trainer.
 *
 * A node's trainer runs one feed server on its reserved feed port.  Feeding
 * tasks (producers) connect, authenticate with the job secret (auth.h), send
 * FEED_HELLO(partition, flags, call, call_partitions, tag), then BATCH frames,
 * then END_PARTITION(count).
 *
 * Calls.  A feed carries any number of calls (a driver's train() or
 * inference()), each named by a 64-bit call id in the HELLO, and each made of
 * partitions 0..2^32-1.  Every partition state below (delivered, resumed,
 * duplicate) is per (call, partition).  Call 0 is anonymous: its partitions
 * are batches only.  For a named call (id != 0) the consumer also gets
 *   - PARTITION_START(call, partition, tag) before the partition's first
 *     batch (once per partition, not again for a resumed attempt): the tag is
 *     the producer's description of the partition, opaque to the feed (up to
 *     EMBER_FEED_TAG_MAX bytes);
 *   - PARTITION_END(call, partition) after its last batch, once the
 *     partition was delivered whole (END_PARTITION with the right count);
 *   - CALL_END(call) right after the PARTITION_END that completes the call,
 *     when the HELLOs said how many partitions this node gets in the call
 *     (call_partitions > 0; every HELLO of a call must say the same).
 * So a consumer knows where each call and partition ends from the feed
 * itself, in order with the data, whatever the number of calls.
 * The server's thread reads frames from any number of producers at once into a
 * bounded in-memory queue; when the queue is full it stops reading, so TCP
 * back-pressure blocks the producers (each send has a deadline).  The consumer
 * (the trainer) pops items with ember_feed_server_next.
 *
 * Delivery: END_PARTITION is answered with ACK only once every batch of that
 * connection (and its PARTITION_END, CALL_END) has been popped by the
 * consumer and the count matches, so a producer that saw ACK(EMBER_OK) knows
 * its partition was delivered whole.  A (call, partition) whose END_PARTITION
 * was already accepted in this server's life is answered ACK(EMBER_OK)
 * without being queued again (a retried task must not duplicate data); its
 * batches are discarded.
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
 * default ring size (1 MiB).  A producer that dies, a consumer that
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

#include "ember/batch.h" /* the batch codec: ember_column, ember_batch_* */
#include "ember/net.h"   /* ember_log_fn */

#ifdef __cplusplus
extern "C" {
#endif

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

/* Largest partition tag in a FEED_HELLO. */
#define EMBER_FEED_TAG_MAX 1024u

typedef enum {
  EMBER_FEED_ITEM_BATCH = 1, /* data = an encoded batch */
  EMBER_FEED_ITEM_END = 2,   /* END_FEED: no more data will come */
  EMBER_FEED_ITEM_ERROR = 3, /* a producer failed (FEED_ERROR or a ring ERROR
                                marker): data = its reason, NUL-terminated, len
                                without the NUL; after the batches it sent */
  EMBER_FEED_ITEM_PARTITION_START = 4, /* named calls only: data = the tag (may
                                be empty, then NULL) */
  EMBER_FEED_ITEM_PARTITION_END = 5, /* named calls only: delivered whole */
  EMBER_FEED_ITEM_CALL_END = 6 /* named calls with call_partitions: every
                                partition of the call for this node ended */
} ember_feed_item_kind;

typedef struct {
  int kind;
  uint64_t source;    /* producer connection id, for send_results */
  uint64_t call;      /* from the producer's FEED_HELLO (0: anonymous) */
  uint32_t partition; /* from the producer's FEED_HELLO */
  uint32_t flags;     /* the producer's FEED_HELLO flags */
  uint8_t *data;      /* encoded batch (8-aligned malloc), owned by the item */
  size_t len;
  /* BATCH: the batch as the server decoded (and validated) it, pointing into
   * data, so the consumer need not decode it again; NULL/0 for other kinds */
  ember_column *cols; /* ncols entries, owned by the item */
  uint32_t ncols, nrows;
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
  ember_log_fn log_fn;  /* rejected strangers, rate-limited (net.h), and a
                           producer dropped because its data was altered in
                           transit; NULL: stderr */
  void *log_arg;
  int encrypt;          /* 1: producers' TCP connections are encrypted and
                           authenticated records (secure.h); a producer in
                           clear is refused, and so is an encrypting one
                           when 0.  Shared-memory rings stay in clear. */
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

/* Connects, authenticates, sends FEED_HELLO(partition, flags) for the
 * anonymous call 0 (see connect_ex for named calls). */
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
  size_t shm_bytes; /* ring capacity; 0 = EMBER_FEED_SHM_BYTES, else 1 MiB */
  uint64_t call;    /* the call this partition belongs to; 0 = anonymous */
  uint32_t call_partitions; /* partitions of the call this node gets; 0 =
                               not counted (no CALL_END) */
  const uint8_t *tag; /* the partition's description (PARTITION_START) */
  size_t tag_len;     /* 0..EMBER_FEED_TAG_MAX */
  int encrypt;        /* 1: the connection is encrypted (secure.h); must
                         match the server's ember_feed_server_config.encrypt */
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

/* Where begin_batch puts one column: its data, and for a BYTES column its
 * nrows + 1 offsets (little-endian uint64, 8-aligned; NULL for the others). */
typedef struct {
  void *data;
  uint64_t *offsets;
} ember_batch_place;

/* Sends one BATCH written in place, for a producer that builds the columns
 * itself and would otherwise build them once in its own memory and then
 * copy them here.  begin_batch lays the batch out from cols' shapes alone
 * (dtype, width, name, data_len; their data and offsets are ignored) and sets
 * places[i] to where column i goes: ring memory when the batch fits half the
 * connection's ring (waiting up to timeout_ms for room), else the client's
 * own buffer (TCP, or a larger batch, which commit splits through the ring).
 * The caller fills every byte of each place, then commit_batch checks the
 * offsets and BOOL values as send does and sends the batch; or cancel_batch
 * (or send, end_partition, end_feed, fail) drops it and nothing is sent.  A failed commit sends
 * nothing either, unless it failed sending (the client is broken then, as
 * after a failed send).  No other call may run between begin and commit. */
int ember_feed_client_begin_batch(ember_feed_client *c, const ember_column *cols,
                                  uint32_t ncols, uint32_t nrows, ember_batch_place *places,
                                  int64_t timeout_ms);
int ember_feed_client_commit_batch(ember_feed_client *c, int64_t timeout_ms);
void ember_feed_client_cancel_batch(ember_feed_client *c); /* accepts NULL */
/* The largest batch begin_batch writes in place, straight into the ring
 * (half the ring less a record header); 0 over TCP, or before the first
 * batch decided the transport.  A producer that cuts its own batches keeps
 * them under it so that each is written once and the node reads one while
 * the next is written. */
size_t ember_feed_client_in_place_max(const ember_feed_client *c);

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
 * feed; EMBER_ECLOSED if the node went away.  The same as _send then _wait. */
int ember_feed_client_end_partition(ember_feed_client *c, int64_t timeout_ms);

/* The two halves of end_partition.  The node acknowledges a partition only
 * once its trainer has read all of it, so a producer with more partitions
 * for the same node sends the end of one, feeds the next on a connection of
 * its own, and only then waits for the first's ACK: the trainer never finds
 * the node's queue drained at a partition boundary.  After _send the client
 * takes nothing but _wait (or destroy); _wait answers as end_partition does. */
int ember_feed_client_end_partition_send(ember_feed_client *c, int64_t timeout_ms);
int ember_feed_client_end_partition_wait(ember_feed_client *c, int64_t timeout_ms);

/* Sends END_FEED (driver only). */
int ember_feed_client_end_feed(ember_feed_client *c, int64_t timeout_ms);

void ember_feed_client_destroy(ember_feed_client *c); /* accepts NULL */

#ifdef __cplusplus
}
#endif
#endif /* EMBER_FEED_H */
