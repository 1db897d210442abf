/* collective.c - allreduce, broadcast, allgather and barrier over a mesh of
 * authenticated TCP connections, with shared-memory rings (shm_ring.h)
 * between ranks on the same host (see collective.h for the contract).
 *
 * File order:
 *   1. reduction kernels (GCC/clang vector extensions: SSE2-wide, any
 *      alignment, vectorized whatever the -O level);
 *   2. shared memory: rings and doorbells;
 *   3. channels: one non-blocking send and one non-blocking receive primitive
 *      over either transport;
 *   4. the step engine: runs a list of (send region, receive region) steps
 *      against one peer to send to and one to receive from, overlapping the
 *      two on one thread, with the send of a step gated on how much of an
 *      earlier step's receive has been reduced (this is the pipelining);
 *   5. the algorithms (ring, recursive doubling, chain) on top of it;
 *   6. communicator set-up (mesh, auth, shared-memory negotiation).
 *
 * Why one thread and no helper: a blocked send and a blocked receive are both
 * waited for in one poll() (or one futex for shared memory), so the process
 * never stops sending while it reduces, and there is no thread handoff on the
 * hot path.  Why rings in shared memory rather than one shared buffer per
 * rank: a ring is a bounded SPSC stream, so the ring algorithm is the same
 * code on both transports, data passes through the cache-resident ring
 * (one copy in by the sender, the receiver reduces straight out of it) and a
 * ring of a few MiB serves buffers of any size.
 */
#include "ember/collective.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ember/auth.h"
#include "ember/error.h"
#include "ember/net.h"
#include "ember/shm_ring.h"
#include "ember/wire.h"
#include "preauth.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libember's collectives move elements in host order: little-endian only"
#endif

#define COLL_MAGIC 0x4C4F4345u   /* bytes 'E' 'C' 'O' 'L' */
#define INBOX_MAGIC 0x584F424E494C4F43ull /* "COLINBOX" */
#define OPHDR_LEN 24u
/* A message's header is padded to the next 64-byte boundary of its
 * connection's stream (OPHDR_MAX at most), so that every payload starts on
 * one: see hdr_len. */
#define STREAM_ALIGN 64u
#define OPHDR_MAX (OPHDR_LEN + STREAM_ALIGN - 1u)
#define HOST_CAP 256u
#define ADDR_CAP 300u
#define SHM_NAME_CAP 64u
#define SET_UP_FRAME_MAX 512u
#ifndef PREV_RING_CAP
#define PREV_RING_CAP (2u * 1024u * 1024u) /* the ring from the previous rank */
#endif
#define SIDE_RING_CAP (256u * 1024u)        /* the rings from the other ranks */
#ifndef SHM_CHUNK
#define SHM_CHUNK (256u * 1024u)   /* most bytes copied per ring operation */
#endif
/* The most a TCP send takes at a time: EMBER_NET_SEND_PIECE (net.h), as
 * for the feed.  A rank's loop sends to one peer while it receives from
 * another, so a send must not keep it in the kernel for long; smaller pieces
 * pay a system call per few microseconds of copying.  Between simulated
 * hosts (bench-cluster's ring, 2026-11-26) 512 KiB pieces against 32 KiB
 * ones gave 1.0x at 1 MiB, 1.23x at 16 MiB and 1.15x at 256 MiB with 2
 * ranks, 1.17-1.28x at 1-16 MiB with 4; on the machine of the day before,
 * 32 KiB had been ahead of whole-segment sends (2.3-3.2 GB/s against
 * 1.1-1.9), 512 KiB was not tried. */
#ifndef TCP_SEND_PIECE
#define TCP_SEND_PIECE EMBER_NET_SEND_PIECE
#endif
#ifndef TCP_TMP_CAP
#define TCP_TMP_CAP (256u * 1024u) /* receive-then-reduce staging for TCP */
#endif
#define SMALL_MAX_DEFAULT (64u * 1024u)
/* How long a wait on a socket polls, yielding its core between polls, before
 * it sleeps in poll(): a TCP peer's next bytes mostly arrive within a
 * millisecond in the middle of an op, and each sleep costs a context switch
 * and a wake-up (2 ranks between two simulated hosts, 1 MiB: 5 context
 * switches a call, where Open MPI, which polls and yields, has none). */
#define TCP_YIELD_US 1000
enum { ALGO_AUTO = 0, ALGO_RING = 1, ALGO_HALVING = 2, ALGO_DOUBLING = 3 };
#define POLL_SLICE_MS 100  /* abort flag and liveness are checked this often */
#define FUTEX_SLICE_MS 10
/* Accepts per turn of the mesh's poll loop: between batches the pending
 * peers' AUTH frames are read, so strangers cannot push a real rank out of
 * the pending pool by arriving in a burst. */
#define MESH_ACCEPT_BATCH 64
#define MESH_ACCEPT_PAUSE_MS 100
/* Strangers' connections queued before the communicator existed must not fill
 * the accept queue: the kernel would drop the real ranks' SYNs for seconds.
 * (The kernel caps it at net.core.somaxconn.) */
#define MESH_BACKLOG 4096
#define AUTH_FRAME_LEN (EMBER_WIRE_HEADER_LEN + 2u * EMBER_NONCE_LEN)
#define HELLO_FRAME_LEN (EMBER_WIRE_HEADER_LEN + 8u)

/* ======================================================================
 * 1. Reduction kernels: d[i] = d[i] OP s[i], n in bytes (a multiple of the
 *    element size).  Loads and stores go through memcpy, so neither pointer
 *    needs alignment.
 * ====================================================================== */

typedef float v4f __attribute__((vector_size(16)));
typedef double v2d __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef int64_t v2l __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef uint64_t v2u __attribute__((vector_size(16)));

typedef void (*reduce_fn)(uint8_t *d, const uint8_t *s, size_t n);

/* One 16-byte vector per iteration (the compiler unrolls), then scalars.
 * BODY sees VT a, b and leaves the result in a; SCALAR sees T x, y and leaves
 * it in x. */
#define DEF_KERNEL(NAME, T, VT, BODY, SCALAR)                \
  static void NAME(uint8_t *d, const uint8_t *s, size_t n) { \
    size_t i = 0;                                            \
    for (; i + 16 <= n; i += 16) {                           \
      VT a, b;                                               \
      memcpy(&a, d + i, 16);                                 \
      memcpy(&b, s + i, 16);                                 \
      BODY;                                                  \
      memcpy(d + i, &a, 16);                                 \
    }                                                        \
    for (; i + sizeof(T) <= n; i += sizeof(T)) {             \
      T x, y;                                                \
      memcpy(&x, d + i, sizeof x);                           \
      memcpy(&y, s + i, sizeof y);                           \
      SCALAR;                                                \
      memcpy(d + i, &x, sizeof x);                           \
    }                                                        \
  }

/* Floats: min/max return NaN if either input is NaN, in either order (so the
 * operation is commutative and every rank computes the same bits). */
#define FMIN_V(MT) { MT m_ = (MT)(a < b) | (MT)(a != a); a = (__typeof__(a))(((MT)a & m_) | ((MT)b & ~m_)); }
#define FMAX_V(MT) { MT m_ = (MT)(a > b) | (MT)(a != a); a = (__typeof__(a))(((MT)a & m_) | ((MT)b & ~m_)); }
#define IMIN_V { __typeof__(a) m_ = (__typeof__(a))(a < b); a = (a & m_) | (b & ~m_); }
#define IMAX_V { __typeof__(a) m_ = (__typeof__(a))(a > b); a = (a & m_) | (b & ~m_); }

DEF_KERNEL(sum_f32, float, v4f, a = a + b, x = x + y)
DEF_KERNEL(min_f32, float, v4f, FMIN_V(v4i), x = (x < y || x != x) ? x : y)
DEF_KERNEL(max_f32, float, v4f, FMAX_V(v4i), x = (x > y || x != x) ? x : y)
DEF_KERNEL(sum_f64, double, v2d, a = a + b, x = x + y)
DEF_KERNEL(min_f64, double, v2d, FMIN_V(v2l), x = (x < y || x != x) ? x : y)
DEF_KERNEL(max_f64, double, v2d, FMAX_V(v2l), x = (x > y || x != x) ? x : y)
/* Integer sums wrap: computed unsigned (signed overflow is undefined). */
DEF_KERNEL(sum_i32, int32_t, v4i, a = (v4i)((v4u)a + (v4u)b),
           x = (int32_t)((uint32_t)x + (uint32_t)y))
DEF_KERNEL(min_i32, int32_t, v4i, IMIN_V, x = x < y ? x : y)
DEF_KERNEL(max_i32, int32_t, v4i, IMAX_V, x = x > y ? x : y)
DEF_KERNEL(sum_i64, int64_t, v2l, a = (v2l)((v2u)a + (v2u)b),
           x = (int64_t)((uint64_t)x + (uint64_t)y))
DEF_KERNEL(min_i64, int64_t, v2l, IMIN_V, x = x < y ? x : y)
DEF_KERNEL(max_i64, int64_t, v2l, IMAX_V, x = x > y ? x : y)

static reduce_fn pick_kernel(int dtype, int op) {
  int sum = op == EMBER_RED_SUM || op == EMBER_RED_AVG;
  switch (dtype) {
  case EMBER_DT_F32: return sum ? sum_f32 : op == EMBER_RED_MIN ? min_f32 : max_f32;
  case EMBER_DT_F64: return sum ? sum_f64 : op == EMBER_RED_MIN ? min_f64 : max_f64;
  case EMBER_DT_I32: return sum ? sum_i32 : op == EMBER_RED_MIN ? min_i32 : max_i32;
  case EMBER_DT_I64: return sum ? sum_i64 : op == EMBER_RED_MIN ? min_i64 : max_i64;
  default: return NULL;
  }
}

/* avg: divides n bytes of elements by the number of ranks (integers truncate
 * toward zero, as C division does). */
static void scale_avg(uint8_t *d, size_t n, int dtype, uint32_t ranks) {
  size_t i = 0;
  switch (dtype) {
  case EMBER_DT_F32: {
    float k = (float)ranks;
    for (; i + 16 <= n; i += 16) {
      v4f a;
      memcpy(&a, d + i, 16);
      a = a / k;
      memcpy(d + i, &a, 16);
    }
    for (; i + 4 <= n; i += 4) {
      float x;
      memcpy(&x, d + i, 4);
      x /= k;
      memcpy(d + i, &x, 4);
    }
    break;
  }
  case EMBER_DT_F64: {
    double k = (double)ranks;
    for (; i + 16 <= n; i += 16) {
      v2d a;
      memcpy(&a, d + i, 16);
      a = a / k;
      memcpy(d + i, &a, 16);
    }
    for (; i + 8 <= n; i += 8) {
      double x;
      memcpy(&x, d + i, 8);
      x /= k;
      memcpy(d + i, &x, 8);
    }
    break;
  }
  case EMBER_DT_I32:
    for (; i + 4 <= n; i += 4) {
      int32_t x;
      memcpy(&x, d + i, 4);
      x = (int32_t)((int64_t)x / (int64_t)ranks);
      memcpy(d + i, &x, 4);
    }
    break;
  case EMBER_DT_I64:
    for (; i + 8 <= n; i += 8) {
      int64_t x;
      memcpy(&x, d + i, 8);
      x = x / (int64_t)ranks;
      memcpy(d + i, &x, 8);
    }
    break;
  default:
    break;
  }
}

static const char *dtype_str(int dtype) {
  switch (dtype) {
  case EMBER_DT_F32: return "float32";
  case EMBER_DT_F64: return "float64";
  case EMBER_DT_I32: return "int32";
  case EMBER_DT_I64: return "int64";
  default: return "bytes";
  }
}

