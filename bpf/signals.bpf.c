// SPDX-License-Identifier: GPL-2.0
/*
 * The engine's signals back to the guest. The always-on tier ends every
 * waiting request of a VM at its next interrupt (vm_join.bpf.h): under KVM
 * an MSI, through an irqfd or KVM_SIGNAL_MSI (kvm:kvm_msi_set_irq, in the
 * signalling thread); without KVM, QEMU's msix_notify. The deep tier ends
 * each virtio request at its own used-ring push (virtqueue_flush,
 * vu_queue_push) and an NVMe or vhost request at the interrupt
 * (signals.bpf.h).
 */
#include "pickups.bpf.h"
#include "linked.h"
#include "signals.bpf.h"
#include "vm_join.bpf.h"

__inline_linked void signal_due_n(__u32 vm, __u32 n)
{
	__u32 *d = bpf_map_lookup_elem(&vm_signal_due, &vm);

	if (!d)
		bpf_map_update_elem(&vm_signal_due, &vm, &n, BPF_NOEXIST);
	else
		__sync_fetch_and_add(d, n);
}

__inline_linked void signal_due(__u32 vm)
{
	signal_due_n(vm, 1);
}

/* Whether a signal covering `covers` completions (0: all) finds any
 * waiting, taking them. Another CPU's completion racing this is counted
 * either here or for the next signal, never lost: its window is ended by
 * a later record, or counted no_signal if none comes. */
static __always_inline int take_due(__u32 *due, __u32 covers)
{
	__s32 old;

	if (!covers)
		return __sync_lock_test_and_set(due, 0) != 0;
	if (!*due)
		return 0;
	old = (__s32)__sync_fetch_and_add(due, -covers);
	if (old < (__s32)covers)
		/* Fewer waited than it covers: none left, not a debt. */
		__sync_fetch_and_add(due, covers - (old > 0 ? old : 0));
	return old > 0;
}

/* The thread's last two waits for a CPU, newest first. */
static __always_inline void last_waits(__u32 tid, __u64 start[2], __u64 end[2])
{
	struct run_waits *w = bpf_map_lookup_elem(&thread_waits, &tid);

	if (w) {
		__u32 i = (w->next - 1) & (RUN_WAITS - 1), j = (w->next - 2) & (RUN_WAITS - 1);

		start[0] = w->start[i];
		end[0] = w->end[i];
		start[1] = w->start[j];
		end[1] = w->end[j];
	}
}

/* Sends thread `tid`'s gathered pushes, if any. */
static __always_inline void send_pushes(__u32 tid, struct vm_pushes_event *b)
{
	if (!b->n)
		return;
	last_waits(tid, b->wait_start, b->wait_end);
	emit(b, sizeof(*b), b->ts[(b->n - 1) & (PUSH_BATCH - 1)]);
	b->n = 0;
}

__inline_linked void send_pushes_of(__u32 tid)
{
	struct vm_pushes_event *b = bpf_map_lookup_elem(&thread_pushes, &tid);

	if (b)
		send_pushes(tid, b);
}

/* The engine making completions visible to the guest, one record per hit
 * that finds completions waiting (vm_signal_due): virtio's used-ring push
 * (virtqueue_flush, once per request: the guest may reap it by polling the
 * ring, without an interrupt, when QEMU suppresses it under EVENT_IDX;
 * `covers` its count) or, for NVMe, QEMU raising the interrupt after
 * posting the completions (msix_notify, `covers` 0). Attached per VM
 * process, on a push instruction (emulated, not single-stepped). */
