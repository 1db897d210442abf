/* ps_table.c - one shard's part of a parameter-server table (ps_table.h):
 * row storage, the optimizers, deterministic initial values and the
 * checkpoint codec; also ember_ps_shard_of_row (ps.h).
 *
 * Slots are referred to by index, never by pointer, because a sparse
 * table's arrays move when they grow.  A slot's floats are one stride of
 * `vals` (values, then the optimizer state); its row id (sparse) and step
 * count live in parallel arrays.
 *
 * libember links no libm (Makefile LIBS, setup.py, ember.pc), so the few
 * transcendental functions the initialisers need are written out here;
 * they only have to be accurate enough for random initial values, and being
 * our own they give the same bits on every host, which is what makes a
 * row's initial value independent of the machine that materialises it. */
#include "ps_table.h"

#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ember/error.h"
#include "ps_internal.h"

#define GOLDEN 0x9E3779B97F4A7C15ull
#define TWO_PI 6.28318530717958647692

/* Bytes of one slot in the checkpoint before its floats: u64 row, u64 steps. */
#define SLOT_HDR_BYTES 16u
/* 2^-53: turns the top 53 bits of a hash into a double in [0, 1). */
#define TWO_POW_M53 (1.0 / 9007199254740992.0)

typedef struct {
  uint64_t row; /* UINT64_MAX: empty (rows <= UINT64_MAX, so no row id is) */
  size_t slot;
} ps_entry;

struct ember__ps_table {
  ember_ps_table_spec spec; /* normalised; spec.name points at name */
  char name[EMBER_PS_NAME_MAX];
  char where[EMBER_PS_NAME_MAX + 64]; /* "table 'emb' (shard 1 of 2)" */
  uint32_t shard, num_shards;
  uint64_t begin, end;   /* the shard's rows: DENSE its range, SPARSE [0, rows) */
  uint32_t state;        /* floats of optimizer state per value */
  size_t stride;         /* floats per slot: cols * (1 + state) */
  size_t held, cap;      /* slots in use, slots allocated */
  float *vals;           /* cap x stride */
  uint64_t *steps;       /* cap: gradients applied to the slot's row */
  uint64_t *ids;         /* SPARSE, cap: the slot's row (DENSE: begin + slot) */
  ps_entry *map;         /* SPARSE: row -> slot, linear probing */
  size_t map_cap;        /* a power of two, or 0 */
  size_t *slots;         /* push/assign's slot of each row (their exclusive lock) */
  size_t slots_cap;
  _Atomic unsigned char *row_locks; /* PS_ROW_LOCKS spinlocks, a stripe of slots each */
};

/* ================================================================ hashing */

static uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + GOLDEN;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* The map's probe start: a different input than the shard hash's, so that
 * the rows one shard holds (all with splitmix64(row) % n == shard) do not
 * share their low bits and pile into one corner of the map. */
static size_t map_home(uint64_t row, size_t mask) {
  return (size_t)splitmix64(row ^ 0x6A09E667F3BCC909ull) & mask;
}

/* ================================================================ sharding */

uint32_t ember_ps_shard_of_row(uint32_t layout, uint64_t rows, uint64_t row,
                               uint32_t num_shards) {
  if (num_shards == 0 || row >= rows) return UINT32_MAX;
  if (layout == EMBER_PS_SPARSE) return (uint32_t)(splitmix64(row) % num_shards);
  if (layout != EMBER_PS_DENSE) return UINT32_MAX;
  /* The largest k with floor(k*rows/n) <= row, i.e. k*rows < (row+1)*n: it
   * is < n because row < rows, and row < begin(k+1) by maximality, so this
   * is the k of [begin(k), begin(k+1)) holding row even where shards are
   * empty (rows < n). */
  unsigned __int128 num = (unsigned __int128)(row + 1) * num_shards - 1;
  return (uint32_t)(num / rows);
}

/* ================================================================ init */

/* The per-row half of the counter-based hash, shared by a row's columns.
 * This function and init_uniform01 fix every initial value of every table:
 * a sparse row not in a checkpoint is re-created from them after a
 * restore, so changing them changes a restored model. */
static uint64_t init_row_key(uint64_t seed, uint64_t row) {
  return splitmix64(seed ^ (row * GOLDEN));
}

static double init_uniform01(uint64_t row_key, uint64_t counter) {
  return (double)(splitmix64(row_key ^ (counter * 0xD1B54A32D192ED03ull)) >> 11) * TWO_POW_M53;
}

/* Uniform in [-scale, scale): rounding to float could reach +scale. */
static float init_uniform(uint64_t row_key, uint32_t col, float scale) {
  float v = (float)((2.0 * init_uniform01(row_key, col) - 1.0) * scale);
  if (v >= scale && scale > 0.0f) {
    uint32_t bits;
    memcpy(&bits, &scale, sizeof bits);
    bits--; /* the largest float below a positive finite scale */
    memcpy(&v, &bits, sizeof v);
  }
  return v;
}

/* Box-Muller: columns 2p and 2p+1 are the cosine and sine halves of one
 * pair drawn from counters 2p and 2p+1, so a row costs one log per two
 * columns while each value stays a function of (seed, row, col) alone. */
static void init_normal_pair(uint64_t row_key, uint32_t pair, float scale, float *even,
                             float *odd) {
  double u1 = init_uniform01(row_key, 2u * (uint64_t)pair);
  double u2 = init_uniform01(row_key, 2u * (uint64_t)pair + 1u);
  /* 1 - u1 is in (0, 1]: never log(0) */
  double r = sqrt(-2.0 * log(1.0 - u1));
  *even = (float)(r * cos(TWO_PI * u2) * scale);
  *odd = (float)(r * sin(TWO_PI * u2) * scale);
}

