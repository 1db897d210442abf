/* test_hadoop_token.c - the Hadoop token storage reader (csrc/hadoop_token.c)
 * against files Hadoop itself wrote, and against hostile input.
 *
 * tests/c/data/tokens-{writable,protobuf}.bin and tokens-expected.txt come
 * from tests/c/data/TokenFixtures.java (Hadoop 3.4.2's Credentials, Token and
 * DelegationTokenIdentifier; how to regenerate is at its top), so no JVM is
 * needed here.  The data directory is found from __FILE__, i.e. relative to
 * the directory the test was compiled from (the repository root, under make). */
#include <stdint.h>
#include <sys/stat.h>

#include "../../csrc/hadoop_token.h"
#include "harness.h"

/* ================================================================ helpers */

static void data_path(char *out, size_t cap, const char *name) {
  const char *f = __FILE__, *slash = strrchr(f, '/');
  snprintf(out, cap, "%.*sdata/%s", slash ? (int)(slash - f + 1) : 0, f, name);
}

static uint8_t *read_data(const char *name, size_t *len) {
  char path[1024];
  data_path(path, sizeof path, name);
  FILE *f = fopen(path, "rb");
  if (f == NULL) fprintf(stderr, "cannot open %s (run from the repository root)\n", path);
  CHECK(f != NULL);
  uint8_t *buf = malloc(1 << 16);
  CHECK(buf != NULL);
  *len = fread(buf, 1, 1 << 16, f);
  fclose(f);
  return buf;
}

/* An exact-size heap copy of p[0..n), so ASan sees any read past its end. */
static uint8_t *exact_copy(const uint8_t *p, size_t n) {
  uint8_t *d = malloc(n ? n : 1);
  CHECK(d != NULL);
  if (n) memcpy(d, p, n);
  return d;
}

static int contains(const char *hay, const char *needle) { return strstr(hay, needle) != NULL; }

