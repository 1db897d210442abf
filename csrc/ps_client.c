/* ps_client.c - a worker's side of the parameter server (ps.h).
 *
 * One authenticated connection per shard, moved to shared memory when the
 * shard is on this host (ps_link.h).  A call that touches several shards
 * writes every shard's request first and then reads the replies, so the
 * shards work at once; rows are bucketed by ember_ps_shard_of_row and
 * scattered back into the caller's order. */
#include "ember/ps.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "acceptor.h"
#include "ember/auth.h"
#include "ember/error.h"
#include "ember/secure.h"
#include "ember/wire.h"
#include "ps_internal.h"
#include "ps_link.h"
#include "ps_table.h"

#define PS_CLIENT_DEFAULT_TIMEOUT_MS 600000
/* Beyond the bounded-staleness wait the server may spend, the time its
 * reply may take to arrive. */
#define PS_REPLY_SLACK_MS 10000

typedef struct {
  ember__ps_link io;
  char where[160]; /* "ps shard 1 of 2 at 10.0.0.2:7077" */
  uint64_t sent, received;
} ps_link;

typedef struct {
  ember_ps_table_spec spec;
  char name[EMBER_PS_NAME_MAX];
} ps_known;

struct ember_ps_client {
  ps_link *links;
  uint32_t num_shards, worker, num_workers;
  int64_t timeout_ms;
  uint64_t clock;
  int broken; /* a call failed between its requests and their replies */
  atomic_int aborted;
  ps_known *tables;
  size_t ntables;
  uint64_t sent, received;
  /* per-call scratch, by shard */
  uint32_t *count;
  ember_wire_writer *req;
  /* a whole dense push's rows, sent from where they lie after req (NULL: none) */
  const float **tail;
  size_t *tail_floats;
};

/* ------------------------------------------------------------ one exchange */

/* A failed exchange with shard k: the connection is of no more use.  A
 * dropped connection is worded as the collectives word a vanished peer, so
 * the driver counts this worker's failure as the ps node's casualty. */
static int link_failed(ember_ps_client *c, uint32_t k, int rc) {
  c->broken = 1;
  if (atomic_load(&c->aborted))
    return ember__set_error(EMBER_EABORTED, "%s: the client was aborted", c->links[k].where);
  if (rc == EMBER_ECLOSED || rc == EMBER_EIO)
    return ember__set_error(rc, "%s: %s (the ps node failed, was killed or left)",
                            c->links[k].where, ember_last_error());
  return ember__set_error(rc, "%s: %s", c->links[k].where, ember_last_error());
}

/* Shard k's request: w's bytes, then c->tail[k]'s floats where they lie
 * (a whole dense push: a 40 MB gradient is not copied into w). */
static int send_req(ember_ps_client *c, uint32_t k, uint16_t type, const ember_wire_writer *w) {
  ps_link *l = &c->links[k];
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
  size_t tail = c->tail[k] ? c->tail_floats[k] * sizeof(float) : 0;
  if (w->err) return ember__set_error(EMBER_ENOMEM, "%s: out of memory for a request", l->where);
  if (w->len + tail > EMBER_WIRE_ABSOLUTE_MAX)
    return ember__set_error(EMBER_ETOOBIG, "%s: a request of %zu bytes; move fewer rows at once",
                            l->where, w->len + tail);
  ember_wire_encode_header(hdr, type, (uint32_t)(w->len + tail));
  struct iovec iov[3] = {{hdr, sizeof hdr}, {w->buf, w->len},
                         {(void *)(uintptr_t)c->tail[k], tail}};
  int rc = ember__ps_link_sendv(&l->io, iov, tail ? 3 : 2, ember_deadline_after(c->timeout_ms));
  if (rc != EMBER_OK) return link_failed(c, k, rc);
  c->sent += w->len + tail;
  l->sent += w->len + tail;
  return EMBER_OK;
}

/* Reads shard k's reply: its status (refusals become this thread's error,
 * with the server's reason) and, when body is not NULL, exactly body_len
 * bytes of body, received straight into body (a 40 MB pull is not staged). */
