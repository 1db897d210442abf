/* python/ember/_ember_hdfs.c - HDFS over WebHDFS (ember/webhdfs.h): the
 * HdfsFile reader and the hdfs_* functions.
 *
 * Every network call runs with the GIL released.  HdfsFile wraps one
 * ember_webhdfs_file, which is single-threaded, so it carries a lock taken
 * (without the GIL) around each C call.  A missing file raises
 * EmberFileNotFoundError (also a FileNotFoundError), a permission failure
 * EmberPermissionError (also a PermissionError); every other failure maps as
 * elsewhere in the module (EmberError, EmberTimeout, ...).  The two classes
 * live in the module dict (not in the shared module state), found through
 * the module the function or type belongs to.
 */
#include "_ember.h"

#include <string.h>

#include "ember/spnego.h"
#include "ember/webhdfs.h"

#define NOTFOUND_NAME "EmberFileNotFoundError"
#define PERM_NAME "EmberPermissionError"

/* Raises e: our two file errors for ENOTFOUND / EPERM, the module's
 * mapping for everything else.  m: the module. */
static PyObject *hdfs_raise(PyObject *m, const embpy_err *e) {
  ember_state *st = m ? (ember_state *)PyModule_GetState(m) : NULL;
  if (st == NULL) return NULL;
  const char *cls_name = e->code == EMBER_ENOTFOUND ? NOTFOUND_NAME
                         : e->code == EMBER_EPERM   ? PERM_NAME
                                                    : NULL;
  if (cls_name == NULL) return embpy_raise(st, e);
  PyObject *cls = PyObject_GetAttrString(m, cls_name);
  if (cls == NULL) return NULL;
  PyObject *msg = PyUnicode_DecodeUTF8(e->msg, (Py_ssize_t)strlen(e->msg), "replace");
  if (msg != NULL) {
    PyErr_SetObject(cls, msg); /* .code and .name are class attributes */
    Py_DECREF(msg);
  }
  Py_DECREF(cls);
  return NULL;
}

/* ================================================================ options */

typedef struct {
  ember_webhdfs_opts o;
  int64_t timeout_ms;
} hdfs_opts;

static int opts_finish(hdfs_opts *h, PyObject *namenode, PyObject *user, PyObject *conf_dir,
                       Py_ssize_t range_bytes, int retries) {
  ember_webhdfs_opts_init(&h->o);
  PyObject *strs[3] = {namenode, user, conf_dir};
  const char **dst[3] = {&h->o.namenode, &h->o.user, &h->o.conf_dir};
  const char *names[3] = {"namenode", "user", "conf_dir"};
  for (int i = 0; i < 3; i++) {
    if (strs[i] == NULL || strs[i] == Py_None) continue;
    if (!PyUnicode_Check(strs[i])) {
      PyErr_Format(PyExc_TypeError, "%s must be str or None, not %.100s", names[i],
                   Py_TYPE(strs[i])->tp_name);
      return -1;
    }
    /* valid while the argument lives, i.e. for the whole call */
    *dst[i] = PyUnicode_AsUTF8(strs[i]);
    if (*dst[i] == NULL) return -1;
  }
  if (h->timeout_ms <= 0) {
    PyErr_SetString(PyExc_ValueError, "timeout must be positive");
    return -1;
  }
  h->o.timeout_ms = h->timeout_ms;
  if (range_bytes < 0 || (size_t)range_bytes > EMBER_WEBHDFS_MAX_RANGE) {
    PyErr_Format(PyExc_ValueError, "range_bytes must be in 0..%u (0: default), not %zd",
                 EMBER_WEBHDFS_MAX_RANGE, range_bytes);
    return -1;
  }
  h->o.range_bytes = (size_t)range_bytes;
  h->o.retries = retries;
  return 0;
}

#define OPTS_KW "namenode", "user", "conf_dir", "timeout", "range_bytes", "retries"
#define OPTS_FMT "OOOO&ni"
#define OPTS_DECL                                                          \
  PyObject *namenode = NULL, *user = NULL, *conf_dir = NULL;             \
  Py_ssize_t range_bytes = 0;                                             \
  int retries = -1;                                                       \
  hdfs_opts ho;                                                           \
  ho.timeout_ms = EMBER_WEBHDFS_DEFAULT_TIMEOUT_MS
