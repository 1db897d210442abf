/* test_example.c - tf.train.Example: encoder/decoder round trips, protobuf
 * decoding rules (unknown fields, unpacked lists, merges, last key wins),
 * schema checks, and malformed input. */
#include <math.h>
#include <stdint.h>

#include "ember/example.h"
#include "harness.h"

/* ---------------------------------------------------------------- a tiny protobuf writer */
typedef struct {
  uint8_t b[4096];
  size_t n;
} pb;

static void pb_varint(pb *p, uint64_t v) {
  while (v >= 0x80) {
    p->b[p->n++] = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  p->b[p->n++] = (uint8_t)v;
}
static void pb_tag(pb *p, uint32_t field, uint32_t wt) { pb_varint(p, (uint64_t)field << 3 | wt); }
static void pb_bytes(pb *p, uint32_t field, const void *d, size_t n) {
  pb_tag(p, field, 2);
  pb_varint(p, n);
  memcpy(p->b + p->n, d, n);
  p->n += n;
}
static void pb_msg(pb *p, uint32_t field, const pb *m) { pb_bytes(p, field, m->b, m->n); }
static void pb_f32(pb *p, uint32_t field, float f) {
  pb_tag(p, field, 5);
  memcpy(p->b + p->n, &f, 4);
  p->n += 4;
}

/* Example{features{entry...}} from a list of entries. */
static void wrap_example(pb *ex, const pb *entries, int n) {
  pb feats = {.n = 0};
  for (int i = 0; i < n; i++) pb_msg(&feats, 1, &entries[i]);
  ex->n = 0;
  pb_msg(ex, 1, &feats);
}
static void entry(pb *e, const char *key, const pb *feature) {
  e->n = 0;
  pb_bytes(e, 1, key, strlen(key));
  pb_msg(e, 2, feature);
}

/* ---------------------------------------------------------------- helpers */

static ember_ex_decoder *decoder(const ember_ex_spec *s, uint32_t n) {
  ember_ex_decoder *d;
  CHECK_OK(ember_ex_decoder_create(&d, s, n));
  return d;
}

static const ember_ex_feature *find(const ember_ex_feature *f, size_t n, const char *name) {
  for (size_t i = 0; i < n; i++)
    if (f[i].name_len == strlen(name) && memcmp(f[i].name, name, f[i].name_len) == 0) return &f[i];
  return NULL;
}

/* Frees what ember_ex_decoder_take or _gather handed over. */
static void free_columns(ember_ex_column *c, int n) {
  for (int i = 0; i < n; i++) ember_ex_column_free(&c[i]);
}

/* ---------------------------------------------------------------- tests */

TEST(round_trip_columns) {
  /* 3 rows: image dense float[4], label int64 scalar, tags varlen bytes,
   * ids varlen int64 (with negatives), and an optional float missing in row 1. */
  float image[12] = {0, 1.5f, -2, 3, NAN, INFINITY, -INFINITY, 1e-30f, 7, 8, 9, 10};
  int64_t label[3] = {0, -1, INT64_MAX};
  const char tags[] = "abcdefgh";
  uint64_t tag_off[] = {0, 1, 3, 3, 8};       /* "a", "bc", "", "defgh" */
  uint64_t tag_rows[] = {0, 2, 2, 4};          /* row 1 has no tags */
  int64_t ids[] = {INT64_MIN, 5, 300};
  uint64_t id_rows[] = {0, 0, 1, 3};
  float opt[3] = {1, 2, 3};
  uint8_t opt_present[3] = {1, 0, 1};
  ember_ex_input in[] = {
      {"image", EMBER_EX_FLOAT, 4, image, 12, NULL, 0, NULL, NULL},
      {"label", EMBER_EX_INT64, 1, label, 3, NULL, 0, NULL, NULL},
      {"tags", EMBER_EX_BYTES, 0, tags, 4, tag_off, 8, tag_rows, NULL},
      {"ids", EMBER_EX_INT64, 0, ids, 3, NULL, 0, id_rows, NULL},
      {"opt", EMBER_EX_FLOAT, 1, opt, 3, NULL, 0, NULL, opt_present},
  };
  ember_ex_spec spec[] = {
      {"label", EMBER_EX_INT64, 1, 0},      {"image", EMBER_EX_FLOAT, 4, 0},
      {"tags", EMBER_EX_BYTES, 0, 0},       {"ids", EMBER_EX_INT64, 0, 0},
      {"opt", EMBER_EX_FLOAT, 1, EMBER_EX_OPTIONAL},
  };
  ember_ex_decoder *d = decoder(spec, 5);
  for (uint64_t row = 0; row < 3; row++) {
    size_t size, written;
    CHECK_OK(ember_ex_encoded_size(in, 5, row, &size));
    uint8_t *buf = malloc(size);
    CHECK_OK(ember_ex_encode(in, 5, row, buf, size, &written));
    CHECK_EQ_INT(written, size);
    CHECK_EQ_INT(ember_ex_encode(in, 5, row, buf, size - 1, &written), EMBER_ETOOBIG);
    CHECK_OK(ember_ex_decoder_add(d, buf, size));
    /* The generic parser sees the same. */
    ember_ex_feature f[8];
    size_t nf;
    CHECK_OK(ember_ex_parse(buf, size, f, 8, &nf));
    CHECK_EQ_INT(nf, row == 1 ? 4 : 5);
    const ember_ex_feature *lf = find(f, nf, "label");
    CHECK(lf && lf->kind == EMBER_EX_INT64 && lf->count == 1);
    int64_t lv;
    CHECK_OK(ember_ex_feature_values(lf, &lv, NULL));
    CHECK_EQ_INT(lv, label[row]);
    free(buf);
  }
  CHECK_EQ_INT(ember_ex_decoder_rows(d), 3);
  ember_ex_column c;
  CHECK_OK(ember_ex_decoder_column(d, 1, &c)); /* image */
  CHECK_EQ_INT(c.nvalues, 12);
  CHECK(c.row_offsets == NULL);
  const float *fi = c.values;
  for (int i = 0; i < 12; i++)
    CHECK(isnan(image[i]) ? isnan(fi[i]) : memcmp(&fi[i], &image[i], 4) == 0);
  CHECK_OK(ember_ex_decoder_column(d, 0, &c)); /* label */
  CHECK(memcmp(c.values, label, sizeof label) == 0);
  CHECK_OK(ember_ex_decoder_column(d, 2, &c)); /* tags */
  CHECK_EQ_INT(c.nvalues, 4);
  CHECK_EQ_INT(c.nbytes, 8);
  CHECK(memcmp(c.values, "abcdefgh", 8) == 0);
  CHECK(memcmp(c.value_offsets, tag_off, sizeof tag_off) == 0);
  CHECK(memcmp(c.row_offsets, tag_rows, sizeof tag_rows) == 0);
  CHECK_OK(ember_ex_decoder_column(d, 3, &c)); /* ids */
  CHECK(memcmp(c.values, ids, sizeof ids) == 0);
  CHECK(memcmp(c.row_offsets, id_rows, sizeof id_rows) == 0);
  CHECK_OK(ember_ex_decoder_column(d, 4, &c)); /* opt: row 1 missing -> 0, present 0 */
  CHECK(c.present[0] == 1 && c.present[1] == 0 && c.present[2] == 1);
  const float *fo = c.values;
  CHECK(fo[0] == 1 && fo[1] == 0 && fo[2] == 3);

  /* gather copies rows in any order, repeats included, and keeps the rows. */
  ember_ex_column g[5];
  const uint64_t pick[] = {2, 0, 2, 1};
  CHECK_OK(ember_ex_decoder_gather(d, pick, 4, g));
  CHECK_EQ_INT(ember_ex_decoder_rows(d), 3);
  const int64_t glabel[] = {INT64_MAX, 0, INT64_MAX, -1};
  CHECK(g[0].nrows == 4 && memcmp(g[0].values, glabel, sizeof glabel) == 0);
  const float *gi = g[1].values;
  CHECK(g[1].nvalues == 16 && g[1].row_offsets == NULL);
  CHECK(memcmp(gi, image + 8, 16) == 0 && memcmp(gi + 4, image, 16) == 0 &&
        memcmp(gi + 8, image + 8, 16) == 0 && memcmp(gi + 12, image + 4, 16) == 0);
  /* tags: row 2 "", "defgh"; row 0 "a", "bc"; row 2 again; row 1 none */
  const uint64_t gtag_off[] = {0, 0, 5, 6, 8, 8, 13};
  const uint64_t gtag_rows[] = {0, 2, 4, 6, 6};
  CHECK(g[2].nvalues == 6 && g[2].nbytes == 13 && memcmp(g[2].values, "defghabcdefgh", 13) == 0);
  CHECK(memcmp(g[2].value_offsets, gtag_off, sizeof gtag_off) == 0);
  CHECK(memcmp(g[2].row_offsets, gtag_rows, sizeof gtag_rows) == 0);
  const int64_t gids[] = {5, 300, 5, 300, INT64_MIN};
  const uint64_t gid_rows[] = {0, 2, 2, 4, 5};
  CHECK(g[3].nvalues == 5 && memcmp(g[3].values, gids, sizeof gids) == 0);
  CHECK(memcmp(g[3].row_offsets, gid_rows, sizeof gid_rows) == 0);
  CHECK(g[4].present[0] == 1 && g[4].present[1] == 1 && g[4].present[3] == 0);
  free_columns(g, 5);
  CHECK_OK(ember_ex_decoder_gather(d, pick, 0, g)); /* no rows: offsets still start with 0 */
  CHECK(g[2].row_offsets[0] == 0 && g[2].value_offsets[0] == 0 && g[3].row_offsets[0] == 0);
  free_columns(g, 5);
  const uint64_t beyond[] = {1, 3};
  CHECK_EQ_INT(ember_ex_decoder_gather(d, beyond, 2, g), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "row 3 (index 1) is out of range") != NULL);

  /* take moves everything out and restarts. */
  ember_ex_column t[5];
  CHECK_OK(ember_ex_decoder_take(d, t));
  CHECK_EQ_INT(t[2].nrows, 3);
  CHECK_EQ_INT(ember_ex_decoder_rows(d), 0);
  free_columns(t, 5);
  CHECK_OK(ember_ex_decoder_take(d, t)); /* empty: offsets still start with 0 */
  CHECK(t[2].row_offsets != NULL && t[2].row_offsets[0] == 0 && t[2].value_offsets[0] == 0);
  free_columns(t, 5);
  ember_ex_decoder_destroy(d);
}

