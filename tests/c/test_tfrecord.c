/* test_tfrecord.c - TFRecord writer/reader round trips over memory, files and
 * read functions, plain/GZIP/ZLIB, and corruption: flipped length bit,
 * flipped data bit, truncated tail, each detected with file and offset or
 * skipped and counted. */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "ember/crc32c.h"
#include "ember/tfrecord.h"
#include "harness.h"

#define NREC 50

/* Record i: i*37 bytes of a pattern (record 0 is empty). */
static size_t rec_len(int i) { return (size_t)i * 37u; }
static void rec_fill(uint8_t *p, int i) {
  for (size_t k = 0; k < rec_len(i); k++) p[k] = (uint8_t)(i * 7 + k);
}

/* Writes NREC records into memory; returns a malloc'd copy. */
static uint8_t *make_file(int compression, size_t *len) {
  ember_tfr_writer *w;
  CHECK_OK(ember_tfr_writer_open_mem(&w, compression, -1));
  uint8_t rec[NREC * 37];
  for (int i = 0; i < NREC; i++) {
    rec_fill(rec, i);
    CHECK_OK(ember_tfr_writer_write(w, rec, rec_len(i)));
  }
  CHECK_OK(ember_tfr_writer_close(w));
  CHECK_EQ_INT(ember_tfr_writer_records(w), NREC);
  const uint8_t *d;
  CHECK_OK(ember_tfr_writer_mem(w, &d, len));
  uint8_t *copy = malloc(*len ? *len : 1);
  memcpy(copy, d, *len);
  ember_tfr_writer_destroy(w);
  return copy;
}

/* Reads all records and checks them against the pattern; returns the count. */
static int read_all(ember_tfr_reader *r) {
  const uint8_t *d;
  size_t n;
  int i = 0, rc;
  uint8_t want[NREC * 37];
  while ((rc = ember_tfr_reader_next(r, &d, &n)) == 1) {
    CHECK(i < NREC);
    rec_fill(want, i);
    CHECK_EQ_INT(n, rec_len(i));
    CHECK(n == 0 || memcmp(d, want, n) == 0);
    i++;
  }
  CHECK_EQ_INT(rc, 0);
  return i;
}

TEST(plain_layout) {
  size_t len;
  uint8_t *f = make_file(EMBER_TFR_PLAIN, &len);
  size_t want = 0;
  for (int i = 0; i < NREC; i++) want += 16 + rec_len(i);
  CHECK_EQ_INT(len, want);
  /* Record 0 is empty: its header is length 0 plus the masked CRC of 8 zero
   * bytes, then the masked CRC of nothing. */
  uint8_t zero8[8] = {0};
  uint32_t c = ember_crc32c_masked(zero8, 8);
  CHECK(memcmp(f, zero8, 8) == 0);
  CHECK(f[8] == (c & 0xff) && f[11] == (c >> 24));
  uint32_t e = ember_crc32c_masked(NULL, 0);
  CHECK(f[12] == (e & 0xff) && f[15] == (e >> 24));
  free(f);
}

TEST(round_trip_memory_all_compressions) {
  for (int comp = 0; comp <= 2; comp++) {
    size_t len;
    uint8_t *f = make_file(comp, &len);
    ember_tfr_options o = {comp, 0, 0, 0};
    ember_tfr_reader *r;
    CHECK_OK(ember_tfr_reader_open_mem(&r, f, len, "mem", &o));
    CHECK_EQ_INT(read_all(r), NREC);
    ember_tfr_stats st;
    ember_tfr_reader_stats(r, &st);
    CHECK_EQ_INT(st.records, NREC);
    CHECK_EQ_INT(st.skipped, 0);
    /* At the end, next keeps returning 0. */
    const uint8_t *d;
    size_t n;
    CHECK_EQ_INT(ember_tfr_reader_next(r, &d, &n), 0);
    ember_tfr_reader_destroy(r);
    free(f);
  }
}

static char *tmpfile_with(const uint8_t *data, size_t len) {
  char *path = strdup("/tmp/ember_tfr_XXXXXX");
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  CHECK(write(fd, data, len) == (ssize_t)len);
  close(fd);
  return path;
}

