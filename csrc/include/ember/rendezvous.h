/* ember/rendezvous.h - the reservation server (driver) and its client (node).
 *
 * The driver starts one server per job with a fresh secret.  Each node
 * connects, authenticates (auth.h), and sends REGISTER with its barrier index,
 * host, executor id, pid and reserved ports.  When all num_nodes have
 * registered, the server assigns roles and sends every node the same SPEC: the
 * node table in index order, each row with its role and task index.  The
 * connection then stays open as the node's control channel: the node sends
 * HEARTBEATs and REPORTs (progress, done, failed with a traceback); the server
 * may send STOP.  A node whose heartbeats stop for heartbeat_timeout_ms is
 * LOST.  No pickle, no JSON: fixed little-endian fields and bounded strings.
 *
 * Roles follow TensorFlowOnSpark's order over the indexes 0..n-1: the first
 * num_ps nodes are "ps"; then one "chief" if has_chief; then one "evaluator"
 * if has_evaluator; the rest are "worker".  task_index counts within a role.
 *
 * REGISTER payload: u32 index, str host, str executor_id, u32 pid,
 *                   u32 nports, u16 ports[nports]
 *   (an empty host means "the address this connection came from").
 * SPEC payload:     u32 your_index, u32 count, then count times:
 *                   u32 index, str host, str executor_id, u32 pid, u32 nports,
 *                   u16 ports[nports], str role, u32 task_index
 * REPORT payload:   u32 kind (ember_rdv_report_kind), i32 code, str text
 * STOP payload:     u32 grace_ms
 *
 * The server runs one background thread with a poll loop; a slow or hostile
 * peer (bad secret, garbage frames, a half-sent frame) is dropped and never
 * stalls the others.  Connections that have not authenticated get a short
 * deadline (preauth_timeout_ms) and a pool of their own (max_pending; when it
 * is full the oldest is evicted, never a registered node), and are reported
 * rate-limited: the first REJECTED event at once, then at most one per
 * EMBER_REJECT_LOG_INTERVAL_MS (default 10 s) whose code is the number of
 * connections it covers and whose text names the latest peer and reason.  An
 * authenticated peer that is refused (bad REGISTER, duplicate index) gets a
 * REJECTED event of its own (code 1).
 */
#ifndef EMBER_RENDEZVOUS_H
#define EMBER_RENDEZVOUS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EMBER_RDV_MAX_PORTS 8u
#define EMBER_RDV_HOST_MAX 256u
#define EMBER_RDV_ID_MAX 128u
#define EMBER_RDV_ROLE_MAX 16u
#define EMBER_RDV_MAX_NODES 65536u
#define EMBER_RDV_TEXT_MAX (1024u * 1024u) /* tracebacks are truncated to this */

typedef struct {
  uint32_t index;                 /* barrier partition id, 0..num_nodes-1 */
  char host[EMBER_RDV_HOST_MAX];  /* address other nodes reach this node at */
  char executor_id[EMBER_RDV_ID_MAX];
  uint32_t pid;
  uint32_t num_ports;
  uint16_t ports[EMBER_RDV_MAX_PORTS]; /* [0] framework, [1] feed, ... */
  char role[EMBER_RDV_ROLE_MAX];       /* filled by the server */
  uint32_t task_index;                 /* filled by the server */
} ember_rdv_node;

/* ---------------------------------------------------------------- server */

typedef struct {
  const uint8_t *secret; /* copied; >= EMBER_SECRET_MIN_LEN bytes */
  size_t secret_len;
  const char *bind_host; /* NULL or "" = all interfaces */
  uint16_t port;         /* 0 = any free port */
  uint32_t num_nodes;
  uint32_t num_ps;
  int has_chief;
  int has_evaluator;
  uint32_t heartbeat_timeout_ms; /* 0 = default 10000 */
  uint32_t handshake_timeout_ms; /* per connection, to finish auth+REGISTER; 0 = 10000 */
  uint32_t preauth_timeout_ms;   /* from accept to a valid AUTH (capped by the
                                    handshake timeout); 0 = EMBER_PREAUTH_TIMEOUT_MS
                                    or 3000 */
  uint32_t max_pending;          /* unauthenticated connections kept at once; the
                                    oldest is evicted for a new one; 0 =
                                    EMBER_PREAUTH_MAX_PENDING or 512, and at
                                    least num_nodes + 64 */
} ember_rdv_server_config;

typedef enum {
  EMBER_RDV_EV_REGISTERED = 1, /* node registered (node = index) */
  EMBER_RDV_EV_READY = 2,      /* all nodes registered, SPEC sent */
  EMBER_RDV_EV_PROGRESS = 3,   /* node REPORT of kind PROGRESS; text */
  EMBER_RDV_EV_DONE = 4,       /* node reported DONE; code = exit code */
  EMBER_RDV_EV_FAILED = 5,     /* node reported FAILED; code, text = traceback */
  EMBER_RDV_EV_LOST = 6,       /* node's control connection dropped or went
                                  silent before it reported DONE/FAILED */
  EMBER_RDV_EV_REJECTED = 7    /* connection(s) refused; node = -1 unless
                                  known; code = how many (rate-limited, see
                                  above); text = a whole log line naming the
                                  server, the (latest) peer and the reason */
} ember_rdv_event_kind;

