/* ps_link.c - one parameter-server connection's transport: the socket or a
 * pair of shm rings used as a byte stream (ps_link.h). */
#include "ps_link.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "ember/error.h"
#include "ember/net.h"
#include "ember/wire.h"
#include "feed_internal.h" /* ember__feed_host_id: one notion of "this host" */

void ember__ps_link_init(ember__ps_link *l, int fd, ember_sec *sec) {
  memset(l, 0, sizeof *l);
  l->fd = fd;
  l->sec = sec;
}

int ember__ps_link_is_shm(const ember__ps_link *l) { return l->tx != NULL; }

void ember__ps_link_use_rings(ember__ps_link *l, ember_shm_ring *tx, ember_shm_ring *rx) {
  l->tx = tx;
  l->rx = rx;
  l->cur_have = 0;
  l->cur_off = 0;
}

/* The largest record a link writes, header included.  Small records
 * pipeline: the consumer copies one out while the producer fills the next,
 * and the bytes are still in cache when it does.  Records of a quarter of
 * the 8 MiB default ring (2 MiB) made a round of a 4 MB dense pull and push
 * 1.5 to 2 times slower than records of 64-512 KiB, and slower than
 * loopback TCP (measured on a 2-core VM: the consumer waited for each
 * 2 MiB, then read it from memory). */
#define PS_LINK_RECORD (128u * 1024u)

/* The ring calls take a relative timeout; negative: none. */
static int64_t ms_left(int64_t deadline) {
  if (deadline == INT64_MAX) return -1;
  int64_t left = deadline - ember_now_ms();
  return left > 0 ? left : 0;
}

static int ring_sendv(ember__ps_link *l, const struct iovec *iov, int iovcnt, int64_t deadline) {
  /* Records of PS_LINK_RECORD bytes, a quarter of a smaller ring (>= 64 KiB) */
  size_t chunk = ember_shm_ring_capacity(l->tx) / 4u;
  if (chunk > PS_LINK_RECORD) chunk = PS_LINK_RECORD;
  chunk -= EMBER_SHM_RING_RECORD_HDR;
  size_t left = 0, voff = 0;
  int vi = 0;
  for (int i = 0; i < iovcnt; i++) {
    if (iov[i].iov_len > 0 && iov[i].iov_base == NULL)
      return ember__set_error(EMBER_EINVAL, "ps link send: iovec %d is NULL", i);
    if (__builtin_add_overflow(left, iov[i].iov_len, &left))
      return ember__set_error(EMBER_ETOOBIG, "ps link send: message size overflows");
  }
  while (left > 0) {
    size_t n = left < chunk ? left : chunk, done = 0;
    void *dst;
    int rc = ember_shm_ring_reserve(l->tx, n, &dst, ms_left(deadline));
    if (rc != EMBER_OK) return rc;
    while (done < n) {
      size_t take = iov[vi].iov_len - voff;
      if (take > n - done) take = n - done;
      if (take) memcpy((uint8_t *)dst + done, (const uint8_t *)iov[vi].iov_base + voff, take);
      done += take;
      voff += take;
      if (voff == iov[vi].iov_len) {
        vi++;
        voff = 0;
      }
    }
    rc = ember_shm_ring_commit(l->tx, n);
    if (rc != EMBER_OK) return rc;
    left -= n;
  }
  return EMBER_OK;
}

static int ring_recv(ember__ps_link *l, uint8_t *buf, size_t len, int64_t deadline) {
  while (len > 0) {
    if (!l->cur_have) {
      ember_shm_msg *m = &l->cur;
      int rc = ember_shm_ring_next(l->rx, m, ember_shm_ring_max_record(l->rx), ms_left(deadline));
      if (rc != EMBER_OK) return rc;
      if (m->kind == EMBER_SHM_MSG_END)
        return ember__set_error(EMBER_ECLOSED, "shm ring: the peer ended its stream");
      if (m->kind == EMBER_SHM_MSG_ERROR)
        return ember__set_error(m->code < 0 ? m->code : EMBER_EIO, "shm ring: the peer "
                                "failed: %s", m->reason);
      if (m->data == NULL) /* a fragment: its bytes cannot be read a few at a time */
        return ember__set_error(EMBER_ECORRUPT, "shm ring: a %zu-byte message split into "
                                "fragments, which a ps link never writes", m->len);
      l->cur_have = 1;
      l->cur_off = 0;
    }
    /* cur.len was bounded by the ring (one record, mapped contiguously) */
    size_t n = l->cur.len - l->cur_off;
    if (n > len) n = len;
    if (n) memcpy(buf, (const uint8_t *)l->cur.data + l->cur_off, n);
    buf += n;
    len -= n;
    l->cur_off += n;
    if (l->cur_off == l->cur.len) {
      l->cur_have = 0;
      int rc = ember_shm_ring_release(l->rx, ms_left(deadline));
      if (rc != EMBER_OK) return rc;
    }
  }
  return EMBER_OK;
}