#define CHECK_MSG(needle)                                                                   \
  do {                                                                                      \
    if (!contains(ember_last_error(), (needle))) {                                          \
      fprintf(stderr, "%s:%d: message lacks \"%s\": %s\n", __FILE__, __LINE__, (needle),    \
              ember_last_error());                                                          \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

/* What TokenFixtures.java wrote into tokens-expected.txt. */
typedef struct {
  char alias[64], kind[64], service[128], url[2048];
  int has_ident;
  char owner[64], renewer[64], real_user[64];
  long long issue, max, seq, mkid;
} expected;

static const char *undash(const char *s) { return strcmp(s, "-") == 0 ? "" : s; }

static int load_expected(expected *e, int cap) {
  char path[1024], line[4096];
  data_path(path, sizeof path, "tokens-expected.txt");
  FILE *f = fopen(path, "r");
  CHECK(f != NULL);
  int n = 0;
  while (fgets(line, sizeof line, f) != NULL) {
    char a[64], b[64], c[128], d[2048];
    if (sscanf(line, "token %63s %63s %127s %2047s", a, b, c, d) == 4) {
      CHECK(n < cap);
      memset(&e[n], 0, sizeof e[n]);
      strcpy(e[n].alias, a);
      strcpy(e[n].kind, b);
      strcpy(e[n].service, undash(c));
      strcpy(e[n].url, d);
      n++;
    } else if (line[0] == 'i') {
      expected *x = NULL;
      char al[64], o[64], r[64], ru[64];
      long long v[4];
      CHECK(sscanf(line, "ident %63s %63s %63s %63s %lld %lld %lld %lld", al, o, r, ru, &v[0],
                   &v[1], &v[2], &v[3]) == 8);
      for (int i = 0; i < n; i++)
        if (strcmp(e[i].alias, al) == 0) x = &e[i];
      CHECK(x != NULL);
      x->has_ident = 1;
      strcpy(x->owner, undash(o));
      strcpy(x->renewer, undash(r));
      strcpy(x->real_user, undash(ru));
      x->issue = v[0];
      x->max = v[1];
      x->seq = v[2];
      x->mkid = v[3];
    }
  }
  fclose(f);
  return n;
}

static const ember__token *by_alias(const ember__credentials *c, const char *alias) {
  for (size_t i = 0; i < c->n; i++)
    if (strcmp(c->tokens[i].alias, alias) == 0) return &c->tokens[i];
  return NULL;
}

static void check_against_java(const ember__credentials *c) {
  expected e[8];
  int n = load_expected(e, 8);
  CHECK_EQ_INT(n, 3);
  CHECK_EQ_INT(c->n, 3);
  for (int i = 0; i < n; i++) {
    const ember__token *t = by_alias(c, e[i].alias);
    CHECK(t != NULL);
    CHECK(strcmp(t->kind, e[i].kind) == 0);
    CHECK(strcmp(t->service, e[i].service) == 0);
    char *url = NULL;
    CHECK_OK(ember__token_encode_url(t, &url));
    if (strcmp(url, e[i].url) != 0) fprintf(stderr, "ours: %s\njava: %s\n", url, e[i].url);
    CHECK(strcmp(url, e[i].url) == 0);
    /* and back */
    ember__token d;
    CHECK_OK(ember__token_decode_url(&d, url, strlen(url), "url"));
    CHECK_EQ_INT(d.identifier_len, t->identifier_len);
    CHECK(memcmp(d.identifier, t->identifier, t->identifier_len) == 0);
    CHECK_EQ_INT(d.password_len, t->password_len);
    CHECK(memcmp(d.password, t->password, t->password_len) == 0);
    CHECK(strcmp(d.kind, t->kind) == 0 && strcmp(d.service, t->service) == 0);
    CHECK(strcmp(d.alias, "") == 0);
    ember__token_clear(&d);
    free(url);

    ember__token_ident id;
    int rc = ember__token_ident_parse(t, &id);
    if (!e[i].has_ident) {
      CHECK_EQ_INT(rc, EMBER_EPROTO);
      CHECK_MSG(t->kind);
      CHECK(id.owner == NULL);
      continue;
    }
    CHECK_OK(rc);
    CHECK(strcmp(id.owner, e[i].owner) == 0);
    CHECK(strcmp(id.renewer, e[i].renewer) == 0);
    CHECK(strcmp(id.real_user, e[i].real_user) == 0);
    CHECK_EQ_INT(id.issue_date_ms, e[i].issue);
    CHECK_EQ_INT(id.max_date_ms, e[i].max);
    CHECK_EQ_INT(id.sequence_number, e[i].seq);
    CHECK_EQ_INT(id.master_key_id, e[i].mkid);
    ember__token_ident_free(&id);
  }
}

static void parse_fixture(const char *name, ember__credentials *c, uint8_t **buf, size_t *len) {
  *buf = read_data(name, len);
  CHECK(*len > 5);
  CHECK_OK(ember__credentials_parse(c, *buf, *len, name));
}

/* A little builder for hand-made files. */
typedef struct {
  uint8_t d[1 << 17];
  size_t n;
} out;

static void put(out *o, const void *p, size_t n) {
  CHECK(o->n + n <= sizeof o->d);
  memcpy(o->d + o->n, p, n);
  o->n += n;
}
static void put_byte(out *o, unsigned b) {
  uint8_t x = (uint8_t)b;
  put(o, &x, 1);
}
static void put_str(out *o, const char *s) { put(o, s, strlen(s)); }

/* WritableUtils.writeVLong, written independently of the module's. */
static void put_vlong(out *o, long long v) {
  if (v >= -112 && v <= 127) {
    put_byte(o, (unsigned)(v & 0xFF));
    return;
  }
  int neg = v < 0;
  unsigned long long u = neg ? ~(unsigned long long)v : (unsigned long long)v;
  int nb = 0;
  for (unsigned long long t = u; t; t >>= 8) nb++;
  put_byte(o, (unsigned)((neg ? -120 - nb : -112 - nb) & 0xFF));
  for (int k = nb - 1; k >= 0; k--) put_byte(o, (unsigned)(u >> (8 * k)) & 0xFF);
}
static void put_text(out *o, const char *s) {
  put_vlong(o, (long long)strlen(s));
  put_str(o, s);
}
static void put_wtoken(out *o, const char *alias, const char *id, const char *pw, const char *kind,
                       const char *service) {
  put_text(o, alias);
  put_text(o, id);
  put_text(o, pw);
  put_text(o, kind);
  put_text(o, service);
}

static void put_varint(out *o, unsigned long long v) {
  do {
    put_byte(o, (unsigned)(v & 0x7F) | (v > 0x7F ? 0x80 : 0));
    v >>= 7;
  } while (v);
}
static void put_pb_bytes(out *o, unsigned field, const void *p, size_t n) {
  put_varint(o, field << 3 | 2);
  put_varint(o, n);
  put(o, p, n);
}
static void put_pb_str(out *o, unsigned field, const char *s) {
  put_pb_bytes(o, field, s, strlen(s));
}

/* TokenProto; NULL fields are left out */
static void put_pb_token(out *o, const char *id, const char *pw, const char *kind,
                         const char *service) {
  if (id) put_pb_str(o, 1, id);
  if (pw) put_pb_str(o, 2, pw);
  if (kind) put_pb_str(o, 3, kind);
  if (service) put_pb_str(o, 4, service);
}

/* "HDTS" 1 + delimited CredentialsProto holding `entries` as tokens (1). */
static void pb_file(out *f, const out *msg) {
  f->n = 0;
  put_str(f, "HDTS");
  put_byte(f, 1);
  put_varint(f, msg->n);
  put(f, msg->d, msg->n);
}

static void pb_entry(out *msg, unsigned field, const char *alias, const out *token) {
  out kv = {0};
  if (alias) put_pb_str(&kv, 1, alias);
  if (token) put_pb_bytes(&kv, 2, token->d, token->n);
  put_pb_bytes(msg, field, kv.d, kv.n);
}

static int parse_out(const out *o, ember__credentials *c) {
  uint8_t *d = exact_copy(o->d, o->n);
  int rc = ember__credentials_parse(c, d, o->n, "test file");
  free(d);
  return rc;
}

static void check_zeroed(const ember__credentials *c) { CHECK(c->n == 0 && c->tokens == NULL); }

/* ================================================================ Hadoop-written files */

TEST(writable_fixture_matches_java) {
  ember__credentials c;
  uint8_t *buf;
  size_t len;
  parse_fixture("tokens-writable.bin", &c, &buf, &len);
  CHECK_EQ_INT(buf[4], 0);
  check_against_java(&c);
  ember__credentials_free(&c);
  free(buf);
}

TEST(protobuf_fixture_matches_java) {
  ember__credentials c;
  uint8_t *buf;
  size_t len;
  parse_fixture("tokens-protobuf.bin", &c, &buf, &len);
  CHECK_EQ_INT(buf[4], 1);
  check_against_java(&c);
  ember__credentials_free(&c);
  free(buf);
}

TEST(both_formats_same_tokens) {
  ember__credentials a, b;
  uint8_t *ba, *bb;
  size_t la, lb;
  parse_fixture("tokens-writable.bin", &a, &ba, &la);
  parse_fixture("tokens-protobuf.bin", &b, &bb, &lb);
  CHECK_EQ_INT(a.n, b.n);
  for (size_t i = 0; i < a.n; i++) {
    /* Hadoop writes both from one HashMap: the same order */
    const ember__token *x = &a.tokens[i], *y = &b.tokens[i];
    CHECK(strcmp(x->alias, y->alias) == 0);
    CHECK(strcmp(x->kind, y->kind) == 0 && strcmp(x->service, y->service) == 0);
    CHECK(x->identifier_len == y->identifier_len &&
          memcmp(x->identifier, y->identifier, x->identifier_len) == 0);
    CHECK(x->password_len == y->password_len &&
          memcmp(x->password, y->password, x->password_len) == 0);
  }
  ember__credentials_free(&a);
  ember__credentials_free(&b);
  free(ba);
  free(bb);
}

TEST(find_by_kind_and_service) {
  ember__credentials c;
  uint8_t *buf;
  size_t len;
  parse_fixture("tokens-protobuf.bin", &c, &buf, &len);
  const ember__token *t = ember__credentials_find(&c, EMBER__TOKEN_KIND_HDFS, "127.0.0.1:8020");
  CHECK(t != NULL && strcmp(t->alias, "hdfs") == 0);
  CHECK(ember__credentials_find(&c, EMBER__TOKEN_KIND_HDFS, NULL) == t);
  CHECK(ember__credentials_find(&c, EMBER__TOKEN_KIND_HDFS, "127.0.0.1:8021") == NULL);
  CHECK(ember__credentials_find(&c, EMBER__TOKEN_KIND_HDFS, "") == NULL);
  CHECK(ember__credentials_find(&c, "kms-dt", "127.0.0.1:8020") == NULL);
  t = ember__credentials_find(&c, "kms-dt", NULL);
  CHECK(t != NULL && strcmp(t->alias, "kms") == 0);
  t = ember__credentials_find(&c, NULL, "");
  CHECK(t != NULL && strcmp(t->alias, "blob") == 0);
  CHECK(ember__credentials_find(&c, "hdfs_delegation_token", NULL) == NULL); /* bytes, not case */
  CHECK(ember__credentials_find(NULL, NULL, NULL) == NULL);
  ember__credentials_free(&c);
  ember__credentials_free(&c); /* zeroed: harmless */
  free(buf);
}

TEST(load_file_and_missing_file) {
  char path[1024];
  data_path(path, sizeof path, "tokens-writable.bin");
  ember__credentials c;
  CHECK_OK(ember__credentials_load(&c, path));
  CHECK_EQ_INT(c.n, 3);
  ember__credentials_free(&c);

  CHECK_EQ_INT(ember__credentials_load(&c, "/nonexistent/ember/tokens"), EMBER_ENOTFOUND);
  CHECK_MSG("/nonexistent/ember/tokens");
  check_zeroed(&c);

  /* a malformed file names itself */
  char tmp[] = "/tmp/ember-token-XXXXXX";
  int fd = mkstemp(tmp);
  CHECK(fd >= 0);
  CHECK(write(fd, "HDTS\7", 5) == 5);
  close(fd);
  CHECK_EQ_INT(ember__credentials_load(&c, tmp), EMBER_EPROTO);
  CHECK_MSG("token file ");
  CHECK_MSG(tmp);
  CHECK_MSG("version 7");
  unlink(tmp);
}

/* ================================================================ hostile input */

/* Every proper prefix of a real file fails cleanly: all its fields are
 * required, so no prefix is itself a token file. */
static void truncate_everywhere(const char *name) {
  size_t len;
  uint8_t *buf = read_data(name, &len);
  for (size_t k = 0; k < len; k++) {
    uint8_t *d = exact_copy(buf, k);
    ember__credentials c = {(size_t)7, (ember__token *)d}; /* overwritten */
    int rc = ember__credentials_parse(&c, d, k, "truncated");
    if (rc == EMBER_OK) fprintf(stderr, "prefix of %zu bytes parsed\n", k);
    CHECK_EQ_INT(rc, EMBER_EPROTO);
    check_zeroed(&c);
    CHECK_MSG("truncated: ");
    if (k > 5) CHECK_MSG("offset ");
    free(d);
  }
  free(buf);
}

TEST(truncated_at_every_offset_writable) { truncate_everywhere("tokens-writable.bin"); }
TEST(truncated_at_every_offset_protobuf) { truncate_everywhere("tokens-protobuf.bin"); }

/* Bytes flipped one at a time: never a crash or an out-of-bounds read; what
 * parses is usable (encodes, its identifiers parse or fail cleanly). */
static void flip_everywhere(const char *name) {
  static const uint8_t masks[] = {0x01, 0x40, 0x80, 0xFF};
  size_t len;
  uint8_t *buf = read_data(name, &len);
  for (size_t k = 0; k < len; k++) {
    for (size_t m = 0; m < sizeof masks; m++) {
      uint8_t *d = exact_copy(buf, len);
      d[k] ^= masks[m];
      ember__credentials c;
      int rc = ember__credentials_parse(&c, d, len, "flipped");
      if (rc == EMBER_OK) {
        for (size_t i = 0; i < c.n; i++) {
          char *url;
          CHECK_OK(ember__token_encode_url(&c.tokens[i], &url));
          free(url);
          ember__token_ident id;
          if (ember__token_ident_parse(&c.tokens[i], &id) == EMBER_OK) ember__token_ident_free(&id);
        }
        ember__credentials_free(&c);
      } else {
        CHECK(rc == EMBER_EPROTO || rc == EMBER_ETOOBIG);
        CHECK_MSG("flipped: ");
      }
      free(d);
    }
  }
  free(buf);
}

TEST(flipped_bytes_writable) { flip_everywhere("tokens-writable.bin"); }
TEST(flipped_bytes_protobuf) { flip_everywhere("tokens-protobuf.bin"); }

TEST(empty_wrong_magic_and_version) {
  ember__credentials c;
  CHECK_EQ_INT(ember__credentials_parse(&c, NULL, 0, "empty"), EMBER_EPROTO);
  CHECK_MSG("empty: not a Hadoop token storage file");
  check_zeroed(&c);

  const uint8_t zip[] = {'P', 'K', 3, 4, 20, 0, 0, 0};
  CHECK_EQ_INT(ember__credentials_parse(&c, zip, sizeof zip, "zip"), EMBER_EPROTO);
  CHECK_MSG("not a Hadoop token storage file");
  const uint8_t lower[] = "hdts\0\0\0";
  CHECK_EQ_INT(ember__credentials_parse(&c, lower, 7, "lower"), EMBER_EPROTO);
  CHECK_MSG("not a Hadoop token storage file");
  CHECK_EQ_INT(ember__credentials_parse(&c, (const uint8_t *)"HD", 2, "short"), EMBER_EPROTO);
  CHECK_MSG("short: the input ends inside the token storage header");

  const uint8_t v7[] = {'H', 'D', 'T', 'S', 7, 0, 0};
  CHECK_EQ_INT(ember__credentials_parse(&c, v7, sizeof v7, "v7"), EMBER_EPROTO);
  CHECK_MSG("version 7 is not supported");
  const uint8_t v255[] = {'H', 'D', 'T', 'S', 0xFF};
  CHECK_EQ_INT(ember__credentials_parse(&c, v255, sizeof v255, "v255"), EMBER_EPROTO);
  CHECK_MSG("version 255");
  check_zeroed(&c);
}

TEST(zero_tokens) {
  ember__credentials c;
  const uint8_t w[] = {'H', 'D', 'T', 'S', 0, 0, 0};
  CHECK_OK(ember__credentials_parse(&c, w, sizeof w, "w"));
  check_zeroed(&c);
  CHECK(ember__credentials_find(&c, NULL, NULL) == NULL);
  const uint8_t p[] = {'H', 'D', 'T', 'S', 1, 0};
  CHECK_OK(ember__credentials_parse(&c, p, sizeof p, "p"));
  check_zeroed(&c);
  /* the secrets count is required in WRITABLE, the message length in PROTOBUF */
  CHECK_EQ_INT(ember__credentials_parse(&c, w, 6, "w6"), EMBER_EPROTO);
  CHECK_MSG("secret count");
  CHECK_EQ_INT(ember__credentials_parse(&c, p, 5, "p5"), EMBER_EPROTO);
  /* trailing bytes are ignored, as Hadoop does */
  const uint8_t wt[] = {'H', 'D', 'T', 'S', 0, 0, 0, 'x', 'y'};
  CHECK_OK(ember__credentials_parse(&c, wt, sizeof wt, "wt"));
}

TEST(message_names_token_field_and_offset) {
  out o = {0};
  put_str(&o, "HDTS");
  put_byte(&o, 0);
  put_vlong(&o, 2);
  put_wtoken(&o, "a", "id1", "pw1", "k", "s"); /* offsets 6..23 */
  put_text(&o, "b");
  put_text(&o, "id2");
  size_t at = o.n;
  put_vlong(&o, 9999); /* 0x8e 0x27 0x0f */
  put_str(&o, "short");
  ember__credentials c;
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  char want[128];
  snprintf(want, sizeof want, "test file: token 2 password length 9999 runs past the end, 5 bytes "
                              "left (offset %zu)", at);
  CHECK_MSG(want);
  check_zeroed(&c);
}

TEST(huge_lengths) {
  ember__credentials c;
  out o = {0};
  /* identifier length INT32_MAX in a few bytes */
  put_str(&o, "HDTS");
  put_byte(&o, 0);
  put_vlong(&o, 1);
  put_text(&o, "a");
  put_vlong(&o, 0x7FFFFFFF);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("token 1 identifier length 2147483647 runs past the end");

  /* negative length */
  o.n = 0;
  put_str(&o, "HDTS");
  put_byte(&o, 0);
  put_vlong(&o, 1);
  put_vlong(&o, -1);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("token 1 alias length -1 is negative");

  /* token count over the cap, and a negative one */
  o.n = 0;
  put_str(&o, "HDTS");
  put_byte(&o, 0);
  put_vlong(&o, EMBER__TOKEN_MAX_COUNT + 1);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_ETOOBIG);
  o.n = 5;
  put_vlong(&o, -3);
  put_vlong(&o, 0);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("token count -3 is negative");

  /* protobuf: message length far past the end; a 10-byte varint; an 11-byte one */
  o.n = 0;
  put_str(&o, "HDTS");
  put_byte(&o, 1);
  put_varint(&o, 0xFFFFFFFFFFFFFFFFull);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("credentials message length 18446744073709551615 runs past the end");
  o.n = 5;
  for (int k = 0; k < 11; k++) put_byte(&o, 0x80);
  put_byte(&o, 0);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("varint longer than 10 bytes");

  /* an inner length past its parent's end (but not the file's) */
  out msg = {0}, kv = {0};
  put_varint(&kv, 1 << 3 | 2);
  put_varint(&kv, 50);
  put_str(&kv, "abc");
  put_pb_bytes(&msg, 1, kv.d, kv.n);
  pb_file(&o, &msg);
  put(&o, "0123456789012345678901234567890123456789012345678901234567890123456789", 70);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("token 1 alias length 50 runs past the end, 3 bytes left");

  /* a file over the size cap is refused before it is read */
  CHECK_EQ_INT(ember__credentials_parse(&c, o.d, (size_t)EMBER__TOKEN_FILE_MAX_BYTES + 1, "big"),
               EMBER_ETOOBIG);
}

TEST(vint_overflow) {
  ember__credentials c;
  out o = {0};
  /* 9-byte vint (0x88: positive, 8 magnitude bytes) for the token count */
  put_str(&o, "HDTS");
  put_byte(&o, 0);
  put_byte(&o, 0x88);
  for (int k = 0; k < 8; k++) put_byte(&o, 0xFF);
  put_vlong(&o, 0);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("token count: 9-byte vint overflows 64 bits (offset 5)");
  /* the same for a negative one (0x80: negative, 8 bytes) */
  o.d[5] = 0x80;
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("9-byte vint overflows 64 bits");
  /* INT64_MAX is a fine vlong but no vint */
  o.n = 5;
  put_vlong(&o, 0x7FFFFFFFFFFFFFFFLL);
  put_vlong(&o, 0);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("vint 9223372036854775807 does not fit in 32 bits");
  /* one past INT32_MAX, and a negative one below INT32_MIN */
  o.n = 5;
  put_vlong(&o, 2147483648LL);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("vint 2147483648 does not fit in 32 bits");
  o.n = 5;
  put_vlong(&o, -2147483649LL);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("vint -2147483649 does not fit in 32 bits");
  /* a 9-byte vint cut short */
  o.n = 5;
  put_byte(&o, 0x88);
  put_byte(&o, 0);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("the input ends inside a 9-byte vint, 2 bytes left (offset 5)");
  /* non-minimal but in range: accepted, as by Hadoop (0x8f 0x01 = 1) */
  o.n = 5;
  put_byte(&o, 0x8F);
  put_byte(&o, 0x01);
  put_wtoken(&o, "a", "i", "p", "k", "s");
  put_vlong(&o, 0);
  CHECK_OK(parse_out(&o, &c));
  CHECK_EQ_INT(c.n, 1);
  ember__credentials_free(&c);
}

TEST(duplicate_alias_later_wins) {
  ember__credentials c;
  out o = {0};
  put_str(&o, "HDTS");
  put_byte(&o, 0);
  put_vlong(&o, 3);
  put_wtoken(&o, "x", "id1", "pw1", "K", "s1");
  put_wtoken(&o, "y", "id2", "pw2", "K", "s2");
  put_wtoken(&o, "x", "id3", "pw3", "K", "s3");
  put_vlong(&o, 1);
  put_text(&o, "secret-alias");
  put_text(&o, "secret-bytes");
  CHECK_OK(parse_out(&o, &c));
  CHECK_EQ_INT(c.n, 2);
  CHECK(strcmp(c.tokens[0].alias, "x") == 0 && strcmp(c.tokens[0].service, "s3") == 0);
  CHECK(ember__credentials_find(&c, "K", "s1") == NULL);
  ember__credentials_free(&c);
}

TEST(protobuf_required_fields_and_unknown_fields) {
  ember__credentials c;
  out o = {0}, msg = {0}, tok = {0};
  /* unknown fields everywhere are skipped; a repeated field: last wins */
  put_varint(&tok, 9 << 3 | 0); /* varint */
  put_varint(&tok, 300);
  put_pb_token(&tok, "ID", "PW", "KIND", "old");
  put_pb_str(&tok, 4, "svc");
  put_varint(&tok, 10 << 3 | 1); /* fixed64 */
  put(&tok, "12345678", 8);
  put_varint(&tok, 11 << 3 | 5); /* fixed32 */
  put(&tok, "1234", 4);
  put_varint(&tok, 3 << 3 | 0); /* kind with the wrong wire type: unknown */
  put_varint(&tok, 1);
  pb_entry(&msg, 1, "alias", &tok);
  put_varint(&msg, 7 << 3 | 2);
  put_varint(&msg, 0);
  out sec = {0};
  put_pb_str(&sec, 3, "secret");
  put_pb_str(&sec, 1, "secret-alias");
  put_pb_bytes(&msg, 2, sec.d, sec.n);
  pb_file(&o, &msg);
  CHECK_OK(parse_out(&o, &c));
  CHECK_EQ_INT(c.n, 1);
  CHECK(strcmp(c.tokens[0].kind, "KIND") == 0 && strcmp(c.tokens[0].service, "svc") == 0);
  CHECK(c.tokens[0].identifier_len == 2 && memcmp(c.tokens[0].identifier, "ID", 2) == 0);
  ember__credentials_free(&c);

  /* a token lacking a required field */
  msg.n = tok.n = 0;
  put_pb_token(&tok, "ID", "PW", "KIND", NULL);
  pb_entry(&msg, 1, "alias", &tok);
  pb_file(&o, &msg);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("token 1 (alias \"alias\") lacks its service");
  /* an entry without alias, a token entry without token, a secret without alias */
  msg.n = tok.n = 0;
  put_pb_token(&tok, "ID", "PW", "KIND", "svc");
  pb_entry(&msg, 1, NULL, &tok);
  pb_file(&o, &msg);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("token 1 has no alias");
  msg.n = 0;
  pb_entry(&msg, 1, "a", NULL);
  pb_file(&o, &msg);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("has no token");
  msg.n = 0;
  pb_entry(&msg, 2, NULL, NULL);
  pb_file(&o, &msg);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("secret 1 has no alias");
  /* groups, and a zero tag */
  msg.n = 0;
  put_varint(&msg, 5 << 3 | 3);
  pb_file(&o, &msg);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("groups are not supported");
  msg.n = 0;
  put_byte(&msg, 0);
  pb_file(&o, &msg);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("invalid protobuf tag 0");
  /* a NUL byte in a kind */
  msg.n = tok.n = 0;
  put_pb_str(&tok, 1, "ID");
  put_pb_str(&tok, 2, "PW");
  put_pb_bytes(&tok, 3, "K\0K", 3);
  put_pb_str(&tok, 4, "svc");
  pb_entry(&msg, 1, "a", &tok);
  pb_file(&o, &msg);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_EPROTO);
  CHECK_MSG("token 1 kind contains a NUL byte");
  check_zeroed(&c);
}