static __always_inline int on_signal(__u32 covers)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct vm_proc *proc;
	__u32 vm;
	struct vm_signal_event ev = { .kind = EVENT_VM_SIGNAL };
	struct pick *p;

	if (!targ_vm_segments)
		return 0;
	proc = vm_proc_of(tgid);
	if (!proc)
		return 0;
	vm = proc->slot;
	/* An iothread completing requests after it submitted its pickup's
	 * batch went round its loop: what it submits before it reads another
	 * kick was found by polling. One known to poll that completes
	 * requests between a read and its submission, likewise (the read's
	 * kick may be one its poll had already served). Other engine threads
	 * may deliver completions between the submissions of one kick's
	 * batch (qemu-storage-daemon does), and never poll. */
	if (in_iothread()) {
		p = bpf_map_lookup_elem(&thread_picks, &tid);
		if (p && (p->flags & PICK_READ) && (p->flags & (PICK_TAKEN | PICK_POLLS)))
			p->flags |= PICK_SPENT;
	}
	{
		__u32 *due = bpf_map_lookup_elem(&vm_signal_due, &vm);

		/* Every push is recorded, waited for or not: one left out
		 * (taken as another's by the count of a request started before
		 * the probes, which QEMU pushes too) would make every later
		 * request take the push after its own. */
		if (covers) {
			static const struct vm_pushes_event fresh = { .kind = EVENT_VM_PUSHES };
			struct vm_pushes_event *b = lookup_or_init(&thread_pushes, &tid, &fresh);
			__u32 i;

			if (!b)
				return 0;
			if (b->vm != vm) {
				send_pushes(tid, b);
				b->vm = vm;
			}
			/* A push of several completions is one stamp each. */
			for (i = 0; i < PUSH_BATCH && i < covers; i++) {
				__u32 n = b->n;

				if (n >= PUSH_BATCH) {
					send_pushes(tid, b);
					n = 0;
				}
				b->ts[n & (PUSH_BATCH - 1)] = bpf_ktime_get_ns();
				b->n = n + 1;
			}
			if (due)
				take_due(due, covers);
			if (b->n >= PUSH_BATCH || !due || !*due)
				send_pushes(tid, b);
			return 0;
		}
		if (!due || !take_due(due, 0))
			return 0;
	}
	ev.vm = vm;
	ev.ts_ns = bpf_ktime_get_ns();
	last_waits(tid, ev.wait_start, ev.wait_end);
	emit(&ev, sizeof(ev), ev.ts_ns);
	return 0;
}

/* The deep tier: VM slot `vm`'s engine raising an interrupt for its guest
 * now. The vCPU that runs next takes it (sched.bpf.c's vcpu_ran): its wait
 * for a CPU from here is the injection's. */
static __always_inline void note_raise(__u32 vm)
{
	__u32 idx = vm & (MAX_VM_COUNTS - 1);
	struct vm_counts *c = vm_counts_of(vm);
	__u64 *raised = bpf_map_lookup_elem(&vm_raised, &idx);

	if (raised)
		*raised = bpf_ktime_get_ns();
	if (c)
		__sync_fetch_and_add(&c->raises, 1);
}

/* The deep tier's used-ring push, which raises the completion's interrupt
 * (unless the guest, still reaping, asked for none): a raise of the
 * pushing process's VM (an engine outside QEMU is registered under it). */
static __always_inline void note_raise_here(void)
{
	struct vm_proc *p = vm_proc_of(bpf_get_current_pid_tgid() >> 32);

	if (targ_vm_segments && p)
		note_raise(p->slot);
}

static __always_inline void split_hist(struct vm_split_stats *st, int seg, __u64 v)
{
	__u32 b = hist_bucket(v);

	if (b >= HIST_BUCKETS)
		b = HIST_BUCKETS - 1;
	if (seg < 0 || seg >= VM_NR_SEGS)
		return;
	st->hist[seg][b] += 1;
	st->sum_ns[seg] += v;
	if (v > st->max_ns[seg])
		st->max_ns[seg] = v;
}

/* Where a drain keeps what consecutive requests share: their histograms'
 * entry (one per VM, virtual disk, host disk, op and queue) and their
 * virtual disk's streaming threshold. */
struct settle_cache {
	struct vm_split_key key;
	struct vm_split_stats *st;
	__u32 slow_vdisk;
	__u64 slow_ns;
};

/* Whether the agent wants this joined request streamed, and why. */
static __always_inline __u32 sampled_by(__u32 vm_flags, const struct tier_state *t,
					struct settle_cache *c, __u32 vdisk, __u64 window)
{
	__u32 why = 0;

	if (vdisk != c->slow_vdisk) {
		__u64 *slow = bpf_map_lookup_elem(&vdisk_slow_ns, &vdisk);

		c->slow_vdisk = vdisk;
		c->slow_ns = slow ? *slow : 0;
	}
	if (vm_flags & VMF_STREAM_ALL)
		why |= SAMPLED_ALL;
	if ((t->slower_than_ns && window >= t->slower_than_ns) ||
	    (c->slow_ns && window >= c->slow_ns))
		why |= SAMPLED_SLOW;
	if (t->one_in && bpf_get_prandom_u32() % t->one_in == 0)
		why |= SAMPLED_ONE_IN;
	return why;
}

static __always_inline void stream_joined(const struct done_ent *e, __u32 vm, __u64 sig, __u32 why)
{
	struct vm_split_event ev = {};

	ev.io.kind = EVENT_VM_SPLIT;
	ev.io.op = e->op;
	ev.io.flags = e->flags;
	ev.io.dev = e->dev;
	ev.io.kick_ns = e->kick_ns;
	ev.io.pick_ns = e->pick_ns;
	ev.io.start_ns = e->start_ns;
	ev.io.issue_ns = e->issue_ns;
	ev.io.done_ns = e->done_ns;
	ev.io.bytes = e->bytes;
	ev.io.vm = vm;
	ev.io.vdisk = e->vdisk;
	ev.io.queue = e->queue;
	ev.io.pos = e->pos;
	ev.signal_ns = sig;
	ev.sampled_by = why;
	if (!emit(&ev, sizeof(ev), sig))
		count(CNT_SAMPLED);
}

