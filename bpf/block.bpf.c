// SPDX-License-Identifier: GPL-2.0
/*
 * Host block layer: every request's queue and service time, aggregated in
 * per-CPU log-linear histograms per disk and operation; per-request records
 * through a ring buffer only when sampling or a latency threshold asks.
 *
 * Cost is the design constraint. The completion reads the timestamps the
 * kernel already keeps in struct request; the only per-request state of our
 * own is a slot in a flat array addressed by a hash of the request's
 * (queue, hardware context, tag) — no hash-map insert or delete — holding
 * the issue time, partial-completion bytes and requeues.
 *
 * Each handler exists twice: `*_btf` on tp_btf (direct, cheap reads) and a
 * raw_tp twin (probe reads) for kernels without BTF-typed tracepoints. The
 * agent loads one set.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "agent_abi.h"
#include "blk_op.bpf.h"
#include "hist.h"
#include "rq_account.h"
#include "core_fixes.bpf.h"
#include "maps.bpf.h"

const volatile __u32 targ_max_disks = DEFAULT_MAX_DISKS;
const volatile __u32 targ_sample_every = 0;     /* stream 1 in N requests; 0: none */
const volatile __u64 targ_slower_than_ns = 0;   /* stream requests at least this slow; 0: off */
const volatile __u64 targ_wakeup_bytes = 256 << 10; /* wake the reader past this backlog */
/* Stream only requests of these disks (all when targ_nr_stream_devs is 0);
 * histograms always cover every disk. */
const volatile __u32 targ_nr_stream_devs = 0;
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
const volatile __u32 targ_stream_devs[MAX_STREAM_DEVS] = {};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, DEFAULT_MAX_DISKS * BLK_NR_OPS);
	__type(key, __u32);
	__type(value, struct blk_stats);
} blk_latency SEC(".maps");

/* Updates that found their per-CPU entry busy (nested on the same CPU);
 * shared, so updated atomically. Rare. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEFAULT_MAX_DISKS * BLK_NR_OPS);
	__type(key, __u32);
	__type(value, struct blk_stats);
} blk_latency_nested SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DEFAULT_MAX_DISKS);
	__type(key, __u32);
	__type(value, struct disk_slot);
} disk_queues SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RQ_SLOTS);
	__type(key, __u32);
	__type(value, struct rq_slot);
} inflight SEC(".maps");

/* Processes that are VMs: tgid -> VM slot. The agent adds the ones
 * running when it starts; exec of a new one adds itself (below). The agent
 * also adds, under the VM's slot, an engine process that serves the VM's
 * disks from outside QEMU (vhost-user): its requests are the VM's. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} vm_pids SEC(".maps");

/* VM slot -> what happened to its requests besides completing: the guest
 * requests that never became host requests of their own because they were
 * merged, by QEMU or by the host block layer, and how many it started.
 * (Those whose completion never reached us are in vm_undelivered.) */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct vm_counts);
} vm_counts SEC(".maps");

/* Backing files of VMs' virtual disks -> virtual disk slot. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct file_key);
	__type(value, __u32);
} vdisk_files SEC(".maps");

/* Requests VMs submitted, per (VM, host disk, op, virtual disk). Per-CPU
 * entries under the same busy flag as blk_latency; nested updates go,
 * atomically, to the shared vm_latency_nested. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 128);
	__type(key, struct vm_key);
	__type(value, struct blk_stats);
} vm_latency SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 128);
	__type(key, struct vm_key);
	__type(value, struct blk_stats);
} vm_latency_nested SEC(".maps");

/* A VM's requests whose completion never reached us, per (VM, host disk,
 * op, virtual disk): the requests its entry counts beside the timed ones.
 * The agent adds those still open when their VM has exited. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 128);
	__type(key, struct vm_key);
	__type(value, __u64);
} vm_undelivered SEC(".maps");

/* (VM, host disk) -> the VM's virtual disk there, or VDISK_SEVERAL. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct vm_dev_key);
	__type(value, __u32);
} vm_disks SEC(".maps");

struct fd_key {
	__u32 tgid;
	__u32 fd;
};

/* A VM's eventfds with a kick written by a vCPU thread and not yet read:
 * the eventfd's open file -> time of the first such write. Keyed by the
 * file, not (process, fd): the engine reading the kick may be another
 * process holding the same eventfd (qemu-storage-daemon, an SPDK target,
 * served over vhost-user). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u64);
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

/* VMs whose guest runs: tgid -> VM_RUNNING, set at the first eventfd write
 * of a vCPU thread, a KVM notify, or a queue notifier made (and by the
 * agent for VMs running when it starts). Before that the process only
 * opens its images and realizes its devices (format, alignment and
 * geometry probes); after QEMU closes its queue notifiers (the VM stopped
 * or shut down, or the guest reset the device) it may probe or close its
 * images: such requests are QEMU's own, not any virtual disk's. */