float ember__ps_init_value(const ember_ps_table_spec *spec, uint64_t row, uint32_t col) {
  uint64_t key = init_row_key(spec->seed, row);
  switch (spec->init) {
    case EMBER_PS_INIT_UNIFORM: return init_uniform(key, col, spec->init_scale);
    case EMBER_PS_INIT_NORMAL: {
      float even, odd;
      init_normal_pair(key, col / 2u, spec->init_scale, &even, &odd);
      return (col & 1u) ? odd : even;
    }
    default: return 0.0f;
  }
}

/* A row's cols values (the same as ember__ps_init_value, column by column). */
static void init_row(const ember_ps_table_spec *spec, uint64_t row, float *out) {
  uint32_t cols = spec->cols;
  uint64_t key = init_row_key(spec->seed, row);
  switch (spec->init) {
    case EMBER_PS_INIT_UNIFORM:
      for (uint32_t c = 0; c < cols; c++) out[c] = init_uniform(key, c, spec->init_scale);
      break;
    case EMBER_PS_INIT_NORMAL:
      for (uint32_t c = 0; c < cols; c += 2) {
        float odd;
        init_normal_pair(key, c / 2u, spec->init_scale, &out[c], &odd);
        if (c + 1 < cols) out[c + 1] = odd;
      }
      break;
    default:
      memset(out, 0, (size_t)cols * sizeof *out);
      break;
  }
}

/* ================================================================ spec */

static const char *layout_name(uint32_t v) {
  return v == EMBER_PS_DENSE ? "DENSE" : v == EMBER_PS_SPARSE ? "SPARSE" : "?";
}

static const char *optimizer_name(uint32_t v) {
  switch (v) {
    case EMBER_PS_SGD: return "SGD";
    case EMBER_PS_MOMENTUM: return "MOMENTUM";
    case EMBER_PS_ADAGRAD: return "ADAGRAD";
    case EMBER_PS_ADAM: return "ADAM";
    default: return "?";
  }
}

static const char *init_name(uint32_t v) {
  switch (v) {
    case EMBER_PS_INIT_ZEROS: return "ZEROS";
    case EMBER_PS_INIT_UNIFORM: return "UNIFORM";
    case EMBER_PS_INIT_NORMAL: return "NORMAL";
    default: return "?";
  }
}

/* Names reach error messages and logs; they may come off the network. */
static void printable(const char *s, char *out, size_t cap) {
  size_t n = 0;
  for (; s[n] != '\0' && n + 1 < cap; n++) {
    unsigned char ch = (unsigned char)s[n];
    out[n] = ch >= 0x20 && ch < 0x7F && ch != '\'' ? (char)ch : '?';
  }
  out[n] = '\0';
}

static int bad_field(const char *name, const char *field, double v, const char *must) {
  return ember__set_error(EMBER_EINVAL, "table '%s': %s %.9g %s", name, field, v, must);
}

int ember__ps_spec_normalize(const ember_ps_table_spec *in, ember_ps_table_spec *out,
                             char *name_buf) {
  if (in == NULL || out == NULL || name_buf == NULL)
    return ember__set_error(EMBER_EINVAL, "table spec: no spec or no output");
  if (in->name == NULL || in->name[0] == '\0')
    return ember__set_error(EMBER_EINVAL, "table spec: the name is empty");
  size_t len = strnlen(in->name, EMBER_PS_NAME_MAX);
  char nm[EMBER_PS_NAME_MAX];
  if (len >= EMBER_PS_NAME_MAX) {
    printable(in->name, nm, 40);
    return ember__set_error(EMBER_EINVAL, "table spec: the name '%s...' is longer than %u bytes",
                            nm, EMBER_PS_NAME_MAX - 1u);
  }
  printable(in->name, nm, sizeof nm);
  ember_ps_table_spec s = *in;
  ember_ps_optimizer *o = &s.optimizer;
  if (s.layout != EMBER_PS_DENSE && s.layout != EMBER_PS_SPARSE)
    return ember__set_error(EMBER_EINVAL, "table '%s': layout %u is neither DENSE (0) nor SPARSE (1)",
                            nm, s.layout);
  if (s.rows == 0) return ember__set_error(EMBER_EINVAL, "table '%s': rows is 0", nm);
  if (s.cols == 0 || s.cols > EMBER_PS_MAX_COLS)
    return ember__set_error(EMBER_EINVAL, "table '%s': cols %u is not in 1..%u", nm, s.cols,
                            EMBER_PS_MAX_COLS);
  if (o->kind > EMBER_PS_ADAM)
    return ember__set_error(EMBER_EINVAL, "table '%s': optimizer kind %u is unknown (0..3)", nm,
                            o->kind);
  if (s.init > EMBER_PS_INIT_NORMAL)
    return ember__set_error(EMBER_EINVAL, "table '%s': init %u is unknown (0..2)", nm, s.init);
  if (!isfinite(o->learning_rate) || o->learning_rate < 0.0f)
    return bad_field(nm, "learning_rate", o->learning_rate, "is not a finite number >= 0");

  /* Fields the optimizer does not read are zeroed, so two specs that differ
   * only there are the same table (ember__ps_spec_same) and every shard
   * writes the same checkpoint header. */
  float momentum = 0.0f, beta1 = 0.0f, beta2 = 0.0f, epsilon = 0.0f, accumulator = 0.0f;
  switch (o->kind) {
    case EMBER_PS_MOMENTUM:
      momentum = o->momentum;
      /* Keras refuses a momentum outside [0, 1] too */
      if (!(momentum >= 0.0f && momentum <= 1.0f))
        return bad_field(nm, "momentum", momentum, "is not in [0, 1]");
      break;
    case EMBER_PS_ADAGRAD:
      epsilon = o->epsilon == 0.0f ? 1e-7f : o->epsilon;
      accumulator = o->initial_accumulator;
      if (!isfinite(epsilon) || epsilon < 0.0f)
        return bad_field(nm, "epsilon", epsilon, "is not a finite number >= 0");
      /* 0 stays 0: the caller asked for it (Keras's default is 0.1) */
      if (!isfinite(accumulator) || accumulator < 0.0f)
        return bad_field(nm, "initial_accumulator", accumulator, "is not a finite number >= 0");
      break;
    case EMBER_PS_ADAM:
      beta1 = o->beta1 == 0.0f ? 0.9f : o->beta1;
      beta2 = o->beta2 == 0.0f ? 0.999f : o->beta2;
      epsilon = o->epsilon == 0.0f ? 1e-7f : o->epsilon;
      /* a beta of 1 or more divides by 1 - beta^t = 0 (or worse) */
      if (!(beta1 > 0.0f && beta1 < 1.0f)) return bad_field(nm, "beta1", beta1, "is not in (0, 1)");
      if (!(beta2 > 0.0f && beta2 < 1.0f)) return bad_field(nm, "beta2", beta2, "is not in (0, 1)");
      if (!isfinite(epsilon) || epsilon < 0.0f)
        return bad_field(nm, "epsilon", epsilon, "is not a finite number >= 0");
      break;
    default:
      break;
  }
  o->momentum = momentum;
  o->beta1 = beta1;
  o->beta2 = beta2;
  o->epsilon = epsilon;
  o->initial_accumulator = accumulator;
  if (s.init == EMBER_PS_INIT_ZEROS) {
    s.init_scale = 0.0f;
    s.seed = 0;
  } else if (!isfinite(s.init_scale) || s.init_scale < 0.0f) {
    return bad_field(nm, "init_scale", s.init_scale, "is not a finite number >= 0");
  }
  /* memmove: in->name may already be name_buf */
  memmove(name_buf, in->name, len + 1);
  s.name = name_buf;
  *out = s;
  return EMBER_OK;
}

