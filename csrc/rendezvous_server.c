/* rendezvous_server.c - the reservation server (driver side); its client is
 * rendezvous_client.c, the contract ember/rendezvous.h.
 *
 * One background thread runs a poll() loop over a wake eventfd, the
 * acceptor's descriptors (acceptor.h: the listener and every connection that
 * has not yet authenticated and sent REGISTER) and every node's connection.
 * The acceptor hands over a connection with its REGISTER; from there each
 * connection is a NODE, or CLOSING when it is being refused, with its own
 * incremental frame parser and its own output queue, so a slow or hostile
 * peer only ever costs its own buffers and never stalls the loop.  The node
 * table, the ready flag and the event queue are shared with API callers
 * under one mutex + condvar.
 *
 * Scale: per loop iteration the work is O(connections) (poll itself is), per
 * frame O(1), and the SPEC node table is encoded once and queued by reference
 * to every node behind that node's own 16-byte header + your_index prefix. */
#include "ember/rendezvous.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "acceptor.h"
#include "ember/auth.h"
#include "ember/error.h"
#include "ember/net.h"
#include "ember/wire.h"
#include "rendezvous_codec.h"
#include "rendezvous_internal.h"

#define DEFAULT_HEARTBEAT_TIMEOUT_MS 10000u
#define DEFAULT_HANDSHAKE_TIMEOUT_MS 10000u
#define READ_CHUNK 65536u
/* Bytes of frames we build for one connection (STOPs, echoes, REFUSED) that
 * may wait unsent; the shared SPEC is not counted.  A peer that lets this
 * fill is not reading and is dropped. */
#define OUT_QUEUE_MAX (1u << 20)
/* How long a refused connection is kept to deliver its REFUSED frame. */
#define CLOSE_LINGER_MS 1000
/* How long destroy() keeps flushing queued STOPs before closing. */
#define FINAL_FLUSH_MS 500
/* The event queue is bounded: past these, PROGRESS and REJECTED events (the
 * ones a peer can generate at will) are dropped and counted. */
#define EVENT_BYTES_MAX (64u << 20)
#define EVENT_COUNT_MAX 100000u
#define MAX_IOV 16

typedef struct seg {
  struct seg *next;
  const uint8_t *data; /* own[] or the server's shared SPEC table */
  size_t len, off;
  size_t owned; /* bytes counted against OUT_QUEUE_MAX */
  uint8_t own[];
} seg;

/* A connection comes from the acceptor with its REGISTER (C_REGISTER only
 * while that is looked at), then is a NODE, or CLOSING when refused. */
enum { C_REGISTER, C_NODE, C_CLOSING };

typedef struct conn {
  int fd;
  int state;
  int dead; /* closed at the next sweep; handlers never free a conn */
  char peer[96];
  char peer_host[96];
  ember_wire_parser *parser;
  seg *head, *tail;
  size_t queued;
  int64_t deadline;   /* CLOSING: the end of the linger */
  int64_t last_heard; /* NODE: time of the last frame received */
  int32_t node;       /* index once registered, else -1 */
  int reported;       /* loop-thread copy of node_slot.reported */
} conn;

typedef struct {
  ember_rdv_node info;
  int registered;
  int connected;
  int reported; /* DONE/FAILED seen: a later disconnect is not LOST */
  conn *c;      /* loop thread only */
} node_slot;

typedef struct ev_item {
  struct ev_item *next;
  ember_rdv_event ev;
  size_t bytes;
} ev_item;

typedef struct cmd {
  struct cmd *next;
  int32_t node;
  uint32_t grace_ms;
} cmd;

struct ember_rdv_server {
  /* immutable after create */
  uint32_t num_nodes, num_ps;
  int has_chief, has_evaluator;
  uint32_t hb_ms;
  uint16_t port;
  int wake_fd;
  pthread_t thread;
  int thread_started;

  pthread_mutex_t mu;
  pthread_cond_t cv;
  /* under mu */
  node_slot *nodes;
  uint32_t registered_count;
  int ready;
  int fatal;
  char fatal_msg[512];
  ev_item *ev_head, *ev_tail;
  size_t ev_bytes, ev_count;
  uint64_t ev_dropped;
  cmd *cmd_head, *cmd_tail;
  int quit;

  /* loop thread only */
  ember__acceptor *acc;
  struct pollfd *pfds; /* [0] wake eventfd, then the acceptor's, then conns' */
  size_t capfds;
  conn **conns;
  size_t nconns, capconns;
  uint8_t *spec_table;
  size_t spec_table_len;
  uint8_t rbuf[READ_CHUNK];
};

/* ---------------------------------------------------------------- helpers */

/* malloc'd printf; NULL on failure (events then carry no text). */
static char *fmt_alloc(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *fmt_alloc(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0) return NULL;
  char *s = malloc((size_t)n + 1);
  if (s == NULL) return NULL;
  va_start(ap, fmt);
  vsnprintf(s, (size_t)n + 1, fmt, ap);
  va_end(ap);
  return s;
}

/* Bounded: a peer streaming garbage must not keep the loop here. */
static void drain_socket(int fd) {
  uint8_t buf[4096];
  for (int i = 0; i < 16; i++)
    if (recv(fd, buf, sizeof buf, MSG_DONTWAIT) <= 0) return;
}

