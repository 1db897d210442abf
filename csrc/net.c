/* net.c - TCP sockets with deadlines and framed I/O.
 *
 * Every socket is non-blocking and close-on-exec from birth (SOCK_NONBLOCK |
 * SOCK_CLOEXEC, accept4), so a trainer forked later never inherits a control
 * connection, and "blocking" calls are loops of poll() bounded by an absolute
 * monotonic deadline: a silent peer costs a timeout, never a hang.  Sends use
 * MSG_NOSIGNAL so a dead peer is an error code, not a SIGPIPE. */
#include "ember/net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "ember/error.h"
#include "net_internal.h"

/* Peer names are "[v6addr]:port" at most ~56 bytes. */
#define EMBER__PEER_CAP 96

int64_t ember_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t ember_deadline_after(int64_t timeout_ms) {
  int64_t now = ember_now_ms();
  if (timeout_ms > 0 && timeout_ms > INT64_MAX - now) return INT64_MAX;
  return now + timeout_ms;
}

/* Milliseconds left until deadline, clamped to poll's int range; 0 if past. */
static int remaining_ms(int64_t deadline_ms) {
  int64_t left = deadline_ms - ember_now_ms();
  if (left <= 0) return 0;
  return left > INT_MAX ? INT_MAX : (int)left;
}

/* Waits until fd is ready for `events` or the deadline passes.  Returns
 * EMBER_OK when ready (including POLLERR/POLLHUP: the following syscall then
 * reports the precise error), EMBER_ETIMEDOUT, or EMBER_ESYS. */
static int wait_fd(int fd, short events, int64_t deadline_ms) {
  for (;;) {
    struct pollfd pfd = {.fd = fd, .events = events, .revents = 0};
    int ms = remaining_ms(deadline_ms);
    int rc = poll(&pfd, 1, ms);
    if (rc > 0) return EMBER_OK;
    if (rc == 0) {
      if (ms == 0 || ember_now_ms() >= deadline_ms) return EMBER_ETIMEDOUT;
      continue; /* woke early on a clamped timeout */
    }
    if (errno == EINTR) continue;
    return EMBER_ESYS;
  }
}

static void format_sockaddr(const struct sockaddr *sa, char *out, size_t cap) {
  char host[INET6_ADDRSTRLEN];
  if (cap == 0) return;
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
    if (inet_ntop(AF_INET, &in->sin_addr, host, sizeof host) == NULL) goto unknown;
    snprintf(out, cap, "%s:%u", host, (unsigned)ntohs(in->sin_port));
    return;
  }
  if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
    if (inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host) == NULL) goto unknown;
    snprintf(out, cap, "[%s]:%u", host, (unsigned)ntohs(in6->sin6_port));
    return;
  }
  if (sa->sa_family == AF_UNIX) { /* socketpairs in tests */
    snprintf(out, cap, "unix-socket");
    return;
  }
unknown:
  snprintf(out, cap, "?");
}

void ember_net_peer_name(int fd, char *out, size_t cap) {
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (out == NULL || cap == 0) return;
  if (fd < 0 || getpeername(fd, (struct sockaddr *)&ss, &sl) != 0) {
    snprintf(out, cap, "?");
    return;
  }
  format_sockaddr((const struct sockaddr *)&ss, out, cap);
}

void ember_net_local_addr(int fd, char *host, size_t cap, uint16_t *port) {
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (port != NULL) *port = 0;
  if (host != NULL && cap > 0) snprintf(host, cap, "?");
  if (fd < 0 || getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) return;
  if (ss.ss_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)&ss;
    if (host != NULL && cap > 0) inet_ntop(AF_INET, &in->sin_addr, host, (socklen_t)cap);
    if (port != NULL) *port = ntohs(in->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)&ss;
    if (host != NULL && cap > 0)
      inet_ntop(AF_INET6, &in6->sin6_addr, host, (socklen_t)cap);
    if (port != NULL) *port = ntohs(in6->sin6_port);
  }
}

void ember_net_close(int fd) {
  if (fd < 0) return;
  int saved = errno;
  close(fd);
  errno = saved;
}

