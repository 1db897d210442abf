/* python/ember/_ember.c - module ember._ember: init, state, exceptions,
 * shared helpers (errors, timeouts, handles, column specs) and the
 * module-level functions.  The types live in _ember_rdv.c, _ember_feed.c,
 * _ember_coll.c, _ember_tfrecord.c, _ember_hdfs.c and _ember_ps.c.
 */
#include "_ember.h"

#include <math.h>
#include <stdarg.h>
#include <string.h>

/* ================================================================ errors */

void embpy_err_capture(embpy_err *e, int code) {
  const char *m = ember_last_error();
  if (m == NULL || m[0] == '\0')
    m = ember_strerror(code);
  size_t n = strlen(m);
  if (n >= sizeof e->msg) {
    memcpy(e->msg, m, sizeof e->msg - 4);
    memcpy(e->msg + sizeof e->msg - 4, "...", 4);
  } else {
    memcpy(e->msg, m, n + 1);
  }
  e->code = code;
}

static PyObject *error_class(ember_state *st, int code) {
  switch (code) {
  case EMBER_ETIMEDOUT:
    return st->EmberTimeout;
  case EMBER_EAUTH:
    return st->EmberAuthError;
  case EMBER_EABORTED:
    return st->EmberAborted;
  case EMBER_ECORRUPT:
  case EMBER_ETRUNCATED:
    return st->EmberCorruptError ? st->EmberCorruptError : st->EmberError;
  case EMBER_ESCHEMA:
    return st->EmberSchemaError ? st->EmberSchemaError : st->EmberError;
  default:
    return st->EmberError;
  }
}

/* Sets .code and .name on an exception instance. */
static int set_code_attrs(PyObject *exc, int code) {
  PyObject *v = PyLong_FromLong(code);
  if (v == NULL)
    return -1;
  int r = PyObject_SetAttrString(exc, "code", v);
  Py_DECREF(v);
  if (r < 0)
    return -1;
  v = PyUnicode_FromString(ember_err_name(code));
  if (v == NULL)
    return -1;
  r = PyObject_SetAttrString(exc, "name", v);
  Py_DECREF(v);
  return r;
}

PyObject *embpy_raise(ember_state *st, const embpy_err *e) {
  if (st == NULL) { /* module state not found: PyType_GetModuleByDef set it */
    return NULL;
  }
  PyObject *cls = error_class(st, e->code);
  PyObject *msg = PyUnicode_DecodeUTF8(e->msg, (Py_ssize_t)strlen(e->msg), "replace");
  if (msg == NULL)
    return NULL;
  PyObject *exc = PyObject_CallOneArg(cls, msg);
  Py_DECREF(msg);
  if (exc == NULL)
    return NULL;
  if (set_code_attrs(exc, e->code) < 0) {
    Py_DECREF(exc);
    return NULL;
  }
  PyErr_SetObject(cls, exc);
  Py_DECREF(exc);
  return NULL;
}

PyObject *embpy_chain(PyObject *type, const char *fmt, ...) {
  PyObject *t0, *v0, *tb0;
  PyErr_Fetch(&t0, &v0, &tb0);
  PyErr_NormalizeException(&t0, &v0, &tb0);
  if (v0 != NULL && tb0 != NULL)
    PyException_SetTraceback(v0, tb0);
  Py_XDECREF(t0);
  Py_XDECREF(tb0);

  va_list ap;
  va_start(ap, fmt);
  PyErr_FormatV(type, fmt, ap);
  va_end(ap);

  if (v0 != NULL) {
    PyObject *t1, *v1, *tb1;
    PyErr_Fetch(&t1, &v1, &tb1);
    PyErr_NormalizeException(&t1, &v1, &tb1);
    if (v1 != NULL) {
      Py_INCREF(v0);
      PyException_SetCause(v1, v0);   /* steals */
      PyException_SetContext(v1, v0); /* steals */
    } else {
      Py_DECREF(v0);
    }
    PyErr_Restore(t1, v1, tb1);
  }
  return NULL;
}

/* ================================================================ arguments */

/* About 100 years: far beyond any real wait, far below int64 overflow when
 * the C side adds it to the monotonic clock. */
#define EMBPY_TIMEOUT_MAX_MS 3.2e12

int embpy_timeout_conv(PyObject *obj, void *out_ms) {
  double s = PyFloat_AsDouble(obj);
  if (s == -1.0 && PyErr_Occurred())
    return 0;
  if (isnan(s) || s < 0.0) {
    PyErr_Format(PyExc_ValueError,
                 "timeout must be a non-negative number of seconds, not %R", obj);
    return 0;
  }
  double ms = ceil(s * 1000.0);
  if (ms > EMBPY_TIMEOUT_MAX_MS)
    ms = EMBPY_TIMEOUT_MAX_MS;
  *(int64_t *)out_ms = (int64_t)ms;
  return 1;
}

