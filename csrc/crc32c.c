/* crc32c.c - CRC-32C with the SSE4.2 instruction and a portable fallback.
 *
 * Hardware path (after Mark Adler's crc32c.c): the crc32 instruction has a
 * latency of three cycles but a throughput of one per cycle, so one
 * dependent chain runs at a third of the possible speed.  Long inputs are cut
 * into three adjacent blocks whose CRCs run as three independent chains in
 * the same loop; the three CRCs are then combined by "shifting" the first
 * through the length of the next block with a precomputed GF(2) operator (4
 * table lookups) and xoring.  Blocks of LONG bytes, then SHORT bytes, keep the
 * combining cost below 1% of the work for any input over a few hundred bytes.
 *
 * Portable path: slicing-by-8 (eight 256-entry tables, 8 bytes per step).
 *
 * Tables are built once under pthread_once; CPU detection uses
 * __builtin_cpu_supports, so a binary built here still runs on a CPU without
 * SSE4.2. */
#include "ember/crc32c.h"

#include <pthread.h>
#include <string.h>

#define POLY 0x82f63b78u /* CRC-32C, reflected */

/* ================================================================ portable */

static uint32_t sw_table[8][256];
static pthread_once_t sw_once = PTHREAD_ONCE_INIT;

static void sw_init(void) {
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t c = n;
    for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
    sw_table[0][n] = c;
  }
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t c = sw_table[0][n];
    for (int k = 1; k < 8; k++) {
      c = sw_table[0][c & 0xff] ^ (c >> 8);
      sw_table[k][n] = c;
    }
  }
}

static inline uint64_t load_le64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

uint32_t ember_crc32c_portable(uint32_t crc, const void *buf, size_t n) {
  const unsigned char *p = buf;
  pthread_once(&sw_once, sw_init);
  uint64_t c = crc ^ 0xffffffffu;
  while (n > 0 && ((uintptr_t)p & 7) != 0) {
    c = sw_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    n--;
  }
  while (n >= 8) {
    c ^= load_le64(p);
    c = sw_table[7][c & 0xff] ^ sw_table[6][(c >> 8) & 0xff] ^
        sw_table[5][(c >> 16) & 0xff] ^ sw_table[4][(c >> 24) & 0xff] ^
        sw_table[3][(c >> 32) & 0xff] ^ sw_table[2][(c >> 40) & 0xff] ^
        sw_table[1][(c >> 48) & 0xff] ^ sw_table[0][c >> 56];
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = sw_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    n--;
  }
  return (uint32_t)c ^ 0xffffffffu;
}

/* ================================================================ hardware */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define EMBER__CRC_HW 1

#define LONG 8192u
#define SHORT 256u

static uint32_t zeros_long[4][256];
static uint32_t zeros_short[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    mat++;
  }
  return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
  for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends len zero bytes to a CRC (len a power of two). */
static void zeros_op(uint32_t *even, size_t len) {
  uint32_t odd[32];
  odd[0] = POLY; /* one zero bit */
  uint32_t row = 1;
  for (int n = 1; n < 32; n++) {
    odd[n] = row;
    row <<= 1;
  }
  gf2_square(even, odd); /* two zero bits */
  gf2_square(odd, even); /* four */
  /* The first square below gives one zero byte, the next two, and so on. */
  do {
    gf2_square(even, odd);
    len >>= 1;
    if (len == 0) return;
    gf2_square(odd, even);
    len >>= 1;
  } while (len);
  memcpy(even, odd, sizeof odd);
}

static void zeros_tables(uint32_t zeros[4][256], size_t len) {
  uint32_t op[32];
  zeros_op(op, len);
  for (uint32_t n = 0; n < 256; n++) {
    zeros[0][n] = gf2_times(op, n);
    zeros[1][n] = gf2_times(op, n << 8);
    zeros[2][n] = gf2_times(op, n << 16);
    zeros[3][n] = gf2_times(op, n << 24);
  }
}

static void hw_init(void) {
  zeros_tables(zeros_long, LONG);
  zeros_tables(zeros_short, SHORT);
}

static inline uint32_t shift(uint32_t zeros[4][256], uint32_t crc) {
  return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^
         zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const void *buf,
                                                          size_t len) {
  const unsigned char *next = buf;
  uint64_t c0 = crc ^ 0xffffffffu;
  while (len > 0 && ((uintptr_t)next & 7) != 0) {
    c0 = _mm_crc32_u8((uint32_t)c0, *next++);
    len--;
  }
  while (len >= 3 * LONG) {
    uint64_t c1 = 0, c2 = 0;
    const unsigned char *end = next + LONG;
    do {
      c0 = _mm_crc32_u64(c0, load_le64(next));
      c1 = _mm_crc32_u64(c1, load_le64(next + LONG));
      c2 = _mm_crc32_u64(c2, load_le64(next + 2 * LONG));
      next += 8;
    } while (next < end);
    c0 = shift(zeros_long, (uint32_t)c0) ^ c1;
    c0 = shift(zeros_long, (uint32_t)c0) ^ c2;
    next += 2 * LONG;
    len -= 3 * LONG;
  }
  while (len >= 3 * SHORT) {
    uint64_t c1 = 0, c2 = 0;
    const unsigned char *end = next + SHORT;
    do {
      c0 = _mm_crc32_u64(c0, load_le64(next));
      c1 = _mm_crc32_u64(c1, load_le64(next + SHORT));
      c2 = _mm_crc32_u64(c2, load_le64(next + 2 * SHORT));
      next += 8;
    } while (next < end);
    c0 = shift(zeros_short, (uint32_t)c0) ^ c1;
    c0 = shift(zeros_short, (uint32_t)c0) ^ c2;
    next += 2 * SHORT;
    len -= 3 * SHORT;
  }
  while (len >= 8) {
    c0 = _mm_crc32_u64(c0, load_le64(next));
    next += 8;
    len -= 8;
  }
  while (len > 0) {
    c0 = _mm_crc32_u8((uint32_t)c0, *next++);
    len--;
  }
  return (uint32_t)c0 ^ 0xffffffffu;
}

static int hw_detect(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2") ? 1 : 0;
}
#endif

/* ================================================================ dispatch */

static int use_hw = -1; /* set once under pthread_once */
static pthread_once_t dispatch_once = PTHREAD_ONCE_INIT;

static void dispatch_init(void) {
#ifdef EMBER__CRC_HW
  use_hw = hw_detect();
  if (use_hw) hw_init();
#else
  use_hw = 0;
#endif
}

int ember_crc32c_hw(void) {
  pthread_once(&dispatch_once, dispatch_init);
  return use_hw;
}

uint32_t ember_crc32c(uint32_t crc, const void *buf, size_t n) {
  if (n == 0) return crc;
  pthread_once(&dispatch_once, dispatch_init);
#ifdef EMBER__CRC_HW
  if (use_hw) return crc_hw(crc, buf, n);
#endif
  return ember_crc32c_portable(crc, buf, n);
}
