/* webhdfs.c - HDFS over WebHDFS with libcurl (see ember/webhdfs.h).
 *
 * Every operation is one or two HTTP requests: to the NameNode, and for
 * data (OPEN, CREATE, APPEND) to the DataNode its 307 redirect names.
 * Redirects are followed by hand, not by curl, so that a request body is
 * sent only to the DataNode, errors say which side failed, and a read that
 * loses its DataNode goes back through the NameNode (which may choose
 * another replica).  One easy handle per file / writer / call keeps its
 * connections alive across the ranges of a file.
 *
 * Authentication, to the NameNode only (its redirects carry a delegation
 * token the DataNode checks): on a simple-auth cluster the user name as a
 * query parameter; on a Kerberized one (core-site.xml says so, or the
 * NameNode answers 401) the HDFS delegation token from the process's
 * Hadoop token file when it has one for this NameNode (YARN containers,
 * Spark executors), else SPNEGO from the user's Kerberos ticket. */
#include "ember/webhdfs.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <errno.h>
#include <netdb.h>
#include <pthread.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ember/error.h"
#include "hadoop_conf.h"
#include "hadoop_token.h"
#include "json.h"
#include "ember/spnego.h"

#define MAX_NAMENODES 8
/* Bodies of error replies kept for the message (a RemoteException is small). */
#define ERR_BODY_MAX (64u << 10)
/* Longest URL we build or accept in a Location header. */
#define URL_MAX (16u << 10)
#define DISPLAY_MAX 512

/* ================================================================ curl init */

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc = CURLE_OK;

