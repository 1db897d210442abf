/* python/ember/_ember_tfrecord.c - TFRecordReader, TFRecordWriter,
 * ExampleDecoder, Buffer, and the crc32c / Example helpers.
 *
 * The hot path is TFRecordReader.read_examples(decoder, n): it reads up to n
 * records and decodes each into the decoder's columns in one C loop with the
 * GIL released; ExampleDecoder.take() then hands the column buffers over as
 * Buffer objects (malloc'd memory exported through the buffer protocol with
 * a typed format), so numpy.asarray(buf) views them without a copy and
 * without a Python object per value.  TFRecordWriter.write_examples(columns,
 * nrows) is the same in the other direction.
 *
 * Thread-safety: the C reader, writer and decoder are single-threaded
 * objects, so each wrapper carries a lock taken (with the GIL released)
 * around every C call; read_examples takes the reader's, then the decoder's.
 */
#include "_ember.h"

#include <string.h>

#include "ember/crc32c.h"
#include "ember/example.h"
#include "ember/tfrecord.h"
#include "ember/webhdfs.h"

/* hdfs://, webhdfs:// and swebhdfs:// sources and sinks go through
 * libember's WebHDFS client (ember/webhdfs.h), resolved from
 * HADOOP_CONF_DIR as there; everything else is a local path. */
static int is_hdfs_url(const char *p) {
  return strncmp(p, "hdfs://", 7) == 0 || strncmp(p, "webhdfs://", 10) == 0 ||
         strncmp(p, "swebhdfs://", 11) == 0;
}

/* ================================================================ Buffer */

typedef struct {
  PyObject_HEAD
  void *ptr;              /* malloc'd (ember_ex_free); NULL when empty */
  Py_ssize_t len;         /* bytes */
  Py_ssize_t itemsize;
  Py_ssize_t shape;       /* len / itemsize */
  char format[2];
} BufferObject;

/* Takes ownership of ptr whatever happens. */
static PyObject *Buffer_new_owned(ember_state *st, void *ptr, size_t len, char format,
                                  Py_ssize_t itemsize) {
  if (len > (size_t)PY_SSIZE_T_MAX) {
    ember_ex_free(ptr);
    return PyErr_NoMemory();
  }
  BufferObject *b = (BufferObject *)st->Buffer_Type->tp_alloc(st->Buffer_Type, 0);
  if (b == NULL) {
    ember_ex_free(ptr);
    return NULL;
  }
  b->ptr = ptr;
  b->len = (Py_ssize_t)len;
  b->itemsize = itemsize;
  b->shape = b->len / itemsize;
  b->format[0] = format;
  b->format[1] = '\0';
  return (PyObject *)b;
}

static void Buffer_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  ember_ex_free(((BufferObject *)op)->ptr);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static int Buffer_getbuffer(PyObject *op, Py_buffer *view, int flags) {
  BufferObject *b = (BufferObject *)op;
  static uint64_t empty; /* a valid, aligned pointer for empty buffers */
  view->obj = Py_NewRef(op);
  view->buf = b->ptr != NULL ? b->ptr : (void *)&empty;
  view->len = b->len;
  view->readonly = 0;
  view->itemsize = b->itemsize;
  view->format = (flags & PyBUF_FORMAT) ? b->format : NULL;
  view->ndim = 1;
  view->shape = (flags & PyBUF_ND) ? &b->shape : NULL;
  view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &b->itemsize : NULL;
  view->suboffsets = NULL;
  view->internal = NULL;
  return 0;
}

static PyObject *Buffer_repr(PyObject *op) {
  BufferObject *b = (BufferObject *)op;
  return PyUnicode_FromFormat("<ember._ember.Buffer format=%s items=%zd>", b->format, b->shape);
}

static Py_ssize_t Buffer_length(PyObject *op) { return ((BufferObject *)op)->shape; }

static PyType_Slot Buffer_slots[] = {
    {Py_tp_doc, (void *)"Memory owned by Ember, exported through the buffer protocol\n"
                        "(typed format, one dimension); numpy.asarray(buf) views it."},
    {Py_tp_dealloc, Buffer_dealloc},
    {Py_tp_repr, Buffer_repr},
    {Py_sq_length, Buffer_length},
    {Py_bf_getbuffer, Buffer_getbuffer},
    {0, NULL},
};

static PyType_Spec Buffer_spec = {
    .name = "ember._ember.Buffer",
    .basicsize = sizeof(BufferObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Buffer_slots,
};

/* ================================================================ helpers */

static PyObject *self_enter(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  return Py_NewRef(self);
}

static int check_compression(int c) {
  if (c < 0 || c > 2) {
    PyErr_Format(PyExc_ValueError, "compression must be 0 (none), 1 (GZIP) or 2 (ZLIB), not %d", c);
    return -1;
  }
  return 0;
}

/* ================================================================ ExampleDecoder */

typedef struct {
  PyObject_HEAD
  embpy_handle h;
  uint32_t ncols;
  uint8_t *kinds;  /* per column */
  uint32_t *widths;
} ExampleDecoderObject;

static void decoder_destroy(void *p) { ember_ex_decoder_destroy(p); }

static PyObject *ExampleDecoder_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"specs", NULL};
  PyObject *specs;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:ExampleDecoder", kwlist, &specs))
    return NULL;
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL) return NULL;
  PyObject *fast = PySequence_Tuple(specs);
  if (fast == NULL) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(fast);
  ExampleDecoderObject *self = NULL;
  ember_ex_spec *cs = NULL;
  if (n > (Py_ssize_t)EMBER_EX_MAX_COLS) {
    PyErr_Format(PyExc_ValueError, "too many columns: %zd (at most %u)", n, EMBER_EX_MAX_COLS);
    goto err;
  }
  cs = PyMem_Calloc(n ? (size_t)n : 1, sizeof *cs);
  self = (ExampleDecoderObject *)type->tp_alloc(type, 0);
  if (cs == NULL || self == NULL) goto err;
  if (embpy_handle_init(&self->h, "ExampleDecoder", decoder_destroy, 1) < 0) goto err;
  self->kinds = PyMem_Calloc(n ? (size_t)n : 1, 1);
  self->widths = PyMem_Calloc(n ? (size_t)n : 1, sizeof *self->widths);
  if (self->kinds == NULL || self->widths == NULL) {
    PyErr_NoMemory();
    goto err;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    const char *name;
    int kind;
    unsigned int width = 0, flags = 0;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(fast, i), "si|II;spec must be (name, kind, width, flags)",
                          &name, &kind, &width, &flags))
      goto err;
    cs[i].name = name; /* borrowed from the tuple, copied by create */
    cs[i].kind = (uint8_t)kind;
    cs[i].width = width;
    cs[i].flags = flags;
    if (kind < 1 || kind > 3) {
      PyErr_Format(PyExc_ValueError, "column '%s': kind must be 1 (bytes), 2 (float) or 3 (int64), not %d", name, kind);
      goto err;
    }
    self->kinds[i] = (uint8_t)kind;
    self->widths[i] = width;
  }
  ember_ex_decoder *d;
  embpy_err e;
  int rc;
  EMBPY_CALL(rc, &e, ember_ex_decoder_create(&d, cs, (uint32_t)n));
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto err;
  }
  self->h.ptr = d;
  self->ncols = (uint32_t)n;
  PyMem_Free(cs);
  Py_DECREF(fast);
  return (PyObject *)self;