#define OPTS_ARGS &namenode, &user, &conf_dir, embpy_timeout_conv, &ho.timeout_ms, \
                  &range_bytes, &retries
#define OPTS_FINISH() opts_finish(&ho, namenode, user, conf_dir, range_bytes, retries)

#define OPTS_DOC                                                                       \
  "Options (keyword-only): namenode -- the NameNode's HTTP address \"host:port\"\n"   \
  "(default: from the URL, HADOOP_CONF_DIR's hdfs-site.xml, or port 9870);\n"         \
  "user -- user.name (default: $HADOOP_USER_NAME or the login name); conf_dir --\n"   \
  "a Hadoop conf dir instead of $HADOOP_CONF_DIR; timeout -- seconds for connecting\n" \
  "and for any stall (default 60); range_bytes -- bytes per read request / written\n" \
  "chunk (default 8 MiB); retries -- retries of a lost read (default 4).\n"

/* Reads up to n bytes into dst, looping over ranges so that a read of n
 * gets n unless the file ends first; *got: how many.  Without the GIL. */
static int read_full(ember_webhdfs_file *f, char *dst, size_t n, size_t *got) {
  *got = 0;
  while (*got < n) {
    int64_t r = ember_webhdfs_read(f, dst + *got, n - *got);
    if (r < 0)
      return (int)r;
    if (r == 0)
      break;
    *got += (size_t)r;
  }
  return EMBER_OK;
}

/* hdfs_read's part without the GIL: from start, read up to n, then close. */
static int read_range_and_close(ember_webhdfs_file *f, uint64_t start, char *dst, size_t n,
                                size_t *got) {
  *got = 0;
  int rc = ember_webhdfs_seek(f, start);
  if (rc == EMBER_OK)
    rc = read_full(f, dst, n, got);
  ember_webhdfs_close(f);
  return rc;
}

/* ================================================================ status */

static PyObject *status_dict(const ember_webhdfs_status *s) {
  return Py_BuildValue("{sssssKsLsIsIsKssss}", "name", s->name, "type",
                       s->is_dir ? "DIRECTORY" : "FILE", "length", (unsigned long long)s->length,
                       "modification_time", (long long)s->mtime_ms, "permission",
                       (unsigned)s->permission, "replication", (unsigned)s->replication,
                       "block_size", (unsigned long long)s->block_size, "owner", s->owner,
                       "group", s->group);
}

PyDoc_STRVAR(hdfs_stat_doc,
             "hdfs_stat(url, *, namenode=None, user=None, conf_dir=None, timeout=60.0,\n"
             "          range_bytes=0, retries=-1) -> dict\n\n"
             "GETFILESTATUS of url (hdfs://, webhdfs:// or swebhdfs://): a dict with name\n"
             "(''), type ('FILE' or 'DIRECTORY'), length, modification_time (ms since the\n"
             "epoch), permission (int, e.g. 0o644), replication, block_size, owner, group.\n\n"
             OPTS_DOC);

static PyObject *py_hdfs_stat(PyObject *m, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"url", OPTS_KW, NULL};
  const char *url;
  OPTS_DECL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|$" OPTS_FMT ":hdfs_stat", kwlist, &url,
                                   OPTS_ARGS) ||
      OPTS_FINISH() < 0)
    return NULL;
  ember_webhdfs_status s;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_webhdfs_stat(url, &ho.o, &s));
  if (rc != EMBER_OK) return hdfs_raise(m, &e);
  PyObject *d = status_dict(&s);
  ember_webhdfs_status_clear(&s);
  return d;
}

PyDoc_STRVAR(hdfs_list_doc,
             "hdfs_list(url, *, namenode=None, ...) -> list[dict]\n\n"
             "LISTSTATUS of a directory: one dict per entry (see hdfs_stat), sorted by\n"
             "name.  A file lists as itself, with name ''.\n\n" OPTS_DOC);

