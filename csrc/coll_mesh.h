/* coll_mesh.h - internal: how a communicator's ranks find each other.
 *
 * The mesh: one authenticated TCP connection per pair of ranks.  A rank
 * connects to every lower rank (ember__connect_auth, which reconnects when a
 * flooded peer evicted the pending connection), sends COLL_HELLO(rank, size)
 * and reads the peer's; it accepts every higher rank on its own port, where
 * strangers may connect too (the port's handshakes follow the Strangers
 * rules of docs/architecture.md).  Waits only go to lower ranks and rank 0
 * only accepts, so there is no cycle.
 *
 * Shared memory, negotiated over the mesh: each rank creates its inbox
 * (shm_open, mode 0600, a random name and token) and one shm_ring per peer
 * for that peer to send into, and offers both in COLL_SHM; a peer that can
 * open the inbox by name (the same host's /dev/shm) maps it, attaches to its
 * ring as the producer and says so in COLL_SHM_ACK.  The inbox's name is
 * unlinked once every peer has answered; rings of peers that use TCP are
 * freed.
 *
 * Blocking: both calls block until done or the absolute deadline
 * (ember_now_ms clock) passes.  Ownership: connections, rings and mappings
 * are stored in c->peers and c->inbox, which ember_comm_destroy frees
 * whatever happened.  Thread-safety: the creating thread only. */
#ifndef EMBER_COLL_MESH_H
#define EMBER_COLL_MESH_H

#include <stddef.h>
#include <stdint.h>

#include "coll_internal.h"

/* "host:port" or "[v6]:port" of rank idx -> host (cap bytes), port
 * (1..65535); EMBER_EINVAL naming the rank otherwise. */
int ember__coll_parse_address(const char *s, uint32_t idx, char *host, size_t cap,
                              uint16_t *port);

/* Listens on this rank's port (listen_fd >= 0: that bound socket, taken over
 * even on failure; else binds cfg->bind_host and the port of
 * cfg->addresses[rank]), connects every lower rank, accepts every higher one
 * and stops listening; fills c->peers[j].fd. */
int ember__coll_build_mesh(ember_comm *c, const ember_comm_config *cfg, int listen_fd,
                           int64_t deadline);

/* Offers and takes shared memory with every peer (none with
 * EMBER_COMM_TCP_ONLY in flags); sets c->peers[j].shm where both sides can. */
int ember__coll_setup_shm(ember_comm *c, uint32_t flags, int64_t deadline);

#endif /* EMBER_COLL_MESH_H */
