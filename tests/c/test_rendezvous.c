/* test_rendezvous.c - reservation server and client on loopback, nodes as
 * pthreads (or forked children where EXIT_ON_LOSS must kill something).
 * Timeouts are small (hundreds of ms) so the file runs in seconds. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>

#include "ember/auth.h"
#include "ember/net.h"
#include "ember/rendezvous.h"
#include "harness.h"
#include "strangers.h"

static const uint8_t SECRET[32] = "rendezvous-test-secret-32-bytes!";

static ember_rdv_server *server(uint32_t n, uint32_t ps, int chief, int eval,
                                uint32_t hb_ms, uint32_t hs_ms) {
  ember_rdv_server_config cfg = {.secret = SECRET,
                                 .secret_len = sizeof SECRET,
                                 .bind_host = "127.0.0.1",
                                 .port = 0,
                                 .num_nodes = n,
                                 .num_ps = ps,
                                 .has_chief = chief,
                                 .has_evaluator = eval,
                                 .heartbeat_timeout_ms = hb_ms,
                                 .handshake_timeout_ms = hs_ms};
  ember_rdv_server *s = NULL;
  CHECK_OK(ember_rdv_server_create(&s, &cfg));
  CHECK(ember_rdv_server_port(s) != 0);
  return s;
}

typedef struct {
  uint16_t port;
  uint32_t index;
  const uint8_t *secret;
  int start;            /* start the heartbeat thread after SPEC */
  uint32_t interval_ms; /* heartbeat interval */
  uint32_t silence_ms; /* 0: the client's default */
  uint32_t flags;
  /* results */
  int rc;
  char msg[512];
  ember_rdv_client *c;
  ember_rdv_node *nodes;
  uint32_t count, self_pos;
} node_arg;

static void *node_main(void *arg) {
  node_arg *a = arg;
  ember_rdv_node me;
  memset(&me, 0, sizeof me);
  me.index = a->index;
  /* host left empty: the server fills in the address we came from */
  snprintf(me.executor_id, sizeof me.executor_id, "exec-%u", (unsigned)a->index);
  me.pid = (uint32_t)getpid();
  me.num_ports = 2;
  me.ports[0] = (uint16_t)(20000 + a->index);
  me.ports[1] = (uint16_t)(30000 + a->index);
  a->rc = ember_rdv_client_connect(&a->c, "127.0.0.1", a->port,
                                   a->secret ? a->secret : SECRET, 32, 5000);
  if (a->rc == EMBER_OK) a->rc = ember_rdv_client_register(a->c, &me, 5000);
  if (a->rc == EMBER_OK)
    a->rc = ember_rdv_client_wait_spec(a->c, &a->nodes, &a->count, &a->self_pos, 10000);
  if (a->rc == EMBER_OK && a->start)
    a->rc = ember_rdv_client_start(a->c, a->interval_ms, a->silence_ms, a->flags);
  snprintf(a->msg, sizeof a->msg, "%s", ember_last_error());
  return NULL;
}

static void node_free(node_arg *a) {
  ember_rdv_client_destroy(a->c);
  a->c = NULL;
  free(a->nodes);
  a->nodes = NULL;
}

/* Starts a node thread; with interval_ms > 0 it starts heartbeats after SPEC. */
static void spawn_hb(pthread_t *t, node_arg *a, uint16_t port, uint32_t index,
                     uint32_t interval_ms) {
  memset(a, 0, sizeof *a);
  a->port = port;
  a->index = index;
  a->start = interval_ms > 0;
  a->interval_ms = interval_ms;
  CHECK(pthread_create(t, NULL, node_main, a) == 0);
}

static void spawn(pthread_t *t, node_arg *a, uint16_t port, uint32_t index) {
  spawn_hb(t, a, port, index, 0);
}

/* Waits for the next event of `kind` (skipping others); fails on timeout. */
static void wait_event(ember_rdv_server *s, int kind, int32_t node, int64_t timeout_ms,
                       ember_rdv_event *out) {
  int64_t deadline = ember_deadline_after(timeout_ms);
  for (;;) {
    ember_rdv_event ev;
    int64_t left = deadline - ember_now_ms();
    if (left < 0) left = 0;
    int rc = ember_rdv_server_next_event(s, &ev, left);
    if (rc != EMBER_OK) {
      fprintf(stderr, "no event of kind %d for node %d: %s\n", kind, (int)node,
              ember_last_error());
      exit(1);
    }
    if (ev.kind == kind && (node == -2 || ev.node == node)) {
      if (out) *out = ev;
      else ember_rdv_event_clear(&ev);
      return;
    }
    ember_rdv_event_clear(&ev);
  }
}

