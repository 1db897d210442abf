/* acceptor.c - the door of every Ember server (see acceptor.h): listener,
 * accept batches, the pending pool and its deadlines, the handshake up to the
 * protocol's first frame, the policy when out of descriptors, rate-limited
 * reports of rejected peers; and the client's reconnect when evicted.
 *
 * A pending connection moves through:
 *   P_AUTH   CHALLENGE sent (or going out), AUTH awaited; in the pool;
 *   P_FIRST  AUTH_OK sent, the first frame awaited; out of the pool;
 *   P_LINGER REFUSED going out, then our side shut; the peer's bytes are
 *            read and dropped until it closes or LINGER_MS pass;
 *   P_DONE   closed or handed over; freed at the end of the turn.
 * It reads only when nothing waits to be written, so its output buffer holds
 * one frame at a time (CHALLENGE, AUTH_OK or REFUSED) and a peer that does
 * not read cannot make us buffer more. */
#include "acceptor.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ember/auth.h"
#include "ember/error.h"
#include "ember/net.h"
#include "ember/secure.h"

#define DEFAULT_PREAUTH_MS 3000u
#define DEFAULT_MAX_PENDING 512u
#define DEFAULT_REJECT_LOG_INTERVAL_MS 10000u
#define ACCEPT_BATCH 64
#define ACCEPT_PAUSE_MS 100
#define BACKLOG 4096
#define LINGER_MS 1000
#define AUTH_LEN (2u * EMBER_NONCE_LEN)
#define REASON_MAX 512u
#define OUT_CAP (EMBER_WIRE_HEADER_LEN + 8u + REASON_MAX)

enum { P_AUTH, P_FIRST, P_LINGER, P_DONE };

typedef struct pending {
  struct pending *prev, *next; /* the pool, oldest first */
  int in_pool;
  int fd;
  int state;
  short revents;       /* copied from the owner's poll set */
  int64_t accepted, deadline;
  ember_auth_pending auth;
  size_t have;         /* bytes of the current frame received */
  uint8_t buf[EMBER_WIRE_HEADER_LEN + AUTH_LEN]; /* its header (and AUTH's payload) */
  ember_frame_header fh; /* decoded once have >= EMBER_WIRE_HEADER_LEN */
  uint8_t *payload;    /* the first frame's payload */
  ember_sec *sec;      /* the record layer, once authenticated (encrypt) */
  size_t out_len, out_off;
  uint8_t out[OUT_CAP];
  int shut;            /* P_LINGER: our side is shut */
  char peer[96];
} pending;

/* Rate-limited reporting of rejected unauthenticated connections. */
typedef struct {
  int64_t interval_ms;     /* 0: every rejection is its own line */
  int64_t window_start_ms; /* start of the span the next line covers */
  int64_t last_line_ms;    /* when the last line was written; INT64_MIN: never */
  uint64_t count;          /* rejections not yet reported */
  char last[320];          /* "peer: reason" of the latest */
} reject_log;

struct ember__acceptor {
  ember__acceptor_config cfg; /* its secret and name are NULL: ours follow */
  uint8_t *secret;
  char name[96];          /* "feed server on :41234" */
  int listen_fd;
  uint16_t port;
  uint32_t pre_ms, first_ms, max_pending;
  pending **v;            /* every pending connection, any order */
  size_t n, cap, nfilled; /* nfilled: v[0..nfilled) are in the poll set */
  pending *head, *tail;   /* the pool */
  size_t pooled;
  int64_t paused_until;
  int pause_reported;
  reject_log rejects;
};

/* ---------------------------------------------------------------- settings */

/* A positive integer from the environment, or `fallback` when the variable is
 * unset, empty, not a number or out of [lo, hi].  A typo must not turn the
 * deadline off, so bad values are ignored rather than clamped. */
static uint64_t env_u64(const char *name, uint64_t lo, uint64_t hi, uint64_t fallback) {
  const char *v = getenv(name);
  char *end = NULL;
  if (v == NULL || *v == '\0' || *v < '0' || *v > '9') return fallback;
  errno = 0;
  unsigned long long n = strtoull(v, &end, 10);
  if (errno != 0 || *end != '\0' || n < lo || n > hi) return fallback;
  return (uint64_t)n;
}

