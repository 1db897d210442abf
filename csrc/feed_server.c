/* feed_server.c - the feed server: a poll() loop over an eventfd for
 * wake-ups, the acceptor's descriptors (acceptor.h: the listener and every
 * connection that has not yet authenticated and sent FEED_HELLO) and every
 * producer connection; the consumer pops items from a byte-bounded queue
 * under one mutex (protocol: ember/feed.h).  The codec is batch.c, the
 * client feed_client.c.
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
 * drops the lock around poll() and a producer's recv() only (recv writes into
 * buffers that belong to the loop), and writes with non-blocking sendmsg()
 * under the lock, because a queued RESULTS frame points at the consumer's
 * buffer, which is only guaranteed alive while that consumer waits under the
 * same lock.  The acceptor runs under the lock too (its reads are a few
 * dozen bytes), so its callbacks may touch the server's state.
 */
#include "ember/feed.h"

#include <errno.h>
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

#include "acceptor.h"
#include "ember/auth.h"
#include "ember/error.h"
#include "ember/net.h"
#include "ember/shm_ring.h"
#include "ember/wire.h"
#include "feed_internal.h"
#include "ember/secure.h"

#define FEED_STAGE_LEN 65536u
/* A body read with at least this much left goes straight into the batch
 * buffer, bypassing the staging buffer (no copy on the hot path). */
#define FEED_DIRECT_MIN 16384u
/* Bytes read from one connection per loop turn, so one fast producer cannot
 * starve the others (poll is level-triggered: the rest is read next turn). */
#define FEED_READ_BUDGET (4u * 1024u * 1024u)
/* Producers at once.  Connections still in the handshake are the acceptor's,
 * with a pool of their own (max_pending), so strangers cannot use these up. */
#define FEED_MAX_CONNS 1024u
/* After a REFUSED, keep reading (and discarding) this long before closing,
 * so the peer reads our reason instead of a connection reset. */
#define FEED_LINGER_MS 2000
/* Shared-memory producers at once (one reader thread each); more get TCP. */
#define FEED_MAX_RINGS 64u

/* A connection comes from the acceptor with its FEED_HELLO (C_HELLO only
 * while that is looked at). */
enum { C_HELLO, C_STREAM, C_ENDING, C_DONE, C_LINGER, C_DEAD };
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
  char peer[96];
  ember_sec *sec;   /* the record layer when the job encrypts; NULL in clear.
                       Its receiving half is the loop thread's (read without
                       the lock, like the socket), its sending half is used
                       under mu */
  int64_t deadline; /* flush / linger deadline; 0 = none */
  /* receive state: loop thread only */
  int rx;
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
  size_t hdr_have;
  ember_frame_header fh;
  uint8_t *body;
  size_t body_have;
  /* partition state */
  int helloed;
  uint64_t call;
  uint32_t partition, flags;
  uint32_t call_partitions; /* from the HELLO: this node's partitions of the call */
  int dup;           /* partition already acknowledged: discard its data */
  int acked_ok;      /* END_PARTITION accepted: the partition is delivered
                        (its PARTITION_END is queued; the ACK follows its pop) */
  uint64_t batches;  /* BATCH frames queued for this partition */
  uint64_t records;  /* rows in them */
  uint64_t end_count;
  size_t outstanding; /* queued items not yet popped */
  int shm_asked;      /* FEED_SHM seen (once per connection) */
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
  int wake_fd;
  uint16_t port;
  size_t queue_limit;
  uint32_t max_frame;
  int64_t io_ms;
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
  /* every (call, partition) seen, sorted: whether it started (PARTITION_START
   * queued) and ended (delivered whole), and the records queued by its
   * connections that ended without an END (what a resuming producer skips) */
  struct part_state { uint64_t call; uint32_t partition; uint8_t started, ended;
                      uint32_t call_partitions; /* as its HELLO said (0: not counted) */
                      uint64_t held; } *parts;
  size_t nparts, parts_cap;
  ember_feed_stats stats;
  size_t nrings;
  size_t nproducers; /* connections not C_DEAD, at most FEED_MAX_CONNS */

  /* loop thread only */
  ember__acceptor *acc;
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