static int recv_reply(ember_ps_client *c, uint32_t k, void *body, size_t body_len) {
  ps_link *l = &c->links[k];
  uint8_t hdr[EMBER_WIRE_HEADER_LEN], pre[8];
  char reason[1024];
  ember_frame_header h;
  int64_t deadline = ember_deadline_after(c->timeout_ms + PS_REPLY_SLACK_MS);
  int rc = ember__ps_link_recv(&l->io, hdr, sizeof hdr, deadline);
  if (rc == EMBER_OK) rc = ember_wire_decode_header(hdr, sizeof hdr, EMBER_WIRE_ABSOLUTE_MAX, &h);
  if (rc == EMBER_OK && h.type != EMBER_MSG_PS_REPLY && h.type != EMBER_MSG_REFUSED)
    rc = ember__set_error(EMBER_EPROTO, "unexpected %s frame", ember_wire_type_name(h.type));
  if (rc == EMBER_OK && h.length < sizeof pre)
    rc = ember__set_error(EMBER_EPROTO, "a reply of %u bytes", h.length);
  if (rc == EMBER_OK) rc = ember__ps_link_recv(&l->io, pre, sizeof pre, deadline);
  if (rc != EMBER_OK) return link_failed(c, k, rc);
  int32_t status = (int32_t)ember_wire_get_u32(pre);
  uint32_t reason_len = ember_wire_get_u32(pre + 4);
  if (reason_len >= sizeof reason || reason_len > h.length - sizeof pre)
    return link_failed(c, k, ember__set_error(EMBER_EPROTO, "malformed reply (reason of %u "
                                              "bytes)", reason_len));
  rc = ember__ps_link_recv(&l->io, reason, reason_len, deadline);
  if (rc != EMBER_OK) return link_failed(c, k, rc);
  reason[reason_len] = '\0';
  size_t rest = h.length - sizeof pre - reason_len;
  c->received += h.length;
  l->received += h.length;
  if (h.type == EMBER_MSG_REFUSED || status != EMBER_OK) {
    int code = status < 0 ? status : EMBER_EPROTO;
    if (h.type == EMBER_MSG_REFUSED || rest != 0) c->broken = 1;
    return ember__set_error(code, "%s", reason[0] ? reason : ember_strerror(code));
  }
  if (rest != (body ? body_len : 0))
    return link_failed(c, k, ember__set_error(EMBER_EPROTO, "reply of %zu bytes, %zu expected",
                                              rest, body ? body_len : (size_t)0));
  if (rest != 0 && (rc = ember__ps_link_recv(&l->io, body, rest, deadline)) != EMBER_OK)
    return link_failed(c, k, rc);
  return EMBER_OK;
}

static int check_usable(ember_ps_client *c) {
  if (c == NULL) return ember__set_error(EMBER_EINVAL, "ps client: NULL");
  if (atomic_load(&c->aborted))
    return ember__set_error(EMBER_ESTATE, "ps client: aborted; create a new client");
  if (c->broken)
    return ember__set_error(EMBER_ESTATE,
                            "ps client: an earlier call failed half-way (connection lost or "
                            "garbled); create a new client");
  return EMBER_OK;
}

/* The same request to every shard, then every reply; the first failure is
 * the error, after every reply was read. */
static int broadcast(ember_ps_client *c, uint16_t type, const ember_wire_writer *w) {
  int rc = check_usable(c), first = EMBER_OK;
  char err[1024] = "";
  if (rc != EMBER_OK) return rc;
  for (uint32_t k = 0; k < c->num_shards; k++)
    if ((rc = send_req(c, k, type, w)) != EMBER_OK) return rc;
  for (uint32_t k = 0; k < c->num_shards; k++) {
    rc = recv_reply(c, k, NULL, 0);
    if (rc != EMBER_OK && first == EMBER_OK) {
      first = rc;
      snprintf(err, sizeof err, "%s", ember_last_error());
    }
    if (c->broken) return rc;
  }
  return first == EMBER_OK ? EMBER_OK : ember__set_error(first, "%s", err);
}

/* ------------------------------------------------------------ lifecycle */

void ember_ps_client_destroy(ember_ps_client *c) {
  if (c == NULL) return;
  for (uint32_t k = 0; c->links && k < c->num_shards; k++) ember__ps_link_destroy(&c->links[k].io);
  for (uint32_t k = 0; c->req && k < c->num_shards; k++) ember_wire_writer_free(&c->req[k]);
  free(c->req);
  free(c->tail);
  free(c->tail_floats);
  free(c->count);
  free(c->links);
  free(c->tables);
  free(c);
}