/* Runs n nodes to READY and checks the common invariants. */
static void run_nodes(uint32_t n, uint32_t ps, int chief, int eval, const char **roles,
                      const uint32_t *tasks) {
  ember_rdv_server *s = server(n, ps, chief, eval, 5000, 5000);
  pthread_t *t = calloc(n, sizeof *t);
  node_arg *a = calloc(n, sizeof *a);
  CHECK(t && a);
  for (uint32_t i = 0; i < n; i++) spawn(&t[i], &a[i], ember_rdv_server_port(s), i);
  CHECK_OK(ember_rdv_server_wait_ready(s, 10000));
  for (uint32_t i = 0; i < n; i++) pthread_join(t[i], NULL);
  for (uint32_t i = 0; i < n; i++) {
    if (a[i].rc != EMBER_OK) fprintf(stderr, "node %u: %s\n", (unsigned)i, a[i].msg);
    CHECK_OK(a[i].rc);
    CHECK_EQ_INT(a[i].count, n);
    CHECK_EQ_INT(a[i].self_pos, i);
    for (uint32_t j = 0; j < n; j++) {
      const ember_rdv_node *r = &a[i].nodes[j];
      CHECK_EQ_INT(r->index, j);
      CHECK(strcmp(r->host, "127.0.0.1") == 0);
      char ex[32];
      snprintf(ex, sizeof ex, "exec-%u", (unsigned)j);
      CHECK(strcmp(r->executor_id, ex) == 0);
      CHECK_EQ_INT(r->num_ports, 2);
      CHECK_EQ_INT(r->ports[0], 20000 + j);
      CHECK_EQ_INT(r->ports[1], 30000 + j);
      if (roles) {
        CHECK(strcmp(r->role, roles[j]) == 0);
        CHECK_EQ_INT(r->task_index, tasks[j]);
      }
      /* Every node sees the same table. */
      CHECK(memcmp(r, &a[0].nodes[j], sizeof *r) == 0);
    }
  }
  /* Events: n REGISTERED, then READY. */
  uint32_t reg = 0;
  for (;;) {
    ember_rdv_event ev;
    CHECK_OK(ember_rdv_server_next_event(s, &ev, 2000));
    int kind = ev.kind;
    if (kind == EMBER_RDV_EV_REGISTERED) reg++;
    ember_rdv_event_clear(&ev);
    if (kind == EMBER_RDV_EV_READY) break;
    CHECK_EQ_INT(kind, EMBER_RDV_EV_REGISTERED);
  }
  CHECK_EQ_INT(reg, n);
  ember_rdv_node *rows;
  uint32_t count;
  CHECK_OK(ember_rdv_server_nodes(s, &rows, &count));
  CHECK_EQ_INT(count, n);
  for (uint32_t j = 0; j < n; j++) CHECK(memcmp(&rows[j], &a[0].nodes[j], sizeof rows[j]) == 0);
  free(rows);
  for (uint32_t i = 0; i < n; i++) node_free(&a[i]);
  ember_rdv_server_destroy(s);
  free(t);
  free(a);
}

TEST(two_nodes) {
  const char *roles[] = {"worker", "worker"};
  const uint32_t tasks[] = {0, 1};
  run_nodes(2, 0, 0, 0, roles, tasks);
}

TEST(four_nodes_roles) {
  const char *roles[] = {"ps", "chief", "evaluator", "worker"};
  const uint32_t tasks[] = {0, 0, 0, 0};
  run_nodes(4, 1, 1, 1, roles, tasks);
  const char *roles2[] = {"ps", "ps", "chief", "worker"};
  const uint32_t tasks2[] = {0, 1, 0, 0};
  run_nodes(4, 2, 1, 0, roles2, tasks2);
}

TEST(sixty_four_nodes) { run_nodes(64, 0, 1, 0, NULL, NULL); }

TEST(bad_config) {
  ember_rdv_server_config cfg = {.secret = SECRET, .secret_len = 8, .num_nodes = 2};
  ember_rdv_server *s = NULL;
  CHECK_EQ_INT(ember_rdv_server_create(&s, &cfg), EMBER_EINVAL);
  cfg.secret_len = 32;
  cfg.num_nodes = 0;
  CHECK_EQ_INT(ember_rdv_server_create(&s, &cfg), EMBER_EINVAL);
  cfg.num_nodes = 2;
  cfg.num_ps = 2;
  cfg.has_chief = 1;
  CHECK_EQ_INT(ember_rdv_server_create(&s, &cfg), EMBER_EINVAL);
  CHECK(s == NULL);
  ember_rdv_server_destroy(NULL);
  ember_rdv_client_destroy(NULL);
}

TEST(reservation_timeout_names_missing_node) {
  ember_rdv_server *s = server(4, 0, 0, 0, 5000, 5000);
  pthread_t t[3];
  node_arg a[3];
  uint32_t idx[3] = {0, 1, 3};
  for (int i = 0; i < 3; i++) spawn(&t[i], &a[i], ember_rdv_server_port(s), idx[i]);
  for (int i = 0; i < 3; i++) wait_event(s, EMBER_RDV_EV_REGISTERED, -2, 3000, NULL);
  CHECK_EQ_INT(ember_rdv_server_wait_ready(s, 300), EMBER_ETIMEDOUT);
  CHECK(strcmp(ember_last_error(), "reservation timed out after 300 ms: 3 of 4 nodes "
                                   "registered; missing node(s): 2") == 0);
  ember_rdv_node *rows;
  uint32_t count;
  CHECK_OK(ember_rdv_server_nodes(s, &rows, &count));
  CHECK_EQ_INT(count, 3);
  CHECK_EQ_INT(rows[2].index, 3);
  CHECK(rows[2].role[0] == '\0');
  free(rows);
  /* The server is destroyed under waiting clients: they see the loss. */
  ember_rdv_server_destroy(s);
  for (int i = 0; i < 3; i++) {
    pthread_join(t[i], NULL);
    CHECK(a[i].rc != EMBER_OK);
    node_free(&a[i]);
  }
}

