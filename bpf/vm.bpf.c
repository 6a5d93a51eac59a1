// SPDX-License-Identifier: GPL-2.0
/*
 * VM attribution and the host window: which processes are VMs (exec), and
 * each VM's notifications — the guest's kick (a vCPU's eventfd write, or
 * KVM's MMIO exit on a notify address), the engine's pickup (its eventfd
 * read, or a hand-off to the worker it wakes), the engine's signal back
 * (the used-ring push, the interrupt) — and QEMU's merges. block.bpf.c
 * puts a VM's requests between the pickup and the signal.
 */
#include "host.bpf.h"
#include "core_fixes.bpf.h"

/* Attribute requests to VMs (processes in vm_pids) and keep vm_latency. */
const volatile __u32 targ_track_vms = 0;
/* Follow VMs' notifications (eventfd kicks, pickups, signals) to split the
 * host window of their requests; needs targ_track_vms. */
const volatile __u32 targ_vm_segments = 0;
/* Next VM slot to hand out; the agent starts it past the VMs it found. */
__u32 next_vm = 0;
/* Addresses of the direct-I/O completion functions, in enum dio_kind's
 * order (from kallsyms; 0 when absent). */
const volatile __u64 targ_dio_end_io[NR_DIO_END_IO] = {};

vm_pids_map_t vm_pids SEC(".maps");
vm_counts_map_t vm_counts SEC(".maps");
vdisk_files_map_t vdisk_files SEC(".maps");
vm_latency_map_t vm_latency SEC(".maps");
vm_latency_nested_map_t vm_latency_nested SEC(".maps");
vm_undelivered_map_t vm_undelivered SEC(".maps");
vm_disks_map_t vm_disks SEC(".maps");
vm_started_map_t vm_started SEC(".maps");
vm_last_pick_map_t vm_last_pick SEC(".maps");
thread_pops_map_t thread_pops SEC(".maps");
thread_pushes_map_t thread_pushes SEC(".maps");
thread_picks_map_t thread_picks SEC(".maps");
punted_picks_map_t punted_picks SEC(".maps");
vm_signal_due_map_t vm_signal_due SEC(".maps");

struct fd_key {
	__u32 tgid;
	__u32 fd;
};

/* A kick not yet picked up: when it came (the first since the last
 * pickup) and through which guest queue (VQ_*). */
struct kick {
	__u64 ts_ns;
	__u64 queue;
};

/* A VM's eventfds with a kick written by a vCPU thread and not yet read:
 * the eventfd's open file -> its kick. Keyed by the
 * file, not (process, fd): the engine reading the kick may be another
 * process holding the same eventfd (qemu-storage-daemon, an SPDK target,
 * served over vhost-user). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct kick);
} pending_kicks SEC(".maps");

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

/* The queue notifiers of VMs started while iospan runs: (tgid, fd) of each
 * eventfd a vCPU thread created or any thread created once the guest ran.
 * QEMU makes its loop notifiers (main loop, iothreads) before the guest
 * runs; a queue's host notifier when the guest driver starts the device
 * (virtio-blk, in the vCPU thread) or sets up doorbell buffers (NVMe with
 * ioeventfd=on, in the engine). A vCPU also writes the
 * loop notifiers (timer changes wake the main loop): counted as kicks,
 * they would hand a request held in the engine a later notification. */
struct notifier {
	__u8 kicked;  /* a guest kicked it: it counts as open (vm_open_notifiers) */
	__u8 _pad;
	__u16 queue;  /* VQ_*: which guest queue it notifies */
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct fd_key);
	__type(value, struct notifier);
} vq_notifiers SEC(".maps");

/* Queue notifiers a VM made so far (tgid -> count): each one's order of
 * creation names its queue where no address does (VQ_BY_ORDER). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} notifiers_made SEC(".maps");

/* Open queue notifiers per VM (tgid -> count): the VM has stopped when the
 * last one closes, not at any one (QEMU re-creates some while running).
 * Only notifiers a guest has kicked count: QEMU also makes and closes
 * eventfds of its own while the guest runs (event notifiers of new
 * contexts), which must not make a running VM look stopped. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __s64);
} vm_open_notifiers SEC(".maps");

/* VMs whose notifiers are known (exec'd while iospan ran): tgid -> 1. A VM
 * found already running has kicks taken from any eventfd its vCPUs write. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
} vm_notifiers_known SEC(".maps");

/* A kick on `file`: pending for the engine reading it, or, on a vhost
 * kick eventfd, for the VM's vhost worker. */
