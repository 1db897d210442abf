/* test_collective.c - the collectives with 2, 3 and 4 ranks as forked
 * processes on loopback, over shared memory and over TCP.
 *
 * Every rank fills its buffer with values that are a function of (rank,
 * index), so each rank can compute the exact expected result on its own:
 * float inputs are small integers and quarters, whose sums are exact, so
 * results are compared bit for bit (which also proves that every rank got the
 * same bits).  Integer inputs are large enough to wrap around in int32 sums.
 *
 * The parent binds one listening socket per rank before forking (no port
 * race) and hands rank i its socket through ember_comm_config.listen_fd. */
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>

#include "ember/collective.h"
#include "ember/net.h"
#include "harness.h"
#include "strangers.h"

static const uint8_t SECRET[32] = "0123456789abcdef0123456789abcdef";
static const uint8_t WRONG[32] = "fedcba9876543210fedcba9876543210";

#define MAX_RANKS 4
#define RANK_TIMEOUT_MS 30000

typedef struct {
  uint32_t flags;
  size_t small_max;
  const uint8_t *secret_of[MAX_RANKS]; /* NULL: SECRET */
  int strangers, slow; /* hostile connections held on every rank's port */
  int own_hosts;       /* rank i on 127.0.0.<i+1>: a host of its own to the
                          algorithm choice (one machine to shared memory) */
} world_opts;

typedef int (*rank_fn)(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg);

static char g_addr[MAX_RANKS][32];
static const char *g_addrs[MAX_RANKS];

/* Forks n ranks; each runs fn with a ready config.  Returns the number of
 * ranks that failed. */
static int run_world(uint32_t n, const world_opts *wo, rank_fn fn, void *arg) {
  int fds[MAX_RANKS];
  pid_t pids[MAX_RANKS];
  strangers st[MAX_RANKS];
  int hostile = wo != NULL && (wo->strangers > 0 || wo->slow > 0);
  for (uint32_t i = 0; i < n; i++) {
    uint16_t port = 0;
    /* As a node reserves its collective port: listening from the start, so
     * strangers can queue there before the communicator exists. */
    char host[24] = "127.0.0.1";
    if (wo != NULL && wo->own_hosts) snprintf(host, sizeof host, "127.0.0.%u", i + 1);
    CHECK_OK(ember_net_bind(host, 0, hostile ? 4096 : 16, 0, &fds[i], &port));
    snprintf(g_addr[i], sizeof g_addr[i], "%s:%u", host, (unsigned)port);
    g_addrs[i] = g_addr[i];
    if (hostile) strangers_open(&st[i], port, wo->strangers, wo->slow);
  }
  for (uint32_t i = 0; i < n; i++) {
    pids[i] = fork();
    CHECK(pids[i] >= 0);
    if (pids[i] == 0) {
      alarm(50);
      for (uint32_t j = 0; j < n; j++)
        if (j != i) close(fds[j]);
      if (hostile) /* the strangers stay the parent's */
        for (uint32_t j = 0; j < n; j++) {
          for (int k = 0; k < st[j].nidle; k++) close(st[j].idle[k]);
          for (int k = 0; k < st[j].nslow; k++) close(st[j].slow[k]);
        }
      ember_comm_config cfg = {.rank = i, .size = n, .addresses = g_addrs,
                               .secret = SECRET, .secret_len = sizeof SECRET,
                               .listen_fd = fds[i], .flags = wo ? wo->flags : 0,
                               .small_max = wo ? wo->small_max : 0};
      if (wo && wo->secret_of[i]) cfg.secret = wo->secret_of[i];
      int rc = fn(i, n, &cfg, arg);
      fflush(stderr);
      _exit(rc == 0 ? 0 : 1);
    }
  }
  for (uint32_t i = 0; i < n; i++) close(fds[i]);
  if (hostile)
    for (uint32_t i = 0; i < n; i++) strangers_start(&st[i]);
  int failed = 0;
  for (uint32_t i = 0; i < n; i++) {
    int status = 0;
    CHECK(waitpid(pids[i], &status, 0) == pids[i]);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fprintf(stderr, "rank %u failed (status 0x%x)\n", i, status);
      failed++;
    }
  }
  if (hostile)
    for (uint32_t i = 0; i < n; i++) strangers_close(&st[i]);
  return failed;
}

#define RCHECK(cond)                                                             \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "rank %u: %s:%d: CHECK failed: %s (last error: %s)\n",     \
              rank, __FILE__, __LINE__, #cond, ember_last_error());              \
      return 1;                                                                  \
    }                                                                            \
  } while (0)

static int64_t now_ms(void) { return ember_now_ms(); }

/* ------------------------------------------------------------ values */