static void curl_init(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

static int ensure_curl(void) {
  pthread_once(&curl_once, curl_init);
  if (curl_init_rc != CURLE_OK)
    return ember__set_error(EMBER_EIO, "webhdfs: libcurl initialisation failed: %s",
                            curl_easy_strerror(curl_init_rc));
  return EMBER_OK;
}

/* ================================================================ strings */

typedef struct {
  char *p;
  size_t len, cap;
  int oom;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (p == NULL) {
      b->oom = 1;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

/* Percent-encodes s; keeps RFC 3986 unreserved characters (and '/' if
 * keep_slash). */
static void sb_pct(sbuf *b, const char *s, int keep_slash) {
  static const char hex[] = "0123456789ABCDEF";
  for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
    if ((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
        *c == '-' || *c == '.' || *c == '_' || *c == '~' || (keep_slash && *c == '/')) {
      sb_add(b, (const char *)c, 1);
    } else {
      char e[3] = {'%', hex[*c >> 4], hex[*c & 15]};
      sb_add(b, e, 3);
    }
  }
}

/* "host:port" of an http(s) URL, for messages. */
static void host_of(const char *url, char *out, size_t cap) {
  const char *h = strstr(url, "://");
  h = h ? h + 3 : url;
  size_t n = strcspn(h, "/?#");
  snprintf(out, cap, "%.*s", (int)(n < 200 ? n : 200), h);
}

static void sleep_ms(int64_t ms) {
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
  }
}

/* ================================================================ endpoint */

enum { AUTH_SIMPLE = 0, AUTH_TOKEN, AUTH_KERBEROS };

typedef struct {
  char *bases[MAX_NAMENODES]; /* "http(s)://host:port", no trailing slash */
  size_t nbases;
  size_t cur;                 /* the NameNode that answered last */
  char *path;                 /* absolute HDFS path */
  char *user;
  char display[DISPLAY_MAX];  /* the URL as given, for messages */
  int64_t timeout_ms;
  size_t range;
  int retries;
  CURL *curl;
  ember_webhdfs_stats stats;
  int auth;                   /* AUTH_* */
  int auth_settled;           /* Kerberos chosen (by the configuration or a 401) */
  char *token;                /* AUTH_TOKEN: Token.encodeToUrlString() */
  char token_desc[DISPLAY_MAX];
  char rpc_auth[256];         /* the hdfs:// authority, for matching tokens */
} endpoint;

static void ep_free(endpoint *ep) {
  for (size_t i = 0; i < ep->nbases; i++) free(ep->bases[i]);
  free(ep->path);
  free(ep->user);
  free(ep->token);
  if (ep->curl) curl_easy_cleanup(ep->curl);
  memset(ep, 0, sizeof *ep);
}

static int add_base(endpoint *ep, const char *scheme, const char *hostport, size_t n) {
  if (ep->nbases >= MAX_NAMENODES) return EMBER_OK;
  sbuf b = {0};
  sb_str(&b, scheme);
  sb_str(&b, "://");
  sb_add(&b, hostport, n);
  while (b.len > 0 && b.p[b.len - 1] == '/') b.p[--b.len] = '\0';
  if (b.oom) {
    free(b.p);
    return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
  }
  ep->bases[ep->nbases++] = b.p;
  return EMBER_OK;
}

static int valid_authority(const char *a, size_t n) {
  for (size_t i = 0; i < n; i++) {
    char c = a[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          c == '.' || c == '-' || c == '_' || c == ':' || c == '[' || c == ']'))
      return 0;
  }
  return 1;
}

/* The authority of an hdfs:// URI ("host:port"), or NULL. */
static const char *hdfs_authority(const char *uri, size_t *n) {
  if (uri == NULL || strncmp(uri, "hdfs://", 7) != 0) return NULL;
  *n = strcspn(uri + 7, "/");
  return uri + 7;
}

/* Replaces a wildcard host ("0.0.0.0:9870") by `host`. */
static int add_conf_address(endpoint *ep, const char *scheme, const char *addr,
                            const char *host, size_t host_len) {
  if (strncmp(addr, "0.0.0.0:", 8) == 0 && host_len > 0) {
    sbuf b = {0};
    const char *colon = memchr(host, ':', host_len);
    sb_add(&b, host, colon ? (size_t)(colon - host) : host_len);
    sb_str(&b, addr + 7);
    if (b.oom) {
      free(b.p);
      return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
    }
    int rc = add_base(ep, scheme, b.p, b.len);
    free(b.p);
    return rc;
  }
  return add_base(ep, scheme, addr, strlen(addr));
}

/* NameNode HTTP addresses for an hdfs:// authority, from the configuration
 * (see the header for the rules).  Adds nothing when it has no answer. */
static int resolve_from_conf(endpoint *ep, const ember__conf *conf, const char *auth,
                             size_t auth_len) {
  const char *policy = ember__conf_get(conf, "dfs.http.policy");
  int https = policy != NULL && strcmp(policy, "HTTPS_ONLY") == 0;
  const char *scheme = https ? "https" : "http";
  const char *key = https ? "dfs.namenode.https-address" : "dfs.namenode.http-address";
  char name[512];
  int rc;

  /* HA nameservice: dfs.ha.namenodes.<ns> = nn1,nn2 */
  snprintf(name, sizeof name, "dfs.ha.namenodes.%.*s", (int)auth_len, auth);
  const char *ids = auth_len < 256 ? ember__conf_get(conf, name) : NULL;
  if (ids != NULL) {
    const char *p = ids;
    while (*p) {
      size_t n = strcspn(p, ",");
      const char *id = p;
      size_t idn = n;
      while (idn > 0 && (*id == ' ' || *id == '\t' || *id == '\n')) {
        id++;
        idn--;
      }
      while (idn > 0 && (id[idn - 1] == ' ' || id[idn - 1] == '\t' || id[idn - 1] == '\n')) idn--;
      if (idn > 0 && idn < 128) {
        snprintf(name, sizeof name, "%s.%.*s.%.*s", key, (int)auth_len, auth, (int)idn, id);
        const char *addr = ember__conf_get(conf, name);
        if (addr != NULL && (rc = add_conf_address(ep, scheme, addr, "", 0)) != EMBER_OK) return rc;
      }
      p += n;
      if (*p == ',') p++;
    }
    if (ep->nbases == 0)
      return ember__set_error(EMBER_EINVAL,
                              "webhdfs %s: HA nameservice '%.*s' lists NameNodes (%s) but "
                              "none has a %s.%.*s.<id>",
                              ep->display, (int)auth_len, auth, ids, key, (int)auth_len, auth);
    return EMBER_OK;
  }
  /* federation without HA: dfs.namenode.http-address.<ns> */
  snprintf(name, sizeof name, "%s.%.*s", key, (int)(auth_len < 256 ? auth_len : 0), auth);
  const char *addr = auth_len < 256 && auth_len > 0 ? ember__conf_get(conf, name) : NULL;
  if (addr != NULL) return add_conf_address(ep, scheme, addr, auth, auth_len);

  /* the single NameNode of this configuration, if the URL names it */
  addr = ember__conf_get(conf, key);
  if (addr == NULL) return EMBER_OK;
  const char *rpc = ember__conf_get(conf, "dfs.namenode.rpc-address");
  size_t dn = 0;
  const char *dfs = hdfs_authority(ember__conf_get(conf, "fs.defaultFS"), &dn);
  int matches = auth_len == 0 ||
                (rpc != NULL && strlen(rpc) == auth_len && memcmp(rpc, auth, auth_len) == 0) ||
                (dfs != NULL && dn == auth_len && memcmp(dfs, auth, auth_len) == 0);
  if (!matches) return EMBER_OK;
  return add_conf_address(ep, scheme, addr, auth, auth_len);
}

static char *default_user(void) {
  const char *u = getenv("HADOOP_USER_NAME");
  if (u != NULL && u[0] != '\0') return strdup(u);
  char buf[4096];
  struct passwd pw, *res = NULL;
  if (getpwuid_r(geteuid(), &pw, buf, sizeof buf, &res) == 0 && res != NULL && res->pw_name)
    return strdup(res->pw_name);
  u = getenv("USER");
  return strdup(u != NULL && u[0] != '\0' ? u : "nobody");
}

/* ================================================================ auth */

/* The kinds of token a NameNode's WebHDFS takes as delegation=. */
static const char *const HDFS_TOKEN_KINDS[] = {"HDFS_DELEGATION_TOKEN", "WEBHDFS delegation",
                                               "SWEBHDFS delegation"};

/* Whether a token's service names the NameNode whose RPC authority is a
 * ("host:port", or an HA nameservice): Hadoop writes "ip:port" (its default,
 * hadoop.security.token.service.use_ip), "host:port", or
 * "ha-hdfs:<nameservice>". */
static int service_matches(const char *service, const char *a) {
  if (a[0] == '\0') return 0;
  if (strcmp(service, a) == 0) return 1;
  if (strncmp(service, "ha-hdfs:", 8) == 0 && strcmp(service + 8, a) == 0) return 1;
  const char *colon = strrchr(a, ':'), *scolon = strrchr(service, ':');
  if (colon == NULL || scolon == NULL || strcmp(colon, scolon) != 0) return 0;
  char host[256];
  snprintf(host, sizeof host, "%.*s", (int)(colon - a), a);
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_INET;
  if (getaddrinfo(host, NULL, &hints, &res) != 0) return 0;
  int match = 0;
  size_t slen = (size_t)(scolon - service);
  for (struct addrinfo *ai = res; ai != NULL && !match; ai = ai->ai_next) {
    char ip[INET_ADDRSTRLEN];
    const struct sockaddr_in *sin = (const struct sockaddr_in *)(const void *)ai->ai_addr;
    if (inet_ntop(AF_INET, &sin->sin_addr, ip, sizeof ip) != NULL && strlen(ip) == slen &&
        memcmp(ip, service, slen) == 0)
      match = 1;
  }
  freeaddrinfo(res);
  return match;
}

static int set_user(endpoint *ep, const char *user) {
  char *u = strdup(user);
  if (u == NULL) return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
  free(ep->user);
  ep->user = u;
  return EMBER_OK;
}

/* The cluster is Kerberized: the HDFS delegation token for this NameNode
 * from the process's Hadoop token file (what YARN gives containers and
 * Spark its executors), else SPNEGO with the user's own ticket.  A token
 * file with one HDFS token is taken whatever its service says (a NameNode
 * known by another name); with several, the one for this NameNode. */
static int use_kerberos(endpoint *ep) {
  ep->auth_settled = 1;
  ep->auth = AUTH_KERBEROS;
  const char *file = getenv("HADOOP_TOKEN_FILE_LOCATION");
  if (file == NULL || file[0] == '\0') {
    char who[256];
    ember_spnego_principal(who, sizeof who);
    return who[0] ? set_user(ep, who) : EMBER_OK;
  }
  ember__credentials creds;
  memset(&creds, 0, sizeof creds);
  int rc = ember__credentials_load(&creds, file);
  if (rc != EMBER_OK)
    return ember__set_error(EMBER_EAUTH,
                            "webhdfs %s: HADOOP_TOKEN_FILE_LOCATION names a token file Ember "
                            "cannot use: %s",
                            ep->display, ember_last_error());
  const ember__token *pick = NULL, *only = NULL;
  size_t nhdfs = 0;
  for (size_t i = 0; i < creds.n; i++) {
    const ember__token *t = &creds.tokens[i];
    int hdfs_kind = 0;
    for (size_t k = 0; k < sizeof HDFS_TOKEN_KINDS / sizeof *HDFS_TOKEN_KINDS; k++)
      if (strcmp(t->kind, HDFS_TOKEN_KINDS[k]) == 0) hdfs_kind = 1;
    if (!hdfs_kind) continue;
    nhdfs++;
    only = t;
    if (pick == NULL && service_matches(t->service, ep->rpc_auth)) pick = t;
  }
  if (pick == NULL && nhdfs == 1) pick = only;
  if (pick != NULL) {
    ember__token_ident id;
    memset(&id, 0, sizeof id);
    int have_id = ember__token_ident_parse(pick, &id) == EMBER_OK;
    ember_clear_error();
    rc = ember__token_encode_url(pick, &ep->token);
    if (rc == EMBER_OK) {
      ep->auth = AUTH_TOKEN;
      snprintf(ep->token_desc, sizeof ep->token_desc,
               "the %s token for %s%s%s from HADOOP_TOKEN_FILE_LOCATION=%s", pick->kind,
               pick->service, have_id ? " owned by " : "", have_id ? id.owner : "", file);
      if (have_id && id.owner != NULL && id.owner[0] != '\0') rc = set_user(ep, id.owner);
    }
    if (have_id) ember__token_ident_free(&id);
  } else {
    snprintf(ep->token_desc, sizeof ep->token_desc,
             "HADOOP_TOKEN_FILE_LOCATION=%s holds %zu HDFS token%s, none for %s", file, nhdfs,
             nhdfs == 1 ? "" : "s", ep->rpc_auth[0] ? ep->rpc_auth : "this NameNode");
  }
  ember__credentials_free(&creds);
  return rc;
}

/* Whether dir's core-site.xml says hadoop.security.authentication=kerberos. */
static int conf_says_kerberos(const ember__conf *conf) {
  const char *a = ember__conf_get(conf, "hadoop.security.authentication");
  return a != NULL && strcasecmp(a, "kerberos") == 0;
}

/* Parses url, resolves the NameNode(s) and the user, creates the handle. */
static int ep_init(endpoint *ep, const char *url, const ember_webhdfs_opts *opts_in) {
  memset(ep, 0, sizeof *ep);
  ember_webhdfs_opts opts;
  if (opts_in != NULL) opts = *opts_in;
  else ember_webhdfs_opts_init(&opts);
  if (url == NULL) return ember__set_error(EMBER_EINVAL, "webhdfs: URL is NULL");
  snprintf(ep->display, sizeof ep->display, "%s", url);
  int rc = ensure_curl();
  if (rc != EMBER_OK) return rc;

  ep->timeout_ms = opts.timeout_ms > 0 ? opts.timeout_ms : EMBER_WEBHDFS_DEFAULT_TIMEOUT_MS;
  ep->range = opts.range_bytes ? opts.range_bytes : EMBER_WEBHDFS_DEFAULT_RANGE;
  if (ep->range > EMBER_WEBHDFS_MAX_RANGE)
    return ember__set_error(EMBER_EINVAL, "webhdfs %s: range_bytes %zu is over the limit %u",
                            ep->display, ep->range, EMBER_WEBHDFS_MAX_RANGE);
  ep->retries = opts.retries >= 0 ? opts.retries : EMBER_WEBHDFS_DEFAULT_RETRIES;

  /* scheme://authority/path */
  const char *sep = strstr(url, "://");
  size_t slen = sep ? (size_t)(sep - url) : 0;
  int is_hdfs = slen == 4 && strncmp(url, "hdfs", 4) == 0;
  int is_web = slen == 7 && strncmp(url, "webhdfs", 7) == 0;
  int is_sweb = slen == 8 && strncmp(url, "swebhdfs", 8) == 0;
  if (!is_hdfs && !is_web && !is_sweb)
    return ember__set_error(EMBER_EINVAL,
                            "webhdfs: unsupported URL '%s' (expected hdfs://, webhdfs:// or "
                            "swebhdfs://)",
                            ep->display);
  const char *auth = sep + 3;
  size_t auth_len = strcspn(auth, "/");
  if (!valid_authority(auth, auth_len))
    return ember__set_error(EMBER_EINVAL, "webhdfs: bad host:port in URL '%s'", ep->display);
  const char *path = auth + auth_len;
  for (const char *c = path; *c; c++)
    if ((unsigned char)*c < 0x20 || *c == 0x7f)
      return ember__set_error(EMBER_EINVAL, "webhdfs: control character in path of '%s'",
                              ep->display);
  if (strlen(path) > URL_MAX / 4)
    return ember__set_error(EMBER_EINVAL, "webhdfs: path too long in '%s'", ep->display);
  ep->path = strdup(path[0] ? path : "/");
  if (ep->path == NULL) return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");

  int kerberos = 0;
  if (opts.namenode != NULL && opts.namenode[0] != '\0') {
    const char *nn = opts.namenode, *scheme = "http";
    if (strncmp(nn, "http://", 7) == 0) nn += 7;
    else if (strncmp(nn, "https://", 8) == 0) nn += 8, scheme = "https";
    size_t n = strcspn(nn, "/");
    if (n == 0 || !valid_authority(nn, n))
      return ember__set_error(EMBER_EINVAL, "webhdfs: bad NameNode address '%s'", opts.namenode);
    rc = add_base(ep, scheme, nn, n);
  } else if (!is_hdfs) {
    if (auth_len == 0)
      return ember__set_error(EMBER_EINVAL, "webhdfs: URL '%s' names no host", ep->display);
    rc = add_base(ep, is_sweb ? "https" : "http", auth, auth_len);
  } else {
    const char *dir = opts.conf_dir ? opts.conf_dir : getenv("HADOOP_CONF_DIR");
    ember__conf conf = {0};
    rc = EMBER_OK;
    kerberos = 0;
    if (dir != NULL && dir[0] != '\0') {
      rc = ember__conf_load(&conf, dir, "core-site.xml");
      if (rc == EMBER_ENOTFOUND) rc = EMBER_OK;
      if (rc == EMBER_OK) rc = ember__conf_load(&conf, dir, "hdfs-site.xml");
      if (rc == EMBER_ENOTFOUND) rc = EMBER_OK;
    }
    if (rc == EMBER_OK && auth_len == 0) {
      auth = hdfs_authority(ember__conf_get(&conf, "fs.defaultFS"), &auth_len);
      if (auth == NULL) auth_len = 0;
    }
    if (auth != NULL && auth_len < sizeof ep->rpc_auth)
      snprintf(ep->rpc_auth, sizeof ep->rpc_auth, "%.*s", (int)auth_len, auth);
    kerberos = conf_says_kerberos(&conf);
    if (rc == EMBER_OK) rc = resolve_from_conf(ep, &conf, auth ? auth : "", auth_len);
    ember__conf_free(&conf);
    if (rc == EMBER_OK && ep->nbases == 0) {
      if (auth_len == 0)
        return ember__set_error(EMBER_EINVAL,
                                "webhdfs: '%s' names no NameNode: give its HTTP address "
                                "(namenode=) or a HADOOP_CONF_DIR with fs.defaultFS and "
                                "dfs.namenode.http-address%s",
                                ep->display, dir ? "" : " (HADOOP_CONF_DIR is not set)");
      /* Hadoop's default HTTP port on the URL's host */
      const char *colon = memchr(auth, ':', auth_len);
      sbuf b = {0};
      sb_add(&b, auth, colon ? (size_t)(colon - auth) : auth_len);
      char port[16];
      snprintf(port, sizeof port, ":%d", EMBER_WEBHDFS_DEFAULT_HTTP_PORT);
      sb_str(&b, port);
      rc = b.oom ? ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory")
                 : add_base(ep, "http", b.p, b.len);
      free(b.p);
    }
  }
  if (rc != EMBER_OK) return rc;

  ep->user = opts.user && opts.user[0] ? strdup(opts.user) : default_user();
  if (ep->user == NULL) return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
  ep->curl = curl_easy_init();
  if (ep->curl == NULL) return ember__set_error(EMBER_ENOMEM, "webhdfs: curl_easy_init failed");
  return kerberos ? use_kerberos(ep) : EMBER_OK;
}

/* base/webhdfs/v1<path>?op=OP&user.name=U<extra> */
static char *nn_url(const endpoint *ep, const char *base, const char *op, const char *extra) {
  sbuf b = {0};
  sb_str(&b, base);
  sb_str(&b, "/webhdfs/v1");
  sb_pct(&b, ep->path, 1);
  sb_str(&b, "?op=");
  sb_str(&b, op);
  if (ep->auth == AUTH_SIMPLE) {
    sb_str(&b, "&user.name=");
    sb_pct(&b, ep->user, 0);
  } else if (ep->auth == AUTH_TOKEN) {
    sb_str(&b, "&delegation=");
    sb_str(&b, ep->token); /* URL-safe base64 already */
  }
  if (extra) sb_str(&b, extra);
  if (b.oom) {
    free(b.p);
    return NULL;
  }
  return b.p;
}

/* ================================================================ HTTP */

enum { SINK_NONE = 0, SINK_DATA, SINK_JSON };

typedef struct {
  CURL *curl;
  int mode;
  uint8_t *data; /* SINK_DATA: fixed buffer */
  size_t data_len, data_cap;
  int overflow;
  sbuf json;     /* SINK_JSON: 2xx body, up to EMBER_WEBHDFS_MAX_JSON */
  sbuf err;      /* non-2xx body, up to ERR_BODY_MAX (then truncated) */
} sink;

static size_t on_body(char *p, size_t size, size_t nmemb, void *ud) {
  sink *s = ud;
  size_t n = size * nmemb;
  long code = 0;
  curl_easy_getinfo(s->curl, CURLINFO_RESPONSE_CODE, &code);
  if (code < 200 || code > 299) {
    size_t room = s->err.len < ERR_BODY_MAX ? ERR_BODY_MAX - s->err.len : 0;
    sb_add(&s->err, p, n < room ? n : room);
    return n;
  }
  if (s->mode == SINK_DATA) {
    if (n > s->data_cap - s->data_len) {
      s->overflow = 1; /* more than asked for: refuse, abort the transfer */
      return 0;
    }
    memcpy(s->data + s->data_len, p, n);
    s->data_len += n;
    return n;
  }
  if (s->mode == SINK_JSON) {
    if (n > EMBER_WEBHDFS_MAX_JSON - s->json.len) {
      s->overflow = 1;
      return 0;
    }
    sb_add(&s->json, p, n);
    if (s->json.oom) return 0;
  }
  return n;
}

typedef struct {
  const uint8_t *p;
  size_t len, pos;
} upload;

static size_t on_upload(char *buf, size_t size, size_t nmemb, void *ud) {
  upload *u = ud;
  size_t n = size * nmemb, left = u->len - u->pos;
  if (n > left) n = left;
  if (n == 0) return 0;
  memcpy(buf, u->p + u->pos, n);
  u->pos += n;
  return n;
}

typedef struct {
  long status;
  char *location; /* Location of a 3xx, malloc'd */
  CURLcode cc;
  char curl_msg[CURL_ERROR_SIZE];
} reply;

enum { T_STALL = 0, T_TOTAL = 1 };

/* One HTTP exchange.  Returns EMBER_OK when a reply was received (any
 * status, in r), or the transport failure: EMBER_ETIMEDOUT / EMBER_EIO (no
 * message set; the caller names the operation) or EMBER_ENOMEM. */
static int http_once(endpoint *ep, const char *method, const char *url, const void *body,
                     size_t body_len, int timeout_kind, const char *auth_header, sink *s,
                     reply *r) {
  CURL *c = ep->curl;
  memset(r, 0, sizeof *r);
  s->curl = c;
  curl_easy_reset(c);
  struct curl_slist *hdr = NULL;
  upload up = {body, body_len, 0};
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
#if LIBCURL_VERSION_NUM >= 0x075500
  curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
#else
  curl_easy_setopt(c, CURLOPT_PROTOCOLS, (long)(CURLPROTO_HTTP | CURLPROTO_HTTPS));
#endif
  curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
  /* Cluster traffic goes direct, as Hadoop's own clients do: an http_proxy
   * set for the internet must not capture NameNode/DataNode requests. */
  curl_easy_setopt(c, CURLOPT_PROXY, "");
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, r->curl_msg);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)ep->timeout_ms);
  /* a stall: less than 1 byte/s for the timeout (curl counts in seconds) */
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, (long)((ep->timeout_ms + 999) / 1000));
  if (timeout_kind == T_TOTAL) curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)ep->timeout_ms);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, s);
  /* no "Expect: 100-continue" round trip before a body */
  hdr = curl_slist_append(hdr, "Expect:");
  if (body != NULL) hdr = curl_slist_append(hdr, "Content-Type: application/octet-stream");
  if (auth_header != NULL && hdr != NULL) hdr = curl_slist_append(hdr, auth_header);
  if (hdr == NULL) return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdr);
  if (strcmp(method, "PUT") == 0) {
    curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(c, CURLOPT_READFUNCTION, on_upload);
    curl_easy_setopt(c, CURLOPT_READDATA, &up);
    curl_easy_setopt(c, CURLOPT_INFILESIZE_LARGE, (curl_off_t)body_len);
  } else if (strcmp(method, "POST") == 0) {
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_READFUNCTION, on_upload);
    curl_easy_setopt(c, CURLOPT_READDATA, &up);
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
  } else if (strcmp(method, "DELETE") == 0) {
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, "DELETE");
  }
  ep->stats.requests++;
  r->cc = curl_easy_perform(c);
  /* nothing of this call's stack may stay referenced by the handle */
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, NULL);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, NULL);
  curl_slist_free_all(hdr);
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &r->status);
  if (r->cc != CURLE_OK) {
    if (r->curl_msg[0] == '\0')
      snprintf(r->curl_msg, sizeof r->curl_msg, "%s", curl_easy_strerror(r->cc));
    if (s->json.oom || s->err.oom) return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
    return r->cc == CURLE_OPERATION_TIMEDOUT ? EMBER_ETIMEDOUT : EMBER_EIO;
  }
  if (r->status >= 300 && r->status <= 399) {
    char *loc = NULL;
    curl_easy_getinfo(c, CURLINFO_REDIRECT_URL, &loc);
    if (loc != NULL) {
      r->location = strdup(loc);
      if (r->location == NULL) return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
    }
  }
  return EMBER_OK;
}