static __always_inline void note_kick(__u32 tgid, __u64 file, __u16 queue)
{
	struct kick k = { .ts_ns = bpf_ktime_get_ns(), .queue = queue };

	if (bpf_map_lookup_elem(&vhost_kick_files, &file))
		bpf_map_update_elem(&vhost_kicks, &tgid, &k.ts_ns, BPF_NOEXIST);
	else
		bpf_map_update_elem(&pending_kicks, &file, &k, BPF_NOEXIST);
}

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
	if (comm[0] == 'q' && comm[1] == 'e' && comm[2] == 'm' && comm[3] == 'u' && comm[4] == '-' &&
	    comm[5] == 'k' && comm[6] == 'v' && comm[7] == 'm' && comm[8] == 0)
		return 1;
	return comm[0] == 'k' && comm[1] == 'v' && comm[2] == 'm' && comm[3] == 0;
}

/* A new process whose command is a VM: give it a slot before its first
 * request, so no request of it is ever attributed to the host. */
static __always_inline void on_exec(void)
{
	char comm[16];
	__u32 tgid, slot;

	if (!targ_track_vms)
		return;
	bpf_get_current_comm(comm, sizeof(comm));
	if (!vm_comm(comm))
		return;
	tgid = bpf_get_current_pid_tgid() >> 32;
	slot = __sync_fetch_and_add(&next_vm, 1) + 1;
	bpf_map_update_elem(&vm_pids, &tgid, &slot, BPF_NOEXIST);
	if (targ_vm_segments) {
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

/* The VM a read or write belongs to. An eventfd write moves exactly 8
 * bytes; reads are made with larger buffers (QEMU drains an eventfd with a
 * 512-byte read), so only writes are filtered on size. */
static __always_inline __u32 vm_of_eventfd_io(const struct trace_event_raw_sys_enter *ctx, int write)
{
	__u32 tgid, *vm;

	if (!targ_vm_segments || (write && ctx->args[2] != 8) || ctx->args[2] < 8)
		return 0;
	tgid = bpf_get_current_pid_tgid() >> 32;
	vm = bpf_map_lookup_elem(&vm_pids, &tgid);
	return vm ? *vm : 0;
}

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

/* A vCPU's eventfd write is the guest's kick; the first one not yet
 * picked up counts. */
SEC("tracepoint/syscalls/sys_enter_write")
int sys_enter_write(struct trace_event_raw_sys_enter *ctx)
{
	struct fd_key k;
	__u64 file;
	__u16 queue = 0;

	if (!vm_of_eventfd_io(ctx, 1) || !in_vcpu())
		return 0;
	k.tgid = bpf_get_current_pid_tgid() >> 32;
	k.fd = (__u32)ctx->args[0];
	if (!bpf_map_lookup_elem(&vm_started, &k.tgid)) {
		__u8 one = 1;

		bpf_map_update_elem(&vm_started, &k.tgid, &one, BPF_ANY);
	}
	if (bpf_map_lookup_elem(&vm_notifiers_known, &k.tgid)) {
		struct notifier *n = bpf_map_lookup_elem(&vq_notifiers, &k);

		if (!n)
			return 0;
		note_kicked(&k, n);
		queue = n->queue;
	}
	file = fd_file(k.fd);
	if (file)
		note_kick(k.tgid, file, queue);
	return 0;
}

/* An eventfd made by a vCPU, or once the guest ran: a queue notifier
 * (see vq_notifiers). Rare, so attached whenever VMs are tracked. */
static __always_inline void on_eventfd_created(long fd)
{
	struct fd_key k;
	struct notifier n = {};
	__u32 *made, first = 1;
	__u8 one = 1;

	if (!targ_vm_segments || fd < 0)
		return;
	k.tgid = bpf_get_current_pid_tgid() >> 32;
	if (!bpf_map_lookup_elem(&vm_pids, &k.tgid) || (!in_vcpu() && !bpf_map_lookup_elem(&vm_started, &k.tgid)))
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
	bpf_map_update_elem(&vm_started, &k.tgid, &one, BPF_ANY);
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
	__u8 stopped = VM_STOPPED, was_kicked;
	__s64 *open;
	__u64 file;

	if (!targ_vm_segments)
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
		bpf_map_delete_elem(&pending_kicks, &file);
		bpf_map_delete_elem(&vhost_kick_files, &file);
	}
	if (!was_kicked)
		return 0;
	open = bpf_map_lookup_elem(&vm_open_notifiers, &k.tgid);
	if (open && __sync_fetch_and_add(open, -1) <= 1 && !bpf_map_lookup_elem(&vm_no_stop, &k.tgid))
		bpf_map_update_elem(&vm_started, &k.tgid, &stopped, BPF_ANY);
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

/* Under KVM a kick is the guest's MMIO write to a queue's notify address,
 * signalled to the eventfd inside the kernel (no write syscall): the
 * address comes from QEMU registering the eventfd (KVM_IOEVENTFD), the
 * write from kvm:kvm_mmio (or kvm:kvm_fast_mmio where the CPU takes the
 * fast path). (tgid, guest physical address) -> eventfd. */
struct gpa_key {
	__u32 tgid;
	__u32 _pad;
	__u64 gpa;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct gpa_key);
	__type(value, __u32);
} kvm_notify_addrs SEC(".maps");

/* struct kvm_ioeventfd, the ioctl's argument (UAPI: fixed layout). */
struct ioeventfd_arg {
	__u64 datamatch;
	__u64 addr;
	__u32 len;
	__s32 fd;
	__u32 flags;
};

#define KVM_IOEVENTFD_CMD 0x4040ae79 /* _IOW(KVMIO, 0x79, struct kvm_ioeventfd) */
#define VHOST_SET_VRING_KICK_CMD 0x4008af20 /* _IOW(VHOST_VIRTIO, 0x20, struct vhost_vring_file) */

/* struct vhost_vring_file (UAPI). */
struct vring_file_arg {
	__u32 index;
	__s32 fd;
};
#define KVM_IOEVENTFD_DATAMATCH (1 << 0)
#define KVM_IOEVENTFD_DEASSIGN (1 << 2)
#define KVM_TRACE_MMIO_WRITE 2

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

	if ((cmd != KVM_IOEVENTFD_CMD && cmd != VHOST_SET_VRING_KICK_CMD) || !targ_vm_segments)
		return 0;
	if (!bpf_map_lookup_elem(&vm_pids, &tgid))
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
	queue = (io->flags & KVM_IOEVENTFD_DATAMATCH) ? VQ_BY_INDEX | (io->datamatch & VQ_VALUE_MASK)
						      : VQ_BY_ADDR | (io->addr & 0xfff);
	if (!(io->flags & KVM_IOEVENTFD_DATAMATCH) && !(io->addr & 0xfff)) {
		struct gpa_key below = { .tgid = k.tgid, .gpa = io->addr - 0x1000 };
		__u32 *below_fd = bpf_map_lookup_elem(&kvm_notify_addrs, &below);

		if (below_fd) {
			struct fd_key bf = { .tgid = k.tgid, .fd = *below_fd };
			struct notifier *b = bpf_map_lookup_elem(&vq_notifiers, &bf);

			if (b && (b->queue & ~VQ_VALUE_MASK) == VQ_BY_ADDR && !(b->queue & VQ_VALUE_MASK))
				queue = VQ_BY_INDEX | 1;
			else if (b && (b->queue & ~VQ_VALUE_MASK) == VQ_BY_INDEX)
				queue = VQ_BY_INDEX | (((b->queue & VQ_VALUE_MASK) + 1) & VQ_VALUE_MASK);
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

/* The kvm tracepoints' records, as their format files give them (the
 * module's types may be absent from vmlinux BTF: no CO-RE here). */
struct kvm_mmio_record {
	__u64 common;
	__u32 type;
	__u32 len;
	__u64 gpa;
	__u64 val;
};

struct kvm_fast_mmio_record {
	__u64 common;
	__u64 gpa;
};

static __always_inline void on_kvm_notify(__u64 gpa)
{
	struct gpa_key k = { .gpa = gpa };
	struct fd_key f;
	struct notifier *n;
	__u32 *fd;
	__u64 file;
	__u16 queue = 0;
	__u8 one = 1;

	k.tgid = bpf_get_current_pid_tgid() >> 32;
	fd = bpf_map_lookup_elem(&kvm_notify_addrs, &k);
	if (!fd)
		return;
	if (!bpf_map_lookup_elem(&vm_started, &k.tgid))
		bpf_map_update_elem(&vm_started, &k.tgid, &one, BPF_ANY);
	f.tgid = k.tgid;
	f.fd = *fd;
	n = bpf_map_lookup_elem(&vq_notifiers, &f);
	if (n) {
		note_kicked(&f, n);
		queue = n->queue;
	}
	/* In the vCPU's exit: the current process is the VM's. */
	file = fd_file(f.fd);
	if (file)
		note_kick(k.tgid, file, queue);
}

SEC("tracepoint/kvm/kvm_mmio")
int kvm_mmio(struct kvm_mmio_record *ctx)
{
	if (targ_vm_segments && ctx->type == KVM_TRACE_MMIO_WRITE)
		on_kvm_notify(ctx->gpa);
	return 0;
}

SEC("tracepoint/kvm/kvm_fast_mmio")
int kvm_fast_mmio(struct kvm_fast_mmio_record *ctx)
{
	if (targ_vm_segments)
		on_kvm_notify(ctx->gpa);
	return 0;
}

/* A VM thread waking another of the same VM hands it the kick it last
 * picked up: with aio=threads the engine thread picks the kick up and
 * queues the request to a worker, which wakes and submits it. Picks only
 * move forward (a worker waking the engine back leaves its newer pick). A
 * worker that takes its next request without sleeping has used its handed
 * pick: it takes the VM's latest (vm_last_pick). Attached only while a VM
 * with such a disk runs. */
static __always_inline void on_waking(__u32 wakee_tgid, __u32 wakee_tid)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct pick *mine, *theirs, handed;

	if (!targ_vm_segments || wakee_tgid != tgid || wakee_tid == tid || !bpf_map_lookup_elem(&vm_pids, &tgid))
		return;
	mine = bpf_map_lookup_elem(&thread_picks, &tid);
	if (!mine)
		return;
	theirs = bpf_map_lookup_elem(&thread_picks, &wakee_tid);
	if (theirs && theirs->pick_ns >= mine->pick_ns)
		return;
	handed = *mine;
	handed.flags = PICK_HANDED;
	bpf_map_update_elem(&thread_picks, &wakee_tid, &handed, BPF_ANY);
}

SEC("tp_btf/sched_waking")
int BPF_PROG(sched_waking_btf, struct task_struct *p)
{
	on_waking(p->tgid, p->pid);
	return 0;
}

SEC("raw_tp/sched_waking")
int BPF_PROG(sched_waking, struct task_struct *p)
{
	on_waking(BPF_CORE_READ(p, tgid), BPF_CORE_READ(p, pid));
	return 0;
}

/* A worker the engine thread starts for the request it just queued. */
SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(sched_wakeup_new_btf, struct task_struct *p)
{
	on_waking(p->tgid, p->pid);
	return 0;
}

SEC("raw_tp/sched_wakeup_new")
int BPF_PROG(sched_wakeup_new, struct task_struct *p)
{
	on_waking(BPF_CORE_READ(p, tgid), BPF_CORE_READ(p, pid));
	return 0;
}

/* virtqueue_flush(vq, count): count completions pushed (virtqueue_push
 * flushes one). */
SEC("uprobe")
int BPF_KPROBE(virtqueue_flush, void *vq, unsigned int count)
{
	return on_signal(count ? count : 1);
}

SEC("uprobe")
int msix_notify(void *ctx)
{
	return on_signal(0);
}

/* libvhost-user's used-ring push (fill, then flush), in an engine serving
 * the VM's disk over vhost-user (qemu-storage-daemon): once per request,
 * as virtqueue_flush in QEMU, and entered with a push where the flush is
 * not. The engine process is registered under the VM's slot. */
SEC("uprobe")
int vu_queue_push(void *ctx)
{
	return on_signal(1);
}

/* QEMU's device models start their clock for a guest request as they
 * take it (block_acct_start(stats, cookie, bytes, type), one call per read
 * or write): in an engine thread that read a kick, the stamp of when its
 * request was taken (see struct pops). BLOCK_ACCT_READ is 1, _WRITE 2. */
SEC("uprobe")
int BPF_KPROBE(block_acct_start, void *stats, void *cookie, __s64 bytes, int type)
{
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	static const struct pops fresh;
	struct pick *p;
	struct pops *q;
	__u32 op, t;

	if (!targ_vm_segments || (type != 1 && type != 2))
		return 0;
	p = bpf_map_lookup_elem(&thread_picks, &tid);
	if (!p || !(p->flags & PICK_READ) || (p->flags & PICK_SPENT))
		return 0;
	q = lookup_or_init(&thread_pops, &tid, &fresh);
	if (!q)
		return 0;
	if (q->pick_ns != p->pick_ns) {
		q->pick_ns = p->pick_ns;
		q->head[0] = q->tail[0] = 0;
		q->head[1] = q->tail[1] = 0;
	}
	op = type == 2;
	t = q->tail[op];
	if (t - q->head[op] >= POPS)
		return 0;
	q->ts[op][t & POPS_MASK] = bpf_ktime_get_ns();
	q->tail[op] = t + 1;
	return 0;
}

/* Guest requests that never become host requests of their own: merged
 * into a neighbour's by QEMU (virtio-blk merges adjacent requests of one
 * batch and accounts them with block_acct_merge_done(stats, type, n), a
 * call made only when it merges) or, bio into request, by the host block
 * layer in the VM's submitting thread. Both are rare under random I/O and
 * the rule under sequential I/O: without them a VM's request count would
 * fall short of its guest's. */
static __always_inline void note_merges(__u64 n, int engine, __u32 dev)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	struct vm_counts *c;
	__u32 *vm;
	__u8 *state;

	if (!targ_track_vms)
		return;
	vm = bpf_map_lookup_elem(&vm_pids, &tgid);
	if (!vm)
		return;
	/* QEMU's own requests (before the guest runs, after it stops) are no
	 * guest's. */
	state = bpf_map_lookup_elem(&vm_started, &tgid);
	if (!state || *state != VM_RUNNING)
		return;
	/* A bio the VM's thread merged on a disk holding none of its virtual
	 * disks is no guest request: its own log or image of another kind
	 * written back from its context (direct reclaim, dirty throttling). */
	if (!engine) {
		struct vm_dev_key vk = { .vm = *vm, .dev = dev };

		if (!bpf_map_lookup_elem(&vm_disks, &vk))
			return;
	}
	c = vm_counts_of(*vm);
	if (!c)
		return;
	if (engine)
		__sync_fetch_and_add(&c->engine_merges, n);
	else
		__sync_fetch_and_add(&c->bio_merges, n);
	/* Each merged guest request is still pushed to the used ring on its
	 * own when the one host request completes: its push waits too, so
	 * that it does not take the place of another request's. */
	signal_due_n(*vm, n);
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
	note_merges(1, 0, bio_disk_dev(bio));
	return 0;
}

SEC("raw_tp/block_bio_backmerge")
int BPF_PROG(block_bio_backmerge, struct bio *bio)
{
	note_merges(1, 0, bio_disk_dev(bio));
	return 0;
}

SEC("tp_btf/block_bio_frontmerge")
int BPF_PROG(block_bio_frontmerge_btf, struct bio *bio)
{
	note_merges(1, 0, bio_disk_dev(bio));
	return 0;
}

SEC("raw_tp/block_bio_frontmerge")
int BPF_PROG(block_bio_frontmerge, struct bio *bio)
{
	note_merges(1, 0, bio_disk_dev(bio));
	return 0;
}

/* An engine thread reading an eventfd a vCPU kicked picks the kick up: a
 * thread of the VM's own QEMU, or of an engine process registered under
 * the VM's slot. */
SEC("tracepoint/syscalls/sys_enter_read")
int sys_enter_read(struct trace_event_raw_sys_enter *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct fd_key k = { .tgid = pid_tgid >> 32, .fd = (__u32)ctx->args[0] };
	struct pick p = {};
	struct kick *kick;
	__u64 file;
	__u32 tid = (__u32)pid_tgid;

	if (!vm_of_eventfd_io(ctx, 0) || in_vcpu())
		return 0;
	file = fd_file(k.fd);
	if (!file)
		return 0;
	kick = bpf_map_lookup_elem(&pending_kicks, &file);
	if (!kick)
		return 0;
	p.kick_ns = kick->ts_ns;
	p.queue = (__u32)kick->queue;
	p.pick_ns = bpf_ktime_get_ns();
	p.hv_wait_ns = waited_within(tid, p.kick_ns, p.pick_ns);
	p.flags = PICK_READ;
	{
		struct pick *old = bpf_map_lookup_elem(&thread_picks, &tid);

		/* A polling thread reads a kick whose requests it may already
		 * have found by polling: so it did if it submitted since the
		 * kick, and may have if it has not slept since it last
		 * submitted (a kick that found it asleep woke it; one that
		 * came while it polled was raced by its poll, and the guest's
		 * MMIO exit can reach KVM after the poll took the requests).
		 * Nothing after such a read is known to be its batch. */
		if (old && (old->flags & PICK_READ)) {
			p.last_start_ns = old->last_start_ns;
			p.nvcsw = old->nvcsw;
			p.flags |= old->flags & PICK_POLLS;
			if ((old->flags & PICK_POLLS) &&
			    (old->last_start_ns > p.kick_ns || current_nvcsw() == old->nvcsw))
				p.flags |= PICK_SPENT;
		}
	}
	bpf_map_delete_elem(&pending_kicks, &file);
	bpf_map_update_elem(&thread_picks, &tid, &p, BPF_ANY);
	bpf_map_update_elem(&vm_last_pick, &k.tgid, &p, BPF_ANY);
	return 0;
}

/* A submitting system call of a VM thread: the pick whose batch an
 * earlier call submitted is spent (see struct pick). */
static __always_inline void on_submit_call(__u64 nr)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct pick *p;

	if (!targ_vm_segments || !nr || !bpf_map_lookup_elem(&vm_pids, &tgid))
		return;
	p = bpf_map_lookup_elem(&thread_picks, &tid);
	if (!p || !(p->flags & PICK_READ))
		return;
	/* An iothread submits a kick's batch in one call (virtio-blk plugs
	 * it); other engines may submit theirs one request per call (QEMU's
	 * NVMe, unplugged io_uring), and never poll. */
	if ((p->flags & PICK_TAKEN) && in_iothread())
		p->flags |= PICK_SPENT;
	p->flags |= PICK_ENTERED;
}

