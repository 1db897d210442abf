/* test_ps.c - the parameter server (ps.h) on loopback: shards and workers in
 * one process, dense and sparse tables, the server-side optimizer, bounded
 * staleness, checkpoints, and peers that send garbage or the wrong shapes.
 * Workers and shards share a host here, so every client that does not say
 * otherwise talks to its shards through shared memory (ps.h, "Transport");
 * the tests at the end compare it with TCP and play its hostile and dying
 * peers. */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../csrc/ps_link.h"
#include "ember/auth.h"
#include "ember/net.h"
#include "ember/ps.h"
#include "ember/shm_ring.h"
#include "ember/wire.h"
#include "harness.h"

static const uint8_t SECRET[32] = "0123456789abcdef0123456789abcdef";

typedef struct {
  ember_ps_server *srv[4];
  uint16_t ports[4];
  const char *hosts[4];
  uint32_t shards;
} ps_cluster;

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static char log_seen[2048];
static void capture_log(void *arg, const char *line) {
  (void)arg;
  pthread_mutex_lock(&log_mu);
  snprintf(log_seen, sizeof log_seen, "%s", line);
  pthread_mutex_unlock(&log_mu);
}

/* 1 once the servers logged a line containing every one of a, b and c
 * (NULL: any), within ms. */
static int logged(const char *a, const char *b, const char *c, int ms) {
  int64_t until = ember_now_ms() + ms;
  for (;;) {
    pthread_mutex_lock(&log_mu);
    int ok = strstr(log_seen, a) && (!b || strstr(log_seen, b)) && (!c || strstr(log_seen, c));
    pthread_mutex_unlock(&log_mu);
    if (ok) return 1;
    if (ember_now_ms() >= until) return 0;
    usleep(10 * 1000);
  }
}

static void start_ex(ps_cluster *p, uint32_t shards, uint32_t workers, uint32_t staleness,
                     int encrypt, int disable_shm) {
  memset(p, 0, sizeof *p);
  p->shards = shards;
  for (uint32_t k = 0; k < shards; k++) {
    ember_ps_server_config cfg = {.listen_fd = -1, .bind_host = "127.0.0.1", .secret = SECRET,
                                  .secret_len = sizeof SECRET, .encrypt = encrypt, .shard = k,
                                  .num_shards = shards, .num_workers = workers,
                                  .staleness = staleness, .log_fn = capture_log,
                                  .disable_shm = disable_shm};
    CHECK_OK(ember_ps_server_create(&p->srv[k], &cfg));
    p->ports[k] = ember_ps_server_port(p->srv[k]);
    p->hosts[k] = "127.0.0.1";
  }
}

static void start(ps_cluster *p, uint32_t shards, uint32_t workers, uint32_t staleness,
                  int encrypt) {
  start_ex(p, shards, workers, staleness, encrypt, 0);
}

static void stop(ps_cluster *p) {
  for (uint32_t k = 0; k < p->shards; k++) ember_ps_server_destroy(p->srv[k]);
}

static ember_ps_client_config client_cfg(ps_cluster *p, uint32_t w, uint32_t workers,
                                         int encrypt, int64_t timeout_ms, int shm,
                                         size_t shm_bytes) {
  ember_ps_client_config cfg = {.hosts = p->hosts, .ports = p->ports, .num_shards = p->shards,
                                .secret = SECRET, .secret_len = sizeof SECRET,
                                .encrypt = encrypt, .worker = w, .num_workers = workers,
                                .timeout_ms = timeout_ms, .shm = shm, .shm_bytes = shm_bytes};
  return cfg;
}

static ember_ps_client *worker_ex(ps_cluster *p, uint32_t w, uint32_t workers, int encrypt,
                                  int64_t timeout_ms, int shm, size_t shm_bytes) {
  ember_ps_client *c = NULL;
  ember_ps_client_config cfg = client_cfg(p, w, workers, encrypt, timeout_ms, shm, shm_bytes);
  CHECK_OK(ember_ps_client_create(&c, &cfg));
  return c;
}

static ember_ps_client *worker(ps_cluster *p, uint32_t w, uint32_t workers, int encrypt,
                               int64_t timeout_ms) {
  return worker_ex(p, w, workers, encrypt, timeout_ms, EMBER_PS_SHM_AUTO, 0);
}

/* 1 if every shard link of c uses transport t */
static int all_links(const ember_ps_client *c, uint32_t shards, int t) {
  for (uint32_t k = 0; k < shards; k++)
    if (ember_ps_client_transport(c, k, NULL, NULL) != t) return 0;
  return 1;
}

static ember_ps_table_spec dense(const char *name, uint64_t rows, uint32_t cols, uint32_t opt,
                                 float lr) {
  ember_ps_table_spec s = {.name = name, .layout = EMBER_PS_DENSE, .rows = rows, .cols = cols,
                           .optimizer = {.kind = opt, .learning_rate = lr},
                           .init = EMBER_PS_INIT_UNIFORM, .init_scale = 0.5f, .seed = 7};
  return s;
}

static int near(float a, float b) { return fabsf(a - b) <= 1e-5f * (1 + fabsf(b)); }

/* ------------------------------------------------------------ dense */

TEST(dense_table_split_over_shards_pulls_whole_and_applies_sgd) {
  ps_cluster p;
  start(&p, 3, 1, EMBER_PS_ASYNC, 0);
  ember_ps_client *c = worker(&p, 0, 1, 0, 10000);
  ember_ps_table_spec spec = dense("w", 10, 4, EMBER_PS_SGD, 0.5f);
  CHECK_OK(ember_ps_client_declare(c, &spec));
  CHECK_OK(ember_ps_client_declare(c, &spec)); /* the same spec again: a no-op */
  float w0[40], g[40], w1[40], rows[8];
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 10, 4, w0));
  int nonzero = 0;
  for (int i = 0; i < 40; i++) {
    CHECK(w0[i] >= -0.5f && w0[i] < 0.5f);
    nonzero += w0[i] != 0;
    g[i] = (float)i / 10;
  }
  CHECK(nonzero > 30);
  CHECK_OK(ember_ps_client_push(c, "w", NULL, 10, 4, g));
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 10, 4, w1));
  for (int i = 0; i < 40; i++) CHECK(near(w1[i], w0[i] - 0.5f * g[i]));
  /* named rows of a dense table, in the order asked, across shards */
  uint64_t ids[2] = {9, 0};
  CHECK_OK(ember_ps_client_pull(c, "w", ids, 2, 4, rows));
  CHECK(memcmp(rows, w1 + 36, 16) == 0 && memcmp(rows + 4, w1, 16) == 0);
  ember_ps_stats st;
  uint64_t held = 0;
  for (int k = 0; k < 3; k++) {
    ember_ps_server_stats(p.srv[k], &st);
    CHECK_EQ_INT(st.tables, 1);
    held += st.rows_held;
  }
  CHECK_EQ_INT(held, 10);
  CHECK_EQ_INT(st.workers_connected, 1);
  ember_ps_client_destroy(c);
  /* the worker's connection ends on the server soon after (ember.ps ends a
   * ps node once every worker finished and left) */
  int64_t until = ember_now_ms() + 5000;
  do {
    usleep(10 * 1000);
    ember_ps_server_stats(p.srv[0], &st);
  } while (st.workers_connected != 0 && ember_now_ms() < until);
  CHECK_EQ_INT(st.workers_connected, 0);
  stop(&p);
}