/* The first field where a and b differ, described into out; 0 if none. */
static int spec_diff(const ember_ps_table_spec *a, const ember_ps_table_spec *b, char *out,
                     size_t cap) {
  const ember_ps_optimizer *p = &a->optimizer, *q = &b->optimizer;
  char x[EMBER_PS_NAME_MAX], y[EMBER_PS_NAME_MAX];
  if (strcmp(a->name, b->name) != 0) {
    printable(a->name, x, sizeof x);
    printable(b->name, y, sizeof y);
    return snprintf(out, cap, "name '%s' here, '%s' asked", x, y), 1;
  }
  if (a->layout != b->layout)
    return snprintf(out, cap, "layout %s here, %s asked", layout_name(a->layout),
                    layout_name(b->layout)), 1;
  if (a->rows != b->rows)
    return snprintf(out, cap, "rows %llu here, %llu asked", (unsigned long long)a->rows,
                    (unsigned long long)b->rows), 1;
  if (a->cols != b->cols) return snprintf(out, cap, "cols %u here, %u asked", a->cols, b->cols), 1;
  if (p->kind != q->kind)
    return snprintf(out, cap, "optimizer %s here, %s asked", optimizer_name(p->kind),
                    optimizer_name(q->kind)), 1;
  const struct {
    const char *field;
    float here, asked;
  } f[] = {{"learning_rate", p->learning_rate, q->learning_rate},
           {"momentum", p->momentum, q->momentum},
           {"beta1", p->beta1, q->beta1},
           {"beta2", p->beta2, q->beta2},
           {"epsilon", p->epsilon, q->epsilon},
           {"initial_accumulator", p->initial_accumulator, q->initial_accumulator}};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
    if (f[i].here != f[i].asked)
      return snprintf(out, cap, "%s %.9g here, %.9g asked", f[i].field, (double)f[i].here,
                      (double)f[i].asked), 1;
  if (a->init != b->init)
    return snprintf(out, cap, "init %s here, %s asked", init_name(a->init), init_name(b->init)), 1;
  if (a->init_scale != b->init_scale)
    return snprintf(out, cap, "init_scale %.9g here, %.9g asked", (double)a->init_scale,
                    (double)b->init_scale), 1;
  if (a->seed != b->seed)
    return snprintf(out, cap, "seed %llu here, %llu asked", (unsigned long long)a->seed,
                    (unsigned long long)b->seed), 1;
  return 0;
}

int ember__ps_spec_same(const ember_ps_table_spec *a, const ember_ps_table_spec *b,
                        char *why, size_t cap) {
  char tmp[2 * EMBER_PS_NAME_MAX + 64] = "";
  int differ = a == NULL || b == NULL || a->name == NULL || b->name == NULL
                   ? (snprintf(tmp, sizeof tmp, "no spec to compare"), 1)
                   : spec_diff(a, b, tmp, sizeof tmp);
  if (why != NULL && cap > 0) snprintf(why, cap, "%s", differ ? tmp : "");
  return !differ;
}

uint32_t ember__ps_state_per_value(uint32_t optimizer_kind) {
  switch (optimizer_kind) {
    case EMBER_PS_MOMENTUM:
    case EMBER_PS_ADAGRAD: return 1;
    case EMBER_PS_ADAM: return 2;
    default: return 0;
  }
}

/* ================================================================ row locks */

/* Under the caller's shared lock, several threads read and push the rows
 * held at once (ps_table.h); each row is copied and updated under the
 * spinlock of its stripe of slots, so a push applies a row whole and a read
 * never sees half of one.  A lock is held for one row's copy or update
 * (tens of nanoseconds), hence spinning; 4,096 one-byte locks cost 4 KiB a
 * table and made two threads' pushes about as fast as with no locks at all
 * (in process, 4,096 random rows of a 1M x 64 table: 766-796 pull+push
 * rounds/s against 766-836 unlocked and 342-356 with pushes exclusive). */
