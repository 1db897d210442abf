/* test_secure.c - the encrypted record layer (secure.h): round trips, the
 * key schedule, the handshake's mode agreement, and a man in the middle that
 * flips, drops, replays, reorders or truncates records, both on a bare pair
 * of record layers and on a real encrypted feed and collective. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <arpa/inet.h>

#include "ember/auth.h"
#include "ember/batch.h"
#include "ember/collective.h"
#include "ember/feed.h"
#include "ember/net.h"
#include "ember/secure.h"
#include "ember/wire.h"
#include "harness.h"

static const uint8_t SECRET[32] = "0123456789abcdef0123456789abcdef";
static const uint8_t SN[32] = "server-nonce-server-nonce-server";
static const uint8_t CN[32] = "client-nonce-client-nonce-client";

static void pair(int sv[2]) {
  CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) == 0);
}

static void make_pair(ember_sec **cli, ember_sec **srv) {
  CHECK_OK(ember_sec_create(cli, SECRET, sizeof SECRET, SN, CN, EMBER_SEC_CLIENT, "server:1"));
  CHECK_OK(ember_sec_create(srv, SECRET, sizeof SECRET, SN, CN, EMBER_SEC_SERVER, "client:2"));
}

static void fill(uint8_t *p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; i++) p[i] = (uint8_t)((i * 2654435761u + seed) >> 13);
}

typedef struct {
  ember_sec *sec;
  int fd;
  const uint8_t *buf;
  size_t len, piece;
  int rc;
} sender_args;

static void *sender(void *arg) {
  sender_args *a = arg;
  a->rc = EMBER_OK;
  for (size_t off = 0; off < a->len && a->rc == EMBER_OK; off += a->piece) {
    size_t n = a->len - off < a->piece ? a->len - off : a->piece;
    a->rc = ember_sec_send_all(a->sec, a->fd, a->buf + off, n, ember_deadline_after(10000));
  }
  return NULL;
}

/* ------------------------------------------------------------ round trips */

TEST(round_trip_sizes_and_pieces) {
  static const size_t sizes[] = {1, 12, 4096, EMBER_SEC_RECORD_MAX - 1, EMBER_SEC_RECORD_MAX,
                                 EMBER_SEC_RECORD_MAX + 1, 3u << 20};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    ember_sec *cli, *srv;
    int sv[2];
    size_t n = sizes[k];
    uint8_t *in = malloc(n), *out = malloc(n);
    fill(in, n, (uint32_t)k);
    make_pair(&cli, &srv);
    pair(sv);
    sender_args a = {.sec = cli, .fd = sv[0], .buf = in, .len = n, .piece = 100000};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, sender, &a) == 0);
    /* odd receive sizes: records are split and joined across calls */
    size_t got = 0, step = 1;
    while (got < n) {
      size_t want = n - got < step ? n - got : step;
      CHECK_OK(ember_sec_recv_all(srv, sv[1], out + got, want, ember_deadline_after(10000)));
      got += want;
      step = step * 7 + 3;
    }
    pthread_join(t, NULL);
    CHECK_OK(a.rc);
    CHECK(memcmp(in, out, n) == 0);
    CHECK_EQ_INT(ember_sec_pending(srv), 0);
    ember_sec_destroy(cli);
    ember_sec_destroy(srv);
    close(sv[0]);
    close(sv[1]);
    free(in);
    free(out);
  }
}

