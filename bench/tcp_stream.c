/* bench/tcp_stream.c - one TCP stream between two hosts, the ceiling that
 * bench/cluster.py compares the collectives and the feed with.
 *
 *   tcp_stream recv PORT [SOCKBUF [READ]]    accepts one connection, reads
 *                                            READ bytes at a time (default
 *                                            4 MiB) until EOF, prints
 *                                            "stream BYTES SECONDS"
 *   tcp_stream send HOST PORT SECONDS [WRITE [SOCKBUF]]
 *                                            writes WRITE-byte buffers
 *                                            (default 4 MiB) for SECONDS
 *   tcp_stream ring PORT NEXT_HOST NEXT_PORT SECONDS [WRITE]
 *                                            one host of a ring: listens on
 *                                            PORT, prints "ready", waits for
 *                                            a line on stdin, connects to
 *                                            the next host, accepts the
 *                                            previous one, and for SECONDS
 *                                            writes to the next while it
 *                                            reads from the previous, in one
 *                                            non-blocking loop that polls
 *                                            only when neither moved (as a
 *                                            rank of a ring allreduce
 *                                            does); then reads to
 *                                            EOF and prints "stream BYTES
 *                                            SECONDS" of what it received
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
#include <errno.h>
#include <netdb.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
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

static int listen_on(int port, int sockbuf) {
  int srv = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  struct sockaddr_in a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  setsockopt(srv, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  set_buf(srv, sockbuf);
  if (srv < 0 || bind(srv, (struct sockaddr *)&a, sizeof a) != 0 || listen(srv, 1) != 0) {
    perror("tcp_stream: listen");
    return -1;
  }
  return srv;
}

static int connect_to(const char *host, const char *port, int sockbuf) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host, port, &hints, &res) != 0 || res == NULL) {
    fprintf(stderr, "tcp_stream: cannot resolve %s\n", host);
    return -1;
  }
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  set_buf(fd, sockbuf);
  if (fd < 0 || connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    perror("tcp_stream: connect");
    freeaddrinfo(res);
    return -1;
  }
  freeaddrinfo(res);
  return fd;
}

static int do_recv(int port, int sockbuf, size_t cap) {
  int srv = listen_on(port, sockbuf); /* the buffer size is inherited (window scale) */
  if (srv < 0) return 1;
  printf("ready\n");
  fflush(stdout);
  int fd = accept(srv, NULL, NULL);
  if (fd < 0) {
    perror("tcp_stream: accept");
    return 1;
  }
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
  int fd = connect_to(host, port, sockbuf);
  if (fd < 0) return 1;
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

static int do_ring(int port, const char *next_host, const char *next_port, double seconds,
                   size_t wbytes) {
  char line[16];
  int srv = listen_on(port, 0);
  if (srv < 0) return 1;
  printf("ready\n");
  fflush(stdout);
  if (fgets(line, sizeof line, stdin) == NULL) return 1; /* every host listens: go */
  int out = connect_to(next_host, next_port, 0);
  int in = accept(srv, NULL, NULL);
  char *wbuf = malloc(wbytes), *rbuf = malloc(wbytes);
  if (out < 0 || in < 0 || wbuf == NULL || rbuf == NULL) {
    perror("tcp_stream: ring set-up");
    return 1;
  }
  memset(wbuf, 0x5a, wbytes);
  fcntl(out, F_SETFL, fcntl(out, F_GETFL) | O_NONBLOCK);
  fcntl(in, F_SETFL, fcntl(in, F_GETFL) | O_NONBLOCK);
  long long total = 0;
  size_t off = 0;
  double t0 = 0, start = now_s();
  int sending = 1, receiving = 1;
  while (receiving) {
    /* Both ways without waiting, and poll() only when neither moved, as a
     * rank's loop does: a poll() before every call holds both back. */
    int moved = 0;
    ssize_t n = recv(in, rbuf, wbytes, 0);
    if (n < 0 && errno != EAGAIN) {
      perror("tcp_stream: recv");
      return 1;
    }
    if (n == 0) receiving = 0;
    if (n > 0) {
      if (total == 0) t0 = now_s();
      total += n;
      moved = 1;
    }
    if (sending) {
      n = send(out, wbuf + off, wbytes - off, MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN) {
        perror("tcp_stream: send");
        return 1;
      }
      if (n > 0) {
        off = (off + (size_t)n) % wbytes;
        moved = 1;
      }
      if (now_s() - start >= seconds) {
        shutdown(out, SHUT_WR); /* the next host reads to EOF */
        sending = 0;
      }
    }
    if (!moved && receiving) {
      struct pollfd p[2] = {{.fd = in, .events = POLLIN}, {.fd = out, .events = POLLOUT}};
      if (poll(p, sending ? 2 : 1, 1000) < 0) {
        perror("tcp_stream: poll");
        return 1;
      }
    }
  }
  printf("stream %lld %.9f\n", total, now_s() - t0);
  fflush(stdout);
  close(in);
  close(out);
  close(srv);
  free(wbuf);
  free(rbuf);
  return 0;
}

int main(int argc, char **argv) {
  if (argc >= 6 && strcmp(argv[1], "ring") == 0)
    return do_ring(atoi(argv[2]), argv[3], argv[4], atof(argv[5]),
                   argc > 6 ? (size_t)atoll(argv[6]) : (size_t)512 << 10);
  if (argc >= 3 && strcmp(argv[1], "recv") == 0)
    return do_recv(atoi(argv[2]), argc > 3 ? atoi(argv[3]) : 0,
                   argc > 4 ? (size_t)atoll(argv[4]) : (size_t)4 << 20);
  if (argc >= 5 && strcmp(argv[1], "send") == 0)
    return do_send(argv[2], argv[3], atof(argv[4]),
                   argc > 5 ? (size_t)atoll(argv[5]) : (size_t)4 << 20,
                   argc > 6 ? atoi(argv[6]) : 0);
  fprintf(stderr, "usage: tcp_stream recv PORT [SOCKBUF [READ]] | "
                  "tcp_stream ring PORT NEXT_HOST NEXT_PORT SECONDS [WRITE] | "
                  "tcp_stream send HOST PORT SECONDS [WRITE [SOCKBUF]]\n");
  return 2;
}
