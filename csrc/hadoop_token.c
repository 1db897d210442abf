/* hadoop_token.c - Hadoop token storage files (see hadoop_token.h).
 *
 * Two small decoders over one bounded reader: WritableUtils' zero-compressed
 * vints for the WRITABLE form and the delegation-token identifier, protobuf
 * varints and length-delimited fields for the PROTOBUF form.  Every read
 * first checks the bytes left (nanopb's bytes_left); a length-delimited
 * protobuf field is read through a sub-reader that ends where the field
 * does, so a field cannot reach past its parent. */
#include "hadoop_token.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ember/error.h"
#include "hadoop_conf.h"

/* ================================================================ reader */

typedef struct {
  const uint8_t *base;    /* offsets in messages count from here */
  const uint8_t *p, *end; /* what is left to read */
  const char *what;       /* the source, first in every message */
  const char *unit;       /* "offset", "identifier byte", ... */
  char field[96];         /* what is being read, e.g. "token 2 password" */
} rd;

static size_t left(const rd *r) { return (size_t)(r->end - r->p); }

static void set_field(rd *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_field(rd *r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->field, sizeof r->field, fmt, ap);
  va_end(ap);
}

/* EMBER_EPROTO "<what>: <problem> (<unit> <offset of at>)". */
static int bad(const rd *r, const uint8_t *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad(const rd *r, const uint8_t *at, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return ember__set_error(EMBER_EPROTO, "%s: %s (%s %zu)", r->what, msg, r->unit,
                          (size_t)(at - r->base));
}

static int oom(const char *what) {
  return ember__set_error(EMBER_ENOMEM, "%s: out of memory", what);
}

/* A malloc'd copy of p[0..n) with a 0 after it (so never NULL for n == 0). */
static uint8_t *dup_bytes(const uint8_t *p, size_t n) {
  if (n == SIZE_MAX) return NULL;
  uint8_t *d = malloc(n + 1);
  if (d == NULL) return NULL;
  if (n > 0) memcpy(d, p, n);
  d[n] = 0;
  return d;
}

/* Two's complement without implementation-defined conversions. */
static int64_t as_int64(uint64_t v) {
  return v <= (uint64_t)INT64_MAX ? (int64_t)v : -(int64_t)(~v) - 1;
}

/* ================================================================ Writable */

/* WritableUtils.readVLong: a first byte in [-112, 127] is the value; else it
 * gives the sign and the count (1..8) of big-endian magnitude bytes after it
 * (one's complement for negatives).  Like Hadoop, non-minimal forms are
 * accepted; unlike Hadoop, a magnitude that overflows int64 is not. */
static int w_vlong(rd *r, int64_t *out) {
  const uint8_t *at = r->p;
  if (left(r) < 1) return bad(r, at, "%s: the input ends where a vint should start", r->field);
  int first = (int8_t)r->p[0];
  size_t size = first >= -112 ? 1 : first < -120 ? (size_t)(-119 - first) : (size_t)(-111 - first);
  if (left(r) < size)
    return bad(r, at, "%s: the input ends inside a %zu-byte vint, %zu bytes left", r->field,
               size, left(r));
  if (size == 1) {
    r->p++;
    *out = first;
    return EMBER_OK;
  }
  uint64_t v = 0;
  for (size_t k = 1; k < size; k++) v = v << 8 | r->p[k];
  /* Hadoop would wrap around; writeVLong never writes a magnitude >= 2^63 */
  if (v >> 63) return bad(r, at, "%s: %zu-byte vint overflows 64 bits", r->field, size);
  r->p += size;
  *out = as_int64(first < -120 ? ~v : v);
  return EMBER_OK;
}

/* WritableUtils.readVInt: a vlong that must fit in 32 bits. */
static int w_vint(rd *r, int32_t *out) {
  const uint8_t *at = r->p;
  int64_t v = 0;
  int rc = w_vlong(r, &v);
  if (rc != EMBER_OK) return rc;
  if (v < INT32_MIN || v > INT32_MAX)
    return bad(r, at, "%s: vint %lld does not fit in 32 bits", r->field, (long long)v);
  *out = (int32_t)v;
  return EMBER_OK;
}

/* A vint length, bounded by the bytes left and by max. */
static int w_len(rd *r, size_t max, size_t *out) {
  const uint8_t *at = r->p;
  int32_t n = 0;
  int rc = w_vint(r, &n);
  if (rc != EMBER_OK) return rc;
  if (n < 0) return bad(r, at, "%s length %d is negative", r->field, (int)n);
  if ((size_t)n > left(r))
    return bad(r, at, "%s length %d runs past the end, %zu bytes left", r->field, (int)n,
               left(r));
  if ((size_t)n > max)
    return bad(r, at, "%s length %d is more than the %zu accepted", r->field, (int)n, max);
  *out = (size_t)n;
  return EMBER_OK;
}

/* vint length + bytes, copied (out NULL: skipped). */
static int w_bytes(rd *r, uint8_t **out, size_t *len) {
  size_t n = 0;
  int rc = w_len(r, SIZE_MAX, &n);
  if (rc != EMBER_OK) return rc;
  if (out != NULL) {
    if ((*out = dup_bytes(r->p, n)) == NULL) return oom(r->what);
    *len = n;
  }
  r->p += n;
  return EMBER_OK;
}

/* org.apache.hadoop.io.Text: vint length + UTF-8 (not validated, as in
 * Hadoop), copied as a C string, so a NUL byte is refused (out NULL:
 * skipped, NULs allowed). */
static int w_text(rd *r, size_t max, char **out) {
  const uint8_t *at = r->p;
  size_t n = 0;
  int rc = w_len(r, max, &n);
  if (rc != EMBER_OK) return rc;
  if (out != NULL) {
    if (memchr(r->p, 0, n) != NULL) return bad(r, at, "%s contains a NUL byte", r->field);
    if ((*out = (char *)dup_bytes(r->p, n)) == NULL) return oom(r->what);
  }
  r->p += n;
  return EMBER_OK;
}

/* ================================================================ tokens */

void ember__token_clear(ember__token *t) {
  if (t == NULL) return;
  free(t->identifier);
  free(t->password);
  free(t->kind);
  free(t->service);
  free(t->alias);
  memset(t, 0, sizeof *t);
}

void ember__credentials_free(ember__credentials *c) {
  if (c == NULL) return;
  for (size_t i = 0; i < c->n; i++) ember__token_clear(&c->tokens[i]);
  free(c->tokens);
  memset(c, 0, sizeof *c);
}

/* Adds t (taking its fields; t is zeroed): replaces the token of the same
 * alias if there is one, as Credentials' map does, else appends. */
static int add_token(ember__credentials *c, size_t *cap, ember__token *t, const char *what) {
  for (size_t i = 0; i < c->n; i++) {
    if (strcmp(c->tokens[i].alias, t->alias) == 0) {
      ember__token_clear(&c->tokens[i]);
      c->tokens[i] = *t;
      memset(t, 0, sizeof *t);
      return EMBER_OK;
    }
  }
  if (c->n == *cap) {
    size_t ncap = *cap ? *cap * 2 : 4; /* at most 2 * EMBER__TOKEN_MAX_COUNT */
    ember__token *nt = realloc(c->tokens, ncap * sizeof *nt);
    if (nt == NULL) return oom(what);
    c->tokens = nt;
    *cap = ncap;
  }
  c->tokens[c->n++] = *t;
  memset(t, 0, sizeof *t);
  return EMBER_OK;
}

/* Token.readFields: identifier, password, Text kind, Text service. */
static int w_token(rd *r, size_t i, ember__token *t) {
  int rc;
  set_field(r, "token %zu identifier", i);
  if ((rc = w_bytes(r, &t->identifier, &t->identifier_len)) != EMBER_OK) return rc;
  set_field(r, "token %zu password", i);
  if ((rc = w_bytes(r, &t->password, &t->password_len)) != EMBER_OK) return rc;
  set_field(r, "token %zu kind", i);
  if ((rc = w_text(r, SIZE_MAX, &t->kind)) != EMBER_OK) return rc;
  set_field(r, "token %zu service", i);
  return w_text(r, SIZE_MAX, &t->service);
}

/* Credentials.readFields: vint n, n x (Text alias, Token); vint m,
 * m x (Text alias, vint len, secret). */
static int parse_writable(rd *r, ember__credentials *c) {
  const uint8_t *at = r->p;
  int32_t count = 0;
  size_t cap = 0;
  int rc;
  set_field(r, "token count");
  if ((rc = w_vint(r, &count)) != EMBER_OK) return rc;
  if (count < 0) return bad(r, at, "token count %d is negative", (int)count);
  if ((uint32_t)count > EMBER__TOKEN_MAX_COUNT)
    return ember__set_error(EMBER_ETOOBIG, "%s: %d tokens, more than the %u accepted (offset %zu)",
                            r->what, (int)count, EMBER__TOKEN_MAX_COUNT, (size_t)(at - r->base));
  for (int32_t i = 1; i <= count; i++) {
    ember__token t = {0};
    set_field(r, "token %d alias", (int)i);
    rc = w_text(r, SIZE_MAX, &t.alias);
    if (rc == EMBER_OK) rc = w_token(r, (size_t)i, &t);
    if (rc == EMBER_OK) rc = add_token(c, &cap, &t, r->what);
    ember__token_clear(&t);
    if (rc != EMBER_OK) return rc;
  }
  at = r->p;
  set_field(r, "secret count");
  if ((rc = w_vint(r, &count)) != EMBER_OK) return rc;
  if (count < 0) return bad(r, at, "secret count %d is negative", (int)count);
  /* no cap needed: nothing is kept, and each secret costs input bytes */
  for (int32_t i = 1; i <= count; i++) {
    set_field(r, "secret %d alias", (int)i);
    if ((rc = w_text(r, SIZE_MAX, NULL)) != EMBER_OK) return rc;
    set_field(r, "secret %d", (int)i);
    if ((rc = w_bytes(r, NULL, NULL)) != EMBER_OK) return rc;
  }
  return EMBER_OK; /* trailing bytes are ignored, as Hadoop does */
}

/* ================================================================ protobuf */

enum { PB_VARINT = 0, PB_I64 = 1, PB_LEN = 2, PB_I32 = 5 };

static int pb_varint(rd *r, uint64_t *out) {
  const uint8_t *at = r->p;
  uint64_t v = 0;
  for (unsigned k = 0; k < 10; k++) {
    if (r->p == r->end) return bad(r, at, "%s: the input ends inside a varint", r->field);
    uint8_t b = *r->p++;
    v |= (uint64_t)(b & 0x7F) << (7 * k);
    if (!(b & 0x80)) {
      *out = v;
      return EMBER_OK;
    }
  }
  return bad(r, at, "%s: varint longer than 10 bytes", r->field);
}

/* A length-delimited field's contents as a sub-reader; r moves past it. */
static int pb_sub(rd *r, rd *sub) {
  const uint8_t *at = r->p;
  uint64_t n = 0;
  int rc = pb_varint(r, &n);
  if (rc != EMBER_OK) return rc;
  if (n > left(r))
    return bad(r, at, "%s length %llu runs past the end, %zu bytes left", r->field,
               (unsigned long long)n, left(r));
  *sub = *r;
  sub->end = r->p + n;
  r->p += n;
  return EMBER_OK;
}

/* The next field's number and wire type; *done at the end of r. */
static int pb_tag(rd *r, uint32_t *field, unsigned *wt, int *done) {
  const uint8_t *at = r->p;
  *done = r->p == r->end;
  if (*done) return EMBER_OK;
  uint64_t tag = 0;
  int rc = pb_varint(r, &tag);
  if (rc != EMBER_OK) return rc;
  if (tag >> 3 == 0 || tag > UINT32_MAX)
    return bad(r, at, "%s: invalid protobuf tag %llu", r->field, (unsigned long long)tag);
  *field = (uint32_t)(tag >> 3);
  *wt = (unsigned)(tag & 7);
  return EMBER_OK;
}

/* Skips a field protobuf does not know here (or knows with another wire
 * type, which protobuf also treats as unknown). */
static int pb_skip(rd *r, uint32_t field, unsigned wt) {
  const uint8_t *at = r->p;
  uint64_t v;
  rd sub;
  size_t n = 0;
  switch (wt) {
  case PB_VARINT:
    return pb_varint(r, &v);
  case PB_LEN:
    return pb_sub(r, &sub);
  case PB_I64:
  case PB_I32:
    n = wt == PB_I64 ? 8 : 4;
    if (left(r) < n)
      return bad(r, at, "%s: the input ends inside field %u, %zu bytes left", r->field,
                 (unsigned)field, left(r));
    r->p += n;
    return EMBER_OK;
  default:
    return bad(r, at, "%s: field %u has wire type %u (groups are not supported)", r->field,
               (unsigned)field, wt);
  }
}

/* A bytes field into *out (replacing an earlier value: last one wins). */
static int pb_bytes(rd *r, uint8_t **out, size_t *len) {
  rd sub;
  int rc = pb_sub(r, &sub);
  if (rc != EMBER_OK) return rc;
  uint8_t *d = dup_bytes(sub.p, left(&sub));
  if (d == NULL) return oom(r->what);
  free(*out);
  *out = d;
  *len = left(&sub);
  return EMBER_OK;
}

/* A string field into *out as a C string (out NULL: only skipped). */
static int pb_string(rd *r, char **out) {
  const uint8_t *at = r->p;
  rd sub;
  int rc = pb_sub(r, &sub);
  if (rc != EMBER_OK) return rc;
  if (out == NULL) return EMBER_OK;
  if (memchr(sub.p, 0, left(&sub)) != NULL)
    return bad(r, at, "%s contains a NUL byte", r->field);
  char *s = (char *)dup_bytes(sub.p, left(&sub));
  if (s == NULL) return oom(r->what);
  free(*out);
  *out = s;
  return EMBER_OK;
}

enum { HAS_ID = 1, HAS_PW = 2, HAS_KIND = 4, HAS_SERVICE = 8, HAS_ALL = 15 };

/* TokenProto into t; a second TokenProto for the same entry merges into
 * the first, field by field, as protobuf does. */
static int pb_token(rd *r, size_t i, ember__token *t, unsigned *has) {
  for (;;) {
    uint32_t field;
    unsigned wt;
    int done, rc;
    set_field(r, "token %zu", i);
    if ((rc = pb_tag(r, &field, &wt, &done)) != EMBER_OK) return rc;
    if (done) return EMBER_OK;
    if (wt != PB_LEN || field > 4) {
      rc = pb_skip(r, field, wt);
    } else if (field == 1) {
      set_field(r, "token %zu identifier", i);
      rc = pb_bytes(r, &t->identifier, &t->identifier_len);
      *has |= HAS_ID;
    } else if (field == 2) {
      set_field(r, "token %zu password", i);
      rc = pb_bytes(r, &t->password, &t->password_len);
      *has |= HAS_PW;
    } else if (field == 3) {
      set_field(r, "token %zu kind", i);
      rc = pb_string(r, &t->kind);
      *has |= HAS_KIND;
    } else {
      set_field(r, "token %zu service", i);
      rc = pb_string(r, &t->service);
      *has |= HAS_SERVICE;
    }
    if (rc != EMBER_OK) return rc;
  }
}

/* CredentialsKVProto {alias = 1, token = 2, secret = 3}: a token entry
 * (t != NULL) must have an alias and a complete token; a secret entry an
 * alias (its secret is skipped). */
static int pb_entry(rd *r, const char *name, size_t i, ember__token *t) {
  const uint8_t *at = r->p;
  unsigned has = 0;
  int has_alias = 0, has_token = 0;
  for (;;) {
    uint32_t field;
    unsigned wt;
    int done, rc;
    set_field(r, "%s %zu", name, i);
    if ((rc = pb_tag(r, &field, &wt, &done)) != EMBER_OK) return rc;
    if (done) break;
    if (wt == PB_LEN && field == 1) {
      set_field(r, "%s %zu alias", name, i);
      rc = pb_string(r, t != NULL ? &t->alias : NULL);
      has_alias = 1;
    } else if (wt == PB_LEN && field == 2 && t != NULL) {
      rd sub;
      set_field(r, "token %zu", i);
      rc = pb_sub(r, &sub);
      if (rc == EMBER_OK) rc = pb_token(&sub, i, t, &has);
      has_token = 1;
    } else {
      rc = pb_skip(r, field, wt);
    }
    if (rc != EMBER_OK) return rc;
  }
  if (!has_alias) return bad(r, at, "%s %zu has no alias", name, i);
  if (t == NULL) return EMBER_OK;
  if (!has_token) return bad(r, at, "token %zu (alias \"%s\") has no token", i, t->alias);
  if (has != HAS_ALL)
    return bad(r, at, "token %zu (alias \"%s\") lacks its %s", i, t->alias,
               !(has & HAS_ID) ? "identifier" : !(has & HAS_PW) ? "password"
               : !(has & HAS_KIND) ? "kind" : "service");
  return EMBER_OK;
}

/* Credentials.readProto: CredentialsProto.parseDelimitedFrom. */
static int parse_protobuf(rd *r, ember__credentials *c) {
  rd msg;
  size_t cap = 0, ntok = 0, nsec = 0;
  int rc;
  set_field(r, "credentials message");
  if ((rc = pb_sub(r, &msg)) != EMBER_OK) return rc;
  for (;;) {
    const uint8_t *at = msg.p;
    uint32_t field;
    unsigned wt;
    int done;
    set_field(&msg, "credentials message");
    if ((rc = pb_tag(&msg, &field, &wt, &done)) != EMBER_OK) return rc;
    if (done) break;
    rd sub;
    if (wt == PB_LEN && field == 1) {
      if (++ntok > EMBER__TOKEN_MAX_COUNT)
        return ember__set_error(EMBER_ETOOBIG, "%s: more than %u tokens (offset %zu)", r->what,
                                EMBER__TOKEN_MAX_COUNT, (size_t)(at - r->base));
      ember__token t = {0};
      set_field(&msg, "token %zu", ntok);
      rc = pb_sub(&msg, &sub);
      if (rc == EMBER_OK) rc = pb_entry(&sub, "token", ntok, &t);
      if (rc == EMBER_OK) rc = add_token(c, &cap, &t, r->what);
      ember__token_clear(&t);
    } else if (wt == PB_LEN && field == 2) {
      set_field(&msg, "secret %zu", ++nsec);
      rc = pb_sub(&msg, &sub);
      if (rc == EMBER_OK) rc = pb_entry(&sub, "secret", nsec, NULL);
    } else {
      rc = pb_skip(&msg, field, wt);
    }
    if (rc != EMBER_OK) return rc;
  }
  return EMBER_OK; /* bytes after the delimited message are ignored, as in Hadoop */
}

/* ================================================================ files */

int ember__credentials_parse(ember__credentials *out, const uint8_t *buf, size_t len,
                             const char *what) {
  static const uint8_t magic[4] = {'H', 'D', 'T', 'S'};
  memset(out, 0, sizeof *out);
  if (what == NULL) what = "token file";
  if (len > EMBER__TOKEN_FILE_MAX_BYTES)
    return ember__set_error(EMBER_ETOOBIG, "%s: %zu bytes, more than the %u accepted", what, len,
                            EMBER__TOKEN_FILE_MAX_BYTES);
  if (len == 0 || memcmp(buf, magic, len < 4 ? len : 4) != 0)
    return ember__set_error(EMBER_EPROTO,
                            "%s: not a Hadoop token storage file (it does not start with \"HDTS\")",
                            what);
  if (len < 5)
    return ember__set_error(EMBER_EPROTO,
                            "%s: the input ends inside the token storage header (%zu bytes)",
                            what, len);
  rd r = {.base = buf, .p = buf + 5, .end = buf + len, .what = what, .unit = "offset"};
  ember__credentials c = {0};
  int rc;
  switch (buf[4]) {
  case 0:
    rc = parse_writable(&r, &c);
    break;
  case 1:
    rc = parse_protobuf(&r, &c);
    break;
  default:
    return ember__set_error(EMBER_EPROTO,
                            "%s: token storage version %u is not supported (Hadoop writes 0, "
                            "Writable, and 1, protobuf)",
                            what, (unsigned)buf[4]);
  }
  if (rc != EMBER_OK) {
    ember__credentials_free(&c);
    return rc;
  }
  *out = c;
  return EMBER_OK;
}

int ember__credentials_load(ember__credentials *out, const char *path) {
  memset(out, 0, sizeof *out);
  size_t wlen = strlen(path) + sizeof "token file ";
  char *what = malloc(wlen);
  if (what == NULL) return oom(path);
  snprintf(what, wlen, "token file %s", path);
  char *buf = NULL;
  size_t len = 0;
  int rc = ember__read_bounded_file(path, EMBER__TOKEN_FILE_MAX_BYTES, what, &buf, &len);
  if (rc == EMBER_OK) rc = ember__credentials_parse(out, (const uint8_t *)buf, len, what);
  free(buf);
  free(what);
  return rc;
}

const ember__token *ember__credentials_find(const ember__credentials *c, const char *kind,
                                            const char *service) {
  for (size_t i = 0; c != NULL && i < c->n; i++) {
    const ember__token *t = &c->tokens[i];
    if ((kind == NULL || strcmp(t->kind, kind) == 0) &&
        (service == NULL || strcmp(t->service, service) == 0))
      return t;
  }
  return NULL;
}

/* ================================================================ URL form */

/* WritableUtils.writeVLong into o (NULL: only the size). */
static size_t put_vlong(uint8_t *o, int64_t i) {
  if (i >= -112 && i <= 127) {
    if (o != NULL) o[0] = (uint8_t)(i & 0xFF);
    return 1;
  }
  int len = -112;
  uint64_t u = (uint64_t)i;
  if (i < 0) {
    u = ~u;
    len = -120;
  }
  for (uint64_t tmp = u; tmp != 0; tmp >>= 8) len--;
  size_t nb = (size_t)(len < -120 ? -(len + 120) : -(len + 112));
  if (o != NULL) {
    o[0] = (uint8_t)(256 + len);
    for (size_t k = 0; k < nb; k++) o[1 + k] = (uint8_t)(u >> (8 * (nb - 1 - k)));
  }
  return nb + 1;
}

/* The Writable form's size: each field a vint length + its bytes. */
static int writable_size(const size_t lens[4], size_t *out) {
  size_t total = 0;
  for (int k = 0; k < 4; k++) {
    if (lens[k] > INT32_MAX) return -1; /* a Java array cannot be longer */
    size_t f = put_vlong(NULL, (int64_t)lens[k]) + lens[k];
    if (total > SIZE_MAX - f) return -1;
    total += f;
  }
  *out = total;
  return 0;
}

int ember__token_encode_url(const ember__token *t, char **out) {
  static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  *out = NULL;
  const char *kind = t->kind ? t->kind : "", *service = t->service ? t->service : "";
  const uint8_t *parts[4] = {t->identifier, t->password, (const uint8_t *)kind,
                             (const uint8_t *)service};
  size_t lens[4] = {t->identifier_len, t->password_len, strlen(kind), strlen(service)};
  size_t n = 0;
  if (writable_size(lens, &n) != 0 || n / 3 > (SIZE_MAX - 8) / 4)
    return ember__set_error(EMBER_EINVAL, "token %s for %s: a field is too long to encode",
                            kind, service);
  uint8_t *raw = malloc(n ? n : 1);
  char *s = malloc(n / 3 * 4 + 4);
  if (raw == NULL || s == NULL) {
    free(raw);
    free(s);
    return oom("token encoding");
  }
  size_t o = 0;
  for (int k = 0; k < 4; k++) {
    o += put_vlong(raw + o, (int64_t)lens[k]);
    if (lens[k] > 0) memcpy(raw + o, parts[k], lens[k]);
    o += lens[k];
  }
  /* Base64(0, null, true): URL-safe alphabet, no padding, no line breaks */
  size_t j = 0, i = 0;
  for (; i + 3 <= n; i += 3) {
    uint32_t v = (uint32_t)raw[i] << 16 | (uint32_t)raw[i + 1] << 8 | raw[i + 2];
    s[j++] = b64[v >> 18];
    s[j++] = b64[(v >> 12) & 63];
    s[j++] = b64[(v >> 6) & 63];
    s[j++] = b64[v & 63];
  }
  if (n - i == 1) {
    s[j++] = b64[raw[i] >> 2];
    s[j++] = b64[(raw[i] & 3) << 4];
  } else if (n - i == 2) {
    s[j++] = b64[raw[i] >> 2];
    s[j++] = b64[(raw[i] & 3) << 4 | raw[i + 1] >> 4];
    s[j++] = b64[(raw[i + 1] & 15) << 2];
  }
  s[j] = '\0';
  free(raw);
  *out = s;
  return EMBER_OK;
}

static int b64_value(char ch) {
  if (ch >= 'A' && ch <= 'Z') return ch - 'A';
  if (ch >= 'a' && ch <= 'z') return ch - 'a' + 26;
  if (ch >= '0' && ch <= '9') return ch - '0' + 52;
  if (ch == '-' || ch == '+') return 62;
  if (ch == '_' || ch == '/') return 63;
  return -1;
}

int ember__token_decode_url(ember__token *out, const char *s, size_t len, const char *what) {
  memset(out, 0, sizeof *out);
  if (len > EMBER__TOKEN_FILE_MAX_BYTES)
    return ember__set_error(EMBER_ETOOBIG, "%s: %zu characters, more than the %u accepted", what,
                            len, EMBER__TOKEN_FILE_MAX_BYTES);
  size_t n = len;
  for (int pad = 0; pad < 2 && n > 0 && s[n - 1] == '='; pad++) n--;
  if (n % 4 == 1)
    return ember__set_error(EMBER_EPROTO, "%s: %zu Base64 characters cannot be a whole number "
                            "of bytes", what, n);
  size_t raw_len = n / 4 * 3 + (n % 4 ? n % 4 - 1 : 0);
  uint8_t *raw = malloc(raw_len ? raw_len : 1);
  if (raw == NULL) return oom(what);
  uint32_t acc = 0;
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    int v = b64_value(s[i]);
    if (v < 0) {
      free(raw);
      return ember__set_error(EMBER_EPROTO, "%s: character %zu is not Base64", what, i);
    }
    acc = acc << 6 | (uint32_t)v;
    if (i % 4 == 3) {
      raw[o++] = (uint8_t)(acc >> 16);
      raw[o++] = (uint8_t)(acc >> 8);
      raw[o++] = (uint8_t)acc;
      acc = 0;
    }
  }
  if (n % 4 == 2) {
    raw[o++] = (uint8_t)(acc >> 4);
  } else if (n % 4 == 3) {
    raw[o++] = (uint8_t)(acc >> 10);
    raw[o++] = (uint8_t)(acc >> 2);
  }
  rd r = {.base = raw, .p = raw, .end = raw + o, .what = what, .unit = "decoded byte"};
  ember__token t = {0};
  int rc = w_token(&r, 1, &t);
  if (rc == EMBER_OK && r.p != r.end)
    rc = bad(&r, r.p, "%zu bytes after the token", left(&r));
  if (rc == EMBER_OK && (t.alias = strdup("")) == NULL) rc = oom(what);
  free(raw);
  if (rc != EMBER_OK) {
    ember__token_clear(&t);
    return rc;
  }
  *out = t;
  return EMBER_OK;
}