static PyObject *py_hdfs_list(PyObject *m, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"url", OPTS_KW, NULL};
  const char *url;
  OPTS_DECL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|$" OPTS_FMT ":hdfs_list", kwlist, &url,
                                   OPTS_ARGS) ||
      OPTS_FINISH() < 0)
    return NULL;
  ember_webhdfs_status *v = NULL;
  size_t n = 0;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_webhdfs_list(url, &ho.o, &v, &n));
  if (rc != EMBER_OK) return hdfs_raise(m, &e);
  PyObject *list = PyList_New((Py_ssize_t)n);
  for (size_t i = 0; list != NULL && i < n; i++) {
    PyObject *d = status_dict(&v[i]);
    if (d == NULL) Py_CLEAR(list);
    else PyList_SET_ITEM(list, (Py_ssize_t)i, d);
  }
  ember_webhdfs_list_free(v, n);
  return list;
}

PyDoc_STRVAR(hdfs_read_doc,
             "hdfs_read(url, offset=0, length=-1, *, namenode=None, ...) -> bytes\n\n"
             "Reads length bytes (all to the end with -1) from offset of the HDFS file url.\n"
             "Raises EmberFileNotFoundError / EmberPermissionError with the path.\n\n" OPTS_DOC);

static PyObject *py_hdfs_read(PyObject *m, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"url", "offset", "length", OPTS_KW, NULL};
  const char *url;
  long long offset = 0, length = -1;
  OPTS_DECL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|LL$" OPTS_FMT ":hdfs_read", kwlist, &url,
                                   &offset, &length, OPTS_ARGS) ||
      OPTS_FINISH() < 0)
    return NULL;
  if (offset < 0) {
    PyErr_Format(PyExc_ValueError, "offset must be >= 0, not %lld", offset);
    return NULL;
  }
  ember_webhdfs_file *f = NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_webhdfs_open(&f, url, &ho.o));
  if (rc != EMBER_OK) return hdfs_raise(m, &e);
  uint64_t size = ember_webhdfs_size(f);
  uint64_t start = (uint64_t)offset < size ? (uint64_t)offset : size;
  uint64_t want = size - start;
  if (length >= 0 && (uint64_t)length < want) want = (uint64_t)length;
  if (want > (uint64_t)PY_SSIZE_T_MAX) {
    ember_webhdfs_close(f);
    return PyErr_NoMemory();
  }
  PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)want);
  if (out == NULL) {
    ember_webhdfs_close(f);
    return NULL;
  }
  /* nobody else can see `out` yet: fill it without the GIL */
  size_t got = 0;
  EMBPY_NOGIL(rc, &e, NULL,
              read_range_and_close(f, start, PyBytes_AS_STRING(out), (size_t)want, &got));
  if (rc != EMBER_OK) {
    Py_DECREF(out);
    return hdfs_raise(m, &e);
  }
  if (got < want && _PyBytes_Resize(&out, (Py_ssize_t)got) < 0) return NULL;
  return out;
}

PyDoc_STRVAR(hdfs_write_doc,
             "hdfs_write(url, data, *, overwrite=True, namenode=None, ...) -> None\n\n"
             "Writes data (bytes-like) as the whole file url: one CREATE (NameNode, then\n"
             "DataNode) when it fits range_bytes, else CREATE then APPENDs.  Parent\n"
             "directories are created.  With overwrite=False an existing file raises.\n\n"
             OPTS_DOC);

static PyObject *py_hdfs_write(PyObject *m, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"url", "data", "overwrite", OPTS_KW, NULL};
  const char *url;
  Py_buffer data;
  int overwrite = 1;
  OPTS_DECL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sy*|$p" OPTS_FMT ":hdfs_write", kwlist, &url,
                                   &data, &overwrite, OPTS_ARGS))
    return NULL;
  if (OPTS_FINISH() < 0) {
    PyBuffer_Release(&data);
    return NULL;
  }
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL,
              ember_webhdfs_write_file(url, data.buf, (size_t)data.len,
                                       overwrite ? EMBER_WEBHDFS_OVERWRITE : 0, &ho.o));
  PyBuffer_Release(&data);
  if (rc != EMBER_OK) return hdfs_raise(m, &e);
  Py_RETURN_NONE;
}

