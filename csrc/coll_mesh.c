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

#include "acceptor.h"
#include "ember/auth.h"
#include "ember/error.h"
#include "ember/net.h"
#include "ember/wire.h"

#define SHM_NAME_CAP 64u
#define SET_UP_FRAME_MAX 512u
#ifndef PREV_RING_CAP
#define PREV_RING_CAP (2u * 1024u * 1024u) /* the ring from the previous rank */
#endif
#define SIDE_RING_CAP (256u * 1024u)        /* the rings from the other ranks */
#define HELLO_FRAME_LEN (EMBER_WIRE_HEADER_LEN + 8u)

int ember__coll_parse_address(const char *s, uint32_t idx, char *host, size_t cap,
                              uint16_t *port) {
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

static int send_hello(int fd, ember_sec *sec, const ember_comm *c, int64_t deadline) {
  uint8_t b[8];
  ember_wire_put_u32(b, c->rank);
  ember_wire_put_u32(b + 4, c->size);
  return ember_sec_send_frame(sec, fd, EMBER_MSG_COLL_HELLO, b, sizeof b, deadline);
}

static int recv_hello(int fd, ember_sec *sec, const ember_comm *c, const char *peer,
                      uint32_t *rank, int64_t deadline) {
  ember_frame_header hdr;
  uint8_t *pl = NULL;
  int rc = ember_sec_recv_frame(sec, fd, SET_UP_FRAME_MAX, &hdr, &pl, deadline);
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

/* ---- the mesh ---- */

/* Connects to every lower rank: authenticated, then COLL_HELLO both ways. */
static int connect_lower(ember_comm *c, const ember_comm_config *cfg, int64_t deadline) {
  for (uint32_t j = 0; j < c->rank; j++) {
    ember__coll_peer *p = &c->peers[j];
    uint32_t got = 0;
    /* Retries a connection the peer evicted from its pending pool (a flood
     * of strangers there); a refusal of our proof is final. */
    int rc = ember__connect_auth_ex(p->host, p->port, cfg->secret, cfg->secret_len,
                                    cfg->encrypt ? EMBER_AUTH_ENCRYPT : 0, deadline, &p->fd,
                                    &p->sec);
    if (rc != EMBER_OK)
      return ember__set_error(rc, "comm: connecting to %s: %s", p->desc, ember_last_error());
    ember_sec_set_peer(p->sec, p->desc);
    rc = send_hello(p->fd, p->sec, c, deadline);
    if (rc == EMBER_OK) rc = recv_hello(p->fd, p->sec, c, p->desc, &got, deadline);
    if (rc == EMBER_OK && got != j)
      rc = ember__set_error(EMBER_EPROTO, "comm: the address of rank %u (%s:%u) is served "
                            "by rank %u", j, p->host, (unsigned)p->port, (unsigned)got);
    if (rc != EMBER_OK)
      return ember__set_error(rc, "comm: with %s: %s", p->desc, ember_last_error());
    tune_socket(p->fd);
  }
  return EMBER_OK;
}

/* Accepting the higher ranks.  Strangers may connect to a rank's port too:
 * the acceptor (acceptor.h) handshakes every connection at once and hands
 * over the ones that authenticated and sent COLL_HELLO, read exactly (the
 * shared-memory offer after it is not consumed here), so neither idle nor
 * slow strangers delay the real ranks. */
typedef struct {
  ember_comm *c;
  uint32_t missing; /* higher ranks not connected yet */
  ember_log_fn log_fn;
  void *log_arg;
  uint64_t nrejected;
  char rejected[512]; /* the latest, for the timeout message */
} mesh_accept;

/* Any rejected connection, stranger or rank, is named in the message a mesh
 * timeout will carry. */
static void note_rejected(mesh_accept *m, const char *peer, const char *reason) {
  m->nrejected++;
  snprintf(m->rejected, sizeof m->rejected, "from %s was rejected: %s", peer, reason);
}

static void on_rejected(void *arg, const char *peer, int authed, const char *reason) {
  note_rejected(arg, peer, reason);
}

/* Strangers, rate-limited, to the config's log. */
static void on_log(void *arg, const char *line, uint64_t count) {
  mesh_accept *m = arg;
  m->log_fn(m->log_arg, line);
}

/* One non-blocking send of a small frame: a connection's first few dozen
 * bytes always fit its socket buffer, so anything short of all is a failure. */
static int send_small(int fd, ember_sec *sec, const uint8_t *b, size_t len) {
  ssize_t w;
  if (sec != NULL) {
    struct iovec iov = {.iov_base = (void *)(uintptr_t)b, .iov_len = len};
    long k = ember_sec_send(sec, fd, &iov, 1);
    if (k == 0) errno = EAGAIN;
    return k == (long)len ? EMBER_OK : EMBER_EIO;
  }
  do {
    w = send(fd, b, len, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (w < 0 && errno == EINTR);
  return w == (ssize_t)len ? EMBER_OK : EMBER_EIO;
}

/* An authenticated connection with its COLL_HELLO: checked, answered with
 * ours, and given to its rank. */
static void on_hello(void *arg, ember__accepted *a) {
  mesh_accept *m = arg;
  ember_comm *c = m->c;
  char why[256];
  uint32_t got = a->first.length == 8 ? ember_wire_get_u32(a->payload) : 0;
  uint32_t size = a->first.length == 8 ? ember_wire_get_u32(a->payload + 4) : 0;
  free(a->payload);
  if (a->first.length != 8) {
    snprintf(why, sizeof why, "sent a COLL_HELLO of %u bytes (expected 8)",
             (unsigned)a->first.length);
  } else if (size != c->size) {
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
    if (send_small(a->fd, a->sec, f, sizeof f) == EMBER_OK) {
      c->peers[got].fd = a->fd;
      c->peers[got].sec = a->sec;
      ember_sec_set_peer(a->sec, c->peers[got].desc);
      m->missing--;
      return;
    }
    snprintf(why, sizeof why, "sending COLL_HELLO failed: %s", strerror(errno));
  }
  ember_net_close(a->fd);
  ember_sec_destroy(a->sec);
  note_rejected(m, a->peer, why);
}

/* Runs the acceptor until every higher rank is connected or the deadline
 * passes. */
static int accept_higher(mesh_accept *m, ember__acceptor *acc, int64_t deadline) {
  ember_comm *c = m->c;
  struct pollfd *pfds = NULL;
  size_t cap = 0;
  int rc = EMBER_OK;
  while (m->missing > 0) {
    int64_t now = ember_now_ms();
    if (now >= deadline) {
      char list[256] = "";
      size_t used = 0;
      for (uint32_t j = c->rank + 1; j < c->size && used + 16 < sizeof list; j++)
        if (c->peers[j].fd < 0)
          used += (size_t)snprintf(list + used, sizeof list - used, "%s%u", used ? ", " : "", j);
      char extra[700] = "";
      if (m->nrejected == 1)
        snprintf(extra, sizeof extra, "; a connection %s", m->rejected);
      else if (m->nrejected > 1)
        snprintf(extra, sizeof extra, "; %llu connections were rejected (the last one %s)",
                 (unsigned long long)m->nrejected, m->rejected);
      rc = ember__set_error(EMBER_ETIMEDOUT, "comm: rank %u timed out waiting for rank(s) "
                            "%s to connect%s", c->rank, list, extra);
      break;
    }
    size_t n = ember__acceptor_npoll(acc);
    if (n > cap) {
      struct pollfd *np = realloc(pfds, n * sizeof *np);
      if (np == NULL) {
        rc = ember__set_error(EMBER_ENOMEM, "comm: out of memory for %zu connections", n);
        break;
      }
      pfds = np;
      cap = n;
    }
    ember__acceptor_poll_fill(acc, pfds);
    int64_t wake = ember__acceptor_due(acc);
    if (wake > deadline) wake = deadline;
    int64_t left = wake - now;
    int pr = poll(pfds, (nfds_t)n,
                  left <= 0 ? 0 : left > COLL_POLL_SLICE_MS * 10 ? COLL_POLL_SLICE_MS * 10
                                                                 : (int)left);
    if (pr < 0 && errno != EINTR) {
      rc = ember__set_errno(EMBER_ESYS, errno, "comm: poll while accepting ranks");
      break;
    }
    ember__acceptor_run(acc, pfds);
  }
  free(pfds);
  return rc;
}

int ember__coll_build_mesh(ember_comm *c, const ember_comm_config *cfg, int listen_fd,
                           int64_t deadline) {
  mesh_accept m = {.c = c, .missing = c->size - 1 - c->rank,
                   .log_fn = cfg->log_fn ? cfg->log_fn : ember__log_stderr,
                   .log_arg = cfg->log_fn ? cfg->log_arg : NULL};
  char name[48];
  snprintf(name, sizeof name, "collective rank %u", (unsigned)c->rank);
  /* Listening before connecting anywhere: higher ranks may connect first. */
  ember__acceptor_config acfg = {
      .listen_fd = listen_fd, .bind_host = cfg->bind_host, .port = c->peers[c->rank].port,
      .expected = m.missing, .secret = cfg->secret, .secret_len = cfg->secret_len,
      .encrypt = cfg->encrypt,
      .preauth_timeout_ms = cfg->preauth_timeout_ms, .max_pending = cfg->max_pending,
      .first_type = EMBER_MSG_COLL_HELLO, .first_max = SET_UP_FRAME_MAX, .name = name,
      .arg = &m, .ready = on_hello, .rejected = on_rejected, .log = on_log};
  ember__acceptor *acc = NULL;
  int rc = ember__acceptor_create(&acc, &acfg);
  if (rc != EMBER_OK) return rc;
  rc = connect_lower(c, cfg, deadline);
  if (rc == EMBER_OK) rc = accept_higher(&m, acc, deadline);
  ember__acceptor_destroy(acc); /* the mesh is complete: no one else may join */
  return rc;
}

/* The ring from `from` to this rank: the ring algorithms stream through the
 * one from the previous rank; the others carry recursive doubling's small
 * exchanges. */
static size_t ring_cap_for(const ember_comm *c, uint32_t from) {
  return from == (c->rank + c->size - 1) % c->size ? PREV_RING_CAP : SIDE_RING_CAP;
}

/* COLL_SHM: our inbox's name ("" = no shared memory), its token, and the
 * descriptor of the ring we created for the peer to send into. */
static int send_shm_offer(int fd, ember_sec *sec, const char *name, const uint8_t *token,
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
  int rc = w.err ? w.err
                 : ember_sec_send_frame(sec, fd, EMBER_MSG_COLL_SHM, w.buf, (uint32_t)w.len,
                                        deadline);
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

/* Receives peer j's next set-up frame, which must be of type `type`; *pl
 * (malloc'd, NULL when empty) is the caller's to free. */
static int recv_setup(ember_comm *c, uint32_t j, uint16_t type, ember_frame_header *hdr,
                      uint8_t **pl, int64_t deadline) {
  int rc = ember_sec_recv_frame(c->peers[j].sec, c->peers[j].fd, SET_UP_FRAME_MAX, hdr, pl,
                                deadline);
  if (rc == EMBER_OK && hdr->type != type)
    rc = ember__set_error(EMBER_EPROTO, "comm: %s sent %s, expected %s", c->peers[j].desc,
                          ember_wire_type_name(hdr->type), ember_wire_type_name(type));
  return rc;
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
    rc = send_shm_offer(c->peers[j].fd, c->peers[j].sec, c->inbox ? name : "", token,
                        c->peers[j].in, deadline);
  }
  for (uint32_t j = 0; j < c->size && rc == EMBER_OK; j++) {
    if (j == c->rank) continue;
    ember_frame_header hdr;
    uint8_t *pl = NULL;
    rc = recv_setup(c, j, EMBER_MSG_COLL_SHM, &hdr, &pl, deadline);
    if (rc == EMBER_OK && !(flags & EMBER_COMM_TCP_ONLY)) {
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
    rc = ember_sec_send_frame(c->peers[j].sec, c->peers[j].fd, EMBER_MSG_COLL_SHM_ACK, b, 4,
                              deadline);
  }
  for (uint32_t j = 0; j < c->size && rc == EMBER_OK; j++) {
    if (j == c->rank) continue;
    ember_frame_header hdr;
    uint8_t *pl = NULL;
    rc = recv_setup(c, j, EMBER_MSG_COLL_SHM_ACK, &hdr, &pl, deadline);
    if (rc == EMBER_OK && hdr.length != 4)
      rc = ember__set_error(EMBER_EPROTO, "comm: %s sent a COLL_SHM_ACK of %u bytes (expected 4)",
                            c->peers[j].desc, (unsigned)hdr.length);
    if (rc == EMBER_OK)
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
