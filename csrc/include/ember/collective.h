/* ember/collective.h - collectives between the ranks of a job: allreduce,
 * broadcast, allgather, barrier, on the caller's memory.
 *
 * A communicator is built from the list of rank addresses ("host:port" per
 * rank; rank i listens on its own port).  Every pair of ranks gets one TCP
 * connection (the higher rank connects to the lower), authenticated with the
 * job secret (auth.h) before any other byte is read, then introduced with a
 * COLL_HELLO frame (rank, size).  A rank handshakes every connection to its
 * port at once (one poll loop), so strangers connecting there cannot delay
 * the real ranks: each connection must authenticate and send COLL_HELLO
 * within preauth_timeout_ms (3 s), at most max_pending unauthenticated ones
 * are kept (a new one evicts the oldest, and a rank whose connection was
 * evicted reconnects), and they are logged rate-limited.  The port stops
 * listening once the mesh is complete.  Ranks that share a host (they can open each
 * other's shared-memory segment: no configuration, it is tried and verified)
 * then move their data through shared-memory rings (shm_ring.h, one from
 * each peer); the TCP connection stays as the control and liveness channel
 * (a dead peer closes it).
 *
 * Algorithms:
 *   - allreduce of more than small_max bytes: a reduce-scatter then an
 *     allgather (bandwidth-optimal: each rank sends 2(n-1)/n of the buffer),
 *     either around a ring, pipelined (a chunk is forwarded as soon as it has
 *     been reduced), or by recursive halving and doubling (Rabenseifner:
 *     2 log2(n) exchanges with one partner each instead of the ring's 2(n-1)
 *     steps).  Halving is chosen when n is a power of two of at least 4 and
 *     every rank has a host of its own (no two addresses share a host):
 *     between 4 simulated hosts that share two cores (bench-cluster) it
 *     carried 1.03-1.42x the ring's bus bandwidth at 1-256 MiB; for 2
 *     ranks the two are the same exchanges and the ring pipelines them.  Every rank
 *     makes the same choice from the same addresses; EMBER_COMM_RING or
 *     EMBER_COMM_HALVING forces one (then on every rank);
 *   - allreduce up to small_max bytes, and barrier: recursive doubling
 *     (latency-optimal: ceil(log2 n) exchanges, plus 2 for a non power of two);
 *   - broadcast: a pipelined chain from the root; allgather: a ring.
 * Every rank ends with bit-identical allreduce results (each element is
 * reduced in one order, or combined with a commutative operation), so
 * replicas of a model stay identical.
 *
 * Operations and dtypes: sum, avg (sum, then divided by the number of ranks;
 * integer avg truncates toward zero), min, max on float32, float64, int32,
 * int64 (ember_dtype values of feed.h).  Integer sums wrap around on
 * overflow.  min/max propagate NaN.
 *
 * Data on the wire: each message of a collective starts with a 24-byte header
 * (magic "ECOL", u32 sequence number, u8 kind, u8 dtype, u8 op, u8 step,
 * u32 root, u64 total bytes), all little-endian, then zeros up to the next
 * 64-byte boundary of the connection's collective bytes, so that payloads
 * start on 64-byte lines of the kernel's socket buffers (both ends count
 * the bytes; the kernel copies misaligned data up to 5x slower on some
 * CPUs); a rank that receives a header that does not match its own call
 * fails with EMBER_EPROTO naming the peer and both calls, instead of
 * reducing garbage.  Element data is in host byte
 * order (libember requires a little-endian host).
 *
 * Timeouts and failures: every call takes a timeout in milliseconds (negative:
 * no limit).  A peer that dies closes its connection and the ranks next to it
 * fail at once; a silent peer makes the call fail when its timeout passes,
 * with EMBER_ETIMEDOUT and a message naming the rank being waited for.  After
 * any failure the communicator is broken: it closes its connections and
 * marks itself aborted in its peers' shared memory so that they fail promptly too
 * (they see EMBER_ECLOSED or EMBER_EABORTED naming this rank), and every
 * later call returns EMBER_ESTATE with the first error.  Recreate the
 * communicator (a new job attempt) to continue.
 *
 * Shared memory: a segment is created 0600 under a random name, verified by a
 * random token, and unlinked as soon as the peers have mapped it (on every
 * exit path), so nothing is left in /dev/shm.
 *
 * Thread-safety: calls on one communicator are serialized (a second
 * thread's call waits for the first's to return), and ember_comm_abort may
 * be called from any thread at any time before destroy.  All ranks must call
 * the same collectives in the same order: two threads of one rank that race
 * their calls leave that order to chance.
 */
