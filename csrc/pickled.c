/* pickled.c - Spark's pickled batches of records, read without Python
 * (ember/pickled.h).
 *
 * A small pickle machine that knows only the values of the common form: it
 * keeps a stack and a memo of descriptions (an int, a string's place, an
 * array's place and shape), never objects, and refuses every opcode and
 * global outside the form.  What it accepts, Python's pickle would load as
 * the same values: a numpy dtype made by numpy.dtype(code, False, True) is
 * native (little-endian here), and the state a BUILD gives it is checked to
 * leave it so, which also makes the memo's copy taken before the BUILD
 * (numpy's pickle memoizes the dtype first) describe the same dtype.
 */
#include "ember/pickled.h"

#include <stdlib.h>
#include <string.h>

#include "ember/batch.h"
#include "ember/error.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "pickled.c reads numpy's native byte order as little-endian"
#endif

/* The highest memo index a pickle may use here (the pickler numbers its
 * objects from 0, so a frame of records stays far below). */
#define MAX_MEMO (1u << 24)

/* What a value on the machine's stack is. */
typedef enum {
  V_UNSET = 0, /* an empty memo slot */
  V_MARK,
  V_NONE,
  V_BOOL,
  V_INT,
  V_FLOAT,
  V_STR,   /* at, u.len: its UTF-8 bytes in the input */
  V_BYTES, /* at, u.len: bytes or bytearray, in the input */
  V_FROMBUFFER, /* the global numpy._core.numeric._frombuffer */
  V_DTYPE_CLASS, /* the global numpy.dtype */
  V_DTYPE, /* a dtype: dtype (EMBER_DT_*), n its itemsize */
  V_TUPLE, /* n items from items[at] */
  V_ARRAY, /* dtype, at its data in the input, n dims from items[u.first] */
  V_LIST,  /* the list of records */
} vkind;

typedef struct {
  uint8_t kind;
  uint8_t dtype;
  uint32_t n;
  uint64_t at;
  union {
    int64_t i;
    double f;
    uint64_t len;
    uint64_t first;
  } u;
} val;

typedef struct {
  val *v;
  size_t len, cap;
} vec;

struct ember_pickled {
  size_t count, width;
  int tuples;
  ember_pickled_field *fields;
  ember_pickled_value *values; /* count x width, a record's fields together */
};

typedef struct {
  const uint8_t *buf;
  size_t len, pos;
  vec stack, items, memo, records;
  size_t memo_count; /* slots of memo set: where MEMOIZE puts (pickle's len(memo)) */
  int have_list;
} machine;

static int refuse(const machine *m, const char *what) {
  return ember__set_error(EMBER_ESCHEMA, "pickled records: %s (at byte %zu)", what, m->pos);
}

static int vec_reserve(vec *v, size_t want) {
  if (want <= v->cap) return EMBER_OK;
  size_t cap = v->cap ? v->cap : 64;
  while (cap < want) {
    if (cap > SIZE_MAX / 2 / sizeof(val)) return ember__set_error(EMBER_ENOMEM, "pickled records: out of memory");
    cap *= 2;
  }
  val *nv = realloc(v->v, cap * sizeof(val));
  if (nv == NULL) return ember__set_error(EMBER_ENOMEM, "pickled records: out of memory");
  v->v = nv;
  v->cap = cap;
  return EMBER_OK;
}

static int vec_push(vec *v, val x) {
  int rc = vec_reserve(v, v->len + 1);
  if (rc == EMBER_OK) v->v[v->len++] = x;
  return rc;
}

/* ------------------------------------------------------------ reading the input */

static int need(const machine *m, size_t n) {
  return m->len - m->pos >= n ? EMBER_OK : refuse(m, "the input ends inside an opcode");
}

static uint64_t le(const uint8_t *p, size_t n) {
  uint64_t x = 0;
  for (size_t k = 0; k < n; k++) x |= (uint64_t)p[k] << (8 * k);
  return x;
}

