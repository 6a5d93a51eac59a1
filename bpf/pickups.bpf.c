// SPDX-License-Identifier: GPL-2.0
/*
 * The engine's pickups. The deep tier sees the engine thread read the
 * eventfd a kick was on (the read system call's tracepoint); the always-on
 * tier, eventfd_read itself where fentry or a kprobe reaches it, else the
 * engine thread's switch-in after the kick woke it (sched.bpf.c) or its
 * next request start when the kick found it running (vm_request.bpf.h).
 * Here too: the wake-ups that name a KVM notifier's engine
 * (kicks.bpf.h), the hand-off of a pick to the worker an engine thread
 * wakes (aio=threads), QEMU's device models taking each request (the deep
 * tier), the submitting calls that end a pickup's batch (the deep tier)
 * and io_uring's hand-offs to its workers.
 */
#include "pickups.bpf.h"
#include "kicks.bpf.h"
#include "linked.h"
#include "notifiers.bpf.h"
#include "nesting.bpf.h"

__inline_linked void kicks_read_by_sleep(struct thread_kicks *k)
{
	__u64 now;
	__u32 i;

	now = bpf_ktime_get_ns();
	for (i = 0; i < KICK_SLOTS; i++) {
		__u64 t = k->ts[i];

		if (t && t < now)
			__sync_val_compare_and_swap(&k->ts[i], t, 0);
	}
}

__inline_linked void pick_after_sleep(__u32 tgid, __u32 tid, __u64 now, __u64 nvcsw)
{
	struct pick *cur = bpf_map_lookup_elem(&thread_picks, &tid);

	if (cur && (cur->flags & PICK_TAKEN) && cur->nvcsw == nvcsw)
		return;
	pick_up_thread_kick(tgid, tid, now, nvcsw);
}

__inline_linked int take_pick(struct pick *p, __u64 now, __u64 nvcsw)
{
	int polled = !!(p->flags & PICK_SPENT);

	p->flags |= polled ? PICK_POLLS : PICK_TAKEN;
	p->last_start_ns = now;
	p->nvcsw = nvcsw;
	return polled;
}

__inline_linked __u64 take_pop(__u32 tid, __u64 pick_ns, __u32 op)
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

__inline_linked void claim_vhost_kick(__u32 tgid, __u32 tid)
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

/* How long thread `tid`, running now, waited for a CPU within [from, to]:
 * its last RUN_WAITS waits, clipped to the interval (more waits than that
 * in one interval are not counted; saturates at ~4.3 s). Deep tier only:
 * thread_waits is kept there. */
__noinline __u32 waited_within(__u32 tid, __u64 from, __u64 to)
{
	struct run_waits *w;
	__u64 sum = 0;
	int i;

	if (!from || to <= from)
		return 0;
	w = bpf_map_lookup_elem(&thread_waits, &tid);
	if (!w)
		return 0;
	for (i = 0; i < RUN_WAITS; i++) {
		__u64 s = w->start[i] > from ? w->start[i] : from;
		__u64 e = w->end[i] < to ? w->end[i] : to;

		if (e > s)
			sum += e - s;
	}
	return sum > 0xffffffffULL ? 0xffffffffU : (__u32)sum;
}

/* Thread `tid` of VM process `tgid` picks up a kick at `now`; `nvcsw` is
 * its voluntary context switches so far. A polling thread reads a kick
 * whose requests it may already have found by polling: so it did if it
 * submitted since the kick, and may have if it has not slept since it last
 * submitted (a kick that found it asleep woke it; one that came while it
 * polled was raced by its poll, and the guest's MMIO exit can reach KVM
 * after the poll took the requests). Nothing after such a pickup is known
 * to be its batch. */
static __always_inline void pick_up(__u32 tgid, __u32 tid, __u64 kick_ns, __u32 queue, __u64 now,
				    __u64 nvcsw)
{
	struct pick p = {}, *old;

	p.kick_ns = kick_ns;
	p.queue = queue;
	p.pick_ns = now;
	p.flags = PICK_READ;
	p.engine = tid;
	if (deep_tier())
		p.hv_wait_ns = waited_within(tid, kick_ns, now);
	old = bpf_map_lookup_elem(&thread_picks, &tid);
	if (old && (old->flags & PICK_READ)) {
		p.last_start_ns = old->last_start_ns;
		p.nvcsw = old->nvcsw;
		p.flags |= old->flags & PICK_POLLS;
		if ((old->flags & PICK_POLLS) &&
		    (old->last_start_ns > kick_ns || nvcsw == old->nvcsw))
			p.flags |= PICK_SPENT;
	}
	bpf_map_update_elem(&thread_picks, &tid, &p, BPF_ANY);
	bpf_map_update_elem(&vm_last_pick, &tgid, &p, BPF_ANY);
}

