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
 * Thread-safety: runs with the GIL held and calls no Python-level code while
 * it reads the records (numpy's scalar and buffer slots are C), and it
 * allocates no object tracked by the cyclic GC until every value is read, so
 * no finalizer can change the records under it.  Every access to a record is
 * still bounds-checked.
 */
#include "_ember.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

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

static unsigned char *bytearray_data(PyObject *ba) {
  return (unsigned char *)PyByteArray_AS_STRING(ba);
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

typedef struct {
  PyObject *field;   /* the field name (strong) */
  PyObject *ref;     /* the partition's reference for it (strong), or NULL: a new one */
  colref want;       /* what ref says, or this chunk's first value */
  char dtype;        /* numpy type character of data, 0 for a str/bytes column */
  PyObject *data;    /* bytearray (numbers, arrays) or bytes (str/bytes), strong */
  PyObject *offsets; /* bytearray of n + 1 uint64 (str/bytes columns), strong, or NULL */
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

/* --- numbers: one value per record, or the elements of list rows */

/* Numbers written as they come, 8 bytes each: int64 while all are bools or
 * ints, float64 from the first float on (the values before it converted in
 * place), as numpy promotes a list of Python bool < int < float; one byte
 * each in the end when all are bools. */
enum { NUM_BOOL, NUM_INT, NUM_FLOAT };
typedef struct {
  unsigned char *buf; /* room for 8 bytes per value */
  Py_ssize_t n;       /* values written */
  int mode;
} numsink;

/* Appends v of class cl (Python bool/int/float, numpy bool/int64/float64).
 * 0, or SLOW for an int beyond int64 or another class. */
static int sink_put(numsink *s, PyObject *v, vclass cl) {
  unsigned char *slot = s->buf + 8 * s->n;
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
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return SLOW; /* numpy makes uint64 or object of it: the Python path decides */
    }
    iv = (int64_t)x;
    if (s->mode == NUM_BOOL) s->mode = NUM_INT;
    break;
  }
  case V_FLOAT:
  case V_NP_F64: { /* numpy's float64 is a float subclass */
    double d = PyFloat_AS_DOUBLE(v);
    if (s->mode != NUM_FLOAT) {
      for (Py_ssize_t k = 0; k < s->n; k++) {
        int64_t x;
        memcpy(&x, s->buf + 8 * k, 8);
        double y = (double)x; /* round to nearest, as numpy's int -> float */
        memcpy(s->buf + 8 * k, &y, 8);
      }
      s->mode = NUM_FLOAT;
    }
    memcpy(slot, &d, 8);
    s->n++;
    return 0;
  }
  default:
    return SLOW;
  }
  if (s->mode == NUM_FLOAT) {
    double d = (double)iv;
    memcpy(slot, &d, 8);
  } else {
    memcpy(slot, &iv, 8);
  }
  s->n++;
  return 0;
}

/* The sink's data (col->data, 8 bytes a value) in its final dtype: bool (a
 * new bytearray, one byte a value), int64 or float64 (float64 when empty, as
 * numpy makes of empty rows).  0 or -1. */
static int sink_finish(numsink *s, column *col) {
  if (s->n == 0 || s->mode == NUM_FLOAT) {
    col->dtype = 'd';
    return 0;
  }
  if (s->mode == NUM_INT) {
    col->dtype = 'l';
    return 0;
  }
  PyObject *bools = PyByteArray_FromStringAndSize(NULL, s->n);
  if (bools == NULL) return -1;
  unsigned char *out = bytearray_data(bools);
  for (Py_ssize_t k = 0; k < s->n; k++) {
    int64_t x;
    memcpy(&x, s->buf + 8 * k, 8);
    out[k] = x != 0;
  }
  Py_SETREF(col->data, bools);
  col->dtype = '?';
  return 0;
}

/* A column of numbers: Python and numpy bool/int64/float64 promoted as numpy
 * does, or numpy int32/uint8/float32 scalars all of one type. */
