/* fuzz_hadoop_token.c - libFuzzer harness for the Hadoop token storage
 * reader (hadoop_token.c): the token file a container is handed
 * (HADOOP_TOKEN_FILE_LOCATION), the URL form of a token and the
 * delegation-token identifier inside it.  Every input goes to all three.
 *
 * Besides "no crash, no out-of-bounds read" (ASan/UBSan) it checks:
 *  - a parsed file holds at most EMBER__TOKEN_MAX_COUNT tokens with distinct
 *    aliases, NUL-free strings and fields no longer than the input, and
 *    ember__credentials_find finds a token of each kind and service;
 *  - every parsed token encodes to the URL form and decodes back to the
 *    same bytes, and its identifier parses or fails with a message;
 *  - a failure leaves the output zeroed and sets a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../csrc/hadoop_token.h"
#include "ember/error.h"

static void require(int cond) {
  if (!cond) abort();
}

static void check_ident(const ember__token *t, size_t size) {
  ember__token_ident id;
  if (ember__token_ident_parse(t, &id) == EMBER_OK) {
    require(id.owner != NULL && id.renewer != NULL && id.real_user != NULL);
    require(strlen(id.owner) + strlen(id.renewer) + strlen(id.real_user) < t->identifier_len);
    require(t->identifier_len <= size);
    ember__token_ident_free(&id);
    require(id.owner == NULL);
  } else {
    require(id.owner == NULL && id.renewer == NULL && id.real_user == NULL);
    require(ember_last_error()[0] != '\0');
  }
}

static int same_token(const ember__token *a, const ember__token *b) {
  return a->identifier_len == b->identifier_len && a->password_len == b->password_len &&
         memcmp(a->identifier, b->identifier, a->identifier_len) == 0 &&
         memcmp(a->password, b->password, a->password_len) == 0 &&
         strcmp(a->kind, b->kind) == 0 && strcmp(a->service, b->service) == 0;
}

/* URL form round trip: encode, decode, compare. */
static void check_url(const ember__token *t) {
  char *url = NULL;
  require(ember__token_encode_url(t, &url) == EMBER_OK);
  ember__token back;
  require(ember__token_decode_url(&back, url, strlen(url), "url") == EMBER_OK);
  require(same_token(t, &back));
  ember__token_clear(&back);
  free(url);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  ember__credentials c;
  if (ember__credentials_parse(&c, data, size, "fuzz") == EMBER_OK) {
    require(c.n <= EMBER__TOKEN_MAX_COUNT);
    require(c.n == 0 || c.tokens != NULL);
    for (size_t i = 0; i < c.n; i++) {
      const ember__token *t = &c.tokens[i];
      require(t->identifier != NULL && t->password != NULL);
      require(t->kind != NULL && t->service != NULL && t->alias != NULL);
      require(t->identifier_len + t->password_len + strlen(t->kind) + strlen(t->service) +
                  strlen(t->alias) <= size);
      for (size_t k = 0; k < i; k++) require(strcmp(c.tokens[k].alias, t->alias) != 0);
      const ember__token *f = ember__credentials_find(&c, t->kind, t->service);
      require(f != NULL && f <= t && strcmp(f->kind, t->kind) == 0 &&
              strcmp(f->service, t->service) == 0);
      check_url(t);
      check_ident(t, size);
    }
    ember__credentials_free(&c);
  } else {
    require(c.n == 0 && c.tokens == NULL);
    require(ember_last_error()[0] != '\0');
  }

  /* the input as a token's URL form */
  ember__token t;
  if (ember__token_decode_url(&t, (const char *)data, size, "fuzz url") == EMBER_OK) {
    require(t.alias != NULL && t.alias[0] == '\0');
    check_url(&t);
    check_ident(&t, size);
    ember__token_clear(&t);
  } else {
    require(t.identifier == NULL && t.kind == NULL);
  }

  /* the input as a delegation-token identifier */
  ember__token raw = {(uint8_t *)data, size, (uint8_t *)"", 0, "fuzz", "", ""};
  check_ident(&raw, size);
  return 0;
}
