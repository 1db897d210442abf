/* python/ember/_ember_ps.c - PsServer and PsClient: the parameter server of
 * libember (ps.h) on Python buffers.
 *
 * Bulk data goes through the buffer protocol without a copy: pull() fills a
 * float32 array (a new numpy array, or the caller's `out`) in place with the
 * GIL released, and push() hands the caller's gradient buffer straight to
 * libember.  Row ids are any C-contiguous buffer of 8-byte integers (numpy
 * uint64 or int64) or a sequence of ints.
 *
 * The binding keeps the (layout, rows, cols) of every table its client
 * declared: pulling or pushing a whole dense table needs its row count to
 * size the array, and a push checks its gradients' shape against the
 * table's, which libember cannot do from a bare float pointer.  libember's
 * client keeps the same specs (and refuses an undeclared table itself).
 *
 * Thread-safety: a server is thread-safe in C (one thread per connection),
 * so PsServer needs no lock: stats() or save() may run while another thread
 * restores.  A client is used by one thread at a time in C, so PsClient
 * serializes its calls with a per-object lock.  A pull that waits for a
 * slower worker (bounded staleness) waits without the GIL: the other Python
 * threads, the slower worker's included, keep running.  close() from another
 * thread aborts a call in flight (ember_ps_client_abort: it raises
 * EmberAborted at once), then closes.
 *
 * A client on the same host as a shard talks to it through shared memory
 * (ps.h, "Transport"; PsClient's shm); `transports` says which shards do.
 */
#include "_ember.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ember/ps.h"

static PyObject *self_enter(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  return Py_NewRef(self);
}

static int Handle_traverse(PyObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  return 0;
}

static int check_u32(Py_ssize_t v, const char *what, uint32_t *out) {
  if (v < 0 || (unsigned long long)v > UINT32_MAX) {
    PyErr_Format(PyExc_ValueError, "%s must be in 0..%u, not %zd", what, UINT32_MAX, v);
    return -1;
  }
  *out = (uint32_t)v;
  return 0;
}

/* "O&" converter: a non-negative int below 2**64 into uint64_t. */
static int u64_conv(PyObject *obj, void *out) {
  PyObject *idx = PyNumber_Index(obj);
  if (idx == NULL)
    return 0;
  unsigned long long v = PyLong_AsUnsignedLongLong(idx);
  Py_DECREF(idx);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) {
    if (PyErr_ExceptionMatches(PyExc_OverflowError))
      embpy_chain(PyExc_ValueError, "%R is not in 0..2**64-1", obj);
    return 0;
  }
  *(uint64_t *)out = (uint64_t)v;
  return 1;
}

/* A failure this binding finds before calling libember, raised as libember
 * would raise it (the class embpy_raise maps `code` to, with .code and
 * .name): a caller sees one error whichever side checked. */
static PyObject *raise_status(PyTypeObject *tp, int code, const char *fmt, ...) {
  embpy_err e;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e.msg, sizeof e.msg, fmt, ap);
  va_end(ap);
  e.code = code;
  return embpy_raise(embpy_state_of_type(tp), &e);
}

/* A keyword argument spelled as a name: index of s in names (count). */
static int parse_choice(const char *s, const char *what, const char *const *names,
                        uint32_t count, uint32_t *out) {
  for (uint32_t i = 0; i < count; i++)
    if (strcmp(s, names[i]) == 0) {
      *out = i;
      return 0;
    }
  char allowed[128] = "";
  size_t at = 0;
  for (uint32_t i = 0; i < count && at < sizeof allowed; i++) {
    int w = snprintf(allowed + at, sizeof allowed - at, "%s'%s'",
                     i == 0 ? "" : i + 1 == count ? " or " : ", ", names[i]);
    if (w < 0)
      break;
    at += (size_t)w;
  }
  PyErr_Format(PyExc_ValueError, "%s must be %s, not '%s'", what, allowed, s);
  return -1;
}

/* In ember_ps_layout / _optimizer_kind / _init_kind order. */
static const char *const layout_names[] = {"dense", "sparse"};
static const char *const optimizer_names[] = {"sgd", "momentum", "adagrad", "adam"};
static const char *const init_names[] = {"zeros", "uniform", "normal"};

/* A struct-module format without its native / little-endian prefix (the
 * hosts libember builds for are little-endian). */
static const char *bare_format(const Py_buffer *v) {
  const char *f = v->format ? v->format : "B";
  if (*f == '@' || *f == '=' || *f == '<')
    f++;
  return f;
}

static int is_float32(const Py_buffer *v) {
  const char *f = bare_format(v);
  return v->itemsize == 4 && f[0] == 'f' && f[1] == '\0';
}

/* "(4, 3)": a buffer's shape, for messages. */
static void shape_str(const Py_buffer *v, char *out, size_t cap) {
  size_t at = 0;
  out[0] = '\0';
  if (v->shape == NULL || v->ndim < 1) {
    snprintf(out, cap, "(%zd,)", v->len / (v->itemsize ? v->itemsize : 1));
    return;
  }
  for (int i = 0; i < v->ndim && at < cap; i++) {
    int w = snprintf(out + at, cap - at, "%s%zd%s", i == 0 ? "(" : ", ", v->shape[i],
                     i + 1 == v->ndim ? (v->ndim == 1 ? ",)" : ")") : "");
    if (w < 0)
      break;
    at += (size_t)w;
  }
}

/* ================================================================ row ids */

typedef struct {
  Py_buffer view;      /* the ids' buffer; view.obj NULL when none */
  uint64_t *copy;      /* PyMem: ids from a sequence, or an aligned copy */
  const uint64_t *ids; /* NULL: the whole (dense) table */
  size_t n;
} row_ids;

static void row_ids_release(row_ids *r) {
  if (r->view.obj != NULL)
    PyBuffer_Release(&r->view);
  PyMem_Free(r->copy);
  r->copy = NULL;
  r->ids = NULL;
}

