/* test_webhdfs.c - the WebHDFS client against a tiny in-process WebHDFS
 * server (a NameNode that redirects to a "DataNode" path on the same port),
 * plus the JSON and Hadoop-configuration parsers it relies on.
 *
 * The server runs one thread per connection on 127.0.0.1, answers with
 * "Connection: close", keeps its files in memory, and can misbehave on
 * request: drop a DataNode connection after k body bytes, stall, send more
 * than asked, play a standby NameNode.  No JVM needed; the real HDFS is
 * exercised from tests/python/test_hadoop.py. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "../../csrc/hadoop_conf.h"
#include "../../csrc/hadoop_token.h"
#include "../../csrc/json.h"
#include "ember/io.h"
#include "ember/tfrecord.h"
#include "ember/webhdfs.h"
#include "harness.h"

/* ================================================================ server */

#define MAX_FILES 32
#define MAX_CONNS 256
#define MAX_LOG 256

typedef struct {
  char path[256];
  uint8_t *data;
  size_t len;
  int denied; /* AccessControlException for anyone */
} sfile;

typedef struct {
  int fd;
  uint16_t port;
  pthread_t acceptor;
  volatile int stop;
  pthread_mutex_t mu;
  pthread_t conns[MAX_CONNS];
  int nconns;
  sfile files[MAX_FILES];
  int nfiles;
  /* misbehaviour */
  int drop_after;    /* DataNode OPEN: close after this many body bytes ... */
  int drop_count;    /* ... for this many requests */
  int stall_ms;      /* DataNode OPEN: stall after the headers ... */
  int stall_count;   /* ... for this many requests */
  int over_send;     /* DataNode OPEN: send 10 bytes more than asked */
  int standby;       /* every NameNode request: 403 StandbyException */
  int shrink_to;     /* >= 0: after GETFILESTATUS, files shrink to this */
  /* what happened */
  int nn_requests, dn_requests, creates, appends, renames;
  char last_rename_opts[32];
  long dn_offsets[MAX_LOG];
  int ndn;
  char last_user[64];
  /* a Kerberized NameNode: requests must carry delegation=want_token (none:
   * 401; another or a refused one: 403 InvalidToken) */
  char want_token[2048];
  int token_expired;
  char last_delegation[2048];
} server;

static void pct_decode(const char *s, size_t n, char *out, size_t cap) {
  size_t o = 0;
  for (size_t i = 0; i < n && o + 1 < cap; i++) {
    if (s[i] == '%' && i + 2 < n) {
      char h[3] = {s[i + 1], s[i + 2], 0};
      out[o++] = (char)strtol(h, NULL, 16);
      i += 2;
    } else {
      out[o++] = s[i];
    }
  }
  out[o] = '\0';
}

/* The value of query parameter `key` (decoded) or "" */
static void param(const char *query, const char *key, char *out, size_t cap) {
  out[0] = '\0';
  size_t kn = strlen(key);
  for (const char *p = query; p && *p;) {
    if (strncmp(p, key, kn) == 0 && p[kn] == '=') {
      const char *v = p + kn + 1;
      pct_decode(v, strcspn(v, "&"), out, cap);
      return;
    }
    p = strchr(p, '&');
    if (p) p++;
  }
}

static void send_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return;
    p += w;
    n -= (size_t)w;
  }
}

static void respond(int fd, int status, const char *reason, const char *extra_hdr,
                    const void *body, size_t len) {
  char h[2048];
  int n = snprintf(h, sizeof h,
                   "HTTP/1.1 %d %s\r\nContent-Length: %zu\r\nConnection: close\r\n%s"
                   "Content-Type: application/json\r\n\r\n",
                   status, reason, len, extra_hdr ? extra_hdr : "");
  send_all(fd, h, (size_t)n);
  if (len) send_all(fd, body, len);
}

static void respond_json(int fd, int status, const char *reason, const char *json) {
  respond(fd, status, reason, NULL, json, strlen(json));
}

static void remote_exc(int fd, int status, const char *reason, const char *exc, const char *msg) {
  char b[2600];
  snprintf(b, sizeof b,
           "{\"RemoteException\":{\"exception\":\"%s\",\"javaClassName\":\"x.%s\","
           "\"message\":\"%s\"}}",
           exc, exc, msg);
  respond_json(fd, status, reason, b);
}

static sfile *find_file(server *s, const char *path) {
  for (int i = 0; i < s->nfiles; i++)
    if (strcmp(s->files[i].path, path) == 0) return &s->files[i];
  return NULL;
}

static int is_dir(server *s, const char *path) {
  size_t n = strlen(path);
  if (strcmp(path, "/") == 0) return 1;
  for (int i = 0; i < s->nfiles; i++)
    if (strncmp(s->files[i].path, path, n) == 0 && s->files[i].path[n] == '/') return 1;
  return 0;
}

static sfile *add_file(server *s, const char *path, const void *data, size_t len) {
  sfile *f = find_file(s, path);
  if (f == NULL) {
    CHECK(s->nfiles < MAX_FILES);
    f = &s->files[s->nfiles++];
    snprintf(f->path, sizeof f->path, "%s", path);
  }
  free(f->data);
  f->data = malloc(len ? len : 1);
  CHECK(f->data != NULL);
  if (len) memcpy(f->data, data, len);
  f->len = len;
  f->denied = 0;
  return f;
}

static void status_json(char *out, size_t cap, const char *suffix, int dir, size_t len) {
  snprintf(out, cap,
           "{\"accessTime\":0,\"blockSize\":1048576,\"childrenNum\":0,\"fileId\":16386,"
           "\"group\":\"supergroup\",\"length\":%zu,\"modificationTime\":1700000000123,"
           "\"owner\":\"hdfs\",\"pathSuffix\":\"%s\",\"permission\":\"%s\","
           "\"replication\":%d,\"storagePolicy\":0,\"type\":\"%s\"}",
           dir ? 0 : len, suffix, dir ? "755" : "644", dir ? 0 : 1,
           dir ? "DIRECTORY" : "FILE");
}

typedef struct {
  server *s;
  int fd;
} conn_arg;

/* Reads one request: method, target, body.  Returns 0 on success. */
static int read_request(int fd, char *method, char *target, size_t tcap, uint8_t **body,
                        size_t *blen) {
  char buf[65536];
  size_t n = 0;
  char *end = NULL;
  while (end == NULL) {
    if (n >= sizeof buf - 1) return -1;
    ssize_t r = recv(fd, buf + n, sizeof buf - 1 - n, 0);
    if (r <= 0) return -1;
    n += (size_t)r;
    buf[n] = '\0';
    end = strstr(buf, "\r\n\r\n");
  }
  if (sscanf(buf, "%15s %4095s", method, target) != 2) return -1;
  (void)tcap;
  size_t clen = 0;
  const char *cl = strcasestr(buf, "\r\nContent-Length:");
  if (cl) clen = (size_t)strtoul(cl + 17, NULL, 10);
  size_t have = n - (size_t)(end + 4 - buf);
  *body = malloc(clen + 1);
  if (*body == NULL) return -1;
  memcpy(*body, end + 4, have < clen ? have : clen);
  while (have < clen) {
    ssize_t r = recv(fd, *body + have, clen - have, 0);
    if (r <= 0) return -1;
    have += (size_t)r;
  }
  *blen = clen;
  return 0;
}

