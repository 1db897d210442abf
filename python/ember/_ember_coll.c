/* python/ember/_ember_coll.c - Communicator: the collectives of libember
 * (collective.h) on Python buffers.
 *
 * allreduce and broadcast work in place on any writable contiguous buffer
 * (numpy arrays, bytearray, memoryview, array.array, torch CPU tensors via
 * .numpy()): the C call reads and writes the caller's memory directly, with
 * the GIL released, and the buffer export keeps the memory alive meanwhile.
 * allreduce takes its element type from the buffer's format (float32,
 * float64, int32, int64, native or little-endian).
 *
 * Threads: a communicator is used by one thread at a time (a per-object lock
 * serializes calls); abort() and close() may come from any thread: both break
 * a call in flight, which then raises EmberAborted within about 100 ms.
 */
#include "_ember.h"

#include <string.h>

typedef struct {
  PyObject_HEAD
  embpy_handle h;   /* h.lock serializes collective calls */
  int64_t timeout_ms; /* default per-call timeout; -1 = none */
  uint32_t rank, size;
  uint64_t id;        /* ember_comm_id: how the TensorFlow op names it */
} CommObject;

static void comm_destroy(void *p) { ember_comm_destroy(p); }

/* timeout=None -> the communicator's default; else seconds. */
static int op_timeout(CommObject *self, PyObject *obj, int64_t *ms) {
  if (obj == NULL || obj == Py_None) {
    *ms = self->timeout_ms;
    return 0;
  }
  return embpy_timeout_conv(obj, ms) ? 0 : -1;
}

static int parse_redop(PyObject *obj, int *op) {
  if (obj == NULL) {
    *op = EMBER_RED_SUM;
    return 0;
  }
  if (!PyUnicode_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "op must be 'sum', 'avg', 'min' or 'max', not %.100s",
                 Py_TYPE(obj)->tp_name);
    return -1;
  }
  const char *s = PyUnicode_AsUTF8(obj);
  if (s == NULL)
    return -1;
  if (strcmp(s, "sum") == 0)
    *op = EMBER_RED_SUM;
  else if (strcmp(s, "avg") == 0 || strcmp(s, "mean") == 0)
    *op = EMBER_RED_AVG;
  else if (strcmp(s, "min") == 0)
    *op = EMBER_RED_MIN;
  else if (strcmp(s, "max") == 0)
    *op = EMBER_RED_MAX;
  else {
    PyErr_Format(PyExc_ValueError, "op must be 'sum', 'avg', 'min' or 'max', not %R", obj);
    return -1;
  }
  return 0;
}

/* The element type of a buffer from its struct-module format. */
static int buffer_dtype(const Py_buffer *v, int *dtype) {
  const char *f = v->format ? v->format : "B";
  const char *full = f;
  if (*f == '@' || *f == '=' || *f == '<')
    f++;
  if (f[0] != '\0' && f[1] == '\0') {
    if (f[0] == 'f' && v->itemsize == 4) {
      *dtype = EMBER_DT_F32;
      return 0;
    }
    if (f[0] == 'd' && v->itemsize == 8) {
      *dtype = EMBER_DT_F64;
      return 0;
    }
    if ((f[0] == 'i' || f[0] == 'l' || f[0] == 'q') && v->itemsize == 4) {
      *dtype = EMBER_DT_I32;
      return 0;
    }
    if ((f[0] == 'i' || f[0] == 'l' || f[0] == 'q') && v->itemsize == 8) {
      *dtype = EMBER_DT_I64;
      return 0;
    }
  }
  PyErr_Format(PyExc_TypeError,
               "allreduce supports float32, float64, int32 and int64 buffers in native "
               "byte order, not format '%s' (itemsize %zd)",
               full, v->itemsize);
  return -1;
}

static int get_writable(PyObject *obj, Py_buffer *v, int flags, const char *what) {
  if (PyObject_GetBuffer(obj, v, PyBUF_WRITABLE | flags) < 0) {
    embpy_chain(PyExc_TypeError,
                "%s needs a writable contiguous buffer (e.g. a contiguous numpy array), "
                "not %.100s",
                what, Py_TYPE(obj)->tp_name);
    return -1;
  }
  return 0;
}

