/* test_ps_table.c - one shard of a parameter-server table (ps_table.h):
 * spec checks, row sharding, the optimizers against hand-computed
 * references, deterministic initial values, sparse materialisation, refused
 * pushes, and the checkpoint codec against truncation, bit flips and files
 * of another shard.  (libember links no libm, so neither does this test:
 * the reference square root is a few Newton steps.) */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "../../csrc/ps_table.h"
#include "ember/ps.h"
#include "ember/wire.h"
#include "harness.h"

static double dabs(double x) { return x < 0 ? -x : x; }

static double ref_sqrt(double x) {
  if (x <= 0) return 0;
  double y = x > 1 ? x : 1;
  for (int i = 0; i < 200; i++) y = 0.5 * (y + x / y);
  return y;
}

/* |got - want| within 1e-6 of |want| (of 1 below 1, where the float
 * storage of a value near 0 would make a relative bound meaningless). */
static int close_to(double got, double want) {
  double scale = dabs(want) > 1 ? dabs(want) : 1;
  return dabs(got - want) <= 1e-6 * scale;
}

#define CHECK_CLOSE(got, want)                                                      \
  do {                                                                              \
    double g_ = (got), w_ = (want);                                                 \
    if (!close_to(g_, w_)) {                                                        \
      fprintf(stderr, "%s:%d: %s = %.12g, want %.12g\n", __FILE__, __LINE__, #got, \
              g_, w_);                                                              \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)

static ember_ps_table_spec spec_of(const char *name, uint32_t layout, uint64_t rows, uint32_t cols,
                                   uint32_t opt, uint32_t init) {
  ember_ps_table_spec s;
  memset(&s, 0, sizeof s);
  s.name = name;
  s.layout = layout;
  s.rows = rows;
  s.cols = cols;
  s.optimizer.kind = opt;
  s.optimizer.learning_rate = 0.1f;
  s.optimizer.momentum = 0.9f;
  s.optimizer.initial_accumulator = 0.1f;
  s.init = init;
  s.init_scale = 0.5f;
  s.seed = 1234;
  return s;
}

static ember__ps_table *make(const ember_ps_table_spec *s, uint32_t shard, uint32_t n) {
  ember__ps_table *t = NULL;
  CHECK_OK(ember__ps_table_create(&t, s, shard, n));
  CHECK(t != NULL);
  return t;
}

static void encode(const ember__ps_table *t, ember_wire_writer *w) {
  ember_wire_writer_init(w);
  ember__ps_table_encode(t, w);
  CHECK_OK(w->err);
}

static int decode(const uint8_t *p, size_t n, uint32_t shard, uint32_t shards,
                  ember__ps_table **out) {
  ember_wire_reader r;
  ember_wire_reader_init(&r, p, n);
  return ember__ps_table_decode(&r, shard, shards, out);
}

static int same_encoding(const ember__ps_table *a, const ember__ps_table *b) {
  ember_wire_writer x, y;
  encode(a, &x);
  encode(b, &y);
  int same = x.len == y.len && memcmp(x.buf, y.buf, x.len) == 0;
  ember_wire_writer_free(&x);
  ember_wire_writer_free(&y);
  return same;
}

static int has(const char *needle) {
  if (strstr(ember_last_error(), needle) != NULL) return 1;
  fprintf(stderr, "message '%s' lacks '%s'\n", ember_last_error(), needle);
  return 0;
}

/* A row of `layout` held by shard k of n, the i-th such from `from`. */
static uint64_t row_on(uint32_t layout, uint64_t rows, uint32_t k, uint32_t n, uint64_t from) {
  for (uint64_t r = from; r < rows; r++)
    if (ember_ps_shard_of_row(layout, rows, r, n) == k) return r;
  CHECK(0);
  return 0;
}

/* ------------------------------------------------------------ spec */

TEST(spec_normalize_fills_defaults_and_copies_the_name) {
  ember_ps_table_spec s = spec_of("emb", EMBER_PS_SPARSE, 100, 8, EMBER_PS_ADAM, EMBER_PS_INIT_NORMAL), o;
  char name[EMBER_PS_NAME_MAX];
  CHECK_OK(ember__ps_spec_normalize(&s, &o, name));
  CHECK(o.name == name && strcmp(name, "emb") == 0);
  CHECK(o.optimizer.beta1 == 0.9f && o.optimizer.beta2 == 0.999f && o.optimizer.epsilon == 1e-7f);
  /* fields Adam does not read are zeroed */
  CHECK(o.optimizer.momentum == 0.0f && o.optimizer.initial_accumulator == 0.0f);
  s.optimizer.beta1 = 0.5f;
  s.optimizer.epsilon = 1e-3f;
  CHECK_OK(ember__ps_spec_normalize(&s, &o, name));
  CHECK(o.optimizer.beta1 == 0.5f && o.optimizer.epsilon == 1e-3f);

  /* Adagrad: epsilon defaults, an initial accumulator of 0 stays 0 */
  s = spec_of("a", EMBER_PS_DENSE, 4, 2, EMBER_PS_ADAGRAD, EMBER_PS_INIT_ZEROS);
  s.optimizer.initial_accumulator = 0.0f;
  CHECK_OK(ember__ps_spec_normalize(&s, &o, name));
  CHECK(o.optimizer.epsilon == 1e-7f && o.optimizer.initial_accumulator == 0.0f);
  CHECK(o.init_scale == 0.0f && o.seed == 0); /* ZEROS reads neither */

  /* the longest name fits */
  char longest[EMBER_PS_NAME_MAX];
  memset(longest, 'n', sizeof longest - 1);
  longest[sizeof longest - 1] = '\0';
  s.name = longest;
  CHECK_OK(ember__ps_spec_normalize(&s, &o, name));
  CHECK(strcmp(name, longest) == 0);
}

TEST(spec_normalize_refuses_each_bad_field) {
  ember_ps_table_spec base = spec_of("emb", EMBER_PS_DENSE, 10, 4, EMBER_PS_SGD, EMBER_PS_INIT_UNIFORM);
  ember_ps_table_spec s, o;
  char name[EMBER_PS_NAME_MAX];
  char toolong[EMBER_PS_NAME_MAX + 1];
  memset(toolong, 'x', sizeof toolong - 1);
  toolong[sizeof toolong - 1] = '\0';
  const float nan = __builtin_nanf(""), inf = __builtin_inff();

  s = base; s.name = NULL;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("name"));
  s = base; s.name = "";
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("name is empty"));
  s = base; s.name = toolong;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("longer than 127"));
  s = base; s.layout = 2;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("layout 2"));
  s = base; s.rows = 0;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("'emb': rows is 0"));
  s = base; s.cols = 0;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("cols 0"));
  s = base; s.cols = EMBER_PS_MAX_COLS + 1;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("cols 1048577"));
  s = base; s.cols = EMBER_PS_MAX_COLS;
  CHECK_OK(ember__ps_spec_normalize(&s, &o, name));
  s = base; s.optimizer.kind = 4;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("optimizer kind 4"));
  s = base; s.init = 3;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("init 3"));
  s = base; s.optimizer.learning_rate = -0.5f;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("learning_rate -0.5"));
  s = base; s.optimizer.learning_rate = nan;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("learning_rate nan"));
  s = base; s.optimizer.learning_rate = inf;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("learning_rate inf"));
  s = base; s.init_scale = nan;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("init_scale"));
  s = base; s.optimizer.kind = EMBER_PS_MOMENTUM; s.optimizer.momentum = 1.5f;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("momentum 1.5"));
  s = base; s.optimizer.kind = EMBER_PS_ADAM; s.optimizer.beta1 = 1.0f;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("beta1 1"));
  s = base; s.optimizer.kind = EMBER_PS_ADAM; s.optimizer.beta2 = -0.5f;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("beta2 -0.5"));
  s = base; s.optimizer.kind = EMBER_PS_ADAGRAD; s.optimizer.epsilon = -1.0f;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("epsilon -1"));
  s = base; s.optimizer.kind = EMBER_PS_ADAGRAD; s.optimizer.initial_accumulator = -1.0f;
  CHECK_EQ_INT(ember__ps_spec_normalize(&s, &o, name), EMBER_EINVAL); CHECK(has("initial_accumulator -1"));
  /* momentum is not read by SGD, so it is not refused there */
  s = base; s.optimizer.momentum = nan;
  CHECK_OK(ember__ps_spec_normalize(&s, &o, name));
  CHECK(o.optimizer.momentum == 0.0f);
}