int embpy_port_conv(PyObject *obj, void *out_port) {
  long v = PyLong_AsLong(obj);
  if (v == -1 && PyErr_Occurred())
    return 0;
  if (v < 0 || v > 65535) {
    PyErr_Format(PyExc_ValueError, "port must be in 0..65535, not %ld", v);
    return 0;
  }
  *(uint16_t *)out_port = (uint16_t)v;
  return 1;
}

/* ================================================================ handles */

int embpy_handle_init(embpy_handle *h, const char *what, void (*destroy)(void *),
                      int want_lock) {
  h->ptr = NULL;
  h->destroy = destroy;
  h->what = what;
  h->closed = 0;
  h->busy = 0;
  h->lock = NULL;
  h->raise = NULL;
  if (want_lock) {
    h->lock = PyThread_allocate_lock();
    if (h->lock == NULL) {
      PyErr_NoMemory();
      return -1;
    }
  }
  return 0;
}

int embpy_handle_enter(embpy_handle *h) {
  if (h->closed || h->ptr == NULL) {
    PyErr_Format(PyExc_ValueError, "%s is closed", h->what);
    return -1;
  }
  h->busy++;
  return 0;
}

/* Destroys the C handle with the GIL released: destroy joins background
 * threads and closes sockets, which must not stall other Python threads. */
static void handle_destroy(embpy_handle *h) {
  void *p = h->ptr;
  h->ptr = NULL; /* before releasing the GIL: nobody else can see it now */
  if (p == NULL || h->destroy == NULL)
    return;
  Py_BEGIN_ALLOW_THREADS
  h->destroy(p);
  Py_END_ALLOW_THREADS
}

void embpy_handle_leave(embpy_handle *h) {
  h->busy--;
  if (h->busy == 0 && h->closed)
    handle_destroy(h);
}

void embpy_handle_close(embpy_handle *h) {
  h->closed = 1;
  if (h->busy == 0)
    handle_destroy(h);
}

void embpy_handle_dealloc(embpy_handle *h) {
  h->closed = 1;
  handle_destroy(h); /* busy is 0: every call in flight holds a reference */
  if (h->lock != NULL) {
    PyThread_free_lock(h->lock);
    h->lock = NULL;
  }
}

int embpy_handle_wait(embpy_handle *h, PyTypeObject *tp, int64_t ms,
                      int (*fn)(void *arg, int64_t slice_ms), void *arg) {
  embpy_err e;
  int rc;
  if (embpy_handle_enter(h) < 0)
    return -1;
  int64_t deadline = ember_deadline_after(ms);
  for (;;) {
    int64_t left = deadline - ember_now_ms();
    if (left < 0)
      left = 0;
    int64_t slice = left > EMBPY_SLICE_MS ? EMBPY_SLICE_MS : left;
    EMBPY_NOGIL(rc, &e, h->lock, fn(arg, slice));
    if (rc != EMBER_ETIMEDOUT || slice == left)
      break;
    if (h->closed) {
      embpy_handle_leave(h);
      PyErr_Format(PyExc_ValueError, "%s is closed", h->what);
      return -1;
    }
    if (PyErr_CheckSignals() < 0) {
      embpy_handle_leave(h);
      return -1;
    }
  }
  embpy_handle_leave(h);
  if (rc == EMBER_ETIMEDOUT)
    return 1;
  if (rc != EMBER_OK) {
    embpy_handle_raise(h, tp, &e);
    return -1;
  }
  return 0;
}

PyObject *embpy_handle_raise(const embpy_handle *h, PyTypeObject *tp, const embpy_err *e) {
  if (h->raise == NULL)
    return embpy_raise(embpy_state_of_type(tp), e);
  return h->raise(PyType_GetModuleByDef(tp, &embpy_module), e);
}

/* ================================================================ columns */

static const char *dtype_name(long dtype) {
  switch (dtype) {
  case EMBER_DT_F32: return "DT_F32";
  case EMBER_DT_F64: return "DT_F64";
  case EMBER_DT_I32: return "DT_I32";
  case EMBER_DT_I64: return "DT_I64";
  case EMBER_DT_U8: return "DT_U8";
  case EMBER_DT_BYTES: return "DT_BYTES";
  case EMBER_DT_BOOL: return "DT_BOOL";
  default: return "?";
  }
}

