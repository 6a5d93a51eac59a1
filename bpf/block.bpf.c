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
#include "host.bpf.h"
#include "blk_op.bpf.h"
#include "hist.h"
#include "rq_account.h"
#include "core_fixes.bpf.h"

const volatile __u32 targ_max_disks = DEFAULT_MAX_DISKS;
const volatile __u32 targ_sample_every = 0;     /* stream 1 in N requests; 0: none */
const volatile __u64 targ_slower_than_ns = 0;   /* stream requests at least this slow; 0: off */
const volatile __u64 targ_wakeup_bytes = 256 << 10; /* wake the reader past this backlog */
/* Stream only requests of these disks (all when targ_nr_stream_devs is 0);
 * histograms always cover every disk. */
const volatile __u32 targ_nr_stream_devs = 0;
const volatile __u32 targ_stream_devs[MAX_STREAM_DEVS] = {};

counters_map_t counters SEC(".maps");
events_map_t events SEC(".maps");
const struct blk_stats zero_stats = {};

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

#include "vm_request.bpf.h"

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

char LICENSE[] SEC("license") = "GPL";