static void handle(server *s, int fd) {
  char method[16], target[4096];
  uint8_t *body = NULL;
  size_t blen = 0;
  if (read_request(fd, method, target, sizeof target, &body, &blen) != 0) {
    free(body);
    return;
  }
  int dn = strncmp(target, "/dn/", 4) == 0;
  const char *t = dn ? target + 3 : target;
  if (strncmp(t, "/webhdfs/v1", 11) != 0) {
    respond_json(fd, 404, "Not Found", "{}");
    free(body);
    return;
  }
  const char *q = strchr(t, '?');
  char path[1024], op[32], user[64], tmp[64], token[2048];
  pct_decode(t + 11, q ? (size_t)(q - (t + 11)) : strlen(t + 11), path, sizeof path);
  param(q ? q + 1 : "", "op", op, sizeof op);
  param(q ? q + 1 : "", "user.name", user, sizeof user);
  param(q ? q + 1 : "", "delegation", token, sizeof token);

  pthread_mutex_lock(&s->mu);
  snprintf(s->last_user, sizeof s->last_user, "%s", user);
  snprintf(s->last_delegation, sizeof s->last_delegation, "%s", token);
  if (dn) s->dn_requests++;
  else s->nn_requests++;
  if (!dn && s->want_token[0] != '\0') {
    int ok = strcmp(token, s->want_token) == 0 && !s->token_expired;
    pthread_mutex_unlock(&s->mu);
    if (token[0] == '\0') {
      respond_json(fd, 401, "Unauthorized", "{}");
    } else if (!ok) {
      remote_exc(fd, 403, "Forbidden", "SecurityException",
                 "Failed to obtain user group information: org.apache.hadoop.security.token."
                 "SecretManager$InvalidToken: token (HDFS_DELEGATION_TOKEN token 7 for alice) "
                 "is expired");
    }
    if (!ok) {
      free(body);
      return;
    }
    pthread_mutex_lock(&s->mu);
  }
  if (!dn && s->standby) {
    pthread_mutex_unlock(&s->mu);
    remote_exc(fd, 403, "Forbidden", "StandbyException",
               "Operation category READ is not supported in state standby");
    free(body);
    return;
  }
  sfile *f = find_file(s, path);
  char loc[4300];
  snprintf(loc, sizeof loc, "Location: http://127.0.0.1:%u/dn%s\r\n", s->port, t);

  if (strcmp(op, "GETFILESTATUS") == 0) {
    char js[1024], st[900];
    if (f == NULL && !is_dir(s, path)) {
      pthread_mutex_unlock(&s->mu);
      char m[1100];
      snprintf(m, sizeof m, "File does not exist: %s", path);
      remote_exc(fd, 404, "Not Found", "FileNotFoundException", m);
    } else if (f != NULL && f->denied) {
      pthread_mutex_unlock(&s->mu);
      char m[1200];
      snprintf(m, sizeof m, "Permission denied: user=%.60s, access=READ, inode=\\\"%.1000s\\\"",
               user, path);
      remote_exc(fd, 403, "Forbidden", "AccessControlException", m);
    } else {
      status_json(st, sizeof st, "", f == NULL, f ? f->len : 0);
      if (f != NULL && s->shrink_to >= 0 && (size_t)s->shrink_to < f->len)
        f->len = (size_t)s->shrink_to;
      pthread_mutex_unlock(&s->mu);
      snprintf(js, sizeof js, "{\"FileStatus\":%s}", st);
      respond_json(fd, 200, "OK", js);
    }
  } else if (strcmp(op, "LISTSTATUS") == 0) {
    char js[16384] = "{\"FileStatuses\":{\"FileStatus\":[", st[900], seen[MAX_FILES][256];
    int nseen = 0;
    size_t pn = strlen(path);
    if (!is_dir(s, path)) {
      pthread_mutex_unlock(&s->mu);
      remote_exc(fd, 404, "Not Found", "FileNotFoundException", "File /nope does not exist.");
      free(body);
      return;
    }
    for (int i = 0; i < s->nfiles; i++) {
      const char *fp = s->files[i].path;
      if (strncmp(fp, path, pn) != 0 || fp[pn] != '/') continue;
      const char *rest = fp + pn + 1;
      size_t cn = strcspn(rest, "/");
      int sub = rest[cn] == '/';
      char name[256];
      snprintf(name, sizeof name, "%.*s", (int)cn, rest);
      int dup = 0;
      for (int k = 0; k < nseen; k++) dup |= strcmp(seen[k], name) == 0;
      if (dup) continue;
      snprintf(seen[nseen++], 256, "%s", name);
      status_json(st, sizeof st, name, sub, s->files[i].len);
      if (nseen > 1) strcat(js, ",");
      strcat(js, st);
    }
    pthread_mutex_unlock(&s->mu);
    strcat(js, "]}}");
    respond_json(fd, 200, "OK", js);
  } else if (strcmp(op, "OPEN") == 0 && !dn) {
    pthread_mutex_unlock(&s->mu);
    if (f == NULL) remote_exc(fd, 404, "Not Found", "FileNotFoundException", "gone");
    else respond(fd, 307, "Temporary Redirect", loc, NULL, 0);
  } else if (strcmp(op, "OPEN") == 0 && dn) {
    param(q + 1, "offset", tmp, sizeof tmp);
    long off = atol(tmp);
    param(q + 1, "length", tmp, sizeof tmp);
    long want = atol(tmp);
    if (s->ndn < MAX_LOG) s->dn_offsets[s->ndn++] = off;
    int drop = s->drop_count > 0 ? (s->drop_count--, s->drop_after) : -1;
    int stall = s->stall_count > 0 ? (s->stall_count--, s->stall_ms) : 0;
    int over = s->over_send;
    uint8_t *copy = NULL;
    size_t n = 0;
    if (f != NULL && off >= 0 && (size_t)off <= f->len) {
      n = f->len - (size_t)off;
      if (want >= 0 && (size_t)want < n) n = (size_t)want;
      copy = malloc(n + 16);
      memcpy(copy, f->data + off, n);
      if (over) {
        memset(copy + n, 'X', 10);
        n += 10;
      }
    }
    pthread_mutex_unlock(&s->mu);
    if (copy == NULL) {
      remote_exc(fd, 403, "Forbidden", "IOException", "Offset out of range");
    } else {
      char h[256];
      int hn = snprintf(h, sizeof h,
                        "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\nConnection: close\r\n"
                        "Content-Type: application/octet-stream\r\n\r\n", n);
      send_all(fd, h, (size_t)hn);
      if (stall > 0) usleep((useconds_t)stall * 1000u);
      if (drop >= 0 && (size_t)drop < n) {
        send_all(fd, copy, (size_t)drop);
      } else {
        send_all(fd, copy, n);
      }
    }
    free(copy);
  } else if ((strcmp(op, "CREATE") == 0 || strcmp(op, "APPEND") == 0) && !dn) {
    param(q + 1, "overwrite", tmp, sizeof tmp);
    int exists = f != NULL;
    pthread_mutex_unlock(&s->mu);
    if (strcmp(op, "CREATE") == 0 && exists && strcmp(tmp, "true") != 0)
      remote_exc(fd, 403, "Forbidden", "FileAlreadyExistsException", "already exists");
    else if (strcmp(op, "APPEND") == 0 && !exists)
      remote_exc(fd, 404, "Not Found", "FileNotFoundException", "no file to append to");
    else
      respond(fd, 307, "Temporary Redirect", loc, NULL, 0);
  } else if (strcmp(op, "CREATE") == 0 && dn) {
    s->creates++;
    add_file(s, path, body, blen);
    pthread_mutex_unlock(&s->mu);
    respond(fd, 201, "Created", "Location: hdfs://x\r\n", NULL, 0);
  } else if (strcmp(op, "APPEND") == 0 && dn) {
    s->appends++;
    if (f != NULL) {
      f->data = realloc(f->data, f->len + blen + 1);
      memcpy(f->data + f->len, body, blen);
      f->len += blen;
    }
    pthread_mutex_unlock(&s->mu);
    respond(fd, 200, "OK", NULL, NULL, 0);
  } else if (strcmp(op, "MKDIRS") == 0) {
    char p2[1100];
    snprintf(p2, sizeof p2, "%s/.keep", path);
    add_file(s, p2, "", 0);
    pthread_mutex_unlock(&s->mu);
    respond_json(fd, 200, "OK", "{\"boolean\":true}");
  } else if (strcmp(op, "RENAME") == 0) {
    /* rename2: a file only here; dst's parent must exist */
    char dst[250], ro[32], parent[250];
    param(q ? q + 1 : "", "destination", dst, sizeof dst);
    param(q ? q + 1 : "", "renameoptions", ro, sizeof ro);
    s->renames++;
    snprintf(s->last_rename_opts, sizeof s->last_rename_opts, "%s", ro);
    snprintf(parent, sizeof parent, "%s", dst);
    char *slash = strrchr(parent, '/');
    if (slash != NULL) *(slash == parent ? slash + 1 : slash) = '\0';
    sfile *d = find_file(s, dst);
    if (f == NULL || !is_dir(s, parent)) {
      pthread_mutex_unlock(&s->mu);
      remote_exc(fd, 404, "Not Found", "FileNotFoundException",
                 f == NULL ? "rename source not found" : "rename destination parent not found");
    } else if (d != NULL && strcmp(ro, "OVERWRITE") != 0) {
      pthread_mutex_unlock(&s->mu);
      remote_exc(fd, 403, "Forbidden", "FileAlreadyExistsException",
                 "rename destination already exists");
    } else {
      if (d != NULL) {
        free(d->data);
        *d = s->files[--s->nfiles];
        f = find_file(s, path); /* the array moved */
      }
      snprintf(f->path, sizeof f->path, "%s", dst);
      pthread_mutex_unlock(&s->mu);
      respond(fd, 200, "OK", "Content-Type: application/octet-stream\r\n", NULL, 0);
    }
  } else if (strcmp(op, "DELETE") == 0) {
    int removed = 0;
    size_t pn = strlen(path);
    for (int i = 0; i < s->nfiles;) {
      if (strcmp(s->files[i].path, path) == 0 ||
          (strncmp(s->files[i].path, path, pn) == 0 && s->files[i].path[pn] == '/')) {
        free(s->files[i].data);
        s->files[i] = s->files[--s->nfiles];
        removed = 1;
      } else {
        i++;
      }
    }
    pthread_mutex_unlock(&s->mu);
    respond_json(fd, 200, "OK", removed ? "{\"boolean\":true}" : "{\"boolean\":false}");
  } else {
    pthread_mutex_unlock(&s->mu);
    remote_exc(fd, 400, "Bad Request", "IllegalArgumentException", "Invalid value for op");
  }
  free(body);
}

