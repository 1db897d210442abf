/* fuzz_tfrecord.c - libFuzzer harness for the TFRecord reader.
 *
 * The first input byte picks the compression (plain, GZIP, ZLIB), the CRC
 * and skip flags and the read-function chunk size; the rest is the file.
 * Besides "no crash, no out-of-bounds read" (ASan/UBSan) it checks:
 *  - the memory reader (zero copy) and the read-function reader (chunked
 *    reads, window slides) return the same records and the same status;
 *  - with SKIP_CORRUPT on plain input the reader never fails and accounts
 *    for every byte (stream_bytes == input length);
 *  - records accepted with CRC checks re-encode to exactly the bytes read. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ember/crc32c.h"
#include "ember/error.h"
#include "ember/tfrecord.h"

static void require(int cond) {
  if (!cond) abort();
}

typedef struct {
  const uint8_t *p;
  size_t len, pos, step;
} src;

static int64_t src_read(void *opaque, void *buf, size_t n) {
  src *s = opaque;
  size_t k = s->len - s->pos;
  if (k > n) k = n;
  if (k > s->step) k = s->step;
  memcpy(buf, s->p + s->pos, k);
  s->pos += k;
  return (int64_t)k;
}

#define MAXREC 64

typedef struct {
  size_t n;
  uint32_t crc[MAXREC];
  size_t len[MAXREC];
  int status;
  ember_tfr_stats st;
} run_result;

static void run(ember_tfr_reader *r, run_result *out) {
  const uint8_t *d;
  size_t n;
  int rc;
  out->n = 0;
  while ((rc = ember_tfr_reader_next(r, &d, &n)) == 1) {
    if (out->n < MAXREC) {
      out->crc[out->n] = ember_crc32c(0, d, n);
      out->len[out->n] = n;
    }
    out->n++;
  }
  out->status = rc;
  ember_tfr_reader_stats(r, &out->st);
  /* Sticky end or error. */
  require(ember_tfr_reader_next(r, &d, &n) == rc);
  ember_tfr_reader_destroy(r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  uint8_t mode = data[0];
  const uint8_t *file = data + 1;
  size_t len = size - 1;
  ember_tfr_options o = {mode % 3, 0, 1u << 20, 0};
  if (mode & 0x04) o.flags |= EMBER_TFR_SKIP_CORRUPT;
  if (mode & 0x08) o.flags |= EMBER_TFR_NO_CRC;
  size_t step = 1 + (mode >> 4) * 37u;

  ember_tfr_reader *r;
  run_result a, b;
  require(ember_tfr_reader_open_mem(&r, file, len, "fuzz", &o) == EMBER_OK);
  run(r, &a);
  src s = {file, len, 0, step};
  o.chunk = 4096; /* the minimum: many refills */
  require(ember_tfr_reader_open_fn(&r, src_read, &s, "fuzz", &o) == EMBER_OK);
  run(r, &b);
  require(a.status == b.status && a.n == b.n);
  for (size_t i = 0; i < a.n && i < MAXREC; i++) require(a.crc[i] == b.crc[i] && a.len[i] == b.len[i]);
  require(a.st.records == a.n && a.st.skipped == b.st.skipped);
  require(a.status <= 0);
  if (o.compression == EMBER_TFR_PLAIN && (o.flags & EMBER_TFR_SKIP_CORRUPT)) {
    require(a.status == 0);
    require(a.st.stream_bytes == len);
  }
  /* Plain, checked, clean: the records re-encode to the input's prefix. */
  if (o.compression == EMBER_TFR_PLAIN && o.flags == 0 && a.n > 0 && a.n <= MAXREC) {
    ember_tfr_reader_open_mem(&r, file, len, "fuzz", &o);
    ember_tfr_writer *w;
    require(ember_tfr_writer_open_mem(&w, EMBER_TFR_PLAIN, -1) == EMBER_OK);
    const uint8_t *d;
    size_t n;
    while (ember_tfr_reader_next(r, &d, &n) == 1) require(ember_tfr_writer_write(w, d, n) == EMBER_OK);
    require(ember_tfr_writer_close(w) == EMBER_OK);
    const uint8_t *out;
    size_t olen;
    require(ember_tfr_writer_mem(w, &out, &olen) == EMBER_OK);
    require(olen <= len && memcmp(out, file, olen) == 0);
    ember_tfr_writer_destroy(w);
    ember_tfr_reader_destroy(r);
  }
  return 0;
}