static int64_t abs_deadline_to_ts(int64_t deadline_ms, struct timespec *ts) {
  /* Condvars use CLOCK_MONOTONIC (set at init), the clock of ember_now_ms. */
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  int64_t left = deadline_ms - ember_now_ms();
  if (left < 0) left = 0;
  int64_t ns = (int64_t)now.tv_nsec + (left % 1000) * 1000000;
  ts->tv_sec = now.tv_sec + (time_t)(left / 1000) + (time_t)(ns / 1000000000);
  ts->tv_nsec = (long)(ns % 1000000000);
  return left;
}

/* ---------------------------------------------------------------- events */

static int droppable(int kind) {
  return kind == EMBER_RDV_EV_PROGRESS || kind == EMBER_RDV_EV_REJECTED;
}

/* Takes ownership of text.  Caller holds s->mu. */
static void push_event_locked(ember_rdv_server *s, int kind, int32_t node, int32_t code,
                              char *text) {
  size_t bytes = sizeof(ev_item) + (text ? strlen(text) : 0);
  if (droppable(kind) &&
      (s->ev_bytes + bytes > EVENT_BYTES_MAX || s->ev_count >= EVENT_COUNT_MAX)) {
    s->ev_dropped++;
    free(text);
    return;
  }
  ev_item *it = calloc(1, sizeof *it);
  if (it == NULL) {
    s->ev_dropped++;
    free(text);
    return;
  }
  it->ev.kind = kind;
  it->ev.node = node;
  it->ev.code = code;
  it->ev.text = text;
  it->bytes = bytes;
  if (s->ev_tail) s->ev_tail->next = it;
  else s->ev_head = it;
  s->ev_tail = it;
  s->ev_bytes += bytes;
  s->ev_count++;
  pthread_cond_broadcast(&s->cv);
}

static void push_event(ember_rdv_server *s, int kind, int32_t node, int32_t code,
                       char *text) {
  pthread_mutex_lock(&s->mu);
  push_event_locked(s, kind, node, code, text);
  pthread_mutex_unlock(&s->mu);
}