/* ids from a buffer of 8-byte integers; signed ones must not be negative. */
static int row_ids_from_buffer(PyObject *obj, row_ids *r) {
  if (PyObject_GetBuffer(obj, &r->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    r->view.obj = NULL;
    embpy_chain(PyExc_TypeError,
                "ids must be a C-contiguous buffer of uint64 or int64 row ids (a numpy "
                "array) or a sequence of ints, not %.100s",
                Py_TYPE(obj)->tp_name);
    return -1;
  }
  const char *f = bare_format(&r->view);
  int is_unsigned = f[0] == 'Q' || f[0] == 'L';
  int is_signed = f[0] == 'q' || f[0] == 'l';
  if (r->view.itemsize != 8 || !(is_unsigned || is_signed) || f[1] != '\0') {
    PyErr_Format(PyExc_TypeError,
                 "ids must hold 8-byte integers (numpy uint64 or int64), got format '%s' "
                 "(itemsize %zd)",
                 r->view.format ? r->view.format : "B", r->view.itemsize);
    return -1;
  }
  r->n = (size_t)r->view.len / 8;
  r->ids = r->view.buf;
  if (((uintptr_t)r->view.buf & 7u) != 0) {
    /* libember reads ids as uint64_t: give it an aligned copy. */
    r->copy = PyMem_Malloc(r->n ? r->n * 8 : 8);
    if (r->copy == NULL) {
      PyErr_NoMemory();
      return -1;
    }
    memcpy(r->copy, r->view.buf, r->n * 8);
    r->ids = r->copy;
  }
  if (is_signed) {
    for (size_t i = 0; i < r->n; i++)
      if ((int64_t)r->ids[i] < 0) {
        PyErr_Format(PyExc_ValueError, "ids[%zu] is %lld: row ids are >= 0", i,
                     (long long)(int64_t)r->ids[i]);
        return -1;
      }
  }
  return 0;
}

static int row_ids_from_sequence(PyObject *obj, row_ids *r) {
  PyObject *fast = PySequence_Fast(obj, "ids must be None, a buffer of uint64 or int64 "
                                        "row ids (a numpy array) or a sequence of ints");
  if (fast == NULL)
    return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  int ret = -1;
  r->copy = PyMem_Malloc(n ? (size_t)n * 8 : 8);
  if (r->copy == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *idx = PyNumber_Index(PySequence_Fast_GET_ITEM(fast, i));
    if (idx == NULL) {
      embpy_chain(PyExc_TypeError, "ids[%zd] is not an int", i);
      goto done;
    }
    int overflow = 0;
    long long s = PyLong_AsLongLongAndOverflow(idx, &overflow);
    unsigned long long u = (unsigned long long)s;
    if (overflow > 0)
      u = PyLong_AsUnsignedLongLong(idx); /* 2**63..2**64-1, or OverflowError */
    Py_DECREF(idx);
    if (PyErr_Occurred())
      goto done;
    if (overflow < 0 || (overflow == 0 && s < 0)) {
      PyErr_Format(PyExc_ValueError, "ids[%zd] is negative: row ids are >= 0", i);
      goto done;
    }
    r->copy[i] = (uint64_t)u;
  }
  r->ids = r->copy;
  r->n = (size_t)n;
  ret = 0;
done:
  Py_DECREF(fast);
  return ret;
}

/* None (ids NULL: the whole table), a buffer, or a sequence of ints.  0, or
 * -1 with an exception (nothing to release). */
static int row_ids_parse(PyObject *obj, row_ids *r) {
  static const uint64_t none_yet; /* ids of an empty buffer: not NULL, which means "whole" */
  memset(r, 0, sizeof *r);
  if (obj == Py_None)
    return 0;
  int rc;
  if (PyObject_CheckBuffer(obj)) {
    rc = row_ids_from_buffer(obj, r);
  } else if (PyUnicode_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "ids must be row ids, not a str");
    rc = -1;
  } else {
    rc = row_ids_from_sequence(obj, r);
  }
  if (rc < 0) {
    row_ids_release(r);
    return -1;
  }
  if (r->ids == NULL)
    r->ids = &none_yet;
  return 0;
}

/* ================================================================ PsServer */

typedef struct {
  PyObject_HEAD
  embpy_handle h; /* no lock: the C server is thread-safe */
  uint16_t port;
} PsServerObject;

static void ps_server_destroy(void *p) { ember_ps_server_destroy(p); }

static PyObject *PsServer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"secret",    "shard", "num_shards", "num_workers", "staleness",
                           "host",      "port",  "listen_fd",  "encrypt",     "shm",
                           NULL};
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL)
    return NULL;
  Py_buffer secret;
  Py_ssize_t shard, num_shards, num_workers;
  PyObject *staleness = Py_None;
  const char *host = "";
  uint16_t port = 0;
  int listen_fd = -1, encrypt = 0, shm = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*nnn|$OsO&ipp:PsServer", kwlist, &secret,
                                   &shard, &num_shards, &num_workers, &staleness, &host,
                                   embpy_port_conv, &port, &listen_fd, &encrypt, &shm))
    return NULL;
  PsServerObject *self = NULL;
  ember_ps_server_config cfg;
  memset(&cfg, 0, sizeof cfg);
  if (check_u32(shard, "shard", &cfg.shard) < 0 ||
      check_u32(num_shards, "num_shards", &cfg.num_shards) < 0 ||
      check_u32(num_workers, "num_workers", &cfg.num_workers) < 0)
    goto err;
  if (staleness == Py_None) {
    cfg.staleness = EMBER_PS_ASYNC;
  } else {
    Py_ssize_t s = PyNumber_AsSsize_t(staleness, PyExc_OverflowError);
    if (s == -1 && PyErr_Occurred()) {
      embpy_chain(PyExc_TypeError, "staleness must be None (asynchronous) or an int in 0..%u",
                  EMBER_PS_ASYNC);
      goto err;
    }
    if (check_u32(s, "staleness", &cfg.staleness) < 0)
      goto err;
  }
  cfg.secret = secret.buf;
  cfg.secret_len = (size_t)secret.len;
  cfg.listen_fd = listen_fd < 0 ? -1 : listen_fd;
  cfg.bind_host = host;
  cfg.port = port;
  cfg.encrypt = encrypt;
  cfg.disable_shm = !shm;

  self = (PsServerObject *)type->tp_alloc(type, 0);
  if (self == NULL)
    goto err;
  if (embpy_handle_init(&self->h, "PsServer", ps_server_destroy, 0) < 0)
    goto err;
  listen_fd = -1; /* ember_ps_server_create owns it now, whatever happens */
  ember_ps_server *s = NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_ps_server_create(&s, &cfg));
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto err;
  }
  self->port = ember_ps_server_port(s);
  self->h.ptr = s;
  PyBuffer_Release(&secret);
  return (PyObject *)self;