/* --- partition and call state: sorted arrays, binary search --- */

static int part_less(const struct part_state *a, uint64_t call, uint32_t p) {
  return a->call < call || (a->call == call && a->partition < p);
}

/* The state of (call, p), NULL when never seen. */
static struct part_state *part_find(const ember_feed_server *s, uint64_t call, uint32_t p,
                                    size_t *at) {
  size_t lo = 0, hi = s->nparts;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (part_less(&s->parts[mid], call, p)) lo = mid + 1;
    else hi = mid;
  }
  if (at) *at = lo;
  return lo < s->nparts && s->parts[lo].call == call && s->parts[lo].partition == p
             ? &s->parts[lo]
             : NULL;
}

/* The state of (call, p), made if new; NULL without memory. */
static struct part_state *part_get(ember_feed_server *s, uint64_t call, uint32_t p) {
  size_t at = 0;
  struct part_state *st = part_find(s, call, p, &at);
  if (st) return st;
  if (s->nparts == s->parts_cap) {
    size_t ncap = s->parts_cap ? s->parts_cap * 2 : 64;
    struct part_state *n = realloc(s->parts, ncap * sizeof *n);
    if (n == NULL) return NULL;
    s->parts = n;
    s->parts_cap = ncap;
  }
  memmove(s->parts + at + 1, s->parts + at, (s->nparts - at) * sizeof *s->parts);
  memset(&s->parts[at], 0, sizeof s->parts[at]);
  s->parts[at].call = call;
  s->parts[at].partition = p;
  s->nparts++;
  return &s->parts[at];
}

static int part_ended(const ember_feed_server *s, uint64_t call, uint32_t p) {
  const struct part_state *st = part_find(s, call, p, NULL);
  return st != NULL && st->ended;
}

static uint64_t held_records(const ember_feed_server *s, uint64_t call, uint32_t p) {
  const struct part_state *st = part_find(s, call, p, NULL);
  return st ? st->held : 0;
}

/* Remembers records of (call, p) queued by a connection that ended without
 * an END.  On ENOMEM the count is lost: a later resume re-sends them
 * (duplicates), the pre-resume behaviour, never a loss. */
static void held_add(ember_feed_server *s, uint64_t call, uint32_t p, uint64_t records) {
  struct part_state *st = part_get(s, call, p);
  if (st) st->held += records;
}

/* A call's partitions are one run of the sorted array: what its HELLOs said
 * the call counts (0: none said), and how many of them ended. */
static uint32_t call_partitions_said(const ember_feed_server *s, uint64_t call) {
  size_t at = 0;
  (void)part_find(s, call, 0, &at);
  for (; at < s->nparts && s->parts[at].call == call; at++)
    if (s->parts[at].call_partitions) return s->parts[at].call_partitions;
  return 0;
}

static uint32_t call_partitions_ended(const ember_feed_server *s, uint64_t call) {
  size_t at = 0;
  uint32_t ended = 0;
  (void)part_find(s, call, 0, &at);
  for (; at < s->nparts && s->parts[at].call == call; at++) ended += s->parts[at].ended;
  return ended;
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
    if (c->sec != NULL) {
      long k = n ? ember_sec_send(c->sec, c->fd, iov, n) : 0;
      if (k < 0) return (int)k; /* the message names the producer */
      if (k == 0) break;
      w = (ssize_t)k;
    } else {
      w = n ? sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT) : 0;
    }
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
  s->nproducers--;
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
  if (queue_status_frame(c, EMBER_MSG_REFUSED, code, reason) != EMBER_OK) {
    conn_kill(s, c);
    return;
  }
  free(c->body);
  c->body = NULL;
  c->state = C_LINGER;
  c->shut_after_flush = 1;
  c->deadline = ember_now_ms() + s->io_ms;
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
    default: return 1; /* EOF must be seen */
  }
}