static void set_fatal(ember_rdv_server *s, int code, const char *msg) {
  pthread_mutex_lock(&s->mu);
  if (!s->fatal) {
    s->fatal = code;
    snprintf(s->fatal_msg, sizeof s->fatal_msg, "rendezvous server failed: %s", msg);
  }
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

/* ---------------------------------------------------------------- output */

static int queue_seg(conn *c, const void *owned, size_t owned_len, const uint8_t *shared,
                     size_t shared_len) {
  if (owned_len > OUT_QUEUE_MAX - c->queued || owned_len > OUT_QUEUE_MAX)
    return EMBER_ETOOBIG;
  seg *g = malloc(sizeof *g + owned_len);
  if (g == NULL) return EMBER_ENOMEM;
  g->next = NULL;
  g->off = 0;
  g->owned = owned_len;
  if (shared != NULL) {
    g->data = shared;
    g->len = shared_len;
  } else {
    memcpy(g->own, owned, owned_len);
    g->data = g->own;
    g->len = owned_len;
  }
  if (c->tail) c->tail->next = g;
  else c->head = g;
  c->tail = g;
  c->queued += owned_len;
  return EMBER_OK;
}

static int queue_frame(conn *c, uint16_t type, const uint8_t *payload, uint32_t len) {
  uint8_t small[EMBER_WIRE_HEADER_LEN + 64];
  uint8_t *buf = small;
  size_t total = (size_t)EMBER_WIRE_HEADER_LEN + len;
  if (total > sizeof small) {
    buf = malloc(total);
    if (buf == NULL) return EMBER_ENOMEM;
  }
  ember_wire_encode_header(buf, type, len);
  if (len > 0) memcpy(buf + EMBER_WIRE_HEADER_LEN, payload, len);
  int rc = queue_seg(c, buf, total, NULL, 0);
  if (buf != small) free(buf);
  return rc;
}

static void free_segs(conn *c) {
  seg *g = c->head;
  while (g) {
    seg *n = g->next;
    free(g);
    g = n;
  }
  c->head = c->tail = NULL;
  c->queued = 0;
}

/* The connection is closed at the next sweep. */
static void mark_dead(conn *c) { c->dead = 1; }

/* Reports a refused peer that had proven the secret (a node with a bad or
 * late REGISTER, a duplicate index) at once, as a REJECTED event of its own;
 * strangers are counted by the acceptor and reported rate-limited
 * (on_log). */
static void report_rejected(ember_rdv_server *s, const char *peer, int32_t ev_node,
                            const char *reason) {
  push_event(s, EMBER_RDV_EV_REJECTED, ev_node, 1,
             fmt_alloc("%s rejected a connection from %s: %s", ember__acceptor_name(s->acc),
                       peer, reason));
}

/* ---------------------------------------------------------------- conn end */

/* Detaches a registered node from its connection: LOST unless it already
 * reported DONE/FAILED; before READY its registration is withdrawn so the
 * index can register again (a retried Spark task) and wait_ready names it. */
static void node_gone(ember_rdv_server *s, conn *c, const char *reason) {
  if (c->node < 0) return;
  pthread_mutex_lock(&s->mu);
  node_slot *sl = &s->nodes[c->node];
  sl->connected = 0;
  sl->c = NULL;
  if (!sl->reported) {
    push_event_locked(s, EMBER_RDV_EV_LOST, c->node, 0,
                      fmt_alloc("node %d (executor '%s' on host %s, pid %u) lost: %s",
                                (int)c->node, sl->info.executor_id, sl->info.host,
                                (unsigned)sl->info.pid, reason));
    if (!s->ready) {
      sl->registered = 0;
      s->registered_count--;
    }
  }
  pthread_mutex_unlock(&s->mu);
  c->node = -1;
}

/* Ends a connection now.  Registered nodes become LOST (see node_gone). */
static void conn_drop(ember_rdv_server *s, conn *c, const char *reason) {
  if (c->dead) return;
  if (c->node >= 0) node_gone(s, c, reason);
  mark_dead(c);
}

/* Refuses a connection whose REGISTER is not accepted: REJECTED event, a
 * REFUSED frame telling the peer why, then a short linger to deliver it. */
static void conn_refuse(ember_rdv_server *s, conn *c, int status, int32_t ev_node,
                        const char *reason) {
  if (c->dead || c->state == C_CLOSING) return;
  report_rejected(s, c->peer, ev_node, reason);
  ember_wire_writer w;
  ember_wire_writer_init(&w);
  ember__rdv_encode_refused(&w, status, reason);
  int rc = w.err ? w.err : queue_frame(c, EMBER_MSG_REFUSED, w.buf, (uint32_t)w.len);
  ember_wire_writer_free(&w);
  if (rc != EMBER_OK) {
    mark_dead(c);
    return;
  }
  c->state = C_CLOSING;
  c->deadline = ember_now_ms() + CLOSE_LINGER_MS;
}

/* Frees a connection's resources (the sweep's job; never from a handler). */
static void conn_free(conn *c) {
  if (c == NULL) return;
  if (c->fd >= 0) {
    /* Read what the peer already sent, so close() sends FIN rather than an
     * RST that could destroy the REFUSED frame in flight. */
    drain_socket(c->fd);
    ember_net_close(c->fd);
  }
  ember_wire_parser_destroy(c->parser);
  free_segs(c);
  free(c);
}

/* ---------------------------------------------------------------- flush */

static void conn_flush(ember_rdv_server *s, conn *c) {
  while (c->head != NULL && !c->dead) {
    struct iovec iov[MAX_IOV];
    int n = 0;
    for (seg *g = c->head; g != NULL && n < MAX_IOV; g = g->next, n++) {
      iov[n].iov_base = (void *)(g->data + g->off);
      iov[n].iov_len = g->len - g->off;
    }
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = iov;
    mh.msg_iovlen = (size_t)n;
    ssize_t w = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      char why[160];
      snprintf(why, sizeof why, "send failed: %s", strerror(errno));
      if (c->state == C_CLOSING) mark_dead(c);
      else conn_drop(s, c, why);
      return;
    }
    size_t left = (size_t)w;
    while (c->head != NULL && left > 0) {
      seg *g = c->head;
      size_t part = g->len - g->off;
      if (left < part) {
        g->off += left;
        left = 0;
        break;
      }
      left -= part;
      c->head = g->next;
      if (c->head == NULL) c->tail = NULL;
      c->queued -= g->owned;
      free(g);
    }
  }
  if (c->head == NULL && c->state == C_CLOSING) mark_dead(c);
}

/* ---------------------------------------------------------------- ready */

/* All nodes are in: assign roles, encode the node table once, queue SPEC to
 * everyone.  Runs on the loop thread. */
static void become_ready(ember_rdv_server *s) {
  ember_wire_writer w;
  ember_rdv_node *table = NULL;
  int rc;
  ember_wire_writer_init(&w);

  pthread_mutex_lock(&s->mu);
  table = malloc((size_t)s->num_nodes * sizeof *table);
  if (table == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "out of memory building the cluster spec");
    goto fail_locked;
  }
  for (uint32_t i = 0; i < s->num_nodes; i++) table[i] = s->nodes[i].info;
  rc = ember__rdv_assign_roles(table, s->num_nodes, s->num_ps, s->has_chief,
                               s->has_evaluator);
  if (rc != EMBER_OK) goto fail_locked;
  rc = ember__rdv_encode_spec_table(&w, table, s->num_nodes);
  if (rc != EMBER_OK) goto fail_locked;
  if (w.len > EMBER__RDV_SPEC_MAX - 4) {
    rc = ember__set_error(EMBER_ETOOBIG, "cluster spec of %zu bytes is too large", w.len);
    goto fail_locked;
  }
  for (uint32_t i = 0; i < s->num_nodes; i++) {
    memcpy(s->nodes[i].info.role, table[i].role, sizeof table[i].role);
    s->nodes[i].info.task_index = table[i].task_index;
  }
  s->spec_table = w.buf;
  s->spec_table_len = w.len;
  w.buf = NULL;
  s->ready = 1;
  push_event_locked(s, EMBER_RDV_EV_READY, -1, 0,
                    fmt_alloc("all %u nodes registered; cluster spec sent",
                              (unsigned)s->num_nodes));
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  free(table);

  /* Conn pointers are loop-thread state; the ready flag is now set, so no
   * registration can change under us. */
  int64_t now = ember_now_ms();
  for (uint32_t i = 0; i < s->num_nodes; i++) {
    conn *c = s->nodes[i].c;
    if (c == NULL || c->dead) continue;
    uint8_t pre[EMBER_WIRE_HEADER_LEN + 4];
    ember_wire_encode_header(pre, EMBER_MSG_SPEC, (uint32_t)(4 + s->spec_table_len));
    ember_wire_put_u32(pre + EMBER_WIRE_HEADER_LEN, i);
    if (queue_seg(c, pre, sizeof pre, NULL, 0) != EMBER_OK ||
        queue_seg(c, NULL, 0, s->spec_table, s->spec_table_len) != EMBER_OK) {
      conn_drop(s, c, "out of memory queueing the cluster spec");
      continue;
    }
    /* The heartbeat clock starts with the spec: before it, a node has no
     * reason to send anything. */
    c->last_heard = now;
  }
  ember_wire_writer_free(&w);
  return;

