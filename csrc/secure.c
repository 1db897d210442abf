/* secure.c - the encrypted record layer (see ember/secure.h for the format,
 * the key schedule and the contract).
 *
 * Each direction has its own EVP_CIPHER_CTX, keyed once at create; a record
 * only sets its nonce, so the AES key schedule is not redone per record, and
 * the two halves share no state (a sender and a receiver thread may run at
 * once).  Buffers grow to the largest record seen, so a control connection
 * that only carries small frames keeps small buffers. */
#include "ember/secure.h"

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "ember/error.h"
#include "ember/net.h"
#include "net_internal.h"

#define KEY_LEN 32u
#define IV_LEN 12u
#define LABEL "ember-record-v1 "

typedef struct {
  EVP_CIPHER_CTX *ctx;
  uint8_t iv[IV_LEN];
  uint64_t seq; /* the next record's number */
  uint8_t *buf; /* one whole record: header, ciphertext, tag */
  size_t cap;
} direction;

struct ember_sec {
  direction tx, rx;
  /* tx: a record in buf that the socket has not taken whole yet */
  size_t tx_len, tx_off, tx_plain;
  /* rx: bytes of the current record in buf; its plaintext length once the
   * header is in (0: not yet); decrypted bytes waiting at buf+4+rx_poff */
  size_t rx_have, rx_len, rx_poff, rx_pend;
  int rx_err; /* sticky: the first failure, repeated on every later call */
  char peer[128];
};

/* --------------------------------------------------------------- keys */

/* HKDF-SHA256 expand of 44 bytes for one direction's label. */
static int expand(const uint8_t prk[EMBER_MAC_LEN], const char *dir, uint8_t out[44]) {
  char info[64];
  uint8_t t1[EMBER_MAC_LEN], t2[EMBER_MAC_LEN], one = 1, two = 2;
  int n = snprintf(info, sizeof info, LABEL "%s", dir);
  int rc = ember_auth_hmac(prk, EMBER_MAC_LEN, info, (size_t)n, &one, 1, NULL, 0, t1);
  if (rc == EMBER_OK)
    rc = ember_auth_hmac(prk, EMBER_MAC_LEN, t1, sizeof t1, info, (size_t)n, &two, 1, t2);
  if (rc == EMBER_OK) {
    memcpy(out, t1, 32);
    memcpy(out + 32, t2, 12);
  }
  OPENSSL_cleanse(t1, sizeof t1);
  OPENSSL_cleanse(t2, sizeof t2);
  return rc;
}

static int dir_init(direction *d, const uint8_t okm[44], int enc) {
  d->ctx = EVP_CIPHER_CTX_new();
  if (d->ctx == NULL) return ember__set_error(EMBER_ENOMEM, "secure: EVP_CIPHER_CTX_new failed");
  if (EVP_CipherInit_ex(d->ctx, EVP_aes_256_gcm(), NULL, okm, NULL, enc) != 1)
    return ember__set_error(EMBER_ESYS, "secure: AES-256-GCM is not available in OpenSSL");
  memcpy(d->iv, okm + KEY_LEN, IV_LEN);
  d->seq = 0;
  return EMBER_OK;
}