static void sink_reset(sink *s) {
  s->data_len = 0;
  s->overflow = 0;
  s->json.len = 0;
  s->err.len = 0;
  if (s->json.p) s->json.p[0] = '\0';
  if (s->err.p) s->err.p[0] = '\0';
}

static void sink_free(sink *s) {
  free(s->json.p);
  free(s->err.p);
}

/* ================================================================ errors */

/* A delegation token the NameNode refused: expired, cancelled, or from
 * another NameNode. */
static int token_error(const endpoint *ep, const char *op, const char *exc, const char *msg,
                       ember__json *j) {
  int rc = ember__set_error(
      EMBER_EAUTH,
      "webhdfs %s %s: the NameNode refused %s (%s: %s): delegation tokens expire unless renewed "
      "(dfs.namenode.delegation.token.renew-interval, a day by default) and end at their "
      "max-lifetime (a week); for jobs that outlive them give spark-submit --principal and "
      "--keytab, so that Spark renews and replaces its tokens, or submit again",
      op, ep->display, ep->token_desc, exc, msg ? msg : "");
  ember__json_free(j);
  return rc;
}

/* Sets the message for a reply that is not the expected success and returns
 * its code; *retry says whether trying again may help (5xx, a standby or
 * retriable exception). */
static int reply_error(const endpoint *ep, const char *op, const char *url, const reply *r,
                       const sink *s, int *retry) {
  char where[256];
  host_of(url, where, sizeof where);
  const char *exc = NULL, *msg = NULL;
  ember__json *j = NULL;
  if (s->err.len > 0 && ember__json_parse(s->err.p, s->err.len, 8, &j) == EMBER_OK) {
    const ember__json *re = ember__json_get(j, "RemoteException");
    exc = ember__json_get_str(re, "exception");
    msg = ember__json_get_str(re, "message");
  }
  ember_clear_error(); /* a failed parse above is not the story */
  int code = EMBER_EIO;
  const char *what = "remote error";
  *retry = 0;
  /* a refused token arrives as InvalidToken, or as a SecurityException
   * "Failed to obtain user group information: ... Token has expired" */
  if (ep->auth == AUTH_TOKEN && exc != NULL &&
      (strstr(exc, "InvalidToken") != NULL ||
       (strcmp(exc, "SecurityException") == 0 && msg != NULL && strstr(msg, "oken") != NULL)))
    return token_error(ep, op, exc, msg, j);
  if (exc != NULL && strcmp(exc, "FileNotFoundException") == 0) {
    code = EMBER_ENOTFOUND;
    what = "no such file or directory";
  } else if (exc != NULL && (strcmp(exc, "AccessControlException") == 0 ||
                             strcmp(exc, "SecurityException") == 0 ||
                             strcmp(exc, "AuthorizationException") == 0)) {
    code = EMBER_EPERM;
    what = "permission denied";
  } else if (r->status == 401 && ep->auth == AUTH_TOKEN) {
    return token_error(ep, op, exc ? exc : "HTTP 401", msg ? msg : "", j);
  } else if (r->status == 401) {
    code = EMBER_EAUTH;
    what = ep->auth == AUTH_KERBEROS
               ? "the NameNode refused the Kerberos credentials (is the service principal's key "
                 "in the NameNode's keytab the one the KDC has?)"
               : "the cluster requires authentication, and no Kerberos ticket or HDFS delegation "
                 "token could be used";
  } else if (exc != NULL && strcmp(exc, "FileAlreadyExistsException") == 0) {
    code = EMBER_EINVAL;
    what = "already exists";
  } else if (exc != NULL && (strcmp(exc, "StandbyException") == 0 ||
                             strcmp(exc, "RetriableException") == 0)) {
    *retry = 1;
    what = "NameNode not available";
  } else if (exc == NULL && r->status == 404) {
    code = EMBER_ENOTFOUND;
    what = "no such file or directory (HTTP 404)";
  } else if (r->status == 400 || (exc != NULL && (strcmp(exc, "IllegalArgumentException") == 0 ||
                                                 strcmp(exc, "UnsupportedOperationException") == 0))) {
    code = EMBER_EINVAL;
    what = "rejected";
  } else if (r->status >= 500) {
    *retry = 1;
  } else if (r->status >= 300 && r->status <= 399) {
    code = EMBER_EPROTO;
    what = "redirect without a usable Location";
  }
  if (code == EMBER_EPERM)
    ember__set_error(code, "webhdfs %s %s: %s for %s '%s' (%s: %s)", op, ep->display, what,
                     ep->auth == AUTH_SIMPLE ? "user" : "Kerberos user", ep->user, exc,
                     msg ? msg : "");
  else if (exc != NULL)
    ember__set_error(code, "webhdfs %s %s: %s (%s: %s)", op, ep->display, what, exc,
                     msg ? msg : "");
  else
    ember__set_error(code, "webhdfs %s %s: %s (HTTP %ld from %s)", op, ep->display, what,
                     r->status, where);
  ember__json_free(j);
  return code;
}

