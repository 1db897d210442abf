/* feed_internal.h - pieces the feed's codec, server and client share
 * (not public; ember/feed.h and ember/batch.h are the contract). */
#ifndef EMBER_FEED_INTERNAL_H
#define EMBER_FEED_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "ember/batch.h"
#include "ember/feed.h"
#include "ember/shm_ring.h"

#define FEED_DEFAULT_QUEUE (64u * 1024u * 1024u)
#define FEED_DEFAULT_MAX_FRAME (256u * 1024u * 1024u)
#define FEED_DEFAULT_IO_MS 600000u
/* Payload limit of every frame but BATCH/RESULTS (HELLO, AUTH, ACK, ...). */
#define FEED_CTL_MAX 4096u
#define FEED_REASON_MAX 1024u

#define FEED_DEFAULT_RING (1u * 1024u * 1024u)
/* FEED_SHM payload: host id, pid, fd, segment bytes, token */
#define FEED_SHM_REQ_LEN (16u + EMBER_SHM_RING_DESC_WIRE_LEN) /* host id, ring */

/* ---- batch codec pieces (batch.c) ---- */

/* Validates the caller's columns and computes the layout: *desc_end is the
 * offset just past the last descriptor, *total the encoded size.  It is
 * ember__batch_shape_layout with pointers, then ember__batch_check_content. */
int ember__batch_layout(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                        size_t *desc_end, size_t *total);
/* The layout from the columns' shapes alone (dtype, width, name, data_len):
 * what an in-place writer needs before the data exists.  with_pointers: also
 * require data (and BYTES offsets) to be set. */
int ember__batch_shape_layout(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                              int with_pointers, size_t *desc_end, size_t *total);
/* The checks that read the data: BYTES offsets and BOOL values. */
int ember__batch_check_content(const ember_column *cols, uint32_t ncols, uint32_t nrows);
/* Writes the 8-byte header and the descriptors (not the padding) to out. */
void ember__batch_write_descriptors(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                                    uint8_t *out);
/* Zeroes the padding from end (the previous column's end, or the end of the
 * descriptors) and sets where column c's offsets (BYTES) and data go in
 * out; returns the column's end. */
size_t ember__batch_place_column(const ember_column *c, uint32_t nrows, uint8_t *out,
                                 size_t end, ember_batch_place *place);
/* Writes a batch whose layout ember__batch_layout has checked; returns its size. */
size_t ember__batch_encode_checked(const ember_column *cols, uint32_t ncols, uint32_t nrows,
                                   size_t desc_end, uint8_t *out);

/* ---- shared by server and client (feed_common.c) ---- */

/* Absolute deadline; a negative timeout means "no limit". */
int64_t ember__feed_deadline(int64_t timeout_ms);
/* 1 if code is one of the EMBER_E* values (for statuses read off the wire). */
int ember__feed_known_status(int32_t code);
/* This host's identity for FEED_SHM (see feed_common.c), all zero when unknown. */
void ember__feed_host_id(uint8_t out[16]);
/* EMBER_FEED_SHM=0 (or "false", "no", "off") turns shared memory off. */
int ember__feed_env_shm_enabled(void);
/* EMBER_FEED_SHM_BYTES, else FEED_DEFAULT_RING. */
size_t ember__feed_env_ring_bytes(void);

#endif /* EMBER_FEED_INTERNAL_H */