err:
  PyMem_Free(cs);
  Py_DECREF(fast);
  Py_XDECREF(self);
  return NULL;
}

static int Handle_traverse(PyObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  return 0;
}

static void ExampleDecoder_dealloc(PyObject *op) {
  ExampleDecoderObject *self = (ExampleDecoderObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&self->h);
  PyMem_Free(self->kinds);
  PyMem_Free(self->widths);
  tp->tp_free(op);
  Py_DECREF(tp);
}

PyDoc_STRVAR(ExampleDecoder_add_doc,
             "add(example) -> None\n\n"
             "Decodes one serialized tf.train.Example as the next row.  Raises\n"
             "EmberCorruptError for malformed bytes and EmberSchemaError when it does\n"
             "not fit the specs; the columns are then unchanged.");

static PyObject *ExampleDecoder_add(PyObject *op, PyObject *arg) {
  ExampleDecoderObject *self = (ExampleDecoderObject *)op;
  Py_buffer v;
  if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0) return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_ex_decoder_add(self->h.ptr, v.buf, (size_t)v.len));
  PyBuffer_Release(&v);
  if (ok < 0) return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(ExampleDecoder_take_doc,
             "take() -> (nrows, columns)\n\n"
             "Hands over the decoded rows and restarts at 0 rows.  columns[i] is\n"
             "(values, value_offsets, row_offsets, present): Buffer objects (numpy:\n"
             "numpy.asarray(buf)) -- values float32 / int64 / uint8 bytes data;\n"
             "value_offsets (bytes columns) and row_offsets (width 0 columns) uint64,\n"
             "else None; present uint8, 1 where the record had the feature.");

static PyObject *column_tuple(ember_state *st, ember_ex_column *c) {
  PyObject *vals = NULL, *voff = NULL, *roff = NULL, *pres = NULL;
  char fmt = c->kind == EMBER_EX_FLOAT ? 'f' : c->kind == EMBER_EX_INT64 ? 'q' : 'B';
  Py_ssize_t isz = c->kind == EMBER_EX_FLOAT ? 4 : c->kind == EMBER_EX_INT64 ? 8 : 1;
  size_t vlen = c->kind == EMBER_EX_BYTES ? (size_t)c->nbytes : (size_t)c->nvalues * (size_t)isz;
  vals = Buffer_new_owned(st, c->values, vlen, fmt, isz);
  c->values = NULL;
  if (c->kind == EMBER_EX_BYTES) {
    voff = Buffer_new_owned(st, c->value_offsets, 8 * ((size_t)c->nvalues + 1), 'Q', 8);
  } else {
    ember_ex_free(c->value_offsets);
    voff = Py_NewRef(Py_None);
  }
  c->value_offsets = NULL;
  if (c->row_offsets != NULL)
    roff = Buffer_new_owned(st, c->row_offsets, 8 * ((size_t)c->nrows + 1), 'Q', 8);
  else
    roff = Py_NewRef(Py_None);
  c->row_offsets = NULL;
  pres = Buffer_new_owned(st, c->present, (size_t)c->nrows, 'B', 1);
  c->present = NULL;
  if (vals == NULL || voff == NULL || roff == NULL || pres == NULL) {
    Py_XDECREF(vals);
    Py_XDECREF(voff);
    Py_XDECREF(roff);
    Py_XDECREF(pres);
    return NULL;
  }
  return Py_BuildValue("(NNNN)", vals, voff, roff, pres);
}

/* take()'s part without the GIL: the rows, then the columns. */
static int take_rows(ember_ex_decoder *dec, ember_ex_column *cols, uint64_t *nrows) {
  *nrows = ember_ex_decoder_rows(dec);
  return ember_ex_decoder_take(dec, cols);
}

/* The (nrows, columns) of take() and gather() from columns the caller owns
 * (handed to Buffer objects; freed here on failure), and frees cols. */
static PyObject *columns_result(ember_state *st, ember_ex_column *cols, uint32_t ncols,
                                uint64_t nrows) {
  PyObject *list = PyList_New(ncols);
  for (uint32_t i = 0; i < ncols; i++) {
    PyObject *t = list ? column_tuple(st, &cols[i]) : NULL;
    if (t == NULL) {
      /* free what the failed or remaining columns still own */
      for (uint32_t k = i; k < ncols; k++) ember_ex_column_free(&cols[k]);
      Py_XDECREF(list);
      PyMem_Free(cols);
      return NULL;
    }
    PyList_SET_ITEM(list, i, t);
  }
  PyMem_Free(cols);
  return Py_BuildValue("(KN)", (unsigned long long)nrows, list);
}

static PyObject *ExampleDecoder_take(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ExampleDecoderObject *self = (ExampleDecoderObject *)op;
  ember_state *st = embpy_state_of_type(Py_TYPE(op));
  if (st == NULL) return NULL;
  ember_ex_column *cols = PyMem_Calloc(self->ncols ? self->ncols : 1, sizeof *cols);
  if (cols == NULL) return PyErr_NoMemory();
  uint64_t nrows = 0;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), take_rows(self->h.ptr, cols, &nrows));
  if (ok < 0) {
    PyMem_Free(cols);
    return NULL;
  }
  return columns_result(st, cols, self->ncols, nrows);
}

PyDoc_STRVAR(ExampleDecoder_gather_doc,
             "gather(rows) -> (nrows, columns)\n\n"
             "Copies the decoded rows at the indices rows (a contiguous int64 buffer,\n"
             "e.g. a numpy array; any order, repeats allowed) into new buffers, as\n"
             "take() returns them, and keeps the decoder's rows: a shuffle gathers\n"
             "its batches from a window, then clear() reuses the window's memory.");

typedef struct {
  ember_ex_decoder *dec;
  const uint64_t *rows;
  size_t n;
  ember_ex_column *cols;
} gather_args;

static int gather_rows(gather_args *a) {
  return ember_ex_decoder_gather(a->dec, a->rows, a->n, a->cols);
}