PyDoc_STRVAR(hdfs_mkdirs_doc,
             "hdfs_mkdirs(url, *, namenode=None, ...) -> None\n\n"
             "Creates the directory url and its parents (existing ones are fine).\n\n" OPTS_DOC);

static PyObject *py_hdfs_mkdirs(PyObject *m, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"url", OPTS_KW, NULL};
  const char *url;
  OPTS_DECL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|$" OPTS_FMT ":hdfs_mkdirs", kwlist, &url,
                                   OPTS_ARGS) ||
      OPTS_FINISH() < 0)
    return NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_webhdfs_mkdirs(url, &ho.o));
  if (rc != EMBER_OK) return hdfs_raise(m, &e);
  Py_RETURN_NONE;
}

PyDoc_STRVAR(hdfs_set_permission_doc,
             "hdfs_set_permission(url, mode, *, namenode=None, ...) -> None\n\n"
             "Sets url's permission bits (an int such as 0o700).\n\n" OPTS_DOC);

static PyObject *py_hdfs_set_permission(PyObject *m, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"url", "mode", OPTS_KW, NULL};
  const char *url;
  unsigned int mode;
  OPTS_DECL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sI|$" OPTS_FMT ":hdfs_set_permission", kwlist,
                                   &url, &mode, OPTS_ARGS) ||
      OPTS_FINISH() < 0)
    return NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_webhdfs_set_permission(url, mode, &ho.o));
  if (rc != EMBER_OK) return hdfs_raise(m, &e);
  Py_RETURN_NONE;
}

PyDoc_STRVAR(hdfs_delegation_token_doc,
             "hdfs_delegation_token(url, renewer, *, namenode=None, ...) -> str\n\n"
             "A new HDFS delegation token of the Kerberos user, renewable by renewer,\n"
             "as Hadoop's Token.encodeToUrlString() (kind HDFS_DELEGATION_TOKEN): what\n"
             "a YARN application's launch context carries.\n\n" OPTS_DOC);

static PyObject *py_hdfs_delegation_token(PyObject *m, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"url", "renewer", OPTS_KW, NULL};
  const char *url, *renewer;
  OPTS_DECL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ss|$" OPTS_FMT ":hdfs_delegation_token",
                                   kwlist, &url, &renewer, OPTS_ARGS) ||
      OPTS_FINISH() < 0)
    return NULL;
  embpy_err e;
  int rc;
  char *token = NULL;
  EMBPY_NOGIL(rc, &e, NULL, ember_webhdfs_delegation_token(url, renewer, &ho.o, &token));
  if (rc != EMBER_OK) return hdfs_raise(m, &e);
  PyObject *out = PyUnicode_FromString(token);
  free(token);
  return out;
}

PyDoc_STRVAR(spnego_header_doc,
             "spnego_header(host, what=None) -> str\n\n"
             "The value of an Authorization header (\"Negotiate <token>\") for the\n"
             "Kerberized web service HTTP@host, from the Kerberos ticket cache\n"
             "(KRB5CCNAME) or a client keytab (KRB5_CLIENT_KTNAME).  Raises\n"
             "EmberAuthError saying what to do (kinit, an expired ticket, ...);\n"
             "what names the service in that message.");

static PyObject *py_spnego_header(PyObject *m, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"host", "what", NULL};
  const char *host, *what = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|z:spnego_header", kwlist, &host, &what))
    return NULL;
  char name[300];
  if (what == NULL) {
    snprintf(name, sizeof name, "HTTP@%s", host);
    what = name;
  }
  embpy_err e;
  int rc;
  char *header = NULL;
  EMBPY_NOGIL(rc, &e, NULL, ember_spnego_header(host, what, &header));
  if (rc != EMBER_OK) return hdfs_raise(m, &e);
  /* the header line's value, after "Authorization: " */
  const char *colon = strchr(header, ':');
  PyObject *out = PyUnicode_FromString(colon ? colon + 2 : header);
  free(header);
  return out;
}

PyDoc_STRVAR(kerberos_principal_doc,
             "kerberos_principal() -> str\n\n"
             "The Kerberos principal this process would authenticate as\n"
             "(\"alice@EXAMPLE.COM\"), or \"\" without usable credentials.");