TEST(two_workers_share_updates_and_momentum_state_lives_on_the_server) {
  ps_cluster p;
  start(&p, 2, 2, EMBER_PS_ASYNC, 0);
  ember_ps_client *a = worker(&p, 0, 2, 0, 10000), *b = worker(&p, 1, 2, 0, 10000);
  ember_ps_table_spec spec = dense("m", 3, 2, EMBER_PS_MOMENTUM, 0.1f);
  spec.optimizer.momentum = 0.9f;
  spec.init = EMBER_PS_INIT_ZEROS;
  CHECK_OK(ember_ps_client_declare(a, &spec));
  CHECK_OK(ember_ps_client_declare(b, &spec));
  float g[6] = {1, 1, 1, 1, 1, 1}, w[6];
  CHECK_OK(ember_ps_client_push(a, "m", NULL, 3, 2, g)); /* v = -0.1, w = -0.1 */
  CHECK_OK(ember_ps_client_push(b, "m", NULL, 3, 2, g)); /* v = -0.19, w = -0.29 */
  CHECK_OK(ember_ps_client_pull(a, "m", NULL, 3, 2, w));
  for (int i = 0; i < 6; i++) CHECK(near(w[i], -0.29f));
  ember_ps_client_destroy(a);
  ember_ps_client_destroy(b);
  stop(&p);
}

TEST(assign_sets_values_and_the_optimizer_goes_on_from_them) {
  ps_cluster p;
  start(&p, 2, 1, EMBER_PS_ASYNC, 0);
  ember_ps_client *c = worker(&p, 0, 1, 0, 10000);
  ember_ps_table_spec spec = dense("w", 5, 2, EMBER_PS_SGD, 0.5f);
  ember_ps_table_spec emb = {.name = "e", .layout = EMBER_PS_SPARSE, .rows = 1000, .cols = 2,
                             .optimizer = {.kind = EMBER_PS_SGD, .learning_rate = 1.0f}};
  CHECK_OK(ember_ps_client_declare(c, &spec));
  CHECK_OK(ember_ps_client_declare(c, &emb));
  float v[10], g[10], w[10];
  for (int i = 0; i < 10; i++) {
    v[i] = (float)i;
    g[i] = 1.0f;
  }
  CHECK_OK(ember_ps_client_assign(c, "w", NULL, 5, 2, v));
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 5, 2, w));
  CHECK(memcmp(v, w, sizeof v) == 0);
  CHECK_OK(ember_ps_client_push(c, "w", NULL, 5, 2, g));
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 5, 2, w));
  for (int i = 0; i < 10; i++) CHECK(near(w[i], (float)i - 0.5f));
  uint64_t ids[3] = {999, 3, 500};
  CHECK_OK(ember_ps_client_assign(c, "e", ids, 3, 2, v));
  CHECK_OK(ember_ps_client_pull(c, "e", ids, 3, 2, w));
  CHECK(memcmp(v, w, 6 * sizeof *v) == 0);
  CHECK_EQ_INT(ember_ps_client_assign(c, "e", ids, 3, 3, v), EMBER_ESCHEMA);
  /* init leaves trained rows (the dense table was pushed once) and sets fresh ones */
  float z[10] = {0}, e_rows[6];
  CHECK_OK(ember_ps_client_init(c, "w", NULL, 5, 2, z));
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 5, 2, w));
  for (int i = 0; i < 10; i++) CHECK(near(w[i], (float)i - 0.5f));
  uint64_t fresh[2] = {3, 7}; /* 3 was assigned (not trained), 7 never touched */
  CHECK_OK(ember_ps_client_init(c, "e", fresh, 2, 2, z));
  CHECK_OK(ember_ps_client_pull(c, "e", fresh, 2, 2, e_rows));
  for (int i = 0; i < 4; i++) CHECK(e_rows[i] == 0.0f);
  ember_ps_stats a, b;
  ember_ps_server_stats(p.srv[0], &a);
  ember_ps_server_stats(p.srv[1], &b);
  CHECK_EQ_INT(a.pushes + b.pushes, 2); /* assigns are not pushes: one dense push, 2 shards */
  ember_ps_client_destroy(c);
  stop(&p);
}

/* ------------------------------------------------------------ sparse */

TEST(sparse_rows_materialise_when_touched_and_bytes_follow_the_rows) {
  ps_cluster p;
  start(&p, 2, 1, EMBER_PS_ASYNC, 0);
  ember_ps_client *c = worker(&p, 0, 1, 0, 10000);
  ember_ps_table_spec spec = {.name = "emb", .layout = EMBER_PS_SPARSE, .rows = 1000000000ull,
                              .cols = 16, .optimizer = {.kind = EMBER_PS_ADAGRAD,
                                                        .learning_rate = 0.1f,
                                                        .initial_accumulator = 0.1f},
                              .init = EMBER_PS_INIT_NORMAL, .init_scale = 0.01f, .seed = 3};
  CHECK_OK(ember_ps_client_declare(c, &spec));
  uint64_t ids[64];
  float rows[64 * 16], again[64 * 16], g[64 * 16];
  for (int i = 0; i < 64; i++) ids[i] = (uint64_t)i * 15485863ull;
  uint64_t sent0, recv0, sent1, recv1;
  ember_ps_client_bytes(c, &sent0, &recv0);
  CHECK_OK(ember_ps_client_pull(c, "emb", ids, 64, 16, rows));
  ember_ps_client_bytes(c, &sent1, &recv1);
  /* 64 rows of 16 floats back, 64 ids out, plus small headers */
  CHECK(recv1 - recv0 >= 64 * 16 * 4 && recv1 - recv0 < 64 * 16 * 4 + 256);
  CHECK(sent1 - sent0 >= 64 * 8 && sent1 - sent0 < 64 * 8 + 256);
  ember_ps_stats s0, s1;
  ember_ps_server_stats(p.srv[0], &s0);
  ember_ps_server_stats(p.srv[1], &s1);
  CHECK_EQ_INT(s0.rows_held + s1.rows_held, 64);
  CHECK(s0.rows_held > 10 && s1.rows_held > 10); /* hashed over both shards */
  CHECK_OK(ember_ps_client_pull(c, "emb", ids, 64, 16, again));
  CHECK(memcmp(rows, again, sizeof rows) == 0);
  for (int i = 0; i < 64 * 16; i++) g[i] = 1.0f;
  CHECK_OK(ember_ps_client_push(c, "emb", ids, 64, 16, g));
  CHECK_OK(ember_ps_client_pull(c, "emb", ids, 64, 16, again));
  /* Adagrad: a = 0.1 + 1, w -= 0.1 * 1 / (sqrt(1.1) + 1e-7) */
  for (int i = 0; i < 64 * 16; i++) CHECK(near(again[i], rows[i] - 0.1f / sqrtf(1.1f)));
  ember_ps_server_stats(p.srv[0], &s0);
  ember_ps_server_stats(p.srv[1], &s1);
  CHECK_EQ_INT(s0.rows_held + s1.rows_held, 64);
  CHECK_EQ_INT(s0.rows_pushed + s1.rows_pushed, 64);
  ember_ps_client_destroy(c);
  stop(&p);
}

