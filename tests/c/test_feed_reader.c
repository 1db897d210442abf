/* tests/c/test_feed_reader.c - the feed read as batches of rows
 * (ember/feed_reader.h): a real feed server fed by real clients over TCP. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "ember/feed.h"
#include "ember/feed_reader.h"
#include "harness.h"

static const uint8_t SECRET[32] = "0123456789abcdef0123456789abcdef";

static ember_feed_server *start_server(void) {
  ember_feed_server_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.secret = SECRET;
  cfg.secret_len = sizeof SECRET;
  cfg.listen_fd = -1;
  cfg.bind_host = "127.0.0.1";
  cfg.disable_shm = 1;
  ember_feed_server *s = NULL;
  CHECK_OK(ember_feed_server_create(&s, &cfg));
  return s;
}

static ember_feed_client *connect_call(ember_feed_server *s, uint64_t call, uint32_t partition,
                                       uint32_t call_partitions) {
  ember_feed_client_options o;
  memset(&o, 0, sizeof o);
  o.shm = EMBER_FEED_SHM_OFF;
  o.call = call;
  o.call_partitions = call_partitions;
  ember_feed_client *c = NULL;
  CHECK_OK(ember_feed_client_connect_ex(&c, "127.0.0.1", ember_feed_server_port(s), SECRET,
                                        sizeof SECRET, partition, 0, &o, 5000));
  return c;
}

/* Sends rows first..first+n-1 as (x: f32[2] = {v, -v}, id: i64, tag: bytes "r<v>"). */
static void send_rows(ember_feed_client *c, int64_t first, uint32_t n) {
  float x[64];
  int64_t id[32];
  uint64_t offsets[33];
  char text[32 * 8];
  CHECK(n <= 32);
  offsets[0] = 0;
  for (uint32_t i = 0; i < n; i++) {
    int64_t v = first + i;
    x[2 * i] = (float)v;
    x[2 * i + 1] = (float)-v;
    id[i] = v;
    int len = snprintf(text + offsets[i], 8, "r%lld", (long long)v);
    offsets[i + 1] = offsets[i] + (uint64_t)len;
  }
  ember_column cols[3] = {
      {EMBER_DT_F32, 1, "x", 2, x, (uint64_t)n * 2 * sizeof(float), NULL},
      {EMBER_DT_I64, 2, "id", 1, id, (uint64_t)n * sizeof(int64_t), NULL},
      {EMBER_DT_BYTES, 3, "tag", 0, text, offsets[n], offsets},
  };
  CHECK_OK(ember_feed_client_send(c, cols, 3, n, 5000));
}

/* A feeding task on a thread of its own: END_PARTITION is acknowledged only
 * once the reader took every row, so it cannot run on the reading thread. */
typedef struct {
  ember_feed_server *s;
  uint64_t call;
  uint32_t partition, call_partitions;
  int64_t first[4];
  uint32_t n[4];
  int sends;
  int pause_ms; /* before each send after the first */
  const char *fail; /* fails the partition after its sends, with this reason */
  int end_feed;
  int rc;
  pthread_t thread;
} producer;

static void *produce(void *arg) {
  producer *p = arg;
  ember_feed_client *c = connect_call(p->s, p->call, p->partition, p->call_partitions);
  for (int i = 0; i < p->sends; i++) {
    if (i > 0 && p->pause_ms > 0) {
      struct timespec pause = {0, p->pause_ms * 1000000L};
      nanosleep(&pause, NULL);
    }
    send_rows(c, p->first[i], p->n[i]);
  }
  if (p->fail)
    p->rc = ember_feed_client_fail(c, p->fail, 5000);
  else
    p->rc = ember_feed_client_end_partition(c, 5000);
  if (p->rc != EMBER_OK)
    fprintf(stderr, "producer of partition %u: %s\n", (unsigned)p->partition,
            ember_last_error());
  ember_feed_client_destroy(c);
  if (p->rc == EMBER_OK && p->end_feed) { /* as the driver does, on its own connection */
    ember_feed_client *driver = NULL;
    p->rc = ember_feed_client_connect(&driver, "127.0.0.1", ember_feed_server_port(p->s),
                                      SECRET, sizeof SECRET, UINT32_MAX, 0, 5000);
    if (p->rc == EMBER_OK)
      p->rc = ember_feed_client_end_feed(driver, 5000);
    ember_feed_client_destroy(driver);
  }
  return NULL;
}

