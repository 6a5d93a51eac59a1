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
#include "stats.bpf.h"
#include "vm_request.bpf.h"

const volatile __u32 targ_max_disks = DEFAULT_MAX_DISKS;
const volatile __u32 targ_sample_every = 0;   /* stream 1 in N requests; 0: none */
const volatile __u64 targ_slower_than_ns = 0; /* stream requests at least this slow; 0: off */
/* Stream only requests of these disks (all when targ_nr_stream_devs is 0);
 * histograms always cover every disk. */
const volatile __u32 targ_nr_stream_devs = 0;

/* Kernels before block_io_start (v6.5): a VM's request is taken at
 * block_getrq by its bio and joined to its request at its first issue. */
const volatile __u32 targ_getrq = 0;
const volatile __u32 targ_stream_devs[MAX_STREAM_DEVS] = {};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, (DEFAULT_MAX_DISKS * BLK_NR_OPS));
	__type(key, __u32);
	__type(value, struct blk_stats);
} blk_latency SEC(".maps");

/* Updates that found their per-CPU entry busy (nested on the same CPU);
 * shared, so updated atomically. Rare. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, (DEFAULT_MAX_DISKS * BLK_NR_OPS));
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

/* targ_getrq: VMs' requests taken at block_getrq, by bio, until their
 * first issue; LRU, so a bio whose request never issues is not kept. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct vm_start);
} bio_starts SEC(".maps");

/* How many bio_starts holds, roughly (an issue looks there only when it
 * holds any: requests of no VM pay one read). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __s64);
} bio_starts_held SEC(".maps");

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

static __always_inline void stream(const struct rq_outcome *o, const struct rq_fields *f, __u8 op,
				   __u64 now)
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
	if (!emit(&ev, sizeof(ev), now))
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

static __always_inline __s64 *bio_starts_count(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&bio_starts_held, &zero);
}

/* targ_getrq: the VM's request taken at block_getrq, if this is its
 * first issue, into its slot as block_io_start would have put it. */
static __always_inline void start_from_bio(struct request *rq, __u64 key, struct rq_slot *s,
					   int btf)
{
	__s64 *held = bio_starts_count();
	__u64 bio, kstart;
	struct vm_start *v;
	struct vm_counts *c;

	if (!held || *held <= 0)
		return;
	bio = (__u64)READ(btf, rq, bio);
	v = bio ? bpf_map_lookup_elem(&bio_starts, &bio) : 0;
	if (!v)
		return;
	if (rq_undelivered(s, key))
		note_undelivered(s);
	kstart = READ(btf, rq, start_time_ns);
	rq_on_start(s, key, kstart ? 0 : v->stamp_ns, v->vm, v->vdisk, v->kick_ns, v->pick_ns,
		    v->pos, v->dev, v->op);
	s->queue = (__u16)v->queue;
	s->hv_wait_ns = v->hv_wait_ns;
	s->eng_wait_ns = v->eng_wait_ns;
	if (v->polled)
		s->flags |= RQ_F_POLLED;
	c = vm_counts_of(v->vm);
	if (c)
		__sync_fetch_and_add(&c->submitted, 1);
	if (!bpf_map_delete_elem(&bio_starts, &bio))
		__sync_fetch_and_add(held, -1);
}

static __always_inline void on_issue(struct request *rq, __u64 key, int btf)
{
	struct rq_slot *s = rq_slot_of(key, 1);

	/* An issued, unfinished request here may be dispatched again (not
	 * lost): only a new request's start tells a lost completion. */
	if (!s)
		return;
	if (targ_getrq && targ_track_vms)
		start_from_bio(rq, key, s, btf);
	rq_on_issue(s, key, bpf_ktime_get_ns());
}

/* targ_getrq: a new request for `bio`, in its submitter's context. */
static __always_inline void on_getrq(struct bio *bio, int btf)
{
	struct vm_start v = {};
	__u64 key = (__u64)bio;
	__s64 *held;

	if (!targ_track_vms ||
	    !vm_bio_start(bio, acting_cmd(bpf_get_current_pid_tgid()), bio_disk_dev(bio),
			  op_class(READ(btf, bio, bi_opf)), bpf_ktime_get_ns(), btf, &v))
		return;
	if (bpf_map_update_elem(&bio_starts, &key, &v, BPF_NOEXIST))
		return;
	held = bio_starts_count();
	if (held)
		__sync_fetch_and_add(held, 1);
}

SEC("tp_btf/block_getrq")
int BPF_PROG(block_getrq_btf, struct bio *bio)
{
	on_getrq(bio, 1);
	return 0;
}

