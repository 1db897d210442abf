/* coll_engine.h - internal: how a collective moves bytes between two peers,
 * on one thread, over TCP or shared memory.
 *
 * Layers, bottom up (coll_engine.c):
 *   - doorbells: each rank's inbox (coll_internal.h) holds a futex word;
 *     whoever moves a ring position a rank waits on rings its bell;
 *   - channels: one non-blocking send and one non-blocking receive per
 *     peer, over its TCP connection or its pair of shared-memory rings (a
 *     try-reserve of up to 256 KiB cut on element boundaries; peek and
 *     partial consume on the receiver, which reduces straight out of the
 *     ring); a TCP send takes at most EMBER_NET_SEND_PIECE at a time;
 *   - the step engine: runs a list of (send region, receive region) steps
 *     against one peer to send to and one to receive from, overlapping the
 *     two, with the send of a step gated on how much of an earlier step's
 *     receive has been reduced (this is the pipelining).  When neither side
 *     can move it waits for both in one poll() or one futex wait, spinning
 *     first (adaptively) and yielding its core when ranks outnumber cores.
 *
 * Every message starts with a 24-byte header (magic "ECOL", sequence, kind,
 * dtype, op, step, root, total bytes) checked against the local call, padded
 * with zeros to the next 64-byte boundary of the connection's collective
 * bytes (both ends count them), so payloads sit on 64-byte lines.
 *
 * Why one thread and no helper: a blocked send and a blocked receive are both
 * waited for in one poll() (or one futex for shared memory), so the process
 * never stops sending while it reduces, and there is no thread handoff on the
 * hot path.  Why rings in shared memory rather than one shared buffer per
 * rank: a ring is a bounded SPSC stream, so the ring algorithm is the same
 * code on both transports, data passes through the cache-resident ring (one
 * copy in by the sender, the receiver reduces straight out of it) and a ring
 * of a few MiB serves buffers of any size.
 *
 * Blocking: ember__coll_run_steps blocks until its steps are done, the op's
 * deadline passes (EMBER_ETIMEDOUT naming the peer and the progress), a peer
 * it depends on hangs up (EMBER_ECLOSED) or the communicator is aborted
 * (EMBER_EABORTED).  Thread-safety: the communicator's thread only, except
 * ember__coll_bell and ember__coll_break_links, which ember_comm_abort calls
 * from any thread. */
#ifndef EMBER_COLL_ENGINE_H
#define EMBER_COLL_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "coll_internal.h"
#include "coll_reduce.h"

/* Payloads start at multiples of this many bytes into their stream, and
 * algorithms cut buffers into segments on multiples of it. */
#define COLL_STREAM_ALIGN 64u

enum { COLL_ALLREDUCE = 1, COLL_BROADCAST = 2, COLL_ALLGATHER = 3, COLL_BARRIER = 4 };

/* One collective call in progress. */
typedef struct {
  ember_comm *c;
  int kind, dtype, op;
  uint32_t root;
  uint64_t nbytes;
  uint32_t seq;
  size_t esz;
  ember__reduce_fn fn;
  int64_t start_ms, deadline_ms, timeout_ms;
  char what[160]; /* ember__coll_op_name(): empty until an error message needs it */
} ember__coll_op;

/* One step: what to send to the next peer and what to receive from the
 * previous one, as regions of the op's buffers. */
typedef struct {
  size_t send_off, send_len;
  size_t recv_off, recv_len;
  int gate;   /* -1, or the step whose receive progress gates this send */
  int reduce; /* receive mode: reduce into the region (else copy) */
  int scale;  /* avg: divide the reduced bytes by the number of ranks */
} ember__coll_step;

/* Starts call `o` of the given kind on c (dtype and op count for allreduce
 * only): numbers it, sets its deadline (timeout_ms < 0: none) and picks its
 * kernel.  EMBER_ESTATE if an earlier failure broke c, EMBER_EABORTED after
 * ember_comm_abort. */
int ember__coll_op_begin(ember_comm *c, ember__coll_op *o, int kind, int dtype, int op,
                         uint32_t root, uint64_t nbytes, int64_t timeout_ms);

/* Ends a call with status rc, which it returns: a failure breaks c (the
 * message is kept for later calls) and its links (ember__coll_break_links). */
int ember__coll_op_end(ember_comm *c, int rc);

/* "allreduce #3 (float32 sum, 4096 bytes)": the call as messages name it,
 * formatted on first use (a small op takes a few microseconds; formatting
 * its name every time cost a visible share of it). */
const char *ember__coll_op_name(ember__coll_op *o);

/* Runs steps st[0..nsteps) of step_id against `to` (NULL: nothing to send)
 * and `from` (NULL: nothing to receive): sends read sbuf, receives write (or
 * reduce into) rbuf.  Blocks as the header says; a failure after
 * ember_comm_abort is reported as the abort. */
int ember__coll_run_steps(ember__coll_op *o, int step_id, ember__coll_peer *to,
                          ember__coll_peer *from, const uint8_t *sbuf, uint8_t *rbuf,
                          const ember__coll_step *st, int nsteps);

/* Rings ib's doorbell whether or not its owner sleeps. */
void ember__coll_bell(ember__coll_inbox *ib);

/* Shuts every connection and rings every peer's doorbell with our abort, so
 * that the other ranks stop waiting on us at once; fds stay open (no reuse
 * race) until destroy. */
void ember__coll_break_links(ember_comm *c);

#endif /* EMBER_COLL_ENGINE_H */