/* Offsets: 8-byte native-order integers (numpy uint64/int64 export "L"/"l" or
 * "Q"/"q"), or raw bytes holding them (format "B", from .tobytes()). */
static int offsets_format_ok(const Py_buffer *v) {
  const char *f = v->format ? v->format : "B";
  if (v->itemsize == 1)
    return strcmp(f, "B") == 0 || strcmp(f, "b") == 0 || strcmp(f, "c") == 0;
  if (v->itemsize != 8)
    return 0;
  if (*f == '@' || *f == '=' || *f == '<')
    f++;
  return (f[0] == 'Q' || f[0] == 'q' || f[0] == 'L' || f[0] == 'l') && f[1] == '\0';
}

void embpy_columns_release(embpy_columns *c) {
  if (c->views != NULL) {
    for (uint32_t i = 0; i < 2 * c->ncols; i++)
      if (c->views[i].obj != NULL)
        PyBuffer_Release(&c->views[i]);
  }
  if (c->names != NULL) {
    for (uint32_t i = 0; i < c->ncols; i++)
      Py_XDECREF(c->names[i]);
  }
  if (c->copies != NULL) {
    for (uint32_t i = 0; i < c->ncols; i++)
      PyMem_Free(c->copies[i]);
  }
  PyMem_Free(c->cols);
  PyMem_Free(c->views);
  PyMem_Free(c->names);
  PyMem_Free(c->copies);
  memset(c, 0, sizeof *c);
}

/* Parses column i from `spec` into c->cols[i] (c->ncols already counts it, so
 * a failure part-way is cleaned up by embpy_columns_release). */
