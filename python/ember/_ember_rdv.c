/* python/ember/_ember_rdv.c - RendezvousServer and RendezvousClient.
 *
 * Thread-safety: the C server is thread-safe (wait_ready, next_event, nodes,
 * stop may run concurrently from different threads), so RendezvousServer has
 * no lock of its own, only the in-flight count that keeps close() from
 * freeing the handle under a running call.  The C client is not safe for
 * concurrent calls from two threads (register/wait_spec/report share one
 * socket), so RendezvousClient serializes them with a per-object lock;
 * stop_state() does not take it (it only reads state kept by the client's
 * background thread, atomically), so a watchdog thread can poll it while
 * another thread is blocked in wait_spec or report.
 */
#include "_ember.h"

#include <string.h>

/* ================================================================ helpers */

static int check_u32(Py_ssize_t v, const char *what, Py_ssize_t lo, uint32_t *out) {
  if (v < lo || (unsigned long long)v > UINT32_MAX) {
    PyErr_Format(PyExc_ValueError, "%s must be in %zd..%u, not %zd", what, lo,
                 UINT32_MAX, v);
    return -1;
  }
  *out = (uint32_t)v;
  return 0;
}

static PyObject *decode_field(const char *s, size_t cap) {
  return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strnlen(s, cap), "replace");
}

/* dict(index, host, executor_id, pid, ports, role, task_index) */
static PyObject *node_to_dict(const ember_rdv_node *n) {
  uint32_t np = n->num_ports <= EMBER_RDV_MAX_PORTS ? n->num_ports : EMBER_RDV_MAX_PORTS;
  PyObject *ports = PyList_New(np);
  if (ports == NULL)
    return NULL;
  for (uint32_t i = 0; i < np; i++) {
    PyObject *p = PyLong_FromLong(n->ports[i]);
    if (p == NULL) {
      Py_DECREF(ports);
      return NULL;
    }
    PyList_SET_ITEM(ports, i, p);
  }
  PyObject *host = decode_field(n->host, sizeof n->host);
  PyObject *eid = decode_field(n->executor_id, sizeof n->executor_id);
  PyObject *role = decode_field(n->role, sizeof n->role);
  if (host == NULL || eid == NULL || role == NULL) {
    Py_XDECREF(host);
    Py_XDECREF(eid);
    Py_XDECREF(role);
    Py_DECREF(ports);
    return NULL;
  }
  return Py_BuildValue("{s:I,s:N,s:N,s:I,s:N,s:N,s:I}", "index", (unsigned int)n->index,
                       "host", host, "executor_id", eid, "pid", (unsigned int)n->pid,
                       "ports", ports, "role", role, "task_index",
                       (unsigned int)n->task_index);
}

static PyObject *nodes_to_list(const ember_rdv_node *nodes, uint32_t count) {
  PyObject *list = PyList_New(count);
  if (list == NULL)
    return NULL;
  for (uint32_t i = 0; i < count; i++) {
    PyObject *d = node_to_dict(&nodes[i]);
    if (d == NULL) {
      Py_DECREF(list);
      return NULL;
    }
    PyList_SET_ITEM(list, i, d);
  }
  return list;
}

static PyObject *self_enter(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  return Py_NewRef(self);
}

/* ================================================================ ClusterSpec */

/* The node table a client received, held as the C array: rows become dicts
 * only when read.  A node process reads its own row and perhaps walks the
 * table once, so decoding all N rows into N dicts up front (what an unpickled
 * list costs) would be paid N times over on a host running many nodes, for
 * objects nobody looks at. */
typedef struct {
  PyObject_HEAD
  ember_rdv_node *nodes; /* owned, malloc'd by ember_rdv_client_wait_spec */
  uint32_t count;
} ClusterSpecObject;