int ember_sec_create(ember_sec **out, const uint8_t *secret, size_t secret_len,
                     const uint8_t server_nonce[EMBER_NONCE_LEN],
                     const uint8_t client_nonce[EMBER_NONCE_LEN], ember_sec_role role,
                     const char *peer) {
  uint8_t salt[2 * EMBER_NONCE_LEN], prk[EMBER_MAC_LEN], c2s[44], s2c[44];
  ember_sec *s = NULL;
  int rc;
  if (out == NULL || server_nonce == NULL || client_nonce == NULL ||
      (role != EMBER_SEC_CLIENT && role != EMBER_SEC_SERVER))
    return ember__set_error(EMBER_EINVAL, "sec_create: bad arguments");
  *out = NULL;
  if (secret == NULL || secret_len < EMBER_SECRET_MIN_LEN)
    return ember__set_error(EMBER_EINVAL, "sec_create: the secret must have at least %u bytes",
                            (unsigned)EMBER_SECRET_MIN_LEN);
  s = calloc(1, sizeof *s);
  if (s == NULL) return ember__set_error(EMBER_ENOMEM, "sec_create: out of memory");
  ember_sec_set_peer(s, peer);
  /* HKDF-Extract: the nonces are the salt, the job secret the input. */
  memcpy(salt, server_nonce, EMBER_NONCE_LEN);
  memcpy(salt + EMBER_NONCE_LEN, client_nonce, EMBER_NONCE_LEN);
  rc = ember_auth_hmac(salt, sizeof salt, secret, secret_len, NULL, 0, NULL, 0, prk);
  if (rc == EMBER_OK) rc = expand(prk, "c2s", c2s);
  if (rc == EMBER_OK) rc = expand(prk, "s2c", s2c);
  if (rc == EMBER_OK)
    rc = dir_init(&s->tx, role == EMBER_SEC_CLIENT ? c2s : s2c, 1);
  if (rc == EMBER_OK)
    rc = dir_init(&s->rx, role == EMBER_SEC_CLIENT ? s2c : c2s, 0);
  OPENSSL_cleanse(prk, sizeof prk);
  OPENSSL_cleanse(c2s, sizeof c2s);
  OPENSSL_cleanse(s2c, sizeof s2c);
  if (rc != EMBER_OK) {
    ember_sec_destroy(s);
    return rc;
  }
  *out = s;
  return EMBER_OK;
}

static void dir_free(direction *d) {
  EVP_CIPHER_CTX_free(d->ctx); /* wipes the key schedule */
  if (d->buf) OPENSSL_cleanse(d->buf, d->cap);
  free(d->buf);
  OPENSSL_cleanse(d->iv, sizeof d->iv);
}

void ember_sec_destroy(ember_sec *s) {
  if (s == NULL) return;
  dir_free(&s->tx);
  dir_free(&s->rx);
  free(s);
}

void ember_sec_set_peer(ember_sec *s, const char *peer) {
  if (s == NULL) return;
  snprintf(s->peer, sizeof s->peer, "%s", peer && *peer ? peer : "the peer");
}

void ember__sec_set_seq(ember_sec *s, uint64_t tx, uint64_t rx) {
  s->tx.seq = tx;
  s->rx.seq = rx;
}

size_t ember_sec_pending(const ember_sec *s) { return s ? s->rx_pend : 0; }

/* --------------------------------------------------------------- helpers */

static void put_u32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
  p[2] = (uint8_t)(v >> 16);
  p[3] = (uint8_t)(v >> 24);
}

static void nonce_of(const direction *d, uint8_t nonce[IV_LEN]) {
  memcpy(nonce, d->iv, IV_LEN);
  for (int i = 0; i < 8; i++) nonce[4 + i] ^= (uint8_t)(d->seq >> (8 * i));
}

static int grow(direction *d, size_t need) {
  if (d->cap >= need) return EMBER_OK;
  size_t cap = d->cap ? d->cap : 4096;
  while (cap < need) cap *= 2;
  if (cap > EMBER_SEC_RECORD_MAX + EMBER_SEC_OVERHEAD)
    cap = EMBER_SEC_RECORD_MAX + EMBER_SEC_OVERHEAD;
  uint8_t *b = malloc(cap); /* not realloc: nothing in it needs keeping */
  if (b == NULL) return ember__set_error(EMBER_ENOMEM, "secure: out of memory for a record");
  if (d->buf) OPENSSL_cleanse(d->buf, d->cap);
  free(d->buf);
  d->buf = b;
  d->cap = cap;
  return EMBER_OK;
}

static int io_fail(const ember_sec *s, const char *op, int err) {
  int code = (err == EPIPE || err == ECONNRESET || err == ENOTCONN) ? EMBER_ECLOSED : EMBER_EIO;
  return ember__set_errno(code, err, "%s %s", op, s->peer);
}

/* --------------------------------------------------------------- sending */

