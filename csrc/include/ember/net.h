/* ember/net.h - TCP sockets with deadlines, and framed I/O over them.
 *
 * Every blocking call takes an absolute deadline on the monotonic clock
 * (ember_now_ms()); none blocks past it.  Sockets are created non-blocking and
 * close-on-exec; blocking behaviour is built from poll(), so a silent peer
 * costs a timeout, never a hang.  SIGPIPE is avoided with MSG_NOSIGNAL.
 *
 * Error messages name the peer ("send to 127.0.0.1:40112: connection reset").
 * Thread-safety: functions are safe on distinct fds; one fd must not be read
 * (or written) by two threads at once.
 */
#ifndef EMBER_NET_H
#define EMBER_NET_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "ember/wire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Monotonic milliseconds (CLOCK_MONOTONIC). */
int64_t ember_now_ms(void);

/* Deadline helper: ember_now_ms() + timeout_ms, saturating. */
int64_t ember_deadline_after(int64_t timeout_ms);

/* Binds (and, if backlog > 0, listens on) host:port.  host NULL or "" means
 * all interfaces; port 0 picks a free port, returned in *out_port.
 * flags: EMBER_NET_REUSEPORT sets SO_REUSEPORT, which is how a reserved port
 * is handed to a framework without a race window: Ember keeps its bound (not
 * listening) socket open while the framework binds the same port with
 * SO_REUSEPORT (gRPC does by default), so no third process can take the port
 * in between; a bound-but-not-listening socket receives no connections. */
#define EMBER_NET_REUSEPORT 1
int ember_net_bind(const char *host, uint16_t port, int backlog, int flags,
                   int *out_fd, uint16_t *out_port);

/* Makes an already-bound socket listen (used for a reserved feed port). */
int ember_net_listen_fd(int fd, int backlog);

/* Connects to host:port (name or dotted address), retrying refused
 * connections until the deadline (the server may not be up yet). */
int ember_net_connect(const char *host, uint16_t port, int64_t deadline_ms,
                      int *out_fd);

/* Accepts one connection (non-blocking, cloexec); waits until deadline. */
int ember_net_accept(int listen_fd, int64_t deadline_ms, int *out_fd);

/* The most bytes Ember's sends hand the kernel in one call, here and in the
 * collectives: between two hosts (bench-cluster) one 4 MiB sendmsg() carries
 * 1.9 GB/s where 512 KiB ones carry 3.2, and smaller pieces pay a system
 * call per few microseconds of copying. */
#define EMBER_NET_SEND_PIECE (512u * 1024u)

/* Writes/reads exactly len bytes, or fails (EMBER_ETIMEDOUT, EMBER_ECLOSED,
 * EMBER_EIO).  The sends give the kernel at most EMBER_NET_SEND_PIECE bytes
 * a call; sendv_all advances the caller's iov past what it wrote. */
int ember_net_send_all(int fd, const void *buf, size_t len, int64_t deadline_ms);
int ember_net_sendv_all(int fd, struct iovec *iov, int iovcnt, int64_t deadline_ms);
int ember_net_recv_all(int fd, void *buf, size_t len, int64_t deadline_ms);

/* Sends one frame (header + payload, gathered from both: no copy). */
int ember_net_send_frame(int fd, uint16_t type, const void *payload,
                         uint32_t len, int64_t deadline_ms);

/* Receives one frame whose payload is at most max_payload bytes.  *payload is
 * malloc'd (caller frees; NULL when length is 0).  A frame over the limit is
 * rejected with EMBER_ETOOBIG before its payload is read. */
int ember_net_recv_frame(int fd, uint32_t max_payload, ember_frame_header *hdr,
                         uint8_t **payload, int64_t deadline_ms);

/* "host:port" of the peer / local end, for messages and for learning the
 * address a node is reachable at.  Writes "?" on failure. */
void ember_net_peer_name(int fd, char *out, size_t cap);
void ember_net_local_addr(int fd, char *host, size_t cap, uint16_t *port);

/* Enables TCP keepalive and TCP_NODELAY, and caps TCP's retransmission
 * backoff at 1 s where the kernel allows it (Linux 6.15+), so a connection
 * carries data again within a second of a partition healing (control, feed
 * and collective connections). */
int ember_net_tune(int fd);

/* Where a server reports connections it rejected before they authenticated
 * (at most one line per EMBER_REJECT_LOG_INTERVAL_MS, default 10 s: "feed
 * server on :41234 rejected 2,997 unauthenticated connections in the last
 * 10 s (last: 127.0.0.1:5555: handshake not completed within 3000 ms (no
 * valid AUTH frame))"), and once that it paused accepting because the
 * process ran out of file descriptors with no stranger's left to give up.
 * Called on the server's thread; the line has no trailing newline and is
 * valid only during the call; the callback must not call back into that
 * server.  A NULL callback in a config means stderr, as "[ember] <line>". */
typedef void (*ember_log_fn)(void *arg, const char *line);

/* close() that preserves errno and ignores fd < 0. */
void ember_net_close(int fd);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_NET_H */