static int parse_one_column(embpy_columns *c, uint32_t i, PyObject *spec) {
  ember_column *col = &c->cols[i];
  /* A tuple snapshot: the Python code run below (__index__, buffer
   * exporters) cannot change what we are reading. */
  PyObject *fast = PySequence_Tuple(spec);
  if (fast == NULL) {
    embpy_chain(PyExc_TypeError,
                "column %u: expected a tuple (name, dtype, width, data, offsets), "
                "not %.100s",
                i, Py_TYPE(spec)->tp_name);
    return -1;
  }
  int ret = -1;
  if (PyTuple_GET_SIZE(fast) != 5) {
    PyErr_Format(PyExc_ValueError,
                 "column %u: expected a tuple (name, dtype, width, data, offsets), "
                 "got %zd items",
                 i, PyTuple_GET_SIZE(fast));
    goto done;
  }
  PyObject **it = &PyTuple_GET_ITEM(fast, 0);

  /* name */
  if (!PyUnicode_Check(it[0])) {
    PyErr_Format(PyExc_TypeError, "column %u: name must be str, not %.100s", i,
                 Py_TYPE(it[0])->tp_name);
    goto done;
  }
  PyObject *name = it[0];
  Py_ssize_t name_len;
  const char *utf8 = PyUnicode_AsUTF8AndSize(name, &name_len);
  if (utf8 == NULL)
    goto done;
  if (name_len > 255) {
    PyErr_Format(PyExc_ValueError, "column %R: name is longer than 255 UTF-8 bytes",
                 name);
    goto done;
  }
  c->names[i] = Py_NewRef(name); /* keeps utf8 alive even if the list changes */
  col->name = utf8;
  col->name_len = (uint8_t)name_len;

  /* dtype, width */
  long dtype = PyLong_AsLong(it[1]);
  if (dtype == -1 && PyErr_Occurred())
    goto done;
  if (dtype < EMBER_DT_F32 || dtype > EMBER_DT_BOOL) {
    PyErr_Format(PyExc_ValueError, "column %R: unknown dtype %ld", name, dtype);
    goto done;
  }
  col->dtype = (uint8_t)dtype;
  long long width = PyLong_AsLongLong(it[2]);
  if (width == -1 && PyErr_Occurred())
    goto done;
  if (width < 0 || width > (long long)UINT32_MAX) {
    PyErr_Format(PyExc_ValueError, "column %R: width %lld out of range", name, width);
    goto done;
  }

  /* data */
  Py_buffer *dv = &c->views[2 * i];
  if (PyObject_GetBuffer(it[3], dv, PyBUF_C_CONTIGUOUS) < 0) {
    dv->obj = NULL;
    embpy_chain(PyExc_TypeError,
                "column %R: data must be a C-contiguous buffer (bytes, numpy "
                "array, ...), not %.100s",
                name, Py_TYPE(it[3])->tp_name);
    goto done;
  }
  col->data = dv->buf;
  col->data_len = (uint64_t)dv->len;
  col->offsets = NULL;

  if (dtype != EMBER_DT_BYTES) {
    size_t esize = ember_dtype_size((uint8_t)dtype);
    uint64_t need;
    if (__builtin_mul_overflow((uint64_t)c->nrows, (uint64_t)width, &need) ||
        __builtin_mul_overflow(need, (uint64_t)esize, &need)) {
      PyErr_Format(PyExc_ValueError, "column %R: nrows %u x width %lld overflows",
                   name, c->nrows, width);
      goto done;
    }
    if ((uint64_t)dv->len != need) {
      PyErr_Format(PyExc_ValueError,
                   "column %R: data has %zd bytes, expected %llu (nrows %u x "
                   "width %lld x %zu-byte %s)",
                   name, dv->len, (unsigned long long)need, c->nrows, width, esize,
                   dtype_name(dtype));
      goto done;
    }
    if (it[4] != Py_None) {
      PyErr_Format(PyExc_ValueError,
                   "column %R: offsets are only for DT_BYTES columns (pass None)",
                   name);
      goto done;
    }
    col->width = (uint32_t)width;
  } else {
    col->width = 0; /* BYTES columns have no width on the wire */
    if (it[4] == Py_None) {
      PyErr_Format(PyExc_ValueError,
                   "column %R: DT_BYTES needs offsets (nrows + 1 uint64 values)",
                   name);
      goto done;
    }
    Py_buffer *ov = &c->views[2 * i + 1];
    if (PyObject_GetBuffer(it[4], ov, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
      ov->obj = NULL;
      embpy_chain(PyExc_TypeError,
                  "column %R: offsets must be a C-contiguous buffer of uint64, "
                  "not %.100s",
                  name, Py_TYPE(it[4])->tp_name);
      goto done;
    }
    if (!offsets_format_ok(ov)) {
      PyErr_Format(PyExc_ValueError,
                   "column %R: offsets must be 8-byte integers (uint64), got "
                   "format '%s'",
                   name, ov->format ? ov->format : "B");
      goto done;
    }
    uint64_t need = ((uint64_t)c->nrows + 1) * 8u;
    if ((uint64_t)ov->len != need) {
      PyErr_Format(PyExc_ValueError,
                   "column %R: offsets have %zd bytes, expected %llu (nrows + 1 = "
                   "%llu uint64 values)",
                   name, ov->len, (unsigned long long)need,
                   (unsigned long long)c->nrows + 1);
      goto done;
    }
    if (((uintptr_t)ov->buf & 7u) != 0) {
      /* libember reads offsets as uint64_t: give it an aligned copy. */
      c->copies[i] = PyMem_Malloc((size_t)need);
      if (c->copies[i] == NULL) {
        PyErr_NoMemory();
        goto done;
      }
      memcpy(c->copies[i], ov->buf, (size_t)need);
      col->offsets = c->copies[i];
    } else {
      col->offsets = (const uint64_t *)ov->buf;
    }
  }
  ret = 0;
done:
  Py_DECREF(fast);
  return ret;
}

int embpy_columns_parse(PyObject *columns, Py_ssize_t nrows, embpy_columns *out) {
  memset(out, 0, sizeof *out);
  if (nrows < 0 || (unsigned long long)nrows > UINT32_MAX) {
    PyErr_Format(PyExc_ValueError, "nrows must be in 0..%u, not %zd", UINT32_MAX,
                 nrows);
    return -1;
  }
  PyObject *fast = PySequence_Tuple(columns); /* a snapshot, as above */
  if (fast == NULL) {
    embpy_chain(PyExc_TypeError,
                "columns must be a sequence of (name, dtype, width, data, offsets), "
                "not %.100s",
                Py_TYPE(columns)->tp_name);
    return -1;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(fast);
  if (n > (Py_ssize_t)EMBER_BATCH_MAX_COLS) {
    PyErr_Format(PyExc_ValueError, "too many columns: %zd (at most %u)", n,
                 EMBER_BATCH_MAX_COLS);
    Py_DECREF(fast);
    return -1;
  }
  out->nrows = (uint32_t)nrows;
  size_t cap = n > 0 ? (size_t)n : 1;
  out->cols = PyMem_Calloc(cap, sizeof *out->cols);
  out->views = PyMem_Calloc(2 * cap, sizeof *out->views);
  out->names = PyMem_Calloc(cap, sizeof *out->names);
  out->copies = PyMem_Calloc(cap, sizeof *out->copies);
  if (!out->cols || !out->views || !out->names || !out->copies) {
    PyErr_NoMemory();
    goto err;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    out->ncols = (uint32_t)i + 1; /* so release() cleans column i too */
    if (parse_one_column(out, (uint32_t)i, PyTuple_GET_ITEM(fast, i)) < 0)
      goto err;
  }
  Py_DECREF(fast);
  return 0;
err:
  Py_DECREF(fast);
  embpy_columns_release(out);
  return -1;
}

/* ================================================================ decoding */

int embpy_decode(const uint8_t *buf, size_t len, embpy_decoded *out) {
  memset(out, 0, sizeof *out);
  /* Size the descriptor array from the batch header; the decoder itself
   * checks ncols against this bound. */
  uint32_t want = len >= 8 ? ember_wire_get_u32(buf + 4) : 0;
  if (want > EMBER_BATCH_MAX_COLS)
    want = EMBER_BATCH_MAX_COLS;
  out->cols = PyMem_RawCalloc(want ? want : 1, sizeof *out->cols);
  if (out->cols == NULL)
    return EMBER_ENOMEM;
  int rc = ember_batch_decode(buf, len, out->cols, want, &out->ncols, &out->nrows);
  if (rc != EMBER_OK) {
    PyMem_RawFree(out->cols);
    out->cols = NULL;
    out->ncols = out->nrows = 0;
  }
  return rc;
}

void embpy_decoded_free(embpy_decoded *d) {
  PyMem_RawFree(d->cols);
  d->cols = NULL;
  d->ncols = 0;
}

PyObject *embpy_decoded_to_list(const uint8_t *base, const embpy_decoded *d) {
  PyObject *list = PyList_New(d->ncols);
  if (list == NULL)
    return NULL;
  for (uint32_t i = 0; i < d->ncols; i++) {
    const ember_column *c = &d->cols[i];
    long long off = c->data ? (long long)((const uint8_t *)c->data - base) : 0;
    long long ooff = -1;
    if (c->dtype == EMBER_DT_BYTES && c->offsets != NULL)
      ooff = (long long)((const uint8_t *)c->offsets - base);
    PyObject *name =
        PyUnicode_DecodeUTF8(c->name ? c->name : "", c->name ? c->name_len : 0, "replace");
    if (name == NULL)
      goto err;
    PyObject *t = Py_BuildValue("(NIILKL)", name, (unsigned int)c->dtype,
                                (unsigned int)c->width, off,
                                (unsigned long long)c->data_len, ooff);
    if (t == NULL)
      goto err;
    PyList_SET_ITEM(list, i, t);
  }
  return list;
err:
  Py_DECREF(list);
  return NULL;
}

/* ================================================================ functions */

static ember_state *module_state(PyObject *m) {
  return (ember_state *)PyModule_GetState(m);
}

PyDoc_STRVAR(random_secret_doc,
             "random_secret() -> bytes\n\n"
             "32 cryptographically random bytes, for a per-job secret.");

static PyObject *random_secret(PyObject *module, PyObject *Py_UNUSED(ignored)) {
  uint8_t buf[EMBER_SECRET_LEN];
  embpy_err err;
  int rc;
  EMBPY_NOGIL(rc, &err, NULL, ember_auth_random(buf, sizeof buf));
  if (rc != EMBER_OK)
    return embpy_raise(module_state(module), &err);
  return PyBytes_FromStringAndSize((const char *)buf, sizeof buf);
}

PyDoc_STRVAR(reserve_port_doc,
             "reserve_port(host='', listen=False, backlog=4096) -> (fd, port)\n\n"
             "Binds a free TCP port with SO_REUSEPORT and returns the socket fd\n"
             "(the caller owns it) and the port.  The socket only listens when\n"
             "listen is true; a bound socket that does not listen reserves the\n"
             "port without receiving connections.  The backlog is large (the\n"
             "kernel caps it at net.core.somaxconn) so that strangers queued\n"
             "before the server starts cannot make the kernel drop real peers'\n"
             "connections.");

static PyObject *reserve_port(PyObject *module, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"host", "listen", "backlog", NULL};
  const char *host = "";
  int listen = 0, backlog = 4096;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|spi:reserve_port", kwlist, &host,
                                   &listen, &backlog))
    return NULL;
  if (listen && backlog <= 0) {
    PyErr_SetString(PyExc_ValueError, "backlog must be positive");
    return NULL;
  }
  int fd = -1;
  uint16_t port = 0;
  embpy_err err;
  int rc;
  EMBPY_NOGIL(rc, &err, NULL,
              ember_net_bind(host, 0, listen ? backlog : 0, EMBER_NET_REUSEPORT, &fd, &port));
  if (rc != EMBER_OK)
    return embpy_raise(module_state(module), &err);
  return Py_BuildValue("(ii)", fd, (int)port);
}