static const char *op_str(int op) {
  switch (op) {
  case EMBER_RED_SUM: return "sum";
  case EMBER_RED_AVG: return "avg";
  case EMBER_RED_MIN: return "min";
  case EMBER_RED_MAX: return "max";
  default: return "?";
  }
}

/* ======================================================================
 * 2. Shared memory.  Every rank owns one ring (shm_ring.h) from each peer on
 *    its host, and one small "inbox" segment holding its doorbell and the
 *    abort word.  A rank drives its rings with the ring's non-blocking
 *    stream calls and waits on its own doorbell (a futex word) for all of
 *    them at once; whoever moves a ring's position that a rank waits on
 *    rings that rank's doorbell.  The inbox is a named POSIX segment, opened
 *    by name once and unlinked: a peer that can open it shares this host's
 *    /dev/shm, which is what makes it a peer on this host (ranks in other
 *    containers or namespaces on one kernel could still reach the rings
 *    through /proc).
 * ====================================================================== */

typedef struct {
  uint64_t magic;
  uint8_t token[32];
  uint32_t owner_rank, size;
  char pad0[16];
  _Atomic uint32_t bell;       /* the futex word */
  _Atomic uint32_t waiting;    /* the owner may be asleep on bell */
  _Atomic uint32_t aborted_by; /* 1 + rank of a rank that broke the comm */
  char pad1[52];
} inbox_hdr;
#define INBOX_HDR_LEN 4096u

_Static_assert(sizeof(inbox_hdr) <= INBOX_HDR_LEN, "inbox header layout");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "shared-memory doorbells need lock-free atomics");

static long futex_wait(_Atomic uint32_t *w, uint32_t val, int ms) {
  struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
  return syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *w) {
  syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Rings `ib`'s doorbell if its owner may be asleep.  The fence pairs with the
 * one in wait_io: either we see waiting == 1, or the sleeper sees our ring
 * update before it goes to sleep. */
static void ring(inbox_hdr *ib) {
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(&ib->waiting, memory_order_relaxed)) {
    atomic_fetch_add_explicit(&ib->bell, 1, memory_order_relaxed);
    futex_wake(&ib->bell);
  }
}

static void ring_always(inbox_hdr *ib) {
  atomic_fetch_add_explicit(&ib->bell, 1, memory_order_seq_cst);
  futex_wake(&ib->bell);
}

/* ======================================================================
 * Communicator
 * ====================================================================== */

typedef struct {
  uint32_t rank;
  int fd;
  char host[HOST_CAP];
  uint16_t port;
  char desc[ADDR_CAP + 32]; /* "rank 2 (127.0.0.1:5002)" */
  int shm;
  ember_shm_ring *in;  /* peer -> me: this rank created it, the consumer */
  ember_shm_ring *out; /* me -> peer: attached to the peer's, the producer */
  inbox_hdr *peer_ib;  /* the peer's inbox (its doorbell) */
  uint64_t in_seen, out_seen; /* the rings' peer positions when we last found no progress */
  uint64_t out_pos, in_pos;   /* collective bytes sent to / received from this peer */
} peer_t;

struct ember_comm {
  uint32_t rank, size;
  peer_t *peers; /* size entries; peers[rank] is this rank (fd -1) */
  int listen_fd;
  inbox_hdr *inbox;
  uint8_t *tmp;
  size_t tmp_cap, tmp_fill;
  size_t small_max;
  uint32_t seq;
  int algo;           /* ALGO_AUTO, or the large allreduce's forced one */
  int own_hosts;      /* every rank's address names a host of its own */
  int spin_us;        /* most a wait spins before it sleeps */
  int yield_us;       /* then how long it yields its core before it sleeps */
  int tcp_yield_us;   /* the same for a wait on sockets only */
  int64_t spin_cur_ns; /* adaptive spin budget, 0..spin_us */
  unsigned waits;
  _Atomic int abort_req;
  int broken;
  char broken_msg[1024];
};

/* ======================================================================
 * 3. Channels
 * ====================================================================== */

/* What a failed channel call means, with the peer named. */
static int io_fail(peer_t *p, const char *what, int err) {
  int code = (err == EPIPE || err == ECONNRESET || err == ENOTCONN || err == ESHUTDOWN)
                 ? EMBER_ECLOSED
                 : EMBER_EIO;
  if (code == EMBER_ECLOSED)
    return ember__set_errno(code, err, "%s %s (the peer failed, was killed or left)", what,
                            p->desc);
  return ember__set_errno(code, err, "%s %s", what, p->desc);
}

/* Sends up to alen bytes of a then blen bytes of b without blocking; returns
 * the bytes taken (0: no room now) or a negative status.  Over shared memory
 * the bytes of b taken are a multiple of gran (the element size), so the
 * receiver reduces whole elements out of every record. */
static long ch_send(ember_comm *c, peer_t *p, const uint8_t *a, size_t alen,
                    const uint8_t *b, size_t blen, size_t gran) {
  if (!p->shm) {
    struct iovec iov[2];
    int cnt = 0;
    if (alen > 0) iov[cnt++] = (struct iovec){.iov_base = (void *)a, .iov_len = alen};
    if (blen > TCP_SEND_PIECE) blen = TCP_SEND_PIECE;
    if (blen > 0) iov[cnt++] = (struct iovec){.iov_base = (void *)b, .iov_len = blen};
    if (cnt == 0) return 0;
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov;
    mh.msg_iovlen = (size_t)cnt;
    for (;;) {
      ssize_t n = sendmsg(p->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) return (long)n;
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      return io_fail(p, "send to", errno);
    }
  }
  void *dst = NULL;
  size_t room = 0, want = alen + blen;
  /* The position to wait on is read before the look for room: one read
   * after it could already include the room freed meanwhile, and the wait
   * would then sleep through the only change it needed to see. */
  uint64_t seen = ember_shm_ring_peer_position(p->out);
  int rc = ember_shm_ring_try_reserve(p->out, want < SHM_CHUNK ? want : SHM_CHUNK, &dst, &room);
  if (rc != EMBER_OK) return ember__set_error(rc, "send to %s: %s", p->desc, ember_last_error());
  size_t na = alen < room ? alen : room;
  size_t nb = blen < room - na ? blen : room - na;
  nb -= nb % gran; /* a record never ends inside an element */
  if (na + nb == 0) {
    p->out_seen = seen;
    return 0;
  }
  if (na > 0) memcpy(dst, a, na);
  if (nb > 0) memcpy((uint8_t *)dst + na, b, nb);
  rc = ember_shm_ring_commit(p->out, na + nb);
  if (rc != EMBER_OK) return ember__set_error(rc, "send to %s: %s", p->desc, ember_last_error());
  ring(p->peer_ib);
  return (long)(na + nb);
}

/* Receives up to len bytes into dst (copy) or reduces them into dst
 * (fn != NULL).  Returns the bytes of dst completed; *moved is set when any
 * byte was taken off the channel (a TCP read may end inside an element,
 * which is kept in c->tmp until the rest arrives). */
static long ch_recv(ember_comm *c, peer_t *p, uint8_t *dst, size_t len, reduce_fn fn,
                    size_t esz, int *moved) {
  *moved = 0;
  if (len == 0) return 0;
  if (!p->shm) {
    uint8_t *into = dst;
    size_t want = len;
    if (fn != NULL) {
      want = (len < c->tmp_cap ? len : c->tmp_cap) - c->tmp_fill;
      into = c->tmp + c->tmp_fill;
    }
    for (;;) {
      ssize_t n = recv(p->fd, into, want, MSG_DONTWAIT);
      if (n > 0) {
        *moved = 1;
        if (fn == NULL) return (long)n;
        size_t have = c->tmp_fill + (size_t)n;
        size_t whole = have - have % esz;
        fn(dst, c->tmp, whole);
        c->tmp_fill = have - whole;
        if (c->tmp_fill > 0) memmove(c->tmp, c->tmp + whole, c->tmp_fill);
        return (long)whole;
      }
      if (n == 0)
        return ember__set_error(EMBER_ECLOSED,
                                "recv from %s: connection closed (the peer failed, was "
                                "killed or left)",
                                p->desc);
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      return io_fail(p, "recv from", errno);
    }
  }
  const void *src = NULL;
  size_t avail = 0;
  uint64_t seen = ember_shm_ring_peer_position(p->in); /* before the look: see ch_send */
  int rc = ember_shm_ring_peek(p->in, &src, &avail);
  if (rc != EMBER_OK)
    return ember__set_error(rc, "recv from %s: %s", p->desc, ember_last_error());
  if (avail == 0) {
    p->in_seen = seen;
    return 0;
  }
  if (avail > len) avail = len;
  if (avail > SHM_CHUNK) avail = SHM_CHUNK;
  if (fn != NULL) {
    avail -= avail % esz;
    if (avail == 0)
      return ember__set_error(EMBER_EPROTO, "recv from %s: a record ends inside a %zu-byte "
                              "element (the peer broke the stream)", p->desc, esz);
    fn(dst, src, avail);
  } else {
    memcpy(dst, src, avail);
  }
  rc = ember_shm_ring_consume(p->in, avail);
  if (rc != EMBER_OK)
    return ember__set_error(rc, "recv from %s: %s", p->desc, ember_last_error());
  ring(p->peer_ib);
  *moved = 1;
  return (long)avail;
}

/* ======================================================================
 * 4. The step engine
 * ====================================================================== */

enum { K_ALLREDUCE = 1, K_BROADCAST = 2, K_ALLGATHER = 3, K_BARRIER = 4 };

static const char *kind_str(int k) {
  switch (k) {
  case K_ALLREDUCE: return "allreduce";
  case K_BROADCAST: return "broadcast";
  case K_ALLGATHER: return "allgather";
  case K_BARRIER: return "barrier";
  default: return "unknown";
  }
}

typedef struct {
  ember_comm *c;
  int kind, dtype, op;
  uint32_t root;
  uint64_t nbytes;
  uint32_t seq;
  size_t esz;
  reduce_fn fn;
  int64_t start_ms, deadline_ms, timeout_ms;
  char what[160]; /* op_name(): empty until an error message needs it */
} op_ctx;

typedef struct {
  size_t send_off, send_len;
  size_t recv_off, recv_len;
  int gate;   /* -1, or the step whose receive progress gates this send */
  int reduce; /* receive mode: reduce into the region (else copy) */
  int scale;  /* avg: divide the reduced bytes by the number of ranks */
} step_t;

/* The length of a header that starts at stream position pos: OPHDR_LEN
 * bytes, then zeros up to the next multiple of STREAM_ALIGN, so the payload
 * after it starts at a multiple of 64 bytes into the connection (both ends
 * count the same bytes, so the length is never sent).  With 24-byte headers
 * each message moved its payload 24 bytes further along the 64-byte lines of
 * the kernel's socket buffers, and the kernel's copies into and out of
 * them, which are most of a TCP allreduce's time, ran up to 5x slower at
 * some of those offsets (AMD EPYC, rep movsb): between simulated hosts
 * (bench-cluster) payloads on 64-byte lines took 2 ranks at 1 MiB from 1.18
 * to 1.87 GB/s and 4 ranks from 0.54 to 0.88, and gave 1.03-1.4x at
 * 4-256 MiB. */
static size_t hdr_len(uint64_t pos) {
  uint64_t end = (pos + OPHDR_LEN + STREAM_ALIGN - 1) / STREAM_ALIGN * STREAM_ALIGN;
  return (size_t)(end - pos);
}

static void encode_ophdr(const op_ctx *o, int step, uint8_t out[OPHDR_LEN]) {
  ember_wire_put_u32(out, COLL_MAGIC);
  ember_wire_put_u32(out + 4, o->seq);
  out[8] = (uint8_t)o->kind;
  out[9] = (uint8_t)o->dtype;
  out[10] = (uint8_t)o->op;
  out[11] = (uint8_t)step;
  ember_wire_put_u32(out + 12, o->root);
  ember_wire_put_u64(out + 16, o->nbytes);
}

