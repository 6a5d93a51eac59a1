/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The always-on tier's join: a VM request's host window put together in
 * the kernel. At its host completion the request (its kick, pickup, start
 * and completion) waits in its VM's table of completions (vm_done); the
 * VM's next interrupt ends the window of every request waiting there that
 * completed before it, and each lands in the per-CPU histograms of
 * vm_split per (VM, virtual disk, host disk, op, guest queue). Only the
 * requests the agent exports cross the ring buffer (sampled: every one at
 * least a threshold long, one in N, or all of a VM whose guest agent joins
 * them).
 *
 * The table is a ring of DONE_RING slots per VM: completions on any CPU
 * take the next index (an atomic add) and publish their slot last; an
 * interrupt on any CPU claims slots in order (compare-and-swap of the
 * head), each slot once (signals.bpf.c). This header is the completion's
 * side.
 */
#ifndef IOSPAN_VM_JOIN_BPF_H
#define IOSPAN_VM_JOIN_BPF_H

#include "host.bpf.h"
#include "hist.h"
#include "rq_account.h"

/* VM slot modulo the table's size -> its ring; the agent frees a VM's
 * ring (all zero) when the VM is gone. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 256);
	__type(key, __u32);
	__type(value, struct done_ring);
} vm_done_map_t;
extern vm_done_map_t vm_done SEC(".maps");

typedef struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 512);
	__type(key, struct vm_split_key);
	__type(value, struct vm_split_stats);
} vm_split_map_t;
extern vm_split_map_t vm_split SEC(".maps");

typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct vdisk_key);
	__type(value, struct vm_unsplit);
} vm_unsplit_map_t;
extern vm_unsplit_map_t vm_unsplit SEC(".maps");

/* Per virtual disk slot, the latency at least which its joined requests
 * are streamed (the agent's threshold for exporting the slowest few a
 * second, or one the user set). */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u64);
} vdisk_slow_ns_map_t;
extern vdisk_slow_ns_map_t vdisk_slow_ns SEC(".maps");

/* A drain in progress on this CPU: one nested in it (an interrupt raised
 * from interrupt context) leaves its completions to the next. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} draining_map_t;
extern draining_map_t draining SEC(".maps");

extern const struct vm_split_stats zero_split;

enum unsplit_why {
	UNSPLIT_NO_KICK,
	UNSPLIT_NO_SIGNAL,
	UNSPLIT_POLLED,
	UNSPLIT_UNORDERED
};

void count_unsplit(__u32 vm, __u32 vdisk, enum unsplit_why why);

/* The ring of VM slot `vm`, claimed for it if free. */
struct done_ring *ring_of(__u32 vm);

/* A VM's request completed on the host: it waits for the VM's signal, or,
 * when its window cannot be split, is counted why. */
void join_completed(const struct rq_outcome *o, __u32 dev, __u8 op, __u64 now);

#endif /* IOSPAN_VM_JOIN_BPF_H */