static void start(producer *p) { CHECK_OK(pthread_create(&p->thread, NULL, produce, p)); }

static void finish(producer *p) {
  pthread_join(p->thread, NULL);
  CHECK_OK(p->rc);
}

/* Takes a batch of `rows` rows and checks they are first..first+rows-1. */
static void take_and_check(ember_feed_reader *r, uint32_t rows, int64_t first) {
  float x[2 * 64];
  int64_t id[64];
  ember_feed_reader_bytes tag[64];
  void *dest[3] = {x, id, tag};
  CHECK(rows <= 64);
  ember_column cols[4];
  uint32_t ncols = 0;
  CHECK_OK(ember_feed_reader_layout(r, cols, 4, &ncols));
  CHECK_EQ_INT(ncols, 3);
  CHECK_EQ_INT(cols[0].dtype, EMBER_DT_F32);
  CHECK_EQ_INT(cols[0].width, 2);
  CHECK(cols[1].name_len == 2 && memcmp(cols[1].name, "id", 2) == 0);
  CHECK_EQ_INT(cols[2].dtype, EMBER_DT_BYTES);
  CHECK_OK(ember_feed_reader_take(r, rows, dest, 3));
  for (uint32_t i = 0; i < rows; i++) {
    int64_t v = first + i;
    CHECK_EQ_INT(id[i], v);
    CHECK(x[2 * i] == (float)v && x[2 * i + 1] == (float)-v);
    char want[16];
    int len = snprintf(want, sizeof want, "r%lld", (long long)v);
    CHECK_EQ_INT(tag[i].len, len);
    CHECK(memcmp(tag[i].data, want, (size_t)len) == 0);
  }
}

static uint32_t wait_rows(ember_feed_reader *r, uint32_t batch) {
  uint32_t rows = 99999;
  CHECK_OK(ember_feed_reader_wait(r, batch, 5000, &rows));
  return rows;
}

TEST(batches_span_items_and_end_with_the_call) {
  ember_feed_server *s = start_server();
  ember_feed_reader *r = NULL;
  CHECK_OK(ember_feed_reader_create(&r, s, NULL));
  producer p = {s, 7, 0, 1, {0, 3, 8}, {3, 5, 7}, 3, 0, NULL, 0, 0, 0}; /* items of 3, 5, 7 */
  start(&p);

  CHECK_EQ_INT(wait_rows(r, 4), 4);
  take_and_check(r, 4, 0); /* 3 from the first item, 1 from the second */
  CHECK_EQ_INT(wait_rows(r, 4), 4);
  take_and_check(r, 4, 4);
  CHECK_EQ_INT(wait_rows(r, 4), 4);
  take_and_check(r, 4, 8);
  CHECK_EQ_INT(wait_rows(r, 4), 3); /* the call ended: a short last batch */
  take_and_check(r, 3, 12);
  CHECK_EQ_INT(wait_rows(r, 4), 0); /* then the end of the sequence */
  finish(&p);

  /* the next call is the next sequence */
  producer q = {s, 8, 0, 1, {100}, {2}, 1, 0, NULL, 0, 0, 0};
  start(&q);
  CHECK_EQ_INT(wait_rows(r, 4), 2);
  take_and_check(r, 2, 100);
  CHECK_EQ_INT(wait_rows(r, 4), 0);
  finish(&q);

  ember_feed_reader_stats st;
  ember_feed_reader_stats_get(r, &st);
  CHECK_EQ_INT(st.rows, 17);
  CHECK_EQ_INT(st.batches, 5);
  CHECK_EQ_INT(st.calls_ended, 2);
  ember_feed_reader_destroy(r);
  ember_feed_server_destroy(s);
}

TEST(end_of_feed_ends_every_sequence) {
  ember_feed_server *s = start_server();
  ember_feed_reader *r = NULL;
  CHECK_OK(ember_feed_reader_create(&r, s, NULL));
  producer p = {s, 0, 0, 0, {0}, {5}, 1, 0, NULL, 1, 0, 0}; /* anonymous: no CALL_END */
  start(&p);
  CHECK_EQ_INT(wait_rows(r, 2), 2);
  take_and_check(r, 2, 0);
  CHECK_EQ_INT(wait_rows(r, 2), 2);
  take_and_check(r, 2, 2);
  CHECK_EQ_INT(wait_rows(r, 2), 1);
  take_and_check(r, 1, 4);
  for (int i = 0; i < 3; i++)
    CHECK_EQ_INT(wait_rows(r, 2), 0);
  finish(&p);
  ember_feed_reader_destroy(r);
  ember_feed_server_destroy(s);
}