/* An n-byte little-endian argument (n <= 8) into *x. */
static int arg(machine *m, size_t n, uint64_t *x) {
  int rc = need(m, n);
  if (rc) return rc;
  *x = le(m->buf + m->pos, n);
  m->pos += n;
  return EMBER_OK;
}

/* A string or bytes of the length an n-byte argument gives. */
static int sized(machine *m, size_t n, uint8_t kind) {
  uint64_t len;
  int rc = arg(m, n, &len);
  if (rc == EMBER_OK && len > m->len - m->pos) rc = refuse(m, "a string runs past the input");
  if (rc) return rc;
  val v = {.kind = kind, .at = m->pos, .u.len = len};
  m->pos += (size_t)len;
  return vec_push(&m->stack, v);
}

static int str_is(const machine *m, const val *v, const char *s) {
  size_t n = strlen(s);
  return v->kind == V_STR && v->u.len == n && memcmp(m->buf + v->at, s, n) == 0;
}

/* ------------------------------------------------------------ the stack */

/* Pops the top value (not a mark) into *out. */
static int pop(machine *m, val *out) {
  if (m->stack.len == 0 || m->stack.v[m->stack.len - 1].kind == V_MARK)
    return refuse(m, "an opcode pops an empty stack");
  *out = m->stack.v[--m->stack.len];
  return EMBER_OK;
}

/* The values above the last mark: they start at stack[*from], and the mark
 * goes once the caller has read them (m->stack.len = *from - 1). */
static int above_mark(machine *m, size_t *from) {
  for (size_t k = m->stack.len; k > 0; k--)
    if (m->stack.v[k - 1].kind == V_MARK) {
      *from = k;
      return EMBER_OK;
    }
  return refuse(m, "an opcode needs a mark and there is none");
}

/* A tuple of the n values at vs (copied to items), pushed. */
static int push_tuple(machine *m, const val *vs, size_t n) {
  if (n > UINT32_MAX) return refuse(m, "a tuple too long");
  int rc = vec_reserve(&m->items, m->items.len + n);
  if (rc) return rc;
  for (size_t k = 0; k < n; k++) {
    if (vs[k].kind == V_LIST) return refuse(m, "a record holds a list");
    m->items.v[m->items.len + k] = vs[k];
  }
  val t = {.kind = V_TUPLE, .n = (uint32_t)n, .at = m->items.len};
  m->items.len += n;
  return vec_push(&m->stack, t);
}

static int add_record(machine *m, const val *v) {
  switch (v->kind) {
  case V_TUPLE:
  case V_INT:
  case V_FLOAT:
  case V_BOOL:
  case V_ARRAY:
    return vec_push(&m->records, *v);
  default:
    return refuse(m, "a record is not a tuple, a number or a numpy array");
  }
}

/* The list the records are appended to: the value under what APPEND(S) adds. */
static int list_at(machine *m, size_t k) {
  return k < m->stack.len && m->stack.v[k].kind == V_LIST ? EMBER_OK
                                                           : refuse(m, "an append to something not the list");
}

/* memo[idx] = the top of the stack. */
static int memo_put(machine *m, uint64_t idx) {
  /* picklers number what they memoize 0, 1, 2...: an index past the next is
   * refused, so the memo stays within what the input's opcodes can fill */
  if (idx > m->memo.len || idx >= MAX_MEMO) return refuse(m, "a memo index out of sequence");
  if (m->stack.len == 0 || m->stack.v[m->stack.len - 1].kind == V_MARK)
    return refuse(m, "a memo put of nothing");
  int rc = vec_reserve(&m->memo, (size_t)idx + 1);
  if (rc) return rc;
  while (m->memo.len <= idx) m->memo.v[m->memo.len++] = (val){.kind = V_UNSET};
  if (m->memo.v[idx].kind == V_UNSET) m->memo_count++;
  m->memo.v[idx] = m->stack.v[m->stack.len - 1];
  return EMBER_OK;
}

/* ------------------------------------------------------------ numpy */

static const struct {
  const char *code;
  uint8_t dtype;
  uint8_t itemsize;
} dtypes[] = {
    {"f4", EMBER_DT_F32, 4}, {"f8", EMBER_DT_F64, 8}, {"i4", EMBER_DT_I32, 4},
    {"i8", EMBER_DT_I64, 8}, {"u1", EMBER_DT_U8, 1},  {"b1", EMBER_DT_BOOL, 1},
};