static PyObject *ExampleDecoder_gather(PyObject *op, PyObject *arg) {
  ExampleDecoderObject *self = (ExampleDecoderObject *)op;
  ember_state *st = embpy_state_of_type(Py_TYPE(op));
  if (st == NULL) return NULL;
  Py_buffer v;
  if (PyObject_GetBuffer(arg, &v, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
  const char *f = v.format ? v.format : "B";
  if (f[0] == '@' || f[0] == '=' || f[0] == '<') f++;
  if (v.itemsize != 8 || f[0] == '\0' || f[1] != '\0' || strchr("qQlL", f[0]) == NULL) {
    PyErr_Format(PyExc_TypeError, "gather: rows must be a contiguous int64 array, not format "
                 "'%s' with %zd-byte items", v.format ? v.format : "B", v.itemsize);
    PyBuffer_Release(&v);
    return NULL;
  }
  ember_ex_column *cols = PyMem_Calloc(self->ncols ? self->ncols : 1, sizeof *cols);
  if (cols == NULL) {
    PyBuffer_Release(&v);
    return PyErr_NoMemory();
  }
  gather_args a = {NULL, v.buf, (size_t)(v.len / 8), cols};
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), (a.dec = self->h.ptr, gather_rows(&a)));
  PyBuffer_Release(&v);
  if (ok < 0) {
    PyMem_Free(cols);
    return NULL;
  }
  return columns_result(st, cols, self->ncols, (uint64_t)a.n);
}

static PyObject *ExampleDecoder_clear(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ExampleDecoderObject *self = (ExampleDecoderObject *)op;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), (ember_ex_decoder_clear(self->h.ptr), EMBER_OK));
  if (ok < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *ExampleDecoder_rows(PyObject *op, void *c) {
  ExampleDecoderObject *self = (ExampleDecoderObject *)op;
  uint64_t n = 0;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), (n = ember_ex_decoder_rows(self->h.ptr), EMBER_OK));
  if (ok < 0) return NULL;
  return PyLong_FromUnsignedLongLong(n);
}

static PyObject *ExampleDecoder_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  embpy_handle_close(&((ExampleDecoderObject *)op)->h);
  Py_RETURN_NONE;
}

static PyMethodDef ExampleDecoder_methods[] = {
    {"add", ExampleDecoder_add, METH_O, ExampleDecoder_add_doc},
    {"take", ExampleDecoder_take, METH_NOARGS, ExampleDecoder_take_doc},
    {"gather", ExampleDecoder_gather, METH_O, ExampleDecoder_gather_doc},
    {"clear", ExampleDecoder_clear, METH_NOARGS, "clear() -> None\n\nDrops the decoded rows."},
    {"close", ExampleDecoder_close, METH_NOARGS, "close() -> None"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ExampleDecoder_getset[] = {
    {"rows", ExampleDecoder_rows, NULL, "Rows decoded since the last take() or clear().", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(ExampleDecoder_doc,
             "ExampleDecoder(specs)\n\n"
             "Decodes serialized tf.train.Examples into columns.  specs is a sequence\n"
             "of (name, kind, width, flags): kind 1 bytes, 2 float, 3 int64; width > 0\n"
             "for dense columns of exactly width values per record, 0 for variable\n"
             "length; flags 1 (OPTIONAL) makes a missing feature a null row instead\n"
             "of an error.");

static PyType_Slot ExampleDecoder_slots[] = {
    {Py_tp_doc, (void *)ExampleDecoder_doc},
    {Py_tp_new, ExampleDecoder_new},
    {Py_tp_dealloc, ExampleDecoder_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_methods, ExampleDecoder_methods},
    {Py_tp_getset, ExampleDecoder_getset},
    {0, NULL},
};

static PyType_Spec ExampleDecoder_spec = {
    .name = "ember._ember.ExampleDecoder",
    .basicsize = sizeof(ExampleDecoderObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = ExampleDecoder_slots,
};

/* ================================================================ TFRecordReader */

typedef struct {
  PyObject_HEAD
  embpy_handle h;
  Py_buffer mem;     /* the memory source (obj NULL for files) */
} TFRecordReaderObject;

static void reader_destroy(void *p) { ember_tfr_reader_destroy(p); }

static PyObject *TFRecordReader_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"source", "name", "compression", "check_crc", "skip_corrupt",
                           "max_record", NULL};
  PyObject *source;
  const char *name = NULL;
  int compression = 0, check_crc = 1, skip = 0;
  unsigned long long max_record = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$zippK:TFRecordReader", kwlist, &source,
                                   &name, &compression, &check_crc, &skip, &max_record))
    return NULL;
  if (check_compression(compression) < 0) return NULL;
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL) return NULL;
  TFRecordReaderObject *self = (TFRecordReaderObject *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  if (embpy_handle_init(&self->h, "TFRecordReader", reader_destroy, 1) < 0) goto err;
  ember_tfr_options o = {compression, (check_crc ? 0u : EMBER_TFR_NO_CRC) | (skip ? EMBER_TFR_SKIP_CORRUPT : 0u),
                         max_record, 0};
  ember_tfr_reader *r = NULL;
  embpy_err e;
  int rc;
  if (PyUnicode_Check(source) || (!PyBytes_Check(source) && !PyObject_CheckBuffer(source))) {
    PyObject *path = NULL;
    if (!PyUnicode_FSConverter(source, &path)) goto err;
    const char *p = PyBytes_AS_STRING(path);
    EMBPY_NOGIL(rc, &e, NULL,
                is_hdfs_url(p) ? ember_webhdfs_tfr_reader_open(&r, p, NULL, &o)
                               : ember_tfr_reader_open_path(&r, p, &o));
    Py_DECREF(path);
  } else {
    if (PyObject_GetBuffer(source, &self->mem, PyBUF_SIMPLE) < 0) goto err;
    EMBPY_CALL(rc, &e, ember_tfr_reader_open_mem(&r, self->mem.buf, (size_t)self->mem.len,
                                                 name ? name : "<memory>", &o));
  }
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto err;
  }
  self->h.ptr = r;
  return (PyObject *)self;
err:
  Py_DECREF(self);
  return NULL;
}

static void TFRecordReader_dealloc(PyObject *op) {
  TFRecordReaderObject *self = (TFRecordReaderObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&self->h); /* before the memory it reads */
  if (self->mem.obj != NULL) PyBuffer_Release(&self->mem);
  tp->tp_free(op);
  Py_DECREF(tp);
}

/* next() without the GIL.  Not EMBPY_HANDLE_CALL: the reader's pointer is
 * only valid until its next call, so the record is copied into bytes with
 * the handle's lock still held (the GIL taken back inside it). */