static PyObject *py_kerberos_principal(PyObject *m, PyObject *Py_UNUSED(ignored)) {
  char who[512];
  Py_BEGIN_ALLOW_THREADS;
  ember_spnego_principal(who, sizeof who);
  Py_END_ALLOW_THREADS;
  return PyUnicode_FromString(who);
}

PyDoc_STRVAR(hdfs_delete_doc,
             "hdfs_delete(url, recursive=False, *, namenode=None, ...) -> bool\n\n"
             "Deletes url; True if something was removed (a missing path is not an\n"
             "error).  A non-empty directory needs recursive=True.\n\n" OPTS_DOC);

static PyObject *py_hdfs_delete(PyObject *m, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"url", "recursive", OPTS_KW, NULL};
  const char *url;
  int recursive = 0, deleted = 0;
  OPTS_DECL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|p$" OPTS_FMT ":hdfs_delete", kwlist, &url,
                                   &recursive, OPTS_ARGS) ||
      OPTS_FINISH() < 0)
    return NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_webhdfs_delete(url, recursive, &ho.o, &deleted));
  if (rc != EMBER_OK) return hdfs_raise(m, &e);
  return PyBool_FromLong(deleted);
}

PyDoc_STRVAR(hdfs_rename_doc,
             "hdfs_rename(src, dst, overwrite=False, *, namenode=None, ...) -> None\n\n"
             "Renames the HDFS path src (a URL) to dst (an absolute path, or a URL on the\n"
             "same file system), atomically.  Never moves src *into* a directory dst.\n"
             "An existing dst raises EmberError ('already exists') unless overwrite,\n"
             "which replaces a file or an empty directory.  dst's parent must exist.\n\n"
             OPTS_DOC);

static PyObject *py_hdfs_rename(PyObject *m, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"src", "dst", "overwrite", OPTS_KW, NULL};
  const char *src, *dst;
  int overwrite = 0;
  OPTS_DECL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ss|p$" OPTS_FMT ":hdfs_rename", kwlist, &src,
                                   &dst, &overwrite, OPTS_ARGS) ||
      OPTS_FINISH() < 0)
    return NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL,
              ember_webhdfs_rename(src, dst, overwrite ? EMBER_WEBHDFS_OVERWRITE : 0, &ho.o));
  if (rc != EMBER_OK) return hdfs_raise(m, &e);
  Py_RETURN_NONE;
}

/* ================================================================ HdfsFile */

typedef struct {
  PyObject_HEAD
  embpy_handle h;
  PyObject *url;
  uint64_t size;
} HdfsFileObject;

static void file_destroy(void *p) { ember_webhdfs_close(p); }

static PyObject *HdfsFile_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
  static char *kwlist[] = {"url", OPTS_KW, NULL};
  PyObject *url_obj;
  OPTS_DECL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "U|$" OPTS_FMT ":HdfsFile", kwlist, &url_obj,
                                   OPTS_ARGS) ||
      OPTS_FINISH() < 0)
    return NULL;
  const char *url = PyUnicode_AsUTF8(url_obj);
  if (url == NULL) return NULL;
  PyObject *m = PyType_GetModuleByDef(type, &embpy_module);
  if (m == NULL) return NULL;
  HdfsFileObject *self = (HdfsFileObject *)type->tp_alloc(type, 0);
  if (self == NULL) return NULL;
  self->url = Py_NewRef(url_obj);
  if (embpy_handle_init(&self->h, "HdfsFile", file_destroy, 1) < 0) {
    Py_DECREF(self);
    return NULL;
  }
  self->h.raise = hdfs_raise;
  ember_webhdfs_file *f = NULL;
  embpy_err e;
  int rc;
  EMBPY_NOGIL(rc, &e, NULL, ember_webhdfs_open(&f, url, &ho.o));
  if (rc != EMBER_OK) {
    Py_DECREF(self);
    return hdfs_raise(m, &e);
  }
  self->h.ptr = f;
  self->size = ember_webhdfs_size(f);
  return (PyObject *)self;
}

static int HdfsFile_traverse(PyObject *op, visitproc visit, void *arg) {
  Py_VISIT(Py_TYPE(op));
  Py_VISIT(((HdfsFileObject *)op)->url);
  return 0;
}