SEC("tracepoint/syscalls/sys_enter_io_uring_enter")
int sys_enter_io_uring_enter(struct trace_event_raw_sys_enter *ctx)
{
	on_submit_call(ctx->args[1]);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_io_submit")
int sys_enter_io_submit(struct trace_event_raw_sys_enter *ctx)
{
	on_submit_call(ctx->args[1]);
	return 0;
}

/* io_uring:io_uring_queue_async_work, as its format file gives it since
 * 5.5: the request follows the ring. */
struct io_uring_async_record {
	__u64 common;
	__u64 ctx;
	__u64 req;
};

/* An engine thread's io_uring request punted to an io-wq worker: the
 * worker issues it later, with the pick it was submitted under. */
SEC("tracepoint/io_uring/io_uring_queue_async_work")
int io_uring_queue_async_work(struct io_uring_async_record *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	struct pick *p;
	__u64 req = ctx->req;

	if (!targ_vm_segments || !bpf_map_lookup_elem(&vm_pids, &tgid))
		return 0;
	p = bpf_map_lookup_elem(&thread_picks, &tid);
	if (!p)
		return 0;
	if ((p->flags & PICK_READ) && !(p->flags & PICK_ENTERED)) {
		/* No submitting call since the pickup: a request of an earlier
		 * call, whose retry io_uring queued as task work (a busy
		 * device refused it without waiting); its pickup is not known. */
		struct pick unknown = {};

		bpf_map_update_elem(&punted_picks, &req, &unknown, BPF_ANY);
		return 0;
	}
	if (p->flags & PICK_READ)
		take_pick(p, bpf_ktime_get_ns());
	bpf_map_update_elem(&punted_picks, &req, p, BPF_ANY);
	return 0;
}

/* Linked into host.bpf.o with block.bpf.c, whose license section it shares. */