#define VM_RUNNING 1
#define VM_STOPPED 2

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
} vm_started SEC(".maps");

/* The queue notifiers of VMs started while iospan runs: (tgid, fd) of each
 * eventfd a vCPU thread created or any thread created once the guest ran.
 * QEMU makes its loop notifiers (main loop, iothreads) before the guest
 * runs; a queue's host notifier when the guest driver starts the device
 * (virtio-blk, in the vCPU thread) or sets up doorbell buffers (NVMe with
 * ioeventfd=on, in the engine). A vCPU also writes the
 * loop notifiers (timer changes wake the main loop): counted as kicks,
 * they would hand a request held in the engine a later notification. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct fd_key);
	__type(value, __u8);
} vq_notifiers SEC(".maps");

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

/* The last kick each engine thread picked up: tid -> {kick, pickup}. The
 * requests that thread submits next belong to that notification. */
struct pick {
	__u64 kick_ns;
	__u64 pick_ns;
	__u64 flags; /* PICK_* */
};

#define PICK_HANDED (1 << 0) /* handed to a worker it woke (aio=threads) */
#define PICK_USED (1 << 1)   /* a worker submitted with it */

/* Each VM's latest pickup: a worker that goes on to its next request
 * without sleeping (no hand-off) takes this one. It may be later than the
 * notification that queued the request (the queueing then shows as
 * hypervisor time); the worker's previous one would be earlier than the
 * request's kick, making its window outgrow what the guest saw. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct pick);
} vm_last_pick SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct pick);
} thread_picks SEC(".maps");

/* The eventfds QEMU hands the kernel's vhost as a queue's kick
 * (VHOST_SET_VRING_KICK): open file -> 1. A kick on one reaches the worker
 * inside the kernel (eventfd wake-up -> vhost_task), with no read. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u8);
} vhost_kick_files SEC(".maps");

/* VMs with a vhost kick not yet picked up: tgid -> time of the first. The
 * pickup is the VM's vhost worker being switched in. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} vhost_kicks SEC(".maps");

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

/* A kick on `file`: pending for the engine reading it, or, on a vhost
 * kick eventfd, for the VM's vhost worker. */
static __always_inline void note_kick(__u32 tgid, __u64 file)
{
	__u64 now = bpf_ktime_get_ns();

	if (bpf_map_lookup_elem(&vhost_kick_files, &file))
		bpf_map_update_elem(&vhost_kicks, &tgid, &now, BPF_NOEXIST);
	else
		bpf_map_update_elem(&pending_kicks, &file, &now, BPF_NOEXIST);
}

/* Source of a zeroed blk_stats for new vm_latency entries (too big for the
 * stack). */
const struct blk_stats zero_stats = {};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4 << 20);
} events SEC(".maps");

/* What the handlers read from struct request, by either flavour. */
struct rq_fields {
	__u64 key;
	__u64 sector;
	__u64 start_ns;
	__u64 io_start_ns;
	__u32 cmd_flags;
	__u32 data_len;
	__u32 dev;
	int qid;
};

/* A request's identity while in flight, as a scalar (a tp_btf request
 * pointer may not be hashed): queue, hardware context and tag. The
 * scheduler tag is kept across a requeue, the driver tag may not be, so
 * the scheduler tag is used when there is one. Never 0. */
static __always_inline __u64 rq_key(int qid, __u32 hctx, int tag, int internal_tag)
{
	__u32 t = internal_tag >= 0 ? ((__u32)internal_tag | (1 << 20)) : (__u32)tag & 0xfffff;

	return (1ULL << 63) | ((__u64)((__u32)qid & 0xffffff) << 36) |
	       ((__u64)(hctx & 0x7fff) << 21) | t;
}

static __always_inline __u64 rq_key_btf(struct request *rq)
{
	return rq_key(rq->q->id, rq->mq_hctx->queue_num, rq->tag, rq->internal_tag);
}

static __always_inline __u64 rq_key_raw(struct request *rq)
{
	return rq_key(BPF_CORE_READ(rq, q, id), BPF_CORE_READ(rq, mq_hctx, queue_num),
		      BPF_CORE_READ(rq, tag), BPF_CORE_READ(rq, internal_tag));
}

static __always_inline void read_rq_btf(struct request *rq, struct rq_fields *f)
{
	struct request_queue *q = rq->q;

	f->qid = q->id;
	f->dev = rq_dev_btf(rq);
	f->key = rq_key(q->id, rq->mq_hctx->queue_num, rq->tag, rq->internal_tag);
	f->sector = rq->__sector;
	f->start_ns = rq->start_time_ns;
	f->io_start_ns = rq->io_start_time_ns;
	f->cmd_flags = rq->cmd_flags;
	f->data_len = rq->__data_len;
}

