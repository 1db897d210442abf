/* test_auth.c - the HMAC challenge/response, both sides, good and bad. */
#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>

#include "ember/auth.h"
#include "ember/net.h"
#include "harness.h"

static const uint8_t SECRET[32] = "0123456789abcdef0123456789abcdef";

typedef struct {
  int fd;
  const uint8_t *secret;
  size_t secret_len;
  int64_t timeout_ms;
  int rc;
  char msg[512];
} side;

static void *run_server(void *arg) {
  side *s = arg;
  s->rc = ember_auth_server(s->fd, s->secret, s->secret_len,
                            ember_deadline_after(s->timeout_ms));
  snprintf(s->msg, sizeof s->msg, "%s", ember_last_error());
  return NULL;
}

static void *run_client(void *arg) {
  side *s = arg;
  s->rc = ember_auth_client(s->fd, s->secret, s->secret_len,
                            ember_deadline_after(s->timeout_ms));
  snprintf(s->msg, sizeof s->msg, "%s", ember_last_error());
  return NULL;
}

static void pair(int sv[2]) {
  CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) == 0);
}

/* Runs server and client handshakes concurrently on a socketpair. */
static void handshake(const uint8_t *ssec, const uint8_t *csec, side *srv, side *cli) {
  int sv[2];
  pthread_t t;
  pair(sv);
  *srv = (side){.fd = sv[0], .secret = ssec, .secret_len = 32, .timeout_ms = 3000};
  *cli = (side){.fd = sv[1], .secret = csec, .secret_len = 32, .timeout_ms = 3000};
  pthread_create(&t, NULL, run_server, srv);
  run_client(cli);
  pthread_join(t, NULL);
  ember_net_close(sv[0]);
  ember_net_close(sv[1]);
}

TEST(hmac_rfc4231_case2) {
  static const uint8_t expect[32] = {
      0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e, 0x6a, 0x04, 0x24,
      0x26, 0x08, 0x95, 0x75, 0xc7, 0x5a, 0x00, 0x3f, 0x08, 0x9d, 0x27,
      0x39, 0x83, 0x9d, 0xec, 0x58, 0xb9, 0x64, 0xec, 0x38, 0x43};
  uint8_t out[32];
  /* The message split over three parts must equal the one-shot MAC. */
  CHECK_OK(ember_auth_hmac((const uint8_t *)"Jefe", 4, "what do ya", 10, " want for ", 10,
                           "nothing?", 8, out));
  CHECK(memcmp(out, expect, 32) == 0);
  CHECK_OK(ember_auth_hmac((const uint8_t *)"Jefe", 4, NULL, 0,
                           "what do ya want for nothing?", 28, NULL, 0, out));
  CHECK(memcmp(out, expect, 32) == 0);
  uint8_t r1[32], r2[32];
  CHECK_OK(ember_auth_random(r1, 32));
  CHECK_OK(ember_auth_random(r2, 32));
  CHECK(memcmp(r1, r2, 32) != 0);
}

TEST(good_secret_both_ways) {
  side s, c;
  handshake(SECRET, SECRET, &s, &c);
  CHECK_EQ_INT(s.rc, EMBER_OK);
  CHECK_EQ_INT(c.rc, EMBER_OK);

  /* And over real TCP. */
  int lfd, a, b;
  uint16_t port;
  pthread_t t;
  CHECK_OK(ember_net_bind("127.0.0.1", 0, 4, 0, &lfd, &port));
  CHECK_OK(ember_net_connect("127.0.0.1", port, ember_deadline_after(1000), &a));
  CHECK_OK(ember_net_accept(lfd, ember_deadline_after(1000), &b));
  s = (side){.fd = b, .secret = SECRET, .secret_len = 32, .timeout_ms = 3000};
  c = (side){.fd = a, .secret = SECRET, .secret_len = 32, .timeout_ms = 3000};
  pthread_create(&t, NULL, run_server, &s);
  run_client(&c);
  pthread_join(t, NULL);
  CHECK_EQ_INT(s.rc, EMBER_OK);
  CHECK_EQ_INT(c.rc, EMBER_OK);
  /* The connection is usable afterwards. */
  CHECK_OK(ember_net_send_frame(a, EMBER_MSG_HEARTBEAT, NULL, 0, ember_deadline_after(500)));
  ember_frame_header h;
  uint8_t *p;
  CHECK_OK(ember_net_recv_frame(b, 16, &h, &p, ember_deadline_after(500)));
  CHECK_EQ_INT(h.type, EMBER_MSG_HEARTBEAT);
  ember_net_close(a);
  ember_net_close(b);
  ember_net_close(lfd);
}

TEST(wrong_secret_refused_on_both_sides) {
  uint8_t other[32];
  memcpy(other, SECRET, 32);
  other[31] ^= 1;
  side s, c;
  handshake(SECRET, other, &s, &c);
  CHECK_EQ_INT(s.rc, EMBER_EAUTH);
  CHECK_EQ_INT(c.rc, EMBER_EAUTH);
  CHECK(strstr(s.msg, "bad MAC") != NULL);
  CHECK(strstr(c.msg, "refused") != NULL);
  CHECK(strstr(c.msg, "bad MAC") != NULL);
}