TEST(wrong_secret_rejected_then_reservation_completes) {
  ember_rdv_server *s = server(2, 0, 0, 0, 5000, 5000);
  uint8_t wrong[32];
  memcpy(wrong, SECRET, 32);
  wrong[0] ^= 0x55;
  ember_rdv_client *c = NULL;
  CHECK_EQ_INT(ember_rdv_client_connect(&c, "127.0.0.1", ember_rdv_server_port(s), wrong,
                                        32, 2000),
               EMBER_EAUTH);
  CHECK(c == NULL);
  ember_rdv_event ev;
  wait_event(s, EMBER_RDV_EV_REJECTED, -1, 2000, &ev);
  CHECK(strstr(ev.text, "127.0.0.1:") != NULL);
  CHECK(strstr(ev.text, "bad MAC") != NULL);
  ember_rdv_event_clear(&ev);

  pthread_t t[2];
  node_arg a[2];
  for (uint32_t i = 0; i < 2; i++) spawn(&t[i], &a[i], ember_rdv_server_port(s), i);
  CHECK_OK(ember_rdv_server_wait_ready(s, 5000));
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    CHECK_OK(a[i].rc);
    node_free(&a[i]);
  }
  ember_rdv_server_destroy(s);
}

static int raw_connect(uint16_t port) {
  int fd;
  CHECK_OK(ember_net_connect("127.0.0.1", port, ember_deadline_after(2000), &fd));
  return fd;
}

TEST(hostile_peers_do_not_disturb_a_reservation) {
  /* Every rejection its own event, to check each reason (strangers are
   * normally reported rate-limited: rejections_are_reported_rate_limited). */
  setenv("EMBER_REJECT_LOG_INTERVAL_MS", "0", 1);
  ember_rdv_server *s = server(2, 0, 0, 0, 5000, 1000);
  uint16_t port = ember_rdv_server_port(s);

  /* 1: garbage bytes instead of AUTH. */
  int g = raw_connect(port);
  CHECK_OK(ember_net_send_all(g, "GET / HTTP/1.1\r\nHost: x\r\n\r\n", 27,
                              ember_deadline_after(1000)));
  /* 2: an AUTH header claiming a 1 GiB payload. */
  int big = raw_connect(port);
  uint8_t h[EMBER_WIRE_HEADER_LEN];
  ember_wire_encode_header(h, EMBER_MSG_AUTH, 1u << 30);
  CHECK_OK(ember_net_send_all(big, h, sizeof h, ember_deadline_after(1000)));
  /* 3: half an AUTH frame, then silence (must time out, not block). */
  int half = raw_connect(port);
  uint8_t auth[EMBER_WIRE_HEADER_LEN + 64] = {0};
  ember_wire_encode_header(auth, EMBER_MSG_AUTH, 64);
  CHECK_OK(ember_net_send_all(half, auth, 30, ember_deadline_after(1000)));
  /* 4: connects and says nothing. */
  int mute = raw_connect(port);
  /* 5: authenticates properly, then sends an oversized frame. */
  int authed = raw_connect(port);
  CHECK_OK(ember_auth_client(authed, SECRET, 32, ember_deadline_after(2000)));
  ember_wire_encode_header(h, EMBER_MSG_REGISTER, 100u << 20);
  CHECK_OK(ember_net_send_all(authed, h, sizeof h, ember_deadline_after(1000)));
  /* 6: authenticates, sends half a REGISTER. */
  int halfreg = raw_connect(port);
  CHECK_OK(ember_auth_client(halfreg, SECRET, 32, ember_deadline_after(2000)));
  ember_wire_encode_header(h, EMBER_MSG_REGISTER, 40);
  CHECK_OK(ember_net_send_all(halfreg, h, sizeof h, ember_deadline_after(1000)));

  /* Meanwhile the real nodes register at once, not after the timeouts. */
  int64_t t0 = ember_now_ms();
  pthread_t t[2];
  node_arg a[2];
  for (uint32_t i = 0; i < 2; i++) spawn(&t[i], &a[i], port, i);
  CHECK_OK(ember_rdv_server_wait_ready(s, 5000));
  CHECK(ember_now_ms() - t0 < 800);
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    CHECK_OK(a[i].rc);
  }

  /* Every hostile peer is rejected, the slow ones after the handshake
   * timeout; each REJECTED names the peer. */
  int rejected = 0, magic = 0, oversized = 0, timeouts = 0, toobig = 0;
  int64_t deadline = ember_deadline_after(4000);
  while (rejected < 6 && ember_now_ms() < deadline) {
    ember_rdv_event ev;
    if (ember_rdv_server_next_event(s, &ev, 200) != EMBER_OK) continue;
    if (ev.kind == EMBER_RDV_EV_REJECTED) {
      rejected++;
      CHECK(strstr(ev.text, "127.0.0.1:") != NULL);
      if (strstr(ev.text, "magic")) magic++;
      if (strstr(ev.text, "AUTH frame of 1073741824 bytes")) oversized++;
      if (strstr(ev.text, "handshake not completed within 1000 ms")) timeouts++;
      if (strstr(ev.text, "exceeds the limit")) toobig++;
    }
    ember_rdv_event_clear(&ev);
  }
  CHECK_EQ_INT(rejected, 6);
  CHECK_EQ_INT(magic, 1);
  CHECK_EQ_INT(oversized, 1);
  CHECK_EQ_INT(timeouts, 3);
  CHECK_EQ_INT(toobig, 1);

  /* The refused raw peers got a REFUSED frame or a close, never a hang. */
  ember_frame_header fh;
  uint8_t *p = NULL;
  int rc = ember_net_recv_frame(authed, 4096, &fh, &p, ember_deadline_after(1000));
  CHECK(rc == EMBER_OK && fh.type == EMBER_MSG_REFUSED);
  free(p);
  int fds[] = {g, big, half, mute, authed, halfreg};
  for (int i = 0; i < 6; i++) ember_net_close(fds[i]);
  for (int i = 0; i < 2; i++) node_free(&a[i]);
  ember_rdv_server_destroy(s);
}