/* Seals the first n plaintext bytes of the iovec into tx.buf. */
static int seal(ember_sec *s, const struct iovec *iov, int iovcnt, size_t n) {
  direction *d = &s->tx;
  uint8_t nonce[IV_LEN];
  int outl = 0, rc = grow(d, n + EMBER_SEC_OVERHEAD);
  if (rc != EMBER_OK) return rc;
  if (d->seq == UINT64_MAX)
    return ember__set_error(EMBER_ESTATE, "send to %s: the connection has sent 2^64-1 "
                            "encrypted records and must not reuse a nonce", s->peer);
  put_u32(d->buf, (uint32_t)n);
  nonce_of(d, nonce);
  uint8_t *o = d->buf + EMBER_SEC_HEADER_LEN;
  if (EVP_EncryptInit_ex(d->ctx, NULL, NULL, NULL, nonce) != 1 ||
      EVP_EncryptUpdate(d->ctx, NULL, &outl, d->buf, EMBER_SEC_HEADER_LEN) != 1)
    return ember__set_error(EMBER_ESYS, "send to %s: AES-GCM set-up failed", s->peer);
  size_t left = n;
  for (int i = 0; i < iovcnt && left > 0; i++) {
    size_t k = iov[i].iov_len < left ? iov[i].iov_len : left;
    if (k == 0) continue;
    if (EVP_EncryptUpdate(d->ctx, o, &outl, iov[i].iov_base, (int)k) != 1 || (size_t)outl != k)
      return ember__set_error(EMBER_ESYS, "send to %s: AES-GCM encryption failed", s->peer);
    o += k;
    left -= k;
  }
  if (EVP_EncryptFinal_ex(d->ctx, o, &outl) != 1 ||
      EVP_CIPHER_CTX_ctrl(d->ctx, EVP_CTRL_GCM_GET_TAG, EMBER_SEC_TAG_LEN, o) != 1)
    return ember__set_error(EMBER_ESYS, "send to %s: AES-GCM tag failed", s->peer);
  d->seq++;
  s->tx_len = n + EMBER_SEC_OVERHEAD;
  s->tx_off = 0;
  s->tx_plain = n;
  return EMBER_OK;
}

long ember_sec_send(ember_sec *s, int fd, const struct iovec *iov, int iovcnt) {
  size_t total = 0;
  if (iovcnt < 0 || (iov == NULL && iovcnt > 0))
    return ember__set_error(EMBER_EINVAL, "sec_send: bad iovec");
  for (int i = 0; i < iovcnt && total < EMBER_SEC_RECORD_MAX; i++)
    total += iov[i].iov_len < EMBER_SEC_RECORD_MAX ? iov[i].iov_len : EMBER_SEC_RECORD_MAX;
  if (total > EMBER_SEC_RECORD_MAX) total = EMBER_SEC_RECORD_MAX; /* no overflow: each term capped */
  if (s == NULL) {
    struct msghdr mh;
    memset(&mh, 0, sizeof mh);
    mh.msg_iov = (struct iovec *)(uintptr_t)iov;
    mh.msg_iovlen = (size_t)iovcnt;
    for (;;) {
      ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) return (long)n;
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      return ember__set_errno(errno == EPIPE || errno == ECONNRESET ? EMBER_ECLOSED : EMBER_EIO,
                              errno, "send");
    }
  }
  if (s->tx_len == 0) {
    if (total == 0) return 0;
    int rc = seal(s, iov, iovcnt, total);
    if (rc != EMBER_OK) return rc;
  } else if (total < s->tx_plain) {
    return ember__set_error(EMBER_EINVAL, "sec_send to %s: a retry passed %zu bytes where the "
                            "record under way holds %zu", s->peer, total, s->tx_plain);
  }
  while (s->tx_off < s->tx_len) {
    ssize_t n = send(fd, s->tx.buf + s->tx_off, s->tx_len - s->tx_off,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (n < 0) return io_fail(s, "send to", errno);
    s->tx_off += (size_t)n;
  }
  long done = (long)s->tx_plain;
  s->tx_len = s->tx_off = s->tx_plain = 0;
  return done;
}

/* --------------------------------------------------------------- receiving */

