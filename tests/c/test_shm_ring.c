/* test_shm_ring.c - the shared-memory SPSC ring: sizes and wrap-around,
 * back-pressure and deadlines, markers, early exits and killed peers (in
 * forked processes), cleanup, permissions, hostile positions. */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/stat.h>
#include <time.h>

#include "ember/net.h"
#include "ember/shm_ring.h"
#include "harness.h"

#if defined(__SANITIZE_ADDRESS__)
#define RING_TEST_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define RING_TEST_LSAN 1
#endif
#endif
#ifdef RING_TEST_LSAN
#include <sanitizer/lsan_interface.h>
#define LEAK_CHECK() CHECK(__lsan_do_recoverable_leak_check() == 0)
#else
#define LEAK_CHECK() ((void)0)
#endif

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Byte k of message `seq`: a pattern that differs per message and offset. */
static uint8_t pat(uint64_t seq, uint64_t k) { return (uint8_t)(seq * 131u + k * 7u + (k >> 8)); }

static void fill(uint8_t *p, uint64_t seq, size_t n) {
  for (size_t k = 0; k < n; k++) p[k] = pat(seq, k);
}

static int check_pattern(const uint8_t *p, uint64_t seq, size_t n) {
  for (size_t k = 0; k < n; k++)
    if (p[k] != pat(seq, k)) return 0;
  return 1;
}

/* Odd sizes from 0 up to ~2.5x the ring (so some are split). */
static size_t size_of(uint64_t seq, size_t cap) {
  uint64_t x = seq * 2654435761u;
  switch (seq % 5) {
    case 0: return (size_t)(x % 17);
    case 1: return (size_t)(x % 4099);
    case 2: return (size_t)(x % (cap / 3)) | 1u;
    case 3: return seq % 10 == 3 ? cap * 2 + 13 : (size_t)(x % 1000) + 3;
    default: return (size_t)(x % (cap - 16)) + 1;
  }
}

/* Number of /dev/shm entries (memfd rings must never add one). */
static int dev_shm_entries(void) {
  DIR *d = opendir("/dev/shm");
  struct dirent *e;
  int n = 0;
  if (d == NULL) return 0;
  while ((e = readdir(d)) != NULL)
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
  closedir(d);
  return n;
}

/* 1 if this process still maps or holds an ember ring memfd. */
static int ring_memfd_in_process(void) {
  char line[512];
  FILE *f = fopen("/proc/self/maps", "r");
  int found = 0;
  DIR *d;
  struct dirent *e;
  CHECK(f != NULL);
  while (fgets(line, sizeof line, f))
    if (strstr(line, "memfd:ember-ring")) found = 1;
  fclose(f);
  d = opendir("/proc/self/fd");
  CHECK(d != NULL);
  while ((e = readdir(d)) != NULL) {
    char path[300], target[256];
    ssize_t n;
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    n = readlink(path, target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (strstr(target, "memfd:ember-ring")) found = 1;
  }
  closedir(d);
  return found;
}

static ember_shm_ring *attach_peer(ember_shm_ring *r, ember_shm_role role) {
  ember_shm_ring_desc d;
  ember_shm_ring *p = NULL;
  ember_shm_ring_describe(r, &d);
  CHECK_OK(ember_shm_ring_attach(&p, &d, role));
  return p;
}

static double thread_cpu_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ------------------------------------------------------------ tests */

TEST(create_mode_seals_and_limits) {
  ember_shm_ring *r = NULL;
  struct stat st;
  int before = dev_shm_entries(), seals;
  CHECK_EQ_INT(ember_shm_ring_create(&r, 1000, EMBER_SHM_PRODUCER), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "capacity 1000") != NULL);
  CHECK_EQ_INT(ember_shm_ring_create(&r, (size_t)EMBER_SHM_RING_MAX_BYTES + 1, EMBER_SHM_PRODUCER),
               EMBER_EINVAL);
  CHECK_OK(ember_shm_ring_create(&r, 100000, EMBER_SHM_CONSUMER));
  CHECK_EQ_INT(ember_shm_ring_capacity(r) % 4096, 0);
  CHECK(ember_shm_ring_capacity(r) >= 100000);
  CHECK_EQ_INT(ember_shm_ring_max_record(r), ember_shm_ring_capacity(r) - 16);
  CHECK_OK(fstat(ember_shm_ring_fd(r), &st));
  CHECK_EQ_INT(st.st_mode & 07777, 0600);
  CHECK_EQ_INT(st.st_uid, geteuid());
  seals = fcntl(ember_shm_ring_fd(r), F_GET_SEALS);
  CHECK(seals >= 0 && (seals & F_SEAL_SHRINK) && (seals & F_SEAL_GROW) && (seals & F_SEAL_SEAL));
  CHECK(ftruncate(ember_shm_ring_fd(r), 4096) != 0); /* the peer cannot shrink it */
  CHECK(!ember_shm_ring_attached(r));
  CHECK_EQ_INT(dev_shm_entries(), before);
  CHECK(ring_memfd_in_process());
  ember_shm_ring_destroy(r);
  CHECK(!ring_memfd_in_process());
  ember_shm_ring_destroy(NULL);
  LEAK_CHECK();
}