static int is_int(const val *v, int64_t x) { return v->kind == V_INT && v->u.i == x; }

/* numpy.dtype(code, align, copy) */
static int make_dtype(machine *m, const val *args) {
  if (args->n != 3) return refuse(m, "numpy.dtype with other arguments than (code, align, copy)");
  const val *a = &m->items.v[args->at];
  if (a[0].kind != V_STR || a[1].kind != V_BOOL || a[2].kind != V_BOOL)
    return refuse(m, "numpy.dtype with other arguments than (code, align, copy)");
  for (size_t k = 0; k < sizeof dtypes / sizeof dtypes[0]; k++)
    if (str_is(m, &a[0], dtypes[k].code)) {
      val d = {.kind = V_DTYPE, .dtype = dtypes[k].dtype, .n = dtypes[k].itemsize};
      return vec_push(&m->stack, d);
    }
  return refuse(m, "a numpy dtype other than float32, float64, int32, int64, uint8, bool");
}

/* A dtype's state (numpy's dtype.__setstate__, version 3): no fields, no
 * subarray, the native byte order ('|' for one-byte types). */
static int build_dtype(machine *m, const val *d, const val *state) {
  if (state->kind != V_TUPLE || state->n != 8)
    return refuse(m, "a numpy dtype's state other than a plain one's");
  const val *s = &m->items.v[state->at];
  if (!is_int(&s[0], 3) || s[1].kind != V_STR ||
      s[1].u.len != 1 || s[2].kind != V_NONE || s[3].kind != V_NONE || s[4].kind != V_NONE ||
      !is_int(&s[5], -1) || !is_int(&s[6], -1) || !is_int(&s[7], 0))
    return refuse(m, "a numpy dtype's state other than a plain one's");
  uint8_t order = m->buf[s[1].at];
  if (!(order == '<' || order == '=' || (order == '|' && d->n == 1)))
    return refuse(m, "a numpy dtype that is not little-endian");
  return EMBER_OK;
}

/* numpy._core.numeric._frombuffer(data, dtype, shape, 'C') */
static int make_array(machine *m, const val *args) {
  if (args->n != 4)
    return refuse(m, "a numpy array other than a C-ordered one of bytes, dtype and shape");
  const val *a = &m->items.v[args->at];
  if (a[0].kind != V_BYTES || a[1].kind != V_DTYPE || a[2].kind != V_TUPLE ||
      !str_is(m, &a[3], "C"))
    return refuse(m, "a numpy array other than a C-ordered one of bytes, dtype and shape");
  const val *shape = &a[2];
  if (shape->n < 1 || shape->n > EMBER_PICKLED_MAX_DIMS)
    return refuse(m, "a numpy array of 0 or too many dimensions");
  uint64_t bytes = a[1].n;
  for (uint32_t d = 0; d < shape->n; d++) {
    const val *dim = &m->items.v[shape->at + d];
    if (dim->kind != V_INT || dim->u.i < 0) return refuse(m, "a numpy array's shape is not of sizes");
    uint64_t x = (uint64_t)dim->u.i;
    if (x != 0 && bytes > UINT64_MAX / x) return refuse(m, "a numpy array's size overflows");
    bytes *= x;
  }
  if (bytes != a[0].u.len) return refuse(m, "a numpy array's data does not match its shape");
  val v = {.kind = V_ARRAY, .dtype = a[1].dtype, .n = shape->n, .at = a[0].at,
           .u.first = shape->at};
  return vec_push(&m->stack, v);
}

/* ------------------------------------------------------------ the machine */

