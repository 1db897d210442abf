/* bench/crc32c.c - CRC-32C throughput: ember_crc32c against the bare loop of
 * three independent crc32 instruction streams (no combining, so an upper
 * bound no real CRC of one buffer reaches), and the portable table code.
 * The buffer fits in L2 so the instruction, not memory, is measured.
 * EMBER_BENCH_QUICK=1 (make bench-smoke): rounds of ~0.02 s instead.
 * Prints one line: crc_gbps=<x> crc_limit_gbps=<y> portable_gbps=<z> hw=<0|1> */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ember/crc32c.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
__attribute__((target("sse4.2"))) static uint64_t bare3(const uint8_t *p, size_t n) {
  uint64_t a = 0, b = 0, c = 0;
  size_t third = (n / 3) & ~(size_t)7;
  const uint8_t *q = p + third, *r = p + 2 * third;
  for (size_t i = 0; i < third; i += 8) {
    uint64_t x, y, z;
    memcpy(&x, p + i, 8);
    memcpy(&y, q + i, 8);
    memcpy(&z, r + i, 8);
    a = _mm_crc32_u64(a, x);
    b = _mm_crc32_u64(b, y);
    c = _mm_crc32_u64(c, z);
  }
  return a ^ b ^ c;
}
#endif

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static volatile uint64_t sink;

static double round_s = 0.2;

/* Best of 5 rounds of ~round_s each, in GB/s. */
#define MEASURE(expr)                                                  \
  ({                                                                   \
    double best = 0;                                                   \
    for (int round = 0; round < 5; round++) {                          \
      size_t done = 0;                                                 \
      double t0 = now(), t;                                            \
      do {                                                             \
        for (int k = 0; k < 64; k++) sink += (expr);                   \
        done += 64 * N;                                                \
      } while ((t = now() - t0) < round_s);                             \
      if (done / t / 1e9 > best) best = done / t / 1e9;                \
    }                                                                  \
    best;                                                              \
  })

int main(void) {
  enum { N = 192 * 1024 };
  const char *quick = getenv("EMBER_BENCH_QUICK");
  if (quick != NULL && quick[0] != '\0' && strcmp(quick, "0") != 0) round_s = 0.02;
  uint8_t *buf = aligned_alloc(64, N);
  for (size_t i = 0; i < N; i++) buf[i] = (uint8_t)(i * 131 + 7);
  int hw = ember_crc32c_hw();
  double crc = MEASURE(ember_crc32c(0, buf, N));
  double limit = 0;
#if defined(__x86_64__)
  if (hw) limit = MEASURE(bare3(buf, N));
#endif
  double portable = MEASURE(ember_crc32c_portable(0, buf, N));
  printf("crc_gbps=%.2f crc_limit_gbps=%.2f portable_gbps=%.2f hw=%d\n", crc, limit, portable, hw);
  free(buf);
  return 0;
}
