/* SPDX-License-Identifier: GPL-2.0 */
/*
 * LIO's commands run for a kernel vhost worker's VM by other tasks: the
 * task executing a VM's command (LIO's submission workqueue, or the worker
 * itself) submits the backstore's I/O for that VM (bpf/scsi_target.bpf.c).
 */
#ifndef IOSPAN_SCSI_TARGET_BPF_H
#define IOSPAN_SCSI_TARGET_BPF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

/* Whether the scsi_target programs may run here (LIO loaded, VMs
 * followed): without them no task acts for a VM, and this costs nothing. */
extern const volatile __u32 targ_scsi_target;

/* The task executing a VM's command → that VM's process, while it runs. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} acting_for_map_t;
extern acting_for_map_t acting_for SEC(".maps");

/* The process a request of the current task is submitted for: a VM's
 * where the task is executing that VM's SCSI command, else its own. */
static __always_inline __u32 submitter_tgid(__u64 pid_tgid)
{
	__u32 tid = (__u32)pid_tgid, *vm;

	if (!targ_scsi_target)
		return pid_tgid >> 32;
	vm = bpf_map_lookup_elem(&acting_for, &tid);
	return vm ? *vm : pid_tgid >> 32;
}

#endif /* IOSPAN_SCSI_TARGET_BPF_H */