static void *conn_main(void *arg) {
  conn_arg *a = arg;
  handle(a->s, a->fd);
  shutdown(a->fd, SHUT_WR);
  close(a->fd);
  free(a);
  return NULL;
}

static void *accept_main(void *arg) {
  server *s = arg;
  while (!s->stop) {
    struct pollfd p = {s->fd, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    int c = accept(s->fd, NULL, NULL);
    if (c < 0) continue;
    conn_arg *a = malloc(sizeof *a);
    a->s = s;
    a->fd = c;
    pthread_mutex_lock(&s->mu);
    if (s->nconns < MAX_CONNS && pthread_create(&s->conns[s->nconns], NULL, conn_main, a) == 0) {
      s->nconns++;
    } else {
      close(c);
      free(a);
    }
    pthread_mutex_unlock(&s->mu);
  }
  return NULL;
}

static void server_start(server *s) {
  memset(s, 0, sizeof *s);
  s->shrink_to = -1;
  pthread_mutex_init(&s->mu, NULL);
  s->fd = socket(AF_INET, SOCK_STREAM, 0);
  CHECK(s->fd >= 0);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  CHECK(bind(s->fd, (struct sockaddr *)&a, sizeof a) == 0);
  CHECK(listen(s->fd, 64) == 0);
  socklen_t al = sizeof a;
  CHECK(getsockname(s->fd, (struct sockaddr *)&a, &al) == 0);
  s->port = ntohs(a.sin_port);
  CHECK(pthread_create(&s->acceptor, NULL, accept_main, s) == 0);
}

static void server_stop(server *s) {
  s->stop = 1;
  pthread_join(s->acceptor, NULL);
  for (int i = 0; i < s->nconns; i++) pthread_join(s->conns[i], NULL);
  close(s->fd);
  for (int i = 0; i < s->nfiles; i++) free(s->files[i].data);
  pthread_mutex_destroy(&s->mu);
}

/* ================================================================ helpers */

static void fill_pattern(uint8_t *p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1103515245u + 12345u;
    p[i] = (uint8_t)(seed >> 16);
  }
}

static void web_url(char *out, size_t cap, const server *s, const char *path) {
  snprintf(out, cap, "webhdfs://127.0.0.1:%u%s", s->port, path);
}

static ember_webhdfs_opts quick_opts(size_t range) {
  ember_webhdfs_opts o;
  ember_webhdfs_opts_init(&o);
  o.user = "alice";
  o.range_bytes = range;
  o.timeout_ms = 5000;
  o.retries = 3;
  return o;
}

/* Reads the whole file through the ember_read_fn interface with reads of
 * `chunk` bytes. */
static size_t read_all(ember_read_fn fn, void *src, uint8_t *out, size_t cap, size_t chunk) {
  size_t got = 0;
  for (;;) {
    size_t want = chunk < cap - got ? chunk : cap - got;
    int64_t r = fn(src, out + got, want ? want : 1);
    CHECK(r >= 0);
    if (r == 0) break;
    got += (size_t)r;
    CHECK(got <= cap);
  }
  return got;
}

/* ================================================================ JSON + conf */

TEST(json_parses_webhdfs_replies) {
  const char *doc =
      " {\"FileStatuses\":{\"FileStatus\":[{\"pathSuffix\":\"a\\u00e9\\ud83d\\ude00\\n\","
      "\"length\":9007199254740993,\"x\":-1.5e3,\"t\":true,\"f\":false,\"n\":null},[]]}} ";
  ember__json *j = NULL;
  CHECK_OK(ember__json_parse(doc, strlen(doc), 0, &j));
  const ember__json *arr = ember__json_get(ember__json_get(j, "FileStatuses"), "FileStatus");
  CHECK(arr && arr->kind == EMBER__JSON_ARRAY && arr->count == 2);
  const ember__json *e = arr->child;
  CHECK(strcmp(ember__json_get_str(e, "pathSuffix"), "a\xc3\xa9\xf0\x9f\x98\x80\n") == 0);
  int found = 0;
  CHECK(ember__json_get_int(e, "length", &found) == 9007199254740993LL && found);
  const ember__json *x = ember__json_get(e, "x");
  CHECK(x->kind == EMBER__JSON_NUMBER && !x->is_int && x->d == -1500.0);
  CHECK(ember__json_get(e, "t")->kind == EMBER__JSON_TRUE);
  CHECK(ember__json_get(e, "n")->kind == EMBER__JSON_NULL);
  CHECK(ember__json_get(e, "missing") == NULL);
  ember__json_get_int(e, "pathSuffix", &found);
  CHECK(!found);
  ember__json_free(j);
}

TEST(json_rejects_malformed) {
  const char *bad[] = {"", "{", "{\"a\":}", "[1,]", "{\"a\" 1}", "\"abc", "01", "1.",
                       "-", "tru", "[1] x", "\"\\x\"", "\"\\u12\"", "{\"a\":1,}", "\"a\x01\""};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ember__json *j = (ember__json *)1;
    CHECK_EQ_INT(ember__json_parse(bad[i], strlen(bad[i]), 0, &j), EMBER_EPROTO);
    CHECK(j == NULL);
    CHECK(strstr(ember_last_error(), "malformed JSON at byte") != NULL);
  }
  /* depth limit: 100 nested arrays */
  char deep[256];
  memset(deep, '[', 100);
  memset(deep + 100, ']', 100);
  ember__json *j = NULL;
  CHECK_EQ_INT(ember__json_parse(deep, 200, 0, &j), EMBER_EPROTO);
  CHECK(strstr(ember_last_error(), "too deep") != NULL);
  CHECK_OK(ember__json_parse(deep + 40, 120, 0, &j)); /* 60 deep is fine */
  ember__json_free(j);
  /* an integer too big for int64 is still a number, not an int */
  CHECK_OK(ember__json_parse("99999999999999999999", 20, 0, &j));
  CHECK(j->kind == EMBER__JSON_NUMBER && !j->is_int);
  ember__json_free(j);
}

