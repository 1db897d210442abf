/* preauth.c - the rules every Ember server applies to connections that have
 * not authenticated yet (see preauth.h): the deadline and pool size read from
 * the environment in one place, the open-file limit, the client's retry when
 * a flooded server evicted its pending connection, and rate-limited
 * reporting of rejected peers. */
#include "preauth.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "ember/auth.h"
#include "ember/error.h"

/* A positive integer from the environment, or `fallback` when the variable is
 * unset, empty, not a number or out of [lo, hi].  A typo must not turn the
 * deadline off, so bad values are ignored rather than clamped. */
static uint64_t env_u64(const char *name, uint64_t lo, uint64_t hi, uint64_t fallback) {
  const char *v = getenv(name);
  char *end = NULL;
  if (v == NULL || *v == '\0' || *v < '0' || *v > '9') return fallback;
  errno = 0;
  unsigned long long n = strtoull(v, &end, 10);
  if (errno != 0 || *end != '\0' || n < lo || n > hi) return fallback;
  return (uint64_t)n;
}

uint32_t ember__preauth_timeout_ms(uint32_t configured) {
  if (configured != 0) return configured;
  return (uint32_t)env_u64("EMBER_PREAUTH_TIMEOUT_MS", 1, 3600000u,
                           EMBER__PREAUTH_DEFAULT_TIMEOUT_MS);
}

uint32_t ember__preauth_max_pending(uint32_t configured) {
  uint64_t n = configured != 0 ? configured
                               : env_u64("EMBER_PREAUTH_MAX_PENDING", 1, 1u << 20,
                                         EMBER__PREAUTH_DEFAULT_MAX_PENDING);
  /* Several servers share one process (a node runs the feed and the
   * collective): each may take at most a quarter of the descriptors, so a
   * flood of one port cannot starve another of them. */
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
      n > rl.rlim_cur / 4)
    n = rl.rlim_cur / 4;
  return n < 4 ? 4u : (uint32_t)n;
}

void ember__raise_fd_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  /* An unlimited hard limit still cannot exceed fs.nr_open (1 Mi by default). */
  rlim_t want = rl.rlim_max == RLIM_INFINITY ? (rlim_t)1 << 20 : rl.rlim_max;
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur >= want) return;
  if (rl.rlim_cur == RLIM_INFINITY) return;
  rl.rlim_cur = want;
  (void)setrlimit(RLIMIT_NOFILE, &rl);
}

int ember__connect_auth(const char *host, uint16_t port, const uint8_t *secret,
                        size_t secret_len, int64_t deadline_ms, int *out_fd) {
  int64_t backoff = 10;
  if (out_fd == NULL) return ember__set_error(EMBER_EINVAL, "connect_auth: out_fd is NULL");
  *out_fd = -1;
  for (;;) {
    int fd = -1;
    int rc = ember_net_connect(host, port, deadline_ms, &fd);
    if (rc != EMBER_OK) return rc;
    rc = ember_auth_client(fd, secret, secret_len, deadline_ms);
    if (rc == EMBER_OK) {
      *out_fd = fd;
      return EMBER_OK;
    }
    ember_net_close(fd);
    /* Only a close without a REFUSED is retried: the server never judged
     * our proof, it dropped a pending connection (flood, or out of fds). */
    if (rc != EMBER_ECLOSED || ember_now_ms() + backoff >= deadline_ms) return rc;
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)backoff * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    if (backoff < 200) backoff *= 2;
  }
}

/* ---------------------------------------------------------------- log */

/* 2997 -> "2,997": the counts are read by people scanning a log. */
static void fmt_count(uint64_t n, char *out, size_t cap) {
  char digits[32];
  int len = snprintf(digits, sizeof digits, "%llu", (unsigned long long)n);
  size_t o = 0;
  for (int i = 0; i < len && o + 2 < cap; i++) {
    if (i > 0 && (len - i) % 3 == 0) out[o++] = ',';
    out[o++] = digits[i];
  }
  out[o < cap ? o : cap - 1] = '\0';
}

