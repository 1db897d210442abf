/* ember/webhdfs.h - HDFS files over WebHDFS (the NameNode's HTTP REST API),
 * with libcurl: no libhdfs, no JVM, no CLASSPATH on the reading side.
 *
 * URLs.  "hdfs://host:port/path" names a file by its NameNode's RPC address,
 * as everywhere in Hadoop; WebHDFS needs the NameNode's HTTP address, found
 * in this order:
 *   1. opts.namenode ("host:port" or "http(s)://host:port"), if set;
 *   2. hdfs-site.xml in opts.conf_dir, else in $HADOOP_CONF_DIR:
 *      dfs.namenode.http-address (or dfs.namenode.https-address when
 *      dfs.http.policy is HTTPS_ONLY), provided that the URL names no
 *      authority or the one in dfs.namenode.rpc-address / fs.defaultFS;
 *      for an HA nameservice "hdfs://ns/...", dfs.namenode.http-address.ns.<id>
 *      of every id in dfs.ha.namenodes.ns, tried in that order (a standby or
 *      unreachable NameNode moves on to the next);
 *   3. the URL's host with Hadoop's default HTTP port 9870.
 * "webhdfs://host:port/path" (and "swebhdfs://" for HTTPS) name the HTTP
 * address directly, as Hadoop's WebHdfsFileSystem does.  "hdfs:///path"
 * (no authority) needs 1 or 2.  Paths are taken literally (no %-decoding);
 * the request encodes them.  Requests never go through an HTTP proxy
 * (http_proxy and friends are ignored, as by Hadoop's Java clients).
 *
 * Authentication.  On a cluster with simple authentication, requests carry
 * user.name: opts.user, else $HADOOP_USER_NAME, else the login name of the
 * effective user.  On a Kerberized one (hadoop.security.authentication=
 * kerberos in the configuration's core-site.xml, or a NameNode answering
 * 401 to a simple request) they authenticate to the NameNode, in this order,
 * with:
 *   1. the HDFS delegation token in the Hadoop token file named by
 *      $HADOOP_TOKEN_FILE_LOCATION (what YARN gives every container and
 *      Spark its executors), the one whose service is this NameNode's RPC
 *      address, or the only HDFS token there is (delegation= parameter);
 *   2. SPNEGO (ember/spnego.h) with the user's Kerberos ticket (KRB5CCNAME,
 *      filled by kinit) or client keytab (KRB5_CLIENT_KTNAME).
 * DataNodes are reached through the NameNode's redirects, which carry a
 * delegation token of their own.  Bad credentials are EMBER_EAUTH at once,
 * without retries, with what to do: no ticket (kinit), an expired ticket, a
 * service principal the KDC does not know (a NameNode addressed by another
 * name), a token the NameNode refused (expired or cancelled), a token file
 * that cannot be read.
 *
 * Reading.  ember_webhdfs_open checks the path (GETFILESTATUS: it must be a
 * file) and learns its length.  Reads are served from one buffer of
 * opts.range_bytes, filled by one OPEN request per range (offset + length)
 * that follows the NameNode's redirect to a DataNode, so memory is bounded
 * whatever the file size and a DataNode never sends more than was asked.  A
 * connection lost mid-range (reset, refused, stalled past the timeout, a
 * DataNode answering 5xx) is retried from the exact byte reached, through the
 * NameNode again (which may pick another replica), up to opts.retries times
 * in a row without progress, with 0.1 s, 0.2 s, ... (at most 2 s) between.
 *
 * Errors name the operation and the URL, e.g.
 *   "webhdfs OPEN hdfs://nn:8020/data/x: no such file or directory
 *    (FileNotFoundException: File does not exist: /data/x)"
 *   EMBER_ENOTFOUND   no such file or directory
 *   EMBER_EPERM       permission denied (AccessControlException), naming the user
 *   EMBER_EAUTH       Kerberos credentials missing, expired or refused
 *   EMBER_EINVAL      bad URL, a directory where a file is needed (or the
 *                     reverse), a file that already exists, a bad argument
 *   EMBER_ETIMEDOUT   connect or stall timeout (after the retries, for data)
 *   EMBER_EIO         connection lost after every retry, other remote errors
 *   EMBER_EPROTO      a reply that is not what WebHDFS sends
 *   EMBER_ETRUNCATED  the file ended before the length it had at open
 *
 * Blocking: every call blocks on the network; each HTTP request is bounded
 * by opts.timeout_ms for connecting and for any stall of the transfer
 * (no bytes for that long), metadata requests also in total.
 * Thread-safety: a file or writer is used by one thread at a time; distinct
 * handles and the one-shot calls are independent and thread-safe (libcurl is
 * initialised once, thread-safely).
 */