TEST(protobuf_rules) {
  pb list, feat, e[4], ex, junk;
  /* x: unpacked floats with unknown fields in the list, feature, entry,
   * features and example (varint, fixed64, fixed32, a nested group). */
  list.n = 0;
  pb_tag(&list, 9, 0);
  pb_varint(&list, 12345);
  pb_f32(&list, 1, 1.0f);
  pb_tag(&list, 7, 1);
  memset(list.b + list.n, 0xee, 8);
  list.n += 8;
  pb_f32(&list, 1, 2.0f);
  feat.n = 0;
  pb_tag(&feat, 20, 3); /* group 20 { group 21 { fixed32 } } */
  pb_tag(&feat, 21, 3);
  pb_f32(&feat, 5, 9.0f);
  pb_tag(&feat, 21, 4);
  pb_tag(&feat, 20, 4);
  pb_msg(&feat, 2, &list);
  entry(&e[0], "x", &feat);
  pb_tag(&e[0], 3, 5);
  memset(e[0].b + e[0].n, 0, 4);
  e[0].n += 4;
  /* y: oneof switches float -> int64 (unpacked then packed, merged). */
  pb fl = {.n = 0}, il = {.n = 0}, il2 = {.n = 0};
  pb_f32(&fl, 1, 5.0f);
  pb_tag(&il, 1, 0);
  pb_varint(&il, (uint64_t)-7);
  pb packed = {.n = 0};
  pb_varint(&packed, 1);
  pb_varint(&packed, 1u << 20);
  pb_bytes(&il2, 1, packed.b, packed.n);
  feat.n = 0;
  pb_msg(&feat, 2, &fl);
  pb_msg(&feat, 3, &il);
  pb_msg(&feat, 3, &il2);
  entry(&e[1], "y", &feat);
  /* z: first entry is replaced by a later one with the same key; the later
   * entry has its value before its key, in two fragments that merge. */
  pb b1 = {.n = 0};
  pb_bytes(&b1, 1, "old", 3);
  feat.n = 0;
  pb_msg(&feat, 1, &b1);
  entry(&e[2], "z", &feat);
  pb b2 = {.n = 0}, b3 = {.n = 0}, f2 = {.n = 0}, f3 = {.n = 0};
  pb_bytes(&b2, 1, "new", 3);
  pb_bytes(&b3, 1, "er", 2);
  pb_msg(&f2, 1, &b2);
  pb_msg(&f3, 1, &b3);
  e[3].n = 0;
  pb_msg(&e[3], 2, &f2);
  pb_bytes(&e[3], 1, "z", 1);
  pb_msg(&e[3], 2, &f3);
  wrap_example(&ex, e, 4);
  junk.n = 0;
  pb_tag(&junk, 2, 0);
  pb_varint(&junk, 1);
  memcpy(ex.b + ex.n, junk.b, junk.n); /* unknown field after features */
  ex.n += junk.n;

  ember_ex_spec spec[] = {{"x", EMBER_EX_FLOAT, 0, 0}, {"y", EMBER_EX_INT64, 0, 0},
                          {"z", EMBER_EX_BYTES, 0, 0}};
  ember_ex_decoder *d = decoder(spec, 3);
  CHECK_OK(ember_ex_decoder_add(d, ex.b, ex.n));
  ember_ex_column c;
  CHECK_OK(ember_ex_decoder_column(d, 0, &c));
  CHECK_EQ_INT(c.nvalues, 2);
  CHECK(((float *)c.values)[0] == 1.0f && ((float *)c.values)[1] == 2.0f);
  CHECK_OK(ember_ex_decoder_column(d, 1, &c));
  CHECK_EQ_INT(c.nvalues, 3);
  CHECK_EQ_INT(((int64_t *)c.values)[0], -7);
  CHECK_EQ_INT(((int64_t *)c.values)[1], 1);
  CHECK_EQ_INT(((int64_t *)c.values)[2], 1 << 20);
  CHECK_OK(ember_ex_decoder_column(d, 2, &c));
  CHECK_EQ_INT(c.nvalues, 2);
  CHECK(c.nbytes == 5 && memcmp(c.values, "newer", 5) == 0);
  CHECK_EQ_INT(c.value_offsets[1], 3);
  ember_ex_decoder_destroy(d);

  ember_ex_feature f[4];
  size_t nf;
  CHECK_OK(ember_ex_parse(ex.b, ex.n, f, 4, &nf));
  CHECK_EQ_INT(nf, 3);
  CHECK_EQ_INT(ember_ex_parse(ex.b, ex.n, f, 2, &nf), EMBER_ETOOBIG);
  /* An empty record is an Example with no features. */
  CHECK_OK(ember_ex_parse(NULL, 0, f, 4, &nf));
  CHECK_EQ_INT(nf, 0);
}

