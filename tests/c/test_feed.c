/* test_feed.c - the batch codec, and the feed server and client on loopback.
 *
 * Every server test runs twice: as written (producers on the same host as
 * the server, so batches go through shared-memory rings) and with a tcp_
 * prefix under EMBER_FEED_SHM=0 (TCP as before); the producer helper checks
 * that the transport is the expected one.  The shm_ tests cover what only
 * shared memory has (negotiation, killed peers, split batches).
 *
 * Server tests run producers in threads (END_PARTITION blocks until the
 * consumer has popped the partition) and end with an explicit LeakSanitizer
 * check: the harness ends each test with _exit, which skips LSan's atexit
 * check, so leaks would otherwise go unseen. */
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>
#include <time.h>

#include "ember/auth.h"
#include "ember/feed.h"
#include "ember/net.h"
#include "ember/shm_ring.h"
#include "ember/wire.h"
#include "harness.h"
#include "strangers.h"

#include <dirent.h>
#include <sys/stat.h>

#if defined(__SANITIZE_ADDRESS__)
#define FEED_TEST_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FEED_TEST_LSAN 1
#endif
#endif
#ifdef FEED_TEST_LSAN
#include <sanitizer/lsan_interface.h>
#define LEAK_CHECK() CHECK(__lsan_do_recoverable_leak_check() == 0)
#else
#define LEAK_CHECK() ((void)0)
#endif

static const uint8_t SECRET[32] = "0123456789abcdef0123456789abcdef";
static const uint8_t WRONG[32] = "fedcba9876543210fedcba9876543210";

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------ codec tests */

/* Copies into an exact-size heap buffer so ASan sees any read past len. */
static uint8_t *dup_exact(const uint8_t *p, size_t n) {
  uint8_t *d = malloc(n ? n : 1);
  CHECK(d != NULL);
  if (n) memcpy(d, p, n);
  return d;
}

typedef struct {
  float f32[5 * 2];
  double f64[5];
  int32_t i32[5 * 3];
  int64_t i64[5];
  uint8_t u8[5 * 4];
  uint8_t b[5];
  uint64_t off[6];
  char bytes[32];
  ember_column cols[7];
} sample;

/* 7 columns, one per dtype; BYTES rows are "", "a", "", "bcd", "" */
static void make_sample(sample *s, uint32_t nrows) {
  static const char *strs[5] = {"", "a", "", "bcd", ""};
  uint64_t o = 0;
  memset(s, 0, sizeof *s);
  for (uint32_t r = 0; r < nrows; r++) {
    s->f32[2 * r] = (float)r + 0.5f;
    s->f32[2 * r + 1] = -(float)r;
    s->f64[r] = r * 1.25;
    for (int k = 0; k < 3; k++) s->i32[3 * r + k] = (int32_t)(r * 10 + k) - 7;
    s->i64[r] = (int64_t)r * 1000000007LL - 3;
    for (int k = 0; k < 4; k++) s->u8[4 * r + k] = (uint8_t)(r * 4 + k + 200);
    s->b[r] = (uint8_t)(r & 1);
    s->off[r] = o;
    memcpy(s->bytes + o, strs[r], strlen(strs[r]));
    o += strlen(strs[r]);
  }
  s->off[nrows] = o;
  s->cols[0] = (ember_column){EMBER_DT_F32, 3, "f32", 2, s->f32, 8ull * nrows, NULL};
  s->cols[1] = (ember_column){EMBER_DT_F64, 0, NULL, 1, s->f64, 8ull * nrows, NULL};
  s->cols[2] = (ember_column){EMBER_DT_I32, 5, "int32", 3, s->i32, 12ull * nrows, NULL};
  s->cols[3] = (ember_column){EMBER_DT_I64, 3, "i64", 1, s->i64, 8ull * nrows, NULL};
  s->cols[4] = (ember_column){EMBER_DT_U8, 2, "u8", 4, s->u8, 4ull * nrows, NULL};
  s->cols[5] = (ember_column){EMBER_DT_BYTES, 5, "bytes", 0, s->bytes, o, s->off};
  s->cols[6] = (ember_column){EMBER_DT_BOOL, 4, "bool", 1, s->b, nrows, NULL};
}

static void check_cols_equal(const ember_column *a, const ember_column *b, uint32_t n,
                             uint32_t nrows) {
  for (uint32_t i = 0; i < n; i++) {
    CHECK_EQ_INT(a[i].dtype, b[i].dtype);
    CHECK_EQ_INT(a[i].name_len, b[i].name_len);
    if (a[i].name_len) CHECK(memcmp(a[i].name, b[i].name, a[i].name_len) == 0);
    CHECK_EQ_INT(a[i].width, b[i].width);
    CHECK_EQ_INT(a[i].data_len, b[i].data_len);
    if (a[i].data_len) CHECK(memcmp(a[i].data, b[i].data, a[i].data_len) == 0);
    if (a[i].dtype == EMBER_DT_BYTES)
      CHECK(memcmp(a[i].offsets, b[i].offsets, ((size_t)nrows + 1) * 8) == 0);
  }
}

static uint8_t *encode_sample(sample *s, uint32_t nrows, size_t *len) {
  size_t need = 0, wrote = 0;
  uint8_t *buf;
  make_sample(s, nrows);
  CHECK_OK(ember_batch_encoded_size(s->cols, 7, nrows, &need));
  buf = malloc(need);
  CHECK(buf != NULL);
  CHECK_OK(ember_batch_encode(s->cols, 7, nrows, buf, need, &wrote));
  CHECK_EQ_INT(wrote, need);
  *len = need;
  return buf;
}

TEST(dtype_sizes) {
  CHECK_EQ_INT(ember_dtype_size(EMBER_DT_F32), 4);
  CHECK_EQ_INT(ember_dtype_size(EMBER_DT_F64), 8);
  CHECK_EQ_INT(ember_dtype_size(EMBER_DT_I32), 4);
  CHECK_EQ_INT(ember_dtype_size(EMBER_DT_I64), 8);
  CHECK_EQ_INT(ember_dtype_size(EMBER_DT_U8), 1);
  CHECK_EQ_INT(ember_dtype_size(EMBER_DT_BOOL), 1);
  CHECK_EQ_INT(ember_dtype_size(EMBER_DT_BYTES), 0);
  CHECK_EQ_INT(ember_dtype_size(0), 0);
  CHECK_EQ_INT(ember_dtype_size(8), 0);
}

TEST(codec_roundtrip_every_dtype) {
  for (uint32_t nrows = 0; nrows <= 5; nrows++) {
    sample s;
    ember_column out[8];
    uint32_t nc = 0, nr = 99;
    size_t len = 0;
    uint8_t *buf = encode_sample(&s, nrows, &len);
    CHECK_OK(ember_batch_decode(buf, len, out, 8, &nc, &nr));
    CHECK_EQ_INT(nc, 7);
    CHECK_EQ_INT(nr, nrows);
    check_cols_equal(s.cols, out, 7, nrows);
    /* bodies are 8-aligned relative to the buffer */
    for (int i = 0; i < 7; i++) {
      const uint8_t *body = out[i].dtype == EMBER_DT_BYTES ? (const uint8_t *)out[i].offsets
                                                           : (const uint8_t *)out[i].data;
      CHECK(((size_t)(body - buf) % 8) == 0);
    }
    if (nrows == 5) {
      /* the empty strings survive: rows 0, 2, 4 have zero length */
      CHECK(out[5].offsets[0] == 0 && out[5].offsets[1] == 0);
      CHECK(out[5].offsets[2] == 1 && out[5].offsets[3] == 1);
      CHECK(out[5].offsets[5] == 4 && out[5].data_len == 4);
      CHECK(memcmp(out[5].data, "abcd", 4) == 0);
    }
    free(buf);
  }
}

TEST(codec_zero_columns_and_bytes_only) {
  uint8_t buf[64];
  size_t wrote = 0;
  uint32_t nc = 9, nr = 9;
  ember_column col, out;
  uint64_t off[3] = {0, 0, 0};
  CHECK_OK(ember_batch_encode(NULL, 0, 3, buf, sizeof buf, &wrote));
  CHECK_EQ_INT(wrote, 8);
  CHECK_OK(ember_batch_decode(buf, wrote, NULL, 0, &nc, &nr));
  CHECK_EQ_INT(nc, 0);
  CHECK_EQ_INT(nr, 3);
  /* A BYTES column of two empty strings: no data bytes at all. */
  col = (ember_column){EMBER_DT_BYTES, 1, "s", 0, NULL, 0, off};
  CHECK_OK(ember_batch_encode(&col, 1, 2, buf, sizeof buf, &wrote));
  CHECK_EQ_INT(wrote, 8 + 16 + 1 + 7 + 24);
  CHECK_OK(ember_batch_decode(buf, wrote, &out, 1, &nc, &nr));
  CHECK_EQ_INT(out.data_len, 0);
  CHECK_EQ_INT(nr, 2);
  /* Trailing padding up to the next 8-byte boundary is accepted, not more. */
  col = (ember_column){EMBER_DT_U8, 0, NULL, 3, "abc", 3, NULL};
  memset(buf, 0, sizeof buf);
  CHECK_OK(ember_batch_encode(&col, 1, 1, buf, sizeof buf, &wrote));
  CHECK_EQ_INT(wrote, 8 + 16 + 3);
  CHECK_OK(ember_batch_decode(buf, wrote + 5, &out, 1, &nc, &nr));
  CHECK_EQ_INT(ember_batch_decode(buf, wrote + 6, &out, 1, &nc, &nr), EMBER_EPROTO);
}

TEST(codec_encode_rejects_inconsistent_columns) {
  sample s;
  uint8_t buf[1024];
  size_t n = 0;
  ember_column c[1];
  uint64_t bad_off[3] = {0, 5, 3};
  uint8_t b2[2] = {1, 2};
  make_sample(&s, 5);
  c[0] = s.cols[2];
  c[0].data_len -= 4;
  CHECK_EQ_INT(ember_batch_encoded_size(c, 1, 5, &n), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "column 0 ('int32')") != NULL);
  c[0] = (ember_column){EMBER_DT_BYTES, 1, "s", 0, "abcde", 5, bad_off};
  CHECK_EQ_INT(ember_batch_encode(c, 1, 2, buf, sizeof buf, &n), EMBER_EINVAL);
  c[0] = (ember_column){EMBER_DT_BYTES, 1, "s", 1, "abcde", 5, (uint64_t[]){0, 2, 5}};
  CHECK_EQ_INT(ember_batch_encode(c, 1, 2, buf, sizeof buf, &n), EMBER_EINVAL); /* width */
  c[0] = (ember_column){9, 1, "s", 1, "ab", 2, NULL};
  CHECK_EQ_INT(ember_batch_encode(c, 1, 2, buf, sizeof buf, &n), EMBER_EINVAL);
  c[0] = (ember_column){EMBER_DT_BOOL, 1, "b", 1, b2, 2, NULL};
  CHECK_EQ_INT(ember_batch_encode(c, 1, 2, buf, sizeof buf, &n), EMBER_EINVAL);
  c[0] = (ember_column){EMBER_DT_F64, 1, "x", 0xffffffffu, NULL, 0, NULL};
  CHECK_EQ_INT(ember_batch_encoded_size(c, 1, 0xffffffffu, &n), EMBER_ETOOBIG);
  CHECK_EQ_INT(ember_batch_encode(s.cols, 7, 5, buf, 16, &n), EMBER_ETOOBIG); /* cap */
  CHECK_EQ_INT(ember_batch_encoded_size(s.cols, EMBER_BATCH_MAX_COLS + 1, 5, &n), EMBER_EINVAL);
}

TEST(decode_rejects_every_truncation) {
  sample s;
  ember_column out[7];
  uint32_t nc, nr;
  size_t len = 0;
  uint8_t *buf = encode_sample(&s, 5, &len);
  for (size_t cut = 0; cut < len; cut++) {
    uint8_t *p = dup_exact(buf, cut);
    int rc = ember_batch_decode(p, cut, out, 7, &nc, &nr);
    if (rc != EMBER_EPROTO) {
      fprintf(stderr, "prefix %zu of %zu: rc %d\n", cut, len, rc);
      CHECK(0);
    }
    free(p);
  }
  free(buf);
}

/* Byte offset of column i's descriptor in a sample batch. */
static size_t desc_at(const sample *s, int i) {
  size_t p = 8;
  for (int k = 0; k < i; k++) p += 16 + s->cols[k].name_len;
  return p;
}

