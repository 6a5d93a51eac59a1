/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * The eBPF side's pure logic and record layouts, compiled natively so the
 * Rust tests drive the very same code with synthetic event streams and
 * compare layouts with the C compiler's.
 */
#include <stddef.h>
#include <linux/types.h>
#include "agent_abi.h"
#include "hist.h"
#include "rq_account.h"

__u32 shim_hist_bucket(__u64 v) { return hist_bucket(v); }

void shim_rq_on_start(struct rq_slot *s, __u64 rq, __u64 now, __u32 vm, __u32 vdisk,
		      __u64 kick_ns, __u64 pick_ns, __u64 pos, __u32 dev, __u32 op)
{
	rq_on_start(s, rq, now, vm, vdisk, kick_ns, pick_ns, pos, dev, op);
}
void shim_rq_on_issue(struct rq_slot *s, __u64 rq, __u64 now) { rq_on_issue(s, rq, now); }
void shim_rq_on_requeue(struct rq_slot *s, __u64 rq) { rq_on_requeue(s, rq); }
int shim_rq_undelivered(const struct rq_slot *s, __u64 rq) { return rq_undelivered(s, rq); }
int shim_rq_on_complete(struct rq_slot *s, const struct rq_completion *c, struct rq_outcome *o)
{
	return rq_on_complete(s, c, o);
}
void shim_rq_segments(const struct rq_outcome *o, __u64 now, __u64 *seg) { rq_segments(o, now, seg); }

/* Layout table: name, offset, size. */
struct shim_field {
	const char *name;
	size_t offset;
	size_t size;
};

#define F(type, field) { #type "." #field, offsetof(struct type, field), sizeof(((struct type *)0)->field) }
#define S(type) { #type, 0, sizeof(struct type) }

static const struct shim_field fields[] = {
	S(blk_io_event), F(blk_io_event, kind), F(blk_io_event, op), F(blk_io_event, flags),
	F(blk_io_event, dev), F(blk_io_event, start_ns), F(blk_io_event, issue_ns),
	F(blk_io_event, done_ns), F(blk_io_event, sector), F(blk_io_event, bytes),
	F(blk_io_event, requeues), F(blk_io_event, cpu_lo), F(blk_io_event, vdisk), F(blk_io_event, vm),
	S(rq_slot), F(rq_slot, rq), F(rq_slot, start_ns), F(rq_slot, issue_ns),
	F(rq_slot, done_bytes), F(rq_slot, requeues), F(rq_slot, flags), F(rq_slot, vm), F(rq_slot, vdisk), F(rq_slot, kick_ns), F(rq_slot, pick_ns), F(rq_slot, pos), F(rq_slot, dev), F(rq_slot, op), F(rq_slot, queue), F(rq_slot, hv_wait_ns), F(rq_slot, eng_wait_ns),
	S(disk_slot), F(disk_slot, queue), F(disk_slot, dev),
	S(vm_key), F(vm_key, vm), F(vm_key, dev), F(vm_key, op), F(vm_key, vdisk),
	S(file_key), F(file_key, dev), F(file_key, ino),
	S(vm_dev_key), F(vm_dev_key, vm), F(vm_dev_key, dev),
	S(vm_io_event), F(vm_io_event, kind), F(vm_io_event, op), F(vm_io_event, flags), F(vm_io_event, dev),
	F(vm_io_event, kick_ns), F(vm_io_event, pick_ns), F(vm_io_event, start_ns), F(vm_io_event, issue_ns),
	F(vm_io_event, done_ns), F(vm_io_event, bytes), F(vm_io_event, vm), F(vm_io_event, vdisk), F(vm_io_event, queue), F(vm_io_event, pos), F(vm_io_event, hv_wait_ns), F(vm_io_event, eng_wait_ns),
	S(vm_signal_event), F(vm_signal_event, kind), F(vm_signal_event, vm), F(vm_signal_event, ts_ns), F(vm_signal_event, wait_start), F(vm_signal_event, wait_end),
	S(vm_pushes_event), F(vm_pushes_event, kind), F(vm_pushes_event, n), F(vm_pushes_event, vm), F(vm_pushes_event, ts), F(vm_pushes_event, wait_start), F(vm_pushes_event, wait_end),
	S(vm_proc), F(vm_proc, slot), F(vm_proc, state),
	S(vm_split_key), F(vm_split_key, vm), F(vm_split_key, vdisk), F(vm_split_key, dev),
	F(vm_split_key, op), F(vm_split_key, queue),
	S(vm_split_stats), F(vm_split_stats, count), F(vm_split_stats, bytes), F(vm_split_stats, sum_ns),
	F(vm_split_stats, max_ns), F(vm_split_stats, hist),
	S(done_ring), F(done_ring, head), F(done_ring, tail), F(done_ring, vm), F(done_ring, _pad),
	F(done_ring, ent),
	S(vdisk_key), F(vdisk_key, vm), F(vdisk_key, vdisk),
	S(vm_unsplit), F(vm_unsplit, no_kick), F(vm_unsplit, no_signal), F(vm_unsplit, polled),
	F(vm_unsplit, unordered),
	S(tier_state), F(tier_state, deep), F(tier_state, handoff), F(tier_state, one_in),
	F(tier_state, pick_at_read), F(tier_state, slower_than_ns),
	S(vm_split_event), F(vm_split_event, io), F(vm_split_event, signal_ns),
	F(vm_split_event, sampled_by), F(vm_split_event, _pad),
	S(blk_stats), F(blk_stats, busy), F(blk_stats, ios), F(blk_stats, bytes), F(blk_stats, errors),
	F(blk_stats, requeued), F(blk_stats, partial), F(blk_stats, sum_ns), F(blk_stats, max_ns),
	F(blk_stats, hist),
	S(rq_completion), F(rq_completion, rq), F(rq_completion, kstart_ns), F(rq_completion, kissue_ns),
	F(rq_completion, now_ns), F(rq_completion, remaining), F(rq_completion, nr_bytes),
	S(rq_outcome), F(rq_outcome, start_ns), F(rq_outcome, issue_ns), F(rq_outcome, bytes),
	F(rq_outcome, requeues), F(rq_outcome, flags), F(rq_outcome, vm), F(rq_outcome, vdisk), F(rq_outcome, kick_ns), F(rq_outcome, pick_ns), F(rq_outcome, pos), F(rq_outcome, queue), F(rq_outcome, hv_wait_ns), F(rq_outcome, eng_wait_ns),
	S(guest_io_event), F(guest_io_event, kind), F(guest_io_event, op), F(guest_io_event, flags),
	F(guest_io_event, dev), F(guest_io_event, sector), F(guest_io_event, start_ns), F(guest_io_event, issue_ns),
	F(guest_io_event, kick_ns), F(guest_io_event, irq_ns), F(guest_io_event, done_ns), F(guest_io_event, bytes),
	F(guest_io_event, queue), F(guest_io_event, sys_ns), F(guest_io_event, reap_ns), F(guest_io_event, tgid),
	F(guest_io_event, tid),
	S(guest_reap_event), F(guest_reap_event, kind), F(guest_reap_event, flags), F(guest_reap_event, id),
	F(guest_reap_event, ts_ns),
	{ 0, 0, 0 },
};