static void describe_ophdr(const uint8_t *h, char *out, size_t cap) {
  int kind = h[8];
  if (kind == K_ALLREDUCE)
    snprintf(out, cap, "allreduce #%u (%s %s, %llu bytes)", (unsigned)ember_wire_get_u32(h + 4),
             dtype_str(h[9]), op_str(h[10]),
             (unsigned long long)ember_wire_get_u64(h + 16));
  else if (kind == K_BROADCAST)
    snprintf(out, cap, "broadcast #%u (root %u, %llu bytes)",
             (unsigned)ember_wire_get_u32(h + 4), (unsigned)ember_wire_get_u32(h + 12),
             (unsigned long long)ember_wire_get_u64(h + 16));
  else
    snprintf(out, cap, "%s #%u (%llu bytes)", kind_str(kind),
             (unsigned)ember_wire_get_u32(h + 4),
             (unsigned long long)ember_wire_get_u64(h + 16));
}

/* "allreduce #3 (float32 sum, 4096 bytes)": the op as error messages name it,
 * formatted only when one is written (a small op takes a few microseconds,
 * and formatting the name every time cost a visible share of it). */
static const char *op_name(op_ctx *o) {
  if (o->what[0] == '\0') {
    uint8_t h[OPHDR_LEN];
    encode_ophdr(o, 0, h);
    describe_ophdr(h, o->what, sizeof o->what);
  }
  return o->what;
}

static int check_ophdr(op_ctx *o, peer_t *from, int step, const uint8_t *got, size_t len) {
  uint8_t want[OPHDR_LEN];
  encode_ophdr(o, step, want);
  int pad_ok = 1;
  for (size_t i = OPHDR_LEN; i < len; i++) pad_ok &= got[i] == 0;
  if (memcmp(want, got, OPHDR_LEN) == 0 && pad_ok) return EMBER_OK;
  if (memcmp(want, got, OPHDR_LEN) == 0)
    return ember__set_error(EMBER_EPROTO, "%s: %s sent a header whose padding is not zero: "
                            "the stream is out of step", op_name(o), from->desc);
  if (ember_wire_get_u32(got) != COLL_MAGIC)
    return ember__set_error(EMBER_EPROTO,
                            "%s: %s sent bytes that are not a collective header (magic "
                            "0x%08x): the ranks' calls are out of step",
                            op_name(o), from->desc, (unsigned)ember_wire_get_u32(got));
  char theirs[160];
  describe_ophdr(got, theirs, sizeof theirs);
  if (got[11] != (uint8_t)step && memcmp(want, got, 11) == 0)
    return ember__set_error(EMBER_EPROTO, "%s: %s is at step %u, this rank at step %d",
                            op_name(o), from->desc, (unsigned)got[11], step);
  return ember__set_error(EMBER_EPROTO,
                          "mismatched collectives: this rank called %s but %s called %s "
                          "(all ranks must make the same calls in the same order)",
                          op_name(o), from->desc, theirs);
}

/* Is the peer's end of the connection gone?  (POLLRDHUP: it shut down or
 * exited; data it sent before that can still be read.) */