TEST(hadoop_conf_parses_site_files) {
  const char *xml =
      "<?xml version=\"1.0\"?>\n<!-- a comment with <property> in it -->\n"
      "<configuration>\n"
      " <property><name>dfs.namenode.http-address</name>\n"
      "   <value> nn1.example.com:9870 </value><final>true</final></property>\n"
      " <property>\n  <name>a.b</name><value>x &amp; y &lt;z&gt; &#65;&#x42;</value>\n"
      "  <description>ignored</description></property>\n"
      " <property><name>cdata</name><value><![CDATA[<raw&>]]></value></property>\n"
      " <property><name>empty</name><value/></property>\n"
      " <property><name>a.b</name><value>override</value></property>\n"
      "</configuration>\n";
  ember__conf c = {0};
  CHECK_OK(ember__conf_parse(&c, xml, strlen(xml), "test.xml"));
  CHECK(strcmp(ember__conf_get(&c, "dfs.namenode.http-address"), "nn1.example.com:9870") == 0);
  CHECK(strcmp(ember__conf_get(&c, "a.b"), "override") == 0);
  CHECK(strcmp(ember__conf_get(&c, "cdata"), "<raw&>") == 0);
  CHECK(strcmp(ember__conf_get(&c, "empty"), "") == 0);
  CHECK(ember__conf_get(&c, "nope") == NULL);
  CHECK_EQ_INT(c.n, 5); /* both definitions of a.b are kept; the last wins */
  ember__conf_free(&c);

  const char *x2 = "<configuration><property><name>a</name><value>x &bogus; y</value>"
                   "</property></configuration>";
  CHECK_EQ_INT(ember__conf_parse(&c, x2, strlen(x2), "bad.xml"), EMBER_EPROTO);
  CHECK(strstr(ember_last_error(), "bad.xml") && strstr(ember_last_error(), "entity"));
  ember__conf_free(&c);
  const char *x3 = "<configuration><property><name>a</name>";
  CHECK_EQ_INT(ember__conf_parse(&c, x3, strlen(x3), "cut.xml"), EMBER_EPROTO);
  ember__conf_free(&c);
  const char *x4 = "<configuration><property><name>a</name><value>&#x110000;</value>"
                   "</property></configuration>";
  CHECK_EQ_INT(ember__conf_parse(&c, x4, strlen(x4), "ref.xml"), EMBER_EPROTO);
  ember__conf_free(&c);
  CHECK_EQ_INT(ember__conf_load(&c, "/nonexistent-dir", "hdfs-site.xml"), EMBER_ENOTFOUND);
}

/* ================================================================ reading */

TEST(read_in_ranges) {
  server s;
  server_start(&s);
  uint8_t data[1000], got[1000];
  fill_pattern(data, sizeof data, 7);
  add_file(&s, "/data/dir with space/f.bin", data, sizeof data);
  char url[256];
  web_url(url, sizeof url, &s, "/data/dir with space/f.bin");
  ember_webhdfs_opts o = quick_opts(64);
  ember_webhdfs_file *f;
  CHECK_OK(ember_webhdfs_open(&f, url, &o));
  CHECK_EQ_INT(ember_webhdfs_size(f), 1000);
  ember_read_fn fn = ember_webhdfs_read; /* the io.h interface, exactly */
  CHECK_EQ_INT(read_all(fn, f, got, sizeof got, 37), 1000);
  CHECK(memcmp(data, got, sizeof data) == 0);
  CHECK_EQ_INT(fn(f, got, 10), 0); /* end of stream stays end */
  ember_webhdfs_stats st;
  ember_webhdfs_file_stats(f, &st);
  CHECK_EQ_INT(st.ranges, 16); /* ceil(1000 / 64) */
  CHECK_EQ_INT(st.bytes, 1000);
  CHECK_EQ_INT(st.retries, 0);
  CHECK_EQ_INT(s.dn_requests, 16);
  CHECK(strcmp(s.last_user, "alice") == 0);

  /* seek back into the middle: a new range starts there */
  CHECK_OK(ember_webhdfs_seek(f, 500));
  uint8_t b[100];
  CHECK_EQ_INT(ember_webhdfs_read(f, b, 100), 64); /* range [500, 564) */
  CHECK(memcmp(b, data + 500, 64) == 0);
  CHECK_EQ_INT(ember_webhdfs_tell(f), 564);
  CHECK_EQ_INT(s.dn_requests, 17);
  /* a seek inside the buffered range costs no request */
  CHECK_OK(ember_webhdfs_seek(f, 520));
  CHECK_EQ_INT(ember_webhdfs_read(f, b, 10), 10);
  CHECK(memcmp(b, data + 520, 10) == 0);
  CHECK_EQ_INT(s.dn_requests, 17);
  CHECK_EQ_INT(ember_webhdfs_seek(f, 1001), EMBER_EINVAL);
  ember_webhdfs_close(f);
  server_stop(&s);
}

TEST(resume_after_lost_datanode_connection) {
  server s;
  server_start(&s);
  static uint8_t data[10000], got[10000];
  fill_pattern(data, sizeof data, 11);
  add_file(&s, "/x", data, sizeof data);
  s.drop_after = 100; /* the first two DataNode replies die after 100 bytes */
  s.drop_count = 2;
  char url[256];
  web_url(url, sizeof url, &s, "/x");
  ember_webhdfs_opts o = quick_opts(4096);
  ember_webhdfs_file *f;
  CHECK_OK(ember_webhdfs_open(&f, url, &o));
  CHECK_EQ_INT(read_all(ember_webhdfs_read, f, got, sizeof got, 1000), 10000);
  CHECK(memcmp(data, got, sizeof data) == 0);
  ember_webhdfs_stats st;
  ember_webhdfs_file_stats(f, &st);
  CHECK_EQ_INT(st.retries, 2);
  /* each retry resumed exactly where the data stopped */
  CHECK_EQ_INT(s.ndn, 5);
  CHECK_EQ_INT(s.dn_offsets[0], 0);
  CHECK_EQ_INT(s.dn_offsets[1], 100);
  CHECK_EQ_INT(s.dn_offsets[2], 200);
  CHECK_EQ_INT(s.dn_offsets[3], 4096);
  CHECK_EQ_INT(s.dn_offsets[4], 8192);
  ember_webhdfs_close(f);
  server_stop(&s);
}

TEST(gives_up_after_retries) {
  server s;
  server_start(&s);
  uint8_t data[500], got[500];
  fill_pattern(data, sizeof data, 3);
  add_file(&s, "/flaky", data, sizeof data);
  s.drop_after = 0; /* never a byte */
  s.drop_count = 1000;
  char url[256];
  web_url(url, sizeof url, &s, "/flaky");
  ember_webhdfs_opts o = quick_opts(4096);
  o.retries = 2;
  ember_webhdfs_file *f;
  CHECK_OK(ember_webhdfs_open(&f, url, &o));
  CHECK_EQ_INT(ember_webhdfs_read(f, got, sizeof got), EMBER_EIO);
  const char *m = ember_last_error();
  CHECK(strstr(m, "webhdfs OPEN webhdfs://127.0.0.1:") && strstr(m, "/flaky"));
  CHECK(strstr(m, "DataNode 127.0.0.1:") && strstr(m, "gave up after 2 retries at byte 0"));
  CHECK_EQ_INT(s.dn_requests, 3);
  /* the reader is usable again once the DataNode behaves */
  s.drop_count = 0;
  CHECK_EQ_INT(ember_webhdfs_read(f, got, sizeof got), 500);
  CHECK(memcmp(data, got, 500) == 0);
  ember_webhdfs_close(f);
  server_stop(&s);
}