static void ClusterSpec_dealloc(PyObject *op) {
  ClusterSpecObject *self = (ClusterSpecObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  free(self->nodes);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static Py_ssize_t ClusterSpec_len(PyObject *op) {
  return (Py_ssize_t)((ClusterSpecObject *)op)->count;
}

static PyObject *ClusterSpec_item(PyObject *op, Py_ssize_t i) {
  ClusterSpecObject *self = (ClusterSpecObject *)op;
  if (i < 0 || i >= (Py_ssize_t)self->count) {
    PyErr_SetString(PyExc_IndexError, "ClusterSpec index out of range");
    return NULL;
  }
  return node_to_dict(&self->nodes[i]);
}

static PyObject *ClusterSpec_tolist(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  ClusterSpecObject *self = (ClusterSpecObject *)op;
  return nodes_to_list(self->nodes, self->count);
}

static PyObject *ClusterSpec_repr(PyObject *op) {
  return PyUnicode_FromFormat("<ember ClusterSpec of %u nodes>",
                              (unsigned int)((ClusterSpecObject *)op)->count);
}

static PyMethodDef ClusterSpec_methods[] = {
    {"tolist", ClusterSpec_tolist, METH_NOARGS,
     PyDoc_STR("tolist() -> list of dict: every row decoded")},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot ClusterSpec_slots[] = {
    {Py_tp_doc, PyDoc_STR("The cluster spec a node received: a read-only sequence of node\n"
                          "dicts (index, host, executor_id, pid, ports, role, task_index),\n"
                          "in index order, decoded row by row on access.")},
    {Py_tp_dealloc, ClusterSpec_dealloc},
    {Py_tp_repr, ClusterSpec_repr},
    {Py_tp_methods, ClusterSpec_methods},
    {Py_sq_length, ClusterSpec_len},
    {Py_sq_item, ClusterSpec_item},
    {0, NULL},
};

static PyType_Spec ClusterSpec_spec = {
    .name = "ember._ember.ClusterSpec",
    .basicsize = sizeof(ClusterSpecObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = ClusterSpec_slots,
};

/* Takes ownership of nodes (freed here on failure too). */
static PyObject *cluster_spec_new(PyTypeObject *client_type, ember_rdv_node *nodes,
                                  uint32_t count) {
  PyObject *m = PyType_GetModuleByDef(client_type, &embpy_module);
  PyObject *tp = m ? PyObject_GetAttrString(m, "ClusterSpec") : NULL;
  if (tp == NULL) {
    free(nodes);
    return NULL;
  }
  ClusterSpecObject *self = PyObject_New(ClusterSpecObject, (PyTypeObject *)tp);
  Py_DECREF(tp); /* instances hold their own reference (taken by PyObject_New for heap types) */
  if (self == NULL) {
    free(nodes);
    return NULL;
  }
  self->nodes = nodes;
  self->count = count;
  return (PyObject *)self;
}

/* ================================================================ RendezvousServer */

typedef struct {
  PyObject_HEAD
  embpy_handle h;
  uint16_t port;
} RdvServerObject;

static void rdv_server_destroy(void *p) { ember_rdv_server_destroy(p); }

static PyObject *RdvServer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"secret",    "num_nodes", "num_ps",
                           "chief",     "evaluator", "host",
                           "port",      "heartbeat_timeout_ms",
                           "handshake_timeout_ms", NULL};
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL)
    return NULL;
  Py_buffer secret;
  Py_ssize_t num_nodes, num_ps = 0, hb_ms = 10000, hs_ms = 10000;
  int chief = 0, evaluator = 0;
  const char *host = "";
  uint16_t port = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*n|$nppsO&nn:RendezvousServer",
                                   kwlist, &secret, &num_nodes, &num_ps, &chief,
                                   &evaluator, &host, embpy_port_conv, &port, &hb_ms,
                                   &hs_ms))
    return NULL;
  RdvServerObject *self = NULL;
  ember_rdv_server_config cfg;
  memset(&cfg, 0, sizeof cfg);
  if (num_nodes < 1 || num_nodes > (Py_ssize_t)EMBER_RDV_MAX_NODES) {
    PyErr_Format(PyExc_ValueError, "num_nodes must be in 1..%u, not %zd",
                 EMBER_RDV_MAX_NODES, num_nodes);
    goto err;
  }
  if (check_u32(num_ps, "num_ps", 0, &cfg.num_ps) < 0 ||
      check_u32(hb_ms, "heartbeat_timeout_ms", 0, &cfg.heartbeat_timeout_ms) < 0 ||
      check_u32(hs_ms, "handshake_timeout_ms", 0, &cfg.handshake_timeout_ms) < 0)
    goto err;
  cfg.secret = secret.buf;
  cfg.secret_len = (size_t)secret.len;
  cfg.bind_host = host;
  cfg.port = port;
  cfg.num_nodes = (uint32_t)num_nodes;
  cfg.has_chief = chief;
  cfg.has_evaluator = evaluator;

  self = (RdvServerObject *)type->tp_alloc(type, 0);
  if (self == NULL)
    goto err;
  if (embpy_handle_init(&self->h, "RendezvousServer", rdv_server_destroy, 0) < 0)
    goto err;
  ember_rdv_server *s = NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_rdv_server_create(&s, &cfg));
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto err;
  }
  self->port = ember_rdv_server_port(s);
  self->h.ptr = s;
  PyBuffer_Release(&secret);
  return (PyObject *)self;