static PyObject *TFRecordReader_next(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  TFRecordReaderObject *self = (TFRecordReaderObject *)op;
  if (embpy_handle_enter(&self->h) < 0) return NULL;
  const uint8_t *d = NULL;
  size_t n = 0;
  embpy_err e;
  int rc;
  PyObject *out = NULL;
  Py_BEGIN_ALLOW_THREADS
  embpy_lock(self->h.lock);
  ember_clear_error();
  rc = ember_tfr_reader_next(self->h.ptr, &d, &n);
  if (rc < 0) embpy_err_capture(&e, rc);
  Py_BLOCK_THREADS
  if (rc == 1) out = PyBytes_FromStringAndSize((const char *)d, (Py_ssize_t)n);
  Py_UNBLOCK_THREADS
  embpy_unlock(self->h.lock);
  Py_END_ALLOW_THREADS
  embpy_handle_leave(&self->h);
  if (rc < 0) return embpy_raise(embpy_state_of_type(Py_TYPE(op)), &e);
  if (rc == 0) Py_RETURN_NONE;
  return out;
}

static PyObject *TFRecordReader_iternext(PyObject *op) {
  PyObject *r = TFRecordReader_next(op, NULL);
  if (r == Py_None) {
    Py_DECREF(r);
    return NULL; /* StopIteration */
  }
  return r;
}

PyDoc_STRVAR(TFRecordReader_read_examples_doc,
             "read_examples(decoder, n, every=1, phase=0) -> int\n\n"
             "Reads up to n records and decodes each into decoder (an ExampleDecoder)\n"
             "with the GIL released; returns how many were added (0 at the end).\n"
             "With every > 1 only records whose index in the file is phase modulo\n"
             "every are decoded (the others are read and dropped).  A\n"
             "record that does not decode raises with the file, record number and\n"
             "byte offset; the records before it stay in the decoder.");

/* read_examples' part without the GIL and with the reader's lock held
 * (EMBPY_HANDLE_CALL): takes the decoder's lock, always after the reader's,
 * and reads records into it. */
static int read_into(ember_tfr_reader *r, ExampleDecoderObject *dec, Py_ssize_t n,
                     Py_ssize_t every, Py_ssize_t phase, Py_ssize_t *got) {
  int rc = EMBER_OK;
  embpy_lock(dec->h.lock);
  while (*got < n) {
    const uint8_t *d;
    size_t len;
    rc = ember_tfr_reader_next(r, &d, &len);
    if (rc <= 0) break;
    if (every > 1) {
      ember_tfr_stats sk;
      ember_tfr_reader_stats(r, &sk);
      if ((sk.records - 1) % (uint64_t)every != (uint64_t)phase) continue;
    }
    rc = ember_ex_decoder_add(dec->h.ptr, d, len);
    if (rc != EMBER_OK) {
      ember_tfr_stats stt;
      ember_tfr_reader_stats(r, &stt);
      ember__set_error(rc, "%s: record %llu (byte offset %llu): %s", ember_tfr_reader_name(r),
                       (unsigned long long)(stt.records - 1),
                       (unsigned long long)ember_tfr_reader_offset(r), ember_last_error());
      break;
    }
    (*got)++;
  }
  embpy_unlock(dec->h.lock);
  return rc < 0 ? rc : EMBER_OK;
}

static PyObject *TFRecordReader_read_examples(PyObject *op, PyObject *args) {
  TFRecordReaderObject *self = (TFRecordReaderObject *)op;
  PyObject *dobj;
  Py_ssize_t n, every = 1, phase = 0;
  ember_state *st = embpy_state_of_type(Py_TYPE(op));
  if (st == NULL) return NULL;
  if (!PyArg_ParseTuple(args, "O!n|nn:read_examples", st->ExampleDecoder_Type, &dobj, &n, &every,
                        &phase))
    return NULL;
  if (n < 0 || every < 1 || phase < 0 || phase >= every) {
    PyErr_SetString(PyExc_ValueError, "need n >= 0, every >= 1 and 0 <= phase < every");
    return NULL;
  }
  ExampleDecoderObject *dec = (ExampleDecoderObject *)dobj;
  if (embpy_handle_enter(&dec->h) < 0) return NULL;
  Py_ssize_t got = 0;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    read_into(self->h.ptr, dec, n, every, phase, &got));
  embpy_handle_leave(&dec->h);
  if (ok < 0) return NULL;
  return PyLong_FromSsize_t(got);
}

static PyObject *TFRecordReader_stats(PyObject *op, void *c) {
  TFRecordReaderObject *self = (TFRecordReaderObject *)op;
  ember_tfr_stats s;
  uint64_t off = 0;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    (ember_tfr_reader_stats(self->h.ptr, &s),
                     off = ember_tfr_reader_offset(self->h.ptr), EMBER_OK));
  if (ok < 0) return NULL;
  return Py_BuildValue("{sKsKsKsKsKsK}", "records", (unsigned long long)s.records, "data_bytes",
                       (unsigned long long)s.data_bytes, "stream_bytes",
                       (unsigned long long)s.stream_bytes, "skipped", (unsigned long long)s.skipped,
                       "skipped_bytes", (unsigned long long)s.skipped_bytes, "last_offset",
                       (unsigned long long)off);
}

static PyObject *TFRecordReader_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  embpy_handle_close(&((TFRecordReaderObject *)op)->h);
  Py_RETURN_NONE;
}

static PyObject *TFRecordReader_exit(PyObject *op, PyObject *args) {
  return TFRecordReader_close(op, NULL);
}