TEST(stalled_datanode_times_out_and_is_retried) {
  server s;
  server_start(&s);
  uint8_t data[300], got[300];
  fill_pattern(data, sizeof data, 5);
  add_file(&s, "/slow", data, sizeof data);
  s.stall_ms = 3500;
  s.stall_count = 1;
  char url[256];
  web_url(url, sizeof url, &s, "/slow");
  ember_webhdfs_opts o = quick_opts(4096);
  o.timeout_ms = 1000;
  ember_webhdfs_file *f;
  CHECK_OK(ember_webhdfs_open(&f, url, &o));
  CHECK_EQ_INT(read_all(ember_webhdfs_read, f, got, sizeof got, 300), 300);
  CHECK(memcmp(data, got, 300) == 0);
  ember_webhdfs_stats st;
  ember_webhdfs_file_stats(f, &st);
  CHECK_EQ_INT(st.retries, 1);
  ember_webhdfs_close(f);

  /* without retries the stall is the error */
  s.stall_count = 1;
  o.retries = 0;
  CHECK_OK(ember_webhdfs_open(&f, url, &o));
  CHECK_EQ_INT(ember_webhdfs_read(f, got, sizeof got), EMBER_ETIMEDOUT);
  CHECK(strstr(ember_last_error(), "timed out") != NULL);
  ember_webhdfs_close(f);
  server_stop(&s);
}

TEST(missing_file_and_permission_errors) {
  server s;
  server_start(&s);
  add_file(&s, "/secret/f", "abc", 3)->denied = 1;
  add_file(&s, "/dir/a", "abc", 3);
  char url[256];
  ember_webhdfs_opts o = quick_opts(0);
  ember_webhdfs_file *f = (ember_webhdfs_file *)1;

  web_url(url, sizeof url, &s, "/no/such/file.tfrecord");
  CHECK_EQ_INT(ember_webhdfs_open(&f, url, &o), EMBER_ENOTFOUND);
  CHECK(f == NULL);
  const char *m = ember_last_error();
  CHECK(strstr(m, "/no/such/file.tfrecord") && strstr(m, "no such file or directory"));
  CHECK(strstr(m, "FileNotFoundException") != NULL);

  web_url(url, sizeof url, &s, "/secret/f");
  CHECK_EQ_INT(ember_webhdfs_open(&f, url, &o), EMBER_EPERM);
  m = ember_last_error();
  CHECK(strstr(m, "/secret/f") && strstr(m, "permission denied for user 'alice'"));
  CHECK(strstr(m, "AccessControlException") != NULL);

  web_url(url, sizeof url, &s, "/dir");
  CHECK_EQ_INT(ember_webhdfs_open(&f, url, &o), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "is a directory") != NULL);
  server_stop(&s);
}

TEST(protocol_violations) {
  server s;
  server_start(&s);
  uint8_t data[200], got[200];
  fill_pattern(data, sizeof data, 9);
  add_file(&s, "/f", data, sizeof data);
  char url[256];
  web_url(url, sizeof url, &s, "/f");
  ember_webhdfs_opts o = quick_opts(0);
  ember_webhdfs_file *f;
  /* a DataNode that sends more than asked is refused, not believed */
  s.over_send = 1;
  CHECK_OK(ember_webhdfs_open(&f, url, &o));
  CHECK_EQ_INT(ember_webhdfs_read(f, got, sizeof got), EMBER_EPROTO);
  CHECK(strstr(ember_last_error(), "more than the 200 bytes") != NULL);
  ember_webhdfs_close(f);
  s.over_send = 0;
  /* a file that shrinks after open is reported, not silently short */
  s.shrink_to = 50;
  CHECK_OK(ember_webhdfs_open(&f, url, &o));
  CHECK_EQ_INT(ember_webhdfs_read(f, got, sizeof got), EMBER_ETRUNCATED);
  CHECK(strstr(ember_last_error(), "ends at byte 50") && strstr(ember_last_error(), "200 bytes"));
  ember_webhdfs_close(f);
  server_stop(&s);
}

TEST(bad_urls) {
  ember_webhdfs_file *f;
  ember_webhdfs_opts o = quick_opts(0);
  CHECK_EQ_INT(ember_webhdfs_open(&f, "s3://bucket/x", &o), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "unsupported URL 's3://bucket/x'") != NULL);
  CHECK_EQ_INT(ember_webhdfs_open(&f, "/local/path", &o), EMBER_EINVAL);
  CHECK_EQ_INT(ember_webhdfs_open(&f, "hdfs://a b:1/x", &o), EMBER_EINVAL);
  CHECK_EQ_INT(ember_webhdfs_open(&f, "webhdfs:///x", &o), EMBER_EINVAL);
  CHECK_EQ_INT(ember_webhdfs_open(&f, "hdfs://h:1/a\nb", &o), EMBER_EINVAL);
  CHECK_EQ_INT(ember_webhdfs_open(&f, NULL, &o), EMBER_EINVAL);
  o.range_bytes = (size_t)EMBER_WEBHDFS_MAX_RANGE + 1;
  CHECK_EQ_INT(ember_webhdfs_open(&f, "webhdfs://h:1/x", &o), EMBER_EINVAL);
  /* hdfs:/// with no configuration says what is missing */
  o = quick_opts(0);
  o.conf_dir = "/nonexistent-conf-dir";
  CHECK_EQ_INT(ember_webhdfs_open(&f, "hdfs:///x", &o), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "dfs.namenode.http-address") != NULL);
  /* nothing listening: a connection error naming the NameNode */
  o.retries = 0;
  CHECK_EQ_INT(ember_webhdfs_open(&f, "webhdfs://127.0.0.1:1/x", &o), EMBER_EIO);
  CHECK(strstr(ember_last_error(), "NameNode 127.0.0.1:1") != NULL);
}

static void write_conf(const char *dir, const char *file, const char *body) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", dir, file);
  FILE *fp = fopen(p, "w");
  CHECK(fp != NULL);
  fputs(body, fp);
  fclose(fp);
}

static void make_conf_dir(char *dir, size_t cap) {
  snprintf(dir, cap, "/tmp/ember-whdfs-conf-XXXXXX");
  CHECK(mkdtemp(dir) != NULL);
}

static void rm_conf_dir(const char *dir) {
  char p[512];
  snprintf(p, sizeof p, "%s/core-site.xml", dir);
  unlink(p);
  snprintf(p, sizeof p, "%s/hdfs-site.xml", dir);
  unlink(p);
  rmdir(dir);
}

TEST(namenode_from_hadoop_conf_dir) {
  server s;
  server_start(&s);
  add_file(&s, "/d/f", "hello", 5);
  char dir[64], xml[2048], core[512];
  make_conf_dir(dir, sizeof dir);
  snprintf(xml, sizeof xml,
           "<configuration>\n<property><name>dfs.namenode.rpc-address</name>"
           "<value>nn.example:8020</value></property>\n"
           "<property><name>dfs.namenode.http-address</name><value>127.0.0.1:%u</value>"
           "</property></configuration>\n", s.port);
  write_conf(dir, "hdfs-site.xml", xml);
  snprintf(core, sizeof core, "<configuration><property><name>fs.defaultFS</name>"
           "<value>hdfs://nn.example:8020</value></property></configuration>");
  write_conf(dir, "core-site.xml", core);
  ember_webhdfs_opts o = quick_opts(0);
  o.conf_dir = dir;
  char got[16];
  ember_webhdfs_file *f;
  const char *urls[] = {"hdfs://nn.example:8020/d/f", "hdfs:///d/f"};
  for (int i = 0; i < 2; i++) {
    CHECK_OK(ember_webhdfs_open(&f, urls[i], &o));
    CHECK_EQ_INT(ember_webhdfs_read(f, got, sizeof got), 5);
    CHECK(memcmp(got, "hello", 5) == 0);
    ember_webhdfs_close(f);
  }
  /* $HADOOP_CONF_DIR is the default */
  setenv("HADOOP_CONF_DIR", dir, 1);
  o.conf_dir = NULL;
  CHECK_OK(ember_webhdfs_open(&f, "hdfs:///d/f", &o));
  ember_webhdfs_close(f);
  /* and the user comes from HADOOP_USER_NAME when not given */
  setenv("HADOOP_USER_NAME", "bob", 1);
  o.user = NULL;
  CHECK_OK(ember_webhdfs_open(&f, "hdfs:///d/f", &o));
  CHECK(strcmp(s.last_user, "bob") == 0);
  ember_webhdfs_close(f);
  /* an explicit namenode wins over everything */
  ember_webhdfs_opts o2 = quick_opts(0);
  char nn[64];
  snprintf(nn, sizeof nn, "http://127.0.0.1:%u/", s.port);
  o2.namenode = nn;
  o2.conf_dir = "/nonexistent";
  CHECK_OK(ember_webhdfs_open(&f, "hdfs://elsewhere:8020/d/f", &o2));
  ember_webhdfs_close(f);
  /* a malformed hdfs-site.xml is an error naming the file */
  write_conf(dir, "hdfs-site.xml", "<configuration><property><name>x</name>");
  o.conf_dir = dir;
  CHECK_EQ_INT(ember_webhdfs_open(&f, "hdfs:///d/f", &o), EMBER_EPROTO);
  CHECK(strstr(ember_last_error(), "hdfs-site.xml") != NULL);
  rm_conf_dir(dir);
  server_stop(&s);
}

