/* SPDX-License-Identifier: GPL-2.0 */
/*
 * A VM's request at the host block layer, for block.bpf.c's handlers: its
 * VM, virtual disk, offset and notification at the start; its accounting
 * at the completion, and its host window's join (the always-on tier) or
 * its record (the deep tier).
 */
#ifndef IOSPAN_VM_REQUEST_BPF_H
#define IOSPAN_VM_REQUEST_BPF_H

#include "host.bpf.h"
#include "rq_account.h"
#include "scsi_target.bpf.h"

/* Counted globally, and per VM entry where the lost request was a VM's
 * (the VM's own total is its entries' sum). */
void note_undelivered(const struct rq_slot *s);

/* What a VM's request is, taken at its start in the submitting task
 * (completions run in interrupt context under unrelated tasks). */
struct vm_start {
	__u64 kick_ns;
	__u64 pick_ns;
	__u64 pos;
	__u64 stamp_ns; /* when it was taken */
	__u32 vm;
	__u32 vdisk;
	__u32 dev;
	__u32 op;
	__u32 queue;
	__u32 hv_wait_ns;
	__u32 eng_wait_ns;
	__u32 polled;
};

/* A request of bio `bio` (its first), submitted by the current task for
 * the SCSI command `cmd` of a VM (acting_cmd), or none, on host disk
 * `dev`, op `op`, starting at `start` (the kernel's stamp, or ours):
 * whether a VM submitted it, and if so what it is. `btf`: a constant per
 * inlined call site, choosing direct or probe reads. */
int vm_bio_start(struct bio *bio, const struct vhost_cmd *cmd, __u32 dev, __u32 op, __u64 start,
		 int btf, struct vm_start *v);

/* The same for a request at block_io_start. */
int vm_request_start(struct request *rq, __u64 start, int btf, struct vm_start *v);

/* A VM's finished request: into vm_latency, with its whole byte count
 * (partial pieces were carried in the slot), and, for a virtual disk's,
 * its host window: joined here (always-on) or streamed (deep). */
void vm_request_done(const struct rq_outcome *o, __u32 dev, __u8 op, const __u64 seg[BLK_NR_SEGS],
		     __u64 now);

#endif /* IOSPAN_VM_REQUEST_BPF_H */
