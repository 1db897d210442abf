/* auth.c - mutual HMAC-SHA256 challenge/response (see auth.h for the
 * transcript).
 *
 * The two MACs use different labels ("... client" / "... server") and put the
 * nonces in opposite orders, so one side's proof can never be replayed as the
 * other's; fresh 32-byte nonces on both sides make every transcript unique. */
#include "ember/auth.h"

#include <limits.h>
#include <pthread.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <openssl/opensslv.h>
#include <openssl/rand.h>
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
#include <openssl/core_names.h>
#include <openssl/evp.h>
#endif

#include "ember/error.h"
#include "ember/net.h"
#include "ember/wire.h"

#define CLIENT_LABEL "ember-auth-v1 client"
#define SERVER_LABEL "ember-auth-v1 server"
#define ENC_CLIENT_LABEL "ember-auth-v1 client aes-256-gcm"
#define ENC_SERVER_LABEL "ember-auth-v1 server aes-256-gcm"
#define CLABEL(f) ((f) & EMBER_AUTH_ENCRYPT ? ENC_CLIENT_LABEL : CLIENT_LABEL)
#define SLABEL(f) ((f) & EMBER_AUTH_ENCRYPT ? ENC_SERVER_LABEL : SERVER_LABEL)
#define AUTH_PAYLOAD_LEN (EMBER_NONCE_LEN + EMBER_MAC_LEN)
/* A REFUSED frame from a server is small; bound what the client reads. */
#define REFUSED_MAX 4096u
/* How long a refusing server keeps trying to deliver the REFUSED frame. */
#define REFUSE_SEND_MS 1000

int ember_auth_random(uint8_t *buf, size_t len) {
  if (buf == NULL && len > 0) return ember__set_error(EMBER_EINVAL, "auth_random: NULL");
  while (len > 0) {
    int chunk = len > INT_MAX ? INT_MAX : (int)len;
    if (RAND_bytes(buf, chunk) != 1)
      return ember__set_error(EMBER_ESYS, "RAND_bytes failed (no entropy source?)");
    buf += chunk;
    len -= (size_t)chunk;
  }
  return EMBER_OK;
}

#if OPENSSL_VERSION_NUMBER >= 0x30000000L
/* EVP_MAC_fetch walks the provider tables; fetch once and share the (immutable,
 * refcounted, thread-safe) EVP_MAC.  Each call gets its own EVP_MAC_CTX. */
static EVP_MAC *g_hmac;
static pthread_once_t g_hmac_once = PTHREAD_ONCE_INIT;
static void fetch_hmac(void) { g_hmac = EVP_MAC_fetch(NULL, "HMAC", NULL); }
#endif