TEST(short_secret_is_einval) {
  int sv[2];
  pair(sv);
  CHECK_EQ_INT(ember_auth_client(sv[0], SECRET, 8, ember_deadline_after(100)),
               EMBER_EINVAL);
  CHECK_EQ_INT(ember_auth_server(sv[0], SECRET, 15, ember_deadline_after(100)),
               EMBER_EINVAL);
  ember_net_close(sv[0]);
  ember_net_close(sv[1]);
}

/* Raw client: reads the CHALLENGE, sends `bytes`, returns the reply frame type. */
static int raw_exchange(const void *bytes, size_t n, side *srv, char *reason, size_t cap) {
  int sv[2];
  pthread_t t;
  ember_frame_header h;
  uint8_t *p = NULL;
  pair(sv);
  *srv = (side){.fd = sv[0], .secret = SECRET, .secret_len = 32, .timeout_ms = 2000};
  pthread_create(&t, NULL, run_server, srv);
  CHECK_OK(ember_net_recv_frame(sv[1], 64, &h, &p, ember_deadline_after(2000)));
  CHECK_EQ_INT(h.type, EMBER_MSG_CHALLENGE);
  CHECK_EQ_INT(h.length, 32);
  free(p);
  CHECK_OK(ember_net_send_all(sv[1], bytes, n, ember_deadline_after(1000)));
  pthread_join(t, NULL);
  CHECK_OK(ember_net_recv_frame(sv[1], 4096, &h, &p, ember_deadline_after(2000)));
  if (h.type == EMBER_MSG_REFUSED && reason != NULL) {
    ember_wire_reader r;
    ember_wire_reader_init(&r, p, h.length);
    CHECK_EQ_INT((int32_t)ember_wire_read_u32(&r), EMBER_EAUTH);
    ember_wire_read_str(&r, reason, cap);
    CHECK_OK(ember_wire_reader_finish(&r, 1, "REFUSED"));
  }
  free(p);
  ember_net_close(sv[0]);
  ember_net_close(sv[1]);
  return h.type;
}

TEST(garbage_first_frame_refused) {
  side s;
  char reason[256];
  uint8_t junk[76];
  memset(junk, 'A', sizeof junk);
  CHECK_EQ_INT(raw_exchange(junk, sizeof junk, &s, reason, sizeof reason),
               EMBER_MSG_REFUSED);
  CHECK_EQ_INT(s.rc, EMBER_EAUTH);
  CHECK(strstr(reason, "magic") != NULL);
  CHECK(strstr(s.msg, "magic") != NULL);

  /* Right framing, wrong type: refused without reading its payload. */
  uint8_t f[EMBER_WIRE_HEADER_LEN];
  ember_wire_encode_header(f, EMBER_MSG_BATCH, 1u << 30);
  CHECK_EQ_INT(raw_exchange(f, sizeof f, &s, reason, sizeof reason), EMBER_MSG_REFUSED);
  CHECK_EQ_INT(s.rc, EMBER_EAUTH);
  CHECK(strstr(reason, "expected AUTH frame, got BATCH") != NULL);

  /* AUTH with the wrong length. */
  uint8_t g[EMBER_WIRE_HEADER_LEN + 10] = {0};
  ember_wire_encode_header(g, EMBER_MSG_AUTH, 10);
  CHECK_EQ_INT(raw_exchange(g, sizeof g, &s, reason, sizeof reason), EMBER_MSG_REFUSED);
  CHECK_EQ_INT(s.rc, EMBER_EAUTH);
  CHECK(strstr(reason, "AUTH frame of 10 bytes") != NULL);

  /* Well-formed AUTH with a random MAC. */
  uint8_t a[EMBER_WIRE_HEADER_LEN + 64];
  ember_wire_encode_header(a, EMBER_MSG_AUTH, 64);
  CHECK_OK(ember_auth_random(a + EMBER_WIRE_HEADER_LEN, 64));
  CHECK_EQ_INT(raw_exchange(a, sizeof a, &s, reason, sizeof reason), EMBER_MSG_REFUSED);
  CHECK(strstr(reason, "bad MAC") != NULL);
}

TEST(server_times_out_on_silent_client) {
  int sv[2];
  pair(sv);
  int64_t t0 = ember_now_ms();
  CHECK_EQ_INT(ember_auth_server(sv[0], SECRET, 32, ember_deadline_after(200)),
               EMBER_ETIMEDOUT);
  int64_t took = ember_now_ms() - t0;
  CHECK(took >= 190 && took < 2000);
  ember_net_close(sv[0]);
  ember_net_close(sv[1]);
}