static __always_inline void read_rq_raw(struct request *rq, struct rq_fields *f)
{
	f->qid = BPF_CORE_READ(rq, q, id);
	f->dev = rq_dev(rq);
	f->key = rq_key_raw(rq);
	f->sector = BPF_CORE_READ(rq, __sector);
	f->start_ns = BPF_CORE_READ(rq, start_time_ns);
	f->io_start_ns = BPF_CORE_READ(rq, io_start_time_ns);
	f->cmd_flags = BPF_CORE_READ(rq, cmd_flags);
	f->data_len = BPF_CORE_READ(rq, __data_len);
}


/* Two candidate slots per request key (a 2-way set), so two requests
 * rarely evict each other; a miss is counted, never guessed. The second
 * slot is only looked at when the first is not ours. A finished request
 * leaves its key in its slot (RQ_F_DONE): the next I/O on that tag finds it
 * at the first look, and any other key may take it over. */
static __always_inline struct rq_slot *rq_slot_of(__u64 key, int claim)
{
	__u32 idx = (__u32)((key * 0x9E3779B97F4A7C15ULL) >> (64 - RQ_SLOT_BITS));
	struct rq_slot *s, *t;

	s = bpf_map_lookup_elem(&inflight, &idx);
	if (!s)
		return 0;
	if (s->rq == key)
		return s;
	idx ^= 1;
	t = bpf_map_lookup_elem(&inflight, &idx);
	if (!t)
		return 0;
	if (t->rq == key)
		return t;
	if (!claim)
		return 0;
	if (!s->rq || (s->flags & RQ_F_DONE))
		return s;
	if (!t->rq || (t->flags & RQ_F_DONE))
		return t;
	count(CNT_SLOT_CONFLICTS);
	return 0;
}

/* The disk's slot in blk_latency: the queue id picks it (ids are dense and
 * unique among live queues), the first disk to arrive owns it. Another disk
 * on the same slot (more disks than slots, or a queue id reused by a new
 * disk) is counted, not mixed in. */
static __always_inline int disk_slot_of(const struct rq_fields *f)
{
	__u32 idx = (__u32)f->qid % targ_max_disks;
	__u64 owner = (1ULL << 32) | f->dev;
	struct disk_slot *d = bpf_map_lookup_elem(&disk_queues, &idx);

	if (!d)
		return -1;
	if (d->queue == owner)
		return idx;
	if (!d->queue && __sync_val_compare_and_swap(&d->queue, 0, owner) == 0) {
		d->dev = f->dev;
		return idx;
	}
	if (d->queue == owner)
		return idx;
	count(CNT_DISK_CONFLICTS);
	return -1;
}

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

static __always_inline void stream(const struct rq_outcome *o, const struct rq_fields *f,
				   __u8 op, __u64 now)
{
	struct blk_io_event ev = {};

	ev.kind = EVENT_BLK_IO;
	ev.op = op;
	ev.flags = (__u8)o->flags;
	ev.dev = f->dev;
	ev.start_ns = o->start_ns;
	ev.issue_ns = o->issue_ns;
	ev.done_ns = now;
	ev.sector = f->sector;
	ev.bytes = o->bytes;
	ev.requeues = o->requeues;
	ev.cpu_lo = (__u8)bpf_get_smp_processor_id();
	ev.vdisk = o->vdisk;
	ev.vm = o->vm;
	if (!emit(&ev, sizeof(ev)))
		count(CNT_SAMPLED);
}

static __always_inline int stream_wanted(__u32 dev)
{
	int i;

	if (!targ_nr_stream_devs)
		return 1;
	for (i = 0; i < MAX_STREAM_DEVS; i++)
		if (i < targ_nr_stream_devs && targ_stream_devs[i] == dev)
			return 1;
	return 0;
}

#define PLAIN_ADD(dst, v) ((dst) += (v))
#define ATOMIC_ADD(dst, v) __sync_fetch_and_add(&(dst), (v))
#define PLAIN_MAX(dst, v) do { if ((v) > (dst)) (dst) = (v); } while (0)
/* One attempt: losing to a concurrent nested update on another CPU leaves
 * the smaller of two maxima, and both are rare. */
#define ATOMIC_MAX(dst, v) do { __u64 __o = (dst); if ((v) > __o) __sync_val_compare_and_swap(&(dst), __o, (v)); } while (0)

