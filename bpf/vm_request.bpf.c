/* SPDX-License-Identifier: GPL-2.0 */
/* A VM's requests: which VM disk a request is for, its pick, its start and
 * its end (vm_request.bpf.h). */
#include "vm_request.bpf.h"
#include "blk_op.bpf.h"
#include "core_fixes.bpf.h"
#include "linked.h"
#include "pickups.bpf.h"
#include "signals.bpf.h"
#include "stats.bpf.h"
#include "vm_join.bpf.h"

/* What the last process to start a request on this CPU is (consecutive
 * requests come from one engine thread, a batch at a time): its VM and the
 * VM's virtual disk on the last host disk, good for the generation of
 * vm_gen they were read in. */
struct proc_cache {
	__u32 tgid;
	__u32 gen;
	struct vm_proc proc; /* slot 0: no VM's */
	__u32 dev;
	__u32 vdisk_slot; /* vm_disks[(slot, dev)]: 0 none, VDISK_SEVERAL */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct proc_cache);
} proc_cache SEC(".maps");

#define PF_IO_WORKER_FLAG 0x00000010 /* PF_IO_WORKER: an io_uring io-wq worker */

/* The kiocb a direct-I/O bio serves, where its completion kind keeps one
 * (iomap, and the block device's asynchronous paths). */
static __always_inline __u64 bio_kiocb(struct bio *bio, int btf)
{
	struct blkdev_dio *bdio;
	struct iomap_dio *idio;
	__u64 end_io;

	if (!bio)
		return 0;
	end_io = (__u64)READ(btf, bio, bi_end_io);
	if (!end_io)
		return 0;
	if (end_io == targ_dio_end_io[DIO_IOMAP]) {
		idio = BPF_CORE_READ(bio, bi_private);
		return (__u64)BPF_CORE_READ(idio, iocb);
	}
	if (end_io == targ_dio_end_io[DIO_BLKDEV]) {
		bdio = BPF_CORE_READ(bio, bi_private);
		return (__u64)BPF_CORE_READ(bdio, iocb);
	}
	if (end_io == targ_dio_end_io[DIO_BLKDEV_ASYNC]) {
		/* The bio is embedded in its blkdev_dio. */
		bdio = (void *)bio - bpf_core_field_offset(struct blkdev_dio, bio);
		return (__u64)BPF_CORE_READ(bdio, iocb);
	}
	return 0;
}

/* Whether a direct-I/O bio at offset 0 of a VM process's main thread is
 * QEMU's own: a synchronous read there is its probe of the image's
 * alignment, as it opens the image and again as it exits. A guest's
 * requests never are: QEMU's main loop submits them asynchronously
 * (io_uring, Linux AIO), aio=threads from its pool's workers. A
 * device-mapper clone hides its kiocb: not told. */
static __always_inline int qemus_probe(struct bio *bio, int kind, int btf)
{
	struct kiocb *iocb;

	if (kind == DIO_BLKDEV_SYNC)
		return 1;
	iocb = (struct kiocb *)bio_kiocb(bio, btf);
	return iocb && !BPF_CORE_READ(iocb, ki_complete);
}

/* The virtual disk a VM's direct-I/O request is for. Where the VM has one
 * virtual disk on this host disk, a direct-I/O bio of its process is that
 * disk's; only where several share it is the file or device read (see
 * enum dio_kind). Buffered I/O (cache=writeback, QEMU's own files) is not
 * resolved here (0), except from a vhost worker, nor is QEMU's probe of an
 * image (qemus_probe). `pos` is the request's
 * offset in the virtual disk's backing (the guest's offset on a raw
 * image), where known. `acting`: the task executes a VM's SCSI command
 * for it (LIO's workqueue). */
static __always_inline __u32 vdisk_of(struct bio *bio, __u32 vm, __u32 dev, __u64 *pos, int btf,
				      struct proc_cache *c, int main_thread, int acting)
{
	struct vm_dev_key vk = { .vm = vm, .dev = dev };
	struct iomap_dio *dio_priv;
	struct block_device *bdev;
	struct kiocb *iocb;
	struct inode *inode;
	struct file_key k = {};
	__u64 end_io;
	__u32 *slot;
	int i, kind = -1;

