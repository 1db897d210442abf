/* coll_engine.c - doorbells, channels and the step engine of the collective
 * (see coll_engine.h). */
#include "coll_engine.h"

#include <stdlib.h>

#include "ember/secure.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ember/error.h"
#include "ember/net.h"
#include "ember/wire.h"

#define COLL_MAGIC 0x4C4F4345u /* bytes 'E' 'C' 'O' 'L' */
#define OPHDR_LEN 24u
/* A message's header is padded to the next 64-byte boundary of its
 * connection's stream (OPHDR_MAX at most), so that every payload starts on
 * one: see hdr_len. */
#define OPHDR_MAX (OPHDR_LEN + COLL_STREAM_ALIGN - 1u)
#ifndef SHM_CHUNK
#define SHM_CHUNK (256u * 1024u) /* most bytes copied per ring operation */
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
#define FUTEX_SLICE_MS 10 /* a doorbell wait's sleep, between checks */

/* ---------------------------------------------------------------- doorbells */

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
static void ring(ember__coll_inbox *ib) {
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(&ib->waiting, memory_order_relaxed)) {
    atomic_fetch_add_explicit(&ib->bell, 1, memory_order_relaxed);
    futex_wake(&ib->bell);
  }
}

void ember__coll_bell(ember__coll_inbox *ib) {
  atomic_fetch_add_explicit(&ib->bell, 1, memory_order_seq_cst);
  futex_wake(&ib->bell);
}

/* ---------------------------------------------------------------- channels */

/* What a failed channel call means, with the peer named. */
static int io_fail(ember__coll_peer *p, const char *what, int err) {
  int code = (err == EPIPE || err == ECONNRESET || err == ENOTCONN || err == ESHUTDOWN)
                 ? EMBER_ECLOSED
                 : EMBER_EIO;
  if (code == EMBER_ECLOSED)
    return ember__set_errno(code, err, "%s %s (the peer failed, was killed or left)", what,
                            p->desc);
  /* The kernel gave up retransmitting (about 15 s with ember_net_tune's
   * backoff cap): nothing crossed the network, though the peer may live. */
  if (err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH)
    return ember__set_errno(code, err,
                            "%s %s (no packet got through for seconds: the network between "
                            "the two hosts is cut, or the peer's host is down)",
                            what, p->desc);
  return ember__set_errno(code, err, "%s %s", what, p->desc);
}

/* Sends up to alen bytes of a then blen bytes of b without blocking; returns
 * the bytes taken (0: no room now) or a negative status.  Over shared memory
 * the bytes of b taken are a multiple of gran (the element size), so the
 * receiver reduces whole elements out of every record. */
/* Encrypted records of at most this many bytes: the receiver can open a
 * record (and reduce it) only once all of it is in, so smaller records keep
 * the two ranks' work overlapped; larger ones cost fewer GCM set-ups. */
static size_t coll_sec_piece(void) {
  static size_t v;
  if (v == 0) {
    const char *e = getenv("EMBER_COLL_SEC_RECORD");
    long n = e ? atol(e) : 0;
    v = n >= 4096 && n <= (long)EMBER_SEC_RECORD_MAX ? (size_t)n : EMBER_SEC_RECORD_MAX;
  }
  return v;
}