SEC("raw_tp/block_getrq")
int BPF_PROG(block_getrq, struct bio *bio)
{
	on_getrq(bio, 0);
	return 0;
}

static __always_inline void on_requeue(__u64 key)
{
	struct rq_slot *s = rq_slot_of(key, 0);

	count(CNT_REQUEUES);
	if (s)
		rq_on_requeue(s, key);
}

static __always_inline void on_complete(const struct rq_fields *f, int error, __u32 nr_bytes)
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
	if (final && o.vm)
		vm_request_done(&o, f->dev, op, seg, c.now_ns);

	if (final &&
	    ((targ_sample_every && bpf_get_prandom_u32() % targ_sample_every == 0) ||
	     (targ_slower_than_ns && seg[BLK_SEG_TOTAL] != ~0ULL &&
	      seg[BLK_SEG_TOTAL] >= targ_slower_than_ns)) &&
	    stream_wanted(f->dev))
		stream(&o, f, op, c.now_ns);
}

/* A request starts, in its submitter's context: who submitted it (a VM's
 * requests are taken here, with their notification), and our start stamp
 * where the kernel keeps none. `btf`: a constant per inlined call site,
 * choosing direct or probe reads. Most requests return before any read of
 * the request: the kernel keeps their start time and no VM submitted them. */
static __always_inline void on_start(struct request *rq, __u64 kstart_ns, int btf)
{
	struct vm_start v = {};
	struct rq_slot *s;
	/* Our start stamp, where the kernel keeps none: one clock read. */
	__u64 now = kstart_ns ? 0 : bpf_ktime_get_ns();
	__u64 key;
	/* Before block_io_start, VMs' requests are taken at block_getrq. */
	int vm = targ_track_vms && !targ_getrq &&
		 vm_request_start(rq, kstart_ns ? kstart_ns : now, btf, &v);

	if (kstart_ns && !vm)
		return;
	key = btf ? rq_key_btf(rq) : rq_key_raw(rq);
	s = rq_slot_of(key, 1);
	if (!s)
		return;
	if (rq_undelivered(s, key))
		note_undelivered(s);
	if (vm) {
		struct vm_counts *c = vm_counts_of(v.vm);

		if (c)
			__sync_fetch_and_add(&c->submitted, 1);
	}
	rq_on_start(s, key, now, v.vm, v.vdisk, v.kick_ns, v.pick_ns, v.pos, v.dev, v.op);
	s->queue = (__u16)v.queue;
	s->hv_wait_ns = v.hv_wait_ns;
	s->eng_wait_ns = v.eng_wait_ns;
	if (v.polled)
		s->flags |= RQ_F_POLLED;
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
	on_issue(rq, rq_key_btf(rq), 1);
	return 0;
}

SEC("raw_tp/block_rq_issue")
int BPF_PROG(block_rq_issue, struct request *rq)
{
	on_issue(rq, rq_key_raw(rq), 0);
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
static __always_inline void on_rq_merge(struct request *rq, __u64 key, int btf)
{
	struct rq_slot *s = rq_slot_of(key, 0);
	struct vm_counts *c;
	struct vm_start *v;
	__s64 *held;
	__u64 bio;

	if (targ_getrq && targ_track_vms && (held = bio_starts_count()) && *held > 0) {
		/* Never issued: still waiting by its bio. */
		bio = (__u64)READ(btf, rq, bio);
		v = bio ? bpf_map_lookup_elem(&bio_starts, &bio) : 0;
		if (v) {
			if (v->vdisk && (c = vm_counts_of(v->vm))) {
				__sync_fetch_and_add(&c->submitted, 1);
				__sync_fetch_and_add(&c->bio_merges, 1);
			}
			if (!bpf_map_delete_elem(&bio_starts, &bio))
				__sync_fetch_and_add(held, -1);
			return;
		}
	}
	if (!s || !rq_on_merge(s, key))
		return;
	if (s->vm && s->vdisk && (c = vm_counts_of(s->vm)))
		__sync_fetch_and_add(&c->bio_merges, 1);
}

SEC("tp_btf/block_rq_merge")
int BPF_PROG(block_rq_merge_btf, struct request *rq)
{
	on_rq_merge(rq, rq_key_btf(rq), 1);
	return 0;
}

SEC("raw_tp/block_rq_merge")
int BPF_PROG(block_rq_merge, struct request *rq)
{
	on_rq_merge(rq, rq_key_raw(rq), 0);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
