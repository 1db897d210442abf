/* ps_codec.c - the parameter server's request codec (ps_internal.h). */
#include <string.h>

#include "ember/error.h"
#include "ps_internal.h"

uint64_t ember__ps_dense_begin(uint64_t rows, uint32_t k, uint32_t n) {
  if (n == 0 || k >= n) return rows;
  return (uint64_t)(((unsigned __int128)rows * k) / n);
}

static void write_f32(ember_wire_writer *w, float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  ember_wire_write_u32(w, u);
}

static float read_f32(ember_wire_reader *r) {
  uint32_t u = ember_wire_read_u32(r);
  float v;
  memcpy(&v, &u, sizeof v);
  return v;
}

void ember__ps_encode_spec(ember_wire_writer *w, const ember_ps_table_spec *spec) {
  const ember_ps_optimizer *o = &spec->optimizer;
  ember_wire_write_str(w, spec->name ? spec->name : "");
  ember_wire_write_u32(w, spec->layout);
  ember_wire_write_u64(w, spec->rows);
  ember_wire_write_u32(w, spec->cols);
  ember_wire_write_u32(w, o->kind);
  write_f32(w, o->learning_rate);
  write_f32(w, o->momentum);
  write_f32(w, o->beta1);
  write_f32(w, o->beta2);
  write_f32(w, o->epsilon);
  write_f32(w, o->initial_accumulator);
  ember_wire_write_u32(w, spec->init);
  write_f32(w, spec->init_scale);
  ember_wire_write_u64(w, spec->seed);
}

void ember__ps_read_spec(ember_wire_reader *r, ember_ps_table_spec *spec, char *name_buf) {
  ember_ps_optimizer *o = &spec->optimizer;
  memset(spec, 0, sizeof *spec);
  ember_wire_read_str(r, name_buf, EMBER_PS_NAME_MAX);
  spec->name = name_buf;
  spec->layout = ember_wire_read_u32(r);
  spec->rows = ember_wire_read_u64(r);
  spec->cols = ember_wire_read_u32(r);
  o->kind = ember_wire_read_u32(r);
  o->learning_rate = read_f32(r);
  o->momentum = read_f32(r);
  o->beta1 = read_f32(r);
  o->beta2 = read_f32(r);
  o->epsilon = read_f32(r);
  o->initial_accumulator = read_f32(r);
  spec->init = ember_wire_read_u32(r);
  spec->init_scale = read_f32(r);
  spec->seed = ember_wire_read_u64(r);
}

int ember__ps_decode_spec(const uint8_t *p, size_t len, ember_ps_table_spec *spec,
                          char *name_buf) {
  ember_wire_reader r;
  ember_wire_reader_init(&r, p, len);
  ember__ps_read_spec(&r, spec, name_buf);
  return ember_wire_reader_finish(&r, 1, "PS_DECLARE");
}

int ember__ps_decode_pull(const uint8_t *p, size_t len, ember__ps_pull_req *out) {
  ember_wire_reader r;
  memset(out, 0, sizeof *out);
  ember_wire_reader_init(&r, p, len);
  ember_wire_read_str(&r, out->table, sizeof out->table);
  out->clock = ember_wire_read_u64(&r);
  out->wait_ms = ember_wire_read_u32(&r);
  out->whole = ember_wire_read_u8(&r) != 0;
  out->n = ember_wire_read_u32(&r);
  if (!r.err && !out->whole) {
    if ((uint64_t)out->n * 8 > r.left)
      return ember__set_error(EMBER_EPROTO, "PS_PULL names %u rows in %zu bytes", out->n, r.left);
    ember_wire_read_raw(&r, &out->ids, (size_t)out->n * 8);
  }
  return ember_wire_reader_finish(&r, 1, "PS_PULL");
}

int ember__ps_decode_push(const uint8_t *p, size_t len, ember__ps_push_req *out) {
  ember_wire_reader r;
  memset(out, 0, sizeof *out);
  ember_wire_reader_init(&r, p, len);
  ember_wire_read_str(&r, out->table, sizeof out->table);
  out->whole = ember_wire_read_u8(&r) != 0;
  out->n = ember_wire_read_u32(&r);
  out->cols = ember_wire_read_u32(&r);
  if (!r.err) {
    if (out->cols > EMBER_PS_MAX_COLS)
      return ember__set_error(EMBER_EPROTO, "PS_PUSH: rows of %u floats (at most %u)", out->cols,
                              EMBER_PS_MAX_COLS);
    uint64_t id_bytes = out->whole ? 0 : (uint64_t)out->n * 8;
    uint64_t grad_bytes = (uint64_t)out->n * out->cols * 4; /* < 2^54 */
    if (id_bytes + grad_bytes != r.left)
      return ember__set_error(EMBER_EPROTO,
                              "PS_PUSH of %u rows x %u floats%s needs %llu bytes, the frame "
                              "has %zu", out->n, out->cols, out->whole ? "" : " with row ids",
                              (unsigned long long)(id_bytes + grad_bytes), r.left);
    if (id_bytes) ember_wire_read_raw(&r, &out->ids, (size_t)id_bytes);
    if (grad_bytes) ember_wire_read_raw(&r, &out->grads, (size_t)grad_bytes);
  }
  return ember_wire_reader_finish(&r, 1, "PS_PUSH");
}