static PyObject *Comm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"rank",     "addresses", "secret",    "timeout", "listen_fd",
                           "bind_host", "tcp_only", "small_max", "encrypt", NULL};
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL)
    return NULL;
  Py_ssize_t rank, small_max = 0;
  PyObject *addresses, *fast = NULL;
  Py_buffer secret;
  int64_t ms = 60000;
  int listen_fd = -1, tcp_only = 0, encrypt = 0;
  const char *bind_host = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nOy*|O&$izpnp:Communicator", kwlist, &rank,
                                   &addresses, &secret, embpy_timeout_conv, &ms, &listen_fd,
                                   &bind_host, &tcp_only, &small_max, &encrypt))
    return NULL;
  CommObject *self = NULL;
  const char **addrs = NULL;
  if (PyUnicode_Check(addresses) || PyBytes_Check(addresses)) {
    PyErr_SetString(PyExc_TypeError, "addresses must be a sequence of 'host:port' strings");
    goto err;
  }
  fast = PySequence_Tuple(addresses);
  if (fast == NULL) {
    embpy_chain(PyExc_TypeError, "addresses must be a sequence of 'host:port' strings, not "
                "%.100s", Py_TYPE(addresses)->tp_name);
    goto err;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(fast);
  if (n < 1 || n > (Py_ssize_t)EMBER_COMM_MAX_RANKS) {
    PyErr_Format(PyExc_ValueError, "addresses must list 1..%u ranks, not %zd",
                 EMBER_COMM_MAX_RANKS, n);
    goto err;
  }
  if (rank < 0 || rank >= n) {
    PyErr_Format(PyExc_ValueError, "rank %zd is not in 0..%zd (one address per rank)", rank,
                 n - 1);
    goto err;
  }
  if (small_max < 0) {
    PyErr_SetString(PyExc_ValueError, "small_max must be >= 0");
    goto err;
  }
  addrs = PyMem_Calloc((size_t)n, sizeof *addrs);
  if (addrs == NULL) {
    PyErr_NoMemory();
    goto err;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *a = PyTuple_GET_ITEM(fast, i);
    if (!PyUnicode_Check(a)) {
      PyErr_Format(PyExc_TypeError, "addresses[%zd] must be a 'host:port' str, not %.100s", i,
                   Py_TYPE(a)->tp_name);
      goto err;
    }
    addrs[i] = PyUnicode_AsUTF8(a); /* owned by the str, which fast keeps alive */
    if (addrs[i] == NULL)
      goto err;
  }
  self = (CommObject *)type->tp_alloc(type, 0);
  if (self == NULL)
    goto err;
  if (embpy_handle_init(&self->h, "Communicator", comm_destroy, 1) < 0)
    goto err;
  self->timeout_ms = ms;
  self->rank = (uint32_t)rank;
  self->size = (uint32_t)n;
  ember_comm_config cfg = {.rank = (uint32_t)rank,
                           .size = (uint32_t)n,
                           .addresses = addrs,
                           .secret = secret.buf,
                           .secret_len = (size_t)secret.len,
                           .listen_fd = listen_fd,
                           .bind_host = bind_host,
                           .flags = tcp_only ? EMBER_COMM_TCP_ONLY : 0u,
                           .small_max = (size_t)small_max,
                           .encrypt = encrypt};
  listen_fd = -1; /* ember_comm_create owns it now, whatever happens */
  ember_comm *c = NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_comm_create(&c, &cfg, ms));
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto err;
  }
  self->h.ptr = c;
  self->id = ember_comm_id(c);
  PyMem_Free(addrs);
  Py_DECREF(fast);
  PyBuffer_Release(&secret);
  return (PyObject *)self;
err:
  if (listen_fd >= 0)
    ember_net_close(listen_fd); /* documented: the fd is taken over */
  PyMem_Free(addrs);
  Py_XDECREF(fast);
  PyBuffer_Release(&secret);
  Py_XDECREF(self);
  return NULL;
}

static void Comm_dealloc(PyObject *op) {
  CommObject *self = (CommObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&self->h);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static int Comm_traverse(PyObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  return 0;
}

PyDoc_STRVAR(Comm_allreduce_doc,
             "allreduce(buf, op='sum', timeout=None) -> buf\n\n"
             "Reduces buf elementwise over all ranks, in place: afterwards every\n"
             "rank holds the same result.  buf is any writable contiguous buffer of\n"
             "float32, float64, int32 or int64 (a numpy array: no copy is made).\n"
             "op is 'sum', 'avg' (alias 'mean'; integers truncate toward zero),\n"
             "'min' or 'max'.  timeout in seconds, None for the communicator's.\n"
             "Returns buf.");

static PyObject *Comm_allreduce(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"buf", "op", "timeout", NULL};
  CommObject *self = (CommObject *)op;
  PyObject *obj, *opobj = NULL, *tobj = NULL;
  int redop, dtype;
  int64_t ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OO:allreduce", kwlist, &obj, &opobj,
                                   &tobj))
    return NULL;
  if (parse_redop(opobj, &redop) < 0 || op_timeout(self, tobj, &ms) < 0)
    return NULL;
  Py_buffer v;
  if (get_writable(obj, &v, PyBUF_FORMAT | PyBUF_ANY_CONTIGUOUS, "allreduce") < 0)
    return NULL;
  if (buffer_dtype(&v, &dtype) < 0) {
    PyBuffer_Release(&v);
    return NULL;
  }
  size_t count = (size_t)v.len / (size_t)v.itemsize;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_comm_allreduce(self->h.ptr, v.buf, count, dtype, redop, ms));
  PyBuffer_Release(&v);
  return ok < 0 ? NULL : Py_NewRef(obj);
}