TEST(spec_same_names_the_difference) {
  ember_ps_table_spec a = spec_of("emb", EMBER_PS_SPARSE, 100, 64, EMBER_PS_ADAM, EMBER_PS_INIT_NORMAL);
  ember_ps_table_spec b = a, na, nb;
  char n1[EMBER_PS_NAME_MAX], n2[EMBER_PS_NAME_MAX], why[256];
  b.optimizer.beta1 = 0.9f; /* the default, written out */
  CHECK_OK(ember__ps_spec_normalize(&a, &na, n1));
  CHECK_OK(ember__ps_spec_normalize(&b, &nb, n2));
  CHECK(ember__ps_spec_same(&na, &nb, why, sizeof why) == 1);
  CHECK(why[0] == '\0');
  b.cols = 32;
  CHECK_OK(ember__ps_spec_normalize(&b, &nb, n2));
  CHECK(ember__ps_spec_same(&na, &nb, why, sizeof why) == 0);
  CHECK(strcmp(why, "cols 64 here, 32 asked") == 0);
  b = a;
  b.seed = 7;
  CHECK_OK(ember__ps_spec_normalize(&b, &nb, n2));
  CHECK(ember__ps_spec_same(&na, &nb, why, sizeof why) == 0);
  CHECK(strcmp(why, "seed 1234 here, 7 asked") == 0);
  b = a;
  b.optimizer.kind = EMBER_PS_SGD;
  CHECK_OK(ember__ps_spec_normalize(&b, &nb, n2));
  CHECK(ember__ps_spec_same(&na, &nb, why, sizeof why) == 0);
  CHECK(strcmp(why, "optimizer ADAM here, SGD asked") == 0);
  b = a;
  b.optimizer.learning_rate = 0.5f;
  CHECK_OK(ember__ps_spec_normalize(&b, &nb, n2));
  CHECK(ember__ps_spec_same(&na, &nb, NULL, 0) == 0);
  b = a;
  b.name = "other";
  b.layout = EMBER_PS_DENSE;
  CHECK_OK(ember__ps_spec_normalize(&b, &nb, n2));
  CHECK(ember__ps_spec_same(&na, &nb, why, sizeof why) == 0);
  CHECK(strcmp(why, "name 'emb' here, 'other' asked") == 0);
}

TEST(state_per_value) {
  CHECK_EQ_INT(ember__ps_state_per_value(EMBER_PS_SGD), 0);
  CHECK_EQ_INT(ember__ps_state_per_value(EMBER_PS_MOMENTUM), 1);
  CHECK_EQ_INT(ember__ps_state_per_value(EMBER_PS_ADAGRAD), 1);
  CHECK_EQ_INT(ember__ps_state_per_value(EMBER_PS_ADAM), 2);
}

TEST(create_refuses_bad_shards_and_specs) {
  ember_ps_table_spec s = spec_of("emb", EMBER_PS_DENSE, 10, 4, EMBER_PS_SGD, EMBER_PS_INIT_ZEROS);
  ember__ps_table *t = (ember__ps_table *)&s;
  CHECK_EQ_INT(ember__ps_table_create(&t, &s, 2, 2), EMBER_EINVAL);
  CHECK(t == NULL);
  CHECK(has("table 'emb': shard 2 of 2"));
  CHECK_EQ_INT(ember__ps_table_create(&t, &s, 0, 0), EMBER_EINVAL);
  CHECK_EQ_INT(ember__ps_table_create(&t, &s, 0, EMBER_PS_MAX_SHARDS + 1), EMBER_EINVAL);
  s.cols = 0;
  CHECK_EQ_INT(ember__ps_table_create(&t, &s, 0, 1), EMBER_EINVAL);
  CHECK(has("cols 0"));
  /* a dense range too big for memory: refused, not crashed */
  s = spec_of("huge", EMBER_PS_DENSE, UINT64_MAX, EMBER_PS_MAX_COLS, EMBER_PS_ADAM, EMBER_PS_INIT_ZEROS);
  CHECK_EQ_INT(ember__ps_table_create(&t, &s, 0, 1), EMBER_ENOMEM);
  CHECK(has("table 'huge' (shard 0 of 1)"));
  ember__ps_table_destroy(NULL);
}

/* ------------------------------------------------------------ sharding */

static uint64_t ref_begin(uint64_t rows, uint32_t k, uint32_t n) {
  return (uint64_t)((unsigned __int128)rows * k / n);
}