TEST(client_times_out_on_silent_server) {
  int sv[2];
  pair(sv);
  int64_t t0 = ember_now_ms();
  CHECK_EQ_INT(ember_auth_client(sv[0], SECRET, 32, ember_deadline_after(200)),
               EMBER_ETIMEDOUT);
  CHECK(ember_now_ms() - t0 < 2000);
  ember_net_close(sv[0]);
  ember_net_close(sv[1]);
}

/* An impostor server: sends a CHALLENGE, accepts anything, answers AUTH_OK
 * with a MAC it cannot compute. */
static void *impostor(void *arg) {
  int fd = *(int *)arg;
  uint8_t ch[EMBER_WIRE_HEADER_LEN + 32], buf[EMBER_WIRE_HEADER_LEN + 64];
  ember_wire_encode_header(ch, EMBER_MSG_CHALLENGE, 32);
  ember_auth_random(ch + EMBER_WIRE_HEADER_LEN, 32);
  ember_net_send_all(fd, ch, sizeof ch, ember_deadline_after(1000));
  ember_net_recv_all(fd, buf, sizeof buf, ember_deadline_after(1000));
  uint8_t ok[EMBER_WIRE_HEADER_LEN + 32];
  ember_wire_encode_header(ok, EMBER_MSG_AUTH_OK, 32);
  ember_auth_random(ok + EMBER_WIRE_HEADER_LEN, 32);
  ember_net_send_all(fd, ok, sizeof ok, ember_deadline_after(1000));
  return NULL;
}

TEST(client_rejects_impostor_server) {
  int sv[2];
  pthread_t t;
  pair(sv);
  pthread_create(&t, NULL, impostor, &sv[0]);
  CHECK_EQ_INT(ember_auth_client(sv[1], SECRET, 32, ember_deadline_after(2000)),
               EMBER_EAUTH);
  CHECK(strstr(ember_last_error(), "failed to prove") != NULL);
  pthread_join(t, NULL);
  ember_net_close(sv[0]);
  ember_net_close(sv[1]);
}

TEST(nonblocking_pair) {
  ember_auth_pending st;
  uint8_t ch[EMBER_WIRE_HEADER_LEN + 32], reply[EMBER_WIRE_HEADER_LEN + 300];
  size_t n = 0, rn = 0;
  CHECK_EQ_INT(ember_auth_server_begin(&st, ch, 10, &n), EMBER_EINVAL);
  CHECK_OK(ember_auth_server_begin(&st, ch, sizeof ch, &n));
  CHECK_EQ_INT(n, sizeof ch);
  CHECK(memcmp(ch + EMBER_WIRE_HEADER_LEN, st.server_nonce, 32) == 0);

  /* Build a correct AUTH the way a client does. */
  uint8_t msg[64];
  CHECK_OK(ember_auth_random(msg, 32));
  CHECK_OK(ember_auth_hmac(SECRET, 32, "ember-auth-v1 client", 20, st.server_nonce, 32,
                           msg, 32, msg + 32));
  CHECK_OK(ember_auth_server_check(&st, SECRET, 32, EMBER_MSG_AUTH, msg, 64, reply,
                                   sizeof reply, &rn));
  CHECK_EQ_INT(rn, EMBER_WIRE_HEADER_LEN + 32);
  ember_frame_header h;
  CHECK_OK(ember_wire_decode_header(reply, rn, 64, &h));
  CHECK_EQ_INT(h.type, EMBER_MSG_AUTH_OK);
  uint8_t proof[32];
  CHECK_OK(ember_auth_hmac(SECRET, 32, "ember-auth-v1 server", 20, msg, 32,
                           st.server_nonce, 32, proof));
  CHECK(memcmp(proof, reply + EMBER_WIRE_HEADER_LEN, 32) == 0);

  /* A flipped MAC bit and a wrong type are refused with a REFUSED reply. */
  msg[40] ^= 0x10;
  CHECK_EQ_INT(ember_auth_server_check(&st, SECRET, 32, EMBER_MSG_AUTH, msg, 64, reply,
                                       sizeof reply, &rn),
               EMBER_EAUTH);
  CHECK_OK(ember_wire_decode_header(reply, rn, 4096, &h));
  CHECK_EQ_INT(h.type, EMBER_MSG_REFUSED);
  CHECK_EQ_INT(ember_auth_server_check(&st, SECRET, 32, EMBER_MSG_REGISTER, NULL, 500,
                                       reply, sizeof reply, &rn),
               EMBER_EAUTH);
  CHECK(strstr(ember_last_error(), "got REGISTER") != NULL);
  /* Reply buffer too small for even AUTH_OK. */
  CHECK_EQ_INT(ember_auth_server_check(&st, SECRET, 32, EMBER_MSG_AUTH, msg, 64, reply, 20,
                                       &rn),
               EMBER_EINVAL);
}

RUN_TESTS(T(hmac_rfc4231_case2), T(good_secret_both_ways),
          T(wrong_secret_refused_on_both_sides), T(short_secret_is_einval),
          T(garbage_first_frame_refused), T(server_times_out_on_silent_client),
          T(client_times_out_on_silent_server), T(client_rejects_impostor_server),
          T(nonblocking_pair))