static PyMethodDef TFRecordReader_methods[] = {
    {"next", TFRecordReader_next, METH_NOARGS,
     "next() -> bytes or None\n\nThe next record, or None at the end."},
    {"read_examples", TFRecordReader_read_examples, METH_VARARGS, TFRecordReader_read_examples_doc},
    {"close", TFRecordReader_close, METH_NOARGS, "close() -> None"},
    {"__enter__", self_enter, METH_NOARGS, NULL},
    {"__exit__", TFRecordReader_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef TFRecordReader_getset[] = {
    {"stats", TFRecordReader_stats, NULL,
     "{'records', 'data_bytes', 'stream_bytes', 'skipped', 'skipped_bytes', 'last_offset'}", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(TFRecordReader_doc,
             "TFRecordReader(source, *, name=None, compression=0, check_crc=True,\n"
             "               skip_corrupt=False, max_record=0)\n\n"
             "Reads a TFRecord file (source: a path, or an hdfs:// / webhdfs:// URL read\n"
             "over WebHDFS with HADOOP_CONF_DIR's NameNode) or buffer (bytes-like; name names\n"
             "it in errors).  compression: 0 none, 1 GZIP, 2 ZLIB.  CRCs are checked\n"
             "unless check_crc is false; a corrupt or truncated record raises\n"
             "EmberCorruptError naming the file and byte offset, unless skip_corrupt,\n"
             "which skips it and counts it in .stats.  Iterating yields records.");

static PyType_Slot TFRecordReader_slots[] = {
    {Py_tp_doc, (void *)TFRecordReader_doc},
    {Py_tp_new, TFRecordReader_new},
    {Py_tp_dealloc, TFRecordReader_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, TFRecordReader_iternext},
    {Py_tp_methods, TFRecordReader_methods},
    {Py_tp_getset, TFRecordReader_getset},
    {0, NULL},
};

static PyType_Spec TFRecordReader_spec = {
    .name = "ember._ember.TFRecordReader",
    .basicsize = sizeof(TFRecordReaderObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = TFRecordReader_slots,
};

/* ================================================================ encoder columns */

typedef struct {
  uint32_t ncols;
  uint64_t nrows;
  ember_ex_input *cols;
  Py_buffer *views;   /* 4 per column: values, value_offsets, row_offsets, present */
  PyObject **names;   /* UTF-8 bytes objects keeping the names alive */
  void **copies;      /* 3 per column: aligned copies of misaligned buffers */
} enc_columns;

static void enc_release(enc_columns *c) {
  if (c->views)
    for (uint32_t i = 0; i < 4 * c->ncols; i++)
      if (c->views[i].obj) PyBuffer_Release(&c->views[i]);
  if (c->names)
    for (uint32_t i = 0; i < c->ncols; i++) Py_XDECREF(c->names[i]);
  if (c->copies)
    for (uint32_t i = 0; i < 3 * c->ncols; i++) PyMem_Free(c->copies[i]);
  PyMem_Free(c->cols);
  PyMem_Free(c->views);
  PyMem_Free(c->names);
  PyMem_Free(c->copies);
  memset(c, 0, sizeof *c);
}

/* Gets a contiguous buffer of obj; an aligned copy when its address is not a
 * multiple of `align`.  *count = len / itemsize (len must divide). */
static int get_view(PyObject *obj, Py_buffer *v, void **copy, size_t align, size_t itemsize,
                    const char *col, const char *what, const void **ptr, uint64_t *count) {
  if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS) < 0) {
    embpy_chain(PyExc_TypeError, "column '%s': %s must be a contiguous buffer", col, what);
    return -1;
  }
  if ((size_t)v->len % itemsize != 0) {
    PyErr_Format(PyExc_ValueError, "column '%s': %s has %zd bytes, not a multiple of %zu", col,
                 what, v->len, itemsize);
    return -1;
  }
  *ptr = v->buf;
  if (align > 1 && ((uintptr_t)v->buf % align) != 0) {
    *copy = PyMem_Malloc(v->len ? (size_t)v->len : 1);
    if (*copy == NULL) {
      PyErr_NoMemory();
      return -1;
    }
    memcpy(*copy, v->buf, (size_t)v->len);
    *ptr = *copy;
  }
  *count = (uint64_t)v->len / itemsize;
  return 0;
}

/* Parses (name, kind, width, values, value_offsets, row_offsets, present). */
static int enc_parse(PyObject *columns, Py_ssize_t nrows, enc_columns *c) {
  memset(c, 0, sizeof *c);
  if (nrows < 0) {
    PyErr_SetString(PyExc_ValueError, "nrows must be >= 0");
    return -1;
  }
  PyObject *fast = PySequence_Tuple(columns);
  if (fast == NULL) return -1;
  Py_ssize_t n = PyTuple_GET_SIZE(fast);
  if (n > (Py_ssize_t)EMBER_EX_MAX_COLS) {
    PyErr_Format(PyExc_ValueError, "too many columns: %zd", n);
    goto err;
  }
  size_t cap = n ? (size_t)n : 1;
  c->nrows = (uint64_t)nrows;
  c->cols = PyMem_Calloc(cap, sizeof *c->cols);
  c->views = PyMem_Calloc(4 * cap, sizeof *c->views);
  c->names = PyMem_Calloc(cap, sizeof *c->names);
  c->copies = PyMem_Calloc(3 * cap, sizeof *c->copies);
  if (!c->cols || !c->views || !c->names || !c->copies) {
    PyErr_NoMemory();
    goto err;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    c->ncols = (uint32_t)i + 1;
    PyObject *name, *vals, *voff, *roff, *pres;
    int kind;
    unsigned int width;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(fast, i),
                          "UiIOOOO;column must be (name, kind, width, values, value_offsets, "
                          "row_offsets, present)",
                          &name, &kind, &width, &vals, &voff, &roff, &pres))
      goto err;
    c->names[i] = PyUnicode_AsUTF8String(name);
    if (c->names[i] == NULL) goto err;
    const char *cn = PyBytes_AS_STRING(c->names[i]);
    if ((size_t)PyBytes_GET_SIZE(c->names[i]) != strlen(cn)) {
      PyErr_Format(PyExc_ValueError, "column %zd: name contains a NUL byte", i);
      goto err;
    }
    ember_ex_input *in = &c->cols[i];
    in->name = cn;
    in->kind = (uint8_t)kind;
    in->width = width;
    if (kind < 1 || kind > 3) {
      PyErr_Format(PyExc_ValueError, "column '%s': kind must be 1, 2 or 3, not %d", cn, kind);
      goto err;
    }
    size_t isz = kind == EMBER_EX_FLOAT ? 4 : kind == EMBER_EX_INT64 ? 8 : 1;
    uint64_t count;
    const void *p;
    if (get_view(vals, &c->views[4 * i], &c->copies[3 * i], isz, isz, cn, "values", &p, &count) < 0)
      goto err;
    in->values = p;
    if (kind == EMBER_EX_BYTES) {
      in->nbytes = count;
      if (voff == Py_None) {
        PyErr_Format(PyExc_ValueError, "column '%s': bytes columns need value_offsets", cn);
        goto err;
      }
      if (get_view(voff, &c->views[4 * i + 1], &c->copies[3 * i + 1], 8, 8, cn, "value_offsets", &p,
                   &count) < 0)
        goto err;
      if (count == 0) {
        PyErr_Format(PyExc_ValueError, "column '%s': value_offsets is empty", cn);
        goto err;
      }
      in->value_offsets = p;
      in->nvalues = count - 1;
    } else {
      in->nvalues = count;
    }
    if (width > 0) {
      if (in->nvalues != c->nrows * width) {
        PyErr_Format(PyExc_ValueError, "column '%s': %llu values for %zd rows of width %u", cn,
                     (unsigned long long)in->nvalues, nrows, width);
        goto err;
      }
    } else {
      if (roff == Py_None) {
        PyErr_Format(PyExc_ValueError, "column '%s': width 0 needs row_offsets", cn);
        goto err;
      }
      if (get_view(roff, &c->views[4 * i + 2], &c->copies[3 * i + 2], 8, 8, cn, "row_offsets", &p,
                   &count) < 0)
        goto err;
      if (count != c->nrows + 1) {
        PyErr_Format(PyExc_ValueError, "column '%s': %llu row_offsets for %zd rows (need nrows + 1)",
                     cn, (unsigned long long)count, nrows);
        goto err;
      }
      in->row_offsets = p;
    }
    if (pres != Py_None) {
      if (get_view(pres, &c->views[4 * i + 3], NULL, 1, 1, cn, "present", &p, &count) < 0) goto err;
      if (count != c->nrows) {
        PyErr_Format(PyExc_ValueError, "column '%s': present has %llu entries for %zd rows", cn,
                     (unsigned long long)count, nrows);
        goto err;
      }
      in->present = p;
    }
  }
  Py_DECREF(fast);
  return 0;
err:
  Py_DECREF(fast);
  enc_release(c);
  return -1;
}

/* Encodes row `row` into *buf (grown as needed; malloc'd).  No GIL. */
static int encode_row(const enc_columns *c, uint64_t row, uint8_t **buf, size_t *cap, size_t *len) {
  size_t need;
  int rc = ember_ex_encoded_size(c->cols, c->ncols, row, &need);
  if (rc != EMBER_OK) return rc;
  if (need > *cap) {
    size_t ncap = need < 4096 ? 4096 : need * 2;
    uint8_t *nb = PyMem_RawRealloc(*buf, ncap);
    if (nb == NULL) return ember__set_error(EMBER_ENOMEM, "out of memory encoding an Example");
    *buf = nb;
    *cap = ncap;
  }
  return ember_ex_encode(c->cols, c->ncols, row, *buf, *cap, len);
}

/* ================================================================ TFRecordWriter */

typedef struct {
  PyObject_HEAD
  embpy_handle h;
  int mem;
} TFRecordWriterObject;

static void writer_destroy(void *p) { ember_tfr_writer_destroy(p); }

static PyObject *TFRecordWriter_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"path", "compression", "level", NULL};
  PyObject *path;
  int compression = 0, level = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|ii:TFRecordWriter", kwlist, &path,
                                   &compression, &level))
    return NULL;
  if (check_compression(compression) < 0) return NULL;
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL) return NULL;
  TFRecordWriterObject *self = (TFRecordWriterObject *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  if (embpy_handle_init(&self->h, "TFRecordWriter", writer_destroy, 1) < 0) goto err;
  ember_tfr_writer *w = NULL;
  embpy_err e;
  int rc;
  if (path == Py_None) {
    self->mem = 1;
    EMBPY_CALL(rc, &e, ember_tfr_writer_open_mem(&w, compression, level));
  } else {
    PyObject *p = NULL;
    if (!PyUnicode_FSConverter(path, &p)) goto err;
    const char *ps = PyBytes_AS_STRING(p);
    /* HDFS is streamed: CREATE, then an APPEND per 8 MiB; complete at close() */
    EMBPY_NOGIL(rc, &e, NULL,
                is_hdfs_url(ps) ? ember_webhdfs_tfr_writer_open(&w, ps, EMBER_WEBHDFS_OVERWRITE,
                                                                NULL, compression, level)
                                : ember_tfr_writer_open_path(&w, ps, compression, level));
    Py_DECREF(p);
  }
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto err;
  }
  self->h.ptr = w;
  return (PyObject *)self;
