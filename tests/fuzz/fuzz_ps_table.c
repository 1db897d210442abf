/* fuzz_ps_table.c - libFuzzer harness for the parameter-server table's
 * checkpoint decoder (ps_table.c).  The first byte picks the shard (of 4);
 * the rest is decoded as one table.
 *
 * Besides "no crash, no out-of-bounds read, no leak" (ASan/UBSan) it checks:
 *  - a failure is EMBER_ECORRUPT, leaves the output NULL and sets a message;
 *  - a decoded table re-encodes to as many bytes as it was read from, and
 *    that encoding decodes (to the byte) to itself;
 *  - the table serves rows: a pull and a push of rows this shard holds
 *    succeed, and a push naming a row out of range is refused and changes
 *    nothing. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/ps_table.h"
#include "ember/error.h"
#include "ember/ps.h"
#include "ember/wire.h"

#define SHARDS 4u

static void require(int cond) {
  if (!cond) abort();
}

static void encode(const ember__ps_table *t, ember_wire_writer *w) {
  ember_wire_writer_init(w);
  ember__ps_table_encode(t, w);
  require(w->err == EMBER_OK);
}

static int same(const ember_wire_writer *a, const ember_wire_writer *b) {
  return a->len == b->len && (a->len == 0 || memcmp(a->buf, b->buf, a->len) == 0);
}

/* A few rows this shard holds, picked from the table's range; 0 if none. */
static size_t pick_rows(const ember_ps_table_spec *s, uint32_t shard, uint64_t *ids, size_t cap) {
  size_t n = 0;
  if (s->layout == EMBER_PS_DENSE) {
    uint64_t begin = (uint64_t)((unsigned __int128)s->rows * shard / SHARDS);
    uint64_t end = (uint64_t)((unsigned __int128)s->rows * (shard + 1) / SHARDS);
    for (uint64_t r = begin; r < end && n < cap; r += 1 + (end - begin) / cap) ids[n++] = r;
  } else {
    /* about one row in SHARDS is ours: try a few spread over the range */
    for (uint64_t i = 0; i < 8 * cap && n < cap; i++) {
      uint64_t r = s->rows <= 8 * cap ? i : i * (s->rows / (8 * cap));
      if (r < s->rows && ember_ps_shard_of_row(s->layout, s->rows, r, SHARDS) == shard)
        ids[n++] = r;
    }
  }
  return n;
}

static void exercise(ember__ps_table *t, uint32_t shard, const uint8_t *data, size_t size) {
  const ember_ps_table_spec *s = ember__ps_table_spec(t);
  /* wide rows cost time, not coverage */
  if (s->cols > 4096) return;
  uint64_t ids[4];
  size_t n = pick_rows(s, shard, ids, 3);
  float *buf = malloc((size_t)s->cols * 4 * sizeof *buf);
  require(buf != NULL);
  if (n > 0) {
    uint64_t held = ember__ps_table_held(t);
    require(ember__ps_table_pull(t, ids, n, buf) == EMBER_OK);
    require(ember__ps_table_held(t) <= held + n);
    for (size_t i = 0; i < n * s->cols; i++) {
      uint8_t b = size > 0 ? data[i % size] : 1;
      buf[i] = ((float)b - 128.0f) / 64.0f;
    }
    ids[n] = ids[0]; /* a row twice */
    memcpy(buf + n * s->cols, buf, s->cols * sizeof *buf);
    require(ember__ps_table_push(t, ids, n + 1, buf) == EMBER_OK);
  }
  /* a row beyond the table: refused, the table unchanged */
  if (s->rows < UINT64_MAX) {
    ember_wire_writer before, after;
    encode(t, &before);
    ids[n] = s->rows;
    for (size_t i = 0; i < (n + 1) * s->cols; i++) buf[i] = 1.0f;
    require(ember__ps_table_push(t, ids, n + 1, buf) == EMBER_EINVAL);
    encode(t, &after);
    require(same(&before, &after));
    ember_wire_writer_free(&before);
    ember_wire_writer_free(&after);
  }
  free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  uint32_t shard = data[0] % SHARDS;
  ember_wire_reader r;
  ember_wire_reader_init(&r, data + 1, size - 1);
  ember__ps_table *t = (ember__ps_table *)&r; /* must be cleared on failure */
  int rc = ember__ps_table_decode(&r, shard, SHARDS, &t);
  if (rc != EMBER_OK) {
    require(rc == EMBER_ECORRUPT);
    require(t == NULL);
    require(ember_last_error()[0] != '\0');
    return 0;
  }
  require(t != NULL);
  const ember_ps_table_spec *s = ember__ps_table_spec(t);
  require(s->rows > 0 && s->cols > 0 && s->cols <= EMBER_PS_MAX_COLS);
  require(ember__ps_table_held(t) <= s->rows);

  /* normalising the spec rewrites fields in place, never their size */
  ember_wire_writer w, w2;
  encode(t, &w);
  require(w.len == size - 1 - r.left);
  ember_wire_reader r2;
  ember_wire_reader_init(&r2, w.buf, w.len);
  ember__ps_table *t2 = NULL;
  require(ember__ps_table_decode(&r2, shard, SHARDS, &t2) == EMBER_OK);
  require(r2.left == 0);
  encode(t2, &w2);
  require(same(&w, &w2));
  ember_wire_writer_free(&w);
  ember_wire_writer_free(&w2);
  ember__ps_table_destroy(t2);

  exercise(t, shard, data, size);
  ember__ps_table_destroy(t);
  return 0;
}
