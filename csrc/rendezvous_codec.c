/* rendezvous_codec.c - REGISTER / SPEC / REPORT / REFUSED payload codecs.
 *
 * Fixed little-endian fields and length-prefixed strings only (no pickle, no
 * JSON); decoders bound every string by the destination's capacity and every
 * count by the bytes actually present. */
#include "rendezvous_codec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ember/error.h"

static void write_row_common(ember_wire_writer *w, const ember_rdv_node *n) {
  ember_wire_write_u32(w, n->index);
  ember_wire_write_str(w, n->host);
  ember_wire_write_str(w, n->executor_id);
  ember_wire_write_u32(w, n->pid);
  ember_wire_write_u32(w, n->num_ports);
  for (uint32_t i = 0; i < n->num_ports && i < EMBER_RDV_MAX_PORTS; i++)
    ember_wire_write_u16(w, n->ports[i]);
}

/* Strings in the struct are fixed arrays: insist they are terminated so
 * strlen in the writer cannot run past them. */
static int check_node(const ember_rdv_node *n) {
  if (memchr(n->host, 0, sizeof n->host) == NULL ||
      memchr(n->executor_id, 0, sizeof n->executor_id) == NULL ||
      memchr(n->role, 0, sizeof n->role) == NULL)
    return ember__set_error(EMBER_EINVAL, "node %u: unterminated string field",
                            (unsigned)n->index);
  if (n->num_ports > EMBER_RDV_MAX_PORTS)
    return ember__set_error(EMBER_EINVAL, "node %u: %u ports (at most %u)",
                            (unsigned)n->index, (unsigned)n->num_ports,
                            (unsigned)EMBER_RDV_MAX_PORTS);
  return EMBER_OK;
}

static void read_row_common(ember_wire_reader *r, ember_rdv_node *n) {
  n->index = ember_wire_read_u32(r);
  ember_wire_read_str(r, n->host, sizeof n->host);
  ember_wire_read_str(r, n->executor_id, sizeof n->executor_id);
  n->pid = ember_wire_read_u32(r);
  n->num_ports = ember_wire_read_u32(r);
  if (r->err) return;
  if (n->num_ports > EMBER_RDV_MAX_PORTS) {
    r->err = ember__set_error(EMBER_EPROTO, "node %u claims %u ports (at most %u)",
                              (unsigned)n->index, (unsigned)n->num_ports,
                              (unsigned)EMBER_RDV_MAX_PORTS);
    n->num_ports = 0;
    return;
  }
  for (uint32_t i = 0; i < n->num_ports; i++) n->ports[i] = ember_wire_read_u16(r);
}

int ember__rdv_encode_register(ember_wire_writer *w, const ember_rdv_node *n) {
  if (w == NULL || n == NULL) return ember__set_error(EMBER_EINVAL, "encode REGISTER: NULL");
  int rc = check_node(n);
  if (rc != EMBER_OK) return rc;
  write_row_common(w, n);
  return w->err;
}

int ember__rdv_decode_register(const uint8_t *p, size_t len, ember_rdv_node *out) {
  ember_wire_reader r;
  memset(out, 0, sizeof *out);
  ember_wire_reader_init(&r, p, len);
  read_row_common(&r, out);
  return ember_wire_reader_finish(&r, 1, "REGISTER payload");
}

int ember__rdv_encode_spec_table(ember_wire_writer *w, const ember_rdv_node *nodes,
                                 uint32_t count) {
  if (w == NULL || (nodes == NULL && count > 0))
    return ember__set_error(EMBER_EINVAL, "encode SPEC: NULL");
  ember_wire_write_u32(w, count);
  for (uint32_t i = 0; i < count; i++) {
    int rc = check_node(&nodes[i]);
    if (rc != EMBER_OK) return rc;
    write_row_common(w, &nodes[i]);
    ember_wire_write_str(w, nodes[i].role);
    ember_wire_write_u32(w, nodes[i].task_index);
  }
  return w->err;
}

int ember__rdv_decode_spec(const uint8_t *p, size_t len, uint32_t *your_index,
                           ember_rdv_node **nodes, uint32_t *count) {
  ember_wire_reader r;
  ember_rdv_node *t = NULL;
  int rc = EMBER_OK;
  *nodes = NULL;
  *count = 0;
  *your_index = 0;
  ember_wire_reader_init(&r, p, len);
  uint32_t me = ember_wire_read_u32(&r);
  uint32_t n = ember_wire_read_u32(&r);
  if (r.err) goto finish;
  if (n == 0 || n > EMBER_RDV_MAX_NODES || n > r.left / EMBER__RDV_ROW_MIN) {
    rc = ember__set_error(EMBER_EPROTO,
                          "malformed SPEC payload: %u rows cannot fit in %zu bytes "
                          "(or exceed %u)",
                          (unsigned)n, r.left, (unsigned)EMBER_RDV_MAX_NODES);
    goto done;
  }
  if (me >= n) {
    rc = ember__set_error(EMBER_EPROTO, "malformed SPEC payload: your_index %u >= count %u",
                          (unsigned)me, (unsigned)n);
    goto done;
  }
  /* n <= 65536 and sizeof(ember_rdv_node) < 1 KiB: no overflow in calloc. */
  t = calloc(n, sizeof *t);
  if (t == NULL) {
    rc = ember__set_error(EMBER_ENOMEM, "decode SPEC: out of memory for %u rows",
                          (unsigned)n);
    goto done;
  }
  for (uint32_t i = 0; i < n && !r.err; i++) {
    read_row_common(&r, &t[i]);
    ember_wire_read_str(&r, t[i].role, sizeof t[i].role);
    t[i].task_index = ember_wire_read_u32(&r);
    if (!r.err && t[i].index != i) {
      rc = ember__set_error(EMBER_EPROTO,
                            "malformed SPEC payload: row %u has node index %u "
                            "(rows must be in index order)",
                            (unsigned)i, (unsigned)t[i].index);
      goto done;
    }
  }
finish:
  rc = ember_wire_reader_finish(&r, 1, "SPEC payload");
  if (rc != EMBER_OK) goto done;
  *nodes = t;
  *count = n;
  *your_index = me;
  t = NULL;
done:
  free(t);
  return rc;
}

