/* hadoop_conf.h - internal: reads Hadoop's XML configuration files
 * (core-site.xml, hdfs-site.xml) into name -> value pairs.  Not installed;
 * ember__ names.
 *
 * Understands what Hadoop writes and people edit: <property> elements with
 * <name> and <value> children (other children such as <final>, <source>,
 * <description> are ignored), comments, CDATA sections, the five predefined
 * entities and numeric character references; surrounding whitespace of
 * names and values is trimmed.  No ${var} expansion, no XInclude.  A later
 * property with the same name overrides an earlier one.  Bounded: at most
 * EMBER__CONF_MAX_BYTES of input; malformed input is EMBER_EPROTO naming the
 * byte offset.  Never reads outside the input.
 *
 * Thread-safety: pure functions; a conf is immutable once parsed.
 */
#ifndef EMBER_HADOOP_CONF_H
#define EMBER_HADOOP_CONF_H

#include <stddef.h>

#define EMBER__CONF_MAX_BYTES (8u << 20)

typedef struct {
  size_t n;
  char **names;
  char **values;
} ember__conf;

/* Parses xml[0..len) and appends its properties to *conf (which starts
 * zeroed), so several files can be layered.  `what` names the source in
 * error messages. */
int ember__conf_parse(ember__conf *conf, const char *xml, size_t len, const char *what);

/* Reads and parses dir/file into *conf; a missing file is EMBER_ENOTFOUND
 * (and leaves *conf as it was). */
int ember__conf_load(ember__conf *conf, const char *dir, const char *file);

/* Reads the whole file at path (at most max bytes, else EMBER_ETOOBIG) into
 * *buf (malloc'd, NUL-terminated after *len bytes).  A missing file is
 * EMBER_ENOTFOUND; `what` names the file in messages.  Shared by the
 * readers of Hadoop's files (configuration, token files). */
int ember__read_bounded_file(const char *path, size_t max, const char *what, char **buf,
                             size_t *len);

/* The value of name (the last definition, also across layered files), or
 * NULL.  Linear in the number of properties. */
const char *ember__conf_get(const ember__conf *conf, const char *name);

void ember__conf_free(ember__conf *conf);

#endif /* EMBER_HADOOP_CONF_H */