static int peer_hung_up(short revents) {
  return (revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

static int timeout_error(op_ctx *o, peer_t *to, peer_t *from, const char *progress) {
  char who[2 * sizeof to->desc + 64];
  if (to != NULL && from != NULL && to != from)
    snprintf(who, sizeof who, "%s (to receive) and %s (to send)", from->desc, to->desc);
  else
    snprintf(who, sizeof who, "%s", from != NULL ? from->desc : to != NULL ? to->desc : "?");
  return ember__set_error(EMBER_ETIMEDOUT, "%s: timed out after %lld ms waiting for %s (%s)",
                          op_name(o), (long long)(ember_now_ms() - o->start_ms), who,
                          progress);
}

static int aborted_error(op_ctx *o) {
  ember_comm *c = o->c;
  if (atomic_load(&c->abort_req))
    return ember__set_error(EMBER_EABORTED, "%s: aborted on this rank (ember_comm_abort)",
                            op_name(o));
  uint32_t by = c->inbox ? atomic_load(&c->inbox->aborted_by) : 0;
  if (by >= 1 && by <= c->size)
    return ember__set_error(EMBER_EABORTED,
                            "%s: %s aborted the collective (it failed or was closed)",
                            op_name(o), c->peers[by - 1].desc);
  return ember__set_error(EMBER_EABORTED, "%s: aborted", op_name(o));
}

static int shm_ready(const peer_t *to, const peer_t *from) {
  return (to != NULL && to->shm && ember_shm_ring_peer_position(to->out) != to->out_seen) ||
         (from != NULL && from->shm && ember_shm_ring_peer_position(from->in) != from->in_seen);
}

static int64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Adaptive spinning (as in adaptive mutexes).  A wait that spinning ended
 * doubles the budget (to at least twice that wait); a wait that had to sleep
 * halves it, since the peer was not running (more ranks than idle cores, or
 * the scheduler put two ranks on one core) and spinning only keeps it off
 * the core.  Every 32nd wait probes with the full budget, to notice when
 * cores free up again.  Doubling matters: a budget that a slow start (a peer
 * still importing, ranks arriving seconds apart) halved to nothing must grow
 * back within a few waits, or every later wait of a few microseconds sleeps
 * and pays a futex wake-up, several times the op itself. */
static void adapt_spin(ember_comm *c, int64_t waited_ns, int spun) {
  int64_t max = (int64_t)c->spin_us * 1000;
  if (spun) {
    int64_t want = 2 * waited_ns + 2000;
    if (want < 2 * c->spin_cur_ns) want = 2 * c->spin_cur_ns;
    c->spin_cur_ns = want < max ? want : max;
  } else {
    c->spin_cur_ns /= 2;
  }
}

/* This wait's spin budget: the adaptive one, or the full one every 32nd
 * wait (the probe of adapt_spin). */
static int64_t spin_budget_ns(ember_comm *c) {
  return (++c->waits & 31u) == 0 ? (int64_t)c->spin_us * 1000 : c->spin_cur_ns;
}

/* Blocks until `to` can take more bytes or `from` has more (either may be
 * NULL: not waited for), the deadline passes (EMBER_ETIMEDOUT), or a peer we
 * still depend on is gone: to_live (we still have bytes for it) and from_live
 * (we still need bytes from it) are watched for hang-ups. */
static int wait_io(op_ctx *o, peer_t *to, peer_t *from, peer_t *to_live, peer_t *from_live,
                   const char *progress) {
  ember_comm *c = o->c;
  int any_shm = (to != NULL && to->shm) || (from != NULL && from->shm);
  int any_tcp = (to != NULL && !to->shm) || (from != NULL && !from->shm);
  /* Sockets only: poll without blocking for as long as a shared-memory wait
   * would spin, then for TCP_YIELD_US more with the core yielded between
   * polls, since a blocking poll's wake-up costs tens of microseconds, more
   * than a small op over loopback or a LAN takes. */
  int64_t t_spin = any_shm ? 0 : mono_ns();
  int64_t spin_until = any_shm ? 0 : t_spin + spin_budget_ns(c);
  int64_t poll_until = any_shm ? 0 : spin_until + (int64_t)c->tcp_yield_us * 1000;
  for (;;) {
    if (atomic_load_explicit(&c->abort_req, memory_order_relaxed) ||
        (c->inbox != NULL && atomic_load_explicit(&c->inbox->aborted_by, memory_order_relaxed)))
      return aborted_error(o);
    int64_t now = ember_now_ms();
    if (now >= o->deadline_ms) return timeout_error(o, to_live, from_live, progress);
    int64_t left = o->deadline_ms - now;

    if (any_shm) {
      /* Spin briefly (a peer on another core answers within microseconds),
       * then sleep on our doorbell in short slices. */
      int64_t budget = spin_budget_ns(c);
      int64_t t0 = mono_ns(), until = t0 + budget;
      for (unsigned it = 0;; it++) {
        if (shm_ready(to, from)) {
          adapt_spin(c, mono_ns() - t0, 1);
          return EMBER_OK;
        }
        if ((it & 15u) == 15u && mono_ns() >= until) break;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
      /* More ranks than cores: the peer we wait for is likely queued behind
       * us on our own core.  Yielding hands it the core at once, where a
       * futex sleep would add the wake-up's tens of microseconds to every
       * step (Open MPI yields likewise when oversubscribed). */
      if (c->yield_us > 0) {
        int64_t yield_until = mono_ns() + (int64_t)c->yield_us * 1000;
        for (unsigned it = 0;; it++) {
          if (shm_ready(to, from)) return EMBER_OK;
          if ((it & 3u) == 3u && mono_ns() >= yield_until) break;
          sched_yield();
        }
      }
      atomic_store_explicit(&c->inbox->waiting, 1, memory_order_seq_cst);
      uint32_t bell = atomic_load_explicit(&c->inbox->bell, memory_order_seq_cst);
      atomic_thread_fence(memory_order_seq_cst);
      if (!shm_ready(to, from)) {
        int ms = left < FUTEX_SLICE_MS ? (int)left : FUTEX_SLICE_MS;
        if (any_tcp) ms = 1; /* a socket in the mix cannot be slept on */
        (void)futex_wait(&c->inbox->bell, bell, ms > 0 ? ms : 1);
      }
      atomic_store_explicit(&c->inbox->waiting, 0, memory_order_relaxed);
      adapt_spin(c, 0, 0);
      if (shm_ready(to, from)) return EMBER_OK;
    }

    /* Socket readiness, and hang-ups of the peers we depend on. */
    struct pollfd pf[2];
    peer_t *who[2];
    int n = 0;
    peer_t *cand[2] = {to_live, from_live};
    for (int k = 0; k < 2; k++) {
      peer_t *p = cand[k];
      if (p == NULL || (n == 1 && who[0] == p)) continue;
      pf[n] = (struct pollfd){.fd = p->fd, .events = POLLRDHUP, .revents = 0};
      who[n++] = p;
    }
    if (to != NULL && !to->shm) {
      for (int i = 0; i < n; i++)
        if (who[i] == to) pf[i].events |= POLLOUT;
    }
    if (from != NULL && !from->shm) {
      for (int i = 0; i < n; i++)
        if (who[i] == from) pf[i].events |= POLLIN;
    }
    int64_t t_now = any_shm ? 0 : mono_ns();
    int spinning = !any_shm && t_now < poll_until;
    int ms = any_shm || spinning ? 0 : (left < POLL_SLICE_MS ? (int)left : POLL_SLICE_MS);
    int rc = poll(pf, (nfds_t)n, ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      return ember__set_errno(EMBER_ESYS, errno, "%s: poll", op_name(o));
    }
    int ready = 0;
    for (int i = 0; i < n; i++) {
      short ev = pf[i].revents;
      if (ev == 0) continue;
      if (peer_hung_up(ev)) {
        /* What the peer sent before it left is still ours to take: let the
         * receive drain it (and find the end of the stream). */
        if (who[i] == from_live && (!from_live->shm || shm_ready(NULL, from_live))) {
          ready = 1;
          continue;
        }
        return ember__set_error(EMBER_ECLOSED,
                                "%s: %s closed its connection (it failed, was killed or "
                                "left) while this rank still %s it",
                                op_name(o), who[i]->desc,
                                who[i] == to_live ? "had data for" : "waited on");
      }
      if (ev & (POLLIN | POLLOUT)) ready = 1;
    }
    if (!any_shm && t_spin != 0 && (ready || !spinning)) {
      adapt_spin(c, t_now - t_spin, ready && t_now < spin_until);
      t_spin = 0; /* judged once per wait */
    }
    if (ready) return EMBER_OK;
    if (spinning && t_now >= spin_until) sched_yield();
  }
}

/* Runs steps against `to` (may be NULL: nothing to send) and `from` (may be
 * NULL: nothing to receive).  Sends read sbuf, receives write rbuf. */
static int run_steps_(op_ctx *o, int step_id, peer_t *to, peer_t *from,
                      const uint8_t *sbuf, uint8_t *rbuf, const step_t *st, int nsteps) {
  ember_comm *c = o->c;
  uint8_t shdr[OPHDR_MAX] = {0}, rhdr[OPHDR_MAX];
  size_t hs = 0, hr = 0, sdone = 0, rdone = 0;
  /* header lengths: from each stream's position (hdr_len) */
  size_t hls = to != NULL ? hdr_len(to->out_pos) : 0;
  size_t hlr = from != NULL ? hdr_len(from->in_pos) : 0;
  int ss = 0, rs = 0;
  char progress[128];
  encode_ophdr(o, step_id, shdr);
  c->tmp_fill = 0;
  if (to == NULL) ss = nsteps;
  if (from == NULL) rs = nsteps;

  for (unsigned iter = 0;; iter++) {
    int progressed = 0, want_out = 0, want_in = 0;
    /* ---- send */
    while (ss < nsteps && hs == hls && sdone >= st[ss].send_len) {
      ss++;
      sdone = 0;
    }
    if (to != NULL && (hs < hls || ss < nsteps)) {
      size_t avail = 0;
      const uint8_t *p = NULL;
      if (ss < nsteps) {
        const step_t *s = &st[ss];
        size_t lim = s->send_len;
        if (s->gate >= 0) {
          if (rs < s->gate) lim = 0;
          else if (rs == s->gate && rdone < lim) lim = rdone;
        }
        avail = lim > sdone ? lim - sdone : 0;
        if (avail > 0) p = sbuf + s->send_off + sdone;
      }
      if (hs < hls || avail > 0) {
        long n = ch_send(c, to, shdr + hs, hls - hs, p, avail, o->esz);
        if (n < 0) return ember__set_error((int)n, "%s: %s", op_name(o), ember_last_error());
        if (n == 0) {
          want_out = 1;
        } else {
          size_t k = (size_t)n < hls - hs ? (size_t)n : hls - hs;
          hs += k;
          sdone += (size_t)n - k;
          progressed = 1;
        }
      }
    }
    /* ---- receive */
    if (from != NULL && hr < hlr) {
      int moved = 0;
      long n = ch_recv(c, from, rhdr + hr, hlr - hr, NULL, 1, &moved);
      if (n < 0) return ember__set_error((int)n, "%s: %s", op_name(o), ember_last_error());
      if (n == 0) want_in = 1;
      hr += (size_t)n;
      if (n > 0) progressed = 1;
      if (hr == hlr) {
        int rc = check_ophdr(o, from, step_id, rhdr, hlr);
        if (rc != EMBER_OK) return rc;
      }
    } else if (from != NULL) {
      while (rs < nsteps && rdone >= st[rs].recv_len) {
        rs++;
        rdone = 0;
      }
      if (rs < nsteps) {
        const step_t *s = &st[rs];
        int moved = 0;
        uint8_t *dst = rbuf + s->recv_off + rdone;
        long n = ch_recv(c, from, dst, s->recv_len - rdone, s->reduce ? o->fn : NULL, o->esz,
                         &moved);
        if (n < 0) return ember__set_error((int)n, "%s: %s", op_name(o), ember_last_error());
        if (n > 0 && s->scale) scale_avg(dst, (size_t)n, o->dtype, c->size);
        rdone += (size_t)n;
        if (moved) progressed = 1;
        else want_in = 1;
        while (rs < nsteps && rdone >= st[rs].recv_len) {
          rs++;
          rdone = 0;
        }
      }
    }
    int send_open = to != NULL && (hs < hls || ss < nsteps);
    int recv_open = from != NULL && (hr < hlr || rs < nsteps);
    if (!send_open && !recv_open) {
      for (int k = 0; k < nsteps; k++) {
        if (to != NULL) to->out_pos += st[k].send_len;
        if (from != NULL) from->in_pos += st[k].recv_len;
      }
      if (to != NULL) to->out_pos += hls;
      if (from != NULL) from->in_pos += hlr;
      return EMBER_OK;
    }
    if ((iter & 255u) == 255u) {
      if (atomic_load_explicit(&c->abort_req, memory_order_relaxed)) return aborted_error(o);
      if (ember_now_ms() >= o->deadline_ms) {
        snprintf(progress, sizeof progress, "step %d of %d", rs < ss ? rs + 1 : ss + 1, nsteps);
        return timeout_error(o, send_open ? to : NULL, recv_open ? from : NULL, progress);
      }
    }
    if (progressed) continue;
    if (!want_out && !want_in)
      return ember__set_error(EMBER_ESTATE, "%s: internal error: no progress possible",
                              op_name(o));
    if (recv_open && rs < nsteps)
      snprintf(progress, sizeof progress, "step %d of %d: %zu of %zu bytes received", rs + 1,
               nsteps, rdone, st[rs].recv_len);
    else if (send_open && ss < nsteps)
      snprintf(progress, sizeof progress, "step %d of %d: %zu of %zu bytes sent", ss + 1,
               nsteps, sdone, st[ss].send_len);
    else
      snprintf(progress, sizeof progress, "waiting for the collective header");
    int rc = wait_io(o, want_out ? to : NULL, want_in ? from : NULL, send_open ? to : NULL,
                     recv_open ? from : NULL, progress);
    if (rc != EMBER_OK) return rc;
  }
}

/* A failure seen after ember_comm_abort (our own shut-down sockets) is the
 * abort, not a peer's fault. */
static int run_steps(op_ctx *o, int step_id, peer_t *to, peer_t *from, const uint8_t *sbuf,
                     uint8_t *rbuf, const step_t *st, int nsteps) {
  int rc = run_steps_(o, step_id, to, from, sbuf, rbuf, st, nsteps);
  if (rc != EMBER_OK && atomic_load(&o->c->abort_req)) return aborted_error(o);
  return rc;
}

/* ======================================================================
 * 5. Algorithms
 * ====================================================================== */

/* Segment k of n of a buffer of count elements: balanced in whole 64-byte
 * units (the elements left over go to the last segment), so that every
 * segment starts on a 64-byte boundary of the buffer, as every payload
 * starts on one of its stream (hdr_len).  seg_off(.., n, ..) is the end. */
static size_t seg_off(size_t count, uint32_t n, uint32_t k, size_t esz) {
  if (k >= n) return count * esz;
  size_t unit = STREAM_ALIGN / esz; /* elements of 4 or 8 bytes */
  size_t units = count / unit, base = units / n, rem = units % n;
  return (base * k + (k < rem ? k : rem)) * unit * esz;
}

static size_t seg_len(size_t count, uint32_t n, uint32_t k, size_t esz) {
  return seg_off(count, n, k + 1, esz) - seg_off(count, n, k, esz);
}

static int ring_allreduce(op_ctx *o, uint8_t *buf, size_t count) {
  ember_comm *c = o->c;
  uint32_t n = c->size, r = c->rank;
  int nsteps = 2 * (int)(n - 1);
  step_t *st = calloc((size_t)nsteps, sizeof *st);
  if (st == NULL) return ember__set_error(EMBER_ENOMEM, "%s: out of memory", op_name(o));
  for (int s = 0; s < nsteps; s++) {
    uint32_t send_seg, recv_seg;
    if (s < (int)n - 1) { /* reduce-scatter */
      send_seg = (r + n - (uint32_t)s % n) % n;
      recv_seg = (r + 2 * n - (uint32_t)s - 1) % n;
      st[s].reduce = 1;
      st[s].scale = (s == (int)n - 2) && o->op == EMBER_RED_AVG;
    } else { /* allgather */
      uint32_t a = (uint32_t)s - (n - 1);
      send_seg = (r + 1 + n - a) % n;
      recv_seg = (r + n - a) % n;
    }
    st[s].send_off = seg_off(count, n, send_seg, o->esz);
    st[s].send_len = seg_len(count, n, send_seg, o->esz);
    st[s].recv_off = seg_off(count, n, recv_seg, o->esz);
    st[s].recv_len = seg_len(count, n, recv_seg, o->esz);
    st[s].gate = s - 1;
  }
  peer_t *next = &c->peers[(r + 1) % n], *prev = &c->peers[(r + n - 1) % n];
  int rc = run_steps(o, 0, next, prev, buf, buf, st, nsteps);
  free(st);
  return rc;
}

/* One full-buffer exchange with `partner` (to and/or from). */
static int exchange(op_ctx *o, int step_id, peer_t *to, peer_t *from, const uint8_t *sbuf,
                    uint8_t *rbuf, size_t len) {
  step_t st = {.send_off = 0, .send_len = to ? len : 0, .recv_off = 0,
               .recv_len = from ? len : 0, .gate = -1};
  return run_steps(o, step_id, to, from, sbuf, rbuf, &st, 1);
}

/* Recursive doubling, with the usual fold for a non power of two: ranks
 * >= p2 hand their data to rank - p2 first and get the result back last. */
static int rd_allreduce(op_ctx *o, uint8_t *buf, size_t len) {
  ember_comm *c = o->c;
  uint32_t n = c->size, r = c->rank, p2 = 1;
  int rc, step = 0, logp = 0;
  while (p2 * 2 <= n) p2 *= 2, logp++;
  uint32_t extra = n - p2;
  if (r >= p2) {
    peer_t *partner = &c->peers[r - p2];
    rc = exchange(o, 0, partner, NULL, buf, NULL, len);
    if (rc == EMBER_OK) rc = exchange(o, 1 + logp, NULL, partner, NULL, buf, len);
    return rc;
  }
  if (r < extra) {
    rc = exchange(o, 0, NULL, &c->peers[r + p2], NULL, c->tmp, len);
    if (rc != EMBER_OK) return rc;
    if (o->fn) o->fn(buf, c->tmp, len);
  }
  step = 1;
  for (uint32_t mask = 1; mask < p2; mask <<= 1, step++) {
    peer_t *partner = &c->peers[r ^ mask];
    rc = exchange(o, step, partner, partner, buf, c->tmp, len);
    if (rc != EMBER_OK) return rc;
    if (o->fn) o->fn(buf, c->tmp, len);
  }
  if (o->op == EMBER_RED_AVG && len > 0) scale_avg(buf, len, o->dtype, n);
  if (r < extra) return exchange(o, step, &c->peers[r + p2], NULL, buf, NULL, len);
  return EMBER_OK;
}

/* Rabenseifner's allreduce: a reduce-scatter by recursive halving, then an
 * allgather by recursive doubling, over the largest power of two of ranks
 * (the others fold in first and get the result last, as in rd_allreduce).
 * Each rank sends what the ring sends, 2(p-1)/p of the buffer, but in
 * 2 log2(p) exchanges with one partner at a time instead of the ring's
 * 2(p-1) steps through every rank: with 4 ranks the ring's chain of 6
 * dependent steps is 4 exchanges.  Block b of the p blocks is reduced on
 * virtual rank b alone, so every rank still ends with the same bits. */
static int rh_allreduce(op_ctx *o, uint8_t *buf, size_t count) {
  ember_comm *c = o->c;
  uint32_t n = c->size, r = c->rank, p2 = 1;
  int logp = 0, rc;
  while (p2 * 2 <= n) p2 *= 2, logp++;
  uint32_t extra = n - p2;
  size_t esz = o->esz, len = count * esz;
  if (r >= p2) { /* folded in: hand over the whole buffer, get the result */
    peer_t *partner = &c->peers[r - p2];
    rc = exchange(o, 0, partner, NULL, buf, NULL, len);
    if (rc == EMBER_OK) rc = exchange(o, 1 + 2 * logp, NULL, partner, NULL, buf, len);
    return rc;
  }
  if (r < extra) {
    step_t fold = {.recv_len = len, .gate = -1, .reduce = 1};
    rc = run_steps(o, 0, NULL, &c->peers[r + p2], NULL, buf, &fold, 1);
    if (rc != EMBER_OK) return rc;
  }
  /* [lo, hi): the blocks of the p2 this rank is responsible for. */
  uint32_t lo = 0, hi = p2;
  int step = 1;
  for (uint32_t mask = p2 / 2; mask >= 1; mask /= 2, step++) {
    uint32_t mid = lo + (hi - lo) / 2;
    int upper = (r & mask) != 0; /* keeps [mid, hi), gives [lo, mid) */
    uint32_t klo = upper ? mid : lo, khi = upper ? hi : mid;
    uint32_t glo = upper ? lo : mid, ghi = upper ? mid : hi;
    step_t st = {.send_off = seg_off(count, p2, glo, esz),
                 .send_len = seg_off(count, p2, ghi, esz) - seg_off(count, p2, glo, esz),
                 .recv_off = seg_off(count, p2, klo, esz),
                 .recv_len = seg_off(count, p2, khi, esz) - seg_off(count, p2, klo, esz),
                 .gate = -1, .reduce = 1};
    peer_t *partner = &c->peers[r ^ mask];
    rc = run_steps(o, step, partner, partner, buf, buf, &st, 1);
    if (rc != EMBER_OK) return rc;
    lo = klo, hi = khi;
  }
  if (o->op == EMBER_RED_AVG) {
    size_t off = seg_off(count, p2, lo, esz);
    if (seg_off(count, p2, hi, esz) > off)
      scale_avg(buf + off, seg_off(count, p2, hi, esz) - off, o->dtype, n);
  }
  for (uint32_t mask = 1; mask < p2; mask *= 2, step++) {
    uint32_t width = hi - lo;
    uint32_t plo = (r & mask) ? lo - width : hi; /* the partner's blocks, beside ours */
    step_t st = {.send_off = seg_off(count, p2, lo, esz),
                 .send_len = seg_off(count, p2, hi, esz) - seg_off(count, p2, lo, esz),
                 .recv_off = seg_off(count, p2, plo, esz),
                 .recv_len = seg_off(count, p2, plo + width, esz) - seg_off(count, p2, plo, esz),
                 .gate = -1};
    peer_t *partner = &c->peers[r ^ mask];
    rc = run_steps(o, step, partner, partner, buf, buf, &st, 1);
    if (rc != EMBER_OK) return rc;
    if (plo < lo) lo = plo;
    else hi = plo + width;
  }
  if (r < extra) return exchange(o, step, &c->peers[r + p2], NULL, buf, NULL, len);
  return EMBER_OK;
}

static int begin_op(ember_comm *c, op_ctx *o, int kind, int dtype, int op, uint32_t root,
                    uint64_t nbytes, int64_t timeout_ms) {
  memset(o, 0, sizeof *o);
  o->c = c;
  o->kind = kind;
  o->dtype = kind == K_ALLREDUCE ? dtype : 0;
  o->op = kind == K_ALLREDUCE ? op : 0;
  o->root = root;
  o->nbytes = nbytes;
  o->esz = kind == K_ALLREDUCE ? ember_dtype_size((uint8_t)dtype) : 1;
  o->fn = kind == K_ALLREDUCE ? pick_kernel(dtype, op) : NULL;
  o->seq = ++c->seq;
  o->timeout_ms = timeout_ms;
  o->start_ms = ember_now_ms();
  o->deadline_ms = timeout_ms < 0 ? INT64_MAX : ember_deadline_after(timeout_ms);
  if (c->broken)
    return ember__set_error(EMBER_ESTATE, "%s: the communicator is broken by an earlier "
                            "failure: %s", op_name(o), c->broken_msg);
  if (atomic_load(&c->abort_req)) return aborted_error(o);
  return EMBER_OK;
}

/* Shuts every connection and rings every peer's doorbell with our abort, so
 * that the other ranks stop waiting on us at once; fds stay open (no reuse
 * race) until destroy. */
static void break_links(ember_comm *c) {
  for (uint32_t j = 0; j < c->size; j++) {
    peer_t *p = &c->peers[j];
    if (j == c->rank) continue;
    if (p->peer_ib != NULL) {
      uint32_t zero = 0;
      atomic_compare_exchange_strong(&p->peer_ib->aborted_by, &zero, c->rank + 1);
      ring_always(p->peer_ib);
    }
    if (p->fd >= 0) shutdown(p->fd, SHUT_RDWR);
  }
}

static int end_op(ember_comm *c, int rc) {
  if (rc == EMBER_OK || c->broken) return rc;
  c->broken = 1;
  snprintf(c->broken_msg, sizeof c->broken_msg, "%s", ember_last_error());
  break_links(c);
  return rc;
}

static int check_comm(const ember_comm *c, const char *what) {
  if (c == NULL) return ember__set_error(EMBER_EINVAL, "%s: communicator is NULL", what);
  return EMBER_OK;
}

/* An allreduce's algorithm (collective.h): the same answer on every rank,
 * from the sizes, flags and addresses they all share. */
static int pick_algo(const ember_comm *c, size_t nbytes, size_t count) {
  if (nbytes <= c->small_max || count < c->size) return ALGO_DOUBLING;
  if (c->algo != ALGO_AUTO) return c->algo;
  int pow2 = c->size >= 4 && (c->size & (c->size - 1)) == 0;
  return pow2 && c->own_hosts ? ALGO_HALVING : ALGO_RING;
}

const char *ember_comm_allreduce_algorithm(const ember_comm *c, size_t count, int dtype) {
  size_t nbytes = 0;
  if (c == NULL || c->size == 1 || pick_kernel(dtype, EMBER_RED_SUM) == NULL ||
      __builtin_mul_overflow(count, ember_dtype_size((uint8_t)dtype), &nbytes))
    return "none";
  switch (pick_algo(c, nbytes, count)) {
  case ALGO_DOUBLING: return "recursive doubling";
  case ALGO_HALVING: return "halving";
  default: return "ring";
  }
}

int ember_comm_allreduce(ember_comm *c, void *buf, size_t count, int dtype, int op,
                         int64_t timeout_ms) {
  op_ctx o;
  int rc = check_comm(c, "allreduce");
  if (rc != EMBER_OK) return rc;
  if (pick_kernel(dtype, EMBER_RED_SUM) == NULL)
    return ember__set_error(EMBER_EINVAL,
                            "allreduce: unsupported dtype %d (float32, float64, int32 or "
                            "int64)", dtype);
  if (op < EMBER_RED_SUM || op > EMBER_RED_MAX)
    return ember__set_error(EMBER_EINVAL, "allreduce: unknown op %d (sum, avg, min, max)", op);
  size_t esz = ember_dtype_size((uint8_t)dtype), nbytes = 0;
  if (__builtin_mul_overflow(count, esz, &nbytes))
    return ember__set_error(EMBER_ETOOBIG, "allreduce: %zu elements overflow size_t", count);
  if (buf == NULL && nbytes > 0) return ember__set_error(EMBER_EINVAL, "allreduce: buf is NULL");
  rc = begin_op(c, &o, K_ALLREDUCE, dtype, op, 0, nbytes, timeout_ms);
  if (rc != EMBER_OK) return rc;
  if (c->size == 1) return EMBER_OK; /* avg over one rank is the identity */
  switch (pick_algo(c, nbytes, count)) {
  case ALGO_DOUBLING: rc = rd_allreduce(&o, buf, nbytes); break;
  case ALGO_HALVING: rc = rh_allreduce(&o, buf, count); break;
  default: rc = ring_allreduce(&o, buf, count); break;
  }
  return end_op(c, rc);
}

int ember_comm_broadcast(ember_comm *c, void *buf, size_t nbytes, uint32_t root,
                         int64_t timeout_ms) {
  op_ctx o;
  int rc = check_comm(c, "broadcast");
  if (rc != EMBER_OK) return rc;
  if (root >= c->size)
    return ember__set_error(EMBER_EINVAL, "broadcast: root %u is not a rank (size %u)", root,
                            c->size);
  if (buf == NULL && nbytes > 0) return ember__set_error(EMBER_EINVAL, "broadcast: buf is NULL");
  rc = begin_op(c, &o, K_BROADCAST, 0, 0, root, nbytes, timeout_ms);
  if (rc != EMBER_OK || c->size == 1) return rc;
  uint32_t n = c->size, pos = (c->rank + n - root) % n;
  peer_t *next = pos + 1 < n ? &c->peers[(c->rank + 1) % n] : NULL;
  peer_t *prev = pos > 0 ? &c->peers[(c->rank + n - 1) % n] : NULL;
  step_t st = {.send_off = 0, .send_len = next ? nbytes : 0, .recv_off = 0,
               .recv_len = prev ? nbytes : 0, .gate = prev ? 0 : -1};
  rc = run_steps(&o, 0, next, prev, buf, buf, &st, 1);
  return end_op(c, rc);
}

int ember_comm_allgather(ember_comm *c, const void *sendbuf, void *recvbuf, size_t nbytes,
                         int64_t timeout_ms) {
  op_ctx o;
  int rc = check_comm(c, "allgather");
  if (rc != EMBER_OK) return rc;
  size_t total = 0;
  if (__builtin_mul_overflow(nbytes, (size_t)c->size, &total))
    return ember__set_error(EMBER_ETOOBIG, "allgather: %zu bytes x %u ranks overflows", nbytes,
                            c->size);
  if (recvbuf == NULL && total > 0) return ember__set_error(EMBER_EINVAL, "allgather: recvbuf is NULL");
  uint8_t *rb = recvbuf;
  uint8_t *mine = total > 0 ? rb + (size_t)c->rank * nbytes : NULL;
  if (sendbuf != NULL && sendbuf != mine && nbytes > 0) {
    const uint8_t *sb = sendbuf;
    if (sb < rb + total && rb < sb + nbytes)
      return ember__set_error(EMBER_EINVAL,
                              "allgather: sendbuf overlaps recvbuf other than at this rank's "
                              "block");
  }
  rc = begin_op(c, &o, K_ALLGATHER, 0, 0, 0, total, timeout_ms);
  if (rc != EMBER_OK) return rc;
  if (sendbuf != NULL && sendbuf != mine && nbytes > 0) memcpy(mine, sendbuf, nbytes);
  if (c->size == 1) return EMBER_OK;
  uint32_t n = c->size, r = c->rank;
  int nsteps = (int)n - 1;
  step_t *st = calloc((size_t)nsteps, sizeof *st);
  if (st == NULL) return end_op(c, ember__set_error(EMBER_ENOMEM, "%s: out of memory", o.what));
  for (int s = 0; s < nsteps; s++) {
    st[s].send_off = (size_t)((r + n - (uint32_t)s) % n) * nbytes;
    st[s].send_len = nbytes;
    st[s].recv_off = (size_t)((r + 2 * n - (uint32_t)s - 1) % n) * nbytes;
    st[s].recv_len = nbytes;
    st[s].gate = s - 1;
  }
  rc = run_steps(&o, 0, &c->peers[(r + 1) % n], &c->peers[(r + n - 1) % n], rb, rb, st,
                 nsteps);
  free(st);
  return end_op(c, rc);
}

int ember_comm_barrier(ember_comm *c, int64_t timeout_ms) {
  op_ctx o;
  int rc = check_comm(c, "barrier");
  if (rc != EMBER_OK) return rc;
  rc = begin_op(c, &o, K_BARRIER, 0, 0, 0, 0, timeout_ms);
  if (rc != EMBER_OK || c->size == 1) return rc;
  rc = rd_allreduce(&o, NULL, 0);
  return end_op(c, rc);
}

void ember_comm_abort(ember_comm *c) {
  if (c == NULL) return;
  atomic_store(&c->abort_req, 1);
  if (c->inbox != NULL) ring_always(c->inbox);
  break_links(c);
}

uint32_t ember_comm_rank(const ember_comm *c) { return c ? c->rank : 0; }
uint32_t ember_comm_size(const ember_comm *c) { return c ? c->size : 0; }

int ember_comm_peer_is_shm(const ember_comm *c, uint32_t peer) {
  if (c == NULL || peer >= c->size || peer == c->rank) return 0;
  return c->peers[peer].shm;
}

/* ======================================================================
 * 6. Set-up
 * ====================================================================== */

/* "host:port" or "[v6]:port" -> host, port (1..65535). */
static int parse_address(const char *s, uint32_t idx, char *host, size_t cap, uint16_t *port) {
  if (s == NULL) return ember__set_error(EMBER_EINVAL, "comm: address of rank %u is NULL", idx);
  size_t len = strnlen(s, ADDR_CAP);
  if (len >= ADDR_CAP)
    return ember__set_error(EMBER_EINVAL, "comm: address of rank %u is longer than %u bytes",
                            idx, ADDR_CAP - 1);
  const char *h = s, *colon;
  size_t hlen;
  if (s[0] == '[') {
    const char *close = memchr(s, ']', len);
    if (close == NULL || close[1] != ':')
      return ember__set_error(EMBER_EINVAL, "comm: address of rank %u ('%s') is not "
                              "'[v6addr]:port'", idx, s);
    h = s + 1;
    hlen = (size_t)(close - h);
    colon = close + 1;
  } else {
    colon = strrchr(s, ':');
    if (colon == NULL || memchr(s, ':', (size_t)(colon - s)) != NULL)
      return ember__set_error(EMBER_EINVAL, "comm: address of rank %u ('%s') is not "
                              "'host:port' (IPv6 addresses go in brackets)", idx, s);
    hlen = (size_t)(colon - s);
  }
  if (hlen == 0 || hlen >= cap)
    return ember__set_error(EMBER_EINVAL, "comm: address of rank %u ('%s') has no valid host",
                            idx, s);
  char *end = NULL;
  errno = 0;
  unsigned long p = strtoul(colon + 1, &end, 10);
  if (colon[1] < '0' || colon[1] > '9' || *end != '\0' || errno != 0 || p == 0 || p > 65535)
    return ember__set_error(EMBER_EINVAL, "comm: address of rank %u ('%s') has no valid port "
                            "(1..65535)", idx, s);
  memcpy(host, h, hlen);
  host[hlen] = '\0';
  *port = (uint16_t)p;
  return EMBER_OK;
}

/* Keepalive and TCP_NODELAY; the buffer sizes are the kernel's to tune
 * (setting one turns its autotuning off): between simulated hosts autotuned
 * buffers carried 1.05-1.2x what fixed 4 MiB ones did at 1-256 MiB with 2
 * ranks and 1.0-1.17x at 16-256 MiB with 4 (bench-cluster, 2026-11-26), and
 * on a real network they grow to what its bandwidth-delay product needs. */
static void tune_socket(int fd) { (void)ember_net_tune(fd); }

static int send_hello(int fd, const ember_comm *c, int64_t deadline) {
  uint8_t b[8];
  ember_wire_put_u32(b, c->rank);
  ember_wire_put_u32(b + 4, c->size);
  return ember_net_send_frame(fd, EMBER_MSG_COLL_HELLO, b, sizeof b, deadline);
}

static int recv_hello(int fd, const ember_comm *c, const char *peer, uint32_t *rank,
                      int64_t deadline) {
  ember_frame_header hdr;
  uint8_t *pl = NULL;
  int rc = ember_net_recv_frame(fd, SET_UP_FRAME_MAX, &hdr, &pl, deadline);
  if (rc != EMBER_OK) return rc;
  if (hdr.type != EMBER_MSG_COLL_HELLO || hdr.length != 8) {
    rc = ember__set_error(EMBER_EPROTO, "comm: %s sent %s of %u bytes, expected COLL_HELLO",
                          peer, ember_wire_type_name(hdr.type), (unsigned)hdr.length);
    goto out;
  }
  *rank = ember_wire_get_u32(pl);
  uint32_t size = ember_wire_get_u32(pl + 4);
  if (size != c->size) {
    rc = ember__set_error(EMBER_EPROTO, "comm: %s (rank %u) has size %u, this rank has %u",
                          peer, (unsigned)*rank, (unsigned)size, (unsigned)c->size);
    goto out;
  }
  if (*rank >= c->size) {
    rc = ember__set_error(EMBER_EPROTO, "comm: %s claims rank %u of %u", peer,
                          (unsigned)*rank, (unsigned)c->size);
    goto out;
  }
out:
  free(pl);
  return rc;
}

/* ---- accepting the higher ranks: every pending connection at once ----
 *
 * Strangers may connect to a rank's port too.  Each accepted connection is
 * handshaken without blocking, in one poll loop over the listener and every
 * pending connection: CHALLENGE out at accept, then AUTH in, AUTH_OK out,
 * COLL_HELLO in, ours out.  A connection has preauth_ms from accept for all
 * of it; at most max_pending unauthenticated ones are kept (a new one evicts
 * the oldest); so neither idle nor slow strangers delay the real ranks.
 * Exactly the bytes of the current frame are read, so nothing past the
 * peer's COLL_HELLO (the shared-memory offer) is consumed here. */

typedef struct {
  int fd;
  int authed;       /* proved the secret; waiting for COLL_HELLO; never evicted */
  int64_t deadline; /* accept + preauth_ms */
  size_t have;      /* bytes of the current frame in buf */
  ember_auth_pending auth;
  uint8_t buf[AUTH_FRAME_LEN];
  char peer[96];
} mesh_pending;

typedef struct {
  ember_comm *c;
  const uint8_t *secret;
  size_t secret_len;
  mesh_pending *p; /* oldest first */
  size_t n, cap, nunauth;
  struct pollfd *pfds;
  uint32_t pre_ms, max_pending;
  int64_t paused_until;
  ember__reject_log rejects;
  ember_log_fn log_fn;
  void *log_arg;
  uint64_t nrejected;
  char rejected[512]; /* the latest, for the timeout message */
} mesh_accept;

/* One non-blocking send of a small frame: a connection's first few dozen
 * bytes always fit its socket buffer, so anything short of all is a failure. */
static int send_small(int fd, const uint8_t *b, size_t len) {
  ssize_t w;
  do {
    w = send(fd, b, len, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (w < 0 && errno == EINTR);
  return w == (ssize_t)len ? EMBER_OK : EMBER_EIO;
}

/* Ends pending connection i: sends `reply` (a REFUSED) if given, closes it,
 * and reports it: a stranger rate-limited in the log, any peer in the
 * message a mesh timeout will carry. */
static void mesh_reject(mesh_accept *m, size_t i, const char *reason, const uint8_t *reply,
                        size_t reply_len) {
  mesh_pending *q = &m->p[i];
  char line[768];
  if (reply != NULL && reply_len > 0) (void)send_small(q->fd, reply, reply_len);
  ember_net_close(q->fd);
  m->nrejected++;
  snprintf(m->rejected, sizeof m->rejected, "from %s was rejected: %s", q->peer, reason);
  if (!q->authed &&
      ember__reject_note(&m->rejects, ember_now_ms(), q->peer, reason, line, sizeof line) > 0)
    m->log_fn(m->log_arg, line);
  if (!q->authed) m->nunauth--;
  memmove(q, q + 1, (m->n - i - 1) * sizeof *q);
  m->n--;
}

/* COLL_HELLO has arrived whole: checks it, answers with ours, and hands the
 * connection to its rank.  Returns 1 when the rank is now connected. */
static int mesh_hello(mesh_accept *m, size_t i) {
  mesh_pending *q = &m->p[i];
  ember_comm *c = m->c;
  char why[256];
  uint32_t got = ember_wire_get_u32(q->buf + EMBER_WIRE_HEADER_LEN);
  uint32_t size = ember_wire_get_u32(q->buf + EMBER_WIRE_HEADER_LEN + 4);
  if (size != c->size) {
    snprintf(why, sizeof why, "rank %u has size %u, this rank has %u", (unsigned)got,
             (unsigned)size, (unsigned)c->size);
  } else if (got >= c->size) {
    snprintf(why, sizeof why, "claims rank %u of %u", (unsigned)got, (unsigned)c->size);
  } else if (got <= c->rank || c->peers[got].fd >= 0) {
    snprintf(why, sizeof why, "claims rank %u, which does not connect to rank %u or is "
             "already connected", (unsigned)got, (unsigned)c->rank);
  } else {
    uint8_t f[HELLO_FRAME_LEN];
    ember_wire_encode_header(f, EMBER_MSG_COLL_HELLO, 8);
    ember_wire_put_u32(f + EMBER_WIRE_HEADER_LEN, c->rank);
    ember_wire_put_u32(f + EMBER_WIRE_HEADER_LEN + 4, c->size);
    if (send_small(q->fd, f, sizeof f) != EMBER_OK) {
      snprintf(why, sizeof why, "sending COLL_HELLO failed: %s", strerror(errno));
    } else {
      tune_socket(q->fd);
      c->peers[got].fd = q->fd;
      memmove(q, q + 1, (m->n - i - 1) * sizeof *q);
      m->n--;
      return 1;
    }
  }
  mesh_reject(m, i, why, NULL, 0);
  return 0;
}

/* Reads what pending connection i has of its current frame and acts on a
 * whole one.  Returns 1 when a rank got connected. */
static int mesh_read(mesh_accept *m, size_t i) {
  mesh_pending *q = &m->p[i];
  ember_frame_header h;
  uint8_t reply[EMBER_WIRE_HEADER_LEN + 8 + 256];
  size_t reply_len = 0, want;
  char why[384];
  const size_t frame = q->authed ? HELLO_FRAME_LEN : AUTH_FRAME_LEN;
  want = q->have < EMBER_WIRE_HEADER_LEN ? EMBER_WIRE_HEADER_LEN : frame;
  ssize_t n;
  do {
    n = recv(q->fd, q->buf + q->have, want - q->have, MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
  if (n <= 0) {
    snprintf(why, sizeof why, "%s%s", n == 0 ? "closed the connection" : strerror(errno),
             q->authed ? " before COLL_HELLO" : " before authenticating");
    mesh_reject(m, i, why, NULL, 0);
    return 0;
  }
  q->have += (size_t)n;
  if (q->have < EMBER_WIRE_HEADER_LEN) return 0;
  if (ember_wire_decode_header(q->buf, EMBER_WIRE_HEADER_LEN,
                               q->authed ? SET_UP_FRAME_MAX : EMBER_WIRE_ABSOLUTE_MAX,
                               &h) != EMBER_OK) {
    snprintf(why, sizeof why, "expected %s: %s", q->authed ? "COLL_HELLO" : "AUTH frame",
             ember_last_error());
    mesh_reject(m, i, why, NULL, 0);
    return 0;
  }
  if (q->authed) {
    if (h.type != EMBER_MSG_COLL_HELLO || h.length != 8) {
      snprintf(why, sizeof why, "sent %s of %u bytes, expected COLL_HELLO",
               ember_wire_type_name(h.type), (unsigned)h.length);
      mesh_reject(m, i, why, NULL, 0);
      return 0;
    }
    return q->have == HELLO_FRAME_LEN ? mesh_hello(m, i) : 0;
  }
  /* A wrong type or length is refused on the header alone, before any of
   * the payload it claims is read. */
  int well_formed = h.type == EMBER_MSG_AUTH && h.length == 2u * EMBER_NONCE_LEN;
  if (well_formed && q->have < AUTH_FRAME_LEN) return 0;
  int rc = ember_auth_server_check(&q->auth, m->secret, m->secret_len, h.type,
                                   well_formed ? q->buf + EMBER_WIRE_HEADER_LEN : NULL,
                                   h.length, reply, sizeof reply, &reply_len);
  if (rc == EMBER_OK && send_small(q->fd, reply, reply_len) == EMBER_OK) {
    q->authed = 1;
    q->have = 0;
    m->nunauth--;
    return 0;
  }
  snprintf(why, sizeof why, "%s", rc == EMBER_OK ? "sending AUTH_OK failed"
                                                 : ember_last_error());
  mesh_reject(m, i, why, rc == EMBER_EAUTH ? reply : NULL, reply_len);
  return 0;
}

/* Ends the oldest unauthenticated pending connection.  0 if there is none. */
static int mesh_evict(mesh_accept *m, const char *why) {
  for (size_t i = 0; i < m->n; i++) {
    if (m->p[i].authed) continue;
    char reason[192];
    snprintf(reason, sizeof reason, "evicted before authenticating: %s", why);
    mesh_reject(m, i, reason, NULL, 0);
    return 1;
  }
  return 0;
}

static void mesh_accept_some(mesh_accept *m) {
  for (int k = 0; k < MESH_ACCEPT_BATCH; k++) {
    int fd = accept4(m->c->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if ((err == EMFILE || err == ENFILE) &&
          mesh_evict(m, "this rank is out of file descriptors"))
        continue;
      m->paused_until = ember_now_ms() + MESH_ACCEPT_PAUSE_MS;
      return;
    }
    if (m->nunauth >= m->max_pending) {
      char why[96];
      snprintf(why, sizeof why, "%zu connections were waiting to authenticate (limit %u)",
               m->nunauth, (unsigned)m->max_pending);
      mesh_evict(m, why);
    }
    if (m->n == m->cap) { /* authenticated ones fill the rest: unlikely */
      ember_net_close(fd);
      continue;
    }
    mesh_pending *q = &m->p[m->n];
    size_t chl = 0;
    memset(q, 0, sizeof *q);
    q->fd = fd;
    q->deadline = ember_now_ms() + m->pre_ms;
    ember_net_peer_name(fd, q->peer, sizeof q->peer);
    if (ember_auth_server_begin(&q->auth, q->buf, sizeof q->buf, &chl) != EMBER_OK ||
        send_small(fd, q->buf, chl) != EMBER_OK) {
      ember_net_close(fd);
      continue;
    }
    m->n++;
    m->nunauth++;
  }
}

/* Accepts until every higher rank is connected or the deadline passes. */
static int accept_higher(ember_comm *c, const ember_comm_config *cfg, int64_t deadline) {
  uint32_t missing = c->size - 1 - c->rank;
  mesh_accept m;
  int rc = EMBER_OK;
  char line[768];
  if (missing == 0) return EMBER_OK;
  memset(&m, 0, sizeof m);
  m.c = c;
  m.secret = cfg->secret;
  m.secret_len = cfg->secret_len;
  m.pre_ms = ember__preauth_timeout_ms(cfg->preauth_timeout_ms);
  m.max_pending = ember__preauth_max_pending(cfg->max_pending);
  if (cfg->max_pending == 0 && m.max_pending < missing + 64u) /* a big world at once */
    m.max_pending = ember__preauth_max_pending(missing + 64u);
  m.log_fn = cfg->log_fn ? cfg->log_fn : ember__log_stderr;
  m.log_arg = cfg->log_fn ? cfg->log_arg : NULL;
  m.cap = (size_t)m.max_pending + missing;
  m.p = calloc(m.cap, sizeof *m.p);
  m.pfds = calloc(m.cap + 1, sizeof *m.pfds);
  if (m.p == NULL || m.pfds == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "comm: out of memory for %zu pending connections",
                          m.cap);
    goto out;
  }
  {
    uint16_t port = 0;
    ember_net_local_addr(c->listen_fd, NULL, 0, &port);
    ember__reject_log_init(&m.rejects, "collective rank %u on :%u", (unsigned)c->rank,
                           (unsigned)port);
  }
  while (missing > 0) {
    int64_t now = ember_now_ms();
    for (size_t i = m.n; i-- > 0;)
      if (now >= m.p[i].deadline) {
        char why[96];
        snprintf(why, sizeof why, "handshake not completed within %u ms (%s)",
                 (unsigned)m.pre_ms, m.p[i].authed ? "no COLL_HELLO" : "no valid AUTH frame");
        mesh_reject(&m, i, why, NULL, 0);
      }
    if (ember__reject_take(&m.rejects, now, line, sizeof line) > 0) m.log_fn(m.log_arg, line);
    if (now >= deadline) {
      char list[256] = "";
      size_t used = 0;
      for (uint32_t j = c->rank + 1; j < c->size && used + 16 < sizeof list; j++)
        if (c->peers[j].fd < 0)
          used += (size_t)snprintf(list + used, sizeof list - used, "%s%u", used ? ", " : "", j);
      char extra[700] = "";
      if (m.nrejected == 1)
        snprintf(extra, sizeof extra, "; a connection %s", m.rejected);
      else if (m.nrejected > 1)
        snprintf(extra, sizeof extra, "; %llu connections were rejected (the last one %s)",
                 (unsigned long long)m.nrejected, m.rejected);
      rc = ember__set_error(EMBER_ETIMEDOUT, "comm: rank %u timed out waiting for rank(s) "
                            "%s to connect%s", c->rank, list, extra);
      goto out;
    }
    int64_t wake = deadline;
    if (m.n > 0 && m.p[0].deadline < wake) wake = m.p[0].deadline; /* the oldest's is first */
    if (ember__reject_due(&m.rejects) < wake) wake = ember__reject_due(&m.rejects);
    int paused = now < m.paused_until;
    if (paused && m.paused_until < wake) wake = m.paused_until;
    m.pfds[0] = (struct pollfd){.fd = paused ? -1 : c->listen_fd, .events = POLLIN};
    for (size_t i = 0; i < m.n; i++)
      m.pfds[1 + i] = (struct pollfd){.fd = m.p[i].fd, .events = POLLIN};
    int64_t left = wake - now;
    int pr = poll(m.pfds, (nfds_t)(m.n + 1),
                  left <= 0 ? 0 : left > POLL_SLICE_MS * 10 ? POLL_SLICE_MS * 10 : (int)left);
    if (pr < 0 && errno != EINTR) {
      rc = ember__set_errno(EMBER_ESYS, errno, "comm: poll while accepting ranks");
      goto out;
    }
    if (pr <= 0) continue;
    /* Pending connections first (backwards: a removal only moves entries
     * already visited), then new ones. */
    for (size_t i = m.n; i-- > 0;)
      if (m.pfds[1 + i].revents != 0 && mesh_read(&m, i)) missing--;
    if (m.pfds[0].revents & POLLIN) mesh_accept_some(&m);
  }
out:
  for (size_t i = 0; i < m.n; i++) ember_net_close(m.p[i].fd);
  if (m.log_fn != NULL && ember__reject_flush(&m.rejects, ember_now_ms(), line, sizeof line) > 0)
    m.log_fn(m.log_arg, line);
  free(m.p);
  free(m.pfds);
  return rc;
}

/* Connects to every lower rank and accepts every higher one.  Waits only go
 * to lower ranks, and rank 0 only accepts, so there is no cycle. */
static int build_mesh(ember_comm *c, const ember_comm_config *cfg, int64_t deadline) {
  int rc;
  for (uint32_t j = 0; j < c->rank; j++) {
    peer_t *p = &c->peers[j];
    uint32_t got = 0;
    /* Retries a connection the peer evicted from its pending pool (a flood
     * of strangers there); a refusal of our proof is final. */
    rc = ember__connect_auth(p->host, p->port, cfg->secret, cfg->secret_len, deadline,
                             &p->fd);
    if (rc != EMBER_OK)
      return ember__set_error(rc, "comm: connecting to %s: %s", p->desc, ember_last_error());
    rc = send_hello(p->fd, c, deadline);
    if (rc == EMBER_OK) rc = recv_hello(p->fd, c, p->desc, &got, deadline);
    if (rc == EMBER_OK && got != j)
      rc = ember__set_error(EMBER_EPROTO, "comm: the address of rank %u (%s:%u) is served "
                            "by rank %u", j, p->host, (unsigned)p->port, (unsigned)got);
    if (rc != EMBER_OK)
      return ember__set_error(rc, "comm: with %s: %s", p->desc, ember_last_error());
    tune_socket(p->fd);
  }
  return accept_higher(c, cfg, deadline);
}

/* The ring from `from` to this rank: the ring algorithms stream through the
 * one from the previous rank; the others carry recursive doubling's small
 * exchanges. */
static size_t ring_cap_for(const ember_comm *c, uint32_t from) {
  return from == (c->rank + c->size - 1) % c->size ? PREV_RING_CAP : SIDE_RING_CAP;
}

/* COLL_SHM: our inbox's name ("" = no shared memory), its token, and the
 * descriptor of the ring we created for the peer to send into. */
static int send_shm_offer(int fd, const char *name, const uint8_t *token,
                          const ember_shm_ring *in, int64_t deadline) {
  ember_shm_ring_desc d;
  uint8_t desc[EMBER_SHM_RING_DESC_WIRE_LEN];
  memset(&d, 0, sizeof d);
  if (in != NULL) ember_shm_ring_describe(in, &d);
  ember_shm_ring_desc_encode(&d, desc);
  ember_wire_writer w;
  ember_wire_writer_init(&w);
  ember_wire_write_str(&w, name);
  ember_wire_write_raw(&w, token, 32);
  ember_wire_write_raw(&w, desc, sizeof desc);
  int rc = w.err ? w.err : ember_net_send_frame(fd, EMBER_MSG_COLL_SHM, w.buf, (uint32_t)w.len, deadline);
  ember_wire_writer_free(&w);
  return rc;
}

/* Maps a peer's inbox and attaches to the ring it made for us from its
 * offer; 1 on success, 0 if they cannot be used here (another host, or no
 * shared memory), negative on a protocol error. */
static int map_peer_inbox(ember_comm *c, peer_t *p, const uint8_t *pl, uint32_t len) {
  ember_wire_reader r;
  char name[SHM_NAME_CAP];
  const uint8_t *token = NULL, *desc = NULL;
  ember_shm_ring_desc d;
  ember_wire_reader_init(&r, pl, len);
  ember_wire_read_str(&r, name, sizeof name);
  ember_wire_read_raw(&r, &token, 32);
  ember_wire_read_raw(&r, &desc, EMBER_SHM_RING_DESC_WIRE_LEN);
  int rc = ember_wire_reader_finish(&r, 1, "COLL_SHM");
  if (rc != EMBER_OK)
    return ember__set_error(rc, "comm: from %s: %s", p->desc, ember_last_error());
  if (name[0] == '\0') return 0; /* the peer offers no shared memory */
  if (name[0] != '/' || strchr(name + 1, '/') != NULL)
    return ember__set_error(EMBER_EPROTO, "comm: %s offered an invalid shared-memory "
                            "segment name '%s'", p->desc, name);
  ember_shm_ring_desc_decode(desc, &d);
  int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return 0; /* not on this host (or no /dev/shm): TCP */
  struct stat stt;
  void *m = MAP_FAILED;
  if (fstat(fd, &stt) == 0 && stt.st_uid == geteuid() && (uint64_t)stt.st_size == INBOX_HDR_LEN)
    m = mmap(NULL, INBOX_HDR_LEN, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return 0;
  inbox_hdr *ib = m;
  if (ib->magic != INBOX_MAGIC || memcmp(ib->token, token, 32) != 0 ||
      ib->owner_rank != p->rank || ib->size != c->size) {
    munmap(m, INBOX_HDR_LEN);
    return 0; /* a same-named segment of someone else: never trust it */
  }
  /* The ring checks its own segment (owner, mode, seals, size, token). */
  if (ember_shm_ring_attach(&p->out, &d, EMBER_SHM_PRODUCER) != EMBER_OK) {
    munmap(m, INBOX_HDR_LEN);
    return 0;
  }
  p->peer_ib = ib;
  return 1;
}

/* Creates this rank's inbox and one ring from each peer; on any failure,
 * none (the communicator then uses TCP only). */
static int create_shm(ember_comm *c, char name[SHM_NAME_CAP], uint8_t token[32]) {
  uint8_t rnd[16];
  int rc = ember_auth_random(rnd, sizeof rnd);
  if (rc == EMBER_OK) rc = ember_auth_random(token, 32);
  if (rc != EMBER_OK) return rc;
  int n = snprintf(name, SHM_NAME_CAP, "/ember-coll-");
  for (size_t i = 0; i < sizeof rnd; i++)
    n += snprintf(name + n, SHM_NAME_CAP - (size_t)n, "%02x", rnd[i]);
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    name[0] = '\0'; /* no shared memory here: TCP only */
    return EMBER_OK;
  }
  void *m = MAP_FAILED;
  if (ftruncate(fd, INBOX_HDR_LEN) == 0)
    m = mmap(NULL, INBOX_HDR_LEN, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  int ok = m != MAP_FAILED;
  for (uint32_t j = 0; j < c->size && ok; j++)
    if (j != c->rank &&
        ember_shm_ring_create(&c->peers[j].in, ring_cap_for(c, j), EMBER_SHM_CONSUMER) != EMBER_OK)
      ok = 0;
  if (!ok) {
    shm_unlink(name);
    name[0] = '\0';
    if (m != MAP_FAILED) munmap(m, INBOX_HDR_LEN);
    for (uint32_t j = 0; j < c->size; j++) {
      ember_shm_ring_destroy(c->peers[j].in);
      c->peers[j].in = NULL;
    }
    return EMBER_OK;
  }
  c->inbox = m;
  c->inbox->magic = INBOX_MAGIC;
  memcpy(c->inbox->token, token, 32);
  c->inbox->owner_rank = c->rank;
  c->inbox->size = c->size;
  return EMBER_OK;
}

static int setup_shm(ember_comm *c, uint32_t flags, int64_t deadline) {
  char name[SHM_NAME_CAP] = "";
  uint8_t token[32] = {0};
  int rc = EMBER_OK;
  uint8_t *ok = calloc(c->size, 1);
  if (ok == NULL) return ember__set_error(EMBER_ENOMEM, "comm: out of memory");

  if (!(flags & EMBER_COMM_TCP_ONLY)) rc = create_shm(c, name, token);
  for (uint32_t j = 0; j < c->size && rc == EMBER_OK; j++) {
    if (j == c->rank) continue;
    rc = send_shm_offer(c->peers[j].fd, c->inbox ? name : "", token, c->peers[j].in, deadline);
  }
  for (uint32_t j = 0; j < c->size && rc == EMBER_OK; j++) {
    if (j == c->rank) continue;
    ember_frame_header hdr;
    uint8_t *pl = NULL;
    rc = ember_net_recv_frame(c->peers[j].fd, SET_UP_FRAME_MAX, &hdr, &pl, deadline);
    if (rc != EMBER_OK) break;
    if (hdr.type != EMBER_MSG_COLL_SHM)
      rc = ember__set_error(EMBER_EPROTO, "comm: %s sent %s, expected COLL_SHM",
                            c->peers[j].desc, ember_wire_type_name(hdr.type));
    else if (flags & EMBER_COMM_TCP_ONLY)
      ok[j] = 0;
    else {
      int m = map_peer_inbox(c, &c->peers[j], pl, hdr.length);
      if (m < 0) rc = m;
      ok[j] = m > 0;
    }
    free(pl);
  }
  for (uint32_t j = 0; j < c->size && rc == EMBER_OK; j++) {
    if (j == c->rank) continue;
    uint8_t b[4];
    ember_wire_put_u32(b, ok[j]);
    rc = ember_net_send_frame(c->peers[j].fd, EMBER_MSG_COLL_SHM_ACK, b, 4, deadline);
  }
  for (uint32_t j = 0; j < c->size && rc == EMBER_OK; j++) {
    if (j == c->rank) continue;
    ember_frame_header hdr;
    uint8_t *pl = NULL;
    rc = ember_net_recv_frame(c->peers[j].fd, SET_UP_FRAME_MAX, &hdr, &pl, deadline);
    if (rc != EMBER_OK) break;
    if (hdr.type != EMBER_MSG_COLL_SHM_ACK || hdr.length != 4)
      rc = ember__set_error(EMBER_EPROTO, "comm: %s sent %s, expected COLL_SHM_ACK",
                            c->peers[j].desc, ember_wire_type_name(hdr.type));
    else
      c->peers[j].shm = ok[j] && ember_wire_get_u32(pl) == 1 && c->inbox != NULL;
    free(pl);
  }
  /* Every peer that will map our inbox has mapped it by now (or failed to):
   * the name goes, the memory stays until the last unmap.  Rings of peers
   * that use TCP are freed now. */
  if (name[0] != '\0') shm_unlink(name);
  for (uint32_t j = 0; j < c->size; j++) {
    peer_t *p = &c->peers[j];
    if (p->shm) continue;
    ember_shm_ring_destroy(p->in);
    ember_shm_ring_destroy(p->out);
    p->in = p->out = NULL;
    if (p->peer_ib != NULL) munmap(p->peer_ib, INBOX_HDR_LEN);
    p->peer_ib = NULL;
  }
  free(ok);
  return rc;
}

void ember_comm_destroy(ember_comm *c) {
  if (c == NULL) return;
  if (c->peers != NULL) {
    for (uint32_t j = 0; j < c->size; j++) {
      peer_t *p = &c->peers[j];
      ember_net_close(p->fd);
      ember_shm_ring_destroy(p->in);
      ember_shm_ring_destroy(p->out);
      if (p->peer_ib != NULL) munmap(p->peer_ib, INBOX_HDR_LEN);
    }
  }
  if (c->inbox != NULL) munmap(c->inbox, INBOX_HDR_LEN);
  ember_net_close(c->listen_fd);
  free(c->peers);
  free(c->tmp);
  free(c);
}

int ember_comm_create(ember_comm **out, const ember_comm_config *cfg, int64_t timeout_ms) {
  ember_comm *c = NULL;
  int rc = EMBER_OK;
  int listen_fd = cfg != NULL ? cfg->listen_fd : -1;
  if (out == NULL || cfg == NULL) {
    ember_net_close(listen_fd);
    return ember__set_error(EMBER_EINVAL, "comm_create: out and cfg are required");
  }
  *out = NULL;
  int64_t deadline = timeout_ms < 0 ? INT64_MAX : ember_deadline_after(timeout_ms);
  if (cfg->size == 0 || cfg->size > EMBER_COMM_MAX_RANKS) {
    rc = ember__set_error(EMBER_EINVAL, "comm_create: size %u is not in 1..%u", cfg->size,
                          EMBER_COMM_MAX_RANKS);
    goto fail;
  }
  if (cfg->rank >= cfg->size) {
    rc = ember__set_error(EMBER_EINVAL, "comm_create: rank %u is not below size %u", cfg->rank,
                          cfg->size);
    goto fail;
  }
  if (cfg->addresses == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "comm_create: addresses is NULL");
    goto fail;
  }
  if (cfg->secret == NULL || cfg->secret_len < EMBER_SECRET_MIN_LEN) {
    rc = ember__set_error(EMBER_EINVAL, "comm_create: the job secret must have at least %u "
                          "bytes", (unsigned)EMBER_SECRET_MIN_LEN);
    goto fail;
  }
  c = calloc(1, sizeof *c);
  if (c == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "comm_create: out of memory");
    goto fail;
  }
  c->rank = cfg->rank;
  c->size = cfg->size;
  c->listen_fd = -1;
  c->small_max = cfg->small_max ? cfg->small_max : SMALL_MAX_DEFAULT;
  c->peers = calloc(c->size, sizeof *c->peers);
  c->tmp_cap = c->small_max > TCP_TMP_CAP ? c->small_max : TCP_TMP_CAP;
  c->tmp = malloc(c->tmp_cap);
  if (c->peers == NULL || c->tmp == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "comm_create: out of memory");
    goto fail;
  }
  for (uint32_t j = 0; j < c->size; j++) {
    peer_t *p = &c->peers[j];
    p->fd = -1;
    p->rank = j;
    rc = parse_address(cfg->addresses[j], j, p->host, sizeof p->host, &p->port);
    if (rc != EMBER_OK) goto fail;
    snprintf(p->desc, sizeof p->desc, "rank %u (%s)", j, cfg->addresses[j]);
  }
  /* Spinning only pays when every rank on this host can have a core; ranks
   * on other hosts (another address) do not compete for ours. */
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN), local = 0;
  for (uint32_t j = 0; j < c->size; j++)
    local += strcmp(c->peers[j].host, c->peers[c->rank].host) == 0;
  int oversubscribed = ncpu > 0 && local > ncpu;
  c->spin_us = oversubscribed ? 2 : 50;
  const char *spin = getenv("EMBER_COLL_SPIN_US"); /* tuning knob, microseconds */
  if (spin != NULL && spin[0] >= '0' && spin[0] <= '9') {
    long v = strtol(spin, NULL, 10);
    c->spin_us = v > 100000 ? 100000 : (int)v;
  }
  c->spin_cur_ns = (int64_t)c->spin_us * 1000;
  c->yield_us = oversubscribed ? 1000 : 0;
  c->tcp_yield_us = TCP_YIELD_US;
  const char *yield = getenv("EMBER_COLL_YIELD_US"); /* tuning knob, microseconds */
  if (yield != NULL && yield[0] >= '0' && yield[0] <= '9') {
    long v = strtol(yield, NULL, 10);
    c->yield_us = c->tcp_yield_us = v > 100000 ? 100000 : (int)v;
  }
  if ((cfg->flags & EMBER_COMM_RING) && (cfg->flags & EMBER_COMM_HALVING)) {
    rc = ember__set_error(EMBER_EINVAL, "comm_create: EMBER_COMM_RING and "
                          "EMBER_COMM_HALVING exclude each other");
    goto fail;
  }
  c->algo = (cfg->flags & EMBER_COMM_RING)      ? ALGO_RING
            : (cfg->flags & EMBER_COMM_HALVING) ? ALGO_HALVING
                                                : ALGO_AUTO;
  c->own_hosts = 1;
  for (uint32_t i = 0; i < c->size && c->own_hosts; i++)
    for (uint32_t j = i + 1; j < c->size; j++)
      if (strcmp(c->peers[i].host, c->peers[j].host) == 0) {
        c->own_hosts = 0;
        break;
      }
  ember__raise_fd_limit();

  if (c->size > 1) {
    if (listen_fd >= 0) {
      c->listen_fd = listen_fd;
      listen_fd = -1;
      rc = ember_net_listen_fd(c->listen_fd, MESH_BACKLOG);
    } else {
      rc = ember_net_bind(cfg->bind_host, c->peers[c->rank].port, MESH_BACKLOG, 0,
                          &c->listen_fd, NULL);
    }
    if (rc != EMBER_OK) goto fail;
    rc = build_mesh(c, cfg, deadline);
    if (rc != EMBER_OK) goto fail;
    rc = setup_shm(c, cfg->flags, deadline);
    if (rc != EMBER_OK) goto fail;
    ember_net_close(c->listen_fd); /* the mesh is complete: no one else may join */
    c->listen_fd = -1;
  }
  ember_net_close(listen_fd);
  *out = c;
  return EMBER_OK;
fail:
  ember_net_close(listen_fd);
  ember_comm_destroy(c);
  return rc;
}