err:
  PyBuffer_Release(&secret);
  Py_XDECREF(self);
  return NULL;
}

static int RdvServer_traverse(PyObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  return 0;
}

static void RdvServer_dealloc(PyObject *op) {
  RdvServerObject *self = (RdvServerObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&self->h);
  tp->tp_free(op);
  Py_DECREF(tp);
}

static PyObject *RdvServer_port(PyObject *op, void *closure) {
  RdvServerObject *self = (RdvServerObject *)op;
  if (self->h.closed || self->h.ptr == NULL) {
    PyErr_SetString(PyExc_ValueError, "RendezvousServer is closed");
    return NULL;
  }
  return PyLong_FromLong(self->port);
}

PyDoc_STRVAR(RdvServer_wait_ready_doc,
             "wait_ready(timeout_s) -> None\n\n"
             "Blocks until every node has registered.  Raises EmberTimeout naming\n"
             "the missing nodes.  Does not consume events.");

static PyObject *RdvServer_wait_ready(PyObject *op, PyObject *arg) {
  RdvServerObject *self = (RdvServerObject *)op;
  int64_t ms;
  if (!embpy_timeout_conv(arg, &ms))
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), ember_rdv_server_wait_ready(self->h.ptr, ms));
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

static const char *event_kind_name(int kind) {
  switch (kind) {
  case EMBER_RDV_EV_REGISTERED: return "registered";
  case EMBER_RDV_EV_READY: return "ready";
  case EMBER_RDV_EV_PROGRESS: return "progress";
  case EMBER_RDV_EV_DONE: return "done";
  case EMBER_RDV_EV_FAILED: return "failed";
  case EMBER_RDV_EV_LOST: return "lost";
  case EMBER_RDV_EV_REJECTED: return "rejected";
  default: return "unknown";
  }
}

PyDoc_STRVAR(RdvServer_next_event_doc,
             "next_event(timeout_s) -> (kind, node, code, text) or None\n\n"
             "Pops the next event, waiting up to timeout_s; None on timeout.  kind\n"
             "is one of 'registered', 'ready', 'progress', 'done', 'failed',\n"
             "'lost', 'rejected'; node is the node index or -1; code is the exit\n"
             "code of 'done'/'failed' and the number of connections a 'rejected'\n"
             "covers (strangers are reported rate-limited: the first at once,\n"
             "then one event per EMBER_REJECT_LOG_INTERVAL_MS); text is a str or\n"
             "None.");

/* One slice of next_event's wait (embpy_handle_wait). */
typedef struct {
  ember_rdv_server *s;
  ember_rdv_event ev;
} next_event_wait;

static int next_event_slice(void *arg, int64_t slice_ms) {
  next_event_wait *w = arg;
  return ember_rdv_server_next_event(w->s, &w->ev, slice_ms);
}

static PyObject *RdvServer_next_event(PyObject *op, PyObject *arg) {
  RdvServerObject *self = (RdvServerObject *)op;
  int64_t ms;
  if (!embpy_timeout_conv(arg, &ms))
    return NULL;
  next_event_wait w;
  memset(&w, 0, sizeof w);
  w.s = self->h.ptr;
  int r = embpy_handle_wait(&self->h, Py_TYPE(op), ms, next_event_slice, &w);
  if (r < 0)
    return NULL;
  if (r > 0)
    Py_RETURN_NONE;
  ember_rdv_event ev = w.ev;
  PyObject *text;
  if (ev.text != NULL)
    text = PyUnicode_DecodeUTF8(ev.text, (Py_ssize_t)strlen(ev.text), "replace");
  else
    text = Py_NewRef(Py_None);
  PyObject *result = NULL;
  if (text != NULL)
    result = Py_BuildValue("(siiN)", event_kind_name(ev.kind), (int)ev.node,
                           (int)ev.code, text);
  ember_rdv_event_clear(&ev);
  return result;
}