/* ------------------------------------------------------------ careless users */

TEST(wrong_shapes_unknown_tables_and_conflicting_specs_are_named) {
  ps_cluster p;
  start(&p, 2, 1, EMBER_PS_ASYNC, 0);
  ember_ps_client *c = worker(&p, 0, 1, 0, 10000);
  ember_ps_table_spec spec = dense("w", 4, 8, EMBER_PS_ADAM, 0.001f);
  CHECK_OK(ember_ps_client_declare(c, &spec));
  float buf[64] = {0};
  CHECK_EQ_INT(ember_ps_client_push(c, "w", NULL, 4, 4, buf), EMBER_ESCHEMA);
  CHECK(strstr(ember_last_error(), "'w'") && strstr(ember_last_error(), "4") &&
        strstr(ember_last_error(), "8"));
  CHECK_EQ_INT(ember_ps_client_pull(c, "nope", NULL, 4, 8, buf), EMBER_ENOTFOUND);
  CHECK(strstr(ember_last_error(), "'nope'") != NULL);
  uint64_t far = 4;
  CHECK_EQ_INT(ember_ps_client_pull(c, "w", &far, 1, 8, buf), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "row 4 out of range") != NULL);
  ember_ps_table_spec other = dense("w", 4, 16, EMBER_PS_ADAM, 0.001f);
  CHECK_EQ_INT(ember_ps_client_declare(c, &other), EMBER_ESCHEMA);
  CHECK(strstr(ember_last_error(), "'w'") && strstr(ember_last_error(), "declared differently"));
  /* the client is still usable */
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 4, 8, buf));
  ember_ps_client_destroy(c);
  stop(&p);
}

/* A worker that speaks the protocol by hand: authenticated, then frames. */
static int raw_peer(uint16_t port, uint32_t shard, uint32_t shards) {
  int fd = -1;
  uint8_t hello[16];
  ember_frame_header h;
  uint8_t *payload = NULL;
  CHECK_OK(ember_net_connect("127.0.0.1", port, ember_deadline_after(5000), &fd));
  CHECK_OK(ember_auth_client(fd, SECRET, sizeof SECRET, ember_deadline_after(5000)));
  ember_wire_put_u32(hello, 0);
  ember_wire_put_u32(hello + 4, 1);
  ember_wire_put_u32(hello + 8, shard);
  ember_wire_put_u32(hello + 12, shards);
  CHECK_OK(ember_net_send_frame(fd, EMBER_MSG_PS_HELLO, hello, 16, ember_deadline_after(5000)));
  CHECK_OK(ember_net_recv_frame(fd, 4096, &h, &payload, ember_deadline_after(5000)));
  CHECK(h.type == EMBER_MSG_PS_REPLY || h.type == EMBER_MSG_REFUSED);
  int refused = h.type == EMBER_MSG_REFUSED;
  if (refused) snprintf(log_seen, sizeof log_seen, "%.*s", (int)h.length - 8, payload + 8);
  free(payload);
  if (refused) {
    ember_net_close(fd);
    return -1;
  }
  return fd;
}

static int32_t raw_request(int fd, uint16_t type, const void *p, uint32_t len, char *reason,
                           size_t cap) {
  ember_frame_header h;
  uint8_t *payload = NULL;
  CHECK_OK(ember_net_send_frame(fd, type, p, len, ember_deadline_after(5000)));
  CHECK_OK(ember_net_recv_frame(fd, 1 << 20, &h, &payload, ember_deadline_after(5000)));
  CHECK(h.type == EMBER_MSG_PS_REPLY && h.length >= 8);
  int32_t status = (int32_t)ember_wire_get_u32(payload);
  uint32_t n = ember_wire_get_u32(payload + 4);
  CHECK(n <= h.length - 8);
  snprintf(reason, cap, "%.*s", (int)n, payload + 8);
  free(payload);
  return status;
}

TEST(hostile_worker_gets_named_refusals_and_others_keep_being_served) {
  ps_cluster p;
  start(&p, 1, 1, EMBER_PS_ASYNC, 0);
  ember_ps_client *good = worker(&p, 0, 1, 0, 10000);
  ember_ps_table_spec spec = dense("w", 4, 8, EMBER_PS_SGD, 0.1f);
  CHECK_OK(ember_ps_client_declare(good, &spec));
  /* the wrong shard */
  CHECK(raw_peer(p.ports[0], 1, 2) < 0);
  CHECK(strstr(log_seen, "shard 0 of 1") != NULL);
  int fd = raw_peer(p.ports[0], 0, 1);
  CHECK(fd >= 0);
  char why[512];
  /* a push of rows of 4 floats to a table of rows of 8 */
  ember_wire_writer w;
  ember_wire_writer_init(&w);
  ember_wire_write_str(&w, "w");
  ember_wire_write_u8(&w, 0);
  ember_wire_write_u32(&w, 1);
  ember_wire_write_u32(&w, 4);
  ember_wire_write_u64(&w, 2);
  for (int i = 0; i < 4; i++) ember_wire_write_u32(&w, 0);
  CHECK_EQ_INT(raw_request(fd, EMBER_MSG_PS_PUSH, w.buf, (uint32_t)w.len, why, sizeof why),
               EMBER_ESCHEMA);
  CHECK(strstr(why, "'w'") && strstr(why, "shard 0 of 1") && strstr(why, "(1, 4)") &&
        strstr(why, "(4, 8)"));
  /* a count that claims more rows than the frame holds */
  w.len = 0;
  ember_wire_write_str(&w, "w");
  ember_wire_write_u64(&w, 0);
  ember_wire_write_u32(&w, 0);
  ember_wire_write_u8(&w, 0);
  ember_wire_write_u32(&w, 1000000);
  CHECK_EQ_INT(raw_request(fd, EMBER_MSG_PS_PULL, w.buf, (uint32_t)w.len, why, sizeof why),
               EMBER_EPROTO);
  /* an unknown table */
  w.len = 0;
  ember_wire_write_str(&w, "ghost");
  ember_wire_write_u8(&w, 1);
  ember_wire_write_u32(&w, 0);
  ember_wire_write_u32(&w, 8);
  CHECK_EQ_INT(raw_request(fd, EMBER_MSG_PS_PUSH, w.buf, (uint32_t)w.len, why, sizeof why),
               EMBER_ENOTFOUND);
  CHECK(strstr(why, "'ghost'") && strstr(why, "declared: w"));
  ember_wire_writer_free(&w);
  /* garbage bytes: the connection is dropped, the good worker is not */
  CHECK_OK(ember_net_send_all(fd, "GARBAGE-GARBAGE!", 16, ember_deadline_after(1000)));
  float buf[32];
  CHECK_OK(ember_ps_client_pull(good, "w", NULL, 4, 8, buf));
  ember_net_close(fd);
  ember_ps_stats st;
  ember_ps_server_stats(p.srv[0], &st);
  CHECK(st.requests_refused >= 4);
  /* a wrong secret never gets in */
  ember_ps_client *bad = NULL;
  static const uint8_t WRONG[32] = "fedcba9876543210fedcba9876543210";
  ember_ps_client_config cfg = {.hosts = p.hosts, .ports = p.ports, .num_shards = 1,
                                .secret = WRONG, .secret_len = sizeof WRONG, .worker = 0,
                                .num_workers = 1, .timeout_ms = 3000};
  CHECK_EQ_INT(ember_ps_client_create(&bad, &cfg), EMBER_EAUTH);
  CHECK_OK(ember_ps_client_pull(good, "w", NULL, 4, 8, buf));
  ember_ps_client_destroy(good);
  stop(&p);
}