static int numbers_column(const chunk *c, Py_ssize_t j, vclass c0, column *col) {
  Py_ssize_t n = c->n, size;
  if (c0 == V_NP_I32 || c0 == V_NP_U8 || c0 == V_NP_F32) {
    Py_ssize_t item = c0 == V_NP_U8 ? 1 : 4;
    if (!kind_agrees(col->want.k, kind_of(c0)) || mul_size(n, item, &size)) return SLOW;
    col->data = PyByteArray_FromStringAndSize(NULL, size);
    if (col->data == NULL) return -1;
    unsigned char *out = bytearray_data(col->data);
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject *v = value_at(c, i, j);
      if (v == NULL || classify(c, v) != c0 || np_scalar_bytes(v, out + item * i, item))
        return SLOW;
    }
    col->dtype = c0 == V_NP_I32 ? 'i' : c0 == V_NP_U8 ? 'B' : 'f';
    return 0;
  }
  if (mul_size(n, 8, &size)) return SLOW;
  col->data = PyByteArray_FromStringAndSize(NULL, size);
  if (col->data == NULL) return -1;
  numsink s = {bytearray_data(col->data), 0, NUM_BOOL};
  int bools = col->want.k == K_BOOL;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL) return SLOW;
    vclass cl = classify(c, v);
    int ok = bools ? (cl == V_BOOL || cl == V_NP_BOOL)
                   : (cl == V_INT || cl == V_FLOAT || cl == V_NP_I64 || cl == V_NP_F64);
    if (!ok || sink_put(&s, v, cl)) return SLOW;
  }
  return sink_finish(&s, col);
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

/* A str or bytes column: the values joined (a bytes object) and n + 1 uint64
 * offsets.  Two passes: the lengths, then the copies. */
static int bytes_column(const chunk *c, Py_ssize_t j, column *col) {
  vclass want = col->want.k == K_STR ? V_STR : V_BYTES;
  Py_ssize_t n = c->n, total = 0, size;
  Py_buffer view;
  const char *p;
  Py_ssize_t len;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL || classify(c, v) != want || bytes_of(v, want, &view, &p, &len)) return SLOW;
    if (view.obj) PyBuffer_Release(&view);
    if (len > PY_SSIZE_T_MAX - total) return SLOW;
    total += len;
  }
  if (mul_size(n + 1, 8, &size)) return SLOW;
  col->data = PyBytes_FromStringAndSize(NULL, total);
  if (col->data == NULL) return -1;
  col->offsets = PyByteArray_FromStringAndSize(NULL, size);
  if (col->offsets == NULL) return -1;
  char *out = PyBytes_AS_STRING(col->data);
  unsigned char *offs = bytearray_data(col->offsets);
  uint64_t at = 0;
  memcpy(offs, &at, 8);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL || classify(c, v) != want || bytes_of(v, want, &view, &p, &len)) return SLOW;
    int fits = len <= total - (Py_ssize_t)at; /* the first pass's sizes still hold */
    if (fits) memcpy(out + at, p, (size_t)len);
    if (view.obj) PyBuffer_Release(&view);
    if (!fits) return SLOW;
    at += (uint64_t)len;
    memcpy(offs + 8 * (i + 1), &at, 8);
  }
  if ((Py_ssize_t)at != total) return SLOW;
  col->dtype = 0;
  return 0;
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
 * one memcpy a record (np.stack). */
static int ndarray_column(const chunk *c, Py_ssize_t j, column *col) {
  Py_ssize_t n = c->n, row = 0, size;
  char format = 0;
  unsigned char *out = NULL;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL || Py_TYPE(v) != c->np[NP_NDARRAY]) return SLOW;
    Py_buffer b;
    if (PyObject_GetBuffer(v, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
      PyErr_Clear(); /* not C-contiguous, or no buffer (object arrays) */
      return SLOW;
    }
    int rc = 0;
    if (i == 0) {
      format = b.format ? b.format[0] : 0;
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
      row = b.itemsize;
      for (int d = 0; rc == 0 && d < b.ndim; d++) rc = mul_size(row, b.shape[d], &row);
      if (rc == 0) rc = mul_size(n, row, &size);
      if (rc == 0) {
        col->data = PyByteArray_FromStringAndSize(NULL, size);
        if (col->data == NULL)
          rc = -1;
        else
          out = bytearray_data(col->data);
      }
    } else {
      rc = b.format != NULL && b.format[0] == format && b.format[1] == '\0' &&
                   b.ndim == col->want.ndim
               ? 0
               : SLOW;
      for (int d = 0; rc == 0 && d < b.ndim; d++)
        if (b.shape[d] != col->want.dims[d]) rc = SLOW;
    }
    if (rc == 0 && b.len != row) rc = SLOW;
    if (rc == 0) memcpy(out + row * i, b.buf, (size_t)row);
    PyBuffer_Release(&b);
    if (rc) return rc;
  }
  return 0;
}

