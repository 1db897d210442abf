/* fuzz_webhdfs.c - libFuzzer harness for the parsers of the bytes the
 * WebHDFS client takes from outside: NameNode/DataNode JSON replies
 * (json.c) and Hadoop XML configuration files (hadoop_conf.c).  Every input
 * goes to both.
 *
 * Besides "no crash, no out-of-bounds read" (ASan/UBSan), it checks that an
 * accepted JSON tree is consistent (child counts match the lists, strings
 * are NUL-terminated at their length, integers agree with their literal)
 * and that every configuration property is a pair of NUL-terminated
 * strings, and lookups find the last definition of a name. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/hadoop_conf.h"
#include "../../csrc/json.h"
#include "ember/error.h"

static void require(int cond) {
  if (!cond) abort();
}

static size_t walk(const ember__json *v, unsigned depth) {
  require(depth <= EMBER__JSON_MAX_DEPTH);
  size_t nodes = 1;
  switch (v->kind) {
  case EMBER__JSON_STRING:
  case EMBER__JSON_NUMBER:
    require(v->str != NULL && v->str[v->len] == '\0');
    if (v->kind == EMBER__JSON_NUMBER && v->is_int)
      require(strtoll(v->str, NULL, 10) == v->i);
    break;
  case EMBER__JSON_ARRAY:
  case EMBER__JSON_OBJECT: {
    size_t n = 0;
    for (const ember__json *c = v->child; c != NULL; c = c->next) {
      if (v->kind == EMBER__JSON_OBJECT) require(c->key != NULL && c->key[c->key_len] == '\0');
      else require(c->key == NULL);
      nodes += walk(c, depth + 1);
      n++;
    }
    require(n == v->count);
    break;
  }
  default:
    require(v->child == NULL && v->str == NULL);
  }
  return nodes;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  ember__json *j = NULL;
  if (ember__json_parse((const char *)data, size, 0, &j) == EMBER_OK) {
    /* every node costs at least one input byte */
    require(walk(j, 0) <= size);
    ember__json_free(j);
  } else {
    require(j == NULL);
    require(ember_last_error()[0] != '\0');
  }

  ember__conf c = {0};
  if (ember__conf_parse(&c, (const char *)data, size, "fuzz.xml") == EMBER_OK) {
    for (size_t i = 0; i < c.n; i++) {
      require(c.names[i] != NULL && c.values[i] != NULL);
      require(c.names[i][0] != '\0');
      require(strlen(c.names[i]) <= size && strlen(c.values[i]) <= size);
      const char *v = ember__conf_get(&c, c.names[i]);
      size_t last = i;
      for (size_t k = i + 1; k < c.n; k++)
        if (strcmp(c.names[k], c.names[i]) == 0) last = k;
      require(v == c.values[last]);
    }
  }
  ember__conf_free(&c);
  return 0;
}