int ember_auth_hmac(const uint8_t *key, size_t key_len, const void *a, size_t alen,
                    const void *b, size_t blen, const void *c, size_t clen,
                    uint8_t out[EMBER_MAC_LEN]) {
  const void *parts[3] = {a, b, c};
  size_t lens[3] = {alen, blen, clen};
  int rc = EMBER_OK;
  if (key == NULL || key_len == 0 || out == NULL)
    return ember__set_error(EMBER_EINVAL, "auth_hmac: key and out are required");
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
  EVP_MAC_CTX *ctx = NULL;
  size_t outl = 0;
  char digest[] = "SHA256";
  OSSL_PARAM params[2] = {
      OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
      OSSL_PARAM_construct_end()};
  pthread_once(&g_hmac_once, fetch_hmac);
  if (g_hmac == NULL) return ember__set_error(EMBER_ESYS, "EVP_MAC_fetch(HMAC) failed");
  ctx = EVP_MAC_CTX_new(g_hmac);
  if (ctx == NULL) return ember__set_error(EMBER_ENOMEM, "EVP_MAC_CTX_new failed");
  if (EVP_MAC_init(ctx, key, key_len, params) != 1) {
    rc = ember__set_error(EMBER_ESYS, "EVP_MAC_init(HMAC-SHA256) failed");
    goto done;
  }
  for (int i = 0; i < 3; i++) {
    if (parts[i] == NULL || lens[i] == 0) continue;
    if (EVP_MAC_update(ctx, parts[i], lens[i]) != 1) {
      rc = ember__set_error(EMBER_ESYS, "EVP_MAC_update failed");
      goto done;
    }
  }
  if (EVP_MAC_final(ctx, out, &outl, EMBER_MAC_LEN) != 1 || outl != EMBER_MAC_LEN)
    rc = ember__set_error(EMBER_ESYS, "EVP_MAC_final failed");
done:
  EVP_MAC_CTX_free(ctx);
  return rc;
#else
  unsigned int outl = 0;
  HMAC_CTX *ctx = HMAC_CTX_new();
  if (ctx == NULL) return ember__set_error(EMBER_ENOMEM, "HMAC_CTX_new failed");
  if (key_len > INT_MAX || HMAC_Init_ex(ctx, key, (int)key_len, EVP_sha256(), NULL) != 1) {
    rc = ember__set_error(EMBER_ESYS, "HMAC_Init_ex failed");
    goto done;
  }
  for (int i = 0; i < 3; i++) {
    if (parts[i] == NULL || lens[i] == 0) continue;
    if (HMAC_Update(ctx, parts[i], lens[i]) != 1) {
      rc = ember__set_error(EMBER_ESYS, "HMAC_Update failed");
      goto done;
    }
  }
  if (HMAC_Final(ctx, out, &outl) != 1 || outl != EMBER_MAC_LEN)
    rc = ember__set_error(EMBER_ESYS, "HMAC_Final failed");
done:
  HMAC_CTX_free(ctx);
  return rc;
#endif
}

static int check_secret(const uint8_t *secret, size_t secret_len) {
  if (secret == NULL || secret_len < EMBER_SECRET_MIN_LEN)
    return ember__set_error(EMBER_EINVAL,
                            "auth: secret of %zu bytes is too short (minimum %u)",
                            secret ? secret_len : 0, (unsigned)EMBER_SECRET_MIN_LEN);
  return EMBER_OK;
}

/* Writes a REFUSED frame (u32 status, str reason) into out, truncating the
 * reason to fit; returns the frame length, or 0 if cap cannot hold even an
 * empty reason. */
static size_t build_refused(int status, const char *reason, uint8_t *out, size_t cap) {
  const size_t fixed = EMBER_WIRE_HEADER_LEN + 8;
  if (cap < fixed) return 0;
  size_t rlen = strlen(reason);
  if (rlen > cap - fixed) rlen = cap - fixed;
  if (rlen > 1024) rlen = 1024;
  ember_wire_encode_header(out, EMBER_MSG_REFUSED, (uint32_t)(8 + rlen));
  ember_wire_put_u32(out + EMBER_WIRE_HEADER_LEN, (uint32_t)(int32_t)status);
  ember_wire_put_u32(out + EMBER_WIRE_HEADER_LEN + 4, (uint32_t)rlen);
  memcpy(out + fixed, reason, rlen);
  return fixed + rlen;
}

/* Decodes a REFUSED payload into a status (a known negative code, else
 * EMBER_EAUTH) and a printable reason. */
static void parse_refused(const uint8_t *payload, uint32_t len, int *status,
                          char *reason, size_t cap) {
  ember_wire_reader r;
  ember_wire_reader_init(&r, payload, len);
  int32_t st = (int32_t)ember_wire_read_u32(&r);
  ember_wire_read_str(&r, reason, cap);
  if (r.err) snprintf(reason, cap, "(malformed REFUSED frame)");
  *status = (st < 0 && strcmp(ember_err_name(st), "EMBER_UNKNOWN") != 0) ? st : EMBER_EAUTH;
}

