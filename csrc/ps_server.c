/* ps_server.c - a parameter-server shard (ps.h).
 *
 * One thread runs the acceptor (the servers' one accept path: strangers,
 * authentication, encryption); every authenticated worker connection then
 * gets a thread of its own that reads a request, answers it and reads the
 * next.  Workers are few (tens) and each has one request in flight, so a
 * thread per connection costs little and lets a pull wait for bounded
 * staleness on a condition variable without holding up anyone else.  Each
 * table has its own reader-writer lock: pulls and pushes of rows it holds
 * share it, so workers' requests to one shard run at once (ps_table.c locks
 * each row while it copies or updates it); creating rows, assigns and
 * checkpoints take it alone.  With pushes exclusive, two threads' sparse
 * rounds on one shard were slower than one thread's.  The registry, the
 * clocks and the counters share s->mu.  A worker on this host moves its
 * connection to two shm rings it offers in PS_SHM (ps_link.h); the thread
 * then reads and answers through them. */
#include "ember/ps.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "acceptor.h"
#include "ember/auth.h"
#include "ember/crc32c.h"
#include "ember/error.h"
#include "ember/secure.h"
#include "ember/wire.h"
#include "hadoop_conf.h"
#include "ps_internal.h"
#include "ps_link.h"
#include "ps_table.h"

#define PS_DEFAULT_MAX_FRAME (256u * 1024u * 1024u)
#define PS_IO_MS 600000
#define PS_MAX_TABLES 4096u
#define PS_CKPT_MAGIC 0x53504D45u /* "EMPS" */
#define PS_CKPT_VERSION 1u
#define PS_CKPT_MAX ((size_t)1 << 40)

typedef struct {
  ember__ps_table *table;
  /* shared: pulls and pushes of held rows, stats; exclusive: assigns,
   * saves, and pulls and pushes that create rows */
  pthread_rwlock_t lock;
} ps_entry;

typedef struct ps_conn {
  struct ps_conn *next;
  ember_ps_server *srv;
  ember__ps_link link; /* its rings are installed under s->mu (destroy closes them) */
  char peer[96];
  uint32_t worker;
  pthread_t thread;
  int started;
  int done; /* its thread has ended (under s->mu): reaped at the next accept */
  int counted; /* in stats.workers_connected */
  int shm_asked;               /* PS_SHM came (once per connection) */
  int shm_counted;             /* in stats.shm_connections */
  ember_shm_ring *new_tx, *new_rx; /* attached by PS_SHM, used once it is answered */
  /* Buffers kept from request to request: a 10M-float model's pull and push
   * are 40 MB each, and fresh buffers of that size are fresh mappings whose
   * every page faults (most of the server's time, measured by bench-ps). */
  uint8_t *in;     /* the request's payload */
  size_t in_cap;
  uint64_t *ids;   /* its rows */
  size_t ids_cap;
  float *rows;     /* a pull's reply body, a push's gradients (aligned) */
  size_t rows_cap;
  size_t *slots;   /* a push's table slots (ember__ps_table_push_held) */
  size_t slots_cap;
} ps_conn;

struct ember_ps_server {
  pthread_mutex_t mu;
  pthread_cond_t clock_cond; /* a worker's clock advanced */
  pthread_t thread;
  int thread_started, stopping, wake_fd;
  ember__acceptor *acc;
  uint16_t port;
  uint32_t shard, num_shards, num_workers, staleness, max_frame;
  int shm_enabled;
  uint8_t host_id[16];
  ember_log_fn log_fn;
  void *log_arg;
  ps_entry **tables;
  size_t ntables;
  uint64_t *clocks; /* per worker; UINT64_MAX: finished */
  ps_conn *conns;
  ember_ps_stats stats;
  struct pollfd *pfds;
  size_t pfds_cap;
};

/* ------------------------------------------------------------ helpers */