TEST(ha_nameservice_skips_the_standby) {
  server standby, active;
  server_start(&standby);
  server_start(&active);
  standby.standby = 1;
  add_file(&active, "/f", "0123456789", 10);
  char dir[64], xml[2048];
  make_conf_dir(dir, sizeof dir);
  snprintf(xml, sizeof xml,
           "<configuration>\n"
           "<property><name>dfs.nameservices</name><value>ns1</value></property>\n"
           "<property><name>dfs.ha.namenodes.ns1</name><value>nn1, nn2</value></property>\n"
           "<property><name>dfs.namenode.http-address.ns1.nn1</name>"
           "<value>127.0.0.1:%u</value></property>\n"
           "<property><name>dfs.namenode.http-address.ns1.nn2</name>"
           "<value>127.0.0.1:%u</value></property>\n</configuration>\n",
           standby.port, active.port);
  write_conf(dir, "hdfs-site.xml", xml);
  ember_webhdfs_opts o = quick_opts(4);
  o.conf_dir = dir;
  ember_webhdfs_file *f;
  uint8_t got[10];
  CHECK_OK(ember_webhdfs_open(&f, "hdfs://ns1/f", &o));
  CHECK_EQ_INT(read_all(ember_webhdfs_read, f, got, sizeof got, 10), 10);
  CHECK(memcmp(got, "0123456789", 10) == 0);
  ember_webhdfs_close(f);
  /* the standby was asked once (GETFILESTATUS); later requests went to the
   * NameNode that answered */
  CHECK_EQ_INT(standby.nn_requests, 1);
  CHECK_EQ_INT(active.nn_requests, 4); /* status + 3 ranges of 4 bytes */
  rm_conf_dir(dir);
  server_stop(&standby);
  server_stop(&active);
}

/* ================================================================ metadata */

TEST(list_directory_of_part_files) {
  server s;
  server_start(&s);
  add_file(&s, "/out/part-00001", "bb", 2);
  add_file(&s, "/out/part-00000", "a", 1);
  add_file(&s, "/out/_SUCCESS", "", 0);
  add_file(&s, "/out/sub/x", "xyz", 3);
  add_file(&s, "/other/y", "y", 1);
  char url[256];
  web_url(url, sizeof url, &s, "/out");
  ember_webhdfs_opts o = quick_opts(0);
  ember_webhdfs_status *e;
  size_t n;
  CHECK_OK(ember_webhdfs_list(url, &o, &e, &n));
  CHECK_EQ_INT(n, 4);
  CHECK(strcmp(e[0].name, "_SUCCESS") == 0 && !e[0].is_dir && e[0].length == 0);
  CHECK(strcmp(e[1].name, "part-00000") == 0 && e[1].length == 1);
  CHECK(strcmp(e[2].name, "part-00001") == 0 && e[2].length == 2);
  CHECK(strcmp(e[3].name, "sub") == 0 && e[3].is_dir);
  CHECK_EQ_INT(e[1].permission, 0644);
  CHECK_EQ_INT(e[3].permission, 0755);
  CHECK_EQ_INT(e[1].mtime_ms, 1700000000123LL);
  CHECK(strcmp(e[1].owner, "hdfs") == 0 && strcmp(e[1].group, "supergroup") == 0);
  ember_webhdfs_list_free(e, n);

  web_url(url, sizeof url, &s, "/nope");
  CHECK_EQ_INT(ember_webhdfs_list(url, &o, &e, &n), EMBER_ENOTFOUND);
  CHECK(e == NULL && n == 0);

  ember_webhdfs_status st;
  web_url(url, sizeof url, &s, "/out/part-00001");
  CHECK_OK(ember_webhdfs_stat(url, &o, &st));
  CHECK(!st.is_dir && st.length == 2 && st.block_size == 1048576 && st.replication == 1);
  ember_webhdfs_status_clear(&st);
  server_stop(&s);
}

TEST(mkdirs_and_delete) {
  server s;
  server_start(&s);
  add_file(&s, "/t/a", "1", 1);
  char url[256];
  ember_webhdfs_opts o = quick_opts(0);
  web_url(url, sizeof url, &s, "/new/dir");
  CHECK_OK(ember_webhdfs_mkdirs(url, &o));
  CHECK(is_dir(&s, "/new/dir"));
  int deleted = -1;
  web_url(url, sizeof url, &s, "/t");
  CHECK_OK(ember_webhdfs_delete(url, 1, &o, &deleted));
  CHECK_EQ_INT(deleted, 1);
  CHECK(find_file(&s, "/t/a") == NULL);
  CHECK_OK(ember_webhdfs_delete(url, 1, &o, &deleted));
  CHECK_EQ_INT(deleted, 0);
  server_stop(&s);
}

/* ================================================================ writing */

TEST(write_small_file_is_one_create) {
  server s;
  server_start(&s);
  char url[256];
  web_url(url, sizeof url, &s, "/w/small.txt");
  ember_webhdfs_opts o = quick_opts(1024);
  CHECK_OK(ember_webhdfs_write_file(url, "hello hdfs", 10, 0, &o));
  sfile *f = find_file(&s, "/w/small.txt");
  CHECK(f != NULL && f->len == 10 && memcmp(f->data, "hello hdfs", 10) == 0);
  CHECK_EQ_INT(s.creates, 1);
  CHECK_EQ_INT(s.appends, 0);
  /* no overwrite: refused, naming the file */
  CHECK_EQ_INT(ember_webhdfs_write_file(url, "x", 1, 0, &o), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "/w/small.txt") && strstr(ember_last_error(), "already exists"));
  CHECK_OK(ember_webhdfs_write_file(url, "x", 1, EMBER_WEBHDFS_OVERWRITE, &o));
  CHECK(find_file(&s, "/w/small.txt")->len == 1);
  /* an empty file is still created */
  web_url(url, sizeof url, &s, "/w/empty");
  CHECK_OK(ember_webhdfs_write_file(url, NULL, 0, 0, &o));
  CHECK(find_file(&s, "/w/empty") != NULL && find_file(&s, "/w/empty")->len == 0);
  server_stop(&s);
}

TEST(writer_creates_then_appends) {
  server s;
  server_start(&s);
  uint8_t data[250], got[250];
  fill_pattern(data, sizeof data, 21);
  char url[256];
  web_url(url, sizeof url, &s, "/w/big.bin");
  ember_webhdfs_opts o = quick_opts(100);
  ember_webhdfs_writer *w;
  CHECK_OK(ember_webhdfs_writer_create(&w, url, 0, &o));
  for (size_t i = 0; i < 250; i += 25) CHECK_OK(ember_webhdfs_writer_write(w, data + i, 25));
  CHECK_EQ_INT(s.creates, 1); /* the first 100 bytes */
  CHECK_EQ_INT(s.appends, 1); /* the next 100 */
  CHECK_OK(ember_webhdfs_writer_close(w));
  CHECK_EQ_INT(s.appends, 2); /* the last 50 at close */
  /* read it back through the reader */
  ember_webhdfs_file *f;
  CHECK_OK(ember_webhdfs_open(&f, url, &o));
  CHECK_EQ_INT(read_all(ember_webhdfs_read, f, got, sizeof got, 250), 250);
  CHECK(memcmp(data, got, 250) == 0);
  ember_webhdfs_close(f);
  server_stop(&s);
}

