// SPDX-License-Identifier: GPL-2.0
/*
 * The guest's kicks. Under KVM, the guest's write to a queue's notify
 * address, seen in its exit (kvm:kvm_mmio, kvm:kvm_fast_mmio): a kick on
 * the registered eventfd (the deep tier, which saw QEMU register it) or on
 * a notifier learnt from the wake-up it made (kicks.bpf.h; both tiers).
 * Under TCG, a vCPU thread's write of an eventfd: seen by the write system
 * call's tracepoint (the deep tier) or, where the kernel lets fentry or a
 * kprobe reach it, by eventfd_write itself (the always-on tier): no
 * system-call tracepoint, no cost to any other write on the host.
 */
#include "kicks.bpf.h"
#include "linked.h"
#include "notifiers.bpf.h"

kvm_notifiers_map_t kvm_notifiers SEC(".maps");
mmio_marks_map_t mmio_marks SEC(".maps");
last_wake_map_t last_wake SEC(".maps");

/* The queue a notify address names: its offset in its page (virtio-pci's
 * notify addresses 4 bytes apart, NVMe's doorbells 8); at offset 0, its
 * page (queue 0, or a device with a page per queue: the agent tells). */
static __always_inline __u16 queue_of_gpa(__u64 gpa)
{
	if (gpa & 0xfff)
		return VQ_BY_ADDR | (gpa & 0xfff);
	return VQ_BY_ADDR | VQ_ADDR_PAGE | ((gpa >> 12) & (VQ_ADDR_PAGE - 1));
}

/* A kick at `now` for engine thread `tid`'s notifier in `slot`: the
 * first one since its last pickup counts. */
static __always_inline void thread_kick(__u32 tid, __u32 slot, __u64 now)
{
	struct thread_kicks *k = thread_kicks_of(tid);

	if (!k || slot >= KICK_SLOTS || k->ts[slot])
		return;
	k->ts[slot] = now;
	__sync_fetch_and_or(&k->pending, 1u << slot);
}

/* The slot of `queue` among engine thread `tid`'s notifiers, given one
 * if it has none yet (KICK_SLOTS at most: a further notifier shares the
 * last slot). */
static __always_inline __u32 kick_slot(__u32 tid, __u16 queue)
{
	static const struct thread_kicks fresh;
	struct thread_kicks *k = lookup_or_init(&thread_kicks, &tid, &fresh);
	__u32 i;

	if (!k)
		return KICK_SLOTS;
	mark_thread_kicked(tid);
	for (i = 0; i < KICK_SLOTS; i++) {
		if (k->queue[i] == queue)
			return i;
		if (!k->queue[i]) {
			k->queue[i] = queue;
			return i;
		}
	}
	return KICK_SLOTS - 1;
}

__inline_linked void learnt_kick(__u32 tgid, __u64 gpa, __u32 engine, __u64 now)
{
	struct notify_key k = { .tgid = tgid, .gpa = gpa };
	struct notify_engine e = { .tid = engine, .queue = queue_of_gpa(gpa) }, *old;

	old = bpf_map_lookup_elem(&kvm_notifiers, &k);
	if (old && old->tid == engine) {
		thread_kick(engine, old->slot, now);
		return;
	}
	if (old) {
		struct thread_kicks *stale = bpf_map_lookup_elem(&thread_kicks, &old->tid);

		if (stale && old->slot < KICK_SLOTS)
			stale->ts[old->slot & (KICK_SLOTS - 1)] = 0;
	}
	e.slot = kick_slot(engine, e.queue);
	bpf_map_update_elem(&kvm_notifiers, &k, &e, BPF_ANY);
	thread_kick(engine, e.slot, now);
}

/* The VM a read or write belongs to. An eventfd write moves exactly 8
 * bytes; reads are made with larger buffers (QEMU drains an eventfd with a
 * 512-byte read), so only writes are filtered on size. */