PyDoc_STRVAR(encode_batch_doc,
             "encode_batch(columns, nrows) -> bytes\n\n"
             "Encodes columns (a sequence of (name, dtype, width, data, offsets))\n"
             "of nrows rows into one batch, the payload format of the feed.");

static PyObject *encode_batch(PyObject *module, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"columns", "nrows", NULL};
  PyObject *columns;
  Py_ssize_t nrows;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On:encode_batch", kwlist, &columns,
                                   &nrows))
    return NULL;
  embpy_columns cs;
  if (embpy_columns_parse(columns, nrows, &cs) < 0)
    return NULL;
  PyObject *result = NULL;
  embpy_err err;
  int rc;
  size_t size = 0, written = 0;
  EMBPY_CALL(rc, &err, ember_batch_encoded_size(cs.cols, cs.ncols, cs.nrows, &size));
  if (rc != EMBER_OK) {
    embpy_raise(module_state(module), &err);
    goto done;
  }
  if (size > (size_t)PY_SSIZE_T_MAX) {
    PyErr_NoMemory();
    goto done;
  }
  result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
  if (result == NULL)
    goto done;
  uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
  if (size >= EMBPY_NOGIL_BYTES)
    EMBPY_NOGIL(rc, &err, NULL,
                ember_batch_encode(cs.cols, cs.ncols, cs.nrows, out, size, &written));
  else
    EMBPY_CALL(rc, &err, ember_batch_encode(cs.cols, cs.ncols, cs.nrows, out, size, &written));
  if (rc != EMBER_OK) {
    Py_CLEAR(result);
    embpy_raise(module_state(module), &err);
    goto done;
  }
  if (written != size && _PyBytes_Resize(&result, (Py_ssize_t)written) < 0)
    goto done;
