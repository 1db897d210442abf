/* python/ember/_ember_records.c - records_to_columns(): a chunk of Spark RDD
 * records to feed columns in one C call.
 *
 * The fast path of ember._columns.records_to_columns.  A chunk of records
 * (tuples or pyspark Rows of numbers, str, bytes and numpy arrays; plain
 * numbers; vectors) is converted column by column, each value read once and
 * written straight into the column's buffer: a bytearray that the caller views
 * as a numpy array (np.frombuffer, no copy), or the bytes object of a
 * str/bytes column.
 *
 * Anything this file does not handle -- a type it does not know, values that
 * disagree with each other or with the partition's earlier chunks, a None, a
 * ragged array, an int beyond int64, a name too long -- makes it return None,
 * and the caller converts the chunk with the Python implementation, which
 * either handles the rare case or raises the EmberFeedError that names the
 * record, the column and both types or shapes.  So the wording of every feed
 * error has one source (_columns.py); this file raises only MemoryError, and
 * TypeError for arguments of the wrong type.  What it accepts, it converts
 * exactly as the Python path does: the same dtypes (numpy's promotion of
 * Python bool < int < float, int64 and float64 scalars), the same names,
 * byte-identical data.
 *
 * A conversion is planned, then written (embpy_records_plan, _write): the
 * plan reads the first value of each column (and the types or lengths of the
 * rest where the dtype or size depends on them) and fixes every column's
 * dtype and byte size, so the write can go straight into memory of exactly
 * that size -- bytearrays here, or a batch's place in a feed ring
 * (FeedClient.send_records, which saves the copy of the columns into the
 * ring).  The write pass checks every value against the plan again and
 * answers SLOW for one that disagrees.
 *
 * Thread-safety: runs with the GIL held and calls no Python-level code while
 * it reads the records (numpy's scalar and buffer slots are C), and it
 * allocates no object tracked by the cyclic GC between plan and write, so no
 * finalizer can change the records under it.  send_records releases the GIL
 * between them while it waits for room in the ring: records another thread
 * changes meanwhile meet the write pass's checks (sizes included), so they
 * are never read or written out of bounds.  Every access to a record is
 * bounds-checked.
 */
#include "_ember.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ember/pickled.h"
#include <structmember.h> /* T_OBJECT_EX, T_PYSSIZET, READONLY: Py_T_* are 3.12+ */

/* A converter's answer for "not on the fast path" (0: done; -1: exception). */
#define SLOW 1

/* A row shape of an array column: numpy allows 64 dimensions (NPY_MAXDIMS). */
#define MAX_DIMS 64

/* ------------------------------------------------------------ numpy's types */

/* The exact numpy types this file reads, in st->np_types in this order. */
enum { NP_NDARRAY, NP_BOOL, NP_INT32, NP_INT64, NP_UINT8, NP_FLOAT32, NP_FLOAT64, NP_NTYPES };
static const char *const np_type_names[NP_NTYPES] = {
    "ndarray", "bool_", "int32", "int64", "uint8", "float32", "float64",
};

/* st->np_types (borrowed), importing numpy on the first call.  NULL with an
 * exception when numpy cannot be imported. */
static PyObject *records_np_types(ember_state *st) {
  if (st->np_types != NULL) return st->np_types;
  PyObject *np = PyImport_ImportModule("numpy");
  if (np == NULL) return NULL;
  PyObject *types = PyTuple_New(NP_NTYPES);
  if (types == NULL) goto err;
  for (int i = 0; i < NP_NTYPES; i++) {
    PyObject *t = PyObject_GetAttrString(np, np_type_names[i]);
    if (t == NULL) goto err;
    PyTuple_SET_ITEM(types, i, t); /* steals t */
    if (!PyType_Check(t)) {
      PyErr_Format(PyExc_ImportError, "numpy.%s is not a type", np_type_names[i]);
      goto err;
    }
  }
  Py_DECREF(np);
  if (st->np_types == NULL) /* the import ran Python code: another call may have set it */
    st->np_types = types;
  else
    Py_DECREF(types);
  return st->np_types;
err:
  Py_XDECREF(types);
  Py_DECREF(np);
  return NULL;
}

/* ------------------------------------------------------------ values */

/* The classes of values the fast path reads; everything else is V_OTHER.
 * Exact types only: a subclass may change what numpy makes of it. */
typedef enum {
  V_OTHER,
  V_BOOL, /* Python bool, int and float */
  V_INT,
  V_FLOAT,
  V_NP_BOOL, /* numpy scalars numpy promotes with Python's as bool, int64, float64 */
  V_NP_I64,
  V_NP_F64,
  V_NP_I32, /* numpy scalars that keep their dtype: only in a column of their own type */
  V_NP_U8,
  V_NP_F32,
  V_STR,
  V_BYTES, /* bytes, bytearray, memoryview */
  V_NDARRAY,
  V_SEQ, /* list or tuple (of numbers: an array value) */
} vclass;

/* The feed's kind of a value (_columns._type_kind); the names are the ones the
 * Python path keeps in layout["refs"]. */
typedef enum { K_BOOL, K_INT, K_FLOAT, K_STR, K_BYTES, K_ARRAY, K_NKINDS } kind;
static const char *const kind_names[K_NKINDS] = {"bool", "int", "float", "str", "bytes", "array"};

static kind kind_of(vclass c) {
  switch (c) {
  case V_BOOL:
  case V_NP_BOOL:
    return K_BOOL;
  case V_INT:
  case V_NP_I64:
  case V_NP_I32:
  case V_NP_U8:
    return K_INT;
  case V_FLOAT:
  case V_NP_F64:
  case V_NP_F32:
    return K_FLOAT;
  case V_STR:
    return K_STR;
  case V_BYTES:
    return K_BYTES;
  case V_NDARRAY:
  case V_SEQ:
    return K_ARRAY;
  case V_OTHER:
    break;
  }
  return K_NKINDS;
}

/* Whether a value of kind k may join a column of kind ref (int and float mix). */
static int kind_agrees(kind ref, kind k) {
  if (k == ref) return 1;
  return (k == K_INT || k == K_FLOAT) && (ref == K_INT || ref == K_FLOAT);
}

/* A chunk of records being converted. */
typedef struct {
  PyObject *records; /* list (borrowed from the caller's arguments) */
  Py_ssize_t n;      /* records */
  Py_ssize_t width;  /* fields per record, or -1: each record is the one column's value */
  PyTypeObject *np[NP_NTYPES];
} chunk;

static vclass classify(const chunk *c, PyObject *v) {
  PyTypeObject *t = Py_TYPE(v);
  if (t == &PyFloat_Type) return V_FLOAT;
  if (t == &PyLong_Type) return V_INT;
  if (t == &PyBool_Type) return V_BOOL;
  if (t == &PyUnicode_Type) return V_STR;
  if (t == c->np[NP_NDARRAY]) return V_NDARRAY;
  if (t == &PyList_Type || t == &PyTuple_Type) return V_SEQ;
  if (t == &PyBytes_Type || t == &PyByteArray_Type || t == &PyMemoryView_Type) return V_BYTES;
  if (t == c->np[NP_FLOAT32]) return V_NP_F32;
  if (t == c->np[NP_FLOAT64]) return V_NP_F64;
  if (t == c->np[NP_INT64]) return V_NP_I64;
  if (t == c->np[NP_INT32]) return V_NP_I32;
  if (t == c->np[NP_BOOL]) return V_NP_BOOL;
  if (t == c->np[NP_UINT8]) return V_NP_U8;
  return V_OTHER;
}