TEST(dense_ranges_partition_every_row) {
  static const uint64_t rows_list[] = {1, 2, 3, 5, 7, 10, 64, 999, 1000, 1001};
  static const uint32_t shard_list[] = {1, 2, 3, 4, 7, 16, 33};
  for (size_t a = 0; a < sizeof rows_list / sizeof rows_list[0]; a++) {
    for (size_t b = 0; b < sizeof shard_list / sizeof shard_list[0]; b++) {
      uint64_t rows = rows_list[a];
      uint32_t n = shard_list[b];
      uint32_t prev = 0;
      for (uint64_t r = 0; r < rows; r++) {
        uint32_t k = ember_ps_shard_of_row(EMBER_PS_DENSE, rows, r, n);
        CHECK(k < n);
        CHECK(ref_begin(rows, k, n) <= r && r < ref_begin(rows, k + 1, n));
        CHECK(k >= prev); /* contiguous ranges in shard order */
        prev = k;
      }
      /* each shard's table holds exactly its range, together every row */
      if (rows <= 64) {
        ember_ps_table_spec s = spec_of("d", EMBER_PS_DENSE, rows, 1, EMBER_PS_SGD, EMBER_PS_INIT_ZEROS);
        uint64_t total = 0;
        for (uint32_t k = 0; k < n; k++) {
          ember__ps_table *t = make(&s, k, n);
          CHECK_EQ_INT(ember__ps_table_held(t), ref_begin(rows, k + 1, n) - ref_begin(rows, k, n));
          total += ember__ps_table_held(t);
          for (uint64_t r = 0; r < rows; r++) {
            float v;
            int rc = ember__ps_table_pull(t, &r, 1, &v);
            CHECK_EQ_INT(rc, ember_ps_shard_of_row(EMBER_PS_DENSE, rows, r, n) == k ? EMBER_OK : EMBER_EINVAL);
          }
          ember__ps_table_destroy(t);
        }
        CHECK_EQ_INT(total, rows);
      }
    }
  }
  /* fewer rows than shards: rows land on distinct shards, some hold none */
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, 2, 0, 4), 1);
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, 2, 1, 4), 3);
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, 1, 0, 1024), 1023);
}

TEST(dense_huge_row_counts_do_not_overflow) {
  const uint64_t big = 1ull << 63;
  uint64_t b1 = big / 3; /* floor(2^63 / 3) */
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, big, 0, 3), 0);
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, big, b1 - 1, 3), 0);
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, big, b1, 3), 1);
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, big, big - 1, 3), 2);
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, UINT64_MAX, UINT64_MAX - 1, 1024), 1023);
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, UINT64_MAX, 0, 1024), 0);
  for (uint32_t k = 1; k < 1024; k += 97) {
    uint64_t b = ref_begin(UINT64_MAX, k, 1024);
    CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, UINT64_MAX, b, 1024), k);
    CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, UINT64_MAX, b - 1, 1024), k - 1);
  }
  /* out of range, no shards */
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, big, big, 3), UINT32_MAX);
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_DENSE, 10, 3, 0), UINT32_MAX);
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_SPARSE, 10, 10, 2), UINT32_MAX);
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_SPARSE, 10, 3, 0), UINT32_MAX);
  CHECK_EQ_INT(ember_ps_shard_of_row(7, 10, 3, 2), UINT32_MAX);
}

TEST(sparse_rows_spread_evenly) {
  static const uint32_t shard_list[] = {1, 2, 4, 7};
  for (size_t b = 0; b < sizeof shard_list / sizeof shard_list[0]; b++) {
    uint32_t n = shard_list[b];
    uint64_t count[8] = {0};
    const uint64_t rows = 1000000;
    for (uint64_t r = 0; r < rows; r++) {
      uint32_t k = ember_ps_shard_of_row(EMBER_PS_SPARSE, rows, r, n);
      CHECK(k < n);
      count[k]++;
    }
    for (uint32_t k = 0; k < n; k++) {
      double share = (double)count[k] * n / rows;
      CHECK(share > 0.97 && share < 1.03);
    }
  }
  /* splitmix64's published first outputs for seed 0 are of x = 0, G, 2G...:
   * the hash of row 0 is 0xE220A8397B1DCDAF */
  CHECK_EQ_INT(ember_ps_shard_of_row(EMBER_PS_SPARSE, 10, 0, 1000),
               (uint32_t)(0xE220A8397B1DCDAFull % 1000));
  /* the same on huge ids */
  CHECK(ember_ps_shard_of_row(EMBER_PS_SPARSE, UINT64_MAX, UINT64_MAX - 1, 5) < 5);
}

/* ------------------------------------------------------------ optimizers */

TEST(optimizers_hand_computed) {
  /* zeros, lr 0.1 (Adam 0.001), a gradient of 1 three times (Python's
   * float64 arithmetic on Keras's formulas) */
  static const double want[4][3] = {
      {-0.1, -0.2, -0.3},
      {-0.1, -0.29, -0.561},
      {-0.09534625459063867, -0.16435280888186093, -0.22114899139049998},
      {-0.0009999968377323405, -0.0019999946011101323, -0.0029999927744583594}};
  for (uint32_t kind = EMBER_PS_SGD; kind <= EMBER_PS_ADAM; kind++) {
    ember_ps_table_spec s = spec_of("h", EMBER_PS_DENSE, 1, 1, kind, EMBER_PS_INIT_ZEROS);
    if (kind == EMBER_PS_ADAM) s.optimizer.learning_rate = 0.001f;
    ember__ps_table *t = make(&s, 0, 1);
    const uint64_t row = 0;
    const float g = 1.0f;
    for (int step = 0; step < 3; step++) {
      float w;
      CHECK_OK(ember__ps_table_push(t, &row, 1, &g));
      CHECK_OK(ember__ps_table_pull(t, &row, 1, &w));
      CHECK_CLOSE(w, want[kind][step]);
    }
    ember__ps_table_destroy(t);
  }
}

/* Keras 3 (keras/src/optimizers/adagrad.py) divides by sqrt(a + epsilon),
 * not sqrt(a) + epsilon: with a small accumulator the two differ widely. */
TEST(adagrad_epsilon_inside_the_root_as_keras_3) {
  ember_ps_table_spec s = spec_of("ag", EMBER_PS_DENSE, 1, 1, EMBER_PS_ADAGRAD, EMBER_PS_INIT_ZEROS);
  s.optimizer.initial_accumulator = 0.0f;
  s.optimizer.epsilon = 1e-4f;
  ember__ps_table *t = make(&s, 0, 1);
  const uint64_t row = 0;
  const float g = 0.01f;
  float w;
  CHECK_OK(ember__ps_table_push(t, &row, 1, &g));
  CHECK_OK(ember__ps_table_pull(t, &row, 1, &w));
  /* -0.1 * 0.01 / sqrt(0.0001 + 0.0001); sqrt(a) + eps would give -0.0990 */
  CHECK_CLOSE(w, -0.1 * (double)0.01f / ref_sqrt((double)0.01f * 0.01f + (double)1e-4f));
  CHECK(w > -0.0708 && w < -0.0707);
  ember__ps_table_destroy(t);
}