static const int DTYPES[4] = {EMBER_DT_F32, EMBER_DT_F64, EMBER_DT_I32, EMBER_DT_I64};
static const int OPS[4] = {EMBER_RED_SUM, EMBER_RED_AVG, EMBER_RED_MIN, EMBER_RED_MAX};

static double fval(uint32_t rank, size_t i) {
  return (double)((int64_t)((i * 7 + rank * 13) % 101) - 50) + 0.25 * rank;
}
static int64_t ival(uint32_t rank, size_t i) {
  return (int64_t)((uint64_t)i * 2654435761u + (uint64_t)rank * 0x9E3779B97F4Aull) ^
         (int64_t)rank << 33;
}

/* memcpy stores: the buffers are deliberately misaligned. */
static void fill(int dtype, uint32_t rank, size_t count, uint8_t *buf) {
  for (size_t i = 0; i < count; i++) {
    float f;
    double d;
    int32_t a;
    int64_t b;
    switch (dtype) {
    case EMBER_DT_F32: f = (float)fval(rank, i); memcpy(buf + 4 * i, &f, 4); break;
    case EMBER_DT_F64: d = fval(rank, i); memcpy(buf + 8 * i, &d, 8); break;
    case EMBER_DT_I32: a = (int32_t)(uint32_t)ival(rank, i); memcpy(buf + 4 * i, &a, 4); break;
    case EMBER_DT_I64: b = ival(rank, i); memcpy(buf + 8 * i, &b, 8); break;
    }
  }
}

/* The expected value of element i, in the element type, written to out. */
static void expect(int dtype, int op, uint32_t n, size_t i, void *out) {
  if (dtype == EMBER_DT_F32 || dtype == EMBER_DT_F64) {
    double acc = fval(0, i);
    for (uint32_t r = 1; r < n; r++) {
      double v = fval(r, i);
      if (op == EMBER_RED_MIN) acc = v < acc ? v : acc;
      else if (op == EMBER_RED_MAX) acc = v > acc ? v : acc;
      else acc += v; /* exact: small integers and quarters */
    }
    if (dtype == EMBER_DT_F32) {
      float f = (float)acc;
      if (op == EMBER_RED_AVG) f = f / (float)n;
      memcpy(out, &f, 4);
    } else {
      if (op == EMBER_RED_AVG) acc = acc / (double)n;
      memcpy(out, &acc, 8);
    }
    return;
  }
  if (dtype == EMBER_DT_I32) {
    int32_t acc = (int32_t)(uint32_t)ival(0, i);
    for (uint32_t r = 1; r < n; r++) {
      int32_t v = (int32_t)(uint32_t)ival(r, i);
      if (op == EMBER_RED_MIN) acc = v < acc ? v : acc;
      else if (op == EMBER_RED_MAX) acc = v > acc ? v : acc;
      else acc = (int32_t)((uint32_t)acc + (uint32_t)v);
    }
    if (op == EMBER_RED_AVG) acc = (int32_t)(acc / (int32_t)n);
    memcpy(out, &acc, 4);
    return;
  }
  int64_t acc = ival(0, i);
  for (uint32_t r = 1; r < n; r++) {
    int64_t v = ival(r, i);
    if (op == EMBER_RED_MIN) acc = v < acc ? v : acc;
    else if (op == EMBER_RED_MAX) acc = v > acc ? v : acc;
    else acc = (int64_t)((uint64_t)acc + (uint64_t)v);
  }
  if (op == EMBER_RED_AVG) acc = acc / (int64_t)n;
  memcpy(out, &acc, 8);
}

static size_t esize(int dtype) { return ember_dtype_size((uint8_t)dtype); }

/* Allreduces count elements and compares with expect(); 0 on success. */
static int check_allreduce(uint32_t rank, uint32_t n, ember_comm *c, int dtype, int op,
                           size_t count, size_t misalign) {
  size_t es = esize(dtype);
  uint8_t *raw = malloc(count * es + 16);
  RCHECK(raw != NULL);
  uint8_t *buf = raw + misalign; /* the API needs no alignment */
  fill(dtype, rank, count, buf);
  int rc = ember_comm_allreduce(c, count ? buf : NULL, count, dtype, op, RANK_TIMEOUT_MS);
  if (rc != 0) {
    fprintf(stderr, "rank %u: allreduce dtype %d op %d count %zu: %s\n", rank, dtype, op,
            count, ember_last_error());
    free(raw);
    return 1;
  }
  for (size_t i = 0; i < count; i++) {
    uint8_t want[8];
    expect(dtype, op, n, i, want);
    if (memcmp(want, buf + i * es, es) != 0) {
      fprintf(stderr, "rank %u: allreduce dtype %d op %d count %zu: element %zu differs\n",
              rank, dtype, op, count, i);
      free(raw);
      return 1;
    }
  }
  free(raw);
  return 0;
}

/* ------------------------------------------------------------ every op */

