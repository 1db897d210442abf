/* coll_algos.c - the collective's algorithms (see coll_algos.h). */
#include "coll_algos.h"

#include <stdlib.h>

#include "ember/error.h"

/* Segment k of n of a buffer of count elements: balanced in whole 64-byte
 * units (the elements left over go to the last segment), so that every
 * segment starts on a 64-byte boundary of the buffer, as every payload
 * starts on one of its stream (hdr_len).  seg_off(.., n, ..) is the end. */
static size_t seg_off(size_t count, uint32_t n, uint32_t k, size_t esz) {
  if (k >= n) return count * esz;
  size_t unit = COLL_STREAM_ALIGN / esz; /* elements of 4 or 8 bytes */
  size_t units = count / unit, base = units / n, rem = units % n;
  return (base * k + (k < rem ? k : rem)) * unit * esz;
}

/* The bytes of segments k0..k1-1. */
static size_t seg_span(size_t count, uint32_t n, uint32_t k0, uint32_t k1, size_t esz) {
  return seg_off(count, n, k1, esz) - seg_off(count, n, k0, esz);
}

/* nsteps zeroed steps, or NULL with the error set. */
static ember__coll_step *new_steps(ember__coll_op *o, int nsteps) {
  ember__coll_step *st = calloc((size_t)nsteps, sizeof *st);
  if (st == NULL) ember__set_error(EMBER_ENOMEM, "%s: out of memory", ember__coll_op_name(o));
  return st;
}

/* Runs steps st[0..nsteps) on buf around the ring (sending to the next rank,
 * receiving from the previous one) and frees them. */
static int around_ring(ember__coll_op *o, ember__coll_step *st, int nsteps, uint8_t *buf) {
  ember_comm *c = o->c;
  uint32_t n = c->size, r = c->rank;
  int rc = ember__coll_run_steps(o, 0, &c->peers[(r + 1) % n], &c->peers[(r + n - 1) % n], buf,
                                 buf, st, nsteps);
  free(st);
  return rc;
}

int ember__coll_ring_allreduce(ember__coll_op *o, uint8_t *buf, size_t count) {
  uint32_t n = o->c->size, r = o->c->rank;
  int nsteps = 2 * (int)(n - 1);
  ember__coll_step *st = new_steps(o, nsteps);
  if (st == NULL) return EMBER_ENOMEM;
  for (int s = 0; s < nsteps; s++) {
    uint32_t send_seg, recv_seg;
    if (s < (int)n - 1) { /* reduce-scatter */
      send_seg = (r + n - (uint32_t)s % n) % n;
      recv_seg = (r + 2 * n - (uint32_t)s - 1) % n;
      st[s].reduce = 1;
      st[s].scale = (s == (int)n - 2) && o->op == EMBER_RED_AVG;
    } else { /* allgather */
      uint32_t a = (uint32_t)s - (n - 1);
      send_seg = (r + 1 + n - a) % n;
      recv_seg = (r + n - a) % n;
    }
    st[s].send_off = seg_off(count, n, send_seg, o->esz);
    st[s].send_len = seg_span(count, n, send_seg, send_seg + 1, o->esz);
    st[s].recv_off = seg_off(count, n, recv_seg, o->esz);
    st[s].recv_len = seg_span(count, n, recv_seg, recv_seg + 1, o->esz);
    st[s].gate = s - 1;
  }
  return around_ring(o, st, nsteps, buf);
}

/* One full-buffer exchange with `partner` (to and/or from). */
static int exchange(ember__coll_op *o, int step_id, ember__coll_peer *to,
                    ember__coll_peer *from, const uint8_t *sbuf, uint8_t *rbuf, size_t len) {
  ember__coll_step st = {.send_off = 0, .send_len = to ? len : 0, .recv_off = 0,
                         .recv_len = from ? len : 0, .gate = -1};
  return ember__coll_run_steps(o, step_id, to, from, sbuf, rbuf, &st, 1);
}

/* Recursive doubling, with the usual fold for a non power of two: ranks
 * >= p2 hand their data to rank - p2 first and get the result back last. */
int ember__coll_rd_allreduce(ember__coll_op *o, uint8_t *buf, size_t len) {
  ember_comm *c = o->c;
  uint32_t n = c->size, r = c->rank, p2 = 1;
  int rc, step = 0, logp = 0;
  while (p2 * 2 <= n) p2 *= 2, logp++;
  uint32_t extra = n - p2;
  if (r >= p2) {
    ember__coll_peer *partner = &c->peers[r - p2];
    rc = exchange(o, 0, partner, NULL, buf, NULL, len);
    if (rc == EMBER_OK) rc = exchange(o, 1 + logp, NULL, partner, NULL, buf, len);
    return rc;
  }
  if (r < extra) {
    rc = exchange(o, 0, NULL, &c->peers[r + p2], NULL, c->tmp, len);
    if (rc != EMBER_OK) return rc;
    if (o->fn) o->fn(buf, c->tmp, len);
  }
  step = 1;
  for (uint32_t mask = 1; mask < p2; mask <<= 1, step++) {
    ember__coll_peer *partner = &c->peers[r ^ mask];
    rc = exchange(o, step, partner, partner, buf, c->tmp, len);
    if (rc != EMBER_OK) return rc;
    if (o->fn) o->fn(buf, c->tmp, len);
  }
  if (o->op == EMBER_RED_AVG && len > 0) ember__coll_scale_avg(buf, len, o->dtype, n);
  if (r < extra) return exchange(o, step, &c->peers[r + p2], NULL, buf, NULL, len);
  return EMBER_OK;
}