static long rx_fail(ember_sec *s, int code, const char *fmt, const char *what) {
  char why[384];
  snprintf(why, sizeof why, fmt, what);
  s->rx_err = ember__set_error(code, "recv from %s: %s", s->peer, why);
  return s->rx_err;
}

/* Opens the record in rx.buf (header and rx_len + 16 bytes in), decrypting
 * into dst (which may be the record's own bytes). */
static long rx_open(ember_sec *s, uint8_t *dst) {
  direction *d = &s->rx;
  uint8_t nonce[IV_LEN];
  int outl = 0;
  const uint8_t *ct = d->buf + EMBER_SEC_HEADER_LEN;
  if (d->seq == UINT64_MAX)
    return rx_fail(s, EMBER_ETAMPERED, "%s", "record number 2^64-1: the sender must not have "
                   "sent it (the data was altered in transit)");
  nonce_of(d, nonce);
  if (EVP_DecryptInit_ex(d->ctx, NULL, NULL, NULL, nonce) != 1 ||
      EVP_DecryptUpdate(d->ctx, NULL, &outl, d->buf, EMBER_SEC_HEADER_LEN) != 1 ||
      (s->rx_len > 0 && EVP_DecryptUpdate(d->ctx, dst, &outl, ct, (int)s->rx_len) != 1) ||
      EVP_CIPHER_CTX_ctrl(d->ctx, EVP_CTRL_GCM_SET_TAG, EMBER_SEC_TAG_LEN,
                          (void *)(uintptr_t)(ct + s->rx_len)) != 1)
    return rx_fail(s, EMBER_ESYS, "%s", "AES-GCM decryption failed in OpenSSL");
  if (EVP_DecryptFinal_ex(d->ctx, dst + s->rx_len, &outl) != 1) {
    char what[64];
    snprintf(what, sizeof what, "%llu", (unsigned long long)d->seq);
    return rx_fail(s, EMBER_ETAMPERED,
                   "encrypted record %s failed authentication: the data was altered in "
                   "transit (a changed, dropped, replayed or reordered record, or a peer "
                   "with other keys); nothing of it was delivered", what);
  }
  d->seq++;
  return EMBER_OK;
}

/* Reads from the socket until the current record is whole.  1: whole, 0:
 * not yet, negative: failure (sticky). */
