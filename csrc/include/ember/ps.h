/* ember/ps.h - the parameter server: named float32 tables that workers pull
 * rows of and push gradients to, with the update rule applied on the server
 * (ps-lite's keyed push/pull, BytePS's server-side optimizer).
 *
 * Tables.  A table is `rows` x `cols` float32s and lives on every ps node
 * (shard) of the job, each holding part of its rows:
 *   - DENSE (a model's variables): rows split into contiguous ranges, shard k
 *     of n holds rows [k*rows/n, (k+1)*rows/n), all materialised at declare;
 *   - SPARSE (embedding tables): row r lives on shard ember_ps_shard_of_row;
 *     a row is materialised when first pulled or pushed, so a table of 10^9
 *     rows costs only the rows a job touches.  Only the rows a batch names
 *     travel, in either direction.
 * A row's initial values depend on (seed, row, column) only (init below), so
 * a row reads the same whichever shard holds it and whenever it appears.
 *
 * Optimizers.  A push carries gradients; the server applies them with the
 * table's optimizer (SGD, momentum, Adagrad, Adam as Keras defines them;
 * Adam's bias correction counts the steps of each row), keeping the
 * optimizer's state per row, so weights never travel from workers.  A push
 * naming a row twice applies both gradients, in order.
 *
 * Consistency.  Each row is read and updated whole: a pull never sees half
 * of a push's update to a row, and pushes that reach one row are applied to
 * it one after the other, none lost.  A request is not atomic across its
 * rows: different workers' pulls and pushes to one shard run at once, so a
 * pull may see another worker's concurrent push on some of its rows and not
 * yet on others (per-row consistency, as asynchronous parameter servers such
 * as ps-lite give per key).  One worker's requests are applied in the order
 * it sends them (one request at a time a connection).
 *
 * Staleness.  With staleness S (config), every worker also reports its
 * clock (ember_ps_client_clock, once per step); a pull by a worker at clock
 * c is answered only once every worker of
 * the job reached at least c - S (bounded staleness: no worker more than S
 * steps ahead of the slowest), or fails naming the slowest worker when that
 * takes longer than the client's timeout.  EMBER_PS_ASYNC: never waits.  A
 * worker that ends (ember_ps_client_finish) no longer holds anyone back,
 * until it clocks again.
 *
 * Wire.  Every connection is authenticated with the job secret (auth.h, the
 * servers' one accept path), optionally encrypted (secure.h), and carries
 * one request at a time, answered PS_REPLY(u32 status, str reason, body):
 *   PS_HELLO    u32 worker, u32 num_workers, u32 shard, u32 num_shards
 *               (the worker's view must match the server's, else REFUSED)
 *   PS_DECLARE  table spec (below); declaring an existing table with the
 *               same spec is a no-op, a different spec is refused naming both
 *   PS_PULL     str table, u64 clock, u32 wait_ms, u8 whole, u32 n, n x u64
 *               row -> body n x cols f32 (whole: a dense table's rows on
 *               that shard, no ids; wait_ms: the longest staleness wait)
 *   PS_PUSH     str table, u8 whole, u32 n, u32 cols, n x u64 row (unless
 *               whole), n x cols f32
 *   PS_ASSIGN   as PS_PUSH, with values to set instead of gradients
 *   PS_INIT     as PS_ASSIGN, to the rows no push has reached only
 *   PS_CLOCK    u64 clock (the worker finished that many steps)
 *   PS_SAVE     str dir: the shard writes its checkpoint file there
 *   PS_SHM      16-byte host id, request ring, reply ring (below)
 * The server keeps serving every other worker whatever one sends: a
 * malformed frame, an unknown table or a push of the wrong shape is
 * answered with a status and a reason naming the table, the shard and both
 * shapes (the connection stays usable after a refused request, and is
 * closed after a malformed frame).
 *
 * Transport.  A worker and a shard on one host move their requests and
 * replies to shared memory once the connection is authenticated, as the
 * feed does (feed.h): the worker creates two shm rings (shm_ring.h; 8 MiB
 * each unless shm_bytes says otherwise), the request ring it writes and the
 * reply ring it reads, and offers them in PS_SHM with this host's identity
 * (the kernel's boot id and the network namespace).  A shard on the same
 * host attaches both and answers status 0 over TCP; from the next request
 * on, the rings carry the very frames the socket would (the socket stays
 * open, idle).  A shard on another host, or one that cannot attach, or with
 * shared memory disabled (disable_shm, EMBER_PS_SHM=0), declines with a
 * reason: the worker stays on TCP (shm AUTO) or fails naming the reason
 * (shm ON).  Encrypted connections always stay on TCP (encrypt and shm ON
 * together are refused): encryption is asked for when the wire is not
 * trusted, and the simple rule is easier to audit than "encrypted unless
 * local".  Nothing else changes: the byte counters count the same payloads,
 * a pull still lands straight in the caller's array and a whole dense push
 * leaves from where its floats lie (the ring takes the place of the
 * socket's kernel buffers: no staging copy is added), and a worker or
 * shard that dies, even by SIGKILL, is seen through the rings' liveness
 * locks (EMBER_ECLOSED) as a closed socket would be (a child forked
 * without exec after the client connected holds them, as it holds the
 * sockets: shm_ring.h, "Forking").  A record that breaks the ring's format
 * ends that connection only, logged naming the shard and the worker.
 * ember_ps_client_transport says which transport each shard's link uses.
 *
 * Checkpoints.  ember_ps_server_save writes every table of the shard and its
 * optimizer state to <dir>/ps-<shard>-of-<num_shards>.ckpt (written to a
 * temporary name and renamed, CRC-32C protected); ember_ps_server_restore
 * reads it back, refusing a file of another shard count or a corrupt one.
 *
 * Thread-safety: a server is safe from any thread (it serves each
 * connection on a thread of its own); a client is used by one thread at a
 * time, except ember_ps_client_abort.  Every blocking call has a deadline. */
