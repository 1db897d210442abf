/* bench/example_decode.c - decoding tf.train.Examples into columns: Ember's
 * hand-written decoder (csrc/example.c) against protobuf-c's generated one
 * (protobuf_c_message_unpack, then copying each wanted list into its column,
 * then free_unpacked -- what using protobuf-c inside Ember would cost).
 * Input: a plain TFRecord file of Examples with a dense float feature and an
 * int64 feature (bench/tfrecord.py writes Fashion-MNIST: "image" 784 floats,
 * "label").  Prints: ember_gbps=<x> protobuf_c_gbps=<y> records=<n> */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ember/error.h"
#include "ember/example.h"
#include "ember/tfrecord.h"
#include "example.pb-c.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
  const uint8_t *p;
  size_t n;
} rec;

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s FILE FLOAT_FEATURE INT_FEATURE [WIDTH]\n", argv[0]);
    return 2;
  }
  uint32_t width = argc > 4 ? (uint32_t)atoi(argv[4]) : 784;
  ember_tfr_reader *r;
  if (ember_tfr_reader_open_path(&r, argv[1], NULL) != 0) {
    fprintf(stderr, "%s\n", ember_last_error());
    return 1;
  }
  /* Load every record into memory first: only decoding is timed. */
  size_t cap = 1024, n = 0, total = 0;
  rec *recs = malloc(cap * sizeof *recs);
  const uint8_t *d;
  size_t len;
  while (ember_tfr_reader_next(r, &d, &len) == 1) {
    if (n == cap) recs = realloc(recs, (cap *= 2) * sizeof *recs);
    uint8_t *c = malloc(len ? len : 1);
    memcpy(c, d, len);
    recs[n].p = c;
    recs[n++].n = len;
    total += len;
  }
  ember_tfr_reader_destroy(r);
  enum { BATCH = 1024 };

  /* Ember: decode into dense columns, BATCH rows at a time. */
  ember_ex_spec spec[2] = {{argv[2], EMBER_EX_FLOAT, width, 0}, {argv[3], EMBER_EX_INT64, 1, 0}};
  ember_ex_decoder *dec;
  ember_ex_decoder_create(&dec, spec, 2);
  double best_e = 0, best_p = 0;
  for (int round = 0; round < 3; round++) {
    double t0 = now();
    for (size_t i = 0; i < n; i++) {
      if (ember_ex_decoder_add(dec, recs[i].p, recs[i].n) != 0) {
        fprintf(stderr, "record %zu: %s\n", i, ember_last_error());
        return 1;
      }
      if (ember_ex_decoder_rows(dec) == BATCH) ember_ex_decoder_clear(dec);
    }
    double g = total / (now() - t0) / 1e9;
    if (g > best_e) best_e = g;
    ember_ex_decoder_clear(dec);
  }
  ember_ex_decoder_destroy(dec);

  /* protobuf-c: unpack, copy the two lists into the same column layout, free. */
  float *img = malloc((size_t)BATCH * width * sizeof *img);
  int64_t *lab = malloc(BATCH * sizeof *lab);
  for (int round = 0; round < 3; round++) {
    double t0 = now();
    size_t row = 0;
    for (size_t i = 0; i < n; i++) {
      Tensorflow__Example *ex = tensorflow__example__unpack(NULL, recs[i].n, recs[i].p);
      if (ex == NULL || ex->features == NULL) {
        fprintf(stderr, "protobuf-c failed on record %zu\n", i);
        return 1;
      }
      int got = 0;
      for (size_t k = 0; k < ex->features->n_feature; k++) {
        Tensorflow__Features__FeatureEntry *e = ex->features->feature[k];
        if (strcmp(e->key, argv[2]) == 0 && e->value->kind_case == TENSORFLOW__FEATURE__KIND_FLOAT_LIST &&
            e->value->float_list->n_value == width) {
          memcpy(img + row * width, e->value->float_list->value, width * sizeof(float));
          got++;
        } else if (strcmp(e->key, argv[3]) == 0 &&
                   e->value->kind_case == TENSORFLOW__FEATURE__KIND_INT64_LIST &&
                   e->value->int64_list->n_value == 1) {
          lab[row] = e->value->int64_list->value[0];
          got++;
        }
      }
      if (got != 2) {
        fprintf(stderr, "protobuf-c: record %zu lacks the features\n", i);
        return 1;
      }
      tensorflow__example__free_unpacked(ex, NULL);
      if (++row == BATCH) row = 0;
    }
    double g = total / (now() - t0) / 1e9;
    if (g > best_p) best_p = g;
  }
  printf("ember_gbps=%.3f protobuf_c_gbps=%.3f records=%zu\n", best_e, best_p, n);
  for (size_t i = 0; i < n; i++) free((void *)recs[i].p);
  free(recs);
  free(img);
  free(lab);
  return 0;
}
