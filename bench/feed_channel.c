/* bench/feed_channel.c - the bare feed channel, no Spark, no Python.
 *
 * Moves ~1,000,000 Fashion-MNIST-shaped records (784 float32 + int64 label,
 * 3144 bytes each) in batches of 1024 rows from a producer PROCESS to a
 * consumer that touches every byte of every batch (sums it as u64 words),
 * through:
 *   (a) the shared-memory ring alone: the producer encodes each batch
 *       straight into ring memory (reserve/commit), the consumer reads it in
 *       place (zero-copy view) and releases it;
 *   (b) the full feed over shared memory: ember_feed_client_send on one
 *       side, ember_feed_server_next + ember_feed_item_free on the other (the
 *       ring reader thread copies each batch once into the item);
 *   (c) the full feed over TCP loopback (EMBER_FEED_SHM_OFF);
 * against (d) a plain memcpy of the same column bytes, one thread, from the
 * same source batches into a destination window as large as the ring
 * (the same working set the ring has).
 * Every run checks the consumer's checksum against the producer's data.
 * GB/s counts record bytes (3144 per record) for all four, so they compare.
 *
 * Usage: feed_channel [records] [ring_bytes]; EMBER_BENCH_QUICK=1 in the
 * environment (make bench-smoke) makes the default 32768 records.  The line
 *   CHANNEL channel_gbps=<a> feed_shm_gbps=<b> feed_tcp_gbps=<c> memcpy_gbps=<d>
 * (which bench/feed.py reads) is followed by the last line
 *   RESULT feed_channel feed_shm_vs_memcpy=<b/d> feed_tcp_vs_memcpy=<c/d>
 *     channel_vs_memcpy=<a/d> channel_gbps=<a> feed_shm_gbps=<b> feed_tcp_gbps=<c>
 *     memcpy_gbps=<d>
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ember/error.h"
#include "ember/feed.h"
#include "ember/net.h"
#include "ember/shm_ring.h"

#define IMG 784
#define BATCH_ROWS 1024
#define POOL 16 /* distinct source batches, cycled (~51 MB: well past the caches) */
#define REC_BYTES (IMG * 4 + 8)

static const uint8_t SECRET[32] = "bench-feed-channel-secret-000000";

typedef struct {
  float *img;
  int64_t *label;
} src_batch;

static src_batch pool[POOL];
static uint64_t total_records = 1000000;
static size_t ring_bytes = 16u << 20;
static uint64_t nbatches;
static uint64_t expected_sum; /* of every encoded batch, in order */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what) {
  fprintf(stderr, "feed_channel: %s: %s\n", what, ember_last_error());
  exit(1);
}

/* Reads every byte: the "consumer touches every batch" of the benchmark. */
static uint64_t touch(const void *p, size_t len) {
  const uint8_t *b = p;
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, w[4];
  size_t i = 0;
  for (; i + 32 <= len; i += 32) {
    memcpy(w, b + i, 32);
    s0 += w[0];
    s1 += w[1];
    s2 += w[2];
    s3 += w[3];
  }
  for (; i < len; i++) s0 += b[i];
  return s0 + s1 + s2 + s3;
}

static uint32_t rows_of(uint64_t k) {
  uint64_t left = total_records - k * BATCH_ROWS;
  return left < BATCH_ROWS ? (uint32_t)left : BATCH_ROWS;
}

static void columns_of(uint64_t k, ember_column cols[2]) {
  src_batch *s = &pool[k % POOL];
  uint32_t n = rows_of(k);
  cols[0] = (ember_column){EMBER_DT_F32, 5, "image", IMG, s->img, (uint64_t)n * IMG * 4, NULL};
  cols[1] = (ember_column){EMBER_DT_I64, 5, "label", 1, s->label, (uint64_t)n * 8, NULL};
}

static void prepare(void) {
  uint64_t seed = 88172645463325252ull;
  uint8_t *tmp;
  size_t cap = 0;
  for (int b = 0; b < POOL; b++) {
    pool[b].img = malloc(sizeof(float) * IMG * BATCH_ROWS);
    pool[b].label = malloc(sizeof(int64_t) * BATCH_ROWS);
    if (!pool[b].img || !pool[b].label) die("malloc");
    for (size_t i = 0; i < (size_t)IMG * BATCH_ROWS; i++) {
      seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
      pool[b].img[i] = (float)(seed % 256) / 255.0f;
    }
    for (int r = 0; r < BATCH_ROWS; r++) pool[b].label[r] = (int64_t)((seed >> (r % 50)) % 10);
  }
  nbatches = (total_records + BATCH_ROWS - 1) / BATCH_ROWS;
  {
    ember_column cols[2];
    columns_of(0, cols);
    if (ember_batch_encoded_size(cols, 2, BATCH_ROWS, &cap) != EMBER_OK) die("size");
  }
  tmp = malloc(cap);
  for (uint64_t k = 0; k < nbatches; k++) {
    ember_column cols[2];
    size_t len = 0;
    columns_of(k, cols);
    if (ember_batch_encode(cols, 2, rows_of(k), tmp, cap, &len) != EMBER_OK) die("encode");
    expected_sum += touch(tmp, len);
  }
  free(tmp);
}

