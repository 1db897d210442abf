/* python/ember/_ember.h - private header of the CPython extension ember._ember.
 *
 * The extension is kept to argument parsing and object lifetime (the style of
 * CPython's Modules/_struct.c, python-zstandard and msgspec): multi-phase
 * init with per-module state, heap types, one exception hierarchy mirroring
 * the C status codes, Py_buffer for bulk data, and the GIL released around
 * every libember call that may block, resolve names or do crypto.
 *
 * Object lifetime and threads.  Every type wrapping a C handle embeds an
 * embpy_handle.  A method "enters" the handle while holding the GIL (which
 * fails with ValueError("X is closed") after close()), releases the GIL for
 * the C call, re-acquires it and "leaves".  close() marks the handle closed
 * and destroys it at once if no call is in flight; otherwise the last call to
 * leave destroys it.  So close() from one thread never frees a handle another
 * thread is blocked in, and no Python thread ever waits on a C destroy while
 * holding the GIL.  Handles whose C API is not thread-safe also carry a
 * PyThread lock, taken with the GIL released, around each C call.
 *
 * Requires CPython >= 3.11 (PyType_GetModuleByDef).
 */
#ifndef EMBER_PY_EMBER_H
#define EMBER_PY_EMBER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

#include <stdint.h>

#include "ember/auth.h"
#include "ember/collective.h"
#include "ember/error.h"
#include "ember/feed.h"
#include "ember/net.h"
#include "ember/rendezvous.h"

#if PY_VERSION_HEX < 0x030B0000
#error "ember._ember needs CPython 3.11 or newer"
#endif

/* The build passes the package's version (python/ember/_version.py); the
 * module refuses to load beside a package of another version. */
#ifndef EMBER_VERSION
#error "EMBER_VERSION must be defined by the build (setup.py reads ember/_version.py)"
#endif

/* ------------------------------------------------------------ module state */

typedef struct {
  PyObject *EmberError;     /* base: .code (negative int), .name ("EMBER_E...") */
  PyObject *EmberTimeout;   /* EMBER_ETIMEDOUT; also a TimeoutError */
  PyObject *EmberAuthError; /* EMBER_EAUTH */
  PyObject *EmberAborted;   /* EMBER_EABORTED */
  PyTypeObject *RendezvousServer_Type;
  PyTypeObject *RendezvousClient_Type;
  PyTypeObject *FeedServer_Type;
  PyTypeObject *FeedClient_Type;
  PyTypeObject *FeedItem_Type;
  PyTypeObject *Communicator_Type;
  /* _ember_tfrecord.c */
  PyObject *EmberCorruptError; /* EMBER_ECORRUPT, EMBER_ETRUNCATED */
  PyObject *EmberSchemaError;  /* EMBER_ESCHEMA; also a ValueError */
  PyTypeObject *Buffer_Type;
  PyTypeObject *ExampleDecoder_Type;
  PyTypeObject *TFRecordReader_Type;
  PyTypeObject *TFRecordWriter_Type;
  /* _ember_ps.c */
  PyTypeObject *PsServer_Type;
  PyTypeObject *PsClient_Type;
  PyObject *np_empty; /* numpy.empty, imported on the first PsClient.pull (NULL before) */
  /* _ember_records.c: numpy's ndarray and scalar types, imported on the first
   * records_to_columns() call (NULL before; see records_np_types there) */
  PyObject *np_types;
  PyTypeObject *PickledRecords_Type;
} ember_state;

extern PyModuleDef embpy_module;

/* The state of the module that created `tp` (one of our heap types). */
static inline ember_state *embpy_state_of_type(PyTypeObject *tp) {
  PyObject *m = PyType_GetModuleByDef(tp, &embpy_module);
  return m ? (ember_state *)PyModule_GetState(m) : NULL;
}

/* ------------------------------------------------------------ errors */

/* Room for ember_last_error(); longer messages are truncated with "...". */
#define EMBPY_ERRMSG_MAX 4096

/* A failure captured on the thread that made the call, without the GIL. */
typedef struct {
  int code;
  char msg[EMBPY_ERRMSG_MAX];
} embpy_err;

/* Records `code` and copies ember_last_error() (or ember_strerror(code) when
 * the thread has no message).  Must be called on the thread that made the
 * failing libember call, before it makes another one; does not need the GIL. */
void embpy_err_capture(embpy_err *e, int code);

/* Raises the exception class for e->code with e->msg; returns NULL. */
PyObject *embpy_raise(ember_state *st, const embpy_err *e);

/* Calls `call` (an expression yielding an int status) with the thread's last
 * error cleared first, capturing the failure into *err.  No GIL needed. */
