/* test_crc32c.c - CRC-32C known answers, hardware == portable on every length
 * and alignment, chaining, and TFRecord's mask. */
#include <stdint.h>

#include "ember/crc32c.h"
#include "harness.h"

TEST(known_answers) {
  /* The standard check value, and RFC 3720 (iSCSI) B.4 vectors. */
  CHECK_EQ_INT(ember_crc32c(0, "123456789", 9), 0xe3069283u);
  CHECK_EQ_INT(ember_crc32c_portable(0, "123456789", 9), 0xe3069283u);
  uint8_t buf[32];
  memset(buf, 0, sizeof buf);
  CHECK_EQ_INT(ember_crc32c(0, buf, 32), 0x8a9136aau);
  memset(buf, 0xff, sizeof buf);
  CHECK_EQ_INT(ember_crc32c(0, buf, 32), 0x62a8ab43u);
  for (int i = 0; i < 32; i++) buf[i] = (uint8_t)i;
  CHECK_EQ_INT(ember_crc32c(0, buf, 32), 0x46dd794eu);
  for (int i = 0; i < 32; i++) buf[i] = (uint8_t)(31 - i);
  CHECK_EQ_INT(ember_crc32c(0, buf, 32), 0x113fdb5cu);
  CHECK_EQ_INT(ember_crc32c(0, NULL, 0), 0);
  CHECK_EQ_INT(ember_crc32c(0x1234, NULL, 0), 0x1234);
}

TEST(hw_matches_portable_all_lengths_and_alignments) {
  /* Lengths across the SHORT (3*256) and LONG (3*8192) block boundaries. */
  enum { N = 3 * 8192 * 2 + 4096 };
  uint8_t *buf = malloc(N + 8);
  CHECK(buf != NULL);
  uint32_t s = 12345;
  for (size_t i = 0; i < N + 8; i++) {
    s = s * 1103515245u + 12345u;
    buf[i] = (uint8_t)(s >> 16);
  }
  static const size_t lens[] = {1, 7, 8, 9, 255, 256, 767, 768, 769, 1000, 3136,
                                24575, 24576, 24577, 49152, 53248};
  for (size_t a = 0; a < 8; a++)
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
      uint32_t h = ember_crc32c(0, buf + a, lens[i]);
      uint32_t p = ember_crc32c_portable(0, buf + a, lens[i]);
      if (h != p) fprintf(stderr, "align %zu len %zu: %08x != %08x\n", a, lens[i], h, p);
      CHECK(h == p);
    }
  /* Chaining: crc(a||b) == crc(crc(a), b), split anywhere. */
  uint32_t whole = ember_crc32c(0, buf, 30000);
  for (size_t cut = 0; cut <= 30000; cut += 997)
    CHECK_EQ_INT(ember_crc32c(ember_crc32c(0, buf, cut), buf + cut, 30000 - cut), whole);
  free(buf);
}

TEST(mask_round_trip) {
  CHECK_EQ_INT(ember_crc32c_hw(), ember_crc32c_hw()); /* stable */
  uint32_t v[] = {0, 1, 0xe3069283u, 0xffffffffu, 0x80000000u};
  for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
    CHECK_EQ_INT(ember_crc32c_unmask(ember_crc32c_mask(v[i])), v[i]);
    CHECK(ember_crc32c_mask(v[i]) != v[i]);
  }
  /* TFRecord header of an empty record: length 0 (8 zero bytes), masked. */
  uint8_t zero8[8] = {0};
  CHECK_EQ_INT(ember_crc32c_masked(zero8, 8),
               ember_crc32c_mask(ember_crc32c(0, zero8, 8)));
}

RUN_TESTS(T(known_answers), T(hw_matches_portable_all_lengths_and_alignments),
          T(mask_round_trip))