/* ---------------------------------------------------------------- strangers */

static ember_rdv_server *server_pre(uint32_t n, uint32_t hs_ms, uint32_t pre_ms,
                                    uint32_t max_pending) {
  ember_rdv_server_config cfg = {.secret = SECRET, .secret_len = sizeof SECRET,
                                 .bind_host = "127.0.0.1", .num_nodes = n,
                                 .heartbeat_timeout_ms = 20000, .handshake_timeout_ms = hs_ms,
                                 .preauth_timeout_ms = pre_ms, .max_pending = max_pending};
  ember_rdv_server *s = NULL;
  CHECK_OK(ember_rdv_server_create(&s, &cfg));
  return s;
}

/* Thousands of strangers (idle, and slow ones that send AUTH a byte a second)
 * hold connections while the nodes register: with deadlines far longer than
 * the test, only the pending pool (256 here; the oldest is evicted for a new
 * one) and the concurrent handshake keep the server open to the real nodes. */
TEST(strangers_do_not_delay_registration) {
  int n = strangers_fit(1500, 400);
  ember_rdv_server *s = server_pre(2, 30000, 30000, 256);
  uint16_t port = ember_rdv_server_port(s);
  strangers st;
  CHECK(strangers_open_paced(&st, port, n, 20) == n + 20);
  strangers_start(&st);

  int64_t t0 = ember_now_ms();
  pthread_t t[2];
  node_arg a[2];
  for (uint32_t i = 0; i < 2; i++) spawn(&t[i], &a[i], port, i);
  CHECK_OK(ember_rdv_server_wait_ready(s, 10000));
  int64_t took = ember_now_ms() - t0;
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    if (a[i].rc != EMBER_OK) fprintf(stderr, "node %d: %s\n", i, a[i].msg);
    CHECK_OK(a[i].rc);
  }
  fprintf(stderr, "2 nodes registered in %lld ms beside %d strangers\n", (long long)took,
          n + 20);
  CHECK(took < 3000);
  /* The pool held at most 256 of them: the rest were evicted, oldest first. */
  int closed = 0;
  for (int i = 0; i < n; i++) closed += stranger_closed(st.idle[i]);
  for (int i = 0; i < 20; i++) closed += stranger_closed(st.slow[i]);
  fprintf(stderr, "%d of %d strangers evicted\n", closed, n + 20);
  CHECK(closed >= n + 20 - 256);
  CHECK(!stranger_closed(st.idle[n - 1])); /* the newest keeps its place */
  strangers_close(&st);
  for (int i = 0; i < 2; i++) node_free(&a[i]);
  ember_rdv_server_destroy(s);
}

/* A stranger gets the short pre-authentication deadline (here 300 ms from
 * the environment), not the handshake timeout an authenticated node has for
 * REGISTER (10 s). */
TEST(preauth_deadline_is_short_and_separate) {
  setenv("EMBER_PREAUTH_TIMEOUT_MS", "300", 1);
  ember_rdv_server *s = server_pre(2, 10000, 0, 0);
  uint16_t port = ember_rdv_server_port(s);
  int authed = raw_connect(port);
  CHECK_OK(ember_auth_client(authed, SECRET, 32, ember_deadline_after(2000)));
  int mute = raw_connect(port);
  int64_t t0 = ember_now_ms();
  while (!stranger_closed(mute)) {
    CHECK(ember_now_ms() - t0 < 3000);
    struct pollfd pfd = {mute, POLLIN, 0};
    (void)poll(&pfd, 1, 50);
  }
  int64_t took = ember_now_ms() - t0;
  CHECK(took >= 250 && took < 2000);
  CHECK(!stranger_closed(authed)); /* still within its REGISTER deadline */
  ember_rdv_event ev;
  wait_event(s, EMBER_RDV_EV_REJECTED, -1, 2000, &ev);
  CHECK(strstr(ev.text, "handshake not completed within 300 ms") != NULL);
  ember_rdv_event_clear(&ev);
  ember_net_close(mute);
  ember_net_close(authed);
  ember_rdv_server_destroy(s);
}

/* 400 strangers sending garbage are reported in a few REJECTED events (the
 * first at once, then one per interval, 1 s here), whose codes add up to 400. */