TEST(too_many_protobuf_tokens) {
  ember__credentials c;
  out o = {0}, msg = {0}, tok = {0};
  put_pb_token(&tok, "", "", "", "");
  for (unsigned i = 0; i <= EMBER__TOKEN_MAX_COUNT; i++) {
    char alias[16];
    snprintf(alias, sizeof alias, "%u", i % 2); /* duplicates: cheap to hold */
    pb_entry(&msg, 1, alias, &tok);
  }
  pb_file(&o, &msg);
  CHECK_EQ_INT(parse_out(&o, &c), EMBER_ETOOBIG);
  CHECK_MSG("more than 4096 tokens");
}

/* ================================================================ URL form and identifier */

TEST(encode_url_edge_cases) {
  char *s;
  ember__token t = {(uint8_t *)"", 0, (uint8_t *)"", 0, "", "", ""};
  CHECK_OK(ember__token_encode_url(&t, &s)); /* 4 zero bytes */
  CHECK(strcmp(s, "AAAAAA") == 0);
  free(s);
  t.kind = "a";
  CHECK_OK(ember__token_encode_url(&t, &s)); /* 00 00 01 61 00 */
  CHECK(strcmp(s, "AAABYQA") == 0);
  free(s);
  /* 0xFB 0xFF bytes map to '-' and '_' */
  uint8_t id[] = {0xFB, 0xEF, 0xFF};
  t.identifier = id;
  t.identifier_len = 3;
  t.kind = "";
  CHECK_OK(ember__token_encode_url(&t, &s)); /* 03 FB EF FF 00 00 00 */
  CHECK(strcmp(s, "A_vv_wAAAA") == 0);
  ember__token d;
  CHECK_OK(ember__token_decode_url(&d, s, strlen(s), "url"));
  CHECK(d.identifier_len == 3 && memcmp(d.identifier, id, 3) == 0);
  ember__token_clear(&d);
  /* standard alphabet and padding are accepted too */
  CHECK_OK(ember__token_decode_url(&d, "A/vv/wAAAA==", 12, "url"));
  CHECK(d.identifier_len == 3 && memcmp(d.identifier, id, 3) == 0);
  ember__token_clear(&d);
  free(s);

  CHECK_EQ_INT(ember__token_decode_url(&d, "AAAAA", 5, "url"), EMBER_EPROTO);
  CHECK_EQ_INT(ember__token_decode_url(&d, "AA AAA", 6, "url"), EMBER_EPROTO);
  CHECK_MSG("url: character 2 is not Base64");
  CHECK_EQ_INT(ember__token_decode_url(&d, "AAAAAAAA", 8, "url"), EMBER_EPROTO);
  CHECK_MSG("2 bytes after the token");
  CHECK_EQ_INT(ember__token_decode_url(&d, "AAAA", 4, "url"), EMBER_EPROTO);
  CHECK_MSG("token 1 service: the input ends where a vint should start (decoded byte 3)");
  CHECK(d.identifier == NULL && d.alias == NULL);
}