static int HdfsFile_clear(PyObject *op) {
  Py_CLEAR(((HdfsFileObject *)op)->url);
  return 0;
}

static void HdfsFile_dealloc(PyObject *op) {
  HdfsFileObject *self = (HdfsFileObject *)op;
  PyTypeObject *tp = Py_TYPE(op);
  PyObject_GC_UnTrack(op);
  embpy_handle_dealloc(&self->h);
  HdfsFile_clear(op);
  tp->tp_free(op);
  Py_DECREF(tp);
}

/* The position, read under the handle's lock (taken without the GIL: a
 * read in another thread holds it for as long as the network takes). */
static int file_tell(HdfsFileObject *self, uint64_t *pos) {
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(self),
                    (*pos = ember_webhdfs_tell(self->h.ptr), EMBER_OK));
  return ok;
}

static PyObject *HdfsFile_read(PyObject *op, PyObject *args) {
  HdfsFileObject *self = (HdfsFileObject *)op;
  Py_ssize_t n = -1;
  if (!PyArg_ParseTuple(args, "|n:read", &n)) return NULL;
  /* another thread may move the position before we read: then the read
   * is shorter than sized here, and the bytes are resized */
  uint64_t pos = 0;
  if (file_tell(self, &pos) < 0) return NULL;
  uint64_t left = pos < self->size ? self->size - pos : 0;
  if (n < 0 || (uint64_t)n > left) {
    if (left > (uint64_t)PY_SSIZE_T_MAX) return PyErr_NoMemory();
    n = (Py_ssize_t)left;
  }
  PyObject *out = PyBytes_FromStringAndSize(NULL, n);
  if (out == NULL) return NULL;
  size_t got = 0;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    read_full(self->h.ptr, PyBytes_AS_STRING(out), (size_t)n, &got));
  if (ok < 0) {
    Py_DECREF(out);
    return NULL;
  }
  if ((Py_ssize_t)got < n && _PyBytes_Resize(&out, (Py_ssize_t)got) < 0) return NULL;
  return out;
}

static PyObject *HdfsFile_readinto(PyObject *op, PyObject *arg) {
  HdfsFileObject *self = (HdfsFileObject *)op;
  Py_buffer b;
  if (PyObject_GetBuffer(arg, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
  size_t got = 0;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op), read_full(self->h.ptr, b.buf, (size_t)b.len, &got));
  PyBuffer_Release(&b);
  if (ok < 0) return NULL;
  return PyLong_FromSize_t(got);
}

/* seek's target from whence and off; *bad when it is outside the file.  No
 * network: the next read fetches. */
static int seek_to(ember_webhdfs_file *f, uint64_t size, int whence, long long off,
                   long long *base, long long *target, int *bad) {
  *base = whence == 0 ? 0 : whence == 1 ? (long long)ember_webhdfs_tell(f) : (long long)size;
  *bad = __builtin_add_overflow(*base, off, target) || *target < 0 ||
         (unsigned long long)*target > size;
  return *bad ? EMBER_OK : ember_webhdfs_seek(f, (uint64_t)*target);
}

static PyObject *HdfsFile_seek(PyObject *op, PyObject *args) {
  HdfsFileObject *self = (HdfsFileObject *)op;
  long long off;
  int whence = 0;
  if (!PyArg_ParseTuple(args, "L|i:seek", &off, &whence)) return NULL;
  if (whence < 0 || whence > 2) {
    PyErr_Format(PyExc_ValueError, "whence must be 0, 1 or 2, not %d", whence);
    return NULL;
  }
  long long base = 0, target = 0;
  int bad = 0, ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    seek_to(self->h.ptr, self->size, whence, off, &base, &target, &bad));
  if (ok < 0) return NULL;
  if (bad)
    return PyErr_Format(PyExc_ValueError, "seek to %lld%+lld is outside the file (0..%llu)",
                        base, off, (unsigned long long)self->size);
  return PyLong_FromLongLong(target);
}

static PyObject *HdfsFile_tell(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  uint64_t pos = 0;
  if (file_tell((HdfsFileObject *)op, &pos) < 0) return NULL;
  return PyLong_FromUnsignedLongLong(pos);
}

