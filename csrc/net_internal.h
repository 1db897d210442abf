/* net_internal.h - internal: what the clear sends (net.c) and the
 * encrypted ones (secure.c) share.  Not installed. */
#ifndef EMBER_NET_INTERNAL_H
#define EMBER_NET_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

/* *total = the bytes of iov[0..iovcnt): EMBER_EINVAL for a bad array,
 * EMBER_ETOOBIG if the sum overflows. */
int ember__iov_total(const struct iovec *iov, int iovcnt, size_t *total);

/* A frame as two iovecs (header, payload) after checking its arguments:
 * hdr receives the encoded header; *iovcnt is 1 for an empty payload.
 * EMBER_EINVAL for a NULL payload with a length, EMBER_ETOOBIG above
 * EMBER_WIRE_ABSOLUTE_MAX (messages name the frame type). */
int ember__frame_iov(uint8_t *hdr, uint16_t type, const void *payload, uint32_t len,
                     struct iovec iov[2], int *iovcnt);

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

#endif /* EMBER_NET_INTERNAL_H */