#define PS_ROW_LOCKS 4096u

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

static void row_lock(const ember__ps_table *t, size_t slot) {
  _Atomic unsigned char *l = &t->row_locks[slot & (PS_ROW_LOCKS - 1)];
  unsigned spins = 0;
  while (atomic_exchange_explicit(l, 1, memory_order_acquire)) {
    while (atomic_load_explicit(l, memory_order_relaxed)) {
      /* a holder descheduled mid-row (more threads than cores) */
      if (++spins % 1024 == 0) sched_yield();
      else cpu_relax();
    }
  }
}

static void row_unlock(const ember__ps_table *t, size_t slot) {
  atomic_store_explicit(&t->row_locks[slot & (PS_ROW_LOCKS - 1)], 0, memory_order_release);
}

/* ================================================================ storage */

static int too_big(const ember__ps_table *t, uint64_t slots) {
  return ember__set_error(EMBER_ENOMEM,
                          "%s: %llu rows of %zu floats do not fit in this address space",
                          t->where, (unsigned long long)slots, t->stride);
}

static int no_memory(const ember__ps_table *t, size_t bytes) {
  return ember__set_error(EMBER_ENOMEM, "%s: out of memory allocating %zu bytes", t->where,
                          bytes);
}

/* Rows are looked up and updated at random across arrays far larger than
 * what the TLB maps in 4 KiB pages, so each access to a large table also
 * waited on a page walk.  Arrays of 2 MiB and more are therefore 2 MiB-aligned
 * and asked for transparent huge pages (the kernels' default THP mode,
 * "madvise", gives them only when asked; a kernel without THP refuses and
 * the array works as before).  A grown array is a new allocation, not a
 * realloc: mremap would carry the old 4 KiB pages over. */
#define PS_HUGE_PAGE ((size_t)2 << 20)

static void *grow_array(void *old, size_t old_bytes, size_t bytes) {
  if (bytes < PS_HUGE_PAGE) return realloc(old, bytes);
  size_t whole = (bytes + PS_HUGE_PAGE - 1) & ~(PS_HUGE_PAGE - 1);
  void *p = aligned_alloc(PS_HUGE_PAGE, whole);
  if (p == NULL) return NULL;
  (void)madvise(p, whole, MADV_HUGEPAGE);
  if (old_bytes > 0) memcpy(p, old, old_bytes);
  free(old);
  return p;
}

/* Grows the slot arrays to hold ncap slots.  Each growth that succeeds is
 * kept even when a later one fails: an array larger than cap is harmless. */
static int reserve_slots(ember__ps_table *t, size_t ncap) {
  if (ncap <= t->cap) return EMBER_OK;
  size_t vbytes, ubytes;
  if (__builtin_mul_overflow(ncap, t->stride, &vbytes) ||
      __builtin_mul_overflow(vbytes, sizeof(float), &vbytes) ||
      __builtin_mul_overflow(ncap, sizeof(uint64_t), &ubytes))
    return too_big(t, ncap);
  size_t old_u = t->cap * sizeof(uint64_t), old_v = t->cap * t->stride * sizeof(float);
  uint64_t *st = grow_array(t->steps, old_u, ubytes);
  if (st == NULL) return no_memory(t, ubytes);
  t->steps = st;
  if (t->spec.layout == EMBER_PS_SPARSE) {
    uint64_t *ids = grow_array(t->ids, old_u, ubytes);
    if (ids == NULL) return no_memory(t, ubytes);
    t->ids = ids;
  }
  float *v = grow_array(t->vals, old_v, vbytes);
  if (v == NULL) return no_memory(t, vbytes);
  t->vals = v;
  t->cap = ncap;
  return EMBER_OK;
}

static size_t map_find(const ember__ps_table *t, uint64_t row) {
  if (t->map_cap == 0) return SIZE_MAX;
  size_t mask = t->map_cap - 1;
  for (size_t i = map_home(row, mask);; i = (i + 1) & mask) {
    if (t->map[i].row == row) return t->map[i].slot;
    if (t->map[i].row == UINT64_MAX) return SIZE_MAX;
  }
}

/* A batch's rows are scattered over a table far larger than the caches, so
 * each lookup and each row would wait for memory in turn; the batched loops
 * below ask for the map entry and the row of a few rows ahead first
 * (software prefetch), so that those waits overlap.  16 rows ahead measured
 * best (against 4 and 8) on 4,096 random rows of a 1M x 64 table. */
#define PS_AHEAD 16

static void prefetch_home(const ember__ps_table *t, uint64_t row) {
  if (t->map_cap != 0) __builtin_prefetch(&t->map[map_home(row, t->map_cap - 1)]);
}

/* The first `bytes` of a slot's floats, and its step count (apply's). */
static void prefetch_slot(const ember__ps_table *t, size_t slot, size_t bytes) {
  const char *p = (const char *)(t->vals + slot * t->stride);
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
  __builtin_prefetch(&t->steps[slot]);
}

/* slots[i] = the slot of checked row ids[i], SIZE_MAX where a sparse row is
 * not held. */
static void find_slots(const ember__ps_table *t, const uint64_t *ids, size_t n,
                       size_t *slots) {
  if (t->spec.layout == EMBER_PS_DENSE) {
    for (size_t i = 0; i < n; i++) slots[i] = (size_t)(ids[i] - t->begin);
    return;
  }
  for (size_t i = 0; i < n && i < PS_AHEAD; i++) prefetch_home(t, ids[i]);
  for (size_t i = 0; i < n; i++) {
    if (i + PS_AHEAD < n) prefetch_home(t, ids[i + PS_AHEAD]);
    slots[i] = map_find(t, ids[i]);
  }
}