TEST(empty_lists_and_kindless_features) {
  pb emptyf = {.n = 0}, nokind = {.n = 0}, e[2], ex;
  pb_bytes(&emptyf, 2, "", 0); /* float_list {} */
  entry(&e[0], "empty", &emptyf);
  entry(&e[1], "nokind", &nokind);
  wrap_example(&ex, e, 2);
  ember_ex_spec spec[] = {{"empty", EMBER_EX_FLOAT, 0, 0}, {"nokind", EMBER_EX_BYTES, 0, 0}};
  ember_ex_decoder *d = decoder(spec, 2);
  CHECK_OK(ember_ex_decoder_add(d, ex.b, ex.n));
  ember_ex_column c;
  CHECK_OK(ember_ex_decoder_column(d, 0, &c));
  CHECK(c.nvalues == 0 && c.row_offsets[1] == 0 && c.present[0] == 1);
  CHECK_OK(ember_ex_decoder_column(d, 1, &c));
  CHECK(c.nvalues == 0 && c.present[0] == 1);
  ember_ex_decoder_destroy(d);
  /* A dense column does not accept an empty list. */
  ember_ex_spec dense[] = {{"empty", EMBER_EX_FLOAT, 1, 0}};
  d = decoder(dense, 1);
  CHECK_EQ_INT(ember_ex_decoder_add(d, ex.b, ex.n), EMBER_ESCHEMA);
  CHECK(strstr(ember_last_error(), "feature 'empty': expected 1 float_list values, found 0") != NULL);
  ember_ex_decoder_destroy(d);
}