TEST(rejections_are_reported_rate_limited) {
  setenv("EMBER_REJECT_LOG_INTERVAL_MS", "1000", 1);
  ember_rdv_server *s = server(2, 0, 0, 0, 5000, 5000);
  uint16_t port = ember_rdv_server_port(s);
  enum { N = 400 };
  static int fds[N];
  for (int i = 0; i < N; i++) {
    fds[i] = raw_connect(port);
    CHECK_OK(ember_net_send_all(fds[i], "GET / HTTP/1.1\r\nHost: x\r\n\r\n", 27,
                                ember_deadline_after(1000)));
  }
  int events = 0;
  long long covered = 0;
  int64_t deadline = ember_deadline_after(4000);
  while (covered < N && ember_now_ms() < deadline) {
    ember_rdv_event ev;
    if (ember_rdv_server_next_event(s, &ev, 200) != EMBER_OK) continue;
    if (ev.kind == EMBER_RDV_EV_REJECTED) {
      events++;
      covered += ev.code;
      CHECK(strstr(ev.text, "rendezvous server on :") != NULL);
      CHECK(strstr(ev.text, "127.0.0.1:") != NULL);
      CHECK(strstr(ev.text, "magic") != NULL);
      if (ev.code > 1) CHECK(strstr(ev.text, "unauthenticated connections in the last") != NULL);
    }
    ember_rdv_event_clear(&ev);
  }
  fprintf(stderr, "%d REJECTED events covered %lld rejections\n", events, covered);
  CHECK_EQ_INT(covered, N);
  CHECK(events <= 6);
  for (int i = 0; i < N; i++) ember_net_close(fds[i]);
  ember_rdv_server_destroy(s);
}

TEST(duplicate_and_out_of_range_index_refused) {
  ember_rdv_server *s = server(2, 0, 0, 0, 5000, 5000);
  uint16_t port = ember_rdv_server_port(s);
  pthread_t t0, t1, t2, t3;
  node_arg a0, a1, a2, a3;
  spawn(&t0, &a0, port, 0);
  wait_event(s, EMBER_RDV_EV_REGISTERED, 0, 3000, NULL);

  spawn(&t1, &a1, port, 0); /* duplicate */
  pthread_join(t1, NULL);
  CHECK_EQ_INT(a1.rc, EMBER_ESTATE);
  CHECK(strstr(a1.msg, "registration refused") != NULL);
  CHECK(strstr(a1.msg, "duplicate node index 0") != NULL);
  ember_rdv_event ev;
  wait_event(s, EMBER_RDV_EV_REJECTED, 0, 2000, &ev);
  CHECK(strstr(ev.text, "duplicate node index 0") != NULL);
  CHECK(strstr(ev.text, "exec-0") != NULL);
  ember_rdv_event_clear(&ev);

  spawn(&t2, &a2, port, 7); /* out of range */
  pthread_join(t2, NULL);
  CHECK_EQ_INT(a2.rc, EMBER_EINVAL);
  CHECK(strstr(a2.msg, "node index 7 out of range (num_nodes = 2)") != NULL);
  wait_event(s, EMBER_RDV_EV_REJECTED, -1, 2000, NULL);

  /* The server still completes the reservation. */
  spawn(&t3, &a3, port, 1);
  CHECK_OK(ember_rdv_server_wait_ready(s, 5000));
  pthread_join(t0, NULL);
  pthread_join(t3, NULL);
  CHECK_OK(a0.rc);
  CHECK_OK(a3.rc);
  node_free(&a0);
  node_free(&a1);
  node_free(&a2);
  node_free(&a3);
  ember_rdv_server_destroy(s);
}

TEST(disconnect_before_ready_frees_the_index) {
  ember_rdv_server *s = server(2, 0, 0, 0, 5000, 5000);
  uint16_t port = ember_rdv_server_port(s);
  ember_rdv_client *c = NULL;
  ember_rdv_node me;
  memset(&me, 0, sizeof me);
  snprintf(me.executor_id, sizeof me.executor_id, "exec-early");
  CHECK_OK(ember_rdv_client_connect(&c, "127.0.0.1", port, SECRET, 32, 2000));
  CHECK_OK(ember_rdv_client_register(c, &me, 1000));
  wait_event(s, EMBER_RDV_EV_REGISTERED, 0, 2000, NULL);
  ember_rdv_client_destroy(c);
  ember_rdv_event ev;
  wait_event(s, EMBER_RDV_EV_LOST, 0, 2000, &ev);
  CHECK(strstr(ev.text, "exec-early") != NULL);
  ember_rdv_event_clear(&ev);
  CHECK_EQ_INT(ember_rdv_server_wait_ready(s, 50), EMBER_ETIMEDOUT);
  CHECK(strstr(ember_last_error(), "0 of 2 nodes registered; missing node(s): 0, 1") != NULL);
  /* A retried task registers index 0 again. */
  pthread_t t[2];
  node_arg a[2];
  for (uint32_t i = 0; i < 2; i++) spawn(&t[i], &a[i], port, i);
  CHECK_OK(ember_rdv_server_wait_ready(s, 5000));
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    CHECK_OK(a[i].rc);
    node_free(&a[i]);
  }
  ember_rdv_server_destroy(s);
}

