/* collective.c - the public calls of the collective (ember/collective.h):
 * argument checks, the choice of algorithm, create and destroy.  The work is
 * done by the files coll_internal.h lists: the kernels (coll_reduce.c), the
 * step engine (coll_engine.c), the algorithms (coll_algos.c) and the set-up
 * (coll_mesh.c). */
#include "ember/collective.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "coll_algos.h"
#include "coll_engine.h"
#include "coll_internal.h"
#include "coll_mesh.h"
#include "coll_reduce.h"
#include "ember/auth.h"
#include "ember/error.h"
#include "ember/net.h"

#ifndef TCP_TMP_CAP
#define TCP_TMP_CAP (256u * 1024u) /* receive-then-reduce staging for TCP */
#endif
#define SMALL_MAX_DEFAULT (64u * 1024u)
/* How long a wait on a socket polls, yielding its core between polls, before
 * it sleeps in poll(): a TCP peer's next bytes mostly arrive within a
 * millisecond in the middle of an op, and each sleep costs a context switch
 * and a wake-up (2 ranks between two simulated hosts, 1 MiB: 5 context
 * switches a call, where Open MPI, which polls and yields, has none). */
#define TCP_YIELD_US 1000

static int check_comm(const ember_comm *c, const char *what) {
  if (c == NULL) return ember__set_error(EMBER_EINVAL, "%s: communicator is NULL", what);
  return EMBER_OK;
}

/* An allreduce's algorithm (collective.h): the same answer on every rank,
 * from the sizes, flags and addresses they all share. */
static int pick_algo(const ember_comm *c, size_t nbytes, size_t count) {
  if (nbytes <= c->small_max || count < c->size) return COLL_ALGO_DOUBLING;
  if (c->algo != COLL_ALGO_AUTO) return c->algo;
  int pow2 = c->size >= 4 && (c->size & (c->size - 1)) == 0;
  return pow2 && c->own_hosts ? COLL_ALGO_HALVING : COLL_ALGO_RING;
}

const char *ember_comm_allreduce_algorithm(const ember_comm *c, size_t count, int dtype) {
  size_t nbytes = 0;
  if (c == NULL || c->size == 1 || ember__coll_kernel(dtype, EMBER_RED_SUM) == NULL ||
      __builtin_mul_overflow(count, ember_dtype_size((uint8_t)dtype), &nbytes))
    return "none";
  switch (pick_algo(c, nbytes, count)) {
  case COLL_ALGO_DOUBLING: return "recursive doubling";
  case COLL_ALGO_HALVING: return "halving";
  default: return "ring";
  }
}

static int comm_allreduce(ember_comm *c, void *buf, size_t count, int dtype, int op,
                         int64_t timeout_ms) {
  ember__coll_op o;
  int rc = check_comm(c, "allreduce");
  if (rc != EMBER_OK) return rc;
  if (ember__coll_kernel(dtype, EMBER_RED_SUM) == NULL)
    return ember__set_error(EMBER_EINVAL,
                            "allreduce: unsupported dtype %d (float32, float64, int32 or "
                            "int64)", dtype);
  if (op < EMBER_RED_SUM || op > EMBER_RED_MAX)
    return ember__set_error(EMBER_EINVAL, "allreduce: unknown op %d (sum, avg, min, max)", op);
  size_t esz = ember_dtype_size((uint8_t)dtype), nbytes = 0;
  if (__builtin_mul_overflow(count, esz, &nbytes))
    return ember__set_error(EMBER_ETOOBIG, "allreduce: %zu elements overflow size_t", count);
  if (buf == NULL && nbytes > 0) return ember__set_error(EMBER_EINVAL, "allreduce: buf is NULL");
  rc = ember__coll_op_begin(c, &o, COLL_ALLREDUCE, dtype, op, 0, nbytes, timeout_ms);
  if (rc != EMBER_OK) return rc;
  if (c->size == 1) return EMBER_OK; /* avg over one rank is the identity */
  switch (pick_algo(c, nbytes, count)) {
  case COLL_ALGO_DOUBLING: rc = ember__coll_rd_allreduce(&o, buf, nbytes); break;
  case COLL_ALGO_HALVING: rc = ember__coll_rh_allreduce(&o, buf, count); break;
  default: rc = ember__coll_ring_allreduce(&o, buf, count); break;
  }
  return ember__coll_op_end(c, rc);
}