/* <netinet/tcp.h> of older C libraries lacks it; the kernel's value. */
#ifdef TCP_RTO_MAX_MS
#define EMBER_TCP_RTO_MAX_MS TCP_RTO_MAX_MS
#else
#define EMBER_TCP_RTO_MAX_MS 44
#endif

int ember_net_tune(int fd) {
  int one = 1;
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
    return ember__set_errno(EMBER_ESYS, errno, "setsockopt(TCP_NODELAY)");
  if (setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one) != 0)
    return ember__set_errno(EMBER_ESYS, errno, "setsockopt(SO_KEEPALIVE)");
#ifdef TCP_KEEPIDLE
  /* Linux defaults (2 h idle) would notice a vanished host far too late; the
   * heartbeats are the primary detector, keepalive the backstop for a feed
   * connection that is idle between partitions. */
  int idle = 30, intvl = 10, cnt = 3;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
#endif
  /* TCP doubles its retransmission timeout after each loss, up to 120 s, so
   * a partition of a few seconds used to stall a connection for as long
   * again after it healed: long enough to miss a heartbeat timeout.  Capped
   * at the smallest value Linux takes (1 s, since 6.15; older kernels
   * refuse the option and keep their backoff), a healed link carries data
   * again within a second. */
  int rto_max_ms = 1000;
  (void)setsockopt(fd, IPPROTO_TCP, EMBER_TCP_RTO_MAX_MS, &rto_max_ms, sizeof rto_max_ms);
  return EMBER_OK;
}

/* ---------------------------------------------------------------- bind */

int ember_net_bind(const char *host, uint16_t port, int backlog, int flags,
                   int *out_fd, uint16_t *out_port) {
  struct addrinfo hints, *res = NULL;
  char service[8];
  int fd = -1, rc = EMBER_OK, last_errno = 0;
  const char *what = "socket";

  if (out_fd == NULL) return ember__set_error(EMBER_EINVAL, "net_bind: out_fd is NULL");
  *out_fd = -1;
  memset(&hints, 0, sizeof hints);
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  /* "All interfaces" is IPv4 0.0.0.0: Spark clusters address executors by
   * IPv4, and a dual-stack [::] socket interacts badly with SO_REUSEPORT
   * hand-offs to frameworks that bind 0.0.0.0. */
  hints.ai_family = (host == NULL || host[0] == '\0') ? AF_INET : AF_UNSPEC;
  snprintf(service, sizeof service, "%u", (unsigned)port);
  int gai = getaddrinfo((host == NULL || host[0] == '\0') ? NULL : host, service, &hints,
                        &res);
  if (gai != 0)
    return ember__set_error(EMBER_ENOTFOUND, "bind %s:%u: cannot resolve host: %s",
                            host ? host : "", (unsigned)port, gai_strerror(gai));

  for (struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                ai->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      what = "socket";
      continue;
    }
    int one = 1;
    /* SO_REUSEADDR lets a restarted driver rebind while old connections sit
     * in TIME_WAIT. */
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if ((flags & EMBER_NET_REUSEPORT) &&
        setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) != 0) {
      last_errno = errno;
      what = "setsockopt(SO_REUSEPORT)";
      ember_net_close(fd);
      fd = -1;
      continue;
    }
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
      last_errno = errno;
      what = "bind";
      ember_net_close(fd);
      fd = -1;
      continue;
    }
    break;
  }
  freeaddrinfo(res);
  if (fd < 0) {
    rc = ember__set_errno(EMBER_ESYS, last_errno, "%s %s:%u", what, host ? host : "",
                          (unsigned)port);
    goto fail;
  }
  if (backlog > 0 && listen(fd, backlog) != 0) {
    rc = ember__set_errno(EMBER_ESYS, errno, "listen on %s:%u", host ? host : "",
                          (unsigned)port);
    goto fail;
  }
  if (out_port != NULL) ember_net_local_addr(fd, NULL, 0, out_port);
  *out_fd = fd;
  return EMBER_OK;

fail:
  ember_net_close(fd);
  return rc;
}

int ember_net_listen_fd(int fd, int backlog) {
  if (fd < 0) return ember__set_error(EMBER_EINVAL, "listen: bad fd");
  if (listen(fd, backlog > 0 ? backlog : SOMAXCONN) != 0) {
    char host[64];
    uint16_t port;
    ember_net_local_addr(fd, host, sizeof host, &port);
    return ember__set_errno(EMBER_ESYS, errno, "listen on %s:%u", host, (unsigned)port);
  }
  return EMBER_OK;
}

