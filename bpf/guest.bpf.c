// SPDX-License-Identifier: GPL-2.0
/*
 * Guest side: each request's own ends, on the guest's clock. Block layer
 * start/issue/complete from tracepoints; the driver's kick to the device
 * and its sight of the completion from kprobes on the guest kernel
 * (virtqueue_notify, blk_mq_complete_request) or NVMe's tracepoints. The
 * host joins these records to its own by disk offset and time.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "agent_abi.h"
#include "blk_op.bpf.h"
#include "maps.bpf.h"

/* Requests between issue and completion: request pointer -> stamps. */
struct guest_slot {
	__u64 start_ns;
	__u64 issue_ns;
	__u64 kick_ns;
	__u64 irq_ns;
	__u32 flags;
	__u32 _pad;
};

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
		return 0;
	}
	s.issue_ns = bpf_ktime_get_ns();
	s.start_ns = rq->start_time_ns;
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
	ev->flags = s->flags;
	if (!s->kick_ns)
		ev->flags |= GUEST_F_NO_KICK;
	if (!s->irq_ns)
		ev->flags |= GUEST_F_NO_IRQ;
	ev->dev = disk ? (__u32)disk->major << 20 | (__u32)disk->first_minor : 0;
	ev->sector = rq->__sector;
	ev->start_ns = s->start_ns ? s->start_ns : s->issue_ns;
	ev->issue_ns = s->issue_ns;
	ev->kick_ns = s->kick_ns;
	ev->irq_ns = s->irq_ns;
	ev->done_ns = bpf_ktime_get_ns();
	ev->bytes = rq->__data_len;
	ev->queue = rq->mq_hctx ? rq->mq_hctx->queue_num : 0;
	/* The agent drains on a timer: no wake-up per request, which in a
	 * guest would cost an exit and a context switch per I/O. */
	bpf_ringbuf_submit(ev, BPF_RB_NO_WAKEUP);
	bpf_map_delete_elem(&guest_inflight, &key);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