TEST(round_trip_files_small_chunks) {
  for (int comp = 0; comp <= 2; comp++) {
    char *path = strdup("/tmp/ember_tfr_XXXXXX");
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    ember_tfr_writer *w;
    CHECK_OK(ember_tfr_writer_open_path(&w, path, comp, 6));
    uint8_t rec[NREC * 37];
    for (int i = 0; i < NREC; i++) {
      rec_fill(rec, i);
      CHECK_OK(ember_tfr_writer_write(w, rec, rec_len(i)));
      if (i == 10) CHECK_OK(ember_tfr_writer_flush(w));
    }
    CHECK_OK(ember_tfr_writer_close(w));
    CHECK_EQ_INT(ember_tfr_writer_write(w, rec, 1), EMBER_ESTATE);
    ember_tfr_writer_destroy(w);
    /* The smallest chunk forces many refills and window slides. */
    ember_tfr_options o = {comp, 0, 0, 1};
    ember_tfr_reader *r;
    CHECK_OK(ember_tfr_reader_open_path(&r, path, &o));
    CHECK_EQ_INT(read_all(r), NREC);
    ember_tfr_reader_destroy(r);
    unlink(path);
    free(path);
  }
  ember_tfr_reader *r;
  CHECK_EQ_INT(ember_tfr_reader_open_path(&r, "/nonexistent/x.tfrecord", NULL), EMBER_ENOTFOUND);
  CHECK(strstr(ember_last_error(), "/nonexistent/x.tfrecord") != NULL);
}

/* A read function returning at most `step` bytes per call. */
typedef struct {
  const uint8_t *p;
  size_t len, pos, step;
  int fail_at; /* fail with EMBER_EIO once pos reaches this (-1: never) */
} src_state;

static int64_t src_read(void *opaque, void *buf, size_t n) {
  src_state *s = opaque;
  if (s->fail_at >= 0 && s->pos >= (size_t)s->fail_at)
    return ember__set_error(EMBER_EIO, "webhdfs GET: connection reset");
  size_t k = s->len - s->pos;
  if (k > n) k = n;
  if (k > s->step) k = s->step;
  memcpy(buf, s->p + s->pos, k);
  s->pos += k;
  return (int64_t)k;
}

TEST(read_function_source) {
  for (int comp = 0; comp <= 2; comp++) {
    size_t len;
    uint8_t *f = make_file(comp, &len);
    for (size_t step = 1; step <= 4099; step += 2049) {
      src_state s = {f, len, 0, step, -1};
      ember_tfr_options o = {comp, 0, 0, 0};
      ember_tfr_reader *r;
      CHECK_OK(ember_tfr_reader_open_fn(&r, src_read, &s, "webhdfs://nn/x", &o));
      CHECK_EQ_INT(read_all(r), NREC);
      ember_tfr_reader_destroy(r);
    }
    /* A failing source: its message comes through, prefixed with the name. */
    src_state s = {f, len, 0, 100, 300};
    ember_tfr_options o = {comp, 0, 0, 0};
    ember_tfr_reader *r;
    CHECK_OK(ember_tfr_reader_open_fn(&r, src_read, &s, "webhdfs://nn/x", &o));
    const uint8_t *d;
    size_t n;
    int rc;
    while ((rc = ember_tfr_reader_next(r, &d, &n)) == 1) {
    }
    CHECK_EQ_INT(rc, EMBER_EIO);
    CHECK(strstr(ember_last_error(), "webhdfs://nn/x") != NULL);
    CHECK(strstr(ember_last_error(), "connection reset") != NULL);
    ember_tfr_reader_destroy(r);
    free(f);
  }
}

TEST(large_record_and_limit) {
  size_t big = 5u << 20;
  uint8_t *rec = malloc(big);
  for (size_t i = 0; i < big; i++) rec[i] = (uint8_t)(i * 13);
  ember_tfr_writer *w;
  CHECK_OK(ember_tfr_writer_open_mem(&w, EMBER_TFR_PLAIN, -1));
  CHECK_OK(ember_tfr_writer_write(w, "x", 1));
  CHECK_OK(ember_tfr_writer_write(w, rec, big));
  CHECK_OK(ember_tfr_writer_close(w));
  const uint8_t *f;
  size_t len;
  CHECK_OK(ember_tfr_writer_mem(w, &f, &len));
  char *path = tmpfile_with(f, len);
  ember_tfr_reader *r;
  const uint8_t *d;
  size_t n;
  CHECK_OK(ember_tfr_reader_open_path(&r, path, NULL));
  CHECK_EQ_INT(ember_tfr_reader_next(r, &d, &n), 1);
  CHECK_EQ_INT(ember_tfr_reader_next(r, &d, &n), 1);
  CHECK_EQ_INT(n, big);
  CHECK(memcmp(d, rec, big) == 0);
  CHECK_EQ_INT(ember_tfr_reader_offset(r), 17);
  CHECK_EQ_INT(ember_tfr_reader_next(r, &d, &n), 0);
  ember_tfr_reader_destroy(r);
  /* With a 1 MiB limit the big record is refused before it is buffered. */
  ember_tfr_options o = {0, 0, 1u << 20, 0};
  CHECK_OK(ember_tfr_reader_open_path(&r, path, &o));
  CHECK_EQ_INT(ember_tfr_reader_next(r, &d, &n), 1);
  CHECK_EQ_INT(ember_tfr_reader_next(r, &d, &n), EMBER_ETOOBIG);
  CHECK(strstr(ember_last_error(), "byte offset 17") != NULL);
  ember_tfr_reader_destroy(r);
  unlink(path);
  free(path);
  ember_tfr_writer_destroy(w);
  free(rec);
}