static int transport_error(const endpoint *ep, const char *op, const char *role,
                           const char *url, int code, const reply *r) {
  char where[256];
  host_of(url, where, sizeof where);
  return ember__set_error(code, "webhdfs %s %s: %s %s: %s", op, ep->display, role, where,
                          code == EMBER_ETIMEDOUT ? "timed out" : r->curl_msg);
}

/* ================================================================ requests */

/* The Negotiate header for a NameNode at base ("http://host:port"). */
static int spnego_for(endpoint *ep, const char *op, const char *base, char **header) {
  char host[256], what[320];
  host_of(base, host, sizeof host);
  snprintf(what, sizeof what, "the NameNode %s", host);
  char *colon = strrchr(host, ':');
  if (colon != NULL && strchr(host, ']') == NULL) *colon = '\0';
  if (host[0] == '[') { /* [v6]:port */
    memmove(host, host + 1, strlen(host));
    char *end = strchr(host, ']');
    if (end != NULL) *end = '\0';
  }
  int rc = ember_spnego_header(host, what, header);
  if (rc == EMBER_OK) return rc;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", ember_last_error());
  const char *file = getenv("HADOOP_TOKEN_FILE_LOCATION");
  /* where there is no ticket (executors, containers), the token is the way */
  if (strstr(msg, "no Kerberos ticket") == NULL)
    return ember__set_error(rc, "webhdfs %s %s: %s", op, ep->display, msg);
  return ember__set_error(rc, "webhdfs %s %s: %s; %s", op, ep->display, msg,
                          file != NULL && file[0] != '\0'
                              ? ep->token_desc
                              : "a Spark executor or YARN container has no ticket of its own: "
                                "it needs an HDFS delegation token in HADOOP_TOKEN_FILE_LOCATION "
                                "(Spark obtains one with spark.kerberos.access.hadoopFileSystems"
                                " and --principal/--keytab or the submitter's ticket)");
}