PyDoc_STRVAR(RdvServer_nodes_doc,
             "nodes() -> list of dict\n\n"
             "The registered nodes in index order: dict(index, host, executor_id,\n"
             "pid, ports, role, task_index).  Before 'ready', only registered rows\n"
             "are returned and roles are not yet assigned.");

static PyObject *RdvServer_nodes(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  RdvServerObject *self = (RdvServerObject *)op;
  ember_rdv_node *nodes = NULL;
  uint32_t count = 0;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), ember_rdv_server_nodes(self->h.ptr, &nodes, &count));
  if (ok < 0)
    return NULL;
  PyObject *list = nodes_to_list(nodes, count);
  free(nodes);
  return list;
}

PyDoc_STRVAR(RdvServer_stop_doc,
             "stop(node=-1, grace_ms=0) -> None\n\n"
             "Sends STOP(grace_ms) to every connected node, or only to `node`.");

static PyObject *RdvServer_stop(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"node", "grace_ms", NULL};
  RdvServerObject *self = (RdvServerObject *)op;
  int node = -1;
  Py_ssize_t grace = 0;
  uint32_t grace_ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|in:stop", kwlist, &node, &grace))
    return NULL;
  if (check_u32(grace, "grace_ms", 0, &grace_ms) < 0)
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), ember_rdv_server_stop(self->h.ptr, node, grace_ms));
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(RdvServer_close_doc,
             "close() -> None\n\n"
             "Stops the server thread and closes every connection (nodes started\n"
             "with exit_on_loss then exit).  Idempotent.");

static PyObject *RdvServer_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  embpy_handle_close(&((RdvServerObject *)op)->h);
  Py_RETURN_NONE;
}

static PyObject *RdvServer_exit(PyObject *op, PyObject *args) {
  embpy_handle_close(&((RdvServerObject *)op)->h);
  Py_RETURN_FALSE;
}

static PyMethodDef RdvServer_methods[] = {
    {"wait_ready", RdvServer_wait_ready, METH_O, RdvServer_wait_ready_doc},
    {"next_event", RdvServer_next_event, METH_O, RdvServer_next_event_doc},
    {"nodes", RdvServer_nodes, METH_NOARGS, RdvServer_nodes_doc},
    {"stop", (PyCFunction)(void (*)(void))RdvServer_stop, METH_VARARGS | METH_KEYWORDS,
     RdvServer_stop_doc},
    {"close", RdvServer_close, METH_NOARGS, RdvServer_close_doc},
    {"__enter__", self_enter, METH_NOARGS, NULL},
    {"__exit__", RdvServer_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef RdvServer_getset[] = {
    {"port", RdvServer_port, NULL, "The TCP port the server listens on.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(RdvServer_doc,
             "RendezvousServer(secret, num_nodes, *, num_ps=0, chief=False,\n"
             "                 evaluator=False, host='', port=0,\n"
             "                 heartbeat_timeout_ms=10000, handshake_timeout_ms=10000)\n\n"
             "The reservation server of one job (driver side).  Binds and starts\n"
             "its thread at once; nodes then register with RendezvousClient.\n"
             "wait_ready, next_event, nodes and stop are thread-safe.");

static PyType_Slot RdvServer_slots[] = {
    {Py_tp_doc, (void *)RdvServer_doc},
    {Py_tp_new, RdvServer_new},
    {Py_tp_dealloc, RdvServer_dealloc},
    {Py_tp_traverse, RdvServer_traverse},
    {Py_tp_methods, RdvServer_methods},
    {Py_tp_getset, RdvServer_getset},
    {0, NULL},
};

static PyType_Spec RdvServer_spec = {
    .name = "ember._ember.RendezvousServer",
    .basicsize = sizeof(RdvServerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = RdvServer_slots,
};

/* ================================================================ RendezvousClient */

typedef struct {
  PyObject_HEAD
  embpy_handle h;
} RdvClientObject;

static void rdv_client_destroy(void *p) { ember_rdv_client_destroy(p); }

static PyObject *RdvClient_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"host", "port", "secret", "timeout_s", NULL};
  ember_state *st = embpy_state_of_type(type);
  if (st == NULL)
    return NULL;
  const char *host;
  uint16_t port;
  Py_buffer secret;
  int64_t ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sO&y*O&:RendezvousClient", kwlist,
                                   &host, embpy_port_conv, &port, &secret,
                                   embpy_timeout_conv, &ms))
    return NULL;
  RdvClientObject *self = (RdvClientObject *)type->tp_alloc(type, 0);
  if (self == NULL)
    goto err;
  if (embpy_handle_init(&self->h, "RendezvousClient", rdv_client_destroy, 1) < 0)
    goto err;
  ember_rdv_client *c = NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL,
              ember_rdv_client_connect(&c, host, port, secret.buf, (size_t)secret.len, ms));
  if (rc != EMBER_OK) {
    embpy_raise(st, &e);
    goto err;
  }
  self->h.ptr = c;
  PyBuffer_Release(&secret);
  return (PyObject *)self;