static double gbps(double secs) { return (double)total_records * REC_BYTES / secs / 1e9; }

static void check_sum(const char *what, uint64_t got) {
  if (got != expected_sum) {
    fprintf(stderr, "feed_channel: %s delivered different bytes (checksum %llx, want %llx)\n",
            what, (unsigned long long)got, (unsigned long long)expected_sum);
    exit(1);
  }
}

/* (d) */
static double run_memcpy(void) {
  uint8_t *dst = malloc(ring_bytes);
  size_t off = 0;
  double t0;
  uint64_t sink = 0;
  if (dst == NULL) die("malloc");
  memset(dst, 1, ring_bytes); /* fault the pages in, as a used ring has them */
  t0 = now_s();
  for (uint64_t k = 0; k < nbatches; k++) {
    ember_column cols[2];
    columns_of(k, cols);
    for (int c = 0; c < 2; c++) {
      size_t n = (size_t)cols[c].data_len;
      if (off + n > ring_bytes) off = 0;
      memcpy(dst + off, cols[c].data, n);
      off += (n + 63) & ~(size_t)63;
    }
  }
  sink = dst[off / 2];
  t0 = now_s() - t0;
  free(dst);
  if (sink == 0x100) puts(""); /* keep the copies */
  return t0;
}

/* (a) */
static double run_ring(void) {
  ember_shm_ring *r = NULL;
  ember_shm_ring_desc d;
  uint64_t sum = 0;
  int status = 0;
  pid_t pid;
  double t0;
  if (ember_shm_ring_create(&r, ring_bytes, EMBER_SHM_CONSUMER) != EMBER_OK) die("ring create");
  ember_shm_ring_describe(r, &d);
  t0 = now_s();
  pid = fork();
  if (pid == 0) {
    ember_shm_ring *p = NULL;
    if (ember_shm_ring_attach(&p, &d, EMBER_SHM_PRODUCER) != EMBER_OK) die("attach");
    for (uint64_t k = 0; k < nbatches; k++) {
      ember_column cols[2];
      size_t need = 0, len = 0;
      void *w = NULL;
      columns_of(k, cols);
      if (ember_batch_encoded_size(cols, 2, rows_of(k), &need) != EMBER_OK ||
          ember_shm_ring_reserve(p, need, &w, 60000) != EMBER_OK ||
          ember_batch_encode(cols, 2, rows_of(k), w, need, &len) != EMBER_OK ||
          ember_shm_ring_commit(p, len) != EMBER_OK)
        die("ring producer");
    }
    if (ember_shm_ring_end(p, 60000) != EMBER_OK) die("ring end");
    ember_shm_ring_destroy(p);
    _exit(0);
  }
  for (;;) {
    ember_shm_msg m;
    if (ember_shm_ring_next(r, &m, 0, 60000) != EMBER_OK) die("ring next");
    if (m.kind != EMBER_SHM_MSG_DATA) break;
    if (m.data == NULL) die("ring message was split (ring too small for a batch)");
    sum += touch(m.data, m.len);
    if (ember_shm_ring_release(r, 60000) != EMBER_OK) die("ring release");
  }
  t0 = now_s() - t0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) die("ring producer process failed");
  ember_shm_ring_destroy(r);
  check_sum("the ring", sum);
  return t0;
}