TEST(schema_errors_leave_columns_untouched) {
  float v[2] = {1, 2};
  int64_t i64[1] = {4};
  ember_ex_input in[] = {{"a", EMBER_EX_FLOAT, 2, v, 2, NULL, 0, NULL, NULL},
                         {"b", EMBER_EX_INT64, 1, i64, 1, NULL, 0, NULL, NULL}};
  uint8_t buf[256];
  size_t n;
  CHECK_OK(ember_ex_encode(in, 2, 0, buf, sizeof buf, &n));
  ember_ex_spec ok[] = {{"a", EMBER_EX_FLOAT, 2, 0}, {"b", EMBER_EX_INT64, 1, 0}};
  ember_ex_spec kind[] = {{"a", EMBER_EX_FLOAT, 2, 0}, {"b", EMBER_EX_FLOAT, 1, 0}};
  ember_ex_spec width[] = {{"a", EMBER_EX_FLOAT, 3, 0}};
  ember_ex_spec missing[] = {{"a", EMBER_EX_FLOAT, 2, 0}, {"c", EMBER_EX_BYTES, 0, 0}};
  ember_ex_decoder *d = decoder(kind, 2);
  CHECK_EQ_INT(ember_ex_decoder_add(d, buf, n), EMBER_ESCHEMA);
  CHECK(strstr(ember_last_error(), "feature 'b': expected float_list, found int64_list") != NULL);
  ember_ex_column c;
  CHECK_OK(ember_ex_decoder_column(d, 0, &c));
  CHECK_EQ_INT(c.nvalues, 0); /* column a was not appended to */
  CHECK_EQ_INT(ember_ex_decoder_rows(d), 0);
  ember_ex_decoder_destroy(d);
  d = decoder(width, 1);
  CHECK_EQ_INT(ember_ex_decoder_add(d, buf, n), EMBER_ESCHEMA);
  CHECK(strstr(ember_last_error(), "expected 3 float_list values, found 2") != NULL);
  ember_ex_decoder_destroy(d);
  d = decoder(missing, 2);
  CHECK_EQ_INT(ember_ex_decoder_add(d, buf, n), EMBER_ESCHEMA);
  CHECK(strstr(ember_last_error(), "feature 'c' (bytes_list) is missing") != NULL);
  ember_ex_decoder_destroy(d);
  d = decoder(ok, 2);
  CHECK_OK(ember_ex_decoder_add(d, buf, n));
  ember_ex_decoder_destroy(d);
  /* Bad specs. */
  ember_ex_spec dup[] = {{"a", EMBER_EX_FLOAT, 2, 0}, {"a", EMBER_EX_INT64, 1, 0}};
  ember_ex_spec badkind[] = {{"a", 9, 2, 0}};
  CHECK_EQ_INT(ember_ex_decoder_create(&d, dup, 2), EMBER_EINVAL);
  CHECK_EQ_INT(ember_ex_decoder_create(&d, badkind, 1), EMBER_EINVAL);
  /* Encoder input checks. */
  uint64_t bad_rows[] = {0, 5};
  ember_ex_input bad[] = {{"a", EMBER_EX_FLOAT, 0, v, 2, NULL, 0, bad_rows, NULL}};
  CHECK_EQ_INT(ember_ex_encoded_size(bad, 1, 0, &n), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "column 'a', row 0") != NULL);
}

