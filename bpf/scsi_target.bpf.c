// SPDX-License-Identifier: GPL-2.0
/*
 * A kernel vhost-scsi worker's commands through LIO. The worker pops each
 * command from the VM's queue and prepares it (target_init_cmd) in its own
 * context: a thread of the VM's process since Linux 6.4, a kernel thread
 * on the VM's memory before. LIO then executes it (__target_execute_cmd,
 * the backstore's submission inside) in the worker, or in a kworker of its
 * submission workqueue (Linux 5.16 on, the default for vhost): while it
 * runs, that task's requests are the VM's (submitter_tgid). kprobes only,
 * on target_core_mod's functions; no system call is traced.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "host.bpf.h"
#include "scsi_target.bpf.h"

const volatile __u32 targ_scsi_target = 0;

acting_for_map_t acting_for SEC(".maps");

/* A prepared command → the VM process its worker serves. Commands are
 * preallocated per queue and prepared again for each use: the last
 * preparation wins, and an unused one ages out. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u32);
} scsi_cmd_vms SEC(".maps");

#define PF_KTHREAD_FLAG 0x00200000

/* The VM process the current vhost worker serves: its own since 6.4;
 * before, a kernel thread using the VM's memory, whose owner is the VM's
 * process (with memory cgroups: else not known, 0). */
static __always_inline __u32 served_tgid(void)
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

/* cmd: the struct se_cmd (a module type, not in vmlinux.h). */
SEC("kprobe/target_init_cmd")
int BPF_KPROBE(target_init_cmd_kprobe, void *cmd)
{
	__u64 key = (__u64)cmd;
	__u32 tgid;

	if (!in_vhost_worker())
		return 0;
	tgid = served_tgid();
	if (tgid)
		bpf_map_update_elem(&scsi_cmd_vms, &key, &tgid, BPF_ANY);
	return 0;
}

SEC("kprobe/__target_execute_cmd")
int BPF_KPROBE(target_execute_kprobe, void *cmd)
{
	__u64 key = (__u64)cmd;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	__u32 *tgid = bpf_map_lookup_elem(&scsi_cmd_vms, &key);

	if (tgid)
		bpf_map_update_elem(&acting_for, &tid, tgid, BPF_ANY);
	return 0;
}

SEC("kretprobe/__target_execute_cmd")
int BPF_KRETPROBE(target_execute_kretprobe)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();

	bpf_map_delete_elem(&acting_for, &tid);
	return 0;
}
