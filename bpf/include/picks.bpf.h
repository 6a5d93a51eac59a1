/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Kicks and their pickups, as the programs that see them hand them on:
 * a kick waits for its engine thread (file_kicks, thread_kicks); the
 * pickup makes it the thread's pick (thread_picks), which the requests the
 * thread then starts take (vm_request.bpf.h).
 */
#ifndef IOSPAN_PICKS_BPF_H
#define IOSPAN_PICKS_BPF_H

#include "host.bpf.h"
#include "scsi_target.bpf.h"

/* Functions of their own (pickups.bpf.c), each verified once rather
 * than at every caller: their loops over a thread's slots made the
 * programs that inline them among the slowest to load. */

/* How long thread `tid`, running now, waited for a CPU within [from, to]
 * (deep tier only: thread_waits is kept there). */
__u32 waited_within(__u32 tid, __u64 from, __u64 to);

/* Thread `tid`'s earliest kick waiting in thread_kicks, picked up at
 * `now` (0: read the clock): whether there was one. */
int pick_up_thread_kick(__u32 tgid, __u32 tid, __u64 now, __u64 nvcsw);

/* A kick at `now` for engine thread `tid`'s notifier in `slot`: the
 * first one since its last pickup counts. */
static __always_inline void thread_kick(__u32 tid, __u32 slot, __u64 now)
{
	struct thread_kicks *k = bpf_map_lookup_elem(&thread_kicks, &tid);

	if (!k || slot >= KICK_SLOTS || k->ts[slot])
		return;
	k->ts[slot] = now;
	__sync_fetch_and_or(&k->pending, 1u << slot);
}

/* The slot of `queue` among engine thread `tid`'s notifiers, given one
 * if it has none yet (KICK_SLOTS at most: a further notifier shares the
 * last slot). */
static __always_inline __u32 kick_slot(__u32 tid, __u16 queue)
{
	static const struct thread_kicks fresh;
	struct thread_kicks *k = lookup_or_init(&thread_kicks, &tid, &fresh);
	__u32 i;

	if (!k)
		return KICK_SLOTS;
	for (i = 0; i < KICK_SLOTS; i++) {
		if (k->queue[i] == queue)
			return i;
		if (!k->queue[i]) {
			k->queue[i] = queue;
			return i;
		}
	}
	return KICK_SLOTS - 1;
}

/* Thread `tid` going to sleep: an engine sleeps only once every notifier
 * ready before it has been read, so each kick waiting for it came before
 * and was taken — by a batch, or by a read that found the queue already
 * served (a guest may queue more requests, and kick again, between the
 * engine's read and its pop). Such a kick never has a submitting call of
 * its own: without this, the queue's next batch would take it. */
static __always_inline void kicks_read_by_sleep(__u32 tid)
{
	struct thread_kicks *k = bpf_map_lookup_elem(&thread_kicks, &tid);
	__u64 now;
	__u32 i;

	if (!k || !k->pending)
		return;
	now = bpf_ktime_get_ns();
	for (i = 0; i < KICK_SLOTS; i++) {
		__u64 t = k->ts[i];

		if (t && t < now)
			__sync_val_compare_and_swap(&k->ts[i], t, 0);
	}
}

/* The switch-in of thread `tid` after a kick: a pickup if the thread has
 * slept since its last submission (`nvcsw`: its voluntary switches now);
 * one back from a preemption is in the middle of its work, whose requests
 * are not the kick's. */
static __always_inline void pick_after_sleep(__u32 tgid, __u32 tid, __u64 now, __u64 nvcsw)
{
	struct pick *cur = bpf_map_lookup_elem(&thread_picks, &tid);

	if (cur && (cur->flags & PICK_TAKEN) && cur->nvcsw == nvcsw)
		return;
	pick_up_thread_kick(tgid, tid, now, nvcsw);
}

/* An engine thread submitting under its own pick at `now` (a request's
 * start, or its punt to an io-wq worker): the pick's batch is taken, or,
 * when an earlier call spent it, the request was found by polling. */
static __always_inline int take_pick(struct pick *p, __u64 now, __u64 nvcsw)
{
	int polled = !!(p->flags & PICK_SPENT);

	p->flags |= polled ? PICK_POLLS : PICK_TAKEN;
	p->last_start_ns = now;
	p->nvcsw = nvcsw;
	return polled;
}

/* The stamp of the next request of op `op` that thread `tid` (or a worker
 * it queued requests to) starts under pickup `pick_ns`, or `pick_ns` when
 * it has none. A pickup reads a notifier once for the whole batch, and
 * each request then waits its turn behind the ones taken before it, which
 * is not engine time of its own; a polling iothread takes more requests
 * under one pickup, long after its read. A request takes the oldest stamp
 * of its op (the batch is submitted in sector order, and workers start
 * what they were queued in any order: exact for the batch's sum, not for
 * each request, and never after the request's own start); a batch of more
 * than POPS of an op, and requests the device model took without
 * accounting, keep the pickup. Workers on several CPUs take from one
 * thread's stamps: the take is atomic. */
static __always_inline __u64 take_pop(__u32 tid, __u64 pick_ns, __u32 op)
{
	struct pops *q;
	__u32 h, i;

	if (op > BLK_OP_WRITE)
		return pick_ns;
	q = bpf_map_lookup_elem(&thread_pops, &tid);
	if (!q || q->pick_ns != pick_ns)
		return pick_ns;
	for (i = 0; i < 4; i++) {
		h = q->head[op & 1];
		if (h == q->tail[op & 1])
			return pick_ns;
		if (__sync_val_compare_and_swap(&q->head[op & 1], h, h + 1) == h)
			return q->ts[op & 1][h & POPS_MASK];
	}
	return pick_ns;
}

/* The VM's vhost worker taking its pending kick (deep tier: its kick
 * eventfds known from VHOST_SET_VRING_KICK), if there is one: when it is
 * switched in, or, when the kick came while it ran (no wake-up needed), at
 * its next submission (the worker's queueing then counts as the
 * hypervisor's). */
static __always_inline void claim_vhost_kick(__u32 tgid, __u32 tid)
{
	struct pick p = {};
	__u64 *kick;

	/* Where LIO runs, its programs time each command from its batch's
	 * kick to its pop (scsi_target.bpf.c). */
	if (targ_scsi_target)
		return;
	kick = bpf_map_lookup_elem(&vhost_kicks, &tgid);
	if (!kick)
		return;
	p.kick_ns = *kick;
	p.pick_ns = bpf_ktime_get_ns();
	p.engine = tid;
	bpf_map_delete_elem(&vhost_kicks, &tgid);
	bpf_map_update_elem(&thread_picks, &tid, &p, BPF_ANY);
	bpf_map_update_elem(&vm_last_pick, &tgid, &p, BPF_ANY);
}

#endif /* IOSPAN_PICKS_BPF_H */
