/* shm_ring.c - SPSC ring of variable-size messages in a sealed memfd (see
 * shm_ring.h for the contract, the layout and the wake-up protocol).
 *
 * File order: the shared header; futex and liveness helpers; mapping
 * (create / attach); the wait loop both ends share; producer; consumer.
 *
 * Memory ordering: the producer writes a record, then publishes head with a
 * release store; the consumer reads head with an acquire load before it
 * reads the record.  Symmetrically the consumer publishes tail (release)
 * after it is done with a record's bytes and the producer reads tail
 * (acquire) before it overwrites them.  The "waiting" handshake uses
 * seq_cst fences on both sides (Dekker): either the publisher sees
 * waiting == 1 and wakes, or the sleeper's re-check after announcing itself
 * sees the new position and does not sleep.
 */
#include "ember/shm_ring.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "ember/auth.h"
#include "ember/error.h"
#include "ember/net.h"
#include "ember/wire.h"

#define RING_MAGIC 0x474E495252424D45ull /* "EMBRRING" */
#define RING_VERSION 1u
#define REC_HDR EMBER_SHM_RING_RECORD_HDR

enum { REC_DATA = 1, REC_END = 2, REC_ERROR = 3 };
enum { REC_F_MORE = 1 };
enum { ST_ABSENT = 0, ST_OPEN = 1, ST_CLOSED = 2 };

typedef struct {
  /* written once by the creator, before the descriptor is handed out */
  uint64_t magic;
  uint32_t version;
  uint32_t creator_role;
  uint64_t hdr_len;
  uint64_t cap;
  uint8_t token[32];
  /* producer -> consumer */
  _Alignas(64) _Atomic uint64_t head;
  _Atomic uint32_t data_seq;     /* futex word the consumer sleeps on */
  _Atomic uint32_t cons_waiting; /* the consumer may be asleep */
  /* consumer -> producer */
  _Alignas(64) _Atomic uint64_t tail;
  _Atomic uint32_t space_seq;    /* futex word the producer sleeps on */
  _Atomic uint32_t prod_waiting;
  /* ST_* of each end, indexed by ember_shm_role */
  _Alignas(64) _Atomic uint32_t state[2];
} ring_hdr;

_Static_assert(sizeof(ring_hdr) <= 4096, "ring header fits its page");
_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "the shared ring needs lock-free atomics");

struct ember_shm_ring {
  int fd;
  int role;
  uint8_t *base;   /* header page + data + the data's mirror */
  size_t map_len;
  size_t hdr_len;
  ring_hdr *h;
  uint8_t *data;
  uint64_t cap;
  uint8_t token[32];
  int64_t next_live_check;
  /* producer */
  uint64_t head;          /* our position (the shared one is only written) */
  size_t reserved;        /* payload bytes of the open reservation */
  int have_reservation;
  int finished;           /* END or ERROR written */
  /* consumer */
  uint64_t tail;
  int have_msg;           /* cur describes the message at tail */
  ember_shm_msg cur;
  uint64_t cur_done;      /* bytes of a split message already consumed */
  int final;              /* END or ERROR consumed: cur is sticky */
  /* consumer, stream calls: the record at tail, partly consumed */
  int stream_have;
  uint32_t stream_len, stream_off;
};

static const char *role_name(int role) {
  return role == EMBER_SHM_PRODUCER ? "producer" : "consumer";
}

static uint64_t align16(uint64_t v) { return (v + 15u) & ~(uint64_t)15u; }

static int64_t ring_deadline(int64_t timeout_ms) {
  return timeout_ms < 0 ? INT64_MAX : ember_deadline_after(timeout_ms);
}

/* ---------------------------------------------------------------- futex */

static void futex_wait(_Atomic uint32_t *w, uint32_t val, int64_t ms) {
  struct timespec ts = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000L};
  /* Not FUTEX_PRIVATE: the word is in a MAP_SHARED page of another process. */
  (void)syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *w) {
  (void)syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* After publishing a position: wakes the other end if it announced it sleeps. */
static void wake_if_waiting(_Atomic uint32_t *seq, _Atomic uint32_t *waiting) {
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(waiting, memory_order_relaxed)) {
    atomic_fetch_add_explicit(seq, 1, memory_order_relaxed);
    futex_wake_all(seq);
  }
}

/* ---------------------------------------------------------------- liveness */

/* Each end holds a write lock on byte `role` of the memfd through its own
 * open file description; the kernel drops it when that description is
 * closed, which process death does. */
static int lock_role(int fd, int role) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = role;
  fl.l_len = 1;
  return fcntl(fd, F_OFD_SETLK, &fl);
}

/* 1 if some open file description holds the peer's lock (or we cannot tell). */
static int peer_alive(const ember_shm_ring *r) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = 1 - r->role;
  fl.l_len = 1;
  if (fcntl(r->fd, F_OFD_GETLK, &fl) != 0) return 1;
  return fl.l_type != F_UNLCK;
}