TEST(frames_both_ways_and_peek) {
  ember_sec *cli, *srv;
  int sv[2];
  ember_frame_header h;
  uint8_t *p = NULL, hdr[EMBER_WIRE_HEADER_LEN];
  make_pair(&cli, &srv);
  pair(sv);
  CHECK_OK(ember_sec_send_frame(cli, sv[0], EMBER_MSG_ACK, "hello", 5, ember_deadline_after(1000)));
  CHECK_EQ_INT(ember_sec_peek(srv, sv[1], hdr, sizeof hdr), sizeof hdr);
  CHECK_EQ_INT(ember_sec_pending(srv), EMBER_WIRE_HEADER_LEN + 5);
  CHECK_OK(ember_sec_recv_frame(srv, sv[1], 64, &h, &p, ember_deadline_after(1000)));
  CHECK_EQ_INT(h.type, EMBER_MSG_ACK);
  CHECK(h.length == 5 && memcmp(p, "hello", 5) == 0);
  free(p);
  CHECK_OK(ember_sec_send_frame(srv, sv[1], EMBER_MSG_REFUSED, "no", 2, ember_deadline_after(1000)));
  CHECK_OK(ember_sec_recv_frame(cli, sv[0], 64, &h, &p, ember_deadline_after(1000)));
  CHECK(h.type == EMBER_MSG_REFUSED && h.length == 2 && memcmp(p, "no", 2) == 0);
  free(p);
  /* nothing waiting: recv says 0, not an error */
  CHECK_EQ_INT(ember_sec_recv(srv, sv[1], hdr, sizeof hdr), 0);
  ember_sec_destroy(cli);
  ember_sec_destroy(srv);
  close(sv[0]);
  close(sv[1]);
}

/* ------------------------------------------------------------ keys */

/* Reads one whole record off fd (the raw bytes). */
static size_t raw_record(int fd, uint8_t *buf, size_t cap) {
  CHECK_OK(ember_net_recv_all(fd, buf, 4, ember_deadline_after(2000)));
  size_t len = (size_t)buf[0] | (size_t)buf[1] << 8 | (size_t)buf[2] << 16 | (size_t)buf[3] << 24;
  CHECK(len + EMBER_SEC_OVERHEAD <= cap);
  CHECK_OK(ember_net_recv_all(fd, buf + 4, len + EMBER_SEC_TAG_LEN, ember_deadline_after(2000)));
  return len + EMBER_SEC_OVERHEAD;
}

TEST(keys_differ_per_direction_connection_and_secret) {
  static const uint8_t msg[64] = "the same plaintext on every connection, every direction";
  uint8_t r[4][256];
  size_t n[4];
  uint8_t other_cn[32];
  memcpy(other_cn, CN, 32);
  other_cn[0] ^= 1;
  for (int k = 0; k < 4; k++) {
    ember_sec *s;
    int sv[2];
    pair(sv);
    CHECK_OK(ember_sec_create(&s, k == 3 ? (const uint8_t *)"another-secret-of-32-bytes-long!" : SECRET,
                              32, SN, k == 2 ? other_cn : CN,
                              k == 1 ? EMBER_SEC_SERVER : EMBER_SEC_CLIENT, "x"));
    CHECK_OK(ember_sec_send_all(s, sv[0], msg, sizeof msg, ember_deadline_after(1000)));
    n[k] = raw_record(sv[1], r[k], sizeof r[k]);
    CHECK_EQ_INT(n[k], sizeof msg + EMBER_SEC_OVERHEAD);
    CHECK(memmem(r[k], n[k], "plaintext", 9) == NULL); /* not in clear */
    ember_sec_destroy(s);
    close(sv[0]);
    close(sv[1]);
  }
  for (int i = 0; i < 4; i++)
    for (int j = i + 1; j < 4; j++) CHECK(memcmp(r[i] + 4, r[j] + 4, sizeof msg) != 0);
}

TEST(a_reflected_record_is_refused) {
  /* The client's own record sent back to it: other direction, other key. */
  ember_sec *cli, *srv;
  int sv[2];
  uint8_t rec[256], out[64];
  make_pair(&cli, &srv);
  pair(sv);
  CHECK_OK(ember_sec_send_all(cli, sv[0], "reflect me", 10, ember_deadline_after(1000)));
  size_t n = raw_record(sv[1], rec, sizeof rec);
  CHECK_OK(ember_net_send_all(sv[1], rec, n, ember_deadline_after(1000)));
  CHECK_EQ_INT(ember_sec_recv_all(cli, sv[0], out, 10, ember_deadline_after(1000)),
               EMBER_ETAMPERED);
  CHECK(strstr(ember_last_error(), "altered in transit") != NULL);
  CHECK(strstr(ember_last_error(), "server:1") != NULL);
  ember_sec_destroy(cli);
  ember_sec_destroy(srv);
  close(sv[0]);
  close(sv[1]);
}