#ifndef EMBER_WEBHDFS_H
#define EMBER_WEBHDFS_H

#include <stddef.h>
#include <stdint.h>

#include "ember/io.h"
#include "ember/tfrecord.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EMBER_WEBHDFS_DEFAULT_TIMEOUT_MS 60000
#define EMBER_WEBHDFS_DEFAULT_RANGE (8u << 20)
#define EMBER_WEBHDFS_MAX_RANGE (1u << 30)
#define EMBER_WEBHDFS_MIN_RANGE 1u
#define EMBER_WEBHDFS_DEFAULT_RETRIES 4
#define EMBER_WEBHDFS_DEFAULT_HTTP_PORT 9870
/* Largest JSON reply accepted (a LISTSTATUS of ~200k entries). */
#define EMBER_WEBHDFS_MAX_JSON (64u << 20)

typedef struct {
  const char *namenode; /* NameNode HTTP address; NULL: resolve (see above) */
  const char *conf_dir; /* Hadoop conf dir; NULL: $HADOOP_CONF_DIR */
  const char *user;     /* user.name; NULL: $HADOOP_USER_NAME or login name */
  int64_t timeout_ms;   /* connect / stall timeout per request; <= 0: default */
  size_t range_bytes;   /* bytes per OPEN request and per written chunk; 0: default */
  int retries;          /* consecutive retries of a lost read; < 0: default */
} ember_webhdfs_opts;

/* Fills o with the defaults (all resolution automatic). */
void ember_webhdfs_opts_init(ember_webhdfs_opts *o);

/* ------------------------------------------------------------ reading */

typedef struct ember_webhdfs_file ember_webhdfs_file;

/* Opens url for reading.  opts may be NULL (defaults); its strings are
 * copied.  Blocks for one GETFILESTATUS round trip. */
int ember_webhdfs_open(ember_webhdfs_file **out, const char *url,
                       const ember_webhdfs_opts *opts);

/* An ember_read_fn (io.h): reads up to n bytes at the current position into
 * buf; returns the count (short only at a range boundary or the end), 0 at
 * the end of the file, or a negative EMBER_E* code.  Errors other than
 * retried connection losses are sticky. */
int64_t ember_webhdfs_read(void *file, void *buf, size_t n);

/* Moves the read position (<= size); the next read starts a new range
 * unless the target lies in the buffered one. */
int ember_webhdfs_seek(ember_webhdfs_file *f, uint64_t offset);
uint64_t ember_webhdfs_tell(const ember_webhdfs_file *f);
/* The file's length when it was opened. */
uint64_t ember_webhdfs_size(const ember_webhdfs_file *f);

typedef struct {
  uint64_t requests; /* HTTP requests made (NameNode and DataNode) */
  uint64_t ranges;   /* OPEN ranges fetched */
  uint64_t retries;  /* reads retried after a lost connection */
  uint64_t bytes;    /* data bytes received */
} ember_webhdfs_stats;
void ember_webhdfs_file_stats(const ember_webhdfs_file *f, ember_webhdfs_stats *out);

/* Closes and frees (NULL is fine).  Never blocks on the network for long:
 * idle connections are closed. */
void ember_webhdfs_close(ember_webhdfs_file *f);

/* ------------------------------------------------------------ metadata */

typedef struct {
  char *name;        /* LISTSTATUS: the entry's name; GETFILESTATUS: "" */
  int is_dir;
  uint64_t length;
  int64_t mtime_ms;  /* modification time, ms since the epoch */
  uint32_t permission; /* e.g. 0644 */
  uint32_t replication;
  uint64_t block_size;
  char *owner;
  char *group;
} ember_webhdfs_status;

/* GETFILESTATUS of url into *out (free with ember_webhdfs_status_clear). */
int ember_webhdfs_stat(const char *url, const ember_webhdfs_opts *opts,
                       ember_webhdfs_status *out);
void ember_webhdfs_status_clear(ember_webhdfs_status *st);

/* LISTSTATUS of a directory: *out is an array of *count entries sorted by
 * name (free with ember_webhdfs_list_free).  A file lists as itself, one
 * entry named "" (HDFS's rule). */
int ember_webhdfs_list(const char *url, const ember_webhdfs_opts *opts,
                       ember_webhdfs_status **out, size_t *count);
void ember_webhdfs_list_free(ember_webhdfs_status *entries, size_t count);