static void logf_(ember_ps_server *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void logf_(ember_ps_server *s, const char *fmt, ...) {
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  s->log_fn(s->log_arg, line);
}

/* Under s->mu. */
static ps_entry *find_table(ember_ps_server *s, const char *name) {
  for (size_t i = 0; i < s->ntables; i++)
    if (strcmp(ember__ps_table_spec(s->tables[i]->table)->name, name) == 0) return s->tables[i];
  return NULL;
}

/* "a, b, c" of the declared tables, for "no table" messages.  Under s->mu. */
static void table_names(ember_ps_server *s, char *out, size_t cap) {
  size_t at = 0;
  out[0] = '\0';
  for (size_t i = 0; i < s->ntables && at + 1 < cap; i++) {
    int n = snprintf(out + at, cap - at, "%s%s", i ? ", " : "",
                     ember__ps_table_spec(s->tables[i]->table)->name);
    if (n < 0) break;
    at += (size_t)n;
  }
  if (s->ntables == 0) snprintf(out, cap, "none");
}

/* Under s->mu. */
static uint64_t min_clock(const ember_ps_server *s, uint32_t *slowest) {
  uint64_t m = UINT64_MAX;
  for (uint32_t w = 0; w < s->num_workers; w++)
    if (s->clocks[w] < m) {
      m = s->clocks[w];
      if (slowest) *slowest = w;
    }
  return m;
}

static int add_table(ember_ps_server *s, ember__ps_table *t) {
  ps_entry *e;
  ps_entry **grown;
  if (s->ntables >= PS_MAX_TABLES)
    return ember__set_error(EMBER_EINVAL, "ps shard %u: more than %u tables", s->shard,
                            PS_MAX_TABLES);
  e = calloc(1, sizeof *e);
  grown = realloc(s->tables, (s->ntables + 1) * sizeof *grown);
  if (e == NULL || grown == NULL) {
    free(e);
    if (grown) s->tables = grown;
    return ember__set_error(EMBER_ENOMEM, "ps shard %u: out of memory", s->shard);
  }
  s->tables = grown;
  pthread_rwlock_init(&e->lock, NULL);
  e->table = t;
  s->tables[s->ntables++] = e;
  return EMBER_OK;
}

/* ------------------------------------------------------------ requests */

typedef struct {
  int status;
  char reason[512];
  const void *body; /* sent after status and reason (status 0 only) */
  size_t body_len;
} ps_reply;

/* *buf holds at least `need` bytes (grown, never shrunk). */
static int grow(void **buf, size_t *cap, size_t need) {
  if (need <= *cap) return EMBER_OK;
  size_t want = need > *cap * 2 ? need : *cap * 2;
  void *p = realloc(*buf, want);
  if (p == NULL) return EMBER_ENOMEM;
  *buf = p;
  *cap = want;
  return EMBER_OK;
}

static int refuse(ps_reply *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int refuse(ps_reply *r, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->reason, sizeof r->reason, fmt, ap);
  va_end(ap);
  r->status = status;
  return status;
}

static void handle_declare(ember_ps_server *s, const uint8_t *p, size_t len, ps_reply *r) {
  ember_ps_table_spec spec, norm;
  char name[EMBER_PS_NAME_MAX], name2[EMBER_PS_NAME_MAX], why[256];
  ember__ps_table *t = NULL;
  int rc = ember__ps_decode_spec(p, len, &spec, name);
  if (rc != EMBER_OK) {
    refuse(r, rc, "ps shard %u of %u: %s", s->shard, s->num_shards, ember_last_error());
    return;
  }
  rc = ember__ps_spec_normalize(&spec, &norm, name2);
  if (rc != EMBER_OK) {
    refuse(r, rc, "ps shard %u of %u: %s", s->shard, s->num_shards, ember_last_error());
    return;
  }
  pthread_mutex_lock(&s->mu);
  ps_entry *e = find_table(s, norm.name);
  if (e != NULL) {
    if (!ember__ps_spec_same(ember__ps_table_spec(e->table), &norm, why, sizeof why))
      refuse(r, EMBER_ESCHEMA,
             "table '%s' on ps shard %u of %u was declared differently: %s", norm.name,
             s->shard, s->num_shards, why);
    pthread_mutex_unlock(&s->mu);
    return;
  }
  rc = ember__ps_table_create(&t, &norm, s->shard, s->num_shards);
  if (rc == EMBER_OK) rc = add_table(s, t);
  if (rc == EMBER_OK) {
    s->stats.tables = s->ntables;
  } else {
    ember__ps_table_destroy(t);
    refuse(r, rc, "%s", ember_last_error());
  }
  pthread_mutex_unlock(&s->mu);
}

/* Waits (bounded staleness) until every worker reached clock - staleness,
 * or wait_ms passed.  Under s->mu. */
static int await_staleness(ember_ps_server *s, ps_conn *c, uint64_t clock, uint32_t wait_ms,
                           ps_reply *r) {
  uint64_t need;
  uint32_t slowest = 0;
  int waited = 0;
  struct timespec until;
  if (s->staleness == EMBER_PS_ASYNC || clock <= s->staleness) return EMBER_OK;
  need = clock - s->staleness;
  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_sec += wait_ms / 1000;
  until.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  while (min_clock(s, &slowest) < need && !s->stopping) {
    if (!waited) s->stats.stale_waits++;
    waited = 1;
    if (pthread_cond_timedwait(&s->clock_cond, &s->mu, &until) == ETIMEDOUT) {
      uint64_t at = min_clock(s, &slowest);
      if (at >= need) break;
      return refuse(r, EMBER_ETIMEDOUT,
                    "ps shard %u of %u: worker %u is at step %llu and this worker (%u) at "
                    "step %llu may lead it by %u steps at most (bounded staleness); waited "
                    "%u ms: is worker %u stuck or gone?",
                    s->shard, s->num_shards, slowest, (unsigned long long)at, c->worker,
                    (unsigned long long)clock, s->staleness, wait_ms, slowest);
    }
  }
  if (s->stopping) return refuse(r, EMBER_EABORTED, "ps shard %u: stopping", s->shard);
  return EMBER_OK;
}

/* The rows a request names: its ids, or (whole) every row this shard holds
 * of a DENSE table. */
static int request_rows(ember_ps_server *s, ps_conn *c, const ember_ps_table_spec *spec,
                        int whole, const uint8_t *raw, uint32_t n, uint64_t **ids,
                        ps_reply *r) {
  *ids = NULL;
  if (n != 0 && grow((void **)&c->ids, &c->ids_cap, (size_t)n * sizeof *c->ids) != EMBER_OK)
    return refuse(r, EMBER_ENOMEM, "ps shard %u: out of memory for %u row ids", s->shard, n);
  if (whole) {
    uint64_t b = ember__ps_dense_begin(spec->rows, s->shard, s->num_shards);
    uint64_t e = ember__ps_dense_begin(spec->rows, s->shard + 1, s->num_shards);
    if (spec->layout != EMBER_PS_DENSE)
      return refuse(r, EMBER_EINVAL,
                    "table '%s' is sparse: name the rows to pull or push (only dense "
                    "tables move whole)", spec->name);
    if (e - b != n)
      return refuse(r, EMBER_ESCHEMA,
                    "table '%s' (shard %u of %u) holds %llu rows, the request moves %u",
                    spec->name, s->shard, s->num_shards, (unsigned long long)(e - b), n);
    *ids = c->ids;
    for (uint32_t i = 0; i < n; i++) c->ids[i] = b + i;
    return EMBER_OK;
  }
  *ids = c->ids;
  for (uint32_t i = 0; i < n; i++) c->ids[i] = ember_wire_get_u64(raw + (size_t)i * 8);
  return EMBER_OK;
}

/* The table a request names, or NULL having refused it naming the tables
 * this shard has (`op`: "pull", "push"...).  Under s->mu. */
static ps_entry *table_or_refuse(ember_ps_server *s, const char *name, const char *op,
                                 ps_reply *r) {
  ps_entry *e = find_table(s, name);
  if (e == NULL) {
    char names[256];
    table_names(s, names, sizeof names);
    refuse(r, EMBER_ENOTFOUND, "%s of table '%s': no such table on ps shard %u of %u "
           "(declared: %s); declare it first", op, name, s->shard, s->num_shards, names);
  }
  return e;
}

static void handle_pull(ember_ps_server *s, ps_conn *c, const uint8_t *p, size_t len,
                        ps_reply *r) {
  ember__ps_pull_req q;
  uint64_t *ids = NULL;
  int rc = ember__ps_decode_pull(p, len, &q);
  if (rc != EMBER_OK) {
    refuse(r, rc, "ps shard %u of %u: %s", s->shard, s->num_shards, ember_last_error());
    return;
  }
  pthread_mutex_lock(&s->mu);
  ps_entry *e = table_or_refuse(s, q.table, "pull", r);
  if (e == NULL) {
    pthread_mutex_unlock(&s->mu);
    return;
  }
  rc = await_staleness(s, c, q.clock, q.wait_ms, r);
  pthread_mutex_unlock(&s->mu);
  if (rc != EMBER_OK) return;
  const ember_ps_table_spec *spec = ember__ps_table_spec(e->table);
  if (request_rows(s, c, spec, q.whole, q.ids, q.n, &ids, r) != EMBER_OK) return;
  size_t floats = (size_t)q.n * spec->cols; /* < 2^52: n < 2^32, cols <= 2^20 */
  if (floats * 4 > s->max_frame) {
    refuse(r, EMBER_ETOOBIG,
           "pull of %u rows x %u floats of table '%s' from ps shard %u: %zu bytes, over the "
           "%u-byte frame limit; pull fewer rows at once", q.n, spec->cols, spec->name, s->shard,
           floats * 4, s->max_frame);
    return;
  }
  if (grow((void **)&c->rows, &c->rows_cap, floats * sizeof *c->rows) != EMBER_OK) {
    refuse(r, EMBER_ENOMEM, "ps shard %u: out of memory for %zu floats", s->shard, floats);
    return;
  }
  pthread_rwlock_rdlock(&e->lock);
  rc = ember__ps_table_read(e->table, ids, q.n, c->rows);
  pthread_rwlock_unlock(&e->lock);
  if (rc == 0) { /* a row not held yet: create it, alone */
    pthread_rwlock_wrlock(&e->lock);
    rc = ember__ps_table_pull(e->table, ids, q.n, c->rows);
    pthread_rwlock_unlock(&e->lock);
  } else if (rc == 1) {
    rc = EMBER_OK;
  }
  if (rc != EMBER_OK) {
    refuse(r, rc, "%s", ember_last_error());
    return;
  }
  r->body = c->rows; /* little-endian floats: the wire's order (ps_internal.h) */
  r->body_len = floats * sizeof *c->rows;
  pthread_mutex_lock(&s->mu);
  s->stats.pulls++;
  s->stats.rows_pulled += q.n;
  pthread_mutex_unlock(&s->mu);
}

/* PS_PUSH (gradients through the optimizer), PS_ASSIGN and PS_INIT
 * (values), which share their layout. */
static void handle_push(ember_ps_server *s, ps_conn *c, uint16_t type, const uint8_t *p,
                        size_t len, ps_reply *r) {
  int assign = type != EMBER_MSG_PS_PUSH;
  const char *op = type == EMBER_MSG_PS_PUSH ? "push" : type == EMBER_MSG_PS_INIT ? "init"
                                                                                  : "assign";
  ember__ps_push_req q;
  uint64_t *ids = NULL;
  int rc = ember__ps_decode_push(p, len, &q);
  if (rc != EMBER_OK) {
    refuse(r, rc, "ps shard %u of %u: %s", s->shard, s->num_shards, ember_last_error());
    return;
  }
  pthread_mutex_lock(&s->mu);
  ps_entry *e = table_or_refuse(s, q.table, op, r);
  pthread_mutex_unlock(&s->mu);
  if (e == NULL) return;
  const ember_ps_table_spec *spec = ember__ps_table_spec(e->table);
  if (q.cols != spec->cols) {
    refuse(r, EMBER_ESCHEMA,
           "%s to table '%s' on ps shard %u of %u: %s of shape (%u, %u), the table's "
           "rows are of shape (%llu, %u): %u floats a row, not %u",
           op, spec->name, s->shard, s->num_shards, assign ? "values" : "gradient", q.n, q.cols,
           (unsigned long long)spec->rows,
           spec->cols, spec->cols, q.cols);
    return;
  }
  if (request_rows(s, c, spec, q.whole, q.ids, q.n, &ids, r) != EMBER_OK) return;
  size_t floats = (size_t)q.n * q.cols;
  /* the floats are used where they arrived when aligned (the payload buffer
   * is malloc's, the offset depends on the table name's length), else
   * copied once into the connection's buffer */
  const float *grads = (const float *)(const void *)q.grads;
  if (floats != 0 && (uintptr_t)q.grads % _Alignof(float) != 0) {
    if (grow((void **)&c->rows, &c->rows_cap, floats * sizeof *c->rows) != EMBER_OK) {
      refuse(r, EMBER_ENOMEM, "ps shard %u: out of memory for %zu floats", s->shard, floats);
      return;
    }
    memcpy(c->rows, q.grads, floats * sizeof *c->rows); /* little-endian hosts: as sent */
    grads = c->rows;
  }
  rc = 0; /* not applied yet */
  if (!assign) {
    if (grow((void **)&c->slots, &c->slots_cap, (size_t)q.n * sizeof *c->slots) != EMBER_OK) {
      refuse(r, EMBER_ENOMEM, "ps shard %u: out of memory for %u rows", s->shard, q.n);
      return;
    }
    pthread_rwlock_rdlock(&e->lock);
    rc = ember__ps_table_push_held(e->table, ids, q.n, grads, c->slots);
    pthread_rwlock_unlock(&e->lock);
  }
  if (rc == 0) { /* an assign, or a push that creates a row: alone */
    pthread_rwlock_wrlock(&e->lock);
    rc = assign ? ember__ps_table_assign(e->table, ids, q.n, grads, type == EMBER_MSG_PS_INIT)
                : ember__ps_table_push(e->table, ids, q.n, grads);
    pthread_rwlock_unlock(&e->lock);
  } else if (rc == 1) {
    rc = EMBER_OK;
  }
  if (rc != EMBER_OK) {
    refuse(r, rc, "%s", ember_last_error());
    return;
  }
  if (!assign) {
    pthread_mutex_lock(&s->mu);
    s->stats.pushes++;
    s->stats.rows_pushed += q.n;
    pthread_mutex_unlock(&s->mu);
  }
}

static void handle_clock(ember_ps_server *s, ps_conn *c, const uint8_t *p, size_t len,
                         ps_reply *r) {
  ember_wire_reader rd;
  ember_wire_reader_init(&rd, p, len);
  uint64_t clock = ember_wire_read_u64(&rd);
  if (ember_wire_reader_finish(&rd, 1, "PS_CLOCK") != EMBER_OK) {
    refuse(r, EMBER_EPROTO, "%s", ember_last_error());
    return;
  }
  pthread_mutex_lock(&s->mu);
  /* a finished worker that clocks again trains again (a second fit) */
  if (clock > s->clocks[c->worker] || clock == UINT64_MAX || s->clocks[c->worker] == UINT64_MAX)
    s->clocks[c->worker] = clock;
  pthread_cond_broadcast(&s->clock_cond);
  pthread_mutex_unlock(&s->mu);
}

static void handle_save(ember_ps_server *s, const uint8_t *p, size_t len, ps_reply *r) {
  ember_wire_reader rd;
  char dir[4096];
  ember_wire_reader_init(&rd, p, len);
  ember_wire_read_str(&rd, dir, sizeof dir);
  if (ember_wire_reader_finish(&rd, 1, "PS_SAVE") != EMBER_OK) {
    refuse(r, EMBER_EPROTO, "%s", ember_last_error());
    return;
  }
  if (ember_ps_server_save(s, dir) != EMBER_OK) refuse(r, EMBER_EIO, "%s", ember_last_error());
}

/* PS_REPLY: the frame header, status and reason, then the body where it
 * lies (a pull's rows: no copy). */
static int send_reply(ps_conn *c, ps_reply *r) {
  ember_wire_writer head;
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
  int ok = r->status == EMBER_OK;
  size_t body = ok ? r->body_len : 0;
  ember_wire_writer_init(&head);
  ember_wire_write_u32(&head, (uint32_t)r->status);
  ember_wire_write_str(&head, ok ? "" : r->reason);
  if (head.err || head.len + body > EMBER_WIRE_ABSOLUTE_MAX) {
    ember_wire_writer_free(&head);
    return EMBER_ENOMEM;
  }
  ember_wire_encode_header(hdr, EMBER_MSG_PS_REPLY, (uint32_t)(head.len + body));
  struct iovec iov[3] = {{hdr, sizeof hdr}, {head.buf, head.len},
                         {(void *)(uintptr_t)r->body, body}};
  int rc = ember__ps_link_sendv(&c->link, iov, body ? 3 : 2, ember_deadline_after(PS_IO_MS));
  pthread_mutex_lock(&c->srv->mu);
  c->srv->stats.bytes_sent += head.len + body;
  pthread_mutex_unlock(&c->srv->mu);
  ember_wire_writer_free(&head);
  return rc;
}

/* The next request into c->in (kept from request to request): its header
 * in *h.  Waits as long as the worker takes (destroy shuts the socket and
 * closes the rings). */
static int recv_request(ember_ps_server *s, ps_conn *c, ember_frame_header *h) {
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
  int rc = ember__ps_link_recv(&c->link, hdr, sizeof hdr, INT64_MAX);
  if (rc != EMBER_OK) return rc;
  rc = ember_wire_decode_header(hdr, sizeof hdr, s->max_frame, h);
  if (rc != EMBER_OK) return rc;
  if (grow((void **)&c->in, &c->in_cap, h->length ? h->length : 1) != EMBER_OK)
    return ember__set_error(EMBER_ENOMEM, "ps shard %u: out of memory for a %u-byte request",
                            s->shard, h->length);
  return ember__ps_link_recv(&c->link, c->in, h->length, ember_deadline_after(PS_IO_MS));
}

/* PS_SHM: attach the worker's rings when it is on this host and the
 * connection is not encrypted; they are used once the reply (over TCP) is
 * out (start_shm).  Declining is a refusal like any other: the worker stays
 * on TCP, or fails naming the reason when it required shared memory. */
static void handle_shm(ember_ps_server *s, ps_conn *c, const uint8_t *p, size_t len,
                       ps_reply *r) {
  static const uint8_t zero[16] = {0};
  uint8_t host[16];
  ember_shm_ring_desc req, rep;
  ember_shm_ring *rx = NULL, *tx = NULL;
  if (c->shm_asked) {
    refuse(r, EMBER_EPROTO, "ps shard %u of %u: worker %u sent PS_SHM twice", s->shard,
           s->num_shards, c->worker);
    return;
  }
  c->shm_asked = 1;
  if (ember__ps_shm_decode(p, len, host, &req, &rep) != EMBER_OK) {
    refuse(r, EMBER_EPROTO, "ps shard %u of %u: %s", s->shard, s->num_shards, ember_last_error());
    return;
  }
  if (!s->shm_enabled) {
    refuse(r, EMBER_ENOTFOUND, "ps shard %u of %u: shared memory is disabled on this shard",
           s->shard, s->num_shards);
  } else if (c->link.sec != NULL) {
    refuse(r, EMBER_ENOTFOUND, "ps shard %u of %u: the connection is encrypted, and "
           "encrypted connections stay on TCP", s->shard, s->num_shards);
  } else if (memcmp(host, zero, 16) != 0 && memcmp(s->host_id, zero, 16) != 0 &&
             memcmp(host, s->host_id, 16) != 0) {
    refuse(r, EMBER_ENOTFOUND, "ps shard %u of %u: worker %u runs on another host", s->shard,
           s->num_shards, c->worker);
  } else {
    int rc = ember_shm_ring_attach(&rx, &req, EMBER_SHM_CONSUMER);
    if (rc == EMBER_OK) rc = ember_shm_ring_attach(&tx, &rep, EMBER_SHM_PRODUCER);
    if (rc != EMBER_OK) {
      refuse(r, rc, "ps shard %u of %u: cannot attach worker %u's rings: %s", s->shard,
             s->num_shards, c->worker, ember_last_error());
      ember_shm_ring_destroy(rx);
      return;
    }
    c->new_rx = rx;
    c->new_tx = tx;
  }
}

/* After PS_SHM's answer went out: the connection continues on the rings.
 * Under s->mu, so that destroy either sees them (and closes them) or this
 * sees it stopping.  EMBER_OK to go on serving. */
static int start_shm(ember_ps_server *s, ps_conn *c) {
  int rc = EMBER_OK;
  pthread_mutex_lock(&s->mu);
  if (s->stopping) {
    ember_shm_ring_destroy(c->new_tx);
    ember_shm_ring_destroy(c->new_rx);
    rc = EMBER_ECLOSED;
  } else {
    ember__ps_link_use_rings(&c->link, c->new_tx, c->new_rx);
    s->stats.shm_connections++;
    c->shm_counted = 1;
  }
  c->new_tx = c->new_rx = NULL;
  pthread_mutex_unlock(&s->mu);
  return rc;
}

static void *conn_main(void *arg) {
  ps_conn *c = arg;
  ember_ps_server *s = c->srv;
  ps_reply hello = {.status = EMBER_OK};
  int ok = send_reply(c, &hello) == EMBER_OK; /* HELLO accepted */
  while (ok) {
    ember_frame_header h;
    ps_reply r = {.status = EMBER_OK};
    int rc = recv_request(s, c, &h);
    if (rc != EMBER_OK) {
      /* a worker that closed between requests simply left; anything else
       * (garbage, a frame over the limit, altered records) is logged */
      if (rc != EMBER_ECLOSED && !s->stopping) {
        logf_(s, "ps shard %u: dropped worker %u (%s): %s", s->shard, c->worker, c->peer,
              ember_last_error());
        pthread_mutex_lock(&s->mu);
        s->stats.requests_refused++;
        pthread_mutex_unlock(&s->mu);
      }
      break;
    }
    pthread_mutex_lock(&s->mu);
    s->stats.bytes_received += h.length;
    pthread_mutex_unlock(&s->mu);
    const uint8_t *payload = c->in;
    switch (h.type) {
    case EMBER_MSG_PS_DECLARE: handle_declare(s, payload, h.length, &r); break;
    case EMBER_MSG_PS_PULL: handle_pull(s, c, payload, h.length, &r); break;
    case EMBER_MSG_PS_PUSH:
    case EMBER_MSG_PS_ASSIGN:
    case EMBER_MSG_PS_INIT: handle_push(s, c, h.type, payload, h.length, &r); break;
    case EMBER_MSG_PS_CLOCK: handle_clock(s, c, payload, h.length, &r); break;
    case EMBER_MSG_PS_SAVE: handle_save(s, payload, h.length, &r); break;
    case EMBER_MSG_PS_SHM: handle_shm(s, c, payload, h.length, &r); break;
    default:
      refuse(&r, EMBER_EPROTO, "ps shard %u: unexpected %s frame", s->shard,
             ember_wire_type_name(h.type));
    }
    /* a declined PS_SHM (ENOTFOUND: another host...) is the normal answer
     * to every worker elsewhere, not a refused request */
    if (r.status != EMBER_OK &&
        !(h.type == EMBER_MSG_PS_SHM && r.status == EMBER_ENOTFOUND)) {
      pthread_mutex_lock(&s->mu);
      s->stats.requests_refused++;
      pthread_mutex_unlock(&s->mu);
    }
    if (send_reply(c, &r) != EMBER_OK) break;
    if (c->new_rx && start_shm(s, c) != EMBER_OK) break;
  }
  /* the worker learns at once that this connection is over (the fd and the
   * rings are freed when the thread is reaped) */
  ember_shm_ring_destroy(c->new_tx);
  ember_shm_ring_destroy(c->new_rx);
  c->new_tx = c->new_rx = NULL;
  pthread_mutex_lock(&s->mu);
  ember__ps_link_shutdown(&c->link);
  c->done = 1;
  if (c->counted) s->stats.workers_connected--;
  if (c->shm_counted) s->stats.shm_connections--;
  c->counted = c->shm_counted = 0;
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* Joins and frees the connections whose threads ended.  Under s->mu. */
static void reap(ember_ps_server *s) {
  for (ps_conn **at = &s->conns; *at;) {
    ps_conn *c = *at;
    if (!c->done) {
      at = &c->next;
      continue;
    }
    *at = c->next;
    if (c->started) pthread_join(c->thread, NULL);
    ember__ps_link_destroy(&c->link);
    free(c->in);
    free(c->ids);
    free(c->rows);
    free(c->slots);
    free(c);
  }
}

/* ------------------------------------------------------------ accepting */

static void refuse_conn(ps_conn *c, int status, const char *why) {
  ember_wire_writer w;
  ember_wire_writer_init(&w);
  ember_wire_write_u32(&w, (uint32_t)status);
  ember_wire_write_str(&w, why);
  if (!w.err)
    (void)ember_sec_send_frame(c->link.sec, c->link.fd, EMBER_MSG_REFUSED, w.buf,
                               (uint32_t)w.len, ember_deadline_after(1000));
  ember_wire_writer_free(&w);
}

static void on_accepted(void *arg, ember__accepted *a) {
  ember_ps_server *s = arg;
  ember_wire_reader rd;
  char why[256] = "";
  reap(s);
  ps_conn *c = calloc(1, sizeof *c);
  if (c == NULL) {
    ember_net_close(a->fd);
    ember_sec_destroy(a->sec);
    free(a->payload);
    return;
  }
  c->srv = s;
  ember__ps_link_init(&c->link, a->fd, a->sec);
  memcpy(c->peer, a->peer, sizeof c->peer);
  if (a->sec) ember_sec_set_peer(a->sec, c->peer);
  ember_wire_reader_init(&rd, a->payload, a->first.length);
  uint32_t worker = ember_wire_read_u32(&rd), workers = ember_wire_read_u32(&rd);
  uint32_t shard = ember_wire_read_u32(&rd), shards = ember_wire_read_u32(&rd);
  free(a->payload);
  if (ember_wire_reader_finish(&rd, 1, "PS_HELLO") != EMBER_OK)
    snprintf(why, sizeof why, "%s", ember_last_error());
  else if (shard != s->shard || shards != s->num_shards)
    snprintf(why, sizeof why, "this is ps shard %u of %u, the worker dialled shard %u of %u",
             s->shard, s->num_shards, shard, shards);
  else if (workers != s->num_workers || worker >= workers)
    snprintf(why, sizeof why, "ps shard %u serves %u workers; worker %u of %u connected",
             s->shard, s->num_workers, worker, workers);
  c->worker = worker;
  c->next = s->conns;
  s->conns = c;
  if (why[0]) {
    s->stats.requests_refused++;
    logf_(s, "ps shard %u: refused %s: %s", s->shard, c->peer, why);
    refuse_conn(c, EMBER_ESTATE, why);
    c->done = 1;
    return;
  }
  if (s->clocks[worker] == UINT64_MAX) s->clocks[worker] = 0; /* a worker back after finishing */
  /* its thread answers the HELLO: replies count bytes under s->mu, held here */
  if (pthread_create(&c->thread, NULL, conn_main, c) == 0) {
    c->started = 1;
    c->counted = 1;
    s->stats.workers_connected++;
  } else {
    c->done = 1;
  }
}

static void on_rejected(void *arg, const char *peer, int authed, const char *reason) {
  ember_ps_server *s = arg;
  s->stats.requests_refused++;
  if (authed) logf_(s, "ps shard %u: refused %s: %s", s->shard, peer, reason);
}

static void on_log(void *arg, const char *line, uint64_t count) {
  ember_ps_server *s = arg;
  s->log_fn(s->log_arg, line);
}

static void *accept_loop(void *arg) {
  ember_ps_server *s = arg;
  pthread_mutex_lock(&s->mu);
  while (!s->stopping) {
    size_t n = 1 + ember__acceptor_npoll(s->acc);
    if (n > s->pfds_cap) {
      struct pollfd *grown = realloc(s->pfds, n * sizeof *grown);
      if (grown == NULL) break;
      s->pfds = grown;
      s->pfds_cap = n;
    }
    s->pfds[0] = (struct pollfd){.fd = s->wake_fd, .events = POLLIN};
    ember__acceptor_poll_fill(s->acc, s->pfds + 1);
    int64_t due = ember__acceptor_due(s->acc), now = ember_now_ms();
    int timeout = due == INT64_MAX ? -1 : due <= now ? 0 : due - now > INT_MAX ? INT_MAX
                                                                               : (int)(due - now);
    pthread_mutex_unlock(&s->mu);
    int rc = poll(s->pfds, (nfds_t)n, timeout);
    pthread_mutex_lock(&s->mu);
    if (rc < 0 && errno != EINTR) break;
    if (rc < 0) continue;
    if (s->pfds[0].revents) {
      uint64_t v;
      ssize_t got = read(s->wake_fd, &v, sizeof v);
      (void)got;
    }
    if (!s->stopping) ember__acceptor_run(s->acc, s->pfds + 1);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* ------------------------------------------------------------ lifecycle */

void ember_ps_server_destroy(ember_ps_server *s) {
  ps_conn *c, *nx;
  if (s == NULL) return;
  pthread_mutex_lock(&s->mu);
  s->stopping = 1;
  pthread_cond_broadcast(&s->clock_cond);
  pthread_mutex_unlock(&s->mu);
  if (s->thread_started) {
    uint64_t one = 1;
    ssize_t w = write(s->wake_fd, &one, sizeof one);
    (void)w;
    pthread_join(s->thread, NULL);
  }
  /* Each connection thread blocks in a read: shutting the socket down and
   * closing the rings ends it (under s->mu: see start_shm). */
  pthread_mutex_lock(&s->mu);
  for (c = s->conns; c; c = c->next) ember__ps_link_shutdown(&c->link);
  pthread_mutex_unlock(&s->mu);
  for (c = s->conns; c; c = nx) {
    nx = c->next;
    if (c->started) pthread_join(c->thread, NULL);
    ember__ps_link_destroy(&c->link);
    free(c->in);
    free(c->ids);
    free(c->rows);
    free(c->slots);
    free(c);
  }
  ember__acceptor_destroy(s->acc);
  for (size_t i = 0; i < s->ntables; i++) {
    ember__ps_table_destroy(s->tables[i]->table);
    pthread_rwlock_destroy(&s->tables[i]->lock);
    free(s->tables[i]);
  }
  free(s->tables);
  free(s->clocks);
  free(s->pfds);
  ember_net_close(s->wake_fd);
  pthread_cond_destroy(&s->clock_cond);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

int ember_ps_server_create(ember_ps_server **out, const ember_ps_server_config *cfg) {
  ember_ps_server *s = NULL;
  pthread_condattr_t ca;
  int rc = EMBER_OK, fd = cfg ? cfg->listen_fd : -1;
  if (out == NULL || cfg == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "ps server: NULL argument");
    goto fail;
  }
  *out = NULL;
  if (cfg->secret == NULL || cfg->secret_len < EMBER_SECRET_MIN_LEN) {
    rc = ember__set_error(EMBER_EINVAL, "ps server: secret must be at least %u bytes",
                          EMBER_SECRET_MIN_LEN);
    goto fail;
  }
  if (cfg->num_shards == 0 || cfg->num_shards > EMBER_PS_MAX_SHARDS ||
      cfg->shard >= cfg->num_shards) {
    rc = ember__set_error(EMBER_EINVAL, "ps server: shard %u of %u (1..%u shards)", cfg->shard,
                          cfg->num_shards, EMBER_PS_MAX_SHARDS);
    goto fail;
  }
  if (cfg->num_workers == 0 || cfg->num_workers > 65536) {
    rc = ember__set_error(EMBER_EINVAL, "ps server: %u workers (1..65536)", cfg->num_workers);
    goto fail;
  }
  s = calloc(1, sizeof *s);
  if (s == NULL || (s->clocks = calloc(cfg->num_workers, sizeof *s->clocks)) == NULL) {
    free(s);
    s = NULL;
    rc = ember__set_error(EMBER_ENOMEM, "ps server: out of memory");
    goto fail;
  }
  s->wake_fd = -1;
  s->shard = cfg->shard;
  s->num_shards = cfg->num_shards;
  s->num_workers = cfg->num_workers;
  s->staleness = cfg->staleness;
  s->max_frame = cfg->max_frame ? cfg->max_frame : PS_DEFAULT_MAX_FRAME;
  if (s->max_frame > EMBER_WIRE_ABSOLUTE_MAX) s->max_frame = EMBER_WIRE_ABSOLUTE_MAX;
  s->shm_enabled = !cfg->disable_shm && ember__ps_env_shm_enabled();
  ember__ps_host_id(s->host_id);
  s->log_fn = cfg->log_fn ? cfg->log_fn : ember__log_stderr;
  s->log_arg = cfg->log_fn ? cfg->log_arg : NULL;
  pthread_mutex_init(&s->mu, NULL);
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->clock_cond, &ca);
  pthread_condattr_destroy(&ca);
  s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s->wake_fd < 0) {
    rc = ember__set_errno(EMBER_ESYS, errno, "ps server: eventfd");
    goto fail;
  }
  {
    ember__acceptor_config acfg = {
        .listen_fd = fd, .bind_host = cfg->bind_host, .port = cfg->port,
        .expected = cfg->num_workers, .secret = cfg->secret, .secret_len = cfg->secret_len,
        .encrypt = cfg->encrypt, .first_type = EMBER_MSG_PS_HELLO, .first_max = 16,
        .refuse_first = 1, .name = "ps server", .arg = s, .ready = on_accepted,
        .rejected = on_rejected, .log = on_log};
    fd = -1; /* the acceptor's now, even if it fails */
    rc = ember__acceptor_create(&s->acc, &acfg);
    if (rc != EMBER_OK) goto fail;
    s->port = ember__acceptor_port(s->acc);
  }
  if (pthread_create(&s->thread, NULL, accept_loop, s) != 0) {
    rc = ember__set_error(EMBER_ESYS, "ps server: cannot start its thread");
    goto fail;
  }
  s->thread_started = 1;
  *out = s;
  return EMBER_OK;
fail:
  ember_net_close(fd);
  ember_ps_server_destroy(s);
  return rc;
}

uint16_t ember_ps_server_port(const ember_ps_server *s) { return s ? s->port : 0; }

void ember_ps_server_stats(ember_ps_server *s, ember_ps_stats *out) {
  if (s == NULL || out == NULL) return;
  pthread_mutex_lock(&s->mu);
  *out = s->stats;
  out->tables = s->ntables;
  out->min_clock = min_clock(s, NULL);
  ps_entry **tables = s->tables;
  size_t n = s->ntables;
  out->rows_held = 0;
  for (size_t i = 0; i < n; i++) {
    pthread_rwlock_rdlock(&tables[i]->lock);
    out->rows_held += ember__ps_table_held(tables[i]->table);
    pthread_rwlock_unlock(&tables[i]->lock);
  }
  pthread_mutex_unlock(&s->mu);
}

/* ------------------------------------------------------------ checkpoints */

static void ckpt_path(const ember_ps_server *s, const char *dir, const char *suffix, char *out,
                      size_t cap) {
  snprintf(out, cap, "%s/ps-%u-of-%u.ckpt%s", dir, s->shard, s->num_shards, suffix);
}

int ember_ps_server_save(ember_ps_server *s, const char *dir) {
  ember_wire_writer w;
  char path[4200], tmp[4200];
  int rc = EMBER_OK, fd = -1;
  if (s == NULL || dir == NULL) return ember__set_error(EMBER_EINVAL, "ps save: NULL argument");
  ckpt_path(s, dir, "", path, sizeof path);
  ckpt_path(s, dir, ".tmp", tmp, sizeof tmp);
  ember_wire_writer_init(&w);
  ember_wire_write_u32(&w, PS_CKPT_MAGIC);
  ember_wire_write_u32(&w, PS_CKPT_VERSION);
  ember_wire_write_u32(&w, s->shard);
  ember_wire_write_u32(&w, s->num_shards);
  pthread_mutex_lock(&s->mu);
  ember_wire_write_u32(&w, (uint32_t)s->ntables);
  for (size_t i = 0; i < s->ntables; i++) {
    /* alone: a checkpoint holds each row as one moment left it */
    pthread_rwlock_wrlock(&s->tables[i]->lock);
    ember__ps_table_encode(s->tables[i]->table, &w);
    pthread_rwlock_unlock(&s->tables[i]->lock);
  }
  pthread_mutex_unlock(&s->mu);
  ember_wire_write_u32(&w, ember_crc32c(0, w.buf, w.len));
  if (w.err) {
    rc = ember__set_error(EMBER_ENOMEM, "ps shard %u: out of memory encoding its checkpoint",
                          s->shard);
    goto out;
  }
  (void)mkdir(dir, 0700);
  fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    rc = ember__set_errno(EMBER_EIO, errno, "ps shard %u: cannot write checkpoint %s", s->shard,
                          tmp);
    goto out;
  }
  for (size_t at = 0; at < w.len;) {
    ssize_t n = write(fd, w.buf + at, w.len - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      rc = ember__set_errno(EMBER_EIO, errno, "ps shard %u: writing checkpoint %s", s->shard, tmp);
      goto out;
    }
    at += (size_t)n;
  }
  if (fsync(fd) != 0 || close(fd) != 0) {
    fd = -1;
    rc = ember__set_errno(EMBER_EIO, errno, "ps shard %u: writing checkpoint %s", s->shard, tmp);
    goto out;
  }
  fd = -1;
  if (rename(tmp, path) != 0)
    rc = ember__set_errno(EMBER_EIO, errno, "ps shard %u: renaming %s to %s", s->shard, tmp, path);
out:
  if (fd >= 0) close(fd);
  if (rc != EMBER_OK) unlink(tmp);
  ember_wire_writer_free(&w);
  return rc;
}

int ember_ps_server_restore(ember_ps_server *s, const char *dir) {
  char path[4200];
  char *buf = NULL;
  size_t len = 0;
  ember_wire_reader rd;
  ember__ps_table **tables = NULL;
  uint32_t n = 0, done = 0;
  int rc;
  if (s == NULL || dir == NULL) return ember__set_error(EMBER_EINVAL, "ps restore: NULL argument");
  ckpt_path(s, dir, "", path, sizeof path);
  rc = ember__read_bounded_file(path, PS_CKPT_MAX, "ps checkpoint", &buf, &len);
  if (rc != EMBER_OK) return rc;
  if (len < 24 || ember_crc32c(0, buf, len - 4) != ember_wire_get_u32((uint8_t *)buf + len - 4)) {
    rc = ember__set_error(EMBER_ECORRUPT, "ps checkpoint %s is corrupt (%s); restore from an "
                          "earlier checkpoint", path, len < 24 ? "truncated" : "bad checksum");
    goto out;
  }
  ember_wire_reader_init(&rd, (const uint8_t *)buf, len - 4);
  uint32_t magic = ember_wire_read_u32(&rd), version = ember_wire_read_u32(&rd);
  uint32_t shard = ember_wire_read_u32(&rd), shards = ember_wire_read_u32(&rd);
  n = ember_wire_read_u32(&rd);
  if (magic != PS_CKPT_MAGIC || version != PS_CKPT_VERSION) {
    rc = ember__set_error(EMBER_ECORRUPT, "%s is not an Ember ps checkpoint (version %u)", path,
                          PS_CKPT_VERSION);
    goto out;
  }
  if (shard != s->shard || shards != s->num_shards) {
    rc = ember__set_error(EMBER_ESCHEMA, "%s holds shard %u of %u; this is shard %u of %u", path,
                          shard, shards, s->shard, s->num_shards);
    goto out;
  }
  if (n > PS_MAX_TABLES) {
    rc = ember__set_error(EMBER_ECORRUPT, "%s: %u tables", path, n);
    goto out;
  }
  tables = calloc(n ? n : 1, sizeof *tables);
  if (tables == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "ps restore: out of memory");
    goto out;
  }
  for (; done < n; done++) {
    rc = ember__ps_table_decode(&rd, s->shard, s->num_shards, &tables[done]);
    if (rc != EMBER_OK) {
      rc = ember__set_error(rc, "%s: table %u: %s", path, done, ember_last_error());
      goto out;
    }
  }
  if (ember_wire_reader_finish(&rd, 1, "ps checkpoint") != EMBER_OK) {
    rc = ember__set_error(EMBER_ECORRUPT, "%s: %s", path, ember_last_error());
    goto out;
  }
  pthread_mutex_lock(&s->mu);
  if (s->ntables != 0) {
    rc = ember__set_error(EMBER_ESTATE, "ps shard %u: restore before any table is declared",
                          s->shard);
  } else {
    for (uint32_t i = 0; i < n && rc == EMBER_OK; i++) {
      rc = add_table(s, tables[i]);
      if (rc == EMBER_OK) tables[i] = NULL;
    }
    s->stats.tables = s->ntables;
  }
  pthread_mutex_unlock(&s->mu);
out:
  if (tables)
    for (uint32_t i = 0; i < done; i++) ember__ps_table_destroy(tables[i]);
  free(tables);
  free(buf);
  return rc;
}