TEST(counter_never_wraps) {
  ember_sec *cli, *srv;
  int sv[2];
  uint8_t out[8];
  make_pair(&cli, &srv);
  pair(sv);
  ember__sec_set_seq(cli, UINT64_MAX - 1, 0);
  ember__sec_set_seq(srv, 0, UINT64_MAX - 1);
  CHECK_OK(ember_sec_send_all(cli, sv[0], "last", 4, ember_deadline_after(1000)));
  CHECK_OK(ember_sec_recv_all(srv, sv[1], out, 4, ember_deadline_after(1000)));
  CHECK(memcmp(out, "last", 4) == 0);
  CHECK_EQ_INT(ember_sec_send_all(cli, sv[0], "wrap", 4, ember_deadline_after(1000)),
               EMBER_ESTATE);
  CHECK(strstr(ember_last_error(), "nonce") != NULL);
  ember_sec_destroy(cli);
  ember_sec_destroy(srv);
  close(sv[0]);
  close(sv[1]);
}

TEST(bad_lengths_refused_before_buffering) {
  static const uint8_t heads[][4] = {{0, 0, 0, 0}, {1, 0, 4, 0}, {0xff, 0xff, 0xff, 0xff}};
  for (size_t k = 0; k < 3; k++) {
    ember_sec *cli, *srv;
    int sv[2];
    uint8_t out[16];
    make_pair(&cli, &srv);
    pair(sv);
    CHECK_OK(ember_net_send_all(sv[0], heads[k], 4, ember_deadline_after(1000)));
    CHECK_EQ_INT(ember_sec_recv_all(srv, sv[1], out, 1, ember_deadline_after(1000)),
                 EMBER_ETAMPERED);
    CHECK(strstr(ember_last_error(), "client:2") != NULL);
    /* sticky */
    CHECK_EQ_INT(ember_sec_recv(srv, sv[1], out, 1), EMBER_ETAMPERED);
    ember_sec_destroy(cli);
    ember_sec_destroy(srv);
    close(sv[0]);
    close(sv[1]);
  }
}

/* ------------------------------------------------------------ the handshake */

typedef struct {
  int fd;
  uint32_t flags;
  int rc;
  char msg[512];
  ember_auth_result res;
} hs_args;

static void *hs_server(void *arg) {
  hs_args *a = arg;
  a->rc = ember_auth_server_ex(a->fd, SECRET, 32, a->flags, ember_deadline_after(2000), &a->res);
  snprintf(a->msg, sizeof a->msg, "%s", ember_last_error());
  return NULL;
}

TEST(handshake_agrees_on_the_mode) {
  for (int mode = 0; mode < 4; mode++) {
    int sv[2];
    pthread_t t;
    ember_auth_result res;
    hs_args s = {.flags = (mode & 1) ? EMBER_AUTH_ENCRYPT : 0};
    uint32_t cflags = (mode & 2) ? EMBER_AUTH_ENCRYPT : 0;
    pair(sv);
    s.fd = sv[1];
    CHECK(pthread_create(&t, NULL, hs_server, &s) == 0);
    int rc = ember_auth_client_ex(sv[0], SECRET, 32, cflags, ember_deadline_after(2000), &res);
    char cmsg[512];
    snprintf(cmsg, sizeof cmsg, "%s", ember_last_error());
    pthread_join(t, NULL);
    if (s.flags == cflags) {
      CHECK_OK(rc);
      CHECK_OK(s.rc);
      CHECK(memcmp(res.server_nonce, s.res.server_nonce, 32) == 0);
      CHECK(memcmp(res.client_nonce, s.res.client_nonce, 32) == 0);
    } else {
      CHECK_EQ_INT(rc, EMBER_EAUTH);
      CHECK_EQ_INT(s.rc, EMBER_EAUTH);
      CHECK(strstr(cmsg, "encryption mismatch") != NULL);
      CHECK(strstr(s.msg, "encryption mismatch") != NULL);
      CHECK(strstr(cmsg, cflags ? "the peer encrypts" : "the peer sends in clear") != NULL);
    }
    close(sv[0]);
    close(sv[1]);
  }
}