/* (b), (c) */
static double run_feed(int shm) {
  ember_feed_server_config cfg;
  ember_feed_server *s = NULL;
  ember_feed_stats st;
  uint64_t sum = 0, rows = 0;
  uint16_t port;
  int status = 0;
  pid_t pid;
  double t0;
  memset(&cfg, 0, sizeof cfg);
  cfg.secret = SECRET;
  cfg.secret_len = sizeof SECRET;
  cfg.listen_fd = -1;
  cfg.bind_host = "127.0.0.1";
  if (ember_feed_server_create(&s, &cfg) != EMBER_OK) die("server");
  port = ember_feed_server_port(s);
  t0 = now_s();
  pid = fork();
  if (pid == 0) {
    ember_feed_client *c = NULL;
    ember_feed_client_options o = {.shm = shm ? EMBER_FEED_SHM_ON : EMBER_FEED_SHM_OFF,
                                   .shm_bytes = ring_bytes};
    if (ember_feed_client_connect_ex(&c, "127.0.0.1", port, SECRET, sizeof SECRET, 0, 0, &o,
                                     10000) != EMBER_OK)
      die("connect");
    for (uint64_t k = 0; k < nbatches; k++) {
      ember_column cols[2];
      columns_of(k, cols);
      if (ember_feed_client_send(c, cols, 2, rows_of(k), 60000) != EMBER_OK) die("send");
    }
    if (ember_feed_client_uses_shm(c) != shm) {
      fprintf(stderr, "feed_channel: transport is not %s\n", shm ? "shm" : "tcp");
      _exit(2);
    }
    if (ember_feed_client_end_partition(c, 60000) != EMBER_OK) die("end_partition");
    ember_feed_client_destroy(c);
    _exit(0);
  }
  while (rows < total_records) {
    ember_feed_item *it = NULL;
    ember_column cols[2];
    uint32_t nc = 0, nr = 0;
    if (ember_feed_server_next(s, &it, 60000) != EMBER_OK) die("next");
    if (ember_batch_decode(it->data, it->len, cols, 2, &nc, &nr) != EMBER_OK) die("decode");
    sum += touch(it->data, it->len);
    rows += nr;
    ember_feed_item_free(it);
  }
  t0 = now_s() - t0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) die("producer process failed");
  ember_feed_server_stats(s, &st);
  if (st.shm_producers != (uint64_t)shm) die("wrong transport on the server");
  ember_feed_server_destroy(s);
  check_sum(shm ? "the feed over shm" : "the feed over TCP", sum);
  return t0;
}

int main(int argc, char **argv) {
  double tm, ta, tb, tc;
  const char *quick = getenv("EMBER_BENCH_QUICK");
  if (quick != NULL && quick[0] != '\0' && strcmp(quick, "0") != 0) total_records = 32768;
  if (argc > 1) total_records = strtoull(argv[1], NULL, 10);
  if (argc > 2) ring_bytes = (size_t)strtoull(argv[2], NULL, 10);
  if (total_records == 0) total_records = 1;
  prepare();
  /* each once to warm up page tables and caches, then the timed run */
  (void)run_memcpy();
  tm = run_memcpy();
  ta = run_ring();
  tb = run_feed(1);
  tc = run_feed(0);
  printf("bare feed channel: %llu records x %d bytes in %llu batches of %d rows, ring %zu "
         "bytes\n", (unsigned long long)total_records, REC_BYTES, (unsigned long long)nbatches,
         BATCH_ROWS, ring_bytes);
  printf("%-28s %14s %10s %12s\n", "path", "records/s", "GB/s", "vs memcpy");
  printf("%-28s %14.0f %10.2f %11.0f%%\n", "(a) shm ring alone", total_records / ta, gbps(ta),
         100.0 * tm / ta);
  printf("%-28s %14.0f %10.2f %11.0f%%\n", "(b) feed over shm", total_records / tb, gbps(tb),
         100.0 * tm / tb);
  printf("%-28s %14.0f %10.2f %11.0f%%\n", "(c) feed over TCP loopback", total_records / tc,
         gbps(tc), 100.0 * tm / tc);
  printf("%-28s %14.0f %10.2f %11s\n", "(d) memcpy", total_records / tm, gbps(tm), "100%");
  printf("CHANNEL channel_gbps=%.2f feed_shm_gbps=%.2f feed_tcp_gbps=%.2f memcpy_gbps=%.2f\n",
         gbps(ta), gbps(tb), gbps(tc), gbps(tm));
  printf("RESULT feed_channel feed_shm_vs_memcpy=%.3f feed_tcp_vs_memcpy=%.3f "
         "channel_vs_memcpy=%.3f channel_gbps=%.2f feed_shm_gbps=%.2f feed_tcp_gbps=%.2f "
         "memcpy_gbps=%.2f\n",
         tm / tb, tm / tc, tm / ta, gbps(ta), gbps(tb), gbps(tc), gbps(tm));
  for (int b = 0; b < POOL; b++) {
    free(pool[b].img);
    free(pool[b].label);
  }
  return 0;
}