TEST(attach_checks_the_descriptor) {
  ember_shm_ring *r = NULL, *p = NULL, *c2 = NULL;
  ember_shm_ring_desc d, bad;
  CHECK_OK(ember_shm_ring_create(&r, 65536, EMBER_SHM_CONSUMER));
  ember_shm_ring_describe(r, &d);
  bad = d;
  bad.token[5] ^= 1;
  CHECK_EQ_INT(ember_shm_ring_attach(&p, &bad, EMBER_SHM_PRODUCER), EMBER_ENOTFOUND);
  CHECK(strstr(ember_last_error(), "token") != NULL);
  bad = d;
  bad.fd = 0; /* stdin: not a sealed memfd */
  CHECK_EQ_INT(ember_shm_ring_attach(&p, &bad, EMBER_SHM_PRODUCER), EMBER_ENOTFOUND);
  bad = d;
  bad.pid = 0x7ffffff0; /* no such process */
  CHECK_EQ_INT(ember_shm_ring_attach(&p, &bad, EMBER_SHM_PRODUCER), EMBER_ENOTFOUND);
  CHECK(strstr(ember_last_error(), "cannot open /proc/") != NULL);
  bad = d;
  bad.size += 4096;
  CHECK_EQ_INT(ember_shm_ring_attach(&p, &bad, EMBER_SHM_PRODUCER), EMBER_ENOTFOUND);
  bad = d;
  bad.size = 3;
  CHECK_EQ_INT(ember_shm_ring_attach(&p, &bad, EMBER_SHM_PRODUCER), EMBER_EINVAL);
  CHECK_EQ_INT(ember_shm_ring_attach(&p, &d, EMBER_SHM_CONSUMER), EMBER_EINVAL);
  CHECK(p == NULL);
  CHECK_OK(ember_shm_ring_attach(&p, &d, EMBER_SHM_PRODUCER));
  CHECK(ember_shm_ring_attached(r) && ember_shm_ring_attached(p));
  CHECK_EQ_INT(ember_shm_ring_attach(&c2, &d, EMBER_SHM_PRODUCER), EMBER_ESTATE);
  CHECK(strstr(ember_last_error(), "already has a producer") != NULL);
  /* wrong-end calls */
  {
    ember_shm_msg m;
    void *w = NULL;
    CHECK_EQ_INT(ember_shm_ring_next(p, &m, 0, 0), EMBER_ESTATE);
    CHECK_EQ_INT(ember_shm_ring_reserve(r, 8, &w, 0), EMBER_ESTATE);
    CHECK_EQ_INT(ember_shm_ring_commit(p, 0), EMBER_ESTATE); /* nothing reserved */
    CHECK_EQ_INT(ember_shm_ring_read(r, NULL, 0, 0), EMBER_ESTATE); /* no current message */
  }
  ember_shm_ring_destroy(p);
  ember_shm_ring_destroy(r);
  LEAK_CHECK();
}

typedef struct {
  ember_shm_ring *r;
  uint64_t n;
  int rc;
  char msg[512];
} side_args;

/* Sends n messages of size_of(seq), alternating reserve/commit (when it
 * fits one record) and sendv in three pieces, then END. */
static void *odd_producer(void *arg) {
  side_args *a = arg;
  size_t cap = ember_shm_ring_capacity(a->r);
  uint8_t *tmp = malloc(cap * 3);
  CHECK(tmp != NULL);
  for (uint64_t seq = 0; seq < a->n && a->rc == 0; seq++) {
    size_t n = size_of(seq, cap);
    if (seq % 2 == 0 && n <= ember_shm_ring_max_record(a->r)) {
      void *w = NULL;
      a->rc = ember_shm_ring_reserve(a->r, n + 100, &w, 10000);
      if (a->rc == 0) {
        CHECK(((uintptr_t)w % 16) == 0);
        fill(w, seq, n);
        a->rc = ember_shm_ring_commit(a->r, n); /* less than reserved */
      }
    } else {
      struct iovec v[3];
      fill(tmp, seq, n);
      v[0] = (struct iovec){tmp, n / 3};
      v[1] = (struct iovec){tmp + n / 3, 0};
      v[2] = (struct iovec){tmp + n / 3, n - n / 3};
      a->rc = ember_shm_ring_sendv(a->r, v, 3, 10000);
    }
  }
  if (a->rc == 0) a->rc = ember_shm_ring_end(a->r, 10000);
  if (a->rc) snprintf(a->msg, sizeof a->msg, "%s", ember_last_error());
  free(tmp);
  return NULL;
}