int ember__rdv_encode_report(ember_wire_writer *w, uint32_t kind, int32_t code,
                             const char *text, size_t text_len) {
  if (w == NULL || (text == NULL && text_len > 0))
    return ember__set_error(EMBER_EINVAL, "encode REPORT: NULL");
  if (text_len > EMBER_RDV_TEXT_MAX) text_len = EMBER_RDV_TEXT_MAX;
  ember_wire_write_u32(w, kind);
  ember_wire_write_u32(w, (uint32_t)code);
  ember_wire_write_u32(w, (uint32_t)text_len);
  ember_wire_write_raw(w, text, text_len);
  return w->err;
}

int ember__rdv_decode_report(const uint8_t *p, size_t len, uint32_t *kind,
                             int32_t *code, char **text) {
  ember_wire_reader r;
  const uint8_t *raw = NULL;
  *text = NULL;
  ember_wire_reader_init(&r, p, len);
  *kind = ember_wire_read_u32(&r);
  *code = (int32_t)ember_wire_read_u32(&r);
  uint32_t n = ember_wire_read_u32(&r);
  if (!r.err && n > EMBER_RDV_TEXT_MAX)
    r.err = ember__set_error(EMBER_EPROTO, "text of %u bytes exceeds the limit of %u",
                             (unsigned)n, (unsigned)EMBER_RDV_TEXT_MAX);
  ember_wire_read_raw(&r, &raw, n);
  if (!r.err && n > 0 && memchr(raw, 0, n) != NULL)
    r.err = ember__set_error(EMBER_EPROTO, "text contains a NUL byte");
  int rc = ember_wire_reader_finish(&r, 1, "REPORT payload");
  if (rc != EMBER_OK) return rc;
  if (*kind < EMBER_RDV_REPORT_PROGRESS || *kind > EMBER_RDV_REPORT_FAILED)
    return ember__set_error(EMBER_EPROTO, "malformed REPORT payload: unknown kind %u",
                            (unsigned)*kind);
  if (n > 0) {
    char *s = malloc((size_t)n + 1);
    if (s == NULL)
      return ember__set_error(EMBER_ENOMEM, "decode REPORT: out of memory (%u bytes)",
                              (unsigned)n);
    memcpy(s, raw, n);
    s[n] = '\0';
    *text = s;
  }
  return EMBER_OK;
}

int ember__rdv_encode_refused(ember_wire_writer *w, int status, const char *reason) {
  if (reason == NULL) reason = "";
  size_t n = strlen(reason);
  if (n > EMBER__RDV_REASON_MAX) n = EMBER__RDV_REASON_MAX;
  ember_wire_write_u32(w, (uint32_t)(int32_t)status);
  ember_wire_write_u32(w, (uint32_t)n);
  ember_wire_write_raw(w, reason, n);
  return w->err;
}

int ember__rdv_decode_refused(const uint8_t *p, size_t len, int *status, char *reason,
                              size_t cap) {
  ember_wire_reader r;
  ember_wire_reader_init(&r, p, len);
  int32_t st = (int32_t)ember_wire_read_u32(&r);
  ember_wire_read_str(&r, reason, cap);
  int rc = ember_wire_reader_finish(&r, 1, "REFUSED payload");
  if (rc != EMBER_OK) {
    *status = EMBER_EPROTO;
    return rc;
  }
  /* Only pass through codes this build knows, so callers can switch on it. */
  *status = (st < 0 && strcmp(ember_err_name(st), "EMBER_UNKNOWN") != 0) ? st
                                                                          : EMBER_EPROTO;
  return EMBER_OK;
}

int ember__rdv_assign_roles(ember_rdv_node *nodes, uint32_t n, uint32_t num_ps,
                            int has_chief, int has_evaluator) {
  uint64_t special = (uint64_t)num_ps + (has_chief ? 1 : 0) + (has_evaluator ? 1 : 0);
  if (special > n)
    return ember__set_error(EMBER_EINVAL,
                            "%u nodes cannot hold %u ps%s%s", (unsigned)n,
                            (unsigned)num_ps, has_chief ? " + chief" : "",
                            has_evaluator ? " + evaluator" : "");
  uint32_t i = 0, worker = 0;
  for (; i < num_ps; i++) {
    snprintf(nodes[i].role, sizeof nodes[i].role, "ps");
    nodes[i].task_index = i;
  }
  if (has_chief) {
    snprintf(nodes[i].role, sizeof nodes[i].role, "chief");
    nodes[i++].task_index = 0;
  }
  if (has_evaluator) {
    snprintf(nodes[i].role, sizeof nodes[i].role, "evaluator");
    nodes[i++].task_index = 0;
  }
  for (; i < n; i++) {
    snprintf(nodes[i].role, sizeof nodes[i].role, "worker");
    nodes[i].task_index = worker++;
  }
  return EMBER_OK;
}
