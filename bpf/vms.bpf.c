// SPDX-License-Identifier: GPL-2.0
/*
 * Which processes are VMs (exec), the tables the agent keeps about them,
 * and the guest requests that never become host requests of their own
 * (merges). block.bpf.c attributes each request to its VM through these.
 */
#include "host.bpf.h"
#include "core_fixes.bpf.h"
#include "notifiers.bpf.h"
#include "signals.bpf.h"

/* Next VM slot to hand out; the agent starts it past the VMs it found. */
__u32 next_vm = 0;

/* The tgid of each VM process just exec'd, each record waking the agent:
 * it names the VM at once instead of looking every few milliseconds (an
 * idle agent's wakeups land on every process's CPU). A record that finds
 * no room is no loss: vm_gen has moved, and the agent's slower look at it
 * names the VM. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096);
} vm_execs SEC(".maps");

/* Whether a program name is a QEMU system emulator's as distributions
 * install it: qemu-system-* (upstream, Debian, SUSE), qemu-kvm (RHEL,
 * Fedora), kvm (Proxmox). Mirrors vms::is_qemu_comm; the agent drops a
 * process that turns out to run no guest. */
static __always_inline int vm_comm(const char *comm)
{
	const char prefix[] = VM_COMM_PREFIX;
	int i, qemu = 1;

	for (i = 0; i < sizeof(prefix) - 1; i++)
		if (comm[i] != prefix[i])
			qemu = 0;
	if (qemu)
		return 1;
	if (comm[0] == 'q' && comm[1] == 'e' && comm[2] == 'm' && comm[3] == 'u' &&
	    comm[4] == '-' && comm[5] == 'k' && comm[6] == 'v' && comm[7] == 'm' && comm[8] == 0)
		return 1;
	return comm[0] == 'k' && comm[1] == 'v' && comm[2] == 'm' && comm[3] == 0;
}

/* A new process whose command is a VM: give it a slot before its first
 * request, so no request of it is ever attributed to the host. */
static __always_inline void on_exec(void)
{
	char comm[16];
	struct vm_proc p = { .state = VM_PROC_STARTING };
	__u32 tgid;

	if (!targ_track_vms)
		return;
	bpf_get_current_comm(comm, sizeof(comm));
	if (!vm_comm(comm))
		return;
	tgid = bpf_get_current_pid_tgid() >> 32;
	p.slot = __sync_fetch_and_add(&next_vm, 1) + 1;
	bpf_map_update_elem(&vm_pids, &tgid, &p, BPF_NOEXIST);
	vm_gen_bump();
	bpf_ringbuf_output(&vm_execs, &tgid, sizeof(tgid), BPF_RB_FORCE_WAKEUP);
	/* Its notifiers' creation is watched while the deep tier runs. */
	if (targ_vm_segments && deep_tier()) {
		__u8 one = 1;

		bpf_map_update_elem(&vm_notifiers_known, &tgid, &one, BPF_ANY);
	}
}

SEC("tp_btf/sched_process_exec")
int BPF_PROG(sched_process_exec_btf)
{
	on_exec();
	return 0;
}

SEC("raw_tp/sched_process_exec")
int BPF_PROG(sched_process_exec)
{
	on_exec();
	return 0;
}

/* Guest requests that never become host requests of their own: merged
 * into a neighbour's by QEMU (virtio-blk merges adjacent requests of one
 * batch and accounts them with block_acct_merge_done(stats, type, n), a
 * call made only when it merges) or, bio into request, by the host block
 * layer in the VM's submitting thread. Both are rare under random I/O and
 * the rule under sequential I/O: without them a VM's request count would
 * fall short of its guest's. */
/* Whether a bio is a guest's: direct I/O (QEMU's cache=none and
 * cache=directsync engines) or a kernel vhost worker's. A VM's own buffered
 * reads (its firmware, kernel and option ROM files, often on the disk that
 * holds its images) are not, and neither are their merges. */
static __always_inline int guest_bio(struct bio *bio, int btf)
{
	__u64 end_io = (__u64)READ(btf, bio, bi_end_io);
	int i;

	for (i = 0; i < NR_DIO_END_IO; i++)
		if (targ_dio_end_io[i] && end_io == targ_dio_end_io[i])
			return 1;
	return in_vhost_worker();
}

static __always_inline void note_merges(__u64 n, int engine, __u32 dev)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	struct vm_counts *c;
	struct vm_proc *p;
	__u32 vm;

	if (!targ_track_vms)
		return;
	p = vm_proc_of(tgid);
	/* QEMU's own requests (before the guest runs, after it stops) are no
	 * guest's. */
	if (!p || p->state != VM_PROC_RUNNING)
		return;
	vm = p->slot;
	/* A bio the VM's thread merged on a disk holding none of its virtual
	 * disks is no guest request: its own log or image of another kind
	 * written back from its context (direct reclaim, dirty throttling). */
	if (!engine) {
		struct vm_dev_key vk = { .vm = vm, .dev = dev };

		if (!bpf_map_lookup_elem(&vm_disks, &vk))
			return;
	}
	c = vm_counts_of(vm);
	if (!c)
		return;
	if (engine)
		__sync_fetch_and_add(&c->engine_merges, n);
	else
		__sync_fetch_and_add(&c->bio_merges, n);
	/* Each merged guest request is still pushed to the used ring on its
	 * own when the one host request completes: its push waits too, so
	 * that it does not take the place of another request's (the deep
	 * tier's pushes). */
	if (deep_tier())
		signal_due_n(vm, n);
}

SEC("uprobe")
int BPF_KPROBE(block_acct_merge_done, void *stats, int type, int num_merged)
{
	if (num_merged > 0)
		note_merges(num_merged, 1, 0);
	return 0;
}

SEC("tp_btf/block_bio_backmerge")
int BPF_PROG(block_bio_backmerge_btf, struct bio *bio)
{
	if (guest_bio(bio, 1))
		note_merges(1, 0, bio_disk_dev(bio));
	return 0;
}

SEC("raw_tp/block_bio_backmerge")
int BPF_PROG(block_bio_backmerge, struct bio *bio)
{
	if (guest_bio(bio, 0))
		note_merges(1, 0, bio_disk_dev(bio));
	return 0;
}

SEC("tp_btf/block_bio_frontmerge")
int BPF_PROG(block_bio_frontmerge_btf, struct bio *bio)
{
	if (guest_bio(bio, 1))
		note_merges(1, 0, bio_disk_dev(bio));
	return 0;
}

SEC("raw_tp/block_bio_frontmerge")
int BPF_PROG(block_bio_frontmerge, struct bio *bio)
{
	if (guest_bio(bio, 0))
		note_merges(1, 0, bio_disk_dev(bio));
	return 0;
}

/* Linked into host.bpf.o with block.bpf.c, whose license section it shares. */