typedef struct {
  double w, s1, s2;
  uint64_t t;
} ref_cell;

static void ref_step(const ember_ps_optimizer *o, ref_cell *c, double g) {
  double lr = o->learning_rate;
  c->t++;
  switch (o->kind) {
    case EMBER_PS_SGD: c->w -= lr * g; break;
    case EMBER_PS_MOMENTUM:
      c->s1 = o->momentum * c->s1 - lr * g;
      c->w += c->s1;
      break;
    case EMBER_PS_ADAGRAD:
      c->s1 += g * g;
      c->w -= lr * g / ref_sqrt(c->s1 + o->epsilon);
      break;
    case EMBER_PS_ADAM: {
      double b1t = 1, b2t = 1;
      for (uint64_t i = 0; i < c->t; i++) {
        b1t *= o->beta1;
        b2t *= o->beta2;
      }
      double alpha = lr * ref_sqrt(1 - b2t) / (1 - b1t);
      c->s1 = o->beta1 * c->s1 + (1 - o->beta1) * g;
      c->s2 = o->beta2 * c->s2 + (1 - o->beta2) * g * g;
      c->w -= alpha * c->s1 / (ref_sqrt(c->s2) + o->epsilon);
      break;
    }
  }
}

/* Every optimizer, random initial values and gradients, rows pushed an
 * unequal number of times (twice in one push for row 0), against a float64
 * reference that keeps a step count per row. */
TEST(optimizers_match_reference_per_row) {
  enum { ROWS = 3, COLS = 5, PUSHES = 4 };
  for (uint32_t kind = EMBER_PS_SGD; kind <= EMBER_PS_ADAM; kind++) {
    for (uint32_t layout = EMBER_PS_DENSE; layout <= EMBER_PS_SPARSE; layout++) {
      ember_ps_table_spec s = spec_of("r", layout, ROWS, COLS, kind, EMBER_PS_INIT_UNIFORM);
      s.optimizer.learning_rate = kind == EMBER_PS_ADAM ? 0.01f : 0.1f;
      ember__ps_table *t = make(&s, 0, 1);
      const ember_ps_optimizer *o = &ember__ps_table_spec(t)->optimizer;
      ref_cell ref[ROWS][COLS];
      uint64_t all[ROWS] = {0, 1, 2};
      float w[ROWS * COLS];
      CHECK_OK(ember__ps_table_pull(t, all, ROWS, w));
      for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++)
          ref[r][c] = (ref_cell){w[r * COLS + c], kind == EMBER_PS_ADAGRAD ? o->initial_accumulator : 0, 0, 0};
      /* push p: rows {0, 0, 1} then {2}, alternating */
      uint32_t seed = 99;
      for (int p = 0; p < PUSHES; p++) {
        uint64_t ids[3] = {0, 0, 1};
        size_t n = 3;
        if (p % 2 == 1) {
          ids[0] = 2;
          n = 1;
        }
        float g[3 * COLS];
        for (size_t i = 0; i < n * COLS; i++) {
          seed = seed * 1664525u + 1013904223u;
          g[i] = (float)((int)(seed >> 16) % 2001 - 1000) / 500.0f;
        }
        CHECK_OK(ember__ps_table_push(t, ids, n, g));
        for (size_t i = 0; i < n; i++)
          for (int c = 0; c < COLS; c++) ref_step(o, &ref[ids[i]][c], g[i * COLS + c]);
      }
      CHECK_EQ_INT(ref[0][0].t, 4);
      CHECK_EQ_INT(ref[1][0].t, 2);
      CHECK_EQ_INT(ref[2][0].t, 2);
      CHECK_OK(ember__ps_table_pull(t, all, ROWS, w));
      for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++) CHECK_CLOSE(w[r * COLS + c], ref[r][c].w);
      ember__ps_table_destroy(t);
    }
  }
}

/* Adam's bias correction counts each row's own steps: a row pushed once
 * after another row was pushed many times moves like a first step. */
TEST(adam_steps_are_per_row) {
  ember_ps_table_spec s = spec_of("adam", EMBER_PS_SPARSE, 1000, 1, EMBER_PS_ADAM, EMBER_PS_INIT_ZEROS);
  s.optimizer.learning_rate = 0.001f;
  ember__ps_table *t = make(&s, 0, 1);
  const float g[2] = {1.0f, 1.0f};
  const uint64_t twice[2] = {5, 5}, once = 6;
  for (int i = 0; i < 10; i++) CHECK_OK(ember__ps_table_push(t, twice, 2, g));
  CHECK_OK(ember__ps_table_push(t, &once, 1, g));
  float w5, w6;
  CHECK_OK(ember__ps_table_pull(t, &twice[0], 1, &w5));
  CHECK_OK(ember__ps_table_pull(t, &once, 1, &w6));
  /* a constant gradient moves Adam by about lr a step, from the first */
  CHECK_CLOSE(w6, -0.0009999968377323405);
  CHECK(w5 < -0.0199 && w5 > -0.0201);
  ember__ps_table_destroy(t);
}

TEST(duplicate_ids_in_one_push_apply_both_in_order) {
  ember_ps_table_spec s = spec_of("dup", EMBER_PS_SPARSE, 100, 2, EMBER_PS_SGD, EMBER_PS_INIT_UNIFORM);
  ember__ps_table *t = make(&s, 0, 1);
  const uint64_t ids[3] = {7, 9, 7};
  float before[2], after[2];
  CHECK_OK(ember__ps_table_pull(t, &ids[0], 1, before));
  const float g[6] = {1, 2, 10, 10, 3, 4};
  CHECK_OK(ember__ps_table_push(t, ids, 3, g));
  CHECK_OK(ember__ps_table_pull(t, &ids[0], 1, after));
  CHECK_CLOSE(after[0], before[0] - 0.1 * (1 + 3));
  CHECK_CLOSE(after[1], before[1] - 0.1 * (2 + 4));
  CHECK_EQ_INT(ember__ps_table_held(t), 2);
  ember__ps_table_destroy(t);
}

/* ------------------------------------------------------------ shared pushes */