	if (!bio)
		return 0;
	end_io = (__u64)READ(btf, bio, bi_end_io);
	for (i = 0; i < NR_DIO_END_IO; i++)
		if (targ_dio_end_io[i] && end_io == targ_dio_end_io[i]) {
			kind = i;
			break;
		}
	if (kind < 0 && !acting && !in_vhost_worker())
		return 0;
	if (c->dev != dev) {
		slot = bpf_map_lookup_elem(&vm_disks, &vk);
		c->dev = dev;
		c->vdisk_slot = slot ? *slot : 0;
	}
	slot = &c->vdisk_slot;
	if (!*slot)
		return 0;
	/* A vhost worker serves only its VM's vhost disks, and its commands'
	 * bios are submitted by it or by LIO's workqueue for it (LIO's block
	 * and file backstores: no kiocb to read): on a host disk holding one
	 * of them, the request is that disk's. A dm
	 * clone's offset is the physical disk's, not the virtual disk's. */
	if (kind < 0 || kind == DIO_DM_CLONE)
		return *slot != VDISK_SEVERAL ? *slot : 0;
	if (kind != DIO_IOMAP) {
		/* Kernels before 5.12 name the disk, not the bdev: no offset,
		 * and the device only where the VM has one disk on it. */
		if (!bpf_core_field_exists(bio->bi_bdev))
			return *slot != VDISK_SEVERAL ? *slot : 0;
		bdev = READ(btf, bio, bi_bdev);
		*pos = (READ(btf, bio, bi_iter.bi_sector) - READ(btf, bdev, bd_start_sect)) << 9;
		if (main_thread && !*pos && qemus_probe(bio, kind, btf))
			return 0;
		if (*slot != VDISK_SEVERAL)
			return *slot;
		k.dev = VDISK_FILE_BDEV;
		k.ino = READ(btf, bdev, bd_dev);
		slot = bpf_map_lookup_elem(&vdisk_files, &k);
		return slot ? *slot : 0;
	}
	/* The iomap_dio begins with the kiocb. Its position is the direct
	 * I/O's start until it completes: the guest's offset on a raw image,
	 * which joins guest and host records. */
	dio_priv = BPF_CORE_READ(bio, bi_private);
	iocb = BPF_CORE_READ(dio_priv, iocb);
	if (!iocb)
		return 0;
	*pos = BPF_CORE_READ(iocb, ki_pos);
	if (main_thread && !*pos && qemus_probe(bio, kind, btf))
		return 0;
	if (*slot != VDISK_SEVERAL)
		return *slot;
	inode = BPF_CORE_READ(iocb, ki_filp, f_inode);
	k.ino = BPF_CORE_READ(inode, i_ino);
	k.dev = BPF_CORE_READ(inode, i_sb, s_dev);
	slot = bpf_map_lookup_elem(&vdisk_files, &k);
	return slot ? *slot : 0;
}

static __always_inline int in_io_worker(struct task_struct *t, int btf)
{
	return !!(READ(btf, t, flags) & PF_IO_WORKER_FLAG);
}

/* The pick an engine thread punted with the request of this bio (see
 * punted_picks), taken out of the table. */
static __always_inline int punted_pick_of(struct bio *bio, struct pick *out, int btf)
{
	__u64 req = bio_kiocb(bio, btf);
	struct pick *p;

	if (!req)
		return 0;
	p = bpf_map_lookup_elem(&punted_picks, &req);
	if (!p)
		return 0;
	*out = *p;
	bpf_map_delete_elem(&punted_picks, &req);
	return 1;
}

__inline_linked void note_undelivered(const struct rq_slot *s)
{
	static const __u64 zero;
	struct vm_key k = { .vm = s->vm, .dev = s->dev, .op = s->op, .vdisk = s->vdisk };
	__u64 *n;

	count(CNT_UNDELIVERED);
	if (!s->vm)
		return;
	n = lookup_or_init(&vm_undelivered, &k, &zero);
	if (n)
		__sync_fetch_and_add(n, 1);
}

