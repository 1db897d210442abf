/* feed_reader.c - a node's feed as batches of rows (ember/feed_reader.h). */
#include "ember/feed_reader.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "acceptor.h" /* ember__log_stderr */
#include "ember/error.h"
#include "ember/net.h"

struct ember_feed_reader {
  ember_feed_server *server;
  ember_feed_reader_options opts;
  uint64_t id;
  pthread_mutex_t mu; /* one consumer at a time (wait, layout, take) */

  /* BATCH items popped and not yet handed out whole, oldest first; the
   * first has `pos` of its rows handed out already */
  ember_feed_item **held;
  size_t nheld, held_cap;
  uint32_t pos;
  uint64_t held_rows;   /* rows in held, less pos */
  uint32_t wait_rows;   /* what the last wait promised (take's bound) */
  /* items handed out whole, kept until the next call for BYTES refs */
  ember_feed_item **retired;
  size_t nretired, retired_cap;

  /* rows whose columns differ from held's: they start the batch after */
  ember_feed_item *other_layout;
  int call_ended;       /* a CALL_END came: the sequence ends after held */
  int feed_ended;       /* END came: every sequence ends after held */
  uint64_t call;        /* of the last item popped, for messages */
  uint32_t partition;
  ember_feed_reader_stats stats;

  /* guarded by the registry's lock */
  int closing;
  int users;
  pthread_cond_t idle;
  ember_feed_reader *next;
};

/* ------------------------------------------------------------ registry */

/* Readers by id, so that a library holding only an id (the TensorFlow op)
 * never touches a freed reader. */
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static ember_feed_reader *registry;
static uint64_t registry_next_id = 1;

static int reader_acquire(uint64_t id, ember_feed_reader **out) {
  *out = NULL;
  pthread_mutex_lock(&registry_mu);
  ember_feed_reader *r = registry;
  while (r != NULL && r->id != id)
    r = r->next;
  if (r != NULL && !r->closing)
    r->users++;
  pthread_mutex_unlock(&registry_mu);
  if (r == NULL || r->closing)
    return ember__set_error(EMBER_ENOTFOUND, "feed reader %llu is closed (the node's feed "
                            "ended or the node is shutting down)", (unsigned long long)id);
  *out = r;
  return EMBER_OK;
}

static void reader_release(ember_feed_reader *r) {
  pthread_mutex_lock(&registry_mu);
  if (--r->users == 0)
    pthread_cond_broadcast(&r->idle);
  pthread_mutex_unlock(&registry_mu);
}

static int reader_closing(ember_feed_reader *r) {
  pthread_mutex_lock(&registry_mu);
  int closing = r->closing;
  pthread_mutex_unlock(&registry_mu);
  return closing;
}

/* ------------------------------------------------------------ lifetime */

int ember_feed_reader_create(ember_feed_reader **out, ember_feed_server *server,
                             const ember_feed_reader_options *opts) {
  *out = NULL;
  if (server == NULL)
    return ember__set_error(EMBER_EINVAL, "feed reader: no feed server");
  ember_feed_reader *r = calloc(1, sizeof *r);
  if (r == NULL)
    return ember__set_error(EMBER_ENOMEM, "feed reader: out of memory");
  r->server = server;
  if (opts != NULL)
    r->opts = *opts;
  if (r->opts.log_fn == NULL) {
    r->opts.log_fn = ember__log_stderr;
    r->opts.log_arg = NULL;
  }
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->idle, NULL);
  pthread_mutex_lock(&registry_mu);
  r->id = registry_next_id++;
  r->users = 1; /* the creator's, given back by destroy */
  r->next = registry;
  registry = r;
  pthread_mutex_unlock(&registry_mu);
  *out = r;
  return EMBER_OK;
}

static void free_items(ember_feed_item **items, size_t *n) {
  for (size_t i = 0; i < *n; i++)
    ember_feed_item_free(items[i]);
  *n = 0;
}

void ember_feed_reader_destroy(ember_feed_reader *r) {
  if (r == NULL)
    return;
  pthread_mutex_lock(&registry_mu);
  r->closing = 1;
  r->users--; /* the creator's */
  while (r->users > 0) /* waits notice closing within a slice */
    pthread_cond_wait(&r->idle, &registry_mu);
  for (ember_feed_reader **p = &registry; *p != NULL; p = &(*p)->next)
    if (*p == r) {
      *p = r->next;
      break;
    }
  pthread_mutex_unlock(&registry_mu);
  free_items(r->held, &r->nheld);
  free_items(r->retired, &r->nretired);
  ember_feed_item_free(r->other_layout);
  free(r->held);
  free(r->retired);
  pthread_cond_destroy(&r->idle);
  pthread_mutex_destroy(&r->mu);
  free(r);
}

uint64_t ember_feed_reader_id(const ember_feed_reader *r) { return r->id; }

/* ------------------------------------------------------------ reading */