TEST(wraparound_odd_sizes_and_split_messages) {
  ember_shm_ring *c = NULL, *p;
  side_args a = {0};
  pthread_t t;
  size_t cap;
  uint8_t *buf;
  uint64_t seq = 0, split = 0, zero_copy = 0;
  CHECK_OK(ember_shm_ring_create(&c, 65536, EMBER_SHM_CONSUMER));
  p = attach_peer(c, EMBER_SHM_PRODUCER);
  cap = ember_shm_ring_capacity(c);
  buf = malloc(cap * 3);
  a.r = p;
  a.n = 3000; /* ~100 laps of the ring */
  CHECK(pthread_create(&t, NULL, odd_producer, &a) == 0);
  for (;;) {
    ember_shm_msg m;
    CHECK_OK(ember_shm_ring_next(c, &m, 0, 10000));
    if (m.kind == EMBER_SHM_MSG_END) break;
    CHECK_EQ_INT(m.kind, EMBER_SHM_MSG_DATA);
    CHECK_EQ_INT(m.len, size_of(seq, cap));
    if (m.data != NULL && seq % 3 == 0) {
      /* zero-copy view of a one-record message */
      CHECK(check_pattern(m.data, seq, m.len));
      CHECK_OK(ember_shm_ring_release(c, 1000));
      zero_copy++;
    } else {
      if (m.data == NULL) split++;
      CHECK_OK(ember_shm_ring_read(c, buf, cap * 3, 10000));
      if (!check_pattern(buf, seq, m.len)) {
        fprintf(stderr, "message %llu (%zu bytes) differs\n", (unsigned long long)seq, m.len);
        CHECK(0);
      }
    }
    seq++;
  }
  pthread_join(t, NULL);
  if (a.rc) fprintf(stderr, "producer: %s\n", a.msg);
  CHECK_OK(a.rc);
  CHECK_EQ_INT(seq, a.n);
  CHECK(split > 0 && zero_copy > 0);
  /* END is final */
  {
    ember_shm_msg m;
    CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
    CHECK_EQ_INT(m.kind, EMBER_SHM_MSG_END);
  }
  free(buf);
  ember_shm_ring_destroy(p);
  ember_shm_ring_destroy(c);
  LEAK_CHECK();
}

TEST(full_ring_blocks_then_times_out) {
  ember_shm_ring *p = NULL, *c;
  uint8_t chunk[20000];
  int n = 0, rc;
  int64_t t0;
  ember_shm_msg m;
  void *w = NULL;
  CHECK_OK(ember_shm_ring_create(&p, 65536, EMBER_SHM_PRODUCER));
  c = attach_peer(p, EMBER_SHM_CONSUMER);
  memset(chunk, 7, sizeof chunk);
  while ((rc = ember_shm_ring_send(p, chunk, sizeof chunk, 0)) == EMBER_OK) n++;
  CHECK_EQ_INT(rc, EMBER_ETIMEDOUT);
  CHECK_EQ_INT(n, 3); /* 3 x (20000 + 16, padded) fit in 64 KiB, a 4th does not */
  t0 = ember_now_ms();
  CHECK_EQ_INT(ember_shm_ring_reserve(p, sizeof chunk, &w, 250), EMBER_ETIMEDOUT);
  CHECK(ember_now_ms() - t0 >= 240);
  CHECK(ember_now_ms() - t0 < 2000);
  CHECK(strstr(ember_last_error(), "no room in the ring") != NULL);
  /* the reservation is not lost to a timeout: consume one, then it fits */
  CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
  CHECK_OK(ember_shm_ring_release(c, 0));
  CHECK_OK(ember_shm_ring_reserve(p, sizeof chunk, &w, 0));
  /* oversize reservations are rejected with the sizes named */
  CHECK_EQ_INT(ember_shm_ring_reserve(p, 65536, &w, 0), EMBER_ETOOBIG);
  CHECK(strstr(ember_last_error(), "65536 bytes does not fit") != NULL);
  CHECK(strstr(ember_last_error(), "at most 65520") != NULL);
  /* the consumer's limit on message sizes */
  CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
  ember_shm_ring_destroy(c);
  ember_shm_ring_destroy(p);
  CHECK_OK(ember_shm_ring_create(&p, 65536, EMBER_SHM_PRODUCER));
  c = attach_peer(p, EMBER_SHM_CONSUMER);
  CHECK_OK(ember_shm_ring_send(p, chunk, 1000, 0));
  CHECK_EQ_INT(ember_shm_ring_next(c, &m, 999, 0), EMBER_ETOOBIG);
  CHECK(strstr(ember_last_error(), "1000 bytes exceeds the consumer's limit of 999") != NULL);
  ember_shm_ring_destroy(c);
  ember_shm_ring_destroy(p);
  LEAK_CHECK();
}