/* An array column of lists (or tuples) of Python numbers, all of one length:
 * rows of np.asarray(values), promoted over the whole chunk. */
static int seq_column(const chunk *c, Py_ssize_t j, column *col) {
  PyObject *v0 = value_at(c, 0, j);
  Py_ssize_t n = c->n, width = PySequence_Fast_GET_SIZE(v0), count, size;
  if (col->ref != NULL) {
    if (col->want.ndim != 1 || col->want.dims[0] != width) return SLOW;
  } else {
    col->want.ndim = 1;
    col->want.dims[0] = width;
  }
  if (mul_size(n, width, &count) || mul_size(count, 8, &size)) return SLOW;
  col->data = PyByteArray_FromStringAndSize(NULL, size);
  if (col->data == NULL) return -1;
  numsink s = {bytearray_data(col->data), 0, NUM_BOOL};
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *v = value_at(c, i, j);
    if (v == NULL || classify(c, v) != V_SEQ || PySequence_Fast_GET_SIZE(v) != width) return SLOW;
    PyObject **items = PySequence_Fast_ITEMS(v);
    for (Py_ssize_t k = 0; k < width; k++) {
      vclass cl = classify(c, items[k]);
      if ((cl != V_BOOL && cl != V_INT && cl != V_FLOAT) || sink_put(&s, items[k], cl))
        return SLOW; /* numpy scalars, nested lists, None...: the Python path */
    }
  }
  return sink_finish(&s, col);
}

/* Converts column j into col (whose field, ref and want are set).  0, SLOW,
 * or -1 with an exception. */