static long rx_fill(ember_sec *s, int fd) {
  direction *d = &s->rx;
  for (;;) {
    size_t want;
    if (s->rx_have < EMBER_SEC_HEADER_LEN) {
      if (d->cap < 4096 && grow(d, 4096) != EMBER_OK) return s->rx_err = EMBER_ENOMEM;
      want = EMBER_SEC_HEADER_LEN - s->rx_have;
    } else {
      want = EMBER_SEC_HEADER_LEN + s->rx_len + EMBER_SEC_TAG_LEN - s->rx_have;
      if (want == 0) return 1;
    }
    ssize_t n = recv(fd, d->buf + s->rx_have, want, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (n < 0) return s->rx_err = io_fail(s, "recv from", errno);
    if (n == 0) {
      if (s->rx_have == 0) {
        s->rx_err = ember__set_error(EMBER_ECLOSED, "recv from %s: connection closed by peer",
                                     s->peer);
        return s->rx_err;
      }
      char what[96];
      snprintf(what, sizeof what, "%zu of %zu bytes", s->rx_have,
               s->rx_have < EMBER_SEC_HEADER_LEN
                   ? (size_t)EMBER_SEC_HEADER_LEN
                   : EMBER_SEC_HEADER_LEN + s->rx_len + EMBER_SEC_TAG_LEN);
      return rx_fail(s, EMBER_ETAMPERED,
                     "the stream ended inside an encrypted record (%s): it was truncated, "
                     "the data was altered in transit or the peer died mid-record", what);
    }
    s->rx_have += (size_t)n;
    if (s->rx_have == EMBER_SEC_HEADER_LEN) {
      const uint8_t *b = d->buf;
      uint32_t len = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                     (uint32_t)b[3] << 24;
      /* Bounded before a byte is buffered for it. */
      if (len == 0 || len > EMBER_SEC_RECORD_MAX) {
        char what[64];
        snprintf(what, sizeof what, "%u", (unsigned)len);
        return rx_fail(s, EMBER_ETAMPERED,
                       "an encrypted record claims %s bytes (1..262144 allowed): the data "
                       "was altered in transit, or the peer does not encrypt", what);
      }
      s->rx_len = len;
      int rc = grow(d, len + EMBER_SEC_OVERHEAD);
      if (rc != EMBER_OK) return s->rx_err = rc;
      /* grow() may have replaced the buffer: keep the header */
      put_u32(d->buf, len);
    }
  }
}

static long rx_get(ember_sec *s, int fd, void *buf, size_t len, int peek) {
  if (len == 0) return 0;
  if (buf == NULL) return ember__set_error(EMBER_EINVAL, "sec_recv: NULL buffer");
  if (s->rx_err) return ember__set_error(s->rx_err, "recv from %s: the encrypted stream "
                                         "failed before", s->peer);
  if (s->rx_pend == 0) {
    long r = rx_fill(s, fd);
    if (r <= 0) return r;
    uint8_t *rec = s->rx.buf + EMBER_SEC_HEADER_LEN;
    /* The whole record fits: decrypt straight into the caller's memory. */
    if (!peek && len >= s->rx_len) {
      r = rx_open(s, buf);
      if (r != EMBER_OK) return r;
      long n = (long)s->rx_len;
      s->rx_have = s->rx_len = 0;
      return n;
    }
    r = rx_open(s, rec);
    if (r != EMBER_OK) return r;
    s->rx_poff = 0;
    s->rx_pend = s->rx_len;
  }
  size_t k = len < s->rx_pend ? len : s->rx_pend;
  memcpy(buf, s->rx.buf + EMBER_SEC_HEADER_LEN + s->rx_poff, k);
  if (!peek) {
    s->rx_poff += k;
    s->rx_pend -= k;
    if (s->rx_pend == 0) s->rx_have = s->rx_len = s->rx_poff = 0;
  }
  return (long)k;
}

long ember_sec_recv(ember_sec *s, int fd, void *buf, size_t len) {
  if (s == NULL) {
    for (;;) {
      ssize_t n = recv(fd, buf, len, MSG_DONTWAIT);
      if (n > 0) return (long)n;
      if (n == 0 && len > 0) return ember__set_error(EMBER_ECLOSED, "connection closed by peer");
      if (n == 0) return 0;
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      return ember__set_errno(errno == ECONNRESET ? EMBER_ECLOSED : EMBER_EIO, errno, "recv");
    }
  }
  return rx_get(s, fd, buf, len, 0);
}

long ember_sec_peek(ember_sec *s, int fd, void *buf, size_t len) {
  if (s == NULL) {
    ssize_t n = recv(fd, buf, len, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0) return (long)n;
    if (n == 0 && len > 0) return ember__set_error(EMBER_ECLOSED, "connection closed by peer");
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return ember__set_errno(EMBER_EIO, errno, "recv");
    return 0;
  }
  return rx_get(s, fd, buf, len, 1);
}

/* --------------------------------------------------------------- blocking */

static int wait_fd(const ember_sec *s, int fd, short ev, int64_t deadline_ms, const char *op,
                   size_t done, size_t total) {
  for (;;) {
    int64_t left = deadline_ms - ember_now_ms();
    if (left <= 0)
      return ember__set_error(EMBER_ETIMEDOUT, "%s %s: timed out (%zu of %zu bytes)", op,
                              s->peer, done, total);
    struct pollfd p = {.fd = fd, .events = ev};
    int r = poll(&p, 1, left > 1000 ? 1000 : (int)left);
    if (r > 0) return EMBER_OK;
    if (r < 0 && errno != EINTR) return ember__set_errno(EMBER_ESYS, errno, "poll");
  }
}

int ember_sec_sendv_all(ember_sec *s, int fd, struct iovec *iov, int iovcnt,
                        int64_t deadline_ms) {
  size_t total = 0, done = 0;
  if (s == NULL) return ember_net_sendv_all(fd, iov, iovcnt, deadline_ms);
  int rc = ember__iov_total(iov, iovcnt, &total);
  if (rc != EMBER_OK) return rc;
  while (iovcnt > 0) {
    if (iov[0].iov_len == 0) {
      iov++;
      iovcnt--;
      continue;
    }
    long n = ember_sec_send(s, fd, iov, iovcnt);
    if (n < 0) return (int)n;
    if (n == 0) {
      rc = wait_fd(s, fd, POLLOUT, deadline_ms, "send to", done, total);
      if (rc != EMBER_OK) return rc;
      continue;
    }
    done += (size_t)n;
    ember__iov_advance(&iov, &iovcnt, (size_t)n);
  }
  return EMBER_OK;
}

int ember_sec_send_all(ember_sec *s, int fd, const void *buf, size_t len, int64_t deadline_ms) {
  struct iovec iov = {.iov_base = (void *)(uintptr_t)buf, .iov_len = len};
  if (buf == NULL && len > 0) return ember__set_error(EMBER_EINVAL, "send: NULL buffer");
  return ember_sec_sendv_all(s, fd, &iov, 1, deadline_ms);
}

int ember_sec_recv_all(ember_sec *s, int fd, void *buf, size_t len, int64_t deadline_ms) {
  size_t done = 0;
  if (s == NULL) return ember_net_recv_all(fd, buf, len, deadline_ms);
  while (done < len) {
    long n = ember_sec_recv(s, fd, (uint8_t *)buf + done, len - done);
    if (n < 0) {
      if (n == EMBER_ECLOSED)
        return ember__set_error(EMBER_ECLOSED,
                                "recv from %s: connection closed by peer (%zu of %zu bytes)",
                                s->peer, done, len);
      return (int)n;
    }
    if (n == 0) {
      int rc = wait_fd(s, fd, POLLIN, deadline_ms, "recv from", done, len);
      if (rc != EMBER_OK) return rc;
      continue;
    }
    done += (size_t)n;
  }
  return EMBER_OK;
}

int ember_sec_send_frame(ember_sec *s, int fd, uint16_t type, const void *payload,
                         uint32_t len, int64_t deadline_ms) {
  uint8_t hdr[EMBER_WIRE_HEADER_LEN];
  if (s == NULL) return ember_net_send_frame(fd, type, payload, len, deadline_ms);
  struct iovec iov[2];
  int n = 0;
  int rc = ember__frame_iov(hdr, type, payload, len, iov, &n);
  return rc != EMBER_OK ? rc : ember_sec_sendv_all(s, fd, iov, n, deadline_ms);
}

int ember_sec_recv_frame(ember_sec *s, int fd, uint32_t max_payload, ember_frame_header *hdr,
                         uint8_t **payload, int64_t deadline_ms) {
  uint8_t h[EMBER_WIRE_HEADER_LEN];
  uint8_t *buf = NULL;
  int rc;
  if (s == NULL) return ember_net_recv_frame(fd, max_payload, hdr, payload, deadline_ms);
  if (hdr == NULL || payload == NULL)
    return ember__set_error(EMBER_EINVAL, "recv_frame: NULL argument");
  *payload = NULL;
  rc = ember_sec_recv_all(s, fd, h, sizeof h, deadline_ms);
  if (rc != EMBER_OK) return rc;
  rc = ember_wire_decode_header(h, sizeof h, max_payload, hdr);
  if (rc != EMBER_OK) return ember__set_error(rc, "recv from %s: %s", s->peer, ember_last_error());
  if (hdr->length > 0) {
    buf = malloc(hdr->length);
    if (buf == NULL)
      return ember__set_error(EMBER_ENOMEM, "recv_frame: out of memory (%u bytes)",
                              (unsigned)hdr->length);
    rc = ember_sec_recv_all(s, fd, buf, hdr->length, deadline_ms);
    if (rc != EMBER_OK) {
      free(buf);
      return rc;
    }
  }
  *payload = buf;
  return EMBER_OK;
}
