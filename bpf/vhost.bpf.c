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

/* A VM's vhost worker switched in with a kick pending picks it up: see
 * on_switch in runq.bpf.c, the one program on sched_switch. */

/* A vhost worker raising its VM's interrupt: the call eventfd it signals
 * after pushing completions to the used ring is an irqfd, which KVM turns
 * into an MSI in the signalling thread. One per batch, as NVMe's
 * msix_notify. */
SEC("tracepoint/kvm/kvm_msi_set_irq")
int kvm_msi_set_irq(void *ctx)
{
	if (targ_vm_segments && in_vhost_worker())
		return on_signal(0);
	return 0;
}

/* Linked into host.bpf.o with block.bpf.c, whose license section it shares. */