/* The point of ember_webhdfs_read matching io.h: the TFRecord reader reads
 * HDFS directly (here GZIP-compressed, through small ranges and a DataNode
 * connection that dies once mid-file). */
TEST(tfrecord_reader_over_webhdfs) {
  ember_tfr_writer *w;
  CHECK_OK(ember_tfr_writer_open_mem(&w, EMBER_TFR_GZIP, -1));
  char rec[64];
  for (int i = 0; i < 500; i++) {
    int n = snprintf(rec, sizeof rec, "record %d with some padding %d", i, i * 7);
    CHECK_OK(ember_tfr_writer_write(w, rec, (size_t)n));
  }
  CHECK_OK(ember_tfr_writer_close(w));
  const uint8_t *bytes;
  size_t len;
  CHECK_OK(ember_tfr_writer_mem(w, &bytes, &len));
  server s;
  server_start(&s);
  add_file(&s, "/data/train.tfrecord.gz", bytes, len);
  ember_tfr_writer_destroy(w);
  s.drop_after = 300;
  s.drop_count = 1;
  char url[256];
  web_url(url, sizeof url, &s, "/data/train.tfrecord.gz");
  ember_webhdfs_opts o = quick_opts(1024);
  ember_webhdfs_file *f;
  CHECK_OK(ember_webhdfs_open(&f, url, &o));
  ember_tfr_options to = {EMBER_TFR_GZIP, 0, 0, 512};
  ember_tfr_reader *r;
  CHECK_OK(ember_tfr_reader_open_fn(&r, ember_webhdfs_read, f, url, &to));
  const uint8_t *d;
  size_t n;
  int count = 0, rc;
  while ((rc = ember_tfr_reader_next(r, &d, &n)) == 1) {
    int k = snprintf(rec, sizeof rec, "record %d with some padding %d", count, count * 7);
    CHECK((size_t)k == n && memcmp(d, rec, n) == 0);
    count++;
  }
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(count, 500);
  ember_webhdfs_stats st;
  ember_webhdfs_file_stats(f, &st);
  CHECK_EQ_INT(st.retries, 1);
  CHECK_EQ_INT(st.bytes, len);
  ember_tfr_reader_destroy(r);
  ember_webhdfs_close(f);
  server_stop(&s);
}

/* ================================================================ rename, TFRecord writer */

TEST(rename_file_atomically) {
  server s;
  server_start(&s);
  add_file(&s, "/out/_temporary/part-0-attempt", "abc", 3);
  add_file(&s, "/out/old", "zz", 2);
  char src[256], dst_url[256];
  ember_webhdfs_opts o = quick_opts(0);
  web_url(src, sizeof src, &s, "/out/_temporary/part-0-attempt");
  /* a path destination, never "move into" (renameoptions is always sent) */
  CHECK_OK(ember_webhdfs_rename(src, "/out/part-00000", 0, &o));
  CHECK(strcmp(s.last_rename_opts, "NONE") == 0);
  CHECK(find_file(&s, "/out/_temporary/part-0-attempt") == NULL);
  sfile *f = find_file(&s, "/out/part-00000");
  CHECK(f != NULL && f->len == 3 && memcmp(f->data, "abc", 3) == 0);
  /* the source is gone now: not found, naming it */
  CHECK_EQ_INT(ember_webhdfs_rename(src, "/out/part-00001", 0, &o), EMBER_ENOTFOUND);
  CHECK(strstr(ember_last_error(), "RENAME") && strstr(ember_last_error(), "part-0-attempt"));
  /* an existing destination: refused without OVERWRITE, replaced with it */
  web_url(src, sizeof src, &s, "/out/part-00000");
  web_url(dst_url, sizeof dst_url, &s, "/out/old");
  CHECK_EQ_INT(ember_webhdfs_rename(src, dst_url, 0, &o), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "already exists") != NULL);
  CHECK(find_file(&s, "/out/old")->len == 2);
  CHECK_OK(ember_webhdfs_rename(src, dst_url, EMBER_WEBHDFS_OVERWRITE, &o));
  CHECK(strcmp(s.last_rename_opts, "OVERWRITE") == 0);
  CHECK(find_file(&s, "/out/old")->len == 3 && find_file(&s, "/out/part-00000") == NULL);
  /* a missing parent, another file system, a relative path */
  web_url(src, sizeof src, &s, "/out/old");
  CHECK_EQ_INT(ember_webhdfs_rename(src, "/nowhere/x", 0, &o), EMBER_ENOTFOUND);
  int before = s.renames;
  CHECK_EQ_INT(ember_webhdfs_rename(src, "webhdfs://10.0.0.1:1/x", 0, &o), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "another file system") != NULL);
  CHECK_EQ_INT(ember_webhdfs_rename(src, "rel/x", 0, &o), EMBER_EINVAL);
  CHECK_EQ_INT(ember_webhdfs_rename(src, NULL, 0, &o), EMBER_EINVAL);
  CHECK_EQ_INT(s.renames, before); /* refused before any request */
  server_stop(&s);
}

/* TFRecords streamed to WebHDFS by the C writer (GZIP, in CREATE + APPEND
 * chunks), then read back by the reader that owns its file. */
TEST(tfrecord_writer_and_reader_over_webhdfs) {
  server s;
  server_start(&s);
  char url[256];
  web_url(url, sizeof url, &s, "/data/_temporary/w.tfrecord.gz");
  ember_webhdfs_opts o = quick_opts(64 << 10);
  ember_tfr_writer *w;
  CHECK_OK(ember_webhdfs_tfr_writer_open(&w, url, 0, &o, EMBER_TFR_GZIP, 1));
  char rec[96];
  uint8_t noise[64];
  for (int i = 0; i < 16000; i++) { /* ~1.3 MB: past the writer's 1 MiB staging */
    fill_pattern(noise, sizeof noise, (uint32_t)i); /* incompressible: several chunks */
    int n = snprintf(rec, sizeof rec, "record %d ", i);
    memcpy(rec + n, noise, 64);
    CHECK_OK(ember_tfr_writer_write(w, rec, (size_t)n + 64));
  }
  CHECK(find_file(&s, "/data/_temporary/w.tfrecord.gz") != NULL); /* streamed, not at close */
  CHECK_OK(ember_tfr_writer_close(w));
  CHECK(s.creates == 1 && s.appends >= 10);
  ember_tfr_writer_destroy(w);
  CHECK_OK(ember_webhdfs_rename(url, "/data/part-00000.tfrecord.gz", 0, &o));
  web_url(url, sizeof url, &s, "/data/part-00000.tfrecord.gz");
  ember_tfr_options to = {EMBER_TFR_GZIP, 0, 0, 1000};
  ember_tfr_reader *r;
  CHECK_OK(ember_webhdfs_tfr_reader_open(&r, url, &o, &to));
  const uint8_t *d;
  size_t n;
  int count = 0, rc;
  while ((rc = ember_tfr_reader_next(r, &d, &n)) == 1) {
    fill_pattern(noise, sizeof noise, (uint32_t)count);
    int k = snprintf(rec, sizeof rec, "record %d ", count);
    CHECK(n == (size_t)k + 64 && memcmp(d, rec, (size_t)k) == 0 && memcmp(d + k, noise, 64) == 0);
    count++;
  }
  CHECK_EQ_INT(rc, 0);
  CHECK_EQ_INT(count, 16000);
  ember_tfr_reader_destroy(r); /* closes the WebHDFS file (ASan: no leak) */
  /* a missing file fails at open, naming it; nothing leaks */
  web_url(url, sizeof url, &s, "/data/missing");
  CHECK_EQ_INT(ember_webhdfs_tfr_reader_open(&r, url, &o, &to), EMBER_ENOTFOUND);
  CHECK(r == NULL && strstr(ember_last_error(), "/data/missing") != NULL);
  /* a writer dropped without close leaves no complete-looking file behind
   * only if nothing was flushed: here the one chunk was never sent */
  web_url(url, sizeof url, &s, "/data/_temporary/dropped");
  CHECK_OK(ember_webhdfs_tfr_writer_open(&w, url, 0, &o, EMBER_TFR_PLAIN, -1));
  CHECK_OK(ember_tfr_writer_write(w, "x", 1));
  ember_tfr_writer_destroy(w);
  CHECK(find_file(&s, "/data/_temporary/dropped") == NULL);
  /* an upload that fails at close reports it from close */
  web_url(url, sizeof url, &s, "/data/part-00000.tfrecord.gz"); /* exists, no OVERWRITE */
  CHECK_OK(ember_webhdfs_tfr_writer_open(&w, url, 0, &o, EMBER_TFR_PLAIN, -1));
  CHECK_OK(ember_tfr_writer_write(w, "x", 1));
  CHECK_EQ_INT(ember_tfr_writer_close(w), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "already exists") != NULL);
  ember_tfr_writer_destroy(w);
  server_stop(&s);
}

