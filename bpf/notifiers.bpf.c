// SPDX-License-Identifier: GPL-2.0
/*
 * The deep tier's knowledge of each VM's queue notifiers, from their
 * registration: eventfds a vCPU thread creates (or any thread once the
 * guest ran), the notify addresses QEMU registers with KVM
 * (KVM_IOEVENTFD), the kick eventfds it hands the kernel's vhost
 * (VHOST_SET_VRING_KICK), and their closing (a VM stopping). System-call
 * tracepoints: they put every task of the host on the slow system-call
 * path, so they are attached only while the deep tier runs. The
 * always-on tier learns KVM's notify addresses from the wake-ups their
 * kicks make instead (kicks.bpf.c).
 */
#include "notifiers.bpf.h"
#include "linked.h"

vq_notifiers_map_t vq_notifiers SEC(".maps");
vm_open_notifiers_map_t vm_open_notifiers SEC(".maps");
vm_notifiers_known_map_t vm_notifiers_known SEC(".maps");
kvm_notify_addrs_map_t kvm_notify_addrs SEC(".maps");

/* Queue notifiers a VM made so far (tgid -> count): each one's order of
 * creation names its queue where no address does (VQ_BY_ORDER). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} notifiers_made SEC(".maps");

__inline_linked __u64 fd_file(__u32 fd)
{
	struct task_struct *t = (struct task_struct *)bpf_get_current_task();
	struct fdtable *fdt = BPF_CORE_READ(t, files, fdt);
	struct file **fds;
	struct file *f = NULL;

	if (!fdt || fd >= BPF_CORE_READ(fdt, max_fds))
		return 0;
	fds = BPF_CORE_READ(fdt, fd);
	if (bpf_probe_read_kernel(&f, sizeof(f), &fds[fd]))
		return 0;
	return (__u64)f;
}

__inline_linked void note_kicked(const struct fd_key *k, struct notifier *n)
{
	__s64 *open, first = 1;

	if (n->kicked)
		return;
	n->kicked = 1;
	open = bpf_map_lookup_elem(&vm_open_notifiers, &k->tgid);
	if (open)
		__sync_fetch_and_add(open, 1);
	else
		bpf_map_update_elem(&vm_open_notifiers, &k->tgid, &first, BPF_ANY);
}

__inline_linked void note_file_kick(__u32 tgid, __u64 file, __u16 queue)
{
	struct kick k = { .ts_ns = bpf_ktime_get_ns(), .queue = queue };

	if (bpf_map_lookup_elem(&vhost_kick_files, &file))
		bpf_map_update_elem(&vhost_kicks, &tgid, &k.ts_ns, BPF_NOEXIST);
	else
		bpf_map_update_elem(&file_kicks, &file, &k, BPF_NOEXIST);
}

__inline_linked void mark_started(__u32 tgid)
{
	struct vm_proc *p = vm_proc_of(tgid);

	if (p && p->state == VM_PROC_STARTING)
		vm_proc_set_state(p, VM_PROC_RUNNING);
}

/* An eventfd made by a vCPU, or once the guest ran: a queue notifier
 * (see vq_notifiers). Rare, so attached whenever VMs are tracked. */
static __always_inline void on_eventfd_created(long fd)
{
	struct fd_key k;
	struct notifier n = {};
	struct vm_proc *p;
	__u32 *made, first = 1;

	if (!targ_vm_segments || fd < 0 || !deep_tier())
		return;
	k.tgid = bpf_get_current_pid_tgid() >> 32;
	p = vm_proc_of(k.tgid);
	if (!p || (!in_vcpu() && p->state == VM_PROC_STARTING))
		return;
	k.fd = (__u32)fd;
	made = bpf_map_lookup_elem(&notifiers_made, &k.tgid);
	if (made)
		n.queue = VQ_BY_ORDER | (__sync_fetch_and_add(made, 1) & VQ_VALUE_MASK);
	else {
		n.queue = VQ_BY_ORDER;
		bpf_map_update_elem(&notifiers_made, &k.tgid, &first, BPF_ANY);
	}
	/* Not kicked yet; an fd number reused for a new eventfd starts over,
	 * its predecessor having been closed. */
	bpf_map_update_elem(&vq_notifiers, &k, &n, BPF_ANY);
	vm_proc_set_state(p, VM_PROC_RUNNING);
}