#define DEFINE_ACCOUNT(name, ADD, MAX)						\
static __always_inline void name(struct blk_stats *st, const struct rq_outcome *o,	\
				 const __u64 seg[BLK_NR_SEGS], __u32 nr_bytes,		\
				 int final)						\
{										\
	int i;									\
										\
	ADD(st->bytes, nr_bytes);						\
	if (!final)								\
		return;								\
	ADD(st->ios, 1);							\
	if (o->flags & RQ_F_ERROR)						\
		ADD(st->errors, 1);						\
	if (o->flags & RQ_F_REQUEUED)						\
		ADD(st->requeued, 1);						\
	if (o->flags & RQ_F_PARTIAL)						\
		ADD(st->partial, 1);						\
	for (i = 0; i < BLK_NR_SEGS; i++) {					\
		__u64 v = seg[i];						\
		__u32 b;							\
										\
		if (v == ~0ULL)							\
			continue;						\
		b = hist_bucket(v);						\
		if (b >= HIST_BUCKETS)						\
			b = HIST_BUCKETS - 1;					\
		ADD(st->hist[i][b], 1);						\
		ADD(st->sum_ns[i], v);						\
		MAX(st->max_ns[i], v);						\
	}									\
}

DEFINE_ACCOUNT(account_plain, PLAIN_ADD, PLAIN_MAX)
DEFINE_ACCOUNT(account_atomic, ATOMIC_ADD, ATOMIC_MAX)

/* The entry of a blk_stats table for `key`; in a hash table it is created
 * zeroed when missing (a full table is counted: only the VM tables are
 * hashes, an array entry always exists). */
static __always_inline struct blk_stats *stats_entry(void *map, void *key)
{
	struct blk_stats *st = lookup_or_init(map, key, &zero_stats);

	if (!st)
		count(CNT_VM_TABLE_FULL);
	return st;
}

/* Updates `map`'s per-CPU entry for `key`, or, when this CPU is already in
 * the middle of updating it (a nested run), `nested`'s shared entry,
 * atomically. Nesting is strictly LIFO on a CPU: a nested run either
 * finishes before we set busy, or sees it set. The barriers keep the
 * compiler from moving the updates outside the busy window. */
static __always_inline void account(void *map, void *nested, void *key, const struct rq_outcome *o,
				    const __u64 seg[BLK_NR_SEGS], __u32 nr_bytes, int final)
{
	struct blk_stats *st = stats_entry(map, key);

	if (!st)
		return;
	if (st->busy) {
		st = stats_entry(nested, key);
		if (st)
			account_atomic(st, o, seg, nr_bytes, final);
		return;
	}
	st->busy = 1;
	asm volatile("" ::: "memory");
	account_plain(st, o, seg, nr_bytes, final);
	asm volatile("" ::: "memory");
	st->busy = 0;
}

/* vCPU threads are named "CPU <n>/KVM" or "CPU <n>/TCG" (debug-threads=on,
 * as libvirt runs QEMU). */