TEST(a_wait_times_out_and_keeps_what_it_found) {
  ember_feed_server *s = start_server();
  ember_feed_reader *r = NULL;
  CHECK_OK(ember_feed_reader_create(&r, s, NULL));
  producer p = {s, 3, 0, 1, {0, 3}, {3, 5}, 2, 800, NULL, 0, 0, 0};
  start(&p);
  uint32_t rows = 0;
  int64_t t0 = ember_now_ms();
  int rc = ember_feed_reader_wait(r, 8, 300, &rows);
  CHECK_EQ_INT(rc, EMBER_ETIMEDOUT);
  CHECK(ember_now_ms() - t0 < 2000);
  CHECK(strstr(ember_last_error(), "3 held") != NULL);
  CHECK_EQ_INT(wait_rows(r, 8), 8); /* nothing lost to the timeout */
  take_and_check(r, 8, 0);
  CHECK_EQ_INT(wait_rows(r, 8), 0);
  finish(&p);
  ember_feed_reader_destroy(r);
  ember_feed_server_destroy(s);
}

TEST(a_new_layout_starts_a_new_batch) {
  ember_feed_server *s = start_server();
  ember_feed_reader *r = NULL;
  CHECK_OK(ember_feed_reader_create(&r, s, NULL));
  ember_feed_client *c = connect_call(s, 1, 0, 1);
  send_rows(c, 0, 3);
  int32_t other[4] = {1, 2, 3, 4};
  ember_column col = {EMBER_DT_I32, 1, "z", 1, other, sizeof other, NULL};
  CHECK_OK(ember_feed_client_send(c, &col, 1, 4, 5000));
  CHECK_EQ_INT(wait_rows(r, 10), 3); /* ends before the other layout */
  take_and_check(r, 3, 0);
  CHECK_EQ_INT(wait_rows(r, 4), 4);
  ember_column cols[2];
  uint32_t ncols = 0;
  CHECK_OK(ember_feed_reader_layout(r, cols, 2, &ncols));
  CHECK(ncols == 1 && cols[0].dtype == EMBER_DT_I32 && cols[0].name[0] == 'z');
  int32_t got[4];
  void *dest[1] = {got};
  CHECK_OK(ember_feed_reader_take(r, 4, dest, 1));
  CHECK(memcmp(got, other, sizeof got) == 0);
  ember_feed_client_destroy(c);
  ember_feed_reader_destroy(r);
  ember_feed_server_destroy(s);
}

TEST(misuse_is_refused) {
  ember_feed_server *s = start_server();
  ember_feed_reader *r = NULL;
  CHECK_EQ_INT(ember_feed_reader_create(&r, NULL, NULL), EMBER_EINVAL);
  CHECK_OK(ember_feed_reader_create(&r, s, NULL));
  uint32_t rows = 0;
  CHECK_EQ_INT(ember_feed_reader_wait(r, 0, 10, &rows), EMBER_EINVAL);
  ember_column cols[4];
  uint32_t ncols = 0;
  CHECK_EQ_INT(ember_feed_reader_layout(r, cols, 4, &ncols), EMBER_ESTATE);
  ember_feed_client *c = connect_call(s, 1, 0, 1);
  send_rows(c, 0, 4);
  CHECK_EQ_INT(wait_rows(r, 2), 2);
  float x[8];
  int64_t id[4];
  ember_feed_reader_bytes tag[4];
  void *dest[3] = {x, id, tag};
  CHECK_EQ_INT(ember_feed_reader_take(r, 3, dest, 3), EMBER_ESTATE); /* more than waited */
  CHECK(strstr(ember_last_error(), "3 rows") != NULL);
  CHECK_EQ_INT(ember_feed_reader_take(r, 2, dest, 2), EMBER_EINVAL);  /* wrong count */
  CHECK_EQ_INT(ember_feed_reader_layout(r, cols, 2, &ncols), EMBER_EINVAL);
  take_and_check(r, 2, 0); /* still intact */
  ember_feed_client_destroy(c);
  ember_feed_reader_destroy(r);
  ember_feed_server_destroy(s);
}