err:
  if (listen_fd >= 0)
    ember_net_close(listen_fd); /* documented: the fd is taken over */
  PyBuffer_Release(&secret);
  Py_XDECREF(self);
  return NULL;
}

static void PsServer_dealloc(PyObject *op) {
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&((PsServerObject *)op)->h);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static PyObject *PsServer_port(PyObject *op, void *closure) {
  PsServerObject *self = (PsServerObject *)op;
  if (self->h.closed || self->h.ptr == NULL) {
    PyErr_SetString(PyExc_ValueError, "PsServer is closed");
    return NULL;
  }
  return PyLong_FromLong(self->port);
}

PyDoc_STRVAR(PsServer_stats_doc,
             "stats() -> dict\n\n"
             "This shard's counters: tables, rows_held (rows materialised here),\n"
             "pulls, pushes, rows_pulled, rows_pushed, bytes_received, bytes_sent\n"
             "(request and reply payloads), requests_refused, stale_waits (pulls\n"
             "that waited for a slower worker) and min_clock (the slowest live\n"
             "worker's clock; 2**64-1 once every worker finished),\n"
             "workers_connected (worker connections open now) and shm_connections\n"
             "(those of them on shared memory).");

static PyObject *PsServer_stats(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  PsServerObject *self = (PsServerObject *)op;
  ember_ps_stats s;
  memset(&s, 0, sizeof s);
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), (ember_ps_server_stats(self->h.ptr, &s), EMBER_OK));
  if (ok < 0)
    return NULL;
  return Py_BuildValue(
      "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "tables",
      (unsigned long long)s.tables,
      "rows_held", (unsigned long long)s.rows_held, "pulls", (unsigned long long)s.pulls,
      "pushes", (unsigned long long)s.pushes, "rows_pulled", (unsigned long long)s.rows_pulled,
      "rows_pushed", (unsigned long long)s.rows_pushed, "bytes_received",
      (unsigned long long)s.bytes_received, "bytes_sent", (unsigned long long)s.bytes_sent,
      "requests_refused", (unsigned long long)s.requests_refused, "stale_waits",
      (unsigned long long)s.stale_waits, "min_clock", (unsigned long long)s.min_clock,
      "workers_connected", (unsigned long long)s.workers_connected, "shm_connections",
      (unsigned long long)s.shm_connections);
}

/* save / restore share this shape: fn(server, dir). */
static PyObject *server_dir_call(PyObject *op, PyObject *arg,
                                 int (*fn)(ember_ps_server *, const char *)) {
  PsServerObject *self = (PsServerObject *)op;
  PyObject *dir = NULL;
  if (!PyUnicode_FSConverter(arg, &dir))
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), fn(self->h.ptr, PyBytes_AS_STRING(dir)));
  Py_DECREF(dir);
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(PsServer_save_doc,
             "save(dir) -> None\n\n"
             "Writes this shard's tables and their optimizer state to\n"
             "dir/ps-<shard>-of-<num_shards>.ckpt (a temporary name, then renamed;\n"
             "CRC-32C protected), creating dir when missing.  Safe while serving.");
PyDoc_STRVAR(PsServer_restore_doc,
             "restore(dir) -> None\n\n"
             "Reads this shard's checkpoint back from dir, before any table is\n"
             "declared (EmberError EMBER_ESTATE otherwise).  Refuses a file of\n"
             "another shard or shard count (EmberSchemaError) and a corrupt one\n"
             "(EmberCorruptError).  Workers then declare the same tables (a no-op).");

static PyObject *PsServer_save(PyObject *op, PyObject *arg) {
  return server_dir_call(op, arg, ember_ps_server_save);
}
static PyObject *PsServer_restore(PyObject *op, PyObject *arg) {
  return server_dir_call(op, arg, ember_ps_server_restore);
}

static PyObject *PsServer_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  embpy_handle_close(&((PsServerObject *)op)->h);
  Py_RETURN_NONE;
}

static PyObject *PsServer_exit(PyObject *op, PyObject *args) {
  embpy_handle_close(&((PsServerObject *)op)->h);
  Py_RETURN_FALSE;
}