TEST(heartbeat_loss_detected) {
  ember_rdv_server *s = server(2, 0, 0, 0, 300, 5000);
  uint16_t port = ember_rdv_server_port(s);
  pthread_t t[2];
  node_arg a[2];
  spawn_hb(&t[0], &a[0], port, 0, 50);
  spawn(&t[1], &a[1], port, 1); /* never starts heartbeats */
  CHECK_OK(ember_rdv_server_wait_ready(s, 5000));
  int64_t ready_at = ember_now_ms();
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    CHECK_OK(a[i].rc);
  }
  ember_rdv_event ev;
  wait_event(s, EMBER_RDV_EV_LOST, -2, 2000, &ev);
  int64_t after = ember_now_ms() - ready_at;
  CHECK_EQ_INT(ev.node, 1);
  CHECK(after >= 250 && after < 1500);
  CHECK(strstr(ev.text, "node 1") != NULL);
  CHECK(strstr(ev.text, "exec-1") != NULL);
  CHECK(strstr(ev.text, "127.0.0.1") != NULL);
  CHECK(strstr(ev.text, "no heartbeat") != NULL);
  ember_rdv_event_clear(&ev);
  /* Node 0 keeps heartbeating: no LOST for it. */
  int rc = ember_rdv_server_next_event(s, &ev, 600);
  CHECK_EQ_INT(rc, EMBER_ETIMEDOUT);
  CHECK_EQ_INT(ember_rdv_client_stop_state(a[0].c), 0);
  /* The lost node's client notices its connection is gone at its next read;
   * the server, once destroyed, is seen as lost by node 0. */
  ember_rdv_server_destroy(s);
  int64_t deadline = ember_deadline_after(2000);
  while (ember_rdv_client_stop_state(a[0].c) == 0 && ember_now_ms() < deadline)
    usleep(10000);
  CHECK_EQ_INT(ember_rdv_client_stop_state(a[0].c), -1);
  for (int i = 0; i < 2; i++) node_free(&a[i]);
}

TEST(closed_connection_is_lost_but_not_after_done) {
  ember_rdv_server *s = server(3, 0, 0, 0, 5000, 5000);
  uint16_t port = ember_rdv_server_port(s);
  pthread_t t[3];
  node_arg a[3];
  for (uint32_t i = 0; i < 3; i++) spawn(&t[i], &a[i], port, i);
  CHECK_OK(ember_rdv_server_wait_ready(s, 5000));
  for (int i = 0; i < 3; i++) {
    pthread_join(t[i], NULL);
    CHECK_OK(a[i].rc);
  }
  wait_event(s, EMBER_RDV_EV_READY, -1, 1000, NULL);

  CHECK_OK(ember_rdv_client_report(a[0].c, EMBER_RDV_REPORT_PROGRESS, 0, "epoch 1", 1000));
  CHECK_OK(ember_rdv_client_report(a[0].c, EMBER_RDV_REPORT_DONE, 0, "finished", 1000));
  const char *tb = "Traceback (most recent call last):\n  File \"main.py\", line 3\n"
                   "ValueError: boom";
  CHECK_OK(ember_rdv_client_report(a[1].c, EMBER_RDV_REPORT_FAILED, 3, tb, 1000));
  CHECK_EQ_INT(ember_rdv_client_report(a[1].c, 99, 0, NULL, 1000), EMBER_EINVAL);

  /* Events of one node keep their order; different nodes interleave. */
  ember_rdv_event ev;
  int seen0 = 0, seen1 = 0;
  for (int k = 0; k < 3; k++) {
    CHECK_OK(ember_rdv_server_next_event(s, &ev, 2000));
    if (ev.node == 0 && seen0 == 0) {
      CHECK_EQ_INT(ev.kind, EMBER_RDV_EV_PROGRESS);
      CHECK(strcmp(ev.text, "epoch 1") == 0);
      seen0++;
    } else if (ev.node == 0) {
      CHECK_EQ_INT(ev.kind, EMBER_RDV_EV_DONE);
      CHECK_EQ_INT(ev.code, 0);
      CHECK(strcmp(ev.text, "finished") == 0);
      seen0++;
    } else {
      CHECK_EQ_INT(ev.node, 1);
      CHECK_EQ_INT(ev.kind, EMBER_RDV_EV_FAILED);
      CHECK_EQ_INT(ev.code, 3);
      CHECK(strcmp(ev.text, tb) == 0);
      seen1++;
    }
    ember_rdv_event_clear(&ev);
  }
  CHECK_EQ_INT(seen0, 2);
  CHECK_EQ_INT(seen1, 1);

  /* Nodes 0 and 1 reported: their disconnects are quiet.  Node 2 did not. */
  node_free(&a[0]);
  node_free(&a[1]);
  node_free(&a[2]);
  CHECK_OK(ember_rdv_server_next_event(s, &ev, 2000));
  CHECK_EQ_INT(ev.kind, EMBER_RDV_EV_LOST);
  CHECK_EQ_INT(ev.node, 2);
  CHECK(strstr(ev.text, "exec-2") != NULL);
  CHECK(strstr(ev.text, "connection closed") != NULL);
  ember_rdv_event_clear(&ev);
  CHECK_EQ_INT(ember_rdv_server_next_event(s, &ev, 300), EMBER_ETIMEDOUT);
  ember_rdv_server_destroy(s);
}