static int convert_column(const chunk *c, Py_ssize_t j, column *col) {
  PyObject *v0 = value_at(c, 0, j);
  if (v0 == NULL) return SLOW;
  vclass c0 = classify(c, v0);
  if (c0 == V_OTHER) return SLOW;
  if (col->ref == NULL) {
    col->want.k = kind_of(c0);
    col->want.ndim = 0;
  } else if (!kind_agrees(col->want.k, kind_of(c0))) {
    return SLOW;
  }
  switch (col->want.k) {
  case K_BOOL:
  case K_INT:
  case K_FLOAT:
    return numbers_column(c, j, c0, col);
  case K_STR:
  case K_BYTES:
    return bytes_column(c, j, col);
  case K_ARRAY:
    return c0 == V_NDARRAY ? ndarray_column(c, j, col) : c0 == V_SEQ ? seq_column(c, j, col) : SLOW;
  case K_NKINDS:
    break;
  }
  return SLOW;
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

/* (name, dtype character or None, width, data, offsets or None, shape or
 * None) for the caller to wrap as a column spec.  NULL with an exception, or
 * NULL and *slow set. */
static PyObject *column_tuple(const column *col, Py_ssize_t n, int *slow) {
  PyObject *name = column_name(col, slow);
  if (name == NULL) return NULL;
  if (col->dtype == 0) /* str/bytes */
    return Py_BuildValue("(NOiOOO)", name, Py_None, 0, col->data, col->offsets, Py_None);
  Py_ssize_t width = 1;
  if (col->want.k == K_ARRAY)
    for (Py_ssize_t d = 0; d < col->want.ndim; d++) width *= col->want.dims[d]; /* <= bytes */
  PyObject *shape = shape_tuple(n, &col->want);
  if (shape == NULL) {
    Py_DECREF(name);
    return NULL;
  }
  return Py_BuildValue("(Ns#nOON)", name, &col->dtype, (Py_ssize_t)1, width, col->data, Py_None,
                       shape);
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

static void columns_free(column *cols, Py_ssize_t ncols) {
  if (cols == NULL) return;
  for (Py_ssize_t j = 0; j < ncols; j++) {
    Py_XDECREF(cols[j].field);
    Py_XDECREF(cols[j].ref);
    Py_XDECREF(cols[j].data);
    Py_XDECREF(cols[j].offsets);
  }
  PyMem_Free(cols);
}

static PyObject *py_records_to_columns(PyObject *m, PyObject *args) {
  PyObject *records, *fields, *refs;
  if (!PyArg_ParseTuple(args, "O!OO:records_to_columns", &PyList_Type, &records, &fields, &refs))
    return NULL;
  if ((fields != Py_None && !PyList_Check(fields)) || (refs != Py_None && !PyList_Check(refs))) {
    PyErr_SetString(PyExc_TypeError, "records_to_columns: fields and refs are lists or None");
    return NULL;
  }
  ember_state *st = (ember_state *)PyModule_GetState(m);
  PyObject *types = st ? records_np_types(st) : NULL;
  if (types == NULL) return NULL;

  chunk c = {records, PyList_GET_SIZE(records), -1, {NULL}};
  for (int i = 0; i < NP_NTYPES; i++) c.np[i] = (PyTypeObject *)PyTuple_GET_ITEM(types, i);
  Py_ssize_t ncols = fields == Py_None ? 1 : PyList_GET_SIZE(fields);
  if (fields != Py_None) c.width = ncols;
  if (c.n == 0 || (refs != Py_None && PyList_GET_SIZE(refs) != ncols)) Py_RETURN_NONE;
  if (!PyList_CheckExact(records)) Py_RETURN_NONE; /* r[j] over a subclass: Python's */
  /* every record has the fields (or the Python path names the first that has not) */
  for (Py_ssize_t i = 0; c.width >= 0 && i < c.n; i++)
    if (!record_has_fields(&c, i)) Py_RETURN_NONE;

  PyObject *result = NULL, *out_cols = NULL, *out_refs = NULL;
  int slow = 0;
  column *cols = PyMem_Calloc((size_t)(ncols ? ncols : 1), sizeof(column));
  if (cols == NULL) return PyErr_NoMemory();
  /* read every value first: nothing GC-tracked is allocated until they are */
  for (Py_ssize_t j = 0; j < ncols; j++) {
    column *col = &cols[j];
    col->field = fields == Py_None ? PyUnicode_FromStringAndSize("", 0)
                                   : Py_NewRef(PyList_GET_ITEM(fields, j));
    if (col->field == NULL) goto done;
    if (!PyUnicode_CheckExact(col->field)) goto slow;
    PyObject *ref = refs == Py_None ? Py_None : PyList_GET_ITEM(refs, j);
    if (ref != Py_None) {
      if (parse_ref(ref, &col->want)) goto slow;
      col->ref = Py_NewRef(ref);
    }
    int rc = convert_column(&c, j, col);
    if (rc < 0) goto done;
    if (rc) goto slow;
  }
  out_cols = PyList_New(ncols);
  out_refs = PyList_New(ncols);
  if (out_cols == NULL || out_refs == NULL) goto done;
  for (Py_ssize_t j = 0; j < ncols; j++) {
    PyObject *t = column_tuple(&cols[j], c.n, &slow);
    if (t == NULL) {
      if (slow) goto slow;
      goto done;
    }
    PyList_SET_ITEM(out_cols, j, t);
    PyObject *r = column_ref(&cols[j]);
    if (r == NULL) goto done;
    PyList_SET_ITEM(out_refs, j, r);
  }
  result = PyTuple_Pack(2, out_cols, out_refs);
  goto done;
slow:
  result = Py_NewRef(Py_None);
done:
  Py_XDECREF(out_cols);
  Py_XDECREF(out_refs);
  columns_free(cols, ncols);
  return result;
}

static PyMethodDef records_functions[] = {
    {"records_to_columns", py_records_to_columns, METH_VARARGS, records_to_columns_doc},
    {NULL, NULL, 0, NULL},
};

int embpy_records_exec(PyObject *m, ember_state *st) {
  (void)st; /* np_types is filled on the first call: importing _ember imports no numpy */
  return PyModule_AddFunctions(m, records_functions);
}