static PyMethodDef PsServer_methods[] = {
    {"stats", PsServer_stats, METH_NOARGS, PsServer_stats_doc},
    {"save", PsServer_save, METH_O, PsServer_save_doc},
    {"restore", PsServer_restore, METH_O, PsServer_restore_doc},
    {"close", PsServer_close, METH_NOARGS,
     "close() -> None\n\nCloses every connection and frees the tables.  Idempotent."},
    {"__enter__", self_enter, METH_NOARGS, NULL},
    {"__exit__", PsServer_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef PsServer_getset[] = {
    {"port", PsServer_port, NULL, "The TCP port the shard listens on.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(PsServer_doc,
             "PsServer(secret, shard, num_shards, num_workers, *, staleness=None,\n"
             "         host='', port=0, listen_fd=-1, encrypt=False, shm=True)\n\n"
             "Shard `shard` of a parameter server of num_shards shards: it holds its\n"
             "part of every table the workers declare, applies their gradients\n"
             "with each table's optimizer and answers their pulls, serving each\n"
             "connection on a thread of its own.  listen_fd (e.g. from reserve_port)\n"
             "is taken over and closed by the server; otherwise it binds host:port\n"
             "(host '': all interfaces).  Every connection proves the job secret\n"
             "(at least 16 bytes); encrypt=True: connections carry AES-256-GCM\n"
             "records, and clients must pass encrypt=True too.\n"
             "shm=True attaches the shared-memory rings that unencrypted workers on\n"
             "this host offer, so their requests and replies bypass TCP; shm=False,\n"
             "or EMBER_PS_SHM=0 in the environment, keeps every worker on TCP.\n"
             "staleness: None (PS_ASYNC) never holds a pull back; S lets no worker\n"
             "pull more than S clock()s ahead of the slowest of the num_workers\n"
             "workers (bounded staleness), its pull waiting for them meanwhile.\n"
             "Refused peers and requests are logged to stderr.");

static PyType_Slot PsServer_slots[] = {
    {Py_tp_doc, (void *)PsServer_doc},
    {Py_tp_new, PsServer_new},
    {Py_tp_dealloc, PsServer_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_methods, PsServer_methods},
    {Py_tp_getset, PsServer_getset},
    {0, NULL},
};

static PyType_Spec PsServer_spec = {
    .name = "ember._ember.PsServer",
    .basicsize = sizeof(PsServerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = PsServer_slots,
};

/* ================================================================ PsClient */

/* What a push or a whole-table pull needs to know of a declared table. */
typedef struct {
  char name[EMBER_PS_NAME_MAX];
  uint32_t layout;
  uint64_t rows;
  uint32_t cols;
} ps_declared;

typedef struct {
  PyObject_HEAD
  embpy_handle h;      /* h.lock serializes every call: the C client is single-threaded */
  ps_declared *tables; /* PyMem: the tables this client declared (GIL-protected) */
  size_t ntables;
  uint32_t num_shards, worker, num_workers;
  uint8_t *shm_links; /* PyMem: 1 where shard k's link is shared memory (fixed at creation) */
} PsClientObject;

static void ps_client_destroy(void *p) { ember_ps_client_destroy(p); }

static const ps_declared *find_declared(const PsClientObject *self, const char *table) {
  for (size_t i = 0; i < self->ntables; i++)
    if (strcmp(self->tables[i].name, table) == 0)
      return &self->tables[i];
  return NULL;
}

/* The declared table, or NULL with libember's own error for an undeclared
 * one (what = "pull", "push"). */
static const ps_declared *declared_table(PsClientObject *self, const char *table,
                                         const char *what) {
  const ps_declared *t = find_declared(self, table);
  if (t == NULL)
    raise_status(Py_TYPE(self), EMBER_ENOTFOUND,
                 "ps %s: table '%s' was not declared by this worker; declare every table a "
                 "worker uses (the same spec on every worker)",
                 what, table);
  return t;
}

/* The rows of a whole (dense) table moved at once (ids None). */
static int whole_table_rows(PsClientObject *self, const ps_declared *t, const char *what,
                            size_t *rows) {
  if (t->layout != EMBER_PS_DENSE) {
    raise_status(Py_TYPE(self), EMBER_EINVAL,
                 "ps %s of table '%s': a sparse table moves named rows only (ids None is for "
                 "dense tables)",
                 what, t->name);
    return -1;
  }
  if (t->rows > (uint64_t)PY_SSIZE_T_MAX) {
    PyErr_NoMemory();
    return -1;
  }
  *rows = (size_t)t->rows;
  return 0;
}

static PyObject *PsClient_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"hosts",     "ports",   "secret", "worker",    "num_workers",
                           "timeout_s", "encrypt", "shm",    "shm_bytes", NULL};
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL)
    return NULL;
  PyObject *hosts, *ports;
  Py_buffer secret;
  Py_ssize_t worker, num_workers;
  int64_t ms = 600000;
  int encrypt = 0;
  PyObject *shm = Py_None;
  Py_ssize_t shm_bytes = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOy*nn|$O&pOn:PsClient", kwlist, &hosts,
                                   &ports, &secret, &worker, &num_workers, embpy_timeout_conv,
                                   &ms, &encrypt, &shm, &shm_bytes))
    return NULL;
  PsClientObject *self = NULL;
  PyObject *host_tuple = NULL, *port_tuple = NULL;
  const char **host_strs = NULL;
  uint16_t *port_nums = NULL;
  ember_ps_client_config cfg;
  memset(&cfg, 0, sizeof cfg);
  if (check_u32(worker, "worker", &cfg.worker) < 0 ||
      check_u32(num_workers, "num_workers", &cfg.num_workers) < 0)
    goto err;
  if (ms == 0) { /* libember reads 0 as its default of 600 s */
    PyErr_SetString(PyExc_ValueError, "timeout_s must be > 0");
    goto err;
  }
  if (shm == Py_None) {
    cfg.shm = EMBER_PS_SHM_AUTO;
  } else {
    int on = PyObject_IsTrue(shm);
    if (on < 0)
      goto err;
    cfg.shm = on ? EMBER_PS_SHM_ON : EMBER_PS_SHM_OFF;
  }
  if (shm_bytes < 0) { /* libember checks the range */
    PyErr_Format(PyExc_ValueError, "shm_bytes must be >= 0, not %zd", shm_bytes);
    goto err;
  }
  cfg.shm_bytes = (size_t)shm_bytes;
  if (PyUnicode_Check(hosts) || PyBytes_Check(hosts)) {
    PyErr_SetString(PyExc_TypeError, "hosts must be a sequence of host names, one per shard");
    goto err;
  }
  host_tuple = PySequence_Tuple(hosts); /* a snapshot: the strs stay alive */
  if (host_tuple == NULL) {
    embpy_chain(PyExc_TypeError, "hosts must be a sequence of host names, one per shard, not "
                "%.100s", Py_TYPE(hosts)->tp_name);
    goto err;
  }
  port_tuple = PySequence_Tuple(ports);
  if (port_tuple == NULL) {
    embpy_chain(PyExc_TypeError, "ports must be a sequence of ints, one per shard, not %.100s",
                Py_TYPE(ports)->tp_name);
    goto err;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(host_tuple);
  if (n < 1 || n > (Py_ssize_t)EMBER_PS_MAX_SHARDS || PyTuple_GET_SIZE(port_tuple) != n) {
    PyErr_Format(PyExc_ValueError,
                 "hosts and ports must list the same 1..%u shards, not %zd hosts and %zd ports",
                 EMBER_PS_MAX_SHARDS, n, PyTuple_GET_SIZE(port_tuple));
    goto err;
  }
  host_strs = PyMem_Calloc((size_t)n, sizeof *host_strs);
  port_nums = PyMem_Calloc((size_t)n, sizeof *port_nums);
  if (host_strs == NULL || port_nums == NULL) {
    PyErr_NoMemory();
    goto err;
  }
  for (Py_ssize_t k = 0; k < n; k++) {
    PyObject *h = PyTuple_GET_ITEM(host_tuple, k);
    if (!PyUnicode_Check(h)) {
      PyErr_Format(PyExc_TypeError, "hosts[%zd] must be a str, not %.100s", k,
                   Py_TYPE(h)->tp_name);
      goto err;
    }
    Py_ssize_t len;
    host_strs[k] = PyUnicode_AsUTF8AndSize(h, &len);
    if (host_strs[k] == NULL)
      goto err;
    if ((size_t)len != strlen(host_strs[k])) {
      PyErr_Format(PyExc_ValueError, "hosts[%zd] contains a NUL character", k);
      goto err;
    }
    if (!embpy_port_conv(PyTuple_GET_ITEM(port_tuple, k), &port_nums[k]))
      goto err;
  }
  cfg.hosts = host_strs;
  cfg.ports = port_nums;
  cfg.num_shards = (uint32_t)n;
  cfg.secret = secret.buf;
  cfg.secret_len = (size_t)secret.len;
  cfg.encrypt = encrypt;
  cfg.timeout_ms = ms;

  self = (PsClientObject *)type->tp_alloc(type, 0);
  if (self == NULL)
    goto err;
  if (embpy_handle_init(&self->h, "PsClient", ps_client_destroy, 1) < 0)
    goto err;
  self->num_shards = cfg.num_shards;
  self->worker = cfg.worker;
  self->num_workers = cfg.num_workers;
  self->shm_links = PyMem_Calloc(cfg.num_shards, 1);
  if (self->shm_links == NULL) {
    PyErr_NoMemory();
    goto err;
  }
  ember_ps_client *c = NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_ps_client_create(&c, &cfg));
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto err;
  }
  self->h.ptr = c;
  for (uint32_t k = 0; k < cfg.num_shards; k++)
    self->shm_links[k] = ember_ps_client_transport(c, k, NULL, NULL) == EMBER_PS_TRANSPORT_SHM;
  PyMem_Free(host_strs);
  PyMem_Free(port_nums);
  Py_DECREF(host_tuple);
  Py_DECREF(port_tuple);
  PyBuffer_Release(&secret);
  return (PyObject *)self;