/* ------------------------------------------------------------ staleness */

TEST(bounded_staleness_holds_the_leader_and_names_the_straggler) {
  ps_cluster p;
  start(&p, 2, 2, 1, 0);
  ember_ps_client *fast = worker(&p, 0, 2, 0, 400), *slow = worker(&p, 1, 2, 0, 400);
  ember_ps_table_spec spec = dense("w", 4, 2, EMBER_PS_SGD, 0.1f);
  CHECK_OK(ember_ps_client_declare(fast, &spec));
  CHECK_OK(ember_ps_client_declare(slow, &spec));
  float buf[8];
  CHECK_OK(ember_ps_client_clock(fast)); /* fast at 1, slow at 0: within 1 */
  CHECK_OK(ember_ps_client_pull(fast, "w", NULL, 4, 2, buf));
  CHECK_OK(ember_ps_client_clock(fast)); /* fast at 2: 2 ahead */
  int64_t t0 = ember_now_ms();
  CHECK_EQ_INT(ember_ps_client_pull(fast, "w", NULL, 4, 2, buf), EMBER_ETIMEDOUT);
  CHECK(ember_now_ms() - t0 >= 350);
  CHECK(strstr(ember_last_error(), "worker 1 is at step 0") != NULL);
  ember_ps_client_destroy(fast); /* its connection's state after a timeout is not trusted */
  fast = worker(&p, 0, 2, 0, 5000);
  CHECK_OK(ember_ps_client_declare(fast, &spec));
  CHECK_OK(ember_ps_client_clock(fast));
  CHECK_OK(ember_ps_client_clock(fast));
  CHECK_OK(ember_ps_client_clock(slow)); /* slow at 1: fast at 2 may read */
  CHECK_OK(ember_ps_client_pull(fast, "w", NULL, 4, 2, buf));
  CHECK_OK(ember_ps_client_clock(fast));
  CHECK_OK(ember_ps_client_finish(slow)); /* a finished worker holds nobody */
  CHECK_OK(ember_ps_client_pull(fast, "w", NULL, 4, 2, buf));
  ember_ps_stats st;
  ember_ps_server_stats(p.srv[0], &st);
  CHECK(st.stale_waits >= 1);
  ember_ps_client_destroy(fast);
  ember_ps_client_destroy(slow);
  stop(&p);
}

typedef struct {
  ember_ps_client *c;
  int rc;
} pull_args;

static void *pull_whole(void *arg) {
  pull_args *a = arg;
  float buf[4];
  a->rc = ember_ps_client_pull(a->c, "w", NULL, 2, 2, buf);
  return NULL;
}

/* Over shared memory the pull waits in the reply ring, over TCP in poll():
 * abort ends both. */
TEST(abort_from_another_thread_ends_a_staleness_wait_at_once) {
  for (int shm = 0; shm < 2; shm++) {
    ps_cluster p;
    start(&p, 1, 2, 0, 0);
    ember_ps_client *c =
        worker_ex(&p, 0, 2, 0, 30000, shm ? EMBER_PS_SHM_ON : EMBER_PS_SHM_OFF, 0);
    CHECK_EQ_INT(ember_ps_client_transport(c, 0, NULL, NULL),
                 shm ? EMBER_PS_TRANSPORT_SHM : EMBER_PS_TRANSPORT_TCP);
    ember_ps_table_spec spec = dense("w", 2, 2, EMBER_PS_SGD, 0.1f);
    CHECK_OK(ember_ps_client_declare(c, &spec));
    CHECK_OK(ember_ps_client_clock(c)); /* worker 1 never comes: a pull waits */
    pull_args a = {.c = c, .rc = 1};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, pull_whole, &a) == 0);
    usleep(200 * 1000);
    int64_t t0 = ember_now_ms();
    ember_ps_client_abort(c);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(ember_now_ms() - t0 < 1000);
    CHECK_EQ_INT(a.rc, EMBER_EABORTED);
    CHECK_EQ_INT(ember_ps_client_clock(c), EMBER_ESTATE);
    ember_ps_client_destroy(c);
    stop(&p);
  }
}

TEST(a_shard_gone_mid_job_is_named_as_a_vanished_peer) {
  ps_cluster p;
  start(&p, 2, 1, EMBER_PS_ASYNC, 0);
  ember_ps_client *c = worker(&p, 0, 1, 0, 5000);
  ember_ps_table_spec spec = dense("w", 4, 2, EMBER_PS_SGD, 0.1f);
  CHECK_OK(ember_ps_client_declare(c, &spec));
  ember_ps_server_destroy(p.srv[1]); /* as a killed ps node's kernel closes its sockets */
  p.shards = 1;
  float buf[8];
  int rc = ember_ps_client_pull(c, "w", NULL, 4, 2, buf);
  CHECK(rc == EMBER_ECLOSED || rc == EMBER_EIO);
  CHECK(strstr(ember_last_error(), "ps shard 1 of 2") != NULL);
  CHECK(strstr(ember_last_error(), "failed, was killed or left)") != NULL);
  CHECK_EQ_INT(ember_ps_client_pull(c, "w", NULL, 4, 2, buf), EMBER_ESTATE);
  ember_ps_client_destroy(c);
  stop(&p);
}

typedef struct {
  ps_cluster *p;
  uint32_t worker;
  int rc;
} racer_args;

