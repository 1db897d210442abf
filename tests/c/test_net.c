/* test_net.c - deadlines, framed I/O and connect retries on loopback. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/socket.h>

#include "ember/net.h"
#include "harness.h"

/* A connected loopback pair: *a is the client end, *b the accepted end. */
static void tcp_pair(int *a, int *b) {
  int lfd;
  uint16_t port;
  CHECK_OK(ember_net_bind("127.0.0.1", 0, 8, 0, &lfd, &port));
  CHECK(port != 0);
  CHECK_OK(ember_net_connect("127.0.0.1", port, ember_deadline_after(2000), a));
  CHECK_OK(ember_net_accept(lfd, ember_deadline_after(2000), b));
  ember_net_close(lfd);
}

TEST(clock_and_deadlines) {
  int64_t t0 = ember_now_ms();
  CHECK(t0 > 0);
  CHECK(ember_deadline_after(INT64_MAX) == INT64_MAX);
  CHECK(ember_deadline_after(100) >= t0 + 100);
}

TEST(recv_deadline_on_silent_peer) {
  int a, b;
  uint8_t buf[4];
  tcp_pair(&a, &b);
  int64_t t0 = ember_now_ms();
  CHECK_EQ_INT(ember_net_recv_all(a, buf, sizeof buf, ember_deadline_after(200)),
               EMBER_ETIMEDOUT);
  int64_t took = ember_now_ms() - t0;
  CHECK(took >= 190 && took < 2000);
  CHECK(strstr(ember_last_error(), "127.0.0.1:") != NULL);
  ember_frame_header h;
  uint8_t *p = NULL;
  CHECK_EQ_INT(ember_net_recv_frame(a, 100, &h, &p, ember_deadline_after(100)),
               EMBER_ETIMEDOUT);
  CHECK(p == NULL);
  ember_net_close(a);
  ember_net_close(b);
}

TEST(send_deadline_when_peer_does_not_read) {
  int a, b;
  tcp_pair(&a, &b);
  static uint8_t big[16 << 20];
  int64_t t0 = ember_now_ms();
  CHECK_EQ_INT(ember_net_send_all(a, big, sizeof big, ember_deadline_after(300)),
               EMBER_ETIMEDOUT);
  CHECK(ember_now_ms() - t0 < 3000);
  CHECK(strstr(ember_last_error(), "send to 127.0.0.1:") != NULL);
  ember_net_close(a);
  ember_net_close(b);
}

TEST(frame_round_trip) {
  int a, b;
  tcp_pair(&a, &b);
  CHECK_OK(ember_net_tune(a));
  CHECK_OK(ember_net_send_frame(a, EMBER_MSG_REPORT, "hello", 5, ember_deadline_after(1000)));
  CHECK_OK(ember_net_send_frame(a, EMBER_MSG_HEARTBEAT, NULL, 0, ember_deadline_after(1000)));
  ember_frame_header h;
  uint8_t *p = NULL;
  CHECK_OK(ember_net_recv_frame(b, 100, &h, &p, ember_deadline_after(1000)));
  CHECK_EQ_INT(h.type, EMBER_MSG_REPORT);
  CHECK_EQ_INT(h.length, 5);
  CHECK(memcmp(p, "hello", 5) == 0);
  free(p);
  CHECK_OK(ember_net_recv_frame(b, 100, &h, &p, ember_deadline_after(1000)));
  CHECK_EQ_INT(h.type, EMBER_MSG_HEARTBEAT);
  CHECK(p == NULL);

  char name[96], host[64];
  uint16_t port = 0;
  ember_net_peer_name(a, name, sizeof name);
  ember_net_local_addr(b, host, sizeof host, &port);
  CHECK(strncmp(name, "127.0.0.1:", 10) == 0);
  CHECK(strcmp(host, "127.0.0.1") == 0 && port != 0);
  ember_net_peer_name(-1, name, sizeof name);
  CHECK(strcmp(name, "?") == 0);

  /* Peer closes: ECLOSED with the peer named. */
  ember_net_close(a);
  CHECK_EQ_INT(ember_net_recv_frame(b, 100, &h, &p, ember_deadline_after(1000)),
               EMBER_ECLOSED);
  CHECK(strstr(ember_last_error(), "closed") != NULL);
  ember_net_close(b);
}

