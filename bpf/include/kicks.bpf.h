/* SPDX-License-Identifier: GPL-2.0 */
/*
 * KVM kicks the always-on tier learns without system-call tracepoints.
 * KVM signals a notify address's eventfd inside the guest's exit, in the
 * vCPU thread: kvm:kvm_mmio names the address before the signal,
 * kvm:kvm_fast_mmio after it, and the signal wakes the engine thread that
 * waits on the eventfd (sched:sched_waking, in the vCPU thread). An
 * address whose write woke a thread of its VM that is no vCPU is a queue
 * notifier, that thread its engine (kvm_notifiers): from then on a write
 * there is a kick for that thread, whether or not it sleeps. The pairing
 * goes both ways round through two per-CPU marks: the address written
 * (mmio_mark, for the wake-up after it) and the last wake-up (last_wake,
 * for kvm_fast_mmio after it). A later pairing that names another thread
 * moves the notifier (QEMU hands a queue to an iothread when the guest
 * starts it).
 */
#ifndef IOSPAN_KICKS_BPF_H
#define IOSPAN_KICKS_BPF_H

#include "host.bpf.h"

/* (tgid, notify address) -> its engine thread and queue. */
struct notify_key {
	__u32 tgid;
	__u32 _pad;
	__u64 gpa;
};

struct notify_engine {
	__u32 tid;
	__u16 queue; /* VQ_* */
	__u16 slot;  /* its slot in the thread's thread_kicks */
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct notify_key);
	__type(value, struct notify_engine);
} kvm_notifiers_map_t;
extern kvm_notifiers_map_t kvm_notifiers SEC(".maps");

/* A vCPU's MMIO write not yet paired with a wake-up. A doorbell QEMU
 * handles in user space (NVMe without ioeventfd) wakes its engine only
 * after the exit: the mark waits up to MARK_NS for it. */
#define MARK_NS 200000ULL

struct mmio_mark {
	__u64 gpa;
	__u64 ts_ns;
	__u32 tid;
	__u32 tgid;
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mmio_mark);
} mmio_marks_map_t;
extern mmio_marks_map_t mmio_marks SEC(".maps");

/* This CPU's last wake-up: who woke whom. */
struct wake {
	__u32 waker;
	__u32 wakee;
	__u32 wakee_tgid;
	__u32 wakee_vcpu;
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct wake);
} last_wake_map_t;
extern last_wake_map_t last_wake SEC(".maps");

/* The write at `gpa` of VM process `tgid` woke `engine`: that is its
 * notifier's engine, and this a kick for it. A kick already waiting for
 * the thread the notifier had before is that thread's no more. */
void learnt_kick(__u32 tgid, __u64 gpa, __u32 engine, __u64 now);

#endif /* IOSPAN_KICKS_BPF_H */