fail_locked:
  pthread_mutex_unlock(&s->mu);
  free(table);
  ember_wire_writer_free(&w);
  set_fatal(s, rc, ember_last_error());
}

/* ---------------------------------------------------------------- frames */

static void on_register(ember_rdv_server *s, conn *c, const uint8_t *p, uint32_t len) {
  ember_rdv_node n;
  char reason[512];
  if (ember__rdv_decode_register(p, len, &n) != EMBER_OK) {
    snprintf(reason, sizeof reason, "%s", ember_last_error());
    conn_refuse(s, c, EMBER_EPROTO, -1, reason);
    return;
  }
  if (n.index >= s->num_nodes) {
    snprintf(reason, sizeof reason, "node index %u out of range (num_nodes = %u)",
             (unsigned)n.index, (unsigned)s->num_nodes);
    conn_refuse(s, c, EMBER_EINVAL, -1, reason);
    return;
  }
  if (n.host[0] == '\0') snprintf(n.host, sizeof n.host, "%s", c->peer_host);
  n.role[0] = '\0';
  n.task_index = 0;

  pthread_mutex_lock(&s->mu);
  node_slot *sl = &s->nodes[n.index];
  if (sl->registered || s->ready) {
    if (sl->registered)
      snprintf(reason, sizeof reason,
               "duplicate node index %u: already registered by executor '%s' on "
               "host %s (pid %u)",
               (unsigned)n.index, sl->info.executor_id, sl->info.host,
               (unsigned)sl->info.pid);
    else
      snprintf(reason, sizeof reason,
               "node index %u: the reservation is already complete", (unsigned)n.index);
    pthread_mutex_unlock(&s->mu);
    conn_refuse(s, c, EMBER_ESTATE, (int32_t)n.index, reason);
    return;
  }
  sl->info = n;
  sl->registered = 1;
  sl->connected = 1;
  sl->reported = 0;
  sl->c = c;
  s->registered_count++;
  int all = s->registered_count == s->num_nodes;
  push_event_locked(s, EMBER_RDV_EV_REGISTERED, (int32_t)n.index, 0,
                    fmt_alloc("node %u registered from %s (executor '%s', host %s, pid %u)",
                              (unsigned)n.index, c->peer, n.executor_id, n.host,
                              (unsigned)n.pid));
  pthread_mutex_unlock(&s->mu);
  c->node = (int32_t)n.index;
  c->state = C_NODE;
  c->last_heard = ember_now_ms();
  if (all) become_ready(s);
}

static void on_node_frame(ember_rdv_server *s, conn *c, const ember_frame_header *h,
                          const uint8_t *p) {
  char reason[512];
  c->last_heard = ember_now_ms();
  switch (h->type) {
  case EMBER_MSG_HEARTBEAT:
    /* One echo in flight is enough to prove liveness; a peer that does not
     * read cannot make us queue more. */
    if (c->head == NULL && queue_frame(c, EMBER_MSG_HEARTBEAT, NULL, 0) != EMBER_OK)
      conn_drop(s, c, "out of memory queueing a heartbeat echo");
    return;
  case EMBER_MSG_REPORT: {
    uint32_t kind;
    int32_t code;
    char *text = NULL;
    if (ember__rdv_decode_report(p, h->length, &kind, &code, &text) != EMBER_OK) {
      snprintf(reason, sizeof reason, "protocol error: %s", ember_last_error());
      conn_drop(s, c, reason);
      return;
    }
    int ev = kind == EMBER_RDV_REPORT_PROGRESS ? EMBER_RDV_EV_PROGRESS
             : kind == EMBER_RDV_REPORT_DONE   ? EMBER_RDV_EV_DONE
                                               : EMBER_RDV_EV_FAILED;
    pthread_mutex_lock(&s->mu);
    if (ev != EMBER_RDV_EV_PROGRESS) s->nodes[c->node].reported = c->reported = 1;
    push_event_locked(s, ev, c->node, code, text);
    pthread_mutex_unlock(&s->mu);
    return;
  }
  default:
    snprintf(reason, sizeof reason, "protocol error: unexpected %s frame on the control "
             "channel", ember_wire_type_name(h->type));
    conn_drop(s, c, reason);
    return;
  }
}

