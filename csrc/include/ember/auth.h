/* ember/auth.h - mutual HMAC-SHA256 challenge/response on a fresh connection.
 *
 * Every Ember TCP connection (rendezvous, control, feed) runs this handshake
 * before any other byte is parsed.  Both sides know the per-job secret; the
 * secret itself never crosses the wire.
 *
 *   server -> CHALLENGE  sn                       (32 random bytes)
 *   client -> AUTH       cn, HMAC(secret, "ember-auth-v1 client" | sn | cn)
 *   server -> AUTH_OK    HMAC(secret, "ember-auth-v1 server" | cn | sn)
 *          or REFUSED    u32 status, reason      (then the server closes)
 *
 * The server reads exactly one frame of type AUTH and exact length 64 before
 * deciding; anything else (wrong type, wrong length, bad MAC) is refused, and
 * MACs are compared in constant time (CRYPTO_memcmp).  The client verifies
 * AUTH_OK, so a node cannot be fooled by an impostor server either.
 *
 * Encryption (secure.h) is agreed here: a job that encrypts its data plane
 * uses the labels "ember-auth-v1 client aes-256-gcm" / "... server
 * aes-256-gcm" (EMBER_AUTH_ENCRYPT).  The mode is thus part of what both
 * MACs prove, so a man in the middle cannot strip it; and a server whose
 * mode differs from its client's recognises the other label and refuses with
 * a reason saying which side encrypts, instead of "bad MAC".  The two nonces
 * (ember_auth_result) are what secure.h derives the connection's keys from.
 *
 * Blocking: both handshakes block until done or until deadline_ms (absolute,
 * ember_now_ms() clock) passes.  Thread-safety: safe on distinct fds.
 */
#ifndef EMBER_AUTH_H
#define EMBER_AUTH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EMBER_SECRET_LEN 32u
#define EMBER_NONCE_LEN 32u
#define EMBER_MAC_LEN 32u
/* Secrets shorter than this are rejected as EMBER_EINVAL. */
#define EMBER_SECRET_MIN_LEN 16u

/* ember_auth_*_ex flags */
#define EMBER_AUTH_ENCRYPT 1u /* the connection goes on as encrypted records */

/* What a successful handshake leaves both sides with. */
typedef struct {
  uint8_t server_nonce[EMBER_NONCE_LEN];
  uint8_t client_nonce[EMBER_NONCE_LEN];
} ember_auth_result;

/* Fills buf with len cryptographically random bytes (OpenSSL RAND_bytes). */
int ember_auth_random(uint8_t *buf, size_t len);

/* HMAC-SHA256 over the concatenation of up to 3 parts (NULL/0 parts skipped). */
int ember_auth_hmac(const uint8_t *key, size_t key_len, const void *a, size_t alen,
                    const void *b, size_t blen, const void *c, size_t clen,
                    uint8_t out[EMBER_MAC_LEN]);

/* Server side, on an accepted fd.  EMBER_OK when the client proved the secret;
 * EMBER_EAUTH (message says why: "bad MAC", "expected AUTH frame, got BATCH",
 * ...) after sending REFUSED; EMBER_ETIMEDOUT / EMBER_ECLOSED / EMBER_EPROTO. */
int ember_auth_server(int fd, const uint8_t *secret, size_t secret_len,
                      int64_t deadline_ms);

/* Client side, on a connected fd.  EMBER_OK when both sides proved the secret;
 * EMBER_EAUTH if the server refused us or failed to prove itself. */
int ember_auth_client(int fd, const uint8_t *secret, size_t secret_len,
                      int64_t deadline_ms);

/* The handshakes with flags (EMBER_AUTH_ENCRYPT) and the nonces (res, may be
 * NULL).  A mode that differs from the peer's is EMBER_EAUTH, the message
 * naming the side that encrypts. */
int ember_auth_server_ex(int fd, const uint8_t *secret, size_t secret_len, uint32_t flags,
                         int64_t deadline_ms, ember_auth_result *res);
int ember_auth_client_ex(int fd, const uint8_t *secret, size_t secret_len, uint32_t flags,
                         int64_t deadline_ms, ember_auth_result *res);

/* Non-blocking server-side state machine, for poll loops that must not stall
 * on one slow client (the rendezvous server).  Usage: ember_auth_server_begin
 * writes the CHALLENGE frame into out (EMBER_WIRE_HEADER_LEN + 32 bytes); when
 * the client's first frame has arrived, ember_auth_server_check verifies it and
 * writes the reply frame (AUTH_OK, or REFUSED) into reply/reply_len.  Set
 * flags after begin (0 there); on success client_nonce holds the client's. */
typedef struct {
  uint8_t server_nonce[EMBER_NONCE_LEN];
  uint8_t client_nonce[EMBER_NONCE_LEN];
  uint32_t flags; /* EMBER_AUTH_ENCRYPT */
} ember_auth_pending;

int ember_auth_server_begin(ember_auth_pending *st, uint8_t *out, size_t cap,
                            size_t *out_len);
int ember_auth_server_check(ember_auth_pending *st, const uint8_t *secret,
                            size_t secret_len, uint16_t frame_type,
                            const uint8_t *payload, uint32_t payload_len,
                            uint8_t *reply, size_t reply_cap, size_t *reply_len);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_AUTH_H */