TEST(decode_rejects_bad_fields) {
  sample s;
  ember_column out[7];
  uint32_t nc, nr;
  size_t len = 0, d;
  uint8_t *buf = encode_sample(&s, 5, &len), *p;
  /* locate BYTES offsets: decode the good batch */
  CHECK_OK(ember_batch_decode(buf, len, out, 7, &nc, &nr));
  size_t offs_at = (size_t)((const uint8_t *)out[5].offsets - buf);
  size_t bool_at = (size_t)((const uint8_t *)out[6].data - buf);

#define MUTATE(stmt, needle)                                                   \
  do {                                                                         \
    p = dup_exact(buf, len);                                                   \
    stmt;                                                                      \
    CHECK_EQ_INT(ember_batch_decode(p, len, out, 7, &nc, &nr), EMBER_EPROTO);  \
    if (strstr(ember_last_error(), needle) == NULL) {                          \
      fprintf(stderr, "message '%s' lacks '%s'\n", ember_last_error(), needle); \
      CHECK(0);                                                                \
    }                                                                          \
    free(p);                                                                   \
  } while (0)

  /* offsets: first not 0, decreasing, past the data, last != data length */
  MUTATE(ember_wire_put_u64(p + offs_at, 1), "column 5 ('bytes')");
  MUTATE(ember_wire_put_u64(p + offs_at + 8 * 3, 0), "bad offset[3] = 0 (previous 1");
  MUTATE(ember_wire_put_u64(p + offs_at + 8 * 3, 1000), "column 5");
  MUTATE((ember_wire_put_u64(p + offs_at + 8 * 4, 3), ember_wire_put_u64(p + offs_at + 8 * 5, 3)),
         "last offset 3 != data length 4");
  /* unknown dtypes, reserved bits */
  d = desc_at(&s, 1);
  MUTATE(p[d] = 0, "column 1 (''): unknown dtype 0");
  MUTATE(p[d] = 8, "unknown dtype 8");
  MUTATE(p[d] = 255, "unknown dtype 255");
  MUTATE(p[d + 2] = 1, "reserved");
  /* nbytes not matching nrows * width * itemsize; overflowing width */
  d = desc_at(&s, 2);
  MUTATE(ember_wire_put_u64(p + d + 8, 64), "column 2 ('int32'): nbytes 64");
  MUTATE(ember_wire_put_u32(p + d + 4, 0xffffffffu), "column 2");
  MUTATE(ember_wire_put_u64(p + d + 8, UINT64_MAX), "column 2");
  /* nrows so large the sizes overflow or the bodies cannot fit */
  MUTATE(ember_wire_put_u32(p, 0xffffffffu), "column 0");
  /* BYTES: width must be 0, nbytes must cover the offsets, body must fit */
  d = desc_at(&s, 5);
  MUTATE(ember_wire_put_u32(p + d + 4, 1), "BYTES width");
  MUTATE(ember_wire_put_u64(p + d + 8, 8), "less than");
  MUTATE(ember_wire_put_u64(p + d + 8, UINT64_MAX - 3), "runs past");
  /* a name running off the end; ncols over every limit */
  MUTATE(ember_wire_put_u32(p + 4, EMBER_BATCH_MAX_COLS + 1), "exceeds the limit");
  MUTATE(ember_wire_put_u32(p + 4, 0xffffffffu), "exceeds the limit");
  /* BOOL values other than 0/1 */
  MUTATE(p[bool_at + 1] = 2, "column 6 ('bool'): BOOL element 1 is 2");
#undef MUTATE
  /* the caller's max_cols is honoured */
  CHECK_EQ_INT(ember_batch_decode(buf, len, out, 6, &nc, &nr), EMBER_EPROTO);
  /* trailing garbage */
  p = calloc(1, len + 8);
  memcpy(p, buf, len);
  CHECK_EQ_INT(ember_batch_decode(p, len + 8, out, 7, &nc, &nr), EMBER_EPROTO);
  free(p);
  /* a name that runs off the end of a tiny batch */
  {
    uint8_t t[24] = {0};
    ember_wire_put_u32(t, 1);
    ember_wire_put_u32(t + 4, 1);
    t[8] = EMBER_DT_U8;
    t[9] = 200;
    CHECK_EQ_INT(ember_batch_decode(t, sizeof t, out, 7, &nc, &nr), EMBER_EPROTO);
    CHECK(strstr(ember_last_error(), "column 0: name") != NULL);
  }
  free(buf);
}

/* ------------------------------------------------------------ server helpers */

static ember_feed_server *start_server_max(size_t queue_bytes, uint32_t io_ms,
                                           uint32_t max_frame) {
  ember_feed_server_config cfg;
  ember_feed_server *s = NULL;
  memset(&cfg, 0, sizeof cfg);
  cfg.secret = SECRET;
  cfg.secret_len = sizeof SECRET;
  cfg.listen_fd = -1;
  cfg.bind_host = "127.0.0.1";
  cfg.queue_bytes = queue_bytes;
  cfg.io_timeout_ms = io_ms;
  cfg.max_frame = max_frame;
  CHECK_OK(ember_feed_server_create(&s, &cfg));
  CHECK(ember_feed_server_port(s) != 0);
  return s;
}

static ember_feed_server *start_server(size_t queue_bytes, uint32_t io_ms) {
  return start_server_max(queue_bytes, io_ms, 0);
}

/* A batch for partition p whose rows carry (p, row index) so the consumer can
 * verify order and content; `extra` pads each row to make batches big. */
typedef struct {
  int32_t *part;
  int64_t *row;
  uint8_t *pad;
  uint64_t *off;
  char *str;
  ember_column cols[4];
  uint32_t nrows;
} gen_batch;

static void gen_make(gen_batch *g, uint32_t p, uint64_t first, uint32_t nrows, uint32_t extra) {
  size_t o = 0;
  g->nrows = nrows;
  g->part = malloc(sizeof(int32_t) * (nrows + 1));
  g->row = malloc(sizeof(int64_t) * (nrows + 1));
  g->pad = calloc((size_t)nrows * extra + 1, 1);
  g->off = malloc(sizeof(uint64_t) * (nrows + 1));
  g->str = malloc((size_t)nrows * 24 + 1);
  CHECK(g->part && g->row && g->pad && g->off && g->str);
  for (uint32_t r = 0; r < nrows; r++) {
    g->part[r] = (int32_t)p;
    g->row[r] = (int64_t)(first + r);
    g->off[r] = o;
    o += (size_t)sprintf(g->str + o, "%u-%llu", p, (unsigned long long)(first + r));
  }
  g->off[nrows] = o;
  g->cols[0] = (ember_column){EMBER_DT_I32, 4, "part", 1, g->part, 4ull * nrows, NULL};
  g->cols[1] = (ember_column){EMBER_DT_I64, 3, "row", 1, g->row, 8ull * nrows, NULL};
  g->cols[2] = (ember_column){EMBER_DT_U8, 3, "pad", extra, g->pad, (uint64_t)extra * nrows,
                              NULL};
  g->cols[3] = (ember_column){EMBER_DT_BYTES, 3, "str", 0, g->str, o, g->off};
}

static void gen_free(gen_batch *g) {
  free(g->part);
  free(g->row);
  free(g->pad);
  free(g->off);
  free(g->str);
}

/* Checks a popped batch: every row belongs to partition p and rows continue
 * from *next (in order, nothing lost or repeated). */
static uint32_t verify_item(const ember_feed_item *it, uint32_t p, uint64_t *next) {
  ember_column c[4];
  uint32_t nc = 0, nr = 0;
  char want[48];
  CHECK_EQ_INT(it->kind, EMBER_FEED_ITEM_BATCH);
  CHECK_EQ_INT(it->partition, p);
  CHECK(((uintptr_t)it->data % 8) == 0);
  CHECK_OK(ember_batch_decode(it->data, it->len, c, 4, &nc, &nr));
  CHECK_EQ_INT(nc, 4);
  for (uint32_t r = 0; r < nr; r++) {
    const int32_t *pp = c[0].data;
    const int64_t *rr = c[1].data;
    int n;
    CHECK_EQ_INT(pp[r], p);
    CHECK_EQ_INT(rr[r], *next);
    n = sprintf(want, "%u-%llu", p, (unsigned long long)*next);
    CHECK_EQ_INT(c[3].offsets[r + 1] - c[3].offsets[r], n);
    CHECK(memcmp((const char *)c[3].data + c[3].offsets[r], want, (size_t)n) == 0);
    (*next)++;
  }
  return nr;
}

typedef struct {
  uint16_t port;
  uint32_t partition, flags;
  uint64_t call;            /* named call (connect_ex), 0: anonymous */
  uint32_t call_partitions; /* with call */
  const char *tag;          /* with call */
  uint32_t nbatches, rows_per_batch, extra;
  int64_t send_timeout_ms;
  int end;             /* call end_partition at the end */
  int results;         /* receive one RESULTS per batch (after all sends) */
  int end_then_results; /* end_partition first, then receive results */
  atomic_uint sent;    /* batches sent so far */
  int used_shm;        /* the client's transport after its first send */
  int send_rc, end_rc, results_rc;
  char end_msg[512];
} producer_args;

/* Shared memory unless the test runs under EMBER_FEED_SHM=0. */
static int expect_shm(void) {
  const char *v = getenv("EMBER_FEED_SHM");
  return v == NULL || strcmp(v, "0") != 0;
}

static void *producer(void *arg) {
  producer_args *a = arg;
  ember_feed_client *c = NULL;
  uint64_t row = 0;
  ember_feed_client_options o = {.call = a->call, .call_partitions = a->call_partitions,
                                 .tag = (const uint8_t *)a->tag,
                                 .tag_len = a->tag ? strlen(a->tag) : 0};
  int rc = ember_feed_client_connect_ex(&c, "127.0.0.1", a->port, SECRET, sizeof SECRET,
                                        a->partition, a->flags, a->call ? &o : NULL, 5000);
  a->send_rc = rc;
  if (rc != EMBER_OK) return NULL;
  for (uint32_t b = 0; b < a->nbatches; b++) {
    gen_batch g;
    gen_make(&g, a->partition, row, a->rows_per_batch, a->extra);
    rc = ember_feed_client_send(c, g.cols, 4, g.nrows, a->send_timeout_ms);
    gen_free(&g);
    if (rc != EMBER_OK) {
      a->send_rc = rc;
      snprintf(a->end_msg, sizeof a->end_msg, "%s", ember_last_error());
      goto out;
    }
    row += a->rows_per_batch;
    if (b == 0) {
      a->used_shm = ember_feed_client_uses_shm(c);
      CHECK_EQ_INT(a->used_shm, expect_shm());
    }
    atomic_fetch_add(&a->sent, 1);
  }
  if (a->end_then_results) {
    a->end_rc = ember_feed_client_end_partition(c, 10000);
    snprintf(a->end_msg, sizeof a->end_msg, "%s", ember_last_error());
  }
  if (a->results || a->end_then_results) {
    uint64_t want = 0;
    for (uint32_t b = 0; b < a->nbatches && a->results_rc == 0; b++) {
      uint8_t *res = NULL;
      size_t len = 0;
      ember_column col;
      uint32_t nc = 0, nr = 0;
      rc = ember_feed_client_recv_results(c, &res, &len, 10000);
      if (rc == EMBER_OK) rc = ember_batch_decode(res, len, &col, 1, &nc, &nr);
      if (rc == EMBER_OK) {
        const int64_t *v = col.data;
        for (uint32_t r = 0; r < nr; r++, want++)
          if (v[r] != (int64_t)want * 2) rc = EMBER_ECORRUPT;
      }
      free(res);
      a->results_rc = rc;
    }
    if (a->results_rc == EMBER_OK && want != (uint64_t)a->nbatches * a->rows_per_batch)
      a->results_rc = EMBER_ECORRUPT;
  }
  if (a->end && !a->end_then_results) {
    a->end_rc = ember_feed_client_end_partition(c, 10000);
    snprintf(a->end_msg, sizeof a->end_msg, "%s", ember_last_error());
  }
out:
  ember_feed_client_destroy(c);
  return NULL;
}

static void producer_init(producer_args *a, uint16_t port, uint32_t partition,
                          uint32_t nbatches, uint32_t rows) {
  memset(a, 0, sizeof *a);
  a->port = port;
  a->partition = partition;
  a->nbatches = nbatches;
  a->rows_per_batch = rows;
  a->send_timeout_ms = 10000;
  a->end = 1;
  atomic_init(&a->sent, 0);
}

/* A raw producer: authenticated, FEED_HELLO sent, then the test writes frames
 * by hand (malformed ones included). */
static int raw_producer(uint16_t port, uint32_t partition) {
  int fd = -1;
  uint8_t hello[24] = {0};
  CHECK_OK(ember_net_connect("127.0.0.1", port, ember_deadline_after(5000), &fd));
  CHECK_OK(ember_auth_client(fd, SECRET, sizeof SECRET, ember_deadline_after(5000)));
  ember_wire_put_u32(hello, partition); /* flags 0, call 0, no count, no tag */
  CHECK_OK(ember_net_send_frame(fd, EMBER_MSG_FEED_HELLO, hello, 24, ember_deadline_after(5000)));
  return fd;
}

/* Reads one status frame (ACK/REFUSED) off a raw producer. */
static int32_t raw_status(int fd, uint16_t want_type, char *reason, size_t cap) {
  ember_frame_header h;
  uint8_t *p = NULL;
  ember_wire_reader r;
  int32_t st;
  CHECK_OK(ember_net_recv_frame(fd, 4096, &h, &p, ember_deadline_after(5000)));
  CHECK_EQ_INT(h.type, want_type);
  ember_wire_reader_init(&r, p, h.length);
  st = (int32_t)ember_wire_read_u32(&r);
  ember_wire_read_str(&r, reason, cap);
  CHECK_OK(ember_wire_reader_finish(&r, 1, "status"));
  free(p);
  return st;
}

/* Pops n batches of partition p (any interleaving with others is the
 * caller's business); returns rows. */
static uint64_t pop_partition(ember_feed_server *s, uint32_t p, uint32_t n, uint64_t *next) {
  uint64_t rows = 0;
  for (uint32_t i = 0; i < n; i++) {
    ember_feed_item *it = NULL;
    CHECK_OK(ember_feed_server_next(s, &it, 10000));
    rows += verify_item(it, p, next);
    ember_feed_item_free(it);
  }
  return rows;
}

/* ------------------------------------------------------------ server tests */