/* Thread `tid`'s earliest kick waiting in thread_kicks, picked up at
 * `now`: whether there was one. One kick per batch: a thread whose pick
 * no request has taken yet keeps it (switched in twice before it
 * submitted, its second switch-in takes nothing); an engine thread whose
 * pick was taken takes the next kick with its next submitting call, or
 * when it is switched in after a sleep (`slept_since`: not a preemption
 * in the middle of a call, see pick_after_sleep). */
__noinline int pick_up_thread_kick(__u32 tgid, __u32 tid, __u64 now, __u64 nvcsw)
{
	struct thread_kicks *k = thread_kicks_of(tid);
	__u64 best = 0, kick_ns;
	__u32 i, slot = KICK_SLOTS, pending;

	struct pick *cur;

	if (!k || !(pending = k->pending))
		return 0;
	cur = bpf_map_lookup_elem(&thread_picks, &tid);
	if (cur && (cur->flags & PICK_READ) && !(cur->flags & PICK_TAKEN))
		return 0;
	if (!now)
		now = bpf_ktime_get_ns();
	for (i = 0; i < KICK_SLOTS; i++) {
		__u64 t = k->ts[i];

		if (!(pending & (1u << i)))
			continue;
		if (!t) {
			__sync_fetch_and_and(&k->pending, ~(1u << i));
			continue;
		}
		if (t <= now && (!best || t < best)) {
			best = t;
			slot = i;
		}
	}
	if (slot >= KICK_SLOTS)
		return 0;
	/* The hint first, then the kick: a kick racing in after sets both
	 * again. Another CPU may have taken it meanwhile. */
	__sync_fetch_and_and(&k->pending, ~(1u << slot));
	kick_ns = __sync_lock_test_and_set(&k->ts[slot], 0);
	if (!kick_ns)
		return 0;
	pick_up(tgid, tid, kick_ns, k->queue[slot], now, nvcsw);
	return 1;
}

/* The deep tier: an engine thread reading an eventfd a vCPU kicked picks
 * the kick up: a thread of the VM's own QEMU, or of an engine process
 * registered under the VM's slot. */
SEC("tracepoint/syscalls/sys_enter_read")
int sys_enter_read(struct trace_event_raw_sys_enter *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid(), now;
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	struct kick *kick;
	__u64 file, kick_ns, queue;

	if (!targ_vm_segments || ctx->args[2] < 8)
		return 0;
	if (!vm_proc_of(tgid) || in_vcpu())
		return 0;
	now = bpf_ktime_get_ns();
	file = fd_file((__u32)ctx->args[0]);
	kick = file ? bpf_map_lookup_elem(&file_kicks, &file) : 0;
	if (!kick) {
		/* A notifier learnt from its kicks' wake-ups. */
		pick_up_thread_kick(tgid, tid, now, current_nvcsw());
		return 0;
	}
	kick_ns = kick->ts_ns;
	queue = kick->queue;
	bpf_map_delete_elem(&file_kicks, &file);
	pick_up(tgid, tid, kick_ns, (__u32)queue, now, current_nvcsw());
	return 0;
}

/* The always-on tier: an engine thread's read of an eventfd (fentry or a
 * kprobe on eventfd_read: only eventfd reads pay) picks up the kick on it,
 * or the kick learnt for the thread. */
static __always_inline void on_eventfd_read(__u64 file)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid(), now;
	__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
	struct kick *kick;
	__u64 kick_ns, queue;

	if (!targ_vm_segments || deep_tier() || !vm_proc_of(tgid) || in_vcpu())
		return;
	now = bpf_ktime_get_ns();
	kick = bpf_map_lookup_elem(&file_kicks, &file);
	if (!kick) {
		pick_up_thread_kick(tgid, tid, now, current_nvcsw());
		return;
	}
	kick_ns = kick->ts_ns;
	queue = kick->queue;
	bpf_map_delete_elem(&file_kicks, &file);
	pick_up(tgid, tid, kick_ns, (__u32)queue, now, current_nvcsw());
}

SEC("fentry/eventfd_read")
int BPF_PROG(eventfd_read_fentry, struct kiocb *iocb)
{
	on_eventfd_read((__u64)iocb->ki_filp);
	return 0;
}

SEC("kprobe/eventfd_read")
int BPF_KPROBE(eventfd_read_kprobe, struct kiocb *iocb)
{
	on_eventfd_read((__u64)BPF_CORE_READ(iocb, ki_filp));
	return 0;
}