/* Runs one opcode; 1 at STOP. */
static int step(machine *m) {
  int rc = need(m, 1);
  if (rc) return rc;
  uint8_t op = m->buf[m->pos++];
  uint64_t x;
  val v, w;
  size_t from = 0;
  switch (op) {
  case 0x80: /* PROTO */
    if ((rc = arg(m, 1, &x))) return rc;
    return x >= 2 && x <= 5 ? EMBER_OK : refuse(m, "a pickle protocol other than 2 to 5");
  case 0x95: /* FRAME: its bytes must be there, as pickle checks */
    if ((rc = arg(m, 8, &x))) return rc;
    return x <= m->len - m->pos ? EMBER_OK : refuse(m, "a frame runs past the input");
  case '.': /* STOP */
    if (m->stack.len != 1 || m->stack.v[0].kind != V_LIST) return refuse(m, "the pickle is not one list");
    return 1;
  case '(': /* MARK */
    return vec_push(&m->stack, (val){.kind = V_MARK});
  case ']': /* EMPTY_LIST */
    if (m->have_list) return refuse(m, "a second list");
    m->have_list = 1;
    return vec_push(&m->stack, (val){.kind = V_LIST});
  case 'a': /* APPEND */
    if ((rc = pop(m, &v)) || (rc = list_at(m, m->stack.len - 1))) return rc;
    return add_record(m, &v);
  case 'e': /* APPENDS */
    if ((rc = above_mark(m, &from)) || (rc = list_at(m, from - 2))) return rc;
    for (size_t k = from; k < m->stack.len; k++)
      if ((rc = add_record(m, &m->stack.v[k]))) return rc;
    m->stack.len = from - 1;
    return EMBER_OK;
  case ')': /* EMPTY_TUPLE */
    return push_tuple(m, NULL, 0);
  case 0x85: /* TUPLE1 */
  case 0x86: /* TUPLE2 */
  case 0x87: { /* TUPLE3 */
    size_t n = (size_t)(op - 0x84);
    if (m->stack.len < n) return refuse(m, "a tuple of more values than the stack holds");
    for (size_t k = m->stack.len - n; k < m->stack.len; k++)
      if (m->stack.v[k].kind == V_MARK) return refuse(m, "a tuple of a mark");
    m->stack.len -= n;
    return push_tuple(m, &m->stack.v[m->stack.len], n);
  }
  case 't': /* TUPLE */
    if ((rc = above_mark(m, &from))) return rc;
    {
      size_t n = m->stack.len - from;
      m->stack.len = from - 1;
      return push_tuple(m, &m->stack.v[from], n); /* still in the stack's memory */
    }
  case 'N': /* NONE */
    return vec_push(&m->stack, (val){.kind = V_NONE});
  case 0x88: /* NEWTRUE */
  case 0x89: /* NEWFALSE */
    return vec_push(&m->stack, (val){.kind = V_BOOL, .u.i = op == 0x88});
  case 'J': /* BININT */
    if ((rc = arg(m, 4, &x))) return rc;
    return vec_push(&m->stack, (val){.kind = V_INT, .u.i = (int32_t)(uint32_t)x});
  case 'K': /* BININT1 */
  case 'M': /* BININT2 */
    if ((rc = arg(m, op == 'K' ? 1 : 2, &x))) return rc;
    return vec_push(&m->stack, (val){.kind = V_INT, .u.i = (int64_t)x});
  case 0x8a: /* LONG1 */
    if ((rc = arg(m, 1, &x))) return rc;
    if (x > 8) return refuse(m, "an int beyond int64");
    {
      size_t n = (size_t)x;
      if ((rc = arg(m, n, &x))) return rc;
      if (n > 0 && n < 8 && (x >> (8 * n - 1)) & 1) x |= ~(uint64_t)0 << (8 * n); /* sign */
      return vec_push(&m->stack, (val){.kind = V_INT, .u.i = (int64_t)x});
    }
  case 'G': /* BINFLOAT: big-endian */
    if ((rc = need(m, 8))) return rc;
    x = 0;
    for (int k = 0; k < 8; k++) x = x << 8 | m->buf[m->pos + k];
    m->pos += 8;
    v = (val){.kind = V_FLOAT};
    memcpy(&v.u.f, &x, sizeof x);
    return vec_push(&m->stack, v);
  case 0x8c: /* SHORT_BINUNICODE */
    return sized(m, 1, V_STR);
  case 'X': /* BINUNICODE */
    return sized(m, 4, V_STR);
  case 'C': /* SHORT_BINBYTES */
    return sized(m, 1, V_BYTES);
  case 'B': /* BINBYTES */
    return sized(m, 4, V_BYTES);
  case 0x8e: /* BINBYTES8 */
  case 0x96: /* BYTEARRAY8 */
    return sized(m, 8, V_BYTES);
  case 0x94: /* MEMOIZE: at the count of memoized values, as pickle's memo */
    return memo_put(m, m->memo_count);
  case 'q': /* BINPUT */
  case 'r': /* LONG_BINPUT */
    if ((rc = arg(m, op == 'q' ? 1 : 4, &x))) return rc;
    return memo_put(m, x);
  case 'h': /* BINGET */
  case 'j': /* LONG_BINGET */
    if ((rc = arg(m, op == 'h' ? 1 : 4, &x))) return rc;
    if (x >= m->memo.len || m->memo.v[x].kind == V_UNSET) return refuse(m, "a memo index not set");
    return vec_push(&m->stack, m->memo.v[x]);
  case 0x93: /* STACK_GLOBAL */
    if ((rc = pop(m, &w)) || (rc = pop(m, &v))) return rc; /* v: module, w: name */
    if ((str_is(m, &v, "numpy._core.numeric") || str_is(m, &v, "numpy.core.numeric")) &&
        str_is(m, &w, "_frombuffer"))
      return vec_push(&m->stack, (val){.kind = V_FROMBUFFER});
    if (str_is(m, &v, "numpy") && str_is(m, &w, "dtype"))
      return vec_push(&m->stack, (val){.kind = V_DTYPE_CLASS});
    return refuse(m, "a global other than numpy's array and dtype");
  case 'R': /* REDUCE */
    if ((rc = pop(m, &w)) || (rc = pop(m, &v))) return rc; /* v(*w) */
    if (w.kind != V_TUPLE) return refuse(m, "REDUCE of arguments that are not a tuple");
    if (v.kind == V_DTYPE_CLASS) return make_dtype(m, &w);
    if (v.kind == V_FROMBUFFER) return make_array(m, &w);
    return refuse(m, "REDUCE of something not numpy's array or dtype");
  case 'b': /* BUILD */
    if ((rc = pop(m, &w))) return rc;
    if (m->stack.len == 0 || m->stack.v[m->stack.len - 1].kind != V_DTYPE)
      return refuse(m, "BUILD of something not a numpy dtype");
    return build_dtype(m, &m->stack.v[m->stack.len - 1], &w);
  default:
    return refuse(m, "an opcode outside the records' form");
  }
}

