/* ember/error.h - status codes and the thread-local last-error message.
 *
 * Every libember function that can fail returns int: EMBER_OK (0) or one of
 * the negative EMBER_E* codes below.  The code says what class of failure it
 * was; ember_last_error() says, for humans, exactly what went wrong, e.g.
 * "recv from 127.0.0.1:41234 (node 2): connection reset by peer".
 *
 * Rule: the function where a failure is first detected sets the message
 * (ember__set_error); callers that merely propagate a code leave it alone, so
 * the first, most specific message wins.
 *
 * Thread-safety: the message is thread-local; all functions are thread-safe.
 */
#ifndef EMBER_ERROR_H
#define EMBER_ERROR_H

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, value, description).  One table yields the enum, ember_strerror and
 * ember_err_name, so they cannot drift apart. */
#define EMBER_ERRNO_MAP(X)                                          \
  X(OK, 0, "success")                                               \
  X(EINVAL, -1, "invalid argument")                                 \
  X(ENOMEM, -2, "out of memory")                                    \
  X(EIO, -3, "input/output error")                                  \
  X(ETIMEDOUT, -4, "timed out")                                     \
  X(ECLOSED, -5, "connection closed by peer")                       \
  X(EPROTO, -6, "protocol error (malformed or unexpected frame)")   \
  X(EAUTH, -7, "authentication failed")                             \
  X(ETOOBIG, -8, "message too large")                               \
  X(EAGAIN, -9, "incomplete input, more bytes needed")              \
  X(ESTATE, -10, "operation not valid in the current state")        \
  X(EABORTED, -11, "aborted by the peer or by a stop request")      \
  X(ENOTFOUND, -12, "not found")                                    \
  X(ECORRUPT, -13, "corrupt data (bad checksum or layout)")         \
  X(ESYS, -14, "system call failed")                                \
  X(ENODE, -15, "a node failed")                                    \
  X(ETRUNCATED, -16, "truncated data (input ended inside a record)")\
  X(ESCHEMA, -17, "data does not match the expected schema")      \
  X(EPERM, -18, "permission denied")                              \
  X(ETAMPERED, -19, "data altered in transit (failed authentication)")

typedef enum {
#define EMBER__ERR_ENUM(name, value, desc) EMBER_##name = (value),
  EMBER_ERRNO_MAP(EMBER__ERR_ENUM)
#undef EMBER__ERR_ENUM
} ember_status;

/* Static description of a status code ("timed out"); never NULL. */
const char *ember_strerror(int code);

/* Static symbolic name of a status code ("EMBER_ETIMEDOUT"); never NULL. */
const char *ember_err_name(int code);

/* The calling thread's last detailed error message; "" if none.  The pointer
 * stays valid until the next libember call on this thread. */
const char *ember_last_error(void);

/* Clears the calling thread's last error message. */
void ember_clear_error(void);

/* Internal: records a printf-style message for this thread and returns code,
 * so call sites read `return ember__set_error(EMBER_EPROTO, "...", ...);`. */
int ember__set_error(int code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Internal: like ember__set_error, but appends ": strerror(errno_value)". */
int ember__set_errno(int code, int errno_value, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#ifdef __cplusplus
}
#endif
#endif /* EMBER_ERROR_H */