/* QEMU closing its last queue notifier: the VM stopped or shut down (or
 * the guest reset its every notified device); until a notifier is made
 * again, its requests are QEMU's own. A VM none of whose disks is notified
 * through an eventfd (NVMe's default doorbells) is exempt (vm_no_stop):
 * its only notifiers may be another device's (a console's), reset while
 * its disks are busy. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
} vm_no_stop SEC(".maps");

SEC("tracepoint/syscalls/sys_enter_close")
int sys_enter_close(struct trace_event_raw_sys_enter *ctx)
{
	struct fd_key k;
	struct notifier *n;
	__u8 was_kicked;
	__s64 *open;
	__u64 file;

	if (!targ_vm_segments || !deep_tier())
		return 0;
	k.tgid = bpf_get_current_pid_tgid() >> 32;
	k.fd = (__u32)ctx->args[0];
	n = bpf_map_lookup_elem(&vq_notifiers, &k);
	if (!n)
		return 0;
	was_kicked = n->kicked;
	bpf_map_delete_elem(&vq_notifiers, &k);
	/* Its file may outlive this fd (another process holds it too); a kick
	 * left pending on it would be a stale one. */
	file = fd_file(k.fd);
	if (file) {
		bpf_map_delete_elem(&file_kicks, &file);
		bpf_map_delete_elem(&vhost_kick_files, &file);
	}
	if (!was_kicked)
		return 0;
	open = bpf_map_lookup_elem(&vm_open_notifiers, &k.tgid);
	if (open && __sync_fetch_and_add(open, -1) <= 1 &&
	    !bpf_map_lookup_elem(&vm_no_stop, &k.tgid)) {
		struct vm_proc *p = vm_proc_of(k.tgid);

		if (p)
			vm_proc_set_state(p, VM_PROC_STOPPED);
	}
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_eventfd2")
int sys_exit_eventfd2(struct trace_event_raw_sys_exit *ctx)
{
	on_eventfd_created(ctx->ret);
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_eventfd")
int sys_exit_eventfd(struct trace_event_raw_sys_exit *ctx)
{
	on_eventfd_created(ctx->ret);
	return 0;
}

/* struct kvm_ioeventfd, the ioctl's argument (UAPI: fixed layout). */
struct ioeventfd_arg {
	__u64 datamatch;
	__u64 addr;
	__u32 len;
	__s32 fd;
	__u32 flags;
};

#define KVM_IOEVENTFD_CMD	 0x4040ae79 /* _IOW(KVMIO, 0x79, struct kvm_ioeventfd) */
#define VHOST_SET_VRING_KICK_CMD 0x4008af20 /* _IOW(VHOST_VIRTIO, 0x20, struct vhost_vring_file) */

/* struct vhost_vring_file (UAPI). */
struct vring_file_arg {
	__u32 index;
	__s32 fd;
};
#define KVM_IOEVENTFD_DATAMATCH (1 << 0)
#define KVM_IOEVENTFD_DEASSIGN	(1 << 2)
#define KVM_TRACE_MMIO_WRITE	2

/* A KVM_IOEVENTFD a VM made, held from the call's entry to its exit: only
 * a registration the kernel accepted is recorded (a refused one, with
 * made-up arguments, leaves nothing in kvm_notify_addrs or vq_notifiers).
 * Thread id -> the call's argument. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct ioeventfd_arg);
} ioeventfd_calls SEC(".maps");

SEC("tracepoint/syscalls/sys_enter_ioctl")
int sys_enter_ioctl(struct trace_event_raw_sys_enter *ctx)
{
	__u32 cmd = (__u32)ctx->args[1];
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;

	if ((cmd != KVM_IOEVENTFD_CMD && cmd != VHOST_SET_VRING_KICK_CMD) || !targ_vm_segments ||
	    !deep_tier())
		return 0;
	if (!vm_proc_of(tgid))
		return 0;
	if (cmd == VHOST_SET_VRING_KICK_CMD) {
		/* Recorded at once: the entry is keyed by an eventfd the VM's
		 * process holds (its open file), concerns only that VM's kicks
		 * and ages out of an LRU table. */
		struct vring_file_arg vf;
		__u64 file;
		__u8 one = 1;

		if (bpf_probe_read_user(&vf, sizeof(vf), (void *)ctx->args[2]) || vf.fd < 0)
			return 0;
		file = fd_file(vf.fd);
		if (file)
			bpf_map_update_elem(&vhost_kick_files, &file, &one, BPF_ANY);
		return 0;
	}
	{
		struct ioeventfd_arg io;

		if (!bpf_probe_read_user(&io, sizeof(io), (void *)ctx->args[2]))
			bpf_map_update_elem(&ioeventfd_calls, &tid, &io, BPF_ANY);
	}
	return 0;
}