err:
  PyMem_Free(host_strs);
  PyMem_Free(port_nums);
  Py_XDECREF(host_tuple);
  Py_XDECREF(port_tuple);
  PyBuffer_Release(&secret);
  Py_XDECREF(self);
  return NULL;
}

static void PsClient_dealloc(PyObject *op) {
  PsClientObject *self = (PsClientObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&self->h);
  PyMem_Free(self->tables);
  PyMem_Free(self->shm_links);
  tp->tp_free(op);
  Py_DECREF(tp);
}

PyDoc_STRVAR(PsClient_declare_doc,
             "declare(name, layout, rows, cols, optimizer, learning_rate, *,\n"
             "        momentum=0.0, beta1=0.0, beta2=0.0, epsilon=0.0,\n"
             "        initial_accumulator=0.0, init='zeros', init_scale=0.0, seed=0)\n"
             "        -> None\n\n"
             "Declares a table of rows x cols float32s on every shard.  layout:\n"
             "'dense' (every row held from the start, split into contiguous ranges)\n"
             "or 'sparse' (a row exists once pulled or pushed; rows bounds the ids).\n"
             "optimizer: 'sgd', 'momentum' (Keras SGD with momentum), 'adagrad' or\n"
             "'adam', as Keras defines them; 0 for beta1, beta2, epsilon picks Keras's\n"
             "0.9, 0.999, 1e-7.  init: 'zeros', 'uniform' (in [-init_scale,\n"
             "init_scale)) or 'normal' (standard deviation init_scale); a row's\n"
             "initial values depend on (seed, row, column) only.  Every worker\n"
             "declares every table it uses with the same spec: declaring it again is\n"
             "a no-op, a different spec raises EmberSchemaError naming both.");

static PyObject *PsClient_declare(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"name",       "layout", "rows",     "cols",
                           "optimizer",  "learning_rate",      "momentum",
                           "beta1",      "beta2",  "epsilon",  "initial_accumulator",
                           "init",       "init_scale",         "seed",
                           NULL};
  PsClientObject *self = (PsClientObject *)op;
  const char *name, *layout, *optimizer, *init = "zeros";
  uint64_t rows, seed = 0;
  Py_ssize_t cols;
  ember_ps_table_spec spec;
  memset(&spec, 0, sizeof spec);
  ember_ps_optimizer *o = &spec.optimizer;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ssO&nsf|$fffffsfO&:declare", kwlist, &name,
                                   &layout, u64_conv, &rows, &cols, &optimizer,
                                   &o->learning_rate, &o->momentum, &o->beta1, &o->beta2,
                                   &o->epsilon, &o->initial_accumulator, &init,
                                   &spec.init_scale, u64_conv, &seed))
    return NULL;
  if (parse_choice(layout, "layout", layout_names, 2, &spec.layout) < 0 ||
      parse_choice(optimizer, "optimizer", optimizer_names, 4, &o->kind) < 0 ||
      parse_choice(init, "init", init_names, 3, &spec.init) < 0 ||
      check_u32(cols, "cols", &spec.cols) < 0)
    return NULL;
  spec.name = name;
  spec.rows = rows;
  spec.seed = seed;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), ember_ps_client_declare(self->h.ptr, &spec));
  if (ok < 0)
    return NULL;
  /* libember accepted it, so the name fits; a repeat changes nothing */
  if (find_declared(self, name) == NULL && strlen(name) < EMBER_PS_NAME_MAX) {
    ps_declared *grown = PyMem_Realloc(self->tables, (self->ntables + 1) * sizeof *grown);
    if (grown == NULL)
      return PyErr_NoMemory();
    self->tables = grown;
    ps_declared *t = &self->tables[self->ntables++];
    memset(t, 0, sizeof *t);
    memcpy(t->name, name, strlen(name) + 1);
    t->layout = spec.layout;
    t->rows = spec.rows;
    t->cols = spec.cols;
  }
  Py_RETURN_NONE;
}

/* numpy.empty((n, cols), float32), numpy.empty cached in the module state. */
static PyObject *new_float32_array(ember_state *st, size_t n, uint32_t cols) {
  if (st->np_empty == NULL) {
    PyObject *np = PyImport_ImportModule("numpy");
    if (np == NULL)
      return NULL;
    PyObject *empty = PyObject_GetAttrString(np, "empty");
    Py_DECREF(np);
    if (empty == NULL)
      return NULL;
    if (st->np_empty == NULL) /* the import ran Python code: another call may have set it */
      st->np_empty = empty;
    else
      Py_DECREF(empty);
  }
  return PyObject_CallFunction(st->np_empty, "((nI)s)", (Py_ssize_t)n, (unsigned int)cols,
                               "float32");
}