int ember_auth_server_begin(ember_auth_pending *st, uint8_t *out, size_t cap,
                            size_t *out_len) {
  if (st == NULL || out == NULL || out_len == NULL ||
      cap < EMBER_WIRE_HEADER_LEN + EMBER_NONCE_LEN)
    return ember__set_error(EMBER_EINVAL, "auth_server_begin: bad arguments");
  memset(st, 0, sizeof *st);
  int rc = ember_auth_random(st->server_nonce, EMBER_NONCE_LEN);
  if (rc != EMBER_OK) return rc;
  ember_wire_encode_header(out, EMBER_MSG_CHALLENGE, EMBER_NONCE_LEN);
  memcpy(out + EMBER_WIRE_HEADER_LEN, st->server_nonce, EMBER_NONCE_LEN);
  *out_len = EMBER_WIRE_HEADER_LEN + EMBER_NONCE_LEN;
  return EMBER_OK;
}

int ember_auth_server_check(ember_auth_pending *st, const uint8_t *secret,
                            size_t secret_len, uint16_t frame_type,
                            const uint8_t *payload, uint32_t payload_len,
                            uint8_t *reply, size_t reply_cap, size_t *reply_len) {
  uint8_t expect[EMBER_MAC_LEN], proof[EMBER_MAC_LEN];
  char reason[160];
  int rc;
  if (st == NULL || reply == NULL || reply_len == NULL ||
      reply_cap < EMBER_WIRE_HEADER_LEN + EMBER_MAC_LEN)
    return ember__set_error(EMBER_EINVAL, "auth_server_check: bad arguments");
  *reply_len = 0;
  rc = check_secret(secret, secret_len);
  if (rc != EMBER_OK) return rc;

  if (frame_type != EMBER_MSG_AUTH) {
    snprintf(reason, sizeof reason, "expected AUTH frame, got %s (type %u)",
             ember_wire_type_name(frame_type), (unsigned)frame_type);
    goto refuse;
  }
  if (payload_len != AUTH_PAYLOAD_LEN) {
    snprintf(reason, sizeof reason, "AUTH frame of %u bytes (expected %u)",
             (unsigned)payload_len, (unsigned)AUTH_PAYLOAD_LEN);
    goto refuse;
  }
  if (payload == NULL)
    return ember__set_error(EMBER_EINVAL, "auth_server_check: NULL payload");
  const uint8_t *cn = payload, *mac = payload + EMBER_NONCE_LEN;
  rc = ember_auth_hmac(secret, secret_len, CLABEL(st->flags), strlen(CLABEL(st->flags)),
                       st->server_nonce, EMBER_NONCE_LEN, cn, EMBER_NONCE_LEN, expect);
  if (rc != EMBER_OK) return rc;
  /* Constant time: a timing side channel must not reveal a MAC prefix. */
  if (CRYPTO_memcmp(expect, mac, EMBER_MAC_LEN) != 0) {
    /* The other mode's label: the secret is right, the modes differ. */
    uint32_t other = st->flags ^ EMBER_AUTH_ENCRYPT;
    rc = ember_auth_hmac(secret, secret_len, CLABEL(other), strlen(CLABEL(other)),
                         st->server_nonce, EMBER_NONCE_LEN, cn, EMBER_NONCE_LEN, expect);
    if (rc != EMBER_OK) return rc;
    if (CRYPTO_memcmp(expect, mac, EMBER_MAC_LEN) == 0)
      snprintf(reason, sizeof reason, "%s",
               st->flags & EMBER_AUTH_ENCRYPT
                   ? "encryption mismatch: the peer sends in clear but this server "
                     "encrypts its data plane (encrypt=True); both ends must agree"
                   : "encryption mismatch: the peer encrypts its data plane "
                     "(encrypt=True) but this server runs in clear; both ends must agree");
    else
      snprintf(reason, sizeof reason, "bad MAC (the peer does not know the job secret)");
    goto refuse;
  }
  memcpy(st->client_nonce, cn, EMBER_NONCE_LEN);
  rc = ember_auth_hmac(secret, secret_len, SLABEL(st->flags), strlen(SLABEL(st->flags)), cn,
                       EMBER_NONCE_LEN, st->server_nonce, EMBER_NONCE_LEN, proof);
  if (rc != EMBER_OK) return rc;
  ember_wire_encode_header(reply, EMBER_MSG_AUTH_OK, EMBER_MAC_LEN);
  memcpy(reply + EMBER_WIRE_HEADER_LEN, proof, EMBER_MAC_LEN);
  *reply_len = EMBER_WIRE_HEADER_LEN + EMBER_MAC_LEN;
  return EMBER_OK;

refuse:
  *reply_len = build_refused(EMBER_EAUTH, reason, reply, reply_cap);
  return ember__set_error(EMBER_EAUTH, "authentication failed: %s", reason);
}