static void expect_corrupt(const uint8_t *b, size_t n, const char *what) {
  ember_ex_spec spec[] = {{"k", EMBER_EX_INT64, 0, EMBER_EX_OPTIONAL},
                          {"f", EMBER_EX_FLOAT, 0, EMBER_EX_OPTIONAL}};
  ember_ex_decoder *d = decoder(spec, 2);
  int rc = ember_ex_decoder_add(d, b, n);
  if (rc != EMBER_ECORRUPT) fprintf(stderr, "%s: rc %d (%s)\n", what, rc, ember_last_error());
  CHECK_EQ_INT(rc, EMBER_ECORRUPT);
  CHECK_EQ_INT(ember_ex_decoder_rows(d), 0);
  ember_ex_decoder_destroy(d);
}

TEST(malformed) {
  pb l = {.n = 0}, f = {.n = 0}, e, ex;
  /* packed float payload of 5 bytes */
  pb_bytes(&l, 1, "\1\2\3\4\5", 5);
  pb_msg(&f, 2, &l);
  entry(&e, "f", &f);
  wrap_example(&ex, &e, 1);
  expect_corrupt(ex.b, ex.n, "packed float length");
  /* unterminated varint in a packed int64 list */
  l.n = f.n = 0;
  pb_bytes(&l, 1, "\x81\x82", 2);
  pb_msg(&f, 3, &l);
  entry(&e, "k", &f);
  wrap_example(&ex, &e, 1);
  expect_corrupt(ex.b, ex.n, "unterminated varint");
  /* an 11-byte varint */
  l.n = f.n = 0;
  pb_bytes(&l, 1, "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11);
  pb_msg(&f, 3, &l);
  entry(&e, "k", &f);
  wrap_example(&ex, &e, 1);
  expect_corrupt(ex.b, ex.n, "long varint");
  /* length beyond the record, wire type 7, stray end group, field 0 */
  const uint8_t over[] = {0x0a, 0x05, 0x0a, 0x01};
  expect_corrupt(over, sizeof over, "overrun");
  const uint8_t wt7[] = {0x0f, 0x00};
  expect_corrupt(wt7, sizeof wt7, "wire type 7");
  const uint8_t egroup[] = {0x0c};
  expect_corrupt(egroup, sizeof egroup, "end group");
  const uint8_t field0[] = {0x02, 0x00};
  expect_corrupt(field0, sizeof field0, "field 0");
  /* groups nested deeper than the limit */
  pb deep = {.n = 0};
  for (int i = 0; i < 100; i++) pb_tag(&deep, 5, 3);
  for (int i = 0; i < 100; i++) pb_tag(&deep, 5, 4);
  expect_corrupt(deep.b, deep.n, "deep groups");
  /* the message names the feature */
  l.n = f.n = 0;
  pb_bytes(&l, 1, "\1\2\3", 3);
  pb_msg(&f, 2, &l);
  entry(&e, "f", &f);
  wrap_example(&ex, &e, 1);
  expect_corrupt(ex.b, ex.n, "named");
  CHECK(strstr(ember_last_error(), "feature 'f'") != NULL);
}

RUN_TESTS(T(round_trip_columns), T(protobuf_rules), T(empty_lists_and_kindless_features),
          T(schema_errors_leave_columns_untouched), T(malformed))