PyDoc_STRVAR(PsClient_pull_doc,
             "pull(table, ids, cols, out=None) -> numpy.ndarray or out\n\n"
             "The rows `ids` of the table (a buffer of uint64 or int64 row ids, e.g.\n"
             "a numpy array, or a sequence of ints; a row may repeat) as float32,\n"
             "shape (len(ids), cols), in the order asked; ids None: every row of a\n"
             "dense table.  cols must be the table's.  out: a writable C-contiguous\n"
             "float32 buffer of exactly that many floats, filled in place and\n"
             "returned (no copy); None: a new numpy array.  With bounded staleness\n"
             "the pull waits until every worker is close enough behind, up to the\n"
             "client's timeout (then EmberTimeout naming the slowest worker).");

static PyObject *PsClient_pull(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"table", "ids", "cols", "out", NULL};
  PsClientObject *self = (PsClientObject *)op;
  const char *table;
  PyObject *ids_obj, *out_obj = Py_None;
  Py_ssize_t cols;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOn|O:pull", kwlist, &table, &ids_obj, &cols,
                                   &out_obj))
    return NULL;
  if (cols < 1 || cols > (Py_ssize_t)EMBER_PS_MAX_COLS) {
    PyErr_Format(PyExc_ValueError, "cols must be in 1..%u, not %zd", EMBER_PS_MAX_COLS, cols);
    return NULL;
  }
  ember_state *st = embpy_state_of_type(Py_TYPE(op));
  if (st == NULL)
    return NULL;
  row_ids ids;
  if (row_ids_parse(ids_obj, &ids) < 0)
    return NULL;
  PyObject *result = NULL;
  Py_buffer dst = {0};
  size_t n = ids.n, floats;
  if (ids.ids == NULL) {
    const ps_declared *t = declared_table(self, table, "pull");
    if (t == NULL || whole_table_rows(self, t, "pull", &n) < 0)
      goto done;
  }
  if (__builtin_mul_overflow(n, (size_t)cols, &floats) || floats > (size_t)PY_SSIZE_T_MAX / 4) {
    PyErr_Format(PyExc_ValueError, "pull of %zu rows x %zd floats is too large", n, cols);
    goto done;
  }
  result = out_obj == Py_None ? new_float32_array(st, n, (uint32_t)cols) : Py_NewRef(out_obj);
  if (result == NULL)
    goto done;
  if (PyObject_GetBuffer(result, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    dst.obj = NULL;
    embpy_chain(PyExc_TypeError,
                "out must be a writable C-contiguous float32 buffer (a numpy array), not "
                "%.100s",
                Py_TYPE(result)->tp_name);
    Py_CLEAR(result);
    goto done;
  }
  if (!is_float32(&dst) || (size_t)dst.len != floats * 4) {
    char shape[96];
    shape_str(&dst, shape, sizeof shape);
    PyErr_Format(PyExc_ValueError,
                 "out must be %zu float32s, shape (%zu, %zd), for %zu rows of table '%s'; got "
                 "format '%s' shape %s",
                 floats, n, cols, n, table, dst.format ? dst.format : "B", shape);
    Py_CLEAR(result);
    goto done;
  }
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_ps_client_pull(self->h.ptr, table, ids.ids, n, (uint32_t)cols,
                                         (float *)dst.buf));
  if (ok < 0)
    Py_CLEAR(result);
done:
  if (dst.obj != NULL)
    PyBuffer_Release(&dst);
  row_ids_release(&ids);
  return result;
}

PyDoc_STRVAR(PsClient_push_doc,
             "push(table, ids, rows) -> None\n\n"
             "Gradients for the rows `ids` (as pull takes them; None: every row of a\n"
             "dense table): rows, the gradients, is a C-contiguous float32 buffer of len(ids) rows\n"
             "of the table's cols (a numpy array of shape (len(ids), cols), or flat).\n"
             "The shards apply them with the table's optimizer; a row named twice\n"
             "gets both gradients, in order.  Gradients of another shape raise\n"
             "EmberSchemaError naming the table and both shapes.");

/* push and assign share this shape: rows and a float32 row for each.  `what`
 * names the rows in messages ("gradients", "values"). */
typedef int (*rows_fn)(ember_ps_client *, const char *, const uint64_t *, size_t, uint32_t,
                       const float *);

static PyObject *send_rows(PyObject *op, PyObject *args, PyObject *kwargs, const char *verb,
                           const char *what, rows_fn fn) {
  static char *kwlist[] = {"table", "ids", "rows", NULL};
  PsClientObject *self = (PsClientObject *)op;
  const char *table;
  PyObject *ids_obj, *grads_obj;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOO", kwlist, &table, &ids_obj,
                                   &grads_obj))
    return NULL;
  Py_buffer grads;
  if (PyObject_GetBuffer(grads_obj, &grads, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
    embpy_chain(PyExc_TypeError,
                "%s must be a C-contiguous float32 buffer (a numpy array), not %.100s", what,
                Py_TYPE(grads_obj)->tp_name);
    return NULL;
  }
  if (!is_float32(&grads)) {
    PyErr_Format(PyExc_TypeError, "%s must be float32, got format '%s' (itemsize %zd)", what,
                 grads.format ? grads.format : "B", grads.itemsize);
    PyBuffer_Release(&grads);
    return NULL;
  }
  row_ids ids;
  if (row_ids_parse(ids_obj, &ids) < 0) {
    PyBuffer_Release(&grads);
    return NULL;
  }
  PyObject *result = NULL;
  size_t n = ids.n;
  const ps_declared *t = declared_table(self, table, verb);
  if (t == NULL || (ids.ids == NULL && whole_table_rows(self, t, verb, &n) < 0))
    goto done;
  /* 2-D gradients say their rows' width; flat ones take the table's */
  size_t cols = grads.ndim == 2 ? (size_t)grads.shape[1] : t->cols, floats = 0;
  if (cols != t->cols || __builtin_mul_overflow(n, cols, &floats) ||
      (size_t)grads.len != floats * 4) {
    char shape[96];
    shape_str(&grads, shape, sizeof shape);
    raise_status(Py_TYPE(op), EMBER_ESCHEMA,
                 "ps %s to table '%s': %s of shape %s do not fit %zu rows of %u "
                 "floats: expected (%zu, %u) (table shape (%llu, %u))",
                 verb, table, what, shape, n, t->cols, n, t->cols, (unsigned long long)t->rows, t->cols);
    goto done;
  }
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    fn(self->h.ptr, table, ids.ids, n, (uint32_t)cols,
                       (const float *)grads.buf));
  if (ok == 0)
    result = Py_NewRef(Py_None);
done:
  row_ids_release(&ids);
  PyBuffer_Release(&grads);
  return result;
}