/* Whether record i is a tuple or list of c->width fields.  A tuple subclass
 * (pyspark Row, namedtuple) counts as its tuple: Row's r[j] is the tuple's
 * item j; a list subclass goes to the Python path. */
static int record_has_fields(const chunk *c, Py_ssize_t i) {
  if (i >= PyList_GET_SIZE(c->records)) return 0;
  PyObject *r = PyList_GET_ITEM(c->records, i);
  if (PyTuple_Check(r)) return PyTuple_GET_SIZE(r) == c->width;
  if (PyList_CheckExact(r)) return PyList_GET_SIZE(r) == c->width;
  return 0;
}

/* Field j of record i (borrowed), or NULL (no exception) when the record has
 * not the chunk's fields. */
static PyObject *value_at(const chunk *c, Py_ssize_t i, Py_ssize_t j) {
  if (i >= PyList_GET_SIZE(c->records)) return NULL;
  PyObject *r = PyList_GET_ITEM(c->records, i);
  if (c->width < 0) return r;
  if (!record_has_fields(c, i) || j >= c->width) return NULL;
  return PyTuple_Check(r) ? PyTuple_GET_ITEM(r, j) : PyList_GET_ITEM(r, j);
}

/* a * b into *out; 0, or SLOW when it does not fit a Py_ssize_t. */
static int mul_size(Py_ssize_t a, Py_ssize_t b, Py_ssize_t *out) {
  if (a < 0 || b < 0 || (b != 0 && a > PY_SSIZE_T_MAX / b)) return SLOW;
  *out = a * b;
  return 0;
}

/* The raw bytes of a numpy scalar (its dtype's itemsize) into out; 0 or SLOW. */
static int np_scalar_bytes(PyObject *v, void *out, Py_ssize_t size) {
  Py_buffer b;
  if (PyObject_GetBuffer(v, &b, PyBUF_SIMPLE) < 0) {
    PyErr_Clear();
    return SLOW;
  }
  int rc = b.len == size ? 0 : SLOW;
  if (rc == 0) memcpy(out, b.buf, (size_t)size);
  PyBuffer_Release(&b);
  return rc;
}

/* ------------------------------------------------------------ columns */

/* A column's kind and row shape: the Python path's layout reference
 * (kind, shape), shape only for arrays. */
typedef struct {
  kind k;
  Py_ssize_t ndim;
  Py_ssize_t dims[MAX_DIMS];
} colref;

/* How a column is written, chosen by the plan. */
typedef enum {
  W_SCALARS,  /* numpy int32/uint8/float32 scalars, their own bytes */
  W_NUMBERS,  /* Python and numpy bool/int64/float64, one per record */
  W_BYTES,    /* str (UTF-8) or bytes values and n + 1 offsets */
  W_NDARRAYS, /* numpy arrays of one dtype and shape, a memcpy each */
  W_SEQS,     /* lists or tuples of Python numbers, all of one length */
  W_PICKLED,  /* a field of PickledRecords: its values where the pickle holds them */
} writer;

typedef struct {
  PyObject *field; /* the field name (strong) */
  PyObject *ref;   /* the partition's reference for it (strong), or NULL: a new one */
  PyObject *name;  /* the encoded column name (strong), once planned */
  colref want;     /* what ref says, or this chunk's first value */
  writer how;
  vclass c0;       /* the class of the chunk's first value */
  char dtype;      /* numpy type character of the data, 0 for a str/bytes column */
  char format;     /* W_NDARRAYS: the first array's buffer format character */
  Py_ssize_t item; /* bytes a value (W_SCALARS, W_NUMBERS, W_SEQS) or a row (W_NDARRAYS) */
  Py_ssize_t size; /* bytes of data */
  unsigned char *out; /* where the data goes */
  unsigned char *offs; /* where the n + 1 offsets go (W_BYTES) */
} column;

/* Reads a layout reference (kind, shape or None) kept by the Python path.
 * 0, or SLOW for anything else. */
static int parse_ref(PyObject *ref, colref *out) {
  if (!PyTuple_CheckExact(ref) || PyTuple_GET_SIZE(ref) != 2) return SLOW;
  PyObject *k = PyTuple_GET_ITEM(ref, 0), *shape = PyTuple_GET_ITEM(ref, 1);
  if (!PyUnicode_CheckExact(k)) return SLOW;
  out->k = K_NKINDS;
  for (int i = 0; i < K_NKINDS; i++)
    if (PyUnicode_CompareWithASCIIString(k, kind_names[i]) == 0) out->k = (kind)i;
  if (out->k == K_NKINDS) return SLOW;
  out->ndim = 0;
  if (out->k != K_ARRAY) return shape == Py_None ? 0 : SLOW;
  if (!PyTuple_CheckExact(shape) || PyTuple_GET_SIZE(shape) > MAX_DIMS) return SLOW;
  out->ndim = PyTuple_GET_SIZE(shape);
  for (Py_ssize_t d = 0; d < out->ndim; d++) {
    PyObject *dim = PyTuple_GET_ITEM(shape, d);
    if (!PyLong_CheckExact(dim)) return SLOW;
    out->dims[d] = PyLong_AsSsize_t(dim);
    if (out->dims[d] < 0) {
      PyErr_Clear();
      return SLOW;
    }
  }
  return 0;
}

/* The conversion is planned from the chunk's first value of each column
 * (and, where the dtype or size depends on all of them, a pass over their
 * types or lengths) before a byte is written, so the columns can be written
 * straight into memory of that exact size: a bytearray, or a batch's place in
 * a feed ring.  The write pass then checks every value against the plan and
 * answers SLOW for one that disagrees. */

/* --- numbers: one value per record, or the elements of list rows */

/* Numbers promote as numpy promotes a list of Python bool < int < float: the
 * dtype of a column of them, from their classes alone.  A class outside
 * bool/int/float is left for the write pass to refuse. */
enum { NUM_BOOL, NUM_INT, NUM_FLOAT };
static char numbers_dtype(int mode, Py_ssize_t count) {
  if (count == 0 || mode == NUM_FLOAT) return 'd'; /* numpy makes float64 of empty rows */
  return mode == NUM_INT ? 'l' : '?';
}

static int class_mode(vclass cl) {
  switch (cl) {
  case V_FLOAT:
  case V_NP_F64:
    return NUM_FLOAT;
  case V_INT:
  case V_NP_I64:
    return NUM_INT;
  default:
    return NUM_BOOL;
  }
}

/* Writes v of class cl (Python bool/int/float, numpy bool/int64/float64) as
 * the column's dtype into slot.  0, or SLOW for an int beyond int64 or a
 * class that does not fit the dtype. */