typedef struct {
  int kind;     /* ember_rdv_event_kind */
  int32_t node; /* node index, or -1 */
  int32_t code; /* exit code for DONE/FAILED; connections for REJECTED */
  char *text;   /* malloc'd, NUL-terminated, may be NULL; freed by
                   ember_rdv_event_clear */
} ember_rdv_event;

typedef struct ember_rdv_server ember_rdv_server;

/* Binds, listens and starts the server thread.  The caller owns *out and must
 * ember_rdv_server_destroy it. */
int ember_rdv_server_create(ember_rdv_server **out, const ember_rdv_server_config *cfg);

/* The port actually bound. Thread-safe. */
uint16_t ember_rdv_server_port(const ember_rdv_server *s);

/* Blocks until all nodes have registered, or timeout_ms passes: then returns
 * EMBER_ETIMEDOUT with a message naming the missing node indexes
 * ("reservation timed out after 5000 ms: 3 of 4 nodes registered; missing
 * node(s): 2").  Does not consume events.  Thread-safe. */
int ember_rdv_server_wait_ready(ember_rdv_server *s, int64_t timeout_ms);

/* Pops the next event (queued in order of occurrence) into *ev, waiting up to
 * timeout_ms.  EMBER_ETIMEDOUT if none came.  Thread-safe. */
int ember_rdv_server_next_event(ember_rdv_server *s, ember_rdv_event *ev,
                                int64_t timeout_ms);
void ember_rdv_event_clear(ember_rdv_event *ev);

/* Copies the registered node table (index order) into a malloc'd array; the
 * caller frees it.  Before READY, only registered rows are returned. */
int ember_rdv_server_nodes(ember_rdv_server *s, ember_rdv_node **out, uint32_t *count);

/* Sends STOP(grace_ms) to every connected node (or only to `node` if >= 0).
 * The node's client thread then has grace_ms to exit by itself before it
 * kills its own process group (see EMBER_RDV_EXIT_ON_LOSS). Thread-safe. */
int ember_rdv_server_stop(ember_rdv_server *s, int32_t node, uint32_t grace_ms);

/* Stops the thread, closes every connection (nodes with EXIT_ON_LOSS then
 * exit) and frees everything.  Accepts NULL. */
void ember_rdv_server_destroy(ember_rdv_server *s);

/* ---------------------------------------------------------------- client */

typedef enum {
  EMBER_RDV_REPORT_PROGRESS = 1,
  EMBER_RDV_REPORT_DONE = 2,
  EMBER_RDV_REPORT_FAILED = 3
} ember_rdv_report_kind;

typedef struct ember_rdv_client ember_rdv_client;

/* Connects to the driver and authenticates.  Blocks until timeout_ms. */
int ember_rdv_client_connect(ember_rdv_client **out, const char *host, uint16_t port,
                             const uint8_t *secret, size_t secret_len,
                             int64_t timeout_ms);

/* Sends REGISTER for self (role/task_index ignored).  Blocks until sent. */
int ember_rdv_client_register(ember_rdv_client *c, const ember_rdv_node *self,
                              int64_t timeout_ms);

/* Waits for SPEC; returns the malloc'd node table (caller frees) and this
 * node's position in it.  EMBER_ETIMEDOUT names how long it waited. */
int ember_rdv_client_wait_spec(ember_rdv_client *c, ember_rdv_node **nodes,
                               uint32_t *count, uint32_t *self_pos,
                               int64_t timeout_ms);

/* Starts the background thread: sends a HEARTBEAT every interval_ms, reads
 * STOP and heartbeat echoes.  The driver counts as lost when the connection
 * drops or nothing has come from it for silence_ms (0: 3 intervals + 5 s).
 * flags:
 *   EMBER_RDV_EXIT_ON_LOSS: when the driver is lost, or a STOP's grace period
 *   runs out, the thread kills this process's group with SIGKILL (the node is
 *   its own group leader), so an orphaned trainer never outlives its driver.
 *
 * A node cut off from the driver by a partition sees silence, not an error.
 * Give silence_ms the server's heartbeat_timeout_ms: every heartbeat is
 * echoed, so the node's last echo arrived after the server last heard it,
 * and the node ends itself no earlier than the server counts it LOST (a
 * partition that heals sooner costs nothing) and only a round trip later:
 * before anything the driver starts in its place can run. */
#define EMBER_RDV_EXIT_ON_LOSS 1u
int ember_rdv_client_start(ember_rdv_client *c, uint32_t interval_ms, uint32_t silence_ms,
                           uint32_t flags);

/* 0 while running; otherwise the grace_ms of the STOP received + 1 (so a
 * STOP with grace 0 reads as 1); -1 if the driver connection was lost. */
int64_t ember_rdv_client_stop_state(ember_rdv_client *c);

/* Sends a REPORT (thread-safe with the background thread). */
int ember_rdv_client_report(ember_rdv_client *c, int kind, int32_t code,
                            const char *text, int64_t timeout_ms);

/* Stops the thread and closes the connection.  Accepts NULL. */
void ember_rdv_client_destroy(ember_rdv_client *c);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_RENDEZVOUS_H */