/* PS_SHM to shard k (ps.h, "Transport"): on the rings when the shard
 * attached them; otherwise still on TCP, which is an error only when
 * required (shm ON) or when the connection itself failed. */
static int offer_shm(ember_ps_client *c, uint32_t k, int required, size_t bytes) {
  ps_link *l = &c->links[k];
  ember_shm_ring *req = NULL, *rep = NULL;
  uint8_t offer[EMBER__PS_SHM_LEN];
  int rc = ember__ps_shm_offer(bytes, &req, &rep, offer);
  if (rc != EMBER_OK)
    return required ? ember__set_error(rc, "%s: shared memory (shm on): %s", l->where,
                                       ember_last_error())
                    : EMBER_OK; /* no memfd here: TCP */
  ember_wire_writer *w = &c->req[k];
  w->len = 0;
  ember_wire_write_raw(w, offer, sizeof offer);
  rc = send_req(c, k, EMBER_MSG_PS_SHM, w);
  if (rc == EMBER_OK) rc = recv_reply(c, k, NULL, 0);
  if (rc == EMBER_OK) {
    ember__ps_link_use_rings(&l->io, req, rep);
    return EMBER_OK;
  }
  ember_shm_ring_destroy(req);
  ember_shm_ring_destroy(rep);
  if (c->broken) return rc; /* the connection failed: named by link_failed */
  if (required)
    return ember__set_error(rc, "%s: shared memory was required (shm on) and the shard "
                            "declined it: %s", l->where, ember_last_error());
  return EMBER_OK; /* declined (another host, disabled...): TCP */
}

int ember_ps_client_create(ember_ps_client **out, const ember_ps_client_config *cfg) {
  ember_ps_client *c = NULL;
  int rc;
  if (out == NULL || cfg == NULL || (cfg->num_shards && (!cfg->hosts || !cfg->ports)))
    return ember__set_error(EMBER_EINVAL, "ps client: NULL argument");
  *out = NULL;
  if (cfg->num_shards == 0 || cfg->num_shards > EMBER_PS_MAX_SHARDS)
    return ember__set_error(EMBER_EINVAL, "ps client: %u shards (1..%u)", cfg->num_shards,
                            EMBER_PS_MAX_SHARDS);
  if (cfg->worker >= cfg->num_workers)
    return ember__set_error(EMBER_EINVAL, "ps client: worker %u of %u", cfg->worker,
                            cfg->num_workers);
  if (cfg->shm < EMBER_PS_SHM_AUTO || cfg->shm > EMBER_PS_SHM_ON)
    return ember__set_error(EMBER_EINVAL, "ps client: unknown shm mode %d", cfg->shm);
  if (cfg->shm == EMBER_PS_SHM_ON && cfg->encrypt)
    return ember__set_error(EMBER_EINVAL, "ps client: shm on and encrypt both asked for; "
                            "encrypted connections stay on TCP (ps.h, \"Transport\"): "
                            "drop one of them");
  if (cfg->shm_bytes != 0 &&
      (cfg->shm_bytes < EMBER_SHM_RING_MIN_BYTES || cfg->shm_bytes > EMBER_SHM_RING_MAX_BYTES))
    return ember__set_error(EMBER_EINVAL, "ps client: shm_bytes %zu is outside %u..%u",
                            cfg->shm_bytes, EMBER_SHM_RING_MIN_BYTES,
                            EMBER_SHM_RING_MAX_BYTES);
  c = calloc(1, sizeof *c);
  if (c == NULL || !(c->links = calloc(cfg->num_shards, sizeof *c->links)) ||
      !(c->count = calloc(cfg->num_shards, sizeof *c->count)) ||
      !(c->req = calloc(cfg->num_shards, sizeof *c->req)) ||
      !(c->tail = calloc(cfg->num_shards, sizeof *c->tail)) ||
      !(c->tail_floats = calloc(cfg->num_shards, sizeof *c->tail_floats))) {
    ember_ps_client_destroy(c);
    return ember__set_error(EMBER_ENOMEM, "ps client: out of memory");
  }
  c->num_shards = cfg->num_shards;
  c->worker = cfg->worker;
  c->num_workers = cfg->num_workers;
  c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : PS_CLIENT_DEFAULT_TIMEOUT_MS;
  for (uint32_t k = 0; k < c->num_shards; k++) {
    ember__ps_link_init(&c->links[k].io, -1, NULL);
    ember_wire_writer_init(&c->req[k]);
  }
  int shm = cfg->shm == EMBER_PS_SHM_ON ||
            (cfg->shm == EMBER_PS_SHM_AUTO && !cfg->encrypt && ember__ps_env_shm_enabled());
  size_t shm_bytes = cfg->shm_bytes ? cfg->shm_bytes : EMBER__PS_SHM_DEFAULT_BYTES;
  int64_t deadline = ember_deadline_after(c->timeout_ms);
  for (uint32_t k = 0; k < c->num_shards; k++) {
    ps_link *l = &c->links[k];
    snprintf(l->where, sizeof l->where, "ps shard %u of %u at %s:%u", k, c->num_shards,
             cfg->hosts[k] ? cfg->hosts[k] : "?", (unsigned)cfg->ports[k]);
    int fd = -1;
    ember_sec *sec = NULL;
    rc = ember__connect_auth_ex(cfg->hosts[k], cfg->ports[k], cfg->secret, cfg->secret_len,
                                cfg->encrypt ? EMBER_AUTH_ENCRYPT : 0, deadline, &fd, &sec);
    ember__ps_link_init(&l->io, fd, sec);
    if (rc != EMBER_OK) {
      rc = ember__set_error(rc, "%s: %s", l->where, ember_last_error());
      goto fail;
    }
    ember_wire_writer *w = &c->req[k];
    w->len = 0;
    ember_wire_write_u32(w, c->worker);
    ember_wire_write_u32(w, c->num_workers);
    ember_wire_write_u32(w, k);
    ember_wire_write_u32(w, c->num_shards);
    if ((rc = send_req(c, k, EMBER_MSG_PS_HELLO, w)) != EMBER_OK) goto fail;
    if ((rc = recv_reply(c, k, NULL, 0)) != EMBER_OK) goto fail;
    if (shm && (rc = offer_shm(c, k, cfg->shm == EMBER_PS_SHM_ON, shm_bytes)) != EMBER_OK)
      goto fail;
  }
  *out = c;
  return EMBER_OK;
fail:
  ember_ps_client_destroy(c);
  return rc;
}