/* 300 rounds of: pull 8 rows (new ones among them), push 1.0 to each. */
static void *racer(void *arg) {
  racer_args *a = arg;
  ember_ps_client *c = worker(a->p, a->worker, 2, 0, 10000);
  ember_ps_table_spec spec = {.name = "e", .layout = EMBER_PS_SPARSE, .rows = 100000, .cols = 4,
                              .optimizer = {.kind = EMBER_PS_SGD, .learning_rate = 0.5f}};
  float rows[32], g[32];
  for (int i = 0; i < 32; i++) g[i] = 1.0f;
  a->rc = ember_ps_client_declare(c, &spec);
  for (int r = 0; r < 300 && a->rc == EMBER_OK; r++) {
    uint64_t ids[8];
    for (int i = 0; i < 8; i++) ids[i] = (uint64_t)((r * 8 + i) % 500) * 7; /* 500 rows */
    a->rc = ember_ps_client_pull(c, "e", ids, 8, 4, rows);
    if (a->rc == EMBER_OK) a->rc = ember_ps_client_push(c, "e", ids, 8, 4, g);
  }
  ember_ps_client_destroy(c);
  return NULL;
}

TEST(concurrent_pulls_and_pushes_lose_no_update) {
  ps_cluster p;
  start(&p, 1, 2, EMBER_PS_ASYNC, 0);
  racer_args a = {.p = &p, .worker = 0}, b = {.p = &p, .worker = 1};
  pthread_t ta, tb;
  CHECK(pthread_create(&ta, NULL, racer, &a) == 0);
  CHECK(pthread_create(&tb, NULL, racer, &b) == 0);
  CHECK(pthread_join(ta, NULL) == 0 && pthread_join(tb, NULL) == 0);
  CHECK_OK(a.rc);
  CHECK_OK(b.rc);
  /* every row got 2 workers x 300 x 8 / 500 = 9.6 pushes on average: exactly
   * (r*8+i) % 500 over r, i; zeros init, so w = -0.5 x its pushes */
  ember_ps_client *c = worker(&p, 0, 2, 0, 10000);
  ember_ps_table_spec spec = {.name = "e", .layout = EMBER_PS_SPARSE, .rows = 100000, .cols = 4,
                              .optimizer = {.kind = EMBER_PS_SGD, .learning_rate = 0.5f}};
  CHECK_OK(ember_ps_client_declare(c, &spec));
  int pushes[500] = {0};
  for (int r = 0; r < 300; r++)
    for (int i = 0; i < 8; i++) pushes[(r * 8 + i) % 500] += 2;
  for (int k = 0; k < 500; k++) {
    uint64_t id = (uint64_t)k * 7;
    float row[4];
    CHECK_OK(ember_ps_client_pull(c, "e", &id, 1, 4, row));
    for (int j = 0; j < 4; j++) CHECK(near(row[j], -0.5f * (float)pushes[k]));
  }
  ember_ps_stats st;
  ember_ps_server_stats(p.srv[0], &st);
  CHECK_EQ_INT(st.rows_held, 500);
  CHECK_EQ_INT(st.rows_pushed, 2 * 300 * 8);
  ember_ps_client_destroy(c);
  stop(&p);
}

TEST(asynchronous_mode_never_waits) {
  ps_cluster p;
  start(&p, 1, 2, EMBER_PS_ASYNC, 0);
  ember_ps_client *fast = worker(&p, 0, 2, 0, 1000);
  ember_ps_table_spec spec = dense("w", 2, 2, EMBER_PS_SGD, 0.1f);
  CHECK_OK(ember_ps_client_declare(fast, &spec));
  float buf[4];
  for (int i = 0; i < 50; i++) {
    CHECK_OK(ember_ps_client_clock(fast));
    CHECK_OK(ember_ps_client_pull(fast, "w", NULL, 2, 2, buf));
  }
  ember_ps_client_destroy(fast);
  stop(&p);
}

/* ------------------------------------------------------------ checkpoints */

TEST(checkpoint_restores_values_and_optimizer_state_and_refuses_corruption) {
  char dir[] = "/tmp/ember-ps-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  ps_cluster p;
  start(&p, 2, 1, EMBER_PS_ASYNC, 0);
  ember_ps_client *c = worker(&p, 0, 1, 0, 10000);
  ember_ps_table_spec d = dense("w", 5, 3, EMBER_PS_ADAM, 0.01f);
  ember_ps_table_spec s = {.name = "emb", .layout = EMBER_PS_SPARSE, .rows = 1u << 30, .cols = 4,
                           .optimizer = {.kind = EMBER_PS_ADAM, .learning_rate = 0.01f},
                           .init = EMBER_PS_INIT_UNIFORM, .init_scale = 0.1f, .seed = 9};
  CHECK_OK(ember_ps_client_declare(c, &d));
  CHECK_OK(ember_ps_client_declare(c, &s));
  float g[15], gs[8], w_before[15], e_before[8], w_after[15], e_after[8];
  uint64_t ids[2] = {12345, 678};
  for (int i = 0; i < 15; i++) g[i] = 0.1f * (float)(i + 1);
  for (int i = 0; i < 8; i++) gs[i] = -0.2f;
  CHECK_OK(ember_ps_client_push(c, "w", NULL, 5, 3, g));
  CHECK_OK(ember_ps_client_push(c, "emb", ids, 2, 4, gs));
  CHECK_OK(ember_ps_client_save(c, dir));
  /* one more step from the checkpointed state, on the live servers */
  CHECK_OK(ember_ps_client_push(c, "w", NULL, 5, 3, g));
  CHECK_OK(ember_ps_client_push(c, "emb", ids, 2, 4, gs));
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 5, 3, w_before));
  CHECK_OK(ember_ps_client_pull(c, "emb", ids, 2, 4, e_before));
  ember_ps_client_destroy(c);
  stop(&p);
  /* new servers from the checkpoint, the same step again: the same values
   * (Adam's moments and step counts came back too) */
  start(&p, 2, 1, EMBER_PS_ASYNC, 0);
  for (int k = 0; k < 2; k++) CHECK_OK(ember_ps_server_restore(p.srv[k], dir));
  c = worker(&p, 0, 1, 0, 10000);
  CHECK_OK(ember_ps_client_declare(c, &d));
  CHECK_OK(ember_ps_client_declare(c, &s));
  CHECK_OK(ember_ps_client_push(c, "w", NULL, 5, 3, g));
  CHECK_OK(ember_ps_client_push(c, "emb", ids, 2, 4, gs));
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 5, 3, w_after));
  CHECK_OK(ember_ps_client_pull(c, "emb", ids, 2, 4, e_after));
  CHECK(memcmp(w_before, w_after, sizeof w_after) == 0);
  CHECK(memcmp(e_before, e_after, sizeof e_after) == 0);
  ember_ps_client_destroy(c);
  /* restoring twice, or into a server that has tables, is refused */
  CHECK_EQ_INT(ember_ps_server_restore(p.srv[0], dir), EMBER_ESTATE);
  stop(&p);
  /* another shard count */
  start(&p, 3, 1, EMBER_PS_ASYNC, 0);
  CHECK_EQ_INT(ember_ps_server_restore(p.srv[0], dir), EMBER_ENOTFOUND);
  stop(&p);
  /* a flipped byte */
  char path[512];
  snprintf(path, sizeof path, "%s/ps-1-of-2.ckpt", dir);
  FILE *f = fopen(path, "r+b");
  CHECK(f != NULL);
  CHECK(fseek(f, 40, SEEK_SET) == 0);
  int ch = fgetc(f);
  CHECK(fseek(f, 40, SEEK_SET) == 0);
  fputc(ch ^ 0x10, f);
  fclose(f);
  start(&p, 2, 1, EMBER_PS_ASYNC, 0);
  CHECK_EQ_INT(ember_ps_server_restore(p.srv[1], dir), EMBER_ECORRUPT);
  CHECK(strstr(ember_last_error(), "ps-1-of-2.ckpt") != NULL);
  CHECK_OK(ember_ps_server_restore(p.srv[0], dir));
  stop(&p);
  snprintf(path, sizeof path, "rm -rf %s", dir);
  CHECK(system(path) == 0);
}