err:
  Py_DECREF(self);
  return NULL;
}

static void TFRecordWriter_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&((TFRecordWriterObject *)op)->h);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static PyObject *TFRecordWriter_write(PyObject *op, PyObject *arg) {
  TFRecordWriterObject *self = (TFRecordWriterObject *)op;
  Py_buffer v;
  if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0) return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_tfr_writer_write(self->h.ptr, v.buf, (size_t)v.len));
  PyBuffer_Release(&v);
  if (ok < 0) return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(TFRecordWriter_write_examples_doc,
             "write_examples(columns, nrows) -> None\n\n"
             "Writes nrows records, row i a tf.train.Example of the columns' values at\n"
             "i, with the GIL released.  columns: (name, kind, width, values,\n"
             "value_offsets, row_offsets, present) -- kind 1 bytes / 2 float / 3 int64;\n"
             "values a float32 / int64 / bytes buffer; value_offsets (bytes: uint64,\n"
             "one per value + 1); width > 0 values per row, or 0 with row_offsets\n"
             "(uint64, nrows + 1); present None or uint8 per row (0 leaves it out).");

/* write_examples' part without the GIL: encodes and writes row by row. */
static int write_rows(ember_tfr_writer *w, const enc_columns *c) {
  uint8_t *buf = NULL;
  size_t cap = 0, len = 0;
  int rc = EMBER_OK;
  for (uint64_t row = 0; row < c->nrows && rc == EMBER_OK; row++) {
    rc = encode_row(c, row, &buf, &cap, &len);
    if (rc == EMBER_OK) rc = ember_tfr_writer_write(w, buf, len);
  }
  PyMem_RawFree(buf);
  return rc;
}

static PyObject *TFRecordWriter_write_examples(PyObject *op, PyObject *args) {
  TFRecordWriterObject *self = (TFRecordWriterObject *)op;
  PyObject *columns;
  Py_ssize_t nrows;
  if (!PyArg_ParseTuple(args, "On:write_examples", &columns, &nrows)) return NULL;
  enc_columns c;
  if (enc_parse(columns, nrows, &c) < 0) return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), write_rows(self->h.ptr, &c));
  enc_release(&c);
  if (ok < 0) return NULL;
  Py_RETURN_NONE;
}

/* flush / close share this shape. */
static PyObject *writer_call(PyObject *op, int (*fn)(ember_tfr_writer *)) {
  TFRecordWriterObject *self = (TFRecordWriterObject *)op;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), fn(self->h.ptr));
  if (ok < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *TFRecordWriter_flush(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  return writer_call(op, ember_tfr_writer_flush);
}

/* close() finishes the stream; the handle stays (for getvalue/counters)
 * until the object goes away. */
static PyObject *TFRecordWriter_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  return writer_call(op, ember_tfr_writer_close);
}