static int push_item(ember_feed_item ***items, size_t *n, size_t *cap, ember_feed_item *item) {
  if (*n == *cap) {
    size_t ncap = *cap ? 2 * *cap : 16;
    ember_feed_item **p = realloc(*items, ncap * sizeof *p);
    if (p == NULL)
      return ember__set_error(EMBER_ENOMEM, "feed reader: out of memory");
    *items = p;
    *cap = ncap;
  }
  (*items)[(*n)++] = item;
  return EMBER_OK;
}

static int same_layout(const ember_feed_item *a, const ember_feed_item *b) {
  if (a->ncols != b->ncols)
    return 0;
  for (uint32_t i = 0; i < a->ncols; i++) {
    const ember_column *x = &a->cols[i], *y = &b->cols[i];
    if (x->dtype != y->dtype || x->width != y->width || x->name_len != y->name_len ||
        memcmp(x->name, y->name, x->name_len) != 0)
      return 0;
  }
  return 1;
}

/* Takes one popped item into the reader's state.  Consumes the item. */
static int absorb(ember_feed_reader *r, ember_feed_item *item) {
  r->call = item->call;
  r->partition = item->partition;
  switch (item->kind) {
  case EMBER_FEED_ITEM_BATCH:
    if (item->nrows == 0)
      break;
    if (r->nheld > 0 && !same_layout(r->held[0], item)) {
      r->other_layout = item; /* the batch ends before it; the next one starts with it */
      return EMBER_OK;
    }
    if (push_item(&r->held, &r->nheld, &r->held_cap, item) != EMBER_OK) {
      ember_feed_item_free(item);
      return EMBER_ENOMEM;
    }
    r->held_rows += item->nrows;
    return EMBER_OK;
  case EMBER_FEED_ITEM_CALL_END:
    r->call_ended = 1;
    r->stats.calls_ended++;
    break;
  case EMBER_FEED_ITEM_END:
    r->feed_ended = 1;
    break;
  case EMBER_FEED_ITEM_ERROR: {
    r->stats.producer_errors++;
    const char *why = item->data ? (const char *)item->data : "no reason given";
    if (r->opts.fail_on_producer_error) {
      int rc = ember__set_error(EMBER_ENODE, "feed call %llu, partition %u: the feeding task "
                                "failed: %s", (unsigned long long)item->call,
                                (unsigned)item->partition, why);
      ember_feed_item_free(item);
      return rc;
    }
    char line[1024];
    snprintf(line, sizeof line, "feed call %llu, partition %u: the feeding task failed: %s "
             "(its rows so far were delivered; Spark's retry sends the rest)",
             (unsigned long long)item->call, (unsigned)item->partition, why);
    r->opts.log_fn(r->opts.log_arg, line);
    break;
  }
  default: /* PARTITION_START, PARTITION_END: the rows say all a batch needs */
    break;
  }
  ember_feed_item_free(item);
  return EMBER_OK;
}

/* The slice a wait blocks in the server without looking at `closing`. */
#define READER_SLICE_MS 200

static int reader_wait_locked(ember_feed_reader *r, uint32_t batch_rows, int64_t timeout_ms,
                              uint32_t *rows) {
  free_items(r->retired, &r->nretired);
  r->wait_rows = 0;
  if (r->held_rows == 0 && r->other_layout != NULL) {
    int rc = push_item(&r->held, &r->nheld, &r->held_cap, r->other_layout);
    if (rc != EMBER_OK)
      return rc;
    r->held_rows = r->other_layout->nrows;
    r->other_layout = NULL;
  }
  int64_t deadline = timeout_ms < 0 ? INT64_MAX : ember_deadline_after(timeout_ms);
  while (r->held_rows < batch_rows && r->other_layout == NULL && !r->call_ended &&
         !r->feed_ended) {
    if (reader_closing(r))
      return ember__set_error(EMBER_EABORTED, "feed reader %llu is closing",
                              (unsigned long long)r->id);
    int64_t left = deadline == INT64_MAX ? READER_SLICE_MS : deadline - ember_now_ms();
    if (left <= 0)
      return ember__set_error(EMBER_ETIMEDOUT, "feed reader: no rows within %lld ms "
                              "(%llu held)", (long long)timeout_ms,
                              (unsigned long long)r->held_rows);
    ember_feed_item *item = NULL;
    int rc = ember_feed_server_next(r->server, &item, left < READER_SLICE_MS ? left
                                                                             : READER_SLICE_MS);
    if (rc == EMBER_ETIMEDOUT)
      continue;
    if (rc != EMBER_OK)
      return rc;
    if ((rc = absorb(r, item)) != EMBER_OK)
      return rc;
  }
  if (r->held_rows == 0) { /* the end of a sequence: the next one begins after it */
    if (!r->feed_ended)
      r->call_ended = 0;
    *rows = 0;
    return EMBER_OK;
  }
  *rows = r->held_rows < batch_rows ? (uint32_t)r->held_rows : batch_rows;
  r->wait_rows = *rows;
  return EMBER_OK;
}

