/* ps_internal.h - internal: the parameter server's request codec (ps.h,
 * "Wire"), shared by ps_client.c, which writes requests, and ps_server.c,
 * which reads them; the decoders bound every count by the bytes left and
 * are what fuzz_ps_wire feeds untrusted bytes to.
 *
 * Floats travel as little-endian IEEE-754 float32 (the hosts Ember builds
 * for are little-endian; ember/wire.h's integers are explicit either way). */
#ifndef EMBER_PS_INTERNAL_H
#define EMBER_PS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "ember/ps.h"
#include "ember/wire.h"

/* The first row shard k of n holds of a DENSE table of `rows` rows
 * (k == n: rows).  Shard k holds [begin(k), begin(k+1)). */
uint64_t ember__ps_dense_begin(uint64_t rows, uint32_t k, uint32_t n);

/* PS_DECLARE: a table spec.  Decoding copies the name into name_buf
 * (EMBER_PS_NAME_MAX) and points spec->name at it; the spec is not
 * validated here (ember__ps_spec_normalize does). */
void ember__ps_encode_spec(ember_wire_writer *w, const ember_ps_table_spec *spec);
int ember__ps_decode_spec(const uint8_t *p, size_t len, ember_ps_table_spec *spec,
                          char *name_buf);
/* The spec's fields from r, which advances (a read past the end sets
 * r->err): what the decoder above and a checkpoint's table (ps_table.c)
 * read. */
void ember__ps_read_spec(ember_wire_reader *r, ember_ps_table_spec *spec, char *name_buf);

/* PS_PULL: str table, u64 clock, u32 wait_ms, u8 whole, u32 n, then (unless
 * whole) n x u64 row.  ids points into the payload (read with
 * ember_wire_get_u64). */
typedef struct {
  char table[EMBER_PS_NAME_MAX];
  uint64_t clock;
  uint32_t wait_ms;
  int whole;
  uint32_t n;
  const uint8_t *ids;
} ember__ps_pull_req;
int ember__ps_decode_pull(const uint8_t *p, size_t len, ember__ps_pull_req *out);

/* PS_PUSH: str table, u8 whole, u32 n, u32 cols, (unless whole) n x u64
 * row, then n x cols f32.  grads points into the payload (unaligned). */
typedef struct {
  char table[EMBER_PS_NAME_MAX];
  int whole;
  uint32_t n, cols;
  const uint8_t *ids;
  const uint8_t *grads;
} ember__ps_push_req;
int ember__ps_decode_push(const uint8_t *p, size_t len, ember__ps_push_req *out);

#endif /* EMBER_PS_INTERNAL_H */