TEST(ident_hostile) {
  ember__token_ident id;
  uint8_t buf[64];
  ember__token t = {buf, 0, (uint8_t *)"", 0, "HDFS_DELEGATION_TOKEN", "nn:8020", "a"};
  CHECK_EQ_INT(ember__token_ident_parse(&t, &id), EMBER_EPROTO);
  CHECK_MSG("HDFS_DELEGATION_TOKEN token for nn:8020: empty identifier");
  /* version 1 */
  buf[0] = 1;
  t.identifier_len = 1;
  CHECK_EQ_INT(ember__token_ident_parse(&t, &id), EMBER_EPROTO);
  CHECK_MSG("identifier version byte is 1, not 0: not a delegation token identifier "
            "(identifier byte 0)");
  /* owner longer than Text.DEFAULT_MAX_LEN allows (the length is checked
   * against the bytes left first, so give it a big buffer) */
  size_t big = (1u << 20) + 16;
  uint8_t *b = calloc(1, big);
  out o = {0};
  put_byte(&o, 0);
  put_vlong(&o, 1 << 20);
  memcpy(b, o.d, o.n);
  ember__token tb = {b, big, (uint8_t *)"", 0, "kms-dt", "", ""};
  CHECK_EQ_INT(ember__token_ident_parse(&tb, &id), EMBER_EPROTO);
  CHECK_MSG("identifier owner length 1048576 is more than the 1048575 accepted");
  CHECK_MSG("kms-dt token for (no service)");
  free(b);
  /* every prefix of a good identifier fails, never reading past it */
  o.n = 0;
  put_byte(&o, 0);
  put_text(&o, "alice");
  put_text(&o, "yarn");
  put_text(&o, "");
  put_vlong(&o, 1700000000000LL);
  put_vlong(&o, -1700000000000LL);
  put_vlong(&o, 42);
  put_vlong(&o, -7);
  for (size_t k = 0; k < o.n; k++) {
    uint8_t *d = exact_copy(o.d, k);
    t.identifier = d;
    t.identifier_len = k;
    CHECK_EQ_INT(ember__token_ident_parse(&t, &id), EMBER_EPROTO);
    CHECK(id.owner == NULL);
    free(d);
  }
  uint8_t *d = exact_copy(o.d, o.n);
  t.identifier = d;
  t.identifier_len = o.n;
  CHECK_OK(ember__token_ident_parse(&t, &id));
  CHECK(strcmp(id.owner, "alice") == 0 && strcmp(id.real_user, "") == 0);
  CHECK_EQ_INT(id.issue_date_ms, 1700000000000LL);
  CHECK_EQ_INT(id.max_date_ms, -1700000000000LL);
  CHECK_EQ_INT(id.master_key_id, -7);
  ember__token_ident_free(&id);
  ember__token_ident_free(NULL);
  free(d);
}

RUN_TESTS(T(writable_fixture_matches_java), T(protobuf_fixture_matches_java),
          T(both_formats_same_tokens), T(find_by_kind_and_service),
          T(load_file_and_missing_file), T(truncated_at_every_offset_writable),
          T(truncated_at_every_offset_protobuf), T(flipped_bytes_writable),
          T(flipped_bytes_protobuf), T(empty_wrong_magic_and_version), T(zero_tokens),
          T(message_names_token_field_and_offset), T(huge_lengths), T(vint_overflow),
          T(duplicate_alias_later_wins), T(protobuf_required_fields_and_unknown_fields),
          T(too_many_protobuf_tokens), T(encode_url_edge_cases), T(ident_hostile))