static int number_put(char dtype, PyObject *v, vclass cl, unsigned char *slot) {
  int64_t iv;
  switch (cl) {
  case V_BOOL:
    iv = v == Py_True;
    break;
  case V_NP_BOOL: {
    int t = PyObject_IsTrue(v);
    if (t < 0) {
      PyErr_Clear();
      return SLOW;
    }
    iv = t;
    break;
  }
  case V_INT:
  case V_NP_I64: { /* numpy's int64 converts through __index__ */
    if (dtype == '?') return SLOW;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return SLOW; /* numpy makes uint64 or object of it: the Python path decides */
    }
    iv = (int64_t)x;
    break;
  }
  case V_FLOAT:
  case V_NP_F64: { /* numpy's float64 is a float subclass */
    if (dtype != 'd') return SLOW;
    double d = PyFloat_AS_DOUBLE(v);
    memcpy(slot, &d, 8);
    return 0;
  }
  default:
    return SLOW;
  }
  if (dtype == '?') {
    *slot = iv != 0;
  } else if (dtype == 'd') {
    double d = (double)iv; /* round to nearest, as numpy's int -> float */
    memcpy(slot, &d, 8);
  } else {
    memcpy(slot, &iv, 8);
  }
  return 0;
}

/* A column of numbers: Python and numpy bool/int64/float64 promoted as numpy
 * does, or numpy int32/uint8/float32 scalars all of one type. */
static int numbers_plan(const chunk *c, Py_ssize_t j, column *col) {
  vclass c0 = col->c0;
  if (c0 == V_NP_I32 || c0 == V_NP_U8 || c0 == V_NP_F32) {
    if (!kind_agrees(col->want.k, kind_of(c0))) return SLOW;
    col->how = W_SCALARS;
    col->item = c0 == V_NP_U8 ? 1 : 4;
    col->dtype = c0 == V_NP_I32 ? 'i' : c0 == V_NP_U8 ? 'B' : 'f';
    return mul_size(c->n, col->item, &col->size);
  }
  int mode = NUM_BOOL;
  if (col->want.k != K_BOOL) { /* a bool column takes only bools */
    mode = NUM_INT;
    for (Py_ssize_t i = 0; i < c->n && mode != NUM_FLOAT; i++) {
      PyObject *v = value_at(c, i, j);
      if (v == NULL) return SLOW;
      if (class_mode(classify(c, v)) == NUM_FLOAT) mode = NUM_FLOAT;
    }
  }
  col->how = W_NUMBERS;
  col->dtype = numbers_dtype(mode, c->n);
  col->item = col->dtype == '?' ? 1 : 8;
  return mul_size(c->n, col->item, &col->size);
}

static int numbers_write(const chunk *c, Py_ssize_t j, column *col) {
  int bools = col->want.k == K_BOOL;
  for (Py_ssize_t i = 0; i < c->n; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL) return SLOW;
    vclass cl = classify(c, v);
    if (col->how == W_SCALARS) {
      if (cl != col->c0 || np_scalar_bytes(v, col->out + col->item * i, col->item)) return SLOW;
      continue;
    }
    int ok = bools ? (cl == V_BOOL || cl == V_NP_BOOL)
                   : (cl == V_INT || cl == V_FLOAT || cl == V_NP_I64 || cl == V_NP_F64);
    if (!ok || number_put(col->dtype, v, cl, col->out + col->item * i)) return SLOW;
  }
  return 0;
}

/* --- str and bytes */

/* The bytes the Python path feeds for v: v.encode() (UTF-8) or bytes(v).
 * view is filled (to release) for a memoryview only.  0 or SLOW. */
static int bytes_of(PyObject *v, vclass cl, Py_buffer *view, const char **p, Py_ssize_t *len) {
  view->obj = NULL;
  if (cl == V_STR) {
    *p = PyUnicode_AsUTF8AndSize(v, len); /* fails on lone surrogates, as encode() */
    if (*p == NULL) {
      PyErr_Clear();
      return SLOW;
    }
    return 0;
  }
  if (PyBytes_CheckExact(v)) {
    *p = PyBytes_AS_STRING(v);
    *len = PyBytes_GET_SIZE(v);
    return 0;
  }
  if (PyByteArray_CheckExact(v)) {
    *p = PyByteArray_AS_STRING(v);
    *len = PyByteArray_GET_SIZE(v);
    return 0;
  }
  /* a memoryview: bytes() of a C-contiguous one is its buffer; others go slow */
  if (PyObject_GetBuffer(v, view, PyBUF_SIMPLE) < 0) {
    PyErr_Clear();
    view->obj = NULL;
    return SLOW;
  }
  *p = view->buf;
  *len = view->len;
  return 0;
}

/* A str or bytes column: the values joined and n + 1 uint64 offsets.  The
 * plan adds up the lengths; the write copies. */
static int bytes_plan(const chunk *c, Py_ssize_t j, column *col) {
  vclass want = col->want.k == K_STR ? V_STR : V_BYTES;
  Py_ssize_t total = 0, osize;
  Py_buffer view;
  const char *p;
  Py_ssize_t len;
  for (Py_ssize_t i = 0; i < c->n; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL || classify(c, v) != want || bytes_of(v, want, &view, &p, &len)) return SLOW;
    if (view.obj) PyBuffer_Release(&view);
    if (len > PY_SSIZE_T_MAX - total) return SLOW;
    total += len;
  }
  col->how = W_BYTES;
  col->dtype = 0;
  col->size = total;
  return mul_size(c->n + 1, 8, &osize);
}

static int bytes_write(const chunk *c, Py_ssize_t j, column *col) {
  vclass want = col->want.k == K_STR ? V_STR : V_BYTES;
  Py_buffer view;
  const char *p;
  Py_ssize_t len;
  uint64_t at = 0;
  memcpy(col->offs, &at, 8);
  for (Py_ssize_t i = 0; i < c->n; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL || classify(c, v) != want || bytes_of(v, want, &view, &p, &len)) return SLOW;
    int fits = len <= col->size - (Py_ssize_t)at; /* the plan's sizes still hold */
    if (fits) memcpy(col->out + at, p, (size_t)len);
    if (view.obj) PyBuffer_Release(&view);
    if (!fits) return SLOW;
    at += (uint64_t)len;
    memcpy(col->offs + 8 * (i + 1), &at, 8);
  }
  return (Py_ssize_t)at == col->size ? 0 : SLOW;
}

/* --- arrays */

/* The numpy type character of an array's buffer format, or 0 for a dtype the
 * fast path does not copy as is (the Python path converts or rejects it). */
static char array_dtype(const Py_buffer *b) {
  const char *f = b->format;
  if (f == NULL || f[0] == '\0' || f[1] != '\0') return 0;
  switch (f[0]) {
  case 'f':
    return b->itemsize == 4 ? 'f' : 0;
  case 'd':
    return b->itemsize == 8 ? 'd' : 0;
  case 'i':
    return b->itemsize == 4 ? 'i' : 0;
  case 'l':
  case 'q': /* numpy's longlong: the same int64 */
    return b->itemsize == 8 ? 'l' : 0;
  case 'B':
    return b->itemsize == 1 ? 'B' : 0;
  case '?':
    return b->itemsize == 1 ? '?' : 0;
  default:
    return 0;
  }
}