typedef struct {
  int want_shm;
} all_ops_arg;

static int rank_all_ops(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *argp) {
  all_ops_arg *arg = argp;
  ember_comm *c = NULL;
  RCHECK(ember_comm_create(&c, cfg, RANK_TIMEOUT_MS) == 0);
  RCHECK(ember_comm_rank(c) == rank && ember_comm_size(c) == n);
  for (uint32_t j = 0; j < n; j++)
    if (j != rank) RCHECK(ember_comm_peer_is_shm(c, j) == arg->want_shm);
  RCHECK(ember_comm_peer_is_shm(c, rank) == 0);
  if (rank == 0 && arg->want_shm) {
    /* Segments are unlinked once mapped: nothing is left in /dev/shm. */
    RCHECK(ember_comm_barrier(c, RANK_TIMEOUT_MS) == 0);
    DIR *d = opendir("/dev/shm");
    if (d != NULL) {
      struct dirent *e;
      while ((e = readdir(d)) != NULL) RCHECK(strncmp(e->d_name, "ember-coll-", 11) != 0);
      closedir(d);
    }
  } else if (arg->want_shm) {
    RCHECK(ember_comm_barrier(c, RANK_TIMEOUT_MS) == 0);
  }

  const size_t counts[] = {0, 1, 7, 1000, 100003};
  for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
    for (int d = 0; d < 4; d++)
      for (int o = 0; o < 4; o++)
        if (check_allreduce(rank, n, c, DTYPES[d], OPS[o], counts[ci], (ci + d) % 3) != 0)
          return 1;

  /* NaN propagates through min and max, whichever rank holds it. */
  float fb[5] = {1, 2, 3, 4, 5};
  fb[2] = rank == n - 1 ? NAN : (float)rank;
  RCHECK(ember_comm_allreduce(c, fb, 5, EMBER_DT_F32, EMBER_RED_MAX, RANK_TIMEOUT_MS) == 0);
  RCHECK(isnan(fb[2]) && fb[0] == 1 && fb[4] == 5);

  /* broadcast from every root, several sizes */
  const size_t bsizes[] = {0, 1, 13, 300001};
  for (uint32_t root = 0; root < n; root++) {
    for (size_t bi = 0; bi < 4; bi++) {
      size_t len = bsizes[bi];
      uint8_t *b = malloc(len + 1);
      RCHECK(b != NULL);
      for (size_t i = 0; i < len; i++)
        b[i] = rank == root ? (uint8_t)(i * 31 + root) : 0xEE;
      RCHECK(ember_comm_broadcast(c, len ? b : NULL, len, root, RANK_TIMEOUT_MS) == 0);
      for (size_t i = 0; i < len; i++) RCHECK(b[i] == (uint8_t)(i * 31 + root));
      free(b);
    }
  }
  RCHECK(ember_comm_broadcast(c, fb, 4, n, 1000) == EMBER_EINVAL);

  /* allgather, separate and in place */
  const size_t gsizes[] = {0, 1, 13, 100001};
  for (size_t gi = 0; gi < 4; gi++) {
    size_t len = gsizes[gi];
    uint8_t *send = malloc(len + 1), *recv = malloc(len * n + 1);
    RCHECK(send && recv);
    for (size_t i = 0; i < len; i++) send[i] = (uint8_t)(i + 17 * rank);
    memset(recv, 0xEE, len * n);
    RCHECK(ember_comm_allgather(c, send, recv, len, RANK_TIMEOUT_MS) == 0);
    for (uint32_t r = 0; r < n; r++)
      for (size_t i = 0; i < len; i++) RCHECK(recv[r * len + i] == (uint8_t)(i + 17 * r));
    memset(recv, 0xEE, len * n);
    memcpy(recv + rank * len, send, len);
    RCHECK(ember_comm_allgather(c, NULL, recv, len, RANK_TIMEOUT_MS) == 0);
    for (uint32_t r = 0; r < n; r++)
      for (size_t i = 0; i < len; i++) RCHECK(recv[r * len + i] == (uint8_t)(i + 17 * r));
    free(send);
    free(recv);
  }

  for (int i = 0; i < 5; i++) RCHECK(ember_comm_barrier(c, RANK_TIMEOUT_MS) == 0);
  /* Bad arguments fail locally and leave the communicator usable. */
  RCHECK(ember_comm_allreduce(c, fb, 1, EMBER_DT_U8, EMBER_RED_SUM, 1000) == EMBER_EINVAL);
  RCHECK(ember_comm_allreduce(c, fb, 1, EMBER_DT_F32, 99, 1000) == EMBER_EINVAL);
  RCHECK(ember_comm_barrier(c, RANK_TIMEOUT_MS) == 0);
  ember_comm_destroy(c);
  return 0;
}