TEST(one_producer_in_order) {
  ember_feed_server *s = start_server(0, 0);
  producer_args a;
  pthread_t t;
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  uint64_t next = 0;
  producer_init(&a, ember_feed_server_port(s), 3, 50, 100);
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  CHECK_EQ_INT(pop_partition(s, 3, 50, &next), 5000);
  pthread_join(t, NULL);
  CHECK_OK(a.send_rc);
  CHECK_OK(a.end_rc);
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 50), EMBER_ETIMEDOUT);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.batches_received, 50);
  CHECK_EQ_INT(st.records_received, 5000);
  CHECK_EQ_INT(st.partitions_acked, 1);
  CHECK_EQ_INT(st.producers_rejected, 0);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(four_concurrent_producers) {
  ember_feed_server *s = start_server(256 * 1024, 0);
  producer_args a[4];
  pthread_t t[4];
  uint64_t next[4] = {0}, total = 0;
  ember_feed_stats st;
  for (int i = 0; i < 4; i++) {
    producer_init(&a[i], ember_feed_server_port(s), 10 + (uint32_t)i, 30, 50 + 10 * (uint32_t)i);
    a[i].extra = 64;
    CHECK(pthread_create(&t[i], NULL, producer, &a[i]) == 0);
  }
  for (int n = 0; n < 4 * 30; n++) {
    ember_feed_item *it = NULL;
    CHECK_OK(ember_feed_server_next(s, &it, 10000));
    CHECK(it->partition >= 10 && it->partition < 14);
    total += verify_item(it, it->partition, &next[it->partition - 10]);
    ember_feed_item_free(it);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    CHECK_OK(a[i].send_rc);
    CHECK_OK(a[i].end_rc);
    CHECK_EQ_INT(next[i], 30 * a[i].rows_per_batch);
  }
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.records_received, total);
  CHECK_EQ_INT(st.partitions_acked, 4);
  CHECK_EQ_INT(st.shm_producers, expect_shm() ? 4 : 0);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(backpressure_blocks_until_pop) {
  /* queue_bytes 1: one queued batch fills the queue; 40 batches of ~1 MiB
   * overflow the loopback socket buffers, so the producer must block. */
  ember_feed_server *s = start_server(1, 0);
  producer_args a;
  pthread_t t;
  ember_feed_stats st;
  uint64_t next = 0;
  producer_init(&a, ember_feed_server_port(s), 1, 40, 1024);
  a.extra = 1024;
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  sleep_ms(600);
  ember_feed_server_stats(s, &st);
  CHECK(atomic_load(&a.sent) < 40);
  CHECK(st.batches_received <= 2);
  CHECK(st.batches_received >= 1);
  CHECK_EQ_INT(pop_partition(s, 1, 40, &next), 40 * 1024);
  pthread_join(t, NULL);
  CHECK_OK(a.send_rc);
  CHECK_OK(a.end_rc);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(backpressure_deadline_times_out) {
  ember_feed_server *s = start_server(1, 0);
  producer_args a;
  ember_feed_stats st;
  producer_init(&a, ember_feed_server_port(s), 2, 200, 1024);
  a.extra = 1024;
  a.send_timeout_ms = 300;
  producer(&a); /* the consumer never pops */
  CHECK_EQ_INT(a.send_rc, EMBER_ETIMEDOUT);
  CHECK(atomic_load(&a.sent) < 200);
  ember_feed_server_stats(s, &st);
  CHECK(st.batches_received <= 2);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(duplicate_partition_discarded) {
  ember_feed_server *s = start_server(0, 0);
  producer_args a, b;
  pthread_t t;
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  uint64_t next = 0;
  producer_init(&a, ember_feed_server_port(s), 7, 3, 10);
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  pop_partition(s, 7, 3, &next);
  pthread_join(t, NULL);
  CHECK_OK(a.end_rc);
  /* the retried task: its data is dropped, and it hears OK */
  producer_init(&b, ember_feed_server_port(s), 7, 3, 10);
  producer(&b);
  CHECK_OK(b.send_rc);
  CHECK_OK(b.end_rc);
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.duplicate_partitions, 1);
  CHECK_EQ_INT(st.batches_received, 3);
  CHECK_EQ_INT(st.partitions_acked, 1);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* A feeding task that dies half-way through its partition and is retried:
 * the node tells the retry how many records it already holds, the retry sends
 * only the rest, and every record arrives exactly once. */
static ember_feed_client *connect_resume(uint16_t port, uint32_t partition, uint64_t *held,
                                         int *delivered) {
  ember_feed_client *c = NULL;
  CHECK_OK(ember_feed_client_connect(&c, "127.0.0.1", port, SECRET, sizeof SECRET, partition,
                                     EMBER_FEED_RESUME, 5000));
  ember_feed_client_resume_point(c, held, delivered);
  return c;
}

TEST(resumed_partition_delivered_exactly_once) {
  ember_feed_server *s = start_server(0, 0);
  uint16_t port = ember_feed_server_port(s);
  ember_feed_client *c, *busy = NULL;
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  uint64_t held = 99, next = 0;
  int delivered = 7;
  gen_batch g;
  /* first attempt: 3 batches of 10 rows, then the task dies */
  c = connect_resume(port, 4, &held, &delivered);
  CHECK_EQ_INT(held, 0);
  CHECK_EQ_INT(delivered, 0);
  for (uint64_t b = 0; b < 3; b++) {
    gen_make(&g, 4, b * 10, 10, 8);
    CHECK_OK(ember_feed_client_send(c, g.cols, 4, g.nrows, 5000));
    gen_free(&g);
  }
  pop_partition(s, 4, 3, &next);
  /* while it is still connected, a second attempt must wait */
  CHECK_EQ_INT(ember_feed_client_connect(&busy, "127.0.0.1", port, SECRET, sizeof SECRET, 4,
                                         EMBER_FEED_RESUME, 5000),
               EMBER_ESTATE);
  CHECK(strstr(ember_last_error(), "still being fed") != NULL);
  ember_feed_client_destroy(c);
  /* the retry hears 30 and sends rows 30..49 */
  for (int i = 0; i < 200; i++) {
    c = NULL;
    if (ember_feed_client_connect(&c, "127.0.0.1", port, SECRET, sizeof SECRET, 4,
                                  EMBER_FEED_RESUME, 5000) == EMBER_OK)
      break;
    CHECK(strstr(ember_last_error(), "still being fed") != NULL);
    sleep_ms(10);
  }
  CHECK(c != NULL);
  ember_feed_client_resume_point(c, &held, &delivered);
  CHECK_EQ_INT(held, 30);
  CHECK_EQ_INT(delivered, 0);
  for (uint64_t b = 0; b < 2; b++) {
    gen_make(&g, 4, held + b * 10, 10, 8);
    CHECK_OK(ember_feed_client_send(c, g.cols, 4, g.nrows, 5000));
    gen_free(&g);
  }
  pop_partition(s, 4, 2, &next);
  CHECK_EQ_INT(next, 50);
  CHECK_OK(ember_feed_client_end_partition(c, 5000));
  ember_feed_client_destroy(c);
  /* a third attempt hears that the partition is delivered */
  c = connect_resume(port, 4, &held, &delivered);
  CHECK_EQ_INT(delivered, 1);
  CHECK_EQ_INT(held, 0);
  CHECK_OK(ember_feed_client_end_partition(c, 5000));
  ember_feed_client_destroy(c);
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.records_received, 50);
  CHECK_EQ_INT(st.partitions_acked, 1);
  /* resuming with results is refused: the results of skipped rows are gone */
  CHECK_EQ_INT(ember_feed_client_connect(&busy, "127.0.0.1", port, SECRET, sizeof SECRET, 5,
                                         EMBER_FEED_RESUME | EMBER_FEED_WANT_RESULTS, 5000),
               EMBER_EPROTO);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(wrong_secret_rejected_others_served) {
  ember_feed_server *s = start_server(0, 0);
  producer_args a;
  pthread_t t;
  ember_feed_client *bad = NULL;
  ember_feed_stats st;
  uint64_t next = 0;
  int silent = -1;
  /* A client that connects and never speaks must not stall anyone. */
  CHECK_OK(ember_net_connect("127.0.0.1", ember_feed_server_port(s), ember_deadline_after(2000),
                             &silent));
  producer_init(&a, ember_feed_server_port(s), 5, 20, 10);
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  pop_partition(s, 5, 10, &next);
  CHECK_EQ_INT(ember_feed_client_connect(&bad, "127.0.0.1", ember_feed_server_port(s), WRONG,
                                         sizeof WRONG, 6, 0, 2000),
               EMBER_EAUTH);
  CHECK(bad == NULL);
  CHECK(strstr(ember_last_error(), "bad MAC") != NULL);
  pop_partition(s, 5, 10, &next);
  pthread_join(t, NULL);
  CHECK_OK(a.end_rc);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.producers_rejected, 1);
  CHECK_EQ_INT(st.partitions_acked, 1);
  ember_net_close(silent);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(handshake_deadline_drops_silent_client) {
  ember_feed_server *s = start_server(0, 200);
  ember_feed_stats st;
  int fd = -1;
  uint8_t buf[256];
  ssize_t n, total = 0;
  CHECK_OK(ember_net_connect("127.0.0.1", ember_feed_server_port(s), ember_deadline_after(2000),
                             &fd));
  /* read the CHALLENGE, then wait for the close */
  for (;;) {
    struct pollfd pfd = {fd, POLLIN, 0};
    CHECK(poll(&pfd, 1, 3000) == 1);
    n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    total += n;
  }
  CHECK_EQ_INT(total, EMBER_WIRE_HEADER_LEN + EMBER_NONCE_LEN);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.producers_rejected, 1);
  ember_net_close(fd);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(malformed_batch_closes_only_that_producer) {
  ember_feed_server *s = start_server(0, 0);
  producer_args a;
  pthread_t t;
  ember_feed_stats st;
  uint64_t next = 0;
  char reason[1100];
  uint8_t junk[64], tmp[16];
  int fd;
  producer_init(&a, ember_feed_server_port(s), 8, 20, 10);
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  fd = raw_producer(ember_feed_server_port(s), 9);
  /* claims 1 column of 1000 rows of F64 in a 64-byte batch */
  memset(junk, 0, sizeof junk);
  ember_wire_put_u32(junk, 1000);
  ember_wire_put_u32(junk + 4, 1);
  junk[8] = EMBER_DT_F64;
  junk[9] = 1;
  ember_wire_put_u32(junk + 12, 1);
  ember_wire_put_u64(junk + 16, 8000);
  junk[24] = 'x';
  CHECK_OK(ember_net_send_frame(fd, EMBER_MSG_BATCH, junk, sizeof junk, ember_deadline_after(2000)));
  CHECK_EQ_INT(raw_status(fd, EMBER_MSG_REFUSED, reason, sizeof reason), EMBER_EPROTO);
  CHECK(strstr(reason, "partition 9, batch 1 rejected") != NULL);
  CHECK(strstr(reason, "column 0 ('x')") != NULL);
  /* then the server closes that connection */
  CHECK_EQ_INT(ember_net_recv_all(fd, tmp, 1, ember_deadline_after(5000)), EMBER_ECLOSED);
  ember_net_close(fd);
  /* the good producer is unaffected */
  pop_partition(s, 8, 20, &next);
  pthread_join(t, NULL);
  CHECK_OK(a.send_rc);
  CHECK_OK(a.end_rc);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.producers_rejected, 1);
  CHECK_EQ_INT(st.partitions_acked, 1);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(client_send_sees_refusal) {
  /* A batch over the server's max_frame is refused from its header alone;
   * the client's next send reports the server's reason instead of
   * streaming on into a closing connection. */
  ember_feed_server *s = start_server_max(0, 0, 4096);
  ember_feed_client *c = NULL;
  gen_batch big, small;
  ember_feed_stats st;
  int rc = EMBER_OK;
  CHECK_OK(ember_feed_client_connect(&c, "127.0.0.1", ember_feed_server_port(s), SECRET,
                                     sizeof SECRET, 4, 0, 5000));
  gen_make(&big, 4, 0, 10, 1000);
  gen_make(&small, 4, 10, 5, 0);
  CHECK_OK(ember_feed_client_send(c, big.cols, 4, big.nrows, 2000));
  for (int i = 0; i < 500 && rc == EMBER_OK; i++) {
    rc = ember_feed_client_send(c, small.cols, 4, small.nrows, 2000);
    if (rc == EMBER_OK) sleep_ms(10);
  }
  gen_free(&big);
  gen_free(&small);
  CHECK_EQ_INT(rc, EMBER_ETOOBIG);
  CHECK(strstr(ember_last_error(), "refused the producer") != NULL);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.producers_rejected, 1);
  CHECK_EQ_INT(st.batches_received, 0);
  CHECK_EQ_INT(ember_feed_client_end_partition(c, 1000), EMBER_ESTATE);
  ember_feed_client_destroy(c);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(record_count_mismatch_acks_eproto) {
  ember_feed_server *s = start_server(0, 0);
  gen_batch g;
  uint8_t *buf, cnt[8];
  size_t len = 0;
  char reason[1100];
  ember_feed_item *it = NULL;
  int fd = raw_producer(ember_feed_server_port(s), 12);
  gen_make(&g, 12, 0, 5, 0);
  CHECK_OK(ember_batch_encoded_size(g.cols, 4, 5, &len));
  buf = malloc(len);
  CHECK_OK(ember_batch_encode(g.cols, 4, 5, buf, len, &len));
  CHECK_OK(ember_net_send_frame(fd, EMBER_MSG_BATCH, buf, (uint32_t)len, ember_deadline_after(2000)));
  ember_wire_put_u64(cnt, 7);
  CHECK_OK(ember_net_send_frame(fd, EMBER_MSG_END_PARTITION, cnt, 8, ember_deadline_after(2000)));
  CHECK_OK(ember_feed_server_next(s, &it, 5000));
  ember_feed_item_free(it);
  CHECK_EQ_INT(raw_status(fd, EMBER_MSG_ACK, reason, sizeof reason), EMBER_EPROTO);
  CHECK(strstr(reason, "says 7 records, the node received 5") != NULL);
  ember_net_close(fd);
  free(buf);
  gen_free(&g);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(terminate_aborts_and_never_blocks_producers) {
  ember_feed_server *s = start_server(1, 0);
  producer_args a;
  pthread_t t;
  ember_feed_item *it = NULL;
  uint64_t next = 0;
  producer_init(&a, ember_feed_server_port(s), 2, 40, 1024);
  a.extra = 1024; /* ~1 MiB batches against a 1-byte queue */
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  pop_partition(s, 2, 2, &next);
  CHECK_OK(ember_feed_server_terminate(s));
  pthread_join(t, NULL); /* returns only if producers are not blocked */
  CHECK_OK(a.send_rc);
  CHECK_EQ_INT(atomic_load(&a.sent), 40);
  CHECK_EQ_INT(a.end_rc, EMBER_EABORTED);
  CHECK(strstr(a.end_msg, "trainer terminated the feed") != NULL);
  CHECK_OK(ember_feed_server_next(s, &it, 0));
  CHECK_EQ_INT(it->kind, EMBER_FEED_ITEM_END);
  ember_feed_item_free(it);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* The consumer of the results test: answers each batch with one I64 column
 * holding row * 2. */
static void answer(ember_feed_server *s, const ember_feed_item *it) {
  ember_column c[4], out;
  uint32_t nc = 0, nr = 0;
  int64_t *v;
  uint8_t *buf;
  size_t len = 0;
  CHECK_OK(ember_batch_decode(it->data, it->len, c, 4, &nc, &nr));
  v = malloc(8 * (size_t)nr + 8);
  for (uint32_t r = 0; r < nr; r++) v[r] = ((const int64_t *)c[1].data)[r] * 2;
  out = (ember_column){EMBER_DT_I64, 4, "pred", 1, v, 8ull * nr, NULL};
  CHECK_OK(ember_batch_encoded_size(&out, 1, nr, &len));
  buf = malloc(len);
  CHECK_OK(ember_batch_encode(&out, 1, nr, buf, len, &len));
  CHECK_OK(ember_feed_server_send_results(s, it->source, buf, len, 5000));
  free(buf);
  free(v);
}

TEST(results_round_trip_in_order) {
  ember_feed_server *s = start_server(0, 0);
  producer_args a, b;
  pthread_t ta, tb;
  uint64_t next[2] = {0, 0};
  /* a: sends all, receives all results, then ends; b: ends first (its ACK
   * can overtake the last RESULTS), then receives the results. */
  producer_init(&a, ember_feed_server_port(s), 20, 12, 7);
  a.flags = EMBER_FEED_WANT_RESULTS;
  a.results = 1;
  producer_init(&b, ember_feed_server_port(s), 21, 12, 5);
  b.flags = EMBER_FEED_WANT_RESULTS;
  b.end_then_results = 1;
  CHECK(pthread_create(&ta, NULL, producer, &a) == 0);
  CHECK(pthread_create(&tb, NULL, producer, &b) == 0);
  for (int n = 0; n < 24; n++) {
    ember_feed_item *it = NULL;
    CHECK_OK(ember_feed_server_next(s, &it, 10000));
    CHECK(it->flags & EMBER_FEED_WANT_RESULTS);
    verify_item(it, it->partition, &next[it->partition - 20]);
    answer(s, it);
    ember_feed_item_free(it);
  }
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  CHECK_OK(a.send_rc);
  CHECK_OK(a.results_rc);
  CHECK_OK(a.end_rc);
  CHECK_OK(b.send_rc);
  CHECK_OK(b.end_rc);
  CHECK_OK(b.results_rc);
  /* results to a gone producer / to a producer that did not ask */
  CHECK_EQ_INT(ember_feed_server_send_results(s, 9999, (const uint8_t *)"", 0, 100),
               EMBER_ENOTFOUND);
  {
    producer_args c;
    ember_feed_item *it = NULL;
    uint64_t n3 = 0;
    pthread_t tc;
    /* two batches: while the second is unpopped the producer is alive,
     * waiting for its ACK */
    producer_init(&c, ember_feed_server_port(s), 22, 2, 3);
    CHECK(pthread_create(&tc, NULL, producer, &c) == 0);
    CHECK_OK(ember_feed_server_next(s, &it, 10000));
    CHECK_EQ_INT(ember_feed_server_send_results(s, it->source, it->data, it->len, 100),
                 EMBER_ESTATE);
    verify_item(it, 22, &n3);
    ember_feed_item_free(it);
    pop_partition(s, 22, 1, &n3);
    pthread_join(tc, NULL);
    CHECK_OK(c.end_rc);
  }
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(end_feed_item_after_queued_batches) {
  ember_feed_server *s = start_server(0, 0);
  producer_args a;
  pthread_t t;
  ember_feed_client *driver = NULL;
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  uint64_t next = 0;
  producer_init(&a, ember_feed_server_port(s), 0, 2, 10);
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  for (int i = 0; i < 500; i++) {
    ember_feed_server_stats(s, &st);
    if (st.batches_received == 2) break;
    sleep_ms(5);
  }
  CHECK_EQ_INT(st.batches_received, 2);
  CHECK_OK(ember_feed_client_connect(&driver, "127.0.0.1", ember_feed_server_port(s), SECRET,
                                     sizeof SECRET, UINT32_MAX, 0, 5000));
  CHECK_OK(ember_feed_client_end_feed(driver, 5000));
  ember_feed_client_destroy(driver);
  pop_partition(s, 0, 2, &next);
  CHECK_OK(ember_feed_server_next(s, &it, 5000));
  CHECK_EQ_INT(it->kind, EMBER_FEED_ITEM_END);
  CHECK(it->data == NULL);
  ember_feed_item_free(it);
  /* END again, at once */
  for (int i = 0; i < 3; i++) {
    CHECK_OK(ember_feed_server_next(s, &it, 0));
    CHECK_EQ_INT(it->kind, EMBER_FEED_ITEM_END);
    ember_feed_item_free(it);
  }
  pthread_join(t, NULL);
  CHECK_OK(a.end_rc);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(destroy_with_connected_producers_leaks_nothing) {
  ember_feed_server *s = start_server(1, 0);
  producer_args a, b;
  pthread_t ta, tb;
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  uint8_t half[6] = {'E', 'M', 'B', 'R', 1, 0};
  int silent = -1, partial;
  /* a: blocked by back-pressure with a batch queued and one half read */
  producer_init(&a, ember_feed_server_port(s), 30, 30, 1024);
  a.extra = 1024;
  a.send_timeout_ms = 3000;
  /* b: waits for its END_PARTITION ACK, which never comes */
  producer_init(&b, ember_feed_server_port(s), 31, 1, 5);
  CHECK(pthread_create(&ta, NULL, producer, &a) == 0);
  CHECK_OK(ember_net_connect("127.0.0.1", ember_feed_server_port(s), ember_deadline_after(2000),
                             &silent));
  partial = raw_producer(ember_feed_server_port(s), 32);
  CHECK_OK(ember_net_send_all(partial, half, sizeof half, ember_deadline_after(1000)));
  for (int i = 0; i < 400; i++) {
    ember_feed_server_stats(s, &st);
    if (st.batches_received >= 1) break; /* one fills the 1-byte queue */
    sleep_ms(5);
  }
  CHECK(st.batches_received >= 1);
  /* b starts once a's batch fills the queue, so the one pop below is a's */
  CHECK(pthread_create(&tb, NULL, producer, &b) == 0);
  for (int i = 0; i < 400 && atomic_load(&b.sent) < 1; i++) sleep_ms(5);
  CHECK_EQ_INT(atomic_load(&b.sent), 1);
  CHECK_OK(ember_feed_server_next(s, &it, 1000)); /* popped, freed: not the server's */
  CHECK_EQ_INT(it->partition, 30);
  ember_feed_item_free(it);
  sleep_ms(100);
  ember_feed_server_destroy(s);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  CHECK(a.send_rc != EMBER_OK || a.end_rc != EMBER_OK);
  if (b.end_rc != EMBER_ECLOSED && b.end_rc != EMBER_EIO) {
    fprintf(stderr, "b: send %d end %d (%s)\n", b.send_rc, b.end_rc, b.end_msg);
    CHECK(0);
  }
  ember_net_close(silent);
  ember_net_close(partial);
  LEAK_CHECK();
}

TEST(create_rejects_bad_config) {
  ember_feed_server_config cfg;
  ember_feed_server *s = NULL;
  memset(&cfg, 0, sizeof cfg);
  cfg.listen_fd = -1;
  cfg.secret = SECRET;
  cfg.secret_len = 8;
  CHECK_EQ_INT(ember_feed_server_create(&s, &cfg), EMBER_EINVAL);
  CHECK(s == NULL);
  /* an already-bound socket (the reserved feed port) is adopted */
  {
    int fd = -1;
    uint16_t port = 0;
    CHECK_OK(ember_net_bind("127.0.0.1", 0, 0, 0, &fd, &port));
    cfg.secret_len = sizeof SECRET;
    cfg.listen_fd = fd;
    CHECK_OK(ember_feed_server_create(&s, &cfg));
    CHECK_EQ_INT(ember_feed_server_port(s), port);
    ember_feed_server_destroy(s);
  }
  ember_feed_server_destroy(NULL);
  ember_feed_client_destroy(NULL);
  ember_feed_item_free(NULL);
  LEAK_CHECK();
}

/* ------------------------------------------------------------ shared memory */

static int dev_shm_entries(void) {
  DIR *d = opendir("/dev/shm");
  struct dirent *e;
  int n = 0;
  if (d == NULL) return 0;
  while ((e = readdir(d)) != NULL)
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
  closedir(d);
  return n;
}

/* 1 if this process still maps an ember ring memfd. */
static int ring_mapped_here(void) {
  char line[512];
  int found = 0;
  FILE *f = fopen("/proc/self/maps", "r");
  CHECK(f != NULL);
  while (fgets(line, sizeof line, f))
    if (strstr(line, "memfd:ember-ring")) found = 1;
  fclose(f);
  return found;
}

static ember_feed_client *connect_opts(uint16_t port, uint32_t partition, int shm,
                                       size_t ring_bytes) {
  ember_feed_client *c = NULL;
  ember_feed_client_options o;
  memset(&o, 0, sizeof o);
  o.shm = shm;
  o.shm_bytes = ring_bytes;
  CHECK_OK(ember_feed_client_connect_ex(&c, "127.0.0.1", port, SECRET, sizeof SECRET, partition,
                                        0, &o, 5000));
  return c;
}

TEST(shm_and_tcp_deliver_identical_batches) {
  ember_feed_server *s = start_server(0, 0);
  uint16_t port = ember_feed_server_port(s);
  /* a 64 KiB ring, so the 100 KB batch takes the split path */
  ember_feed_client *tcp = connect_opts(port, 1, EMBER_FEED_SHM_OFF, 0);
  ember_feed_client *shm = connect_opts(port, 2, EMBER_FEED_SHM_ON, 65536);
  ember_feed_item *items[2][8] = {{NULL}};
  int got[2] = {0, 0}, nb = 0;
  ember_feed_stats st;
  sample smp;
  gen_batch g[3];
  make_sample(&smp, 5);
  gen_make(&g[0], 7, 0, 10, 3);
  gen_make(&g[1], 7, 10, 200, 500); /* ~100 KB: over half the ring */
  gen_make(&g[2], 7, 210, 0, 0);    /* no rows */
  for (int k = 0; k < 2; k++) {
    ember_feed_client *c = k ? shm : tcp;
    CHECK_OK(ember_feed_client_send(c, smp.cols, 7, 5, 5000));
    for (int i = 0; i < 3; i++) CHECK_OK(ember_feed_client_send(c, g[i].cols, 4, g[i].nrows, 5000));
    CHECK_OK(ember_feed_client_send(c, smp.cols, 0, 3, 5000)); /* rows, no columns */
  }
  nb = 5;
  CHECK_EQ_INT(ember_feed_client_uses_shm(tcp), 0);
  CHECK_EQ_INT(ember_feed_client_uses_shm(shm), 1);
  for (int n = 0; n < 2 * nb; n++) {
    ember_feed_item *it = NULL;
    CHECK_OK(ember_feed_server_next(s, &it, 5000));
    CHECK(it->partition == 1 || it->partition == 2);
    CHECK(((uintptr_t)it->data % 8) == 0);
    items[it->partition - 1][got[it->partition - 1]++] = it;
  }
  CHECK_EQ_INT(got[0], nb);
  CHECK_EQ_INT(got[1], nb);
  for (int i = 0; i < nb; i++) {
    CHECK_EQ_INT(items[0][i]->len, items[1][i]->len);
    CHECK(memcmp(items[0][i]->data, items[1][i]->data, items[0][i]->len) == 0);
    ember_feed_item_free(items[0][i]);
    ember_feed_item_free(items[1][i]);
  }
  CHECK_OK(ember_feed_client_end_partition(tcp, 5000));
  CHECK_OK(ember_feed_client_end_partition(shm, 5000));
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.shm_producers, 1);
  CHECK_EQ_INT(st.partitions_acked, 2);
  for (int i = 0; i < 3; i++) gen_free(&g[i]);
  ember_feed_client_destroy(tcp);
  ember_feed_client_destroy(shm);
  ember_feed_server_destroy(s);
  CHECK(!ring_mapped_here());
  LEAK_CHECK();
}

/* end_partition in halves: a producer sends one partition's end, feeds the
 * next partition on another connection while the first is still unread,
 * then reads the first's ACK.  Between the halves the client takes
 * nothing else. */
TEST(end_partition_halves_let_the_next_partition_flow) {
  ember_feed_server *s = start_server(0, 0);
  uint16_t port = ember_feed_server_port(s);
  ember_feed_client *first = connect_opts(port, 1, EMBER_FEED_SHM_ON, 65536);
  ember_feed_client *second = NULL;
  ember_feed_stats st;
  gen_batch g[2];
  uint64_t next1 = 0, next2 = 0;
  gen_make(&g[0], 1, 0, 10, 3);
  gen_make(&g[1], 2, 0, 20, 3);
  CHECK_OK(ember_feed_client_send(first, g[0].cols, 4, g[0].nrows, 5000));
  CHECK_OK(ember_feed_client_end_partition_send(first, 5000));
  CHECK_EQ_INT(ember_feed_client_send(first, g[0].cols, 4, g[0].nrows, 5000), EMBER_ESTATE);
  CHECK_EQ_INT(ember_feed_client_end_partition_send(first, 5000), EMBER_ESTATE);
  /* the next partition goes in while the first is still unread */
  second = connect_opts(port, 2, EMBER_FEED_SHM_ON, 65536);
  CHECK_OK(ember_feed_client_send(second, g[1].cols, 4, g[1].nrows, 5000));
  CHECK_OK(ember_feed_client_end_partition_send(second, 5000));
  for (int n = 0; n < 2; n++) {
    ember_feed_item *it = NULL;
    CHECK_OK(ember_feed_server_next(s, &it, 5000));
    CHECK_EQ_INT(verify_item(it, it->partition, it->partition == 1 ? &next1 : &next2),
                 it->partition == 1 ? 10 : 20);
    ember_feed_item_free(it);
  }
  CHECK_OK(ember_feed_client_end_partition_wait(first, 5000));
  CHECK_OK(ember_feed_client_end_partition_wait(second, 5000));
  CHECK_EQ_INT(ember_feed_client_end_partition_wait(first, 5000), EMBER_ESTATE);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.partitions_acked, 2);
  CHECK_EQ_INT(st.records_received, 30);
  for (int i = 0; i < 2; i++) gen_free(&g[i]);
  ember_feed_client_destroy(first);
  ember_feed_client_destroy(second);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(shm_declined_when_the_node_disables_it) {
  ember_feed_server_config cfg;
  ember_feed_server *s = NULL;
  ember_feed_client *c;
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  gen_batch g;
  uint64_t next = 0;
  memset(&cfg, 0, sizeof cfg);
  cfg.secret = SECRET;
  cfg.secret_len = sizeof SECRET;
  cfg.listen_fd = -1;
  cfg.bind_host = "127.0.0.1";
  cfg.disable_shm = 1;
  CHECK_OK(ember_feed_server_create(&s, &cfg));
  c = connect_opts(ember_feed_server_port(s), 3, EMBER_FEED_SHM_ON, 0);
  gen_make(&g, 3, 0, 10, 0);
  CHECK_OK(ember_feed_client_send(c, g.cols, 4, 10, 5000));
  CHECK_EQ_INT(ember_feed_client_uses_shm(c), 0);
  CHECK_OK(ember_feed_server_next(s, &it, 5000));
  verify_item(it, 3, &next);
  ember_feed_item_free(it);
  CHECK_OK(ember_feed_client_end_partition(c, 5000));
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.shm_producers, 0);
  gen_free(&g);
  ember_feed_client_destroy(c);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* FEED_SHM by hand: a wrong token is declined (TCP goes on), a second offer
 * is refused, a malformed batch in the ring is refused like one over TCP,
 * and a BATCH over TCP after the ring is refused. */
static void send_shm_offer(int fd, const ember_shm_ring_desc *d, int corrupt_token) {
  uint8_t req[64];
  memset(req, 0, 16); /* unknown host id: the node tries to attach */
  ember_wire_put_u32(req + 16, (uint32_t)d->pid);
  ember_wire_put_u32(req + 20, (uint32_t)d->fd);
  ember_wire_put_u64(req + 24, d->size);
  memcpy(req + 32, d->token, 32);
  if (corrupt_token) req[40] ^= 1;
  CHECK_OK(ember_net_send_frame(fd, EMBER_MSG_FEED_SHM, req, sizeof req, ember_deadline_after(2000)));
}

/* A raw producer sets up a ring, then sends a BATCH over TCP: refused, with
 * the reason. */
static void batch_over_tcp_after_ring(uint16_t port, uint32_t partition) {
  ember_shm_ring *ring = NULL;
  ember_shm_ring_desc d;
  char reason[1100];
  uint8_t junk[8] = {0};
  int fd;
  CHECK_OK(ember_shm_ring_create(&ring, 65536, EMBER_SHM_PRODUCER));
  ember_shm_ring_describe(ring, &d);
  fd = raw_producer(port, partition);
  send_shm_offer(fd, &d, 0);
  CHECK_EQ_INT(raw_status(fd, EMBER_MSG_FEED_SHM_REPLY, reason, sizeof reason), 0);
  CHECK_OK(ember_net_send_frame(fd, EMBER_MSG_BATCH, junk, 8, ember_deadline_after(2000)));
  CHECK_EQ_INT(raw_status(fd, EMBER_MSG_REFUSED, reason, sizeof reason), EMBER_EPROTO);
  CHECK(strstr(reason, "BATCH over TCP after setting up a shared-memory ring") != NULL);
  ember_net_close(fd);
  ember_shm_ring_destroy(ring);
}

TEST(shm_raw_negotiation_and_malformed_batch) {
  ember_feed_server *s = start_server(0, 0);
  uint16_t port = ember_feed_server_port(s);
  ember_shm_ring *ring = NULL;
  ember_shm_ring_desc d;
  ember_feed_stats st;
  char reason[1100];
  uint8_t junk[64];
  int fd;
  CHECK_OK(ember_shm_ring_create(&ring, 65536, EMBER_SHM_PRODUCER));
  ember_shm_ring_describe(ring, &d);
  /* 1. a token that does not match: declined with the reason, not refused */
  fd = raw_producer(port, 9);
  send_shm_offer(fd, &d, 1);
  CHECK(raw_status(fd, EMBER_MSG_FEED_SHM_REPLY, reason, sizeof reason) != 0);
  CHECK(strstr(reason, "not the described segment") != NULL);
  CHECK(!ember_shm_ring_attached(ring));
  send_shm_offer(fd, &d, 0); /* once per connection */
  CHECK_EQ_INT(raw_status(fd, EMBER_MSG_REFUSED, reason, sizeof reason), EMBER_EPROTO);
  CHECK(strstr(reason, "FEED_SHM sent twice") != NULL);
  ember_net_close(fd);
  /* 2. attached; a malformed batch through the ring */
  fd = raw_producer(port, 9);
  send_shm_offer(fd, &d, 0);
  CHECK_EQ_INT(raw_status(fd, EMBER_MSG_FEED_SHM_REPLY, reason, sizeof reason), 0);
  CHECK(ember_shm_ring_attached(ring));
  memset(junk, 0, sizeof junk);
  ember_wire_put_u32(junk, 1000);
  ember_wire_put_u32(junk + 4, 1);
  junk[8] = EMBER_DT_F64;
  junk[9] = 1;
  ember_wire_put_u32(junk + 12, 1);
  ember_wire_put_u64(junk + 16, 8000);
  junk[24] = 'x';
  CHECK_OK(ember_shm_ring_send(ring, junk, sizeof junk, 2000));
  CHECK_EQ_INT(raw_status(fd, EMBER_MSG_REFUSED, reason, sizeof reason), EMBER_EPROTO);
  CHECK(strstr(reason, "partition 9, batch 1 rejected") != NULL);
  CHECK(strstr(reason, "column 0 ('x')") != NULL);
  /* the node closed its end of the ring */
  CHECK_EQ_INT(ember_shm_ring_send(ring, junk, sizeof junk, 2000), EMBER_ECLOSED);
  ember_net_close(fd);
  ember_shm_ring_destroy(ring);
  /* 3. a BATCH over TCP after the ring was set up */
  batch_over_tcp_after_ring(port, 10);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.producers_rejected, 3);
  CHECK_EQ_INT(st.batches_received, 0);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* A refusal closes the connection's ring, which stops its reader thread; the
 * refusal's reason must still reach the producer whichever finishes first
 * (once lost to that race: the loop saw the stopped reader and dropped the
 * connection before flushing).  Repeated to meet both orders. */
TEST(shm_refusal_reason_outlives_the_ring_reader) {
  ember_feed_server *s = start_server(0, 0);
  uint16_t port = ember_feed_server_port(s);
  ember_feed_stats st;
  for (uint32_t i = 0; i < 60; i++) batch_over_tcp_after_ring(port, 100 + i);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.producers_rejected, 60);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* The producer gives up on its partition: batches already sent are
 * delivered, nothing is acknowledged, the client cannot go on. */
TEST(client_fail_marker) {
  ember_feed_server *s = start_server(0, 0);
  ember_feed_client *c = NULL;
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  gen_batch g;
  uint64_t next = 0;
  CHECK_OK(ember_feed_client_connect(&c, "127.0.0.1", ember_feed_server_port(s), SECRET,
                                     sizeof SECRET, 5, 0, 5000));
  gen_make(&g, 5, 0, 10, 0);
  CHECK_OK(ember_feed_client_send(c, g.cols, 4, 10, 5000));
  gen_free(&g);
  gen_make(&g, 5, 10, 10, 0);
  CHECK_OK(ember_feed_client_send(c, g.cols, 4, 10, 5000));
  CHECK_EQ_INT(ember_feed_client_uses_shm(c), expect_shm());
  CHECK_OK(ember_feed_client_fail(c, "cannot read partition 5: disk gone", 5000));
  CHECK_EQ_INT(ember_feed_client_send(c, g.cols, 4, 10, 100), EMBER_ESTATE);
  CHECK_EQ_INT(ember_feed_client_end_partition(c, 100), EMBER_ESTATE);
  CHECK_EQ_INT(pop_partition(s, 5, 2, &next), 20);
  /* after its batches, the consumer hears why the producer failed */
  CHECK_OK(ember_feed_server_next(s, &it, 5000));
  CHECK_EQ_INT(it->kind, EMBER_FEED_ITEM_ERROR);
  CHECK_EQ_INT(it->partition, 5);
  CHECK(strstr((const char *)it->data, "producer of partition 5 failed") != NULL);
  CHECK(strstr((const char *)it->data, "cannot read partition 5: disk gone") != NULL);
  CHECK_EQ_INT(it->len, strlen((const char *)it->data));
  ember_feed_item_free(it);
  it = NULL;
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 300), EMBER_ETIMEDOUT);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.partitions_acked, 0);
  gen_free(&g);
  ember_feed_client_destroy(c);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

static void *kill_after(void *arg) {
  pid_t pid = *(pid_t *)arg;
  sleep_ms(500);
  kill(pid, SIGKILL);
  return NULL;
}

TEST(shm_trainer_killed_producer_gets_error) {
  int before = dev_shm_entries(), pfd[2], status = 0, rc = EMBER_OK, sent = 0;
  uint16_t port = 0;
  pid_t pid;
  pthread_t killer;
  ember_feed_client *c;
  gen_batch g;
  int64_t t0;
  CHECK(pipe(pfd) == 0);
  pid = fork();
  if (pid == 0) { /* the trainer: a server whose consumer never pops */
    ember_feed_server *s = start_server(1, 0);
    uint16_t p = ember_feed_server_port(s);
    if (write(pfd[1], &p, sizeof p) != sizeof p) _exit(2);
    for (;;) pause();
  }
  CHECK(read(pfd[0], &port, sizeof port) == sizeof port);
  c = connect_opts(port, 4, EMBER_FEED_SHM_ON, 4u * 1024u * 1024u);
  gen_make(&g, 4, 0, 1024, 1024); /* ~1 MiB: a 4 MiB ring holds 3 */
  CHECK(pthread_create(&killer, NULL, kill_after, &pid) == 0);
  t0 = ember_now_ms();
  while (rc == EMBER_OK && sent < 100) {
    rc = ember_feed_client_send(c, g.cols, 4, g.nrows, 20000);
    if (rc == EMBER_OK) sent++;
  }
  pthread_join(killer, NULL);
  CHECK_EQ_INT(ember_feed_client_uses_shm(c), 1);
  CHECK(sent >= 3 && sent < 100);
  CHECK_EQ_INT(rc, EMBER_ECLOSED);
  CHECK(ember_now_ms() - t0 < 5000); /* seen at once, not at the 20 s deadline */
  CHECK(strstr(ember_last_error(), "closed the connection") != NULL ||
        strstr(ember_last_error(), "process is gone") != NULL);
  waitpid(pid, &status, 0);
  CHECK(WIFSIGNALED(status));
  gen_free(&g);
  ember_feed_client_destroy(c);
  close(pfd[0]);
  close(pfd[1]);
  CHECK_EQ_INT(dev_shm_entries(), before);
  CHECK(!ring_mapped_here());
  LEAK_CHECK();
}

TEST(shm_producer_killed_node_cleans_up) {
  ember_feed_server *s;
  uint16_t port = 0;
  int before = dev_shm_entries(), status = 0, pfd[2];
  ember_feed_item *it = NULL;
  ember_feed_stats st;
  producer_args a;
  pthread_t t;
  uint64_t next = 0;
  pid_t pid;
  /* Fork before the server starts its threads: a child forked while one of
   * them holds a lock (malloc's, OpenSSL's) can deadlock on it. */
  CHECK(pipe(pfd) == 0);
  pid = fork();
  if (pid == 0) { /* a feeding task that keeps sending until killed */
    ember_feed_client *c;
    if (read(pfd[0], &port, sizeof port) != sizeof port) _exit(2);
    c = connect_opts(port, 6, EMBER_FEED_SHM_ON, 1u << 20);
    gen_batch g;
    gen_make(&g, 6, 0, 100, 1000);
    for (;;)
      if (ember_feed_client_send(c, g.cols, 4, g.nrows, 60000) != EMBER_OK) _exit(3);
  }
  s = start_server(1, 0); /* one batch fills the queue */
  port = ember_feed_server_port(s);
  CHECK(write(pfd[1], &port, sizeof port) == sizeof port);
  close(pfd[0]);
  close(pfd[1]);
  CHECK_OK(ember_feed_server_next(s, &it, 10000)); /* data flows */
  CHECK_EQ_INT(it->partition, 6);
  ember_feed_item_free(it);
  CHECK(ring_mapped_here());
  sleep_ms(200); /* the producer is now blocked on its full ring */
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  CHECK(WIFSIGNALED(status));
  /* the node drops the connection and its ring */
  for (int64_t until = ember_now_ms() + 10000; ember_now_ms() < until && ring_mapped_here();) {
    ember_feed_item *x = NULL;
    if (ember_feed_server_next(s, &x, 10) == EMBER_OK) ember_feed_item_free(x);
  }
  CHECK(!ring_mapped_here());
  CHECK_EQ_INT(dev_shm_entries(), before);
  /* batches the dead producer queued before it died may still be waiting */
  for (;;) {
    ember_feed_item *x = NULL;
    if (ember_feed_server_next(s, &x, 200) != EMBER_OK) break;
    CHECK(x->kind != EMBER_FEED_ITEM_BATCH || x->partition == 6);
    ember_feed_item_free(x);
  }
  /* and serves the next producer */
  producer_init(&a, port, 7, 5, 10);
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  pop_partition(s, 7, 5, &next);
  pthread_join(t, NULL);
  CHECK_OK(a.end_rc);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.shm_producers, 2);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* ------------------------------------------------------------ strangers */

static ember_feed_server *start_guarded(uint32_t pre_ms, uint32_t max_pending,
                                        log_capture *lc) {
  ember_feed_server_config cfg;
  ember_feed_server *s = NULL;
  memset(&cfg, 0, sizeof cfg);
  cfg.secret = SECRET;
  cfg.secret_len = sizeof SECRET;
  cfg.listen_fd = -1;
  cfg.bind_host = "127.0.0.1";
  cfg.preauth_timeout_ms = pre_ms;
  cfg.max_pending = max_pending;
  if (lc != NULL) {
    memset(lc, 0, sizeof *lc);
    pthread_mutex_init(&lc->mu, NULL);
    cfg.log_fn = log_capture_fn;
    cfg.log_arg = lc;
  }
  CHECK_OK(ember_feed_server_create(&s, &cfg));
  return s;
}

/* END_PARTITION(0) on a raw producer that sent nothing: answered ACK(OK)
 * only if its connection survived. */
static void raw_end_empty(int fd) {
  uint8_t cnt[8];
  char why[256];
  ember_wire_put_u64(cnt, 0);
  CHECK_OK(ember_net_send_frame(fd, EMBER_MSG_END_PARTITION, cnt, 8, ember_deadline_after(5000)));
  CHECK_EQ_INT(raw_status(fd, EMBER_MSG_ACK, why, sizeof why), EMBER_OK);
}

/* More strangers than the node's limit of producers (1024), idle and slow,
 * with deadlines longer than the test: a producer still connects at once and
 * its partition arrives whole, and a producer connected before them is never
 * displaced.  (Before the pending pool, 1024 idle connections stopped the
 * node's accept loop until their 600 s deadline.) */
TEST(strangers_hold_no_limit_producers_need) {
  int n = strangers_fit(1500, 400);
  ember_feed_server *s = start_guarded(30000, 256, NULL);
  uint16_t port = ember_feed_server_port(s);
  int held = raw_producer(port, 9);
  strangers st;
  /* Every stranger reaches the server (beyond the old limit of 1024
   * connections), none waits in a kernel queue. */
  int in = strangers_open_paced(&st, port, n, 20);
  strangers_start(&st);
  fprintf(stderr, "%d strangers accepted\n", in);
  CHECK(in >= 1024);

  producer_args a;
  pthread_t t;
  uint64_t next = 0;
  int64_t t0 = ember_now_ms();
  producer_init(&a, port, 1, 20, 50);
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  CHECK_EQ_INT(pop_partition(s, 1, 20, &next), 1000);
  pthread_join(t, NULL);
  CHECK_OK(a.end_rc);
  int64_t took = ember_now_ms() - t0;
  fprintf(stderr, "a partition of 1000 rows in %lld ms beside %d strangers\n",
          (long long)took, n + 20);
  CHECK(took < 3000);
  raw_end_empty(held);

  int closed = 0;
  for (int i = 0; i < n; i++) closed += stranger_closed(st.idle[i]);
  for (int i = 0; i < 20; i++) closed += stranger_closed(st.slow[i]);
  CHECK(closed >= n + 20 - 256);
  CHECK(!stranger_closed(st.idle[n - 1]));
  strangers_close(&st);
  ember_net_close(held);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* The pool keeps the newest 8 strangers: each new one evicts the oldest. */
TEST(pending_pool_evicts_the_oldest_stranger) {
  ember_feed_server *s = start_guarded(30000, 8, NULL);
  uint16_t port = ember_feed_server_port(s);
  ember_feed_stats stats;
  int fds[20];
  for (int i = 0; i < 20; i++) {
    fds[i] = stranger_connect(port);
    sleep_ms(20); /* accepted in this order */
  }
  sleep_ms(300);
  for (int i = 0; i < 20; i++) CHECK_EQ_INT(stranger_closed(fds[i]), i < 12);
  ember_feed_server_stats(s, &stats);
  CHECK_EQ_INT(stats.producers_rejected, 12);
  for (int i = 0; i < 20; i++) ember_net_close(fds[i]);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* The pre-authentication deadline (300 ms from the environment) is not the
 * 600 s I/O timeout. */
TEST(preauth_deadline_is_not_the_io_timeout) {
  setenv("EMBER_PREAUTH_TIMEOUT_MS", "300", 1);
  ember_feed_server *s = start_server(0, 0);
  int mute = stranger_connect(ember_feed_server_port(s));
  int64_t t0 = ember_now_ms();
  while (!stranger_closed(mute)) {
    CHECK(ember_now_ms() - t0 < 3000);
    struct pollfd pfd = {mute, POLLIN, 0};
    (void)poll(&pfd, 1, 50);
  }
  CHECK(ember_now_ms() - t0 >= 250);
  ember_net_close(mute);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* 300 strangers sending garbage: a handful of log lines (the first at once,
 * then one per interval, 1 s here) that count all 300. */
TEST(rejections_are_logged_rate_limited) {
  setenv("EMBER_REJECT_LOG_INTERVAL_MS", "1000", 1);
  log_capture lc;
  ember_feed_server *s = start_guarded(0, 0, &lc);
  uint16_t port = ember_feed_server_port(s);
  ember_feed_stats stats;
  enum { N = 300 };
  static int fds[N];
  for (int i = 0; i < N; i++) {
    CHECK_OK(ember_net_connect("127.0.0.1", port, ember_deadline_after(2000), &fds[i]));
    CHECK_OK(ember_net_send_all(fds[i], "GET / HTTP/1.1\r\nHost: x\r\n\r\n", 27,
                                ember_deadline_after(1000)));
  }
  for (int64_t until = ember_now_ms() + 4000; ember_now_ms() < until;) {
    pthread_mutex_lock(&lc.mu);
    long long covered = lc.covered;
    pthread_mutex_unlock(&lc.mu);
    if (covered >= N) break;
    sleep_ms(50);
  }
  pthread_mutex_lock(&lc.mu);
  fprintf(stderr, "%d lines covered %lld rejections; last: %s\n", lc.lines, lc.covered, lc.last);
  CHECK_EQ_INT(lc.covered, N);
  CHECK(lc.lines <= 6);
  CHECK(strstr(lc.last, "feed server on :") != NULL);
  CHECK(strstr(lc.last, "unauthenticated connections in the last") != NULL);
  CHECK(strstr(lc.last, "magic") != NULL);
  pthread_mutex_unlock(&lc.mu);
  ember_feed_server_stats(s, &stats);
  CHECK_EQ_INT(stats.producers_rejected, N);
  for (int i = 0; i < N; i++) ember_net_close(fds[i]);
  ember_feed_server_destroy(s);
  pthread_mutex_destroy(&lc.mu);
  LEAK_CHECK();
}

/* The server tests again, over TCP. */
#define TCP_VARIANT(name)            \
  TEST(tcp_##name) {                 \
    setenv("EMBER_FEED_SHM", "0", 1); \
    test_##name();                   \
  }

/* ------------------------------------------------------------ named calls */

/* Pops one item of the given kind, call and partition (and tag, for START). */
static void pop_event(ember_feed_server *s, int kind, uint64_t call, uint32_t p,
                      const char *tag) {
  ember_feed_item *it = NULL;
  CHECK_OK(ember_feed_server_next(s, &it, 10000));
  CHECK_EQ_INT(it->kind, kind);
  CHECK(it->call == call);
  if (kind != EMBER_FEED_ITEM_CALL_END) CHECK_EQ_INT(it->partition, p);
  if (tag != NULL) {
    CHECK_EQ_INT(it->len, strlen(tag));
    CHECK(it->len == 0 || memcmp(it->data, tag, it->len) == 0);
  }
  ember_feed_item_free(it);
}

/* A call id beyond 32 bits: each partition's START (with its tag) comes
 * before its batches, its END after them, and CALL_END after the END that
 * completes the call; a later call reuses partition numbers freely, and a
 * retried partition of an ended call adds nothing. */
TEST(named_calls_mark_partition_and_call_ends) {
  ember_feed_server *s = start_server(0, 0);
  uint16_t port = ember_feed_server_port(s);
  const uint64_t call = (1ull << 40) + 5;
  producer_args a, b, again;
  pthread_t t;
  ember_feed_item *it = NULL;
  ember_feed_stats st;
  uint64_t next = 0;
  /* partition 0 of 2: START, 3 batches, END, and no CALL_END yet */
  producer_init(&a, port, 0, 3, 10);
  a.call = call;
  a.call_partitions = 2;
  a.tag = "epoch=0";
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  pop_event(s, EMBER_FEED_ITEM_PARTITION_START, call, 0, "epoch=0");
  pop_partition(s, 0, 3, &next);
  pop_event(s, EMBER_FEED_ITEM_PARTITION_END, call, 0, "");
  pthread_join(t, NULL);
  CHECK_OK(a.end_rc);
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  /* partition 1 (an empty tag) completes the call */
  producer_init(&b, port, 1, 2, 5);
  b.call = call;
  b.call_partitions = 2;
  next = 0;
  CHECK(pthread_create(&t, NULL, producer, &b) == 0);
  pop_event(s, EMBER_FEED_ITEM_PARTITION_START, call, 1, "");
  pop_partition(s, 1, 2, &next);
  pop_event(s, EMBER_FEED_ITEM_PARTITION_END, call, 1, NULL);
  pop_event(s, EMBER_FEED_ITEM_CALL_END, call, 0, NULL);
  pthread_join(t, NULL);
  CHECK_OK(b.end_rc);
  /* a late retry of partition 0: acknowledged, nothing queued */
  producer_init(&again, port, 0, 3, 10);
  again.call = call;
  again.call_partitions = 2;
  again.tag = "epoch=0";
  producer(&again);
  CHECK_OK(again.end_rc);
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  /* the next call's partition 0 is new data */
  producer_init(&a, port, 0, 1, 4);
  a.call = call + 1;
  a.call_partitions = 1;
  next = 0;
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  pop_event(s, EMBER_FEED_ITEM_PARTITION_START, call + 1, 0, NULL);
  pop_partition(s, 0, 1, &next);
  pop_event(s, EMBER_FEED_ITEM_PARTITION_END, call + 1, 0, NULL);
  pop_event(s, EMBER_FEED_ITEM_CALL_END, call + 1, 0, NULL);
  pthread_join(t, NULL);
  CHECK_OK(a.end_rc);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.partitions_acked, 3);
  CHECK_EQ_INT(st.duplicate_partitions, 1);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* A named partition's first attempt dies half-way; the resumed attempt skips
 * what was delivered, gets no second START, and the call still ends once. */
TEST(named_call_resumed_partition_starts_and_ends_once) {
  ember_feed_server *s = start_server(0, 0);
  uint16_t port = ember_feed_server_port(s);
  const uint8_t tag[] = "t";
  ember_feed_client_options o = {.call = 9, .call_partitions = 1, .tag = tag, .tag_len = 1};
  ember_feed_client *c = NULL;
  producer_args rest;
  pthread_t t;
  ember_feed_item *it = NULL;
  uint64_t held = 0, next = 0;
  int delivered = 1;
  gen_batch g;
  CHECK_OK(ember_feed_client_connect_ex(&c, "127.0.0.1", port, SECRET, sizeof SECRET, 2,
                                        EMBER_FEED_RESUME, &o, 5000));
  gen_make(&g, 2, 0, 10, 0);
  CHECK_OK(ember_feed_client_send(c, g.cols, 4, g.nrows, 5000));
  gen_free(&g);
  pop_event(s, EMBER_FEED_ITEM_PARTITION_START, 9, 2, "t");
  pop_partition(s, 2, 1, &next);
  ember_feed_client_destroy(c); /* the task dies */
  /* the retry: wait until the node has reaped the first connection */
  for (int tries = 0;; tries++) {
    int rc = ember_feed_client_connect_ex(&c, "127.0.0.1", port, SECRET, sizeof SECRET, 2,
                                          EMBER_FEED_RESUME, &o, 5000);
    if (rc == EMBER_OK) break;
    CHECK_EQ_INT(rc, EMBER_ESTATE);
    CHECK(tries < 100);
    sleep_ms(20);
  }
  ember_feed_client_resume_point(c, &held, &delivered);
  CHECK_EQ_INT(held, 10);
  CHECK_EQ_INT(delivered, 0);
  ember_feed_client_destroy(c);
  /* the rest of the partition, as a resumed producer sends it (rows 10..) */
  producer_init(&rest, port, 2, 0, 0);
  rest.call = 9;
  rest.call_partitions = 1;
  rest.tag = "t";
  rest.flags = EMBER_FEED_RESUME;
  CHECK(pthread_create(&t, NULL, producer, &rest) == 0);
  pop_event(s, EMBER_FEED_ITEM_PARTITION_END, 9, 2, NULL);
  pop_event(s, EMBER_FEED_ITEM_CALL_END, 9, 0, NULL);
  pthread_join(t, NULL);
  /* END_PARTITION counts this connection's records: 0 sent, 0 received */
  CHECK_OK(rest.end_rc);
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* HELLOs that disagree on a call's partition count, or carry a tag longer
 * than the payload or the limit, are refused with the reason; other
 * producers are served. */
TEST(named_call_bad_hellos_refused) {
  ember_feed_server *s = start_server(0, 0);
  uint16_t port = ember_feed_server_port(s);
  producer_args a, b;
  pthread_t t;
  uint8_t hello[24 + 8] = {0};
  char reason[512];
  uint64_t next = 0;
  int fd = -1;
  ember_feed_client *c = NULL;
  uint8_t big[EMBER_FEED_TAG_MAX + 1] = {0};
  ember_feed_client_options o = {.call = 3, .tag = big, .tag_len = sizeof big};
  /* call 3 says 2 partitions, then 5 */
  producer_init(&a, port, 0, 1, 3);
  a.call = 3;
  a.call_partitions = 2;
  CHECK(pthread_create(&t, NULL, producer, &a) == 0);
  pop_event(s, EMBER_FEED_ITEM_PARTITION_START, 3, 0, NULL);
  pop_partition(s, 0, 1, &next);
  pop_event(s, EMBER_FEED_ITEM_PARTITION_END, 3, 0, NULL);
  pthread_join(t, NULL);
  CHECK_OK(a.end_rc);
  producer_init(&b, port, 1, 1, 3);
  b.call = 3;
  b.call_partitions = 5;
  producer(&b);
  CHECK(b.send_rc == EMBER_EPROTO || b.end_rc == EMBER_EPROTO);
  CHECK(strstr(b.end_msg, "says the call has 5 partitions for this node, an earlier one "
                          "said 2") != NULL);
  /* a tag_len beyond the payload */
  CHECK_OK(ember_net_connect("127.0.0.1", port, ember_deadline_after(5000), &fd));
  CHECK_OK(ember_auth_client(fd, SECRET, sizeof SECRET, ember_deadline_after(5000)));
  ember_wire_put_u64(hello + 8, 4);
  ember_wire_put_u32(hello + 20, 9); /* 8 tag bytes follow */
  CHECK_OK(ember_net_send_frame(fd, EMBER_MSG_FEED_HELLO, hello, sizeof hello,
                                ember_deadline_after(5000)));
  CHECK_EQ_INT(raw_status(fd, EMBER_MSG_REFUSED, reason, sizeof reason), EMBER_EPROTO);
  CHECK(strstr(reason, "tag of 9 bytes in a payload of 32") != NULL);
  ember_net_close(fd);
  /* the client refuses a tag over the limit before connecting */
  CHECK_EQ_INT(ember_feed_client_connect_ex(&c, "127.0.0.1", port, SECRET, sizeof SECRET, 0, 0,
                                            &o, 5000),
               EMBER_EINVAL);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* ------------------------------------------------------------ in-place batches */

/* A batch for begin_batch/commit_batch: an F32 column of width 4, a BYTES
 * column whose row r holds (r * 7 + seed) % slen_mod bytes (so values differ
 * in length, empty ones included) and a BOOL column; kept in the test's own
 * memory too, to compare with what the node receives. */
typedef struct {
  float *f32;
  uint64_t *off;
  char *str;
  uint8_t *flag;
  ember_column cols[3];
  uint32_t nrows;
} placed_batch;

static void placed_make(placed_batch *b, uint32_t seed, uint32_t nrows, uint32_t slen_mod) {
  uint64_t o = 0;
  b->nrows = nrows;
  b->f32 = malloc(16 * (size_t)nrows + 1);
  b->off = malloc(8 * ((size_t)nrows + 1));
  b->str = malloc((size_t)nrows * slen_mod + 1);
  b->flag = malloc((size_t)nrows + 1);
  CHECK(b->f32 && b->off && b->str && b->flag);
  for (uint32_t r = 0; r < nrows; r++) {
    uint32_t len = (r * 7u + seed) % slen_mod;
    for (int k = 0; k < 4; k++) b->f32[4 * r + k] = (float)seed * 1000.0f + (float)r + 0.25f * k;
    b->off[r] = o;
    for (uint32_t j = 0; j < len; j++) b->str[o + j] = (char)('a' + (r + j + seed) % 26);
    o += len;
    b->flag[r] = (uint8_t)((r + seed) % 3 == 0);
  }
  b->off[nrows] = o;
  b->cols[0] = (ember_column){EMBER_DT_F32, 3, "f32", 4, b->f32, 16ull * nrows, NULL};
  b->cols[1] = (ember_column){EMBER_DT_BYTES, 3, "str", 0, b->str, o, b->off};
  b->cols[2] = (ember_column){EMBER_DT_BOOL, 4, "flag", 1, b->flag, nrows, NULL};
}

static void placed_free(placed_batch *b) {
  free(b->f32);
  free(b->off);
  free(b->str);
  free(b->flag);
}

static size_t placed_size(const placed_batch *b) {
  size_t n = 0;
  CHECK_OK(ember_batch_encoded_size(b->cols, 3, b->nrows, &n));
  return n;
}

/* 1 if p lies in a mapping of an ember ring memfd (this process maps both
 * ends: the server runs here too). */
static int in_ring_memory(const void *p) {
  char line[512];
  unsigned long lo, hi, a = (unsigned long)(uintptr_t)p;
  int found = 0;
  FILE *f = fopen("/proc/self/maps", "r");
  CHECK(f != NULL);
  while (fgets(line, sizeof line, f))
    if (strstr(line, "memfd:ember-ring") && sscanf(line, "%lx-%lx", &lo, &hi) == 2 && a >= lo &&
        a < hi)
      found = 1;
  fclose(f);
  return found;
}

/* Begins b's batch from its shapes alone (data and offsets NULL: begin must
 * not look at them) and fills the places from b. */
static int placed_begin(ember_feed_client *c, const placed_batch *b, ember_batch_place *pl) {
  ember_column shape[3];
  int rc;
  memcpy(shape, b->cols, sizeof shape);
  for (int i = 0; i < 3; i++) {
    shape[i].data = NULL;
    shape[i].offsets = NULL;
  }
  memset(pl, 0, 3 * sizeof *pl);
  rc = ember_feed_client_begin_batch(c, shape, 3, b->nrows, pl, 5000);
  if (rc != EMBER_OK) return rc;
  CHECK(pl[0].data != NULL && pl[1].data != NULL && pl[2].data != NULL);
  CHECK(pl[0].offsets == NULL && pl[1].offsets != NULL && pl[2].offsets == NULL);
  CHECK(((uintptr_t)pl[1].offsets % 8) == 0);
  for (int i = 0; i < 3; i++) CHECK(((uintptr_t)pl[i].data % 8) == 0);
  memcpy(pl[0].data, b->f32, (size_t)b->cols[0].data_len);
  memcpy(pl[1].offsets, b->off, 8 * ((size_t)b->nrows + 1));
  memcpy(pl[1].data, b->str, (size_t)b->cols[1].data_len);
  memcpy(pl[2].data, b->flag, (size_t)b->cols[2].data_len);
  return EMBER_OK;
}

/* Pops one item: b's batch from partition p, its decoded columns equal to
 * b's and its bytes those ember_batch_encode makes of b. */
static void placed_pop(ember_feed_server *s, uint32_t p, const placed_batch *b) {
  ember_feed_item *it = NULL;
  size_t need = placed_size(b), wrote = 0;
  uint8_t *want = malloc(need);
  CHECK(want != NULL);
  CHECK_OK(ember_batch_encode(b->cols, 3, b->nrows, want, need, &wrote));
  CHECK_OK(ember_feed_server_next(s, &it, 10000));
  CHECK_EQ_INT(it->kind, EMBER_FEED_ITEM_BATCH);
  CHECK_EQ_INT(it->partition, p);
  CHECK_EQ_INT(it->ncols, 3);
  CHECK_EQ_INT(it->nrows, b->nrows);
  check_cols_equal(b->cols, it->cols, 3, b->nrows);
  CHECK_EQ_INT(it->len, wrote);
  CHECK(memcmp(it->data, want, wrote) == 0);
  ember_feed_item_free(it);
  free(want);
}

/* One batch through begin, fill, commit; checks where its places were (1:
 * ring memory, 0: not) and that it arrives as written. */
static void placed_deliver(ember_feed_server *s, ember_feed_client *c, uint32_t p,
                           uint32_t seed, uint32_t nrows, uint32_t slen_mod, int in_ring) {
  placed_batch b;
  ember_batch_place pl[3];
  placed_make(&b, seed, nrows, slen_mod);
  CHECK_OK(placed_begin(c, &b, pl));
  for (int i = 0; i < 3; i++) CHECK_EQ_INT(in_ring_memory(pl[i].data), in_ring);
  CHECK_OK(ember_feed_client_commit_batch(c, 5000));
  placed_pop(s, p, &b);
  placed_free(&b);
}

/* A batch of rows and no columns (cols and places may be NULL). */
static void placed_no_columns(ember_feed_server *s, ember_feed_client *c, uint32_t p) {
  ember_feed_item *it = NULL;
  CHECK_OK(ember_feed_client_begin_batch(c, NULL, 0, 3, NULL, 5000));
  CHECK_OK(ember_feed_client_commit_batch(c, 5000));
  CHECK_OK(ember_feed_server_next(s, &it, 10000));
  CHECK_EQ_INT(it->kind, EMBER_FEED_ITEM_BATCH);
  CHECK_EQ_INT(it->partition, p);
  CHECK_EQ_INT(it->ncols, 0);
  CHECK_EQ_INT(it->nrows, 3);
  CHECK_EQ_INT(it->len, 8);
  ember_feed_item_free(it);
}

TEST(place_batch_over_shm) {
  ember_feed_server *s = start_server(0, 0);
  ember_feed_client *c = connect_opts(ember_feed_server_port(s), 1, EMBER_FEED_SHM_ON, 1u << 20);
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  /* all fit half the 1 MiB ring: written in ring memory */
  CHECK_EQ_INT(ember_feed_client_in_place_max(c), 0); /* the transport is not chosen yet */
  placed_deliver(s, c, 1, 1, 5, 9, 1);
  CHECK_EQ_INT(ember_feed_client_uses_shm(c), 1);
  CHECK_EQ_INT(ember_feed_client_in_place_max(c), (1u << 20) / 2 - EMBER_SHM_RING_RECORD_HDR);
  placed_deliver(s, c, 1, 2, 300, 40, 1);
  placed_deliver(s, c, 1, 3, 0, 1, 1); /* no rows: one offset */
  placed_no_columns(s, c, 1);
  CHECK_OK(ember_feed_client_end_partition(c, 5000));
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.shm_producers, 1);
  CHECK_EQ_INT(st.batches_received, 4);
  CHECK_EQ_INT(st.records_received, 5 + 300 + 0 + 3);
  CHECK_EQ_INT(st.partitions_acked, 1);
  ember_feed_client_destroy(c);
  ember_feed_server_destroy(s);
  CHECK(!ring_mapped_here());
  LEAK_CHECK();
}

TEST(place_batch_over_tcp) {
  ember_feed_server *s = start_server(0, 0);
  ember_feed_client *c = connect_opts(ember_feed_server_port(s), 2, EMBER_FEED_SHM_OFF, 0);
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  placed_deliver(s, c, 2, 1, 5, 9, 0);
  CHECK_EQ_INT(ember_feed_client_uses_shm(c), 0);
  CHECK_EQ_INT(ember_feed_client_in_place_max(c), 0);
  placed_deliver(s, c, 2, 2, 300, 40, 0);
  placed_deliver(s, c, 2, 3, 0, 1, 0);
  placed_deliver(s, c, 2, 4, 3000, 100, 0); /* ~200 KB */
  placed_no_columns(s, c, 2);
  CHECK_OK(ember_feed_client_end_partition(c, 5000));
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.shm_producers, 0);
  CHECK_EQ_INT(st.batches_received, 5);
  CHECK_EQ_INT(st.records_received, 5 + 300 + 0 + 3000 + 3);
  CHECK_EQ_INT(st.partitions_acked, 1);
  ember_feed_client_destroy(c);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* The smallest ring: batches over half of it are built in the client's own
 * buffer and split through the ring by commit; small ones still go in place. */
TEST(place_batch_over_half_the_ring) {
  ember_feed_server *s = start_server(0, 0);
  ember_feed_client *c = connect_opts(ember_feed_server_port(s), 3, EMBER_FEED_SHM_ON,
                                      EMBER_SHM_RING_MIN_BYTES);
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  ember_batch_place pl[3];
  placed_batch mid, big, bad;
  placed_make(&mid, 5, 1000, 40); /* over half the ring, under all of it */
  placed_make(&big, 6, 3000, 100); /* a few times the ring */
  CHECK(placed_size(&mid) + EMBER_SHM_RING_RECORD_HDR > EMBER_SHM_RING_MIN_BYTES / 2);
  CHECK(placed_size(&mid) < EMBER_SHM_RING_MIN_BYTES);
  CHECK(placed_size(&big) > 3u * EMBER_SHM_RING_MIN_BYTES);
  placed_free(&mid);
  placed_free(&big);
  placed_deliver(s, c, 3, 1, 10, 9, 1);
  CHECK_EQ_INT(ember_feed_client_uses_shm(c), 1);
  placed_deliver(s, c, 3, 5, 1000, 40, 0);
  placed_deliver(s, c, 3, 6, 3000, 100, 0);
  placed_deliver(s, c, 3, 7, 3000, 100, 0);
  /* content is checked on the scratch path too: nothing goes into the ring */
  placed_make(&bad, 8, 3000, 100);
  CHECK_OK(placed_begin(c, &bad, pl));
  ((uint8_t *)pl[2].data)[2999] = 2;
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 5000), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "column 2 ('flag'): BOOL element 2999 is 2") != NULL);
  placed_free(&bad);
  placed_deliver(s, c, 3, 9, 10, 9, 1);
  placed_deliver(s, c, 3, 10, 3000, 100, 0);
  CHECK_OK(ember_feed_client_end_partition(c, 5000));
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.shm_producers, 1);
  CHECK_EQ_INT(st.batches_received, 6);
  CHECK_EQ_INT(st.records_received, 10 + 1000 + 3000 + 3000 + 10 + 3000);
  CHECK_EQ_INT(st.partitions_acked, 1);
  ember_feed_client_destroy(c);
  ember_feed_server_destroy(s);
  CHECK(!ring_mapped_here());
  LEAK_CHECK();
}

/* A begun batch is dropped by cancel_batch, by a send and by end_partition:
 * the node sees only what was committed or sent, and END_PARTITION counts
 * only those records. */
TEST(place_batch_cancel_and_other_calls_drop_it) {
  ember_feed_server *s = start_server(0, 0);
  ember_feed_client *c = connect_opts(ember_feed_server_port(s), 4, EMBER_FEED_SHM_AUTO, 0);
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  ember_batch_place pl[3];
  placed_batch a, b, pend, sent, last;
  placed_make(&a, 1, 50, 30);
  placed_make(&b, 2, 7, 9);
  placed_make(&pend, 3, 20, 9);
  placed_make(&sent, 4, 11, 9);
  placed_make(&last, 5, 13, 9);
  /* begin, fill, cancel; then another batch: only it arrives */
  CHECK_OK(placed_begin(c, &a, pl));
  CHECK_EQ_INT(ember_feed_client_uses_shm(c), expect_shm());
  ember_feed_client_cancel_batch(c);
  ember_feed_client_cancel_batch(NULL);
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 1000), EMBER_ESTATE);
  CHECK_OK(placed_begin(c, &b, pl));
  CHECK_OK(ember_feed_client_commit_batch(c, 5000));
  placed_pop(s, 4, &b);
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  /* begin, then send: only the send's batch arrives, and nothing is left to commit */
  CHECK_OK(placed_begin(c, &pend, pl));
  CHECK_OK(ember_feed_client_send(c, sent.cols, 3, sent.nrows, 5000));
  placed_pop(s, 4, &sent);
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 1000), EMBER_ESTATE);
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  /* begin, then end_partition: not delivered; the count is b's and sent's rows */
  CHECK_OK(placed_begin(c, &last, pl));
  CHECK_OK(ember_feed_client_end_partition(c, 5000));
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 1000), EMBER_ESTATE);
  CHECK_EQ_INT(placed_begin(c, &last, pl), EMBER_ESTATE); /* the partition ended */
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.batches_received, 2);
  CHECK_EQ_INT(st.records_received, 7 + 11);
  CHECK_EQ_INT(st.partitions_acked, 1);
  CHECK_EQ_INT(st.shm_producers, expect_shm() ? 1 : 0);
  placed_free(&a);
  placed_free(&b);
  placed_free(&pend);
  placed_free(&sent);
  placed_free(&last);
  ember_feed_client_destroy(c);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