/* ---------------------------------------------------------------- reads */

static void on_readable(ember_rdv_server *s, conn *c) {
  ssize_t n = recv(c->fd, s->rbuf, sizeof s->rbuf, 0);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  if (c->state == C_CLOSING) {
    /* Discard: we only wait for our REFUSED to drain or the peer to go. */
    if (n <= 0) mark_dead(c);
    return;
  }
  if (n == 0) {
    conn_drop(s, c, "connection closed by peer");
    return;
  }
  if (n < 0) {
    char why[160];
    snprintf(why, sizeof why, "recv failed: %s", strerror(errno));
    conn_drop(s, c, why);
    return;
  }
  char reason[512];
  if (ember_wire_parser_feed(c->parser, s->rbuf, (size_t)n) != EMBER_OK) {
    snprintf(reason, sizeof reason, "protocol error: %s", ember_last_error());
    conn_drop(s, c, reason);
    return;
  }
  for (;;) {
    ember_frame_header h;
    const uint8_t *p;
    if (c->dead || c->state == C_CLOSING) return;
    int r = ember_wire_parser_next(c->parser, &h, &p);
    if (r <= 0) return; /* errors surface in feed, already handled */
    on_node_frame(s, c, &h, p);
  }
}

/* ---------------------------------------------------------------- the acceptor */

/* "1.2.3.4:5" -> "1.2.3.4", "[::1]:5" -> "::1": the host part alone, for
 * REGISTER's "empty host means the address this connection came from". */
static void peer_host_of(const char *peer, char *out, size_t cap) {
  char tmp[96];
  snprintf(tmp, sizeof tmp, "%s", peer);
  char *colon = strrchr(tmp, ':');
  if (colon != NULL) *colon = '\0';
  char *h = tmp;
  size_t hl = strlen(h);
  if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') {
    h[hl - 1] = '\0';
    h++;
  }
  snprintf(out, cap, "%s", h);
}

static int add_conn(ember_rdv_server *s, conn *c) {
  if (s->nconns == s->capconns) {
    size_t ncap = s->capconns ? s->capconns * 2 : 64;
    conn **nc = realloc(s->conns, ncap * sizeof *nc);
    if (nc == NULL) return EMBER_ENOMEM;
    s->conns = nc;
    s->capconns = ncap;
  }
  s->conns[s->nconns++] = c;
  return EMBER_OK;
}

static void remove_conn(ember_rdv_server *s, size_t i) {
  conn_free(s->conns[i]);
  s->conns[i] = s->conns[--s->nconns];
}

/* The acceptor hands over an authenticated connection with its REGISTER. */
static void on_accepted(void *arg, ember__accepted *a) {
  ember_rdv_server *s = arg;
  conn *c = calloc(1, sizeof *c);
  if (c == NULL || ember_wire_parser_create(&c->parser, EMBER__RDV_REPORT_MAX) != EMBER_OK ||
      add_conn(s, c) != EMBER_OK) {
    if (c != NULL) ember_wire_parser_destroy(c->parser);
    free(c);
    report_rejected(s, a->peer, -1, "out of memory after authentication");
    ember_net_close(a->fd);
    free(a->payload);
    return;
  }
  c->fd = a->fd;
  c->node = -1;
  c->state = C_REGISTER;
  memcpy(c->peer, a->peer, sizeof c->peer);
  peer_host_of(c->peer, c->peer_host, sizeof c->peer_host);
  on_register(s, c, a->payload, a->first.length);
  free(a->payload);
}

/* A connection the acceptor ended: a peer that had proven the secret but
 * sent a bad or late REGISTER is reported at once (strangers: on_log). */
static void on_rejected(void *arg, const char *peer, int authed, const char *reason) {
  if (authed) report_rejected(arg, peer, -1, reason);
}

/* Strangers, rate-limited: REJECTED events whose code is how many rejected
 * connections they cover (0: accepting paused, out of descriptors). */
static void on_log(void *arg, const char *line, uint64_t count) {
  push_event(arg, EMBER_RDV_EV_REJECTED, -1, count > INT32_MAX ? INT32_MAX : (int32_t)count,
             fmt_alloc("%s", line));
}

/* ---------------------------------------------------------------- commands */

static void apply_stop(ember_rdv_server *s, conn *c, uint32_t grace_ms) {
  uint8_t p[4];
  if (c == NULL || c->dead || c->state != C_NODE) return;
  ember_wire_put_u32(p, grace_ms);
  if (queue_frame(c, EMBER_MSG_STOP, p, sizeof p) != EMBER_OK)
    conn_drop(s, c, "not reading its control connection (output queue full)");
}

static void run_commands(ember_rdv_server *s, cmd *list) {
  while (list) {
    cmd *next = list->next;
    if (list->node >= 0) {
      apply_stop(s, s->nodes[list->node].c, list->grace_ms);
    } else {
      for (size_t i = 0; i < s->nconns; i++) apply_stop(s, s->conns[i], list->grace_ms);
    }
    free(list);
    list = next;
  }
}

/* ---------------------------------------------------------------- loop */