/* ------------------------------------------------------------ the records */

/* Describes the value of field j of the first record; 0 or a refusal. */
static int describe(machine *m, const val *v, ember_pickled_field *f) {
  memset(f, 0, sizeof *f);
  switch (v->kind) {
  case V_INT:
    f->kind = EMBER_PK_INT;
    return EMBER_OK;
  case V_FLOAT:
    f->kind = EMBER_PK_FLOAT;
    return EMBER_OK;
  case V_BOOL:
    f->kind = EMBER_PK_BOOL;
    return EMBER_OK;
  case V_ARRAY:
    f->kind = EMBER_PK_ARRAY;
    f->dtype = v->dtype;
    f->ndim = (uint8_t)v->n;
    f->row_bytes = 1;
    for (uint32_t d = 0; d < v->n; d++) {
      f->dims[d] = (uint64_t)m->items.v[v->u.first + d].u.i;
      f->row_bytes *= f->dims[d]; /* checked by make_array, with the itemsize */
    }
    for (size_t k = 0; k < sizeof dtypes / sizeof dtypes[0]; k++)
      if (dtypes[k].dtype == v->dtype) f->row_bytes *= dtypes[k].itemsize;
    return EMBER_OK;
  default:
    return refuse(m, "a field that is not a number or a numpy array");
  }
}

