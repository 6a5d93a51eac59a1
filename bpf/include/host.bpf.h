/* SPDX-License-Identifier: GPL-2.0 */
/*
 * What the host programs share: block.bpf.c (block accounting), vm.bpf.c
 * (VM attribution and the host window) and vhost.bpf.c (the kernel's vhost
 * workers) are linked into one object, host.bpf.o, whose maps and
 * settings are one set. Each map and setting is defined in the file of its
 * concern and declared here for the others.
 */
#ifndef IOSPAN_HOST_BPF_H
#define IOSPAN_HOST_BPF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "agent_abi.h"
#include "maps.bpf.h"

/* Settings the agent fills in before loading (defined in block.bpf.c and
 * vm.bpf.c). */
extern const volatile __u64 targ_wakeup_bytes;
/* Attribute requests to VMs (processes in vm_pids) and keep vm_latency. */
extern const volatile __u32 targ_track_vms;
/* Follow VMs' notifications (eventfd kicks, pickups, signals) to split the
 * host window of their requests; needs targ_track_vms. */
extern const volatile __u32 targ_vm_segments;
/* Addresses of the direct-I/O completion functions, in enum dio_kind's
 * order (from kallsyms; 0 when absent). */
extern const volatile __u64 targ_dio_end_io[NR_DIO_END_IO];

/* Per-request records to the agent (defined in block.bpf.c). */
typedef struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4 << 20);
} events_map_t;
extern events_map_t events SEC(".maps");

/* VMs whose guest runs: tgid -> VM_RUNNING, set at the first eventfd write
 * of a vCPU thread, a KVM notify, or a queue notifier made (and by the
 * agent for VMs running when it starts). Before that the process only
 * opens its images and realizes its devices (format, alignment and
 * geometry probes); after QEMU closes its queue notifiers (the VM stopped
 * or shut down, or the guest reset the device) it may probe or close its
 * images: such requests are QEMU's own, not any virtual disk's. */
#define VM_RUNNING 1
#define VM_STOPPED 2

/* The last kick each engine thread picked up: tid -> {kick, pickup}. The
 * requests that thread submits next belong to that notification: those of
 * all it submits until it reads the next. A polling engine (QEMU's
 * iothreads, in_iothread) also finds requests with no kick at all, by
 * reading the queue's ring: for those threads a pick is spent once the
 * thread went round its loop after submitting the pick's batch (it
 * delivered completions, or made its next submitting call), and what it
 * submits then is declared polled, never given an older batch's kick. */
struct pick {
	__u64 kick_ns;
	__u64 pick_ns;
	__u64 flags;         /* PICK_* */
	__u64 last_start_ns; /* the thread's latest request start (own reads) */
	__u64 nvcsw;         /* its voluntary context switches then */
	__u32 queue;         /* VQ_*: the notifier the kick came through */
	__u32 hv_wait_ns;    /* the picking thread's CPU waits within kick -> pickup */
};

#define PICK_HANDED (1 << 0) /* handed to a worker it woke (aio=threads) */
#define PICK_USED (1 << 1)   /* a worker submitted with it */
#define PICK_READ (1 << 2)   /* the thread's own read of the notifier */
#define PICK_TAKEN (1 << 3)  /* a request of its batch was submitted */
#define PICK_SPENT (1 << 4)  /* its batch is over: what follows was polled */
#define PICK_POLLS (1 << 5)  /* the thread has submitted polled requests */
#define PICK_ENTERED (1 << 6) /* a submitting call began since the pickup */

/* Processes that are VMs: tgid -> VM slot. The agent adds the ones
 * running when it starts; exec of a new one adds itself (below). The agent
 * also adds, under the VM's slot, an engine process that serves the VM's
 * disks from outside QEMU (vhost-user): its requests are the VM's. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} vm_pids_map_t;
extern vm_pids_map_t vm_pids SEC(".maps");

/* VM slot -> what happened to its requests besides completing: the guest
 * requests that never became host requests of their own because they were
 * merged, by QEMU or by the host block layer, and how many it started.
 * (Those whose completion never reached us are in vm_undelivered.) */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct vm_counts);
} vm_counts_map_t;
extern vm_counts_map_t vm_counts SEC(".maps");