err:
  PyBuffer_Release(&secret);
  Py_XDECREF(self);
  return NULL;
}

static int RdvClient_traverse(PyObject *self, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(self));
  return 0;
}

static void RdvClient_dealloc(PyObject *op) {
  RdvClientObject *self = (RdvClientObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&self->h);
  tp->tp_free(op);
  Py_DECREF(tp);
}

/* Copies a str argument into a fixed field, rejecting what does not fit. */
static int copy_field(char *dst, size_t cap, const char *src, const char *what) {
  size_t n = strlen(src);
  if (n >= cap) {
    PyErr_Format(PyExc_ValueError, "%s is longer than %zu bytes", what, cap - 1);
    return -1;
  }
  memcpy(dst, src, n + 1);
  return 0;
}

PyDoc_STRVAR(RdvClient_register_doc,
             "register(index, host, executor_id, pid, ports, timeout_s) -> None\n\n"
             "Sends REGISTER for this node.  host '' means the address the server\n"
             "sees this connection come from.  ports: up to 8 ints ([0] framework,\n"
             "[1] feed, ...).");

static PyObject *RdvClient_register(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"index", "host", "executor_id", "pid", "ports", "timeout_s",
                           NULL};
  RdvClientObject *self = (RdvClientObject *)op;
  Py_ssize_t index, pid;
  const char *host, *eid;
  PyObject *ports;
  int64_t ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nssnOO&:register", kwlist, &index,
                                   &host, &eid, &pid, &ports, embpy_timeout_conv, &ms))
    return NULL;
  ember_rdv_node node;
  memset(&node, 0, sizeof node);
  if (check_u32(index, "index", 0, &node.index) < 0 ||
      check_u32(pid, "pid", 0, &node.pid) < 0 ||
      copy_field(node.host, sizeof node.host, host, "host") < 0 ||
      copy_field(node.executor_id, sizeof node.executor_id, eid, "executor_id") < 0)
    return NULL;
  PyObject *tup = PySequence_Tuple(ports);
  if (tup == NULL)
    return embpy_chain(PyExc_TypeError, "ports must be a sequence of int, not %.100s",
                       Py_TYPE(ports)->tp_name);
  Py_ssize_t np = PyTuple_GET_SIZE(tup);
  if (np > (Py_ssize_t)EMBER_RDV_MAX_PORTS) {
    Py_DECREF(tup);
    PyErr_Format(PyExc_ValueError, "at most %u ports, got %zd", EMBER_RDV_MAX_PORTS, np);
    return NULL;
  }
  for (Py_ssize_t i = 0; i < np; i++) {
    if (!embpy_port_conv(PyTuple_GET_ITEM(tup, i), &node.ports[i])) {
      Py_DECREF(tup);
      return NULL;
    }
  }
  Py_DECREF(tup);
  node.num_ports = (uint32_t)np;

  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), ember_rdv_client_register(self->h.ptr, &node, ms));
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(RdvClient_wait_spec_doc,
             "wait_spec(timeout_s) -> (spec, self_pos)\n\n"
             "Waits for the cluster spec: the node table (a ClusterSpec, a sequence\n"
             "of dicts as RendezvousServer.nodes, decoded on access) and this\n"
             "node's position in it.");