TEST(long_report_is_truncated_to_its_tail) {
  ember_rdv_server *s = server(1, 0, 0, 0, 5000, 5000);
  pthread_t t;
  node_arg a;
  spawn(&t, &a, ember_rdv_server_port(s), 0);
  pthread_join(t, NULL);
  CHECK_OK(a.rc);
  size_t n = EMBER_RDV_TEXT_MAX + 1000;
  char *big = malloc(n + 1);
  CHECK(big != NULL);
  memset(big, 'x', n);
  memcpy(big + n - 6, "THEEND", 6);
  big[n] = '\0';
  CHECK_OK(ember_rdv_client_report(a.c, EMBER_RDV_REPORT_FAILED, 1, big, 2000));
  free(big);
  ember_rdv_event ev;
  wait_event(s, EMBER_RDV_EV_FAILED, 0, 2000, &ev);
  CHECK_EQ_INT(strlen(ev.text), EMBER_RDV_TEXT_MAX);
  CHECK(strcmp(ev.text + EMBER_RDV_TEXT_MAX - 6, "THEEND") == 0);
  ember_rdv_event_clear(&ev);
  node_free(&a);
  ember_rdv_server_destroy(s);
}

TEST(stop_reaches_client) {
  ember_rdv_server *s = server(2, 0, 0, 0, 5000, 5000);
  uint16_t port = ember_rdv_server_port(s);
  pthread_t t[2];
  node_arg a[2];
  spawn_hb(&t[0], &a[0], port, 0, 50);
  wait_event(s, EMBER_RDV_EV_REGISTERED, 0, 2000, NULL);
  /* Node 1 is not connected yet; 5 does not exist. */
  CHECK_EQ_INT(ember_rdv_server_stop(s, 1, 100), EMBER_ENOTFOUND);
  CHECK_EQ_INT(ember_rdv_server_stop(s, 5, 100), EMBER_EINVAL);
  spawn_hb(&t[1], &a[1], port, 1, 50);
  CHECK_OK(ember_rdv_server_wait_ready(s, 5000));
  for (int i = 0; i < 2; i++) {
    pthread_join(t[i], NULL);
    CHECK_OK(a[i].rc);
  }
  CHECK_OK(ember_rdv_server_stop(s, 1, 777));
  int64_t deadline = ember_deadline_after(2000);
  while (ember_rdv_client_stop_state(a[1].c) == 0 && ember_now_ms() < deadline)
    usleep(5000);
  CHECK_EQ_INT(ember_rdv_client_stop_state(a[1].c), 778);
  CHECK_EQ_INT(ember_rdv_client_stop_state(a[0].c), 0);
  CHECK_OK(ember_rdv_server_stop(s, -1, 0));
  while (ember_rdv_client_stop_state(a[0].c) == 0 && ember_now_ms() < deadline)
    usleep(5000);
  CHECK_EQ_INT(ember_rdv_client_stop_state(a[0].c), 1);
  /* The first STOP's grace stands. */
  CHECK_EQ_INT(ember_rdv_client_stop_state(a[1].c), 778);
  /* After STOP, the server going away does not turn the state into -1. */
  ember_rdv_server_destroy(s);
  usleep(200 * 1000);
  CHECK_EQ_INT(ember_rdv_client_stop_state(a[0].c), 1);
  for (int i = 0; i < 2; i++) node_free(&a[i]);
}

/* A node in its own process, for EXIT_ON_LOSS, which must kill something.
 * Children are forked before the test creates any thread (the server's):
 * a fork while another thread holds a lock (OpenSSL initialising, malloc)
 * would leave the child deadlocked.  The child waits for the server port on
 * a pipe.  alive_fd's write end is held only by the child (and its
 * grandchild): EOF on it proves they are all gone. */
typedef struct {
  pid_t pid;
  int alive_fd, port_fd;
} child_node;

static void fork_node_silence(child_node *cn, uint32_t index, int leader, uint32_t silence_ms) {
  int alive[2], port[2];
  CHECK(pipe(alive) == 0 && pipe(port) == 0);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    close(alive[0]);
    close(port[1]);
    if (leader) {
      setpgid(0, 0);
      if (fork() == 0) {
        sleep(30); /* the grandchild: must die with the group */
        _exit(0);
      }
    }
    uint16_t p = 0;
    if (read(port[0], &p, sizeof p) != (ssize_t)sizeof p) _exit(4);
    node_arg a;
    memset(&a, 0, sizeof a);
    a.port = p;
    a.index = index;
    a.start = 1;
    a.interval_ms = 50;
    a.silence_ms = silence_ms;
    a.flags = EMBER_RDV_EXIT_ON_LOSS;
    node_main(&a);
    if (a.rc != EMBER_OK) {
      fprintf(stderr, "child node: %s\n", a.msg);
      _exit(3);
    }
    sleep(30);
    _exit(0);
  }
  close(alive[1]);
  close(port[0]);
  cn->pid = pid;
  cn->alive_fd = alive[0];
  cn->port_fd = port[1];
}

static void fork_node(child_node *cn, uint32_t index, int leader) {
  fork_node_silence(cn, index, leader, 0);
}