/* A reader thread for sendv_pieces: drains `len` bytes into `buf`. */
struct drain {
  int fd;
  uint8_t *buf;
  size_t len;
  int rc;
};

static void *drain_thread(void *arg) {
  struct drain *d = arg;
  d->rc = ember_net_recv_all(d->fd, d->buf, d->len, ember_deadline_after(10000));
  return NULL;
}

/* sendv_all hands the kernel at most 512 KiB a call: iovecs longer than that,
 * and ones whose boundaries fall on either side of a piece's end, still
 * arrive whole and in order. */
TEST(sendv_pieces) {
  int a, b;
  tcp_pair(&a, &b);
  static const size_t lens[] = {7, 524281, 1, 3 << 20, 524288, 0, 1000003};
  enum { N = sizeof lens / sizeof lens[0] };
  size_t total = 0;
  for (int i = 0; i < N; i++) total += lens[i];
  uint8_t *src = malloc(total), *dst = malloc(total);
  CHECK(src != NULL && dst != NULL);
  for (size_t i = 0; i < total; i++) src[i] = (uint8_t)(i * 131u + (i >> 16));
  struct iovec iov[N];
  size_t at = 0;
  for (int i = 0; i < N; i++) {
    iov[i] = (struct iovec){.iov_base = src + at, .iov_len = lens[i]};
    at += lens[i];
  }
  struct drain d = {.fd = b, .buf = dst, .len = total, .rc = -1};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, drain_thread, &d) == 0);
  CHECK_OK(ember_net_sendv_all(a, iov, N, ember_deadline_after(10000)));
  pthread_join(t, NULL);
  CHECK_OK(d.rc);
  CHECK(memcmp(src, dst, total) == 0);
  free(src);
  free(dst);
  ember_net_close(a);
  ember_net_close(b);
}

TEST(recv_frame_rejects_oversize_before_payload) {
  int a, b;
  tcp_pair(&a, &b);
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
  ember_wire_encode_header(hdr, EMBER_MSG_BATCH, 1u << 20);
  CHECK_OK(ember_net_send_all(a, hdr, sizeof hdr, ember_deadline_after(1000)));
  CHECK_OK(ember_net_send_all(a, "MARK", 4, ember_deadline_after(1000)));
  ember_frame_header h;
  uint8_t *p = (uint8_t *)1;
  CHECK_EQ_INT(ember_net_recv_frame(b, 1024, &h, &p, ember_deadline_after(1000)),
               EMBER_ETOOBIG);
  CHECK(p == NULL);
  CHECK(strstr(ember_last_error(), "127.0.0.1:") != NULL);
  /* The payload was not read: the next bytes on the socket are still ours. */
  char mark[4];
  CHECK_OK(ember_net_recv_all(b, mark, 4, ember_deadline_after(1000)));
  CHECK(memcmp(mark, "MARK", 4) == 0);

  /* Garbage header: EPROTO. */
  CHECK_OK(ember_net_send_all(a, "GET / HTTP/1.0\r\n", 16, ember_deadline_after(1000)));
  CHECK_EQ_INT(ember_net_recv_frame(b, 1024, &h, &p, ember_deadline_after(1000)),
               EMBER_EPROTO);
  ember_net_close(a);
  ember_net_close(b);
}

