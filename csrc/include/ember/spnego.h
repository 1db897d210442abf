/* ember/spnego.h - Kerberos for HTTP clients (SPNEGO, RFC 4559), through
 * the system's GSS-API (MIT Kerberos).
 *
 * A Kerberized Hadoop's web endpoints (WebHDFS, the ResourceManager's REST
 * API) take "Authorization: Negotiate <token>", where the token is a
 * Kerberos AP-REQ for the service principal HTTP/<host>@<realm>.  The
 * client's credentials are whatever MIT Kerberos finds by itself: the
 * ticket cache (KRB5CCNAME, or the default cache filled by `kinit`), or a
 * client keytab (KRB5_CLIENT_KTNAME), from which the library gets a ticket
 * on demand.  The realm and KDC come from krb5.conf (KRB5_CONFIG).  The
 * service ticket is cached in the ticket cache after the first request, so
 * a token costs the KDC nothing afterwards.
 *
 * Errors are EMBER_EAUTH with a message that says what is wrong and what
 * to do (no ticket: kinit; an expired ticket; a service principal the KDC
 * does not know; an unreachable KDC), decided locally or by one KDC
 * exchange, never after retries.
 *
 * Thread-safety: every function may be called from any thread at once.
 */
#ifndef EMBER_SPNEGO_H
#define EMBER_SPNEGO_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A header line "Authorization: Negotiate <base64 token>" for a request to
 * the service HTTP@host (host as in the request's URL, without port).  On
 * success *header is malloc'd (the caller frees it).  `what` names the
 * service in error messages ("the NameNode localhost:9870").  Blocks for at
 * most one exchange with the KDC (its timeouts are krb5.conf's). */
int ember_spnego_header(const char *host, const char *what, char **header);

/* The principal the GSS-API would authenticate as ("alice@EXAMPLE.COM"),
 * written to out (empty when there are no usable credentials).  For
 * messages. */
void ember_spnego_principal(char *out, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* EMBER_SPNEGO_H */
