// SPDX-License-Identifier: GPL-2.0
/*
 * Feature probes for `iospan doctor`: one trivial program per attach type.
 * Whether a type works is found by loading and attaching it, never by
 * reading a kernel version.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

__u64 hits = 0;

SEC("tp_btf/sched_process_exec")
int BPF_PROG(probe_tp_btf)
{
	__sync_fetch_and_add(&hits, 1);
	return 0;
}

SEC("raw_tp/sched_process_exec")
int probe_raw_tp(void *ctx)
{
	__sync_fetch_and_add(&hits, 1);
	return 0;
}

SEC("tracepoint/sched/sched_process_exec")
int probe_tracepoint(void *ctx)
{
	__sync_fetch_and_add(&hits, 1);
	return 0;
}

SEC("kprobe/do_nanosleep")
int BPF_KPROBE(probe_kprobe)
{
	__sync_fetch_and_add(&hits, 1);
	return 0;
}

SEC("fentry/do_nanosleep")
int BPF_PROG(probe_fentry)
{
	__sync_fetch_and_add(&hits, 1);
	return 0;
}

/* The atomic operations iospan's programs use (a fetch-and-add whose
 * result is used, compare-and-exchange): BPF_ATOMIC, Linux 5.12. Older
 * kernels' verifiers refuse them ("BPF_STX uses reserved fields"). */
SEC("raw_tp/sched_process_exec")
int probe_atomics(void *ctx)
{
	__u64 old = __sync_fetch_and_add(&hits, 1);

	__sync_val_compare_and_swap(&hits, old + 1, old + 1);
	return 0;
}

SEC("uprobe")
int BPF_KPROBE(probe_uprobe)
{
	__sync_fetch_and_add(&hits, 1);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