TEST(connect_refused_until_deadline) {
  int lfd, fd = -1;
  uint16_t port;
  /* Bound but not listening: connections are refused, and nobody else can
   * take the port meanwhile. */
  CHECK_OK(ember_net_bind("127.0.0.1", 0, 0, 0, &lfd, &port));
  int64_t t0 = ember_now_ms();
  CHECK_EQ_INT(ember_net_connect("127.0.0.1", port, ember_deadline_after(300), &fd),
               EMBER_ETIMEDOUT);
  int64_t took = ember_now_ms() - t0;
  CHECK(took >= 290 && took < 3000);
  CHECK(strstr(ember_last_error(), "refused") != NULL);
  CHECK(fd == -1);
  ember_net_close(lfd);
}

struct late_listen {
  int fd;
};

static void *listen_later(void *arg) {
  struct late_listen *l = arg;
  usleep(200 * 1000);
  ember_net_listen_fd(l->fd, 8);
  return NULL;
}

TEST(connect_retries_until_server_listens) {
  struct late_listen l;
  uint16_t port;
  int fd = -1, afd = -1;
  pthread_t t;
  CHECK_OK(ember_net_bind("127.0.0.1", 0, 0, 0, &l.fd, &port));
  pthread_create(&t, NULL, listen_later, &l);
  int64_t t0 = ember_now_ms();
  CHECK_OK(ember_net_connect("127.0.0.1", port, ember_deadline_after(5000), &fd));
  CHECK(ember_now_ms() - t0 >= 150);
  pthread_join(t, NULL);
  CHECK_OK(ember_net_accept(l.fd, ember_deadline_after(1000), &afd));
  ember_net_close(fd);
  ember_net_close(afd);
  ember_net_close(l.fd);
}

TEST(connect_by_name_and_errors) {
  int lfd, fd = -1, afd = -1;
  uint16_t port;
  CHECK_OK(ember_net_bind(NULL, 0, 8, 0, &lfd, &port));
  CHECK_OK(ember_net_connect("localhost", port, ember_deadline_after(2000), &fd));
  CHECK_OK(ember_net_accept(lfd, ember_deadline_after(1000), &afd));
  ember_net_close(fd);
  ember_net_close(afd);
  /* NXDOMAIN normally; a resolver that cannot answer (EAI_AGAIN) is retried
   * until the deadline instead. */
  int rc = ember_net_connect("no-such-host.invalid", port, ember_deadline_after(500), &fd);
  CHECK(rc == EMBER_ENOTFOUND || rc == EMBER_ETIMEDOUT);
  CHECK_EQ_INT(ember_net_connect("", port, ember_deadline_after(500), &fd), EMBER_EINVAL);
  /* accept with nothing pending times out. */
  int64_t t0 = ember_now_ms();
  CHECK_EQ_INT(ember_net_accept(lfd, ember_deadline_after(150), &afd), EMBER_ETIMEDOUT);
  CHECK(ember_now_ms() - t0 >= 140);
  ember_net_close(lfd);
}

TEST(reuseport_handoff) {
  int a, b;
  uint16_t port, port2;
  CHECK_OK(ember_net_bind("127.0.0.1", 0, 0, EMBER_NET_REUSEPORT, &a, &port));
  /* A framework binds the reserved port too (it sets SO_REUSEPORT). */
  CHECK_OK(ember_net_bind("127.0.0.1", port, 8, EMBER_NET_REUSEPORT, &b, &port2));
  CHECK_EQ_INT(port, port2);
  /* Without SO_REUSEPORT a third party cannot take it. */
  int c;
  CHECK_EQ_INT(ember_net_bind("127.0.0.1", port, 8, 0, &c, NULL), EMBER_ESYS);
  ember_net_close(a);
  ember_net_close(b);
}

RUN_TESTS(T(clock_and_deadlines), T(recv_deadline_on_silent_peer),
          T(send_deadline_when_peer_does_not_read), T(sendv_pieces), T(frame_round_trip),
          T(recv_frame_rejects_oversize_before_payload),
          T(connect_refused_until_deadline), T(connect_retries_until_server_listens),
          T(connect_by_name_and_errors), T(reuseport_handoff))