/* Rabenseifner's allreduce: a reduce-scatter by recursive halving, then an
 * allgather by recursive doubling, over the largest power of two of ranks
 * (the others fold in first and get the result last, as in
 * ember__coll_rd_allreduce).
 * Each rank sends what the ring sends, 2(p-1)/p of the buffer, but in
 * 2 log2(p) exchanges with one partner at a time instead of the ring's
 * 2(p-1) steps through every rank: with 4 ranks the ring's chain of 6
 * dependent steps is 4 exchanges.  Block b of the p blocks is reduced on
 * virtual rank b alone, so every rank still ends with the same bits. */
int ember__coll_rh_allreduce(ember__coll_op *o, uint8_t *buf, size_t count) {
  ember_comm *c = o->c;
  uint32_t n = c->size, r = c->rank, p2 = 1;
  int logp = 0, rc;
  while (p2 * 2 <= n) p2 *= 2, logp++;
  uint32_t extra = n - p2;
  size_t esz = o->esz, len = count * esz;
  if (r >= p2) { /* folded in: hand over the whole buffer, get the result */
    ember__coll_peer *partner = &c->peers[r - p2];
    rc = exchange(o, 0, partner, NULL, buf, NULL, len);
    if (rc == EMBER_OK) rc = exchange(o, 1 + 2 * logp, NULL, partner, NULL, buf, len);
    return rc;
  }
  if (r < extra) {
    ember__coll_step fold = {.recv_len = len, .gate = -1, .reduce = 1};
    rc = ember__coll_run_steps(o, 0, NULL, &c->peers[r + p2], NULL, buf, &fold, 1);
    if (rc != EMBER_OK) return rc;
  }
  /* [lo, hi): the blocks of the p2 this rank is responsible for. */
  uint32_t lo = 0, hi = p2;
  int step = 1;
  for (uint32_t mask = p2 / 2; mask >= 1; mask /= 2, step++) {
    uint32_t mid = lo + (hi - lo) / 2;
    int upper = (r & mask) != 0; /* keeps [mid, hi), gives [lo, mid) */
    uint32_t klo = upper ? mid : lo, khi = upper ? hi : mid;
    uint32_t glo = upper ? lo : mid, ghi = upper ? mid : hi;
    ember__coll_step st = {.send_off = seg_off(count, p2, glo, esz),
                           .send_len = seg_span(count, p2, glo, ghi, esz),
                           .recv_off = seg_off(count, p2, klo, esz),
                           .recv_len = seg_span(count, p2, klo, khi, esz),
                           .gate = -1, .reduce = 1};
    ember__coll_peer *partner = &c->peers[r ^ mask];
    rc = ember__coll_run_steps(o, step, partner, partner, buf, buf, &st, 1);
    if (rc != EMBER_OK) return rc;
    lo = klo, hi = khi;
  }
  if (o->op == EMBER_RED_AVG) {
    size_t off = seg_off(count, p2, lo, esz);
    if (seg_off(count, p2, hi, esz) > off)
      ember__coll_scale_avg(buf + off, seg_off(count, p2, hi, esz) - off, o->dtype, n);
  }
  for (uint32_t mask = 1; mask < p2; mask *= 2, step++) {
    uint32_t width = hi - lo;
    uint32_t plo = (r & mask) ? lo - width : hi; /* the partner's blocks, beside ours */
    ember__coll_step st = {.send_off = seg_off(count, p2, lo, esz),
                           .send_len = seg_span(count, p2, lo, hi, esz),
                           .recv_off = seg_off(count, p2, plo, esz),
                           .recv_len = seg_span(count, p2, plo, plo + width, esz),
                           .gate = -1};
    ember__coll_peer *partner = &c->peers[r ^ mask];
    rc = ember__coll_run_steps(o, step, partner, partner, buf, buf, &st, 1);
    if (rc != EMBER_OK) return rc;
    if (plo < lo) lo = plo;
    else hi = plo + width;
  }
  if (r < extra) return exchange(o, step, &c->peers[r + p2], NULL, buf, NULL, len);
  return EMBER_OK;
}

int ember__coll_chain_broadcast(ember__coll_op *o, uint8_t *buf, size_t nbytes) {
  ember_comm *c = o->c;
  uint32_t n = c->size, pos = (c->rank + n - o->root) % n;
  ember__coll_peer *next = pos + 1 < n ? &c->peers[(c->rank + 1) % n] : NULL;
  ember__coll_peer *prev = pos > 0 ? &c->peers[(c->rank + n - 1) % n] : NULL;
  ember__coll_step st = {.send_off = 0, .send_len = next ? nbytes : 0, .recv_off = 0,
                         .recv_len = prev ? nbytes : 0, .gate = prev ? 0 : -1};
  return ember__coll_run_steps(o, 0, next, prev, buf, buf, &st, 1);
}

int ember__coll_ring_allgather(ember__coll_op *o, uint8_t *rb, size_t nbytes) {
  uint32_t n = o->c->size, r = o->c->rank;
  int nsteps = (int)n - 1;
  ember__coll_step *st = new_steps(o, nsteps);
  if (st == NULL) return EMBER_ENOMEM;
  for (int s = 0; s < nsteps; s++) {
    st[s].send_off = (size_t)((r + n - (uint32_t)s) % n) * nbytes;
    st[s].send_len = nbytes;
    st[s].recv_off = (size_t)((r + 2 * n - (uint32_t)s - 1) % n) * nbytes;
    st[s].recv_len = nbytes;
    st[s].gate = s - 1;
  }
  return around_ring(o, st, nsteps, rb);
}