typedef struct {
  ember_shm_ring *r;
  int64_t blocked_ms;
  int rc;
} blocked_args;

static void *blocked_sender(void *arg) {
  blocked_args *a = arg;
  uint8_t chunk[30000] = {1};
  int64_t t0 = ember_now_ms();
  a->rc = ember_shm_ring_send(a->r, chunk, sizeof chunk, 10000);
  a->blocked_ms = ember_now_ms() - t0;
  return NULL;
}

TEST(blocked_producer_wakes_on_release_without_spinning) {
  ember_shm_ring *p = NULL, *c;
  uint8_t chunk[30000] = {2};
  blocked_args a = {0};
  pthread_t t;
  ember_shm_msg m;
  double cpu0;
  int64_t t0;
  CHECK_OK(ember_shm_ring_create(&p, 65536, EMBER_SHM_PRODUCER));
  c = attach_peer(p, EMBER_SHM_CONSUMER);
  CHECK_OK(ember_shm_ring_send(p, chunk, sizeof chunk, 0));
  CHECK_OK(ember_shm_ring_send(p, chunk, sizeof chunk, 0));
  a.r = p;
  CHECK(pthread_create(&t, NULL, blocked_sender, &a) == 0);
  sleep_ms(300);
  CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
  CHECK_OK(ember_shm_ring_release(c, 0));
  pthread_join(t, NULL);
  CHECK_OK(a.rc);
  CHECK(a.blocked_ms >= 250);
  CHECK(a.blocked_ms < 2000);
  /* drain, then an idle consumer sleeps in the kernel rather than spin */
  for (int i = 0; i < 2; i++) {
    CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
    CHECK_OK(ember_shm_ring_release(c, 0));
  }
  cpu0 = thread_cpu_ms();
  t0 = ember_now_ms();
  CHECK_EQ_INT(ember_shm_ring_next(c, &m, 0, 600), EMBER_ETIMEDOUT);
  CHECK(ember_now_ms() - t0 >= 590);
  CHECK(thread_cpu_ms() - cpu0 < 60.0);
  ember_shm_ring_destroy(c);
  ember_shm_ring_destroy(p);
  LEAK_CHECK();
}

TEST(end_and_error_markers) {
  ember_shm_ring *p = NULL, *c;
  ember_shm_msg m;
  void *w = NULL;
  char longr[2000];
  CHECK_OK(ember_shm_ring_create(&p, 65536, EMBER_SHM_PRODUCER));
  c = attach_peer(p, EMBER_SHM_CONSUMER);
  for (int i = 0; i < 3; i++) CHECK_OK(ember_shm_ring_send(p, "abc", 3, 0));
  CHECK_OK(ember_shm_ring_fail(p, EMBER_EIO, "partition 4: disk\ngone", 0));
  CHECK_EQ_INT(ember_shm_ring_send(p, "x", 1, 0), EMBER_ESTATE);
  CHECK_EQ_INT(ember_shm_ring_end(p, 0), EMBER_ESTATE);
  for (int i = 0; i < 3; i++) {
    char b[3];
    CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
    CHECK_EQ_INT(m.kind, EMBER_SHM_MSG_DATA);
    CHECK_OK(ember_shm_ring_read(c, b, sizeof b, 0));
    CHECK(memcmp(b, "abc", 3) == 0);
  }
  for (int i = 0; i < 2; i++) { /* sticky */
    CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
    CHECK_EQ_INT(m.kind, EMBER_SHM_MSG_ERROR);
    CHECK_EQ_INT(m.code, EMBER_EIO);
    CHECK(strcmp(m.reason, "partition 4: disk?gone") == 0);
  }
  CHECK_EQ_INT(ember_shm_ring_release(c, 0), EMBER_ESTATE);
  ember_shm_ring_destroy(c);
  ember_shm_ring_destroy(p);
  /* a long reason is cut, an END after data */
  CHECK_OK(ember_shm_ring_create(&p, 65536, EMBER_SHM_PRODUCER));
  c = attach_peer(p, EMBER_SHM_CONSUMER);
  memset(longr, 'r', sizeof longr - 1);
  longr[sizeof longr - 1] = '\0';
  CHECK_OK(ember_shm_ring_reserve(p, 0, &w, 0));
  CHECK_OK(ember_shm_ring_commit(p, 0)); /* an empty message */
  CHECK_OK(ember_shm_ring_fail(p, EMBER_ESCHEMA, longr, 0));
  CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
  CHECK_EQ_INT(m.len, 0);
  CHECK_OK(ember_shm_ring_read(c, NULL, 0, 0));
  CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
  CHECK_EQ_INT(m.kind, EMBER_SHM_MSG_ERROR);
  CHECK_EQ_INT(strlen(m.reason), EMBER_SHM_RING_REASON_MAX);
  ember_shm_ring_destroy(c);
  ember_shm_ring_destroy(p);
  LEAK_CHECK();
}