/* Whether the current task's request now starting is the first of its
 * submitting call: no plug, or none of the plug's requests added yet (the
 * request is added to it after this tracepoint). */
static __always_inline int first_of_call(struct task_struct *t, int btf)
{
	struct blk_plug *plug = READ(btf, t, plug);

	return !plug || READ(btf, plug, rq_count) == 0;
}

/* The notification a VM thread's request at `start` came with: the
 * thread's pick (its own pickup, one handed to it by the engine thread,
 * or the submitter's for an io_uring request punted to a worker). */
static __always_inline void vm_pick(struct bio *bio, __u32 tgid, __u32 tid, __u64 start,
				    struct vm_start *v, int btf)
{
	struct task_struct *t = current_task(btf);
	struct pick *p, punt;
	int deep = deep_tier();
	__u32 picker;
	__u64 nvcsw = READ(btf, t, nvcsw);

	if (deep && in_vhost_worker())
		claim_vhost_kick(tgid, tid);
	/* A kick that came while the thread ran (it needed no wake-up) is
	 * picked up as it starts its next submitting call: at the first
	 * request of a plug (a call submitting a batch plugs it), or at an
	 * unplugged request. */
	if (first_of_call(t, btf))
		pick_up_thread_kick(tgid, tid, 0, nvcsw);
	if (in_io_worker(t, btf) && punted_pick_of(bio, &punt, btf)) {
		/* The submitter's pick, as it was at the punt. */
		p = &punt;
		v->polled = !!(punt.flags & PICK_SPENT);
	} else if (!(p = bpf_map_lookup_elem(&thread_picks, &tid)))
		return;
	else if (p->flags & PICK_USED)
		p = bpf_map_lookup_elem(&vm_last_pick, &tgid);
	else if (p->flags & PICK_HANDED)
		p->flags |= PICK_USED;
	else if (p->flags & PICK_READ)
		v->polled = take_pick(p, start, nvcsw);
	if (!p || v->polled)
		return;
	v->kick_ns = p->kick_ns;
	v->queue = (__u16)p->queue;
	/* The device model's own stamp of the request, from the thread that
	 * picked the kick up: taken by its own starts, or by the workers it
	 * queued the requests to (aio=threads), which otherwise would date
	 * every request a polling iothread took under one pickup from that
	 * pickup's read. A punted request's stamp went with its submitter's
	 * own starts. */
	picker = p->engine ?: tid;
	v->pick_ns = deep && p != &punt ? take_pop(picker, p->pick_ns, v->op) : p->pick_ns;
	if (deep) {
		/* Taken after the pickup: the picking thread's waits up to then
		 * were the request's wait to be taken. */
		v->hv_wait_ns = v->pick_ns == p->pick_ns
					? p->hv_wait_ns
					: waited_within(picker, v->kick_ns, v->pick_ns);
		v->eng_wait_ns = waited_within(tid, v->pick_ns, start);
	}
}

/* The current process's VM (slot 0: none), through this CPU's cache. */
static __always_inline struct proc_cache *cached_proc(__u32 tgid)
{
	__u32 zero = 0, gen = vm_gen_now();
	struct proc_cache *c = bpf_map_lookup_elem(&proc_cache, &zero);
	struct vm_proc *p;

	if (!c)
		return 0;
	if (c->tgid == tgid && c->gen == gen)
		return c;
	p = vm_proc_of(tgid);
	c->tgid = tgid;
	c->gen = gen;
	c->proc.slot = p ? p->slot : 0;
	c->proc.state = p ? p->state : 0;
	c->dev = 0;
	return c;
}

/* A VM's SCSI command's notification: the kick it came with and its pop
 * by the vhost worker, whichever task submits it (`tid`, at `start`); in
 * the deep tier, the worker's CPU waits from kick to pop, and the
 * submitter's from pop to start where it is a VM's thread (the worker). */
