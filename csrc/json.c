/* json.c - a small bounded JSON parser (see json.h).
 *
 * Recursive descent over buf[0..len) with an explicit depth limit, so a
 * hostile "[[[[..." costs an error, not the stack.  Every read is guarded by
 * the remaining length; allocations are sized from bytes actually present
 * (a string's decoded form is never longer than its escaped form). */
#include "json.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ember/error.h"

typedef struct {
  const char *p;
  size_t len;
  size_t pos;
  unsigned max_depth;
} parser;

static int fail(const parser *ps, const char *what) {
  return ember__set_error(EMBER_EPROTO, "malformed JSON at byte %zu of %zu: %s", ps->pos,
                          ps->len, what);
}

static void skip_ws(parser *ps) {
  while (ps->pos < ps->len) {
    char c = ps->p[ps->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    ps->pos++;
  }
}

static int hex4(const parser *ps, size_t at, uint32_t *out) {
  if (ps->len - at < 4) return -1;
  uint32_t v = 0;
  for (size_t i = 0; i < 4; i++) {
    char c = ps->p[at + i];
    v <<= 4;
    if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
    else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
    else return -1;
  }
  *out = v;
  return 0;
}

static size_t put_utf8(char *o, uint32_t cp) {
  if (cp < 0x80) {
    o[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (char)(0xC0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (char)(0xE0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  o[0] = (char)(0xF0 | (cp >> 18));
  o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  o[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

/* At the opening quote.  Decodes into a fresh NUL-terminated buffer.  The
 * output never outgrows the input: an escape of n input bytes yields at most
 * n output bytes (\uXXXX: 6 -> <=3; a surrogate pair: 12 -> 4). */
static int parse_string(parser *ps, char **out, size_t *out_len) {
  size_t start = ++ps->pos; /* past '"' */
  size_t end = start;
  int escapes = 0;
  while (end < ps->len && ps->p[end] != '"') {
    if (ps->p[end] == '\\') {
      escapes = 1;
      end++;
      if (end >= ps->len) break;
    } else if ((unsigned char)ps->p[end] < 0x20) {
      ps->pos = end;
      return fail(ps, "control character in string");
    }
    end++;
  }
  if (end >= ps->len) return fail(ps, "unterminated string");
  size_t raw = end - start;
  char *s = malloc(raw + 1);
  if (s == NULL) return ember__set_error(EMBER_ENOMEM, "JSON: out of memory (string of %zu bytes)", raw);
  size_t n = 0;
  if (!escapes) {
    memcpy(s, ps->p + start, raw);
    n = raw;
  } else {
    size_t i = start;
    while (i < end) {
      char c = ps->p[i];
      if (c != '\\') {
        s[n++] = c;
        i++;
        continue;
      }
      i++; /* i < end: the scan above never ends a string on a backslash */
      char e = ps->p[i++];
      switch (e) {
      case '"': s[n++] = '"'; break;
      case '\\': s[n++] = '\\'; break;
      case '/': s[n++] = '/'; break;
      case 'b': s[n++] = '\b'; break;
      case 'f': s[n++] = '\f'; break;
      case 'n': s[n++] = '\n'; break;
      case 'r': s[n++] = '\r'; break;
      case 't': s[n++] = '\t'; break;
      case 'u': {
        uint32_t cp, lo;
        if (i + 4 > end || hex4(ps, i, &cp) < 0) {
          free(s);
          ps->pos = i;
          return fail(ps, "bad \\u escape");
        }
        i += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          if (i + 6 <= end && ps->p[i] == '\\' && ps->p[i + 1] == 'u' &&
              hex4(ps, i + 2, &lo) == 0 && lo >= 0xDC00 && lo <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            i += 6;
          } else {
            cp = 0xFFFD; /* lone high surrogate */
          }
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
          cp = 0xFFFD; /* lone low surrogate */
        }
        n += put_utf8(s + n, cp);
        break;
      }
      default:
        free(s);
        ps->pos = i - 1;
        return fail(ps, "bad escape in string");
      }
    }
  }
  s[n] = '\0';
  ps->pos = end + 1;
  *out = s;
  *out_len = n;
  return EMBER_OK;
}

static int parse_number(parser *ps, ember__json *v) {
  size_t start = ps->pos, i = ps->pos;
  int is_int = 1;
  if (i < ps->len && ps->p[i] == '-') i++;
  if (i >= ps->len) return fail(ps, "truncated number");
  if (ps->p[i] == '0') {
    i++;
  } else if (ps->p[i] >= '1' && ps->p[i] <= '9') {
    while (i < ps->len && ps->p[i] >= '0' && ps->p[i] <= '9') i++;
  } else {
    return fail(ps, "bad number");
  }
  if (i < ps->len && ps->p[i] == '.') {
    is_int = 0;
    i++;
    size_t d = i;
    while (i < ps->len && ps->p[i] >= '0' && ps->p[i] <= '9') i++;
    if (i == d) {
      ps->pos = i;
      return fail(ps, "bad fraction");
    }
  }
  if (i < ps->len && (ps->p[i] == 'e' || ps->p[i] == 'E')) {
    is_int = 0;
    i++;
    if (i < ps->len && (ps->p[i] == '+' || ps->p[i] == '-')) i++;
    size_t d = i;
    while (i < ps->len && ps->p[i] >= '0' && ps->p[i] <= '9') i++;
    if (i == d) {
      ps->pos = i;
      return fail(ps, "bad exponent");
    }
  }
  size_t n = i - start;
  v->str = malloc(n + 1);
  if (v->str == NULL) return ember__set_error(EMBER_ENOMEM, "JSON: out of memory");
  memcpy(v->str, ps->p + start, n);
  v->str[n] = '\0';
  v->len = n;
  v->kind = EMBER__JSON_NUMBER;
  v->d = strtod(v->str, NULL);
  if (is_int) {
    errno = 0;
    long long x = strtoll(v->str, NULL, 10);
    if (errno == 0) {
      v->is_int = 1;
      v->i = (int64_t)x;
    }
  }
  ps->pos = i;
  return EMBER_OK;
}

static int literal(parser *ps, const char *word, ember__json_kind kind, ember__json *v) {
  size_t n = strlen(word);
  if (ps->len - ps->pos < n || memcmp(ps->p + ps->pos, word, n) != 0) return fail(ps, "unexpected character");
  ps->pos += n;
  v->kind = kind;
  return EMBER_OK;
}

static int parse_value(parser *ps, unsigned depth, ember__json *v);

/* Parses the elements or members of a container at '[' / '{'. */
static int parse_container(parser *ps, unsigned depth, ember__json *v, int is_object) {
  if (depth >= ps->max_depth) return fail(ps, "nesting too deep");
  v->kind = is_object ? EMBER__JSON_OBJECT : EMBER__JSON_ARRAY;
  char close = is_object ? '}' : ']';
  ps->pos++;
  skip_ws(ps);
  if (ps->pos < ps->len && ps->p[ps->pos] == close) {
    ps->pos++;
    return EMBER_OK;
  }
  ember__json **tail = &v->child;
  for (;;) {
    ember__json *c = calloc(1, sizeof *c);
    if (c == NULL) return ember__set_error(EMBER_ENOMEM, "JSON: out of memory");
    *tail = c; /* linked before parsing, so the caller's free reaches it */
    tail = &c->next;
    v->count++;
    skip_ws(ps);
    if (is_object) {
      if (ps->pos >= ps->len || ps->p[ps->pos] != '"') return fail(ps, "expected a member name");
      int rc = parse_string(ps, &c->key, &c->key_len);
      if (rc != EMBER_OK) return rc;
      skip_ws(ps);
      if (ps->pos >= ps->len || ps->p[ps->pos] != ':') return fail(ps, "expected ':'");
      ps->pos++;
      skip_ws(ps);
    }
    int rc = parse_value(ps, depth + 1, c);
    if (rc != EMBER_OK) return rc;
    skip_ws(ps);
    if (ps->pos >= ps->len) return fail(ps, is_object ? "unterminated object" : "unterminated array");
    char ch = ps->p[ps->pos++];
    if (ch == close) return EMBER_OK;
    if (ch != ',') {
      ps->pos--;
      return fail(ps, is_object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
  }
}

static int parse_value(parser *ps, unsigned depth, ember__json *v) {
  skip_ws(ps);
  if (ps->pos >= ps->len) return fail(ps, "unexpected end of input");
  switch (ps->p[ps->pos]) {
  case '{': return parse_container(ps, depth, v, 1);
  case '[': return parse_container(ps, depth, v, 0);
  case '"':
    v->kind = EMBER__JSON_STRING;
    return parse_string(ps, &v->str, &v->len);
  case 't': return literal(ps, "true", EMBER__JSON_TRUE, v);
  case 'f': return literal(ps, "false", EMBER__JSON_FALSE, v);
  case 'n': return literal(ps, "null", EMBER__JSON_NULL, v);
  default: return parse_number(ps, v);
  }
}

int ember__json_parse(const char *buf, size_t len, unsigned max_depth, ember__json **out) {
  *out = NULL;
  if (buf == NULL && len > 0) return ember__set_error(EMBER_EINVAL, "JSON: NULL buffer");
  parser ps = {buf, len, 0, max_depth == 0 || max_depth > EMBER__JSON_MAX_DEPTH
                                ? EMBER__JSON_MAX_DEPTH : max_depth};
  ember__json *root = calloc(1, sizeof *root);
  if (root == NULL) return ember__set_error(EMBER_ENOMEM, "JSON: out of memory");
  int rc = parse_value(&ps, 0, root);
  if (rc == EMBER_OK) {
    skip_ws(&ps);
    if (ps.pos != ps.len) rc = fail(&ps, "trailing characters after the value");
  }
  if (rc != EMBER_OK) {
    ember__json_free(root);
    return rc;
  }
  *out = root;
  return EMBER_OK;
}

/* Iterative over siblings, recursive over children: recursion depth is the
 * nesting depth, which the parser bounded. */
void ember__json_free(ember__json *v) {
  while (v != NULL) {
    ember__json *next = v->next;
    ember__json_free(v->child);
    free(v->key);
    free(v->str);
    free(v);
    v = next;
  }
}

const ember__json *ember__json_get(const ember__json *v, const char *key) {
  if (v == NULL || v->kind != EMBER__JSON_OBJECT) return NULL;
  size_t n = strlen(key);
  for (const ember__json *c = v->child; c != NULL; c = c->next)
    if (c->key_len == n && memcmp(c->key, key, n) == 0) return c;
  return NULL;
}

const char *ember__json_get_str(const ember__json *v, const char *key) {
  const ember__json *c = ember__json_get(v, key);
  return c != NULL && c->kind == EMBER__JSON_STRING ? c->str : NULL;
}

int64_t ember__json_get_int(const ember__json *v, const char *key, int *found) {
  const ember__json *c = ember__json_get(v, key);
  int ok = c != NULL && c->kind == EMBER__JSON_NUMBER && c->is_int;
  if (found != NULL) *found = ok;
  return ok ? c->i : 0;
}