TEST(producer_close_without_end_is_reported_after_the_data) {
  ember_shm_ring *p = NULL, *c;
  ember_shm_msg m;
  uint8_t big[150000];
  CHECK_OK(ember_shm_ring_create(&c, 65536, EMBER_SHM_CONSUMER));
  p = attach_peer(c, EMBER_SHM_PRODUCER);
  CHECK_OK(ember_shm_ring_send(p, "last", 4, 0));
  /* half of a split message, then the producer goes away */
  memset(big, 3, sizeof big);
  CHECK_EQ_INT(ember_shm_ring_send(p, big, sizeof big, 50), EMBER_ETIMEDOUT);
  ember_shm_ring_destroy(p);
  CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
  CHECK_EQ_INT(m.len, 4);
  CHECK_OK(ember_shm_ring_release(c, 0));
  CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
  CHECK_EQ_INT(m.len, sizeof big);
  CHECK(m.data == NULL);
  CHECK_EQ_INT(ember_shm_ring_release(c, 1000), EMBER_ECLOSED);
  CHECK(strstr(ember_last_error(), "the producer closed the ring") != NULL);
  ember_shm_ring_destroy(c);
  LEAK_CHECK();
}

TEST(consumer_closes_early_producer_gets_error) {
  ember_shm_ring *p = NULL, *c;
  blocked_args a = {0};
  pthread_t t;
  uint8_t chunk[30000] = {0};
  CHECK_OK(ember_shm_ring_create(&p, 65536, EMBER_SHM_PRODUCER));
  c = attach_peer(p, EMBER_SHM_CONSUMER);
  CHECK_OK(ember_shm_ring_send(p, chunk, sizeof chunk, 0));
  CHECK_OK(ember_shm_ring_send(p, chunk, sizeof chunk, 0));
  a.r = p;
  CHECK(pthread_create(&t, NULL, blocked_sender, &a) == 0);
  sleep_ms(200);
  ember_shm_ring_destroy(c); /* the consumer leaves without reading */
  pthread_join(t, NULL);
  CHECK_EQ_INT(a.rc, EMBER_ECLOSED);
  CHECK(a.blocked_ms < 1000);
  CHECK_EQ_INT(ember_shm_ring_send(p, chunk, 10, 0), EMBER_ECLOSED);
  CHECK(strstr(ember_last_error(), "the consumer closed the ring") != NULL);
  ember_shm_ring_destroy(p);
  LEAK_CHECK();
}

typedef struct {
  ember_shm_ring *r;
  int rc;
  int64_t waited_ms;
} waiter_args;

static void *blocked_consumer(void *arg) {
  waiter_args *a = arg;
  ember_shm_msg m;
  int64_t t0 = ember_now_ms();
  a->rc = ember_shm_ring_next(a->r, &m, 0, 10000);
  a->waited_ms = ember_now_ms() - t0;
  return NULL;
}

TEST(close_wakes_our_own_blocked_thread) {
  ember_shm_ring *c = NULL, *p;
  waiter_args a = {0};
  pthread_t t;
  CHECK_OK(ember_shm_ring_create(&c, 65536, EMBER_SHM_CONSUMER));
  p = attach_peer(c, EMBER_SHM_PRODUCER);
  a.r = c;
  CHECK(pthread_create(&t, NULL, blocked_consumer, &a) == 0);
  sleep_ms(200);
  ember_shm_ring_close(c); /* from another thread, e.g. a server shutting down */
  pthread_join(t, NULL);
  CHECK_EQ_INT(a.rc, EMBER_ECLOSED);
  CHECK(a.waited_ms < 1000);
  /* and the producer hears about it */
  CHECK_EQ_INT(ember_shm_ring_send(p, "x", 1, 0), EMBER_ECLOSED);
  ember_shm_ring_destroy(p);
  ember_shm_ring_destroy(c);
  LEAK_CHECK();
}

