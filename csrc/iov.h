/* iov.h - internal: moving an iovec array past the bytes a partial write
 * took, shared by the clear sends (net.c) and the encrypted ones
 * (secure.c).  Not installed. */
#ifndef EMBER_IOV_H
#define EMBER_IOV_H

#include <stddef.h>
#include <sys/uio.h>

/* Advances *iov / *iovcnt past n bytes (n no more than they hold); the
 * first remaining entry is adjusted in place. */
static inline void ember__iov_advance(struct iovec **iov, int *iovcnt, size_t n) {
  while (*iovcnt > 0 && n >= (*iov)[0].iov_len) {
    n -= (*iov)[0].iov_len;
    (*iov)++;
    (*iovcnt)--;
  }
  if (*iovcnt > 0 && n > 0) {
    (*iov)[0].iov_base = (char *)(*iov)[0].iov_base + n;
    (*iov)[0].iov_len -= n;
  }
}

#endif /* EMBER_IOV_H */