/* Whether v is of field f's kind (and dtype and shape); its value into *out. */
static int matches(const machine *m, const val *v, const ember_pickled_field *f,
                   ember_pickled_value *out) {
  switch (f->kind) {
  case EMBER_PK_INT:
  case EMBER_PK_BOOL:
    if (v->kind != (f->kind == EMBER_PK_INT ? V_INT : V_BOOL)) return 0;
    out->i = v->u.i;
    return 1;
  case EMBER_PK_FLOAT:
    if (v->kind != V_FLOAT) return 0;
    out->f = v->u.f;
    return 1;
  default:
    if (v->kind != V_ARRAY || v->dtype != f->dtype || v->n != f->ndim) return 0;
    for (uint32_t d = 0; d < v->n; d++)
      if ((uint64_t)m->items.v[v->u.first + d].u.i != f->dims[d]) return 0;
    out->at = v->at;
    return 1;
  }
}

static int collect(machine *m, ember_pickled *p) {
  if (m->records.len == 0) return refuse(m, "an empty list");
  const val *first = &m->records.v[0];
  p->count = m->records.len;
  p->tuples = first->kind == V_TUPLE;
  p->width = p->tuples ? first->n : 1;
  if (p->width == 0 || p->width > EMBER_PICKLED_MAX_FIELDS)
    return refuse(m, "records of no fields or too many");
  if (p->count > SIZE_MAX / sizeof(ember_pickled_value) / p->width)
    return ember__set_error(EMBER_ENOMEM, "pickled records: out of memory");
  p->fields = calloc(p->width, sizeof *p->fields);
  p->values = malloc(p->count * p->width * sizeof *p->values);
  if (p->fields == NULL || p->values == NULL)
    return ember__set_error(EMBER_ENOMEM, "pickled records: out of memory");
  const val *f0 = p->tuples ? &m->items.v[first->at] : first;
  for (size_t j = 0; j < p->width; j++) {
    int rc = describe(m, &f0[j], &p->fields[j]);
    if (rc) return rc;
  }
  for (size_t i = 0; i < p->count; i++) {
    const val *r = &m->records.v[i];
    if (p->tuples ? (r->kind != V_TUPLE || r->n != p->width) : r->kind == V_TUPLE)
      return refuse(m, "records of different forms");
    const val *fs = p->tuples ? &m->items.v[r->at] : r;
    for (size_t j = 0; j < p->width; j++)
      if (!matches(m, &fs[j], &p->fields[j], &p->values[i * p->width + j]))
        return refuse(m, "records whose fields differ in kind, dtype or shape");
  }
  return EMBER_OK;
}

int ember_pickled_scan(const uint8_t *buf, size_t len, ember_pickled **out) {
  *out = NULL;
  machine m = {.buf = buf, .len = buf ? len : 0};
  int rc;
  do {
    rc = step(&m);
  } while (rc == EMBER_OK);
  ember_pickled *p = NULL;
  if (rc == 1) {
    rc = m.pos == m.len ? EMBER_OK : refuse(&m, "bytes after the pickle's STOP");
    if (rc == EMBER_OK) {
      p = calloc(1, sizeof *p);
      rc = p == NULL ? ember__set_error(EMBER_ENOMEM, "pickled records: out of memory")
                     : collect(&m, p);
    }
  }
  free(m.stack.v);
  free(m.items.v);
  free(m.memo.v);
  free(m.records.v);
  if (rc != EMBER_OK) {
    ember_pickled_free(p);
    return rc;
  }
  *out = p;
  return EMBER_OK;
}

size_t ember_pickled_count(const ember_pickled *p) { return p->count; }
size_t ember_pickled_fields(const ember_pickled *p) { return p->width; }
int ember_pickled_tuples(const ember_pickled *p) { return p->tuples; }

const ember_pickled_field *ember_pickled_field_at(const ember_pickled *p, size_t j) {
  return &p->fields[j];
}

ember_pickled_value ember_pickled_value_at(const ember_pickled *p, size_t i, size_t j) {
  return p->values[i * p->width + j];
}

void ember_pickled_free(ember_pickled *p) {
  if (p == NULL) return;
  free(p->fields);
  free(p->values);
  free(p);
}
