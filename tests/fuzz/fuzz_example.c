/* fuzz_example.c - libFuzzer harness for the tf.train.Example decoder.
 *
 * The input is one serialized Example.  It is decoded by the batch decoder
 * with a spec set chosen by the input's last byte (names "a", "b", "c" and
 * the empty key, each kind, dense or variable, optional or not) and by the
 * generic parser.  Properties beyond memory safety:
 *  - a failed add leaves every column unchanged;
 *  - the generic parse and the batch decoder agree (kind, count, values);
 *  - what the generic parser returns re-encodes to an Example that decodes
 *    to the same features (the encoder and decoder are inverse). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ember/error.h"
#include "ember/example.h"

static void require(int cond) {
  if (!cond) abort();
}

static const char *names[4] = {"a", "b", "c", ""};

#define CAP 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t sel = size ? data[size - 1] : 0;
  ember_ex_spec spec[4];
  for (int i = 0; i < 4; i++) {
    uint8_t bits = (uint8_t)(sel >> (2 * i)) ^ (uint8_t)i;
    spec[i].name = names[i];
    spec[i].kind = (uint8_t)(1 + bits % 3);
    spec[i].width = (bits & 4) ? 2 : 0;
    spec[i].flags = (bits & 8) ? 0 : EMBER_EX_OPTIONAL;
  }
  ember_ex_decoder *d;
  require(ember_ex_decoder_create(&d, spec, 4) == EMBER_OK);
  /* Twice: the second add must behave exactly like the first. */
  int rc1 = ember_ex_decoder_add(d, data, size);
  int rc2 = ember_ex_decoder_add(d, data, size);
  require(rc1 == rc2);
  uint64_t rows = ember_ex_decoder_rows(d);
  require(rows == (rc1 == EMBER_OK ? 2u : 0u));
  ember_ex_feature f[CAP];
  size_t nf = 0;
  int prc = ember_ex_parse(data, size, f, CAP, &nf);
  if (rc1 == EMBER_ECORRUPT) require(prc == EMBER_ECORRUPT);
  for (uint32_t i = 0; i < 4; i++) {
    ember_ex_column c;
    require(ember_ex_decoder_column(d, i, &c) == EMBER_OK);
    require(c.nrows == rows);
    if (rows == 0) {
      require(c.nvalues == 0 && c.nbytes == 0);
      continue;
    }
    if (c.width == 0) require(c.row_offsets[0] == 0 && c.row_offsets[rows] == c.nvalues);
    if (c.kind == EMBER_EX_BYTES) require(c.value_offsets[c.nvalues] == c.nbytes);
    /* agree with the generic parser */
    const ember_ex_feature *g = NULL;
    for (size_t k = 0; prc == EMBER_OK && k < nf; k++)
      if (f[k].name_len == strlen(names[i]) && memcmp(f[k].name, names[i], f[k].name_len) == 0) g = &f[k];
    if (prc == EMBER_OK) {
      require((g != NULL) == (c.present[0] == 1));
      if (g != NULL) require(c.nvalues == 2 * g->count);
    }
  }
  /* Gathering rows {1, 0, 1} of the two identical rows: every column three
   * times the one row, offsets consistent. */
  if (rows == 2) {
    const uint64_t pick[3] = {1, 0, 1};
    ember_ex_column g[4], c;
    require(ember_ex_decoder_gather(d, pick, 3, g) == EMBER_OK);
    for (uint32_t i = 0; i < 4; i++) {
      require(ember_ex_decoder_column(d, i, &c) == EMBER_OK);
      require(g[i].nrows == 3 && 2 * g[i].nvalues == 3 * c.nvalues && 2 * g[i].nbytes == 3 * c.nbytes);
      if (g[i].width == 0) require(g[i].row_offsets[3] == g[i].nvalues);
      if (g[i].kind == EMBER_EX_BYTES) require(g[i].value_offsets[g[i].nvalues] == g[i].nbytes);
      size_t isz = c.kind == EMBER_EX_BYTES ? 1 : c.kind == EMBER_EX_FLOAT ? 4 : 8;
      size_t vb = c.kind == EMBER_EX_BYTES ? (size_t)c.nbytes : isz * (size_t)c.nvalues;
      require(memcmp(g[i].values, (const uint8_t *)c.values + vb / 2, vb / 2) == 0);
      require(g[i].present[0] == c.present[1]);
      ember_ex_column_free(&g[i]);
    }
    const uint64_t beyond = 2;
    require(ember_ex_decoder_gather(d, &beyond, 1, g) == EMBER_EINVAL);
  }
  ember_ex_decoder_destroy(d);
  if (prc != EMBER_OK) return 0;

  /* Re-encode the parsed features and parse again. */
  ember_ex_input in[CAP];
  void *vals[CAP];
  uint64_t *voffs[CAP], *roffs[CAP];
  size_t nin = 0;
  for (size_t k = 0; k < nf; k++) {
    if (f[k].kind == EMBER_EX_NONE || f[k].name_len == 0 || memchr(f[k].name, 0, f[k].name_len)) continue;
    size_t isz = f[k].kind == EMBER_EX_BYTES ? 1 : f[k].kind == EMBER_EX_FLOAT ? 4 : 8;
    size_t vb = f[k].kind == EMBER_EX_BYTES ? (size_t)f[k].nbytes : isz * (size_t)f[k].count;
    vals[nin] = malloc(vb ? vb : 1);
    voffs[nin] = malloc(8 * ((size_t)f[k].count + 1));
    roffs[nin] = malloc(16);
    char *name = malloc(f[k].name_len + 1);
    memcpy(name, f[k].name, f[k].name_len);
    name[f[k].name_len] = 0;
    require(ember_ex_feature_values(&f[k], vals[nin], voffs[nin]) == EMBER_OK);
    roffs[nin][0] = 0;
    roffs[nin][1] = f[k].count;
    ember_ex_input *x = &in[nin];
    memset(x, 0, sizeof *x);
    x->name = name;
    x->kind = (uint8_t)f[k].kind;
    x->values = vals[nin];
    x->nvalues = f[k].count;
    x->nbytes = f[k].nbytes;
    x->value_offsets = voffs[nin];
    x->row_offsets = roffs[nin];
    nin++;
  }
  size_t need, wrote;
  require(ember_ex_encoded_size(in, (uint32_t)nin, 0, &need) == EMBER_OK);
  uint8_t *buf = malloc(need);
  require(ember_ex_encode(in, (uint32_t)nin, 0, buf, need, &wrote) == EMBER_OK && wrote == need);
  ember_ex_feature g[CAP];
  size_t ng;
  require(ember_ex_parse(buf, wrote, g, CAP, &ng) == EMBER_OK && ng == nin);
  for (size_t k = 0; k < nin; k++) {
    require(g[k].kind == in[k].kind && g[k].count == in[k].nvalues && g[k].nbytes == in[k].nbytes);
    size_t isz = g[k].kind == EMBER_EX_BYTES ? 1 : g[k].kind == EMBER_EX_FLOAT ? 4 : 8;
    size_t vb = g[k].kind == EMBER_EX_BYTES ? (size_t)g[k].nbytes : isz * (size_t)g[k].count;
    uint8_t *v2 = malloc(vb ? vb : 1);
    uint64_t *o2 = malloc(8 * ((size_t)g[k].count + 1));
    require(ember_ex_feature_values(&g[k], v2, o2) == EMBER_OK);
    require(memcmp(v2, in[k].values, vb) == 0);
    free(v2);
    free(o2);
  }
  free(buf);
  for (size_t k = 0; k < nin; k++) {
    free((void *)in[k].name);
    free(vals[k]);
    free(voffs[k]);
    free(roffs[k]);
  }
  return 0;
}
