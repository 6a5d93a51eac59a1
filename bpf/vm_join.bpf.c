/* SPDX-License-Identifier: GPL-2.0 */
/* A VM request's completion, joined with its interrupt (vm_join.bpf.h). */
#include "vm_join.bpf.h"
#include "linked.h"

vm_done_map_t vm_done SEC(".maps");
vm_split_map_t vm_split SEC(".maps");
vm_unsplit_map_t vm_unsplit SEC(".maps");
vdisk_slow_ns_map_t vdisk_slow_ns SEC(".maps");
draining_map_t draining SEC(".maps");
const struct vm_split_stats zero_split = {};

__inline_linked void count_unsplit(__u32 vm, __u32 vdisk, enum unsplit_why why)
{
	static const struct vm_unsplit zero;
	struct vdisk_key k = { .vm = vm, .vdisk = vdisk };
	struct vm_unsplit *u = lookup_or_init(&vm_unsplit, &k, &zero);

	if (!u)
		return;
	switch (why) {
	case UNSPLIT_NO_KICK:
		__sync_fetch_and_add(&u->no_kick, 1);
		break;
	case UNSPLIT_NO_SIGNAL:
		__sync_fetch_and_add(&u->no_signal, 1);
		break;
	case UNSPLIT_POLLED:
		__sync_fetch_and_add(&u->polled, 1);
		break;
	default:
		__sync_fetch_and_add(&u->unordered, 1);
	}
}

__inline_linked struct done_ring *ring_of(__u32 vm)
{
	__u32 idx = vm & DONE_MASK;
	struct done_ring *r = bpf_map_lookup_elem(&vm_done, &idx);

	if (!r)
		return 0;
	if (r->vm == vm)
		return r;
	if (r->vm == 0 && __sync_val_compare_and_swap(&r->vm, 0, vm) == 0)
		return r;
	return r->vm == vm ? r : 0;
}

/* The ring full: its oldest request, if it has waited past the hold
 * for an interrupt that never came, leaves it counted no_signal (a guest
 * that takes its completions without interrupts would otherwise keep the
 * ring full). */
static __always_inline void retire_stale(struct done_ring *r, __u32 vm, __u64 now)
{
	__u64 h = r->head;
	struct done_ent *e = &r->ent[h & DONE_MASK];
	__u32 vdisk = e->vdisk;

	if (e->seq != h + 1 || now - e->done_ns <= SIGNAL_HOLD_NS)
		return;
	if (__sync_val_compare_and_swap(&r->head, h, h + 1) != h)
		return;
	count_unsplit(vm, vdisk, UNSPLIT_NO_SIGNAL);
}

__inline_linked void join_completed(const struct rq_outcome *o, __u32 dev, __u8 op, __u64 now)
{
	struct done_ring *r;
	struct done_ent *e;
	__u64 idx;

	if (o->flags & RQ_F_POLLED) {
		count_unsplit(o->vm, o->vdisk, UNSPLIT_POLLED);
		return;
	}
	if (!o->kick_ns) {
		count_unsplit(o->vm, o->vdisk, UNSPLIT_NO_KICK);
		return;
	}
	r = ring_of(o->vm);
	if (r && r->tail - r->head >= DONE_ROOM)
		retire_stale(r, o->vm, now);
	if (!r || r->tail - r->head >= DONE_ROOM) {
		count_unsplit(o->vm, o->vdisk, UNSPLIT_NO_SIGNAL);
		return;
	}
	idx = __sync_fetch_and_add(&r->tail, 1);
	e = &r->ent[idx & DONE_MASK];
	e->kick_ns = o->kick_ns;
	e->pick_ns = o->pick_ns;
	e->start_ns = o->start_ns;
	e->issue_ns = o->issue_ns;
	e->done_ns = now;
	e->pos = o->pos;
	e->bytes = o->bytes;
	e->vdisk = o->vdisk;
	e->dev = dev;
	e->queue = (__u16)o->queue;
	e->op = op;
	e->flags = (__u8)o->flags;
	/* Written last, with a full barrier: a drain that sees it sees the rest. */
	__sync_lock_test_and_set(&e->seq, idx + 1);
}