/* ================================================================ Kerberos */

static void token_data(char *out, size_t cap, const char *name) {
  const char *f = __FILE__, *slash = strrchr(f, '/');
  snprintf(out, cap, "%.*sdata/%s", slash ? (int)(slash - f + 1) : 0, f, name);
}

/* A Kerberized NameNode, and a process with no ticket: the configuration or
 * the NameNode's 401 turns the client to Kerberos; the HDFS token of the
 * token file (Hadoop-written, tests/c/data) goes on every NameNode request,
 * without user.name; a refused or unreadable token, or none and no ticket,
 * is EMBER_EAUTH at once (one request, no retries) saying what to do. */
TEST(kerberized_namenode_takes_the_delegation_token) {
  char tokens[1024];
  token_data(tokens, sizeof tokens, "tokens-writable.bin");
  ember__credentials creds = {0};
  CHECK_OK(ember__credentials_load(&creds, tokens));
  const ember__token *hdfs_token =
      ember__credentials_find(&creds, "HDFS_DELEGATION_TOKEN", "127.0.0.1:8020");
  CHECK(hdfs_token != NULL);
  char *want = NULL;
  CHECK_OK(ember__token_encode_url(hdfs_token, &want));
  ember__credentials_free(&creds);

  server s;
  server_start(&s);
  snprintf(s.want_token, sizeof s.want_token, "%s", want);
  add_file(&s, "/d/f", "hello", 5);
  char dir[64], xml[2048];
  make_conf_dir(dir, sizeof dir);
  snprintf(xml, sizeof xml,
           "<configuration><property><name>dfs.namenode.rpc-address</name>"
           "<value>127.0.0.1:8020</value></property><property><name>dfs.namenode.http-address"
           "</name><value>127.0.0.1:%u</value></property></configuration>", s.port);
  write_conf(dir, "hdfs-site.xml", xml);
  write_conf(dir, "core-site.xml", "<configuration><property><name>fs.defaultFS</name>"
             "<value>hdfs://127.0.0.1:8020</value></property></configuration>");
  setenv("KRB5CCNAME", "FILE:/nonexistent/ember-test-ccache", 1);
  unsetenv("KRB5_CLIENT_KTNAME");
  ember_webhdfs_opts o = quick_opts(0);
  o.conf_dir = dir;
  o.user = NULL;
  char got[8];
  ember_webhdfs_file *f;

  /* simple-auth configuration, no token file: the 401 turns to Kerberos,
   * which has no ticket */
  unsetenv("HADOOP_TOKEN_FILE_LOCATION");
  CHECK_EQ_INT(ember_webhdfs_open(&f, "hdfs:///d/f", &o), EMBER_EAUTH);
  CHECK(strstr(ember_last_error(), "no Kerberos ticket") != NULL);
  CHECK(strstr(ember_last_error(), "kinit") != NULL);
  CHECK(strstr(ember_last_error(), "HADOOP_TOKEN_FILE_LOCATION") != NULL);

  /* the token file: the 401 turns to its token, which the NameNode takes */
  setenv("HADOOP_TOKEN_FILE_LOCATION", tokens, 1);
  CHECK_OK(ember_webhdfs_open(&f, "hdfs:///d/f", &o));
  CHECK_EQ_INT(ember_webhdfs_read(f, got, sizeof got), 5);
  CHECK(memcmp(got, "hello", 5) == 0);
  ember_webhdfs_close(f);
  CHECK(strcmp(s.last_delegation, want) == 0);
  CHECK(s.last_user[0] == '\0'); /* no user.name beside a token */

  /* core-site.xml says kerberos: the token from the first request on */
  write_conf(dir, "core-site.xml", "<configuration><property><name>fs.defaultFS</name>"
             "<value>hdfs://127.0.0.1:8020</value></property><property><name>hadoop."
             "security.authentication</name><value>kerberos</value></property>"
             "</configuration>");
  int before = s.nn_requests;
  CHECK_OK(ember_webhdfs_mkdirs("hdfs:///d/new", &o));
  CHECK_EQ_INT(s.nn_requests - before, 1);

  /* a refused token: named, with its owner and file, once, without retries */
  s.token_expired = 1;
  before = s.nn_requests;
  CHECK_EQ_INT(ember_webhdfs_open(&f, "hdfs:///d/f", &o), EMBER_EAUTH);
  CHECK_EQ_INT(s.nn_requests - before, 1);
  const char *m = ember_last_error();
  CHECK(strstr(m, "refused the HDFS_DELEGATION_TOKEN token for 127.0.0.1:8020 owned by alice")
        != NULL);
  CHECK(strstr(m, tokens) != NULL && strstr(m, "--keytab") != NULL);
  s.token_expired = 0;

  /* a token file that is not one, and one that is missing */
  char bad[128];
  snprintf(bad, sizeof bad, "%s/garbage.tokens", dir);
  write_conf(dir, "garbage.tokens", "HDTS\x00\x05not a token");
  setenv("HADOOP_TOKEN_FILE_LOCATION", bad, 1);
  CHECK_EQ_INT(ember_webhdfs_open(&f, "hdfs:///d/f", &o), EMBER_EAUTH);
  CHECK(strstr(ember_last_error(), "token file Ember cannot use") != NULL);
  setenv("HADOOP_TOKEN_FILE_LOCATION", "/nonexistent/x.tokens", 1);
  CHECK_EQ_INT(ember_webhdfs_open(&f, "hdfs:///d/f", &o), EMBER_EAUTH);
  CHECK(strstr(ember_last_error(), "/nonexistent/x.tokens") != NULL);
  unsetenv("HADOOP_TOKEN_FILE_LOCATION");
  unlink(bad);
  rm_conf_dir(dir);
  free(want);
  server_stop(&s);
}

RUN_TESTS(T(json_parses_webhdfs_replies), T(json_rejects_malformed),
          T(hadoop_conf_parses_site_files), T(read_in_ranges),
          T(resume_after_lost_datanode_connection), T(gives_up_after_retries),
          T(stalled_datanode_times_out_and_is_retried), T(missing_file_and_permission_errors),
          T(protocol_violations), T(bad_urls), T(namenode_from_hadoop_conf_dir),
          T(ha_nameservice_skips_the_standby), T(list_directory_of_part_files),
          T(mkdirs_and_delete), T(write_small_file_is_one_create),
          T(writer_creates_then_appends), T(tfrecord_reader_over_webhdfs),
          T(rename_file_atomically), T(tfrecord_writer_and_reader_over_webhdfs),
          T(kerberized_namenode_takes_the_delegation_token))