int ember_feed_reader_wait(ember_feed_reader *r, uint32_t batch_rows, int64_t timeout_ms,
                           uint32_t *rows) {
  *rows = 0;
  if (batch_rows == 0)
    return ember__set_error(EMBER_EINVAL, "feed reader: a batch needs at least one row");
  pthread_mutex_lock(&r->mu);
  int rc = reader_wait_locked(r, batch_rows, timeout_ms, rows);
  pthread_mutex_unlock(&r->mu);
  return rc;
}

int ember_feed_reader_layout(ember_feed_reader *r, ember_column *cols, uint32_t max_cols,
                             uint32_t *ncols) {
  *ncols = 0;
  pthread_mutex_lock(&r->mu);
  int rc = EMBER_OK;
  if (r->held_rows == 0) {
    rc = ember__set_error(EMBER_ESTATE, "feed reader: no rows held (wait found none)");
  } else if (r->held[0]->ncols > max_cols) {
    rc = ember__set_error(EMBER_EINVAL, "feed reader: the rows have %u columns, room for %u",
                          (unsigned)r->held[0]->ncols, (unsigned)max_cols);
  } else {
    const ember_feed_item *first = r->held[0];
    for (uint32_t i = 0; i < first->ncols; i++) {
      memset(&cols[i], 0, sizeof cols[i]);
      cols[i].dtype = first->cols[i].dtype;
      cols[i].width = first->cols[i].width;
      cols[i].name = first->cols[i].name;
      cols[i].name_len = first->cols[i].name_len;
    }
    *ncols = first->ncols;
  }
  pthread_mutex_unlock(&r->mu);
  return rc;
}

/* Copies n rows from row `from` of item into the destinations at row `at`. */
static void copy_rows(const ember_feed_item *item, uint32_t from, uint32_t n, uint32_t at,
                      void *const *dest) {
  for (uint32_t c = 0; c < item->ncols; c++) {
    const ember_column *col = &item->cols[c];
    if (col->dtype == EMBER_DT_BYTES) {
      ember_feed_reader_bytes *out = (ember_feed_reader_bytes *)dest[c] + at;
      const uint8_t *data = col->data;
      for (uint32_t i = 0; i < n; i++) {
        uint64_t lo = col->offsets[from + i], hi = col->offsets[from + i + 1];
        out[i].data = data + lo;
        out[i].len = hi - lo;
      }
      continue;
    }
    size_t row_bytes = ember_dtype_size(col->dtype) * col->width;
    memcpy((uint8_t *)dest[c] + (size_t)at * row_bytes,
           (const uint8_t *)col->data + (size_t)from * row_bytes, (size_t)n * row_bytes);
  }
}

int ember_feed_reader_take(ember_feed_reader *r, uint32_t rows, void *const *dest,
                           uint32_t ndest) {
  pthread_mutex_lock(&r->mu);
  int rc = EMBER_OK;
  free_items(r->retired, &r->nretired);
  if (rows > r->wait_rows) {
    rc = ember__set_error(EMBER_ESTATE, "feed reader: take of %u rows where the last wait "
                          "found %u", (unsigned)rows, (unsigned)r->wait_rows);
    goto out;
  }
  if (rows > 0 && ndest != r->held[0]->ncols) {
    rc = ember__set_error(EMBER_EINVAL, "feed reader: %u destinations for %u columns",
                          (unsigned)ndest, (unsigned)r->held[0]->ncols);
    goto out;
  }
  uint32_t done = 0;
  size_t used = 0; /* items handed out whole */
  while (done < rows) {
    ember_feed_item *item = r->held[used];
    uint32_t n = item->nrows - r->pos;
    if (n > rows - done)
      n = rows - done;
    copy_rows(item, r->pos, n, done, dest);
    done += n;
    r->pos += n;
    if (r->pos == item->nrows) {
      used++;
      r->pos = 0;
    }
  }
  for (size_t i = 0; i < used; i++) /* kept for BYTES refs until the next call */
    if ((rc = push_item(&r->retired, &r->nretired, &r->retired_cap, r->held[i])) != EMBER_OK) {
      for (size_t j = i; j < used; j++)
        ember_feed_item_free(r->held[j]);
      break;
    }
  memmove(r->held, r->held + used, (r->nheld - used) * sizeof *r->held);
  r->nheld -= used;
  r->held_rows -= rows;
  r->wait_rows -= rows;
  r->stats.rows += rows;
  r->stats.batches++;
out:
  pthread_mutex_unlock(&r->mu);
  return rc;
}

void ember_feed_reader_stats_get(ember_feed_reader *r, ember_feed_reader_stats *out) {
  pthread_mutex_lock(&r->mu);
  *out = r->stats;
  pthread_mutex_unlock(&r->mu);
}

/* ------------------------------------------------------------ api table */

static const ember_feed_reader_api api_table = {
    .abi = EMBER_FEED_READER_ABI,
    .size = sizeof(ember_feed_reader_api),
    .acquire = reader_acquire,
    .release = reader_release,
    .wait = ember_feed_reader_wait,
    .layout = ember_feed_reader_layout,
    .take = ember_feed_reader_take,
    .last_error = ember_last_error,
};

const ember_feed_reader_api *ember_feed_reader_api_table(void) { return &api_table; }