#ifndef EMBER_COLLECTIVE_H
#define EMBER_COLLECTIVE_H

#include <stddef.h>
#include <stdint.h>

#include "ember/feed.h" /* ember_dtype */
#include "ember/net.h"  /* ember_log_fn */

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  EMBER_RED_SUM = 1,
  EMBER_RED_AVG = 2,
  EMBER_RED_MIN = 3,
  EMBER_RED_MAX = 4
} ember_redop;

/* Upper bound on ranks (connections and shared-memory rings per rank grow
 * with it; a rank that cannot make or map every ring of its host, e.g. for
 * want of file descriptors, talks TCP instead). */
#define EMBER_COMM_MAX_RANKS 1024u

/* Config flags.  Every rank must pass the same EMBER_COMM_RING or
 * EMBER_COMM_HALVING: ranks that disagree wait on different peers, and their
 * first large allreduce fails with EMBER_EPROTO or times out. */
#define EMBER_COMM_TCP_ONLY 1u /* never use shared memory */
#define EMBER_COMM_RING 2u     /* large allreduces go around the ring */
#define EMBER_COMM_HALVING 4u  /* large allreduces by recursive halving */

typedef struct {
  uint32_t rank;                 /* this rank, 0..size-1 */
  uint32_t size;                 /* number of ranks */
  const char *const *addresses;  /* size entries "host:port" ("[v6]:port") */
  const uint8_t *secret;         /* the job secret (>= EMBER_SECRET_MIN_LEN) */
  size_t secret_len;
  int listen_fd;                 /* an already-bound socket on this rank's port
                                    (ember_net_bind, not listening yet, or
                                    listening), taken over; -1 to bind
                                    bind_host:<port of addresses[rank]> */
  const char *bind_host;         /* NULL or "": all IPv4 interfaces */
  uint32_t flags;                /* EMBER_COMM_* */
  size_t small_max;              /* allreduce up to this many bytes uses
                                    recursive doubling; 0 = 64 KiB */
  uint32_t preauth_timeout_ms;   /* a connection to this rank's port must
                                    authenticate and send COLL_HELLO within
                                    this; 0 = EMBER_PREAUTH_TIMEOUT_MS or 3000 */
  uint32_t max_pending;          /* unauthenticated connections kept at once;
                                    the oldest is evicted for a new one; 0 =
                                    EMBER_PREAUTH_MAX_PENDING or 512, and at
                                    least the higher ranks + 64 */
  ember_log_fn log_fn;           /* rejected strangers, rate-limited (net.h);
                                    NULL: stderr */
  void *log_arg;
  int encrypt;                   /* 1: the TCP connections between ranks carry
                                    AES-256-GCM records (secure.h); every rank
                                    must agree (a rank in the other mode is
                                    refused).  Shared memory between ranks on
                                    one host stays in clear. */
} ember_comm_config;

typedef struct ember_comm ember_comm;

/* Connects to every rank and authenticates; blocks until all ranks are
 * connected or timeout_ms passes (EMBER_ETIMEDOUT naming the missing ranks;
 * a connection that failed authentication is dropped and named in that
 * message, and the wait goes on for the real peer).  EMBER_EAUTH when a peer
 * refused our proof of the secret.  Takes ownership of cfg->listen_fd (closed
 * on failure too).  The strings of cfg are copied. */
