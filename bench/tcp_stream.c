/* bench/tcp_stream.c - one TCP stream between two hosts, the ceiling that
 * bench/cluster.py compares the collectives and the feed with.
 *
 *   tcp_stream recv PORT [SOCKBUF]           accepts one connection, reads
 *                                            until EOF, prints
 *                                            "stream BYTES SECONDS"
 *   tcp_stream send HOST PORT SECONDS [WRITE [SOCKBUF]]
 *                                            writes WRITE-byte buffers
 *                                            (default 4 MiB) for SECONDS
 *
 * C rather than Python so that the ceiling is the kernel's, not the
 * interpreter's: a plain blocking loop of large send()/recv() calls on one
 * connection, TCP_NODELAY off (a bulk stream wants full segments).  SOCKBUF
 * 0 (the default) keeps the kernel's buffer autotuning (net.ipv4.tcp_rmem /
 * tcp_wmem), which on Linux is the best a single stream gets; a size sets
 * SO_SNDBUF/SO_RCVBUF instead.  The receiver times from its first byte to
 * EOF, so connection set-up is not counted.  Prints "ready" once listening.
 */
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void set_buf(int fd, int bytes) {
  if (bytes <= 0) return;
  (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

static int do_recv(int port, int sockbuf) {
  int srv = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  setsockopt(srv, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  set_buf(srv, sockbuf); /* inherited by the accepted socket (window scale) */
  if (srv < 0 || bind(srv, (struct sockaddr *)&a, sizeof a) != 0 || listen(srv, 1) != 0) {
    perror("tcp_stream: listen");
    return 1;
  }
  printf("ready\n");
  fflush(stdout);
  int fd = accept(srv, NULL, NULL);
  if (fd < 0) {
    perror("tcp_stream: accept");
    return 1;
  }
  size_t cap = 4u << 20;
  char *buf = malloc(cap);
  if (buf == NULL) return 1;
  long long total = 0;
  double t0 = 0;
  for (;;) {
    ssize_t n = recv(fd, buf, cap, 0);
    if (n < 0) {
      perror("tcp_stream: recv");
      return 1;
    }
    if (n == 0) break;
    if (total == 0) t0 = now_s();
    total += n;
  }
  double dt = now_s() - t0;
  printf("stream %lld %.9f\n", total, dt);
  fflush(stdout);
  close(fd);
  close(srv);
  free(buf);
  return 0;
}

static int do_send(const char *host, const char *port, double seconds, size_t wbytes,
                   int sockbuf) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host, port, &hints, &res) != 0 || res == NULL) {
    fprintf(stderr, "tcp_stream: cannot resolve %s\n", host);
    return 1;
  }
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  set_buf(fd, sockbuf);
  if (fd < 0 || connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    perror("tcp_stream: connect");
    return 1;
  }
  freeaddrinfo(res);
  char *buf = malloc(wbytes);
  if (buf == NULL) return 1;
  memset(buf, 0x5a, wbytes);
  double t0 = now_s();
  while (now_s() - t0 < seconds) {
    size_t off = 0;
    while (off < wbytes) {
      ssize_t n = send(fd, buf + off, wbytes - off, MSG_NOSIGNAL);
      if (n < 0) {
        perror("tcp_stream: send");
        return 1;
      }
      off += (size_t)n;
    }
  }
  close(fd);
  free(buf);
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 3 && strcmp(argv[1], "recv") == 0)
    return do_recv(atoi(argv[2]), argc > 3 ? atoi(argv[3]) : 0);
  if (argc >= 5 && strcmp(argv[1], "send") == 0)
    return do_send(argv[2], argv[3], atof(argv[4]),
                   argc > 5 ? (size_t)atoll(argv[5]) : (size_t)4 << 20,
                   argc > 6 ? atoi(argv[6]) : 0);
  fprintf(stderr, "usage: tcp_stream recv PORT [SOCKBUF] | "
                  "tcp_stream send HOST PORT SECONDS [WRITE [SOCKBUF]]\n");
  return 2;
}
