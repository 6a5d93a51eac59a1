// SPDX-License-Identifier: GPL-2.0
/*
 * Context switches. The always-on tier's pickup where no eventfd read is
 * seen: an engine thread a kick woke picks it up as it is switched in.
 * The deep tier's CPU waits of VMs' threads: how long each was runnable but
 * not running (woken or preempted, until switched in) — esxtop's %RDY, for
 * the threads of the I/O path; the pickup, the request start and the
 * signal take from here how much of their segment the thread that owned it
 * spent waiting for a CPU. And the kernel's vhost worker (a thread of
 * QEMU since v6.4) picking up a kick on the eventfds QEMU handed it: it
 * runs all its device's work when it runs.
 */
#include "pickups.bpf.h"
#include "signals.bpf.h"
#include "nesting.bpf.h"

/* A VM thread made runnable: its wait starts, unless one already runs
 * (a thread woken while still on its CPU is not waiting; switching out
 * sets the mark right, below). */
static __always_inline void on_wakeup(__u32 tgid, __u32 tid)
{
	static const struct run_waits zero;
	struct run_waits *w;

	if (!targ_vm_segments || !deep_tier() || !vm_proc_of(tgid))
		return;
	w = lookup_or_init(&thread_waits, &tid, &zero);
	if (w && !w->runnable_since)
		w->runnable_since = bpf_ktime_get_ns();
}

/* A woken or preempted wait after which a raise counts as its cause: a
 * vCPU woken this long after its VM's last raise was woken by something
 * else (a timer, an IPI). */
#define VCPU_WAKE_WITHIN_NS 1000000ULL

/* A vCPU of process `tgid` switched in at `now`, runnable since `since`:
 * if its VM raised an interrupt no vCPU had run since, the part of this
 * wait after the raise (after its wake-up, when the raise woke it) is the
 * interrupt's injection waiting for a CPU. The raise is taken either way:
 * the next run of a vCPU is what takes it. */
static __always_inline void vcpu_ran(__u32 tgid, __u64 since, __u64 now)
{
	struct vm_proc *p = vm_proc_of(tgid);
	struct vm_counts *c;
	__u64 *raised, raise;
	__u32 idx;

	if (!p)
		return;
	idx = p->slot & (MAX_VM_COUNTS - 1);
	raised = bpf_map_lookup_elem(&vm_raised, &idx);
	if (!raised || !(raise = *raised) || raise > now)
		return;
	*raised = 0;
	if (since > raise + VCPU_WAKE_WITHIN_NS)
		return;
	c = vm_counts_of(p->slot);
	if (c) {
		__sync_fetch_and_add(&c->vcpu_waits, 1);
		__sync_fetch_and_add(&c->vcpu_wait_ns, now - (since > raise ? since : raise));
	}
}

/* The deep tier's part of a switch from prev to next: prev, if still
 * runnable (preempted), starts waiting, else sleeps; next's wait, if it had
 * one, ends. Only VM threads have entries: any other switch costs two
 * missed lookups (and a VM lookup when it was preempted). */
static __always_inline void waits_at_switch(__u32 prev_tgid, __u32 prev_tid, int preempted,
					    __u32 next_tgid, __u32 next_tid,
					    struct task_struct *next, __u64 *now)
{
	char comm[16];
	struct run_waits *w;

	w = bpf_map_lookup_elem(&thread_waits, &prev_tid);
	if (!w && preempted && vm_proc_of(prev_tgid)) {
		static const struct run_waits zero;

		w = lookup_or_init(&thread_waits, &prev_tid, &zero);
	}
	if (w) {
		if (!*now)
			*now = bpf_ktime_get_ns();
		w->runnable_since = preempted ? *now : 0;
		send_pushes_of(prev_tid);
	}
	w = bpf_map_lookup_elem(&thread_waits, &next_tid);
	if (!w)
		return;
	BPF_CORE_READ_INTO(&comm, next, comm);
	if (vhost_comm(comm))
		claim_vhost_kick(next_tgid, next_tid);
	if (w->runnable_since) {
		__u32 i = w->next & (RUN_WAITS - 1);

		if (!*now)
			*now = bpf_ktime_get_ns();
		w->start[i & (RUN_WAITS - 1)] = w->runnable_since;
		w->end[i & (RUN_WAITS - 1)] = *now;
		w->next++;
		if (vcpu_comm(comm))
			vcpu_ran(next_tgid, w->runnable_since, *now);
		w->runnable_since = 0;
	}
}

/* The task's state as it leaves the CPU: TASK_RUNNING (0) is a preemption.
 * Kernels before 5.14 (2f064a59a11f) name the field `state`. */
struct task_struct___pre514 {
	long state;
} __attribute__((preserve_access_index));

static __always_inline int still_runnable(struct task_struct *t)
{
	if (bpf_core_field_exists(t->__state))
		return BPF_CORE_READ(t, __state) == 0;
	return BPF_CORE_READ((struct task_struct___pre514 *)t, state) == 0;
}

/* A CPU switching from prev to next. The always-on tier: next, an engine
 * thread a kick is waiting for (it slept, and the kick woke it), picks it
 * up as it is switched in — unless pickups come from its eventfd read
 * (fentry or kprobes). Threads no kick was ever for (threads_kicked) cost
 * a switch two array reads: prev's state and next's switch count are read
 * only for a thread that may have kicks waiting. `btf`: a constant per
 * inlined call site, choosing direct or probe reads. */
static __always_inline void on_switch(struct task_struct *prev, __u32 prev_tgid, __u32 prev_tid,
				      struct task_struct *next, __u32 next_tgid, __u32 next_tid,
				      int btf)
{
	struct tier_state *t = tier_now();
	struct thread_kicks *k;
	__u64 now = 0;

	if (!targ_vm_segments || !t)
		return;
	if (t->deep)
		waits_at_switch(prev_tgid, prev_tid, still_runnable(prev), next_tgid, next_tid,
				next, &now);
	if (t->pick_at_read)
		return;
	k = thread_kicks_of(prev_tid);
	if (k && k->pending && !still_runnable(prev))
		kicks_read_by_sleep(k);
	k = thread_kicks_of(next_tid);
	if (k && k->pending) {
		if (!now)
			now = bpf_ktime_get_ns();
		pick_after_sleep(next_tgid, next_tid, now, READ(btf, next, nvcsw));
	}
}

/* Each with its second program (nesting.bpf.h). */
NESTED_WAKE_PROGRAMS("tp_btf/sched_wakeup", sched_wakeup_btf, sched_wakeup_nested_btf, NEST_WAKEUP,
		     CNT_NESTED_WAKEUP, on_wakeup(p->tgid, p->pid))
NESTED_WAKE_PROGRAMS("raw_tp/sched_wakeup", sched_wakeup, sched_wakeup_nested, NEST_WAKEUP,
		     CNT_NESTED_WAKEUP, on_wakeup(BPF_CORE_READ(p, tgid), BPF_CORE_READ(p, pid)))

SEC("tp_btf/sched_switch")
int BPF_PROG(sched_switch_btf, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	on_switch(prev, prev->tgid, prev->pid, next, next->tgid, next->pid, 1);
	return 0;
}

SEC("raw_tp/sched_switch")
int BPF_PROG(sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	on_switch(prev, BPF_CORE_READ(prev, tgid), BPF_CORE_READ(prev, pid), next,
		  BPF_CORE_READ(next, tgid), BPF_CORE_READ(next, pid), 0);
	return 0;
}

/* Linked into host.bpf.o with block.bpf.c, whose license section it shares. */