/* ------------------------------------------------------------ man in the middle */

enum { MITM_NONE, MITM_FLIP, MITM_DROP, MITM_REPLAY, MITM_REORDER, MITM_TRUNCATE, MITM_FLIP_LEN };

typedef struct {
  int in, out; /* reads records from in, writes them to out */
  int mode;
  int at;      /* the record it acts on */
  int skip;    /* records passed through untouched first (handshakes) */
  int done;
} mitm_args;

/* Reads one raw record (blocking, any fd); 0 at EOF. */
static size_t mitm_read(int fd, uint8_t *buf, size_t cap) {
  if (ember_net_recv_all(fd, buf, 4, ember_deadline_after(10000)) != EMBER_OK) return 0;
  size_t len = (size_t)buf[0] | (size_t)buf[1] << 8 | (size_t)buf[2] << 16 | (size_t)buf[3] << 24;
  if (len + EMBER_SEC_OVERHEAD > cap) return 0;
  if (ember_net_recv_all(fd, buf + 4, len + EMBER_SEC_TAG_LEN, ember_deadline_after(10000)) !=
      EMBER_OK)
    return 0;
  return len + EMBER_SEC_OVERHEAD;
}

static void *mitm(void *arg) {
  mitm_args *a = arg;
  size_t cap = EMBER_SEC_RECORD_MAX + EMBER_SEC_OVERHEAD;
  uint8_t *rec = malloc(cap), *held = malloc(cap);
  size_t held_n = 0;
  for (int k = 0;; k++) {
    size_t n = mitm_read(a->in, rec, cap);
    if (n == 0) break;
    int i = k - a->skip;
    int64_t d = ember_deadline_after(10000);
    if (i == a->at) {
      switch (a->mode) {
        case MITM_FLIP: rec[4 + (n - 20) / 2] ^= 0x01; break;
        case MITM_FLIP_LEN: rec[0] ^= 0x01; break;
        case MITM_DROP: continue;
        case MITM_REPLAY: (void)ember_net_send_all(a->out, rec, n, d); break;
        case MITM_REORDER:
          memcpy(held, rec, n);
          held_n = n;
          continue;
        case MITM_TRUNCATE:
          (void)ember_net_send_all(a->out, rec, n / 2, d);
          shutdown(a->out, SHUT_WR);
          goto out;
        default: break;
      }
    }
    if (ember_net_send_all(a->out, rec, n, d) != EMBER_OK) break;
    if (held_n > 0 && i == a->at + 1) {
      if (ember_net_send_all(a->out, held, held_n, d) != EMBER_OK) break;
      held_n = 0;
    }
  }
  shutdown(a->out, SHUT_WR);
out:
  free(rec);
  free(held);
  a->done = 1;
  return NULL;
}

/* 10 records of 1000 bytes through the man in the middle, who acts on the
 * 4th; the receiver gets exactly the first three, then the error. */
static void run_mitm(int mode) {
  ember_sec *cli, *srv;
  int a[2], b[2];
  uint8_t msg[1000], out[1000];
  make_pair(&cli, &srv);
  pair(a);
  pair(b);
  mitm_args m = {.in = a[1], .out = b[0], .mode = mode, .at = 3};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, mitm, &m) == 0);
  for (uint32_t r = 0; r < 10; r++) {
    fill(msg, sizeof msg, r);
    CHECK_OK(ember_sec_send_all(cli, a[0], msg, sizeof msg, ember_deadline_after(2000)));
  }
  shutdown(a[0], SHUT_WR);
  int rc = EMBER_OK;
  uint32_t r = 0;
  for (; r < 10; r++) {
    rc = ember_sec_recv_all(srv, b[1], out, sizeof out, ember_deadline_after(2000));
    if (rc != EMBER_OK) break;
    fill(msg, sizeof msg, r);
    CHECK(memcmp(msg, out, sizeof msg) == 0); /* what is delivered is genuine */
  }
  pthread_join(t, NULL);
  if (mode == MITM_NONE) {
    CHECK_OK(rc);
  } else {
    /* a replayed record comes after the genuine one, which is delivered */
    CHECK_EQ_INT(r, mode == MITM_REPLAY ? 4 : 3);
    CHECK_EQ_INT(rc, EMBER_ETAMPERED);
    CHECK(strstr(ember_last_error(), "altered in transit") != NULL);
    CHECK(strstr(ember_last_error(), "client:2") != NULL);
  }
  ember_sec_destroy(cli);
  ember_sec_destroy(srv);
  close(a[0]);
  close(a[1]);
  close(b[0]);
  close(b[1]);
}