/* commit checks what the caller wrote: bad BYTES offsets or BOOL values are
 * EMBER_EINVAL naming the column, nothing is sent, and the client goes on. */
TEST(place_batch_bad_content_sends_nothing) {
  ember_feed_server *s = start_server(0, 0);
  ember_feed_client *c = connect_opts(ember_feed_server_port(s), 5, EMBER_FEED_SHM_AUTO, 0);
  ember_feed_stats st;
  ember_feed_item *it = NULL;
  ember_batch_place pl[3];
  placed_batch g, h;
  placed_make(&g, 6, 6, 9);
  placed_make(&h, 7, 6, 9);
  /* offsets that decrease */
  CHECK_OK(placed_begin(c, &g, pl));
  pl[1].offsets[2] = pl[1].offsets[3] + 1;
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 5000), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "column 1 ('str'): offset[3]") != NULL);
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  CHECK_EQ_INT(ember_feed_client_uses_shm(c), expect_shm());
  /* offsets that do not start at 0, or do not end at data_len */
  CHECK_OK(placed_begin(c, &g, pl));
  pl[1].offsets[0] = 1;
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 5000), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "column 1 ('str'): offset[0] = 1") != NULL);
  CHECK_OK(placed_begin(c, &g, pl));
  pl[1].offsets[6] = g.cols[1].data_len + 1;
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 5000), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "column 1 ('str'): last offset") != NULL);
  /* the client is still usable */
  CHECK_OK(placed_begin(c, &g, pl));
  CHECK_OK(ember_feed_client_commit_batch(c, 5000));
  placed_pop(s, 5, &g);
  /* a BOOL element of 2 */
  CHECK_OK(placed_begin(c, &h, pl));
  ((uint8_t *)pl[2].data)[4] = 2;
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 5000), EMBER_EINVAL);
  CHECK(strstr(ember_last_error(), "column 2 ('flag'): BOOL element 4 is 2") != NULL);
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  CHECK_OK(placed_begin(c, &h, pl));
  CHECK_OK(ember_feed_client_commit_batch(c, 5000));
  placed_pop(s, 5, &h);
  CHECK_OK(ember_feed_client_end_partition(c, 5000));
  CHECK_EQ_INT(ember_feed_server_next(s, &it, 100), EMBER_ETIMEDOUT);
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.batches_received, 2);
  CHECK_EQ_INT(st.records_received, 12);
  CHECK_EQ_INT(st.partitions_acked, 1);
  CHECK_EQ_INT(st.producers_rejected, 0);
  placed_free(&g);
  placed_free(&h);
  ember_feed_client_destroy(c);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TEST(place_batch_commit_without_begin) {
  ember_feed_server *s = start_server(0, 0);
  ember_feed_client *c = connect_opts(ember_feed_server_port(s), 6, EMBER_FEED_SHM_AUTO, 0);
  ember_feed_stats st;
  ember_batch_place pl[3];
  placed_batch g;
  placed_make(&g, 8, 4, 5);
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 1000), EMBER_ESTATE);
  CHECK(strstr(ember_last_error(), "no batch begun") != NULL);
  CHECK_EQ_INT(ember_feed_client_commit_batch(NULL, 1000), EMBER_EINVAL);
  CHECK_EQ_INT(ember_feed_client_begin_batch(c, g.cols, 3, g.nrows, NULL, 1000), EMBER_EINVAL);
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 1000), EMBER_ESTATE);
  /* once committed, the batch is gone: a second commit has nothing */
  CHECK_OK(placed_begin(c, &g, pl));
  CHECK_OK(ember_feed_client_commit_batch(c, 5000));
  placed_pop(s, 6, &g);
  CHECK_EQ_INT(ember_feed_client_commit_batch(c, 1000), EMBER_ESTATE);
  CHECK_OK(ember_feed_client_end_partition(c, 5000));
  ember_feed_server_stats(s, &st);
  CHECK_EQ_INT(st.batches_received, 1);
  CHECK_EQ_INT(st.records_received, 4);
  CHECK_EQ_INT(st.partitions_acked, 1);
  placed_free(&g);
  ember_feed_client_destroy(c);
  ember_feed_server_destroy(s);
  LEAK_CHECK();
}