/* ------------------------------------------------------------ tables */

static const ember_ps_table_spec *known(ember_ps_client *c, const char *table) {
  for (size_t i = 0; i < c->ntables; i++)
    if (strcmp(c->tables[i].name, table) == 0) return &c->tables[i].spec;
  return NULL;
}

int ember_ps_client_declare(ember_ps_client *c, const ember_ps_table_spec *spec) {
  ps_known k;
  ember_wire_writer w;
  int rc = check_usable(c);
  if (rc != EMBER_OK) return rc;
  if (spec == NULL) return ember__set_error(EMBER_EINVAL, "ps declare: NULL spec");
  if ((rc = ember__ps_spec_normalize(spec, &k.spec, k.name)) != EMBER_OK) return rc;
  k.spec.name = k.name;
  ember_wire_writer_init(&w);
  ember__ps_encode_spec(&w, &k.spec);
  rc = broadcast(c, EMBER_MSG_PS_DECLARE, &w);
  ember_wire_writer_free(&w);
  if (rc != EMBER_OK || known(c, k.name)) return rc;
  ps_known *grown = realloc(c->tables, (c->ntables + 1) * sizeof *grown);
  if (grown == NULL) return ember__set_error(EMBER_ENOMEM, "ps declare: out of memory");
  c->tables = grown;
  c->tables[c->ntables] = k;
  c->tables[c->ntables].spec.name = c->tables[c->ntables].name;
  c->ntables++;
  return EMBER_OK;
}