PyDoc_STRVAR(Comm_broadcast_doc,
             "broadcast(buf, root=0, timeout=None) -> buf\n\n"
             "Copies root's buf into buf on every other rank, in place.  buf is any\n"
             "writable contiguous buffer of the same size in bytes on every rank.\n"
             "Returns buf.");

static PyObject *Comm_broadcast(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"buf", "root", "timeout", NULL};
  CommObject *self = (CommObject *)op;
  PyObject *obj, *tobj = NULL;
  Py_ssize_t root = 0;
  int64_t ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|nO:broadcast", kwlist, &obj, &root, &tobj))
    return NULL;
  if (op_timeout(self, tobj, &ms) < 0)
    return NULL;
  if (root < 0 || root >= (Py_ssize_t)self->size) {
    PyErr_Format(PyExc_ValueError, "root %zd is not a rank (0..%u)", root, self->size - 1);
    return NULL;
  }
  Py_buffer v;
  if (get_writable(obj, &v, PyBUF_ANY_CONTIGUOUS, "broadcast") < 0)
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_comm_broadcast(self->h.ptr, v.buf, (size_t)v.len, (uint32_t)root, ms));
  PyBuffer_Release(&v);
  return ok < 0 ? NULL : Py_NewRef(obj);
}

PyDoc_STRVAR(Comm_allgather_doc,
             "allgather(send, recv, timeout=None) -> recv\n\n"
             "Gathers every rank's send buffer into recv, in rank order: recv must\n"
             "be a writable C-contiguous buffer of size * len(send) bytes (for\n"
             "numpy: shape (size, *send.shape), same dtype).  send may be None when\n"
             "this rank's block of recv already holds its data.  Returns recv.");

static PyObject *Comm_allgather(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"send", "recv", "timeout", NULL};
  CommObject *self = (CommObject *)op;
  PyObject *sobj, *robj, *tobj = NULL;
  int64_t ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|O:allgather", kwlist, &sobj, &robj,
                                   &tobj))
    return NULL;
  if (op_timeout(self, tobj, &ms) < 0)
    return NULL;
  Py_buffer rv, sv;
  int have_send = sobj != Py_None;
  if (get_writable(robj, &rv, PyBUF_C_CONTIGUOUS, "allgather's recv") < 0)
    return NULL;
  size_t block = (size_t)rv.len / self->size;
  if (have_send) {
    if (PyObject_GetBuffer(sobj, &sv, PyBUF_C_CONTIGUOUS) < 0) {
      PyBuffer_Release(&rv);
      embpy_chain(PyExc_TypeError, "allgather's send must be a contiguous buffer, not %.100s",
                  Py_TYPE(sobj)->tp_name);
      return NULL;
    }
    block = (size_t)sv.len;
  }
  if ((size_t)rv.len % self->size != 0 || (size_t)rv.len / self->size != block) {
    PyErr_Format(PyExc_ValueError,
                 "allgather: recv has %zd bytes, expected %u ranks x %zu bytes", rv.len,
                 self->size, block);
    goto fail;
  }
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_comm_allgather(self->h.ptr, have_send ? sv.buf : NULL, rv.buf, block,
                                         ms));
  if (have_send)
    PyBuffer_Release(&sv);
  PyBuffer_Release(&rv);
  return ok < 0 ? NULL : Py_NewRef(robj);
fail:
  if (have_send)
    PyBuffer_Release(&sv);
  PyBuffer_Release(&rv);
  return NULL;
}

PyDoc_STRVAR(Comm_barrier_doc,
             "barrier(timeout=None) -> None\n\n"
             "Returns once every rank has entered the barrier.");