/* ------------------------------------------------------------ encryption */

TEST(encrypted_shards_serve_encrypting_workers_only) {
  ps_cluster p;
  start(&p, 2, 1, EMBER_PS_ASYNC, 1);
  ember_ps_client *c = worker(&p, 0, 1, 1, 10000);
  ember_ps_table_spec spec = dense("w", 6, 5, EMBER_PS_SGD, 1.0f);
  CHECK_OK(ember_ps_client_declare(c, &spec));
  float w0[30], g[30], w1[30];
  for (int i = 0; i < 30; i++) g[i] = 1.0f;
  CHECK(all_links(c, 2, EMBER_PS_TRANSPORT_TCP)); /* encrypted: never shared memory */
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 6, 5, w0));
  CHECK_OK(ember_ps_client_push(c, "w", NULL, 6, 5, g));
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 6, 5, w1));
  for (int i = 0; i < 30; i++) CHECK(near(w1[i], w0[i] - 1.0f));
  ember_ps_client *clear = NULL;
  ember_ps_client_config cfg = {.hosts = p.hosts, .ports = p.ports, .num_shards = 2,
                                .secret = SECRET, .secret_len = sizeof SECRET, .worker = 0,
                                .num_workers = 1, .timeout_ms = 3000};
  CHECK(ember_ps_client_create(&clear, &cfg) != EMBER_OK);
  /* shm required with encryption: refused before connecting, naming both */
  cfg = client_cfg(&p, 0, 1, 1, 3000, EMBER_PS_SHM_ON, 0);
  CHECK_EQ_INT(ember_ps_client_create(&clear, &cfg), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "encrypt") && strstr(ember_last_error(), "shm"));
  ember_ps_client_destroy(c);
  stop(&p);
}

/* ------------------------------------------------------------ shared memory */

static void fill(float *v, size_t n, float scale) {
  for (size_t i = 0; i < n; i++) v[i] = scale * (float)(1 + (i * 2654435761u) % 1000) / 1000.0f;
}

/* A shm worker (small rings: every large message spans many records) and a
 * TCP worker on the same shards see the same tables and move the same
 * payload bytes. */
TEST(shm_and_tcp_workers_share_tables_and_count_the_same_bytes) {
  enum { ROWS = 3000, COLS = 100, N = ROWS * COLS }; /* 600 KB a shard each way */
  ps_cluster p;
  start(&p, 2, 2, EMBER_PS_ASYNC, 0);
  ember_ps_client *a = worker_ex(&p, 0, 2, 0, 10000, EMBER_PS_SHM_AUTO,
                                 EMBER_SHM_RING_MIN_BYTES);
  ember_ps_client *b = worker_ex(&p, 1, 2, 0, 10000, EMBER_PS_SHM_OFF, 0);
  CHECK(all_links(a, 2, EMBER_PS_TRANSPORT_SHM));
  CHECK(all_links(b, 2, EMBER_PS_TRANSPORT_TCP));
  ember_ps_stats st;
  for (int k = 0; k < 2; k++) {
    ember_ps_server_stats(p.srv[k], &st);
    CHECK_EQ_INT(st.workers_connected, 2);
    CHECK_EQ_INT(st.shm_connections, 1);
  }
  ember_ps_table_spec d = dense("w", ROWS, COLS, EMBER_PS_SGD, 0.5f);
  ember_ps_table_spec e = {.name = "e", .layout = EMBER_PS_SPARSE, .rows = 1u << 30, .cols = 16,
                           .optimizer = {.kind = EMBER_PS_ADAGRAD, .learning_rate = 0.1f,
                                         .initial_accumulator = 0.1f},
                           .init = EMBER_PS_INIT_NORMAL, .init_scale = 0.01f, .seed = 5};
  CHECK_OK(ember_ps_client_declare(a, &d));
  CHECK_OK(ember_ps_client_declare(b, &d));
  CHECK_OK(ember_ps_client_declare(a, &e));
  CHECK_OK(ember_ps_client_declare(b, &e));
  float *wa = malloc(N * sizeof *wa), *wb = malloc(N * sizeof *wb), *g = malloc(N * sizeof *g);
  CHECK(wa && wb && g);
  fill(g, N, 1.0f);
  CHECK_OK(ember_ps_client_pull(a, "w", NULL, ROWS, COLS, wa));
  CHECK_OK(ember_ps_client_pull(b, "w", NULL, ROWS, COLS, wb));
  CHECK(memcmp(wa, wb, N * sizeof *wa) == 0);
  CHECK_OK(ember_ps_client_push(a, "w", NULL, ROWS, COLS, g)); /* over the rings */
  CHECK_OK(ember_ps_client_pull(b, "w", NULL, ROWS, COLS, wb)); /* seen over TCP */
  for (size_t i = 0; i < N; i++) CHECK(near(wb[i], wa[i] - 0.5f * g[i]));
  CHECK_OK(ember_ps_client_push(b, "w", NULL, ROWS, COLS, g));
  CHECK_OK(ember_ps_client_pull(a, "w", NULL, ROWS, COLS, wa));
  for (size_t i = 0; i < N; i++) CHECK(near(wa[i], wb[i] - 0.5f * g[i]));
  /* named rows, sparse and dense: the same rows and the same bytes */
  uint64_t ids[64], sa0, ra0, sa1, ra1, sb0, rb0, sb1, rb1;
  float ea[64 * 16], eb[64 * 16];
  for (int i = 0; i < 64; i++) ids[i] = (uint64_t)i * 15485863ull % (1u << 30);
  ember_ps_client_bytes(a, &sa0, &ra0);
  ember_ps_client_bytes(b, &sb0, &rb0);
  CHECK_OK(ember_ps_client_pull(a, "e", ids, 64, 16, ea));
  CHECK_OK(ember_ps_client_pull(b, "e", ids, 64, 16, eb));
  ember_ps_client_bytes(a, &sa1, &ra1);
  ember_ps_client_bytes(b, &sb1, &rb1);
  CHECK(memcmp(ea, eb, sizeof ea) == 0);
  CHECK_EQ_INT(sa1 - sa0, sb1 - sb0);
  CHECK_EQ_INT(ra1 - ra0, rb1 - rb0);
  CHECK(ra1 - ra0 >= 64 * 16 * 4 && ra1 - ra0 < 64 * 16 * 4 + 256);
  CHECK_OK(ember_ps_client_push(a, "e", ids, 64, 16, g));
  CHECK_OK(ember_ps_client_pull(b, "e", ids, 64, 16, eb));
  for (int i = 0; i < 64 * 16; i++) CHECK(eb[i] != ea[i]);
  uint64_t rows[3] = {ROWS - 1, 0, 1500};
  float ra[3 * COLS], rb[3 * COLS];
  CHECK_OK(ember_ps_client_pull(a, "w", rows, 3, COLS, ra));
  CHECK_OK(ember_ps_client_pull(b, "w", rows, 3, COLS, rb));
  CHECK(memcmp(ra, rb, sizeof ra) == 0);
  /* the per-shard counters add up to the client's */
  uint64_t sent = 0, recv = 0, s_all, r_all;
  for (uint32_t k = 0; k < 2; k++) {
    uint64_t sk, rk;
    CHECK_EQ_INT(ember_ps_client_transport(a, k, &sk, &rk), EMBER_PS_TRANSPORT_SHM);
    sent += sk;
    recv += rk;
    CHECK(sk > N / 2 * 4 && rk > N / 2 * 4); /* each shard's half of the table, twice */
  }
  ember_ps_client_bytes(a, &s_all, &r_all);
  CHECK_EQ_INT(sent, s_all);
  CHECK_EQ_INT(recv, r_all);
  CHECK_EQ_INT(ember_ps_client_transport(a, 2, NULL, NULL), EMBER_EINVAL);
  /* a refused request leaves an shm link usable, as it does a TCP one */
  CHECK_EQ_INT(ember_ps_client_pull(a, "nope", NULL, 4, 8, wa), EMBER_ENOTFOUND);
  CHECK_OK(ember_ps_client_pull(a, "w", rows, 3, COLS, ra));
  free(wa);
  free(wb);
  free(g);
  ember_ps_client_destroy(a);
  ember_ps_client_destroy(b);
  int64_t until = ember_now_ms() + 5000;
  do {
    usleep(10 * 1000);
    ember_ps_server_stats(p.srv[0], &st);
  } while ((st.workers_connected != 0 || st.shm_connections != 0) && ember_now_ms() < until);
  CHECK_EQ_INT(st.workers_connected, 0);
  CHECK_EQ_INT(st.shm_connections, 0);
  stop(&p);
}

