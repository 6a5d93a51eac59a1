/* SPDX-License-Identifier: GPL-2.0 */
/*
 * LIO's commands run for a kernel vhost worker's VM by other tasks: the
 * task executing a VM's command (LIO's submission workqueue, or the worker
 * itself) submits the backstore's I/O for that VM, with the command's kick
 * and pop (bpf/scsi_target.bpf.c).
 */
#ifndef IOSPAN_SCSI_TARGET_BPF_H
#define IOSPAN_SCSI_TARGET_BPF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

/* Whether the scsi_target programs may run here (LIO loaded, VMs
 * followed): without them no task acts for a VM, and this costs nothing. */
extern const volatile __u32 targ_scsi_target;

#define VHOST_CMD_POLLED 1 /* popped after its batch's kick was spent */

/* A VM's SCSI command as its vhost worker popped it: the guest's kick it
 * came with (0: none seen), when the worker popped it, the VM and the
 * worker. */
struct vhost_cmd {
	__u64 kick_ns;
	__u64 pick_ns;
	__u32 tgid;
	__u32 worker;
	__u32 flags; /* VHOST_CMD_* */
	__u32 _pad;
};

/* The task executing a VM's command → that command, while it runs. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct vhost_cmd);
} acting_for_map_t;
extern acting_for_map_t acting_for SEC(".maps");

/* The command the current task executes for a VM, if any. */
const struct vhost_cmd *acting_cmd(__u64 pid_tgid);

/* The process a request of the current task is submitted for: a VM's
 * where the task is executing that VM's SCSI command (`cmd`), else its
 * own. */
__u32 submitter_tgid(__u64 pid_tgid, const struct vhost_cmd *cmd);

#define PF_KTHREAD_FLAG 0x00200000

/* The VM process the current vhost worker serves: its own since 6.4;
 * before, a kernel thread using the VM's memory, whose owner is the VM's
 * process (with memory cgroups: else not known, 0). */
__u32 served_tgid(void);

#endif /* IOSPAN_SCSI_TARGET_BPF_H */