/* `configured` if non-zero, else EMBER_PREAUTH_MAX_PENDING, else 512; never
 * more than a quarter of the open-file limit (several servers share one
 * process, a node runs the feed and the collective: a flood of one port must
 * not starve another of descriptors), never less than 4. */
static uint32_t max_pending_of(uint32_t configured) {
  uint64_t n = configured != 0 ? configured
                               : env_u64("EMBER_PREAUTH_MAX_PENDING", 1, 1u << 20,
                                         DEFAULT_MAX_PENDING);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
      n > rl.rlim_cur / 4)
    n = rl.rlim_cur / 4;
  return n < 4 ? 4u : (uint32_t)n;
}

/* Raises RLIMIT_NOFILE's soft limit to the hard limit (any process may; it is
 * never lowered). */
static void raise_fd_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return;
  /* An unlimited hard limit still cannot exceed fs.nr_open (1 Mi by default). */
  rlim_t want = rl.rlim_max == RLIM_INFINITY ? (rlim_t)1 << 20 : rl.rlim_max;
  if (rl.rlim_cur >= want) return;
  rl.rlim_cur = want;
  (void)setrlimit(RLIMIT_NOFILE, &rl);
}

/* ---------------------------------------------------------------- reports */

/* 2997 -> "2,997": the counts are read by people scanning a log. */
static void fmt_count(uint64_t n, char *out, size_t cap) {
  char digits[32];
  int len = snprintf(digits, sizeof digits, "%llu", (unsigned long long)n);
  size_t o = 0;
  for (int i = 0; i < len && o + 2 < cap; i++) {
    if (i > 0 && (len - i) % 3 == 0) out[o++] = ',';
    out[o++] = digits[i];
  }
  out[o < cap ? o : cap - 1] = '\0';
}

/* When the next line is due (INT64_MAX: nothing to report). */
static int64_t reject_due(const reject_log *l) {
  if (l->count == 0) return INT64_MAX;
  if (l->last_line_ms == INT64_MIN) return INT64_MIN;
  return l->last_line_ms > INT64_MAX - l->interval_ms ? INT64_MAX
                                                      : l->last_line_ms + l->interval_ms;
}

/* Writes the line for what is counted, if one is due at now_ms (or at all,
 * with force), to the owner's log. */
static void reject_report(ember__acceptor *a, int64_t now_ms, int force) {
  reject_log *l = &a->rejects;
  char line[768];
  if (l->count == 0 || (!force && now_ms < reject_due(l))) return;
  uint64_t n = l->count;
  if (n == 1) {
    snprintf(line, sizeof line, "%s rejected an unauthenticated connection (%s)", a->name,
             l->last);
  } else {
    char num[40];
    fmt_count(n, num, sizeof num);
    int64_t span = now_ms - l->window_start_ms;
    long long secs = span < 1500 ? 1 : (long long)((span + 500) / 1000);
    snprintf(line, sizeof line, "%s rejected %s unauthenticated connections in the last %lld s "
             "(last: %s)", a->name, num, secs, l->last);
  }
  l->count = 0;
  l->last_line_ms = now_ms;
  a->cfg.log(a->cfg.arg, line, n);
}

/* A connection ended before it was handed over: the owner hears of each;
 * strangers also go into the rate-limited log. */
static void report(ember__acceptor *a, const pending *p, int authed, const char *reason) {
  if (a->cfg.rejected != NULL) a->cfg.rejected(a->cfg.arg, p->peer, authed, reason);
  if (authed) return;
  int64_t now = ember_now_ms();
  reject_log *l = &a->rejects;
  if (l->count == 0) l->window_start_ms = now;
  l->count++;
  snprintf(l->last, sizeof l->last, "%s: %s", p->peer, reason);
  reject_report(a, now, 0);
}

/* ---------------------------------------------------------------- the pool */

