/* error.c - status code names and the thread-local last-error message.
 *
 * The strings come from the one X-macro table in error.h, so codes, names and
 * descriptions cannot drift apart.  The message buffer is thread-local so a
 * failure on one thread never overwrites the message another is reading. */
#include "ember/error.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* 2 KiB holds a peer name, a path and a reason comfortably; longer messages
 * are truncated (vsnprintf never overruns). */
#define EMBER__MSG_CAP 2048

static _Thread_local char tls_msg[EMBER__MSG_CAP];

const char *ember_strerror(int code) {
  switch (code) {
#define EMBER__ERR_STR(name, value, desc) \
  case (value):                           \
    return desc;
    EMBER_ERRNO_MAP(EMBER__ERR_STR)
#undef EMBER__ERR_STR
  default:
    return "unknown error";
  }
}

const char *ember_err_name(int code) {
  switch (code) {
#define EMBER__ERR_NAME(name, value, desc) \
  case (value):                            \
    return "EMBER_" #name;
    EMBER_ERRNO_MAP(EMBER__ERR_NAME)
#undef EMBER__ERR_NAME
  default:
    return "EMBER_UNKNOWN";
  }
}

const char *ember_last_error(void) { return tls_msg; }

void ember_clear_error(void) { tls_msg[0] = '\0'; }

/* Formats into a temporary first: callers legitimately pass the current
 * message as an argument ("%s: %s", what, ember_last_error()) to prefix it,
 * and vsnprintf into an overlapping buffer would be undefined behaviour. */
static void set_msg_v(const char *suffix, const char *fmt, va_list ap) {
  char tmp[EMBER__MSG_CAP];
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  if (n < 0) {
    tmp[0] = '\0';
    n = 0;
  }
  size_t used = (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1;
  if (suffix != NULL && used < sizeof tmp - 1)
    snprintf(tmp + used, sizeof tmp - used, ": %s", suffix);
  memcpy(tls_msg, tmp, sizeof tmp);
}

int ember__set_error(int code, const char *fmt, ...) {
  int saved = errno; /* callers may still want errno after reporting */
  va_list ap;
  va_start(ap, fmt);
  set_msg_v(NULL, fmt, ap);
  va_end(ap);
  errno = saved;
  return code;
}

int ember__set_errno(int code, int errno_value, const char *fmt, ...) {
  int saved = errno;
  char ebuf[256];
  /* _GNU_SOURCE gives the GNU strerror_r, which returns the string to use
   * (possibly a static one rather than ebuf). */
  const char *es = strerror_r(errno_value, ebuf, sizeof ebuf);
  va_list ap;
  va_start(ap, fmt);
  set_msg_v(es != NULL ? es : "unknown errno", fmt, ap);
  va_end(ap);
  errno = saved;
  return code;
}