static int comm_broadcast(ember_comm *c, void *buf, size_t nbytes, uint32_t root,
                         int64_t timeout_ms) {
  ember__coll_op o;
  int rc = check_comm(c, "broadcast");
  if (rc != EMBER_OK) return rc;
  if (root >= c->size)
    return ember__set_error(EMBER_EINVAL, "broadcast: root %u is not a rank (size %u)", root,
                            c->size);
  if (buf == NULL && nbytes > 0) return ember__set_error(EMBER_EINVAL, "broadcast: buf is NULL");
  rc = ember__coll_op_begin(c, &o, COLL_BROADCAST, 0, 0, root, nbytes, timeout_ms);
  if (rc != EMBER_OK || c->size == 1) return rc;
  rc = ember__coll_chain_broadcast(&o, buf, nbytes);
  return ember__coll_op_end(c, rc);
}

static int comm_allgather(ember_comm *c, const void *sendbuf, void *recvbuf, size_t nbytes,
                         int64_t timeout_ms) {
  ember__coll_op o;
  int rc = check_comm(c, "allgather");
  if (rc != EMBER_OK) return rc;
  size_t total = 0;
  if (__builtin_mul_overflow(nbytes, (size_t)c->size, &total))
    return ember__set_error(EMBER_ETOOBIG, "allgather: %zu bytes x %u ranks overflows", nbytes,
                            c->size);
  if (recvbuf == NULL && total > 0)
    return ember__set_error(EMBER_EINVAL, "allgather: recvbuf is NULL");
  uint8_t *rb = recvbuf;
  uint8_t *mine = total > 0 ? rb + (size_t)c->rank * nbytes : NULL;
  if (sendbuf != NULL && sendbuf != mine && nbytes > 0) {
    const uint8_t *sb = sendbuf;
    if (sb < rb + total && rb < sb + nbytes)
      return ember__set_error(EMBER_EINVAL,
                              "allgather: sendbuf overlaps recvbuf other than at this rank's "
                              "block");
  }
  rc = ember__coll_op_begin(c, &o, COLL_ALLGATHER, 0, 0, 0, total, timeout_ms);
  if (rc != EMBER_OK) return rc;
  if (sendbuf != NULL && sendbuf != mine && nbytes > 0) memcpy(mine, sendbuf, nbytes);
  if (c->size == 1) return EMBER_OK;
  rc = ember__coll_ring_allgather(&o, rb, nbytes);
  return ember__coll_op_end(c, rc);
}

static int comm_barrier(ember_comm *c, int64_t timeout_ms) {
  ember__coll_op o;
  int rc = check_comm(c, "barrier");
  if (rc != EMBER_OK) return rc;
  rc = ember__coll_op_begin(c, &o, COLL_BARRIER, 0, 0, 0, 0, timeout_ms);
  if (rc != EMBER_OK || c->size == 1) return rc;
  rc = ember__coll_rd_allreduce(&o, NULL, 0);
  return ember__coll_op_end(c, rc);
}

/* The public calls: one at a time on a communicator (collective.h). */
int ember_comm_allreduce(ember_comm *c, void *buf, size_t count, int dtype, int op,
                         int64_t timeout_ms) {
  if (c == NULL) return check_comm(c, "allreduce");
  pthread_mutex_lock(&c->call_mu);
  int rc = comm_allreduce(c, buf, count, dtype, op, timeout_ms);
  pthread_mutex_unlock(&c->call_mu);
  return rc;
}

int ember_comm_broadcast(ember_comm *c, void *buf, size_t nbytes, uint32_t root,
                         int64_t timeout_ms) {
  if (c == NULL) return check_comm(c, "broadcast");
  pthread_mutex_lock(&c->call_mu);
  int rc = comm_broadcast(c, buf, nbytes, root, timeout_ms);
  pthread_mutex_unlock(&c->call_mu);
  return rc;
}

int ember_comm_allgather(ember_comm *c, const void *sendbuf, void *recvbuf, size_t nbytes,
                         int64_t timeout_ms) {
  if (c == NULL) return check_comm(c, "allgather");
  pthread_mutex_lock(&c->call_mu);
  int rc = comm_allgather(c, sendbuf, recvbuf, nbytes, timeout_ms);
  pthread_mutex_unlock(&c->call_mu);
  return rc;
}

int ember_comm_barrier(ember_comm *c, int64_t timeout_ms) {
  if (c == NULL) return check_comm(c, "barrier");
  pthread_mutex_lock(&c->call_mu);
  int rc = comm_barrier(c, timeout_ms);
  pthread_mutex_unlock(&c->call_mu);
  return rc;
}

/* ------------------------------------------------------------ registry */