static void pool_push(ember__acceptor *a, pending *p) {
  p->prev = a->tail;
  p->next = NULL;
  if (a->tail) a->tail->next = p;
  else a->head = p;
  a->tail = p;
  p->in_pool = 1;
  a->pooled++;
}

static void pool_unlink(ember__acceptor *a, pending *p) {
  if (!p->in_pool) return;
  if (p->prev) p->prev->next = p->next;
  else a->head = p->next;
  if (p->next) p->next->prev = p->prev;
  else a->tail = p->prev;
  p->prev = p->next = NULL;
  p->in_pool = 0;
  a->pooled--;
}

/* ---------------------------------------------------------------- connections */

/* Closes p (it is freed at the end of the turn).  What the peer already sent
 * is read first, bounded, so that close() sends FIN rather than a reset that
 * could destroy a REFUSED in flight. */
static void pend_close(ember__acceptor *a, pending *p) {
  uint8_t buf[4096];
  pool_unlink(a, p);
  if (p->fd >= 0) {
    for (int i = 0; i < 16; i++)
      if (recv(p->fd, buf, sizeof buf, MSG_DONTWAIT) <= 0) break;
    ember_net_close(p->fd);
  }
  p->fd = -1;
  p->state = P_DONE;
}

/* Writes what p has queued, without blocking.  0, or -1 when p was closed. */
static int pend_flush(ember__acceptor *a, pending *p) {
  while (p->out_off < p->out_len) {
    ssize_t w = send(p->fd, p->out + p->out_off, p->out_len - p->out_off,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (w <= 0) {
      if (p->state != P_LINGER) { /* a refused one was reported already */
        char reason[160];
        snprintf(reason, sizeof reason, "send failed: %s", strerror(w < 0 ? errno : EPIPE));
        report(a, p, p->state == P_FIRST, reason);
      }
      pend_close(a, p);
      return -1;
    }
    p->out_off += (size_t)w;
  }
  p->out_off = p->out_len = 0;
  if (p->state == P_LINGER && !p->shut) {
    shutdown(p->fd, SHUT_WR); /* the reason is out: FIN after it */
    p->shut = 1;
  }
  return 0;
}

/* The first out_len bytes of p->out are a REFUSED: p lingers to deliver it. */
static void pend_linger(ember__acceptor *a, pending *p, size_t out_len) {
  p->out_len = out_len;
  p->out_off = 0;
  p->state = P_LINGER;
  p->deadline = ember_now_ms() + LINGER_MS;
  (void)pend_flush(a, p);
}

/* Ends p's handshake with a REFUSED(status, reason) when `answer`, else with
 * a close.  Reported as rejected either way. */
static void pend_refuse(ember__acceptor *a, pending *p, int answer, int status,
                        const char *reason) {
  report(a, p, p->state == P_FIRST, reason);
  /* A peer that has not even read what we sent before cannot be told. */
  if (!answer || p->out_len > 0) {
    pend_close(a, p);
    return;
  }
  size_t rlen = strlen(reason);
  if (rlen > REASON_MAX) rlen = REASON_MAX;
  ember_wire_encode_header(p->out, EMBER_MSG_REFUSED, (uint32_t)(8 + rlen));
  ember_wire_put_u32(p->out + EMBER_WIRE_HEADER_LEN, (uint32_t)(int32_t)status);
  ember_wire_put_u32(p->out + EMBER_WIRE_HEADER_LEN + 4, (uint32_t)rlen);
  memcpy(p->out + EMBER_WIRE_HEADER_LEN + 8, reason, rlen);
  pend_linger(a, p, EMBER_WIRE_HEADER_LEN + 8 + rlen);
}

/* The authenticated peer's first frame failed (bad, late or not of the
 * protocol's type): answered as the protocol wants. */
static void first_failed(ember__acceptor *a, pending *p, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void first_failed(ember__acceptor *a, pending *p, int status, const char *fmt, ...) {
  char reason[REASON_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(reason, sizeof reason, fmt, ap);
  va_end(ap);
  pend_refuse(a, p, a->cfg.refuse_first, status, reason);
}

/* AUTH's header (and, when well-formed, its payload) is in: verified, and
 * answered AUTH_OK (the peer leaves the pool) or REFUSED. */
static void on_auth(ember__acceptor *a, pending *p) {
  size_t reply_len = 0;
  int well_formed = p->fh.type == EMBER_MSG_AUTH && p->fh.length == AUTH_LEN;
  int rc = ember_auth_server_check(&p->auth, a->secret, a->cfg.secret_len, p->fh.type,
                                   well_formed ? p->buf + EMBER_WIRE_HEADER_LEN : NULL,
                                   p->fh.length, p->out, sizeof p->out, &reply_len);
  if (rc == EMBER_OK && a->cfg.encrypt) {
    rc = ember_sec_create(&p->sec, a->secret, a->cfg.secret_len, p->auth.server_nonce,
                          p->auth.client_nonce, EMBER_SEC_SERVER, p->peer);
    if (rc != EMBER_OK) {
      char reason[REASON_MAX];
      snprintf(reason, sizeof reason, "%s", ember_last_error());
      report(a, p, 1, reason);
      pend_close(a, p);
      return;
    }
  }
  if (rc == EMBER_OK) {
    pool_unlink(a, p);
    p->state = P_FIRST;
    p->have = 0;
    p->deadline = p->accepted + (int64_t)a->first_ms;
    p->out_len = reply_len;
    p->out_off = 0;
    (void)pend_flush(a, p);
    return;
  }
  char reason[REASON_MAX];
  snprintf(reason, sizeof reason, "%s", ember_last_error());
  report(a, p, 0, reason);
  if (reply_len == 0) /* no REFUSED to deliver (out of memory, ...) */
    pend_close(a, p);
  else
    pend_linger(a, p, reply_len); /* the REFUSED ember_auth_server_check wrote */
}

/* A frame header is in: checked before anything is read (or allocated) for
 * the payload it claims. */
static void on_header(ember__acceptor *a, pending *p) {
  const char *first = ember_wire_type_name(a->cfg.first_type);
  if (p->state == P_AUTH) {
    if (ember_wire_decode_header(p->buf, EMBER_WIRE_HEADER_LEN, EMBER_WIRE_ABSOLUTE_MAX,
                                 &p->fh) != EMBER_OK) {
      char reason[REASON_MAX];
      snprintf(reason, sizeof reason, "authentication failed: expected AUTH frame: %s",
               ember_last_error());
      pend_refuse(a, p, 1, EMBER_EAUTH, reason);
      return;
    }
    /* A wrong type or length is refused on the header alone. */
    if (p->fh.type != EMBER_MSG_AUTH || p->fh.length != AUTH_LEN) on_auth(a, p);
    return;
  }
  int rc = ember_wire_decode_header(p->buf, EMBER_WIRE_HEADER_LEN, a->cfg.first_max, &p->fh);
  if (rc != EMBER_OK) {
    first_failed(a, p, rc, "protocol error: %s", ember_last_error());
    return;
  }
  if (p->fh.type != a->cfg.first_type) {
    first_failed(a, p, EMBER_EPROTO, "expected %s, got %s", first,
                 ember_wire_type_name(p->fh.type));
    return;
  }
  if (p->fh.length > 0 && (p->payload = malloc(p->fh.length)) == NULL)
    first_failed(a, p, EMBER_ENOMEM, "out of memory for a %u-byte %s frame", p->fh.length,
                 first);
}

/* The first frame is in: the connection is the server's now. */
static void hand_over(ember__acceptor *a, pending *p) {
  ember__accepted acc;
  memset(&acc, 0, sizeof acc);
  acc.fd = p->fd;
  memcpy(acc.peer, p->peer, sizeof acc.peer);
  acc.accepted_ms = p->accepted;
  acc.first = p->fh;
  acc.payload = p->payload;
  acc.sec = p->sec;
  p->fd = -1;
  p->payload = NULL;
  p->sec = NULL;
  p->state = P_DONE;
  a->cfg.ready(a->cfg.arg, &acc);
}

/* Reads what p has of its current frame, never past its end. */
static void pend_read(ember__acceptor *a, pending *p) {
  uint8_t drop[512];
  uint8_t *dst;
  size_t want;
  if (p->state == P_LINGER) {
    dst = drop;
    want = sizeof drop;
  } else if (p->have < EMBER_WIRE_HEADER_LEN) {
    dst = p->buf + p->have;
    want = EMBER_WIRE_HEADER_LEN - p->have;
  } else if (p->state == P_AUTH) {
    dst = p->buf + p->have;
    want = EMBER_WIRE_HEADER_LEN + AUTH_LEN - p->have;
  } else {
    dst = p->payload + (p->have - EMBER_WIRE_HEADER_LEN);
    want = EMBER_WIRE_HEADER_LEN + p->fh.length - p->have;
  }
  ssize_t n;
  if (p->sec != NULL && p->state == P_FIRST) {
    /* The first frame comes in an encrypted record: what the record holds
     * beyond the frame stays in p->sec, for the server. */
    long r = ember_sec_recv(p->sec, p->fd, dst, want);
    if (r == 0) return;
    if (r < 0 && r != EMBER_ECLOSED) {
      char reason[REASON_MAX];
      snprintf(reason, sizeof reason, "%s", ember_last_error());
      report(a, p, 1, reason);
      pend_close(a, p);
      return;
    }
    n = r < 0 ? 0 : (ssize_t)r;
  } else {
    n = recv(p->fd, dst, want, MSG_DONTWAIT);
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (p->state == P_LINGER) {
    if (n <= 0) pend_close(a, p); /* the peer has read our reason and gone */
    return;
  }
  if (n <= 0) {
    char reason[256];
    const char *before = p->state == P_AUTH ? "authenticating"
                                            : ember_wire_type_name(a->cfg.first_type);
    if (n == 0) snprintf(reason, sizeof reason, "closed the connection before %s", before);
    else snprintf(reason, sizeof reason, "recv failed before %s: %s", before, strerror(errno));
    report(a, p, p->state == P_FIRST, reason);
    pend_close(a, p);
    return;
  }
  p->have += (size_t)n;
  if (p->have == EMBER_WIRE_HEADER_LEN) {
    on_header(a, p);
    if (p->state == P_DONE || p->state == P_LINGER) return;
  }
  if (p->have >= EMBER_WIRE_HEADER_LEN && p->have == EMBER_WIRE_HEADER_LEN + p->fh.length) {
    if (p->state == P_AUTH) on_auth(a, p);
    else hand_over(a, p);
    return;
  }
  /* Decrypted bytes of the frame may wait with nothing more on the socket. */
  if (p->state == P_FIRST && ember_sec_pending(p->sec) > 0) pend_read(a, p);
}

/* Closes the oldest unauthenticated connection to make room.  0 if there is
 * none. */
static int evict_oldest(ember__acceptor *a, const char *why) {
  pending *victim = a->head;
  if (victim == NULL) return 0;
  if (victim->state == P_AUTH) {
    char reason[192];
    snprintf(reason, sizeof reason, "evicted before authenticating: %s", why);
    report(a, victim, 0, reason);
  } /* a refused one (P_LINGER) was reported already */
  pend_close(a, victim);
  return 1;
}

/* accept() failed with err: the one policy for running out (acceptor.h). */
static int accept_failed(ember__acceptor *a, int err) {
  if ((err == EMFILE || err == ENFILE) &&
      evict_oldest(a, "the process is out of file descriptors"))
    return 1; /* a descriptor is free again: accept once more */
  a->paused_until = ember_now_ms() + ACCEPT_PAUSE_MS;
  if (!a->pause_reported) {
    char line[256];
    a->pause_reported = 1;
    snprintf(line, sizeof line, "%s: accept failed: %s%s; accepting pauses %d ms at a time",
             a->name, strerror(err),
             err == EMFILE || err == ENFILE ? " (raise the open-file limit?)" : "",
             ACCEPT_PAUSE_MS);
    a->cfg.log(a->cfg.arg, line, 0);
  }
  return 0;
}

static void accept_batch(ember__acceptor *a) {
  for (int k = 0; k < ACCEPT_BATCH; k++) {
    int fd = accept4(a->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EAGAIN || err == EWOULDBLOCK || !accept_failed(a, err)) return;
      continue;
    }
    /* The pool is full: the oldest makes room, never the new one. */
    if (a->pooled >= a->max_pending) {
      char why[96];
      snprintf(why, sizeof why, "%zu connections were waiting to authenticate (limit %u)",
               a->pooled, (unsigned)a->max_pending);
      evict_oldest(a, why);
    }
    pending *p = NULL;
    if (a->n == a->cap) {
      size_t ncap = a->cap ? a->cap * 2 : 64;
      pending **nv = realloc(a->v, ncap * sizeof *nv);
      if (nv != NULL) {
        a->v = nv;
        a->cap = ncap;
      }
    }
    if (a->n < a->cap) p = calloc(1, sizeof *p);
    size_t chl = 0;
    if (p == NULL ||
        ember_auth_server_begin(&p->auth, p->out, sizeof p->out, &chl) != EMBER_OK) {
      free(p);
      ember_net_close(fd);
      continue;
    }
    if (a->cfg.encrypt) p->auth.flags = EMBER_AUTH_ENCRYPT;
    p->fd = fd;
    p->state = P_AUTH;
    p->accepted = ember_now_ms();
    p->deadline = p->accepted + (int64_t)a->pre_ms;
    p->out_len = chl;
    ember_net_peer_name(fd, p->peer, sizeof p->peer);
    (void)ember_net_tune(fd);
    a->v[a->n++] = p;
    pool_push(a, p);
    (void)pend_flush(a, p); /* the CHALLENGE: usually all of it at once */
  }
}

/* ---------------------------------------------------------------- the loop's calls */

size_t ember__acceptor_npoll(const ember__acceptor *a) { return 1 + a->n; }

void ember__acceptor_poll_fill(ember__acceptor *a, struct pollfd *pfds) {
  int paused = ember_now_ms() < a->paused_until;
  pfds[0] = (struct pollfd){.fd = paused ? -1 : a->listen_fd, .events = POLLIN};
  for (size_t i = 0; i < a->n; i++) {
    const pending *p = a->v[i];
    /* Reading waits until what we owe the peer is written. */
    pfds[1 + i] = (struct pollfd){.fd = p->fd, .events = p->out_len > 0 ? POLLOUT : POLLIN};
  }
  a->nfilled = a->n;
}

int64_t ember__acceptor_due(const ember__acceptor *a) {
  int64_t due = reject_due(&a->rejects);
  if (a->paused_until > ember_now_ms() && a->paused_until < due) due = a->paused_until;
  for (size_t i = 0; i < a->n; i++)
    if (a->v[i]->deadline < due) due = a->v[i]->deadline;
  return due;
}

void ember__acceptor_run(ember__acceptor *a, const struct pollfd *pfds) {
  short listener = pfds[0].revents;
  size_t polled = a->nfilled;
  for (size_t i = 0; i < polled; i++) a->v[i]->revents = pfds[1 + i].revents;
  a->nfilled = 0;
  /* The pending peers first, then new ones: a real peer's AUTH is read
   * before a burst of strangers could evict it. */
  for (size_t i = 0; i < polled; i++) {
    pending *p = a->v[i];
    if (p->revents == 0 || p->state == P_DONE) continue;
    if (p->out_len > 0 && pend_flush(a, p) != 0) continue;
    if (p->out_len == 0 && (p->revents & (POLLIN | POLLHUP | POLLERR))) pend_read(a, p);
  }
  if (listener & POLLIN) accept_batch(a);
  int64_t now = ember_now_ms();
  for (size_t i = 0; i < a->n; i++) {
    pending *p = a->v[i];
    if (p->state == P_DONE || now < p->deadline) continue;
    if (p->state == P_LINGER) {
      pend_close(a, p);
    } else if (p->state == P_AUTH) {
      char reason[128];
      snprintf(reason, sizeof reason, "handshake not completed within %u ms (no valid AUTH "
               "frame)", (unsigned)a->pre_ms);
      report(a, p, 0, reason);
      pend_close(a, p);
    } else {
      first_failed(a, p, EMBER_ETIMEDOUT, "handshake not completed within %u ms (no %s frame)",
                   (unsigned)a->first_ms, ember_wire_type_name(a->cfg.first_type));
    }
  }
  /* Free what ended (order does not matter: the pool keeps the age). */
  for (size_t i = a->n; i-- > 0;) {
    pending *p = a->v[i];
    if (p->state != P_DONE) continue;
    free(p->payload);
    ember_sec_destroy(p->sec);
    free(p);
    a->v[i] = a->v[--a->n];
  }
  reject_report(a, now, 0);
}

/* ---------------------------------------------------------------- create, destroy */

uint16_t ember__acceptor_port(const ember__acceptor *a) { return a->port; }

const char *ember__acceptor_name(const ember__acceptor *a) { return a->name; }

void ember__acceptor_destroy(ember__acceptor *a) {
  if (a == NULL) return;
  for (size_t i = 0; i < a->n; i++) {
    ember_net_close(a->v[i]->fd);
    free(a->v[i]->payload);
    ember_sec_destroy(a->v[i]->sec);
    free(a->v[i]);
  }
  free(a->v);
  ember_net_close(a->listen_fd);
  reject_report(a, ember_now_ms(), 1); /* what is counted is not lost with us */
  if (a->secret != NULL) {
    memset(a->secret, 0, a->cfg.secret_len);
    free(a->secret);
  }
  free(a);
}

/* Takes over a bound socket: listening, non-blocking, close-on-exec. */
static int adopt_listener(ember__acceptor *a, int backlog, const char *name) {
  int rc = ember_net_listen_fd(a->listen_fd, backlog);
  if (rc != EMBER_OK) return rc;
  int fl = fcntl(a->listen_fd, F_GETFL);
  if (fl < 0 || fcntl(a->listen_fd, F_SETFL, fl | O_NONBLOCK) < 0 ||
      fcntl(a->listen_fd, F_SETFD, FD_CLOEXEC) < 0)
    return ember__set_errno(EMBER_ESYS, errno, "%s: fcntl on the listen socket", name);
  ember_net_local_addr(a->listen_fd, NULL, 0, &a->port);
  return EMBER_OK;
}

int ember__acceptor_create(ember__acceptor **out, const ember__acceptor_config *cfg) {
  ember__acceptor *a = NULL;
  int rc;
  *out = NULL;
  a = calloc(1, sizeof *a);
  if (a == NULL) {
    ember_net_close(cfg->listen_fd);
    return ember__set_error(EMBER_ENOMEM, "%s: out of memory", cfg->name);
  }
  a->cfg = *cfg;
  a->listen_fd = cfg->listen_fd;
  a->secret = malloc(cfg->secret_len);
  if (a->secret == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "%s: out of memory", cfg->name);
    goto fail;
  }
  memcpy(a->secret, cfg->secret, cfg->secret_len);
  a->cfg.secret = NULL; /* ours: a->secret */
  a->cfg.name = NULL;   /* ours: a->name, once the port is known */
  {
    uint8_t warm[EMBER_MAC_LEN];
    rc = ember_auth_random(warm, sizeof warm);
    if (rc == EMBER_OK)
      rc = ember_auth_hmac(a->secret, cfg->secret_len, warm, sizeof warm, NULL, 0, NULL, 0,
                           warm);
    if (rc != EMBER_OK) goto fail;
  }
  a->pre_ms = cfg->preauth_timeout_ms != 0
                  ? cfg->preauth_timeout_ms
                  : (uint32_t)env_u64("EMBER_PREAUTH_TIMEOUT_MS", 1, 3600000u,
                                      DEFAULT_PREAUTH_MS);
  if (cfg->preauth_cap_ms != 0 && a->pre_ms > cfg->preauth_cap_ms)
    a->pre_ms = cfg->preauth_cap_ms;
  a->first_ms = cfg->first_timeout_ms != 0 ? cfg->first_timeout_ms : a->pre_ms;
  raise_fd_limit(); /* before the pool is sized against it */
  a->max_pending = max_pending_of(cfg->max_pending);
  /* A gang of peers connects at once: the default pool holds all of them, so
   * real peers never evict each other (an evicted one would reconnect, but
   * later). */
  if (cfg->max_pending == 0 && cfg->expected > 0 && a->max_pending < cfg->expected + 64u)
    a->max_pending = max_pending_of(cfg->expected + 64u);
  int backlog = cfg->expected < BACKLOG ? BACKLOG
                : cfg->expected > 65535 ? 65535
                                        : (int)cfg->expected;
  if (a->listen_fd >= 0)
    rc = adopt_listener(a, backlog, cfg->name);
  else
    rc = ember_net_bind(cfg->bind_host, cfg->port, backlog, 0, &a->listen_fd, &a->port);
  if (rc != EMBER_OK) goto fail;
  snprintf(a->name, sizeof a->name, "%s on :%u", cfg->name, (unsigned)a->port);
  a->rejects.interval_ms = (int64_t)env_u64("EMBER_REJECT_LOG_INTERVAL_MS", 0, 86400000u,
                                            DEFAULT_REJECT_LOG_INTERVAL_MS);
  a->rejects.last_line_ms = INT64_MIN;
  *out = a;
  return EMBER_OK;

fail:
  ember__acceptor_destroy(a);
  return rc;
}

/* ---------------------------------------------------------------- the client's side */

int ember__connect_auth(const char *host, uint16_t port, const uint8_t *secret,
                        size_t secret_len, int64_t deadline_ms, int *out_fd) {
  return ember__connect_auth_ex(host, port, secret, secret_len, 0, deadline_ms, out_fd, NULL);
}

int ember__connect_auth_ex(const char *host, uint16_t port, const uint8_t *secret,
                           size_t secret_len, uint32_t flags, int64_t deadline_ms,
                           int *out_fd, ember_sec **out_sec) {
  int64_t backoff = 10;
  if (out_fd == NULL) return ember__set_error(EMBER_EINVAL, "connect_auth: out_fd is NULL");
  *out_fd = -1;
  if (out_sec != NULL) *out_sec = NULL;
  if ((flags & EMBER_AUTH_ENCRYPT) && out_sec == NULL)
    return ember__set_error(EMBER_EINVAL, "connect_auth: encryption needs out_sec");
  for (;;) {
    int fd = -1;
    ember_auth_result res;
    int rc = ember_net_connect(host, port, deadline_ms, &fd);
    if (rc != EMBER_OK) return rc;
    rc = ember_auth_client_ex(fd, secret, secret_len, flags, deadline_ms, &res);
    if (rc == EMBER_OK && (flags & EMBER_AUTH_ENCRYPT)) {
      char peer[96];
      ember_net_peer_name(fd, peer, sizeof peer);
      rc = ember_sec_create(out_sec, secret, secret_len, res.server_nonce, res.client_nonce,
                            EMBER_SEC_CLIENT, peer);
      if (rc != EMBER_OK) {
        ember_net_close(fd);
        return rc;
      }
    }
    if (rc == EMBER_OK) {
      *out_fd = fd;
      return EMBER_OK;
    }
    ember_net_close(fd);
    /* Only a close without a REFUSED is retried: the server never judged
     * our proof, it dropped a pending connection (flood, or out of fds). */
    if (rc != EMBER_ECLOSED || ember_now_ms() + backoff >= deadline_ms) return rc;
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)backoff * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    if (backoff < 200) backoff *= 2;
  }
}

void ember__log_stderr(void *arg, const char *line) {
  char buf[1024];
  (void)arg;
  int n = snprintf(buf, sizeof buf, "[ember] %s\n", line);
  if (n < 0) return;
  size_t len = (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1;
  if (len > 0 && buf[len - 1] != '\n') buf[len - 1] = '\n'; /* truncated */
  /* One write(2): lines of several threads or processes do not interleave. */
  ssize_t w = write(STDERR_FILENO, buf, len);
  (void)w;
}