/* Sends a prepared reply without disturbing the caller's error message: the
 * refusal reason matters more than whether the refused peer still listens. */
static void send_quietly(int fd, const uint8_t *buf, size_t len, int64_t deadline_ms) {
  char saved[512];
  snprintf(saved, sizeof saved, "%s", ember_last_error());
  int64_t d = ember_deadline_after(REFUSE_SEND_MS);
  (void)ember_net_send_all(fd, buf, len, d < deadline_ms ? d : deadline_ms);
  ember__set_error(0, "%s", saved);
}

int ember_auth_server(int fd, const uint8_t *secret, size_t secret_len,
                      int64_t deadline_ms) {
  return ember_auth_server_ex(fd, secret, secret_len, 0, deadline_ms, NULL);
}

int ember_auth_server_ex(int fd, const uint8_t *secret, size_t secret_len, uint32_t flags,
                         int64_t deadline_ms, ember_auth_result *res) {
  ember_auth_pending st;
  uint8_t out[EMBER_WIRE_HEADER_LEN + 256];
  uint8_t h[EMBER_WIRE_HEADER_LEN], payload[AUTH_PAYLOAD_LEN];
  ember_frame_header hdr;
  char peer[96];
  size_t n = 0;
  int rc = check_secret(secret, secret_len);
  if (rc != EMBER_OK) return rc;

  rc = ember_auth_server_begin(&st, out, sizeof out, &n);
  if (rc != EMBER_OK) return rc;
  st.flags = flags;
  rc = ember_net_send_all(fd, out, n, deadline_ms);
  if (rc != EMBER_OK) return rc;

  /* Read the header alone first: a wrong type or length is refused without
   * reading (or allocating for) whatever payload the peer claims. */
  rc = ember_net_recv_all(fd, h, sizeof h, deadline_ms);
  if (rc != EMBER_OK) return rc;
  if (ember_wire_decode_header(h, sizeof h, EMBER_WIRE_ABSOLUTE_MAX, &hdr) != EMBER_OK) {
    char reason[256];
    ember_net_peer_name(fd, peer, sizeof peer);
    snprintf(reason, sizeof reason, "expected AUTH frame: %s", ember_last_error());
    n = build_refused(EMBER_EAUTH, reason, out, sizeof out);
    ember__set_error(EMBER_EAUTH, "auth from %s: %s", peer, reason);
    send_quietly(fd, out, n, deadline_ms);
    return EMBER_EAUTH;
  }
  /* Only a well-formed AUTH has its payload read; anything else is refused
   * by ember_auth_server_check on its type and length alone. */
  const uint8_t *body = NULL;
  if (hdr.type == EMBER_MSG_AUTH && hdr.length == AUTH_PAYLOAD_LEN) {
    rc = ember_net_recv_all(fd, payload, sizeof payload, deadline_ms);
    if (rc != EMBER_OK) return rc;
    body = payload;
  }
  rc = ember_auth_server_check(&st, secret, secret_len, hdr.type, body, hdr.length, out,
                               sizeof out, &n);
  if (rc == EMBER_OK) {
    if (res != NULL) {
      memcpy(res->server_nonce, st.server_nonce, EMBER_NONCE_LEN);
      memcpy(res->client_nonce, st.client_nonce, EMBER_NONCE_LEN);
    }
    return ember_net_send_all(fd, out, n, deadline_ms);
  }
  if (rc == EMBER_EAUTH) {
    ember_net_peer_name(fd, peer, sizeof peer);
    ember__set_error(EMBER_EAUTH, "auth from %s: %s", peer, ember_last_error());
    if (n > 0) send_quietly(fd, out, n, deadline_ms);
  }
  return rc;
}

