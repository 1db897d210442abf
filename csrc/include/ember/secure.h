/* ember/secure.h - the encrypted record layer of Ember's data plane.
 *
 * When a job asks for encryption (ember.run(..., encrypt=True)), every feed
 * and collective TCP connection carries, after the handshake of auth.h, a
 * stream of records instead of clear bytes:
 *
 *   u32 len (little-endian, 1..EMBER_SEC_RECORD_MAX)
 *   len bytes of AES-256-GCM ciphertext
 *   16-byte GCM tag over the ciphertext, with the 4 length bytes as AAD
 *
 * Keys.  Both ends derive them from the job secret and the handshake's two
 * nonces with HKDF-SHA256 (RFC 5869): PRK = HMAC(salt = server nonce |
 * client nonce, secret); then for each direction ("c2s", "s2c") 44 bytes of
 * output keyed by the label "ember-record-v1 <dir>": a 32-byte key and a
 * 12-byte IV.  Every connection therefore has its own keys, one per
 * direction, and a key never encrypts under two connections.
 *
 * Nonces.  The 96-bit nonce of record n of a direction is the direction's
 * IV xor n (64-bit little-endian in the last 8 bytes), n counting from 0, as
 * in TLS 1.3.  The receiver expects exactly the next n, so a record that was
 * flipped, dropped, replayed or reordered fails its tag; a stream that ends
 * inside a record was truncated.  Either is EMBER_ETAMPERED with a message
 * naming the peer and saying that the data was altered in transit; nothing
 * of such a record is delivered as good data (see ember_sec_recv).  A
 * direction that has sent 2^64 - 1 records fails rather than wrap.
 *
 * The record layer is a byte stream like TCP's: framed protocols (the feed's
 * frames) and unframed streams (a collective's data) both run over it;
 * record boundaries mean nothing to them.  A sender encrypts straight out of
 * the caller's memory into the record buffer, a receiver decrypts straight
 * into the caller's memory when it asks for a whole record or more, so a
 * large transfer costs one cipher pass on each side and no copy beyond what
 * clear TCP does.  Shared memory between processes of one host never comes
 * here: it stays in clear and never leaves the host.
 *
 * Every call that takes an ember_sec also accepts NULL: the connection is in
 * clear and the call is plain TCP (ember_net_* in net.h), so one code path
 * serves both modes.
 *
 * Thread-safety: one ember_sec belongs to one connection.  Its sending half
 * (send, sendv_all, send_all, send_frame) and its receiving half (recv,
 * peek, pending, recv_all, recv_frame) are independent: one thread may send
 * while another receives, but two threads must not send (or receive) on one
 * ember_sec at once.  create/destroy are not concurrent with anything.
 */
#ifndef EMBER_SECURE_H
#define EMBER_SECURE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "ember/auth.h"
#include "ember/wire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The largest record's plaintext: large enough that the per-record cost (the
 * GCM set-up, the tag, one syscall) is small next to the cipher pass; each
 * buffer of a connection grows to the largest record it carries, at most
 * this plus EMBER_SEC_OVERHEAD. */
#define EMBER_SEC_RECORD_MAX (256u * 1024u)
#define EMBER_SEC_HEADER_LEN 4u
#define EMBER_SEC_TAG_LEN 16u
#define EMBER_SEC_OVERHEAD (EMBER_SEC_HEADER_LEN + EMBER_SEC_TAG_LEN)

typedef enum {
  EMBER_SEC_CLIENT = 0, /* the side that connected: sends c2s, receives s2c */
  EMBER_SEC_SERVER = 1  /* the side that accepted */
} ember_sec_role;

typedef struct ember_sec ember_sec;

/* Derives the connection's keys (above) and makes its record state.  peer
 * names the other end in messages ("10.0.0.3:41234"; may be NULL, copied).
 * EMBER_EINVAL for a short secret, EMBER_ENOMEM, EMBER_ESYS if OpenSSL
 * fails.  No I/O. */
int ember_sec_create(ember_sec **out, const uint8_t *secret, size_t secret_len,
                     const uint8_t server_nonce[EMBER_NONCE_LEN],
                     const uint8_t client_nonce[EMBER_NONCE_LEN], ember_sec_role role,
                     const char *peer);

/* Wipes the keys and frees everything.  Accepts NULL.  Does not close fd. */
void ember_sec_destroy(ember_sec *s);

/* Renames the peer in later messages ("10.0.0.3:41234 (rank 2)"). */
void ember_sec_set_peer(ember_sec *s, const char *peer);

/* Non-blocking send of the iovec's bytes on a non-blocking socket.  Returns
 * how many plaintext bytes were taken (> 0), 0 when the socket has no room
 * now (poll for POLLOUT), or a negative status.  A record is reported taken
 * only once it is wholly in the socket, so nothing is ever held back behind
 * the caller's back; until then, when a call returned 0 after starting a
 * record, the next call must pass the same leading bytes again (at least as
 * many), as with SSL_write.  At most EMBER_SEC_RECORD_MAX bytes a call. */
long ember_sec_send(ember_sec *s, int fd, const struct iovec *iov, int iovcnt);

/* Non-blocking receive of up to len plaintext bytes.  Returns the bytes
 * delivered (> 0), 0 when nothing whole has arrived yet (poll for POLLIN,
 * unless ember_sec_pending() says bytes wait), EMBER_ECLOSED when the peer
 * closed the connection between records, EMBER_ETAMPERED when a record
 * failed (nothing of it counts as delivered; the bytes of buf this call
 * may have written are unspecified), EMBER_EIO for socket errors.  After a
 * failure every later call fails the same way. */
long ember_sec_recv(ember_sec *s, int fd, void *buf, size_t len);

/* Like ember_sec_recv, but leaves the bytes to be received again. */
long ember_sec_peek(ember_sec *s, int fd, void *buf, size_t len);

/* Decrypted bytes waiting for ember_sec_recv: a poll loop must not wait on
 * the socket while this is non-zero (the socket may have nothing more).
 * 0 for NULL. */
size_t ember_sec_pending(const ember_sec *s);

/* Blocking calls with an absolute deadline (ember_now_ms clock), the record
 * layer's ember_net_sendv_all, send_all, recv_all, send_frame and recv_frame
 * (net.h; same arguments and errors, and EMBER_ETAMPERED).  A frame is sent
 * in as few records as possible, header and payload together. */
int ember_sec_sendv_all(ember_sec *s, int fd, struct iovec *iov, int iovcnt,
                        int64_t deadline_ms);
int ember_sec_send_all(ember_sec *s, int fd, const void *buf, size_t len, int64_t deadline_ms);
int ember_sec_recv_all(ember_sec *s, int fd, void *buf, size_t len, int64_t deadline_ms);
int ember_sec_send_frame(ember_sec *s, int fd, uint16_t type, const void *payload,
                         uint32_t len, int64_t deadline_ms);
int ember_sec_recv_frame(ember_sec *s, int fd, uint32_t max_payload, ember_frame_header *hdr,
                         uint8_t **payload, int64_t deadline_ms);

/* Internal, for tests: sets the next record numbers of both directions
 * (to show that a direction refuses to wrap). */
void ember__sec_set_seq(ember_sec *s, uint64_t tx, uint64_t rx);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_SECURE_H */
