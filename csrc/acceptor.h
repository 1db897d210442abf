/* acceptor.h - internal: the door of every Ember server (the rendezvous
 * server, the feed server and a collective rank's port).  It owns the
 * listening socket and every connection from accept() until the peer has
 * proven the job secret and sent the protocol's first frame (REGISTER,
 * FEED_HELLO, COLL_HELLO); then it hands the connection to the server.  What
 * the first frame must say and everything after it are the server's.
 *
 * Authentication keeps data safe; these rules keep the servers available
 * while strangers connect (docs/architecture.md, "Strangers"):
 *   - every pending handshake runs at once, in the server's own poll loop;
 *   - CHALLENGE goes out at accept; exactly one AUTH frame is read (a wrong
 *     type or length is refused on its header alone) and answered AUTH_OK
 *     or REFUSED; then exactly the first frame, nothing after it;
 *   - a short pre-authentication deadline from accept until the peer has
 *     authenticated and sent its first frame (preauth_timeout_ms, else
 *     EMBER_PREAUTH_TIMEOUT_MS, else 3 s), apart from the long I/O timeouts
 *     after it; a server may give an authenticated peer longer for its first
 *     frame (first_timeout_ms: the rendezvous server's handshake timeout);
 *   - a pool of at most max_pending unauthenticated connections (else
 *     EMBER_PREAUTH_MAX_PENDING, else 512; at least `expected` + 64 by
 *     default; never more than a quarter of the open-file limit), oldest
 *     first: when it is full a new connection evicts the OLDEST, never the
 *     new one, so a stranger holding the pool only evicts other strangers
 *     while a real peer, which answers its CHALLENGE within milliseconds, is
 *     the newest or already out of the pool.  Authenticated connections
 *     are never evicted;
 *   - accepts come in batches of 64 per loop turn: between batches the loop
 *     reads what pending peers sent, so a burst cannot push a real peer out
 *     before its AUTH is read;
 *   - the open-file soft limit raised to the hard limit, and a listen
 *     backlog of 4096 (or `expected`, up to 65535; the kernel caps it at
 *     net.core.somaxconn), so strangers run into the pool rather than into
 *     EMFILE or a full accept queue, where real peers would be refused too;
 *   - out of descriptors (accept fails with EMFILE or ENFILE), the one
 *     policy: the oldest unauthenticated connection is closed at once and
 *     the accept retried, as if the pool were full (a new connection takes
 *     the place of the oldest stranger); when no unauthenticated connection
 *     is left to give up (authenticated peers or the rest of the process
 *     hold the descriptors), accepting pauses for 100 ms, since poll() would
 *     report the listener readable forever, and the first pause is reported
 *     once.  Any other accept failure pauses likewise;
 *   - a REFUSED peer keeps its connection for up to 1 s (in the pool, if
 *     it was: evictable) so that it reads the reason rather than a reset;
 *     a peer that stays silent past its deadline is just closed;
 *   - rejected peers reported rate-limited: the first at once, then one line
 *     per EMBER_REJECT_LOG_INTERVAL_MS (default 10 s; 0: every rejection)
 *     with the count and the latest peer and reason.
 * The environment is read in ember__acceptor_create only.
 *
 * Driving it: the acceptor has no thread.  Each turn of the owner's loop
 * puts ember__acceptor_npoll() entries into its poll set
 * (ember__acceptor_poll_fill), bounds poll()'s timeout by
 * ember__acceptor_due(), and after poll() calls ember__acceptor_run with the
 * same entries; run never blocks.  The owner learns through callbacks, all
 * made from ember__acceptor_run (and `log` also from destroy), on the
 * owner's thread; a callback must not call the acceptor.
 *
 * Thread-safety: one acceptor is used by one thread at a time.  The other
 * calls here (ember__connect_auth, ember__log_stderr) are safe from any
 * thread. */
#ifndef EMBER_ACCEPTOR_H
#define EMBER_ACCEPTOR_H

#include <poll.h>
#include <stddef.h>
#include <stdint.h>

#include "ember/secure.h"
#include "ember/wire.h"

typedef struct ember__acceptor ember__acceptor;

/* A connection handed to its server: authenticated, its first frame read
 * whole, nothing after it. */
typedef struct {
  int fd;                   /* non-blocking; owned by the server from here on */
  char peer[96];            /* "127.0.0.1:41234" */
  int64_t accepted_ms;      /* when accept() returned it (ember_now_ms clock) */
  ember_frame_header first; /* of type first_type, at most first_max bytes */
  uint8_t *payload;         /* first.length bytes (malloc'd, owned by the
                               server from here on; NULL when empty) */
  ember_sec *sec;           /* the connection's record layer when the acceptor
                               encrypts (owned by the server from here on;
                               it may hold decrypted bytes after the first
                               frame); NULL in clear */
} ember__accepted;

