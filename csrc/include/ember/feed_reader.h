/* ember/feed_reader.h - a node's feed read as batches of rows, by a consumer
 * that runs without Python: the TensorFlow op behind ember.tf.feed_dataset
 * (python/ember/_tf_feed_op.c), which TensorFlow's own threads run while the
 * trainer's Python thread is elsewhere.
 *
 * A reader pops the items of one feed server (feed.h) and hands out their
 * rows in batches of a fixed number of rows, each made of consecutive rows of
 * one or more BATCH items, copied once, straight from the received item into
 * the caller's memory (a tensor).  A batch ends early, with fewer rows, only
 * where the data ends: at the end of a feed call (CALL_END: one train() of
 * the driver) or of the feed (END).  After such a short batch (or at once,
 * when no row was left) one wait answers 0 rows: the end of the sequence.
 * The wait after that reads the next call's rows (a dataset iterated again
 * reads the next train()); after END every wait answers 0 rows.  Batches
 * may span partitions and the epochs of one call, as `unbatch().batch(n)`
 * would: a trainer that needs epochs gives Keras steps_per_epoch, as
 * TensorFlowOnSpark's users did.
 *
 * Rows whose columns (names, dtypes, widths) differ from the rows before
 * them start a new batch, so every batch has one layout (layout() below),
 * which the consumer checks against what it declared.  A feeding task's
 * failure fails the wait (EMBER_ENODE, naming the feed call, the partition
 * and the task's reason) when the options ask for it; by default it is
 * logged and reading goes on (Spark retries the task, and the retry sends
 * only the rows not delivered).
 *
 * One consumer at a time: calls on one reader are serialised by its lock.
 * A reader must not share its server with a Python DataFeed (each would get
 * part of the items).
 */
#ifndef EMBER_FEED_READER_H
#define EMBER_FEED_READER_H

#include <stddef.h>
#include <stdint.h>

#include "ember/feed.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ember_feed_reader ember_feed_reader;

typedef struct {
  int fail_on_producer_error; /* 1: a feeding task's failure fails the wait */
  ember_log_fn log_fn;        /* a failure that is logged instead; NULL: stderr */
  void *log_arg;
} ember_feed_reader_options;

/* A reader of `server`, which must outlive it.  opts NULL = defaults.  The
 * reader is registered under a new id (ember_feed_reader_id), by which a
 * consumer compiled apart from libember reaches it (api table below). */
int ember_feed_reader_create(ember_feed_reader **out, ember_feed_server *server,
                             const ember_feed_reader_options *opts);

/* Closes the reader: waits in flight (through the api table too) end with
 * EMBER_EABORTED within a slice, later lookups by id fail, and the reader
 * is freed once the last user released it.  Accepts NULL. */
void ember_feed_reader_destroy(ember_feed_reader *r);

uint64_t ember_feed_reader_id(const ember_feed_reader *r);

/* Waits up to timeout_ms until the next batch is known, and says how many
 * rows it has in *rows: batch_rows, fewer where the data ends, 0 at the end
 * of the sequence (see above).  EMBER_ETIMEDOUT when neither came in time
 * (the rows found so far stay held for the next wait), EMBER_EABORTED once
 * the reader is being destroyed. */
int ember_feed_reader_wait(ember_feed_reader *r, uint32_t batch_rows, int64_t timeout_ms,
                           uint32_t *rows);

/* The columns of the rows the last wait found (it answered rows > 0): their
 * dtype, width, name and name_len (data, data_len and offsets are NULL/0).
 * EMBER_ESTATE when no row is held. */
int ember_feed_reader_layout(ember_feed_reader *r, ember_column *cols, uint32_t max_cols,
                             uint32_t *ncols);

/* One row of a BYTES column, as take hands it out. */
typedef struct {
  const uint8_t *data;
  uint64_t len;
} ember_feed_reader_bytes;

/* Copies the next `rows` rows (at most what the last wait found) into dest,
 * one destination per column of the layout (ndest must equal its ncols):
 * rows * width elements for a fixed column; for a BYTES column an array of
 * `rows` ember_feed_reader_bytes, pointing into memory the reader keeps
 * until its next wait or take. */
int ember_feed_reader_take(ember_feed_reader *r, uint32_t rows, void *const *dest,
                           uint32_t ndest);

/* Counters: rows and batches handed out, feed calls ended. */
typedef struct {
  uint64_t rows, batches, calls_ended, producer_errors;
} ember_feed_reader_stats;
void ember_feed_reader_stats_get(ember_feed_reader *r, ember_feed_reader_stats *out);

/* ------------------------------------------------------------ for other libraries
 *
 * A shared library loaded into the same process but not linked with this
 * copy of libember (the TensorFlow op: TensorFlow loads it, and libember's
 * symbols are private to Ember's Python extension) reaches readers through
 * this table of functions, whose address the extension hands out
 * (ember._ember.FEED_READER_API).  The table is static: it lives as long as
 * the library; readers are named by id, so a stale id fails cleanly
 * (EMBER_ENOTFOUND) instead of touching freed memory. */
#define EMBER_FEED_READER_ABI 1u

typedef struct {
  uint32_t abi;  /* EMBER_FEED_READER_ABI */
  uint32_t size; /* sizeof(ember_feed_reader_api) */
  /* Looks the reader up and holds it for the caller until release. */
  int (*acquire)(uint64_t id, ember_feed_reader **out);
  void (*release)(ember_feed_reader *r);
  int (*wait)(ember_feed_reader *r, uint32_t batch_rows, int64_t timeout_ms, uint32_t *rows);
  int (*layout)(ember_feed_reader *r, ember_column *cols, uint32_t max_cols, uint32_t *ncols);
  int (*take)(ember_feed_reader *r, uint32_t rows, void *const *dest, uint32_t ndest);
  const char *(*last_error)(void); /* the calling thread's message */
} ember_feed_reader_api;

const ember_feed_reader_api *ember_feed_reader_api_table(void);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_FEED_READER_H */