static PyObject *PsClient_push(PyObject *op, PyObject *args, PyObject *kwargs) {
  return send_rows(op, args, kwargs, "push", "gradients", ember_ps_client_push);
}

PyDoc_STRVAR(PsClient_assign_doc,
             "assign(table, ids, rows) -> None\n\n"
             "Sets the rows `ids` (as push takes them) to `rows`, keeping their\n"
             "optimizer state: how the chief puts its model's initial weights on the\n"
             "servers before the workers pull them.");

static PyObject *PsClient_assign(PyObject *op, PyObject *args, PyObject *kwargs) {
  return send_rows(op, args, kwargs, "assign", "values", ember_ps_client_assign);
}

PyDoc_STRVAR(PsClient_initialize_doc,
             "initialize(table, ids, rows) -> None\n\n"
             "assign() for the rows no push has reached yet only: the chief's\n"
             "initial weights, which leave alone what a restored checkpoint (or\n"
             "another worker's pushes) already trained.");

static PyObject *PsClient_initialize(PyObject *op, PyObject *args, PyObject *kwargs) {
  return send_rows(op, args, kwargs, "initialize", "values", ember_ps_client_init);
}

/* clock / finish share this shape: fn(client). */
static PyObject *client_call(PyObject *op, int (*fn)(ember_ps_client *)) {
  PsClientObject *self = (PsClientObject *)op;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), fn(self->h.ptr));
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(PsClient_clock_doc,
             "clock() -> None\n\n"
             "This worker finished another step: with bounded staleness, the pulls\n"
             "of workers waiting for it may go on.  Call once per step.");
PyDoc_STRVAR(PsClient_finish_doc,
             "finish() -> None\n\n"
             "This worker is done: it holds no other worker back any more.");

static PyObject *PsClient_clock(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  return client_call(op, ember_ps_client_clock);
}
static PyObject *PsClient_finish(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  return client_call(op, ember_ps_client_finish);
}

PyDoc_STRVAR(PsClient_save_doc,
             "save(dir) -> None\n\n"
             "Every shard writes its checkpoint to dir, a path on the shards' hosts\n"
             "(see PsServer.save).");

static PyObject *PsClient_save(PyObject *op, PyObject *arg) {
  PsClientObject *self = (PsClientObject *)op;
  PyObject *dir = NULL;
  if (!PyUnicode_FSConverter(arg, &dir))
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_ps_client_save(self->h.ptr, PyBytes_AS_STRING(dir)));
  Py_DECREF(dir);
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(PsClient_bytes_doc,
             "bytes(shard=None) -> (sent, received)\n\n"
             "The payload bytes this client sent and received so far, to and from\n"
             "every shard, or `shard` alone; the same for either transport.");

/* ember_ps_client_transport's counters as an int status */
static int shard_bytes(ember_ps_client *c, uint32_t shard, uint64_t *sent, uint64_t *received) {
  int t = ember_ps_client_transport(c, shard, sent, received);
  return t < 0 ? t : EMBER_OK;
}

static PyObject *PsClient_bytes(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"shard", NULL};
  PsClientObject *self = (PsClientObject *)op;
  PyObject *shard_obj = Py_None;
  uint64_t sent = 0, received = 0;
  uint32_t shard = 0;
  int ok;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:bytes", kwlist, &shard_obj))
    return NULL;
  if (shard_obj != Py_None) {
    Py_ssize_t k = PyNumber_AsSsize_t(shard_obj, PyExc_OverflowError);
    if (k == -1 && PyErr_Occurred())
      return NULL;
    if (k < 0 || (size_t)k >= self->num_shards) {
      PyErr_Format(PyExc_ValueError, "shard must be in 0..%u, not %zd", self->num_shards - 1,
                   k);
      return NULL;
    }
    shard = (uint32_t)k;
  }
  /* under the lock: a call in another thread updates the counters */
  if (shard_obj == Py_None)
    EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                      (ember_ps_client_bytes(self->h.ptr, &sent, &received), EMBER_OK));
  else
    EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                      shard_bytes(self->h.ptr, shard, &sent, &received));
  if (ok < 0)
    return NULL;
  return Py_BuildValue("(KK)", (unsigned long long)sent, (unsigned long long)received);
}

static void ps_client_close(PsClientObject *self) {
  /* A pull blocked in another thread (a staleness wait) would hold the
   * handle for up to its timeout: break it first, so close() means now. */
  if (self->h.busy > 0 && self->h.ptr != NULL) {
    ember_ps_client *c = self->h.ptr;
    Py_BEGIN_ALLOW_THREADS
    ember_ps_client_abort(c); /* thread-safe; no lock: it must reach a blocked call */
    Py_END_ALLOW_THREADS
  }
  embpy_handle_close(&self->h);
}

static PyObject *PsClient_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ps_client_close((PsClientObject *)op);
  Py_RETURN_NONE;
}

static PyObject *PsClient_exit(PyObject *op, PyObject *args) {
  ps_client_close((PsClientObject *)op);
  Py_RETURN_FALSE;
}

static PyObject *PsClient_get_worker(PyObject *op, void *c) {
  return PyLong_FromUnsignedLong(((PsClientObject *)op)->worker);
}
static PyObject *PsClient_get_num_workers(PyObject *op, void *c) {
  return PyLong_FromUnsignedLong(((PsClientObject *)op)->num_workers);
}
static PyObject *PsClient_get_num_shards(PyObject *op, void *c) {
  return PyLong_FromUnsignedLong(((PsClientObject *)op)->num_shards);
}

static PyObject *PsClient_get_transports(PyObject *op, void *c) {
  PsClientObject *self = (PsClientObject *)op;
  PyObject *list = PyList_New(self->num_shards);
  if (list == NULL)
    return NULL;
  for (uint32_t k = 0; k < self->num_shards; k++) {
    PyObject *name = PyUnicode_FromString(self->shm_links[k] ? "shm" : "tcp");
    if (name == NULL) {
      Py_DECREF(list);
      return NULL;
    }
    PyList_SET_ITEM(list, k, name);
  }
  return list;
}

