/* fuzz_batch.c - libFuzzer harness for ember_batch_decode (feed.h).
 *
 * Any input must decode or be rejected without an out-of-bounds read.  An
 * input that decodes must re-encode (canonical form: no trailing padding) to
 * a batch that is no longer than the input, decodes again, and carries the
 * same columns: names, dtypes, widths, data bytes and BYTES offsets.
 *
 * The input is copied into a malloc'd buffer first: the server decodes in
 * 8-aligned buffers, and BYTES offsets are only dereferenceable there. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ember/error.h"
#include "ember/feed.h"

static ember_column cols[EMBER_BATCH_MAX_COLS], again[EMBER_BATCH_MAX_COLS];

static void same_columns(uint32_t nc, uint32_t nr) {
  for (uint32_t i = 0; i < nc; i++) {
    const ember_column *a = &cols[i], *b = &again[i];
    if (a->dtype != b->dtype || a->name_len != b->name_len || a->width != b->width ||
        a->data_len != b->data_len)
      abort();
    if (a->name_len && memcmp(a->name, b->name, a->name_len) != 0) abort();
    if (a->data_len && memcmp(a->data, b->data, (size_t)a->data_len) != 0) abort();
    if (a->dtype == EMBER_DT_BYTES &&
        memcmp(a->offsets, b->offsets, ((size_t)nr + 1u) * 8u) != 0)
      abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t *buf = malloc(size ? size : 1), *out = NULL;
  uint32_t nc = 0, nr = 0, nc2 = 0, nr2 = 0;
  size_t need = 0, wrote = 0;
  if (buf == NULL) return 0;
  if (size) memcpy(buf, data, size);
  if (ember_batch_decode(buf, size, cols, EMBER_BATCH_MAX_COLS, &nc, &nr) != EMBER_OK) goto done;
  if (ember_batch_encoded_size(cols, nc, nr, &need) != EMBER_OK) abort();
  if (need > size || need + 8 <= size) abort(); /* at most 7 bytes of trailing padding */
  out = malloc(need ? need : 1);
  if (out == NULL) goto done;
  if (ember_batch_encode(cols, nc, nr, out, need, &wrote) != EMBER_OK || wrote != need) abort();
  if (ember_batch_decode(out, wrote, again, EMBER_BATCH_MAX_COLS, &nc2, &nr2) != EMBER_OK)
    abort();
  if (nc2 != nc || nr2 != nr) abort();
  same_columns(nc, nr);
done:
  free(out);
  free(buf);
  return 0;
}