int ember_auth_client(int fd, const uint8_t *secret, size_t secret_len,
                      int64_t deadline_ms) {
  return ember_auth_client_ex(fd, secret, secret_len, 0, deadline_ms, NULL);
}

int ember_auth_client_ex(int fd, const uint8_t *secret, size_t secret_len, uint32_t flags,
                         int64_t deadline_ms, ember_auth_result *res) {
  ember_frame_header hdr;
  uint8_t *payload = NULL;
  uint8_t cn[EMBER_NONCE_LEN], msg[AUTH_PAYLOAD_LEN], expect[EMBER_MAC_LEN];
  uint8_t sn[EMBER_NONCE_LEN];
  char peer[96], reason[1025];
  int rc = check_secret(secret, secret_len);
  if (rc != EMBER_OK) return rc;
  ember_net_peer_name(fd, peer, sizeof peer);

  rc = ember_net_recv_frame(fd, REFUSED_MAX, &hdr, &payload, deadline_ms);
  if (rc != EMBER_OK) goto out;
  if (hdr.type == EMBER_MSG_REFUSED) {
    int st;
    parse_refused(payload, hdr.length, &st, reason, sizeof reason);
    rc = ember__set_error(EMBER_EAUTH, "server %s refused the connection: %s", peer, reason);
    goto out;
  }
  if (hdr.type != EMBER_MSG_CHALLENGE || hdr.length != EMBER_NONCE_LEN) {
    rc = ember__set_error(EMBER_EPROTO,
                          "auth with %s: expected a 32-byte CHALLENGE, got %s of %u bytes",
                          peer, ember_wire_type_name(hdr.type), (unsigned)hdr.length);
    goto out;
  }
  memcpy(sn, payload, EMBER_NONCE_LEN);
  free(payload);
  payload = NULL;

  rc = ember_auth_random(cn, sizeof cn);
  if (rc != EMBER_OK) goto out;
  memcpy(msg, cn, EMBER_NONCE_LEN);
  rc = ember_auth_hmac(secret, secret_len, CLABEL(flags), strlen(CLABEL(flags)), sn,
                       EMBER_NONCE_LEN, cn, EMBER_NONCE_LEN, msg + EMBER_NONCE_LEN);
  if (rc != EMBER_OK) goto out;
  rc = ember_net_send_frame(fd, EMBER_MSG_AUTH, msg, sizeof msg, deadline_ms);
  if (rc != EMBER_OK) goto out;

  rc = ember_net_recv_frame(fd, REFUSED_MAX, &hdr, &payload, deadline_ms);
  if (rc != EMBER_OK) goto out;
  if (hdr.type == EMBER_MSG_REFUSED) {
    int st;
    parse_refused(payload, hdr.length, &st, reason, sizeof reason);
    rc = ember__set_error(EMBER_EAUTH, "server %s refused authentication: %s", peer,
                          reason);
    goto out;
  }
  if (hdr.type != EMBER_MSG_AUTH_OK || hdr.length != EMBER_MAC_LEN) {
    rc = ember__set_error(EMBER_EPROTO,
                          "auth with %s: expected a 32-byte AUTH_OK, got %s of %u bytes",
                          peer, ember_wire_type_name(hdr.type), (unsigned)hdr.length);
    goto out;
  }
  rc = ember_auth_hmac(secret, secret_len, SLABEL(flags), strlen(SLABEL(flags)), cn,
                       EMBER_NONCE_LEN, sn, EMBER_NONCE_LEN, expect);
  if (rc != EMBER_OK) goto out;
  if (CRYPTO_memcmp(expect, payload, EMBER_MAC_LEN) != 0)
    rc = ember__set_error(EMBER_EAUTH,
                          "server %s failed to prove the job secret (impostor or stale "
                          "server?)",
                          peer);
  else if (res != NULL) {
    memcpy(res->server_nonce, sn, EMBER_NONCE_LEN);
    memcpy(res->client_nonce, cn, EMBER_NONCE_LEN);
  }
out:
  free(payload);
  return rc;
}
