/* tests/c/strangers.h - hostile peers for the servers' tests, on loopback:
 * idle connections that never send a byte, and slow ones ("slow loris") that
 * send a well-formed AUTH frame one byte per second, so they look alive but
 * never finish.  Header-only, like harness.h. */
#ifndef EMBER_TEST_STRANGERS_H
#define EMBER_TEST_STRANGERS_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>

#include "ember/net.h"
#include "ember/wire.h"
#include "harness.h"

/* Raises the soft open-file limit to the hard one and returns how many
 * strangers (each costs this process two descriptors when the server runs
 * in it too) fit beside `reserve` other descriptors, at most `want`. */
static inline int strangers_fit(int want, int reserve) {
  struct rlimit rl;
  CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY ? (rlim_t)1 << 20 : rl.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &rl);
    CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
  }
  long room = rl.rlim_cur == RLIM_INFINITY ? want : ((long)rl.rlim_cur - reserve) / 2;
  CHECK(room >= 16);
  return room < want ? (int)room : want;
}

/* A non-blocking connect to 127.0.0.1:port; the connection may still be in
 * progress (a full accept queue) when it returns. */
static inline int stranger_connect(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  CHECK(fd >= 0);
  struct sockaddr_in sa;
  memset(&sa, 0, sizeof sa);
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int rc = connect(fd, (struct sockaddr *)&sa, sizeof sa);
  CHECK(rc == 0 || errno == EINPROGRESS);
  return fd;
}

typedef struct {
  uint16_t port;
  int nidle, nslow;
  int *idle, *slow;
  pthread_t thread;
  int started;
  atomic_int stop;
  atomic_int slow_bytes; /* bytes the slow ones sent so far, each */
} strangers;

/* Opens n_idle idle and n_slow slow connections to port (no thread yet). */
static inline void strangers_open(strangers *st, uint16_t port, int n_idle, int n_slow) {
  memset(st, 0, sizeof *st);
  st->port = port;
  st->nidle = n_idle;
  st->nslow = n_slow;
  st->idle = calloc((size_t)n_idle + 1, sizeof *st->idle);
  st->slow = calloc((size_t)n_slow + 1, sizeof *st->slow);
  CHECK(st->idle && st->slow);
  for (int i = 0; i < n_slow; i++) st->slow[i] = stranger_connect(port);
  for (int i = 0; i < n_idle; i++) st->idle[i] = stranger_connect(port);
  atomic_init(&st->stop, 0);
  atomic_init(&st->slow_bytes, 0);
}