/* Sends one request to the NameNode, trying each configured NameNode from
 * the last good one on a transport failure or a standby reply.  On
 * EMBER_OK, r holds a reply (any status) from the NameNode that took it.
 * Transport failures return their code with the message set; *retry tells
 * the caller it may try again later. */
static int nn_request(endpoint *ep, const char *method, const char *op, const char *extra,
                      int timeout_kind, sink *s, reply *r, int *retry) {
  int rc = EMBER_EIO;
  *retry = 0;
  for (size_t k = 0; k < ep->nbases; k++) {
    size_t i = (ep->cur + k) % ep->nbases;
    char *auth_header = NULL;
    if (ep->auth == AUTH_KERBEROS && (rc = spnego_for(ep, op, ep->bases[i], &auth_header)) != 0)
      return rc;
    char *url = nn_url(ep, ep->bases[i], op, extra);
    if (url == NULL) {
      free(auth_header);
      return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
    }
    sink_reset(s);
    free(r->location);
    r->location = NULL;
    rc = http_once(ep, method, url, NULL, 0, timeout_kind, auth_header, s, r);
    free(auth_header);
    if (rc == EMBER_ENOMEM) {
      free(url);
      return rc;
    }
    /* A Kerberized NameNode that our configuration (or its absence) called
     * simple: authenticate as a Kerberos client would and ask again. */
    if (rc == EMBER_OK && r->status == 401 && !ep->auth_settled) {
      free(url);
      if ((rc = use_kerberos(ep)) != EMBER_OK) return rc;
      k--;
      continue;
    }
    if (rc != EMBER_OK) {
      transport_error(ep, op, "NameNode", url, rc, r);
      free(url);
      *retry = 1;
      continue;
    }
    if (r->status == 403 && ep->nbases > 1 && s->err.len > 0 &&
        memmem(s->err.p, s->err.len, "StandbyException", 16) != NULL) {
      int dummy;
      rc = reply_error(ep, op, url, r, s, &dummy);
      free(url);
      *retry = 1;
      continue;
    }
    ep->cur = i;
    free(url);
    return EMBER_OK;
  }
  return rc;
}

static int check_location(const endpoint *ep, const char *op, const reply *r) {
  if (r->location == NULL || (strncmp(r->location, "http://", 7) != 0 &&
                              strncmp(r->location, "https://", 8) != 0) ||
      strlen(r->location) > URL_MAX)
    return ember__set_error(EMBER_EPROTO, "webhdfs %s %s: the NameNode's redirect has no "
                            "usable http(s) Location (HTTP %ld)", op, ep->display, r->status);
  return EMBER_OK;
}

/* A metadata request answered with JSON by the NameNode: 200 expected.
 * Retries transport failures and 5xx like reads do.  *out is the parsed
 * reply (free with ember__json_free); out NULL: the body is not parsed. */
static int json_call(endpoint *ep, const char *method, const char *op, const char *extra,
                     ember__json **out) {
  sink s = {0};
  reply r = {0};
  int rc = EMBER_OK, retry = 0;
  if (out != NULL) *out = NULL;
  s.mode = SINK_JSON;
  for (int attempt = 0;; attempt++) {
    rc = nn_request(ep, method, op, extra, T_TOTAL, &s, &r, &retry);
    if (rc == EMBER_OK) {
      if (r.status == 200 && out == NULL) break; /* no body expected */
      if (r.status == 200) {
        rc = ember__json_parse(s.json.p ? s.json.p : "", s.json.len, 32, out);
        if (rc != EMBER_OK)
          ember__set_error(rc, "webhdfs %s %s: bad JSON reply: %s", op, ep->display,
                           ember_last_error());
        break;
      }
      char *url = nn_url(ep, ep->bases[ep->cur], op, extra);
      rc = reply_error(ep, op, url ? url : ep->bases[ep->cur], &r, &s, &retry);
      free(url);
    }
    if (!retry || rc == EMBER_ENOMEM || attempt >= ep->retries) break;
    ep->stats.retries++;
    sleep_ms(attempt < 4 ? 100 << attempt : 2000);
  }
  free(r.location);
  sink_free(&s);
  return rc;
}

/* ================================================================ status */

void ember_webhdfs_opts_init(ember_webhdfs_opts *o) {
  memset(o, 0, sizeof *o);
  o->timeout_ms = EMBER_WEBHDFS_DEFAULT_TIMEOUT_MS;
  o->range_bytes = EMBER_WEBHDFS_DEFAULT_RANGE;
  o->retries = EMBER_WEBHDFS_DEFAULT_RETRIES;
}

void ember_webhdfs_status_clear(ember_webhdfs_status *st) {
  if (st == NULL) return;
  free(st->name);
  free(st->owner);
  free(st->group);
  memset(st, 0, sizeof *st);
}

/* Fills st from one FileStatus object. */
static int status_from_json(const endpoint *ep, const char *op, const ember__json *fs,
                            ember_webhdfs_status *st) {
  memset(st, 0, sizeof *st);
  int have_len = 0;
  const char *type = ember__json_get_str(fs, "type");
  int64_t len = ember__json_get_int(fs, "length", &have_len);
  if (fs == NULL || type == NULL || !have_len || len < 0)
    return ember__set_error(EMBER_EPROTO, "webhdfs %s %s: a FileStatus without type/length",
                            op, ep->display);
  const char *name = ember__json_get_str(fs, "pathSuffix");
  const char *perm = ember__json_get_str(fs, "permission");
  const char *owner = ember__json_get_str(fs, "owner");
  const char *group = ember__json_get_str(fs, "group");
  st->is_dir = strcmp(type, "DIRECTORY") == 0;
  st->length = (uint64_t)len;
  st->mtime_ms = ember__json_get_int(fs, "modificationTime", NULL);
  int64_t rep = ember__json_get_int(fs, "replication", NULL);
  st->replication = rep > 0 && rep < 65536 ? (uint32_t)rep : 0;
  int64_t bs = ember__json_get_int(fs, "blockSize", NULL);
  st->block_size = bs > 0 ? (uint64_t)bs : 0;
  st->permission = perm ? (uint32_t)(strtoul(perm, NULL, 8) & 07777u) : 0;
  st->name = strdup(name ? name : "");
  st->owner = strdup(owner ? owner : "");
  st->group = strdup(group ? group : "");
  if (!st->name || !st->owner || !st->group) {
    ember_webhdfs_status_clear(st);
    return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
  }
  return EMBER_OK;
}

