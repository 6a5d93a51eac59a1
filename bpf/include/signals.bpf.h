/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The deep tier's signals: each used-ring push (virtqueue_flush,
 * vu_queue_push) ends one request, the oldest completed without one; an
 * interrupt (NVMe's msix_notify, a vhost worker's irqfd) ends every
 * completion before it. Per VM slot, vm_signal_due counts its requests
 * completed on the host and not yet made visible by a signal. Pushes are
 * recorded one by one (the correlator gives each to one request),
 * gathered per thread and sent when none waits any more; an interrupt
 * makes a record only when any waits, and clears them.
 */
#ifndef IOSPAN_SIGNALS_BPF_H
#define IOSPAN_SIGNALS_BPF_H

#include "host.bpf.h"

/* `n` more of a VM's pushes to wait for: a request completed on the host
 * (one), or guest requests merged into another (one each). */
static __always_inline void signal_due_n(__u32 vm, __u32 n)
{
	__u32 *d = bpf_map_lookup_elem(&vm_signal_due, &vm);

	if (!d)
		bpf_map_update_elem(&vm_signal_due, &vm, &n, BPF_NOEXIST);
	else
		__sync_fetch_and_add(d, n);
}

static __always_inline void signal_due(__u32 vm)
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

/* The thread leaving its CPU sends what it gathered: it may not push
 * again for a while. */
static __always_inline void send_pushes_of(__u32 tid)
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

#endif /* IOSPAN_SIGNALS_BPF_H */
