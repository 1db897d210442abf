/* ps_link.h - internal: the byte transport of one parameter-server
 * connection, through which the worker's side (ps_client.c) and the
 * shard's side (ps_server.c) do all their request and reply I/O.
 *
 * A link starts on its authenticated socket (ember_sec_*: plain, or
 * encrypted records).  A worker and a shard on one host then move it to
 * shared memory (ps.h, "Transport"): two shm rings that the worker
 * creates, the request ring (worker -> shard) and the reply ring (shard ->
 * worker), offered in PS_SHM.  The rings carry exactly the bytes the socket
 * would, as a stream:
 *   - sending cuts the bytes into records of 128 KiB at most (a quarter of
 *     a smaller ring), gathered straight from the caller's iovecs into ring
 *     memory (a whole dense push leaves from where its floats lie); small
 *     records, so that the consumer copies one out, still in cache, while
 *     the producer fills the next (ps_link.c has the measurements);
 *   - receiving copies exactly the bytes asked for, across record
 *     boundaries, straight into the caller's buffer (a 40 MB pull lands in
 *     the caller's array), and releases each record once its last byte is
 *     copied out.  Bytes are always copied out of the ring before anyone
 *     looks at them: a hostile producer can rewrite a record it published,
 *     never what we already copied.  A record that breaks the ring's format,
 *     or one split into fragments (a link never writes one), is
 *     EMBER_ECORRUPT.
 * The socket stays open, idle: a peer that dies is seen through the rings'
 * liveness locks (EMBER_ECLOSED), one that closes its end at once.
 *
 * Deadlines are absolute (ember_now_ms clock); INT64_MAX: none.
 * Thread-safety: one thread drives a link at a time; ember__ps_link_shutdown
 * may be called from any thread until ember__ps_link_destroy. */
#ifndef EMBER_PS_LINK_H
#define EMBER_PS_LINK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "ember/secure.h"
#include "ember/shm_ring.h"

#define EMBER__PS_SHM_DEFAULT_BYTES (8u * 1024u * 1024u)
/* PS_SHM: host id, the request ring's descriptor, the reply ring's */
#define EMBER__PS_SHM_LEN (16u + 2u * EMBER_SHM_RING_DESC_WIRE_LEN)

typedef struct {
  int fd;
  ember_sec *sec;          /* NULL: plain TCP */
  ember_shm_ring *tx, *rx; /* both set once on shared memory, else NULL */
  ember_shm_msg cur;       /* rx: the record being read, when cur_have */
  size_t cur_off;          /* its bytes already copied out */
  int cur_have;
} ember__ps_link;

/* A link on the socket fd (and sec); takes ownership of both. */
void ember__ps_link_init(ember__ps_link *l, int fd, ember_sec *sec);

/* 1 when the link goes through shared memory. */
int ember__ps_link_is_shm(const ember__ps_link *l);

/* Moves the link to the rings (tx: this side produces, rx: consumes); takes
 * ownership.  Call between a request and the next: nothing may be in flight. */
void ember__ps_link_use_rings(ember__ps_link *l, ember_shm_ring *tx, ember_shm_ring *rx);

/* Sends every byte of iov (which the TCP path may modify) before deadline. */
int ember__ps_link_sendv(ember__ps_link *l, struct iovec *iov, int iovcnt, int64_t deadline);

/* Receives exactly len bytes into buf before deadline. */
int ember__ps_link_recv(ember__ps_link *l, void *buf, size_t len, int64_t deadline);

/* Breaks the link from any thread: a send or receive blocked on it, here or
 * at the peer, returns at once (the socket is shut down, both rings closed). */
void ember__ps_link_shutdown(ember__ps_link *l);

/* Closes everything the link owns; the link is then as after init(-1, NULL). */
void ember__ps_link_destroy(ember__ps_link *l);

/* ------------------------------------------------------------ PS_SHM */

/* This host's identity (the feed's: boot id and network namespace); all zero
 * when unknown, which a shard then does not hold against the worker. */
void ember__ps_host_id(uint8_t out[16]);

/* EMBER_PS_SHM=0 (or "false", "no", "off") turns shared memory off. */
int ember__ps_env_shm_enabled(void);

/* The worker's offer: creates the request ring (we produce) and the reply
 * ring (we consume), `bytes` each, and writes PS_SHM's payload (host id
 * from ember__ps_host_id).  On failure nothing is left to free. */
int ember__ps_shm_offer(size_t bytes, ember_shm_ring **req, ember_shm_ring **rep,
                        uint8_t out[EMBER__PS_SHM_LEN]);

/* The shard's reading of PS_SHM: copies the fields out, bounded by len;
 * ember_shm_ring_attach checks the descriptors.  EMBER_EPROTO naming the
 * size when the payload is not EMBER__PS_SHM_LEN bytes. */
int ember__ps_shm_decode(const uint8_t *p, size_t len, uint8_t host[16],
                         ember_shm_ring_desc *req, ember_shm_ring_desc *rep);

#endif /* EMBER_PS_LINK_H */