/* The table's spec for a pull or push of rows of `cols` floats. */
static int table_for(ember_ps_client *c, const char *table, uint32_t cols, const uint64_t *ids,
                     const char *what, const ember_ps_table_spec **out) {
  int rc = check_usable(c);
  if (rc != EMBER_OK) return rc;
  if (table == NULL) return ember__set_error(EMBER_EINVAL, "ps %s: NULL table name", what);
  *out = known(c, table);
  if (*out == NULL)
    return ember__set_error(EMBER_ENOTFOUND,
                            "ps %s: table '%s' was not declared by this worker; declare every "
                            "table a worker uses (the same spec on every worker)", what, table);
  if ((*out)->cols != cols)
    return ember__set_error(EMBER_ESCHEMA,
                            "ps %s of table '%s': rows of %u floats given, the table's rows "
                            "have %u (table shape (%llu, %u))", what, table, cols, (*out)->cols,
                            (unsigned long long)(*out)->rows, (*out)->cols);
  if (ids == NULL && (*out)->layout != EMBER_PS_DENSE)
    return ember__set_error(EMBER_EINVAL,
                            "ps %s of table '%s': a sparse table moves named rows only (ids "
                            "NULL is for dense tables)", what, table);
  return EMBER_OK;
}

/* Buckets ids by shard: c->count[k] rows each, shard_of[i] and, into
 * slot[i], i's place within its shard's request. */
static int bucket(ember_ps_client *c, const ember_ps_table_spec *t, const uint64_t *ids,
                  size_t n, uint32_t *shard_of, uint32_t *slot) {
  memset(c->count, 0, c->num_shards * sizeof *c->count);
  for (size_t i = 0; i < n; i++) {
    uint32_t k = ember_ps_shard_of_row(t->layout, t->rows, ids[i], c->num_shards);
    if (k >= c->num_shards)
      return ember__set_error(EMBER_EINVAL, "table '%s': row %llu out of range (rows %llu)",
                              t->name, (unsigned long long)ids[i], (unsigned long long)t->rows);
    if (c->count[k] == UINT32_MAX)
      return ember__set_error(EMBER_ETOOBIG, "table '%s': too many rows in one call", t->name);
    shard_of[i] = k;
    slot[i] = c->count[k]++;
  }
  return EMBER_OK;
}

static void begin_pull(ember_wire_writer *w, const char *table, uint64_t clock, uint32_t wait_ms,
                       int whole, uint32_t n) {
  w->len = 0;
  w->err = 0;
  ember_wire_write_str(w, table);
  ember_wire_write_u64(w, clock);
  ember_wire_write_u32(w, wait_ms);
  ember_wire_write_u8(w, (uint8_t)whole);
  ember_wire_write_u32(w, n);
}

static void begin_push(ember_wire_writer *w, const char *table, int whole, uint32_t n,
                       uint32_t cols) {
  w->len = 0;
  w->err = 0;
  ember_wire_write_str(w, table);
  ember_wire_write_u8(w, (uint8_t)whole);
  ember_wire_write_u32(w, n);
  ember_wire_write_u32(w, cols);
}

/* Sends every non-empty request of the call, then reads each shard's reply
 * into bodies[k] (body_len[k] bytes; NULL: none expected). */
static int exchange(ember_ps_client *c, uint16_t type, uint8_t **bodies, const size_t *body_len) {
  int rc, first = EMBER_OK;
  char err[1024] = "";
  for (uint32_t k = 0; k < c->num_shards; k++)
    if (c->count[k] && (rc = send_req(c, k, type, &c->req[k])) != EMBER_OK) return rc;
  for (uint32_t k = 0; k < c->num_shards; k++) {
    if (!c->count[k]) continue;
    rc = recv_reply(c, k, bodies ? bodies[k] : NULL, bodies ? body_len[k] : 0);
    if (rc != EMBER_OK && first == EMBER_OK) {
      first = rc;
      snprintf(err, sizeof err, "%s", ember_last_error());
    }
    if (c->broken) return rc;
  }
  return first == EMBER_OK ? EMBER_OK : ember__set_error(first, "%s", err);
}

static uint32_t wait_ms(const ember_ps_client *c) {
  return c->timeout_ms > UINT32_MAX ? UINT32_MAX : (uint32_t)c->timeout_ms;
}

