/* coll_algos.h - internal: the collective's algorithms, each a sequence of
 * steps for the step engine (coll_engine.h).
 *
 * Each takes a started call (ember__coll_op_begin) on a communicator of at
 * least 2 ranks and the caller's buffer, and blocks until this rank's part is
 * done or fails (status and message as ember__coll_run_steps).  Buffers are
 * cut into segments on 64-byte boundaries (COLL_STREAM_ALIGN), as payloads
 * start on 64-byte boundaries of their stream.  Results are bit-identical on
 * every rank: each element is reduced in one order on one rank, or combined
 * with a commutative operation.  Thread-safety: the communicator's thread.
 *
 * How the public calls choose among them is collective.c's (pick_algo). */
#ifndef EMBER_COLL_ALGOS_H
#define EMBER_COLL_ALGOS_H

#include <stddef.h>
#include <stdint.h>

#include "coll_engine.h"

/* allreduce of count elements: a reduce-scatter then an allgather around the
 * ring, pipelined (a segment is forwarded as soon as it has been reduced):
 * 2(n-1) dependent steps. */
int ember__coll_ring_allreduce(ember__coll_op *o, uint8_t *buf, size_t count);

/* allreduce of count elements by recursive halving then doubling
 * (Rabenseifner): 2 log2(p) exchanges with one partner each, over the
 * largest power of two p of ranks (the others fold in first and get the
 * result last). */
int ember__coll_rh_allreduce(ember__coll_op *o, uint8_t *buf, size_t count);

/* allreduce of len bytes by recursive doubling (whole-buffer exchanges:
 * latency-optimal for small buffers); buf NULL and len 0 make a barrier. */
int ember__coll_rd_allreduce(ember__coll_op *o, uint8_t *buf, size_t len);

/* broadcast of nbytes from o->root: a pipelined chain around the ring. */
int ember__coll_chain_broadcast(ember__coll_op *o, uint8_t *buf, size_t nbytes);

/* allgather of nbytes per rank into rb (rank r's block at r * nbytes, this
 * rank's already in place): n-1 steps around the ring. */
int ember__coll_ring_allgather(ember__coll_op *o, uint8_t *rb, size_t nbytes);

#endif /* EMBER_COLL_ALGOS_H */