static void map_put(ps_entry *map, size_t map_cap, uint64_t row, size_t slot) {
  size_t mask = map_cap - 1, i = map_home(row, mask);
  while (map[i].row != UINT64_MAX) i = (i + 1) & mask;
  map[i].row = row;
  map[i].slot = slot;
}

/* Makes the map big enough for `want` rows at a load of at most 5/8, which
 * keeps linear probing's expected probe count low. */
static int reserve_map(ember__ps_table *t, size_t want) {
  size_t ncap = t->map_cap ? t->map_cap : 32;
  while (want > ncap / 8 * 5) {
    if (ncap > SIZE_MAX / 2) return too_big(t, want);
    ncap *= 2;
  }
  if (ncap == t->map_cap) return EMBER_OK;
  size_t bytes;
  if (__builtin_mul_overflow(ncap, sizeof(ps_entry), &bytes)) return too_big(t, want);
  ps_entry *m = grow_array(NULL, 0, bytes);
  if (m == NULL) return no_memory(t, bytes);
  for (size_t i = 0; i < ncap; i++) m[i].row = UINT64_MAX;
  for (size_t s = 0; s < t->held; s++) map_put(m, ncap, t->ids[s], s);
  free(t->map);
  t->map = m;
  t->map_cap = ncap;
  return EMBER_OK;
}

/* A fresh slot's floats: initial values, state zero (Adagrad: its
 * initial accumulator). */
static void fill_slot(ember__ps_table *t, size_t slot, uint64_t row) {
  float *v = t->vals + slot * t->stride;
  init_row(&t->spec, row, v);
  float *st = v + t->spec.cols;
  size_t n = t->stride - t->spec.cols;
  if (t->spec.optimizer.kind == EMBER_PS_ADAGRAD) {
    for (size_t i = 0; i < n; i++) st[i] = t->spec.optimizer.initial_accumulator;
  } else if (n > 0) {
    memset(st, 0, n * sizeof *st);
  }
  t->steps[slot] = 0;
}

/* The slot of a checked row, materialising an absent sparse row. */
static int slot_of(ember__ps_table *t, uint64_t row, size_t *out) {
  if (t->spec.layout == EMBER_PS_DENSE) {
    *out = (size_t)(row - t->begin);
    return EMBER_OK;
  }
  size_t s = map_find(t, row);
  if (s != SIZE_MAX) {
    *out = s;
    return EMBER_OK;
  }
  int rc;
  if (t->held == t->cap && (rc = reserve_slots(t, t->cap ? t->cap * 2 : 16)) != EMBER_OK)
    return rc;
  if ((rc = reserve_map(t, t->held + 1)) != EMBER_OK) return rc;
  s = t->held;
  t->ids[s] = row;
  fill_slot(t, s, row);
  map_put(t->map, t->map_cap, row, s);
  t->held++;
  *out = s;
  return EMBER_OK;
}

static void set_where(ember__ps_table *t) {
  char nm[EMBER_PS_NAME_MAX];
  printable(t->name, nm, sizeof nm);
  snprintf(t->where, sizeof t->where, "table '%s' (shard %u of %u)", nm, t->shard,
           t->num_shards);
}

static int check_shards(const char *what, uint32_t shard, uint32_t num_shards) {
  if (num_shards == 0 || num_shards > EMBER_PS_MAX_SHARDS || shard >= num_shards)
    return ember__set_error(EMBER_EINVAL, "%s: shard %u of %u is not a shard (1..%u shards)",
                            what, shard, num_shards, EMBER_PS_MAX_SHARDS);
  return EMBER_OK;
}

/* The table without its rows; a DENSE table's range is allocated (and
 * initialised when fill). */
static int table_new(ember__ps_table **out, const ember_ps_table_spec *norm, uint32_t shard,
                     uint32_t num_shards, int fill) {
  ember__ps_table *t = calloc(1, sizeof *t);
  if (t == NULL) return ember__set_error(EMBER_ENOMEM, "table '%s': out of memory", norm->name);
  t->row_locks = calloc(PS_ROW_LOCKS, sizeof *t->row_locks);
  if (t->row_locks == NULL) {
    free(t);
    return ember__set_error(EMBER_ENOMEM, "table '%s': out of memory", norm->name);
  }
  int rc = EMBER_OK;
  t->spec = *norm;
  memcpy(t->name, norm->name, strlen(norm->name) + 1);
  t->spec.name = t->name;
  t->shard = shard;
  t->num_shards = num_shards;
  set_where(t);
  t->state = ember__ps_state_per_value(norm->optimizer.kind);
  t->stride = (size_t)norm->cols * (1u + t->state); /* <= 3 * 2^20 */
  if (norm->layout == EMBER_PS_DENSE) {
    t->begin = ember__ps_dense_begin(norm->rows, shard, num_shards);
    t->end = ember__ps_dense_begin(norm->rows, shard + 1, num_shards);
    uint64_t n = t->end - t->begin;
    if (n > SIZE_MAX) {
      rc = too_big(t, n);
      goto fail;
    }
    if (n > 0 && (rc = reserve_slots(t, (size_t)n)) != EMBER_OK) goto fail;
    t->held = (size_t)n;
    if (fill)
      for (size_t s = 0; s < t->held; s++) fill_slot(t, s, t->begin + s);
  } else {
    t->begin = 0;
    t->end = norm->rows;
  }
  *out = t;
  return EMBER_OK;
fail:
  ember__ps_table_destroy(t);
  return rc;
}