static PyObject *TFRecordWriter_exit(PyObject *op, PyObject *args) {
  PyObject *exc_type = PyTuple_GET_SIZE(args) > 0 ? PyTuple_GET_ITEM(args, 0) : Py_None;
  if (exc_type != Py_None) {
    /* An exception is on its way: do not finish a partial file as if it
     * were whole; drop the writer (its buffered bytes are discarded). */
    embpy_handle_close(&((TFRecordWriterObject *)op)->h);
    Py_RETURN_NONE;
  }
  return TFRecordWriter_close(op, NULL);
}

static PyObject *TFRecordWriter_getvalue(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  TFRecordWriterObject *self = (TFRecordWriterObject *)op;
  if (embpy_handle_enter(&self->h) < 0) return NULL;
  const uint8_t *d;
  size_t n;
  embpy_err e;
  int rc;
  EMBPY_CALL(rc, &e, ember_tfr_writer_mem(self->h.ptr, &d, &n));
  PyObject *out = rc == EMBER_OK ? PyBytes_FromStringAndSize((const char *)d, (Py_ssize_t)n) : NULL;
  embpy_handle_leave(&self->h);
  if (rc != EMBER_OK) return embpy_raise(embpy_state_of_type(Py_TYPE(op)), &e);
  return out;
}

static PyObject *TFRecordWriter_counts(PyObject *op, void *which) {
  TFRecordWriterObject *self = (TFRecordWriterObject *)op;
  if (embpy_handle_enter(&self->h) < 0) return NULL;
  uint64_t v = which ? ember_tfr_writer_bytes(self->h.ptr) : ember_tfr_writer_records(self->h.ptr);
  embpy_handle_leave(&self->h);
  return PyLong_FromUnsignedLongLong(v);
}

