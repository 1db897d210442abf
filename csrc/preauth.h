/* preauth.h - internal: what every Ember server does with connections that
 * have not proven the job secret yet (rendezvous/control, feed, collective).
 *
 * Authentication keeps data safe; these rules keep the servers available
 * while strangers connect:
 *   - a short pre-authentication deadline, from accept until the peer has
 *     proven the secret and sent its first frame (REGISTER, FEED_HELLO,
 *     COLL_HELLO), separate from the long I/O timeouts that apply after;
 *   - a bounded pool of unauthenticated connections, separate from the
 *     authenticated ones: when it is full the OLDEST pending connection is
 *     evicted, never the new one, so a stranger holding the pool cannot keep
 *     a real peer (which authenticates within milliseconds) out, and an
 *     authenticated connection is never displaced;
 *   - the open-file soft limit raised to the hard limit where a server starts;
 *   - rejected peers logged rate-limited: the first at once, then one line
 *     per interval with the count and the latest peer and reason.
 * Environment (read here only, at server creation): EMBER_PREAUTH_TIMEOUT_MS
 * (default 3000), EMBER_PREAUTH_MAX_PENDING (default 512),
 * EMBER_REJECT_LOG_INTERVAL_MS (default 10000; 0 logs every rejection).
 *
 * Thread-safety: the functions are safe from any thread; one
 * ember__reject_log is used by one thread at a time (its server's loop). */
#ifndef EMBER_PREAUTH_H
#define EMBER_PREAUTH_H

#include <stddef.h>
#include <stdint.h>

#include "ember/net.h"

#define EMBER__PREAUTH_DEFAULT_TIMEOUT_MS 3000u
#define EMBER__PREAUTH_DEFAULT_MAX_PENDING 512u
#define EMBER__REJECT_LOG_DEFAULT_INTERVAL_MS 10000u

/* The pre-authentication deadline in ms: `configured` if non-zero, else
 * EMBER_PREAUTH_TIMEOUT_MS, else 3000. */
uint32_t ember__preauth_timeout_ms(uint32_t configured);

/* The most unauthenticated connections a server keeps at once: `configured`
 * if non-zero, else EMBER_PREAUTH_MAX_PENDING, else 512; never more than a
 * quarter of the open-file limit (call after ember__raise_fd_limit), never
 * less than 4. */
uint32_t ember__preauth_max_pending(uint32_t configured);

/* Raises RLIMIT_NOFILE's soft limit to the hard limit (any process may; it
 * is never lowered).  Strangers' connections then run into the pending pool
 * (evicting each other), not into EMFILE, which would refuse real peers too. */
void ember__raise_fd_limit(void);

/* Connects to host:port and runs ember_auth_client, retrying (until
 * deadline_ms) when the server closed the connection before the handshake
 * ended: a server under a flood of strangers may evict a pending connection
 * (ours, if its CHALLENGE went unanswered for too long), and the handshake
 * has no side effects, so a fresh connection is safe.  A REFUSED (wrong
 * secret) is final.  *out_fd is the authenticated connection. */
int ember__connect_auth(const char *host, uint16_t port, const uint8_t *secret,
                        size_t secret_len, int64_t deadline_ms, int *out_fd);

/* The pool of unauthenticated connections, oldest first: an intrusive
 * doubly linked FIFO.  A server's connection struct embeds an
 * ember__pool_link whose `owner` points back at it. */
typedef struct ember__pool_link {
  struct ember__pool_link *prev, *next;
  void *owner;
  int in_pool;
} ember__pool_link;

typedef struct {
  ember__pool_link *head, *tail;
  size_t n;
} ember__pool;

/* Appends (newest); `owner` is the connection that embeds `link`. */
void ember__pool_push(ember__pool *p, ember__pool_link *link, void *owner);
/* Removes `link` if it is in the pool; a no-op otherwise. */
void ember__pool_unlink(ember__pool *p, ember__pool_link *link);
/* The owner of the oldest connection, NULL when the pool is empty. */
void *ember__pool_oldest(const ember__pool *p);

/* Rate-limited reporting of rejected unauthenticated connections. */
typedef struct {
  char what[96];           /* "feed server on :41234" */
  int64_t interval_ms;     /* 0: every rejection is its own line */
  int64_t window_start_ms; /* start of the span the next line covers */
  int64_t last_line_ms;    /* when the last line was written; INT64_MIN: never */
  uint64_t count;          /* rejections not yet reported */
  uint64_t total;          /* every rejection since init */
  char last[320];          /* "peer: reason" of the latest */
} ember__reject_log;

/* what_fmt names the server ("feed server on :%u").  Reads
 * EMBER_REJECT_LOG_INTERVAL_MS. */
void ember__reject_log_init(ember__reject_log *l, const char *what_fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Counts one rejected connection.  Returns the number of rejections the line
 * now written into out covers (> 0) when a line is due at once (the first
 * rejection after a quiet interval), else 0 (counted; ember__reject_due says
 * when its line is due). */
uint64_t ember__reject_note(ember__reject_log *l, int64_t now_ms, const char *peer,
                            const char *reason, char *out, size_t cap);

/* When the next line is due (INT64_MAX: nothing to report), for poll
 * timeouts. */
int64_t ember__reject_due(const ember__reject_log *l);

/* If a line is due at now_ms, writes it into out and returns the number of
 * rejections it covers; else 0. */
uint64_t ember__reject_take(ember__reject_log *l, int64_t now_ms, char *out, size_t cap);

/* Writes the line for whatever is counted but unreported, due or not (a
 * server that stops); returns how many rejections it covers, 0 if none. */
uint64_t ember__reject_flush(ember__reject_log *l, int64_t now_ms, char *out, size_t cap);

/* The sink of the feed and collective servers when the config names none:
 * "[ember] <line>\n" to stderr in one write. */
void ember__log_stderr(void *arg, const char *line);

#endif /* EMBER_PREAUTH_H */
