/* ember/tfrecord.h - TFRecord files: reader and writer.
 *
 * A TFRecord file is a sequence of records, each
 *   u64 length (little-endian) | u32 masked CRC-32C of those 8 bytes |
 *   length data bytes          | u32 masked CRC-32C of the data
 * optionally compressed as a whole with GZIP or ZLIB (TensorFlow's
 * TFRecordOptions).  See crc32c.h for the mask.
 *
 * Reader.  Opens over a file descriptor, a path, a memory buffer, or an
 * ember_read_fn source (io.h).  It validates both CRCs of every record
 * unless EMBER_TFR_NO_CRC is given, and never trusts a length: a length
 * beyond max_record is refused before anything is allocated for it, and a
 * length whose CRC fails is never used.  A bad record yields EMBER_ECORRUPT,
 * input that ends inside a record EMBER_ETRUNCATED, with a message naming the
 * source and the byte offset of the record, e.g.
 *   "data/part-00003.tfrecord: corrupt record at byte offset 51234: data CRC
 *    mismatch (stored 0x1c2d3e4f, computed 0x0a0b0c0d)"
 * (for compressed input the offset is in the decompressed stream, and the
 * message says so).  These errors are sticky: later calls return the same.
 * With EMBER_TFR_SKIP_CORRUPT the reader instead skips what is bad and counts
 * it (ember_tfr_reader_stats): a record whose data CRC fails is skipped; a
 * header whose length CRC fails makes the reader scan forward, byte by byte,
 * for the next header whose length CRC holds; a truncated tail ends the file.
 *
 * Memory: an uncompressed memory buffer is read in place (records point into
 * it); other sources go through one internal buffer that grows to the largest
 * record seen.  A record returned by next stays valid until the next call on
 * the reader.
 *
 * Writer.  Writes records to a file descriptor, a path or a growable memory
 * buffer, optionally compressed.  Nothing is guaranteed to be written until
 * ember_tfr_writer_close returns EMBER_OK; errors are sticky.
 *
 * Blocking: reads and writes block on the descriptor or source (files do not
 * time out; a network source bounds its own waits, see io.h).
 * Thread-safety: a reader or writer is used by one thread at a time; distinct
 * objects are independent.
 */
#ifndef EMBER_TFRECORD_H
#define EMBER_TFRECORD_H

#include <stddef.h>
#include <stdint.h>

#include "ember/io.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EMBER_TFR_HEADER_LEN 12u
#define EMBER_TFR_FOOTER_LEN 4u
/* Default and hard limits of one record's data length. */
#define EMBER_TFR_DEFAULT_MAX_RECORD (256ull << 20)
#define EMBER_TFR_ABSOLUTE_MAX_RECORD (1ull << 32)

typedef enum {
  EMBER_TFR_PLAIN = 0,
  EMBER_TFR_GZIP = 1,
  EMBER_TFR_ZLIB = 2
} ember_tfr_compression;

/* Reader flags. */
#define EMBER_TFR_NO_CRC 1u        /* do not verify the CRCs */
#define EMBER_TFR_SKIP_CORRUPT 2u  /* skip and count bad records instead of failing */

typedef struct {
  int compression;     /* ember_tfr_compression */
  uint32_t flags;      /* EMBER_TFR_* reader flags */
  uint64_t max_record; /* longest record accepted; 0 = EMBER_TFR_DEFAULT_MAX_RECORD */
  size_t chunk;        /* bytes per read from the source; 0 = 1 MiB */
} ember_tfr_options;

typedef struct {
  uint64_t records;       /* records returned */
  uint64_t data_bytes;    /* their data bytes */
  uint64_t stream_bytes;  /* bytes of the (decompressed) stream consumed */
  uint64_t skipped;       /* corrupt or truncated spots skipped (SKIP_CORRUPT) */
  uint64_t skipped_bytes; /* stream bytes skipped with them */
} ember_tfr_stats;

typedef struct ember_tfr_reader ember_tfr_reader;

/* `name` (copied; may be NULL) names the source in error messages.  opt may
 * be NULL for the defaults.  The fd stays the caller's (not closed). */
int ember_tfr_reader_open_fd(ember_tfr_reader **out, int fd, const char *name,
                             const ember_tfr_options *opt);
/* Opens path read-only; the reader owns and closes the descriptor. */
int ember_tfr_reader_open_path(ember_tfr_reader **out, const char *path,
                               const ember_tfr_options *opt);