/* ---------------------------------------------------------------- connect */

/* One connect attempt to one address.  Returns EMBER_OK with *out_fd, or a
 * code with *err_out = the errno that explains it (ECONNREFUSED is retried by
 * the caller). */
static int connect_once(const struct addrinfo *ai, int64_t deadline_ms, int *out_fd,
                        int *err_out) {
  *out_fd = -1;
  *err_out = 0;
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                  ai->ai_protocol);
  if (fd < 0) {
    *err_out = errno;
    return EMBER_ESYS;
  }
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS && errno != EINTR) {
      *err_out = errno;
      ember_net_close(fd);
      return EMBER_ESYS;
    }
    int rc = wait_fd(fd, POLLOUT, deadline_ms);
    if (rc != EMBER_OK) {
      *err_out = rc == EMBER_ETIMEDOUT ? ETIMEDOUT : errno;
      ember_net_close(fd);
      return rc;
    }
    int soerr = 0;
    socklen_t sl = sizeof soerr;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0) soerr = errno;
    if (soerr != 0) {
      *err_out = soerr;
      ember_net_close(fd);
      return EMBER_ESYS;
    }
  }
  *out_fd = fd;
  return EMBER_OK;
}

int ember_net_connect(const char *host, uint16_t port, int64_t deadline_ms,
                      int *out_fd) {
  struct addrinfo hints, *res = NULL;
  char service[8];
  int64_t start = ember_now_ms();
  int64_t backoff = 10;
  int last_err = 0;

  if (out_fd == NULL || host == NULL || host[0] == '\0')
    return ember__set_error(EMBER_EINVAL, "connect: host and out_fd are required");
  *out_fd = -1;
  memset(&hints, 0, sizeof hints);
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_family = AF_UNSPEC;
  /* No AI_ADDRCONFIG: on a host with only loopback up it hides 127.0.0.1. */
  hints.ai_flags = AI_NUMERICSERV;
  snprintf(service, sizeof service, "%u", (unsigned)port);

  for (;;) {
    /* getaddrinfo cannot take a deadline; a dotted address resolves without
     * I/O, and host names come from Spark, which has resolved them before. */
    int gai = getaddrinfo(host, service, &hints, &res);
    if (gai == EAI_AGAIN) {
      last_err = EAGAIN;
    } else if (gai != 0) {
      return ember__set_error(EMBER_ENOTFOUND, "connect to %s:%u: cannot resolve host: %s",
                              host, (unsigned)port, gai_strerror(gai));
    } else {
      int fatal = 0;
      for (struct addrinfo *ai = res; ai != NULL; ai = ai->ai_next) {
        int fd = -1, err = 0;
        int rc = connect_once(ai, deadline_ms, &fd, &err);
        if (rc == EMBER_OK) {
          freeaddrinfo(res);
          *out_fd = fd;
          return EMBER_OK;
        }
        last_err = err;
        if (rc == EMBER_ETIMEDOUT) break;
        /* Refused: the server may not be listening yet; try the next address,
         * then retry all of them after a backoff.  Anything else (no route,
         * out of fds) will not cure itself by waiting. */
        if (err != ECONNREFUSED && err != EINTR) {
          fatal = 1;
          break;
        }
      }
      freeaddrinfo(res);
      res = NULL;
      if (fatal)
        return ember__set_errno(EMBER_ESYS, last_err, "connect to %s:%u", host,
                                (unsigned)port);
    }
    int64_t now = ember_now_ms();
    if (now >= deadline_ms) break;
    int64_t nap = backoff < deadline_ms - now ? backoff : deadline_ms - now;
    struct timespec ts = {.tv_sec = nap / 1000, .tv_nsec = (long)(nap % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    if (backoff < 200) backoff *= 2;
  }
  char why[256];
  snprintf(why, sizeof why, "%s", last_err ? strerror(last_err) : "no address");
  return ember__set_error(EMBER_ETIMEDOUT, "connect to %s:%u: timed out after %lld ms (%s)",
                          host, (unsigned)port, (long long)(ember_now_ms() - start), why);
}

int ember_net_accept(int listen_fd, int64_t deadline_ms, int *out_fd) {
  if (out_fd == NULL) return ember__set_error(EMBER_EINVAL, "accept: out_fd is NULL");
  *out_fd = -1;
  for (;;) {
    int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      *out_fd = fd;
      return EMBER_OK;
    }
    /* A client that gave up while queued is not our failure: keep waiting. */
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return ember__set_errno(EMBER_ESYS, errno, "accept");
    int rc = wait_fd(listen_fd, POLLIN, deadline_ms);
    if (rc == EMBER_ETIMEDOUT) {
      char host[64];
      uint16_t port;
      ember_net_local_addr(listen_fd, host, sizeof host, &port);
      return ember__set_error(EMBER_ETIMEDOUT, "accept on %s:%u: timed out", host,
                              (unsigned)port);
    }
    if (rc != EMBER_OK) return ember__set_errno(rc, errno, "accept: poll");
  }
}

/* ---------------------------------------------------------------- send/recv */

/* Maps a send/recv errno to a status with a message naming the peer. */
static int io_error(int fd, const char *op, const char *dir, int err) {
  char peer[EMBER__PEER_CAP];
  ember_net_peer_name(fd, peer, sizeof peer);
  int code = (err == EPIPE || err == ECONNRESET || err == ENOTCONN) ? EMBER_ECLOSED
                                                                     : EMBER_EIO;
  return ember__set_errno(code, err, "%s %s %s", op, dir, peer);
}

static int io_timeout(int fd, const char *op, const char *dir, size_t done,
                      size_t total) {
  char peer[EMBER__PEER_CAP];
  ember_net_peer_name(fd, peer, sizeof peer);
  return ember__set_error(EMBER_ETIMEDOUT, "%s %s %s: timed out (%zu of %zu bytes)", op,
                          dir, peer, done, total);
}

int ember__iov_total(const struct iovec *iov, int iovcnt, size_t *total) {
  *total = 0;
  if (iovcnt < 0 || (iov == NULL && iovcnt > 0))
    return ember__set_error(EMBER_EINVAL, "sendv: bad iovec");
  for (int i = 0; i < iovcnt; i++) {
    if (iov[i].iov_len > SIZE_MAX - *total)
      return ember__set_error(EMBER_ETOOBIG, "sendv: total size overflows");
    *total += iov[i].iov_len;
  }
  return EMBER_OK;
}

int ember_net_sendv_all(int fd, struct iovec *iov, int iovcnt, int64_t deadline_ms) {
  size_t total = 0, done = 0;
  int rc = ember__iov_total(iov, iovcnt, &total);
  if (rc != EMBER_OK) return rc;
  while (iovcnt > 0 && iov[0].iov_len == 0) {
    iov++;
    iovcnt--;
  }
  while (iovcnt > 0) {
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    /* At most EMBER_NET_SEND_PIECE bytes a call (net.h), so the tail of a
     * long iovec waits for the next call. */
    size_t piece = 0, cut_len = 0;
    int cnt = 0, cut = -1;
    while (cnt < iovcnt && cnt < IOV_MAX && piece < EMBER_NET_SEND_PIECE) {
      if (iov[cnt].iov_len > EMBER_NET_SEND_PIECE - piece) {
        cut = cnt;
        cut_len = iov[cnt].iov_len;
        iov[cnt].iov_len = EMBER_NET_SEND_PIECE - piece;
      }
      piece += iov[cnt].iov_len;
      cnt++;
    }
    mh.msg_iov = iov;
    mh.msg_iovlen = (size_t)cnt;
    ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL);
    if (cut >= 0) iov[cut].iov_len = cut_len;
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        rc = wait_fd(fd, POLLOUT, deadline_ms);
        if (rc == EMBER_ETIMEDOUT) return io_timeout(fd, "send", "to", done, total);
        if (rc != EMBER_OK) return io_error(fd, "send", "to", errno);
        continue;
      }
      return io_error(fd, "send", "to", errno);
    }
    done += (size_t)n;
    ember__iov_advance(&iov, &iovcnt, (size_t)n);
  }
  return EMBER_OK;
}

