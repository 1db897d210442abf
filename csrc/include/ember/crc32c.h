/* ember/crc32c.h - CRC-32C (Castagnoli), as used by TFRecord framing.
 *
 * ember_crc32c uses the SSE4.2 crc32 instruction when the CPU has it
 * (detected once, at first use) and a portable slicing-by-8 table otherwise;
 * both give identical results.  TFRecord stores CRCs "masked" (rotated and
 * offset) because a CRC computed over data that embeds CRCs is weak;
 * ember_crc32c_mask implements that transform.
 *
 * Thread-safety: all functions are thread-safe (one-time table setup is done
 * under pthread_once).  None blocks.
 */
#ifndef EMBER_CRC32C_H
#define EMBER_CRC32C_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Extends `crc` (0 to start) with buf[0..n).  ember_crc32c(0, "123456789", 9)
 * is 0xe3069283.  buf may be NULL when n is 0. */
uint32_t ember_crc32c(uint32_t crc, const void *buf, size_t n);

/* The portable implementation, whatever the CPU (for tests and benchmarks). */
uint32_t ember_crc32c_portable(uint32_t crc, const void *buf, size_t n);

/* 1 if ember_crc32c uses the crc32 instruction, else 0. */
int ember_crc32c_hw(void);

/* TFRecord's mask: ((crc >> 15) | (crc << 17)) + 0xa282ead8, and its inverse. */
static inline uint32_t ember_crc32c_mask(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}
static inline uint32_t ember_crc32c_unmask(uint32_t masked) {
  uint32_t rot = masked - 0xa282ead8u;
  return (rot >> 17) | (rot << 15);
}

/* The masked CRC-32C of buf[0..n), as stored in a TFRecord. */
static inline uint32_t ember_crc32c_masked(const void *buf, size_t n) {
  return ember_crc32c_mask(ember_crc32c(0, buf, n));
}

#ifdef __cplusplus
}
#endif
#endif /* EMBER_CRC32C_H */
