/* spnego.c - the Negotiate header from the GSS-API (see ember/spnego.h).
 *
 * The GSS-API's own messages ("No Kerberos credentials available (default
 * cache: FILE:/tmp/krb5cc_0)") are kept in every error, after Ember's
 * sentence saying what to do.  The cases a user meets most are told apart
 * by asking the ticket cache (no ticket, an expired one) and then by the
 * GSS message, since the mechanism glue renumbers the Kerberos codes under
 * a GSS status. */
#include "ember/spnego.h"

#include <gssapi/gssapi.h>
#include <gssapi/gssapi_krb5.h>
#include <krb5/krb5.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ember/error.h"

#define STATUS_MAX 512

/* Both layers of a GSS status, as one line. */
static void status_text(OM_uint32 major, OM_uint32 minor, char *out, size_t cap) {
  size_t len = 0;
  out[0] = '\0';
  OM_uint32 codes[2] = {major, minor};
  int types[2] = {GSS_C_GSS_CODE, GSS_C_MECH_CODE};
  for (int k = 0; k < 2; k++) {
    if (codes[k] == 0) continue;
    OM_uint32 ctx = 0, min2;
    do {
      gss_buffer_desc msg = GSS_C_EMPTY_BUFFER;
      if (gss_display_status(&min2, codes[k], types[k], GSS_C_NO_OID, &ctx, &msg) !=
          GSS_S_COMPLETE)
        break;
      if (len < cap)
        len += (size_t)snprintf(out + len, cap - len, "%s%.*s", len ? "; " : "",
                                (int)msg.length, (const char *)msg.value);
      gss_release_buffer(&min2, &msg);
    } while (ctx != 0);
  }
}

void ember_spnego_principal(char *out, size_t cap) {
  OM_uint32 minor;
  gss_cred_id_t cred = GSS_C_NO_CREDENTIAL;
  gss_name_t name = GSS_C_NO_NAME;
  gss_buffer_desc text = GSS_C_EMPTY_BUFFER;
  if (cap == 0) return;
  out[0] = '\0';
  if (gss_acquire_cred(&minor, GSS_C_NO_NAME, GSS_C_INDEFINITE, GSS_C_NO_OID_SET, GSS_C_INITIATE,
                       &cred, NULL, NULL) != GSS_S_COMPLETE)
    return;
  if (gss_inquire_cred(&minor, cred, &name, NULL, NULL, NULL) == GSS_S_COMPLETE &&
      gss_display_name(&minor, name, &text, NULL) == GSS_S_COMPLETE)
    snprintf(out, cap, "%.*s", (int)text.length, (const char *)text.value);
  gss_release_buffer(&minor, &text);
  gss_release_name(&minor, &name);
  gss_release_cred(&minor, &cred);
}

static const char *cache_name(void) {
  const char *cc = getenv("KRB5CCNAME");
  return cc != NULL && cc[0] != '\0' ? cc : "the default ticket cache";
}

/* What the default ticket cache holds, for the message of a failure: the
 * mechanism glue renumbers the Kerberos error codes under a GSS status, so
 * the cache is asked directly.  TICKET_NONE also covers a missing or
 * unreadable cache. */
enum { TICKET_NONE = 0, TICKET_EXPIRED, TICKET_VALID };

static int ticket_state(char *who, size_t cap, time_t *end) {
  krb5_context k = NULL;
  krb5_ccache cc = NULL;
  krb5_principal me = NULL;
  krb5_cc_cursor cur;
  krb5_creds c;
  int state = TICKET_NONE;
  who[0] = '\0';
  *end = 0;
  if (krb5_init_context(&k) != 0) return TICKET_NONE;
  if (krb5_cc_default(k, &cc) != 0 || krb5_cc_get_principal(k, cc, &me) != 0) goto done;
  char *name = NULL;
  if (krb5_unparse_name(k, me, &name) == 0) {
    snprintf(who, cap, "%s", name);
    krb5_free_unparsed_name(k, name);
  }
  if (krb5_cc_start_seq_get(k, cc, &cur) != 0) goto done;
  while (krb5_cc_next_cred(k, cc, &cur, &c) == 0) {
    /* the ticket-granting ticket: krbtgt/REALM@REALM */
    if (krb5_princ_size(k, c.server) == 2 &&
        krb5_princ_component(k, c.server, 0)->length == 6 &&
        memcmp(krb5_princ_component(k, c.server, 0)->data, "krbtgt", 6) == 0) {
      time_t e = (time_t)(uint32_t)c.times.endtime;
      if (e > *end) *end = e;
    }
    krb5_free_cred_contents(k, &c);
  }
  krb5_cc_end_seq_get(k, cc, &cur);
  state = *end == 0 ? TICKET_NONE : *end <= time(NULL) ? TICKET_EXPIRED : TICKET_VALID;
done:
  if (me != NULL) krb5_free_principal(k, me);
  if (cc != NULL) krb5_cc_close(k, cc);
  krb5_free_context(k);
  return state;
}