int ember_net_send_all(int fd, const void *buf, size_t len, int64_t deadline_ms) {
  struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
  if (buf == NULL && len > 0) return ember__set_error(EMBER_EINVAL, "send: NULL buffer");
  return ember_net_sendv_all(fd, &iov, 1, deadline_ms);
}

int ember_net_recv_all(int fd, void *buf, size_t len, int64_t deadline_ms) {
  size_t done = 0;
  if (buf == NULL && len > 0) return ember__set_error(EMBER_EINVAL, "recv: NULL buffer");
  while (done < len) {
    ssize_t n = recv(fd, (char *)buf + done, len - done, 0);
    if (n > 0) {
      done += (size_t)n;
      continue;
    }
    if (n == 0) {
      char peer[EMBER__PEER_CAP];
      ember_net_peer_name(fd, peer, sizeof peer);
      return ember__set_error(EMBER_ECLOSED,
                              "recv from %s: connection closed by peer (%zu of %zu bytes)",
                              peer, done, len);
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      int rc = wait_fd(fd, POLLIN, deadline_ms);
      if (rc == EMBER_ETIMEDOUT) return io_timeout(fd, "recv", "from", done, len);
      if (rc != EMBER_OK) return io_error(fd, "recv", "from", errno);
      continue;
    }
    return io_error(fd, "recv", "from", errno);
  }
  return EMBER_OK;
}