/* ================================================================ identifier */

void ember__token_ident_free(ember__token_ident *id) {
  if (id == NULL) return;
  free(id->owner);
  free(id->renewer);
  free(id->real_user);
  memset(id, 0, sizeof *id);
}

int ember__token_ident_parse(const ember__token *t, ember__token_ident *out) {
  /* Text.DEFAULT_MAX_LEN; Text.readFields(in, max) wants length < max */
  const size_t max_text = (1u << 20) - 1;
  char what[256];
  snprintf(what, sizeof what, "%s token for %s", t->kind ? t->kind : "",
           t->service && t->service[0] ? t->service : "(no service)");
  memset(out, 0, sizeof *out);
  if (t->identifier_len == 0 || t->identifier == NULL)
    return ember__set_error(EMBER_EPROTO, "%s: empty identifier", what);
  rd r = {.base = t->identifier, .p = t->identifier, .end = t->identifier + t->identifier_len,
          .what = what, .unit = "identifier byte"};
  ember__token_ident id = {0};
  int rc;
  if (r.p[0] != 0) {
    rc = bad(&r, r.p, "identifier version byte is %u, not 0: not a delegation token identifier",
             (unsigned)r.p[0]);
    goto fail;
  }
  r.p++;
  set_field(&r, "identifier owner");
  if ((rc = w_text(&r, max_text, &id.owner)) != EMBER_OK) goto fail;
  set_field(&r, "identifier renewer");
  if ((rc = w_text(&r, max_text, &id.renewer)) != EMBER_OK) goto fail;
  set_field(&r, "identifier real user");
  if ((rc = w_text(&r, max_text, &id.real_user)) != EMBER_OK) goto fail;
  set_field(&r, "identifier issue date");
  if ((rc = w_vlong(&r, &id.issue_date_ms)) != EMBER_OK) goto fail;
  set_field(&r, "identifier max date");
  if ((rc = w_vlong(&r, &id.max_date_ms)) != EMBER_OK) goto fail;
  set_field(&r, "identifier sequence number");
  if ((rc = w_vint(&r, &id.sequence_number)) != EMBER_OK) goto fail;
  set_field(&r, "identifier master key id");
  if ((rc = w_vint(&r, &id.master_key_id)) != EMBER_OK) goto fail;
  *out = id;
  return EMBER_OK;
fail:
  ember__token_ident_free(&id);
  return rc;
}