static PyMethodDef TFRecordWriter_methods[] = {
    {"write", TFRecordWriter_write, METH_O, "write(record) -> None\n\nAppends one record."},
    {"write_examples", TFRecordWriter_write_examples, METH_VARARGS,
     TFRecordWriter_write_examples_doc},
    {"flush", TFRecordWriter_flush, METH_NOARGS, "flush() -> None"},
    {"close", TFRecordWriter_close, METH_NOARGS,
     "close() -> None\n\nFinishes the file; raises if anything failed to be written."},
    {"getvalue", TFRecordWriter_getvalue, METH_NOARGS,
     "getvalue() -> bytes\n\nThe bytes of a memory writer (path None), after close()."},
    {"__enter__", self_enter, METH_NOARGS, NULL},
    {"__exit__", TFRecordWriter_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef TFRecordWriter_getset[] = {
    {"records", TFRecordWriter_counts, NULL, "Records written.", NULL},
    {"bytes", TFRecordWriter_counts, NULL, "Bytes written (compressed).", (void *)1},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(TFRecordWriter_doc,
             "TFRecordWriter(path, compression=0, level=-1)\n\n"
             "Writes a TFRecord file (path None: into memory, see getvalue()).  An\n"
             "hdfs:// or webhdfs:// path is streamed over WebHDFS (created or\n"
             "overwritten; complete only once close() returns).\n"
             "compression: 0 none, 1 GZIP, 2 ZLIB; level: zlib level or -1.  Nothing\n"
             "is guaranteed written until close() returns.");

static PyType_Slot TFRecordWriter_slots[] = {
    {Py_tp_doc, (void *)TFRecordWriter_doc},
    {Py_tp_new, TFRecordWriter_new},
    {Py_tp_dealloc, TFRecordWriter_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_methods, TFRecordWriter_methods},
    {Py_tp_getset, TFRecordWriter_getset},
    {0, NULL},
};

static PyType_Spec TFRecordWriter_spec = {
    .name = "ember._ember.TFRecordWriter",
    .basicsize = sizeof(TFRecordWriterObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = TFRecordWriter_slots,
};

/* ================================================================ functions */

PyDoc_STRVAR(crc32c_doc,
             "crc32c(data, value=0) -> int\n\n"
             "CRC-32C of data, continuing from value (SSE4.2 when available).");

static PyObject *py_crc32c(PyObject *module, PyObject *args) {
  Py_buffer v;
  unsigned int value = 0;
  if (!PyArg_ParseTuple(args, "y*|I:crc32c", &v, &value)) return NULL;
  uint32_t c;
  if (v.len >= (Py_ssize_t)EMBPY_NOGIL_BYTES) {
    Py_BEGIN_ALLOW_THREADS
    c = ember_crc32c(value, v.buf, (size_t)v.len);
    Py_END_ALLOW_THREADS
  } else {
    c = ember_crc32c(value, v.buf, (size_t)v.len);
  }
  PyBuffer_Release(&v);
  return PyLong_FromUnsignedLong(c);
}

static PyObject *py_masked_crc32c(PyObject *module, PyObject *arg) {
  Py_buffer v;
  if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0) return NULL;
  uint32_t c = ember_crc32c_masked(v.buf, (size_t)v.len);
  PyBuffer_Release(&v);
  return PyLong_FromUnsignedLong(c);
}

static PyObject *py_crc32c_hw(PyObject *module, PyObject *Py_UNUSED(ignored)) {
  return PyBool_FromLong(ember_crc32c_hw());
}

PyDoc_STRVAR(example_parse_doc,
             "example_parse(data) -> dict\n\n"
             "Parses one serialized tf.train.Example into {name: (kind, values)}, name\n"
             "a str (UTF-8, invalid bytes escaped), kind 0 none / 1 bytes / 2 float /\n"
             "3 int64; values: float32 or int64 little-endian bytes for numbers, a\n"
             "list of bytes for bytes lists.  For inspection and schema inference,\n"
             "not for bulk data (use ExampleDecoder).");

#define PARSE_CAP 4096

static PyObject *py_example_parse(PyObject *module, PyObject *arg) {
  Py_buffer v;
  if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0) return NULL;
  ember_ex_feature *f = PyMem_Malloc(PARSE_CAP * sizeof *f);
  PyObject *dict = NULL;
  if (f == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  size_t n;
  embpy_err e;
  int rc;
  EMBPY_CALL(rc, &e, ember_ex_parse(v.buf, (size_t)v.len, f, PARSE_CAP, &n));
  if (rc != EMBER_OK) {
    embpy_raise((ember_state *)PyModule_GetState(module), &e);
    goto done;
  }
  dict = PyDict_New();
  for (size_t i = 0; dict != NULL && i < n; i++) {
    PyObject *name = PyUnicode_DecodeUTF8((const char *)f[i].name, (Py_ssize_t)f[i].name_len,
                                          "surrogateescape");
    PyObject *vals = NULL;
    if (name == NULL) goto fail;
    if (f[i].kind == EMBER_EX_BYTES) {
      uint8_t *data = PyMem_Malloc(f[i].nbytes ? (size_t)f[i].nbytes : 1);
      uint64_t *off = PyMem_Malloc(8 * ((size_t)f[i].count + 1));
      if (data && off && ember_ex_feature_values(&f[i], data, off) == EMBER_OK) {
        vals = PyList_New((Py_ssize_t)f[i].count);
        for (uint64_t k = 0; vals && k < f[i].count; k++) {
          PyObject *b = PyBytes_FromStringAndSize((const char *)data + off[k],
                                                  (Py_ssize_t)(off[k + 1] - off[k]));
          if (b == NULL) Py_CLEAR(vals);
          else PyList_SET_ITEM(vals, (Py_ssize_t)k, b);
        }
      } else {
        PyErr_NoMemory();
      }
      PyMem_Free(data);
      PyMem_Free(off);
    } else {
      size_t isz = f[i].kind == EMBER_EX_FLOAT ? 4 : 8;
      vals = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(isz * f[i].count));
      if (vals) ember_ex_feature_values(&f[i], PyBytes_AS_STRING(vals), NULL);
    }
    if (vals == NULL) {
      Py_DECREF(name);
      goto fail;
    }
    PyObject *t = Py_BuildValue("(iN)", f[i].kind, vals);
    if (t == NULL || PyDict_SetItem(dict, name, t) < 0) {
      Py_XDECREF(t);
      Py_DECREF(name);
      goto fail;
    }
    Py_DECREF(t);
    Py_DECREF(name);
  }
  goto done;
fail:
  Py_CLEAR(dict);
done:
  PyMem_Free(f);
  PyBuffer_Release(&v);
  return dict;
}

PyDoc_STRVAR(encode_examples_doc,
             "encode_examples(columns, nrows) -> list[bytes]\n\n"
             "Serializes each row as a tf.train.Example (columns as for\n"
             "TFRecordWriter.write_examples).");

static PyObject *py_encode_examples(PyObject *module, PyObject *args) {
  PyObject *columns;
  Py_ssize_t nrows;
  if (!PyArg_ParseTuple(args, "On:encode_examples", &columns, &nrows)) return NULL;
  enc_columns c;
  if (enc_parse(columns, nrows, &c) < 0) return NULL;
  PyObject *list = PyList_New(nrows);
  uint8_t *buf = NULL;
  size_t cap = 0, len = 0;
  for (Py_ssize_t row = 0; list != NULL && row < nrows; row++) {
    embpy_err e;
    int rc;
    EMBPY_CALL(rc, &e, encode_row(&c, (uint64_t)row, &buf, &cap, &len));
    if (rc != EMBER_OK) {
      Py_CLEAR(list);
      embpy_raise((ember_state *)PyModule_GetState(module), &e);
      break;
    }
    PyObject *b = PyBytes_FromStringAndSize((const char *)buf, (Py_ssize_t)len);
    if (b == NULL) {
      Py_CLEAR(list);
      break;
    }
    PyList_SET_ITEM(list, row, b);
  }
  PyMem_RawFree(buf);
  enc_release(&c);
  return list;
}

static PyMethodDef tfrecord_functions[] = {
    {"crc32c", py_crc32c, METH_VARARGS, crc32c_doc},
    {"masked_crc32c", py_masked_crc32c, METH_O,
     "masked_crc32c(data) -> int\n\nTFRecord's masked CRC-32C of data."},
    {"crc32c_hw", py_crc32c_hw, METH_NOARGS,
     "crc32c_hw() -> bool\n\nWhether crc32c uses the SSE4.2 instruction."},
    {"example_parse", py_example_parse, METH_O, example_parse_doc},
    {"encode_examples", py_encode_examples, METH_VARARGS, encode_examples_doc},
    {NULL, NULL, 0, NULL},
};

/* ================================================================ exec */

static int add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **slot) {
  *slot = (PyTypeObject *)PyType_FromModuleAndSpec(m, spec, NULL);
  if (*slot == NULL) return -1;
  return PyModule_AddType(m, *slot);
}

static PyObject *new_error_class(const char *name, const char *doc, PyObject *bases, int code) {
  PyObject *dict = Py_BuildValue("{siss}", "code", code, "name", ember_err_name(code));
  if (dict == NULL) return NULL;
  PyObject *exc = PyErr_NewExceptionWithDoc(name, doc, bases, dict);
  Py_DECREF(dict);
  return exc;
}

int embpy_tfrecord_exec(PyObject *m, ember_state *st) {
  if (add_type(m, &Buffer_spec, &st->Buffer_Type) < 0 ||
      add_type(m, &ExampleDecoder_spec, &st->ExampleDecoder_Type) < 0 ||
      add_type(m, &TFRecordReader_spec, &st->TFRecordReader_Type) < 0 ||
      add_type(m, &TFRecordWriter_spec, &st->TFRecordWriter_Type) < 0)
    return -1;
  if (PyModule_AddFunctions(m, tfrecord_functions) < 0) return -1;
  st->EmberCorruptError = new_error_class(
      "ember._ember.EmberCorruptError",
      "Corrupt or truncated data (EMBER_ECORRUPT, EMBER_ETRUNCATED): a bad CRC,\n"
      "a malformed record or Example; the message names the file and offset.",
      st->EmberError, EMBER_ECORRUPT);
  if (st->EmberCorruptError == NULL) return -1;
  PyObject *bases = PyTuple_Pack(2, st->EmberError, PyExc_ValueError);
  if (bases == NULL) return -1;
  st->EmberSchemaError = new_error_class(
      "ember._ember.EmberSchemaError",
      "Data that does not match the expected schema (EMBER_ESCHEMA); the message\n"
      "names the record and the feature.",
      bases, EMBER_ESCHEMA);
  Py_DECREF(bases);
  if (st->EmberSchemaError == NULL) return -1;
  if (PyModule_AddObjectRef(m, "EmberCorruptError", st->EmberCorruptError) < 0 ||
      PyModule_AddObjectRef(m, "EmberSchemaError", st->EmberSchemaError) < 0)
    return -1;
  if (PyModule_AddIntConstant(m, "EX_BYTES", EMBER_EX_BYTES) < 0 ||
      PyModule_AddIntConstant(m, "EX_FLOAT", EMBER_EX_FLOAT) < 0 ||
      PyModule_AddIntConstant(m, "EX_INT64", EMBER_EX_INT64) < 0 ||
      PyModule_AddIntConstant(m, "EX_OPTIONAL", EMBER_EX_OPTIONAL) < 0 ||
      PyModule_AddIntConstant(m, "TFR_GZIP", EMBER_TFR_GZIP) < 0 ||
      PyModule_AddIntConstant(m, "TFR_ZLIB", EMBER_TFR_ZLIB) < 0)
    return -1;
  return 0;
}