/* Backing files of VMs' virtual disks -> virtual disk slot. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct file_key);
	__type(value, __u32);
} vdisk_files_map_t;
extern vdisk_files_map_t vdisk_files SEC(".maps");

/* Requests VMs submitted, per (VM, host disk, op, virtual disk). Per-CPU
 * entries under the same busy flag as blk_latency; nested updates go,
 * atomically, to the shared vm_latency_nested. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 128);
	__type(key, struct vm_key);
	__type(value, struct blk_stats);
} vm_latency_map_t;
extern vm_latency_map_t vm_latency SEC(".maps");

typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 128);
	__type(key, struct vm_key);
	__type(value, struct blk_stats);
} vm_latency_nested_map_t;
extern vm_latency_nested_map_t vm_latency_nested SEC(".maps");

/* A VM's requests whose completion never reached us, per (VM, host disk,
 * op, virtual disk): the requests its entry counts beside the timed ones.
 * The agent adds those still open when their VM has exited. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 128);
	__type(key, struct vm_key);
	__type(value, __u64);
} vm_undelivered_map_t;
extern vm_undelivered_map_t vm_undelivered SEC(".maps");

/* (VM, host disk) -> the VM's virtual disk there, or VDISK_SEVERAL. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct vm_dev_key);
	__type(value, __u32);
} vm_disks_map_t;
extern vm_disks_map_t vm_disks SEC(".maps");

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
} vm_started_map_t;
extern vm_started_map_t vm_started SEC(".maps");

/* Each VM's latest pickup: a worker that goes on to its next request
 * without sleeping (no hand-off) takes this one. It may be later than the
 * notification that queued the request (the queueing then shows as
 * hypervisor time); the worker's previous one would be earlier than the
 * request's kick, making its window outgrow what the guest saw. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct pick);
} vm_last_pick_map_t;
extern vm_last_pick_map_t vm_last_pick SEC(".maps");

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct pick);
} thread_picks_map_t;
extern thread_picks_map_t thread_picks SEC(".maps");

/* When an engine thread's device model took each request of its latest
 * pickup's batch (QEMU's block_acct_start, where its clock for the request
 * starts), reads and writes apart: a pickup reads a notifier once for the
 * whole batch, and each request then waits its turn behind the ones taken
 * before it, which is not engine time of its own. A request the thread
 * starts takes the oldest stamp of its op (the batch is submitted in
 * sector order, not in the order taken: exact for the batch's sum, not for
 * each request); a batch of more than POPS of an op, and requests the
 * device model took without accounting, keep the pickup. */
#define POPS 32
#define POPS_MASK (POPS - 1)

struct pops {
	__u64 pick_ns;         /* the pickup the stamps follow */
	__u32 head[2];         /* per op (read, write): next to take */
	__u32 tail[2];         /* next free */
	__u64 ts[2][POPS];
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct pops);
} thread_pops_map_t;
extern thread_pops_map_t thread_pops SEC(".maps");

/* The stamp of the next request of op `op` that thread `tid` starts under
 * pickup `pick_ns`, or `pick_ns` when it has none. */
static __always_inline __u64 take_pop(__u32 tid, __u64 pick_ns, __u32 op)
{
	struct pops *q;
	__u32 h;

	if (op > BLK_OP_WRITE)
		return pick_ns;
	q = bpf_map_lookup_elem(&thread_pops, &tid);
	if (!q || q->pick_ns != pick_ns)
		return pick_ns;
	h = q->head[op & 1];
	if (h == q->tail[op & 1])
		return pick_ns;
	q->head[op & 1] = h + 1;
	return q->ts[op & 1][h & POPS_MASK];
}

/* A VM thread's waits for a CPU (runq.bpf.c): since when it is runnable
 * and not running (0: running or asleep), and its last RUN_WAITS waits. */
