/* coll_mesh.c - the collective's set-up: the mesh of authenticated TCP
 * connections, then shared memory between the ranks of one host (see
 * coll_mesh.h). */
#include "coll_mesh.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ember/auth.h"
#include "ember/error.h"
#include "ember/net.h"
#include "ember/wire.h"
#include "preauth.h"

#define SHM_NAME_CAP 64u
#define SET_UP_FRAME_MAX 512u
#ifndef PREV_RING_CAP
#define PREV_RING_CAP (2u * 1024u * 1024u) /* the ring from the previous rank */
#endif
#define SIDE_RING_CAP (256u * 1024u)        /* the rings from the other ranks */
/* Accepts per turn of the mesh's poll loop: between batches the pending
 * peers' AUTH frames are read, so strangers cannot push a real rank out of
 * the pending pool by arriving in a burst. */
#define MESH_ACCEPT_BATCH 64
#define MESH_ACCEPT_PAUSE_MS 100
#define AUTH_FRAME_LEN (EMBER_WIRE_HEADER_LEN + 2u * EMBER_NONCE_LEN)
#define HELLO_FRAME_LEN (EMBER_WIRE_HEADER_LEN + 8u)


/* "host:port" or "[v6]:port" -> host, port (1..65535). */
int ember__coll_parse_address(const char *s, uint32_t idx, char *host, size_t cap, uint16_t *port) {
  if (s == NULL) return ember__set_error(EMBER_EINVAL, "comm: address of rank %u is NULL", idx);
  size_t len = strnlen(s, COLL_ADDR_CAP);
  if (len >= COLL_ADDR_CAP)
    return ember__set_error(EMBER_EINVAL, "comm: address of rank %u is longer than %u bytes",
                            idx, COLL_ADDR_CAP - 1);
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
                  left <= 0 ? 0 : left > COLL_POLL_SLICE_MS * 10 ? COLL_POLL_SLICE_MS * 10 : (int)left);
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
int ember__coll_build_mesh(ember_comm *c, const ember_comm_config *cfg, int64_t deadline) {
  int rc;
  for (uint32_t j = 0; j < c->rank; j++) {
    ember__coll_peer *p = &c->peers[j];
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
static int map_peer_inbox(ember_comm *c, ember__coll_peer *p, const uint8_t *pl, uint32_t len) {
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
  if (fstat(fd, &stt) == 0 && stt.st_uid == geteuid() && (uint64_t)stt.st_size == COLL_INBOX_LEN)
    m = mmap(NULL, COLL_INBOX_LEN, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return 0;
  ember__coll_inbox *ib = m;
  if (ib->magic != COLL_INBOX_MAGIC || memcmp(ib->token, token, 32) != 0 ||
      ib->owner_rank != p->rank || ib->size != c->size) {
    munmap(m, COLL_INBOX_LEN);
    return 0; /* a same-named segment of someone else: never trust it */
  }
  /* The ring checks its own segment (owner, mode, seals, size, token). */
  if (ember_shm_ring_attach(&p->out, &d, EMBER_SHM_PRODUCER) != EMBER_OK) {
    munmap(m, COLL_INBOX_LEN);
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
  if (ftruncate(fd, COLL_INBOX_LEN) == 0)
    m = mmap(NULL, COLL_INBOX_LEN, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  int ok = m != MAP_FAILED;
  for (uint32_t j = 0; j < c->size && ok; j++)
    if (j != c->rank &&
        ember_shm_ring_create(&c->peers[j].in, ring_cap_for(c, j), EMBER_SHM_CONSUMER) != EMBER_OK)
      ok = 0;
  if (!ok) {
    shm_unlink(name);
    name[0] = '\0';
    if (m != MAP_FAILED) munmap(m, COLL_INBOX_LEN);
    for (uint32_t j = 0; j < c->size; j++) {
      ember_shm_ring_destroy(c->peers[j].in);
      c->peers[j].in = NULL;
    }
    return EMBER_OK;
  }
  c->inbox = m;
  c->inbox->magic = COLL_INBOX_MAGIC;
  memcpy(c->inbox->token, token, 32);
  c->inbox->owner_rank = c->rank;
  c->inbox->size = c->size;
  return EMBER_OK;
}

int ember__coll_setup_shm(ember_comm *c, uint32_t flags, int64_t deadline) {
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
    ember__coll_peer *p = &c->peers[j];
    if (p->shm) continue;
    ember_shm_ring_destroy(p->in);
    ember_shm_ring_destroy(p->out);
    p->in = p->out = NULL;
    if (p->peer_ib != NULL) munmap(p->peer_ib, COLL_INBOX_LEN);
    p->peer_ib = NULL;
  }
  free(ok);
  return rc;
}