static void all_ops(uint32_t n, uint32_t flags, size_t small_max) {
  world_opts wo = {.flags = flags, .small_max = small_max};
  all_ops_arg a = {.want_shm = !(flags & EMBER_COMM_TCP_ONLY)};
  CHECK_EQ_INT(run_world(n, &wo, rank_all_ops, &a), 0);
}

/* small_max 1: every allreduce with count >= ranks takes the ring, so odd
 * sizes go through the ring too. */
TEST(ops_2_shm) { all_ops(2, 0, 0); }
TEST(ops_2_tcp_ring) { all_ops(2, EMBER_COMM_TCP_ONLY, 1); }
TEST(ops_3_shm_ring) { all_ops(3, 0, 1); }
TEST(ops_3_tcp) { all_ops(3, EMBER_COMM_TCP_ONLY, 0); }
TEST(ops_4_shm) { all_ops(4, 0, 0); }
TEST(ops_4_tcp_ring) { all_ops(4, EMBER_COMM_TCP_ONLY, 1); }
TEST(ops_4_shm_ring) { all_ops(4, 0, 1); }
TEST(ops_3_tcp_ring) { all_ops(3, EMBER_COMM_TCP_ONLY, 1); }
/* Recursive halving and doubling, forced: 2 and 4 ranks, and 3, where the
 * third rank folds into the first. */
TEST(ops_2_tcp_halving) { all_ops(2, EMBER_COMM_TCP_ONLY | EMBER_COMM_HALVING, 1); }
TEST(ops_3_tcp_halving) { all_ops(3, EMBER_COMM_TCP_ONLY | EMBER_COMM_HALVING, 1); }
TEST(ops_4_tcp_halving) { all_ops(4, EMBER_COMM_TCP_ONLY | EMBER_COMM_HALVING, 1); }
TEST(ops_4_shm_halving) { all_ops(4, EMBER_COMM_HALVING, 1); }

/* Which algorithm each size takes, the same on every rank; and the choice
 * computes the right sums. */
typedef struct {
  const char *mid; /* the algorithm of a 4 MiB float32 allreduce */
} algo_arg;

static int rank_algo_choice(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *argp) {
  algo_arg *a = argp;
  ember_comm *c = NULL;
  RCHECK(ember_comm_create(&c, cfg, RANK_TIMEOUT_MS) == 0);
  const char *got = ember_comm_allreduce_algorithm(c, 1u << 20, EMBER_DT_F32);
  if (strcmp(got, a->mid) != 0) {
    fprintf(stderr, "rank %u: 4 MiB allreduce takes %s, want %s\n", rank, got, a->mid);
    return 1;
  }
  RCHECK(strcmp(ember_comm_allreduce_algorithm(c, 1000, EMBER_DT_F32),
                "recursive doubling") == 0);
  RCHECK(strcmp(ember_comm_allreduce_algorithm(c, n - 1, EMBER_DT_F64),
                "recursive doubling") == 0);
  RCHECK(strcmp(ember_comm_allreduce_algorithm(c, (256u << 20) / 8, EMBER_DT_F64), a->mid) == 0);
  RCHECK(strcmp(ember_comm_allreduce_algorithm(c, 1u << 20, EMBER_DT_U8), "none") == 0);
  RCHECK(strcmp(ember_comm_allreduce_algorithm(NULL, 1u << 20, EMBER_DT_F32), "none") == 0);
  for (int d = 0; d < 4; d++)
    if (check_allreduce(rank, n, c, DTYPES[d], EMBER_RED_AVG, 300007, 1) != 0) return 1;
  ember_comm_destroy(c);
  return 0;
}

static void algo_choice(uint32_t n, int own_hosts, const char *mid) {
  world_opts wo = {.flags = EMBER_COMM_TCP_ONLY, .own_hosts = own_hosts};
  algo_arg a = {.mid = mid};
  CHECK_EQ_INT(run_world(n, &wo, rank_algo_choice, &a), 0);
}

TEST(algo_4_own_hosts_halving) { algo_choice(4, 1, "halving"); }
TEST(algo_4_one_host_ring) { algo_choice(4, 0, "ring"); }
TEST(algo_3_own_hosts_ring) { algo_choice(3, 1, "ring"); }
TEST(algo_2_own_hosts_ring) { algo_choice(2, 1, "ring"); }

static int rank_single(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg) {
  ember_comm *c = NULL;
  RCHECK(ember_comm_create(&c, cfg, 1000) == 0);
  float f[3] = {1, 2, 3};
  RCHECK(ember_comm_allreduce(c, f, 3, EMBER_DT_F32, EMBER_RED_AVG, 1000) == 0);
  RCHECK(f[0] == 1 && f[2] == 3);
  uint8_t g[4] = {0};
  RCHECK(ember_comm_allgather(c, "abcd", g, 4, 1000) == 0 && memcmp(g, "abcd", 4) == 0);
  RCHECK(ember_comm_broadcast(c, g, 4, 0, 1000) == 0);
  RCHECK(ember_comm_barrier(c, 1000) == 0);
  ember_comm_destroy(c);
  return 0;
}