/* An array column of numpy arrays: all of one dtype and shape, C-contiguous;
 * one memcpy a record (np.stack).  Planned from the first array. */
static int ndarray_plan(const chunk *c, Py_ssize_t j, column *col) {
  PyObject *v = value_at(c, 0, j);
  Py_buffer b;
  if (PyObject_GetBuffer(v, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    PyErr_Clear(); /* not C-contiguous, or no buffer (object arrays) */
    return SLOW;
  }
  int rc = 0;
  col->format = b.format ? b.format[0] : 0;
  col->dtype = array_dtype(&b);
  if (col->dtype == 0 || b.ndim < 1 || b.ndim > MAX_DIMS) {
    rc = SLOW;
  } else if (col->ref != NULL) { /* the partition's earlier chunks set the shape */
    rc = col->want.ndim == b.ndim ? 0 : SLOW;
    for (int d = 0; rc == 0 && d < b.ndim; d++)
      if (col->want.dims[d] != b.shape[d]) rc = SLOW;
  } else {
    col->want.ndim = b.ndim;
    for (int d = 0; d < b.ndim; d++) col->want.dims[d] = b.shape[d];
  }
  col->item = b.itemsize;
  for (int d = 0; rc == 0 && d < b.ndim; d++) rc = mul_size(col->item, b.shape[d], &col->item);
  if (rc == 0) rc = mul_size(c->n, col->item, &col->size);
  PyBuffer_Release(&b);
  col->how = W_NDARRAYS;
  return rc;
}

static int ndarray_write(const chunk *c, Py_ssize_t j, column *col) {
  Py_ssize_t row = col->item;
  for (Py_ssize_t i = 0; i < c->n; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL || Py_TYPE(v) != c->np[NP_NDARRAY]) return SLOW;
    Py_buffer b;
    if (PyObject_GetBuffer(v, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
      PyErr_Clear();
      return SLOW;
    }
    int rc = b.format != NULL && b.format[0] == col->format && b.format[1] == '\0' &&
                     b.ndim == col->want.ndim && b.len == row
                 ? 0
                 : SLOW;
    for (int d = 0; rc == 0 && d < b.ndim; d++)
      if (b.shape[d] != col->want.dims[d]) rc = SLOW;
    if (rc == 0) memcpy(col->out + row * i, b.buf, (size_t)row);
    PyBuffer_Release(&b);
    if (rc) return rc;
  }
  return 0;
}

/* An array column of lists (or tuples) of Python numbers, all of one length:
 * rows of np.asarray(values), promoted over the whole chunk. */
static int seq_plan(const chunk *c, Py_ssize_t j, column *col) {
  PyObject *v0 = value_at(c, 0, j);
  Py_ssize_t width = PySequence_Fast_GET_SIZE(v0), count;
  if (col->ref != NULL) {
    if (col->want.ndim != 1 || col->want.dims[0] != width) return SLOW;
  } else {
    col->want.ndim = 1;
    col->want.dims[0] = width;
  }
  if (mul_size(c->n, width, &count)) return SLOW;
  int mode = NUM_BOOL;
  for (Py_ssize_t i = 0; i < c->n && mode != NUM_FLOAT; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL || classify(c, v) != V_SEQ || PySequence_Fast_GET_SIZE(v) != width) return SLOW;
    PyObject **items = PySequence_Fast_ITEMS(v);
    for (Py_ssize_t k = 0; k < width && mode != NUM_FLOAT; k++) {
      vclass cl = classify(c, items[k]);
      if (cl != V_BOOL && cl != V_INT && cl != V_FLOAT)
        return SLOW; /* numpy scalars, nested lists, None...: the Python path */
      if (class_mode(cl) > mode) mode = class_mode(cl);
    }
  }
  col->how = W_SEQS;
  col->dtype = numbers_dtype(mode, count);
  col->item = col->dtype == '?' ? 1 : 8;
  return mul_size(count, col->item, &col->size);
}

static int seq_write(const chunk *c, Py_ssize_t j, column *col) {
  Py_ssize_t width = col->want.dims[0], at = 0;
  for (Py_ssize_t i = 0; i < c->n; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL || classify(c, v) != V_SEQ || PySequence_Fast_GET_SIZE(v) != width) return SLOW;
    PyObject **items = PySequence_Fast_ITEMS(v);
    for (Py_ssize_t k = 0; k < width; k++, at++) {
      vclass cl = classify(c, items[k]);
      if ((cl != V_BOOL && cl != V_INT && cl != V_FLOAT) ||
          number_put(col->dtype, items[k], cl, col->out + col->item * at))
        return SLOW;
    }
  }
  return 0;
}

/* ------------------------------------------------------------ results */

/* _columns._encode_name: field, "|28x28" for a row shape of more than one
 * dimension, ":str" for text.  NULL with an exception, or NULL and *slow set
 * when the name is over 255 bytes or not UTF-8 (the Python path raises). */
static PyObject *column_name(const column *col, int *slow) {
  PyObject *name;
  if (col->want.k == K_ARRAY && col->want.ndim > 1) {
    char dims[MAX_DIMS * 21 + 2];
    size_t at = 0;
    for (Py_ssize_t d = 0; d < col->want.ndim; d++)
      at += (size_t)snprintf(dims + at, sizeof dims - at, "%s%zd", d ? "x" : "|",
                             col->want.dims[d]);
    name = PyUnicode_FromFormat("%U%s", col->field, dims);
  } else if (col->want.k == K_STR) {
    name = PyUnicode_FromFormat("%U:str", col->field);
  } else {
    name = Py_NewRef(col->field);
  }
  if (name == NULL) return NULL;
  Py_ssize_t len;
  if (PyUnicode_AsUTF8AndSize(name, &len) == NULL || len > 255) {
    PyErr_Clear();
    Py_DECREF(name);
    *slow = 1;
    return NULL;
  }
  return name;
}

/* Plans column j (whose field, ref and want are set).  0, SLOW, or -1 with
 * an exception. */
static int plan_column(const chunk *c, Py_ssize_t j, column *col) {
  PyObject *v0 = value_at(c, 0, j);
  if (v0 == NULL) return SLOW;
  vclass c0 = classify(c, v0);
  if (c0 == V_OTHER) return SLOW;
  col->c0 = c0;
  if (col->ref == NULL) {
    col->want.k = kind_of(c0);
    col->want.ndim = 0;
  } else if (!kind_agrees(col->want.k, kind_of(c0))) {
    return SLOW;
  }
  int rc = SLOW;
  switch (col->want.k) {
  case K_BOOL:
  case K_INT:
  case K_FLOAT:
    rc = numbers_plan(c, j, col);
    break;
  case K_STR:
  case K_BYTES:
    rc = bytes_plan(c, j, col);
    break;
  case K_ARRAY:
    rc = c0 == V_NDARRAY ? ndarray_plan(c, j, col) : c0 == V_SEQ ? seq_plan(c, j, col) : SLOW;
    break;
  case K_NKINDS:
    break;
  }
  if (rc) return rc;
  int slow = 0;
  col->name = column_name(col, &slow);
  return col->name != NULL ? 0 : slow ? SLOW : -1;
}

