/* ps_table.h - internal: one shard's part of a parameter-server table (ps.h):
 * its rows, their optimizer state, the update rules and the checkpoint
 * encoding.  No I/O here.  ps_server.c holds each table's reader-writer
 * lock around every call: shared for ember__ps_table_read and
 * ember__ps_table_push_held, which change no table structure and may run on
 * several threads at once; exclusive for every other call.  Those two copy
 * and update each row under a spinlock of the table's own (a stripe of
 * slots), so rows are never read or written half-updated.
 *
 * Storage.  Each held row is one slot: the row id, Adam's step count and
 * cols x (1 + state) floats, the values first, then the optimizer's state
 * (MOMENTUM: velocity; ADAGRAD: accumulator; ADAM: m then v).  DENSE tables
 * hold their shard's contiguous row range from creation; SPARSE tables map
 * row ids to slots with an open-addressing hash table and create a slot the
 * first time a row is pulled or pushed.  A new row's values are
 * ember__ps_init_value(spec, row, col) (state zero; Adagrad's accumulator
 * initial_accumulator).
 *
 * Checkpoint encoding (ember__ps_table_encode/_decode; ps_server.c frames a
 * shard's tables in one file): little-endian,
 *   str name (u32 length + bytes), u32 layout, u64 rows, u32 cols,
 *   u32 optimizer kind, 6 x f32 (learning_rate, momentum, beta1, beta2,
 *   epsilon, initial_accumulator), u32 init, f32 init_scale, u64 seed,
 *   u64 row_begin, u64 row_end (the shard's range; sparse: 0, rows),
 *   u64 held, then held x (u64 row, u64 steps, cols x (1 + state) f32).
 * Decoding bounds every length and count by the bytes left (nanopb's
 * bytes_left) and refuses rows outside the table or the shard's range.
 *
 * Thread-safety: as above; the caller's lock orders everything else. */
#ifndef EMBER_PS_TABLE_H
#define EMBER_PS_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "ember/ps.h"
#include "ember/wire.h"

typedef struct ember__ps_table ember__ps_table;

/* The spec with defaults filled in (Adam's betas, epsilon) and checked:
 * EMBER_EINVAL naming the field for an empty or too long name, an unknown
 * layout/optimizer/init, cols 0 or over EMBER_PS_MAX_COLS, rows 0, or a
 * negative or non-finite learning rate, a momentum outside [0, 1], betas
 * outside (0, 1), or a negative or non-finite epsilon, accumulator or
 * init_scale.  Fields the optimizer or init does not use are zeroed, so two
 * declares that differ only there are the same table (normalising twice
 * changes nothing).  The name is copied into name_buf (EMBER_PS_NAME_MAX)
 * and out->name points at it. */
int ember__ps_spec_normalize(const ember_ps_table_spec *in, ember_ps_table_spec *out,
                             char *name_buf);

/* 1 if a and b (normalised) describe the same table; else 0 and, in
 * why[cap], what differs with both values ("cols 64 here, 32 asked"). */
int ember__ps_spec_same(const ember_ps_table_spec *a, const ember_ps_table_spec *b,
                        char *why, size_t cap);

/* Floats of optimizer state per value (0 SGD, 1 MOMENTUM/ADAGRAD, 2 ADAM). */
uint32_t ember__ps_state_per_value(uint32_t optimizer_kind);

/* The initial value of (row, col): a pure function of the spec's init,
 * init_scale and seed and of row and col. */
float ember__ps_init_value(const ember_ps_table_spec *spec, uint64_t row, uint32_t col);

/* The table's shard `shard` of num_shards: a DENSE table allocates its row
 * range (EMBER_ENOMEM naming the table and the bytes when that fails). */
int ember__ps_table_create(ember__ps_table **out, const ember_ps_table_spec *spec,
                           uint32_t shard, uint32_t num_shards);
void ember__ps_table_destroy(ember__ps_table *t); /* accepts NULL */

const ember_ps_table_spec *ember__ps_table_spec(const ember__ps_table *t);
uint64_t ember__ps_table_held(const ember__ps_table *t); /* rows materialised */

/* Copies rows ids[0..n) (n x cols floats) into out, creating absent sparse
 * rows.  EMBER_EINVAL naming the table, the shard and the row when a row is
 * >= rows or not in this shard (DENSE range / SPARSE hash). */
int ember__ps_table_pull(ember__ps_table *t, const uint64_t *ids, size_t n, float *out);

/* ember__ps_table_pull without creating rows, and without changing t, so
 * several threads may read at once (ps_server.c: under a shared lock):
 * 1 when every row was held and copied, 0 when one is not held yet (out
 * then holds some rows; pull again), or the errors of pull. */
int ember__ps_table_read(const ember__ps_table *t, const uint64_t *ids, size_t n,
                         float *out);

/* Applies gradients grads (n x cols, row i for ids[i], in order) with the
 * table's optimizer; the same row checks as pull, all made before any row
 * changes (a refused push changes nothing). */
int ember__ps_table_push(ember__ps_table *t, const uint64_t *ids, size_t n, const float *grads);

/* ember__ps_table_push for rows already held, under the caller's shared
 * lock, beside reads and other such pushes: 1 when every row was held and
 * updated, 0 when one is not held yet (nothing changed: push, exclusively),
 * or the errors of push.  slots: n entries of the caller's, used here. */
int ember__ps_table_push_held(ember__ps_table *t, const uint64_t *ids, size_t n,
                              const float *grads, size_t *slots);

/* Sets the values of rows ids[0..n) (n x cols, in order; the last wins for
 * a row named twice), leaving their optimizer state and step counts: how a
 * chief puts its model's initial weights on the servers.  untrained_only:
 * only rows no push has reached (step count 0), so a restarted job's chief
 * leaves what a checkpoint restored.  The same checks as push. */
int ember__ps_table_assign(ember__ps_table *t, const uint64_t *ids, size_t n,
                           const float *values, int untrained_only);

/* The table in checkpoint encoding, appended to w. */
void ember__ps_table_encode(const ember__ps_table *t, ember_wire_writer *w);

/* A table from its checkpoint encoding, read from r (which advances);
 * EMBER_ECORRUPT with the reason when r holds something else, or when the
 * table was written by another shard (shard / num_shards given here). */
int ember__ps_table_decode(ember_wire_reader *r, uint32_t shard, uint32_t num_shards,
                           ember__ps_table **out);

#endif /* EMBER_PS_TABLE_H */