static void queue_push(ember_feed_server *s, qnode *n) {
  n->next = NULL;
  if (s->qtail) s->qtail->next = n;
  else s->qhead = n;
  s->qtail = n;
  pthread_cond_signal(&s->item_cond);
}

/* "partition 3", or "partition 3 of call 17" for a named call. */
static const char *part_name(const feed_conn *c, char *out, size_t cap) {
  if (c->call == 0) snprintf(out, cap, "partition %u", c->partition);
  else snprintf(out, cap, "partition %u of call %llu", c->partition,
                (unsigned long long)c->call);
  return out;
}

/* Queues a PARTITION_START (data: a copy of data[0..len)), PARTITION_END or
 * CALL_END of c's call, counted in c's outstanding items so that its ACK
 * waits for their pops.  Under s->mu. */
static int queue_event(ember_feed_server *s, feed_conn *c, int kind, const uint8_t *data,
                       size_t len) {
  qnode *n = calloc(1, sizeof *n);
  if (n == NULL) return EMBER_ENOMEM;
  if (len > 0) {
    n->item.data = malloc(len);
    if (n->item.data == NULL) {
      free(n);
      return EMBER_ENOMEM;
    }
    memcpy(n->item.data, data, len);
  }
  n->item.kind = kind;
  n->item.source = c->id;
  n->item.call = c->call;
  n->item.partition = c->partition;
  n->item.flags = c->flags;
  n->item.len = len;
  n->conn = c;
  c->outstanding++;
  s->qbytes += len;
  queue_push(s, n);
  return EMBER_OK;
}

/* FEED_HELLO: u32 partition, u32 flags, u64 call, u32 call_partitions,
 * u32 tag_len, tag. */
