/* tfrecord_summary.c - summarise a TFRecord file of tf.train.Examples with
 * libember's public C API (ember/tfrecord.h, ember/example.h, ember/error.h).
 *
 *   tfrecord_summary FILE     (FILE ending in .gz is read as GZIP)
 *
 * prints the record count and, for each feature, its kind, how many records
 * have it and how many values they hold.  A corrupt or truncated file, or a
 * record that is not an Example, ends it with exit status 1 and libember's
 * message, which names the file and the byte offset.
 *
 * Build against an installed libember (make install PREFIX=...):
 *   cc -std=c11 tfrecord_summary.c $(pkg-config --cflags --libs ember) -o tfrecord_summary
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ember/error.h>
#include <ember/example.h>
#include <ember/tfrecord.h>

typedef struct {
  char *name;
  int kind;           /* ember_ex_kind of the first record with values; -1 if mixed */
  uint64_t records;   /* records that have the feature */
  uint64_t values;    /* numbers, or byte strings for bytes_list */
  uint64_t bytes;     /* bytes_list: data bytes */
  uint64_t min, max;  /* values per record, over the records that have it */
} stat;

typedef struct {
  stat *v;
  size_t n, cap;
} table;

/* The stat of feature name[0..len), added if new; NULL when out of memory.
 * Records usually list the same features in the same order, so the entry
 * after the previous match is tried first: one comparison per feature in the
 * common case instead of a scan of the table. */
static stat *lookup(table *t, size_t *hint, const uint8_t *name, size_t len) {
  for (size_t k = 0; k < t->n; k++) {
    size_t i = (*hint + k) % t->n;
    if (strlen(t->v[i].name) == len && memcmp(t->v[i].name, name, len) == 0) {
      *hint = i + 1;
      return &t->v[i];
    }
  }
  if (t->n == t->cap) {
    size_t cap = t->cap ? 2 * t->cap : 16;
    stat *v = realloc(t->v, cap * sizeof *v);
    if (v == NULL) return NULL;
    t->v = v;
    t->cap = cap;
  }
  char *copy = malloc(len + 1);
  if (copy == NULL) return NULL;
  memcpy(copy, name, len);
  copy[len] = '\0';
  stat *s = &t->v[t->n++];
  *s = (stat){.name = copy, .kind = EMBER_EX_NONE, .min = UINT64_MAX};
  *hint = t->n;
  return s;
}

static int by_name(const void *a, const void *b) {
  return strcmp(((const stat *)a)->name, ((const stat *)b)->name);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s FILE\n", argv[0]);
    return 2;
  }
  const char *path = argv[1];
  size_t plen = strlen(path);
  ember_tfr_options opt = {0};
  if (plen > 3 && strcmp(path + plen - 3, ".gz") == 0) opt.compression = EMBER_TFR_GZIP;

  int status = 1;
  table t = {0};
  ember_ex_feature *feats = NULL;
  ember_tfr_reader *r = NULL;
  uint64_t records = 0;
  int rc = ember_tfr_reader_open_path(&r, path, &opt);
  if (rc != EMBER_OK) goto fail;

  /* ember_ex_parse refuses an Example with more features than it is given
   * room for; EMBER_EX_MAX_COLS is the decoder's own bound. */
  feats = malloc(EMBER_EX_MAX_COLS * sizeof *feats);
  if (feats == NULL) {
    fprintf(stderr, "tfrecord_summary: out of memory\n");
    goto out;
  }
  const uint8_t *rec;
  size_t len;
  while ((rc = ember_tfr_reader_next(r, &rec, &len)) == 1) {
    size_t n, hint = 0;
    if ((rc = ember_ex_parse(rec, len, feats, EMBER_EX_MAX_COLS, &n)) != EMBER_OK) {
      /* ember_ex_parse knows the bytes, not where they came from. */
      fprintf(stderr, "tfrecord_summary: %s: record %llu at byte offset %llu: %s\n", path,
              (unsigned long long)records, (unsigned long long)ember_tfr_reader_offset(r),
              ember_last_error());
      goto out;
    }
    records++;
    for (size_t i = 0; i < n; i++) {
      stat *s = lookup(&t, &hint, feats[i].name, feats[i].name_len);
      if (s == NULL) {
        fprintf(stderr, "tfrecord_summary: out of memory\n");
        goto out;
      }
      /* A Feature with no list carries no kind; any other kind must agree. */
      if (feats[i].kind != EMBER_EX_NONE && s->kind != feats[i].kind)
        s->kind = s->kind == EMBER_EX_NONE ? feats[i].kind : -1;
      s->records++;
      s->values += feats[i].count;
      s->bytes += feats[i].nbytes;
      if (feats[i].count < s->min) s->min = feats[i].count;
      if (feats[i].count > s->max) s->max = feats[i].count;
    }
  }
  if (rc < 0) goto fail;

  if (t.n > 1) qsort(t.v, t.n, sizeof *t.v, by_name); /* t.v is NULL for an empty file */
  printf("%s: %llu records, %zu features\n", path, (unsigned long long)records, t.n);
  for (size_t i = 0; i < t.n; i++) {
    const stat *s = &t.v[i];
    printf("  %s: %s, in %llu of %llu records, %llu values (%llu..%llu per record)", s->name,
           s->kind < 0 ? "mixed kinds" : ember_ex_kind_name(s->kind),
           (unsigned long long)s->records, (unsigned long long)records,
           (unsigned long long)s->values, (unsigned long long)s->min, (unsigned long long)s->max);
    if (s->kind == EMBER_EX_BYTES) printf(", %llu bytes", (unsigned long long)s->bytes);
    printf("\n");
  }
  status = 0;
  goto out;

fail:
  /* The reader's message already names the file and the byte offset. */
  fprintf(stderr, "tfrecord_summary: %s (%s)\n", ember_last_error(), ember_err_name(rc));
out:
  ember_tfr_reader_destroy(r);
  free(feats);
  for (size_t i = 0; i < t.n; i++) free(t.v[i].name);
  free(t.v);
  return status;
}