static PyObject *RdvClient_wait_spec(PyObject *op, PyObject *arg) {
  RdvClientObject *self = (RdvClientObject *)op;
  int64_t ms;
  if (!embpy_timeout_conv(arg, &ms))
    return NULL;
  ember_rdv_node *nodes = NULL;
  uint32_t count = 0, pos = 0;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_rdv_client_wait_spec(self->h.ptr, &nodes, &count, &pos, ms));
  if (ok < 0)
    return NULL;
  PyObject *spec = cluster_spec_new(Py_TYPE(op), nodes, count);
  if (spec == NULL)
    return NULL;
  return Py_BuildValue("(NI)", spec, (unsigned int)pos);
}

PyDoc_STRVAR(RdvClient_start_doc,
             "start(interval_ms=1000, exit_on_loss=True, silence_ms=0) -> None\n\n"
             "Starts the heartbeat thread.  The driver is lost when its connection\n"
             "drops or it is silent for silence_ms (0: 3 intervals + 5 s).  With\n"
             "exit_on_loss, losing the driver (or a STOP's grace period running\n"
             "out) kills this process group.");

static PyObject *RdvClient_start(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"interval_ms", "exit_on_loss", "silence_ms", NULL};
  RdvClientObject *self = (RdvClientObject *)op;
  Py_ssize_t interval = 1000, silence = 0;
  int exit_on_loss = 1;
  uint32_t interval_ms, silence_ms;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|npn:start", kwlist, &interval,
                                   &exit_on_loss, &silence))
    return NULL;
  if (check_u32(interval, "interval_ms", 1, &interval_ms) < 0 ||
      check_u32(silence, "silence_ms", 0, &silence_ms) < 0)
    return NULL;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_rdv_client_start(self->h.ptr, interval_ms, silence_ms,
                                           exit_on_loss ? EMBER_RDV_EXIT_ON_LOSS : 0u));
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(RdvClient_stop_state_doc,
             "stop_state() -> int\n\n"
             "0 while running; grace_ms + 1 once a STOP was received; -1 if the\n"
             "driver connection was lost.");

static PyObject *RdvClient_stop_state(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  RdvClientObject *self = (RdvClientObject *)op;
  if (embpy_handle_enter(&self->h) < 0)
    return NULL;
  ember_rdv_client *c = self->h.ptr;
  /* An atomic load in libember: no GIL release, no object lock. */
  int64_t v = ember_rdv_client_stop_state(c);
  embpy_handle_leave(&self->h);
  return PyLong_FromLongLong(v);
}

PyDoc_STRVAR(RdvClient_report_doc,
             "report(kind, code, text, timeout_s=10.0) -> None\n\n"
             "Sends a REPORT: kind is 'progress', 'done' or 'failed'; text (a\n"
             "traceback for 'failed') is truncated by the server to 1 MiB.");

static PyObject *RdvClient_report(PyObject *op, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"kind", "code", "text", "timeout_s", NULL};
  RdvClientObject *self = (RdvClientObject *)op;
  const char *kind_s;
  int code;
  PyObject *text;
  int64_t ms = 10000;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "siU|O&:report", kwlist, &kind_s,
                                   &code, &text, embpy_timeout_conv, &ms))
    return NULL;
  int kind;
  if (strcmp(kind_s, "progress") == 0)
    kind = EMBER_RDV_REPORT_PROGRESS;
  else if (strcmp(kind_s, "done") == 0)
    kind = EMBER_RDV_REPORT_DONE;
  else if (strcmp(kind_s, "failed") == 0)
    kind = EMBER_RDV_REPORT_FAILED;
  else {
    PyErr_Format(PyExc_ValueError,
                 "report kind must be 'progress', 'done' or 'failed', not '%s'", kind_s);
    return NULL;
  }
  /* A failure report must never fail on its own text: lone surrogates are
   * escaped, NUL bytes (which would cut the C string) become "\\0". */
  PyObject *utf8 = PyUnicode_AsEncodedString(text, "utf-8", "backslashreplace");
  if (utf8 == NULL)
    return NULL;
  if (memchr(PyBytes_AS_STRING(utf8), '\0', (size_t)PyBytes_GET_SIZE(utf8)) != NULL) {
    PyObject *fixed = PyObject_CallMethod(utf8, "replace", "y#y#", "\0", (Py_ssize_t)1,
                                          "\\0", (Py_ssize_t)2);
    Py_DECREF(utf8);
    if (fixed == NULL)
      return NULL;
    utf8 = fixed;
  }
  const char *ctext = PyBytes_AS_STRING(utf8);
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    ember_rdv_client_report(self->h.ptr, kind, (int32_t)code, ctext, ms));
  Py_DECREF(utf8);
  if (ok < 0)
    return NULL;
  Py_RETURN_NONE;
}