int ember_comm_create(ember_comm **out, const ember_comm_config *cfg,
                      int64_t timeout_ms);

uint32_t ember_comm_rank(const ember_comm *c);
uint32_t ember_comm_size(const ember_comm *c);

/* 1 if data to/from `peer` moves through shared memory, 0 for TCP (0 for
 * this rank itself and for out-of-range ranks). */
int ember_comm_peer_is_shm(const ember_comm *c, uint32_t peer);

/* The algorithm ember_comm_allreduce(c, buf, count, dtype, ...) takes:
 * "recursive doubling" (up to small_max bytes, or fewer elements than
 * ranks), "ring" or "halving" (see Algorithms above), the same on every
 * rank; "none" for one rank, a NULL communicator or a dtype allreduce does
 * not take. */
const char *ember_comm_allreduce_algorithm(const ember_comm *c, size_t count, int dtype);

/* In place: buf holds count elements of dtype; afterwards every rank holds
 * the elementwise reduction over all ranks.  buf needs no alignment. */
int ember_comm_allreduce(ember_comm *c, void *buf, size_t count, int dtype, int op,
                         int64_t timeout_ms);

/* buf (nbytes, the same on every rank) of rank root is copied into buf on
 * every other rank. */
int ember_comm_broadcast(ember_comm *c, void *buf, size_t nbytes, uint32_t root,
                         int64_t timeout_ms);

/* recvbuf (size * nbytes) receives every rank's sendbuf (nbytes) in rank
 * order.  sendbuf may be recvbuf + rank * nbytes (in place) or NULL, which
 * means the same; otherwise the two must not overlap. */
int ember_comm_allgather(ember_comm *c, const void *sendbuf, void *recvbuf,
                         size_t nbytes, int64_t timeout_ms);

/* Returns once every rank has entered the barrier. */
int ember_comm_barrier(ember_comm *c, int64_t timeout_ms);

/* Breaks the communicator from any thread: a call in progress (on another
 * thread) fails with EMBER_EABORTED within about 100 ms, the peers see it as
 * this rank leaving, and later calls fail with EMBER_ESTATE. */
void ember_comm_abort(ember_comm *c);

/* Closes connections, unmaps shared memory.  Accepts NULL.  Must not race a
 * call in progress on another thread of the caller's (abort it and let it
 * return first); a holder through the api table below is aborted and
 * waited for. */
void ember_comm_destroy(ember_comm *c);

/* ------------------------------------------------------------ for other libraries
 *
 * A shared library loaded into the same process but not linked with this
 * copy of libember (the TensorFlow op EmberAllreduce: TensorFlow loads it,
 * and libember's symbols are private to Ember's Python extension) reaches
 * communicators through this table, whose address the extension hands out
 * (ember._ember.COLLECTIVE_API), as feed readers are reached (feed_reader.h).
 * Communicators are named by id, so a stale id fails cleanly
 * (EMBER_ENOTFOUND) instead of touching freed memory; destroy aborts a call
 * made through the table and waits for its release. */
#define EMBER_COMM_ABI 1u

/* The communicator's id in this process (never 0, never reused). */
uint64_t ember_comm_id(const ember_comm *c);

typedef struct {
  uint32_t abi;  /* EMBER_COMM_ABI */
  uint32_t size; /* sizeof(ember_comm_api) */
  /* Looks the communicator up and holds it for the caller until release. */
  int (*acquire)(uint64_t id, ember_comm **out);
  void (*release)(ember_comm *c);
  int (*allreduce)(ember_comm *c, void *buf, size_t count, int dtype, int op,
                   int64_t timeout_ms);
  uint32_t (*rank)(const ember_comm *c);
  uint32_t (*size_of)(const ember_comm *c);
  const char *(*last_error)(void); /* the calling thread's message */
} ember_comm_api;

const ember_comm_api *ember_comm_api_table(void);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_COLLECTIVE_H */