TEST(single_rank) { CHECK_EQ_INT(run_world(1, NULL, rank_single, NULL), 0); }

/* ------------------------------------------------------------ > 64 MiB */

static int rank_big(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg) {
  ember_comm *c = NULL;
  RCHECK(ember_comm_create(&c, cfg, RANK_TIMEOUT_MS) == 0);
  size_t count = (size_t)17 * 1024 * 1024 + 3; /* 68 MiB of float32 */
  float *b = malloc(count * sizeof *b);
  RCHECK(b != NULL);
  for (size_t i = 0; i < count; i++) b[i] = (float)((i % 1000) + rank);
  RCHECK(ember_comm_allreduce(c, b, count, EMBER_DT_F32, EMBER_RED_SUM, RANK_TIMEOUT_MS) == 0);
  for (size_t i = 0; i < count; i++)
    if (b[i] != (float)(2 * (i % 1000) + 1)) RCHECK(!"wrong element in the big allreduce");
  free(b);
  ember_comm_destroy(c);
  return 0;
}

TEST(big_68mib_2_ranks) { CHECK_EQ_INT(run_world(2, NULL, rank_big, NULL), 0); }

/* ------------------------------------------------------------ many ops */

/* Thousands of back-to-back ops on 4 ranks over shared memory, with more
 * ranks than CI has cores, so ranks are preempted anywhere, including
 * between looking at a ring and recording what they saw there.  A wake-up
 * lost in that window stalls an op until its deadline, which fails here. */
static int rank_many(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg) {
  ember_comm *c = NULL;
  RCHECK(ember_comm_create(&c, cfg, RANK_TIMEOUT_MS) == 0);
  RCHECK(ember_comm_peer_is_shm(c, (rank + 1) % n));
  enum { SMALL = 1024, LARGE = 64 * 1024 };
  float *b = malloc(LARGE * sizeof *b);
  RCHECK(b != NULL);
  for (int i = 0; i < 12000; i++) {
    size_t count = i % 8 == 7 ? LARGE : SMALL; /* small: recursive doubling; large: ring */
    for (size_t k = 0; k < count; k += 61) b[k] = (float)(rank + (uint32_t)i % 7);
    int rc = ember_comm_allreduce(c, b, count, EMBER_DT_F32, EMBER_RED_SUM, 5000);
    if (rc != 0) fprintf(stderr, "rank %u, op %d: %s\n", rank, i, ember_last_error());
    RCHECK(rc == 0);
    float want = (float)(n * (n - 1) / 2 + n * ((uint32_t)i % 7));
    for (size_t k = 0; k < count; k += 61) RCHECK(b[k] == want);
  }
  free(b);
  ember_comm_destroy(c);
  return 0;
}

TEST(many_ops_4_ranks_shm) { CHECK_EQ_INT(run_world(4, NULL, rank_many, NULL), 0); }

/* ------------------------------------------------------------ failures */

typedef struct {
  uint32_t victim;
} kill_arg;

static void *killer(void *p) {
  (void)p;
  struct timespec ts = {0, 150 * 1000000L};
  nanosleep(&ts, NULL);
  raise(SIGKILL);
  return NULL;
}

/* The victim dies in the middle of a big allreduce; every other rank must
 * fail well within the timeout, naming a rank. */
static int rank_killed(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *argp) {
  kill_arg *a = argp;
  ember_comm *c = NULL;
  RCHECK(ember_comm_create(&c, cfg, RANK_TIMEOUT_MS) == 0);
  size_t count = 4u * 1024 * 1024;
  float *b = calloc(count, sizeof *b);
  RCHECK(b != NULL);
  if (rank == a->victim) {
    pthread_t t;
    RCHECK(pthread_create(&t, NULL, killer, NULL) == 0);
    for (;;) /* until killed */
      (void)ember_comm_allreduce(c, b, count, EMBER_DT_F32, EMBER_RED_SUM, RANK_TIMEOUT_MS);
  }
  int64_t t0 = now_ms();
  int rc = 0;
  for (int i = 0; i < 1000 && rc == 0; i++)
    rc = ember_comm_allreduce(c, b, count, EMBER_DT_F32, EMBER_RED_SUM, RANK_TIMEOUT_MS);
  int64_t took = now_ms() - t0;
  fprintf(stderr, "rank %u: failed after %lld ms: %s: %s\n", rank, (long long)took,
          ember_err_name(rc), ember_last_error());
  RCHECK(rc == EMBER_ECLOSED || rc == EMBER_EABORTED);
  RCHECK(took < 5000);
  RCHECK(strstr(ember_last_error(), "rank ") != NULL);
  /* Broken for good, with the first error. */
  RCHECK(ember_comm_barrier(c, 1000) == EMBER_ESTATE);
  RCHECK(strstr(ember_last_error(), "broken") != NULL);
  free(b);
  ember_comm_destroy(c);
  return 0;
}