/* A VM thread waking another of the same VM hands it the kick it last
 * picked up: with aio=threads the engine thread picks the kick up and
 * queues the request to a worker, which wakes and submits it. Picks only
 * move forward (a worker waking the engine back leaves its newer pick). A
 * worker that takes its next request without sleeping has used its handed
 * pick: it takes the VM's latest (vm_last_pick). Only while a VM with
 * such a disk runs (tier_state.handoff). */
static __always_inline void hand_off(__u32 wakee_tgid, __u32 wakee_tid)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct pick *mine, *theirs, handed;

	if (wakee_tgid != tgid || wakee_tid == tid || !vm_proc_of(tgid))
		return;
	mine = bpf_map_lookup_elem(&thread_picks, &tid);
	if (!mine)
		return;
	theirs = bpf_map_lookup_elem(&thread_picks, &wakee_tid);
	if (theirs && theirs->pick_ns >= mine->pick_ns)
		return;
	handed = *mine;
	handed.flags = PICK_HANDED;
	bpf_map_update_elem(&thread_picks, &wakee_tid, &handed, BPF_ANY);
}

/* Thread `wakee_tid` of process `wakee_tgid` woken by the current thread:
 * first what it says of KVM's notifiers (a vCPU's write just before it
 * woke that thread), then the hand-off. Run per wake-up on the whole host
 * while a KVM VM runs: most leave after two per-CPU lookups. */
static __always_inline void on_waking(__u32 wakee_tgid, __u32 wakee_tid, const char *wakee_comm)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)id, zero = 0;
	struct mmio_mark *m;
	struct wake *w;
	struct tier_state *t;
	int vcpu = vcpu_comm(wakee_comm);

	if (!targ_vm_segments)
		return;
	w = bpf_map_lookup_elem(&last_wake, &zero);
	if (w) {
		w->waker = tid;
		w->wakee = wakee_tid;
		w->wakee_tgid = wakee_tgid;
		w->wakee_vcpu = vcpu;
	}
	m = bpf_map_lookup_elem(&mmio_marks, &zero);
	if (m && m->tid == tid) {
		__u64 now = bpf_ktime_get_ns();

		m->tid = 0;
		if (m->tgid == wakee_tgid && !vcpu && wakee_tid != tid && now - m->ts_ns < MARK_NS)
			learnt_kick(wakee_tgid, m->gpa, wakee_tid, m->ts_ns);
	}
	t = tier_now();
	if (t && t->handoff)
		hand_off(wakee_tgid, wakee_tid);
}

static __always_inline void on_waking_raw(struct task_struct *p)
{
	char comm[4];

	BPF_CORE_READ_INTO(&comm, p, comm);
	on_waking(BPF_CORE_READ(p, tgid), BPF_CORE_READ(p, pid), comm);
}

/* Each with its second program, for the wake-ups the kernel skips for the
 * first: an interrupt's, nested in one (nesting.bpf.h). */
NESTED_WAKE_PROGRAMS("tp_btf/sched_waking", sched_waking_btf, sched_waking_nested_btf, NEST_WAKING,
		     CNT_NESTED_WAKING, on_waking(p->tgid, p->pid, p->comm))
NESTED_WAKE_PROGRAMS("raw_tp/sched_waking", sched_waking, sched_waking_nested, NEST_WAKING,
		     CNT_NESTED_WAKING, on_waking_raw(p))

/* A worker the engine thread starts for the request it just queued. */
SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(sched_wakeup_new_btf, struct task_struct *p)
{
	if (targ_vm_segments)
		hand_off(p->tgid, p->pid);
	return 0;
}

SEC("raw_tp/sched_wakeup_new")
int BPF_PROG(sched_wakeup_new, struct task_struct *p)
{
	if (targ_vm_segments)
		hand_off(BPF_CORE_READ(p, tgid), BPF_CORE_READ(p, pid));
	return 0;
}

/* QEMU's device models start their clock for a guest request as they
 * take it (block_acct_start(stats, cookie, bytes, type), one call per read
 * or write): in an engine thread that read a kick, the stamp of when its
 * request was taken (see struct pops). BLOCK_ACCT_READ is 1, _WRITE 2. */