#ifndef EMBER_PS_H
#define EMBER_PS_H

#include <stddef.h>
#include <stdint.h>

#include "ember/net.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EMBER_PS_NAME_MAX 128u          /* bytes of a table name, NUL included */
#define EMBER_PS_ASYNC UINT32_MAX       /* staleness: fully asynchronous */
#define EMBER_PS_MAX_SHARDS 1024u
#define EMBER_PS_MAX_COLS (1u << 20)

typedef enum { EMBER_PS_DENSE = 0, EMBER_PS_SPARSE = 1 } ember_ps_layout;

typedef enum {
  EMBER_PS_SGD = 0,      /* w -= lr * g */
  EMBER_PS_MOMENTUM = 1, /* v = momentum * v - lr * g; w += v (Keras SGD) */
  EMBER_PS_ADAGRAD = 2,  /* a += g^2; w -= lr * g / sqrt(a + epsilon) (Keras 3) */
  EMBER_PS_ADAM = 3      /* Keras Adam, bias-corrected per row */
} ember_ps_optimizer_kind;

typedef enum {
  EMBER_PS_INIT_ZEROS = 0,
  EMBER_PS_INIT_UNIFORM = 1, /* uniform in [-scale, scale) */
  EMBER_PS_INIT_NORMAL = 2   /* normal, mean 0, standard deviation scale */
} ember_ps_init_kind;

typedef struct {
  uint32_t kind;             /* ember_ps_optimizer_kind */
  float learning_rate;
  float momentum;            /* MOMENTUM */
  float beta1, beta2;        /* ADAM (0: Keras's 0.9, 0.999) */
  float epsilon;             /* ADAGRAD, ADAM (0: Keras's 1e-7) */
  float initial_accumulator; /* ADAGRAD (Keras: 0.1) */
} ember_ps_optimizer;

typedef struct {
  const char *name;  /* 1..EMBER_PS_NAME_MAX-1 bytes */
  uint32_t layout;   /* ember_ps_layout */
  uint64_t rows;     /* DENSE: the rows; SPARSE: row ids are < rows */
  uint32_t cols;     /* 1..EMBER_PS_MAX_COLS */
  ember_ps_optimizer optimizer;
  uint32_t init;     /* ember_ps_init_kind */
  float init_scale;
  uint64_t seed;
} ember_ps_table_spec;

/* The shard that holds `row` of a table (same on every client and server). */
uint32_t ember_ps_shard_of_row(uint32_t layout, uint64_t rows, uint64_t row,
                               uint32_t num_shards);

/* ------------------------------------------------------------ server */

typedef struct {
  int listen_fd;          /* a bound socket to take over, or -1 to bind */
  const char *bind_host;  /* NULL or "": all interfaces */
  uint16_t port;          /* 0: any */
  const uint8_t *secret;  /* the job secret (copied) */
  size_t secret_len;
  int encrypt;            /* 1: connections are encrypted records */
  uint32_t shard, num_shards;
  uint32_t num_workers;   /* the workers whose clocks bound staleness */
  uint32_t staleness;     /* EMBER_PS_ASYNC, or the steps a worker may lead */
  uint32_t max_frame;     /* largest request; 0: 256 MiB */
  ember_log_fn log_fn;    /* refused peers and requests; NULL: stderr */
  void *log_arg;
  int disable_shm;        /* 1: decline every PS_SHM (so does EMBER_PS_SHM=0) */
} ember_ps_server_config;

typedef struct ember_ps_server ember_ps_server;

/* Takes ownership of cfg->listen_fd and starts serving. */
int ember_ps_server_create(ember_ps_server **out, const ember_ps_server_config *cfg);
uint16_t ember_ps_server_port(const ember_ps_server *s);

typedef struct {
  uint64_t tables, rows_held;              /* rows materialised on this shard */
  uint64_t pulls, pushes, rows_pulled, rows_pushed;
  uint64_t bytes_received, bytes_sent;     /* request and reply payloads */
  uint64_t requests_refused, stale_waits;  /* pulls that waited for a slower worker */
  uint64_t min_clock;                      /* slowest live worker's clock */
  uint64_t workers_connected;              /* worker connections open now */
  uint64_t shm_connections;                /* of those, on shared memory */
} ember_ps_stats;
void ember_ps_server_stats(ember_ps_server *s, ember_ps_stats *out);