TEST(a_shard_that_declines_shm_keeps_auto_workers_on_tcp_and_fails_required_ones) {
  ps_cluster p;
  start_ex(&p, 2, 1, EMBER_PS_ASYNC, 0, 1);
  ember_ps_client *c = worker(&p, 0, 1, 0, 5000);
  CHECK(all_links(c, 2, EMBER_PS_TRANSPORT_TCP));
  ember_ps_table_spec spec = dense("w", 4, 2, EMBER_PS_SGD, 0.1f);
  float buf[8];
  CHECK_OK(ember_ps_client_declare(c, &spec));
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, 4, 2, buf));
  ember_ps_stats st;
  ember_ps_server_stats(p.srv[0], &st);
  CHECK_EQ_INT(st.requests_refused, 0); /* a decline is not a refused request */
  CHECK_EQ_INT(st.shm_connections, 0);
  ember_ps_client *req = NULL;
  ember_ps_client_config cfg = client_cfg(&p, 0, 1, 0, 5000, EMBER_PS_SHM_ON, 0);
  CHECK_EQ_INT(ember_ps_client_create(&req, &cfg), EMBER_ENOTFOUND);
  CHECK(strstr(ember_last_error(), "ps shard 0 of 2") &&
        strstr(ember_last_error(), "declined") && strstr(ember_last_error(), "disabled"));
  cfg.shm = 7;
  CHECK_EQ_INT(ember_ps_client_create(&req, &cfg), EMBER_EINVAL);
  cfg.shm = EMBER_PS_SHM_AUTO;
  cfg.shm_bytes = 1000;
  CHECK_EQ_INT(ember_ps_client_create(&req, &cfg), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "shm_bytes 1000") != NULL);
  ember_ps_client_destroy(c);
  stop(&p);
}

/* A worker process SIGKILLed while it streams 2 MB pulls and pushes through
 * small rings: its connection's thread ends (the rings report the process
 * gone), the other worker goes on being served. */
TEST(a_worker_killed_mid_exchange_ends_only_its_connection) {
  enum { ROWS = 5000, COLS = 100, N = ROWS * COLS };
  ps_cluster p;
  int ready[2];
  start(&p, 1, 2, EMBER_PS_ASYNC, 0);
  ember_ps_table_spec spec = dense("w", ROWS, COLS, EMBER_PS_SGD, 0.01f);
  CHECK(pipe(ready) == 0);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) { /* the doomed worker: round after round until killed */
    alarm(30);
    close(ready[0]);
    float *w = malloc(N * sizeof *w);
    ember_ps_client *c = worker_ex(&p, 1, 2, 0, 20000, EMBER_PS_SHM_ON,
                                   EMBER_SHM_RING_MIN_BYTES);
    CHECK(w != NULL);
    CHECK_OK(ember_ps_client_declare(c, &spec));
    for (int round = 0;; round++) {
      CHECK_OK(ember_ps_client_pull(c, "w", NULL, ROWS, COLS, w));
      CHECK_OK(ember_ps_client_push(c, "w", NULL, ROWS, COLS, w));
      if (round == 2) CHECK(write(ready[1], "r", 1) == 1);
    }
  }
  close(ready[1]);
  char byte;
  CHECK(read(ready[0], &byte, 1) == 1);
  close(ready[0]);
  ember_ps_stats st;
  ember_ps_server_stats(p.srv[0], &st);
  CHECK_EQ_INT(st.shm_connections, 1);
  usleep(7 * 1000); /* somewhere inside a pull or a push */
  CHECK(kill(pid, SIGKILL) == 0);
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  int64_t t0 = ember_now_ms();
  do {
    usleep(10 * 1000);
    ember_ps_server_stats(p.srv[0], &st);
  } while (st.workers_connected != 0 && ember_now_ms() - t0 < 5000);
  CHECK_EQ_INT(st.workers_connected, 0);
  CHECK_EQ_INT(st.shm_connections, 0);
  CHECK(ember_now_ms() - t0 < 2000); /* the liveness check's slice, not a timeout */
  /* the shard serves the next worker as before */
  ember_ps_client *c = worker(&p, 0, 2, 0, 10000);
  CHECK(all_links(c, 1, EMBER_PS_TRANSPORT_SHM));
  float *w = malloc(N * sizeof *w), *w2 = malloc(N * sizeof *w2);
  CHECK(w && w2);
  CHECK_OK(ember_ps_client_declare(c, &spec));
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, ROWS, COLS, w));
  fill(w2, N, 1.0f);
  CHECK_OK(ember_ps_client_push(c, "w", NULL, ROWS, COLS, w2));
  for (size_t i = 0; i < N; i++) w[i] -= 0.01f * w2[i];
  CHECK_OK(ember_ps_client_pull(c, "w", NULL, ROWS, COLS, w2));
  for (size_t i = 0; i < N; i++) CHECK(near(w2[i], w[i]));
  free(w);
  free(w2);
  ember_ps_client_destroy(c);
  stop(&p);
}

