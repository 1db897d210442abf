/* ember/io.h - the byte-source interface readers plug into.
 *
 * A source is a function plus an opaque pointer.  The TFRecord reader
 * (tfrecord.h) reads files, memory, or any such source; other modules (e.g.
 * a WebHDFS client) provide sources by implementing ember_read_fn.
 *
 * Contract of an ember_read_fn:
 *  - Reads up to n (> 0) bytes into buf and returns how many it read; 0 means
 *    end of stream (it will not be called again), a short count is allowed.
 *  - On failure returns a negative EMBER_E* code and sets the thread's last
 *    error (ember__set_error), e.g. "webhdfs GET /data/x: connection reset".
 *  - May block; bounding the wait (its own timeout) is the source's job, the
 *    reader has no clock of its own.
 *  - Is called only from the thread using the reader that owns it; the reader
 *    never frees `opaque` (the source's creator does, after the reader is
 *    destroyed).
 */
#ifndef EMBER_IO_H
#define EMBER_IO_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Reads up to n bytes into buf. Returns the count read (0 = end of stream) or a negative EMBER_E* code
   (with the last-error message set). */
typedef int64_t (*ember_read_fn)(void *opaque, void *buf, size_t n);

/* The other direction, for writers (e.g. ember_tfr_writer_open_fn): takes
   all n bytes of buf, or fails with a negative EMBER_E* code (and the
   last-error message set).  Returns 0 on success.  Same threading rule. */
typedef int (*ember_write_fn)(void *opaque, const void *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* EMBER_IO_H */
