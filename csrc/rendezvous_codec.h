/* rendezvous_codec.h - internal: payload codecs of the rendezvous messages
 * (layouts documented in ember/rendezvous.h), shared by rendezvous_server.c,
 * rendezvous_client.c and the fuzz harness.  Not installed; ember__ names.
 *
 * Every decoder bounds every count and string before using it and returns
 * EMBER_EPROTO with a message naming the field; none reads out of bounds.
 * Thread-safety: pure functions. */
#ifndef EMBER_RENDEZVOUS_CODEC_H
#define EMBER_RENDEZVOUS_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "ember/rendezvous.h"
#include "ember/wire.h"

/* Largest encodings, used as receive limits.  A row: u32 index, str host,
 * str executor_id, u32 pid, u32 nports, u16 ports[], str role, u32 task. */
#define EMBER__RDV_ROW_MAX                                                  \
  (4u + (4u + EMBER_RDV_HOST_MAX - 1u) + (4u + EMBER_RDV_ID_MAX - 1u) + 4u + \
   4u + 2u * EMBER_RDV_MAX_PORTS + (4u + EMBER_RDV_ROLE_MAX - 1u) + 4u)
/* The smallest possible row (all strings empty, no ports): bounds a claimed
 * row count by the bytes actually present before anything is allocated. */
#define EMBER__RDV_ROW_MIN (4u + 4u + 4u + 4u + 4u + 4u + 4u)
#define EMBER__RDV_REGISTER_MAX                                            \
  (4u + (4u + EMBER_RDV_HOST_MAX - 1u) + (4u + EMBER_RDV_ID_MAX - 1u) + 4u + \
   4u + 2u * EMBER_RDV_MAX_PORTS)
#define EMBER__RDV_SPEC_MAX (8u + EMBER_RDV_MAX_NODES * EMBER__RDV_ROW_MAX)
#define EMBER__RDV_REPORT_MAX (12u + EMBER_RDV_TEXT_MAX)
/* REFUSED reasons are short sentences; longer ones are cut. */
#define EMBER__RDV_REASON_MAX 1024u

/* REGISTER: u32 index, str host, str executor_id, u32 pid, u32 nports,
 * u16 ports[nports].  role/task_index of n are ignored. */
int ember__rdv_encode_register(ember_wire_writer *w, const ember_rdv_node *n);
/* Fills *out (role "" and task_index 0). */
int ember__rdv_decode_register(const uint8_t *p, size_t len, ember_rdv_node *out);

/* The part of SPEC shared by every node: u32 count, then count rows.  The
 * server builds it once and sends it after each node's own u32 your_index. */
int ember__rdv_encode_spec_table(ember_wire_writer *w, const ember_rdv_node *nodes,
                                 uint32_t count);
/* Decodes a whole SPEC payload.  Checks that rows are in index order
 * (row i has index i) and your_index < count.  *nodes is malloc'd. */
int ember__rdv_decode_spec(const uint8_t *p, size_t len, uint32_t *your_index,
                           ember_rdv_node **nodes, uint32_t *count);

/* REPORT: u32 kind, i32 code, str text (text_len bytes, <= TEXT_MAX). */
int ember__rdv_encode_report(ember_wire_writer *w, uint32_t kind, int32_t code,
                             const char *text, size_t text_len);
/* *text is malloc'd and NUL-terminated, or NULL for an empty text. */
int ember__rdv_decode_report(const uint8_t *p, size_t len, uint32_t *kind,
                             int32_t *code, char **text);

/* REFUSED: u32 status, str reason.  *status is the sender's code if it is a
 * known negative EMBER_E* code, else EMBER_EPROTO. */
int ember__rdv_encode_refused(ember_wire_writer *w, int status, const char *reason);
int ember__rdv_decode_refused(const uint8_t *p, size_t len, int *status, char *reason,
                              size_t cap);

/* Fills role and task_index of nodes[0..n) (index order) by the rule in
 * rendezvous.h.  EMBER_EINVAL if num_ps + has_chief + has_evaluator > n. */
int ember__rdv_assign_roles(ember_rdv_node *nodes, uint32_t n, uint32_t num_ps,
                            int has_chief, int has_evaluator);

#endif /* EMBER_RENDEZVOUS_CODEC_H */