static PyGetSetDef PsClient_getset[] = {
    {"worker", PsClient_get_worker, NULL, "This worker (0..num_workers-1).", NULL},
    {"transports", PsClient_get_transports, NULL,
     "How each shard is reached, by shard: 'shm' (shared memory: the shard is\n"
     "on this host) or 'tcp'.  Fixed when the client connects.",
     NULL},
    {"num_workers", PsClient_get_num_workers, NULL, "The workers of the job.", NULL},
    {"num_shards", PsClient_get_num_shards, NULL, "The shards (ps nodes) of the job.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef PsClient_methods[] = {
    {"declare", (PyCFunction)(void (*)(void))PsClient_declare, METH_VARARGS | METH_KEYWORDS,
     PsClient_declare_doc},
    {"pull", (PyCFunction)(void (*)(void))PsClient_pull, METH_VARARGS | METH_KEYWORDS,
     PsClient_pull_doc},
    {"push", (PyCFunction)(void (*)(void))PsClient_push, METH_VARARGS | METH_KEYWORDS,
     PsClient_push_doc},
    {"assign", (PyCFunction)(void (*)(void))PsClient_assign, METH_VARARGS | METH_KEYWORDS,
     PsClient_assign_doc},
    {"initialize", (PyCFunction)(void (*)(void))PsClient_initialize,
     METH_VARARGS | METH_KEYWORDS, PsClient_initialize_doc},
    {"clock", PsClient_clock, METH_NOARGS, PsClient_clock_doc},
    {"finish", PsClient_finish, METH_NOARGS, PsClient_finish_doc},
    {"save", PsClient_save, METH_O, PsClient_save_doc},
    {"bytes", (PyCFunction)(void (*)(void))PsClient_bytes, METH_VARARGS | METH_KEYWORDS,
     PsClient_bytes_doc},
    {"close", PsClient_close, METH_NOARGS,
     "close() -> None\n\nCloses the connections; a call in flight in another thread\n"
     "raises EmberAborted at once.  Idempotent."},
    {"__enter__", self_enter, METH_NOARGS, NULL},
    {"__exit__", PsClient_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(PsClient_doc,
             "PsClient(hosts, ports, secret, worker, num_workers, *, timeout_s=600.0,\n"
             "         encrypt=False, shm=None, shm_bytes=0)\n\n"
             "Worker `worker` of num_workers's connection to every shard of a\n"
             "parameter server: shard k at hosts[k]:ports[k].  Connects (retrying\n"
             "until timeout_s: the shards may still be starting), proves the job\n"
             "secret and introduces itself; a shard that counts another number of\n"
             "workers or shards refuses it.  timeout_s is also every call's\n"
             "deadline, a pull's wait for slower workers included.  encrypt must\n"
             "match the servers'.  shm=None moves the connection of every shard on\n"
             "this host to shared memory (two rings of shm_bytes each, 0: 8 MiB),\n"
             "unless encrypt=True or EMBER_PS_SHM=0: the same requests and replies,\n"
             "without TCP; shm=True requires it of every shard (EmberError naming\n"
             "why not), shm=False keeps TCP; `transports` says what each shard got.\n"
             "Calls are serialized by a per-object lock and run without the GIL.\n"
             "After a call fails half-way (a connection lost) the client is broken\n"
             "for good (EmberError EMBER_ESTATE); a refused request (an unknown\n"
             "table, a wrong shape, a staleness timeout) leaves it usable.");

static PyType_Slot PsClient_slots[] = {
    {Py_tp_doc, (void *)PsClient_doc},
    {Py_tp_new, PsClient_new},
    {Py_tp_dealloc, PsClient_dealloc},
    {Py_tp_traverse, Handle_traverse},
    {Py_tp_methods, PsClient_methods},
    {Py_tp_getset, PsClient_getset},
    {0, NULL},
};

static PyType_Spec PsClient_spec = {
    .name = "ember._ember.PsClient",
    .basicsize = sizeof(PsClientObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = PsClient_slots,
};

/* ================================================================ functions */

PyDoc_STRVAR(ps_shard_of_row_doc,
             "ps_shard_of_row(layout, rows, row, num_shards) -> int\n\n"
             "The shard that holds `row` of a table of `rows` rows with layout\n"
             "'dense' or 'sparse', the same on every client and server.");

static PyObject *ps_shard_of_row(PyObject *module, PyObject *args) {
  const char *layout;
  uint64_t rows, row;
  Py_ssize_t num_shards;
  uint32_t lay, shards;
  if (!PyArg_ParseTuple(args, "sO&O&n:ps_shard_of_row", &layout, u64_conv, &rows, u64_conv, &row,
                        &num_shards))
    return NULL;
  if (parse_choice(layout, "layout", layout_names, 2, &lay) < 0 ||
      check_u32(num_shards, "num_shards", &shards) < 0)
    return NULL;
  if (shards == 0 || row >= rows) {
    PyErr_Format(PyExc_ValueError, "row %llu of %llu rows over %u shards has no shard",
                 (unsigned long long)row, (unsigned long long)rows, shards);
    return NULL;
  }
  return PyLong_FromUnsignedLong(ember_ps_shard_of_row(lay, rows, row, shards));
}

static PyMethodDef ps_functions[] = {
    {"ps_shard_of_row", ps_shard_of_row, METH_VARARGS, ps_shard_of_row_doc},
    {NULL, NULL, 0, NULL},
};

/* ================================================================ exec */

int embpy_ps_exec(PyObject *m, ember_state *st) {
  st->PsServer_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &PsServer_spec, NULL);
  if (st->PsServer_Type == NULL || PyModule_AddType(m, st->PsServer_Type) < 0)
    return -1;
  st->PsClient_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &PsClient_spec, NULL);
  if (st->PsClient_Type == NULL || PyModule_AddType(m, st->PsClient_Type) < 0)
    return -1;
  if (PyModule_AddFunctions(m, ps_functions) < 0)
    return -1;
  /* PS_ASYNC is UINT32_MAX: past a C long's guarantee, so built as a Python int */
  PyObject *async = PyLong_FromUnsignedLong(EMBER_PS_ASYNC);
  if (async == NULL || PyModule_AddObjectRef(m, "PS_ASYNC", async) < 0) {
    Py_XDECREF(async);
    return -1;
  }
  Py_DECREF(async);
  if (PyModule_AddIntConstant(m, "PS_NAME_MAX", EMBER_PS_NAME_MAX) < 0 ||
      PyModule_AddIntConstant(m, "PS_MAX_SHARDS", EMBER_PS_MAX_SHARDS) < 0 ||
      PyModule_AddIntConstant(m, "PS_MAX_COLS", EMBER_PS_MAX_COLS) < 0)
    return -1;
  return 0;
}
