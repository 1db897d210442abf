/* json.h - internal: a small, bounded JSON parser for the replies of HTTP
 * services (WebHDFS FileStatus/FileStatuses/RemoteException, YARN REST).
 * Not installed; ember__ names.
 *
 * Parses a whole document into a tree of nodes (RFC 8259: objects, arrays,
 * strings with every escape incl. UTF-16 surrogate pairs decoded to UTF-8,
 * numbers, true/false/null).  Limits: nesting depth (caller's, at most
 * EMBER__JSON_MAX_DEPTH) and input length (the caller bounds what it reads);
 * anything malformed is EMBER_EPROTO with a message giving the byte offset.
 * Never reads outside buf[0..len).  Strings are NUL-terminated copies and
 * may contain NUL bytes (.len tells).
 *
 * Thread-safety: pure functions; a tree is immutable once parsed.
 */
#ifndef EMBER_JSON_H
#define EMBER_JSON_H

#include <stddef.h>
#include <stdint.h>

#define EMBER__JSON_MAX_DEPTH 64u

typedef enum {
  EMBER__JSON_NULL = 0,
  EMBER__JSON_FALSE,
  EMBER__JSON_TRUE,
  EMBER__JSON_NUMBER,
  EMBER__JSON_STRING,
  EMBER__JSON_ARRAY,
  EMBER__JSON_OBJECT
} ember__json_kind;

typedef struct ember__json ember__json;
struct ember__json {
  ember__json_kind kind;
  char *key;          /* member name when inside an object, else NULL */
  size_t key_len;
  char *str;          /* STRING: decoded text; NUMBER: the literal as written */
  size_t len;         /* byte length of str */
  int is_int;         /* NUMBER: an integer literal that fits int64 */
  int64_t i;          /* NUMBER: the value when is_int */
  double d;           /* NUMBER: the value (rounded) */
  ember__json *child; /* ARRAY / OBJECT: first element or member */
  ember__json *next;  /* next sibling */
  size_t count;       /* ARRAY / OBJECT: number of children */
};

/* Parses buf[0..len) (one value, surrounded only by whitespace).  *out is
 * the root; free it with ember__json_free.  EMBER_EPROTO (malformed, too
 * deep), EMBER_ENOMEM. */
int ember__json_parse(const char *buf, size_t len, unsigned max_depth, ember__json **out);

/* Frees a tree (NULL is fine). */
void ember__json_free(ember__json *root);

/* The member `key` of an OBJECT node (first match), or NULL if v is not an
 * object or has no such member. */
const ember__json *ember__json_get(const ember__json *v, const char *key);

/* Convenience lookups: the member's string / integer, or NULL / 0 with
 * *found = 0 when absent or of another kind.  found may be NULL. */
const char *ember__json_get_str(const ember__json *v, const char *key);
int64_t ember__json_get_int(const ember__json *v, const char *key, int *found);

#endif /* EMBER_JSON_H */