typedef struct {
  /* The socket: listen_fd >= 0 is a bound socket that is taken over (even
   * when create fails) and made to listen, non-blocking and close-on-exec;
   * -1 binds bind_host:port (NULL or "": all IPv4 interfaces; port 0: any). */
  int listen_fd;
  const char *bind_host;
  uint16_t port;
  /* Peers of the job that may connect at once (nodes, higher ranks): the
   * backlog and the default pool hold at least that many.  0: none known. */
  uint32_t expected;
  const uint8_t *secret; /* the job secret (copied) */
  size_t secret_len;
  int encrypt;           /* 1: the handshake asks for EMBER_AUTH_ENCRYPT and
                            the first frame and all after it are records
                            (secure.h); a peer in the other mode is refused */
  uint32_t preauth_timeout_ms; /* the server config's; 0: environment, 3 s */
  uint32_t preauth_cap_ms;     /* the deadline never exceeds this; 0: no cap */
  uint32_t max_pending;        /* the server config's; 0: environment, 512 */
  uint16_t first_type;         /* the protocol's first frame */
  uint32_t first_max;          /* its largest payload */
  uint32_t first_timeout_ms;   /* from accept to it, once authenticated; 0:
                                  the pre-authentication deadline */
  int refuse_first;            /* a bad or late first frame is answered
                                  REFUSED(status, reason) (else closed) */
  const char *name;            /* "feed server": lines say "feed server on :41234" */
  void *arg;                   /* passed to the callbacks */
  /* An authenticated connection and its first frame; the server now owns
   * a->fd and a->payload, whatever it makes of them. */
  void (*ready)(void *arg, ember__accepted *a);
  /* A connection ended before it was handed over, each exactly once: its
   * peer, why, and whether it had proven the secret (then it failed at its
   * first frame).  NULL: not told. */
  void (*rejected)(void *arg, const char *peer, int authed, const char *reason);
  /* A line for the log: the rate-limited report of rejected unauthenticated
   * connections (count > 0: how many it covers), or the warning that
   * accepting paused (count 0).  Never NULL. */
  void (*log)(void *arg, const char *line, uint64_t count);
} ember__acceptor_config;

/* Raises the open-file limit, sizes the pool, initialises OpenSSL on the
 * calling thread (not lazily on the loop thread: a host program that forks
 * while another thread is inside OpenSSL's one-time init leaves the child
 * stuck on a lock nobody releases) and binds or takes over the socket. */
int ember__acceptor_create(ember__acceptor **out, const ember__acceptor_config *cfg);

/* The port it listens on; "feed server on :41234" for messages. */
uint16_t ember__acceptor_port(const ember__acceptor *a);
const char *ember__acceptor_name(const ember__acceptor *a);

/* How many pollfd entries the acceptor needs this turn (the listener and
 * every pending connection), and fills exactly that many. */
size_t ember__acceptor_npoll(const ember__acceptor *a);
void ember__acceptor_poll_fill(ember__acceptor *a, struct pollfd *pfds);

/* When the acceptor next needs ember__acceptor_run even if poll() reports
 * nothing (a deadline, the end of a pause, a report line due), on the
 * ember_now_ms clock; INT64_MAX: never. */
int64_t ember__acceptor_due(const ember__acceptor *a);

/* After poll() on the entries poll_fill wrote (revents set; all zero after a
 * timeout): reads and answers pending peers, accepts a batch, hands over
 * connections whose first frame is in, enforces deadlines and writes due
 * report lines.  pfds is read before the first callback, so callbacks may
 * reallocate it.  Never blocks. */
void ember__acceptor_run(ember__acceptor *a, const struct pollfd *pfds);

/* Closes the listener and every pending connection, then writes the report
 * of rejections not yet reported.  Accepts NULL. */
void ember__acceptor_destroy(ember__acceptor *a);

/* The client's side: connects to host:port and runs ember_auth_client,
 * reconnecting (until deadline_ms) when the server closed the connection
 * before the handshake ended, since a server under a flood of strangers may
 * evict a pending connection (ours, if its CHALLENGE went unanswered for too
 * long) and the handshake has no side effects.  A REFUSED (wrong secret) is
 * final.  *out_fd is the authenticated connection. */
int ember__connect_auth(const char *host, uint16_t port, const uint8_t *secret,
                        size_t secret_len, int64_t deadline_ms, int *out_fd);

/* ember__connect_auth with auth flags: with EMBER_AUTH_ENCRYPT, *out_sec is
 * the connection's record layer (client side), to be destroyed by the
 * caller; else NULL. */
int ember__connect_auth_ex(const char *host, uint16_t port, const uint8_t *secret,
                           size_t secret_len, uint32_t flags, int64_t deadline_ms,
                           int *out_fd, ember_sec **out_sec);

/* The log sink of the feed and collective servers when their config names
 * none: "[ember] <line>\n" to stderr in one write. */
void ember__log_stderr(void *arg, const char *line);

#endif /* EMBER_ACCEPTOR_H */