TEST(push_held_applies_only_when_every_row_is_held) {
  ember_ps_table_spec s = spec_of("held", EMBER_PS_SPARSE, 100, 2, EMBER_PS_SGD, EMBER_PS_INIT_ZEROS);
  ember__ps_table *t = make(&s, 0, 1);
  const uint64_t ids[2] = {3, 4};
  const float g[4] = {1, 2, 3, 4};
  float v[4];
  size_t slots[2];
  CHECK_OK(ember__ps_table_pull(t, ids, 1, v)); /* row 3 held, row 4 not */
  CHECK_EQ_INT(ember__ps_table_push_held(t, ids, 2, g, slots), 0);
  CHECK_OK(ember__ps_table_pull(t, ids, 1, v));
  CHECK(v[0] == 0.0f && v[1] == 0.0f); /* nothing applied */
  CHECK_EQ_INT(ember__ps_table_held(t), 1);
  CHECK_OK(ember__ps_table_pull(t, ids, 2, v));
  CHECK_EQ_INT(ember__ps_table_push_held(t, ids, 2, g, slots), 1);
  CHECK_OK(ember__ps_table_pull(t, ids, 2, v));
  CHECK_CLOSE(v[0], -0.1);
  CHECK_CLOSE(v[3], -0.4);
  const uint64_t bad[2] = {3, 100};
  CHECK(ember__ps_table_push_held(t, bad, 2, g, slots) == EMBER_EINVAL);
  CHECK(has("row 100"));
  CHECK_OK(ember__ps_table_pull(t, ids, 1, v));
  CHECK_CLOSE(v[0], -0.1); /* the refused push changed nothing */
  ember__ps_table_destroy(t);
}

enum { SHARED_ROWS = 64, SHARED_COLS = 16, SHARED_PUSHES = 3000 };

typedef struct {
  ember__ps_table *t;
  int reader;
  int torn; /* reader: rows seen with columns of different pushes */
} shared_arg;

/* Every push moves every column of every row by exactly 1 (SGD, lr 1,
 * gradient 1, from zeros), so a row read whole has one value throughout. */
static void *shared_pushes(void *p) {
  shared_arg *a = p;
  uint64_t ids[SHARED_ROWS];
  size_t slots[SHARED_ROWS];
  static float g[SHARED_ROWS * SHARED_COLS];
  float out[SHARED_ROWS * SHARED_COLS];
  for (int i = 0; i < SHARED_ROWS; i++) ids[i] = (uint64_t)(SHARED_ROWS - 1 - i) * 7 % SHARED_ROWS;
  for (int i = 0; i < SHARED_ROWS * SHARED_COLS; i++) g[i] = 1.0f;
  for (int k = 0; k < SHARED_PUSHES; k++) {
    if (a->reader) {
      if (ember__ps_table_read(a->t, ids, SHARED_ROWS, out) != 1) a->torn++;
      for (int r = 0; r < SHARED_ROWS; r++)
        for (int c = 1; c < SHARED_COLS; c++)
          if (out[r * SHARED_COLS + c] != out[r * SHARED_COLS]) a->torn++;
    } else if (ember__ps_table_push_held(a->t, ids, SHARED_ROWS, g, slots) != 1) {
      return (void *)1;
    }
  }
  return NULL;
}

TEST(shared_pushes_lose_no_update_and_reads_see_whole_rows) {
  ember_ps_table_spec s = spec_of("shared", EMBER_PS_SPARSE, 1000, SHARED_COLS, EMBER_PS_SGD,
                                  EMBER_PS_INIT_ZEROS);
  s.optimizer.learning_rate = 1.0f;
  ember__ps_table *t = make(&s, 0, 1);
  uint64_t ids[SHARED_ROWS];
  float v[SHARED_ROWS * SHARED_COLS];
  for (int i = 0; i < SHARED_ROWS; i++) ids[i] = (uint64_t)i;
  CHECK_OK(ember__ps_table_pull(t, ids, SHARED_ROWS, v)); /* held */
  shared_arg args[3] = {{t, 0, 0}, {t, 0, 0}, {t, 1, 0}};
  pthread_t th[3];
  for (int i = 0; i < 3; i++) CHECK(pthread_create(&th[i], NULL, shared_pushes, &args[i]) == 0);
  for (int i = 0; i < 3; i++) {
    void *ret;
    CHECK(pthread_join(th[i], &ret) == 0);
    CHECK(ret == NULL);
  }
  CHECK_EQ_INT(args[2].torn, 0);
  CHECK_OK(ember__ps_table_pull(t, ids, SHARED_ROWS, v));
  for (int i = 0; i < SHARED_ROWS * SHARED_COLS; i++) CHECK(v[i] == -2.0f * SHARED_PUSHES);
  ember__ps_table_destroy(t);
}

/* ------------------------------------------------------------ init */

TEST(init_is_a_function_of_seed_row_and_col) {
  for (uint32_t init = EMBER_PS_INIT_UNIFORM; init <= EMBER_PS_INIT_NORMAL; init++) {
    ember_ps_table_spec sp = spec_of("i", EMBER_PS_SPARSE, 1000, 7, EMBER_PS_ADAM, init);
    ember_ps_table_spec de = sp;
    de.layout = EMBER_PS_DENSE;
    de.optimizer.kind = EMBER_PS_SGD; /* the optimizer plays no part */
    ember__ps_table *sparse[4], *dense[3];
    for (uint32_t k = 0; k < 4; k++) sparse[k] = make(&sp, k, 4);
    for (uint32_t k = 0; k < 3; k++) dense[k] = make(&de, k, 3);
    ember__ps_table *one = make(&sp, 0, 1);
    for (uint64_t row = 0; row < 1000; row += 37) {
      float a[7], b[7], c[7];
      uint32_t ks = ember_ps_shard_of_row(EMBER_PS_SPARSE, 1000, row, 4);
      uint32_t kd = ember_ps_shard_of_row(EMBER_PS_DENSE, 1000, row, 3);
      CHECK_OK(ember__ps_table_pull(sparse[ks], &row, 1, a));
      CHECK_OK(ember__ps_table_pull(dense[kd], &row, 1, b));
      CHECK_OK(ember__ps_table_pull(one, &row, 1, c));
      for (uint32_t col = 0; col < 7; col++) {
        float v = ember__ps_init_value(&sp, row, col);
        CHECK(a[col] == v && b[col] == v && c[col] == v);
        CHECK(v != 0.0f);
        if (col > 0) CHECK(v != a[col - 1]);
      }
    }
    /* another seed, other values; the same seed, the same */
    ember_ps_table_spec other = sp;
    other.seed = 1235;
    int differ = 0;
    for (uint32_t col = 0; col < 7; col++) {
      differ += ember__ps_init_value(&other, 3, col) != ember__ps_init_value(&sp, 3, col);
      CHECK(ember__ps_init_value(&sp, 3, col) == ember__ps_init_value(&sp, 3, col));
      CHECK(ember__ps_init_value(&sp, 4, col) != ember__ps_init_value(&sp, 3, col));
    }
    CHECK_EQ_INT(differ, 7);
    for (uint32_t k = 0; k < 4; k++) ember__ps_table_destroy(sparse[k]);
    for (uint32_t k = 0; k < 3; k++) ember__ps_table_destroy(dense[k]);
    ember__ps_table_destroy(one);
  }
  ember_ps_table_spec z = spec_of("z", EMBER_PS_DENSE, 10, 3, EMBER_PS_SGD, EMBER_PS_INIT_ZEROS);
  for (uint32_t col = 0; col < 3; col++) CHECK(ember__ps_init_value(&z, 5, col) == 0.0f);
}