int ember_ps_client_pull(ember_ps_client *c, const char *table, const uint64_t *ids, size_t n,
                         uint32_t cols, float *out) {
  const ember_ps_table_spec *t;
  uint32_t *shard_of = NULL, *slot = NULL;
  uint8_t **bodies = NULL;
  size_t *len = NULL;
  size_t row_bytes = (size_t)cols * sizeof(float);
  int rc = table_for(c, table, cols, ids, "pull", &t);
  if (rc != EMBER_OK) return rc;
  if (out == NULL && (ids == NULL || n)) return ember__set_error(EMBER_EINVAL, "ps pull: NULL out");
  bodies = calloc(c->num_shards, sizeof *bodies);
  len = calloc(c->num_shards, sizeof *len);
  if (bodies == NULL || len == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "ps pull: out of memory");
    goto out;
  }
  if (ids == NULL) { /* every row of a dense table: each shard's range, in place */
    for (uint32_t k = 0; k < c->num_shards; k++) {
      uint64_t b = ember__ps_dense_begin(t->rows, k, c->num_shards);
      uint64_t e = ember__ps_dense_begin(t->rows, k + 1, c->num_shards);
      if (e - b > UINT32_MAX) {
        rc = ember__set_error(EMBER_ETOOBIG, "ps pull of table '%s': too many rows", table);
        goto out;
      }
      c->count[k] = (uint32_t)(e - b);
      begin_pull(&c->req[k], table, c->clock, wait_ms(c), 1, c->count[k]);
      bodies[k] = (uint8_t *)(out + b * cols);
      len[k] = (size_t)(e - b) * row_bytes;
    }
    rc = exchange(c, EMBER_MSG_PS_PULL, bodies, len);
    for (uint32_t k = 0; k < c->num_shards; k++) bodies[k] = NULL;
    goto out;
  }
  shard_of = malloc((n ? n : 1) * sizeof *shard_of);
  slot = malloc((n ? n : 1) * sizeof *slot);
  if (shard_of == NULL || slot == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "ps pull: out of memory");
    goto out;
  }
  if ((rc = bucket(c, t, ids, n, shard_of, slot)) != EMBER_OK) goto out;
  for (uint32_t k = 0; k < c->num_shards; k++) {
    begin_pull(&c->req[k], table, c->clock, wait_ms(c), 0, c->count[k]);
    len[k] = (size_t)c->count[k] * row_bytes;
    if (c->count[k] && (bodies[k] = malloc(len[k] ? len[k] : 1)) == NULL) {
      rc = ember__set_error(EMBER_ENOMEM, "ps pull: out of memory");
      goto out;
    }
  }
  for (size_t i = 0; i < n; i++) ember_wire_write_u64(&c->req[shard_of[i]], ids[i]);
  if ((rc = exchange(c, EMBER_MSG_PS_PULL, bodies, len)) != EMBER_OK) goto out;
  for (size_t i = 0; i < n; i++)
    memcpy(out + i * cols, bodies[shard_of[i]] + (size_t)slot[i] * row_bytes, row_bytes);
out:
  for (uint32_t k = 0; bodies && k < c->num_shards; k++) free(bodies[k]);
  free(bodies);
  free(len);
  free(shard_of);
  free(slot);
  return rc;
}

/* PS_PUSH and PS_ASSIGN: rows with a float row each, bucketed by shard. */
static int send_rows(ember_ps_client *c, uint16_t type, const char *table, const uint64_t *ids,
                     size_t n, uint32_t cols, const float *grads) {
  const ember_ps_table_spec *t;
  uint32_t *shard_of = NULL, *slot = NULL;
  size_t row_bytes = (size_t)cols * sizeof(float);
  const char *what = type == EMBER_MSG_PS_PUSH ? "push" : type == EMBER_MSG_PS_INIT ? "init"
                                                                                  : "assign";
  int rc = table_for(c, table, cols, ids, what, &t);
  if (rc != EMBER_OK) return rc;
  if (grads == NULL && (ids == NULL || n))
    return ember__set_error(EMBER_EINVAL, "ps %s: NULL rows", what);
  if (ids == NULL) {
    for (uint32_t k = 0; k < c->num_shards; k++) {
      uint64_t b = ember__ps_dense_begin(t->rows, k, c->num_shards);
      uint64_t e = ember__ps_dense_begin(t->rows, k + 1, c->num_shards);
      if (e - b > UINT32_MAX)
        return ember__set_error(EMBER_ETOOBIG, "ps %s to table '%s': too many rows", what, table);
      c->count[k] = (uint32_t)(e - b);
      begin_push(&c->req[k], table, 1, c->count[k], cols);
      c->tail[k] = grads + b * cols; /* little-endian floats: the wire's order */
      c->tail_floats[k] = (size_t)(e - b) * cols;
    }
    rc = exchange(c, type, NULL, NULL);
    memset(c->tail, 0, c->num_shards * sizeof *c->tail);
    return rc;
  }
  shard_of = malloc((n ? n : 1) * sizeof *shard_of);
  slot = malloc((n ? n : 1) * sizeof *slot);
  if (shard_of == NULL || slot == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "ps %s: out of memory", what);
    goto out;
  }
  if ((rc = bucket(c, t, ids, n, shard_of, slot)) != EMBER_OK) goto out;
  for (uint32_t k = 0; k < c->num_shards; k++)
    begin_push(&c->req[k], table, 0, c->count[k], cols);
  for (size_t i = 0; i < n; i++) ember_wire_write_u64(&c->req[shard_of[i]], ids[i]);
  /* the gradients follow all the ids of each request, in the ids' order */
  for (size_t i = 0; i < n; i++)
    ember_wire_write_raw(&c->req[shard_of[i]], (const uint8_t *)grads + i * row_bytes, row_bytes);
  rc = exchange(c, type, NULL, NULL);