/* Checks a connection's timers; returns its next deadline (INT64_MAX if none). */
static int64_t check_timers(ember_rdv_server *s, conn *c, int64_t now) {
  char reason[256];
  if (c->dead) return INT64_MAX;
  switch (c->state) {
  case C_CLOSING:
    if (now >= c->deadline) {
      mark_dead(c);
      return INT64_MAX;
    }
    return c->deadline;
  case C_NODE: {
    /* ready is written only by this thread, so reading it unlocked is safe;
     * before READY nodes are not expected to heartbeat yet. */
    if (!s->ready || c->reported) return INT64_MAX;
    int64_t due = c->last_heard + (int64_t)s->hb_ms;
    if (now >= due) {
      snprintf(reason, sizeof reason, "no heartbeat for %lld ms (timeout %u ms)",
               (long long)(now - c->last_heard), (unsigned)s->hb_ms);
      conn_drop(s, c, reason);
      return INT64_MAX;
    }
    return due;
  }
  default:
    return INT64_MAX;
  }
}

/* Makes room for n pollfd entries. */
static int reserve_pfds(ember_rdv_server *s, size_t n) {
  if (n <= s->capfds) return EMBER_OK;
  struct pollfd *np = realloc(s->pfds, n * sizeof *np);
  if (np == NULL) return ember__set_error(EMBER_ENOMEM, "out of memory for the poll set");
  s->pfds = np;
  s->capfds = n;
  return EMBER_OK;
}

static void final_flush(ember_rdv_server *s) {
  int64_t deadline = ember_now_ms() + FINAL_FLUSH_MS;
  if (reserve_pfds(s, s->nconns) != EMBER_OK) return;
  for (;;) {
    size_t pending = 0;
    for (size_t i = 0; i < s->nconns; i++) {
      conn *c = s->conns[i];
      if (!c->dead && c->head != NULL) conn_flush(s, c);
      int want = !c->dead && c->head != NULL;
      s->pfds[i].events = want ? POLLOUT : 0;
      s->pfds[i].fd = want ? c->fd : -1;
      pending += (size_t)want;
    }
    int64_t left = deadline - ember_now_ms();
    if (pending == 0 || left <= 0) return;
    (void)poll(s->pfds, s->nconns, (int)left);
  }
}

static void *server_main(void *arg) {
  ember_rdv_server *s = arg;
  for (;;) {
    pthread_mutex_lock(&s->mu);
    int quit = s->quit;
    cmd *cmds = s->cmd_head;
    s->cmd_head = s->cmd_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    run_commands(s, cmds);
    if (quit) break;

    int64_t now = ember_now_ms();
    int64_t next = now + 1000;
    /* Backwards, so swap-removal only moves already-visited entries. */
    for (size_t i = s->nconns; i-- > 0;) {
      conn *c = s->conns[i];
      int64_t d = check_timers(s, c, now);
      if (c->dead) {
        if (c->node >= 0) node_gone(s, c, "connection dropped");
        remove_conn(s, i);
        continue;
      }
      if (d < next) next = d;
    }
    /* [0] the wake eventfd, [1, base) the acceptor's, [base + i] conns[i] */
    size_t base = 1 + ember__acceptor_npoll(s->acc);
    int rc = reserve_pfds(s, base + s->nconns);
    if (rc != EMBER_OK) {
      set_fatal(s, rc, ember_last_error());
      break;
    }
    s->pfds[0] = (struct pollfd){.fd = s->wake_fd, .events = POLLIN};
    ember__acceptor_poll_fill(s->acc, s->pfds + 1);
    for (size_t i = 0; i < s->nconns; i++)
      s->pfds[base + i] = (struct pollfd){
          .fd = s->conns[i]->fd, .events = (short)(POLLIN | (s->conns[i]->head ? POLLOUT : 0))};
    int64_t due = ember__acceptor_due(s->acc);
    if (due < next) next = due;
    int timeout = next <= now ? 0 : (int)(next - now);

    rc = poll(s->pfds, base + s->nconns, timeout);
    if (rc < 0) {
      if (errno == EINTR) continue;
      set_fatal(s, EMBER_ESYS, strerror(errno));
      break;
    }
    if (s->pfds[0].revents) ember__rdv_drain(s->wake_fd);
    size_t polled = s->nconns;
    for (size_t i = polled; i-- > 0;) {
      short rev = s->pfds[base + i].revents;
      conn *c = s->conns[i];
      if (rev == 0 || c->dead) continue;
      if (rev & (POLLIN | POLLHUP | POLLERR)) on_readable(s, c);
      if (!c->dead && c->head != NULL && (rev & POLLOUT)) conn_flush(s, c);
    }
    /* Pending handshakes, new connections (on_accepted adds to conns),
     * deadlines, the rate-limited report of strangers (on_log). */
    ember__acceptor_run(s->acc, s->pfds + 1);
  }
  final_flush(s);
  return NULL;
}

/* ---------------------------------------------------------------- API */

static void server_free(ember_rdv_server *s) {
  if (s == NULL) return;
  for (size_t i = 0; i < s->nconns; i++) conn_free(s->conns[i]);
  free(s->conns);
  free(s->pfds);
  ember__acceptor_destroy(s->acc);
  ember_net_close(s->wake_fd);
  for (ev_item *it = s->ev_head; it;) {
    ev_item *n = it->next;
    free(it->ev.text);
    free(it);
    it = n;
  }
  for (cmd *c = s->cmd_head; c;) {
    cmd *n = c->next;
    free(c);
    c = n;
  }
  free(s->spec_table);
  free(s->nodes);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
}