TEST(init_distributions) {
  enum { N = 200000 };
  ember_ps_table_spec u = spec_of("u", EMBER_PS_SPARSE, UINT64_MAX, 16, EMBER_PS_SGD, EMBER_PS_INIT_UNIFORM);
  u.init_scale = 0.25f;
  double sum = 0, sq = 0;
  for (uint32_t i = 0; i < N; i++) {
    float v = ember__ps_init_value(&u, (uint64_t)i / 16 * 1000003u, i % 16);
    CHECK(v >= -0.25f && v < 0.25f);
    sum += v;
    sq += (double)v * v;
  }
  double mean = sum / N, var = sq / N - mean * mean;
  CHECK(dabs(mean) < 0.002);
  CHECK(dabs(var - 0.25 * 0.25 / 3) < 0.0005);

  ember_ps_table_spec g = u;
  g.init = EMBER_PS_INIT_NORMAL;
  g.init_scale = 2.0f;
  sum = sq = 0;
  int in1 = 0, in2 = 0;
  for (uint32_t i = 0; i < N; i++) {
    float v = ember__ps_init_value(&g, (uint64_t)i / 16, i % 16);
    sum += v;
    sq += (double)v * v;
    in1 += dabs(v) < 2.0;
    in2 += dabs(v) < 4.0;
  }
  mean = sum / N;
  double sd = ref_sqrt(sq / N - mean * mean);
  CHECK(dabs(mean) < 0.03);
  CHECK(dabs(sd - 2.0) < 0.03);
  /* the shape, not only two moments: 68.27% within one sigma, 95.45% two */
  CHECK(dabs((double)in1 / N - 0.6827) < 0.005);
  CHECK(dabs((double)in2 / N - 0.9545) < 0.003);

  /* a column pair's halves are not the same draw */
  int same = 0;
  for (uint64_t row = 0; row < 1000; row++)
    same += ember__ps_init_value(&g, row, 0) == ember__ps_init_value(&g, row, 1);
  CHECK(same == 0);
}

/* ------------------------------------------------------------ sparse rows */

TEST(sparse_rows_materialise_on_first_touch) {
  ember_ps_table_spec s = spec_of("emb", EMBER_PS_SPARSE, 1000000000ull, 4, EMBER_PS_ADAGRAD, EMBER_PS_INIT_NORMAL);
  ember__ps_table *t = make(&s, 1, 2);
  CHECK_EQ_INT(ember__ps_table_held(t), 0);
  uint64_t a = row_on(EMBER_PS_SPARSE, s.rows, 1, 2, 500000000ull);
  uint64_t b = row_on(EMBER_PS_SPARSE, s.rows, 1, 2, a + 1);
  uint64_t c = row_on(EMBER_PS_SPARSE, s.rows, 1, 2, b + 1);
  uint64_t ids[3] = {a, b, a};
  float out[12];
  CHECK_OK(ember__ps_table_pull(t, ids, 3, out));
  CHECK_EQ_INT(ember__ps_table_held(t), 2);
  for (uint32_t col = 0; col < 4; col++) {
    CHECK(out[col] == ember__ps_init_value(&s, a, col));
    CHECK(out[4 + col] == ember__ps_init_value(&s, b, col));
    CHECK(out[8 + col] == out[col]);
  }
  CHECK_OK(ember__ps_table_pull(t, ids, 2, out));
  CHECK_EQ_INT(ember__ps_table_held(t), 2);
  const float g[4] = {1, 1, 1, 1};
  CHECK_OK(ember__ps_table_push(t, &c, 1, g)); /* a push materialises too */
  CHECK_EQ_INT(ember__ps_table_held(t), 3);
  CHECK_OK(ember__ps_table_pull(t, NULL, 0, NULL));
  CHECK_OK(ember__ps_table_push(t, NULL, 0, NULL));
  CHECK_EQ_INT(ember__ps_table_pull(t, NULL, 1, out), EMBER_EINVAL);
  ember__ps_table_destroy(t);
}

TEST(sparse_table_grows_past_many_rehashes) {
  ember_ps_table_spec s = spec_of("grow", EMBER_PS_SPARSE, UINT64_MAX, 3, EMBER_PS_MOMENTUM, EMBER_PS_INIT_UNIFORM);
  ember__ps_table *t = make(&s, 2, 3);
  /* past 2 MiB, where the slot arrays and the map become huge-page
   * allocations copied on growth (ps_table.c: grow_array) */
  enum { N = 120000 };
  uint64_t *ids = malloc(N * sizeof *ids);
  CHECK(ids != NULL);
  uint64_t r = 0;
  for (int i = 0; i < N; i++) {
    r = row_on(EMBER_PS_SPARSE, s.rows, 2, 3, r + 1);
    ids[i] = r;
    float g[3] = {(float)i, 0, 0};
    CHECK_OK(ember__ps_table_push(t, &r, 1, g));
  }
  CHECK_EQ_INT(ember__ps_table_held(t), N);
  for (int i = 0; i < N; i++) {
    float v[3];
    CHECK_OK(ember__ps_table_pull(t, &ids[i], 1, v));
    CHECK_CLOSE(v[0], (double)ember__ps_init_value(&s, ids[i], 0) - 0.1 * i);
    CHECK(v[1] == ember__ps_init_value(&s, ids[i], 1) - 0.0f);
  }
  CHECK_EQ_INT(ember__ps_table_held(t), N);
  free(ids);
  ember__ps_table_destroy(t);
}