SEC("uprobe")
int BPF_KPROBE(block_acct_start, void *stats, void *cookie, __s64 bytes, int type)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	static const struct pops fresh;
	struct pick *p;
	struct pops *q;
	__u32 op, t;

	if (!targ_vm_segments || (type != 1 && type != 2))
		return 0;
	p = bpf_map_lookup_elem(&thread_picks, &tid);
	if (!p || !(p->flags & PICK_READ) || (p->flags & PICK_SPENT))
		return 0;
	q = lookup_or_init(&thread_pops, &tid, &fresh);
	if (!q)
		return 0;
	if (q->pick_ns != p->pick_ns) {
		q->pick_ns = p->pick_ns;
		q->head[0] = q->tail[0] = 0;
		q->head[1] = q->tail[1] = 0;
	}
	op = type == 2;
	t = q->tail[op];
	if (t - q->head[op] >= POPS)
		return 0;
	q->ts[op][t & POPS_MASK] = bpf_ktime_get_ns();
	q->tail[op] = t + 1;
	return 0;
}

/* A submitting system call of a VM thread: the pick whose batch an
 * earlier call submitted is spent (see struct pick). */
static __always_inline void on_submit_call(__u64 nr)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct pick *p;

	if (!targ_vm_segments || !nr || !vm_proc_of(tgid))
		return;
	p = bpf_map_lookup_elem(&thread_picks, &tid);
	if (!p || !(p->flags & PICK_READ))
		return;
	/* An iothread submits a kick's batch in one call (virtio-blk plugs
	 * it); other engines may submit theirs one request per call (QEMU's
	 * NVMe, unplugged io_uring), and never poll. */
	if ((p->flags & PICK_TAKEN) && in_iothread())
		p->flags |= PICK_SPENT;
	p->flags |= PICK_ENTERED;
}

SEC("tracepoint/syscalls/sys_enter_io_uring_enter")
int sys_enter_io_uring_enter(struct trace_event_raw_sys_enter *ctx)
{
	on_submit_call(ctx->args[1]);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_io_submit")
int sys_enter_io_submit(struct trace_event_raw_sys_enter *ctx)
{
	on_submit_call(ctx->args[1]);
	return 0;
}

/* io_uring:io_uring_queue_async_work, as its format file gives it since
 * 5.5: the request follows the ring. */
struct io_uring_async_record {
	__u64 common;
	__u64 ctx;
	__u64 req;
};

/* The io_uring submitting call a request is part of: its ring and the
 * ring's submission head, which the kernel moves only at the call's end. */
static __always_inline __u64 io_call_of(__u64 req)
{
	struct io_kiocb *r = (struct io_kiocb *)req;
	struct io_ring_ctx *ctx = BPF_CORE_READ(r, ctx);
	__u32 head = BPF_CORE_READ(ctx, rings, sq.head);

	return ((__u64)ctx << 32) ^ head;
}

/* An engine thread's io_uring request punted to an io-wq worker: the
 * worker issues it later, with the pick it was submitted under. */
SEC("tracepoint/io_uring/io_uring_queue_async_work")
int io_uring_queue_async_work(struct io_uring_async_record *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct pick *p;
	__u64 req = ctx->req;

	if (!targ_vm_segments || !vm_proc_of(tgid))
		return 0;
	if (!deep_tier()) {
		/* The always-on tier sees no submitting call: a punt of a call
		 * the thread's pick has not served yet (the ring's head moves
		 * at each call's end) picks up its next kick, as a request's
		 * start does. */
		__u64 call = io_call_of(req);

		p = bpf_map_lookup_elem(&thread_picks, &tid);
		if (!p || !(p->flags & PICK_READ) || p->call != call)
			pick_up_thread_kick(tgid, tid, bpf_ktime_get_ns(), current_nvcsw());
		p = bpf_map_lookup_elem(&thread_picks, &tid);
		if (!p)
			return 0;
		p->call = call;
		if (p->flags & PICK_READ)
			take_pick(p, bpf_ktime_get_ns(), current_nvcsw());
		bpf_map_update_elem(&punted_picks, &req, p, BPF_ANY);
		return 0;
	}
	p = bpf_map_lookup_elem(&thread_picks, &tid);
	if (!p)
		return 0;
	if ((p->flags & PICK_READ) && !(p->flags & PICK_ENTERED)) {
		/* No submitting call since the pickup: a request of an earlier
		 * call, whose retry io_uring queued as task work (a busy
		 * device refused it without waiting); its pickup is not known. */
		struct pick unknown = {};

		bpf_map_update_elem(&punted_picks, &req, &unknown, BPF_ANY);
		return 0;
	}
	if (p->flags & PICK_READ)
		take_pick(p, bpf_ktime_get_ns(), current_nvcsw());
	bpf_map_update_elem(&punted_picks, &req, p, BPF_ANY);
	return 0;
}

/* Linked into host.bpf.o with block.bpf.c, whose license section it shares. */