/* Offset of record i in the plain file. */
static size_t rec_offset(int i) {
  size_t off = 0;
  for (int k = 0; k < i; k++) off += 16 + rec_len(k);
  return off;
}

static int expect_error(const uint8_t *f, size_t len, int code, const char *what) {
  ember_tfr_reader *r;
  char *path = tmpfile_with(f, len);
  CHECK_OK(ember_tfr_reader_open_path(&r, path, NULL));
  const uint8_t *d;
  size_t n;
  int rc, count = 0;
  while ((rc = ember_tfr_reader_next(r, &d, &n)) == 1) count++;
  CHECK_EQ_INT(rc, code);
  if (strstr(ember_last_error(), what) == NULL || strstr(ember_last_error(), path) == NULL) {
    fprintf(stderr, "message %s lacks %s or %s\n", ember_last_error(), what, path);
    CHECK(0);
  }
  /* Sticky. */
  ember_clear_error();
  CHECK_EQ_INT(ember_tfr_reader_next(r, &d, &n), code);
  CHECK(strstr(ember_last_error(), what) != NULL);
  ember_tfr_reader_destroy(r);
  unlink(path);
  free(path);
  return count;
}

static void expect_skip(const uint8_t *f, size_t len, int want_records, uint64_t want_skipped) {
  ember_tfr_options o = {0, EMBER_TFR_SKIP_CORRUPT, 0, 0};
  ember_tfr_reader *r;
  CHECK_OK(ember_tfr_reader_open_mem(&r, f, len, "mem", &o));
  const uint8_t *d;
  size_t n;
  int rc, count = 0;
  while ((rc = ember_tfr_reader_next(r, &d, &n)) == 1) count++;
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(count, want_records);
  ember_tfr_stats st;
  ember_tfr_reader_stats(r, &st);
  CHECK_EQ_INT(st.records, want_records);
  CHECK_EQ_INT(st.skipped, want_skipped);
  CHECK(st.skipped_bytes > 0);
  CHECK_EQ_INT(st.stream_bytes, len);
  ember_tfr_reader_destroy(r);
}

TEST(corrupt_length_bit) {
  size_t len;
  uint8_t *f = make_file(EMBER_TFR_PLAIN, &len);
  size_t off = rec_offset(20);
  f[off + 2] ^= 0x10; /* a bit of record 20's length */
  char want[64];
  snprintf(want, sizeof want, "byte offset %zu: length CRC mismatch", off);
  CHECK_EQ_INT(expect_error(f, len, EMBER_ECORRUPT, want), 20);
  /* Skipping resynchronizes on record 21's header. */
  expect_skip(f, len, NREC - 1, 1);
  free(f);
}

TEST(corrupt_data_bit) {
  size_t len;
  uint8_t *f = make_file(EMBER_TFR_PLAIN, &len);
  size_t off = rec_offset(33);
  f[off + 12 + 5] ^= 0x01;
  char want[64];
  snprintf(want, sizeof want, "byte offset %zu: data CRC mismatch", off);
  CHECK_EQ_INT(expect_error(f, len, EMBER_ECORRUPT, want), 33);
  expect_skip(f, len, NREC - 1, 1);
  /* Without CRC checks the flipped record is returned as is. */
  ember_tfr_options o = {0, EMBER_TFR_NO_CRC, 0, 0};
  ember_tfr_reader *r;
  CHECK_OK(ember_tfr_reader_open_mem(&r, f, len, "mem", &o));
  const uint8_t *d;
  size_t n;
  int count = 0;
  while (ember_tfr_reader_next(r, &d, &n) == 1) count++;
  CHECK_EQ_INT(count, NREC);
  ember_tfr_reader_destroy(r);
  free(f);
}

