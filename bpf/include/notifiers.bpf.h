/* SPDX-License-Identifier: GPL-2.0 */
/*
 * A VM's queue notifiers as the deep tier learns them from their
 * registration (notifiers.bpf.c): the eventfds a vCPU thread creates, or
 * any thread once the guest ran, and the notify addresses QEMU registers
 * with KVM (KVM_IOEVENTFD). System-call tracepoints: attached only while
 * the deep tier runs.
 */
#ifndef IOSPAN_NOTIFIERS_BPF_H
#define IOSPAN_NOTIFIERS_BPF_H

#include "host.bpf.h"

struct fd_key {
	__u32 tgid;
	__u32 fd;
};

/* The open file behind the current process's `fd` (0 if none). */
static __always_inline __u64 fd_file(__u32 fd)
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

/* The queue notifiers of VMs started while the deep tier runs: (tgid, fd)
 * of each eventfd a vCPU thread created or any thread created once the
 * guest ran. QEMU makes its loop notifiers (main loop, iothreads) before
 * the guest runs; a queue's host notifier when the guest driver starts the
 * device (virtio-blk, in the vCPU thread) or sets up doorbell buffers
 * (NVMe with ioeventfd=on, in the engine). A vCPU also writes the loop
 * notifiers (timer changes wake the main loop): counted as kicks, they
 * would hand a request held in the engine a later notification. */
struct notifier {
	__u8 kicked; /* a guest kicked it: it counts as open (vm_open_notifiers) */
	__u8 _pad;
	__u16 queue; /* VQ_*: which guest queue it notifies */
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct fd_key);
	__type(value, struct notifier);
} vq_notifiers_map_t;
extern vq_notifiers_map_t vq_notifiers SEC(".maps");

/* Open queue notifiers per VM (tgid -> count): the VM has stopped when the
 * last one closes, not at any one (QEMU re-creates some while running).
 * Only notifiers a guest has kicked count: QEMU also makes and closes
 * eventfds of its own while the guest runs (event notifiers of new
 * contexts), which must not make a running VM look stopped. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __s64);
} vm_open_notifiers_map_t;
extern vm_open_notifiers_map_t vm_open_notifiers SEC(".maps");

/* VMs whose notifiers are known (exec'd while the deep tier watched):
 * tgid -> 1. A VM found already running has kicks taken from any eventfd
 * its vCPUs write. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
} vm_notifiers_known_map_t;
extern vm_notifiers_known_map_t vm_notifiers_known SEC(".maps");

/* Under KVM, a notify address QEMU registered (KVM_IOEVENTFD): (tgid,
 * guest physical address) -> eventfd. */
struct gpa_key {
	__u32 tgid;
	__u32 _pad;
	__u64 gpa;
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct gpa_key);
	__type(value, __u32);
} kvm_notify_addrs_map_t;
extern kvm_notify_addrs_map_t kvm_notify_addrs SEC(".maps");

/* A queue notifier's first kick: from now on it counts as open. */
static __always_inline void note_kicked(const struct fd_key *k, struct notifier *n)
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

/* A kick on `file`: pending for the engine reading it, or, on a vhost
 * kick eventfd, for the VM's vhost worker. */
static __always_inline void note_file_kick(__u32 tgid, __u64 file, __u16 queue)
{
	struct kick k = { .ts_ns = bpf_ktime_get_ns(), .queue = queue };

	if (bpf_map_lookup_elem(&vhost_kick_files, &file))
		bpf_map_update_elem(&vhost_kicks, &tgid, &k.ts_ns, BPF_NOEXIST);
	else
		bpf_map_update_elem(&file_kicks, &file, &k, BPF_NOEXIST);
}

/* A guest's first kick: it runs (a stopped VM runs again only when a
 * queue notifier is made again). */
static __always_inline void mark_started(__u32 tgid)
{
	struct vm_proc *p = vm_proc_of(tgid);

	if (p && p->state == VM_PROC_STARTING)
		vm_proc_set_state(p, VM_PROC_RUNNING);
}

#endif /* IOSPAN_NOTIFIERS_BPF_H */