done:
  embpy_columns_release(&cs);
  return result;
}

PyDoc_STRVAR(decode_batch_doc,
             "decode_batch(data) -> (nrows, columns)\n\n"
             "Decodes a batch.  columns is a list of (name, dtype, width, offset,\n"
             "nbytes, offsets_offset): byte offsets into data of each column's\n"
             "values (for DT_BYTES: of its data bytes, nbytes long, and of its\n"
             "nrows + 1 uint64 offsets; offsets_offset is -1 otherwise).");

static PyObject *decode_batch(PyObject *module, PyObject *arg) {
  Py_buffer view;
  if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
    return NULL;
  const uint8_t *buf = view.buf;
  uint8_t *copy = NULL;
  PyObject *result = NULL;
  size_t len = (size_t)view.len;
  if (((uintptr_t)buf & 7u) != 0) {
    /* The decoder validates uint64 offsets in place: give it an 8-aligned
     * copy.  Offsets returned are relative, so they hold for the original. */
    copy = PyMem_Malloc(len ? len : 1);
    if (copy == NULL) {
      PyErr_NoMemory();
      goto done;
    }
    memcpy(copy, buf, len);
    buf = copy;
  }
  embpy_decoded d;
  embpy_err err;
  int rc;
  if (len >= EMBPY_NOGIL_BYTES)
    EMBPY_NOGIL(rc, &err, NULL, embpy_decode(buf, len, &d));
  else
    EMBPY_CALL(rc, &err, embpy_decode(buf, len, &d));
  if (rc != EMBER_OK) {
    embpy_raise(module_state(module), &err);
    goto done;
  }
  PyObject *cols = embpy_decoded_to_list(buf, &d);
  uint32_t nrows = d.nrows;
  embpy_decoded_free(&d);
  if (cols == NULL)
    goto done;
  result = Py_BuildValue("(IN)", (unsigned int)nrows, cols);
done:
  PyMem_Free(copy);
  PyBuffer_Release(&view);
  return result;
}

static PyMethodDef module_methods[] = {
    {"random_secret", random_secret, METH_NOARGS, random_secret_doc},
    {"reserve_port", (PyCFunction)(void (*)(void))reserve_port,
     METH_VARARGS | METH_KEYWORDS, reserve_port_doc},
    {"encode_batch", (PyCFunction)(void (*)(void))encode_batch,
     METH_VARARGS | METH_KEYWORDS, encode_batch_doc},
    {"decode_batch", decode_batch, METH_O, decode_batch_doc},
    {NULL, NULL, 0, NULL},
};

/* ================================================================ module */

/* Creates one exception class with class-level defaults for .code/.name
 * (instances raised by the extension always carry their own). */