/* Reads buf[0..len), which must outlive the reader. */
int ember_tfr_reader_open_mem(ember_tfr_reader **out, const void *buf, size_t len,
                              const char *name, const ember_tfr_options *opt);
/* Reads from fn(opaque, ...) (io.h); the reader does not own opaque. */
int ember_tfr_reader_open_fn(ember_tfr_reader **out, ember_read_fn fn, void *opaque,
                             const char *name, const ember_tfr_options *opt);
/* As ember_tfr_reader_open_fn, but the reader owns opaque: release(opaque)
 * runs when the reader is destroyed, and also here when the open fails. */
int ember_tfr_reader_open_owned(ember_tfr_reader **out, ember_read_fn fn, void *opaque,
                                void (*release)(void *), const char *name,
                                const ember_tfr_options *opt);

/* Reads the next record: returns 1 with *data and *len set (valid until the next
 * call on r), 0 at the clean end of the input, or a negative status. */
int ember_tfr_reader_next(ember_tfr_reader *r, const uint8_t **data, size_t *len);

/* Byte offset (in the decompressed stream) of the record last returned. */
uint64_t ember_tfr_reader_offset(const ember_tfr_reader *r);
void ember_tfr_reader_stats(const ember_tfr_reader *r, ember_tfr_stats *out);
const char *ember_tfr_reader_name(const ember_tfr_reader *r);
void ember_tfr_reader_destroy(ember_tfr_reader *r); /* accepts NULL */

typedef struct ember_tfr_writer ember_tfr_writer;

/* level: zlib level 0..9, or -1 for the default (ignored when plain).  The fd
 * stays the caller's. */
int ember_tfr_writer_open_fd(ember_tfr_writer **out, int fd, const char *name,
                             int compression, int level);
/* Creates or truncates path (mode 0644); the writer owns the descriptor. */
int ember_tfr_writer_open_path(ember_tfr_writer **out, const char *path,
                               int compression, int level);
/* Writes into memory; get the bytes with ember_tfr_writer_mem after close. */
int ember_tfr_writer_open_mem(ember_tfr_writer **out, int compression, int level);
/* Writes through a sink (io.h), e.g. an HDFS upload: write(opaque, ...)
 * takes the bytes as they are produced (in chunks of up to 1 MiB);
 * ember_tfr_writer_close then calls finish(opaque) (may be NULL), whose
 * status becomes close's (it completes the sink: the output is whole only
 * if close returns EMBER_OK).  The writer owns opaque: destroy calls
 * release(opaque) (may be NULL) unless finish was called; so does a failed
 * open.  name (copied) names the sink in errors. */
int ember_tfr_writer_open_fn(ember_tfr_writer **out, ember_write_fn write,
                             int (*finish)(void *), void (*release)(void *), void *opaque,
                             const char *name, int compression, int level);

/* Appends one record (len <= EMBER_TFR_ABSOLUTE_MAX_RECORD). */
int ember_tfr_writer_write(ember_tfr_writer *w, const void *data, size_t len);
/* Hands everything buffered to the descriptor (a zlib sync flush when
 * compressed).  Not needed before close. */
int ember_tfr_writer_flush(ember_tfr_writer *w);
/* Ends the stream (compression trailer) and writes everything out; for a
 * path writer also closes the file (reporting close errors).  Later writes
 * fail with EMBER_ESTATE. */
int ember_tfr_writer_close(ember_tfr_writer *w);
/* A memory writer's bytes, valid until destroy; EMBER_ESTATE before close. */
int ember_tfr_writer_mem(const ember_tfr_writer *w, const uint8_t **data, size_t *len);
/* Records and (compressed) bytes written so far. */
uint64_t ember_tfr_writer_records(const ember_tfr_writer *w);
uint64_t ember_tfr_writer_bytes(const ember_tfr_writer *w);
/* Frees w; without a successful close, the output may be incomplete. */
void ember_tfr_writer_destroy(ember_tfr_writer *w);

/* Framing helpers: the 12-byte header of a record of `len` bytes, and the
 * 4-byte footer of data[0..len). */
void ember_tfr_encode_header(uint8_t out[EMBER_TFR_HEADER_LEN], uint64_t len);
void ember_tfr_encode_footer(uint8_t out[EMBER_TFR_FOOTER_LEN], const void *data,
                             size_t len);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_TFRECORD_H */