TEST(mitm_passthrough_delivers_all) { run_mitm(MITM_NONE); }
TEST(mitm_flipped_byte_refused) { run_mitm(MITM_FLIP); }
TEST(mitm_flipped_length_refused) { run_mitm(MITM_FLIP_LEN); }
TEST(mitm_dropped_record_refused) { run_mitm(MITM_DROP); }
TEST(mitm_replayed_record_refused) { run_mitm(MITM_REPLAY); }
TEST(mitm_reordered_records_refused) { run_mitm(MITM_REORDER); }
TEST(mitm_truncated_stream_refused) { run_mitm(MITM_TRUNCATE); }

/* ------------------------------------------------------------ over real servers */

/* A TCP proxy on 127.0.0.1: accepts one connection, connects to port, and
 * runs a man in the middle each way; client->server records after `skip`
 * raw handshake bytes... the handshake is frames, so the proxy passes the
 * first hs_bytes in clear, then works record by record. */
typedef struct {
  int listen_fd;
  uint16_t port, target;
  int mode, at;
  size_t hs_c2s, hs_s2c; /* clear handshake bytes each way */
  pthread_t t;
} proxy;

typedef struct {
  int in, out;
  size_t clear;
  int mode, at;
} pipe_args;

static void *pipe_run(void *arg) {
  pipe_args *p = arg;
  uint8_t buf[256];
  size_t left = p->clear;
  while (left > 0) { /* forwarded as it comes: the handshake goes back and forth */
    size_t k = left < sizeof buf ? left : sizeof buf;
    struct pollfd pf = {.fd = p->in, .events = POLLIN};
    if (poll(&pf, 1, 10000) <= 0) goto out;
    ssize_t n = recv(p->in, buf, k, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) goto out;
    if (ember_net_send_all(p->out, buf, (size_t)n, ember_deadline_after(10000)) != EMBER_OK)
      goto out;
    left -= (size_t)n;
  }
  {
    mitm_args m = {.in = p->in, .out = p->out, .mode = p->mode, .at = p->at};
    (void)mitm(&m);
  }
out:
  shutdown(p->out, SHUT_WR);
  return NULL;
}

static void *proxy_run(void *arg) {
  proxy *x = arg;
  int c = -1, s = -1;
  if (ember_net_accept(x->listen_fd, ember_deadline_after(10000), &c) != EMBER_OK) return NULL;
  if (ember_net_connect("127.0.0.1", x->target, ember_deadline_after(10000), &s) != EMBER_OK) {
    close(c);
    return NULL;
  }
  pipe_args up = {.in = c, .out = s, .clear = x->hs_c2s, .mode = x->mode, .at = x->at};
  pipe_args down = {.in = s, .out = c, .clear = x->hs_s2c, .mode = MITM_NONE, .at = -1};
  pthread_t t1, t2;
  pthread_create(&t1, NULL, pipe_run, &up);
  pthread_create(&t2, NULL, pipe_run, &down);
  pthread_join(t1, NULL);
  pthread_join(t2, NULL);
  close(c);
  close(s);
  return NULL;
}

/* CHALLENGE (12+32), AUTH (12+64), AUTH_OK (12+32) */
#define HS_S2C (12u + 32u + 12u + 32u)
#define HS_C2S (12u + 64u)