static PyObject *new_exception(const char *name, const char *doc, PyObject *bases,
                               PyObject *code, const char *code_name) {
  PyObject *dict = PyDict_New();
  if (dict == NULL)
    return NULL;
  PyObject *cname = code_name ? PyUnicode_FromString(code_name) : Py_NewRef(Py_None);
  if (cname == NULL || PyDict_SetItemString(dict, "code", code) < 0 ||
      PyDict_SetItemString(dict, "name", cname) < 0) {
    Py_XDECREF(cname);
    Py_DECREF(dict);
    return NULL;
  }
  Py_DECREF(cname);
  PyObject *exc = PyErr_NewExceptionWithDoc(name, doc, bases, dict);
  Py_DECREF(dict);
  return exc;
}

/* ember.errors.EmberError, the base of every Ember exception: defined in
 * Python so that the Python layer's errors and this module's share it (one
 * class, so `except EmberError` means any Ember error).  Instances raised here
 * carry .code and .name (set_code_attrs); the Python layer's have None. */
static PyObject *python_base(void) {
  PyObject *mod = PyImport_ImportModule("ember.errors");
  if (mod == NULL)
    return NULL;
  PyObject *base = PyObject_GetAttrString(mod, "EmberError");
  Py_DECREF(mod);
  if (base != NULL && !PyExceptionClass_Check(base)) {
    PyErr_SetString(PyExc_ImportError, "ember.errors.EmberError is not an exception class");
    Py_CLEAR(base);
  }
  return base;
}

static int add_exceptions(PyObject *m, ember_state *st) {
  PyObject *code = NULL, *bases = NULL;
  st->EmberError = python_base();
  if (st->EmberError == NULL)
    return -1;

  bases = PyTuple_Pack(2, st->EmberError, PyExc_TimeoutError);
  code = PyLong_FromLong(EMBER_ETIMEDOUT);
  if (bases == NULL || code == NULL)
    goto err;
  st->EmberTimeout = new_exception("ember._ember.EmberTimeout",
                                   "A libember wait ran past its timeout (EMBER_ETIMEDOUT).",
                                   bases, code, "EMBER_ETIMEDOUT");
  Py_CLEAR(bases);
  Py_CLEAR(code);
  if (st->EmberTimeout == NULL)
    goto err;

  code = PyLong_FromLong(EMBER_EAUTH);
  if (code == NULL)
    goto err;
  st->EmberAuthError = new_exception(
      "ember._ember.EmberAuthError",
      "The peer did not prove knowledge of the job secret (EMBER_EAUTH).",
      st->EmberError, code, "EMBER_EAUTH");
  Py_CLEAR(code);
  if (st->EmberAuthError == NULL)
    goto err;

  code = PyLong_FromLong(EMBER_EABORTED);
  if (code == NULL)
    goto err;
  st->EmberAborted = new_exception(
      "ember._ember.EmberAborted",
      "Aborted by the peer or by a stop request (EMBER_EABORTED), e.g. the\n"
      "trainer terminated the feed.",
      st->EmberError, code, "EMBER_EABORTED");
  Py_CLEAR(code);
  if (st->EmberAborted == NULL)
    goto err;

  if (PyModule_AddObjectRef(m, "EmberError", st->EmberError) < 0 ||
      PyModule_AddObjectRef(m, "EmberTimeout", st->EmberTimeout) < 0 ||
      PyModule_AddObjectRef(m, "EmberAuthError", st->EmberAuthError) < 0 ||
      PyModule_AddObjectRef(m, "EmberAborted", st->EmberAborted) < 0)
    return -1;
  return 0;
err:
  Py_XDECREF(bases);
  Py_XDECREF(code);
  return -1;
}

#if defined(__clang__)
#define EMBER_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define EMBER_COMPILER "gcc " __VERSION__
#else
#define EMBER_COMPILER "unknown compiler"
#endif

/* An extension built from other sources than the package beside it would
 * speak another wire format or miss functions: refuse it at import. */
static int check_package_version(void) {
  PyObject *mod = PyImport_ImportModule("ember._version");
  if (mod == NULL)
    return -1;
  PyObject *ver = PyObject_GetAttrString(mod, "__version__");
  Py_DECREF(mod);
  if (ver == NULL)
    return -1;
  const char *s = PyUnicode_Check(ver) ? PyUnicode_AsUTF8(ver) : NULL;
  int ok = s != NULL && strcmp(s, EMBER_VERSION) == 0;
  if (!ok && !PyErr_Occurred())
    PyErr_Format(PyExc_ImportError,
                 "ember's C extension is version %s but the ember package beside it is "
                 "version %R; reinstall Ember (pip install, or `make build` in a checkout)",
                 EMBER_VERSION, ver);
  Py_DECREF(ver);
  return ok ? 0 : -1;
}

