// SPDX-License-Identifier: GPL-2.0
/*
 * The floor of what tracing the always-on tier's hooks can cost: a program
 * of the same name on each hook it attaches, in each flavour, doing only
 * what cannot be avoided there — one clock read where a segment needs a
 * time the kernel keeps nowhere (a completion, a kick, an interrupt), else
 * nothing. `cargo xtask bench vm` measures it in the same run as the tiers
 * (`iospan floor`), so each tier's programs are read against the price of
 * the hooks themselves.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

/* Where the stamps go, so that the clock read is not optimised away. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} floor_stamps SEC(".maps");

static __always_inline void stamp(void)
{
	__u32 zero = 0;
	__u64 *s = bpf_map_lookup_elem(&floor_stamps, &zero);

	if (s)
		*s = bpf_ktime_get_ns();
}

/* The tp_btf and raw_tp flavours of hook `tp`, named `name` as the tier's
 * are (`tp`, or a second program on it: nesting.bpf.h). */
#define FLOOR_NAMED(tp, name, body) \
	SEC("tp_btf/" #tp)          \
	int name##_btf(void *ctx)   \
	{                           \
		body;               \
		return 0;           \
	}                           \
	SEC("raw_tp/" #tp)          \
	int name(void *ctx)         \
	{                           \
		body;               \
		return 0;           \
	}
#define FLOOR(tp, body) FLOOR_NAMED(tp, tp, body)

/* A classic tracepoint, for the hooks the tier attaches that way. */
#define FLOOR_CLASSIC(cat, tp, body)    \
	SEC("tracepoint/" #cat "/" #tp) \
	int tp(void *ctx)               \
	{                               \
		body;                   \
		return 0;               \
	}

/* The block layer: the kernel stamps a request's start and issue itself
 * (start_time_ns, io_start_time_ns), not its completion. */
FLOOR(block_io_start, )
FLOOR(block_rq_issue, )
FLOOR(block_rq_complete, stamp())
FLOOR(block_rq_requeue, )
FLOOR(block_rq_insert, )
FLOOR(block_io_done, )
FLOOR(block_bio_backmerge, )
FLOOR(block_bio_frontmerge, )
FLOOR(block_rq_merge, )

/* Processes and the scheduler: a pickup's time is the switch's, taken
 * only when a kick waits. */
FLOOR(sched_process_exec, )
FLOOR(sched_process_exit, )
FLOOR(sched_process_fork, )
FLOOR(sched_switch, )
FLOOR(sched_waking, )
FLOOR_NAMED(sched_waking, sched_waking_nested, )
FLOOR(sched_wakeup, )
FLOOR_NAMED(sched_wakeup, sched_wakeup_nested, )
FLOOR(sched_wakeup_new, )

/* KVM: a kick's exit and an interrupt's injection are the segments' ends. */
FLOOR_CLASSIC(kvm, kvm_mmio, stamp())
FLOOR_CLASSIC(kvm, kvm_fast_mmio, stamp())
FLOOR_CLASSIC(kvm, kvm_msi_set_irq, stamp())
FLOOR_CLASSIC(io_uring, io_uring_queue_async_work, )

char LICENSE[] SEC("license") = "GPL";