int ember__ps_table_create(ember__ps_table **out, const ember_ps_table_spec *spec,
                           uint32_t shard, uint32_t num_shards) {
  if (out == NULL) return ember__set_error(EMBER_EINVAL, "ps table create: no output");
  *out = NULL;
  ember_ps_table_spec norm;
  char name[EMBER_PS_NAME_MAX];
  int rc = ember__ps_spec_normalize(spec, &norm, name);
  if (rc != EMBER_OK) return rc;
  char nm[EMBER_PS_NAME_MAX], what[EMBER_PS_NAME_MAX + 16];
  printable(name, nm, sizeof nm);
  snprintf(what, sizeof what, "table '%s'", nm);
  if ((rc = check_shards(what, shard, num_shards)) != EMBER_OK) return rc;
  return table_new(out, &norm, shard, num_shards, 1);
}

void ember__ps_table_destroy(ember__ps_table *t) {
  if (t == NULL) return;
  free(t->vals);
  free(t->steps);
  free(t->ids);
  free(t->map);
  free(t->slots);
  free((void *)t->row_locks);
  free(t);
}

const ember_ps_table_spec *ember__ps_table_spec(const ember__ps_table *t) { return &t->spec; }

uint64_t ember__ps_table_held(const ember__ps_table *t) { return t->held; }

/* ================================================================ pull / push */

/* EMBER_EINVAL naming the row unless this shard holds it. */
static int check_row(const ember__ps_table *t, uint64_t row, size_t pos, const char *op) {
  if (row >= t->spec.rows)
    return ember__set_error(EMBER_EINVAL, "%s: row %llu (position %zu of the %s) out of range (rows %llu)",
                            t->where, (unsigned long long)row, pos, op,
                            (unsigned long long)t->spec.rows);
  int mine = t->spec.layout == EMBER_PS_DENSE
                 ? row >= t->begin && row < t->end
                 : ember_ps_shard_of_row(EMBER_PS_SPARSE, t->spec.rows, row, t->num_shards) == t->shard;
  if (!mine)
    return ember__set_error(EMBER_EINVAL, "%s: row %llu (position %zu of the %s) is held by shard %u, not this one",
                            t->where, (unsigned long long)row, pos, op,
                            ember_ps_shard_of_row(t->spec.layout, t->spec.rows, row, t->num_shards));
  return EMBER_OK;
}

static int check_rows(const ember__ps_table *t, const uint64_t *ids, size_t n, const void *buf,
                      const char *op) {
  if (n > 0 && (ids == NULL || buf == NULL))
    return ember__set_error(EMBER_EINVAL, "%s: %s of %zu rows without %s", t->where, op, n,
                            ids == NULL ? "row ids" : "a buffer");
  for (size_t i = 0; i < n; i++) {
    int rc = check_row(t, ids[i], i, op);
    if (rc != EMBER_OK) return rc;
  }
  return EMBER_OK;
}

int ember__ps_table_pull(ember__ps_table *t, const uint64_t *ids, size_t n, float *out) {
  int rc = check_rows(t, ids, n, out, "pull");
  if (rc != EMBER_OK) return rc;
  size_t cols = t->spec.cols;
  for (size_t i = 0; i < n; i++) {
    size_t s;
    if ((rc = slot_of(t, ids[i], &s)) != EMBER_OK) return rc;
    memcpy(out + i * cols, t->vals + s * t->stride, cols * sizeof *out);
  }
  return EMBER_OK;
}

int ember__ps_table_read(const ember__ps_table *t, const uint64_t *ids, size_t n,
                         float *out) {
  int rc = check_rows(t, ids, n, out, "pull");
  if (rc != EMBER_OK) return rc;
  size_t cols = t->spec.cols, slots[256]; /* on the stack: readers share the table */
  for (size_t at = 0; at < n; at += 256) {
    size_t m = n - at < 256 ? n - at : 256;
    find_slots(t, ids + at, m, slots);
    for (size_t i = 0; i < m; i++) {
      if (i + PS_AHEAD < m && slots[i + PS_AHEAD] != SIZE_MAX)
        prefetch_slot(t, slots[i + PS_AHEAD], cols * sizeof *out);
      if (slots[i] == SIZE_MAX) return 0; /* not held yet: the caller pulls (and creates) */
      row_lock(t, slots[i]);
      memcpy(out + (at + i) * cols, t->vals + slots[i] * t->stride, cols * sizeof *out);
      row_unlock(t, slots[i]);
    }
  }
  return 1;
}

/* w -= lr * g in float32, as TensorFlow's and Keras's SGD compute it, eight
 * floats at a time: the compiler does not vectorize this loop at -O2, and
 * it was a quarter of a shard's CPU in bench-ps's sparse rounds. */
typedef float ps_f32x8 __attribute__((vector_size(32)));

static void sgd_row(float *w, const float *g, float lr, size_t cols) {
  size_t j = 0;
  ps_f32x8 rate = {lr, lr, lr, lr, lr, lr, lr, lr};
  for (; j + 8 <= cols; j += 8) {
    ps_f32x8 wv, gv;
    memcpy(&wv, w + j, sizeof wv);
    memcpy(&gv, g + j, sizeof gv);
    wv -= rate * gv;
    memcpy(w + j, &wv, sizeof wv);
  }
  for (; j < cols; j++) w[j] -= lr * g[j];
}

/* One gradient row into one slot.  SGD in float32 (sgd_row); the others in
 * double, stored as float: Keras computes them in the variable's float32, so
 * this is at least as exact. */