static PyObject *Comm_barrier(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"timeout", NULL};
  CommObject *self = (CommObject *)op;
  PyObject *tobj = NULL;
  int64_t ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:barrier", kwlist, &tobj))
    return NULL;
  if (op_timeout(self, tobj, &ms) < 0)
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), ember_comm_barrier(self->h.ptr, ms));
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(Comm_abort_doc,
             "abort() -> None\n\n"
             "Breaks the communicator from any thread: a call in flight raises\n"
             "EmberAborted, the other ranks see this rank leave, later calls fail.");

static PyObject *Comm_abort(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  CommObject *self = (CommObject *)op;
  if (embpy_handle_enter(&self->h) < 0)
    return NULL;
  ember_comm *c = self->h.ptr;
  Py_BEGIN_ALLOW_THREADS
  ember_comm_abort(c); /* thread-safe; no lock: it must reach a blocked call */
  Py_END_ALLOW_THREADS
  embpy_handle_leave(&self->h);
  Py_RETURN_NONE;
}

static void comm_close(CommObject *self) {
  /* A call blocked in another thread would hold the handle for up to its
   * timeout: break it first, so close() means "leave now". */
  if (self->h.busy > 0 && self->h.ptr != NULL) {
    ember_comm *c = self->h.ptr;
    Py_BEGIN_ALLOW_THREADS
    ember_comm_abort(c);
    Py_END_ALLOW_THREADS
  }
  embpy_handle_close(&self->h);
}

static PyObject *Comm_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  comm_close((CommObject *)op);
  Py_RETURN_NONE;
}

static PyObject *Comm_enter(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  return Py_NewRef(self);
}

static PyObject *Comm_exit(PyObject *op, PyObject *args) {
  comm_close((CommObject *)op);
  Py_RETURN_FALSE;
}

PyDoc_STRVAR(Comm_transport_doc,
             "transport(peer) -> str\n\n"
             "'shm' if data to and from rank peer moves through shared memory,\n"
             "'tcp' otherwise, 'self' for this rank.");

static PyObject *Comm_transport(PyObject *op, PyObject *arg) {
  CommObject *self = (CommObject *)op;
  Py_ssize_t peer = PyLong_AsSsize_t(arg);
  if (peer == -1 && PyErr_Occurred())
    return NULL;
  if (peer < 0 || peer >= (Py_ssize_t)self->size) {
    PyErr_Format(PyExc_ValueError, "peer %zd is not a rank (0..%u)", peer, self->size - 1);
    return NULL;
  }
  if (embpy_handle_enter(&self->h) < 0)
    return NULL;
  int shm = ember_comm_peer_is_shm(self->h.ptr, (uint32_t)peer); /* reads set-up state */
  embpy_handle_leave(&self->h);
  if ((uint32_t)peer == self->rank)
    return PyUnicode_FromString("self");
  return PyUnicode_FromString(shm ? "shm" : "tcp");
}

PyDoc_STRVAR(Comm_algorithm_doc,
             "algorithm(buf) -> str\n\n"
             "The algorithm allreduce(buf) takes: 'recursive doubling', 'ring' or\n"
             "'halving' (recursive halving and doubling: power-of-two ranks of at\n"
             "least 4, each on a host of its own), the same on every rank; 'none'\n"
             "for one rank.");

static PyObject *Comm_algorithm(PyObject *op, PyObject *arg) {
  CommObject *self = (CommObject *)op;
  Py_buffer v;
  int dtype;
  if (PyObject_GetBuffer(arg, &v, PyBUF_FORMAT | PyBUF_ANY_CONTIGUOUS) < 0)
    return NULL;
  if (buffer_dtype(&v, &dtype) < 0) {
    PyBuffer_Release(&v);
    return NULL;
  }
  size_t count = (size_t)v.len / (size_t)v.itemsize;
  PyBuffer_Release(&v);
  if (embpy_handle_enter(&self->h) < 0)
    return NULL;
  const char *name = ember_comm_allreduce_algorithm(self->h.ptr, count, dtype); /* static */
  embpy_handle_leave(&self->h);
  return PyUnicode_FromString(name);
}

static PyObject *Comm_get_rank(PyObject *op, void *c) {
  return PyLong_FromUnsignedLong(((CommObject *)op)->rank);
}
static PyObject *Comm_get_size(PyObject *op, void *c) {
  return PyLong_FromUnsignedLong(((CommObject *)op)->size);
}
static PyObject *Comm_get_closed(PyObject *op, void *c) {
  return PyBool_FromLong(((CommObject *)op)->h.closed);
}
static PyObject *Comm_get_id(PyObject *op, void *c) {
  return PyLong_FromUnsignedLongLong(((CommObject *)op)->id);
}
static PyObject *Comm_get_timeout(PyObject *op, void *c) {
  int64_t ms = ((CommObject *)op)->timeout_ms;
  return PyFloat_FromDouble((double)ms / 1000.0);
}