struct run_waits {
	__u64 runnable_since;
	__u64 start[RUN_WAITS];
	__u64 end[RUN_WAITS];
	__u32 next;  /* where the next wait goes, modulo RUN_WAITS */
	__u32 _pad;
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32);
	__type(value, struct run_waits);
} thread_waits_map_t;
extern thread_waits_map_t thread_waits SEC(".maps");

/* How long thread `tid`, running now, waited for a CPU within [from, to]:
 * its last RUN_WAITS waits, clipped to the interval (more waits than that
 * in one interval are not counted; saturates at ~4.3 s). */
static __always_inline __u32 waited_within(__u32 tid, __u64 from, __u64 to)
{
	struct run_waits *w;
	__u64 sum = 0;
	int i;

	if (!from || to <= from)
		return 0;
	w = bpf_map_lookup_elem(&thread_waits, &tid);
	if (!w)
		return 0;
	for (i = 0; i < RUN_WAITS; i++) {
		__u64 s = w->start[i] > from ? w->start[i] : from;
		__u64 e = w->end[i] < to ? w->end[i] : to;

		if (e > s)
			sum += e - s;
	}
	return sum > 0xffffffffULL ? 0xffffffffU : (__u32)sum;
}

static __always_inline __u64 current_nvcsw(void)
{
	struct task_struct *t = (struct task_struct *)bpf_get_current_task();

	return BPF_CORE_READ(t, nvcsw);
}

/* An engine thread submitting under its own pick at `now` (a request's
 * start, or its punt to an io-wq worker): the pick's batch is taken, or,
 * when an earlier call spent it, the request was found by polling. */
static __always_inline int take_pick(struct pick *p, __u64 now)
{
	int polled = !!(p->flags & PICK_SPENT);

	p->flags |= polled ? PICK_POLLS : PICK_TAKEN;
	p->last_start_ns = now;
	p->nvcsw = current_nvcsw();
	return polled;
}

/* io_uring requests an engine thread punted to an io-wq worker (a busy
 * device refused them without waiting): request (its kiocb, the first
 * member of io_kiocb) -> the submitting thread's pick, for the worker
 * that issues it. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct pick);
} punted_picks_map_t;
extern punted_picks_map_t punted_picks SEC(".maps");

/* The eventfds QEMU hands the kernel's vhost as a queue's kick
 * (VHOST_SET_VRING_KICK): open file -> 1. A kick on one reaches the worker
 * inside the kernel (eventfd wake-up -> vhost_task), with no read. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u8);
} vhost_kick_files_map_t;
extern vhost_kick_files_map_t vhost_kick_files SEC(".maps");

/* VMs with a vhost kick not yet picked up: tgid -> time of the first. The
 * pickup is the VM's vhost worker being switched in. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} vhost_kicks_map_t;
extern vhost_kicks_map_t vhost_kicks SEC(".maps");

/* Source of a zeroed blk_stats for new vm_latency entries (too big for the
 * stack; defined in block.bpf.c). */
extern const struct blk_stats zero_stats;

/* No wakeup per record: the reader drains on a timer, and is woken only
 * when the backlog grows past targ_wakeup_bytes. */
static __always_inline __u64 wakeup_flags(void)
{
	if (bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) >= targ_wakeup_bytes)
		return BPF_RB_FORCE_WAKEUP;
	return BPF_RB_NO_WAKEUP;
}

/* One record into the ring buffer; no room is counted, never silent. */
static __always_inline int emit(void *rec, __u64 size)
{
	if (bpf_ringbuf_output(&events, rec, size, wakeup_flags())) {
		count(CNT_RINGBUF_DROPS);
		return -1;
	}
	return 0;
}

/* vCPU threads are named "CPU <n>/KVM" or "CPU <n>/TCG" (debug-threads=on,
 * as libvirt runs QEMU). */
static __always_inline int in_vcpu(void)
{
	char c[16];

	bpf_get_current_comm(c, sizeof(c));
	return c[0] == 'C' && c[1] == 'P' && c[2] == 'U' && c[3] == ' ';
}

