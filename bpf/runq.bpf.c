// SPDX-License-Identifier: GPL-2.0
/*
 * CPU waits of VMs' threads: how long each was runnable but not running
 * (woken or preempted, until switched in) — esxtop's %RDY, for the threads
 * of the I/O path. The VM path's segments take from here how much of their
 * time the thread that owned them (the engine thread picking a kick up,
 * the thread submitting, the thread signalling the guest) spent waiting
 * for a CPU: vm.bpf.c, vm_request.bpf.h, on_signal in host.bpf.h.
 *
 * The switch is also where the kernel's vhost worker (a thread of QEMU
 * since v6.4) picks a pending kick up: it runs all its device's work when
 * it runs, and the requests it submits next belong to that kick, as an
 * engine thread's after its eventfd read (vhost.bpf.c).
 */
#include "host.bpf.h"

thread_waits_map_t thread_waits SEC(".maps");

/* A VM thread made runnable: its wait starts, unless one already runs
 * (a thread woken while still on its CPU is not waiting; switching out
 * sets the mark right, below). */
static __always_inline void on_wakeup(__u32 tgid, __u32 tid)
{
	static const struct run_waits zero;
	struct run_waits *w;

	if (!targ_vm_segments || !bpf_map_lookup_elem(&vm_pids, &tgid))
		return;
	w = lookup_or_init(&thread_waits, &tid, &zero);
	if (w && !w->runnable_since)
		w->runnable_since = bpf_ktime_get_ns();
}

/* A CPU switching from prev to next: prev, if still runnable (preempted),
 * starts waiting, else sleeps; next's wait, if it had one, ends. Only VM
 * threads have entries: any other switch costs two missed lookups (and a
 * VM lookup when it was preempted). */
static __always_inline void on_switch(__u32 prev_tgid, __u32 prev_tid, int preempted, __u32 next_tgid,
				      __u32 next_tid, struct task_struct *next)
{
	char comm[16];
	struct run_waits *w;
	__u64 now = 0;

	if (!targ_vm_segments)
		return;
	w = bpf_map_lookup_elem(&thread_waits, &prev_tid);
	if (!w && preempted && bpf_map_lookup_elem(&vm_pids, &prev_tgid)) {
		static const struct run_waits zero;

		w = lookup_or_init(&thread_waits, &prev_tid, &zero);
	}
	if (w) {
		now = bpf_ktime_get_ns();
		w->runnable_since = preempted ? now : 0;
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

		if (!now)
			now = bpf_ktime_get_ns();
		w->start[i & (RUN_WAITS - 1)] = w->runnable_since;
		w->end[i & (RUN_WAITS - 1)] = now;
		w->next++;
		w->runnable_since = 0;
	}
}

/* The task's state as it leaves the CPU: TASK_RUNNING (0) is a preemption.
 * `__state` since v5.14, `state` before. */
struct task_struct___pre514 {
	long state;
} __attribute__((preserve_access_index));

static __always_inline int still_runnable(struct task_struct *t)
{
	if (bpf_core_field_exists(t->__state))
		return BPF_CORE_READ(t, __state) == 0;
	return BPF_CORE_READ((struct task_struct___pre514 *)t, state) == 0;
}

SEC("tp_btf/sched_wakeup")
int BPF_PROG(sched_wakeup_btf, struct task_struct *p)
{
	on_wakeup(p->tgid, p->pid);
	return 0;
}

SEC("raw_tp/sched_wakeup")
int BPF_PROG(sched_wakeup, struct task_struct *p)
{
	on_wakeup(BPF_CORE_READ(p, tgid), BPF_CORE_READ(p, pid));
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(sched_switch_btf, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	on_switch(prev->tgid, prev->pid, still_runnable(prev), next->tgid, next->pid, next);
	return 0;
}

SEC("raw_tp/sched_switch")
int BPF_PROG(sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	on_switch(BPF_CORE_READ(prev, tgid), BPF_CORE_READ(prev, pid), still_runnable(prev),
		  BPF_CORE_READ(next, tgid), BPF_CORE_READ(next, pid), next);
	return 0;
}

/* Linked into host.bpf.o with block.bpf.c, whose license section it shares. */