static int logged;
static void count_log(void *arg, const char *line) {
  (void)arg;
  if (strstr(line, "partition 5") && strstr(line, "disk on fire"))
    logged++;
}

TEST(a_feeding_task_failure_is_logged_or_raised) {
  for (int fail = 0; fail <= 1; fail++) {
    ember_feed_server *s = start_server();
    ember_feed_reader_options o = {fail, count_log, NULL};
    ember_feed_reader *r = NULL;
    CHECK_OK(ember_feed_reader_create(&r, s, &o));
    producer p = {s, 2, 5, 2, {0}, {2}, 1, 0, "disk on fire", 0, 0, 0};
    start(&p);
    finish(&p);
    uint32_t rows = 0;
    if (fail) {
      CHECK_EQ_INT(wait_rows(r, 2), 2); /* the rows before the failure */
      take_and_check(r, 2, 0);
      CHECK_EQ_INT(ember_feed_reader_wait(r, 2, 5000, &rows), EMBER_ENODE);
      CHECK(strstr(ember_last_error(), "partition 5") != NULL);
      CHECK(strstr(ember_last_error(), "disk on fire") != NULL);
    } else {
      producer q = {s, 2, 6, 2, {2}, {2}, 1, 0, NULL, 0, 0, 0};
      start(&q);
      CHECK_EQ_INT(wait_rows(r, 4), 4); /* read on past the failure */
      take_and_check(r, 4, 0);
      /* partition 5 never ends, so the call does not: a wait that times out
       * still pops partition 6's end, which its acknowledgement waits for */
      CHECK_EQ_INT(ember_feed_reader_wait(r, 4, 300, &rows), EMBER_ETIMEDOUT);
      finish(&q);
      CHECK_EQ_INT(logged, 1);
    }
    ember_feed_reader_destroy(r);
    ember_feed_server_destroy(s);
  }
}

typedef struct {
  uint64_t id;
  int rc;
  const ember_feed_reader_api *api;
} waiter_args;

static void *waiter(void *arg) {
  waiter_args *a = arg;
  ember_feed_reader *r = NULL;
  a->rc = a->api->acquire(a->id, &r);
  if (a->rc != EMBER_OK)
    return NULL;
  uint32_t rows = 0;
  a->rc = a->api->wait(r, 4, -1, &rows); /* no data ever comes */
  a->api->release(r);
  return NULL;
}

TEST(destroy_ends_a_wait_through_the_api_and_stale_ids_fail) {
  ember_feed_server *s = start_server();
  const ember_feed_reader_api *api = ember_feed_reader_api_table();
  CHECK_EQ_INT(api->abi, EMBER_FEED_READER_ABI);
  CHECK_EQ_INT(api->size, sizeof(ember_feed_reader_api));
  ember_feed_reader *r = NULL;
  CHECK_OK(ember_feed_reader_create(&r, s, NULL));
  waiter_args a = {ember_feed_reader_id(r), 1, api};
  pthread_t t;
  CHECK_OK(pthread_create(&t, NULL, waiter, &a));
  struct timespec pause = {0, 300 * 1000000L};
  nanosleep(&pause, NULL);
  int64_t t0 = ember_now_ms();
  ember_feed_reader_destroy(r); /* waits for the waiter to leave */
  CHECK(ember_now_ms() - t0 < 2000);
  pthread_join(t, NULL);
  CHECK_EQ_INT(a.rc, EMBER_EABORTED);
  ember_feed_reader *stale = NULL;
  CHECK_EQ_INT(api->acquire(a.id, &stale), EMBER_ENOTFOUND);
  CHECK(stale == NULL);
  CHECK(strstr(api->last_error(), "closed") != NULL);
  ember_feed_server_destroy(s);
}

RUN_TESTS(T(batches_span_items_and_end_with_the_call), T(end_of_feed_ends_every_sequence),
          T(a_wait_times_out_and_keeps_what_it_found), T(a_new_layout_starts_a_new_batch),
          T(misuse_is_refused), T(a_feeding_task_failure_is_logged_or_raised),
          T(destroy_ends_a_wait_through_the_api_and_stale_ids_fail))