static inline void *strangers_loris(void *arg) {
  strangers *st = arg;
  uint8_t frame[EMBER_WIRE_HEADER_LEN + 64];
  memset(frame, 0x5a, sizeof frame);
  ember_wire_encode_header(frame, EMBER_MSG_AUTH, 64);
  for (int b = 0; b < (int)sizeof frame && !atomic_load(&st->stop); b++) {
    for (int i = 0; i < st->nslow; i++)
      (void)send(st->slow[i], frame + b, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    atomic_store(&st->slow_bytes, b + 1);
    for (int t = 0; t < 10 && !atomic_load(&st->stop); t++) {
      struct timespec ts = {0, 100 * 1000000L};
      nanosleep(&ts, NULL);
    }
  }
  return NULL;
}

/* Starts the thread that feeds the slow ones a byte per second. */
static inline void strangers_start(strangers *st) {
  CHECK(pthread_create(&st->thread, NULL, strangers_loris, st) == 0);
  st->started = 1;
}

/* Waits until each of fds[0..n) is readable (the server accepted it and
 * sent its CHALLENGE, or closed it) or timeout_ms passes; returns how many
 * are.  A client sees its connect complete even when the server's accept
 * queue overflowed, so readability is the sign that the server took it. */
static inline int strangers_wait_accepted(const int *fds, int n, int64_t timeout_ms) {
  struct pollfd *pfds = calloc((size_t)n + 1, sizeof *pfds);
  int done = 0;
  CHECK(pfds != NULL);
  for (int i = 0; i < n; i++) pfds[i] = (struct pollfd){fds[i], POLLIN, 0};
  int64_t deadline = ember_deadline_after(timeout_ms);
  for (;;) {
    (void)poll(pfds, (nfds_t)n, 0);
    done = 0;
    for (int i = 0; i < n; i++) done += pfds[i].revents != 0;
    if (done >= n || ember_now_ms() >= deadline) break;
    struct timespec ts = {0, 10 * 1000000L};
    nanosleep(&ts, NULL);
  }
  free(pfds);
  return done;
}

/* strangers_open, but in batches of 64, each accepted by the server before
 * the next is opened (until a batch is not accepted within 2 s), so that
 * every one of them reaches the server rather than a kernel queue.
 * Returns how many were seen accepted. */
static inline int strangers_open_paced(strangers *st, uint16_t port, int n_idle, int n_slow) {
  int accepted = 0, pacing = 1;
  memset(st, 0, sizeof *st);
  st->port = port;
  st->idle = calloc((size_t)n_idle + 1, sizeof *st->idle);
  st->slow = calloc((size_t)n_slow + 1, sizeof *st->slow);
  CHECK(st->idle && st->slow);
  for (int i = 0; i < n_slow; i++) st->slow[i] = stranger_connect(port);
  st->nslow = n_slow;
  if (n_slow > 0) accepted += strangers_wait_accepted(st->slow, n_slow, 2000);
  for (int i = 0; i < n_idle; i += 64) {
    int b = n_idle - i < 64 ? n_idle - i : 64;
    for (int k = 0; k < b; k++) st->idle[i + k] = stranger_connect(port);
    st->nidle = i + b;
    if (!pacing) continue;
    int got = strangers_wait_accepted(st->idle + i, b, 2000);
    accepted += got;
    if (got < b) pacing = 0;
  }
  atomic_init(&st->stop, 0);
  atomic_init(&st->slow_bytes, 0);
  return accepted;
}

/* 1 if the server closed (or reset) fd, 0 if it is still open. */
static inline int stranger_closed(int fd) {
  uint8_t buf[512];
  for (;;) {
    ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) continue; /* the CHALLENGE (or a REFUSED): read past it */
    if (n == 0) return 1;
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINPROGRESS ||
                   errno == ENOTCONN
               ? 0
               : 1;
  }
}

static inline void strangers_close(strangers *st) {
  if (st->started) {
    atomic_store(&st->stop, 1);
    pthread_join(st->thread, NULL);
  }
  for (int i = 0; i < st->nidle; i++) ember_net_close(st->idle[i]);
  for (int i = 0; i < st->nslow; i++) ember_net_close(st->slow[i]);
  free(st->idle);
  free(st->slow);
  memset(st, 0, sizeof *st);
}

/* Lines a server logged through its ember_log_fn, and the rejections they
 * cover ("rejected an unauthenticated ..." is 1, "rejected 2,997 ..." 2997). */
typedef struct {
  pthread_mutex_t mu;
  int lines;
  long long covered;
  char last[1024];
} log_capture;

static inline void log_capture_fn(void *arg, const char *line) {
  log_capture *lc = arg;
  long long n = 0;
  const char *p = strstr(line, " rejected ");
  if (p != NULL) {
    p += strlen(" rejected ");
    if (strncmp(p, "an ", 3) == 0) n = 1;
    for (; (*p >= '0' && *p <= '9') || *p == ','; p++)
      if (*p != ',') n = n * 10 + (*p - '0');
  }
  pthread_mutex_lock(&lc->mu);
  lc->lines++;
  lc->covered += n;
  snprintf(lc->last, sizeof lc->last, "%s", line);
  pthread_mutex_unlock(&lc->mu);
}

#endif /* EMBER_TEST_STRANGERS_H */