TEST(truncated_tail) {
  size_t len;
  uint8_t *f = make_file(EMBER_TFR_PLAIN, &len);
  size_t off = rec_offset(NREC - 1);
  char want[64];
  snprintf(want, sizeof want, "truncated record at byte offset %zu", off);
  /* Inside the data, and inside the header. */
  CHECK_EQ_INT(expect_error(f, len - 3, EMBER_ETRUNCATED, want), NREC - 1);
  CHECK_EQ_INT(expect_error(f, off + 5, EMBER_ETRUNCATED, want), NREC - 1);
  expect_skip(f, len - 3, NREC - 1, 1);
  expect_skip(f, off + 5, NREC - 1, 1);
  free(f);
}

TEST(compressed_corruption) {
  size_t len;
  uint8_t *f = make_file(EMBER_TFR_GZIP, &len);
  ember_tfr_options o = {EMBER_TFR_GZIP, 0, 0, 0};
  ember_tfr_reader *r;
  const uint8_t *d;
  size_t n;
  int rc;
  /* A truncated gzip stream. */
  CHECK_OK(ember_tfr_reader_open_mem(&r, f, len / 2, "x.gz", &o));
  while ((rc = ember_tfr_reader_next(r, &d, &n)) == 1) {
  }
  CHECK(rc == EMBER_ETRUNCATED);
  CHECK(strstr(ember_last_error(), "x.gz") != NULL);
  ember_tfr_reader_destroy(r);
  /* Garbage in the deflate data. */
  for (size_t i = 20; i < 60; i++) f[i] ^= 0x5a;
  CHECK_OK(ember_tfr_reader_open_mem(&r, f, len, "x.gz", &o));
  while ((rc = ember_tfr_reader_next(r, &d, &n)) == 1) {
  }
  CHECK(rc == EMBER_ECORRUPT || rc == EMBER_ETRUNCATED);
  CHECK(strstr(ember_last_error(), "x.gz") != NULL);
  ember_tfr_reader_destroy(r);
  free(f);
  /* Concatenated gzip members read as one stream. */
  size_t l1, l2;
  uint8_t *a = make_file(EMBER_TFR_GZIP, &l1);
  uint8_t *b = make_file(EMBER_TFR_GZIP, &l2);
  uint8_t *ab = malloc(l1 + l2);
  memcpy(ab, a, l1);
  memcpy(ab + l1, b, l2);
  CHECK_OK(ember_tfr_reader_open_mem(&r, ab, l1 + l2, "ab.gz", &o));
  int count = 0;
  while ((rc = ember_tfr_reader_next(r, &d, &n)) == 1) count++;
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(count, 2 * NREC);
  ember_tfr_reader_destroy(r);
  free(a);
  free(b);
  free(ab);
}

TEST(empty_inputs_and_bad_args) {
  ember_tfr_reader *r;
  const uint8_t *d;
  size_t n;
  for (int comp = 0; comp <= 2; comp++) {
    ember_tfr_options o = {comp, 0, 0, 0};
    CHECK_OK(ember_tfr_reader_open_mem(&r, NULL, 0, "empty", &o));
    CHECK_EQ_INT(ember_tfr_reader_next(r, &d, &n), 0);
    ember_tfr_reader_destroy(r);
  }
  ember_tfr_options bad = {7, 0, 0, 0};
  CHECK_EQ_INT(ember_tfr_reader_open_mem(&r, "", 0, "x", &bad), EMBER_EINVAL);
  ember_tfr_options badflags = {0, 0x80, 0, 0};
  CHECK_EQ_INT(ember_tfr_reader_open_mem(&r, "", 0, "x", &badflags), EMBER_EINVAL);
  ember_tfr_writer *w;
  CHECK_EQ_INT(ember_tfr_writer_open_mem(&w, 0, 12), EMBER_EINVAL);
  CHECK_EQ_INT(ember_tfr_writer_open_path(&w, "/nonexistent/dir/x", 0, -1), EMBER_ENOTFOUND);
  CHECK_OK(ember_tfr_writer_open_mem(&w, 0, -1));
  CHECK_EQ_INT(ember_tfr_writer_mem(w, &d, &n), EMBER_ESTATE);
  ember_tfr_writer_destroy(w);
  ember_tfr_reader_destroy(NULL);
  ember_tfr_writer_destroy(NULL);
}

RUN_TESTS(T(plain_layout), T(round_trip_memory_all_compressions),
          T(round_trip_files_small_chunks), T(read_function_source),
          T(large_record_and_limit), T(corrupt_length_bit), T(corrupt_data_bit),
          T(truncated_tail), T(compressed_corruption), T(empty_inputs_and_bad_args))
