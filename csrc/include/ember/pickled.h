/* ember/pickled.h - Spark's pickled batches of records, read without Python.
 *
 * A PySpark RDD holds its records on the JVM side as pickled batches: each
 * frame is pickle.dumps(list of records) (PySpark's batched serializers,
 * protocol 5).  Feeding records to a trainer, Python would unpickle every
 * record into objects (a tuple, a numpy array, an int) only for Ember to
 * copy their bytes out again: most of a feeding task's CPU.  This reader
 * finds the records' values where they lie in the pickle instead, so the
 * feed copies an array's bytes from the frame straight into its ring.
 *
 * It reads the common form only, and refuses the rest:
 *   - the frame is one list of records;
 *   - a record is a tuple of fields, or one bare value;
 *   - a value is a Python int (within int64), float or bool, or a numpy
 *     array of float32, float64, int32, int64, uint8 or bool, little-endian,
 *     C order, 1 to EMBER_PICKLED_MAX_DIMS dimensions (numpy's protocol-5
 *     pickle: numpy._core.numeric._frombuffer(buffer, dtype, shape, 'C'));
 *   - every record has the first one's fields, each of the first one's kind
 *     (and dtype and shape).
 * It never calls anything: a pickle naming any other global, or any opcode
 * outside that form, is refused, and so is every malformed or truncated
 * input.  A refusal is not an error of the data: the caller unpickles the
 * frame with Python's pickle, which reads what this does not and words the
 * error of what is wrong.  Every read is bounded by the input (fuzzed:
 * tests/fuzz/fuzz_pickled.c).
 *
 * Thread-safety: a scan is used by one thread at a time; scans are
 * independent.  Nothing blocks.
 */
#ifndef EMBER_PICKLED_H
#define EMBER_PICKLED_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The most dimensions of an array value this reader takes. */
#define EMBER_PICKLED_MAX_DIMS 8u
/* The most fields of a record (a feed batch's column limit). */
#define EMBER_PICKLED_MAX_FIELDS 1024u

/* What a field of the records holds. */
typedef enum {
  EMBER_PK_ARRAY = 1, /* a numpy array: dtype and shape in the field */
  EMBER_PK_INT = 2,   /* a Python int: value.i */
  EMBER_PK_FLOAT = 3, /* a Python float: value.f */
  EMBER_PK_BOOL = 4   /* a Python bool: value.i, 0 or 1 */
} ember_pickled_kind;

/* A field, the same in every record of the scan. */
typedef struct {
  uint8_t kind;                            /* ember_pickled_kind */
  uint8_t dtype;                           /* an array's EMBER_DT_* (ember/batch.h) */
  uint8_t ndim;                            /* an array's dimensions */
  uint64_t dims[EMBER_PICKLED_MAX_DIMS];   /* an array's shape */
  uint64_t row_bytes;                      /* an array's bytes: itemsize x its elements */
} ember_pickled_field;

/* A field's value in one record. */
typedef union {
  int64_t i; /* EMBER_PK_INT, EMBER_PK_BOOL */
  double f;  /* EMBER_PK_FLOAT */
  uint64_t at; /* EMBER_PK_ARRAY: the offset of its row_bytes in the scanned input */
} ember_pickled_value;

typedef struct ember_pickled ember_pickled;

/* Scans one pickled list of records (buf, len).  EMBER_OK and *out (free it
 * with ember_pickled_free); EMBER_ESCHEMA when the input is not of the form
 * above (the message names the first thing that is not), EMBER_ENOMEM.  The
 * values' offsets point into buf, which the caller keeps while it reads them.
 * An empty list is refused (there is no first record to describe). */
int ember_pickled_scan(const uint8_t *buf, size_t len, ember_pickled **out);

/* Records in the scan (at least 1). */
size_t ember_pickled_count(const ember_pickled *p);

/* Fields per record (1 for bare values). */
size_t ember_pickled_fields(const ember_pickled *p);

/* 1 when the records are tuples of fields, 0 when each is one bare value. */
int ember_pickled_tuples(const ember_pickled *p);

/* Field j (j < ember_pickled_fields). */
const ember_pickled_field *ember_pickled_field_at(const ember_pickled *p, size_t j);

/* Field j of record i (i < count, j < fields). */
ember_pickled_value ember_pickled_value_at(const ember_pickled *p, size_t i, size_t j);

/* Frees a scan; accepts NULL. */
void ember_pickled_free(ember_pickled *p);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_PICKLED_H */
