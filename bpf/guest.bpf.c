// SPDX-License-Identifier: GPL-2.0
/*
 * Guest side: each request's own ends, on the guest's clock. Block layer
 * start/issue/complete from tracepoints; the driver's kick to the device
 * and its sight of the completion from kprobes on the guest kernel
 * (virtqueue_notify, blk_mq_complete_request) or NVMe's tracepoints. The
 * application's ends: the system call that submitted the I/O (followed
 * through stacked devices such as device mapper, which may submit it later
 * from a worker) and the one that handed its completion back. The host
 * joins these records to its own by disk offset and time.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "agent_abi.h"
#include "blk_op.bpf.h"
#include "maps.bpf.h"

/* Where an I/O came from: the system call that submitted it. */
struct origin {
	__u64 sys_ns;
	__u32 tgid;
	__u32 tid;
	__u32 flags; /* GUEST_F_SYSCALL | GUEST_F_SYNC | GUEST_F_STACKED */
	__u32 _pad;
};

/* Requests between issue and completion: request pointer -> stamps. */
struct guest_slot {
	__u64 start_ns;
	__u64 issue_ns;
	__u64 kick_ns;
	__u64 irq_ns;
	__u32 flags;
	__u32 _pad;
	struct origin from;
};

/* The I/O system call a thread is in: entry time and kind (enum io_call). */
struct io_syscall {
	__u64 entry_ns;
	__u32 call;
	__u32 _pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct io_syscall);
} io_syscalls SEC(".maps");

/* A bio on its way down a stack of devices: where it is now. */
struct bio_key {
	__u64 sector;
	__u32 dev;
	__u32 _pad;
};

/* Origins of bios submitted to a stacked (bio-based) device, moved along
 * with each remap until a request of a real disk takes them. LRU: a bio
 * that never reaches one (an error, a discard the target drops) must not
 * hold its entry forever. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, struct bio_key);
	__type(value, struct origin);
} bio_origins SEC(".maps");

/* Set once a bio's origin was kept: until then requests do not look in
 * bio_origins. */
static volatile __u32 origins_kept;

/* Threads (synchronous calls) and processes (1 << 32 | tgid: io_getevents,
 * io_uring_enter) with a request completed since their last reaping call
 * returned. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u8);
} reap_waiting SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct guest_slot);
} guest_inflight SEC(".maps");

/* Requests issued on this CPU and not yet followed by a kick: a driver
 * issues a batch, then notifies the device once, on the same CPU. */
#define UNKICKED_MAX 32
struct unkicked {
	__u32 n;
	__u32 _pad;
	__u64 rq[UNKICKED_MAX];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct unkicked);
} guest_unkicked SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22);
} guest_events SEC(".maps");

/* x86_64 system calls that submit block I/O or hand completions back:
 * synchronous ones do both for their own thread; io_submit only submits,
 * io_getevents only reaps (for the process), io_uring_enter does both. */
enum io_call {
	IO_CALL_NONE,
	IO_CALL_SYNC,
	IO_CALL_SUBMIT,
	IO_CALL_REAP,
	IO_CALL_ASYNC
};

static __always_inline enum io_call io_call_of(long nr)
{
	switch (nr) {
	case 0:	  /* read */
	case 1:	  /* write */
	case 17:  /* pread64 */
	case 18:  /* pwrite64 */
	case 19:  /* readv */
	case 20:  /* writev */
	case 74:  /* fsync */
	case 75:  /* fdatasync */
	case 295: /* preadv */
	case 296: /* pwritev */
	case 327: /* preadv2 */
	case 328: /* pwritev2 */
		return IO_CALL_SYNC;
	case 209: /* io_submit */
		return IO_CALL_SUBMIT;
	case 208: /* io_getevents */
	case 333: /* io_pgetevents */
		return IO_CALL_REAP;
	case 426: /* io_uring_enter */
		return IO_CALL_ASYNC;
	}
	return IO_CALL_NONE;
}