/* A request's window ended by the signal at `sig`: its segments into its
 * histograms, and out through the ring when sampled. */
static __always_inline void settle(const struct done_ent *e, __u32 vm, __u64 sig, __u32 flags,
				   const struct tier_state *t, struct settle_cache *c)
{
	struct vm_split_key k = {
		.vm = vm,
		.vdisk = e->vdisk,
		.dev = e->dev,
		.op = e->op,
		.queue = e->queue,
	};
	struct vm_split_stats *st;
	__u32 why;

	if (!(e->kick_ns <= e->pick_ns && e->pick_ns <= e->start_ns && e->start_ns <= e->done_ns &&
	      e->done_ns <= sig)) {
		count_unsplit(vm, e->vdisk, UNSPLIT_UNORDERED);
		return;
	}
	if (sig - e->done_ns > SIGNAL_HOLD_NS) {
		count_unsplit(vm, e->vdisk, UNSPLIT_NO_SIGNAL);
		return;
	}
	if (c->st && c->key.vm == k.vm && c->key.vdisk == k.vdisk && c->key.dev == k.dev &&
	    c->key.op == k.op && c->key.queue == k.queue) {
		st = c->st;
	} else {
		st = lookup_or_init(&vm_split, &k, &zero_split);
		if (!st) {
			count(CNT_VM_TABLE_FULL);
			return;
		}
		c->key = k;
		c->st = st;
	}
	st->count += 1;
	st->bytes += e->bytes;
	split_hist(st, VM_SEG_HYPERVISOR, e->pick_ns - e->kick_ns);
	split_hist(st, VM_SEG_ENGINE, (e->start_ns - e->pick_ns) + (sig - e->done_ns));
	split_hist(st, VM_SEG_DEVICE, e->done_ns - e->start_ns);
	split_hist(st, VM_SEG_WINDOW, sig - e->kick_ns);
	split_hist(st, VM_SEG_PICKUP_TO_DONE, e->done_ns - e->pick_ns);
	why = sampled_by(flags, t, c, e->vdisk, sig - e->kick_ns);
	if (why)
		stream_joined(e, vm, sig, why);
}

/* Slots one call of settle_batch settles at most. The verifier walks
 * settle once per slot of a batch (about 36,000 instructions each): a
 * batch of 16 took it a second per program to load; 4 keeps most of the
 * cache's hits (the slots of one signal mostly share a histogram entry). */
#define SETTLE_BATCH 4
/* settle_batch's answer: the drain stops (a slot unwritten yet, or
 * completed after the signal: it and those after it wait for the next). */
#define SETTLE_STOP  (1 << 16)

/* Up to SETTLE_BATCH slots of VM slot `vm`'s ring, at its signal `sig`:
 * how many it settled, with SETTLE_STOP when the drain should stop. A
 * slot another CPU's drain took is skipped: each slot is settled once. A
 * function of its own, verified once: a drain calls it in a loop. */
__noinline int settle_batch(__u32 vm, __u64 sig, __u32 vm_flags)
{
	struct tier_state *t = tier_now();
	struct done_ring *r = ring_of(vm);
	struct settle_cache c = {};
	int i, n = 0;

	if (!r || !t)
		return SETTLE_STOP;
	for (i = 0; i < SETTLE_BATCH; i++) {
		__u64 h = r->head;
		struct done_ent *e = &r->ent[h & DONE_MASK], copy;

		if (e->seq != h + 1 || e->done_ns > sig)
			return n | SETTLE_STOP;
		copy = *e;
		if (e->seq != h + 1)
			return n | SETTLE_STOP;
		if (__sync_val_compare_and_swap(&r->head, h, h + 1) != h)
			continue;
		settle(&copy, vm, sig, vm_flags, t, &c);
		n++;
	}
	return n;
}

/* VM slot `vm`'s signal at `sig`: every request waiting in its ring that
 * completed before it is settled, up to DRAIN_MAX. */
static __always_inline void join_signal(__u32 vm, __u64 sig)
{
	__u32 zero = 0, *busy, *flags, vmf = 0;
	int i, stop = 0;

	busy = bpf_map_lookup_elem(&draining, &zero);
	if (!busy)
		return;
	if (*busy) {
		count(CNT_JOIN_DEFERRED);
		return;
	}
	*busy = 1;
	flags = bpf_map_lookup_elem(&vm_flags, &vm);
	if (flags)
		vmf = *flags;
	for (i = 0; i < DRAIN_MAX / SETTLE_BATCH && !stop; i++)
		stop = settle_batch(vm, sig, vmf) & SETTLE_STOP;
	if (!stop)
		count(CNT_JOIN_DEFERRED);
	*busy = 0;
}