TEST(refused_push_changes_nothing_and_names_the_row) {
  for (uint32_t layout = EMBER_PS_DENSE; layout <= EMBER_PS_SPARSE; layout++) {
    ember_ps_table_spec s = spec_of("emb", layout, 1000000, 2, EMBER_PS_ADAM, EMBER_PS_INIT_UNIFORM);
    ember__ps_table *t = make(&s, 1, 2);
    uint64_t mine = row_on(layout, s.rows, 1, 2, 0);
    uint64_t theirs = row_on(layout, s.rows, 0, 2, 0);
    uint64_t ids[2] = {mine, mine};
    float g[4] = {1, 2, 3, 4};
    CHECK_OK(ember__ps_table_push(t, ids, 1, g));
    ember_wire_writer before, after;
    encode(t, &before);
    uint64_t held = ember__ps_table_held(t);

    /* the bad row second, after a good one that must not move either */
    uint64_t fresh = row_on(layout, s.rows, 1, 2, mine + 1);
    uint64_t bad[3] = {mine, fresh, theirs};
    float g3[6] = {1, 1, 1, 1, 1, 1};
    CHECK_EQ_INT(ember__ps_table_push(t, bad, 3, g3), EMBER_EINVAL);
    char want[160];
    snprintf(want, sizeof want, "table 'emb' (shard 1 of 2): row %llu (position 2 of the push) is held by shard 0, not this one",
             (unsigned long long)theirs);
    CHECK(has(want));
    bad[2] = 1000001;
    CHECK_EQ_INT(ember__ps_table_push(t, bad, 3, g3), EMBER_EINVAL);
    CHECK(has("table 'emb' (shard 1 of 2): row 1000001 (position 2 of the push) out of range (rows 1000000)"));
    CHECK_EQ_INT(ember__ps_table_pull(t, bad, 3, g3), EMBER_EINVAL);
    CHECK(has("row 1000001"));
    CHECK_EQ_INT(ember__ps_table_held(t), held);
    encode(t, &after);
    CHECK(before.len == after.len && memcmp(before.buf, after.buf, before.len) == 0);
    ember_wire_writer_free(&before);
    ember_wire_writer_free(&after);
    ember__ps_table_destroy(t);
  }
}

/* ------------------------------------------------------------ checkpoints */

/* The (idx mod count)-th of the rows of a small table shard k holds. */
static uint64_t nth_on(uint32_t layout, uint64_t rows, uint32_t k, uint32_t n, uint64_t idx) {
  uint64_t mine[64], count = 0;
  CHECK(rows <= 64);
  for (uint64_t r = 0; r < rows; r++)
    if (ember_ps_shard_of_row(layout, rows, r, n) == k) mine[count++] = r;
  CHECK(count > 0);
  return mine[idx % count];
}

/* A table with a few rows pushed (every layout and optimizer). */
static ember__ps_table *trained(uint32_t layout, uint32_t kind, uint32_t shard, uint32_t n) {
  ember_ps_table_spec s = spec_of("ck", layout, 40, 3, kind, EMBER_PS_INIT_NORMAL);
  ember__ps_table *t = make(&s, shard, n);
  for (int p = 0; p < 3; p++) {
    uint64_t ids[4];
    for (int i = 0; i < 4; i++) ids[i] = nth_on(layout, 40, shard, n, (uint64_t)(p * 3 + i * 2));
    float g[12];
    for (int i = 0; i < 12; i++) g[i] = (float)(i - 5 + p) / 4.0f;
    CHECK_OK(ember__ps_table_push(t, ids, 4, g));
  }
  return t;
}

TEST(encode_decode_round_trip) {
  for (uint32_t layout = EMBER_PS_DENSE; layout <= EMBER_PS_SPARSE; layout++) {
    for (uint32_t kind = EMBER_PS_SGD; kind <= EMBER_PS_ADAM; kind++) {
      ember__ps_table *t = trained(layout, kind, 1, 3);
      /* written after something else and followed by more: decode reads
       * exactly its own bytes */
      ember_wire_writer w;
      ember_wire_writer_init(&w);
      ember_wire_write_u32(&w, 0xABCD);
      ember__ps_table_encode(t, &w);
      ember_wire_write_u32(&w, 0x1234);
      CHECK_OK(w.err);
      ember_wire_reader r;
      ember_wire_reader_init(&r, w.buf, w.len);
      CHECK_EQ_INT(ember_wire_read_u32(&r), 0xABCD);
      ember__ps_table *back = NULL;
      CHECK_OK(ember__ps_table_decode(&r, 1, 3, &back));
      CHECK_EQ_INT(ember_wire_read_u32(&r), 0x1234);
      CHECK_EQ_INT(r.left, 0);
      CHECK_EQ_INT(ember__ps_table_held(back), ember__ps_table_held(t));
      CHECK(ember__ps_spec_same(ember__ps_table_spec(t), ember__ps_table_spec(back), NULL, 0));
      CHECK(same_encoding(t, back)); /* values, state and steps */
      /* the state carries on: one more identical push keeps them equal */
      uint64_t id = row_on(layout, 40, 1, 3, 0);
      float g[3] = {0.5f, -0.25f, 2.0f}, a[3], b[3];
      CHECK_OK(ember__ps_table_push(t, &id, 1, g));
      CHECK_OK(ember__ps_table_push(back, &id, 1, g));
      CHECK_OK(ember__ps_table_pull(t, &id, 1, a));
      CHECK_OK(ember__ps_table_pull(back, &id, 1, b));
      CHECK(memcmp(a, b, sizeof a) == 0);
      CHECK(same_encoding(t, back));
      ember_wire_writer_free(&w);
      ember__ps_table_destroy(t);
      ember__ps_table_destroy(back);
    }
  }
  /* a dense shard with no rows (rows < shards) round-trips too */
  ember_ps_table_spec s = spec_of("tiny", EMBER_PS_DENSE, 2, 1, EMBER_PS_SGD, EMBER_PS_INIT_ZEROS);
  ember__ps_table *t = make(&s, 0, 4), *back = NULL;
  CHECK_EQ_INT(ember__ps_table_held(t), 0);
  ember_wire_writer w;
  encode(t, &w);
  CHECK_OK(decode(w.buf, w.len, 0, 4, &back));
  CHECK(same_encoding(t, back));
  ember_wire_writer_free(&w);
  ember__ps_table_destroy(t);
  ember__ps_table_destroy(back);
}

TEST(decode_refuses_every_truncation) {
  for (uint32_t layout = EMBER_PS_DENSE; layout <= EMBER_PS_SPARSE; layout++) {
    ember__ps_table *t = trained(layout, EMBER_PS_ADAM, 0, 2);
    ember_wire_writer w;
    encode(t, &w);
    for (size_t n = 0; n < w.len; n++) {
      uint8_t *copy = malloc(n + 1); /* exactly n bytes readable to ASan */
      CHECK(copy != NULL);
      memcpy(copy, w.buf, n);
      ember__ps_table *back = (ember__ps_table *)copy;
      CHECK_EQ_INT(decode(copy, n, 0, 2, &back), EMBER_ECORRUPT);
      CHECK(back == NULL);
      CHECK(ember_last_error()[0] != '\0');
      free(copy);
    }
    ember_wire_writer_free(&w);
    ember__ps_table_destroy(t);
  }
}