static int stat_ep(endpoint *ep, ember_webhdfs_status *out) {
  ember__json *j = NULL;
  int rc = json_call(ep, "GET", "GETFILESTATUS", NULL, &j);
  if (rc == EMBER_OK) rc = status_from_json(ep, "GETFILESTATUS", ember__json_get(j, "FileStatus"), out);
  ember__json_free(j);
  return rc;
}

int ember_webhdfs_stat(const char *url, const ember_webhdfs_opts *opts,
                       ember_webhdfs_status *out) {
  memset(out, 0, sizeof *out);
  endpoint ep;
  int rc = ep_init(&ep, url, opts);
  if (rc == EMBER_OK) rc = stat_ep(&ep, out);
  ep_free(&ep);
  return rc;
}

static int by_name(const void *a, const void *b) {
  return strcmp(((const ember_webhdfs_status *)a)->name, ((const ember_webhdfs_status *)b)->name);
}

void ember_webhdfs_list_free(ember_webhdfs_status *entries, size_t count) {
  if (entries == NULL) return;
  for (size_t i = 0; i < count; i++) ember_webhdfs_status_clear(&entries[i]);
  free(entries);
}

int ember_webhdfs_list(const char *url, const ember_webhdfs_opts *opts,
                       ember_webhdfs_status **out, size_t *count) {
  *out = NULL;
  *count = 0;
  endpoint ep;
  ember__json *j = NULL;
  ember_webhdfs_status *v = NULL;
  size_t n = 0;
  int rc = ep_init(&ep, url, opts);
  if (rc == EMBER_OK) rc = json_call(&ep, "GET", "LISTSTATUS", NULL, &j);
  if (rc != EMBER_OK) goto done;
  const ember__json *arr = ember__json_get(ember__json_get(j, "FileStatuses"), "FileStatus");
  if (arr == NULL || arr->kind != EMBER__JSON_ARRAY) {
    rc = ember__set_error(EMBER_EPROTO, "webhdfs LISTSTATUS %s: reply has no FileStatuses array",
                          ep.display);
    goto done;
  }
  v = calloc(arr->count ? arr->count : 1, sizeof *v);
  if (v == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory (%zu entries)", arr->count);
    goto done;
  }
  for (const ember__json *e = arr->child; e != NULL; e = e->next) {
    rc = status_from_json(&ep, "LISTSTATUS", e, &v[n]);
    if (rc != EMBER_OK) goto done;
    n++;
  }
  qsort(v, n, sizeof *v, by_name);
  *out = v;
  *count = n;
  v = NULL;
done:
  ember_webhdfs_list_free(v, n);
  ember__json_free(j);
  ep_free(&ep);
  return rc;
}

int ember_webhdfs_mkdirs(const char *url, const ember_webhdfs_opts *opts) {
  endpoint ep;
  ember__json *j = NULL;
  int rc = ep_init(&ep, url, opts);
  if (rc == EMBER_OK) rc = json_call(&ep, "PUT", "MKDIRS", NULL, &j);
  if (rc == EMBER_OK) {
    const ember__json *b = ember__json_get(j, "boolean");
    if (b == NULL || b->kind != EMBER__JSON_TRUE)
      rc = ember__set_error(EMBER_EIO, "webhdfs MKDIRS %s: the NameNode did not create it",
                            ep.display);
  }
  ember__json_free(j);
  ep_free(&ep);
  return rc;
}

int ember_webhdfs_set_permission(const char *url, unsigned mode, const ember_webhdfs_opts *opts) {
  if (mode > 01777)
    return ember__set_error(EMBER_EINVAL, "webhdfs SETPERMISSION %s: mode %o is over 1777",
                            url ? url : "(null)", mode);
  char extra[32];
  snprintf(extra, sizeof extra, "&permission=%o", mode);
  endpoint ep;
  int rc = ep_init(&ep, url, opts);
  if (rc == EMBER_OK) rc = json_call(&ep, "PUT", "SETPERMISSION", extra, NULL);
  ep_free(&ep);
  return rc;
}

int ember_webhdfs_delegation_token(const char *url, const char *renewer,
                                   const ember_webhdfs_opts *opts, char **token) {
  *token = NULL;
  if (renewer == NULL || renewer[0] == '\0' || strlen(renewer) > 256)
    return ember__set_error(EMBER_EINVAL, "webhdfs GETDELEGATIONTOKEN: renewer must be a user "
                            "name of 1 to 256 characters");
  sbuf extra = {0};
  sb_str(&extra, "&renewer=");
  sb_pct(&extra, renewer, 0);
  if (extra.oom) return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
  endpoint ep;
  ember__json *j = NULL;
  ember__token t;
  memset(&t, 0, sizeof t);
  int rc = ep_init(&ep, url, opts);
  if (rc == EMBER_OK && ep.auth == AUTH_SIMPLE)
    rc = ember__set_error(EMBER_EINVAL,
                          "webhdfs GETDELEGATIONTOKEN %s: the cluster does not use Kerberos "
                          "(hadoop.security.authentication in HADOOP_CONF_DIR's core-site.xml): "
                          "it hands out no delegation tokens",
                          ep.display);
  if (rc == EMBER_OK) rc = json_call(&ep, "GET", "GETDELEGATIONTOKEN", extra.p, &j);
  const char *s = NULL;
  if (rc == EMBER_OK) {
    s = ember__json_get_str(ember__json_get(j, "Token"), "urlString");
    if (s == NULL)
      rc = ember__set_error(EMBER_EPROTO,
                            "webhdfs GETDELEGATIONTOKEN %s: the reply holds no Token.urlString",
                            ep.display);
  }
  if (rc == EMBER_OK) rc = ember__token_decode_url(&t, s, strlen(s), "the NameNode's token");
  if (rc == EMBER_OK) {
    char *kind = strdup("HDFS_DELEGATION_TOKEN");
    if (kind == NULL) {
      rc = ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
    } else {
      free(t.kind);
      t.kind = kind;
      rc = ember__token_encode_url(&t, token);
    }
  }
  ember__token_clear(&t);
  ember__json_free(j);
  ep_free(&ep);
  free(extra.p);
  return rc;
}

int ember_webhdfs_delete(const char *url, int recursive, const ember_webhdfs_opts *opts,
                         int *deleted) {
  endpoint ep;
  ember__json *j = NULL;
  if (deleted) *deleted = 0;
  int rc = ep_init(&ep, url, opts);
  if (rc == EMBER_OK)
    rc = json_call(&ep, "DELETE", "DELETE", recursive ? "&recursive=true" : "&recursive=false", &j);
  if (rc == EMBER_OK) {
    const ember__json *b = ember__json_get(j, "boolean");
    if (b == NULL || (b->kind != EMBER__JSON_TRUE && b->kind != EMBER__JSON_FALSE))
      rc = ember__set_error(EMBER_EPROTO, "webhdfs DELETE %s: reply has no boolean", ep.display);
    else if (deleted)
      *deleted = b->kind == EMBER__JSON_TRUE;
  }
  ember__json_free(j);
  ep_free(&ep);
  return rc;
}