static __always_inline int in_vcpu(void)
{
	char c[16];

	bpf_get_current_comm(c, sizeof(c));
	return c[0] == 'C' && c[1] == 'P' && c[2] == 'U' && c[3] == ' ';
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

/* The virtual disk a VM's direct-I/O request is for. Where the VM has one
 * virtual disk on this host disk, a direct-I/O bio of its process is that
 * disk's; only where several share it is the file or device read (see
 * enum dio_kind). Buffered I/O (cache=writeback, QEMU's own files) is not
 * resolved here (0), except from a vhost worker. `pos` is the request's
 * offset in the virtual disk's backing (the guest's offset on a raw
 * image), where known. */
static __always_inline __u32 vdisk_of(struct request *rq, __u32 vm, __u32 dev, __u64 *pos)
{
	struct bio *bio = BPF_CORE_READ(rq, bio);
	struct vm_dev_key vk = { .vm = vm, .dev = dev };
	struct iomap_dio *dio_priv;
	struct block_device *bdev;
	struct kiocb *iocb;
	struct inode *inode;
	struct file_key k = {};
	__u64 end_io;
	__u32 *slot;
	int i, kind = -1;

	if (!bio)
		return 0;
	end_io = (__u64)BPF_CORE_READ(bio, bi_end_io);
	for (i = 0; i < NR_DIO_END_IO; i++)
		if (targ_dio_end_io[i] && end_io == targ_dio_end_io[i]) {
			kind = i;
			break;
		}
	if (kind < 0 && !in_vhost_worker())
		return 0;
	slot = bpf_map_lookup_elem(&vm_disks, &vk);
	if (!slot)
		return 0;
	/* A vhost worker serves only its VM's vhost disks, and submits their
	 * bios itself (LIO's block and file backstores: no kiocb to read): on
	 * a host disk holding one of them, the request is that disk's. A dm
	 * clone's offset is the physical disk's, not the virtual disk's. */
	if (kind < 0 || kind == DIO_DM_CLONE)
		return *slot != VDISK_SEVERAL ? *slot : 0;
	if (kind != DIO_IOMAP) {
		/* Kernels before 5.12 name the disk, not the bdev: no offset,
		 * and the device only where the VM has one disk on it. */
		if (!bpf_core_field_exists(bio->bi_bdev))
			return *slot != VDISK_SEVERAL ? *slot : 0;
		bdev = BPF_CORE_READ(bio, bi_bdev);
		*pos = (BPF_CORE_READ(bio, bi_iter.bi_sector) - BPF_CORE_READ(bdev, bd_start_sect)) << 9;
		if (*slot != VDISK_SEVERAL)
			return *slot;
		k.dev = VDISK_FILE_BDEV;
		k.ino = BPF_CORE_READ(bdev, bd_dev);
		slot = bpf_map_lookup_elem(&vdisk_files, &k);
		return slot ? *slot : 0;
	}
	/* The iomap_dio begins with the kiocb. Its position is the direct
	 * I/O's start until it completes: the guest's offset on a raw image,
	 * which joins guest and host records. */
	dio_priv = BPF_CORE_READ(bio, bi_private);
	iocb = BPF_CORE_READ(dio_priv, iocb);
	if (!iocb)
		return 0;
	*pos = BPF_CORE_READ(iocb, ki_pos);
	if (*slot != VDISK_SEVERAL)
		return *slot;
	inode = BPF_CORE_READ(iocb, ki_filp, f_inode);
	k.ino = BPF_CORE_READ(inode, i_ino);
	k.dev = BPF_CORE_READ(inode, i_sb, s_dev);
	slot = bpf_map_lookup_elem(&vdisk_files, &k);
	return slot ? *slot : 0;
}

static __always_inline struct vm_counts *vm_counts_of(__u32 vm)
{
	static const struct vm_counts zero;

	return lookup_or_init(&vm_counts, &vm, &zero);
}

/* Counted globally, and per VM entry where the lost request was a VM's
 * (the VM's own total is its entries' sum). */
static __always_inline void note_undelivered(const struct rq_slot *s)
{
	static const __u64 zero;
	struct vm_key k = { .vm = s->vm, .dev = s->dev, .op = s->op, .vdisk = s->vdisk };
	__u64 *n;

	count(CNT_UNDELIVERED);
	if (!s->vm)
		return;
	n = lookup_or_init(&vm_undelivered, &k, &zero);
	if (n)
		__sync_fetch_and_add(n, 1);
}

/* `btf`: a constant per inlined call site, choosing direct or probe reads.
 * Most requests return before any read of the request: the kernel keeps
 * their start time and no VM submitted them. */
static __always_inline void on_start(struct request *rq, __u64 kstart_ns, int btf)
{
	struct rq_slot *s;
	__u32 vm = 0, vdisk = 0, dev = 0, op = 0;
	__u64 key, kick_ns = 0, pick_ns = 0, pos = 0;

	if (targ_track_vms) {
		__u64 pid_tgid = bpf_get_current_pid_tgid();
		__u32 tgid = pid_tgid >> 32, tid = (__u32)pid_tgid;
		__u32 *v = bpf_map_lookup_elem(&vm_pids, &tgid);

		/* Only a VM's requests need their submitter remembered. */
		if (v) {
			vm = *v;
			__u8 *state = bpf_map_lookup_elem(&vm_started, &tgid);

			dev = btf ? rq_dev_btf(rq) : rq_dev(rq);
			op = op_class(btf ? rq->cmd_flags : BPF_CORE_READ(rq, cmd_flags));
			if (state && *state == VM_RUNNING)
				vdisk = vdisk_of(rq, vm, dev, &pos);
			if (targ_vm_segments) {
				struct pick *p;

				if (in_vhost_worker())
					claim_vhost_kick(tgid, tid);
				p = bpf_map_lookup_elem(&thread_picks, &tid);

				if (p && (p->flags & PICK_USED))
					p = bpf_map_lookup_elem(&vm_last_pick, &tgid);
				else if (p && (p->flags & PICK_HANDED))
					p->flags |= PICK_USED;
				if (p) {
					kick_ns = p->kick_ns;
					pick_ns = p->pick_ns;
				}
			}
		}
	}
	if (kstart_ns && !vm)
		return;
	key = btf ? rq_key_btf(rq) : rq_key_raw(rq);
	s = rq_slot_of(key, 1);
	if (!s)
		return;
	if (rq_undelivered(s, key))
		note_undelivered(s);
	if (vm) {
		struct vm_counts *c = vm_counts_of(vm);

		if (c)
			__sync_fetch_and_add(&c->submitted, 1);
	}
	rq_on_start(s, key, kstart_ns ? 0 : bpf_ktime_get_ns(), vm, vdisk, kick_ns, pick_ns, pos,
		    dev, op);
}

static __always_inline void on_issue(__u64 key)
{
	struct rq_slot *s = rq_slot_of(key, 1);

	/* An issued, unfinished request here may be dispatched again (not
	 * lost): only a new request's start tells a lost completion. */
	if (!s)
		return;
	rq_on_issue(s, key, bpf_ktime_get_ns());
}

static __always_inline void on_requeue(__u64 key)
{
	struct rq_slot *s = rq_slot_of(key, 0);

	count(CNT_REQUEUES);
	if (s)
		rq_on_requeue(s, key);
}

/* A VM's finished request, for the agent to split its host window. */
static __always_inline void stream_vm_io(const struct rq_outcome *o, const struct rq_fields *f,
					 __u8 op, __u64 now)
{
	struct vm_io_event ev = {};

	ev.kind = EVENT_VM_IO;
	ev.op = op;
	ev.flags = (__u8)o->flags;
	ev.dev = f->dev;
	ev.kick_ns = o->kick_ns;
	ev.pick_ns = o->pick_ns;
	ev.start_ns = o->start_ns;
	ev.issue_ns = o->issue_ns;
	ev.done_ns = now;
	ev.bytes = o->bytes;
	ev.vm = o->vm;
	ev.vdisk = o->vdisk;
	ev.pos = o->pos;
	emit(&ev, sizeof(ev));
}

/* A VM's request: also into vm_latency, with its whole byte count (partial
 * pieces were carried in the slot). */
static __always_inline void account_vm(const struct rq_outcome *o, const struct rq_fields *f,
				       __u8 op, const __u64 seg[BLK_NR_SEGS])
{
	struct vm_key k = { .vm = o->vm, .dev = f->dev, .op = op, .vdisk = o->vdisk };

	account(&vm_latency, &vm_latency_nested, &k, o, seg, o->bytes, 1);
}

static __always_inline void on_complete(const struct rq_fields *f,
					int error, __u32 nr_bytes)
{
	struct rq_completion c = {
		.rq = f->key,
		.kstart_ns = f->start_ns,
		.kissue_ns = f->io_start_ns,
		.now_ns = bpf_ktime_get_ns(),
		.remaining = f->data_len,
		.nr_bytes = nr_bytes,
	};
	struct rq_outcome o = {};
	__u64 seg[BLK_NR_SEGS] = {};
	__u8 op = op_class(f->cmd_flags);
	__u32 key;
	int disk, final;

	disk = disk_slot_of(f);
	final = rq_on_complete(rq_slot_of(f->key, 0), &c, &o);
	if (!final) {
		count(CNT_PARTIAL_PIECES);
	} else {
		if (error)
			o.flags |= RQ_F_ERROR;
		if (o.flags & RQ_F_NO_START)
			count(CNT_NO_START);
		if (o.flags & RQ_F_NO_ISSUE)
			count(CNT_NO_ISSUE);
		rq_segments(&o, c.now_ns, seg);
	}
	if (disk < 0)
		return;
	key = (__u32)disk * BLK_NR_OPS + op;
	account(&blk_latency, &blk_latency_nested, &key, &o, seg, nr_bytes, final);
	if (final && o.vm) {
		account_vm(&o, f, op, seg);
		/* Only a virtual disk's requests have a host window to split. */
		if (targ_vm_segments && o.vdisk)
			stream_vm_io(&o, f, op, c.now_ns);
	}

	if (final && ((targ_sample_every && bpf_get_prandom_u32() % targ_sample_every == 0) ||
		      (targ_slower_than_ns && seg[BLK_SEG_TOTAL] != ~0ULL &&
		       seg[BLK_SEG_TOTAL] >= targ_slower_than_ns)) &&
	    stream_wanted(f->dev))
		stream(&o, f, op, c.now_ns);
}

SEC("tp_btf/block_io_start")
int BPF_PROG(block_io_start_btf, struct request *rq)
{
	on_start(rq, rq->start_time_ns, 1);
	return 0;
}

SEC("raw_tp/block_io_start")
int BPF_PROG(block_io_start, struct request *rq)
{
	on_start(rq, BPF_CORE_READ(rq, start_time_ns), 0);
	return 0;
}

/* Start stamp for kernels before block_io_start (v6.5, 5a80bd075f3b). */
SEC("tp_btf/block_rq_insert")
int BPF_PROG(block_rq_insert_btf, struct request *rq)
{
	on_start(rq, rq->start_time_ns, 1);
	return 0;
}

SEC("raw_tp/block_rq_insert")
int BPF_PROG(block_rq_insert, struct request *rq)
{
	on_start(rq, BPF_CORE_READ(rq, start_time_ns), 0);
	return 0;
}

SEC("tp_btf/block_rq_issue")
int BPF_PROG(block_rq_issue_btf, struct request *rq)
{
	on_issue(rq_key_btf(rq));
	return 0;
}

SEC("raw_tp/block_rq_issue")
int BPF_PROG(block_rq_issue, struct request *rq)
{
	on_issue(rq_key_raw(rq));
	return 0;
}

SEC("tp_btf/block_rq_requeue")
int BPF_PROG(block_rq_requeue_btf, struct request *rq)
{
	on_requeue(rq_key_btf(rq));
	return 0;
}

SEC("raw_tp/block_rq_requeue")
int BPF_PROG(block_rq_requeue, struct request *rq)
{
	on_requeue(rq_key_raw(rq));
	return 0;
}

SEC("tp_btf/block_rq_complete")
int BPF_PROG(block_rq_complete_btf, struct request *rq, int error, unsigned int nr_bytes)
{
	struct rq_fields f;

	read_rq_btf(rq, &f);
	on_complete(&f, error, nr_bytes);
	return 0;
}

SEC("raw_tp/block_rq_complete")
int BPF_PROG(block_rq_complete, struct request *rq, int error, unsigned int nr_bytes)
{
	struct rq_fields f;

	read_rq_raw(rq, &f);
	on_complete(&f, error, nr_bytes);
	return 0;
}

/* A started request merged into another before issue (the scheduler's
 * request merges): it ends here, inside the other. A guest's request on
 * a virtual disk counts as merged by the host block layer. */
static __always_inline void on_rq_merge(__u64 key)
{
	struct rq_slot *s = rq_slot_of(key, 0);
	struct vm_counts *c;

	if (!s || !rq_on_merge(s, key))
		return;
	if (s->vm && s->vdisk && (c = vm_counts_of(s->vm)))
		__sync_fetch_and_add(&c->bio_merges, 1);
}

SEC("tp_btf/block_rq_merge")
int BPF_PROG(block_rq_merge_btf, struct request *rq)
{
	on_rq_merge(rq_key_btf(rq));
	return 0;
}

SEC("raw_tp/block_rq_merge")
int BPF_PROG(block_rq_merge, struct request *rq)
{
	on_rq_merge(rq_key_raw(rq));
	return 0;
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
static __always_inline void note_kicked(const struct fd_key *k, __u8 *kicked)
{
	__s64 *open, first = 1;

	if (*kicked)
		return;
	*kicked = 1;
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

	if (!vm_of_eventfd_io(ctx, 1) || !in_vcpu())
		return 0;
	k.tgid = bpf_get_current_pid_tgid() >> 32;
	k.fd = (__u32)ctx->args[0];
	if (!bpf_map_lookup_elem(&vm_started, &k.tgid)) {
		__u8 one = 1;

		bpf_map_update_elem(&vm_started, &k.tgid, &one, BPF_ANY);
	}
	if (bpf_map_lookup_elem(&vm_notifiers_known, &k.tgid)) {
		__u8 *kicked = bpf_map_lookup_elem(&vq_notifiers, &k);

		if (!kicked)
			return 0;
		note_kicked(&k, kicked);
	}
	file = fd_file(k.fd);
	if (file)
		note_kick(k.tgid, file);
	return 0;
}

/* An eventfd made by a vCPU, or once the guest ran: a queue notifier
 * (see vq_notifiers). Rare, so attached whenever VMs are tracked. */
static __always_inline void on_eventfd_created(long fd)
{
	struct fd_key k;
	__u8 one = 1, zero = 0;

	if (!targ_vm_segments || fd < 0)
		return;
	k.tgid = bpf_get_current_pid_tgid() >> 32;
	if (!bpf_map_lookup_elem(&vm_pids, &k.tgid) || (!in_vcpu() && !bpf_map_lookup_elem(&vm_started, &k.tgid)))
		return;
	k.fd = (__u32)fd;
	/* Not kicked yet (0); an fd number reused for a new eventfd starts
	 * over, its predecessor having been closed. */
	bpf_map_update_elem(&vq_notifiers, &k, &zero, BPF_ANY);
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
	__u8 stopped = VM_STOPPED, *kicked, was_kicked;
	__s64 *open;
	__u64 file;

	if (!targ_vm_segments)
		return 0;
	k.tgid = bpf_get_current_pid_tgid() >> 32;
	k.fd = (__u32)ctx->args[0];
	kicked = bpf_map_lookup_elem(&vq_notifiers, &k);
	if (!kicked)
		return 0;
	was_kicked = *kicked;
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
#define KVM_IOEVENTFD_DEASSIGN (1 << 2)
#define KVM_TRACE_MMIO_WRITE 2

SEC("tracepoint/syscalls/sys_enter_ioctl")
int sys_enter_ioctl(struct trace_event_raw_sys_enter *ctx)
{
	struct ioeventfd_arg io;
	struct gpa_key k = {};
	struct fd_key f;
	__u8 zero = 0;

	if (((__u32)ctx->args[1] != KVM_IOEVENTFD_CMD && (__u32)ctx->args[1] != VHOST_SET_VRING_KICK_CMD) ||
	    !targ_vm_segments)
		return 0;
	k.tgid = bpf_get_current_pid_tgid() >> 32;
	if (!bpf_map_lookup_elem(&vm_pids, &k.tgid))
		return 0;
	if ((__u32)ctx->args[1] == VHOST_SET_VRING_KICK_CMD) {
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
	if (bpf_probe_read_user(&io, sizeof(io), (void *)ctx->args[2]))
		return 0;
	k.gpa = io.addr;
	if (io.flags & KVM_IOEVENTFD_DEASSIGN) {
		bpf_map_delete_elem(&kvm_notify_addrs, &k);
		return 0;
	}
	f.tgid = k.tgid;
	f.fd = (__u32)io.fd;
	bpf_map_update_elem(&kvm_notify_addrs, &k, &f.fd, BPF_ANY);
	/* Not kicked yet; a second address on the same eventfd keeps its state. */
	bpf_map_update_elem(&vq_notifiers, &f, &zero, BPF_NOEXIST);
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
	__u32 *fd;
	__u64 file;
	__u8 one = 1, *kicked;

	k.tgid = bpf_get_current_pid_tgid() >> 32;
	fd = bpf_map_lookup_elem(&kvm_notify_addrs, &k);
	if (!fd)
		return;
	if (!bpf_map_lookup_elem(&vm_started, &k.tgid))
		bpf_map_update_elem(&vm_started, &k.tgid, &one, BPF_ANY);
	f.tgid = k.tgid;
	f.fd = *fd;
	kicked = bpf_map_lookup_elem(&vq_notifiers, &f);
	if (kicked)
		note_kicked(&f, kicked);
	/* In the vCPU's exit: the current process is the VM's. */
	file = fd_file(f.fd);
	if (file)
		note_kick(k.tgid, file);
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

/* The engine making a completion visible to the guest, one record per hit:
 * virtio's used-ring push (virtqueue_flush, once per request: the guest may
 * reap it by polling the ring, without an interrupt, when QEMU suppresses
 * it under EVENT_IDX) or, for NVMe, QEMU raising the interrupt after
 * posting the completion (msix_notify). Attached per VM process, on a push
 * instruction (emulated, not single-stepped). */
static __always_inline int on_signal(void)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	__u32 *vm;
	struct vm_signal_event ev = { .kind = EVENT_VM_SIGNAL };

	if (!targ_vm_segments)
		return 0;
	vm = bpf_map_lookup_elem(&vm_pids, &tgid);
	if (!vm)
		return 0;
	ev.vm = *vm;
	ev.ts_ns = bpf_ktime_get_ns();
	emit(&ev, sizeof(ev));
	return 0;
}

SEC("uprobe")
int virtqueue_flush(void *ctx)
{
	return on_signal();
}

SEC("uprobe")
int msix_notify(void *ctx)
{
	return on_signal();
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

/* libvhost-user's used-ring push (fill, then flush), in an engine serving
 * the VM's disk over vhost-user (qemu-storage-daemon): once per request,
 * as virtqueue_flush in QEMU, and entered with a push where the flush is
 * not. The engine process is registered under the VM's slot. */
SEC("uprobe")
int vu_queue_push(void *ctx)
{
	return on_signal();
}

/* Guest requests that never become host requests of their own: merged
 * into a neighbour's by QEMU (virtio-blk merges adjacent requests of one
 * batch and accounts them with block_acct_merge_done(stats, type, n), a
 * call made only when it merges) or, bio into request, by the host block
 * layer in the VM's submitting thread. Both are rare under random I/O and
 * the rule under sequential I/O: without them a VM's request count would
 * fall short of its guest's. */
static __always_inline void note_merges(__u64 n, int engine)
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
	c = vm_counts_of(*vm);
	if (!c)
		return;
	if (engine)
		__sync_fetch_and_add(&c->engine_merges, n);
	else
		__sync_fetch_and_add(&c->bio_merges, n);
}

SEC("uprobe")
int BPF_KPROBE(block_acct_merge_done, void *stats, int type, int num_merged)
{
	if (num_merged > 0)
		note_merges(num_merged, 1);
	return 0;
}

SEC("tracepoint/block/block_bio_backmerge")
int block_bio_backmerge(void *ctx)
{
	note_merges(1, 0);
	return 0;
}

SEC("tracepoint/block/block_bio_frontmerge")
int block_bio_frontmerge(void *ctx)
{
	note_merges(1, 0);
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
	struct pick p;
	__u64 *kick, file;
	__u32 tid = (__u32)pid_tgid;

	if (!vm_of_eventfd_io(ctx, 0) || in_vcpu())
		return 0;
	file = fd_file(k.fd);
	if (!file)
		return 0;
	kick = bpf_map_lookup_elem(&pending_kicks, &file);
	if (!kick)
		return 0;
	p.kick_ns = *kick;
	p.pick_ns = bpf_ktime_get_ns();
	p.flags = 0;
	bpf_map_delete_elem(&pending_kicks, &file);
	bpf_map_update_elem(&thread_picks, &tid, &p, BPF_ANY);
	bpf_map_update_elem(&vm_last_pick, &k.tgid, &p, BPF_ANY);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
