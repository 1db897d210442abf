/* coll_internal.h - internal: the communicator's state, shared by the files
 * of the collective (the contract is ember/collective.h).
 *
 *   collective.c   the public calls: arguments, the algorithm's choice,
 *                  create and destroy;
 *   coll_reduce.c  the reduction kernels;
 *   coll_engine.c  the shared-memory inbox and doorbells, the channels (one
 *                  non-blocking send and receive over TCP or a ring) and
 *                  the step engine that every algorithm runs on;
 *   coll_algos.c   the algorithms (ring, recursive doubling and halving,
 *                  chain, ring allgather) as lists of steps;
 *   coll_mesh.c    set-up: the authenticated mesh of TCP connections and
 *                  the shared-memory negotiation over it.
 *
 * A communicator is used by one thread at a time (its calls), except
 * abort_req, which any thread may set (ember_comm_abort). */
#ifndef EMBER_COLL_INTERNAL_H
#define EMBER_COLL_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "ember/collective.h"
#include "ember/secure.h"
#include "ember/shm_ring.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libember's collectives move elements in host order: little-endian only"
#endif

#define COLL_HOST_CAP 256u
#define COLL_ADDR_CAP 300u
/* How often a blocking wait checks the abort flag and the peers' liveness. */
#define COLL_POLL_SLICE_MS 100

/* The large allreduce's algorithm (ember_comm_config.flags force one). */
enum { COLL_ALGO_AUTO = 0, COLL_ALGO_RING = 1, COLL_ALGO_HALVING = 2, COLL_ALGO_DOUBLING = 3 };

/* ---- the shared-memory inbox ----
 *
 * Every rank owns one ring (shm_ring.h) from each peer on its host, and one
 * small "inbox" segment holding its doorbell and the abort word.  A rank
 * drives its rings with the ring's non-blocking stream calls and waits on
 * its own doorbell (a futex word) for all of them at once; whoever moves a
 * ring's position that a rank waits on rings that rank's doorbell.  The
 * inbox is a named POSIX segment, opened by name once and unlinked: a peer
 * that can open it shares this host's /dev/shm, which is what makes it a
 * peer on this host (ranks in other containers or namespaces on one kernel
 * could still reach the rings through /proc).  coll_mesh.c creates and maps
 * inboxes; coll_engine.c rings and waits on them. */
#define COLL_INBOX_MAGIC 0x584F424E494C4F43ull /* "COLINBOX" */
#define COLL_INBOX_LEN 4096u

typedef struct {
  uint64_t magic;
  uint8_t token[32];
  uint32_t owner_rank, size;
  char pad0[16];
  _Atomic uint32_t bell;       /* the futex word */
  _Atomic uint32_t waiting;    /* the owner may be asleep on bell */
  _Atomic uint32_t aborted_by; /* 1 + rank of a rank that broke the comm */
  char pad1[52];
} ember__coll_inbox;

_Static_assert(sizeof(ember__coll_inbox) <= COLL_INBOX_LEN, "inbox header layout");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "shared-memory doorbells need lock-free atomics");

/* ---- the communicator ---- */

typedef struct {
  uint32_t rank;
  int fd;
  ember_sec *sec; /* the record layer over fd when the job encrypts (secure.h);
                     NULL in clear.  Shared memory never goes through it. */
  char host[COLL_HOST_CAP];
  uint16_t port;
  char desc[COLL_ADDR_CAP + 32]; /* "rank 2 (127.0.0.1:5002)" */
  int shm;
  ember_shm_ring *in;  /* peer -> me: this rank created it, the consumer */
  ember_shm_ring *out; /* me -> peer: attached to the peer's, the producer */
  ember__coll_inbox *peer_ib; /* the peer's inbox (its doorbell) */
  uint64_t in_seen, out_seen; /* the rings' peer positions when we last found no progress */
  uint64_t out_pos, in_pos;   /* collective bytes sent to / received from this peer */
} ember__coll_peer;

struct ember_comm {
  uint32_t rank, size;
  ember__coll_peer *peers; /* size entries; peers[rank] is this rank (fd -1) */
  int listen_fd;
  ember__coll_inbox *inbox;
  uint8_t *tmp;
  size_t tmp_cap, tmp_fill;
  size_t small_max;
  uint32_t seq;
  int algo;           /* COLL_ALGO_AUTO, or the large allreduce's forced one */
  int own_hosts;      /* every rank's address names a host of its own */
  int spin_us;        /* most a wait spins before it sleeps */
  int yield_us;       /* then how long it yields its core before it sleeps */
  int tcp_yield_us;   /* the same for a wait on sockets only */
  int64_t spin_cur_ns; /* adaptive spin budget, 0..spin_us */
  unsigned waits;
  _Atomic int abort_req;
  int broken;
  char broken_msg[1024];
  /* One collective call at a time: the Python binding's thread and
   * TensorFlow's op (through the api table) may both hold the communicator. */
  pthread_mutex_t call_mu;
  /* The registry of collective.c (for other libraries); under its lock. */
  uint64_t id;             /* 0 until ember_comm_create succeeds */
  unsigned refs;           /* acquired through the api table, not yet released */
  pthread_cond_t idle;     /* signalled when refs drops to 0 */
  struct ember_comm *next_registered;
};

#endif /* EMBER_COLL_INTERNAL_H */