int ember_webhdfs_rename(const char *src, const char *dst, int flags,
                         const ember_webhdfs_opts *opts) {
  endpoint ep;
  int rc = ep_init(&ep, src, opts);
  if (rc != EMBER_OK) goto done;
  if (dst == NULL) {
    rc = ember__set_error(EMBER_EINVAL, "webhdfs RENAME %s: NULL destination", ep.display);
    goto done;
  }
  const char *dpath = dst;
  const char *sep = strstr(dst, "://");
  if (sep != NULL) {
    /* a URL: same scheme and authority as src (or none), then its path */
    const char *sauth = strstr(ep.display, "://");
    size_t dlen = strcspn(sep + 3, "/"), slen = sauth ? strcspn(sauth + 3, "/") : 0;
    size_t dscheme = (size_t)(sep - dst), sscheme = sauth ? (size_t)(sauth - ep.display) : 0;
    if (dscheme != sscheme || memcmp(dst, ep.display, dscheme) != 0 ||
        (dlen != 0 && (dlen != slen || memcmp(sep + 3, sauth + 3, dlen) != 0))) {
      rc = ember__set_error(EMBER_EINVAL, "webhdfs RENAME %s: destination '%s' is on another "
                            "file system", ep.display, dst);
      goto done;
    }
    dpath = sep + 3 + dlen;
  }
  if (dpath[0] != '/') {
    rc = ember__set_error(EMBER_EINVAL, "webhdfs RENAME %s: destination '%s' is not an "
                          "absolute path", ep.display, dst);
    goto done;
  }
  for (const char *c = dpath; *c; c++)
    if ((unsigned char)*c < 0x20 || *c == 0x7f) {
      rc = ember__set_error(EMBER_EINVAL, "webhdfs RENAME %s: control character in "
                            "destination", ep.display);
      goto done;
    }
  if (strlen(dpath) > URL_MAX / 4) {
    rc = ember__set_error(EMBER_EINVAL, "webhdfs RENAME %s: destination too long", ep.display);
    goto done;
  }
  sbuf extra = {0};
  sb_str(&extra, "&destination=");
  sb_pct(&extra, dpath, 1);
  sb_str(&extra, (flags & EMBER_WEBHDFS_OVERWRITE) ? "&renameoptions=OVERWRITE"
                                                    : "&renameoptions=NONE");
  if (extra.oom) {
    free(extra.p);
    rc = ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
    goto done;
  }
  /* with renameoptions the NameNode runs rename2 and answers 200, no body */
  rc = json_call(&ep, "PUT", "RENAME", extra.p, NULL);
  free(extra.p);
done:
  ep_free(&ep);
  return rc;
}

/* ================================================================ reading */

struct ember_webhdfs_file {
  endpoint ep;
  uint64_t size;
  uint64_t pos;
  uint8_t *buf;     /* holds [buf_off, buf_off + buf_len) of the file */
  size_t buf_cap;
  uint64_t buf_off;
  size_t buf_len;
};

int ember_webhdfs_open(ember_webhdfs_file **out, const char *url,
                       const ember_webhdfs_opts *opts) {
  *out = NULL;
  ember_webhdfs_file *f = calloc(1, sizeof *f);
  if (f == NULL) return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
  ember_webhdfs_status st = {0};
  int rc = ep_init(&f->ep, url, opts);
  if (rc == EMBER_OK) rc = stat_ep(&f->ep, &st);
  if (rc == EMBER_OK && st.is_dir)
    rc = ember__set_error(EMBER_EINVAL, "webhdfs OPEN %s: is a directory", f->ep.display);
  if (rc != EMBER_OK) {
    ember_webhdfs_status_clear(&st);
    ember_webhdfs_close(f);
    return rc;
  }
  f->size = st.length;
  ember_webhdfs_status_clear(&st);
  *out = f;
  return EMBER_OK;
}

/* One OPEN of [off, off + want) into f->buf + f->buf_len: NameNode, then
 * the DataNode it names.  Bytes that arrived before a failure stay counted
 * in f->buf_len.  *retry as for nn_request. */
static int open_range(ember_webhdfs_file *f, uint64_t off, size_t want, int *retry) {
  endpoint *ep = &f->ep;
  char extra[96];
  snprintf(extra, sizeof extra, "&offset=%llu&length=%zu", (unsigned long long)off, want);
  sink s = {0};
  reply r = {0};
  s.mode = SINK_DATA;
  s.data = f->buf + f->buf_len;
  s.data_cap = want;
  ep->stats.ranges++;
  int rc = nn_request(ep, "GET", "OPEN", extra, T_STALL, &s, &r, retry);
  if (rc != EMBER_OK) goto out;
  /* An HttpFS gateway (or a NameNode serving data itself) answers 200. */
  if (r.status >= 300 && r.status <= 399) {
    rc = check_location(ep, "OPEN", &r);
    if (rc != EMBER_OK) goto out;
    char *dn = r.location;
    r.location = NULL;
    sink_reset(&s);
    rc = http_once(ep, "GET", dn, NULL, 0, T_STALL, NULL, &s, &r);
    if (rc == EMBER_ENOMEM) {
      free(dn);
      goto out;
    }
    if (rc != EMBER_OK) {
      /* keep what arrived: the retry resumes after it */
      *retry = !s.overflow;
      if (s.overflow)
        rc = ember__set_error(EMBER_EPROTO, "webhdfs OPEN %s: DataNode sent more than the %zu "
                              "bytes asked for", ep->display, want);
      else
        transport_error(ep, "OPEN", "DataNode", dn, rc, &r);
      f->buf_len += s.data_len;
      ep->stats.bytes += s.data_len;
      free(dn);
      goto out;
    }
    if (r.status != 200) {
      rc = reply_error(ep, "OPEN", dn, &r, &s, retry);
      free(dn);
      goto out;
    }
    free(dn);
  } else if (r.status != 200) {
    char *url = nn_url(ep, ep->bases[ep->cur], "OPEN", extra);
    rc = reply_error(ep, "OPEN", url ? url : ep->bases[ep->cur], &r, &s, retry);
    free(url);
    goto out;
  }
  f->buf_len += s.data_len;
  ep->stats.bytes += s.data_len;
out:
  free(r.location);
  sink_free(&s);
  return rc;
}

/* Refills the buffer with the range starting at f->pos. */
static int fill(ember_webhdfs_file *f) {
  endpoint *ep = &f->ep;
  uint64_t left = f->size - f->pos;
  size_t want = left < ep->range ? (size_t)left : ep->range;
  if (f->buf_cap < want) {
    /* grows to min(range, size) once */
    uint8_t *b = realloc(f->buf, want);
    if (b == NULL) return ember__set_error(EMBER_ENOMEM, "webhdfs OPEN %s: out of memory "
                                           "(%zu-byte buffer)", ep->display, want);
    f->buf = b;
    f->buf_cap = want;
  }
  f->buf_off = f->pos;
  f->buf_len = 0;
  int fails = 0;
  while (f->buf_len < want) {
    size_t before = f->buf_len;
    int retry = 0;
    int rc = open_range(f, f->buf_off + before, want - before, &retry);
    if (rc == EMBER_OK && f->buf_len == before)
      return ember__set_error(EMBER_ETRUNCATED, "webhdfs OPEN %s: the file ends at byte %llu, "
                              "but it had %llu bytes when opened", ep->display,
                              (unsigned long long)(f->buf_off + before),
                              (unsigned long long)f->size);
    if (rc == EMBER_OK) continue; /* a short reply: ask for the rest */
    if (f->buf_len > before) fails = 0; /* progress before the failure */
    if (!retry || rc == EMBER_ENOMEM || fails >= ep->retries) {
      if (retry && ep->retries > 0)
        ember__set_error(rc, "%s (gave up after %d retries at byte %llu)", ember_last_error(),
                         fails, (unsigned long long)(f->buf_off + f->buf_len));
      return rc;
    }
    sleep_ms(fails < 4 ? 100 << fails : 2000);
    fails++;
    ep->stats.retries++;
  }
  return EMBER_OK;
}

