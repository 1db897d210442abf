/* fuzz_shm_ring.c - libFuzzer harness for the consumer side of shm_ring.h:
 * the ring's records and the producer's position are bytes another process
 * writes, so a consumer must survive any of them.
 *
 * Input: u64 head (the producer's published position), u8 script, then the
 * bytes of the data area (from position 0).  The harness plays the hostile
 * producer through ember__shm_ring_raw, then drives the real consumer API
 * with no waiting: the message calls (next / read / release, chosen by the
 * script bits) or, when the script's top bit is set, the stream calls
 * (peek / consume, a script-chosen part of each record at a time), and
 * checks what it reports: every DATA message is within the consumer's limit,
 * and a zero-copy view lies inside the ring's mapping.  ASan catches any
 * access outside the mapping or the caller's buffer. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ember/error.h"
#include "ember/shm_ring.h"

#define MAX_MESSAGE (256u * 1024u)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static uint8_t *buf;
  ember_shm_ring *c = NULL, *p = NULL;
  ember_shm_ring_desc d;
  uint64_t head;
  uint8_t script, *raw, *view;
  size_t len = 0, hdr, cap;
  if (size < 9) return 0;
  if (buf == NULL && (buf = malloc(MAX_MESSAGE)) == NULL) return 0;
  memcpy(&head, data, 8);
  script = data[8];
  data += 9;
  size -= 9;
  if (ember_shm_ring_create(&c, 65536, EMBER_SHM_CONSUMER) != EMBER_OK) abort();
  ember_shm_ring_describe(c, &d);
  if (ember_shm_ring_attach(&p, &d, EMBER_SHM_PRODUCER) != EMBER_OK) abort();
  raw = ember__shm_ring_raw(p, &len);
  view = ember__shm_ring_raw(c, NULL); /* the consumer's own mapping */
  cap = ember_shm_ring_capacity(p);
  hdr = len - cap;
  if (size > cap) size = cap;
  memcpy(raw + hdr, data, size);
  /* the shared head word sits at offset 64 of the header */
  memcpy(raw + 64, &head, 8);
  for (int i = 0; (script & 0x80) && i < 256; i++) {
    const void *v = NULL;
    size_t got = 0;
    if (ember_shm_ring_peek(c, &v, &got) != EMBER_OK || got == 0) break;
    const uint8_t *b = v;
    if (b < view + hdr || b + got > view + hdr + 2 * cap) abort();
    size_t take = (script & 1) ? got : (got + 1) / 2;
    memcpy(buf, b, take < MAX_MESSAGE ? take : MAX_MESSAGE);
    if (ember_shm_ring_consume(c, take) != EMBER_OK) abort();
  }
  for (int i = 0; !(script & 0x80) && i < 64; i++) {
    ember_shm_msg m;
    int rc = ember_shm_ring_next(c, &m, MAX_MESSAGE, 0);
    if (rc != EMBER_OK) break;
    if (m.kind != EMBER_SHM_MSG_DATA) break; /* END / ERROR are final */
    if (m.len > MAX_MESSAGE) abort();
    if (m.data != NULL) {
      const uint8_t *v = m.data;
      if (v < view + hdr || v + m.len > view + hdr + 2 * cap) abort();
    }
    rc = (script >> (i % 8)) & 1 ? ember_shm_ring_read(c, buf, MAX_MESSAGE, 0)
                                 : ember_shm_ring_release(c, 0);
    if (rc != EMBER_OK) break;
  }
  ember_shm_ring_destroy(p);
  ember_shm_ring_destroy(c);
  return 0;
}