void ember__reject_log_init(ember__reject_log *l, const char *what_fmt, ...) {
  va_list ap;
  memset(l, 0, sizeof *l);
  va_start(ap, what_fmt);
  vsnprintf(l->what, sizeof l->what, what_fmt, ap);
  va_end(ap);
  l->interval_ms = (int64_t)env_u64("EMBER_REJECT_LOG_INTERVAL_MS", 0, 86400000u,
                                    EMBER__REJECT_LOG_DEFAULT_INTERVAL_MS);
  l->last_line_ms = INT64_MIN;
}

int64_t ember__reject_due(const ember__reject_log *l) {
  if (l->count == 0) return INT64_MAX;
  if (l->last_line_ms == INT64_MIN) return INT64_MIN;
  return l->last_line_ms > INT64_MAX - l->interval_ms ? INT64_MAX
                                                      : l->last_line_ms + l->interval_ms;
}

static uint64_t take(ember__reject_log *l, int64_t now_ms, int force, char *out, size_t cap) {
  if (l->count == 0 || (!force && now_ms < ember__reject_due(l))) return 0;
  uint64_t n = l->count;
  if (n == 1) {
    snprintf(out, cap, "%s rejected an unauthenticated connection (%s)", l->what, l->last);
  } else {
    char num[40];
    fmt_count(n, num, sizeof num);
    int64_t span = now_ms - l->window_start_ms;
    long long secs = span < 1500 ? 1 : (long long)((span + 500) / 1000);
    snprintf(out, cap, "%s rejected %s unauthenticated connections in the last %lld s "
             "(last: %s)", l->what, num, secs, l->last);
  }
  l->count = 0;
  l->last_line_ms = now_ms;
  return n;
}

uint64_t ember__reject_take(ember__reject_log *l, int64_t now_ms, char *out, size_t cap) {
  return take(l, now_ms, 0, out, cap);
}

uint64_t ember__reject_flush(ember__reject_log *l, int64_t now_ms, char *out, size_t cap) {
  return take(l, now_ms, 1, out, cap);
}

uint64_t ember__reject_note(ember__reject_log *l, int64_t now_ms, const char *peer,
                            const char *reason, char *out, size_t cap) {
  if (l->count == 0) l->window_start_ms = now_ms;
  l->count++;
  l->total++;
  snprintf(l->last, sizeof l->last, "%s: %s", peer, reason);
  return ember__reject_take(l, now_ms, out, cap);
}

void ember__log_stderr(void *arg, const char *line) {
  char buf[1024];
  (void)arg;
  int n = snprintf(buf, sizeof buf, "[ember] %s\n", line);
  if (n < 0) return;
  size_t len = (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1;
  if (len > 0 && buf[len - 1] != '\n') buf[len - 1] = '\n'; /* truncated */
  /* One write(2): lines of several threads or processes do not interleave. */
  ssize_t w = write(STDERR_FILENO, buf, len);
  (void)w;
}

void ember__pool_push(ember__pool *p, ember__pool_link *link, void *owner) {
  link->owner = owner;
  link->prev = p->tail;
  link->next = NULL;
  if (p->tail) p->tail->next = link;
  else p->head = link;
  p->tail = link;
  link->in_pool = 1;
  p->n++;
}

void ember__pool_unlink(ember__pool *p, ember__pool_link *link) {
  if (!link->in_pool) return;
  if (link->prev) link->prev->next = link->next;
  else p->head = link->next;
  if (link->next) link->next->prev = link->prev;
  else p->tail = link->prev;
  link->prev = link->next = NULL;
  link->in_pool = 0;
  p->n--;
}

void *ember__pool_oldest(const ember__pool *p) {
  return p->head ? p->head->owner : NULL;
}
