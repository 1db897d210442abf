/* hadoop_token.h - internal: reads Hadoop's token storage ("Credentials")
 * files, the file YARN and Spark name in HADOOP_TOKEN_FILE_LOCATION, so the
 * WebHDFS client can send a delegation token on a Kerberized cluster.  Not
 * installed; ember__ names.
 *
 * Format (org.apache.hadoop.security.Credentials, readTokenStorageStream):
 * the magic "HDTS", a version byte, then
 *   0 (WRITABLE): vint n, n x (Text alias, Token), vint m, m x (Text alias,
 *     vint len, len bytes of secret).  A Token is vint len + identifier,
 *     vint len + password, Text kind, Text service; a Text is vint len + UTF-8
 *     bytes; vints are WritableUtils' zero-compressed integers.
 *   1 (PROTOBUF): one length-delimited CredentialsProto {repeated
 *     CredentialsKVProto tokens = 1; repeated CredentialsKVProto secrets = 2},
 *     CredentialsKVProto {required string alias = 1; optional TokenProto
 *     token = 2; optional bytes secret = 3}, TokenProto {required bytes
 *     identifier = 1; required bytes password = 2; required string kind = 3;
 *     required string service = 4} (hadoop-common's Security.proto).
 * Hadoop 3.4's Credentials.writeTokenStorageFile/ToStream still write
 * WRITABLE unless asked for PROTOBUF; both are read here.
 *
 * As in Hadoop, a later token with the same alias replaces an earlier one,
 * unknown protobuf fields are skipped and bytes after the Credentials are
 * ignored.  Stricter than Hadoop: a negative count, a token entry without a
 * token, or a NUL byte in an alias, kind or service (kept as C strings here)
 * is malformed.  Secret keys are parsed (so a malformed one is an error) but
 * not kept.
 *
 * Bounded: at most EMBER__TOKEN_FILE_MAX_BYTES of input and
 * EMBER__TOKEN_MAX_COUNT tokens (EMBER_ETOOBIG beyond); every length read is
 * checked against the bytes left before it is used, so nothing is read
 * outside the input.  Malformed input is EMBER_EPROTO with a message naming
 * the source, the byte offset and what was wrong, e.g. "token file /x: token
 * 2 password length 9999 runs past the end (offset 41)".
 *
 * Ownership: every pointer in an ember__credentials or ember__token_ident is
 * a malloc'd copy owned by it; free with ember__credentials_free /
 * ember__token_ident_free.
 *
 * Thread-safety: pure functions (the message goes to the calling thread's
 * last error); a parsed ember__credentials is immutable and may be read from
 * any number of threads.
 */
#ifndef EMBER_HADOOP_TOKEN_H
#define EMBER_HADOOP_TOKEN_H

#include <stddef.h>
#include <stdint.h>

#define EMBER__TOKEN_FILE_MAX_BYTES (16u << 20)
#define EMBER__TOKEN_MAX_COUNT 4096u

/* The environment variable YARN and Spark set to the container's token file. */
#define EMBER__TOKEN_FILE_ENV "HADOOP_TOKEN_FILE_LOCATION"

/* The kind of an HDFS delegation token (WebHDFS sends it as ?delegation=). */
#define EMBER__TOKEN_KIND_HDFS "HDFS_DELEGATION_TOKEN"

/* One org.apache.hadoop.security.token.Token and its alias in the file.
 * identifier and password are never NULL (an empty one is a 1-byte
 * allocation holding 0); kind, service and alias are NUL-terminated and
 * contain no NUL byte (alias is "" for a token from ember__token_decode_url). */
typedef struct {
  uint8_t *identifier;
  size_t identifier_len;
  uint8_t *password;
  size_t password_len;
  char *kind;    /* e.g. "HDFS_DELEGATION_TOKEN", "kms-dt" */
  char *service; /* e.g. "127.0.0.1:8020", "ha-hdfs:mycluster" */
  char *alias;   /* the Credentials' key, often the service again */
} ember__token;

typedef struct {
  size_t n;
  ember__token *tokens; /* in file order; a repeated alias keeps the first one's place and
                         * the last one's token (NULL when n == 0) */
} ember__credentials;

/* Parses a token storage file held in buf[0..len) (either version) into
 * *out, which is overwritten (any previous content is not freed) and left
 * zeroed on failure.  `what` names the source in error messages ("token
 * file /path").  EMBER_EPROTO (malformed: wrong magic, unknown version,
 * truncated, bad length), EMBER_ETOOBIG (caps above), EMBER_ENOMEM. */
int ember__credentials_parse(ember__credentials *out, const uint8_t *buf, size_t len,
                             const char *what);

/* Reads and parses the file at `path` (one open + read, no waiting).  A
 * missing file is EMBER_ENOTFOUND naming the path; other I/O failures
 * EMBER_ESYS; otherwise as ember__credentials_parse. */
int ember__credentials_load(ember__credentials *out, const char *path);

/* Frees what c holds and zeroes it (NULL or a zeroed c is fine). */
void ember__credentials_free(ember__credentials *c);

/* The first token whose kind equals `kind` and whose service equals
 * `service`, or NULL.  NULL for either matches any.  Byte comparison, as
 * Hadoop's Text.equals.  Linear in the number of tokens. */
const ember__token *ember__credentials_find(const ember__credentials *c, const char *kind,
                                            const char *service);

/* *out = Token.encodeToUrlString(): the token's Writable form (without the
 * alias) in URL-safe Base64 without padding or line breaks, the value of
 * WebHDFS's `delegation` query parameter.  *out is malloc'd and
 * NUL-terminated.  EMBER_EINVAL if a field is longer than a Java array can
 * be; EMBER_ENOMEM. */
int ember__token_encode_url(const ember__token *t, char **out);

/* The reverse, Token.decodeFromUrlString(): s[0..len) in URL-safe (or
 * standard) Base64, padding optional, into *out (alias ""; free its fields
 * with ember__token_clear).  Stricter than commons-codec: characters outside
 * the alphabet and bytes after the token are errors.  EMBER_EPROTO naming
 * `what`, EMBER_ENOMEM. */
int ember__token_decode_url(ember__token *out, const char *s, size_t len, const char *what);

/* Frees a token's fields and zeroes it (for tokens made by
 * ember__token_decode_url; those in an ember__credentials belong to it). */
void ember__token_clear(ember__token *t);

/* The fields of a delegation-token identifier
 * (AbstractDelegationTokenIdentifier: HDFS_DELEGATION_TOKEN, kms-dt, ...).
 * Strings are malloc'd, NUL-terminated, "" when empty. */
typedef struct {
  char *owner;
  char *renewer;
  char *real_user;
  int64_t issue_date_ms; /* ms since the epoch */
  int64_t max_date_ms;
  int32_t sequence_number;
  int32_t master_key_id;
} ember__token_ident;

/* Decodes t's identifier as AbstractDelegationTokenIdentifier.readFields
 * does: version byte 0, Text owner, renewer, realUser (each under 1 MiB),
 * vlong issueDate, vlong maxDate, vint sequenceNumber, vint masterKeyId;
 * bytes after these are ignored (subclasses may add fields).  *out is
 * zeroed on failure.  EMBER_EPROTO (not such an identifier, or malformed;
 * the message names the token's kind and service), EMBER_ENOMEM. */
int ember__token_ident_parse(const ember__token *t, ember__token_ident *out);

/* Frees what id holds and zeroes it (NULL is fine). */
void ember__token_ident_free(ember__token_ident *id);

#endif /* EMBER_HADOOP_TOKEN_H */