PyDoc_STRVAR(RdvClient_close_doc,
             "close() -> None\n\nStops the heartbeat thread and closes the connection.  "
             "Idempotent.");

static PyObject *RdvClient_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  embpy_handle_close(&((RdvClientObject *)op)->h);
  Py_RETURN_NONE;
}

static PyObject *RdvClient_exit(PyObject *op, PyObject *args) {
  embpy_handle_close(&((RdvClientObject *)op)->h);
  Py_RETURN_FALSE;
}

static PyMethodDef RdvClient_methods[] = {
    {"register", (PyCFunction)(void (*)(void))RdvClient_register,
     METH_VARARGS | METH_KEYWORDS, RdvClient_register_doc},
    {"wait_spec", RdvClient_wait_spec, METH_O, RdvClient_wait_spec_doc},
    {"start", (PyCFunction)(void (*)(void))RdvClient_start, METH_VARARGS | METH_KEYWORDS,
     RdvClient_start_doc},
    {"stop_state", RdvClient_stop_state, METH_NOARGS, RdvClient_stop_state_doc},
    {"report", (PyCFunction)(void (*)(void))RdvClient_report,
     METH_VARARGS | METH_KEYWORDS, RdvClient_report_doc},
    {"close", RdvClient_close, METH_NOARGS, RdvClient_close_doc},
    {"__enter__", self_enter, METH_NOARGS, NULL},
    {"__exit__", RdvClient_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(RdvClient_doc,
             "RendezvousClient(host, port, secret, timeout_s)\n\n"
             "A node's connection to the reservation server; connects and\n"
             "authenticates at once.  Calls are serialized by a per-object lock;\n"
             "stop_state() may be polled from any thread.");

static PyType_Slot RdvClient_slots[] = {
    {Py_tp_doc, (void *)RdvClient_doc},
    {Py_tp_new, RdvClient_new},
    {Py_tp_dealloc, RdvClient_dealloc},
    {Py_tp_traverse, RdvClient_traverse},
    {Py_tp_methods, RdvClient_methods},
    {0, NULL},
};

static PyType_Spec RdvClient_spec = {
    .name = "ember._ember.RendezvousClient",
    .basicsize = sizeof(RdvClientObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = RdvClient_slots,
};

/* ================================================================ exec */

int embpy_rdv_exec(PyObject *m, ember_state *st) {
  st->RendezvousServer_Type =
      (PyTypeObject *)PyType_FromModuleAndSpec(m, &RdvServer_spec, NULL);
  if (st->RendezvousServer_Type == NULL ||
      PyModule_AddType(m, st->RendezvousServer_Type) < 0)
    return -1;
  st->RendezvousClient_Type =
      (PyTypeObject *)PyType_FromModuleAndSpec(m, &RdvClient_spec, NULL);
  if (st->RendezvousClient_Type == NULL ||
      PyModule_AddType(m, st->RendezvousClient_Type) < 0)
    return -1;
  /* found again through the module attribute by cluster_spec_new */
  PyObject *spec_type = PyType_FromModuleAndSpec(m, &ClusterSpec_spec, NULL);
  if (spec_type == NULL)
    return -1;
  int rc = PyModule_AddType(m, (PyTypeObject *)spec_type);
  Py_DECREF(spec_type);
  return rc;
}