SEC("tracepoint/syscalls/sys_exit_ioctl")
int sys_exit_ioctl(struct trace_event_raw_sys_exit *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)id;
	struct ioeventfd_arg *io = bpf_map_lookup_elem(&ioeventfd_calls, &tid);
	struct gpa_key k = {};
	struct fd_key f;
	struct notifier fresh = {}, *n;
	__u16 queue;

	if (!io)
		return 0;
	if (ctx->ret != 0)
		goto out;
	k.tgid = id >> 32;
	k.gpa = io->addr;
	if (io->flags & KVM_IOEVENTFD_DEASSIGN) {
		bpf_map_delete_elem(&kvm_notify_addrs, &k);
		goto out;
	}
	f.tgid = k.tgid;
	f.fd = (__u32)io->fd;
	bpf_map_update_elem(&kvm_notify_addrs, &k, &f.fd, BPF_ANY);
	/* The queue: the value a datamatch waits for is its index (virtio's
	 * legacy notify writes it); an address, by its offset in its page —
	 * but for a page of its own per queue (virtio's page-per-vq), where
	 * every offset is 0: the queue one page below's index plus one (QEMU
	 * registers a device's queues in index order). */
	queue = (io->flags & KVM_IOEVENTFD_DATAMATCH)
			? VQ_BY_INDEX | (io->datamatch & VQ_VALUE_MASK)
			: VQ_BY_ADDR | (io->addr & 0xfff);
	if (!(io->flags & KVM_IOEVENTFD_DATAMATCH) && !(io->addr & 0xfff)) {
		struct gpa_key below = { .tgid = k.tgid, .gpa = io->addr - 0x1000 };
		__u32 *below_fd = bpf_map_lookup_elem(&kvm_notify_addrs, &below);

		if (below_fd) {
			struct fd_key bf = { .tgid = k.tgid, .fd = *below_fd };
			struct notifier *b = bpf_map_lookup_elem(&vq_notifiers, &bf);

			if (b && (b->queue & ~VQ_VALUE_MASK) == VQ_BY_ADDR &&
			    !(b->queue & VQ_VALUE_MASK))
				queue = VQ_BY_INDEX | 1;
			else if (b && (b->queue & ~VQ_VALUE_MASK) == VQ_BY_INDEX)
				queue = VQ_BY_INDEX |
					(((b->queue & VQ_VALUE_MASK) + 1) & VQ_VALUE_MASK);
		}
	}
	n = bpf_map_lookup_elem(&vq_notifiers, &f);
	if (!n) {
		fresh.queue = queue;
		bpf_map_update_elem(&vq_notifiers, &f, &fresh, BPF_NOEXIST);
	} else if ((n->queue & ~VQ_VALUE_MASK) != VQ_BY_INDEX) {
		/* A second address on the same eventfd keeps its kicked state;
		 * an index, once known, is kept (QEMU registers a transitional
		 * device's modern address, then its legacy datamatch). */
		n->queue = queue;
	}
out:
	bpf_map_delete_elem(&ioeventfd_calls, &tid);
	return 0;
}

/* Linked into host.bpf.o with block.bpf.c, whose license section it shares. */