static void killed(uint32_t n, uint32_t flags) {
  world_opts wo = {.flags = flags};
  kill_arg a = {.victim = 2};
  /* The victim's own exit status is a SIGKILL: exactly one "failure". */
  CHECK_EQ_INT(run_world(n, &wo, rank_killed, &a), 1);
}

TEST(peer_killed_mid_allreduce_shm_4) { killed(4, 0); }
TEST(peer_killed_mid_allreduce_tcp_4) { killed(4, EMBER_COMM_TCP_ONLY); }
TEST(peer_killed_mid_allreduce_tcp_3) { killed(3, EMBER_COMM_TCP_ONLY); }
TEST(peer_killed_mid_allreduce_tcp_4_halving) {
  killed(4, EMBER_COMM_TCP_ONLY | EMBER_COMM_HALVING);
}

/* A silent rank: the others time out within the bound, naming a rank. */
static int rank_silent(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg) {
  ember_comm *c = NULL;
  RCHECK(ember_comm_create(&c, cfg, RANK_TIMEOUT_MS) == 0);
  float b[100000] = {0};
  if (rank == n - 1) {
    struct timespec ts = {2, 0};
    nanosleep(&ts, NULL);
    ember_comm_destroy(c);
    return 0;
  }
  int64_t t0 = now_ms();
  int rc = ember_comm_allreduce(c, b, 100000, EMBER_DT_F32, EMBER_RED_SUM, 500);
  int64_t took = now_ms() - t0;
  fprintf(stderr, "rank %u: %s after %lld ms: %s\n", rank, ember_err_name(rc),
          (long long)took, ember_last_error());
  /* The rank next to the silent one times out; the others may instead see
   * it abort (it broke the communicator when it gave up). */
  RCHECK(rc == EMBER_ETIMEDOUT || rc == EMBER_EABORTED || rc == EMBER_ECLOSED);
  RCHECK(took >= 400 || rc != EMBER_ETIMEDOUT);
  RCHECK(took < 1500);
  RCHECK(strstr(ember_last_error(), "rank ") != NULL);
  ember_comm_destroy(c);
  return 0;
}

TEST(silent_peer_times_out_shm) { CHECK_EQ_INT(run_world(3, NULL, rank_silent, NULL), 0); }
TEST(silent_peer_times_out_tcp) {
  world_opts wo = {.flags = EMBER_COMM_TCP_ONLY};
  CHECK_EQ_INT(run_world(3, &wo, rank_silent, NULL), 0);
}

static int rank_wrong_secret(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg) {
  ember_comm *c = NULL;
  int rc = ember_comm_create(&c, cfg, 1500);
  fprintf(stderr, "rank %u: %s: %s\n", rank, ember_err_name(rc), ember_last_error());
  if (rank == 1) {
    RCHECK(rc == EMBER_EAUTH); /* the impostor is refused */
  } else {
    RCHECK(rc == EMBER_ETIMEDOUT); /* the real rank 1 never came */
    RCHECK(strstr(ember_last_error(), "rank(s) 1") != NULL);
    RCHECK(strstr(ember_last_error(), "rejected") != NULL);
  }
  RCHECK(c == NULL);
  return 0;
}

TEST(wrong_secret_rejected) {
  world_opts wo = {.secret_of = {NULL, WRONG}};
  CHECK_EQ_INT(run_world(2, &wo, rank_wrong_secret, NULL), 0);
}

static int rank_mismatch(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg) {
  ember_comm *c = NULL;
  RCHECK(ember_comm_create(&c, cfg, RANK_TIMEOUT_MS) == 0);
  float b[16] = {0};
  int rc = rank == 0 ? ember_comm_allreduce(c, b, 16, EMBER_DT_F32, EMBER_RED_SUM, 5000)
                     : ember_comm_broadcast(c, b, 64, 0, 5000);
  fprintf(stderr, "rank %u: %s: %s\n", rank, ember_err_name(rc), ember_last_error());
  RCHECK(rc == EMBER_EPROTO || rc == EMBER_ECLOSED || rc == EMBER_EABORTED);
  RCHECK(rc != EMBER_EPROTO || strstr(ember_last_error(), "mismatched") != NULL);
  ember_comm_destroy(c);
  return 0;
}

TEST(mismatched_calls_detected) {
  CHECK_EQ_INT(run_world(2, NULL, rank_mismatch, NULL), 0);
}