static PyObject *HdfsFile_close(PyObject *op, PyObject *Py_UNUSED(ignored)) {
  embpy_handle_close(&((HdfsFileObject *)op)->h);
  Py_RETURN_NONE;
}

static PyObject *HdfsFile_exit(PyObject *op, PyObject *args) { return HdfsFile_close(op, NULL); }

static PyObject *self_enter(PyObject *self, PyObject *Py_UNUSED(ignored)) {
  return Py_NewRef(self);
}

static PyObject *ret_true(PyObject *self, PyObject *Py_UNUSED(ignored)) { Py_RETURN_TRUE; }

static PyObject *HdfsFile_get_size(PyObject *op, void *c) {
  return PyLong_FromUnsignedLongLong(((HdfsFileObject *)op)->size);
}

static PyObject *HdfsFile_get_url(PyObject *op, void *c) {
  return Py_NewRef(((HdfsFileObject *)op)->url);
}

static PyObject *HdfsFile_get_closed(PyObject *op, void *c) {
  HdfsFileObject *self = (HdfsFileObject *)op;
  return PyBool_FromLong(self->h.closed || self->h.ptr == NULL);
}

static PyObject *HdfsFile_get_stats(PyObject *op, void *c) {
  HdfsFileObject *self = (HdfsFileObject *)op;
  ember_webhdfs_stats s;
  int ok;
  EMBPY_HANDLE_CALL(ok, &self->h, Py_TYPE(op),
                    (ember_webhdfs_file_stats(self->h.ptr, &s), EMBER_OK));
  if (ok < 0) return NULL;
  return Py_BuildValue("{sKsKsKsK}", "requests", (unsigned long long)s.requests, "ranges",
                       (unsigned long long)s.ranges, "retries", (unsigned long long)s.retries,
                       "bytes", (unsigned long long)s.bytes);
}