#define EMBPY_CALL(rc, err, call)        \
  do {                                   \
    ember_clear_error();                 \
    (rc) = (call);                       \
    if ((rc) != EMBER_OK)                \
      embpy_err_capture((err), (rc));    \
  } while (0)

/* Replaces the current exception by a new one of type `type` whose __cause__
 * is the old one.  Returns NULL. */
PyObject *embpy_chain(PyObject *type, const char *fmt, ...);

/* ------------------------------------------------------------ arguments */

/* "O&" converter: float seconds -> int64 milliseconds (rounded up; inf is
 * clamped to ~100 years).  Rejects negative and NaN with ValueError. */
int embpy_timeout_conv(PyObject *obj, void *out_ms);

/* "O&" converter for a TCP port 0..65535 into uint16_t. */
int embpy_port_conv(PyObject *obj, void *out_port);

/* ------------------------------------------------------------ handles */

typedef struct {
  void *ptr;                 /* the C handle; NULL once destroyed */
  void (*destroy)(void *);   /* ember_x_destroy */
  const char *what;          /* type name, for "X is closed" */
  int closed;                /* close() was called (GIL-protected) */
  Py_ssize_t busy;           /* calls in flight (GIL-protected) */
  PyThread_type_lock lock;   /* serializes C calls, or NULL if not needed */
  /* raises a failed call's error (module: the type's); NULL: embpy_raise */
  PyObject *(*raise)(PyObject *module, const embpy_err *e);
} embpy_handle;

/* Initializes h; allocates the lock when want_lock.  -1 with MemoryError. */
int embpy_handle_init(embpy_handle *h, const char *what, void (*destroy)(void *),
                      int want_lock);
/* Marks a call in flight; -1 with ValueError("X is closed") after close(). */
int embpy_handle_enter(embpy_handle *h);
/* Ends a call; destroys the handle if it was closed meanwhile and this was
 * the last call in flight. */
void embpy_handle_leave(embpy_handle *h);
/* close(): idempotent; destroys now, or when the last call leaves. */
void embpy_handle_close(embpy_handle *h);
/* tp_dealloc: destroys the handle (no call can be in flight) and the lock. */
void embpy_handle_dealloc(embpy_handle *h);
/* Raises e, a failed call on h made by a method of type tp (h->raise, else
 * embpy_raise).  Returns NULL. */
PyObject *embpy_handle_raise(const embpy_handle *h, PyTypeObject *tp, const embpy_err *e);

/* Lock helpers for use inside Py_BEGIN_ALLOW_THREADS. */
static inline void embpy_lock(PyThread_type_lock lock) {
  if (lock)
    PyThread_acquire_lock(lock, WAIT_LOCK);
}
static inline void embpy_unlock(PyThread_type_lock lock) {
  if (lock)
    PyThread_release_lock(lock);
}

/* ------------------------------------------------------------ calls */

/* EMBPY_CALL with the GIL released and `lock` held (NULL: none), taken
 * without the GIL: how every call that may block reaches libember. */
#define EMBPY_NOGIL(rc, err, lock, call) \
  do {                                   \
    Py_BEGIN_ALLOW_THREADS               \
    embpy_lock(lock);                    \
    EMBPY_CALL(rc, err, call);           \
    embpy_unlock(lock);                  \
    Py_END_ALLOW_THREADS                 \
  } while (0)

/* A method's call on its handle, the sequence written once: enters h
 * (ValueError after close()), runs `call` (an int status) as EMBPY_NOGIL
 * does with h's lock, leaves h, and raises a failure (embpy_handle_raise;
 * tp: the method's type).  `call` may read h->ptr, which stays valid
 * while h is entered; a call that returns no status is written
 * `(v = f(h->ptr), EMBER_OK)`.  Sets ok to 0, or to -1 with an exception
 * set.  Needs the GIL (and leaves it held). */
#define EMBPY_HANDLE_CALL(ok, h, tp, call)                \
  do {                                                    \
    embpy_err e_;                                         \
    int rc_;                                              \
    (ok) = -1;                                            \
    if (embpy_handle_enter(h) < 0)                        \
      break;                                              \
    EMBPY_NOGIL(rc_, &e_, (h)->lock, call);               \
    embpy_handle_leave(h);                                \
    if (rc_ != EMBER_OK)                                  \
      embpy_handle_raise(h, tp, &e_);                     \
    else                                                  \
      (ok) = 0;                                           \
  } while (0)

/* How long one slice of a long wait runs without the GIL: between slices
 * the wait notices close() from another thread and Ctrl-C. */
#define EMBPY_SLICE_MS 250