static void give_port(child_node *cn, uint16_t port) {
  CHECK(write(cn->port_fd, &port, sizeof port) == (ssize_t)sizeof port);
  close(cn->port_fd);
}

static void wait_gone(child_node *cn) {
  char b;
  /* Blocks until every holder of the write end is dead; the harness alarm
   * bounds it. */
  while (read(cn->alive_fd, &b, 1) > 0) {
  }
  close(cn->alive_fd);
}

static void expect_killed(child_node *cn) {
  int st = 0;
  CHECK(waitpid(cn->pid, &st, 0) == cn->pid);
  if (!(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL))
    fprintf(stderr, "child status: exited=%d code=%d signaled=%d sig=%d\n", WIFEXITED(st),
            WIFEXITED(st) ? WEXITSTATUS(st) : -1, WIFSIGNALED(st),
            WIFSIGNALED(st) ? WTERMSIG(st) : -1);
  CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
}

TEST(exit_on_loss_kills_the_node) {
  child_node c0, c1;
  fork_node(&c0, 0, 0); /* not a group leader: only itself dies */
  fork_node(&c1, 1, 1); /* group leader with a child: the group dies */
  ember_rdv_server *s = server(2, 0, 0, 0, 5000, 5000);
  give_port(&c0, ember_rdv_server_port(s));
  give_port(&c1, ember_rdv_server_port(s));
  CHECK_OK(ember_rdv_server_wait_ready(s, 5000));
  usleep(100 * 1000); /* let both start their threads */
  int64_t t0 = ember_now_ms();
  ember_rdv_server_destroy(s);
  expect_killed(&c0);
  expect_killed(&c1);
  wait_gone(&c0);
  wait_gone(&c1); /* the grandchild died with its group */
  CHECK(ember_now_ms() - t0 < 3000);
}

TEST(exit_on_loss_stop_grace) {
  child_node c;
  fork_node(&c, 0, 0);
  ember_rdv_server *s = server(1, 0, 0, 0, 5000, 5000);
  give_port(&c, ember_rdv_server_port(s));
  CHECK_OK(ember_rdv_server_wait_ready(s, 5000));
  usleep(100 * 1000);
  int64_t t0 = ember_now_ms();
  CHECK_OK(ember_rdv_server_stop(s, -1, 300));
  expect_killed(&c);
  int64_t took = ember_now_ms() - t0;
  CHECK(took >= 250 && took < 2000);
  wait_gone(&c);
  /* Its control connection then dropped without a DONE report. */
  wait_event(s, EMBER_RDV_EV_LOST, 0, 2000, NULL);
  ember_rdv_server_destroy(s);
}

/* A partition: the driver's connection stays open but nothing comes
 * through it (here the driver's process is stopped, so nothing is echoed or
 * closed).  The node ends itself after silence_ms, not at the default
 * 3 intervals + 5 s, and not later than the server's heartbeat timeout
 * would count it lost. */
TEST(exit_on_loss_silent_driver) {
  child_node c;
  int port_pipe[2];
  fork_node_silence(&c, 0, 1, 400);
  CHECK(pipe(port_pipe) == 0);
  fflush(stdout);
  fflush(stderr);
  pid_t driver = fork();
  CHECK(driver >= 0);
  if (driver == 0) {
    close(port_pipe[0]);
    ember_rdv_server *s = server(1, 0, 0, 0, 5000, 400);
    uint16_t p = ember_rdv_server_port(s);
    if (write(port_pipe[1], &p, sizeof p) != (ssize_t)sizeof p) _exit(4);
    for (;;) pause(); /* serves (echoes) until stopped, then killed */
  }
  close(port_pipe[1]);
  uint16_t p = 0;
  CHECK(read(port_pipe[0], &p, sizeof p) == (ssize_t)sizeof p);
  close(port_pipe[0]);
  give_port(&c, p);
  usleep(600 * 1000); /* registered, heartbeats echoed for longer than silence_ms */
  CHECK(waitpid(c.pid, NULL, WNOHANG) == 0);
  int64_t t0 = ember_now_ms();
  CHECK(kill(driver, SIGSTOP) == 0);
  expect_killed(&c);
  int64_t took = ember_now_ms() - t0;
  CHECK(took >= 300 && took < 1500);
  wait_gone(&c);
  kill(driver, SIGKILL);
  CHECK(waitpid(driver, NULL, 0) == driver);
}

RUN_TESTS(T(two_nodes), T(four_nodes_roles), T(sixty_four_nodes), T(bad_config),
          T(reservation_timeout_names_missing_node),
          T(wrong_secret_rejected_then_reservation_completes),
          T(hostile_peers_do_not_disturb_a_reservation),
          T(strangers_do_not_delay_registration),
          T(preauth_deadline_is_short_and_separate),
          T(rejections_are_reported_rate_limited),
          T(duplicate_and_out_of_range_index_refused),
          T(disconnect_before_ready_frees_the_index), T(heartbeat_loss_detected),
          T(closed_connection_is_lost_but_not_after_done),
          T(long_report_is_truncated_to_its_tail), T(stop_reaches_client),
          T(exit_on_loss_kills_the_node), T(exit_on_loss_stop_grace),
          T(exit_on_loss_silent_driver))