static long ch_send(ember_comm *c, ember__coll_peer *p, const uint8_t *a, size_t alen,
                    const uint8_t *b, size_t blen, size_t gran) {
  if (!p->shm) {
    struct iovec iov[2];
    int cnt = 0;
    if (alen > 0) iov[cnt++] = (struct iovec){.iov_base = (void *)a, .iov_len = alen};
    if (blen > TCP_SEND_PIECE) blen = TCP_SEND_PIECE;
    if (p->sec != NULL && blen > coll_sec_piece()) blen = coll_sec_piece();
    if (blen > 0) iov[cnt++] = (struct iovec){.iov_base = (void *)b, .iov_len = blen};
    if (cnt == 0) return 0;
    if (p->sec != NULL) {
      long n = ember_sec_send(p->sec, p->fd, iov, cnt);
      return n; /* an error's message names the peer (ember_sec_set_peer) */
    }
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
static long ch_recv(ember_comm *c, ember__coll_peer *p, uint8_t *dst, size_t len,
                    ember__reduce_fn fn, size_t esz, int *moved) {
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
      ssize_t n;
      if (p->sec != NULL) {
        long k = ember_sec_recv(p->sec, p->fd, into, want);
        if (k < 0 && k != EMBER_ECLOSED) return k; /* the message names the peer */
        if (k == 0) return 0;
        n = k < 0 ? 0 : (ssize_t)k;
      } else {
        n = recv(p->fd, into, want, MSG_DONTWAIT);
      }
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

/* ---------------------------------------------------------------- the step engine */

static const char *kind_str(int k) {
  switch (k) {
  case COLL_ALLREDUCE: return "allreduce";
  case COLL_BROADCAST: return "broadcast";
  case COLL_ALLGATHER: return "allgather";
  case COLL_BARRIER: return "barrier";
  default: return "unknown";
  }
}

/* The length of a header that starts at stream position pos: OPHDR_LEN
 * bytes, then zeros up to the next multiple of COLL_STREAM_ALIGN, so the
 * payload after it starts at a multiple of 64 bytes into the connection (both ends
 * count the same bytes, so the length is never sent).  With 24-byte headers
 * each message moved its payload 24 bytes further along the 64-byte lines of
 * the kernel's socket buffers, and the kernel's copies into and out of
 * them, which are most of a TCP allreduce's time, ran up to 5x slower at
 * some of those offsets (AMD EPYC, rep movsb): between simulated hosts
 * (bench-cluster) payloads on 64-byte lines took 2 ranks at 1 MiB from 1.18
 * to 1.87 GB/s and 4 ranks from 0.54 to 0.88, and gave 1.03-1.4x at
 * 4-256 MiB. */
static size_t hdr_len(uint64_t pos) {
  const uint64_t a = COLL_STREAM_ALIGN;
  uint64_t end = (pos + OPHDR_LEN + a - 1) / a * a;
  return (size_t)(end - pos);
}

static void encode_ophdr(const ember__coll_op *o, int step, uint8_t out[OPHDR_LEN]) {
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
  if (kind == COLL_ALLREDUCE)
    snprintf(out, cap, "allreduce #%u (%s %s, %llu bytes)", (unsigned)ember_wire_get_u32(h + 4),
             ember__coll_dtype_str(h[9]), ember__coll_redop_str(h[10]),
             (unsigned long long)ember_wire_get_u64(h + 16));
  else if (kind == COLL_BROADCAST)
    snprintf(out, cap, "broadcast #%u (root %u, %llu bytes)",
             (unsigned)ember_wire_get_u32(h + 4), (unsigned)ember_wire_get_u32(h + 12),
             (unsigned long long)ember_wire_get_u64(h + 16));
  else
    snprintf(out, cap, "%s #%u (%llu bytes)", kind_str(kind),
             (unsigned)ember_wire_get_u32(h + 4),
             (unsigned long long)ember_wire_get_u64(h + 16));
}

const char *ember__coll_op_name(ember__coll_op *o) {
  if (o->what[0] == '\0') {
    uint8_t h[OPHDR_LEN];
    encode_ophdr(o, 0, h);
    describe_ophdr(h, o->what, sizeof o->what);
  }
  return o->what;
}

static int check_ophdr(ember__coll_op *o, ember__coll_peer *from, int step, const uint8_t *got,
                       size_t len) {
  uint8_t want[OPHDR_LEN];
  encode_ophdr(o, step, want);
  int pad_ok = 1;
  for (size_t i = OPHDR_LEN; i < len; i++) pad_ok &= got[i] == 0;
  if (memcmp(want, got, OPHDR_LEN) == 0 && pad_ok) return EMBER_OK;
  if (memcmp(want, got, OPHDR_LEN) == 0)
    return ember__set_error(EMBER_EPROTO, "%s: %s sent a header whose padding is not zero: "
                            "the stream is out of step", ember__coll_op_name(o), from->desc);
  if (ember_wire_get_u32(got) != COLL_MAGIC)
    return ember__set_error(EMBER_EPROTO,
                            "%s: %s sent bytes that are not a collective header (magic "
                            "0x%08x): the ranks' calls are out of step",
                            ember__coll_op_name(o), from->desc, (unsigned)ember_wire_get_u32(got));
  char theirs[160];
  describe_ophdr(got, theirs, sizeof theirs);
  if (got[11] != (uint8_t)step && memcmp(want, got, 11) == 0)
    return ember__set_error(EMBER_EPROTO, "%s: %s is at step %u, this rank at step %d",
                            ember__coll_op_name(o), from->desc, (unsigned)got[11], step);
  return ember__set_error(EMBER_EPROTO,
                          "mismatched collectives: this rank called %s but %s called %s "
                          "(all ranks must make the same calls in the same order)",
                          ember__coll_op_name(o), from->desc, theirs);
}

/* Is the peer's end of the connection gone?  (POLLRDHUP: it shut down or
 * exited; data it sent before that can still be read.) */
static int peer_hung_up(short revents) {
  return (revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

static int timeout_error(ember__coll_op *o, ember__coll_peer *to, ember__coll_peer *from,
                         const char *progress) {
  char who[2 * sizeof to->desc + 64];
  if (to != NULL && from != NULL && to != from)
    snprintf(who, sizeof who, "%s (to receive) and %s (to send)", from->desc, to->desc);
  else
    snprintf(who, sizeof who, "%s", from != NULL ? from->desc : to != NULL ? to->desc : "?");
  return ember__set_error(EMBER_ETIMEDOUT, "%s: timed out after %lld ms waiting for %s (%s)",
                          ember__coll_op_name(o), (long long)(ember_now_ms() - o->start_ms), who,
                          progress);
}

static int aborted_error(ember__coll_op *o) {
  ember_comm *c = o->c;
  if (atomic_load(&c->abort_req))
    return ember__set_error(EMBER_EABORTED, "%s: aborted on this rank (ember_comm_abort)",
                            ember__coll_op_name(o));
  uint32_t by = c->inbox ? atomic_load(&c->inbox->aborted_by) : 0;
  if (by >= 1 && by <= c->size)
    return ember__set_error(EMBER_EABORTED,
                            "%s: %s aborted the collective (it failed or was closed)",
                            ember__coll_op_name(o), c->peers[by - 1].desc);
  return ember__set_error(EMBER_EABORTED, "%s: aborted", ember__coll_op_name(o));
}

static int shm_ready(const ember__coll_peer *to, const ember__coll_peer *from) {
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
static int wait_io(ember__coll_op *o, ember__coll_peer *to, ember__coll_peer *from,
                   ember__coll_peer *to_live, ember__coll_peer *from_live, const char *progress) {
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
    ember__coll_peer *who[2];
    int n = 0;
    ember__coll_peer *cand[2] = {to_live, from_live};
    for (int k = 0; k < 2; k++) {
      ember__coll_peer *p = cand[k];
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
    int ms = any_shm || spinning ? 0 : (left < COLL_POLL_SLICE_MS ? (int)left : COLL_POLL_SLICE_MS);
    int rc = poll(pf, (nfds_t)n, ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      return ember__set_errno(EMBER_ESYS, errno, "%s: poll", ember__coll_op_name(o));
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
                                ember__coll_op_name(o), who[i]->desc,
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

/* A channel call's failure n (negative), with the op named. */
static int channel_error(ember__coll_op *o, long n) {
  return ember__set_error((int)n, "%s: %s", ember__coll_op_name(o), ember_last_error());
}

/* Runs steps against `to` (may be NULL: nothing to send) and `from` (may be
 * NULL: nothing to receive).  Sends read sbuf, receives write rbuf. */
static int run_steps_(ember__coll_op *o, int step_id, ember__coll_peer *to,
                      ember__coll_peer *from, const uint8_t *sbuf, uint8_t *rbuf,
                      const ember__coll_step *st, int nsteps) {
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
        const ember__coll_step *s = &st[ss];
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
        if (n < 0) return channel_error(o, n);
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
      if (n < 0) return channel_error(o, n);
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
        const ember__coll_step *s = &st[rs];
        int moved = 0;
        uint8_t *dst = rbuf + s->recv_off + rdone;
        long n = ch_recv(c, from, dst, s->recv_len - rdone, s->reduce ? o->fn : NULL, o->esz,
                         &moved);
        if (n < 0) return channel_error(o, n);
        if (n > 0 && s->scale) ember__coll_scale_avg(dst, (size_t)n, o->dtype, c->size);
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
                              ember__coll_op_name(o));
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
int ember__coll_run_steps(ember__coll_op *o, int step_id, ember__coll_peer *to,
                          ember__coll_peer *from, const uint8_t *sbuf, uint8_t *rbuf,
                          const ember__coll_step *st, int nsteps) {
  int rc = run_steps_(o, step_id, to, from, sbuf, rbuf, st, nsteps);
  if (rc != EMBER_OK && atomic_load(&o->c->abort_req)) return aborted_error(o);
  return rc;
}

/* ---------------------------------------------------------------- calls */

int ember__coll_op_begin(ember_comm *c, ember__coll_op *o, int kind, int dtype, int op,
                         uint32_t root, uint64_t nbytes, int64_t timeout_ms) {
  memset(o, 0, sizeof *o);
  o->c = c;
  o->kind = kind;
  o->dtype = kind == COLL_ALLREDUCE ? dtype : 0;
  o->op = kind == COLL_ALLREDUCE ? op : 0;
  o->root = root;
  o->nbytes = nbytes;
  o->esz = kind == COLL_ALLREDUCE ? ember_dtype_size((uint8_t)dtype) : 1;
  o->fn = kind == COLL_ALLREDUCE ? ember__coll_kernel(dtype, op) : NULL;
  o->seq = ++c->seq;
  o->timeout_ms = timeout_ms;
  o->start_ms = ember_now_ms();
  o->deadline_ms = timeout_ms < 0 ? INT64_MAX : ember_deadline_after(timeout_ms);
  if (c->broken)
    return ember__set_error(EMBER_ESTATE, "%s: the communicator is broken by an earlier "
                            "failure: %s", ember__coll_op_name(o), c->broken_msg);
  if (atomic_load(&c->abort_req)) return aborted_error(o);
  return EMBER_OK;
}

void ember__coll_break_links(ember_comm *c) {
  for (uint32_t j = 0; j < c->size; j++) {
    ember__coll_peer *p = &c->peers[j];
    if (j == c->rank) continue;
    if (p->peer_ib != NULL) {
      uint32_t zero = 0;
      atomic_compare_exchange_strong(&p->peer_ib->aborted_by, &zero, c->rank + 1);
      ember__coll_bell(p->peer_ib);
    }
    if (p->fd >= 0) shutdown(p->fd, SHUT_RDWR);
  }
}

int ember__coll_op_end(ember_comm *c, int rc) {
  if (rc == EMBER_OK || c->broken) return rc;
  c->broken = 1;
  snprintf(c->broken_msg, sizeof c->broken_msg, "%s", ember_last_error());
  ember__coll_break_links(c);
  return rc;
}