static int write_column(const chunk *c, Py_ssize_t j, column *col) {
  switch (col->how) {
  case W_SCALARS:
  case W_NUMBERS:
    return numbers_write(c, j, col);
  case W_BYTES:
    return bytes_write(c, j, col);
  case W_NDARRAYS:
    return ndarray_write(c, j, col);
  case W_SEQS:
    return seq_write(c, j, col);
  case W_PICKLED: /* embpy_records_write writes these */
    break;
  }
  return SLOW;
}

/* (n,) + the row shape, or the row shape alone (a reference) when n < 0. */
static PyObject *shape_tuple(Py_ssize_t n, const colref *want) {
  Py_ssize_t lead = n >= 0, ndim = want->k == K_ARRAY ? want->ndim : 0;
  PyObject *t = PyTuple_New(lead + ndim);
  if (t == NULL) return NULL;
  for (Py_ssize_t d = 0; d < lead + ndim; d++) {
    PyObject *dim = PyLong_FromSsize_t(d < lead ? n : want->dims[d - lead]);
    if (dim == NULL) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SET_ITEM(t, d, dim);
  }
  return t;
}

/* Elements a row of the column: the product of its row shape (1 for scalars;
 * it divides the column's byte size, so it fits). */
static Py_ssize_t row_width(const column *col) {
  Py_ssize_t width = 1;
  if (col->want.k == K_ARRAY)
    for (Py_ssize_t d = 0; d < col->want.ndim; d++) width *= col->want.dims[d];
  return width;
}

/* The reference the Python path keeps for the next chunk: the partition's,
 * or (kind, row shape or None) of this chunk's first value. */
static PyObject *column_ref(const column *col) {
  if (col->ref != NULL) return Py_NewRef(col->ref);
  if (col->want.k != K_ARRAY) return Py_BuildValue("(sO)", kind_names[col->want.k], Py_None);
  PyObject *shape = shape_tuple(-1, &col->want);
  if (shape == NULL) return NULL;
  return Py_BuildValue("(sN)", kind_names[K_ARRAY], shape);
}


/* ------------------------------------------------------------ PickledRecords */

/* Records start..stop of a pickled batch (Spark's frame: bytes), scanned by
 * ember/pickled.h.  A slice shares its owner's scan and keeps the owner. */
typedef struct {
  PyObject_HEAD
  PyObject *frame;    /* bytes (strong) */
  PyObject *owner;    /* the PickledRecords whose scan this is (strong), NULL: this one's */
  ember_pickled *scan;
  Py_ssize_t start, stop;
} PickledRecordsObject;