TCP_VARIANT(one_producer_in_order)
TCP_VARIANT(four_concurrent_producers)
TCP_VARIANT(backpressure_blocks_until_pop)
TCP_VARIANT(backpressure_deadline_times_out)
TCP_VARIANT(duplicate_partition_discarded)
TCP_VARIANT(wrong_secret_rejected_others_served)
TCP_VARIANT(malformed_batch_closes_only_that_producer)
TCP_VARIANT(client_send_sees_refusal)
TCP_VARIANT(terminate_aborts_and_never_blocks_producers)
TCP_VARIANT(results_round_trip_in_order)
TCP_VARIANT(end_feed_item_after_queued_batches)
TCP_VARIANT(destroy_with_connected_producers_leaks_nothing)
TCP_VARIANT(client_fail_marker)
TCP_VARIANT(resumed_partition_delivered_exactly_once)
TCP_VARIANT(named_calls_mark_partition_and_call_ends)
TCP_VARIANT(named_call_resumed_partition_starts_and_ends_once)
TCP_VARIANT(place_batch_cancel_and_other_calls_drop_it)
TCP_VARIANT(place_batch_bad_content_sends_nothing)
TCP_VARIANT(place_batch_commit_without_begin)

RUN_TESTS(T(dtype_sizes), T(codec_roundtrip_every_dtype), T(codec_zero_columns_and_bytes_only),
          T(codec_encode_rejects_inconsistent_columns), T(decode_rejects_every_truncation),
          T(decode_rejects_bad_fields), T(one_producer_in_order), T(four_concurrent_producers),
          T(backpressure_blocks_until_pop), T(backpressure_deadline_times_out),
          T(duplicate_partition_discarded), T(resumed_partition_delivered_exactly_once),
          T(wrong_secret_rejected_others_served),
          T(handshake_deadline_drops_silent_client), T(malformed_batch_closes_only_that_producer),
          T(client_send_sees_refusal), T(record_count_mismatch_acks_eproto),
          T(terminate_aborts_and_never_blocks_producers), T(results_round_trip_in_order),
          T(end_feed_item_after_queued_batches), T(destroy_with_connected_producers_leaks_nothing),
          T(create_rejects_bad_config), T(shm_and_tcp_deliver_identical_batches),
          T(end_partition_halves_let_the_next_partition_flow),
          T(shm_declined_when_the_node_disables_it), T(shm_raw_negotiation_and_malformed_batch),
          T(shm_refusal_reason_outlives_the_ring_reader),
          T(client_fail_marker), T(shm_trainer_killed_producer_gets_error),
          T(shm_producer_killed_node_cleans_up), T(tcp_one_producer_in_order),
          T(tcp_four_concurrent_producers), T(tcp_backpressure_blocks_until_pop),
          T(tcp_backpressure_deadline_times_out), T(tcp_duplicate_partition_discarded),
          T(tcp_wrong_secret_rejected_others_served),
          T(tcp_malformed_batch_closes_only_that_producer), T(tcp_client_send_sees_refusal),
          T(tcp_terminate_aborts_and_never_blocks_producers), T(tcp_results_round_trip_in_order),
          T(tcp_end_feed_item_after_queued_batches),
          T(tcp_destroy_with_connected_producers_leaks_nothing), T(tcp_client_fail_marker),
          T(tcp_resumed_partition_delivered_exactly_once),
          T(strangers_hold_no_limit_producers_need), T(pending_pool_evicts_the_oldest_stranger),
          T(preauth_deadline_is_not_the_io_timeout), T(rejections_are_logged_rate_limited),
          T(named_calls_mark_partition_and_call_ends),
          T(named_call_resumed_partition_starts_and_ends_once), T(named_call_bad_hellos_refused),
          T(tcp_named_calls_mark_partition_and_call_ends),
          T(tcp_named_call_resumed_partition_starts_and_ends_once), T(place_batch_over_shm),
          T(place_batch_over_tcp), T(place_batch_over_half_the_ring),
          T(place_batch_cancel_and_other_calls_drop_it), T(place_batch_bad_content_sends_nothing),
          T(place_batch_commit_without_begin), T(tcp_place_batch_cancel_and_other_calls_drop_it),
          T(tcp_place_batch_bad_content_sends_nothing), T(tcp_place_batch_commit_without_begin))