static int module_exec(PyObject *m) {
  ember_state *st = module_state(m);
  if (check_package_version() < 0)
    return -1;
  if (PyModule_AddStringConstant(m, "__version__", EMBER_VERSION) < 0 ||
      PyModule_AddStringConstant(m, "COMPILER", EMBER_COMPILER) < 0 ||
      PyModule_AddIntConstant(m, "DT_F32", EMBER_DT_F32) < 0 ||
      PyModule_AddIntConstant(m, "DT_F64", EMBER_DT_F64) < 0 ||
      PyModule_AddIntConstant(m, "DT_I32", EMBER_DT_I32) < 0 ||
      PyModule_AddIntConstant(m, "DT_I64", EMBER_DT_I64) < 0 ||
      PyModule_AddIntConstant(m, "DT_U8", EMBER_DT_U8) < 0 ||
      PyModule_AddIntConstant(m, "DT_BYTES", EMBER_DT_BYTES) < 0 ||
      PyModule_AddIntConstant(m, "DT_BOOL", EMBER_DT_BOOL) < 0)
    return -1;
  if (add_exceptions(m, st) < 0)
    return -1;
  if (embpy_rdv_exec(m, st) < 0 || embpy_feed_exec(m, st) < 0 || embpy_tfrecord_exec(m, st) < 0)
    return -1;
  if (embpy_coll_exec(m, st) < 0)
    return -1;
  if (embpy_hdfs_exec(m, st) < 0)
    return -1;
  if (embpy_records_exec(m, st) < 0)
    return -1;
  if (embpy_ps_exec(m, st) < 0) /* after tfrecord's: ps errors use EmberSchemaError */
    return -1;
  return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
  ember_state *st = module_state(m);
  Py_VISIT(st->EmberError);
  Py_VISIT(st->EmberTimeout);
  Py_VISIT(st->EmberAuthError);
  Py_VISIT(st->EmberAborted);
  Py_VISIT(st->RendezvousServer_Type);
  Py_VISIT(st->RendezvousClient_Type);
  Py_VISIT(st->FeedServer_Type);
  Py_VISIT(st->FeedClient_Type);
  Py_VISIT(st->FeedItem_Type);
  Py_VISIT(st->EmberCorruptError);
  Py_VISIT(st->EmberSchemaError);
  Py_VISIT(st->Buffer_Type);
  Py_VISIT(st->ExampleDecoder_Type);
  Py_VISIT(st->TFRecordReader_Type);
  Py_VISIT(st->TFRecordWriter_Type);
  Py_VISIT(st->Communicator_Type);
  Py_VISIT(st->PsServer_Type);
  Py_VISIT(st->PsClient_Type);
  Py_VISIT(st->np_types);
  Py_VISIT(st->PickledRecords_Type);
  Py_VISIT(st->np_empty);
  return 0;
}

static int module_clear(PyObject *m) {
  ember_state *st = module_state(m);
  Py_CLEAR(st->EmberError);
  Py_CLEAR(st->EmberTimeout);
  Py_CLEAR(st->EmberAuthError);
  Py_CLEAR(st->EmberAborted);
  Py_CLEAR(st->RendezvousServer_Type);
  Py_CLEAR(st->RendezvousClient_Type);
  Py_CLEAR(st->FeedServer_Type);
  Py_CLEAR(st->FeedClient_Type);
  Py_CLEAR(st->FeedItem_Type);
  Py_CLEAR(st->EmberCorruptError);
  Py_CLEAR(st->EmberSchemaError);
  Py_CLEAR(st->Buffer_Type);
  Py_CLEAR(st->ExampleDecoder_Type);
  Py_CLEAR(st->TFRecordReader_Type);
  Py_CLEAR(st->TFRecordWriter_Type);
  Py_CLEAR(st->Communicator_Type);
  Py_CLEAR(st->PsServer_Type);
  Py_CLEAR(st->PsClient_Type);
  Py_CLEAR(st->np_types);
  Py_CLEAR(st->PickledRecords_Type);
  Py_CLEAR(st->np_empty);
  return 0;
}

static void module_free(void *m) { module_clear((PyObject *)m); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc,
             "ember._ember - the CPython binding of libember (rendezvous, feed,\n"
             "batch codec).  The pure-Python package ember wraps it.");

PyModuleDef embpy_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ember._ember",
    .m_doc = module_doc,
    .m_size = sizeof(ember_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__ember(void) { return PyModuleDef_Init(&embpy_module); }