/* QEMU's iothreads are named "IO <id>" (debug-threads=on, as libvirt runs
 * QEMU). They poll their queues before they sleep (poll-max-ns, 32 µs by
 * default): the only engine threads whose requests may come with no kick. */
static __always_inline int in_iothread(void)
{
	char c[16];

	bpf_get_current_comm(c, sizeof(c));
	return c[0] == 'I' && c[1] == 'O' && c[2] == ' ';
}

/* The kernel's vhost workers are named "vhost-<owner pid>"; since v6.4
 * (vhost_task) they are threads of the owner, QEMU, so its requests and
 * signals reach the VM's slot through its tgid. */
static __always_inline int vhost_comm(const char *c)
{
	return c[0] == 'v' && c[1] == 'h' && c[2] == 'o' && c[3] == 's' && c[4] == 't' && c[5] == '-';
}

static __always_inline int in_vhost_worker(void)
{
	char c[16];

	bpf_get_current_comm(c, sizeof(c));
	return vhost_comm(c);
}


/* The VM's vhost worker taking its pending kick, if there is one: when it
 * is switched in, or, when the kick came while it ran (no wake-up needed),
 * at its next submission (the worker's queueing then counts as the
 * hypervisor's). */
static __always_inline void claim_vhost_kick(__u32 tgid, __u32 tid)
{
	struct pick p = {};
	__u64 *kick = bpf_map_lookup_elem(&vhost_kicks, &tgid);

	if (!kick)
		return;
	p.kick_ns = *kick;
	p.pick_ns = bpf_ktime_get_ns();
	bpf_map_delete_elem(&vhost_kicks, &tgid);
	bpf_map_update_elem(&thread_picks, &tid, &p, BPF_ANY);
	bpf_map_update_elem(&vm_last_pick, &tgid, &p, BPF_ANY);
}

/* Per VM slot, its requests completed on the host and not yet made
 * visible by a signal. Used-ring pushes (virtqueue_flush, vu_queue_push)
 * come one per request, in completion order, and are all recorded (the
 * correlator gives each to one request), gathered per thread and sent
 * when none waits any more; an interrupt (NVMe's msix_notify, a vhost
 * worker's irqfd) covers every completion before it: it makes a record
 * only when any waits, and clears them. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} vm_signal_due_map_t;
extern vm_signal_due_map_t vm_signal_due SEC(".maps");

/* `n` more of a VM's pushes to wait for: a request completed on the host
 * (one), or guest requests merged into another (one each). */
static __always_inline void signal_due_n(__u32 vm, __u32 n)
{
	__u32 *d = bpf_map_lookup_elem(&vm_signal_due, &vm);

	if (!d)
		bpf_map_update_elem(&vm_signal_due, &vm, &n, BPF_NOEXIST);
	else
		__sync_fetch_and_add(d, n);
}

static __always_inline void signal_due(__u32 vm)
{
	signal_due_n(vm, 1);
}

/* Whether a signal covering `covers` completions (0: all) finds any
 * waiting, taking them. Another CPU's completion racing this is counted
 * either here or for the next signal, never lost: its window is ended by
 * a later record, or counted no_signal if none comes. */
static __always_inline int take_due(__u32 *due, __u32 covers)
{
	__s32 old;

	if (!covers)
		return __sync_lock_test_and_set(due, 0) != 0;
	if (!*due)
		return 0;
	old = (__s32)__sync_fetch_and_add(due, -covers);
	if (old < (__s32)covers)
		/* Fewer waited than it covers: none left, not a debt. */
		__sync_fetch_and_add(due, covers - (old > 0 ? old : 0));
	return old > 0;
}

/* Each engine thread's pushes not yet sent (struct vm_pushes_event). */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct vm_pushes_event);
} thread_pushes_map_t;
extern thread_pushes_map_t thread_pushes SEC(".maps");

/* The thread's last two waits for a CPU, newest first. */
static __always_inline void last_waits(__u32 tid, __u64 start[2], __u64 end[2])
{
	struct run_waits *w = bpf_map_lookup_elem(&thread_waits, &tid);

	if (w) {
		__u32 i = (w->next - 1) & (RUN_WAITS - 1), j = (w->next - 2) & (RUN_WAITS - 1);

		start[0] = w->start[i];
		end[0] = w->end[i];
		start[1] = w->start[j];
		end[1] = w->end[j];
	}
}