/* Writes / reads this shard's checkpoint in dir (see above).  Safe while
 * serving: each table is copied under its lock. */
int ember_ps_server_save(ember_ps_server *s, const char *dir);
int ember_ps_server_restore(ember_ps_server *s, const char *dir);

/* Closes every connection (their threads end) and frees.  Accepts NULL. */
void ember_ps_server_destroy(ember_ps_server *s);

/* ------------------------------------------------------------ client */

typedef enum {
  EMBER_PS_SHM_AUTO = 0, /* shared memory with the shards on this host, unless the
                            connection is encrypted or EMBER_PS_SHM=0 */
  EMBER_PS_SHM_OFF = 1,  /* TCP only */
  EMBER_PS_SHM_ON = 2    /* shared memory with every shard, or fail naming why */
} ember_ps_shm_mode;

typedef struct {
  const char *const *hosts; /* shard k at hosts[k]:ports[k] */
  const uint16_t *ports;
  uint32_t num_shards;
  const uint8_t *secret;
  size_t secret_len;
  int encrypt;
  uint32_t worker, num_workers;
  int64_t timeout_ms;       /* each call's deadline; 0: 600000 */
  int shm;                  /* ember_ps_shm_mode (0: AUTO) */
  size_t shm_bytes;         /* each ring's capacity; 0: 8 MiB (64 KiB..1 GiB) */
} ember_ps_client_config;

typedef struct ember_ps_client ember_ps_client;

/* Connects to every shard (retrying until the deadline: servers may still be
 * starting), says HELLO and, as cfg->shm allows, offers shared memory
 * (see "Transport" above). */
int ember_ps_client_create(ember_ps_client **out, const ember_ps_client_config *cfg);

/* Declares a table on every shard (idempotent for the same spec). */
int ember_ps_client_declare(ember_ps_client *c, const ember_ps_table_spec *spec);

/* Rows `ids[0..n)` into out (n x cols floats, in the order asked); ids NULL
 * with a DENSE table: every row (out holds rows x cols).  Blocks for bounded
 * staleness (see above). */
int ember_ps_client_pull(ember_ps_client *c, const char *table, const uint64_t *ids,
                         size_t n, uint32_t cols, float *out);

/* Gradients for rows ids[0..n) (n x cols floats); ids NULL with a DENSE
 * table: the whole table's gradient. */
int ember_ps_client_push(ember_ps_client *c, const char *table, const uint64_t *ids,
                         size_t n, uint32_t cols, const float *grads);

/* Sets rows ids[0..n) to values (n x cols floats; ids NULL with a DENSE
 * table: the whole table), keeping their optimizer state: how the chief
 * puts its model's initial weights on the servers before training. */
int ember_ps_client_assign(ember_ps_client *c, const char *table, const uint64_t *ids,
                           size_t n, uint32_t cols, const float *values);

/* ember_ps_client_assign for the rows no push has reached yet only: a
 * chief's initial weights that leave alone what a restored checkpoint (or
 * another worker's pushes) already trained. */
int ember_ps_client_init(ember_ps_client *c, const char *table, const uint64_t *ids, size_t n,
                         uint32_t cols, const float *values);

/* This worker finished another step (bounded staleness). */
int ember_ps_client_clock(ember_ps_client *c);

/* This worker is done: it holds no other worker back any more. */
int ember_ps_client_finish(ember_ps_client *c);

/* Every shard writes its checkpoint to dir. */
int ember_ps_client_save(ember_ps_client *c, const char *dir);

/* Breaks the client from any thread: a call in progress on another thread
 * (a pull waiting for a straggler) fails with EMBER_EABORTED at once, and
 * later calls fail with EMBER_ESTATE.  Safe until destroy. */
void ember_ps_client_abort(ember_ps_client *c);

/* Bytes this client sent and received (payloads), for tests and benches. */
void ember_ps_client_bytes(const ember_ps_client *c, uint64_t *sent, uint64_t *received);

typedef enum { EMBER_PS_TRANSPORT_TCP = 0, EMBER_PS_TRANSPORT_SHM = 1 } ember_ps_transport;

/* The transport of the link to shard `shard` (EMBER_PS_TRANSPORT_*, fixed
 * from ember_ps_client_create on), and the payload bytes sent to and
 * received from that shard (each may be NULL); EMBER_EINVAL for no such
 * shard.  Same thread rules as ember_ps_client_bytes. */
int ember_ps_client_transport(const ember_ps_client *c, uint32_t shard, uint64_t *sent,
                              uint64_t *received);

void ember_ps_client_destroy(ember_ps_client *c); /* accepts NULL */

#ifdef __cplusplus
}
#endif
#endif /* EMBER_PS_H */
