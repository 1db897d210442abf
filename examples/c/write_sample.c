/* write_sample.c - write a small TFRecord file of tf.train.Examples with
 * libember's public C API: columns in, one Example per row out.
 *
 *   write_sample FILE         (FILE ending in .gz is written as GZIP)
 *
 * Ten rows: "image" 4 floats, "label" one int64, and "caption" one string on
 * the even rows only (left out of the odd ones).  `make test-c-install` reads
 * the file back with tfrecord_summary and checks those counts.
 *
 *   cc -std=c11 write_sample.c $(pkg-config --cflags --libs ember) -o write_sample
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <ember/error.h>
#include <ember/example.h>
#include <ember/tfrecord.h>

#define ROWS 10

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s FILE\n", argv[0]);
    return 2;
  }
  const char *path = argv[1];
  size_t plen = strlen(path);
  int compression = plen > 3 && strcmp(path + plen - 3, ".gz") == 0 ? EMBER_TFR_GZIP : EMBER_TFR_PLAIN;

  /* The columns: dense image and label, and a variable bytes column whose
   * rows index its strings through row_offsets (an empty row is absent). */
  float image[ROWS * 4];
  int64_t label[ROWS];
  char captions[ROWS * 8];
  uint64_t value_offsets[ROWS + 1] = {0}, row_offsets[ROWS + 1] = {0};
  uint8_t present[ROWS];
  uint64_t nstrings = 0, nbytes = 0;
  for (int i = 0; i < ROWS; i++) {
    for (int k = 0; k < 4; k++) image[i * 4 + k] = (float)(i * 4 + k) / 8.0f;
    label[i] = i % 3;
    present[i] = i % 2 == 0;
    if (present[i]) {
      nbytes += (uint64_t)snprintf(captions + nbytes, 8, "row-%d", i);
      value_offsets[++nstrings] = nbytes;
    }
    row_offsets[i + 1] = nstrings;
  }
  const ember_ex_input cols[] = {
      {.name = "image", .kind = EMBER_EX_FLOAT, .width = 4, .values = image, .nvalues = ROWS * 4},
      {.name = "label", .kind = EMBER_EX_INT64, .width = 1, .values = label, .nvalues = ROWS},
      {.name = "caption", .kind = EMBER_EX_BYTES, .width = 0, .values = captions,
       .nvalues = nstrings, .value_offsets = value_offsets, .nbytes = nbytes,
       .row_offsets = row_offsets, .present = present},
  };
  const uint32_t ncols = sizeof cols / sizeof cols[0];

  ember_tfr_writer *w = NULL;
  uint8_t buf[256]; /* one encoded row is well under this; checked below */
  int rc = ember_tfr_writer_open_path(&w, path, compression, -1);
  for (uint64_t row = 0; rc == EMBER_OK && row < ROWS; row++) {
    size_t size = 0, written = 0;
    rc = ember_ex_encoded_size(cols, ncols, row, &size);
    if (rc == EMBER_OK && size > sizeof buf) {
      fprintf(stderr, "write_sample: row %llu needs %zu bytes\n", (unsigned long long)row, size);
      ember_tfr_writer_destroy(w);
      return 1;
    }
    if (rc == EMBER_OK) rc = ember_ex_encode(cols, ncols, row, buf, sizeof buf, &written);
    if (rc == EMBER_OK) rc = ember_tfr_writer_write(w, buf, written);
  }
  /* Nothing is known to be on disk until close succeeds. */
  if (rc == EMBER_OK) rc = ember_tfr_writer_close(w);
  if (rc != EMBER_OK) fprintf(stderr, "write_sample: %s (%s)\n", ember_last_error(), ember_err_name(rc));
  ember_tfr_writer_destroy(w);
  return rc == EMBER_OK ? 0 : 1;
}