static void proxy_start(proxy *x, uint16_t target, int mode, int at) {
  memset(x, 0, sizeof *x);
  CHECK_OK(ember_net_bind("127.0.0.1", 0, 16, 0, &x->listen_fd, &x->port));
  x->target = target;
  x->mode = mode;
  x->at = at;
  x->hs_c2s = HS_C2S;
  x->hs_s2c = HS_S2C;
  CHECK(pthread_create(&x->t, NULL, proxy_run, x) == 0);
}

static void proxy_stop(proxy *x) {
  pthread_join(x->t, NULL);
  close(x->listen_fd);
}

static char g_log[4096];
static pthread_mutex_t g_log_mu = PTHREAD_MUTEX_INITIALIZER;
static void capture_log(void *arg, const char *line) {
  (void)arg;
  pthread_mutex_lock(&g_log_mu);
  size_t n = strlen(g_log);
  snprintf(g_log + n, sizeof g_log - n, "%s\n", line);
  pthread_mutex_unlock(&g_log_mu);
}

static ember_feed_server *feed_server(int encrypt) {
  ember_feed_server *s = NULL;
  ember_feed_server_config cfg = {.secret = SECRET, .secret_len = sizeof SECRET,
                                  .listen_fd = -1, .bind_host = "127.0.0.1",
                                  .disable_shm = 1, .log_fn = capture_log,
                                  .encrypt = encrypt};
  CHECK_OK(ember_feed_server_create(&s, &cfg));
  return s;
}

/* Sends nb batches of one 64 KiB u8 column, then ends the partition. */
static int feed_some(uint16_t port, int encrypt, int nb, char *msg, size_t cap) {
  ember_feed_client *c = NULL;
  ember_feed_client_options o = {.shm = EMBER_FEED_SHM_OFF, .encrypt = encrypt};
  static uint8_t data[65536];
  ember_column col = {.dtype = EMBER_DT_U8, .name_len = 1, .name = "x", .width = 1024,
                      .data = data, .data_len = sizeof data};
  int rc = ember_feed_client_connect_ex(&c, "127.0.0.1", port, SECRET, sizeof SECRET, 0, 0, &o,
                                        5000);
  for (int b = 0; b < nb && rc == EMBER_OK; b++) {
    memset(data, 'A' + b, sizeof data);
    rc = ember_feed_client_send(c, &col, 1, 64, 5000);
  }
  if (rc == EMBER_OK) rc = ember_feed_client_end_partition(c, 5000);
  snprintf(msg, cap, "%s", ember_last_error());
  ember_feed_client_destroy(c);
  return rc;
}

typedef struct {
  uint16_t port;
  int encrypt, nb, rc;
  char msg[512];
} feed_args;

static void *feed_thread(void *arg) {
  feed_args *a = arg;
  a->rc = feed_some(a->port, a->encrypt, a->nb, a->msg, sizeof a->msg);
  return NULL;
}

TEST(feed_encrypted_round_trip) {
  ember_feed_server *s = feed_server(1);
  feed_args a = {.port = ember_feed_server_port(s), .encrypt = 1, .nb = 8};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, feed_thread, &a) == 0);
  for (int b = 0; b < 8; b++) {
    ember_feed_item *it = NULL;
    CHECK_OK(ember_feed_server_next(s, &it, 5000));
    CHECK_EQ_INT(it->kind, EMBER_FEED_ITEM_BATCH);
    CHECK(it->nrows == 64 && ((const uint8_t *)it->cols[0].data)[4321] == 'A' + b);
    ember_feed_item_free(it);
  }
  pthread_join(t, NULL);
  CHECK_OK(a.rc);
  ember_feed_server_destroy(s);
}

TEST(feed_mode_mismatch_refused_both_ways) {
  for (int enc = 0; enc < 2; enc++) {
    ember_feed_server *s = feed_server(enc);
    char msg[512];
    CHECK_EQ_INT(feed_some(ember_feed_server_port(s), !enc, 1, msg, sizeof msg), EMBER_EAUTH);
    CHECK(strstr(msg, "encryption mismatch") != NULL);
    ember_feed_server_destroy(s);
  }
}

