/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Per-request accounting across issue, requeue, partial and final
 * completion. Pure functions over struct rq_slot (bpf/rq_account.c), so the
 * same code runs in block.bpf.c's programs and, compiled natively, in the
 * synthetic-stream tests (tests/native/shim.c).
 *
 * Timestamps: the kernel keeps rq->start_time_ns whenever iostats or an I/O
 * scheduler is on, and rq->io_start_time_ns whenever blk-stat is on; both are
 * zeroed when a request is set up. The start comes from the kernel when it
 * has one, else from our stamp; the issue from our stamp at block_rq_issue,
 * else from the kernel's.
 */
#ifndef IOSPAN_RQ_ACCOUNT_H
#define IOSPAN_RQ_ACCOUNT_H

#include "agent_abi.h"

/* What a completion tracepoint tells us about the request. */
struct rq_completion {
	__u64 rq;	 /* rq_key() of the request */
	__u64 kstart_ns; /* rq->start_time_ns, 0 if the kernel keeps none */
	__u64 kissue_ns; /* rq->io_start_time_ns, 0 if the kernel keeps none */
	__u64 now_ns;
	__u32 remaining; /* rq->__data_len before this completion */
	__u32 nr_bytes;	 /* bytes completed by this event */
};

/* One finished request, as the histograms and the ring buffer see it. */
struct rq_outcome {
	__u64 start_ns;
	__u64 issue_ns;
	__u32 bytes;
	__u16 requeues;
	__u16 flags;
	__u32 vm;
	__u32 vdisk;
	__u64 kick_ns;
	__u64 pick_ns;
	__u64 pos;
	__u32 queue;
	__u32 hv_wait_ns;
	__u32 eng_wait_ns;
	__u32 _pad;
};

/* At block_io_start: the slot still holds an issued request of this key
 * that never finished, and its key (queue, context, tag) is being used
 * again by a new request: that request's
 * completion never reached us, though the kernel completed it (a tag is
 * only reused once its request has ended). The kernel skips tracing
 * programs now and then without counting it anywhere, e.g. for a
 * completion in a softirq that interrupted some task: this is how such a
 * loss is seen, and whose request it was. */
int rq_undelivered(const struct rq_slot *s, __u64 rq);

/* block_io_start (block_rq_insert before v6.5), in the submitter's context:
 * `now` is our start stamp (0 when the kernel keeps one), `vm` and `vdisk`
 * who submitted it and for which virtual disk, `dev` and `op` the entry its
 * lost completion would be counted under — completions run in interrupt
 * context under whatever task was there, so identity is only ever taken
 * here. */
void rq_on_start(struct rq_slot *s, __u64 rq, __u64 now, __u32 vm, __u32 vdisk, __u64 kick_ns,
		 __u64 pick_ns, __u64 pos, __u32 dev, __u32 op);

/* block_rq_issue. A slot already holding this request belongs to the same
 * I/O if it was stamped at start and not issued yet, or was requeued, or is
 * a VM's: every new request of a VM passes block_io_start, which takes the
 * slot afresh, so a second issue is the same request dispatched again (the
 * kernel re-issues some without a requeue event). Otherwise it is a
 * leftover of an earlier I/O of the same preallocated request (e.g. one
 * whose completion we did not see) and starts afresh. */
void rq_on_issue(struct rq_slot *s, __u64 rq, __u64 now);

/* block_rq_requeue: the request goes back to the queue and will be issued
 * again; its queue segment grows by the failed attempt. */
void rq_on_requeue(struct rq_slot *s, __u64 rq);

/* block_rq_merge: a started request merged into another before issue ends
 * inside it. Returns whether the slot held it, open (and now done). */
int rq_on_merge(struct rq_slot *s, __u64 rq);

/* block_rq_complete. Returns 0 for a partial completion (more bytes remain:
 * the request stays in flight) and 1 for the final one, filling *out and
 * marking the slot done. `s` may be NULL when no slot could be found. */
int rq_on_complete(struct rq_slot *s, const struct rq_completion *c, struct rq_outcome *out);

/* Segment durations of a finished request; a segment whose ends are unknown
 * gets ~0 (not counted). Total falls back to issue -> complete. */
void rq_segments(const struct rq_outcome *o, __u64 now, __u64 seg[BLK_NR_SEGS]);

#endif /* IOSPAN_RQ_ACCOUNT_H */