static PyMethodDef HdfsFile_methods[] = {
    {"read", HdfsFile_read, METH_VARARGS,
     "read(n=-1) -> bytes\n\nUp to n bytes (all that is left with -1); b'' at the end."},
    {"readinto", HdfsFile_readinto, METH_O,
     "readinto(buffer) -> int\n\nFills a writable buffer; returns the count (0 at the end)."},
    {"seek", HdfsFile_seek, METH_VARARGS,
     "seek(offset, whence=0) -> int\n\nMoves the position (no network until the next read)."},
    {"tell", HdfsFile_tell, METH_NOARGS, "tell() -> int"},
    {"readable", ret_true, METH_NOARGS, "readable() -> True"},
    {"seekable", ret_true, METH_NOARGS, "seekable() -> True"},
    {"close", HdfsFile_close, METH_NOARGS, "close() -> None"},
    {"__enter__", self_enter, METH_NOARGS, NULL},
    {"__exit__", HdfsFile_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef HdfsFile_getset[] = {
    {"size", HdfsFile_get_size, NULL, "The file's length when opened.", NULL},
    {"url", HdfsFile_get_url, NULL, "The URL it was opened with.", NULL},
    {"closed", HdfsFile_get_closed, NULL, "Whether close() was called.", NULL},
    {"stats", HdfsFile_get_stats, NULL, "{'requests', 'ranges', 'retries', 'bytes'}", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(HdfsFile_doc,
             "HdfsFile(url, *, namenode=None, user=None, conf_dir=None, timeout=60.0,\n"
             "         range_bytes=0, retries=-1)\n\n"
             "A read-only, seekable binary file on HDFS, read over WebHDFS by libember\n"
             "(no JVM, no libhdfs): ranged OPEN requests of range_bytes each, following\n"
             "the NameNode's redirect to a DataNode, resumed from the exact byte after a\n"
             "lost connection.  Opening checks the path (EmberFileNotFoundError,\n"
             "EmberPermissionError, EmberError for a directory).\n\n" OPTS_DOC);

static PyType_Slot HdfsFile_slots[] = {
    {Py_tp_doc, (void *)HdfsFile_doc},
    {Py_tp_new, HdfsFile_new},
    {Py_tp_dealloc, HdfsFile_dealloc},
    {Py_tp_traverse, HdfsFile_traverse},
    {Py_tp_clear, HdfsFile_clear},
    {Py_tp_methods, HdfsFile_methods},
    {Py_tp_getset, HdfsFile_getset},
    {0, NULL},
};

static PyType_Spec HdfsFile_spec = {
    .name = "ember._ember.HdfsFile",
    .basicsize = sizeof(HdfsFileObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = HdfsFile_slots,
};

/* ================================================================ exec */

static PyMethodDef hdfs_functions[] = {
    {"hdfs_read", (PyCFunction)(void (*)(void))py_hdfs_read, METH_VARARGS | METH_KEYWORDS,
     hdfs_read_doc},
    {"hdfs_write", (PyCFunction)(void (*)(void))py_hdfs_write, METH_VARARGS | METH_KEYWORDS,
     hdfs_write_doc},
    {"hdfs_list", (PyCFunction)(void (*)(void))py_hdfs_list, METH_VARARGS | METH_KEYWORDS,
     hdfs_list_doc},
    {"hdfs_stat", (PyCFunction)(void (*)(void))py_hdfs_stat, METH_VARARGS | METH_KEYWORDS,
     hdfs_stat_doc},
    {"hdfs_mkdirs", (PyCFunction)(void (*)(void))py_hdfs_mkdirs, METH_VARARGS | METH_KEYWORDS,
     hdfs_mkdirs_doc},
    {"hdfs_delete", (PyCFunction)(void (*)(void))py_hdfs_delete, METH_VARARGS | METH_KEYWORDS,
     hdfs_delete_doc},
    {"hdfs_set_permission", (PyCFunction)(void (*)(void))py_hdfs_set_permission,
     METH_VARARGS | METH_KEYWORDS, hdfs_set_permission_doc},
    {"hdfs_delegation_token", (PyCFunction)(void (*)(void))py_hdfs_delegation_token,
     METH_VARARGS | METH_KEYWORDS, hdfs_delegation_token_doc},
    {"spnego_header", (PyCFunction)(void (*)(void))py_spnego_header, METH_VARARGS | METH_KEYWORDS,
     spnego_header_doc},
    {"kerberos_principal", py_kerberos_principal, METH_NOARGS, kerberos_principal_doc},
    {"hdfs_rename", (PyCFunction)(void (*)(void))py_hdfs_rename, METH_VARARGS | METH_KEYWORDS,
     hdfs_rename_doc},
    {NULL, NULL, 0, NULL},
};

static int add_error(PyObject *m, ember_state *st, const char *name, PyObject *builtin,
                     int code, const char *doc) {
  char qual[96];
  snprintf(qual, sizeof qual, "ember._ember.%s", name);
  PyObject *bases = PyTuple_Pack(2, st->EmberError, builtin);
  PyObject *dict = Py_BuildValue("{siss}", "code", code, "name", ember_err_name(code));
  PyObject *cls = NULL;
  if (bases != NULL && dict != NULL) cls = PyErr_NewExceptionWithDoc(qual, doc, bases, dict);
  Py_XDECREF(bases);
  Py_XDECREF(dict);
  if (cls == NULL) return -1;
  int r = PyModule_AddObjectRef(m, name, cls);
  Py_DECREF(cls);
  return r;
}

int embpy_hdfs_exec(PyObject *m, ember_state *st) {
  PyTypeObject *t = (PyTypeObject *)PyType_FromModuleAndSpec(m, &HdfsFile_spec, NULL);
  if (t == NULL) return -1;
  int r = PyModule_AddType(m, t);
  Py_DECREF(t); /* the module keeps it */
  if (r < 0) return -1;
  if (PyModule_AddFunctions(m, hdfs_functions) < 0) return -1;
  if (add_error(m, st, NOTFOUND_NAME, PyExc_FileNotFoundError, EMBER_ENOTFOUND,
                "No such file or directory on HDFS (EMBER_ENOTFOUND); the message\n"
                "names the path.") < 0 ||
      add_error(m, st, PERM_NAME, PyExc_PermissionError, EMBER_EPERM,
                "Permission denied on HDFS (EMBER_EPERM, AccessControlException); the\n"
                "message names the path and the user.") < 0)
    return -1;
  return 0;
}