/* ---------------------------------------------------------------- mapping */

/* Maps header + data, then the data pages again right after, so any
 * [pos, pos + len) with len <= cap is contiguous at data + pos % cap. */
static int map_ring(ember_shm_ring *r) {
  uint8_t *va;
  r->map_len = r->hdr_len + 2u * (size_t)r->cap;
  va = mmap(NULL, r->map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (va == MAP_FAILED) return ember__set_errno(EMBER_ESYS, errno, "shm ring: reserving %zu bytes of address space", r->map_len);
  if (mmap(va, r->hdr_len + (size_t)r->cap, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
           r->fd, 0) == MAP_FAILED ||
      mmap(va + r->hdr_len + r->cap, (size_t)r->cap, PROT_READ | PROT_WRITE,
           MAP_SHARED | MAP_FIXED, r->fd, (off_t)r->hdr_len) == MAP_FAILED) {
    int err = errno;
    munmap(va, r->map_len);
    return ember__set_errno(EMBER_ESYS, err, "shm ring: mapping the %llu-byte segment",
                            (unsigned long long)(r->hdr_len + r->cap));
  }
  r->base = va;
  r->h = (ring_hdr *)va;
  r->data = va + r->hdr_len;
  return EMBER_OK;
}

static size_t page_size(void) {
  long p = sysconf(_SC_PAGESIZE);
  return p >= 4096 ? (size_t)p : 4096u;
}

void ember_shm_ring_destroy(ember_shm_ring *r) {
  if (r == NULL) return;
  if (r->h) ember_shm_ring_close(r);
  if (r->base) munmap(r->base, r->map_len);
  if (r->fd >= 0) close(r->fd);
  free(r);
}

int ember_shm_ring_create(ember_shm_ring **out, size_t capacity, ember_shm_role role) {
  ember_shm_ring *r = NULL;
  size_t pg = page_size();
  int rc = EMBER_OK;
  if (out == NULL) return ember__set_error(EMBER_EINVAL, "shm ring create: out is NULL");
  *out = NULL;
  if (role != EMBER_SHM_PRODUCER && role != EMBER_SHM_CONSUMER)
    return ember__set_error(EMBER_EINVAL, "shm ring create: unknown role %d", (int)role);
  if (capacity < EMBER_SHM_RING_MIN_BYTES || capacity > EMBER_SHM_RING_MAX_BYTES)
    return ember__set_error(EMBER_EINVAL, "shm ring create: capacity %zu is outside %u..%u bytes",
                            capacity, EMBER_SHM_RING_MIN_BYTES, EMBER_SHM_RING_MAX_BYTES);
  r = calloc(1, sizeof *r);
  if (r == NULL) return ember__set_error(EMBER_ENOMEM, "shm ring create: out of memory");
  r->fd = -1;
  r->role = role;
  r->hdr_len = pg;
  r->cap = ((uint64_t)capacity + pg - 1u) / pg * pg;
  r->fd = memfd_create("ember-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (r->fd < 0) {
    rc = ember__set_errno(EMBER_ESYS, errno, "shm ring: memfd_create");
    goto cleanup;
  }
  /* memfds start out 0777; the segment is the job's data: owner only. */
  if (fchmod(r->fd, 0600) != 0 || ftruncate(r->fd, (off_t)(r->hdr_len + r->cap)) != 0 ||
      fcntl(r->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    rc = ember__set_errno(EMBER_ESYS, errno, "shm ring: preparing the %llu-byte memfd",
                          (unsigned long long)(r->hdr_len + r->cap));
    goto cleanup;
  }
  if (lock_role(r->fd, role) != 0) {
    rc = ember__set_errno(EMBER_ESYS, errno, "shm ring: locking the %s byte", role_name(role));
    goto cleanup;
  }
  rc = ember_auth_random(r->token, sizeof r->token);
  if (rc != EMBER_OK) goto cleanup;
  rc = map_ring(r);
  if (rc != EMBER_OK) goto cleanup;
  r->h->magic = RING_MAGIC;
  r->h->version = RING_VERSION;
  r->h->creator_role = (uint32_t)role;
  r->h->hdr_len = r->hdr_len;
  r->h->cap = r->cap;
  memcpy(r->h->token, r->token, sizeof r->token);
  atomic_store_explicit(&r->h->state[role], ST_OPEN, memory_order_release);
  *out = r;
  r = NULL;
cleanup:
  ember_shm_ring_destroy(r);
  return rc;
}

void ember_shm_ring_describe(const ember_shm_ring *r, ember_shm_ring_desc *out) {
  if (r == NULL || out == NULL) return;
  memset(out, 0, sizeof *out);
  out->pid = (int32_t)getpid();
  out->fd = r->fd;
  out->size = r->hdr_len + r->cap;
  memcpy(out->token, r->token, sizeof out->token);
}

void ember_shm_ring_desc_encode(const ember_shm_ring_desc *d,
                                uint8_t out[EMBER_SHM_RING_DESC_WIRE_LEN]) {
  ember_wire_put_u32(out, (uint32_t)d->pid);
  ember_wire_put_u32(out + 4, (uint32_t)d->fd);
  ember_wire_put_u64(out + 8, d->size);
  memcpy(out + 16, d->token, sizeof d->token);
}

void ember_shm_ring_desc_decode(const uint8_t in[EMBER_SHM_RING_DESC_WIRE_LEN],
                                ember_shm_ring_desc *d) {
  d->pid = (int32_t)ember_wire_get_u32(in);
  d->fd = (int32_t)ember_wire_get_u32(in + 4);
  d->size = ember_wire_get_u64(in + 8);
  memcpy(d->token, in + 16, sizeof d->token);
}

int ember_shm_ring_attach(ember_shm_ring **out, const ember_shm_ring_desc *d,
                          ember_shm_role role) {
  ember_shm_ring *r = NULL;
  char path[64];
  struct stat st;
  size_t pg = page_size();
  int rc = EMBER_OK, seals;
  if (out == NULL || d == NULL) return ember__set_error(EMBER_EINVAL, "shm ring attach: NULL argument");
  *out = NULL;
  if (role != EMBER_SHM_PRODUCER && role != EMBER_SHM_CONSUMER)
    return ember__set_error(EMBER_EINVAL, "shm ring attach: unknown role %d", (int)role);
  if (d->pid <= 0 || d->fd < 0 || d->size < pg + EMBER_SHM_RING_MIN_BYTES ||
      d->size > (uint64_t)pg + EMBER_SHM_RING_MAX_BYTES || d->size % pg != 0)
    return ember__set_error(EMBER_EINVAL, "shm ring attach: invalid descriptor (pid %d, fd %d, "
                            "%llu bytes)", (int)d->pid, (int)d->fd,
                            (unsigned long long)d->size);
  r = calloc(1, sizeof *r);
  if (r == NULL) return ember__set_error(EMBER_ENOMEM, "shm ring attach: out of memory");
  r->role = role;
  r->hdr_len = pg;
  r->cap = d->size - pg;
  memcpy(r->token, d->token, sizeof r->token);
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)d->pid, (int)d->fd);
  r->fd = open(path, O_RDWR | O_CLOEXEC);
  if (r->fd < 0) {
    rc = ember__set_errno(EMBER_ENOTFOUND, errno, "shm ring: cannot open %s", path);
    goto cleanup;
  }
  seals = fcntl(r->fd, F_GET_SEALS);
  if (fstat(r->fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      (st.st_mode & 07777) != 0600 || (uint64_t)st.st_size != d->size || seals < 0 ||
      (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    rc = ember__set_error(EMBER_ENOTFOUND, "shm ring: %s is not the described segment (a "
                          "sealed 0600 memfd of %llu bytes owned by uid %u)", path,
                          (unsigned long long)d->size, (unsigned)geteuid());
    goto cleanup;
  }
  rc = map_ring(r);
  if (rc != EMBER_OK) goto cleanup;
  if (r->h->magic != RING_MAGIC || r->h->version != RING_VERSION || r->h->hdr_len != pg ||
      r->h->cap != r->cap || memcmp(r->h->token, d->token, sizeof d->token) != 0) {
    rc = ember__set_error(EMBER_ENOTFOUND, "shm ring: %s is not the described segment "
                          "(magic, version, size or token differ)", path);
    goto cleanup;
  }
  if (r->h->creator_role == (uint32_t)role) {
    rc = ember__set_error(EMBER_EINVAL, "shm ring attach: the creator is already the %s",
                          role_name(role));
    goto cleanup;
  }
  if (lock_role(r->fd, role) != 0) {
    rc = errno == EAGAIN || errno == EACCES
             ? ember__set_error(EMBER_ESTATE, "shm ring: it already has a %s", role_name(role))
             : ember__set_errno(EMBER_ESYS, errno, "shm ring: locking the %s byte",
                                role_name(role));
    goto cleanup;
  }
  /* Whatever the creator already did (a producer may be ahead of us). */
  if (role == EMBER_SHM_PRODUCER)
    r->head = atomic_load_explicit(&r->h->head, memory_order_acquire);
  else
    r->tail = atomic_load_explicit(&r->h->tail, memory_order_acquire);
  atomic_store_explicit(&r->h->state[role], ST_OPEN, memory_order_release);
  /* The creator may be asleep waiting for us. */
  atomic_fetch_add(&r->h->data_seq, 1);
  futex_wake_all(&r->h->data_seq);
  atomic_fetch_add(&r->h->space_seq, 1);
  futex_wake_all(&r->h->space_seq);
  *out = r;
  r = NULL;
cleanup:
  if (r) {
    /* Not attached: leave the creator's state alone. */
    if (r->base) munmap(r->base, r->map_len);
    if (r->fd >= 0) close(r->fd);
    free(r);
  }
  return rc;
}

size_t ember_shm_ring_capacity(const ember_shm_ring *r) { return r ? (size_t)r->cap : 0; }
size_t ember_shm_ring_max_record(const ember_shm_ring *r) {
  return r ? (size_t)r->cap - REC_HDR : 0;
}
int ember_shm_ring_fd(const ember_shm_ring *r) { return r ? r->fd : -1; }

int ember_shm_ring_attached(const ember_shm_ring *r) {
  return r != NULL &&
         atomic_load_explicit(&r->h->state[1 - r->role], memory_order_acquire) != ST_ABSENT;
}

void ember_shm_ring_close(ember_shm_ring *r) {
  if (r == NULL || r->h == NULL) return;
  atomic_store_explicit(&r->h->state[r->role], ST_CLOSED, memory_order_seq_cst);
  /* Both words: the peer's sleeper and a thread of ours blocked in a wait. */
  atomic_fetch_add(&r->h->data_seq, 1);
  atomic_fetch_add(&r->h->space_seq, 1);
  futex_wake_all(&r->h->data_seq);
  futex_wake_all(&r->h->space_seq);
}

void *ember__shm_ring_raw(ember_shm_ring *r, size_t *len) {
  if (r == NULL) return NULL;
  if (len) *len = r->hdr_len + (size_t)r->cap;
  return r->base;
}

/* ---------------------------------------------------------------- waiting */

/* Producer: 1 if `need` bytes are free.  Consumer: 1 if a record is there.
 * 0 if not yet; EMBER_ECORRUPT if the peer's position is impossible. */
static int ring_ready(ember_shm_ring *r, uint64_t need) {
  if (r->role == EMBER_SHM_PRODUCER) {
    uint64_t tail = atomic_load_explicit(&r->h->tail, memory_order_acquire);
    if (tail > r->head || r->head - tail > r->cap)
      return ember__set_error(EMBER_ECORRUPT, "shm ring: the consumer's position %llu is "
                              "inconsistent with the producer's %llu (capacity %llu)",
                              (unsigned long long)tail, (unsigned long long)r->head,
                              (unsigned long long)r->cap);
    return r->cap - (r->head - tail) >= need;
  } else {
    uint64_t head = atomic_load_explicit(&r->h->head, memory_order_acquire);
    if (head < r->tail || head - r->tail > r->cap || (head - r->tail) % 16u != 0)
      return ember__set_error(EMBER_ECORRUPT, "shm ring: the producer's position %llu is "
                              "inconsistent with the consumer's %llu (capacity %llu)",
                              (unsigned long long)head, (unsigned long long)r->tail,
                              (unsigned long long)r->cap);
    return head - r->tail >= need;
  }
}

/* Waits until ring_ready(r, need), the deadline, or a reason to give up.
 * `what` names the operation for messages. */
static int ring_wait(ember_shm_ring *r, uint64_t need, int64_t deadline, const char *what) {
  int producer = r->role == EMBER_SHM_PRODUCER;
  _Atomic uint32_t *seq = producer ? &r->h->space_seq : &r->h->data_seq;
  _Atomic uint32_t *waiting = producer ? &r->h->prod_waiting : &r->h->cons_waiting;
  int peer = 1 - r->role;
  for (;;) {
    uint32_t s, peer_st;
    int64_t now, ms;
    int rc = ring_ready(r, need);
    if (rc != 0) return rc > 0 ? EMBER_OK : rc;
    if (atomic_load_explicit(&r->h->state[r->role], memory_order_acquire) == ST_CLOSED)
      return ember__set_error(EMBER_ECLOSED, "shm ring %s: this %s end was closed", what,
                              role_name(r->role));
    peer_st = atomic_load_explicit(&r->h->state[peer], memory_order_acquire);
    if (peer_st == ST_CLOSED) {
      /* Positions are published before the state: look once more. */
      rc = ring_ready(r, need);
      if (rc != 0) return rc > 0 ? EMBER_OK : rc;
      return ember__set_error(EMBER_ECLOSED, "shm ring %s: the %s closed the ring", what,
                              role_name(peer));
    }
    now = ember_now_ms();
    if (peer_st == ST_OPEN && now >= r->next_live_check) {
      if (!peer_alive(r)) {
        rc = ring_ready(r, need);
        if (rc != 0) return rc > 0 ? EMBER_OK : rc;
        return ember__set_error(EMBER_ECLOSED, "shm ring %s: the %s process is gone", what,
                                role_name(peer));
      }
      r->next_live_check = now + EMBER_SHM_RING_SLICE_MS;
    }
    if (now >= deadline)
      return ember__set_error(EMBER_ETIMEDOUT, "shm ring %s: %s", what,
                              producer ? "no room in the ring before the deadline (the "
                                         "consumer is not keeping up)"
                                       : "no message before the deadline");
    s = atomic_load_explicit(seq, memory_order_relaxed);
    atomic_store_explicit(waiting, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    rc = ring_ready(r, need);
    if (rc != 0 ||
        atomic_load_explicit(&r->h->state[r->role], memory_order_relaxed) == ST_CLOSED ||
        atomic_load_explicit(&r->h->state[peer], memory_order_relaxed) != peer_st) {
      atomic_store_explicit(waiting, 0, memory_order_relaxed);
      continue;
    }
    ms = deadline - now;
    if (ms > EMBER_SHM_RING_SLICE_MS) ms = EMBER_SHM_RING_SLICE_MS;
    if (peer_st == ST_OPEN && r->next_live_check - now < ms) ms = r->next_live_check - now;
    if (ms < 1) ms = 1;
    futex_wait(seq, s, ms);
    atomic_store_explicit(waiting, 0, memory_order_relaxed);
  }
}

/* ---------------------------------------------------------------- producer */

static int producer_usable(ember_shm_ring *r, const char *what) {
  if (r == NULL) return ember__set_error(EMBER_EINVAL, "shm ring %s: NULL ring", what);
  if (r->role != EMBER_SHM_PRODUCER)
    return ember__set_error(EMBER_ESTATE, "shm ring %s: this is the consumer end", what);
  if (r->finished)
    return ember__set_error(EMBER_ESTATE, "shm ring %s: the producer already ended", what);
  if (atomic_load_explicit(&r->h->state[EMBER_SHM_CONSUMER], memory_order_acquire) == ST_CLOSED)
    return ember__set_error(EMBER_ECLOSED, "shm ring %s: the consumer closed the ring", what);
  return EMBER_OK;
}

static void put_header(ember_shm_ring *r, uint32_t len, uint16_t type, uint16_t flags,
                       uint64_t total) {
  uint8_t *p = r->data + r->head % r->cap;
  memcpy(p, &len, 4);
  memcpy(p + 4, &type, 2);
  memcpy(p + 6, &flags, 2);
  memcpy(p + 8, &total, 8);
}

static void publish(ember_shm_ring *r, uint64_t len) {
  r->head += align16(REC_HDR + len);
  atomic_store_explicit(&r->h->head, r->head, memory_order_release);
  wake_if_waiting(&r->h->data_seq, &r->h->cons_waiting);
}

/* Waits for room for one record of len payload bytes. */
static int reserve_record(ember_shm_ring *r, size_t len, int64_t deadline, const char *what) {
  if (len > ember_shm_ring_max_record(r))
    return ember__set_error(EMBER_ETOOBIG, "shm ring %s: a message of %zu bytes does not fit "
                            "one record of this %llu-byte ring (at most %zu bytes; "
                            "ember_shm_ring_send splits larger messages)",
                            what, len, (unsigned long long)r->cap, ember_shm_ring_max_record(r));
  return ring_wait(r, align16(REC_HDR + (uint64_t)len), deadline, what);
}

int ember_shm_ring_reserve(ember_shm_ring *r, size_t len, void **out, int64_t timeout_ms) {
  int rc = producer_usable(r, "reserve");
  if (rc == EMBER_OK && out == NULL) rc = ember__set_error(EMBER_EINVAL, "shm ring reserve: out is NULL");
  if (rc != EMBER_OK) return rc;
  *out = NULL;
  r->have_reservation = 0;
  rc = reserve_record(r, len, ring_deadline(timeout_ms), "reserve");
  if (rc != EMBER_OK) return rc;
  r->reserved = len;
  r->have_reservation = 1;
  *out = r->data + r->head % r->cap + REC_HDR;
  return EMBER_OK;
}

int ember_shm_ring_commit(ember_shm_ring *r, size_t len) {
  int rc = producer_usable(r, "commit");
  if (rc != EMBER_OK) return rc;
  if (!r->have_reservation)
    return ember__set_error(EMBER_ESTATE, "shm ring commit: nothing reserved");
  if (len > r->reserved)
    return ember__set_error(EMBER_EINVAL, "shm ring commit: %zu bytes, only %zu reserved", len,
                            r->reserved);
  put_header(r, (uint32_t)len, REC_DATA, 0, len);
  r->have_reservation = 0;
  publish(r, len);
  return EMBER_OK;
}

int ember_shm_ring_sendv(ember_shm_ring *r, const struct iovec *iov, int iovcnt,
                         int64_t timeout_ms) {
  int64_t deadline = ring_deadline(timeout_ms);
  uint64_t total = 0, left;
  size_t frag_max, vi = 0, voff = 0;
  int rc = producer_usable(r, "send");
  if (rc != EMBER_OK) return rc;
  if (iovcnt < 0 || (iovcnt > 0 && iov == NULL))
    return ember__set_error(EMBER_EINVAL, "shm ring send: bad iovec (%d entries)", iovcnt);
  for (int i = 0; i < iovcnt; i++) {
    if (iov[i].iov_len > 0 && iov[i].iov_base == NULL)
      return ember__set_error(EMBER_EINVAL, "shm ring send: iovec %d is NULL", i);
    if (__builtin_add_overflow(total, (uint64_t)iov[i].iov_len, &total))
      return ember__set_error(EMBER_ETOOBIG, "shm ring send: message size overflows");
  }
  r->have_reservation = 0;
  /* Records of at most half the ring, so the producer fills one half while
   * the consumer drains the other; larger messages become fragments. */
  frag_max = (size_t)(r->cap / 2u) - REC_HDR;
  left = total;
  do {
    size_t n = left > frag_max ? frag_max : (size_t)left, done = 0;
    uint8_t *dst;
    rc = reserve_record(r, n, deadline, "send");
    if (rc != EMBER_OK) return rc;
    dst = r->data + r->head % r->cap + REC_HDR;
    while (done < n) {
      size_t take = iov[vi].iov_len - voff;
      if (take > n - done) take = n - done;
      if (take) memcpy(dst + done, (const uint8_t *)iov[vi].iov_base + voff, take);
      done += take;
      voff += take;
      if (voff == iov[vi].iov_len) {
        vi++;
        voff = 0;
      }
    }
    left -= n;
    put_header(r, (uint32_t)n, REC_DATA, left ? REC_F_MORE : 0, total);
    publish(r, n);
  } while (left > 0);
  return EMBER_OK;
}

int ember_shm_ring_send(ember_shm_ring *r, const void *buf, size_t len, int64_t timeout_ms) {
  struct iovec v = {(void *)(uintptr_t)buf, len};
  return ember_shm_ring_sendv(r, &v, 1, timeout_ms);
}

static int put_marker(ember_shm_ring *r, uint16_t type, const void *p, size_t len,
                      int64_t timeout_ms, const char *what) {
  int rc = producer_usable(r, what);
  if (rc != EMBER_OK) return rc;
  r->have_reservation = 0;
  rc = reserve_record(r, len, ring_deadline(timeout_ms), what);
  if (rc != EMBER_OK) return rc;
  if (len) memcpy(r->data + r->head % r->cap + REC_HDR, p, len);
  put_header(r, (uint32_t)len, type, 0, len);
  r->finished = 1;
  publish(r, len);
  return EMBER_OK;
}

int ember_shm_ring_end(ember_shm_ring *r, int64_t timeout_ms) {
  return put_marker(r, REC_END, NULL, 0, timeout_ms, "end");
}

int ember_shm_ring_fail(ember_shm_ring *r, int code, const char *reason, int64_t timeout_ms) {
  uint8_t buf[4 + EMBER_SHM_RING_REASON_MAX];
  size_t n = reason ? strlen(reason) : 0;
  int32_t c = code;
  if (n > EMBER_SHM_RING_REASON_MAX) n = EMBER_SHM_RING_REASON_MAX;
  memcpy(buf, &c, 4);
  if (n) memcpy(buf + 4, reason, n);
  return put_marker(r, REC_ERROR, buf, 4 + n, timeout_ms, "fail");
}

/* ---------------------------------------------------------------- consumer */

typedef struct {
  uint32_t len;
  uint16_t type, flags;
  uint64_t total;
} rec_hdr;

/* Reads and bounds the record header at tail (a record is there). */
static int read_record(ember_shm_ring *r, rec_hdr *rh) {
  const uint8_t *p = r->data + r->tail % r->cap;
  uint64_t head = atomic_load_explicit(&r->h->head, memory_order_acquire), avail;
  /* ring_ready bounded head already, but a hostile producer may have moved
   * it since: bound it again, then copy the header once (the shared bytes
   * could change after we check them). */
  if (head < r->tail || head - r->tail > r->cap)
    return ember__set_error(EMBER_ECORRUPT, "shm ring: the producer's position %llu is "
                            "inconsistent with the consumer's %llu", (unsigned long long)head,
                            (unsigned long long)r->tail);
  avail = head - r->tail;
  memcpy(&rh->len, p, 4);
  memcpy(&rh->type, p + 4, 2);
  memcpy(&rh->flags, p + 6, 2);
  memcpy(&rh->total, p + 8, 8);
  if ((uint64_t)rh->len > avail || align16(REC_HDR + (uint64_t)rh->len) > avail)
    return ember__set_error(EMBER_ECORRUPT, "shm ring: record at position %llu claims %u bytes, "
                            "only %llu are published", (unsigned long long)r->tail, rh->len,
                            (unsigned long long)avail);
  if ((rh->flags & ~(uint16_t)REC_F_MORE) != 0 || (rh->type != REC_DATA && rh->flags != 0))
    return ember__set_error(EMBER_ECORRUPT, "shm ring: record at position %llu has flags 0x%x",
                            (unsigned long long)r->tail, rh->flags);
  switch (rh->type) {
    case REC_DATA:
      if (rh->total < rh->len || (!(rh->flags & REC_F_MORE) && r->cur_done == 0 &&
                                  rh->total != rh->len))
        return ember__set_error(EMBER_ECORRUPT, "shm ring: record at position %llu: %u bytes "
                                "of a %llu-byte message", (unsigned long long)r->tail, rh->len,
                                (unsigned long long)rh->total);
      return EMBER_OK;
    case REC_END:
      if (rh->len != 0) break;
      return EMBER_OK;
    case REC_ERROR:
      if (rh->len < 4 || rh->len > 4 + EMBER_SHM_RING_REASON_MAX) break;
      return EMBER_OK;
    default:
      return ember__set_error(EMBER_ECORRUPT, "shm ring: record at position %llu has unknown "
                              "type %u", (unsigned long long)r->tail, rh->type);
  }
  return ember__set_error(EMBER_ECORRUPT, "shm ring: %s record at position %llu has %u bytes",
                          rh->type == REC_END ? "END" : "ERROR", (unsigned long long)r->tail,
                          rh->len);
}

static void release_record(ember_shm_ring *r, uint32_t len) {
  r->tail += align16(REC_HDR + (uint64_t)len);
  atomic_store_explicit(&r->h->tail, r->tail, memory_order_release);
  wake_if_waiting(&r->h->space_seq, &r->h->prod_waiting);
}

static int consumer_usable(ember_shm_ring *r, const char *what) {
  if (r == NULL) return ember__set_error(EMBER_EINVAL, "shm ring %s: NULL ring", what);
  if (r->role != EMBER_SHM_CONSUMER)
    return ember__set_error(EMBER_ESTATE, "shm ring %s: this is the producer end", what);
  return EMBER_OK;
}

int ember_shm_ring_next(ember_shm_ring *r, ember_shm_msg *m, size_t max_message,
                        int64_t timeout_ms) {
  rec_hdr rh;
  int rc = consumer_usable(r, "next");
  if (rc == EMBER_OK && m == NULL) rc = ember__set_error(EMBER_EINVAL, "shm ring next: m is NULL");
  if (rc != EMBER_OK) return rc;
  if (r->have_msg || r->final) {
    *m = r->cur;
    return EMBER_OK;
  }
  rc = ring_wait(r, REC_HDR, ring_deadline(timeout_ms), "next");
  if (rc != EMBER_OK) return rc;
  rc = read_record(r, &rh);
  if (rc != EMBER_OK) return rc;
  memset(&r->cur, 0, sizeof r->cur);
  r->cur.kind = rh.type;
  if (rh.type == REC_DATA) {
    if ((max_message && rh.total > max_message) || (uint64_t)(size_t)rh.total != rh.total)
      return ember__set_error(EMBER_ETOOBIG, "shm ring: a message of %llu bytes exceeds the "
                              "consumer's limit of %zu bytes", (unsigned long long)rh.total,
                              max_message ? max_message : SIZE_MAX);
    r->cur.len = (size_t)rh.total;
    r->cur.data = (rh.flags & REC_F_MORE) ? NULL : r->data + r->tail % r->cap + REC_HDR;
    r->cur_done = 0;
    r->have_msg = 1;
  } else {
    if (rh.type == REC_ERROR) {
      const uint8_t *p = r->data + r->tail % r->cap + REC_HDR;
      int32_t code;
      memcpy(&code, p, 4);
      r->cur.code = code;
      memcpy(r->cur.reason, p + 4, rh.len - 4);
      r->cur.reason[rh.len - 4] = '\0';
      for (size_t i = 0; i < rh.len - 4u; i++) /* keep messages printable */
        if ((unsigned char)r->cur.reason[i] < 0x20 || r->cur.reason[i] == 0x7f)
          r->cur.reason[i] = '?';
    }
    release_record(r, rh.len);
    r->final = 1;
  }
  *m = r->cur;
  return EMBER_OK;
}

/* Consumes the current DATA message; copies it to buf when copy is set. */
static int consume_message(ember_shm_ring *r, uint8_t *buf, size_t cap, int copy,
                           int64_t timeout_ms, const char *what) {
  int64_t deadline = ring_deadline(timeout_ms);
  int rc = consumer_usable(r, what);
  if (rc != EMBER_OK) return rc;
  if (!r->have_msg || r->cur.kind != EMBER_SHM_MSG_DATA)
    return ember__set_error(EMBER_ESTATE, "shm ring %s: no data message is current (call "
                            "ember_shm_ring_next first)", what);
  if (copy && buf == NULL && r->cur.len > 0)
    return ember__set_error(EMBER_EINVAL, "shm ring %s: buf is NULL", what);
  if (copy && cap < r->cur.len)
    return ember__set_error(EMBER_ETOOBIG, "shm ring %s: the message has %zu bytes, the buffer "
                            "%zu", what, r->cur.len, cap);
  for (;;) {
    rec_hdr rh;
    rc = ring_wait(r, REC_HDR, deadline, what);
    if (rc != EMBER_OK) return rc;
    rc = read_record(r, &rh);
    if (rc != EMBER_OK) return rc;
    if (rh.type != REC_DATA || rh.total != r->cur.len || rh.len > r->cur.len - r->cur_done ||
        (!(rh.flags & REC_F_MORE) && r->cur_done + rh.len != r->cur.len) ||
        ((rh.flags & REC_F_MORE) && r->cur_done + rh.len == r->cur.len))
      return ember__set_error(EMBER_ECORRUPT, "shm ring: record at position %llu (type %u, %u "
                              "bytes of %llu) does not continue a %zu-byte message at byte "
                              "%llu", (unsigned long long)r->tail, rh.type, rh.len,
                              (unsigned long long)rh.total, r->cur.len,
                              (unsigned long long)r->cur_done);
    if (copy && rh.len)
      memcpy(buf + r->cur_done, r->data + r->tail % r->cap + REC_HDR, rh.len);
    r->cur_done += rh.len;
    release_record(r, rh.len);
    if (!(rh.flags & REC_F_MORE)) break;
  }
  r->have_msg = 0;
  r->cur_done = 0;
  return EMBER_OK;
}

int ember_shm_ring_read(ember_shm_ring *r, void *buf, size_t cap, int64_t timeout_ms) {
  return consume_message(r, buf, cap, 1, timeout_ms, "read");
}

int ember_shm_ring_release(ember_shm_ring *r, int64_t timeout_ms) {
  return consume_message(r, NULL, 0, 0, timeout_ms, "release");
}

/* ---------------------------------------------------------------- stream */

int ember_shm_ring_try_reserve(ember_shm_ring *r, size_t max, void **out, size_t *room) {
  int rc = producer_usable(r, "try_reserve");
  if (rc == EMBER_OK && (out == NULL || room == NULL))
    rc = ember__set_error(EMBER_EINVAL, "shm ring try_reserve: out and room are required");
  if (rc != EMBER_OK) return rc;
  *out = NULL;
  *room = 0;
  r->have_reservation = 0;
  uint64_t tail = atomic_load_explicit(&r->h->tail, memory_order_acquire);
  if (tail > r->head || r->head - tail > r->cap)
    return ring_ready(r, 0); /* names the impossible position */
  /* A record of len bytes takes align16(16 + len): len <= free - 16 once
   * free is cut to the 16-byte grain. */
  uint64_t free_bytes = (r->cap - (r->head - tail)) & ~(uint64_t)15u;
  if (free_bytes < 2u * REC_HDR || max == 0) return EMBER_OK;
  uint64_t n = free_bytes - REC_HDR;
  if (n > max) n = max;
  r->reserved = (size_t)n;
  r->have_reservation = 1;
  *out = r->data + r->head % r->cap + REC_HDR;
  *room = (size_t)n;
  return EMBER_OK;
}

int ember_shm_ring_peek(ember_shm_ring *r, const void **data, size_t *len) {
  int rc = consumer_usable(r, "peek");
  if (rc == EMBER_OK && (data == NULL || len == NULL))
    rc = ember__set_error(EMBER_EINVAL, "shm ring peek: data and len are required");
  if (rc != EMBER_OK) return rc;
  *data = NULL;
  *len = 0;
  while (!r->stream_have) {
    rec_hdr rh;
    if (atomic_load_explicit(&r->h->head, memory_order_acquire) == r->tail) return EMBER_OK;
    rc = ring_ready(r, REC_HDR);
    if (rc <= 0) return rc;
    rc = read_record(r, &rh);
    if (rc != EMBER_OK) return rc;
    if (rh.type == REC_END)
      return ember__set_error(EMBER_ECLOSED, "shm ring: the producer ended the stream");
    if (rh.type == REC_ERROR) {
      ember_shm_msg m;
      rc = ember_shm_ring_next(r, &m, 0, 0);
      if (rc != EMBER_OK) return rc;
      return ember__set_error(m.code < 0 ? m.code : EMBER_EIO, "shm ring: the producer "
                              "failed: %s", m.reason);
    }
    if (rh.len == 0) {
      release_record(r, 0);
      continue;
    }
    r->stream_have = 1;
    r->stream_len = rh.len;
    r->stream_off = 0;
  }
  *data = r->data + r->tail % r->cap + REC_HDR + r->stream_off;
  *len = r->stream_len - r->stream_off;
  return EMBER_OK;
}

int ember_shm_ring_consume(ember_shm_ring *r, size_t n) {
  int rc = consumer_usable(r, "consume");
  if (rc != EMBER_OK) return rc;
  if (n == 0) return EMBER_OK;
  if (!r->stream_have || n > (size_t)(r->stream_len - r->stream_off))
    return ember__set_error(EMBER_EINVAL, "shm ring consume: %zu bytes, but peek gave %u",
                            n, r->stream_have ? r->stream_len - r->stream_off : 0u);
  r->stream_off += (uint32_t)n;
  if (r->stream_off == r->stream_len) {
    release_record(r, r->stream_len);
    r->stream_have = 0;
  }
  return EMBER_OK;
}

uint64_t ember_shm_ring_peer_position(const ember_shm_ring *r) {
  if (r == NULL) return 0;
  return atomic_load_explicit(r->role == EMBER_SHM_PRODUCER ? &r->h->tail : &r->h->head,
                              memory_order_acquire);
}
