/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* Per-request accounting (rq_account.h), compiled into the host object and
 * natively for the tests. */
#ifdef __bpf__
#include "vmlinux.h"
#endif
#include "rq_account.h"
#include "linked.h"

static __always_inline void rq_slot_reset(struct rq_slot *s, __u64 rq)
{
	s->rq = rq;
	s->start_ns = 0;
	s->issue_ns = 0;
	s->done_bytes = 0;
	s->requeues = 0;
	s->flags = 0;
	s->vm = 0;
	s->vdisk = 0;
	s->kick_ns = 0;
	s->pick_ns = 0;
	s->pos = 0;
	s->dev = 0;
	s->op = 0;
	s->queue = 0;
	s->hv_wait_ns = 0;
	s->eng_wait_ns = 0;
}

__inline_linked int rq_undelivered(const struct rq_slot *s, __u64 rq)
{
	return s->rq == rq && s->issue_ns && !(s->flags & (RQ_F_DONE | RQ_F_REQUEUE_PENDING));
}

__inline_linked void rq_on_start(struct rq_slot *s, __u64 rq, __u64 now, __u32 vm, __u32 vdisk,
				 __u64 kick_ns, __u64 pick_ns, __u64 pos, __u32 dev, __u32 op)
{
	rq_slot_reset(s, rq);
	s->start_ns = now;
	s->dev = dev;
	s->op = op;
	s->vm = vm;
	s->vdisk = vdisk;
	s->kick_ns = kick_ns;
	s->pick_ns = pick_ns;
	s->pos = pos;
}

__inline_linked void rq_on_issue(struct rq_slot *s, __u64 rq, __u64 now)
{
	if (s->rq != rq || (s->flags & RQ_F_DONE) ||
	    (s->issue_ns && !(s->flags & RQ_F_REQUEUE_PENDING) && !s->vm))
		rq_slot_reset(s, rq);
	s->flags &= ~RQ_F_REQUEUE_PENDING;
	s->issue_ns = now;
}

__inline_linked void rq_on_requeue(struct rq_slot *s, __u64 rq)
{
	if (s->rq != rq || (s->flags & RQ_F_DONE))
		return;
	s->requeues++;
	s->flags |= RQ_F_REQUEUE_PENDING | RQ_F_REQUEUED;
}

__inline_linked int rq_on_merge(struct rq_slot *s, __u64 rq)
{
	if (s->rq != rq || (s->flags & RQ_F_DONE))
		return 0;
	s->flags = RQ_F_DONE;
	return 1;
}

__inline_linked int rq_on_complete(struct rq_slot *s, const struct rq_completion *c,
				   struct rq_outcome *out)
{
	int mine = s && s->rq == c->rq && s->rq != 0 && !(s->flags & RQ_F_DONE);

	if (c->nr_bytes < c->remaining) {
		if (mine) {
			s->done_bytes += c->nr_bytes;
			s->flags |= RQ_F_PARTIAL;
		}
		return 0;
	}

	out->bytes = c->nr_bytes;
	out->start_ns = c->kstart_ns;
	out->issue_ns = c->kissue_ns;
	out->requeues = 0;
	out->flags = 0;
	out->vm = 0;
	out->vdisk = 0;
	out->kick_ns = 0;
	out->pick_ns = 0;
	out->pos = 0;
	out->queue = 0;
	out->hv_wait_ns = 0;
	out->eng_wait_ns = 0;
	if (mine) {
		out->bytes += s->done_bytes;
		if (!out->start_ns)
			out->start_ns = s->start_ns;
		/* Ours first: inside a plug the kernel's io_start_time_ns is the
		 * plug's cached clock (blk_time_get_ns), often equal to the start
		 * time however long the request waited. */
		if (s->issue_ns)
			out->issue_ns = s->issue_ns;
		out->requeues = s->requeues;
		out->flags = s->flags & (RQ_F_PARTIAL | RQ_F_REQUEUED | RQ_F_POLLED);
		out->vm = s->vm;
		out->vdisk = s->vdisk;
		out->kick_ns = s->kick_ns;
		out->pick_ns = s->pick_ns;
		out->pos = s->pos;
		out->queue = s->queue;
		out->hv_wait_ns = s->hv_wait_ns;
		out->eng_wait_ns = s->eng_wait_ns;
		s->flags = RQ_F_DONE;
	}
	/* Stamps from the future are another request's: distrust them. */
	if (out->issue_ns > c->now_ns)
		out->issue_ns = 0;
	if (out->start_ns > c->now_ns || (out->issue_ns && out->start_ns > out->issue_ns))
		out->start_ns = 0;
	if (!out->issue_ns)
		out->flags |= RQ_F_NO_ISSUE;
	if (!out->start_ns)
		out->flags |= RQ_F_NO_START;
	return 1;
}

__inline_linked void rq_segments(const struct rq_outcome *o, __u64 now, __u64 seg[BLK_NR_SEGS])
{
	__u64 from = o->start_ns ? o->start_ns : o->issue_ns;

	seg[BLK_SEG_TOTAL] = from ? now - from : ~0ULL;
	seg[BLK_SEG_QUEUE] = (o->start_ns && o->issue_ns) ? o->issue_ns - o->start_ns : ~0ULL;
	seg[BLK_SEG_SERVICE] = o->issue_ns ? now - o->issue_ns : ~0ULL;
}