static void PickledRecords_dealloc(PyObject *op) {
  PickledRecordsObject *self = (PickledRecordsObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  if (self->owner == NULL) ember_pickled_free(self->scan);
  Py_XDECREF(self->owner);
  Py_XDECREF(self->frame);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static Py_ssize_t PickledRecords_len(PyObject *op) {
  PickledRecordsObject *self = (PickledRecordsObject *)op;
  return self->stop - self->start;
}

static PyObject *pickled_new(PyTypeObject *tp, PyObject *frame, PyObject *owner,
                             ember_pickled *scan, Py_ssize_t start, Py_ssize_t stop) {
  PickledRecordsObject *r = PyObject_New(PickledRecordsObject, tp);
  if (r == NULL) return NULL;
  r->frame = Py_NewRef(frame);
  r->owner = Py_XNewRef(owner);
  r->scan = scan;
  r->start = start;
  r->stop = stop;
  return (PyObject *)r;
}

PyDoc_STRVAR(PickledRecords_slice_doc,
             "slice(start, stop) -> PickledRecords\\n\\n"
             "Records start..stop of these (clamped, as a list's slice), sharing the scan.");

static PyObject *PickledRecords_slice(PyObject *op, PyObject *args) {
  PickledRecordsObject *self = (PickledRecordsObject *)op;
  Py_ssize_t start, stop, n = self->stop - self->start;
  if (!PyArg_ParseTuple(args, "nn:slice", &start, &stop)) return NULL;
  start = start < 0 ? 0 : start > n ? n : start;
  stop = stop < start ? start : stop > n ? n : stop;
  PyObject *owner = self->owner ? self->owner : op;
  return pickled_new(Py_TYPE(op), self->frame, owner, self->scan, self->start + start,
                     self->start + stop);
}

static PyObject *PickledRecords_get_fields(PyObject *op, void *closure) {
  (void)closure;
  PickledRecordsObject *self = (PickledRecordsObject *)op;
  if (!ember_pickled_tuples(self->scan)) Py_RETURN_NONE;
  return PyLong_FromSize_t(ember_pickled_fields(self->scan));
}

static PyMemberDef PickledRecords_members[] = {
    {"frame", T_OBJECT_EX, offsetof(PickledRecordsObject, frame), READONLY,
     "the pickled batch (bytes)"},
    {"start", T_PYSSIZET, offsetof(PickledRecordsObject, start), READONLY,
     "the first record's index in the batch"},
    {"stop", T_PYSSIZET, offsetof(PickledRecordsObject, stop), READONLY,
     "the index after the last record"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef PickledRecords_getset[] = {
    {"fields", PickledRecords_get_fields, NULL,
     "fields per record when the records are tuples, None when each is a bare value", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef PickledRecords_methods[] = {
    {"slice", PickledRecords_slice, METH_VARARGS, PickledRecords_slice_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(PickledRecords_doc,
             "Records of a pickled batch that scan_pickled() read where they lie in\\n"
             "the pickle: FeedClient.send_records and records_to_columns take them\\n"
             "as they take a list of those records, without unpickling them.\\n"
             "pickle.loads(r.frame)[r.start:r.stop] are the records.  Not\\n"
             "constructible from Python.");

static PyType_Slot PickledRecords_slots[] = {
    {Py_tp_doc, (void *)PickledRecords_doc},
    {Py_tp_dealloc, PickledRecords_dealloc},
    {Py_tp_members, PickledRecords_members},
    {Py_tp_getset, PickledRecords_getset},
    {Py_tp_methods, PickledRecords_methods},
    {Py_sq_length, PickledRecords_len},
    {0, NULL},
};

static PyType_Spec PickledRecords_spec = {
    .name = "ember._ember.PickledRecords",
    .basicsize = sizeof(PickledRecordsObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = PickledRecords_slots,
};

/* The numpy type character of a field's data (the Python path's dtype). */
static char pickled_dtype(const ember_pickled_field *f) {
  switch (f->kind) {
  case EMBER_PK_INT: return 'l';
  case EMBER_PK_FLOAT: return 'd';
  case EMBER_PK_BOOL: return '?';
  default: break;
  }
  switch (f->dtype) {
  case EMBER_DT_F32: return 'f';
  case EMBER_DT_F64: return 'd';
  case EMBER_DT_I32: return 'i';
  case EMBER_DT_I64: return 'l';
  case EMBER_DT_U8: return 'B';
  case EMBER_DT_BOOL: return '?';
  default: return 0;
  }
}

/* Whether two fields are alike: kind, dtype and shape. */
static int fields_alike(const ember_pickled_field *a, const ember_pickled_field *b) {
  if (a->kind != b->kind || a->dtype != b->dtype || a->ndim != b->ndim) return 0;
  for (uint8_t d = 0; d < a->ndim; d++)
    if (a->dims[d] != b->dims[d]) return 0;
  return 1;
}

/* Plans column j of pickled records from field f (alike in every part:
 * pickled_plan checked), so only the partition's earlier chunks can
 * disagree. */
static int pickled_plan_column(const ember_pickled_field *f, Py_ssize_t n, column *col) {
  kind k = f->kind == EMBER_PK_ARRAY ? K_ARRAY
           : f->kind == EMBER_PK_INT ? K_INT
           : f->kind == EMBER_PK_FLOAT ? K_FLOAT
                                       : K_BOOL;
  if (col->ref != NULL) {
    if (col->want.k != k) return SLOW; /* int and float mixed: the Python path promotes */
    if (k == K_ARRAY) {
      if (col->want.ndim != f->ndim) return SLOW;
      for (Py_ssize_t d = 0; d < f->ndim; d++)
        if ((uint64_t)col->want.dims[d] != f->dims[d]) return SLOW;
    }
  } else {
    col->want.k = k;
    col->want.ndim = k == K_ARRAY ? f->ndim : 0;
    for (Py_ssize_t d = 0; d < col->want.ndim; d++) {
      if (f->dims[d] > (uint64_t)PY_SSIZE_T_MAX) return SLOW;
      col->want.dims[d] = (Py_ssize_t)f->dims[d];
    }
  }
  col->how = W_PICKLED;
  col->dtype = pickled_dtype(f);
  if (k == K_ARRAY && f->row_bytes > (uint64_t)PY_SSIZE_T_MAX) return SLOW;
  col->item = k == K_ARRAY ? (Py_ssize_t)f->row_bytes : k == K_BOOL ? 1 : 8;
  if (col->dtype == 0 || mul_size(n, col->item, &col->size)) return SLOW;
  int slow = 0;
  col->name = column_name(col, &slow);
  return col->name != NULL ? 0 : slow ? SLOW : -1;
}

/* Writes column j of the records of parts, one after the other. */
static void pickled_write(PyObject *const *parts, Py_ssize_t nparts, Py_ssize_t j, column *col) {
  unsigned char *out = col->out;
  for (Py_ssize_t k = 0; k < nparts; k++) {
    const PickledRecordsObject *pr = (const PickledRecordsObject *)parts[k];
    const unsigned char *frame = (const unsigned char *)PyBytes_AS_STRING(pr->frame);
    const ember_pickled_field *f = ember_pickled_field_at(pr->scan, (size_t)j);
    for (Py_ssize_t i = pr->start; i < pr->stop; i++, out += col->item) {
      ember_pickled_value v = ember_pickled_value_at(pr->scan, (size_t)i, (size_t)j);
      if (f->kind == EMBER_PK_ARRAY) {
        memcpy(out, frame + v.at, (size_t)col->item);
      } else if (f->kind == EMBER_PK_FLOAT) {
        memcpy(out, &v.f, 8);
      } else if (f->kind == EMBER_PK_INT) {
        memcpy(out, &v.i, 8);
      } else {
        *out = (unsigned char)(v.i != 0);
      }
    }
  }
}

/* ------------------------------------------------------------ plans */

struct embpy_records {
  chunk c;
  PyObject *const *parts; /* the records when they are pickled: PickledRecords (borrowed) */
  Py_ssize_t nparts;
  PyObject *one; /* parts of one PickledRecords point here (borrowed) */
  Py_ssize_t ncols;
  column *cols;
};

void embpy_records_free(embpy_records *r) {
  if (r == NULL) return;
  for (Py_ssize_t j = 0; j < r->ncols; j++) {
    Py_XDECREF(r->cols[j].field);
    Py_XDECREF(r->cols[j].ref);
    Py_XDECREF(r->cols[j].name);
  }
  PyMem_Free(r->cols);
  PyMem_Free(r);
}

/* Sets column j's field (its name in fields, "" for bare values) and the
 * partition's reference for it (refs[j], if any).  0, SLOW, or -1 with an
 * exception. */
static int column_begin(column *col, PyObject *fields, PyObject *refs, Py_ssize_t j) {
  col->field = fields == Py_None ? PyUnicode_FromStringAndSize("", 0)
                                 : Py_NewRef(PyList_GET_ITEM(fields, j));
  if (col->field == NULL) return -1;
  if (!PyUnicode_CheckExact(col->field)) return SLOW;
  PyObject *ref = refs == Py_None ? Py_None : PyList_GET_ITEM(refs, j);
  if (ref == Py_None) return 0;
  int rc = parse_ref(ref, &col->want);
  if (rc == 0) col->ref = Py_NewRef(ref);
  return rc;
}

/* embpy_records_plan of pickled records: parts, PickledRecords whose fields
 * are alike; fields, a list of one name per field of tuples (None for bare
 * values).  SLOW for anything else. */
static int pickled_plan(PyObject *const *parts, Py_ssize_t nparts, PyObject *fields,
                        PyObject *refs, embpy_records **out) {
  if (nparts == 0) return SLOW;
  const ember_pickled *first = ((const PickledRecordsObject *)parts[0])->scan;
  Py_ssize_t ncols = (Py_ssize_t)ember_pickled_fields(first), n = 0;
  int tuples = ember_pickled_tuples(first);
  for (Py_ssize_t k = 0; k < nparts; k++) {
    const PickledRecordsObject *pr = (const PickledRecordsObject *)parts[k];
    if (ember_pickled_tuples(pr->scan) != tuples ||
        (Py_ssize_t)ember_pickled_fields(pr->scan) != ncols)
      return SLOW;
    for (Py_ssize_t j = 0; k > 0 && j < ncols; j++)
      if (!fields_alike(ember_pickled_field_at(pr->scan, (size_t)j),
                        ember_pickled_field_at(first, (size_t)j)))
        return SLOW;
    n += pr->stop - pr->start; /* each within a scan of at most PY_SSIZE_T_MAX */
    if (n > UINT32_MAX) return SLOW;
  }
  if (n == 0 || ncols > EMBER_BATCH_MAX_COLS) return SLOW;
  if (tuples ? !(PyList_Check(fields) && PyList_GET_SIZE(fields) == ncols) : fields != Py_None)
    return SLOW;
  if (refs != Py_None && PyList_GET_SIZE(refs) != ncols) return SLOW;
  embpy_records *r = PyMem_Calloc(1, sizeof *r);
  column *cols = PyMem_Calloc((size_t)ncols, sizeof(column));
  if (r == NULL || cols == NULL) {
    PyMem_Free(r);
    PyMem_Free(cols);
    PyErr_NoMemory();
    return -1;
  }
  r->c.n = n;
  r->c.width = tuples ? ncols : -1;
  r->one = parts[0];
  r->parts = nparts == 1 ? &r->one : parts; /* a tuple's items stay where they are */
  r->nparts = nparts;
  r->cols = cols;
  r->ncols = ncols;
  for (Py_ssize_t j = 0; j < ncols; j++) {
    column *col = &cols[j];
    int rc = column_begin(col, fields, refs, j);
    if (rc == 0) rc = pickled_plan_column(ember_pickled_field_at(first, (size_t)j), n, col);
    if (rc) {
      embpy_records_free(r);
      return rc;
    }
  }
  *out = r;
  return 0;
}

/* Whether records are pickled: PickledRecords, or a tuple of them (the
 * parts of one chunk); *parts and *nparts then say which (*parts points to
 * *records for one PickledRecords: pickled_plan keeps no pointer to it). */
static int is_pickled(ember_state *st, PyObject *const *records, PyObject *const **parts,
                      Py_ssize_t *nparts) {
  PyTypeObject *tp = st != NULL ? st->PickledRecords_Type : NULL;
  if (tp == NULL) return 0;
  if (Py_IS_TYPE(*records, tp)) {
    *parts = records;
    *nparts = 1;
    return 1;
  }
  if (!PyTuple_CheckExact(*records) || PyTuple_GET_SIZE(*records) == 0) return 0;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(*records); k++)
    if (!Py_IS_TYPE(PyTuple_GET_ITEM(*records, k), tp)) return 0;
  *parts = &PyTuple_GET_ITEM(*records, 0);
  *nparts = PyTuple_GET_SIZE(*records);
  return 1;
}

int embpy_records_plan(ember_state *st, PyObject *records, PyObject *fields, PyObject *refs,
                       embpy_records **out) {
  *out = NULL;
  PyObject *const *parts;
  Py_ssize_t nparts;
  if (is_pickled(st, &records, &parts, &nparts)) {
    if ((fields != Py_None && !PyList_Check(fields)) || (refs != Py_None && !PyList_Check(refs))) {
      PyErr_SetString(PyExc_TypeError, "records_to_columns: fields and refs are lists or None");
      return -1;
    }
    return pickled_plan(parts, nparts, fields, refs, out);
  }
  if (!PyList_Check(records) || (fields != Py_None && !PyList_Check(fields)) ||
      (refs != Py_None && !PyList_Check(refs))) {
    PyErr_SetString(PyExc_TypeError,
                    "records_to_columns: records is a list, fields and refs are lists or None");
    return -1;
  }
  PyObject *types = st ? records_np_types(st) : NULL;
  if (types == NULL) return -1;
  Py_ssize_t ncols = fields == Py_None ? 1 : PyList_GET_SIZE(fields);
  chunk c = {records, PyList_GET_SIZE(records), fields == Py_None ? -1 : ncols, {NULL}};
  for (int i = 0; i < NP_NTYPES; i++) c.np[i] = (PyTypeObject *)PyTuple_GET_ITEM(types, i);
  if (c.n == 0 || (refs != Py_None && PyList_GET_SIZE(refs) != ncols)) return SLOW;
  if (!PyList_CheckExact(records)) return SLOW; /* r[j] over a subclass: Python's */
  if (ncols > EMBER_BATCH_MAX_COLS || c.n > UINT32_MAX) return SLOW; /* a batch's limits */
  /* every record has the fields (or the Python path names the first that has not) */
  for (Py_ssize_t i = 0; c.width >= 0 && i < c.n; i++)
    if (!record_has_fields(&c, i)) return SLOW;

  embpy_records *r = PyMem_Calloc(1, sizeof *r);
  if (r == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  r->c = c;
  r->cols = PyMem_Calloc((size_t)(ncols ? ncols : 1), sizeof(column));
  if (r->cols == NULL) {
    PyMem_Free(r);
    PyErr_NoMemory();
    return -1;
  }
  r->ncols = ncols;
  for (Py_ssize_t j = 0; j < ncols; j++) {
    column *col = &r->cols[j];
    int rc = column_begin(col, fields, refs, j);
    if (rc == 0) rc = plan_column(&r->c, j, col);
    if (rc) {
      embpy_records_free(r);
      return rc;
    }
  }
  *out = r;
  return 0;
}

Py_ssize_t embpy_records_nrows(const embpy_records *r) { return r->c.n; }
Py_ssize_t embpy_records_ncols(const embpy_records *r) { return r->ncols; }

Py_ssize_t embpy_records_bytes(const embpy_records *r) {
  Py_ssize_t total = 0;
  for (Py_ssize_t j = 0; j < r->ncols; j++) /* each fit a batch, which fits a size_t */
    total += r->cols[j].size + (r->cols[j].dtype == 0 ? 8 * (r->c.n + 1) : 0);
  return total;
}

/* ember's dtype of a numpy type character the plan chose (0: str/bytes). */
static uint8_t ember_dtype_of(char dtype) {
  switch (dtype) {
  case 'f': return EMBER_DT_F32;
  case 'd': return EMBER_DT_F64;
  case 'i': return EMBER_DT_I32;
  case 'l': return EMBER_DT_I64;
  case 'B': return EMBER_DT_U8;
  case '?': return EMBER_DT_BOOL;
  default: return EMBER_DT_BYTES;
  }
}

int embpy_records_columns(const embpy_records *r, ember_column *out) {
  for (Py_ssize_t j = 0; j < r->ncols; j++) {
    const column *col = &r->cols[j];
    Py_ssize_t len = 0;
    if (col->dtype != 0 && row_width(col) > (Py_ssize_t)UINT32_MAX) return SLOW; /* a batch's limit */
    const char *name = PyUnicode_AsUTF8AndSize(col->name, &len); /* checked by the plan */
    memset(&out[j], 0, sizeof out[j]);
    out[j].dtype = ember_dtype_of(col->dtype);
    out[j].name = name;
    out[j].name_len = (uint8_t)len;
    out[j].width = col->dtype == 0 ? 0 : (uint32_t)row_width(col);
    out[j].data_len = (uint64_t)col->size;
  }
  return 0;
}

int embpy_records_write(embpy_records *r, const ember_batch_place *places) {
  for (Py_ssize_t j = 0; j < r->ncols; j++) {
    r->cols[j].out = places[j].data;
    r->cols[j].offs = (unsigned char *)places[j].offsets;
  }
  if (r->parts != NULL) { /* the scans checked every value against their first */
    for (Py_ssize_t j = 0; j < r->ncols; j++) pickled_write(r->parts, r->nparts, j, &r->cols[j]);
    return 0;
  }
  for (Py_ssize_t j = 0; j < r->ncols; j++) {
    int rc = write_column(&r->c, j, &r->cols[j]);
    if (rc) return rc;
  }
  return 0;
}

PyObject *embpy_records_refs(const embpy_records *r) {
  PyObject *refs = PyList_New(r->ncols);
  if (refs == NULL) return NULL;
  for (Py_ssize_t j = 0; j < r->ncols; j++) {
    PyObject *ref = column_ref(&r->cols[j]);
    if (ref == NULL) {
      Py_DECREF(refs);
      return NULL;
    }
    PyList_SET_ITEM(refs, j, ref);
  }
  return refs;
}

/* ------------------------------------------------------------ the function */

PyDoc_STRVAR(records_to_columns_doc,
             "records_to_columns(records, fields, refs) -> (columns, refs) or None\n"
             "\n"
             "The fast path of ember._columns.records_to_columns: converts a list of\n"
             "records to columns in one pass.  fields: the field names when records\n"
             "are tuples (or Rows, or lists) of fields, None when each record is the\n"
             "one column's value.  refs: None, or the partition's (kind, shape) per\n"
             "column from its earlier chunks.  Returns a list of (name, dtype\n"
             "character or None for str/bytes, width, data, offsets or None, shape or\n"
             "None) -- data a bytearray holding the column's array of that shape, or\n"
             "the bytes of a str/bytes column with a bytearray of n + 1 uint64\n"
             "offsets -- and the refs for the next chunk.  Returns None when the chunk\n"
             "is empty or holds anything the fast path does not convert exactly as the\n"
             "Python path (which then converts it, or raises the error naming the\n"
             "record).");

/* (name, dtype character or None, width, data, offsets or None, shape or
 * None) of a written column, for the caller to wrap as a column spec. */
static PyObject *column_tuple(const column *col, Py_ssize_t n, PyObject *data, PyObject *offsets) {
  if (col->dtype == 0) /* str/bytes */
    return Py_BuildValue("(OOiOOO)", col->name, Py_None, 0, data, offsets, Py_None);
  PyObject *shape = shape_tuple(n, &col->want);
  if (shape == NULL) return NULL;
  return Py_BuildValue("(Os#nOON)", col->name, &col->dtype, (Py_ssize_t)1, row_width(col), data,
                       Py_None, shape);
}

static PyObject *py_records_to_columns(PyObject *m, PyObject *args) {
  PyObject *records, *fields, *refs;
  if (!PyArg_ParseTuple(args, "OOO:records_to_columns", &records, &fields, &refs))
    return NULL;
  embpy_records *r = NULL;
  int rc = embpy_records_plan((ember_state *)PyModule_GetState(m), records, fields, refs, &r);
  if (rc < 0) return NULL;
  if (rc) Py_RETURN_NONE;

  PyObject *result = NULL, *out_cols = NULL, *out_refs = NULL;
  /* each column's data and offsets (or NULL): no list, because nothing
   * allocated before the write pass may be tracked by the cyclic GC */
  PyObject **buffers = PyMem_Calloc((size_t)(2 * r->ncols + 1), sizeof *buffers);
  ember_batch_place *places = PyMem_Calloc((size_t)(r->ncols ? r->ncols : 1), sizeof *places);
  if (buffers == NULL || places == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t j = 0; j < r->ncols; j++) {
    const column *col = &r->cols[j];
    if (col->dtype == 0) {
      Py_ssize_t osize = 0;
      buffers[2 * j] = PyBytes_FromStringAndSize(NULL, col->size);
      if (buffers[2 * j] == NULL) goto done;
      places[j].data = PyBytes_AS_STRING(buffers[2 * j]);
      (void)mul_size(r->c.n + 1, 8, &osize); /* checked by the plan */
      buffers[2 * j + 1] = PyByteArray_FromStringAndSize(NULL, osize);
      if (buffers[2 * j + 1] == NULL) goto done;
      places[j].offsets = (uint64_t *)(void *)PyByteArray_AS_STRING(buffers[2 * j + 1]);
    } else {
      buffers[2 * j] = PyByteArray_FromStringAndSize(NULL, col->size);
      if (buffers[2 * j] == NULL) goto done;
      places[j].data = PyByteArray_AS_STRING(buffers[2 * j]);
    }
  }
  rc = embpy_records_write(r, places);
  if (rc) {
    result = Py_NewRef(Py_None);
    goto done;
  }
  out_cols = PyList_New(r->ncols);
  out_refs = embpy_records_refs(r);
  if (out_cols == NULL || out_refs == NULL) goto done;
  for (Py_ssize_t j = 0; j < r->ncols; j++) {
    PyObject *t = column_tuple(&r->cols[j], r->c.n, buffers[2 * j],
                               buffers[2 * j + 1] ? buffers[2 * j + 1] : Py_None);
    if (t == NULL) goto done;
    PyList_SET_ITEM(out_cols, j, t);
  }
  result = PyTuple_Pack(2, out_cols, out_refs);
done:
  Py_XDECREF(out_cols);
  Py_XDECREF(out_refs);
  for (Py_ssize_t k = 0; buffers != NULL && k < 2 * r->ncols; k++) Py_XDECREF(buffers[k]);
  PyMem_Free(buffers);
  PyMem_Free(places);
  embpy_records_free(r);
  return result;
}

PyDoc_STRVAR(scan_pickled_doc,
             "scan_pickled(frame) -> PickledRecords or None\n"
             "\n"
             "Reads a pickled list of records (bytes: a frame of PySpark's batched\n"
             "serializer) without unpickling it, for send_records: None when the frame\n"
             "is not of the common form (tuples of, or bare, Python numbers and numpy\n"
             "arrays of one dtype and shape per field; see ember/pickled.h), and the\n"
             "caller unpickles it.");

static PyObject *py_scan_pickled(PyObject *m, PyObject *frame) {
  ember_state *st = (ember_state *)PyModule_GetState(m);
  if (!PyBytes_CheckExact(frame)) {
    PyErr_SetString(PyExc_TypeError, "scan_pickled: frame is bytes");
    return NULL;
  }
  ember_pickled *scan = NULL;
  int rc = ember_pickled_scan((const uint8_t *)PyBytes_AS_STRING(frame),
                              (size_t)PyBytes_GET_SIZE(frame), &scan);
  if (rc == EMBER_ENOMEM) return PyErr_NoMemory();
  if (rc != EMBER_OK || ember_pickled_count(scan) > PY_SSIZE_T_MAX) {
    ember_pickled_free(scan);
    Py_RETURN_NONE;
  }
  PyObject *r = pickled_new(st->PickledRecords_Type, frame, NULL, scan, 0,
                            (Py_ssize_t)ember_pickled_count(scan));
  if (r == NULL) ember_pickled_free(scan);
  return r;
}

static PyMethodDef records_functions[] = {
    {"records_to_columns", py_records_to_columns, METH_VARARGS, records_to_columns_doc},
    {"scan_pickled", py_scan_pickled, METH_O, scan_pickled_doc},
    {NULL, NULL, 0, NULL},
};

int embpy_records_exec(PyObject *m, ember_state *st) {
  /* np_types is filled on the first call: importing _ember imports no numpy */
  st->PickledRecords_Type =
      (PyTypeObject *)PyType_FromModuleAndSpec(m, &PickledRecords_spec, NULL);
  if (st->PickledRecords_Type == NULL ||
      PyModule_AddType(m, st->PickledRecords_Type) < 0)
    return -1;
  return PyModule_AddFunctions(m, records_functions);
}