/* Communicators by id, for the api table (collective.h).  A list: a process
 * holds a handful. */
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static ember_comm *registry;
static uint64_t registry_next_id = 1;

static void registry_add(ember_comm *c) {
  pthread_mutex_lock(&registry_mu);
  c->id = registry_next_id++;
  c->next_registered = registry;
  registry = c;
  pthread_mutex_unlock(&registry_mu);
}

/* Unlists c (no new acquires), aborts a call made through the table and
 * waits until its holders have released it. */
static void registry_remove(ember_comm *c) {
  pthread_mutex_lock(&registry_mu);
  for (ember_comm **p = &registry; *p != NULL; p = &(*p)->next_registered)
    if (*p == c) {
      *p = c->next_registered;
      break;
    }
  if (c->refs > 0) ember_comm_abort(c);
  while (c->refs > 0) pthread_cond_wait(&c->idle, &registry_mu);
  pthread_mutex_unlock(&registry_mu);
}

static int comm_acquire(uint64_t id, ember_comm **out) {
  *out = NULL;
  pthread_mutex_lock(&registry_mu);
  ember_comm *c = registry;
  while (c != NULL && c->id != id) c = c->next_registered;
  if (c != NULL) c->refs++;
  pthread_mutex_unlock(&registry_mu);
  if (c == NULL)
    return ember__set_error(EMBER_ENOTFOUND, "no communicator %llu in this process (closed: "
                            "the node's main_fun returned, or the collective was closed)",
                            (unsigned long long)id);
  *out = c;
  return EMBER_OK;
}

static void comm_release(ember_comm *c) {
  pthread_mutex_lock(&registry_mu);
  if (--c->refs == 0) pthread_cond_broadcast(&c->idle);
  pthread_mutex_unlock(&registry_mu);
}

uint64_t ember_comm_id(const ember_comm *c) { return c ? c->id : 0; }

static const ember_comm_api api_table = {
    .abi = EMBER_COMM_ABI,
    .size = sizeof(ember_comm_api),
    .acquire = comm_acquire,
    .release = comm_release,
    .allreduce = ember_comm_allreduce,
    .rank = ember_comm_rank,
    .size_of = ember_comm_size,
    .last_error = ember_last_error,
};

const ember_comm_api *ember_comm_api_table(void) { return &api_table; }

void ember_comm_abort(ember_comm *c) {
  if (c == NULL) return;
  atomic_store(&c->abort_req, 1);
  if (c->inbox != NULL) ember__coll_bell(c->inbox);
  ember__coll_break_links(c);
}

uint32_t ember_comm_rank(const ember_comm *c) { return c ? c->rank : 0; }
uint32_t ember_comm_size(const ember_comm *c) { return c ? c->size : 0; }

int ember_comm_peer_is_shm(const ember_comm *c, uint32_t peer) {
  if (c == NULL || peer >= c->size || peer == c->rank) return 0;
  return c->peers[peer].shm;
}

void ember_comm_destroy(ember_comm *c) {
  if (c == NULL) return;
  if (c->id != 0) registry_remove(c);
  if (c->peers != NULL) {
    for (uint32_t j = 0; j < c->size; j++) {
      ember__coll_peer *p = &c->peers[j];
      ember_net_close(p->fd);
      ember_sec_destroy(p->sec);
      ember_shm_ring_destroy(p->in);
      ember_shm_ring_destroy(p->out);
      if (p->peer_ib != NULL) munmap(p->peer_ib, COLL_INBOX_LEN);
    }
  }
  if (c->inbox != NULL) munmap(c->inbox, COLL_INBOX_LEN);
  free(c->peers);
  free(c->tmp);
  pthread_mutex_destroy(&c->call_mu);
  pthread_cond_destroy(&c->idle);
  free(c);
}