/* Child process bodies for the fork tests: they attach through /proc like
 * a real peer, then behave as told. */
static void child_consumer_reads_one_then(int how, const ember_shm_ring_desc *d) {
  ember_shm_ring *c = NULL;
  ember_shm_msg m;
  if (ember_shm_ring_attach(&c, d, EMBER_SHM_CONSUMER) != EMBER_OK) _exit(3);
  if (ember_shm_ring_next(c, &m, 0, 5000) != EMBER_OK) _exit(4);
  if (ember_shm_ring_release(c, 5000) != EMBER_OK) _exit(5);
  if (how == 0) _exit(0); /* exits without closing: the kernel drops its lock */
  for (;;) pause();       /* waits to be killed */
}

TEST(consumer_process_exits_early_producer_gets_error) {
  ember_shm_ring *p = NULL;
  ember_shm_ring_desc d;
  uint8_t chunk[30000] = {0};
  int status = 0, rc = EMBER_OK;
  pid_t pid;
  int64_t t0;
  CHECK_OK(ember_shm_ring_create(&p, 65536, EMBER_SHM_PRODUCER));
  ember_shm_ring_describe(p, &d);
  pid = fork();
  if (pid == 0) {
    close(ember_shm_ring_fd(p)); /* do not keep the parent's lock alive */
    child_consumer_reads_one_then(0, &d);
  }
  t0 = ember_now_ms();
  for (int i = 0; i < 10 && rc == EMBER_OK; i++) rc = ember_shm_ring_send(p, chunk, sizeof chunk, 5000);
  CHECK_EQ_INT(rc, EMBER_ECLOSED);
  CHECK(strstr(ember_last_error(), "the consumer process is gone") != NULL);
  CHECK(ember_now_ms() - t0 < 3000);
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ember_shm_ring_destroy(p);
  CHECK(!ring_memfd_in_process());
  LEAK_CHECK();
}

TEST(killed_peers_leave_nothing_behind) {
  int before = dev_shm_entries();
  /* 1. a consumer SIGKILLed while the producer waits for room */
  {
    ember_shm_ring *p = NULL;
    ember_shm_ring_desc d;
    uint8_t chunk[30000] = {0};
    int status = 0, rc = EMBER_OK;
    pid_t pid;
    CHECK_OK(ember_shm_ring_create(&p, 65536, EMBER_SHM_PRODUCER));
    ember_shm_ring_describe(p, &d);
    pid = fork();
    if (pid == 0) {
      close(ember_shm_ring_fd(p));
      child_consumer_reads_one_then(1, &d);
    }
    CHECK_OK(ember_shm_ring_send(p, chunk, 100, 5000));
    for (int i = 0; i < 200 && !ember_shm_ring_attached(p); i++) sleep_ms(10);
    CHECK(ember_shm_ring_attached(p));
    CHECK_EQ_INT(dev_shm_entries(), before); /* mapped by both: nothing named */
    sleep_ms(100);
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status));
    for (int i = 0; i < 10 && rc == EMBER_OK; i++) rc = ember_shm_ring_send(p, chunk, sizeof chunk, 5000);
    CHECK_EQ_INT(rc, EMBER_ECLOSED);
    CHECK(strstr(ember_last_error(), "the consumer process is gone") != NULL);
    ember_shm_ring_destroy(p);
  }
  /* 2. a producer SIGKILLed in the middle of a split message */
  {
    ember_shm_ring *c = NULL;
    ember_shm_ring_desc d;
    ember_shm_msg m;
    int status = 0;
    pid_t pid;
    CHECK_OK(ember_shm_ring_create(&c, 65536, EMBER_SHM_CONSUMER));
    ember_shm_ring_describe(c, &d);
    pid = fork();
    if (pid == 0) {
      ember_shm_ring *p = NULL;
      static uint8_t big[200000];
      close(ember_shm_ring_fd(c));
      if (ember_shm_ring_attach(&p, &d, EMBER_SHM_PRODUCER) != EMBER_OK) _exit(3);
      (void)ember_shm_ring_send(p, big, sizeof big, 60000); /* blocks half-way */
      _exit(4);
    }
    CHECK_OK(ember_shm_ring_next(c, &m, 0, 5000));
    CHECK_EQ_INT(m.len, 200000);
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status));
    CHECK_EQ_INT(ember_shm_ring_release(c, 5000), EMBER_ECLOSED);
    CHECK(strstr(ember_last_error(), "the producer process is gone") != NULL);
    ember_shm_ring_destroy(c);
  }
  CHECK_EQ_INT(dev_shm_entries(), before);
  CHECK(!ring_memfd_in_process());
  LEAK_CHECK();
}

