// SPDX-License-Identifier: GPL-2.0
/*
 * The kernel's vhost workers (vhost-blk, vhost-scsi): a kick on a vhost
 * kick eventfd is picked up when the VM's worker is switched in, and the
 * worker's irqfd signal is the engine's signal to the guest. The kick
 * eventfds are recorded by vm.bpf.c (VHOST_SET_VRING_KICK).
 */
#include "host.bpf.h"

vhost_kick_files_map_t vhost_kick_files SEC(".maps");
vhost_kicks_map_t vhost_kicks SEC(".maps");

/* A VM's vhost worker switched in with a kick pending: it picks the kick
 * up (it runs all its device's work when it runs), and the requests it
 * submits next belong to it, as an engine thread's after its eventfd
 * read. The wait from kick to here is the hypervisor's. Attached only
 * while a VM with a kernel vhost disk runs: a program run per context
 * switch, most leaving at the name. */
static __always_inline void on_switch_in(__u32 tgid, __u32 tid, const char *comm)
{
	if (vhost_comm(comm))
		claim_vhost_kick(tgid, tid);
}

SEC("tp_btf/sched_switch")
int BPF_PROG(sched_switch_btf, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	char comm[16];

	if (!targ_vm_segments)
		return 0;
	bpf_probe_read_kernel(comm, sizeof(comm), next->comm);
	on_switch_in(next->tgid, next->pid, comm);
	return 0;
}

SEC("raw_tp/sched_switch")
int BPF_PROG(sched_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	char comm[16];

	if (!targ_vm_segments)
		return 0;
	BPF_CORE_READ_INTO(&comm, next, comm);
	on_switch_in(BPF_CORE_READ(next, tgid), BPF_CORE_READ(next, pid), comm);
	return 0;
}

/* A vhost worker raising its VM's interrupt: the call eventfd it signals
 * after pushing completions to the used ring is an irqfd, which KVM turns
 * into an MSI in the signalling thread. One per batch, as NVMe's
 * msix_notify. */
SEC("tracepoint/kvm/kvm_msi_set_irq")
int kvm_msi_set_irq(void *ctx)
{
	if (targ_vm_segments && in_vhost_worker())
		return on_signal();
	return 0;
}

/* Linked into host.bpf.o with block.bpf.c, whose license section it shares. */