static void *aborter(void *p) {
  struct timespec ts = {0, 200 * 1000000L};
  nanosleep(&ts, NULL);
  ember_comm_abort(p);
  return NULL;
}

static int rank_abort(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg) {
  ember_comm *c = NULL;
  RCHECK(ember_comm_create(&c, cfg, RANK_TIMEOUT_MS) == 0);
  float b[4] = {0};
  if (rank == 1) { /* stays silent: rank 0 waits until it aborts */
    struct timespec ts = {1, 0};
    nanosleep(&ts, NULL);
    ember_comm_destroy(c);
    return 0;
  }
  pthread_t t;
  RCHECK(pthread_create(&t, NULL, aborter, c) == 0);
  int64_t t0 = now_ms();
  int rc = ember_comm_allreduce(c, b, 4, EMBER_DT_F32, EMBER_RED_SUM, RANK_TIMEOUT_MS);
  pthread_join(t, NULL);
  RCHECK(rc == EMBER_EABORTED);
  RCHECK(strstr(ember_last_error(), "aborted on this rank") != NULL);
  RCHECK(now_ms() - t0 < 1000);
  RCHECK(ember_comm_barrier(c, 100) != 0);
  ember_comm_destroy(c);
  return 0;
}

TEST(abort_from_another_thread) { CHECK_EQ_INT(run_world(2, NULL, rank_abort, NULL), 0); }

/* ------------------------------------------------------------ the api table */

typedef struct {
  const ember_comm_api *api;
  uint64_t id;
  int rc;
} held_call;

/* Holds the communicator through the table in an allreduce rank 1 never
 * joins, as TensorFlow's op would while the node closes its collective. */
static void *hold_in_allreduce(void *p) {
  held_call *h = p;
  ember_comm *c = NULL;
  h->rc = h->api->acquire(h->id, &c);
  if (h->rc != EMBER_OK) return NULL;
  float b[4] = {0};
  h->rc = h->api->allreduce(c, b, 4, EMBER_DT_F32, EMBER_RED_SUM, RANK_TIMEOUT_MS);
  h->api->release(c);
  return NULL;
}

static int rank_api_table(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg) {
  const ember_comm_api *api = ember_comm_api_table();
  RCHECK(api->abi == EMBER_COMM_ABI && api->size == sizeof(ember_comm_api));
  ember_comm *c = NULL, *got = NULL;
  RCHECK(ember_comm_create(&c, cfg, RANK_TIMEOUT_MS) == 0);
  uint64_t id = ember_comm_id(c);
  RCHECK(id != 0);
  RCHECK(api->acquire(id, &got) == EMBER_OK && got == c);
  RCHECK(api->rank(got) == rank && api->size_of(got) == n);
  float b[3] = {1.0f + (float)rank, 2.0f, 0.5f};
  RCHECK(api->allreduce(got, b, 3, EMBER_DT_F32, EMBER_RED_SUM, RANK_TIMEOUT_MS) == 0);
  RCHECK(b[0] == 3.0f && b[1] == 4.0f && b[2] == 1.0f);
  api->release(got);
  RCHECK(api->acquire(id + 1000, &got) == EMBER_ENOTFOUND && got == NULL);
  RCHECK(strstr(api->last_error(), "no communicator") != NULL);
  RCHECK(ember_comm_barrier(c, RANK_TIMEOUT_MS) == 0);
  if (rank == 1) { /* stays silent while rank 0's holder waits */
    struct timespec ts = {1, 0};
    nanosleep(&ts, NULL);
    ember_comm_destroy(c);
    return 0;
  }
  held_call h = {.api = api, .id = id, .rc = 1};
  pthread_t t;
  RCHECK(pthread_create(&t, NULL, hold_in_allreduce, &h) == 0);
  struct timespec ts = {0, 200 * 1000000L};
  nanosleep(&ts, NULL);
  int64_t t0 = now_ms();
  ember_comm_destroy(c); /* aborts the held call and waits for its release */
  RCHECK(now_ms() - t0 < 1000);
  pthread_join(t, NULL);
  RCHECK(h.rc == EMBER_EABORTED);
  RCHECK(api->acquire(id, &got) == EMBER_ENOTFOUND);
  return 0;
}

TEST(api_table_by_id_and_destroy_while_held) {
  CHECK_EQ_INT(run_world(2, NULL, rank_api_table, NULL), 0);
}