int ember__frame_iov(uint8_t *hdr, uint16_t type, const void *payload, uint32_t len,
                     struct iovec iov[2], int *iovcnt) {
  if (payload == NULL && len > 0)
    return ember__set_error(EMBER_EINVAL, "send_frame: NULL payload");
  if (len > EMBER_WIRE_ABSOLUTE_MAX)
    return ember__set_error(EMBER_ETOOBIG, "send_frame: %s payload of %u bytes exceeds %u",
                            ember_wire_type_name(type), (unsigned)len,
                            (unsigned)EMBER_WIRE_ABSOLUTE_MAX);
  ember_wire_encode_header(hdr, type, len);
  iov[0].iov_base = hdr;
  iov[0].iov_len = EMBER_WIRE_HEADER_LEN;
  iov[1].iov_base = (void *)(uintptr_t)payload;
  iov[1].iov_len = len;
  *iovcnt = len > 0 ? 2 : 1;
  return EMBER_OK;
}

int ember_net_send_frame(int fd, uint16_t type, const void *payload, uint32_t len,
                         int64_t deadline_ms) {
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
  struct iovec iov[2];
  int n = 0;
  int rc = ember__frame_iov(hdr, type, payload, len, iov, &n);
  return rc != EMBER_OK ? rc : ember_net_sendv_all(fd, iov, n, deadline_ms);
}

int ember_net_recv_frame(int fd, uint32_t max_payload, ember_frame_header *hdr,
                         uint8_t **payload, int64_t deadline_ms) {
  uint8_t h[EMBER_WIRE_HEADER_LEN];
  uint8_t *buf = NULL;
  int rc;
  if (hdr == NULL || payload == NULL)
    return ember__set_error(EMBER_EINVAL, "recv_frame: NULL argument");
  *payload = NULL;
  rc = ember_net_recv_all(fd, h, sizeof h, deadline_ms);
  if (rc != EMBER_OK) return rc;
  /* The length is checked here, before a byte of payload is read or a byte
   * of memory is allocated for it. */
  rc = ember_wire_decode_header(h, sizeof h, max_payload, hdr);
  if (rc != EMBER_OK) {
    char peer[EMBER__PEER_CAP];
    ember_net_peer_name(fd, peer, sizeof peer);
    return ember__set_error(rc, "recv from %s: %s", peer, ember_last_error());
  }
  if (hdr->length > 0) {
    buf = malloc(hdr->length);
    if (buf == NULL)
      return ember__set_error(EMBER_ENOMEM, "recv_frame: out of memory (%u bytes)",
                              (unsigned)hdr->length);
    rc = ember_net_recv_all(fd, buf, hdr->length, deadline_ms);
    if (rc != EMBER_OK) {
      free(buf);
      return rc;
    }
  }
  *payload = buf;
  return EMBER_OK;
}