/* MKDIRS (with parents; existing directories are fine). */
int ember_webhdfs_mkdirs(const char *url, const ember_webhdfs_opts *opts);

/* SETPERMISSION: url's permission bits become mode (e.g. 0700; at most
 * 01777). */
int ember_webhdfs_set_permission(const char *url, unsigned mode, const ember_webhdfs_opts *opts);

/* GETDELEGATIONTOKEN: a new HDFS delegation token of the authenticated user
 * (Kerberos: see "Authentication" above), renewable by `renewer` (the short
 * name of the ResourceManager's principal when YARN is to renew it), as
 * Token.encodeToUrlString() in *token (malloc'd).  The token is of kind
 * HDFS_DELEGATION_TOKEN with the NameNode's RPC service, as Hadoop's RPC
 * client and YARN's localizer select tokens (WebHDFS answers with kind
 * "WEBHDFS delegation"; identifier and password are the same).  This is
 * what a YARN client puts in an application's launch context. */
int ember_webhdfs_delegation_token(const char *url, const char *renewer,
                                   const ember_webhdfs_opts *opts, char **token);

/* DELETE; *deleted (may be NULL) says whether something was removed (a
 * missing path is not an error).  A non-empty directory needs recursive. */
int ember_webhdfs_delete(const char *url, int recursive, const ember_webhdfs_opts *opts,
                         int *deleted);

/* RENAME src (a URL) to dst: an absolute path on the same file system, or
 * a URL naming it (its path is used; the authority must be src's).  HDFS's
 * rename2 semantics (WebHDFS renameoptions), never "move into": without
 * EMBER_WEBHDFS_OVERWRITE an existing dst is an error (EMBER_EINVAL,
 * "already exists"); with it a file or empty directory at dst is replaced
 * atomically.  dst's parent must exist (EMBER_ENOTFOUND otherwise, as for
 * a missing src).  A rename retried after a lost reply may find src gone
 * (EMBER_ENOTFOUND): callers that retry check dst. */
int ember_webhdfs_rename(const char *src, const char *dst, int flags,
                         const ember_webhdfs_opts *opts);

/* ------------------------------------------------------------ writing */

#define EMBER_WEBHDFS_OVERWRITE 1

typedef struct ember_webhdfs_writer ember_webhdfs_writer;

/* A writer buffers up to opts.range_bytes; the first full buffer (or close)
 * creates the file with it (CREATE: NameNode, then the DataNode it
 * redirects to), later ones are appended (APPEND).  A small file is thus one
 * CREATE.  Without EMBER_WEBHDFS_OVERWRITE an existing file is an error
 * (EMBER_EINVAL).  Parent directories are created. */
int ember_webhdfs_writer_create(ember_webhdfs_writer **out, const char *url, int flags,
                                const ember_webhdfs_opts *opts);
int ember_webhdfs_writer_write(ember_webhdfs_writer *w, const void *buf, size_t n);
/* Flushes what is buffered (creating an empty file if nothing was written)
 * and frees the writer, whatever the result.  The file is complete only if
 * this returns EMBER_OK. */
int ember_webhdfs_writer_close(ember_webhdfs_writer *w);
/* Frees without flushing (NULL is fine); what was already sent stays. */
void ember_webhdfs_writer_destroy(ember_webhdfs_writer *w);

/* Writes data[0..len) as the whole file url (writer_create + write + close). */
int ember_webhdfs_write_file(const char *url, const void *data, size_t len, int flags,
                             const ember_webhdfs_opts *opts);

/* ------------------------------------------------------------ TFRecord */

/* A TFRecord reader (tfrecord.h) over ember_webhdfs_open(url): ranged,
 * resumed reads; the reader owns the file (destroy closes it).  Errors name
 * the URL.  Blocks for the open's GETFILESTATUS. */
int ember_webhdfs_tfr_reader_open(ember_tfr_reader **out, const char *url,
                                  const ember_webhdfs_opts *opts,
                                  const ember_tfr_options *tfr_opts);

/* A TFRecord writer streaming to url through an ember_webhdfs_writer
 * (flags as for ember_webhdfs_writer_create): ember_tfr_writer_close sends
 * the rest and completes the file; destroy without a successful close
 * leaves whatever chunks were sent (write to a temporary name and
 * ember_webhdfs_rename it for atomicity). */
int ember_webhdfs_tfr_writer_open(ember_tfr_writer **out, const char *url, int flags,
                                  const ember_webhdfs_opts *opts, int compression, int level);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_WEBHDFS_H */
