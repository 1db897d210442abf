/* fuzz_ps_wire.c - libFuzzer harness for the parameter server's request
 * decoders (ps_codec.c, ps_link.c), what a ps shard reads from any
 * authenticated worker: PS_DECLARE, PS_PULL, PS_PUSH and PS_SHM.  Every
 * input goes to all four.
 *
 * Besides "no crash, no out-of-bounds read" (ASan/UBSan) it checks that a
 * decoded request's row ids and gradients lie inside the input, that a
 * decoded spec's name is NUL-free and shorter than the input, and that a
 * decoded spec re-encodes to the same bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/ps_internal.h"
#include "../../csrc/ps_link.h"
#include "ember/error.h"

static void require(int cond) {
  if (!cond) abort();
}

static int inside(const uint8_t *p, size_t n, const uint8_t *data, size_t size) {
  return p >= data && n <= size && (size_t)(p - data) <= size - n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  ember_ps_table_spec spec;
  char name[EMBER_PS_NAME_MAX];
  if (ember__ps_decode_spec(data, size, &spec, name) == EMBER_OK) {
    require(strlen(spec.name) < size);
    ember_wire_writer w;
    ember_wire_writer_init(&w);
    ember__ps_encode_spec(&w, &spec);
    require(!w.err && w.len == size && memcmp(w.buf, data, size) == 0);
    ember_wire_writer_free(&w);
  }
  ember__ps_pull_req pull;
  if (ember__ps_decode_pull(data, size, &pull) == EMBER_OK) {
    require(strlen(pull.table) < size);
    if (!pull.whole && pull.n) require(inside(pull.ids, (size_t)pull.n * 8, data, size));
  }
  ember__ps_push_req push;
  if (ember__ps_decode_push(data, size, &push) == EMBER_OK) {
    require(push.cols <= EMBER_PS_MAX_COLS);
    if (!push.whole && push.n) require(inside(push.ids, (size_t)push.n * 8, data, size));
    require(inside(push.grads, (size_t)push.n * push.cols * 4, data, size) ||
            (size_t)push.n * push.cols == 0);
  }
  /* PS_SHM is fixed-size: decoded exactly when the size is right, and the
   * descriptors re-encode to the input's bytes */
  uint8_t host[16], again[EMBER_SHM_RING_DESC_WIRE_LEN];
  ember_shm_ring_desc req, rep;
  int ok = ember__ps_shm_decode(data, size, host, &req, &rep) == EMBER_OK;
  require(ok == (size == EMBER__PS_SHM_LEN));
  if (ok) {
    require(memcmp(host, data, 16) == 0);
    ember_shm_ring_desc_encode(&req, again);
    require(memcmp(again, data + 16, sizeof again) == 0);
    ember_shm_ring_desc_encode(&rep, again);
    require(memcmp(again, data + 16 + sizeof again, sizeof again) == 0);
  }
  return 0;
}