/* A method's wait of up to ms on its handle (the sequence of
 * EMBPY_HANDLE_CALL for calls that may wait long): enters h, then calls
 * fn(arg, slice_ms), an int status waiting at most slice_ms, in slices of
 * EMBPY_SLICE_MS as EMBPY_NOGIL does, until it returns anything but
 * EMBER_ETIMEDOUT or ms have passed; between slices, close() raises
 * ValueError and a signal handler may raise (KeyboardInterrupt).  Leaves h.
 * Returns 0 (fn succeeded), 1 (the whole wait timed out: no exception), or
 * -1 with an exception set (a failure of fn is raised).  Needs the GIL. */
int embpy_handle_wait(embpy_handle *h, PyTypeObject *tp, int64_t ms,
                      int (*fn)(void *arg, int64_t slice_ms), void *arg);

/* ------------------------------------------------------------ column specs */

/* Parsed column specs: the ember_column array plus everything that keeps its
 * pointers valid (buffer exports, name strings, aligned offset copies). */
typedef struct {
  uint32_t ncols;
  uint32_t nrows;
  ember_column *cols;
  Py_buffer *views;   /* 2 * ncols: [2i] data, [2i+1] offsets (obj NULL if unused) */
  PyObject **names;   /* ncols strong references to the name str objects */
  uint64_t **copies;  /* ncols: aligned copies of misaligned offsets, or NULL */
} embpy_columns;

/* Parses a sequence of (name, dtype, width, data, offsets) tuples for nrows
 * rows.  0 on success (release with embpy_columns_release), -1 with an
 * exception set (nothing to release). */
int embpy_columns_parse(PyObject *columns, Py_ssize_t nrows, embpy_columns *out);
void embpy_columns_release(embpy_columns *c);

/* A decoded batch: column descriptors pointing into the buffer. */
typedef struct {
  uint32_t ncols;
  uint32_t nrows;
  ember_column *cols; /* PyMem_Raw-allocated; free with embpy_decoded_free */
} embpy_decoded;

/* Decodes buf[0..len) (8-aligned) without the GIL.  Status; on failure the
 * error is left for embpy_err_capture. */
int embpy_decode(const uint8_t *buf, size_t len, embpy_decoded *out);
void embpy_decoded_free(embpy_decoded *d);

/* [(name, dtype, width, offset, nbytes, offsets_offset), ...] relative to base. */
PyObject *embpy_decoded_to_list(const uint8_t *base, const embpy_decoded *d);

/* Batches at least this big are encoded/decoded with the GIL released. */
#define EMBPY_NOGIL_BYTES (64u * 1024u)

/* ------------------------------------------------------------ submodules */

int embpy_rdv_exec(PyObject *m, ember_state *st);
int embpy_feed_exec(PyObject *m, ember_state *st);
int embpy_coll_exec(PyObject *m, ember_state *st);
int embpy_tfrecord_exec(PyObject *m, ember_state *st);
int embpy_hdfs_exec(PyObject *m, ember_state *st);
int embpy_records_exec(PyObject *m, ember_state *st);
int embpy_ps_exec(PyObject *m, ember_state *st);

/* A chunk of records planned for conversion to feed columns
 * (_ember_records.c): plan, lay out the batch from the columns, write into
 * its places, keep the refs for the next chunk. */
typedef struct embpy_records embpy_records;
/* 0 (*out set; free it), 1 (not the fast path: the Python path converts the
 * chunk), or -1 with an exception.  records: a list, or PickledRecords (held
 * by the caller until the write); fields and refs: lists or None, as
 * records_to_columns() takes them. */
int embpy_records_plan(ember_state *st, PyObject *records, PyObject *fields, PyObject *refs,
                       embpy_records **out);
Py_ssize_t embpy_records_nrows(const embpy_records *r);
Py_ssize_t embpy_records_ncols(const embpy_records *r);
/* The bytes of the planned columns' data and offsets. */
Py_ssize_t embpy_records_bytes(const embpy_records *r);
/* The planned columns' shapes (names point into r; data and offsets unset);
 * 0, or 1 when a column exceeds a batch's limits. */
int embpy_records_columns(const embpy_records *r, ember_column *out);
/* Writes each column into places[j] (GIL held).  0, 1 (a value disagrees
 * with the plan: nothing usable was written), or -1 with an exception. */
int embpy_records_write(embpy_records *r, const ember_batch_place *places);
/* The refs for the partition's next chunk (a new list), or NULL. */
PyObject *embpy_records_refs(const embpy_records *r);
void embpy_records_free(embpy_records *r); /* accepts NULL */

#endif /* EMBER_PY_EMBER_H */
