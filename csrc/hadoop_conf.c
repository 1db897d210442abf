/* hadoop_conf.c - Hadoop XML configuration files (see hadoop_conf.h).
 *
 * Not a general XML parser: a scanner that finds <property> elements and
 * the text of their <name> and <value> children, which is all a Hadoop
 * client reads from these files.  Every search is bounded by the end of the
 * element being scanned. */
#include "hadoop_conf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ember/error.h"

/* memmem bounded to [from, to). */
static const char *find(const char *from, const char *to, const char *needle) {
  size_t n = strlen(needle);
  if (to < from || (size_t)(to - from) < n) return NULL;
  return memmem(from, (size_t)(to - from), needle, n);
}

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static int bad(const char *what, const char *base, const char *at, const char *why) {
  return ember__set_error(EMBER_EPROTO, "%s: malformed XML at byte %zu: %s", what,
                          (size_t)(at - base), why);
}

static size_t put_utf8(char *o, unsigned long cp) {
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

/* Decodes the character data in [p, end): entities, character references,
 * CDATA sections; drops comments and any other markup.  The result (trimmed,
 * NUL-terminated, malloc'd) is never longer than the input: "&#x10FFFF;" is
 * 10 bytes for 4, every other construct shrinks too. */
static int decode_text(const char *what, const char *base, const char *p, const char *end,
                       char **out) {
  char *s = malloc((size_t)(end - p) + 1);
  if (s == NULL) return ember__set_error(EMBER_ENOMEM, "%s: out of memory", what);
  size_t n = 0;
  while (p < end) {
    if (*p == '<') {
      const char *close;
      if ((size_t)(end - p) >= 9 && memcmp(p, "<![CDATA[", 9) == 0) {
        close = find(p + 9, end, "]]>");
        if (close == NULL) goto unterminated;
        memcpy(s + n, p + 9, (size_t)(close - (p + 9)));
        n += (size_t)(close - (p + 9));
        p = close + 3;
      } else if ((size_t)(end - p) >= 4 && memcmp(p, "<!--", 4) == 0) {
        close = find(p + 4, end, "-->");
        if (close == NULL) goto unterminated;
        p = close + 3;
      } else {
        close = memchr(p, '>', (size_t)(end - p));
        if (close == NULL) goto unterminated;
        p = close + 1;
      }
    } else if (*p == '&') {
      const char *semi = memchr(p, ';', (size_t)(end - p) < 12 ? (size_t)(end - p) : 12);
      if (semi == NULL) {
        free(s);
        return bad(what, base, p, "'&' without an entity");
      }
      size_t elen = (size_t)(semi - p - 1);
      const char *e = p + 1;
      if (elen == 3 && memcmp(e, "amp", 3) == 0) s[n++] = '&';
      else if (elen == 2 && memcmp(e, "lt", 2) == 0) s[n++] = '<';
      else if (elen == 2 && memcmp(e, "gt", 2) == 0) s[n++] = '>';
      else if (elen == 4 && memcmp(e, "quot", 4) == 0) s[n++] = '"';
      else if (elen == 4 && memcmp(e, "apos", 4) == 0) s[n++] = '\'';
      else if (elen >= 2 && e[0] == '#') {
        int hex = e[1] == 'x' || e[1] == 'X';
        const char *d = e + 1 + hex;
        unsigned long cp = 0;
        if (d >= semi) goto badref;
        for (; d < semi; d++) {
          int v;
          if (*d >= '0' && *d <= '9') v = *d - '0';
          else if (hex && *d >= 'a' && *d <= 'f') v = *d - 'a' + 10;
          else if (hex && *d >= 'A' && *d <= 'F') v = *d - 'A' + 10;
          else goto badref;
          cp = cp * (hex ? 16u : 10u) + (unsigned long)v;
          if (cp > 0x10FFFF) goto badref;
        }
        if (cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) goto badref;
        n += put_utf8(s + n, cp);
      } else {
        free(s);
        return bad(what, base, p, "unknown entity");
      }
      p = semi + 1;
    } else {
      s[n++] = *p++;
    }
  }
  s[n] = '\0';
  /* trim */
  size_t a = 0;
  while (a < n && is_space(s[a])) a++;
  while (n > a && is_space(s[n - 1])) n--;
  memmove(s, s + a, n - a);
  s[n - a] = '\0';
  *out = s;
  return EMBER_OK;
badref:
  free(s);
  return bad(what, base, p, "bad character reference");
unterminated:
  free(s);
  return bad(what, base, p, "unterminated markup");
}

/* Finds the child element <tag>...</tag> (or <tag/>) in [p, end) and
 * decodes its text into *out; *out stays NULL if there is none. */
static int child_text(const char *what, const char *base, const char *p, const char *end,
                      const char *tag, char **out) {
  char open[32], close[32];
  snprintf(open, sizeof open, "<%s", tag);
  snprintf(close, sizeof close, "</%s", tag);
  size_t olen = strlen(open);
  *out = NULL;
  for (const char *t = find(p, end, open); t != NULL; t = find(t + 1, end, open)) {
    const char *after = t + olen;
    if (after >= end) break;
    if (*after != '>' && *after != '/' && !is_space(*after)) continue; /* <names> */
    const char *gt = memchr(after, '>', (size_t)(end - after));
    if (gt == NULL) return bad(what, base, t, "unterminated tag");
    if (gt[-1] == '/') { /* <value/> */
      *out = strdup("");
      return *out ? EMBER_OK : ember__set_error(EMBER_ENOMEM, "%s: out of memory", what);
    }
    const char *c = find(gt + 1, end, close);
    if (c == NULL) return bad(what, base, t, "element not closed");
    return decode_text(what, base, gt + 1, c, out);
  }
  return EMBER_OK;
}

/* Appends; a later definition shadows an earlier one at lookup, which
 * searches from the end (no dedup here: that would be quadratic). */
static int add(ember__conf *conf, char *name, char *value) {
  char **nn = realloc(conf->names, (conf->n + 1) * sizeof *nn);
  if (nn != NULL) conf->names = nn;
  char **vv = realloc(conf->values, (conf->n + 1) * sizeof *vv);
  if (vv != NULL) conf->values = vv;
  if (nn == NULL || vv == NULL) {
    free(name);
    free(value);
    return ember__set_error(EMBER_ENOMEM, "configuration: out of memory");
  }
  conf->names[conf->n] = name;
  conf->values[conf->n] = value;
  conf->n++;
  return EMBER_OK;
}

int ember__conf_parse(ember__conf *conf, const char *xml, size_t len, const char *what) {
  if (len > EMBER__CONF_MAX_BYTES)
    return ember__set_error(EMBER_ETOOBIG, "%s: %zu bytes, more than the %u accepted", what,
                            len, EMBER__CONF_MAX_BYTES);
  const char *p = xml, *end = xml + len;
  while (p < end) {
    const char *lt = memchr(p, '<', (size_t)(end - p));
    if (lt == NULL) break;
    size_t left = (size_t)(end - lt);
    const char *close;
    if (left >= 4 && memcmp(lt, "<!--", 4) == 0) {
      close = find(lt + 4, end, "-->");
      if (close == NULL) return bad(what, xml, lt, "unterminated comment");
      p = close + 3;
      continue;
    }
    if (left >= 9 && memcmp(lt, "<![CDATA[", 9) == 0) {
      close = find(lt + 9, end, "]]>");
      if (close == NULL) return bad(what, xml, lt, "unterminated CDATA");
      p = close + 3;
      continue;
    }
    if (left >= 10 && memcmp(lt, "<property", 9) == 0 &&
        (lt[9] == '>' || is_space(lt[9]))) {
      close = find(lt + 9, end, "</property>");
      if (close == NULL) return bad(what, xml, lt, "<property> not closed");
      char *name = NULL, *value = NULL;
      int rc = child_text(what, xml, lt + 9, close, "name", &name);
      if (rc == EMBER_OK) rc = child_text(what, xml, lt + 9, close, "value", &value);
      if (rc != EMBER_OK) {
        free(name);
        free(value);
        return rc;
      }
      if (name != NULL && name[0] != '\0') {
        if (value == NULL && (value = strdup("")) == NULL) {
          free(name);
          return ember__set_error(EMBER_ENOMEM, "%s: out of memory", what);
        }
        rc = add(conf, name, value);
        if (rc != EMBER_OK) return rc;
      } else {
        free(name);
        free(value);
      }
      p = close + 11;
      continue;
    }
    close = memchr(lt, '>', left);
    if (close == NULL) return bad(what, xml, lt, "unterminated tag");
    p = close + 1;
  }
  return EMBER_OK;
}

int ember__read_bounded_file(const char *path, size_t max, const char *what, char **buf,
                             size_t *len) {
  *buf = NULL;
  *len = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    return ember__set_errno(e == ENOENT ? EMBER_ENOTFOUND : EMBER_ESYS, e, "open %s", what);
  }
  struct stat st;
  char *b = NULL;
  int rc = EMBER_OK;
  if (fstat(fd, &st) < 0) {
    rc = ember__set_errno(EMBER_ESYS, errno, "stat %s", what);
    goto out;
  }
  if (st.st_size < 0 || (uint64_t)st.st_size > max) {
    rc = ember__set_error(EMBER_ETOOBIG, "%s: %lld bytes, more than the %zu accepted", what,
                          (long long)st.st_size, max);
    goto out;
  }
  size_t size = (size_t)st.st_size, got = 0;
  if ((b = malloc(size + 1)) == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "%s: out of memory", what);
    goto out;
  }
  while (got < size) {
    ssize_t r = read(fd, b + got, size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      rc = ember__set_errno(EMBER_ESYS, errno, "read %s", what);
      goto out;
    }
    if (r == 0) break; /* shrank meanwhile: parse what is there */
    got += (size_t)r;
  }
  b[got] = '\0';
  *buf = b;
  *len = got;
  b = NULL;
out:
  free(b);
  close(fd);
  return rc;
}

int ember__conf_load(ember__conf *conf, const char *dir, const char *file) {
  char path[4096];
  int n = snprintf(path, sizeof path, "%s/%s", dir, file);
  if (n < 0 || (size_t)n >= sizeof path)
    return ember__set_error(EMBER_EINVAL, "configuration path too long: %s/%s", dir, file);
  char *buf;
  size_t len;
  int rc = ember__read_bounded_file(path, EMBER__CONF_MAX_BYTES, path, &buf, &len);
  if (rc != EMBER_OK) return rc;
  rc = ember__conf_parse(conf, buf, len, path);
  free(buf);
  return rc;
}

const char *ember__conf_get(const ember__conf *conf, const char *name) {
  for (size_t i = conf->n; i > 0; i--)
    if (strcmp(conf->names[i - 1], name) == 0) return conf->values[i - 1];
  return NULL;
}

void ember__conf_free(ember__conf *conf) {
  for (size_t i = 0; i < conf->n; i++) {
    free(conf->names[i]);
    free(conf->values[i]);
  }
  free(conf->names);
  free(conf->values);
  memset(conf, 0, sizeof *conf);
}