/* Sends thread `tid`'s gathered pushes, if any. */
static __always_inline void send_pushes(__u32 tid, struct vm_pushes_event *b)
{
	if (!b->n)
		return;
	last_waits(tid, b->wait_start, b->wait_end);
	emit(b, sizeof(*b));
	b->n = 0;
}

/* The thread leaving its CPU sends what it gathered: it may not push
 * again for a while. */
static __always_inline void send_pushes_of(__u32 tid)
{
	struct vm_pushes_event *b = bpf_map_lookup_elem(&thread_pushes, &tid);

	if (b)
		send_pushes(tid, b);
}

/* The engine making completions visible to the guest, one record per hit
 * that finds completions waiting (vm_signal_due): virtio's used-ring push
 * (virtqueue_flush, once per request: the guest may reap it by polling the
 * ring, without an interrupt, when QEMU suppresses it under EVENT_IDX;
 * `covers` its count) or, for NVMe, QEMU raising the interrupt after
 * posting the completions (msix_notify, `covers` 0). Attached per VM
 * process, on a push instruction (emulated, not single-stepped). */
static __always_inline int on_signal(__u32 covers)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tgid = id >> 32, tid = (__u32)id;
	__u32 *vm;
	struct vm_signal_event ev = { .kind = EVENT_VM_SIGNAL };
	struct pick *p;

	if (!targ_vm_segments)
		return 0;
	vm = bpf_map_lookup_elem(&vm_pids, &tgid);
	if (!vm)
		return 0;
	/* An iothread completing requests after it submitted its pickup's
	 * batch went round its loop: what it submits before it reads another
	 * kick was found by polling. One known to poll that completes
	 * requests between a read and its submission, likewise (the read's
	 * kick may be one its poll had already served). Other engine threads
	 * may deliver completions between the submissions of one kick's
	 * batch (qemu-storage-daemon does), and never poll. */
	if (in_iothread()) {
		p = bpf_map_lookup_elem(&thread_picks, &tid);
		if (p && (p->flags & PICK_READ) && (p->flags & (PICK_TAKEN | PICK_POLLS)))
			p->flags |= PICK_SPENT;
	}
	{
		__u32 *due = bpf_map_lookup_elem(&vm_signal_due, vm);

		/* Every push is recorded, waited for or not: one left out
		 * (taken as another's by the count of a request started before
		 * the probes, which QEMU pushes too) would make every later
		 * request take the push after its own. */
		if (covers) {
			static const struct vm_pushes_event fresh = { .kind = EVENT_VM_PUSHES };
			struct vm_pushes_event *b = lookup_or_init(&thread_pushes, &tid, &fresh);
			__u32 i;

			if (!b)
				return 0;
			if (b->vm != *vm) {
				send_pushes(tid, b);
				b->vm = *vm;
			}
			/* A push of several completions is one stamp each. */
			for (i = 0; i < PUSH_BATCH && i < covers; i++) {
				__u32 n = b->n;

				if (n >= PUSH_BATCH) {
					send_pushes(tid, b);
					n = 0;
				}
				b->ts[n & (PUSH_BATCH - 1)] = bpf_ktime_get_ns();
				b->n = n + 1;
			}
			if (due)
				take_due(due, covers);
			if (b->n >= PUSH_BATCH || !due || !*due)
				send_pushes(tid, b);
			return 0;
		}
		if (!due || !take_due(due, 0))
			return 0;
	}
	ev.vm = *vm;
	ev.ts_ns = bpf_ktime_get_ns();
	last_waits(tid, ev.wait_start, ev.wait_end);
	emit(&ev, sizeof(ev));
	return 0;
}

static __always_inline struct vm_counts *vm_counts_of(__u32 vm)
{
	static const struct vm_counts zero;

	return lookup_or_init(&vm_counts, &vm, &zero);
}

#endif /* IOSPAN_HOST_BPF_H */