int ember_rdv_server_create(ember_rdv_server **out, const ember_rdv_server_config *cfg) {
  ember_rdv_server *s = NULL;
  pthread_condattr_t ca;
  int rc;
  if (out == NULL || cfg == NULL)
    return ember__set_error(EMBER_EINVAL, "rdv_server_create: NULL argument");
  *out = NULL;
  if (cfg->secret == NULL || cfg->secret_len < EMBER_SECRET_MIN_LEN)
    return ember__set_error(EMBER_EINVAL, "rdv_server_create: secret of %zu bytes is too "
                            "short (minimum %u)", cfg->secret ? cfg->secret_len : 0,
                            (unsigned)EMBER_SECRET_MIN_LEN);
  if (cfg->num_nodes == 0 || cfg->num_nodes > EMBER_RDV_MAX_NODES)
    return ember__set_error(EMBER_EINVAL, "rdv_server_create: num_nodes %u not in 1..%u",
                            (unsigned)cfg->num_nodes, (unsigned)EMBER_RDV_MAX_NODES);
  if ((uint64_t)cfg->num_ps + (cfg->has_chief ? 1 : 0) + (cfg->has_evaluator ? 1 : 0) >
      cfg->num_nodes)
    return ember__set_error(EMBER_EINVAL,
                            "rdv_server_create: %u nodes cannot hold %u ps%s%s",
                            (unsigned)cfg->num_nodes, (unsigned)cfg->num_ps,
                            cfg->has_chief ? " + chief" : "",
                            cfg->has_evaluator ? " + evaluator" : "");

  s = calloc(1, sizeof *s);
  if (s == NULL) return ember__set_error(EMBER_ENOMEM, "rdv_server_create: out of memory");
  s->wake_fd = -1;
  pthread_mutex_init(&s->mu, NULL);
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&s->cv, &ca);
  pthread_condattr_destroy(&ca);
  s->num_nodes = cfg->num_nodes;
  s->num_ps = cfg->num_ps;
  s->has_chief = cfg->has_chief != 0;
  s->has_evaluator = cfg->has_evaluator != 0;
  s->hb_ms = cfg->heartbeat_timeout_ms ? cfg->heartbeat_timeout_ms
                                       : DEFAULT_HEARTBEAT_TIMEOUT_MS;
  uint32_t hs_ms = cfg->handshake_timeout_ms ? cfg->handshake_timeout_ms
                                             : DEFAULT_HANDSHAKE_TIMEOUT_MS;
  s->nodes = calloc(cfg->num_nodes, sizeof *s->nodes);
  if (s->nodes == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "rdv_server_create: out of memory");
    goto fail;
  }
  /* A reservation of N nodes needs N sockets in the driver (and 3N more when
   * a test or benchmark runs the N clients in the same process): the
   * acceptor raises the common soft limit of 1024, and its pool and backlog
   * hold a whole gang of nodes connecting at once. */
  ember__acceptor_config acfg = {
      .listen_fd = -1, .bind_host = cfg->bind_host, .port = cfg->port,
      .expected = cfg->num_nodes, .secret = cfg->secret, .secret_len = cfg->secret_len,
      /* the pre-authentication deadline never outlasts the whole handshake's */
      .preauth_timeout_ms = cfg->preauth_timeout_ms, .preauth_cap_ms = hs_ms,
      .max_pending = cfg->max_pending, .first_type = EMBER_MSG_REGISTER,
      .first_max = EMBER__RDV_REGISTER_MAX, .first_timeout_ms = hs_ms, .refuse_first = 1,
      .name = "rendezvous server", .arg = s, .ready = on_accepted, .rejected = on_rejected,
      .log = on_log};
  rc = ember__acceptor_create(&s->acc, &acfg);
  if (rc != EMBER_OK) goto fail;
  s->port = ember__acceptor_port(s->acc);
  rc = ember__rdv_wakefd(&s->wake_fd);
  if (rc != EMBER_OK) goto fail;
  rc = ember__rdv_start_thread(&s->thread, server_main, s);
  if (rc != EMBER_OK) goto fail;
  s->thread_started = 1;
  *out = s;
  return EMBER_OK;

fail:
  server_free(s);
  return rc;
}

uint16_t ember_rdv_server_port(const ember_rdv_server *s) { return s ? s->port : 0; }