TEST(decode_survives_bit_flips) {
  for (uint32_t layout = EMBER_PS_DENSE; layout <= EMBER_PS_SPARSE; layout++) {
    ember__ps_table *t = trained(layout, EMBER_PS_MOMENTUM, 0, 2);
    ember_wire_writer w;
    encode(t, &w);
    int ok = 0, refused = 0;
    for (size_t bit = 0; bit < w.len * 8; bit++) {
      w.buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
      ember__ps_table *back = NULL;
      int rc = decode(w.buf, w.len, 0, 2, &back);
      if (rc == EMBER_OK) {
        ok++;
        /* a valid table: it encodes, and serves its rows */
        ember_wire_writer again;
        encode(back, &again);
        ember_wire_writer_free(&again);
        const ember_ps_table_spec *s = ember__ps_table_spec(back);
        if (s->cols <= 16 && s->rows > 0) {
          float v[16];
          uint64_t row = 0;
          while (row < s->rows && row < 64 &&
                 ember_ps_shard_of_row(s->layout, s->rows, row, 2) != 0)
            row++;
          if (row < s->rows && row < 64) CHECK_OK(ember__ps_table_pull(back, &row, 1, v));
        }
        ember__ps_table_destroy(back);
      } else {
        CHECK_EQ_INT(rc, EMBER_ECORRUPT);
        CHECK(back == NULL);
        refused++;
      }
      w.buf[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    }
    CHECK(ok > 0 && refused > 0); /* flipped floats decode, flipped counts do not */
    ember_wire_writer_free(&w);
    ember__ps_table_destroy(t);
  }
}

/* Offset of the u64 `held` in an encoding of a table named `name`. */
static size_t held_offset(const char *name) {
  return 4 + strlen(name) + 4 + 8 + 4 + 4 + 6 * 4 + 4 + 4 + 8 + 8 + 8;
}

TEST(decode_refuses_another_shard_and_bad_counts) {
  /* a dense shard's file read as another shard or shard count */
  ember__ps_table *t = trained(EMBER_PS_DENSE, EMBER_PS_SGD, 0, 2), *back = NULL;
  ember_wire_writer w;
  encode(t, &w);
  CHECK_EQ_INT(decode(w.buf, w.len, 1, 2, &back), EMBER_ECORRUPT);
  CHECK(has("written for rows [0, 20) but this shard holds [20, 40)"));
  CHECK_EQ_INT(decode(w.buf, w.len, 0, 3, &back), EMBER_ECORRUPT);
  CHECK(has("shard 0 of 3"));
  CHECK(back == NULL);
  CHECK_EQ_INT(decode(w.buf, w.len, 2, 2, &back), EMBER_EINVAL);

  /* held larger than the bytes left: refused before allocating */
  size_t at = held_offset("ck");
  CHECK_EQ_INT(ember_wire_get_u64(w.buf + at), 20);
  ember_wire_put_u64(w.buf + at, 1ull << 60);
  CHECK_EQ_INT(decode(w.buf, w.len, 0, 2, &back), EMBER_ECORRUPT);
  CHECK(has("1152921504606846976 rows of 28 bytes but only"));
  /* a dense shard holding fewer rows than its range */
  ember_wire_put_u64(w.buf + at, 19);
  CHECK_EQ_INT(decode(w.buf, w.len, 0, 2, &back), EMBER_ECORRUPT);
  CHECK(has("19 rows held, but a DENSE shard holds all 20"));
  ember_wire_put_u64(w.buf + at, 20);
  /* a dense row out of place */
  ember_wire_put_u64(w.buf + at + 8 + 28, 7);
  CHECK_EQ_INT(decode(w.buf, w.len, 0, 2, &back), EMBER_ECORRUPT);
  CHECK(has("row 7 where row 1 belongs"));
  ember_wire_writer_free(&w);
  ember__ps_table_destroy(t);

  /* a sparse shard's rows read by another shard */
  t = trained(EMBER_PS_SPARSE, EMBER_PS_ADAGRAD, 1, 2);
  encode(t, &w);
  CHECK_OK(decode(w.buf, w.len, 1, 2, &back));
  ember__ps_table_destroy(back);
  back = NULL;
  CHECK_EQ_INT(decode(w.buf, w.len, 0, 2, &back), EMBER_ECORRUPT);
  CHECK(has("is held by shard 1, not this one"));
  /* a sparse row twice, a row beyond the table */
  at = held_offset("ck");
  size_t slot = 16 + 3 * 2 * 4;
  uint64_t first = ember_wire_get_u64(w.buf + at + 8);
  uint64_t second = ember_wire_get_u64(w.buf + at + 8 + slot);
  ember_wire_put_u64(w.buf + at + 8 + slot, first);
  CHECK_EQ_INT(decode(w.buf, w.len, 1, 2, &back), EMBER_ECORRUPT);
  char want[96];
  snprintf(want, sizeof want, "row %llu appears twice", (unsigned long long)first);
  CHECK(has(want));
  ember_wire_put_u64(w.buf + at + 8 + slot, 40);
  CHECK_EQ_INT(decode(w.buf, w.len, 1, 2, &back), EMBER_ECORRUPT);
  CHECK(has("row 40 (position 1 of the checkpoint) out of range (rows 40)"));
  ember_wire_put_u64(w.buf + at + 8 + slot, second);
  /* a bad spec field */
  ember_wire_put_u32(w.buf + 4 + 2 + 4 + 8, 0); /* cols */
  CHECK_EQ_INT(decode(w.buf, w.len, 1, 2, &back), EMBER_ECORRUPT);
  CHECK(has("cols 0"));
  ember_wire_writer_free(&w);
  ember__ps_table_destroy(t);
}

RUN_TESTS(T(spec_normalize_fills_defaults_and_copies_the_name),
          T(spec_normalize_refuses_each_bad_field), T(spec_same_names_the_difference),
          T(state_per_value), T(create_refuses_bad_shards_and_specs),
          T(dense_ranges_partition_every_row), T(dense_huge_row_counts_do_not_overflow),
          T(sparse_rows_spread_evenly), T(optimizers_hand_computed),
          T(adagrad_epsilon_inside_the_root_as_keras_3),
          T(optimizers_match_reference_per_row), T(adam_steps_are_per_row),
          T(duplicate_ids_in_one_push_apply_both_in_order),
          T(push_held_applies_only_when_every_row_is_held),
          T(shared_pushes_lose_no_update_and_reads_see_whole_rows),
          T(init_is_a_function_of_seed_row_and_col), T(init_distributions),
          T(sparse_rows_materialise_on_first_touch), T(sparse_table_grows_past_many_rehashes),
          T(refused_push_changes_nothing_and_names_the_row), T(encode_decode_round_trip),
          T(decode_refuses_every_truncation), T(decode_survives_bit_flips),
          T(decode_refuses_another_shard_and_bad_counts))