static void handle_hello(ember_feed_server *s, feed_conn *c) {
  char why[320], name[64];
  uint32_t tag_len;
  struct part_state *st;
  if (c->fh.length < 24) {
    snprintf(why, sizeof why, "feed: FEED_HELLO payload is %u bytes, expected at least 24",
             c->fh.length);
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  c->partition = ember_wire_get_u32(c->body);
  c->flags = ember_wire_get_u32(c->body + 4);
  c->call = ember_wire_get_u64(c->body + 8);
  c->call_partitions = ember_wire_get_u32(c->body + 16);
  tag_len = ember_wire_get_u32(c->body + 20);
  part_name(c, name, sizeof name);
  if (tag_len > EMBER_FEED_TAG_MAX || c->fh.length != 24 + tag_len) {
    snprintf(why, sizeof why, "feed: FEED_HELLO of %s: tag of %u bytes in a payload of %u "
             "(the tag is at most %u bytes)", name, tag_len, c->fh.length, EMBER_FEED_TAG_MAX);
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  if (c->flags & ~(EMBER_FEED_WANT_RESULTS | EMBER_FEED_RESUME)) {
    snprintf(why, sizeof why, "feed: FEED_HELLO has unknown flags 0x%x", c->flags);
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  if ((c->flags & EMBER_FEED_RESUME) && (c->flags & EMBER_FEED_WANT_RESULTS)) {
    snprintf(why, sizeof why, "feed: FEED_HELLO asks to resume %s with results "
             "(results of the skipped records are gone)", name);
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  if (c->call != 0 && c->call_partitions > 0) {
    uint32_t said = call_partitions_said(s, c->call);
    if (said != 0 && said != c->call_partitions) {
      snprintf(why, sizeof why, "feed: FEED_HELLO of %s says the call has %u partitions for "
               "this node, an earlier one said %u", name, c->call_partitions, said);
      conn_refuse(s, c, EMBER_EPROTO, why);
      return;
    }
  }
  if (c->flags & EMBER_FEED_RESUME) {
    /* The count is only final once every earlier connection of the partition
     * has ended (and its ring reader stopped queueing). */
    for (feed_conn *o = s->conns; o; o = o->next)
      if (o != c && o->helloed && o->call == c->call && o->partition == c->partition &&
          !o->dup && !o->acked_ok && !(o->flags & EMBER_FEED_WANT_RESULTS)) {
        snprintf(why, sizeof why, "feed: %s is still being fed by another connection "
                 "(%s, an earlier attempt of this task?); retry once it has ended",
                 name, o->peer);
        conn_refuse(s, c, EMBER_ESTATE, why);
        return;
      }
  }
  c->helloed = 1;
  if (part_ended(s, c->call, c->partition)) {
    c->dup = 1;
    s->stats.duplicate_partitions++;
  }
  if (c->flags & EMBER_FEED_RESUME) {
    uint8_t frame[EMBER_WIRE_HEADER_LEN + 12];
    ember_wire_encode_header(frame, EMBER_MSG_FEED_RESUME, 12);
    ember_wire_put_u32(frame + EMBER_WIRE_HEADER_LEN, (uint32_t)c->dup);
    ember_wire_put_u64(frame + EMBER_WIRE_HEADER_LEN + 4,
                       c->dup ? 0 : held_records(s, c->call, c->partition));
    if (queue_owned_frame(c, frame, sizeof frame) != EMBER_OK) {
      conn_kill(s, c);
      return;
    }
  }
  /* A named call's partition starts once, before its first batch: a resumed
   * attempt's batches follow the first attempt's. */
  if (c->call != 0 && !c->dup && !s->terminated) {
    st = part_get(s, c->call, c->partition);
    if (st == NULL ||
        (!st->started &&
         queue_event(s, c, EMBER_FEED_ITEM_PARTITION_START, c->body + 24, tag_len) != EMBER_OK)) {
      conn_refuse(s, c, EMBER_ENOMEM, "feed: out of memory queuing a partition's start");
      return;
    }
    st->started = 1;
    st->call_partitions = c->call_partitions;
  }
  c->state = C_STREAM;
  c->deadline = 0;
}

/* Queues a decoded batch of c (body: malloc'd, taken over; cols: its ncols
 * decoded columns, copied into the item so the consumer need not decode the
 * batch again).  Under s->mu. */
static int queue_batch(ember_feed_server *s, feed_conn *c, uint8_t *body, size_t len,
                       const ember_column *cols, uint32_t ncols, uint32_t nrows) {
  qnode *n = calloc(1, sizeof *n);
  ember_column *copy = malloc(sizeof *copy * (ncols ? ncols : 1));
  if (n == NULL || copy == NULL) {
    free(n);
    free(copy);
    free(body);
    return EMBER_ENOMEM;
  }
  if (ncols) memcpy(copy, cols, sizeof *copy * ncols);
  n->item.cols = copy;
  n->item.ncols = ncols;
  n->item.nrows = nrows;
  n->item.kind = EMBER_FEED_ITEM_BATCH;
  n->item.source = c->id;
  n->item.call = c->call;
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
  n->item.call = c->call;
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
  if (queue_batch(s, c, body, c->fh.length, s->cols, nc, nr) != EMBER_OK)
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
    if (queue_batch(s, c, body, m.len, cols, nc, nr) != EMBER_OK) {
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
  const uint8_t *host = NULL, *desc = NULL;
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
  ember_wire_read_raw(&r, &desc, EMBER_SHM_RING_DESC_WIRE_LEN);
  if (ember_wire_reader_finish(&r, 1, "FEED_SHM") != EMBER_OK) {
    snprintf(why, sizeof why, "feed: %s", ember_last_error());
    conn_refuse(s, c, EMBER_EPROTO, why);
    return;
  }
  ember_shm_ring_desc_decode(desc, &d);
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
    n->item.call = c->call;
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
  uint32_t max = c->state == C_STREAM ? s->max_frame : FEED_CTL_MAX;
  int rc = ember_wire_decode_header(c->hdr, EMBER_WIRE_HEADER_LEN, max, &c->fh);
  if (rc != EMBER_OK) {
    snprintf(why, sizeof why, "feed: bad frame from %s: %s", c->peer, ember_last_error());
    conn_refuse(s, c, rc, why);
    return;
  }
  switch (c->state) {
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
    if (c->sec != NULL) {
      long k = ember_sec_recv(c->sec, c->fd, dst, cap);
      n = k > 0 ? (ssize_t)k : k == 0 ? -1 : 0;
      err = k == 0 ? EAGAIN : 0;
      if (k < 0 && k != EMBER_ECLOSED) {
        /* Altered in transit (or a socket error): said once, in the log,
         * naming the producer; nothing of the record was delivered. */
        char line[768];
        snprintf(line, sizeof line, "feed server: producer %s dropped: %s", c->peer,
                 ember_last_error());
        pthread_mutex_lock(&s->mu);
        s->log_fn(s->log_arg, line);
        if (c->state != C_DEAD) conn_eof(s, c);
        break;
      }
    } else {
      n = recv(c->fd, dst, cap, MSG_DONTWAIT);
      err = errno;
    }
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

/* The acceptor hands over an authenticated connection with its FEED_HELLO.
 * Under s->mu, as every acceptor callback (feed_loop runs it locked). */
static void on_accepted(void *arg, ember__accepted *a) {
  ember_feed_server *s = arg;
  feed_conn *c = calloc(1, sizeof *c);
  if (c == NULL) {
    s->stats.producers_rejected++;
    ember_net_close(a->fd);
    free(a->payload);
    return;
  }
  c->fd = a->fd;
  c->srv = s;
  c->id = ++s->next_id;
  c->state = C_HELLO;
  c->rx = RX_HDR;
  memcpy(c->peer, a->peer, sizeof c->peer);
  c->next = s->conns;
  s->conns = c;
  s->nconns++;
  s->nproducers++;
  c->fh = a->first;
  c->body = a->payload;
  c->sec = a->sec;
  if (s->nproducers > FEED_MAX_CONNS) {
    char why[128];
    snprintf(why, sizeof why, "feed: %u producers are connected already (the limit)",
             FEED_MAX_CONNS);
    conn_refuse(s, c, EMBER_ESTATE, why);
  } else {
    handle_hello(s, c);
  }
  free(c->body);
  c->body = NULL;
}

/* Every connection the acceptor ended counts as a rejected producer. */
static void on_rejected(void *arg, const char *peer, int authed, const char *reason) {
  ember_feed_server *s = arg;
  s->stats.producers_rejected++;
}

/* Strangers, rate-limited, to the config's log. */
static void on_log(void *arg, const char *line, uint64_t count) {
  ember_feed_server *s = arg;
  s->log_fn(s->log_arg, line);
}

/* c's END_PARTITION, with every batch queued: checks the count, then (named
 * call) queues PARTITION_END and, when it completes the call, CALL_END, and
 * records the partition as delivered.  Returns the ACK's status (why: its
 * reason).  Under s->mu. */
static int end_partition(ember_feed_server *s, feed_conn *c, char *why, size_t cap) {
  char name[64];
  struct part_state *st;
  part_name(c, name, sizeof name);
  if (c->end_count != c->records) {
    snprintf(why, cap, "%s: END_PARTITION says %llu records, the node received %llu", name,
             (unsigned long long)c->end_count, (unsigned long long)c->records);
    return EMBER_EPROTO;
  }
  if (part_ended(s, c->call, c->partition)) {
    /* another connection of the partition, open at the same time, ended it
     * first (its batches were delivered too: no dedup without RESUME) */
    c->acked_ok = 1;
    return EMBER_OK;
  }
  st = part_get(s, c->call, c->partition);
  if (st == NULL ||
      (c->call != 0 && queue_event(s, c, EMBER_FEED_ITEM_PARTITION_END, NULL, 0) != EMBER_OK)) {
    snprintf(why, cap, "out of memory recording %s", name);
    return EMBER_ENOMEM;
  }
  st->ended = 1;
  c->acked_ok = 1;
  s->stats.partitions_acked++;
  if (c->call != 0 && c->call_partitions > 0 &&
      call_partitions_ended(s, c->call) == c->call_partitions &&
      queue_event(s, c, EMBER_FEED_ITEM_CALL_END, NULL, 0) != EMBER_OK) {
    snprintf(why, cap, "out of memory ending call %llu", (unsigned long long)c->call);
    return EMBER_ENOMEM;
  }
  return EMBER_OK;
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
      char why[200];
      int st = EMBER_OK, ready = 1;
      why[0] = '\0';
      if (s->terminated) {
        st = EMBER_EABORTED;
        snprintf(why, sizeof why, "trainer terminated the feed");
      } else if (c->ring && !c->ring_ended) {
        ready = 0; /* the reader has not reached the ring's END marker yet */
      } else if (c->dup) {
        /* already delivered by an earlier connection; data discarded */
      } else if (!c->acked_ok) {
        /* Every batch is queued (TCP: END_PARTITION follows them; ring: the
         * reader passed END), so the count is final. */
        st = end_partition(s, c, why, sizeof why);
        ready = st != EMBER_OK || c->outstanding == 0;
      } else {
        ready = c->outstanding == 0; /* the ACK waits for the consumer's pops */
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
    if (c->deadline && now >= c->deadline) conn_kill(s, c);
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
      held_add(s, c->call, c->partition, c->records);
    *pp = c->next;
    s->nconns--;
    if (c->outstanding)
      for (qnode *n = s->qhead; n; n = n->next)
        if (n->conn == c) n->conn = NULL;
    ember_sec_destroy(c->sec);
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
    /* [0] the wake eventfd, [1, base) the acceptor's, [base, n) producers */
    size_t base = 1 + ember__acceptor_npoll(s->acc), n = base, need = base + s->nconns;
    int64_t now = ember_now_ms(), next_deadline;
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
    s->pfds[0] = (struct pollfd){.fd = s->wake_fd, .events = POLLIN};
    ember__acceptor_poll_fill(s->acc, s->pfds + 1);
    next_deadline = ember__acceptor_due(s->acc);
    int decrypted = 0; /* a producer has decrypted bytes the socket may not show */
    for (feed_conn *c = s->conns; c; c = c->next) {
      short ev = 0;
      if (c->state == C_DEAD) continue;
      if (conn_wants_read(s, c)) ev |= POLLIN;
      if ((ev & POLLIN) && ember_sec_pending(c->sec) > 0) decrypted = 1;
      if (c->outq) ev |= POLLOUT;
      s->pconns[n] = c;
      s->pfds[n++] = (struct pollfd){.fd = c->fd, .events = ev};
      if (c->deadline && c->deadline < next_deadline) next_deadline = c->deadline;
    }
    if (decrypted) timeout = 0;
    else if (next_deadline == INT64_MAX) timeout = -1;
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
    if (decrypted)
      for (size_t i = base; i < n; i++) {
        feed_conn *c = s->pconns[i];
        if (c->state != C_DEAD && ember_sec_pending(c->sec) > 0 && conn_wants_read(s, c))
          s->pfds[i].revents |= POLLIN;
      }
    if (rc > 0 || decrypted) {
      if (s->pfds[0].revents) {
        uint64_t v;
        ssize_t r = read(s->wake_fd, &v, sizeof v);
        (void)r;
      }
      for (size_t i = base; i < n; i++) {
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
    }
    /* Pending handshakes, new connections (on_accepted), their deadlines and
     * the rate-limited report of strangers (on_log). */
    ember__acceptor_run(s->acc, s->pfds + 1);
    loop_progress(s);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

static void free_queue(ember_feed_server *s) {
  qnode *n = s->qhead, *nx;
  for (; n; n = nx) {
    nx = n->next;
    if (n->conn) n->conn->outstanding--;
    ember_feed_item_free(&n->item); /* frees n: the item is its first member */
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
  ember__acceptor_destroy(s->acc); /* and the report of what it last counted */
  for (c = s->conns; c; c = nx) {
    nx = c->next;
    ember_shm_ring_destroy(c->ring);
    ember_sec_destroy(c->sec);
    free(c);
  }
  s->conns = NULL;
  for (qnode *n = s->qhead; n; n = n->next) n->conn = NULL;
  free_queue(s);
  ember_net_close(s->wake_fd);
  pthread_cond_destroy(&s->item_cond);
  pthread_cond_destroy(&s->out_cond);
  pthread_cond_destroy(&s->space_cond);
  pthread_mutex_destroy(&s->mu);
  free(s->parts);
  free(s->pfds);
  free(s->pconns);
  free(s);
}

int ember_feed_server_create(ember_feed_server **out, const ember_feed_server_config *cfg) {
  ember_feed_server *s = NULL;
  pthread_condattr_t ca;
  int rc = EMBER_OK, fd = cfg ? cfg->listen_fd : -1, inited = 0;

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
  s->wake_fd = -1;
  s->queue_limit = cfg->queue_bytes ? cfg->queue_bytes : FEED_DEFAULT_QUEUE;
  s->max_frame = cfg->max_frame ? cfg->max_frame : FEED_DEFAULT_MAX_FRAME;
  if (s->max_frame > EMBER_WIRE_ABSOLUTE_MAX) s->max_frame = EMBER_WIRE_ABSOLUTE_MAX;
  s->io_ms = cfg->io_timeout_ms ? cfg->io_timeout_ms : FEED_DEFAULT_IO_MS;
  s->log_fn = cfg->log_fn ? cfg->log_fn : ember__log_stderr;
  s->log_arg = cfg->log_fn ? cfg->log_arg : NULL;
  s->shm_enabled = !cfg->disable_shm && ember__feed_env_shm_enabled();
  ember__feed_host_id(s->host_id);

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
  {
    ember__acceptor_config acfg = {
        .listen_fd = fd, .bind_host = cfg->bind_host, .port = cfg->port,
        .secret = cfg->secret, .secret_len = cfg->secret_len, .encrypt = cfg->encrypt,
        /* strangers get a short deadline, never longer than the I/O timeout */
        .preauth_timeout_ms = cfg->preauth_timeout_ms, .preauth_cap_ms = (uint32_t)s->io_ms,
        .max_pending = cfg->max_pending, .first_type = EMBER_MSG_FEED_HELLO,
        .first_max = FEED_CTL_MAX, .refuse_first = 1, .name = "feed server", .arg = s,
        .ready = on_accepted, .rejected = on_rejected, .log = on_log};
    fd = -1; /* the acceptor's now, even if it fails */
    rc = ember__acceptor_create(&s->acc, &acfg);
    if (rc != EMBER_OK) goto cleanup;
    s->port = ember__acceptor_port(s->acc);
  }
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
      ember_net_close(s->wake_fd);
      free(s);
    }
  }
  return rc;
}

uint16_t ember_feed_server_port(const ember_feed_server *s) { return s ? s->port : 0; }

int ember_feed_server_next(ember_feed_server *s, ember_feed_item **out, int64_t timeout_ms) {
  int64_t deadline = ember__feed_deadline(timeout_ms);
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
  free(item->cols);
  free(item->data);
  free(item); /* item is the first member of its qnode */
}

int ember_feed_server_send_results(ember_feed_server *s, uint64_t source, const uint8_t *batch,
                                   size_t len, int64_t timeout_ms) {
  int64_t deadline = ember__feed_deadline(timeout_ms);
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