const struct shim_field *shim_layout(void) { return fields; }

/* Constants the Rust side mirrors. */
struct shim_consts {
	__u32 hist_buckets, nr_ops, nr_segs, default_max_disks, rq_slots;
	__u32 f_partial, f_requeued, f_no_start, f_no_issue, f_error, f_done, f_requeue_pending;
	__u32 nr_counters, event_blk_io, vdisk_several, event_vm_io, event_vm_signal;
	__u32 nr_dio_end_io, vdisk_file_bdev;
	__u32 vq_by_index, vq_by_addr, vq_by_order, vq_value_mask;
	__u32 event_vm_pushes, push_batch;
	__u32 done_ring, done_ent_size, event_vm_split, _pad;
	__u64 signal_hold_ns;
};

void shim_consts(struct shim_consts *c)
{
	c->hist_buckets = HIST_BUCKETS;
	c->nr_ops = BLK_NR_OPS;
	c->nr_segs = BLK_NR_SEGS;
	c->default_max_disks = DEFAULT_MAX_DISKS;
	c->rq_slots = RQ_SLOTS;
	c->f_partial = RQ_F_PARTIAL;
	c->f_requeued = RQ_F_REQUEUED;
	c->f_no_start = RQ_F_NO_START;
	c->f_no_issue = RQ_F_NO_ISSUE;
	c->f_error = RQ_F_ERROR;
	c->f_done = RQ_F_DONE;
	c->f_requeue_pending = RQ_F_REQUEUE_PENDING;
	c->nr_counters = NR_COUNTERS;
	c->event_blk_io = EVENT_BLK_IO;
	c->vdisk_several = VDISK_SEVERAL;
	c->event_vm_io = EVENT_VM_IO;
	c->event_vm_signal = EVENT_VM_SIGNAL;
	c->nr_dio_end_io = NR_DIO_END_IO;
	c->vq_by_index = VQ_BY_INDEX;
	c->vq_by_addr = VQ_BY_ADDR;
	c->vq_by_order = VQ_BY_ORDER;
	c->vq_value_mask = VQ_VALUE_MASK;
	c->event_vm_pushes = EVENT_VM_PUSHES;
	c->push_batch = PUSH_BATCH;
	c->vdisk_file_bdev = VDISK_FILE_BDEV;
	c->done_ring = DONE_RING;
	c->done_ent_size = sizeof(struct done_ent);
	c->event_vm_split = EVENT_VM_SPLIT;
	c->signal_hold_ns = SIGNAL_HOLD_NS;
}