TEST(feed_through_mitm_flip_refused_naming_the_producer) {
  ember_feed_server *s = feed_server(1);
  proxy x;
  g_log[0] = '\0';
  /* record 0: FEED_HELLO; then the first batch's records: flip one there */
  proxy_start(&x, ember_feed_server_port(s), MITM_FLIP, 1);
  feed_args a = {.port = x.port, .encrypt = 1, .nb = 4};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, feed_thread, &a) == 0);
  ember_feed_item *it = NULL;
  /* nothing of the altered batch (the first) or after it was delivered */
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 2000), EMBER_ETIMEDOUT);
  pthread_join(t, NULL);
  CHECK(a.rc != EMBER_OK);
  proxy_stop(&x);
  ember_feed_server_destroy(s);
  CHECK(strstr(g_log, "altered in transit") != NULL);
  CHECK(strstr(g_log, "127.0.0.1:") != NULL);
}

/* Two ranks over TCP with encryption (fork: one process per rank). */
TEST(collective_encrypted_allreduce_and_mismatch) {
  for (int mismatch = 0; mismatch < 2; mismatch++) {
    int fds[2];
    uint16_t ports[2];
    char addr[2][32];
    for (int r = 0; r < 2; r++) {
      CHECK_OK(ember_net_bind("127.0.0.1", 0, 0, 0, &fds[r], &ports[r]));
      snprintf(addr[r], sizeof addr[r], "127.0.0.1:%u", (unsigned)ports[r]);
    }
    const char *addrs[2] = {addr[0], addr[1]};
    pid_t pids[2];
    for (int r = 0; r < 2; r++) {
      pids[r] = fork();
      if (pids[r] == 0) {
        close(fds[1 - r]);
        ember_comm *c = NULL;
        ember_comm_config cfg = {.rank = (uint32_t)r, .size = 2, .addresses = addrs,
                                 .secret = SECRET, .secret_len = 32, .listen_fd = fds[r],
                                 .flags = EMBER_COMM_TCP_ONLY,
                                 .encrypt = mismatch ? r : 1};
        int rc = ember_comm_create(&c, &cfg, 5000);
        if (mismatch) _exit(rc == EMBER_OK ? 1 : 0);
        if (rc != EMBER_OK) _exit(2);
        size_t n = (3u << 20) / 4 + 5;
        float *v = malloc(n * sizeof *v);
        for (size_t i = 0; i < n; i++) v[i] = (float)(i % 1000) + (float)r;
        rc = ember_comm_allreduce(c, v, n, EMBER_DT_F32, EMBER_RED_SUM, 10000);
        if (rc != EMBER_OK) _exit(3);
        for (size_t i = 0; i < n; i++)
          if (v[i] != 2.0f * (float)(i % 1000) + 1.0f) _exit(4);
        free(v);
        ember_comm_destroy(c);
        _exit(0);
      }
    }
    close(fds[0]);
    close(fds[1]);
    for (int r = 0; r < 2; r++) {
      int st = 0;
      waitpid(pids[r], &st, 0);
      CHECK(WIFEXITED(st));
      CHECK_EQ_INT(WEXITSTATUS(st), 0);
    }
  }
}

RUN_TESTS(T(round_trip_sizes_and_pieces), T(frames_both_ways_and_peek),
          T(keys_differ_per_direction_connection_and_secret), T(a_reflected_record_is_refused),
          T(counter_never_wraps), T(bad_lengths_refused_before_buffering),
          T(handshake_agrees_on_the_mode), T(mitm_passthrough_delivers_all),
          T(mitm_flipped_byte_refused), T(mitm_flipped_length_refused),
          T(mitm_dropped_record_refused), T(mitm_replayed_record_refused),
          T(mitm_reordered_records_refused), T(mitm_truncated_stream_refused),
          T(feed_encrypted_round_trip), T(feed_mode_mismatch_refused_both_ways),
          T(feed_through_mitm_flip_refused_naming_the_producer),
          T(collective_encrypted_allreduce_and_mismatch))