int ember_comm_create(ember_comm **out, const ember_comm_config *cfg, int64_t timeout_ms) {
  ember_comm *c = NULL;
  int rc = EMBER_OK;
  int listen_fd = cfg != NULL ? cfg->listen_fd : -1;
  if (out == NULL || cfg == NULL) {
    ember_net_close(listen_fd);
    return ember__set_error(EMBER_EINVAL, "comm_create: out and cfg are required");
  }
  *out = NULL;
  int64_t deadline = timeout_ms < 0 ? INT64_MAX : ember_deadline_after(timeout_ms);
  if (cfg->size == 0 || cfg->size > EMBER_COMM_MAX_RANKS) {
    rc = ember__set_error(EMBER_EINVAL, "comm_create: size %u is not in 1..%u", cfg->size,
                          EMBER_COMM_MAX_RANKS);
    goto fail;
  }
  if (cfg->rank >= cfg->size) {
    rc = ember__set_error(EMBER_EINVAL, "comm_create: rank %u is not below size %u", cfg->rank,
                          cfg->size);
    goto fail;
  }
  if (cfg->addresses == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "comm_create: addresses is NULL");
    goto fail;
  }
  if (cfg->secret == NULL || cfg->secret_len < EMBER_SECRET_MIN_LEN) {
    rc = ember__set_error(EMBER_EINVAL, "comm_create: the job secret must have at least %u "
                          "bytes", (unsigned)EMBER_SECRET_MIN_LEN);
    goto fail;
  }
  c = calloc(1, sizeof *c);
  if (c == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "comm_create: out of memory");
    goto fail;
  }
  pthread_mutex_init(&c->call_mu, NULL);
  pthread_cond_init(&c->idle, NULL);
  c->rank = cfg->rank;
  c->size = cfg->size;
  c->small_max = cfg->small_max ? cfg->small_max : SMALL_MAX_DEFAULT;
  c->peers = calloc(c->size, sizeof *c->peers);
  c->tmp_cap = c->small_max > TCP_TMP_CAP ? c->small_max : TCP_TMP_CAP;
  c->tmp = malloc(c->tmp_cap);
  if (c->peers == NULL || c->tmp == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "comm_create: out of memory");
    goto fail;
  }
  for (uint32_t j = 0; j < c->size; j++) {
    ember__coll_peer *p = &c->peers[j];
    p->fd = -1;
    p->rank = j;
    rc = ember__coll_parse_address(cfg->addresses[j], j, p->host, sizeof p->host, &p->port);
    if (rc != EMBER_OK) goto fail;
    snprintf(p->desc, sizeof p->desc, "rank %u (%s)", j, cfg->addresses[j]);
  }
  /* Spinning only pays when every rank on this host can have a core; ranks
   * on other hosts (another address) do not compete for ours. */
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN), local = 0;
  for (uint32_t j = 0; j < c->size; j++)
    local += strcmp(c->peers[j].host, c->peers[c->rank].host) == 0;
  int oversubscribed = ncpu > 0 && local > ncpu;
  c->spin_us = oversubscribed ? 2 : 50;
  const char *spin = getenv("EMBER_COLL_SPIN_US"); /* tuning knob, microseconds */
  if (spin != NULL && spin[0] >= '0' && spin[0] <= '9') {
    long v = strtol(spin, NULL, 10);
    c->spin_us = v > 100000 ? 100000 : (int)v;
  }
  c->spin_cur_ns = (int64_t)c->spin_us * 1000;
  c->yield_us = oversubscribed ? 1000 : 0;
  c->tcp_yield_us = TCP_YIELD_US;
  const char *yield = getenv("EMBER_COLL_YIELD_US"); /* tuning knob, microseconds */
  if (yield != NULL && yield[0] >= '0' && yield[0] <= '9') {
    long v = strtol(yield, NULL, 10);
    c->yield_us = c->tcp_yield_us = v > 100000 ? 100000 : (int)v;
  }
  if ((cfg->flags & EMBER_COMM_RING) && (cfg->flags & EMBER_COMM_HALVING)) {
    rc = ember__set_error(EMBER_EINVAL, "comm_create: EMBER_COMM_RING and "
                          "EMBER_COMM_HALVING exclude each other");
    goto fail;
  }
  c->algo = (cfg->flags & EMBER_COMM_RING)      ? COLL_ALGO_RING
            : (cfg->flags & EMBER_COMM_HALVING) ? COLL_ALGO_HALVING
                                                : COLL_ALGO_AUTO;
  c->own_hosts = 1;
  for (uint32_t i = 0; i < c->size && c->own_hosts; i++)
    for (uint32_t j = i + 1; j < c->size; j++)
      if (strcmp(c->peers[i].host, c->peers[j].host) == 0) {
        c->own_hosts = 0;
        break;
      }

  if (c->size > 1) {
    rc = ember__coll_build_mesh(c, cfg, listen_fd, deadline);
    listen_fd = -1; /* taken over */
    if (rc != EMBER_OK) goto fail;
    rc = ember__coll_setup_shm(c, cfg->flags, deadline);
    if (rc != EMBER_OK) goto fail;
  }
  ember_net_close(listen_fd);
  registry_add(c);
  *out = c;
  return EMBER_OK;
fail:
  ember_net_close(listen_fd);
  ember_comm_destroy(c);
  return rc;
}