int ember_rdv_server_wait_ready(ember_rdv_server *s, int64_t timeout_ms) {
  if (s == NULL) return ember__set_error(EMBER_EINVAL, "wait_ready: NULL server");
  int64_t deadline = ember_deadline_after(timeout_ms);
  struct timespec ts;
  int rc = EMBER_OK;
  pthread_mutex_lock(&s->mu);
  while (!s->ready && !s->fatal) {
    if (abs_deadline_to_ts(deadline, &ts) <= 0) break;
    pthread_cond_timedwait(&s->cv, &s->mu, &ts);
  }
  if (s->ready) {
    rc = EMBER_OK;
  } else if (s->fatal) {
    rc = ember__set_error(s->fatal, "%s", s->fatal_msg);
  } else {
    /* Name the missing indexes; a huge job lists the first ones and a count. */
    char list[1400];
    size_t used = 0, shown = 0, missing = s->num_nodes - s->registered_count;
    list[0] = '\0';
    for (uint32_t i = 0; i < s->num_nodes && used < sizeof list - 32; i++) {
      if (s->nodes[i].registered) continue;
      int n = snprintf(list + used, sizeof list - used, "%s%u", shown ? ", " : "",
                       (unsigned)i);
      if (n < 0) break;
      used += (size_t)n;
      shown++;
    }
    if (shown < missing)
      snprintf(list + used, sizeof list - used, ", ... (%zu more)", missing - shown);
    rc = ember__set_error(EMBER_ETIMEDOUT,
                          "reservation timed out after %lld ms: %u of %u nodes "
                          "registered; missing node(s): %s",
                          (long long)timeout_ms, (unsigned)s->registered_count,
                          (unsigned)s->num_nodes, list);
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

int ember_rdv_server_next_event(ember_rdv_server *s, ember_rdv_event *ev,
                                int64_t timeout_ms) {
  if (s == NULL || ev == NULL)
    return ember__set_error(EMBER_EINVAL, "next_event: NULL argument");
  memset(ev, 0, sizeof *ev);
  int64_t deadline = ember_deadline_after(timeout_ms);
  struct timespec ts;
  int rc;
  pthread_mutex_lock(&s->mu);
  while (s->ev_head == NULL && !s->fatal) {
    if (abs_deadline_to_ts(deadline, &ts) <= 0) break;
    pthread_cond_timedwait(&s->cv, &s->mu, &ts);
  }
  if (s->ev_head != NULL) {
    ev_item *it = s->ev_head;
    s->ev_head = it->next;
    if (s->ev_head == NULL) s->ev_tail = NULL;
    s->ev_bytes -= it->bytes;
    s->ev_count--;
    *ev = it->ev;
    free(it);
    rc = EMBER_OK;
  } else if (s->fatal) {
    rc = ember__set_error(s->fatal, "%s", s->fatal_msg);
  } else {
    rc = ember__set_error(EMBER_ETIMEDOUT, "no rendezvous event within %lld ms",
                          (long long)timeout_ms);
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

void ember_rdv_event_clear(ember_rdv_event *ev) {
  if (ev == NULL) return;
  free(ev->text);
  memset(ev, 0, sizeof *ev);
}

int ember_rdv_server_nodes(ember_rdv_server *s, ember_rdv_node **out, uint32_t *count) {
  if (s == NULL || out == NULL || count == NULL)
    return ember__set_error(EMBER_EINVAL, "rdv_server_nodes: NULL argument");
  *out = NULL;
  *count = 0;
  int rc = EMBER_OK;
  pthread_mutex_lock(&s->mu);
  uint32_t n = s->registered_count;
  if (n > 0) {
    ember_rdv_node *t = malloc((size_t)n * sizeof *t);
    if (t == NULL) {
      rc = ember__set_error(EMBER_ENOMEM, "rdv_server_nodes: out of memory");
    } else {
      uint32_t k = 0;
      for (uint32_t i = 0; i < s->num_nodes && k < n; i++)
        if (s->nodes[i].registered) t[k++] = s->nodes[i].info;
      *out = t;
      *count = k;
    }
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

int ember_rdv_server_stop(ember_rdv_server *s, int32_t node, uint32_t grace_ms) {
  if (s == NULL) return ember__set_error(EMBER_EINVAL, "rdv_server_stop: NULL server");
  int rc = EMBER_OK;
  cmd *c = calloc(1, sizeof *c);
  if (c == NULL) return ember__set_error(EMBER_ENOMEM, "rdv_server_stop: out of memory");
  c->node = node < 0 ? -1 : node;
  c->grace_ms = grace_ms;
  pthread_mutex_lock(&s->mu);
  if (s->fatal) {
    rc = ember__set_error(s->fatal, "%s", s->fatal_msg);
  } else if (node >= 0 && (uint32_t)node >= s->num_nodes) {
    rc = ember__set_error(EMBER_EINVAL, "stop: node %d out of range (num_nodes = %u)",
                          (int)node, (unsigned)s->num_nodes);
  } else if (node >= 0 && !s->nodes[node].connected) {
    rc = ember__set_error(EMBER_ENOTFOUND, "stop: node %d is not connected", (int)node);
  } else {
    if (s->cmd_tail) s->cmd_tail->next = c;
    else s->cmd_head = c;
    s->cmd_tail = c;
    c = NULL;
  }
  pthread_mutex_unlock(&s->mu);
  free(c);
  if (rc == EMBER_OK) ember__rdv_wake(s->wake_fd);
  return rc;
}

void ember_rdv_server_destroy(ember_rdv_server *s) {
  if (s == NULL) return;
  if (s->thread_started) {
    pthread_mutex_lock(&s->mu);
    s->quit = 1;
    pthread_mutex_unlock(&s->mu);
    ember__rdv_wake(s->wake_fd);
    pthread_join(s->thread, NULL);
  }
  server_free(s);
}