/* The message for a failed gss_init_sec_context. */
static int init_error(OM_uint32 major, OM_uint32 minor, const char *host, const char *what) {
  char gss[STATUS_MAX], who[256];
  status_text(major, minor, gss, sizeof gss);
  time_t end;
  int state = ticket_state(who, sizeof who, &end);
  const char *conf = getenv("KRB5_CONFIG");
  const char *keytab = getenv("KRB5_CLIENT_KTNAME");
  if (state == TICKET_NONE && (keytab == NULL || keytab[0] == '\0'))
    return ember__set_error(
        EMBER_EAUTH,
        "%s requires Kerberos and there is no Kerberos ticket in %s: run `kinit <you>@<REALM>` "
        "(or `kinit -kt <keytab> <principal>`), set KRB5CCNAME to the cache that holds your "
        "ticket, or KRB5_CLIENT_KTNAME to a keytab (%s)",
        what, cache_name(), gss);
  if (state == TICKET_EXPIRED && (keytab == NULL || keytab[0] == '\0')) {
    char when[64];
    struct tm tm;
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", gmtime_r(&end, &tm));
    return ember__set_error(EMBER_EAUTH,
                            "%s requires Kerberos and the ticket of %s in %s expired at %s: run "
                            "`kinit` again (`kinit -R` renews a renewable ticket) (%s)",
                            what, who, cache_name(), when, gss);
  }
  if (strstr(gss, "not found in Kerberos database") != NULL)
    return ember__set_error(
        EMBER_EAUTH,
        "%s: the KDC knows no service principal HTTP/%s: address the service by the host name "
        "in its SPNEGO principal (for HDFS dfs.web.authentication.kerberos.principal, usually "
        "its fully qualified name; check dfs.namenode.http-address in HADOOP_CONF_DIR) (%s)",
        what, host, gss);
  if (strstr(gss, "Cannot contact any KDC") != NULL || strstr(gss, "Cannot find KDC") != NULL ||
      strstr(gss, "Configuration file does not specify default realm") != NULL)
    return ember__set_error(EMBER_EAUTH,
                            "%s requires Kerberos and the KDC cannot be reached or found: check "
                            "the realm's kdc in %s (%s)",
                            what, conf != NULL ? conf : "/etc/krb5.conf (KRB5_CONFIG is not set)",
                            gss);
  if (strstr(gss, "Clock skew") != NULL)
    return ember__set_error(EMBER_EAUTH,
                            "%s: this host's clock is too far from the KDC's for Kerberos: "
                            "synchronise it (NTP) (%s)",
                            what, gss);
  return ember__set_error(EMBER_EAUTH, "%s: Kerberos authentication of %s failed (%s)", what,
                          who[0] ? who : "this process", gss);
}

int ember_spnego_header(const char *host, const char *what, char **header) {
  *header = NULL;
  OM_uint32 major, minor;
  char svc[512];
  if (snprintf(svc, sizeof svc, "HTTP@%s", host) >= (int)sizeof svc)
    return ember__set_error(EMBER_EINVAL, "%s: host name too long for Kerberos", what);
  gss_buffer_desc name_buf = {strlen(svc), svc};
  gss_name_t target = GSS_C_NO_NAME;
  major = gss_import_name(&minor, &name_buf, GSS_C_NT_HOSTBASED_SERVICE, &target);
  if (GSS_ERROR(major)) {
    char gss[STATUS_MAX];
    status_text(major, minor, gss, sizeof gss);
    return ember__set_error(EMBER_EAUTH, "%s: bad Kerberos service name %s (%s)", what, svc, gss);
  }
  /* SPNEGO's OID: Hadoop's AuthenticationFilter takes both SPNEGO and bare
   * Kerberos tokens; SPNEGO is what browsers and curl send. */
  static gss_OID_desc spnego = {6, (void *)"\x2b\x06\x01\x05\x05\x02"};
  gss_ctx_id_t ctx = GSS_C_NO_CONTEXT;
  gss_buffer_desc out = GSS_C_EMPTY_BUFFER;
  major = gss_init_sec_context(&minor, GSS_C_NO_CREDENTIAL, &ctx, target, &spnego,
                               0, 0, GSS_C_NO_CHANNEL_BINDINGS,
                               GSS_C_NO_BUFFER, NULL, &out, NULL, NULL);
  OM_uint32 min2;
  gss_release_name(&min2, &target);
  int rc = EMBER_OK;
  if (GSS_ERROR(major)) {
    rc = init_error(major, minor, host, what);
  } else if (out.length == 0 || out.length > (64u << 10)) {
    rc = ember__set_error(EMBER_EAUTH, "%s: the GSS-API produced no usable token (%zu bytes)",
                          what, (size_t)out.length);
  } else {
    static const char prefix[] = "Authorization: Negotiate ";
    size_t b64 = 4 * ((out.length + 2) / 3);
    char *h = malloc(sizeof prefix + b64);
    if (h == NULL) {
      rc = ember__set_error(EMBER_ENOMEM, "%s: out of memory", what);
    } else {
      memcpy(h, prefix, sizeof prefix - 1);
      EVP_EncodeBlock((unsigned char *)h + sizeof prefix - 1, out.value, (int)out.length);
      *header = h;
    }
  }
  gss_release_buffer(&min2, &out);
  if (ctx != GSS_C_NO_CONTEXT) gss_delete_sec_context(&min2, &ctx, GSS_C_NO_BUFFER);
  return rc;
}