TEST(hostile_positions_and_records_are_rejected) {
  ember_shm_ring *c = NULL, *p;
  ember_shm_msg m;
  uint64_t *head;
  uint8_t *raw;
  size_t len = 0, hdr;
  CHECK_OK(ember_shm_ring_create(&c, 65536, EMBER_SHM_CONSUMER));
  p = attach_peer(c, EMBER_SHM_PRODUCER);
  raw = ember__shm_ring_raw(p, &len);
  hdr = len - ember_shm_ring_capacity(p);
  head = (uint64_t *)(void *)(raw + 64); /* the shared head word */
  CHECK_OK(ember_shm_ring_send(p, "abcd", 4, 0));
  CHECK_EQ_INT(*head, 32);
  /* a record header claiming more bytes than published */
  raw[hdr] = 0xff;
  raw[hdr + 1] = 0xff;
  CHECK_EQ_INT(ember_shm_ring_next(c, &m, 0, 0), EMBER_ECORRUPT);
  CHECK(strstr(ember_last_error(), "claims 65535 bytes") != NULL);
  raw[hdr] = 4;
  raw[hdr + 1] = 0;
  raw[hdr + 4] = 9; /* unknown type */
  CHECK_EQ_INT(ember_shm_ring_next(c, &m, 0, 0), EMBER_ECORRUPT);
  CHECK(strstr(ember_last_error(), "unknown type 9") != NULL);
  raw[hdr + 4] = 1;
  *head = 1u << 30; /* a head beyond the capacity */
  CHECK_EQ_INT(ember_shm_ring_next(c, &m, 0, 0), EMBER_ECORRUPT);
  CHECK(strstr(ember_last_error(), "inconsistent") != NULL);
  *head = 32;
  CHECK_OK(ember_shm_ring_next(c, &m, 0, 0));
  CHECK(memcmp(m.data, "abcd", 4) == 0);
  ember_shm_ring_destroy(p);
  ember_shm_ring_destroy(c);
  LEAK_CHECK();
}

/* The stream calls the collectives use: never block, partial consumption
 * within a record, room handed back only when a record is fully consumed,
 * wrap-around, the peer position to wait on, END/ERROR, hostile records. */