static __always_inline __u32 disk_dev(struct gendisk *disk)
{
	return disk ? (__u32)disk->major << 20 | (__u32)disk->first_minor : 0;
}

/* The origin of the current thread's I/O, when it is in an I/O call. */
static __always_inline int current_origin(struct origin *o)
{
	struct io_syscall *sc;
	__u64 id;

	sc = bpf_task_storage_get(&io_syscalls, bpf_get_current_task_btf(), 0, 0);
	if (!sc || !sc->entry_ns || sc->call == IO_CALL_REAP)
		return 0;
	id = bpf_get_current_pid_tgid();
	o->sys_ns = sc->entry_ns;
	o->tgid = id >> 32;
	o->tid = (__u32)id;
	o->flags = GUEST_F_SYSCALL | (sc->call == IO_CALL_SYNC ? GUEST_F_SYNC : 0);
	return 1;
}

/* reap_waiting's key: the thread for a synchronous call, else the process. */
static __always_inline __u64 waiter_key(int sync, __u32 tid, __u32 tgid)
{
	return sync ? tid : (1ULL << 32) | tgid;
}

SEC("tp_btf/sys_enter")
int BPF_PROG(sys_enter, struct pt_regs *regs, long nr)
{
	enum io_call call = io_call_of(nr);
	struct io_syscall *sc;

	if (call == IO_CALL_NONE)
		return 0;
	sc = bpf_task_storage_get(&io_syscalls, bpf_get_current_task_btf(), 0,
				  BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (sc) {
		sc->entry_ns = bpf_ktime_get_ns();
		sc->call = call;
	}
	return 0;
}

/* Leaving an I/O call: no longer the origin of what the thread submits,
 * and, if a request it (or, for the asynchronous calls, its process) is
 * waiting for completed meanwhile, the moment the application got it. */
SEC("tp_btf/sys_exit")
int BPF_PROG(sys_exit, struct pt_regs *regs, long ret)
{
	struct io_syscall *sc;
	struct guest_reap_event *ev;
	enum io_call call;
	__u64 id, key;
	int sync;

	sc = bpf_task_storage_get(&io_syscalls, bpf_get_current_task_btf(), 0, 0);
	if (!sc || !sc->entry_ns)
		return 0;
	sc->entry_ns = 0;
	call = sc->call;
	if (call == IO_CALL_SUBMIT)
		return 0;
	id = bpf_get_current_pid_tgid();
	sync = call == IO_CALL_SYNC;
	key = waiter_key(sync, (__u32)id, id >> 32);
	/* Looked up first: most calls find nothing, and a lookup takes no
	 * lock where a delete takes the bucket's. */
	if (!bpf_map_lookup_elem(&reap_waiting, &key))
		return 0;
	bpf_map_delete_elem(&reap_waiting, &key);
	ev = bpf_ringbuf_reserve(&guest_events, sizeof(*ev), 0);
	if (!ev) {
		count(CNT_GUEST_RING_LOST);
		return 0;
	}
	ev->kind = EVENT_GUEST_REAP;
	ev->flags = sync ? GUEST_REAP_SYNC : 0;
	ev->_pad = 0;
	ev->id = sync ? (__u32)id : id >> 32;
	ev->ts_ns = bpf_ktime_get_ns();
	bpf_ringbuf_submit(ev, BPF_RB_NO_WAKEUP);
	return 0;
}

/* A bio entering, from an I/O call, a device whose requests may be issued
 * later from another context keeps that call as its origin: a stacked
 * device (device mapper, md: no request queue of their own, and a target
 * may pass the bio on from a worker, as dm-delay does) or a queue with an
 * I/O scheduler (requests dispatched by kblockd). Without a scheduler the
 * request is issued by the submitting thread, which the issue reads. */
SEC("tp_btf/block_bio_queue")
int BPF_PROG(block_bio_queue, struct bio *bio)
{
	struct gendisk *disk = bio->bi_bdev->bd_disk;
	struct bio_key k = {};
	struct origin o;
	int stacked;

	if (!disk)
		return 0;
	stacked = !disk->queue->mq_ops;
	if ((!stacked && !disk->queue->elevator) || !current_origin(&o))
		return 0;
	k.dev = disk_dev(disk);
	k.sector = bio->bi_iter.bi_sector;
	if (stacked)
		o.flags |= GUEST_F_STACKED;
	bpf_map_update_elem(&bio_origins, &k, &o, BPF_ANY);
	origins_kept = 1;
	return 0;
}

/* A stacked device sending a bio on to the device below. */
SEC("tp_btf/block_bio_remap")
int BPF_PROG(block_bio_remap, struct bio *bio, dev_t dev, sector_t from)
{
	struct bio_key old = { .sector = from, .dev = dev }, k = {};
	struct origin *o, copy;

	if (!origins_kept)
		return 0;
	o = bpf_map_lookup_elem(&bio_origins, &old);
	if (!o)
		return 0;
	copy = *o;
	bpf_map_delete_elem(&bio_origins, &old);
	k.dev = disk_dev(bio->bi_bdev->bd_disk);
	k.sector = bio->bi_iter.bi_sector;
	bpf_map_update_elem(&bio_origins, &k, &copy, BPF_ANY);
	return 0;
}

/* Where a request came from: its bio's kept origin, or the call the
 * issuing thread is in, if that began before the request did (a thread
 * that issues requests others queued is not their origin). */
static __always_inline void origin_of(struct request *rq, struct origin *o)
{
	if (origins_kept) {
		struct bio_key k = { .sector = rq->__sector, .dev = disk_dev(rq->q->disk) };
		struct origin *from = bpf_map_lookup_elem(&bio_origins, &k);

		if (from) {
			*o = *from;
			bpf_map_delete_elem(&bio_origins, &k);
			return;
		}
	}
	if (current_origin(o) && o->sys_ns > rq->start_time_ns)
		__builtin_memset(o, 0, sizeof(*o));
}

SEC("tp_btf/block_rq_issue")
int BPF_PROG(block_rq_issue, struct request *rq)
{
	struct guest_slot s = {}, *old;
	__u64 key = (__u64)rq;
	__u32 zero = 0;
	struct unkicked *u;

	/* NVMe builds its command (our kick stamp) before it starts the
	 * request: keep that stamp. */
	old = bpf_map_lookup_elem(&guest_inflight, &key);
	if (old && (old->flags & GUEST_F_NVME) && !old->issue_ns) {
		old->issue_ns = bpf_ktime_get_ns();
		old->start_ns = rq->start_time_ns;
		origin_of(rq, &old->from);
		return 0;
	}
	s.issue_ns = bpf_ktime_get_ns();
	s.start_ns = rq->start_time_ns;
	origin_of(rq, &s.from);
	if (bpf_map_update_elem(&guest_inflight, &key, &s, BPF_ANY)) {
		count(CNT_GUEST_INFLIGHT_FULL);
		return 0;
	}
	u = bpf_map_lookup_elem(&guest_unkicked, &zero);
	if (u && u->n < UNKICKED_MAX) {
		u->rq[u->n & (UNKICKED_MAX - 1)] = key;
		u->n++;
	}
	return 0;
}

/* The driver notifying the device: every request issued on this CPU since
 * the last notification goes with it. */
SEC("kprobe/virtqueue_notify")
int BPF_KPROBE(virtqueue_notify)
{
	__u64 now = bpf_ktime_get_ns();
	__u32 zero = 0, i;
	struct unkicked *u = bpf_map_lookup_elem(&guest_unkicked, &zero);

	if (!u)
		return 0;
	for (i = 0; i < UNKICKED_MAX; i++) {
		struct guest_slot *s;
		__u64 key;

		if (i >= u->n)
			break;
		key = u->rq[i];
		s = bpf_map_lookup_elem(&guest_inflight, &key);
		if (s && !s->kick_ns)
			s->kick_ns = now;
	}
	u->n = 0;
	return 0;
}

/* The driver's first sight of a request's completion, in its interrupt
 * handler. */
static __always_inline void completion_seen(struct request *rq)
{
	__u64 key = (__u64)rq;
	struct guest_slot *s = bpf_map_lookup_elem(&guest_inflight, &key);

	if (s && !s->irq_ns)
		s->irq_ns = bpf_ktime_get_ns();
}

/* virtio-blk (and other drivers) handing a completed request to the block
 * layer. */
SEC("kprobe/blk_mq_complete_request")
int BPF_KPROBE(blk_mq_complete_request, struct request *rq)
{
	completion_seen(rq);
	return 0;
}

/* NVMe: the command is written to the submission queue right before the
 * doorbell; its completion is seen in the interrupt handler. */
SEC("raw_tp/nvme_setup_cmd")
int BPF_PROG(nvme_setup_cmd, struct request *rq)
{
	struct guest_slot s = { .flags = GUEST_F_NVME };
	__u64 key = (__u64)rq;

	/* Before block_rq_issue (nvme_prep_rq starts the request after
	 * building its command): the slot begins here. */
	s.kick_ns = bpf_ktime_get_ns();
	if (bpf_map_update_elem(&guest_inflight, &key, &s, BPF_ANY))
		count(CNT_GUEST_INFLIGHT_FULL);
	return 0;
}

SEC("raw_tp/nvme_complete_rq")
int BPF_PROG(nvme_complete_rq, struct request *rq)
{
	completion_seen(rq);
	return 0;
}

SEC("tp_btf/block_rq_complete")
int BPF_PROG(block_rq_complete, struct request *rq, int error, unsigned int nr_bytes)
{
	__u64 key = (__u64)rq;
	struct guest_slot *s = bpf_map_lookup_elem(&guest_inflight, &key);
	struct guest_io_event *ev;
	struct gendisk *disk;

	if (!s)
		return 0;
	/* A partial completion: the request goes on. */
	if (nr_bytes < rq->__data_len)
		return 0;
	ev = bpf_ringbuf_reserve(&guest_events, sizeof(*ev), 0);
	if (!ev) {
		count(CNT_GUEST_RING_LOST);
		bpf_map_delete_elem(&guest_inflight, &key);
		return 0;
	}
	disk = rq->q->disk;
	ev->kind = EVENT_GUEST_IO;
	ev->op = op_class(rq->cmd_flags);
	ev->flags = s->flags | s->from.flags;
	if (!s->kick_ns)
		ev->flags |= GUEST_F_NO_KICK;
	if (!s->irq_ns)
		ev->flags |= GUEST_F_NO_IRQ;
	ev->dev = disk_dev(disk);
	ev->sector = rq->__sector;
	ev->start_ns = s->start_ns ? s->start_ns : s->issue_ns;
	ev->issue_ns = s->issue_ns;
	ev->kick_ns = s->kick_ns;
	ev->irq_ns = s->irq_ns;
	ev->done_ns = bpf_ktime_get_ns();
	ev->bytes = rq->__data_len;
	ev->queue = rq->mq_hctx ? rq->mq_hctx->queue_num : 0;
	ev->sys_ns = s->from.sys_ns;
	ev->reap_ns = 0;
	ev->tgid = s->from.tgid;
	ev->tid = s->from.tid;
	if (s->from.tgid) {
		__u64 key = waiter_key(s->from.flags & GUEST_F_SYNC, s->from.tid, s->from.tgid);
		__u8 one = 1;

		bpf_map_update_elem(&reap_waiting, &key, &one, BPF_ANY);
	}
	/* The agent drains on a timer: no wake-up per request, which in a
	 * guest would cost an exit and a context switch per I/O. */
	bpf_ringbuf_submit(ev, BPF_RB_NO_WAKEUP);
	bpf_map_delete_elem(&guest_inflight, &key);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