out:
  free(shard_of);
  free(slot);
  return rc;
}

int ember_ps_client_push(ember_ps_client *c, const char *table, const uint64_t *ids, size_t n,
                         uint32_t cols, const float *grads) {
  return send_rows(c, EMBER_MSG_PS_PUSH, table, ids, n, cols, grads);
}

int ember_ps_client_assign(ember_ps_client *c, const char *table, const uint64_t *ids,
                           size_t n, uint32_t cols, const float *values) {
  return send_rows(c, EMBER_MSG_PS_ASSIGN, table, ids, n, cols, values);
}

int ember_ps_client_init(ember_ps_client *c, const char *table, const uint64_t *ids, size_t n,
                         uint32_t cols, const float *values) {
  return send_rows(c, EMBER_MSG_PS_INIT, table, ids, n, cols, values);
}

static int send_clock(ember_ps_client *c, uint64_t clock) {
  ember_wire_writer w;
  ember_wire_writer_init(&w);
  ember_wire_write_u64(&w, clock);
  int rc = broadcast(c, EMBER_MSG_PS_CLOCK, &w);
  ember_wire_writer_free(&w);
  return rc;
}

int ember_ps_client_clock(ember_ps_client *c) {
  int rc = check_usable(c);
  if (rc != EMBER_OK) return rc;
  c->clock++;
  return send_clock(c, c->clock);
}

int ember_ps_client_finish(ember_ps_client *c) {
  int rc = check_usable(c);
  return rc != EMBER_OK ? rc : send_clock(c, UINT64_MAX);
}

int ember_ps_client_save(ember_ps_client *c, const char *dir) {
  ember_wire_writer w;
  if (dir == NULL) return ember__set_error(EMBER_EINVAL, "ps save: NULL directory");
  ember_wire_writer_init(&w);
  ember_wire_write_str(&w, dir);
  int rc = broadcast(c, EMBER_MSG_PS_SAVE, &w);
  ember_wire_writer_free(&w);
  return rc;
}

void ember_ps_client_abort(ember_ps_client *c) {
  if (c == NULL) return;
  atomic_store(&c->aborted, 1);
  /* a read blocked in poll() on these sockets, or in a wait on these
   * rings, returns at once */
  for (uint32_t k = 0; k < c->num_shards; k++) ember__ps_link_shutdown(&c->links[k].io);
}

void ember_ps_client_bytes(const ember_ps_client *c, uint64_t *sent, uint64_t *received) {
  if (sent) *sent = c ? c->sent : 0;
  if (received) *received = c ? c->received : 0;
}

int ember_ps_client_transport(const ember_ps_client *c, uint32_t shard, uint64_t *sent,
                              uint64_t *received) {
  if (c == NULL || shard >= c->num_shards)
    return ember__set_error(EMBER_EINVAL, "ps client transport: shard %u of %u", shard,
                            c ? c->num_shards : 0);
  const ps_link *l = &c->links[shard];
  if (sent) *sent = l->sent;
  if (received) *received = l->received;
  return ember__ps_link_is_shm(&l->io) ? EMBER_PS_TRANSPORT_SHM : EMBER_PS_TRANSPORT_TCP;
}