/* The always-on tier: an interrupt of VM slot `vm` from the current
 * thread. An iothread delivering completions after it submitted its
 * pickup's batch went round its loop: what it submits before its next
 * pickup was found by polling (as on_signal has it for the deep tier). */
static __always_inline void join_interrupt(__u32 vm)
{
	if (in_iothread()) {
		__u32 tid = (__u32)bpf_get_current_pid_tgid();
		struct pick *p = bpf_map_lookup_elem(&thread_picks, &tid);

		if (p && (p->flags & PICK_READ) && (p->flags & (PICK_TAKEN | PICK_POLLS)))
			p->flags |= PICK_SPENT;
	}
	join_signal(vm, bpf_ktime_get_ns());
}

/* An MSI KVM delivers, in the thread that raised it: the engine's signal
 * through its irqfd (or QEMU's KVM_SIGNAL_MSI). A kernel vhost worker's
 * counts for a VM with a vhost disk only: vhost-net's workers signal the
 * guest's network queues from the same process. The deep tier takes only
 * the vhost worker's (its virtio requests end at their pushes). */
SEC("tracepoint/kvm/kvm_msi_set_irq")
int kvm_msi_set_irq(void *ctx)
{
	struct vm_proc *p = vm_proc_of(bpf_get_current_pid_tgid() >> 32);
	__u32 vm, *flags;
	int vhost;

	if (!targ_vm_segments || !p)
		return 0;
	vm = p->slot;
	vhost = in_vhost_worker();
	if (vhost) {
		flags = bpf_map_lookup_elem(&vm_flags, &vm);
		if (!flags || (*flags & (VMF_VHOST | VMF_VHOST_SIGNAL)) != VMF_VHOST)
			return 0;
	}
	if (deep_tier()) {
		note_raise(vm);
		return vhost ? on_signal(0) : 0;
	}
	join_interrupt(vm);
	return 0;
}

/* A kernel vhost worker signalling a queue of its VM (`vhost_signal`,
 * after it pushed the used ring): the window's end, with or without KVM
 * (an irqfd's MSI is raised inside it; QEMU's own eventfd read under
 * TCG), and whichever thread the worker is (a kernel thread before Linux
 * 6.4). A kprobe attached with LIO's (scsi_target.bpf.c): the VM is then
 * marked VMF_VHOST_SIGNAL and its vhost MSIs are not counted again. */
SEC("kprobe/vhost_signal")
int BPF_KPROBE(vhost_signal_kprobe)
{
	struct vm_proc *p;
	__u32 tgid, *flags;

	if (!targ_vm_segments || !in_vhost_worker())
		return 0;
	tgid = served_tgid();
	p = tgid ? vm_proc_of(tgid) : 0;
	if (!p)
		return 0;
	flags = bpf_map_lookup_elem(&vm_flags, &p->slot);
	if (!flags || !(*flags & VMF_VHOST_SIGNAL))
		return 0;
	if (deep_tier()) {
		note_raise(p->slot);
		return on_signal(0);
	}
	join_interrupt(p->slot);
	return 0;
}

/* virtqueue_flush(vq, count): count completions pushed (virtqueue_push
 * flushes one). */
SEC("uprobe")
int BPF_KPROBE(virtqueue_flush, void *vq, unsigned int count)
{
	note_raise_here();
	return on_signal(count ? count : 1);
}

/* QEMU raising an MSI-X interrupt (NVMe's completions; any device
 * under TCG, where no kernel event shows the interrupt): the deep tier's
 * signal, and the always-on tier's for a VM without KVM (attached there
 * only where its kicks are seen: fentry or kprobes). */
SEC("uprobe")
int msix_notify(void *ctx)
{
	struct vm_proc *p = vm_proc_of(bpf_get_current_pid_tgid() >> 32);

	if (deep_tier()) {
		if (targ_vm_segments && p)
			note_raise(p->slot);
		return on_signal(0);
	}
	if (targ_vm_segments && p)
		join_interrupt(p->slot);
	return 0;
}

/* libvhost-user's used-ring push (fill, then flush), in an engine serving
 * the VM's disk over vhost-user (qemu-storage-daemon): once per request,
 * as virtqueue_flush in QEMU, and entered with a push where the flush is
 * not. The engine process is registered under the VM's slot. */
SEC("uprobe")
int vu_queue_push(void *ctx)
{
	note_raise_here();
	return on_signal(1);
}

/* Linked into host.bpf.o with block.bpf.c, whose license section it shares. */
