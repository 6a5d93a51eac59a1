// SPDX-License-Identifier: GPL-2.0
/*
 * A kernel vhost-scsi worker's commands, kick to submission. The guest's
 * kick wakes the worker's poll on the queue's kick eventfd
 * (vhost_poll_wakeup, in the kicking vCPU thread); the worker starts a
 * batch by disabling the queue's notifications (vhost_disable_notify: a
 * batch takes the kick pending, a second disable in one run finds more
 * requests with no kick of their own) and pops each command, preparing it
 * (target_init_cmd) in its own context: a thread of the VM's process
 * since Linux 6.4, a kernel thread on the VM's memory before. LIO then
 * executes it (__target_execute_cmd, the backstore's submission inside)
 * in the worker, or in a kworker of its submission workqueue (Linux 5.16
 * on, the default for vhost): while it runs, that task's requests are the
 * VM's, with the command's kick and pop (acting_cmd). kprobes only, on
 * vhost's and target_core_mod's functions; no system call is traced.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "host.bpf.h"
#include "linked.h"
#include "scsi_target.bpf.h"

const volatile __u32 targ_scsi_target = 0;

acting_for_map_t acting_for SEC(".maps");

/* A prepared command → what it is. Commands are preallocated per queue
 * and prepared again for each use: the last preparation wins, and an
 * unused one ages out. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct vhost_cmd);
} scsi_cmd_vms SEC(".maps");

/* A vhost worker's current batch: the kick it took (0: none), and
 * whether a later disable in its run found requests the kick did not
 * bring. */
struct vhost_batch {
	__u64 kick_ns;
	__u32 spent;
	__u32 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct vhost_batch);
} vhost_batches SEC(".maps");

__inline_linked const struct vhost_cmd *acting_cmd(__u64 pid_tgid)
{
	__u32 tid = (__u32)pid_tgid;

	if (!targ_scsi_target)
		return 0;
	return bpf_map_lookup_elem(&acting_for, &tid);
}

__inline_linked __u32 submitter_tgid(__u64 pid_tgid, const struct vhost_cmd *cmd)
{
	return cmd ? cmd->tgid : pid_tgid >> 32;
}

__inline_linked __u32 served_tgid(void)
{
	struct task_struct *t = (struct task_struct *)bpf_get_current_task();
	struct mm_struct *mm;

	if (!(BPF_CORE_READ(t, flags) & PF_KTHREAD_FLAG))
		return bpf_get_current_pid_tgid() >> 32;
	mm = BPF_CORE_READ(t, mm);
	if (!mm || !bpf_core_field_exists(mm->owner))
		return 0;
	return BPF_CORE_READ(mm, owner, tgid);
}

/* Whether VM process `tgid` has a disk its kernel vhost workers serve. */
static __always_inline int vhost_vm(__u32 tgid)
{
	struct vm_proc *p = vm_proc_of(tgid);
	__u32 *flags;

	if (!p)
		return 0;
	flags = bpf_map_lookup_elem(&vm_flags, &p->slot);
	return flags && (*flags & VMF_VHOST);
}

/* A wake-up of a vhost poll from a vCPU: the guest's kick on a queue's
 * kick eventfd (KVM's ioeventfd, or QEMU's write of it under TCG). The
 * first not yet taken counts. */
SEC("kprobe/vhost_poll_wakeup")
int BPF_KPROBE(vhost_poll_wakeup_kprobe)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	__u64 now;

	/* Most vhost wake-ups (vhost-net's sockets) come from no vCPU: the
	 * comm first, the VM's tables only for a vCPU's. */
	if (!in_vcpu() || !vhost_vm(tgid))
		return 0;
	now = bpf_ktime_get_ns();
	bpf_map_update_elem(&vhost_kicks, &tgid, &now, BPF_NOEXIST);
	return 0;
}

/* A worker starting a batch of a queue: it takes the VM's pending kick;
 * with none, a batch of this run already took one and these requests
 * came while it ran (found by the worker's recheck: polled). */
SEC("kprobe/vhost_disable_notify")
int BPF_KPROBE(vhost_disable_notify_kprobe)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid(), tgid;
	struct vhost_batch b = {}, *cur;
	__u64 *kick;

	if (!in_vhost_worker())
		return 0;
	tgid = served_tgid();
	kick = tgid ? bpf_map_lookup_elem(&vhost_kicks, &tgid) : 0;
	if (kick) {
		b.kick_ns = *kick;
		bpf_map_delete_elem(&vhost_kicks, &tgid);
		bpf_map_update_elem(&vhost_batches, &tid, &b, BPF_ANY);
		return 0;
	}
	/* No batch yet: its commands find none, and come with no kick. */
	cur = bpf_map_lookup_elem(&vhost_batches, &tid);
	if (cur)
		cur->spent = 1;
	return 0;
}

/* cmd: the struct se_cmd (a module type, not in vmlinux.h). The worker
 * pops and prepares it now. */
SEC("kprobe/target_init_cmd")
int BPF_KPROBE(target_init_cmd_kprobe, void *cmd)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u64 key = (__u64)cmd;
	struct vhost_cmd c = {};
	struct vhost_batch *b;

	if (!in_vhost_worker())
		return 0;
	c.tgid = served_tgid();
	if (!c.tgid)
		return 0;
	c.pick_ns = bpf_ktime_get_ns();
	c.worker = tid;
	b = bpf_map_lookup_elem(&vhost_batches, &tid);
	if (b && b->spent)
		c.flags = VHOST_CMD_POLLED;
	else if (b)
		c.kick_ns = b->kick_ns;
	bpf_map_update_elem(&scsi_cmd_vms, &key, &c, BPF_ANY);
	return 0;
}

SEC("kprobe/__target_execute_cmd")
int BPF_KPROBE(target_execute_kprobe, void *cmd)
{
	__u64 key = (__u64)cmd;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct vhost_cmd *c = bpf_map_lookup_elem(&scsi_cmd_vms, &key);

	if (c && bpf_map_update_elem(&acting_for, &tid, c, BPF_ANY))
		count(CNT_ACTING_FULL);
	return 0;
}

SEC("kretprobe/__target_execute_cmd")
int BPF_KRETPROBE(target_execute_kretprobe)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();

	bpf_map_delete_elem(&acting_for, &tid);
	return 0;
}
