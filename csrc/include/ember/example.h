/* ember/example.h - tf.train.Example, encoded and decoded in columns.
 *
 * The message (tensorflow/core/example/{example,feature}.proto):
 *   Example  { Features features = 1; }
 *   Features { map<string, Feature> feature = 1; }
 *   Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
 *                           Int64List int64_list = 3; } }
 *   BytesList { repeated bytes value = 1; }
 *   FloatList { repeated float value = 1 [packed = true]; }
 *   Int64List { repeated int64 value = 1 [packed = true]; }
 *
 * Decoding follows protobuf's rules, not just what TensorFlow writes: unknown
 * fields (any wire type, groups included) are skipped; a known field with an
 * unexpected wire type is treated as unknown; repeated scalars are accepted
 * packed and unpacked; repeated occurrences of a message field merge (so a
 * map key seen twice keeps the last value, and a oneof keeps the last kind
 * set, concatenating lists of that kind that follow each other); a map entry
 * without a key has key "".  Every length is bounded by the bytes that remain
 * (nanopb's rule) and malformed input yields EMBER_ECORRUPT naming the
 * feature; nothing is read out of bounds.
 *
 * The batch decoder (ember_ex_decoder) appends each Example as one row of a
 * set of columns chosen up front: dense float32/int64 columns of a fixed
 * width, variable-length columns (values + row offsets), and bytes columns
 * (data + value offsets + row offsets), without an object per value.
 *
 * Thread-safety: a decoder is used by one thread at a time; the other
 * functions are pure.  Nothing blocks.
 */
#ifndef EMBER_EXAMPLE_H
#define EMBER_EXAMPLE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The Feature oneof; the values are the proto field numbers. */
typedef enum {
  EMBER_EX_NONE = 0, /* a Feature with no list set (zero values, any kind) */
  EMBER_EX_BYTES = 1,
  EMBER_EX_FLOAT = 2,
  EMBER_EX_INT64 = 3
} ember_ex_kind;

/* "bytes_list", "float_list", "int64_list", "no list" */
const char *ember_ex_kind_name(int kind);

/* Bounds: feature name length, columns per decoder, features per Example for
 * ember_ex_parse. */
#define EMBER_EX_MAX_NAME 4096u
#define EMBER_EX_MAX_COLS 4096u

/* ------------------------------------------------------------ batch decoder */

/* Spec flag: a record without the feature gives a row with present = 0
 * (dense columns are zero-filled, variable ones get no values) instead of
 * failing with EMBER_ESCHEMA. */
#define EMBER_EX_OPTIONAL 1u

typedef struct {
  const char *name; /* feature key, NUL-terminated (copied) */
  uint8_t kind;     /* EMBER_EX_FLOAT, EMBER_EX_INT64 or EMBER_EX_BYTES */
  uint32_t width;   /* > 0: every row has exactly width values; 0: variable */
  uint32_t flags;   /* EMBER_EX_OPTIONAL */
} ember_ex_spec;

/* One decoded column.  Buffers are malloc'd; after ember_ex_decoder_take
 * they belong to the caller (free each with ember_ex_free). */
typedef struct {
  uint8_t kind;
  uint32_t width;
  uint64_t nrows;
  void *values;            /* FLOAT: float[nvalues]; INT64: int64_t[nvalues];
                              BYTES: nbytes data bytes */
  uint64_t nvalues;        /* numbers, or byte strings for BYTES */
  uint64_t nbytes;         /* BYTES: bytes at values */
  uint64_t *value_offsets; /* BYTES: nvalues + 1 byte offsets into values */
  uint64_t *row_offsets;   /* width == 0: nrows + 1 indices into the values;
                              NULL for dense columns */
  uint8_t *present;        /* nrows flags: 1 if the record had the feature */
} ember_ex_column;

typedef struct ember_ex_decoder ember_ex_decoder;

/* EMBER_EINVAL for a bad spec (unknown kind, duplicate or empty name). */
int ember_ex_decoder_create(ember_ex_decoder **out, const ember_ex_spec *specs,
                            uint32_t ncols);
void ember_ex_decoder_destroy(ember_ex_decoder *d); /* accepts NULL */

/* Decodes one serialized Example and appends it as the next row.  On failure
 * no column changes: EMBER_ECORRUPT for malformed bytes, EMBER_ESCHEMA when
 * the Example does not fit the specs (wrong kind, wrong count for a dense
 * column, a required feature missing), with a message naming the feature,
 * e.g. "feature 'image': expected 784 float_list values, found 783". */