static __always_inline __u32 vm_of_eventfd_io(const struct trace_event_raw_sys_enter *ctx,
					      int write)
{
	struct vm_proc *p;

	if (!targ_vm_segments || (write && ctx->args[2] != 8) || ctx->args[2] < 8)
		return 0;
	p = vm_proc_of(bpf_get_current_pid_tgid() >> 32);
	return p ? p->slot : 0;
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
	mark_started(k.tgid);
	if (bpf_map_lookup_elem(&vm_notifiers_known, &k.tgid)) {
		struct notifier *n = bpf_map_lookup_elem(&vq_notifiers, &k);

		if (!n)
			return 0;
		note_kicked(&k, n);
		queue = n->queue;
	}
	file = fd_file(k.fd);
	if (file)
		note_file_kick(k.tgid, file, queue);
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

#define KVM_TRACE_MMIO_WRITE 2

/* A kick on an address QEMU registered while the deep tier watched: on
 * its eventfd's file, as a vCPU's write would be. Whether it was one. */
static __always_inline int registered_kick(__u32 tgid, __u64 gpa)
{
	struct gpa_key k = { .tgid = tgid, .gpa = gpa };
	struct fd_key f;
	struct notifier *n;
	__u32 *fd;
	__u64 file;
	__u16 queue = 0;

	fd = bpf_map_lookup_elem(&kvm_notify_addrs, &k);
	if (!fd)
		return 0;
	mark_started(tgid);
	f.tgid = tgid;
	f.fd = *fd;
	n = bpf_map_lookup_elem(&vq_notifiers, &f);
	if (n) {
		note_kicked(&f, n);
		queue = n->queue;
	}
	/* In the vCPU's exit: the current process is the VM's. */
	file = fd_file(f.fd);
	if (file)
		note_file_kick(tgid, file, queue);
	return 1;
}

/* A vCPU's write at `gpa`; `signalled`: KVM has already signalled its
 * eventfd, if it has one (the fast path's tracepoint comes after). */
static __always_inline void on_kvm_notify(__u64 gpa, int signalled)
{
	__u64 id = bpf_get_current_pid_tgid(), now;
	__u32 tgid = id >> 32, tid = (__u32)id, zero = 0;
	struct notify_key k = { .tgid = tgid, .gpa = gpa };
	struct notify_engine *e;
	struct mmio_mark *m;
	struct wake *w;

	if (registered_kick(tgid, gpa) || !vm_proc_of(tgid))
		return;
	mark_started(tgid);
	now = bpf_ktime_get_ns();
	e = bpf_map_lookup_elem(&kvm_notifiers, &k);
	if (signalled) {
		w = bpf_map_lookup_elem(&last_wake, &zero);
		if (w && w->waker == tid && w->wakee_tgid == tgid && !w->wakee_vcpu &&
		    w->wakee != tid) {
			w->waker = 0;
			learnt_kick(tgid, gpa, w->wakee, now);
			return;
		}
		if (e)
			thread_kick(e->tid, e->slot, now);
		return;
	}
	if (e)
		thread_kick(e->tid, e->slot, now);
	m = bpf_map_lookup_elem(&mmio_marks, &zero);
	if (m) {
		m->gpa = gpa;
		m->ts_ns = now;
		m->tid = tid;
		m->tgid = tgid;
	}
}

SEC("tracepoint/kvm/kvm_mmio")
int kvm_mmio(struct kvm_mmio_record *ctx)
{
	if (targ_vm_segments && ctx->type == KVM_TRACE_MMIO_WRITE)
		on_kvm_notify(ctx->gpa, 0);
	return 0;
}

SEC("tracepoint/kvm/kvm_fast_mmio")
int kvm_fast_mmio(struct kvm_fast_mmio_record *ctx)
{
	if (targ_vm_segments)
		on_kvm_notify(ctx->gpa, 1);
	return 0;
}

/* A vCPU thread's eventfd write (the always-on tier, where fentry or a
 * kprobe reaches eventfd_write: only eventfd writes pay). Any eventfd a
 * vCPU writes counts, the guest's queue notifiers and QEMU's loop
 * notifiers alike (which are which is known only from their creation,
 * watched by the deep tier): a loop notifier's kick is picked up by the
 * loop, which submits nothing for it, and the next pickup replaces it. */
static __always_inline void on_eventfd_write(__u64 file)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;

	if (!targ_vm_segments || deep_tier() || !vm_proc_of(tgid) || !in_vcpu())
		return;
	mark_started(tgid);
	note_file_kick(tgid, file, 0);
}

SEC("fentry/eventfd_write")
int BPF_PROG(eventfd_write_fentry, struct file *file)
{
	on_eventfd_write((__u64)file);
	return 0;
}

SEC("kprobe/eventfd_write")
int BPF_KPROBE(eventfd_write_kprobe, struct file *file)
{
	on_eventfd_write((__u64)file);
	return 0;
}

/* Linked into host.bpf.o with block.bpf.c, whose license section it shares. */