static void apply(ember__ps_table *t, size_t slot, const float *g) {
  const ember_ps_optimizer *o = &t->spec.optimizer;
  size_t cols = t->spec.cols;
  float *w = t->vals + slot * t->stride, *s1 = w + cols, *s2 = s1 + cols;
  double lr = o->learning_rate;
  if (t->steps[slot] != UINT64_MAX) t->steps[slot]++; /* saturate, never back to 0 */
  switch (o->kind) {
    case EMBER_PS_SGD:
      sgd_row(w, g, o->learning_rate, cols);
      break;
    case EMBER_PS_MOMENTUM: {
      double mom = o->momentum;
      for (size_t j = 0; j < cols; j++) {
        s1[j] = (float)(mom * s1[j] - lr * g[j]);
        w[j] = (float)((double)w[j] + s1[j]);
      }
      break;
    }
    case EMBER_PS_ADAGRAD: {
      /* Keras 3 (keras/src/optimizers/adagrad.py): epsilon inside the root */
      double eps = o->epsilon;
      for (size_t j = 0; j < cols; j++) {
        double gj = g[j];
        s1[j] = (float)(s1[j] + gj * gj);
        w[j] = (float)(w[j] - lr * gj / sqrt((double)s1[j] + eps));
      }
      break;
    }
    case EMBER_PS_ADAM: {
      double b1 = o->beta1, b2 = o->beta2, eps = o->epsilon;
      uint64_t step = t->steps[slot];
      double alpha = lr * sqrt(1.0 - pow(b2, step)) / (1.0 - pow(b1, step));
      for (size_t j = 0; j < cols; j++) {
        double gj = g[j];
        s1[j] = (float)(s1[j] + (gj - s1[j]) * (1.0 - b1));
        s2[j] = (float)(s2[j] + (gj * gj - s2[j]) * (1.0 - b2));
        w[j] = (float)(w[j] - s1[j] * alpha / (sqrt(s2[j]) + eps));
      }
      break;
    }
    default:
      break;
  }
}

/* t->slots[i] = the slot of checked row ids[i], materialising absent sparse
 * rows: every row exists before the caller changes any, so that running out
 * of memory leaves only initial-valued rows behind, which read the same as
 * rows never materialised.  Slots are indexes, which later growth of the
 * slot arrays or the map does not move. */
static int slots_for_write(ember__ps_table *t, const uint64_t *ids, size_t n) {
  if (n > t->slots_cap) {
    size_t bytes;
    if (__builtin_mul_overflow(n, sizeof *t->slots, &bytes)) return too_big(t, n);
    size_t *p = realloc(t->slots, bytes);
    if (p == NULL) return no_memory(t, bytes);
    t->slots = p;
    t->slots_cap = n;
  }
  find_slots(t, ids, n, t->slots);
  for (size_t i = 0; i < n; i++) {
    int rc;
    if (t->slots[i] == SIZE_MAX && (rc = slot_of(t, ids[i], &t->slots[i])) != EMBER_OK)
      return rc;
  }
  return EMBER_OK;
}

/* Gradient row i into slots[i], each row under its lock. */
static void apply_rows(ember__ps_table *t, const size_t *slots, size_t n, const float *grads) {
  size_t cols = t->spec.cols, bytes = t->stride * sizeof(float);
  for (size_t i = 0; i < n; i++) {
    if (i + PS_AHEAD < n) prefetch_slot(t, slots[i + PS_AHEAD], bytes);
    row_lock(t, slots[i]);
    apply(t, slots[i], grads + i * cols);
    row_unlock(t, slots[i]);
  }
}

int ember__ps_table_push(ember__ps_table *t, const uint64_t *ids, size_t n, const float *grads) {
  int rc = check_rows(t, ids, n, grads, "push");
  if (rc != EMBER_OK) return rc;
  if ((rc = slots_for_write(t, ids, n)) != EMBER_OK) return rc;
  apply_rows(t, t->slots, n, grads);
  return EMBER_OK;
}

int ember__ps_table_push_held(ember__ps_table *t, const uint64_t *ids, size_t n,
                              const float *grads, size_t *slots) {
  int rc = check_rows(t, ids, n, grads, "push");
  if (rc != EMBER_OK) return rc;
  if (n > 0 && slots == NULL)
    return ember__set_error(EMBER_EINVAL, "%s: push of %zu rows without slot space", t->where, n);
  find_slots(t, ids, n, slots);
  for (size_t i = 0; i < n; i++)
    if (slots[i] == SIZE_MAX) return 0; /* the caller pushes alone, creating the row */
  apply_rows(t, slots, n, grads);
  return 1;
}

int ember__ps_table_assign(ember__ps_table *t, const uint64_t *ids, size_t n,
                           const float *values, int untrained_only) {
  int rc = check_rows(t, ids, n, values, "assign");
  if (rc != EMBER_OK) return rc;
  if ((rc = slots_for_write(t, ids, n)) != EMBER_OK) return rc;
  size_t cols = t->spec.cols;
  for (size_t i = 0; i < n; i++) {
    size_t s = t->slots[i];
    if (untrained_only && t->steps[s] != 0) continue;
    memcpy(t->vals + s * t->stride, values + i * cols, cols * sizeof *values);
  }
  return EMBER_OK;
}

/* ================================================================ checkpoint */

void ember__ps_table_encode(const ember__ps_table *t, ember_wire_writer *w) {
  ember__ps_encode_spec(w, &t->spec); /* the spec as PS_DECLARE carries it */
  ember_wire_write_u64(w, t->begin);
  ember_wire_write_u64(w, t->end);
  ember_wire_write_u64(w, t->held);
  /* floats go through a little-endian staging buffer in chunks: one
   * writer call per float would dominate a large table's save */
  uint8_t buf[4096];
  for (size_t slot = 0; slot < t->held && w->err == EMBER_OK; slot++) {
    ember_wire_write_u64(w, t->spec.layout == EMBER_PS_DENSE ? t->begin + slot : t->ids[slot]);
    ember_wire_write_u64(w, t->steps[slot]);
    const float *v = t->vals + slot * t->stride;
    for (size_t i = 0; i < t->stride;) {
      size_t k = 0;
      for (; k < sizeof buf / 4 && i < t->stride; k++, i++) {
        uint32_t u;
        memcpy(&u, &v[i], sizeof u);
        ember_wire_put_u32(buf + 4 * k, u);
      }
      ember_wire_write_raw(w, buf, 4 * k);
    }
  }
}

