/* SPDX-License-Identifier: GPL-2.0 */
/*
 * A VM's request at the host block layer, for block.bpf.c's handlers: its
 * VM, virtual disk, offset and notification at the start; its accounting
 * and record at the completion. Inlined where the request is seen; the
 * tables it reads are vm.bpf.c's.
 */
#ifndef IOSPAN_VM_REQUEST_BPF_H
#define IOSPAN_VM_REQUEST_BPF_H

/* The virtual disk a VM's direct-I/O request is for. Where the VM has one
 * virtual disk on this host disk, a direct-I/O bio of its process is that
 * disk's; only where several share it is the file or device read (see
 * enum dio_kind). Buffered I/O (cache=writeback, QEMU's own files) is not
 * resolved here (0), except from a vhost worker. `pos` is the request's
 * offset in the virtual disk's backing (the guest's offset on a raw
 * image), where known. */
static __always_inline __u32 vdisk_of(struct request *rq, __u32 vm, __u32 dev, __u64 *pos)
{
	struct bio *bio = BPF_CORE_READ(rq, bio);
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
	end_io = (__u64)BPF_CORE_READ(bio, bi_end_io);
	for (i = 0; i < NR_DIO_END_IO; i++)
		if (targ_dio_end_io[i] && end_io == targ_dio_end_io[i]) {
			kind = i;
			break;
		}
	if (kind < 0 && !in_vhost_worker())
		return 0;
	slot = bpf_map_lookup_elem(&vm_disks, &vk);
	if (!slot)
		return 0;
	/* A vhost worker serves only its VM's vhost disks, and submits their
	 * bios itself (LIO's block and file backstores: no kiocb to read): on
	 * a host disk holding one of them, the request is that disk's. A dm
	 * clone's offset is the physical disk's, not the virtual disk's. */
	if (kind < 0 || kind == DIO_DM_CLONE)
		return *slot != VDISK_SEVERAL ? *slot : 0;
	if (kind != DIO_IOMAP) {
		/* Kernels before 5.12 name the disk, not the bdev: no offset,
		 * and the device only where the VM has one disk on it. */
		if (!bpf_core_field_exists(bio->bi_bdev))
			return *slot != VDISK_SEVERAL ? *slot : 0;
		bdev = BPF_CORE_READ(bio, bi_bdev);
		*pos = (BPF_CORE_READ(bio, bi_iter.bi_sector) - BPF_CORE_READ(bdev, bd_start_sect)) << 9;
		if (*slot != VDISK_SEVERAL)
			return *slot;
		k.dev = VDISK_FILE_BDEV;
		k.ino = BPF_CORE_READ(bdev, bd_dev);
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
	if (*slot != VDISK_SEVERAL)
		return *slot;
	inode = BPF_CORE_READ(iocb, ki_filp, f_inode);
	k.ino = BPF_CORE_READ(inode, i_ino);
	k.dev = BPF_CORE_READ(inode, i_sb, s_dev);
	slot = bpf_map_lookup_elem(&vdisk_files, &k);
	return slot ? *slot : 0;
}

#define PF_IO_WORKER_FLAG 0x00000010 /* PF_IO_WORKER: an io_uring io-wq worker */

static __always_inline int in_io_worker(void)
{
	struct task_struct *t = (struct task_struct *)bpf_get_current_task();

	return !!(BPF_CORE_READ(t, flags) & PF_IO_WORKER_FLAG);
}

/* The kiocb a direct-I/O request serves, where its completion kind keeps
 * one (iomap, and the block device's asynchronous paths). */
static __always_inline __u64 rq_kiocb(struct request *rq)
{
	struct bio *bio = BPF_CORE_READ(rq, bio);
	struct blkdev_dio *bdio;
	struct iomap_dio *idio;
	__u64 end_io;

	if (!bio)
		return 0;
	end_io = (__u64)BPF_CORE_READ(bio, bi_end_io);
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

/* The pick an engine thread punted with the request (see punted_picks),
 * taken out of the table. */
static __always_inline int punted_pick_of(struct request *rq, struct pick *out)
{
	__u64 req = rq_kiocb(rq);
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

/* Counted globally, and per VM entry where the lost request was a VM's
 * (the VM's own total is its entries' sum). */
static __always_inline void note_undelivered(const struct rq_slot *s)
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

/* `btf`: a constant per inlined call site, choosing direct or probe reads.
 * Most requests return before any read of the request: the kernel keeps
 * their start time and no VM submitted them. */
static __always_inline void on_start(struct request *rq, __u64 kstart_ns, int btf)
{
	struct rq_slot *s;
	__u32 vm = 0, vdisk = 0, dev = 0, op = 0;
	__u64 key, kick_ns = 0, pick_ns = 0, pos = 0;
	__u16 queue = 0;
	__u32 hv_wait = 0, eng_wait = 0;
	/* Our start stamp, where the kernel keeps none: one clock read. */
	__u64 now = kstart_ns ? 0 : bpf_ktime_get_ns();
	int polled = 0;

	if (targ_track_vms) {
		__u64 pid_tgid = bpf_get_current_pid_tgid();
		__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
		__u32 *v = bpf_map_lookup_elem(&vm_pids, &tgid);

		/* Only a VM's requests need their submitter remembered. */
		if (v) {
			vm = *v;
			__u8 *state = bpf_map_lookup_elem(&vm_started, &tgid);

			dev = btf ? rq_dev_btf(rq) : rq_dev(rq);
			op = op_class(btf ? rq->cmd_flags : BPF_CORE_READ(rq, cmd_flags));
			if (state && *state == VM_RUNNING)
				vdisk = vdisk_of(rq, vm, dev, &pos);
			if (targ_vm_segments) {
				struct pick *p, punt;
				int own = 0;

				if (in_vhost_worker())
					claim_vhost_kick(tgid, tid);
				if (in_io_worker() && punted_pick_of(rq, &punt)) {
					/* The submitter's pick, as it was at the punt. */
					p = &punt;
					polled = !!(punt.flags & PICK_SPENT);
				} else if (!(p = bpf_map_lookup_elem(&thread_picks, &tid)))
					;
				else if (p->flags & PICK_USED)
					p = bpf_map_lookup_elem(&vm_last_pick, &tgid);
				else if (p->flags & PICK_HANDED)
					p->flags |= PICK_USED;
				else if (p->flags & PICK_READ) {
					polled = take_pick(p, kstart_ns ? kstart_ns : now);
					own = 1;
				}
				if (p && !polled) {
					kick_ns = p->kick_ns;
					pick_ns = own ? take_pop(tid, p->pick_ns, op) : p->pick_ns;
					queue = (__u16)p->queue;
					/* Taken after the pickup: the thread's waits up to
					 * then were the request's wait to be taken. */
					hv_wait = pick_ns == p->pick_ns ? p->hv_wait_ns
									: waited_within(tid, kick_ns, pick_ns);
					eng_wait = waited_within(tid, pick_ns, kstart_ns ? kstart_ns : now);
				}
			}
		}
	}
	if (kstart_ns && !vm)
		return;
	key = btf ? rq_key_btf(rq) : rq_key_raw(rq);
	s = rq_slot_of(key, 1);
	if (!s)
		return;
	if (rq_undelivered(s, key))
		note_undelivered(s);
	if (vm) {
		struct vm_counts *c = vm_counts_of(vm);

		if (c)
			__sync_fetch_and_add(&c->submitted, 1);
	}
	rq_on_start(s, key, now, vm, vdisk, kick_ns, pick_ns, pos,
		    dev, op);
	s->queue = queue;
	s->hv_wait_ns = hv_wait;
	s->eng_wait_ns = eng_wait;
	if (polled)
		s->flags |= RQ_F_POLLED;
}

/* A VM's finished request, for the agent to split its host window. */
static __always_inline void stream_vm_io(const struct rq_outcome *o, const struct rq_fields *f,
					 __u8 op, __u64 now)
{
	struct vm_io_event ev = {};

	signal_due(o->vm);
	ev.kind = EVENT_VM_IO;
	ev.op = op;
	ev.flags = (__u8)o->flags;
	ev.dev = f->dev;
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
	emit(&ev, sizeof(ev));
}

/* A VM's request: also into vm_latency, with its whole byte count (partial
 * pieces were carried in the slot). */
static __always_inline void account_vm(const struct rq_outcome *o, const struct rq_fields *f,
				       __u8 op, const __u64 seg[BLK_NR_SEGS])
{
	struct vm_key k = { .vm = o->vm, .dev = f->dev, .op = op, .vdisk = o->vdisk };

	account(&vm_latency, &vm_latency_nested, &k, o, seg, o->bytes, 1);
}

#endif /* IOSPAN_VM_REQUEST_BPF_H */