int ember_ex_decoder_add(ember_ex_decoder *d, const uint8_t *rec, size_t len);

uint64_t ember_ex_decoder_rows(const ember_ex_decoder *d);

/* A view of column i (valid until the next add, take or clear). */
int ember_ex_decoder_column(const ember_ex_decoder *d, uint32_t i, ember_ex_column *out);

/* Moves every column's buffers to the caller (out[ncols]) and restarts at
 * 0 rows.  Pointers of an empty column may be NULL, except the leading 0 of
 * value_offsets / row_offsets, which is always there. */
int ember_ex_decoder_take(ember_ex_decoder *d, ember_ex_column *out);

/* Copies rows rows[0..n) (any order, repeats allowed) of every column into
 * new buffers that belong to the caller (out[ncols], as after take), leaving
 * the decoder's rows as they are.  A shuffle reads a window of records once,
 * gathers batches from it in a random order, then clears it: the decoder's
 * buffers are reused for the next window instead of fresh memory each time
 * (a window of 10,000 Fashion-MNIST records is 31 MB, whose page faults
 * cost more than decoding it).  EMBER_EINVAL names a row out of range; on
 * failure out owns nothing. */
int ember_ex_decoder_gather(const ember_ex_decoder *d, const uint64_t *rows, size_t n,
                            ember_ex_column *out);

/* Drops all rows, keeping the buffers for reuse. */
void ember_ex_decoder_clear(ember_ex_decoder *d);

void ember_ex_free(void *p);

/* Frees the four buffers of a column from take or gather and zeroes it
 * (accepts a zeroed column). */
void ember_ex_column_free(ember_ex_column *c);

/* ------------------------------------------------------------ generic parse */

/* One feature of a parsed Example, pointing into the serialized bytes. */
typedef struct {
  const uint8_t *name;
  size_t name_len;
  int kind;          /* ember_ex_kind (the last kind set) */
  uint64_t count;    /* values */
  uint64_t nbytes;   /* BYTES: total data bytes */
  const uint8_t *entry_; /* internal: the map entry */
  size_t entry_len_;
  uint64_t run_;     /* internal */
} ember_ex_feature;

/* Lists the features of one Example (a key seen twice appears once, with its
 * last value).  EMBER_ETOOBIG if there are more than cap. */
int ember_ex_parse(const uint8_t *rec, size_t len, ember_ex_feature *out, size_t cap,
                   size_t *n);

/* Writes f's values: FLOAT into (float *)values, INT64 into (int64_t *)values
 * (f->count of them); BYTES: f->nbytes bytes into values and f->count + 1
 * offsets (from 0) into value_offsets. */
int ember_ex_feature_values(const ember_ex_feature *f, void *values, uint64_t *value_offsets);

/* ------------------------------------------------------------ encoder */

/* One column of rows to encode. */
typedef struct {
  const char *name;               /* feature key, NUL-terminated */
  uint8_t kind;                   /* EMBER_EX_FLOAT / INT64 / BYTES */
  uint32_t width;                 /* > 0: width values per row; 0: row_offsets */
  const void *values;             /* float / int64_t / BYTES data bytes */
  uint64_t nvalues;               /* numbers, or byte strings for BYTES */
  const uint64_t *value_offsets;  /* BYTES: nvalues + 1 byte offsets */
  uint64_t nbytes;                /* BYTES: bytes at values */
  const uint64_t *row_offsets;    /* width == 0: nrows + 1 indices into values */
  const uint8_t *present;         /* NULL, or per row: 0 leaves the feature out */
} ember_ex_input;

/* Size of row `row` serialized as an Example.  Checks the row's offsets
 * against nvalues / nbytes (EMBER_EINVAL naming the column). */
int ember_ex_encoded_size(const ember_ex_input *cols, uint32_t ncols, uint64_t row,
                          size_t *size);

/* Serializes row `row` into out[0..cap) (cap from ember_ex_encoded_size):
 * features in column order, lists packed, as TensorFlow writes them. */
int ember_ex_encode(const ember_ex_input *cols, uint32_t ncols, uint64_t row,
                    uint8_t *out, size_t cap, size_t *written);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_EXAMPLE_H */