int ember__ps_table_decode(ember_wire_reader *r, uint32_t shard, uint32_t num_shards,
                           ember__ps_table **out) {
  if (out == NULL || r == NULL)
    return ember__set_error(EMBER_EINVAL, "ps table decode: no reader or no output");
  *out = NULL;
  int rc = check_shards("checkpoint table", shard, num_shards);
  if (rc != EMBER_OK) return rc;
  ember_ps_table_spec in, norm;
  char raw_name[EMBER_PS_NAME_MAX], name[EMBER_PS_NAME_MAX], nm[EMBER_PS_NAME_MAX];
  ember__ps_read_spec(r, &in, raw_name);
  uint64_t begin = ember_wire_read_u64(r), end = ember_wire_read_u64(r);
  uint64_t held = ember_wire_read_u64(r);
  if (r->err != EMBER_OK)
    return ember__set_error(EMBER_ECORRUPT, "checkpoint table for shard %u of %u: header: %s",
                            shard, num_shards, ember_last_error());
  if (ember__ps_spec_normalize(&in, &norm, name) != EMBER_OK)
    return ember__set_error(EMBER_ECORRUPT, "checkpoint table for shard %u of %u: %s", shard,
                            num_shards, ember_last_error());
  printable(name, nm, sizeof nm);

  uint64_t want_begin = 0, want_end = norm.rows;
  if (norm.layout == EMBER_PS_DENSE) {
    want_begin = ember__ps_dense_begin(norm.rows, shard, num_shards);
    want_end = ember__ps_dense_begin(norm.rows, shard + 1, num_shards);
  }
  if (begin != want_begin || end != want_end)
    return ember__set_error(EMBER_ECORRUPT,
                            "checkpoint of table '%s' (shard %u of %u): written for rows [%llu, %llu) "
                            "but this shard holds [%llu, %llu) (another shard or shard count wrote it)",
                            nm, shard, num_shards, (unsigned long long)begin,
                            (unsigned long long)end, (unsigned long long)want_begin,
                            (unsigned long long)want_end);
  /* bound the count by the bytes left before allocating anything for it */
  size_t stride = (size_t)norm.cols * (1u + ember__ps_state_per_value(norm.optimizer.kind));
  size_t slot_bytes = SLOT_HDR_BYTES + 4u * stride; /* <= 16 + 12 * 2^20 */
  if (held > r->left / slot_bytes)
    return ember__set_error(EMBER_ECORRUPT,
                            "checkpoint of table '%s' (shard %u of %u): %llu rows of %zu bytes "
                            "but only %zu bytes left",
                            nm, shard, num_shards, (unsigned long long)held, slot_bytes, r->left);
  if (norm.layout == EMBER_PS_DENSE && held != want_end - want_begin)
    return ember__set_error(EMBER_ECORRUPT,
                            "checkpoint of table '%s' (shard %u of %u): %llu rows held, but a "
                            "DENSE shard holds all %llu of its range",
                            nm, shard, num_shards, (unsigned long long)held,
                            (unsigned long long)(want_end - want_begin));

  ember__ps_table *t = NULL;
  if ((rc = table_new(&t, &norm, shard, num_shards, 0)) != EMBER_OK) return rc;
  if (norm.layout == EMBER_PS_SPARSE &&
      ((rc = reserve_slots(t, (size_t)held)) != EMBER_OK ||
       (rc = reserve_map(t, (size_t)held)) != EMBER_OK))
    goto fail;
  for (uint64_t i = 0; i < held; i++) {
    uint64_t row = ember_wire_read_u64(r), steps = ember_wire_read_u64(r);
    const uint8_t *fl = NULL;
    ember_wire_read_raw(r, &fl, 4u * stride);
    if (r->err != EMBER_OK) {
      /* cannot happen after the bound on held above; checked so that a
       * change there cannot turn into a read through NULL */
      rc = ember__set_error(EMBER_ECORRUPT, "checkpoint of %s: row %llu: %s", t->where,
                            (unsigned long long)i, ember_last_error());
      goto fail;
    }
    size_t slot;
    if (norm.layout == EMBER_PS_DENSE) {
      /* written in row order: anything else is not our encoding */
      if (row != want_begin + i) {
        rc = ember__set_error(EMBER_ECORRUPT, "checkpoint of %s: row %llu where row %llu belongs",
                              t->where, (unsigned long long)row,
                              (unsigned long long)(want_begin + i));
        goto fail;
      }
      slot = (size_t)i;
    } else {
      if (check_row(t, row, (size_t)i, "checkpoint") != EMBER_OK) {
        rc = ember__set_error(EMBER_ECORRUPT, "checkpoint of %s", ember_last_error());
        goto fail;
      }
      if (map_find(t, row) != SIZE_MAX) {
        rc = ember__set_error(EMBER_ECORRUPT, "checkpoint of %s: row %llu appears twice",
                              t->where, (unsigned long long)row);
        goto fail;
      }
      slot = t->held++;
      t->ids[slot] = row;
      map_put(t->map, t->map_cap, row, slot);
    }
    t->steps[slot] = steps;
    float *v = t->vals + slot * stride;
    for (size_t k = 0; k < stride; k++) {
      uint32_t u = ember_wire_get_u32(fl + 4 * k);
      memcpy(&v[k], &u, sizeof u);
    }
  }
  *out = t;
  return EMBER_OK;
fail:
  ember__ps_table_destroy(t);
  return rc;
}