static PyGetSetDef Comm_getset[] = {
    {"rank", Comm_get_rank, NULL, "This rank (0..size-1).", NULL},
    {"size", Comm_get_size, NULL, "The number of ranks.", NULL},
    {"closed", Comm_get_closed, NULL, "True after close().", NULL},
    {"timeout", Comm_get_timeout, NULL, "Default timeout of a call, in seconds.", NULL},
    {"id", Comm_get_id, NULL,
     "The communicator's id, by which the api table at COLLECTIVE_API finds it\n"
     "(TensorFlow's op EmberAllreduce); after close() it names nothing.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Comm_methods[] = {
    {"allreduce", (PyCFunction)(void (*)(void))Comm_allreduce, METH_VARARGS | METH_KEYWORDS,
     Comm_allreduce_doc},
    {"broadcast", (PyCFunction)(void (*)(void))Comm_broadcast, METH_VARARGS | METH_KEYWORDS,
     Comm_broadcast_doc},
    {"allgather", (PyCFunction)(void (*)(void))Comm_allgather, METH_VARARGS | METH_KEYWORDS,
     Comm_allgather_doc},
    {"barrier", (PyCFunction)(void (*)(void))Comm_barrier, METH_VARARGS | METH_KEYWORDS,
     Comm_barrier_doc},
    {"transport", Comm_transport, METH_O, Comm_transport_doc},
    {"algorithm", Comm_algorithm, METH_O, Comm_algorithm_doc},
    {"abort", Comm_abort, METH_NOARGS, Comm_abort_doc},
    {"close", Comm_close, METH_NOARGS,
     "close() -> None\n\nCloses the connections (aborting a call in flight in another\n"
     "thread).  Idempotent."},
    {"__enter__", Comm_enter, METH_NOARGS, NULL},
    {"__exit__", Comm_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Comm_doc,
             "Communicator(rank, addresses, secret, timeout=60.0, *, listen_fd=-1,\n"
             "             bind_host=None, tcp_only=False, small_max=0, encrypt=False)\n\n"
             "encrypt=True: the TCP connections between ranks carry AES-256-GCM\n"
             "records (every rank must agree; shared memory stays in clear).\n"
             "Collectives between the ranks of a job.  addresses lists 'host:port'\n"
             "for every rank ('[v6]:port' for IPv6); this rank listens on its own\n"
             "port (or on listen_fd, a bound socket it takes over, e.g. from\n"
             "reserve_port) on bind_host (None: all interfaces).  Every connection\n"
             "proves the job secret (HMAC challenge/response).  Blocks until every\n"
             "rank is connected or timeout seconds pass (EmberTimeout naming the\n"
             "missing ranks); timeout is also the default of every call.  Ranks on\n"
             "one host move data through shared memory unless tcp_only.  small_max:\n"
             "allreduce up to this many bytes uses recursive doubling (0: 64 KiB).\n\n"
             "After any failure (a peer died: EmberError; timed out: EmberTimeout;\n"
             "aborted: EmberAborted) the communicator is broken for good.");

static PyType_Slot Comm_slots[] = {
    {Py_tp_doc, (void *)Comm_doc},
    {Py_tp_new, Comm_new},
    {Py_tp_dealloc, Comm_dealloc},
    {Py_tp_traverse, Comm_traverse},
    {Py_tp_methods, Comm_methods},
    {Py_tp_getset, Comm_getset},
    {0, NULL},
};

static PyType_Spec Comm_spec = {
    .name = "ember._ember.Communicator",
    .basicsize = sizeof(CommObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Comm_slots,
};

int embpy_coll_exec(PyObject *m, ember_state *st) {
  st->Communicator_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Comm_spec, NULL);
  if (st->Communicator_Type == NULL || PyModule_AddType(m, st->Communicator_Type) < 0)
    return -1;
  /* the address of the static ember_comm_api table, for the op */
  PyObject *api = PyLong_FromVoidPtr((void *)ember_comm_api_table());
  if (api == NULL || PyModule_AddObject(m, "COLLECTIVE_API", api) < 0) {
    Py_XDECREF(api);
    return -1;
  }
  return 0;
}