/* A hand-made worker that moves to shared memory (the PS_SHM payload from
 * ps_link.c's encoder): *req and *rep are its ends of the rings. */
static int raw_shm_peer(uint16_t port, ember_shm_ring **req, ember_shm_ring **rep) {
  uint8_t offer[EMBER__PS_SHM_LEN];
  char why[512];
  int fd = raw_peer(port, 0, 1);
  CHECK(fd >= 0);
  CHECK_OK(ember__ps_shm_offer(EMBER_SHM_RING_MIN_BYTES, req, rep, offer));
  CHECK_EQ_INT(raw_request(fd, EMBER_MSG_PS_SHM, offer, sizeof offer, why, sizeof why), 0);
  return fd;
}

/* One request and its reply through the rings: the reply's status. */
static int32_t ring_request(ember_shm_ring *req, ember_shm_ring *rep, uint16_t type,
                            const void *p, uint32_t len) {
  uint8_t hdr[EMBER_WIRE_HEADER_LEN], reply[4096];
  ember_shm_msg m;
  struct iovec iov[2] = {{hdr, sizeof hdr}, {(void *)(uintptr_t)p, len}};
  ember_wire_encode_header(hdr, type, len);
  CHECK_OK(ember_shm_ring_sendv(req, iov, 2, 5000));
  CHECK_OK(ember_shm_ring_next(rep, &m, sizeof reply, 5000));
  CHECK(m.kind == EMBER_SHM_MSG_DATA && m.len >= EMBER_WIRE_HEADER_LEN + 8);
  CHECK_OK(ember_shm_ring_read(rep, reply, sizeof reply, 5000));
  CHECK(ember_wire_get_u32(reply + 8) == m.len - EMBER_WIRE_HEADER_LEN);
  return (int32_t)ember_wire_get_u32(reply + EMBER_WIRE_HEADER_LEN);
}

TEST(a_corrupt_ring_record_ends_only_that_connection_naming_shard_and_worker) {
  ps_cluster p;
  start(&p, 1, 1, EMBER_PS_ASYNC, 0);
  ember_ps_client *good = worker(&p, 0, 1, 0, 10000);
  ember_ps_table_spec spec = dense("w", 4, 8, EMBER_PS_SGD, 0.1f);
  CHECK_OK(ember_ps_client_declare(good, &spec));
  float buf[32];
  char why[512];
  /* an offer of rings that are not there: declined, the connection stays on TCP */
  int fd = raw_peer(p.ports[0], 0, 1);
  CHECK(fd >= 0);
  uint8_t offer[EMBER__PS_SHM_LEN] = {0};
  ember_wire_put_u32(offer + 16, 1);       /* pid 1 */
  ember_wire_put_u32(offer + 20, 3);       /* fd 3 */
  ember_wire_put_u64(offer + 24, 69632);   /* a plausible size */
  memcpy(offer + 64, offer + 16, 48);
  CHECK(raw_request(fd, EMBER_MSG_PS_SHM, offer, sizeof offer, why, sizeof why) != 0);
  CHECK(strstr(why, "cannot attach worker 0's rings") != NULL);
  CHECK_EQ_INT(raw_request(fd, EMBER_MSG_PS_SHM, offer, 7, why, sizeof why), EMBER_EPROTO);
  CHECK(strstr(why, "twice") != NULL);
  uint8_t clock[8] = {0};
  CHECK_OK(raw_request(fd, EMBER_MSG_PS_CLOCK, clock, 8, why, sizeof why));
  ember_net_close(fd);
  /* rings whose records break the format, two ways */
  for (int how = 0; how < 2; how++) {
    ember_shm_ring *req = NULL, *rep = NULL;
    fd = raw_shm_peer(p.ports[0], &req, &rep);
    CHECK_OK(ring_request(req, rep, EMBER_MSG_PS_CLOCK, clock, 8)); /* the rings work */
    size_t len = 0;
    uint8_t *raw = ember__shm_ring_raw(req, &len);
    size_t cap = ember_shm_ring_capacity(req), hdr = len - cap;
    uint64_t *head = (uint64_t *)(void *)(raw + 64); /* the shared head word */
    uint8_t *rec = raw + hdr + *head % cap;
    memset(rec, 0, 32);
    if (how == 0) {
      rec[0] = 4;
      rec[4] = 9; /* an unknown record type */
    } else {
      ember_wire_put_u32(rec, 1u << 20); /* more bytes than the ring holds */
      rec[4] = 1;
    }
    *head += 32;
    CHECK(logged("ps shard 0: dropped worker 0 (127.0.0.1:", how == 0 ? "unknown type 9"
                                                                      : "claims 1048576 bytes",
                 NULL, 3000));
    ember_shm_msg m;
    CHECK_EQ_INT(ember_shm_ring_next(rep, &m, 0, 3000), EMBER_ECLOSED); /* told at once */
    CHECK_OK(ember_ps_client_pull(good, "w", NULL, 4, 8, buf));
    ember_shm_ring_destroy(req);
    ember_shm_ring_destroy(rep);
    ember_net_close(fd);
  }
  ember_ps_stats st;
  ember_ps_server_stats(p.srv[0], &st);
  CHECK_EQ_INT(st.workers_connected, 1);
  CHECK_EQ_INT(st.shm_connections, 1);
  ember_ps_client_destroy(good);
  stop(&p);
}

RUN_TESTS(T(dense_table_split_over_shards_pulls_whole_and_applies_sgd),
          T(two_workers_share_updates_and_momentum_state_lives_on_the_server),
          T(assign_sets_values_and_the_optimizer_goes_on_from_them),
          T(sparse_rows_materialise_when_touched_and_bytes_follow_the_rows),
          T(wrong_shapes_unknown_tables_and_conflicting_specs_are_named),
          T(hostile_worker_gets_named_refusals_and_others_keep_being_served),
          T(bounded_staleness_holds_the_leader_and_names_the_straggler),
          T(abort_from_another_thread_ends_a_staleness_wait_at_once),
          T(a_shard_gone_mid_job_is_named_as_a_vanished_peer),
          T(concurrent_pulls_and_pushes_lose_no_update),
          T(asynchronous_mode_never_waits),
          T(checkpoint_restores_values_and_optimizer_state_and_refuses_corruption),
          T(encrypted_shards_serve_encrypting_workers_only),
          T(shm_and_tcp_workers_share_tables_and_count_the_same_bytes),
          T(a_shard_that_declines_shm_keeps_auto_workers_on_tcp_and_fails_required_ones),
          T(a_worker_killed_mid_exchange_ends_only_its_connection),
          T(a_corrupt_ring_record_ends_only_that_connection_naming_shard_and_worker))