int64_t ember_webhdfs_read(void *file, void *buf, size_t n) {
  ember_webhdfs_file *f = file;
  if (f == NULL || (buf == NULL && n > 0))
    return ember__set_error(EMBER_EINVAL, "webhdfs read: NULL argument");
  if (n == 0 || f->pos >= f->size) return 0;
  if (!(f->pos >= f->buf_off && f->pos < f->buf_off + f->buf_len)) {
    /* a failure part-way leaves a partial buffer: the next call refills */
    int rc = fill(f);
    if (rc != EMBER_OK) {
      f->buf_len = 0;
      return rc;
    }
  }
  size_t at = (size_t)(f->pos - f->buf_off);
  size_t avail = f->buf_len - at;
  if (n > avail) n = avail;
  if (n > INT64_MAX) n = INT64_MAX;
  memcpy(buf, f->buf + at, n);
  f->pos += n;
  return (int64_t)n;
}

int ember_webhdfs_seek(ember_webhdfs_file *f, uint64_t offset) {
  if (offset > f->size)
    return ember__set_error(EMBER_EINVAL, "webhdfs seek %s: offset %llu is past the end (%llu)",
                            f->ep.display, (unsigned long long)offset,
                            (unsigned long long)f->size);
  f->pos = offset;
  return EMBER_OK;
}

uint64_t ember_webhdfs_tell(const ember_webhdfs_file *f) { return f->pos; }

uint64_t ember_webhdfs_size(const ember_webhdfs_file *f) { return f->size; }

void ember_webhdfs_file_stats(const ember_webhdfs_file *f, ember_webhdfs_stats *out) {
  *out = f->ep.stats;
}

void ember_webhdfs_close(ember_webhdfs_file *f) {
  if (f == NULL) return;
  ep_free(&f->ep);
  free(f->buf);
  free(f);
}

/* ================================================================ writing */

struct ember_webhdfs_writer {
  endpoint ep;
  int overwrite;
  int created;
  uint8_t *buf;
  size_t len, cap;
};

int ember_webhdfs_writer_create(ember_webhdfs_writer **out, const char *url, int flags,
                                const ember_webhdfs_opts *opts) {
  *out = NULL;
  ember_webhdfs_writer *w = calloc(1, sizeof *w);
  if (w == NULL) return ember__set_error(EMBER_ENOMEM, "webhdfs: out of memory");
  int rc = ep_init(&w->ep, url, opts);
  if (rc != EMBER_OK) {
    ember_webhdfs_writer_destroy(w);
    return rc;
  }
  w->overwrite = (flags & EMBER_WEBHDFS_OVERWRITE) != 0;
  *out = w;
  return EMBER_OK;
}

/* CREATE (first) or APPEND (later) of data[0..len): the NameNode names a
 * DataNode, which takes the body.  Not retried: an APPEND that failed
 * part-way may have landed. */
static int send_chunk(ember_webhdfs_writer *w, const uint8_t *data, size_t len) {
  endpoint *ep = &w->ep;
  const char *op = w->created ? "APPEND" : "CREATE";
  const char *method = w->created ? "POST" : "PUT";
  const char *extra = w->created ? NULL : (w->overwrite ? "&overwrite=true" : "&overwrite=false");
  long want = w->created ? 200 : 201;
  sink s = {0};
  reply r = {0};
  int retry = 0;
  s.mode = SINK_NONE;
  int rc = nn_request(ep, method, op, extra, T_TOTAL, &s, &r, &retry);
  if (rc != EMBER_OK) goto out;
  if (r.status < 300 || r.status > 399) {
    char *url = nn_url(ep, ep->bases[ep->cur], op, extra);
    rc = reply_error(ep, op, url ? url : ep->bases[ep->cur], &r, &s, &retry);
    if (rc == EMBER_OK || r.status == want) /* a 2xx without the redirect */
      rc = ember__set_error(EMBER_EPROTO, "webhdfs %s %s: the NameNode answered HTTP %ld "
                            "instead of redirecting to a DataNode", op, ep->display, r.status);
    free(url);
    goto out;
  }
  rc = check_location(ep, op, &r);
  if (rc != EMBER_OK) goto out;
  char *dn = r.location;
  r.location = NULL;
  sink_reset(&s);
  /* data != NULL even for an empty body, so it is sent as a body */
  rc = http_once(ep, method, dn, data ? (const void *)data : (const void *)"", len, T_STALL, NULL,
                 &s, &r);
  if (rc != EMBER_OK && rc != EMBER_ENOMEM) transport_error(ep, op, "DataNode", dn, rc, &r);
  else if (rc == EMBER_OK && r.status != want) rc = reply_error(ep, op, dn, &r, &s, &retry);
  free(dn);
  if (rc == EMBER_OK) w->created = 1;
out:
  free(r.location);
  sink_free(&s);
  return rc;
}

int ember_webhdfs_writer_write(ember_webhdfs_writer *w, const void *buf, size_t n) {
  if (w == NULL || (buf == NULL && n > 0))
    return ember__set_error(EMBER_EINVAL, "webhdfs write: NULL argument");
  const uint8_t *p = buf;
  size_t range = w->ep.range;
  while (n > 0) {
    if (w->cap < range) {
      uint8_t *b = realloc(w->buf, range);
      if (b == NULL)
        return ember__set_error(EMBER_ENOMEM, "webhdfs write %s: out of memory (%zu-byte "
                                "buffer)", w->ep.display, range);
      w->buf = b;
      w->cap = range;
    }
    size_t k = range - w->len < n ? range - w->len : n;
    memcpy(w->buf + w->len, p, k);
    w->len += k;
    p += k;
    n -= k;
    if (w->len == range) {
      int rc = send_chunk(w, w->buf, w->len);
      if (rc != EMBER_OK) return rc;
      w->len = 0;
    }
  }
  return EMBER_OK;
}

int ember_webhdfs_writer_close(ember_webhdfs_writer *w) {
  if (w == NULL) return EMBER_OK;
  int rc = EMBER_OK;
  if (w->len > 0 || !w->created) rc = send_chunk(w, w->buf, w->len);
  ember_webhdfs_writer_destroy(w);
  return rc;
}

void ember_webhdfs_writer_destroy(ember_webhdfs_writer *w) {
  if (w == NULL) return;
  ep_free(&w->ep);
  free(w->buf);
  free(w);
}

int ember_webhdfs_write_file(const char *url, const void *data, size_t len, int flags,
                             const ember_webhdfs_opts *opts) {
  ember_webhdfs_writer *w;
  int rc = ember_webhdfs_writer_create(&w, url, flags, opts);
  if (rc != EMBER_OK) return rc;
  /* one CREATE for the whole file when it fits the chunk size */
  if (len <= w->ep.range) {
    rc = send_chunk(w, data, len);
    ember_webhdfs_writer_destroy(w);
    return rc;
  }
  rc = ember_webhdfs_writer_write(w, data, len);
  if (rc != EMBER_OK) {
    ember_webhdfs_writer_destroy(w);
    return rc;
  }
  return ember_webhdfs_writer_close(w);
}

/* ================================================================ TFRecord */

static void file_release(void *f) { ember_webhdfs_close(f); }

int ember_webhdfs_tfr_reader_open(ember_tfr_reader **out, const char *url,
                                  const ember_webhdfs_opts *opts,
                                  const ember_tfr_options *tfr_opts) {
  *out = NULL;
  ember_webhdfs_file *f;
  int rc = ember_webhdfs_open(&f, url, opts);
  if (rc != EMBER_OK) return rc;
  return ember_tfr_reader_open_owned(out, ember_webhdfs_read, f, file_release, url, tfr_opts);
}

static int sink_write(void *w, const void *buf, size_t n) {
  return ember_webhdfs_writer_write(w, buf, n);
}
static int sink_finish(void *w) { return ember_webhdfs_writer_close(w); }
static void sink_release(void *w) { ember_webhdfs_writer_destroy(w); }

int ember_webhdfs_tfr_writer_open(ember_tfr_writer **out, const char *url, int flags,
                                  const ember_webhdfs_opts *opts, int compression, int level) {
  *out = NULL;
  ember_webhdfs_writer *w;
  int rc = ember_webhdfs_writer_create(&w, url, flags, opts);
  if (rc != EMBER_OK) return rc;
  return ember_tfr_writer_open_fn(out, sink_write, sink_finish, sink_release, w, url,
                                  compression, level);
}
