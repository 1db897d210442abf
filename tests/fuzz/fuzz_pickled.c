/* fuzz_pickled.c - libFuzzer harness for ember_pickled_scan (pickled.h).
 *
 * Any input must be read or refused without an out-of-bounds read or a leak.
 * An input that is read describes at least one record of at least one field,
 * every array value's bytes lie within the input, and every record's values
 * are of their field's kind.  A second scan of the same bytes gives the same
 * answer (the scan keeps no state between calls).  The corpus holds frames
 * that Python's pickle.dumps(records, 5) wrote (tests/fuzz/corpus/fuzz_pickled). */
#include <stdint.h>
#include <stdlib.h>

#include "ember/error.h"
#include "ember/pickled.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  ember_pickled *p = NULL;
  int rc = ember_pickled_scan(data, size, &p);
  if (rc != EMBER_OK) {
    if (p != NULL || (rc != EMBER_ESCHEMA && rc != EMBER_ENOMEM)) abort();
    ember_pickled *again = NULL;
    if (ember_pickled_scan(data, size, &again) != rc || again != NULL) abort();
    return 0;
  }
  size_t n = ember_pickled_count(p), w = ember_pickled_fields(p);
  if (n == 0 || w == 0 || w > EMBER_PICKLED_MAX_FIELDS) abort();
  if (!ember_pickled_tuples(p) && w != 1) abort();
  for (size_t j = 0; j < w; j++) {
    const ember_pickled_field *f = ember_pickled_field_at(p, j);
    if (f->kind < EMBER_PK_ARRAY || f->kind > EMBER_PK_BOOL) abort();
    if (f->kind != EMBER_PK_ARRAY) continue;
    if (f->ndim == 0 || f->ndim > EMBER_PICKLED_MAX_DIMS || f->row_bytes > size) abort();
    for (size_t i = 0; i < n; i++) {
      ember_pickled_value v = ember_pickled_value_at(p, i, j);
      if (v.at > size || f->row_bytes > size - v.at) abort();
      volatile uint8_t sink = 0;
      for (uint64_t k = 0; k < f->row_bytes; k++) sink ^= data[v.at + k]; /* ASan checks */
      (void)sink;
    }
  }
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < w; j++)
      if (ember_pickled_field_at(p, j)->kind == EMBER_PK_BOOL &&
          (ember_pickled_value_at(p, i, j).i & ~(int64_t)1) != 0)
        abort();
  ember_pickled_free(p);
  return 0;
}