static __always_inline void vhost_cmd_pick(const struct vhost_cmd *cmd, __u32 tid, __u64 start,
					   struct vm_start *v)
{
	if (cmd->flags & VHOST_CMD_POLLED) {
		v->polled = 1;
		return;
	}
	if (!cmd->kick_ns)
		return;
	v->kick_ns = cmd->kick_ns;
	v->pick_ns = cmd->pick_ns;
	if (deep_tier()) {
		v->hv_wait_ns = waited_within(cmd->worker, cmd->kick_ns, cmd->pick_ns);
		v->eng_wait_ns = waited_within(tid, cmd->pick_ns, start);
	}
}

__inline_linked int vm_bio_start(struct bio *bio, const struct vhost_cmd *cmd, __u32 dev, __u32 op,
				 __u64 start, int btf, struct vm_start *v)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pid_tgid;
	__u32 tgid = submitter_tgid(pid_tgid, cmd);
	struct proc_cache *c = cached_proc(tgid);

	if (!c || !c->proc.slot)
		return 0;
	v->vm = c->proc.slot;
	v->dev = dev;
	v->op = op;
	v->stamp_ns = start;
	if (!bio)
		return 1;
	if (c->proc.state == VM_PROC_STARTING && in_vcpu()) {
		/* A vCPU submitting it: QEMU serves a device in the vCPU's exit
		 * until the guest driver starts its notifiers — the firmware's
		 * first reads. The guest runs. */
		struct vm_proc *p = vm_proc_of(tgid);

		if (p)
			vm_proc_set_state(p, VM_PROC_RUNNING);
		c->proc.state = VM_PROC_RUNNING;
	}
	if (c->proc.state == VM_PROC_RUNNING)
		v->vdisk = vdisk_of(bio, v->vm, v->dev, &v->pos, btf, c, tid == tgid, !!cmd);
	if (targ_vm_segments && cmd)
		vhost_cmd_pick(cmd, tid, start, v);
	else if (targ_vm_segments)
		vm_pick(bio, tgid, tid, start, v, btf);
	return 1;
}

__inline_linked int vm_request_start(struct request *rq, __u64 start, int btf, struct vm_start *v)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	const struct vhost_cmd *cmd = acting_cmd(pid_tgid);
	struct proc_cache *c = cached_proc(submitter_tgid(pid_tgid, cmd));

	/* Most requests are no VM's: out before any read of the request. */
	if (!c || !c->proc.slot)
		return 0;
	return vm_bio_start(READ(btf, rq, bio), cmd, btf ? rq_dev_btf(rq) : rq_dev(rq),
			    op_class(READ(btf, rq, cmd_flags)), start, btf, v);
}

/* The deep tier: a VM's finished request, for the agent to split its host
 * window. */
static __always_inline void stream_vm_io(const struct rq_outcome *o, __u32 dev, __u8 op, __u64 now)
{
	struct vm_io_event ev = {};

	signal_due(o->vm);
	ev.kind = EVENT_VM_IO;
	ev.op = op;
	ev.flags = (__u8)o->flags;
	ev.dev = dev;
	ev.kick_ns = o->kick_ns;
	ev.pick_ns = o->pick_ns;
	ev.start_ns = o->start_ns;
	ev.issue_ns = o->issue_ns;
	ev.done_ns = now;
	ev.bytes = o->bytes;
	ev.vm = o->vm;
	ev.vdisk = o->vdisk;
	ev.queue = (__u16)o->queue;
	ev.pos = o->pos;
	ev.hv_wait_ns = o->hv_wait_ns;
	ev.eng_wait_ns = o->eng_wait_ns;
	emit(&ev, sizeof(ev), now);
}

__inline_linked void vm_request_done(const struct rq_outcome *o, __u32 dev, __u8 op,
				     const __u64 seg[BLK_NR_SEGS], __u64 now)
{
	struct vm_key k = { .vm = o->vm, .dev = dev, .op = op, .vdisk = o->vdisk };

	account(&vm_latency, &vm_latency_nested, &k, o, seg, o->bytes, 1);
	if (!targ_vm_segments || !o->vdisk)
		return;
	if (deep_tier())
		stream_vm_io(o, dev, op, now);
	else
		join_completed(o, dev, op, now);
}