TEST(stream_calls_partial_records_and_wraparound) {
  ember_shm_ring *c = NULL, *p;
  void *dst;
  const void *src;
  size_t room = 0, got = 0;
  CHECK_OK(ember_shm_ring_create(&c, 65536, EMBER_SHM_CONSUMER));
  p = attach_peer(c, EMBER_SHM_PRODUCER);
  /* empty: no data, no error */
  CHECK_OK(ember_shm_ring_peek(c, &src, &got));
  CHECK_EQ_INT(got, 0);
  CHECK(ember_shm_ring_peer_position(c) == 0);
  /* a full ring takes capacity - 16 bytes in one record, then nothing */
  CHECK_OK(ember_shm_ring_try_reserve(p, SIZE_MAX, &dst, &room));
  CHECK_EQ_INT(room, 65536 - 16);
  CHECK_OK(ember_shm_ring_try_reserve(p, 1000, &dst, &room));
  CHECK_EQ_INT(room, 1000);
  fill(dst, 1, 1000);
  CHECK_OK(ember_shm_ring_commit(p, 1000));
  CHECK(ember_shm_ring_peer_position(c) == 16 + 1008);
  /* taken three bytes at a time, as a reducer takes whole elements */
  uint8_t back[1000];
  size_t off = 0;
  while (off < 1000) {
    CHECK_OK(ember_shm_ring_peek(c, &src, &got));
    CHECK_EQ_INT(got, 1000 - off);
    size_t n = got < 3 ? got : 3;
    memcpy(back + off, src, n);
    if (off + n < 1000) CHECK(ember_shm_ring_peer_position(p) == 0); /* not released yet */
    CHECK_OK(ember_shm_ring_consume(c, n));
    off += n;
  }
  CHECK(check_pattern(back, 1, 1000));
  CHECK(ember_shm_ring_peer_position(p) == 16 + 1008);
  CHECK_EQ_INT(ember_shm_ring_consume(c, 1), EMBER_EINVAL); /* more than peek gave */
  /* fill to the brim across the wrap, 10 KB records */
  uint64_t sent = 0, recvd = 0;
  for (int round = 0; round < 40; round++) {
    for (;;) {
      CHECK_OK(ember_shm_ring_try_reserve(p, 10000, &dst, &room));
      if (room == 0) break;
      fill(dst, sent, room);
      CHECK_OK(ember_shm_ring_commit(p, room));
      sent++;
    }
    while (recvd < sent) {
      CHECK_OK(ember_shm_ring_peek(c, &src, &got));
      CHECK(got > 0);
      CHECK(check_pattern(src, recvd, got));
      CHECK_OK(ember_shm_ring_consume(c, got));
      recvd++;
      if (recvd % 3 == 0) break; /* leave some in: the next fill wraps */
    }
  }
  CHECK(sent > 100);
  /* a hostile record length: named, not followed */
  while (recvd < sent) {
    CHECK_OK(ember_shm_ring_peek(c, &src, &got));
    CHECK_OK(ember_shm_ring_consume(c, got));
    recvd++;
  }
  size_t len = 0;
  uint8_t *raw = ember__shm_ring_raw(p, &len);
  size_t hdr = len - ember_shm_ring_capacity(p);
  CHECK_OK(ember_shm_ring_try_reserve(p, 8, &dst, &room));
  CHECK_OK(ember_shm_ring_commit(p, 8));
  uint64_t at = (ember_shm_ring_peer_position(c) - 32) % ember_shm_ring_capacity(p);
  raw[hdr + at + 2] = 0x7f;
  CHECK_EQ_INT(ember_shm_ring_peek(c, &src, &got), EMBER_ECORRUPT);
  CHECK(strstr(ember_last_error(), "claims") != NULL);
  raw[hdr + at + 2] = 0;
  CHECK_OK(ember_shm_ring_peek(c, &src, &got));
  CHECK_EQ_INT(got, 8);
  CHECK_OK(ember_shm_ring_consume(c, 8));
  /* ERROR and END end the stream with the producer's reason */
  CHECK_OK(ember_shm_ring_fail(p, EMBER_EIO, "disk on fire", 0));
  CHECK_EQ_INT(ember_shm_ring_peek(c, &src, &got), EMBER_EIO);
  CHECK(strstr(ember_last_error(), "disk on fire") != NULL);
  CHECK_EQ_INT(ember_shm_ring_try_reserve(p, 8, &dst, &room), EMBER_ESTATE);
  /* a closed consumer: the producer's next try fails at once */
  ember_shm_ring *c2 = NULL, *p2;
  CHECK_OK(ember_shm_ring_create(&c2, 65536, EMBER_SHM_CONSUMER));
  p2 = attach_peer(c2, EMBER_SHM_PRODUCER);
  CHECK_OK(ember_shm_ring_end(p2, 0));
  CHECK_EQ_INT(ember_shm_ring_peek(c2, &src, &got), EMBER_ECLOSED);
  ember_shm_ring_close(p2);
  ember_shm_ring_destroy(p2);
  ember_shm_ring *c3 = NULL, *p3;
  CHECK_OK(ember_shm_ring_create(&c3, 65536, EMBER_SHM_CONSUMER));
  p3 = attach_peer(c3, EMBER_SHM_PRODUCER);
  ember_shm_ring_close(c3);
  CHECK_EQ_INT(ember_shm_ring_try_reserve(p3, 8, &dst, &room), EMBER_ECLOSED);
  ember_shm_ring_destroy(p3);
  ember_shm_ring_destroy(c3);
  ember_shm_ring_destroy(c2);
  ember_shm_ring_destroy(p);
  ember_shm_ring_destroy(c);
  LEAK_CHECK();
}

RUN_TESTS(T(create_mode_seals_and_limits), T(attach_checks_the_descriptor),
          T(wraparound_odd_sizes_and_split_messages), T(full_ring_blocks_then_times_out),
          T(blocked_producer_wakes_on_release_without_spinning), T(end_and_error_markers),
          T(producer_close_without_end_is_reported_after_the_data),
          T(consumer_closes_early_producer_gets_error), T(close_wakes_our_own_blocked_thread),
          T(consumer_process_exits_early_producer_gets_error),
          T(killed_peers_leave_nothing_behind), T(hostile_positions_and_records_are_rejected),
          T(stream_calls_partial_records_and_wraparound))