int ember__ps_link_sendv(ember__ps_link *l, struct iovec *iov, int iovcnt, int64_t deadline) {
  if (l->tx == NULL) return ember_sec_sendv_all(l->sec, l->fd, iov, iovcnt, deadline);
  return ring_sendv(l, iov, iovcnt, deadline);
}

int ember__ps_link_recv(ember__ps_link *l, void *buf, size_t len, int64_t deadline) {
  if (l->rx == NULL) return ember_sec_recv_all(l->sec, l->fd, buf, len, deadline);
  if (buf == NULL && len > 0) return ember__set_error(EMBER_EINVAL, "ps link recv: NULL buffer");
  return ring_recv(l, buf, len, deadline);
}

void ember__ps_link_shutdown(ember__ps_link *l) {
  if (l->fd >= 0) shutdown(l->fd, SHUT_RDWR);
  ember_shm_ring_close(l->tx); /* accepts NULL */
  ember_shm_ring_close(l->rx);
}

void ember__ps_link_destroy(ember__ps_link *l) {
  ember_shm_ring_destroy(l->tx);
  ember_shm_ring_destroy(l->rx);
  ember_net_close(l->fd);
  ember_sec_destroy(l->sec);
  ember__ps_link_init(l, -1, NULL);
}

/* ------------------------------------------------------------ PS_SHM */

void ember__ps_host_id(uint8_t out[16]) { ember__feed_host_id(out); }

int ember__ps_env_shm_enabled(void) {
  const char *v = getenv("EMBER_PS_SHM");
  if (v == NULL) return 1;
  return !(strcmp(v, "0") == 0 || strcasecmp(v, "false") == 0 || strcasecmp(v, "no") == 0 ||
           strcasecmp(v, "off") == 0);
}

int ember__ps_shm_offer(size_t bytes, ember_shm_ring **req, ember_shm_ring **rep,
                        uint8_t out[EMBER__PS_SHM_LEN]) {
  ember_shm_ring_desc d;
  *req = *rep = NULL;
  int rc = ember_shm_ring_create(req, bytes, EMBER_SHM_PRODUCER);
  if (rc == EMBER_OK) rc = ember_shm_ring_create(rep, bytes, EMBER_SHM_CONSUMER);
  if (rc != EMBER_OK) {
    ember_shm_ring_destroy(*req);
    *req = NULL;
    return rc;
  }
  ember__ps_host_id(out);
  ember_shm_ring_describe(*req, &d);
  ember_shm_ring_desc_encode(&d, out + 16);
  ember_shm_ring_describe(*rep, &d);
  ember_shm_ring_desc_encode(&d, out + 16 + EMBER_SHM_RING_DESC_WIRE_LEN);
  return EMBER_OK;
}

int ember__ps_shm_decode(const uint8_t *p, size_t len, uint8_t host[16],
                         ember_shm_ring_desc *req, ember_shm_ring_desc *rep) {
  if (len != EMBER__PS_SHM_LEN)
    return ember__set_error(EMBER_EPROTO, "PS_SHM of %zu bytes (%u expected)", len,
                            EMBER__PS_SHM_LEN);
  memcpy(host, p, 16);
  ember_shm_ring_desc_decode(p + 16, req);
  ember_shm_ring_desc_decode(p + 16 + EMBER_SHM_RING_DESC_WIRE_LEN, rep);
  return EMBER_OK;
}