static int rank_bad_config(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg) {
  ember_comm *c = NULL;
  const char *bad[2] = {"127.0.0.1", "127.0.0.1:1"};
  ember_comm_config k = *cfg;
  k.listen_fd = -1;
  k.addresses = bad;
  RCHECK(ember_comm_create(&c, &k, 100) == EMBER_EINVAL && c == NULL);
  RCHECK(strstr(ember_last_error(), "rank 0") != NULL);
  bad[0] = "127.0.0.1:70000";
  RCHECK(ember_comm_create(&c, &k, 100) == EMBER_EINVAL);
  bad[0] = "::1:5";
  RCHECK(ember_comm_create(&c, &k, 100) == EMBER_EINVAL);
  k = *cfg;
  k.listen_fd = -1;
  k.rank = 5;
  RCHECK(ember_comm_create(&c, &k, 100) == EMBER_EINVAL);
  k.rank = 0;
  k.secret_len = 8;
  RCHECK(ember_comm_create(&c, &k, 100) == EMBER_EINVAL);
  k = *cfg;
  k.listen_fd = -1;
  k.flags = EMBER_COMM_RING | EMBER_COMM_HALVING;
  RCHECK(ember_comm_create(&c, &k, 100) == EMBER_EINVAL && c == NULL);
  RCHECK(strstr(ember_last_error(), "exclude each other") != NULL);
  RCHECK(ember_comm_create(NULL, cfg, 100) == EMBER_EINVAL); /* closes listen_fd */
  ember_comm_destroy(NULL);
  return 0;
}

TEST(bad_config) { CHECK_EQ_INT(run_world(2, NULL, rank_bad_config, NULL), 0); }

/* Strangers queued on every rank's port before the communicator exists, and
 * more arriving (slow ones send AUTH a byte a second), with a pre-auth
 * deadline longer than the test: the mesh is built and the first allreduce
 * done at once, because every pending connection is handshaken concurrently
 * and the oldest stranger makes room for a new one (pool of 64 here).
 * (Rank 0 used to handshake one connection at a time, 10 s each.) */
static int rank_among_strangers(uint32_t rank, uint32_t n, ember_comm_config *cfg, void *arg) {
  static log_capture lc;
  pthread_mutex_init(&lc.mu, NULL);
  cfg->preauth_timeout_ms = 30000;
  cfg->max_pending = 64;
  cfg->log_fn = log_capture_fn;
  cfg->log_arg = &lc;
  ember_comm *c = NULL;
  int64_t t0 = now_ms();
  RCHECK(ember_comm_create(&c, cfg, 20000) == 0);
  float b[1000];
  for (int i = 0; i < 1000; i++) b[i] = (float)(rank + 1);
  RCHECK(ember_comm_allreduce(c, b, 1000, EMBER_DT_F32, EMBER_RED_SUM, 20000) == 0);
  int64_t took = now_ms() - t0;
  for (int i = 0; i < 1000; i++) RCHECK(b[i] == (float)(n * (n + 1) / 2));
  ember_comm_destroy(c);
  fprintf(stderr, "rank %u: mesh + first allreduce in %lld ms; %d log line(s) for %lld "
          "rejected stranger(s)%s%s\n", rank, (long long)took, lc.lines, lc.covered,
          lc.lines ? "; last: " : "", lc.last);
  /* A SYN the kernel dropped while strangers filled the queue costs a 1 s
   * retransmission; a stranger's handshake would cost 30 s. */
  RCHECK(took < 5000);
  if (rank < n - 1) { /* ranks that accept saw strangers, logged in <= 3 lines */
    RCHECK(lc.covered > 0);
    RCHECK(lc.lines <= 3);
  }
  return 0;
}

TEST(strangers_do_not_delay_the_mesh) {
  world_opts wo = {.flags = EMBER_COMM_TCP_ONLY, .strangers = strangers_fit(400, 600) , .slow = 10};
  CHECK_EQ_INT(run_world(3, &wo, rank_among_strangers, NULL), 0);
}

RUN_TESTS(T(ops_2_shm), T(ops_2_tcp_ring), T(ops_3_shm_ring), T(ops_3_tcp), T(ops_4_shm),
          T(ops_4_tcp_ring), T(ops_4_shm_ring), T(ops_3_tcp_ring), T(ops_2_tcp_halving),
          T(ops_3_tcp_halving), T(ops_4_tcp_halving), T(ops_4_shm_halving),
          T(algo_4_own_hosts_halving), T(algo_4_one_host_ring), T(algo_3_own_hosts_ring),
          T(algo_2_own_hosts_ring), T(single_rank),
          T(big_68mib_2_ranks), T(many_ops_4_ranks_shm), T(peer_killed_mid_allreduce_shm_4),
          T(peer_killed_mid_allreduce_tcp_4), T(peer_killed_mid_allreduce_tcp_3),
          T(peer_killed_mid_allreduce_tcp_4_halving),
          T(silent_peer_times_out_shm), T(silent_peer_times_out_tcp),
          T(wrong_secret_rejected), T(mismatched_calls_detected),
          T(abort_from_another_thread), T(api_table_by_id_and_destroy_while_held), T(bad_config), T(strangers_do_not_delay_the_mesh))
