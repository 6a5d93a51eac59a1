/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Records and constants shared by the eBPF programs and the agent.
 *
 * Every struct here is mirrored in agent/src/abi/mod.rs; the agent-integration
 * test `abi_layout` compiles this header natively and fails on any size or
 * offset drift. Rules: fixed-width types only, no bool, no pointers, explicit
 * padding, a leading `kind` on records that travel through the ring buffer.
 */
#ifndef IOSPAN_AGENT_ABI_H
#define IOSPAN_AGENT_ABI_H

#ifndef __VMLINUX_H__
#include <linux/types.h>
#endif

/* Latency histograms: log-linear, 2^HIST_SUB_BITS linear buckets per power
 * of two, exact below 2 * HIST_SUB ns, up to 2^HIST_MAX_LOG2 ns (~275 s);
 * everything above lands in the last bucket (max_ns keeps the true value). */
#define HIST_SUB_BITS 3
#define HIST_SUB      (1 << HIST_SUB_BITS)
#define HIST_MAX_LOG2 38
#define HIST_BUCKETS  ((HIST_MAX_LOG2 - HIST_SUB_BITS + 2) * HIST_SUB)

/* Operation classes, as reported. */
enum blk_op_class {
	BLK_OP_READ = 0,
	BLK_OP_WRITE = 1,
	BLK_OP_FLUSH = 2,
	BLK_OP_DISCARD = 3,
	BLK_OP_OTHER = 4,
	BLK_NR_OPS = 5,
};

/* Host block-layer segments of one request. */
enum blk_segment {
	BLK_SEG_TOTAL = 0,   /* start (allocation/accounting) -> complete */
	BLK_SEG_QUEUE = 1,   /* start -> (last) issue to the driver */
	BLK_SEG_SERVICE = 2, /* (last) issue -> complete */
	BLK_NR_SEGS = 3,
};

/* Default number of disk slots; the agent may resize `blk_latency` and
 * `disk_queues` at load time and passes the value as `targ_max_disks`. */
#define DEFAULT_MAX_DISKS 32

/* Disks a per-request stream can be narrowed to (`targ_stream_devs`). */
#define MAX_STREAM_DEVS 16

/* Value of the per-CPU array `blk_latency`, indexed by
 * disk_slot * BLK_NR_OPS + op. Counts are per CPU; the agent sums CPUs.
 *
 * A program can nest on one CPU across contexts (task, softirq, hardirq), so
 * an update in progress is marked `busy`; a nested update finds it busy and
 * goes, atomically, to the same index of the shared array
 * `blk_latency_nested`, which the agent adds in. */
struct blk_stats {
	__u32 busy;
	__u32 _pad;
	__u64 ios;	/* completed requests */
	__u64 bytes;	/* bytes completed, partial completions included */
	__u64 errors;	/* requests that completed with an error */
	__u64 requeued; /* requests that were requeued at least once */
	__u64 partial;	/* requests completed in more than one piece */
	__u64 sum_ns[BLK_NR_SEGS];
	__u64 max_ns[BLK_NR_SEGS];
	__u64 hist[BLK_NR_SEGS][HIST_BUCKETS]; /* a segment whose ends are unknown is not counted */
};

/* Value of the array `disk_queues`, indexed by disk slot (request_queue id
 * modulo targ_max_disks): which disk owns the slot. */
struct disk_slot {
	__u64 queue; /* owner: 1 << 32 | dev; 0 = free */
	__u32 dev;   /* major << 20 | minor, the kernel's internal dev_t */
	__u32 _pad;
};

/* In-flight request state, array `inflight`, for what the kernel does not
 * keep itself: the issue time (blk-stat's is coarse or absent), bytes of
 * partial completions, requeues. Addressed by a hash of the request's key. */
struct rq_slot {
	__u64 rq;	  /* rq_key() of the request; 0 = never used (see RQ_F_DONE) */
	__u64 start_ns;	  /* our start stamp, only when the kernel keeps none */
	__u64 issue_ns;	  /* last issue to the driver */
	__u32 done_bytes; /* bytes of earlier partial completions */
	__u16 requeues;
	__u16 flags;   /* RQ_F_* */
	__u32 vm;      /* VM slot of the submitting process, taken at submission (0: none) */
	__u32 vdisk;   /* virtual disk slot of the file the request is for (0: none) */
	__u64 kick_ns; /* the guest's kick the submitting engine thread picked up last (0: none) */
	__u64 pick_ns; /* when it picked that kick up */
	__u64 pos;   /* file offset a VM's direct I/O is for (the guest's offset on a raw image) */
	__u32 dev;   /* host disk, for a VM's request: where a lost completion is counted */
	__u16 op;    /* BLK_OP_* of a VM's request, likewise */
	__u16 queue; /* VQ_* notifier of the kick it came with (0: none known) */
	__u32 hv_wait_ns;  /* of kick -> pickup, the engine thread's wait for a CPU */
	__u32 eng_wait_ns; /* of pickup -> start, the submitting thread's */
};

/* Which guest queue a VM's request came through, as the notifier of its
 * kick tells (rq_slot.queue, vm_io_event.queue): two bits of how, fourteen
 * of what. The agent turns it into the queue's index by the disk's device
 * model (virtio's notify stride, NVMe's doorbells). */
#define VQ_HOW_SHIFT  14
#define VQ_VALUE_MASK ((1u << VQ_HOW_SHIFT) - 1)
/* KVM_IOEVENTFD with a datamatch: the value the guest writes, the queue's
 * index (virtio's legacy and PIO notify). */
#define VQ_BY_INDEX   (1u << VQ_HOW_SHIFT)
/* KVM_IOEVENTFD on an address: its offset in its page (notify regions and
 * doorbells are page-aligned; virtio's stride is 4 bytes, NVMe's 8). */
#define VQ_BY_ADDR    (2u << VQ_HOW_SHIFT)
/* No address (QEMU's user-space ioeventfd, TCG): the notifier's order of
 * creation in its VM (a device's queue notifiers are made in index order). */
#define VQ_BY_ORDER   (3u << VQ_HOW_SHIFT)
/* With VQ_BY_ADDR, a notifier at offset 0 of its page (queue 0, or any
 * queue of a device with a page of its own per queue) learnt from a KVM
 * exit, not from its registration: the value is its page number (low
 * bits); the agent tells the two layouts apart by the offsets it sees. */
#define VQ_ADDR_PAGE  (1u << 13)

#define RQ_SLOT_BITS 15
#define RQ_SLOTS     (1 << RQ_SLOT_BITS)

/* rq_slot.flags and blk_io_event.flags */
#define RQ_F_REQUEUE_PENDING (1 << 0) /* requeued, not yet re-issued */
#define RQ_F_PARTIAL	     (1 << 1) /* completed in more than one piece */
#define RQ_F_REQUEUED	     (1 << 2) /* requeued at least once */
#define RQ_F_NO_START	     (1 << 3) /* no start time known: queue unknown, total from issue */
#define RQ_F_NO_ISSUE	     (1 << 4) /* no issue time known: queue and service unknown */
#define RQ_F_ERROR	     (1 << 5)
/* The slot's request finished; the slot stays with its key, so the next
 * I/O on the same tag finds it at the first look, and any key may take it. */
#define RQ_F_DONE	     (1 << 6)
/* A VM's request its engine found by polling the queue, with no kick of
 * its own: no hypervisor segment can be measured host-side. */
#define RQ_F_POLLED	     (1 << 7)

/* Global counters, per-CPU array `counters`: everything lost or degraded. */
enum counter {
	CNT_RINGBUF_DROPS = 0,	 /* per-I/O records the ring buffer had no room for */
	CNT_DISK_CONFLICTS = 1,	 /* requests whose disk found its slot owned by another queue */
	CNT_SLOT_CONFLICTS = 2,	 /* requests whose in-flight slot was taken by another request */
	CNT_NO_START = 3,	 /* requests without a start time (total measured from issue) */
	CNT_NO_ISSUE = 4,	 /* requests without an issue time (queue/service unknown) */
	CNT_PARTIAL_PIECES = 5,	 /* partial completion events */
	CNT_REQUEUES = 6,	 /* requeue events */
	CNT_SAMPLED = 7,	 /* per-I/O records submitted */
	CNT_VM_TABLE_FULL = 8,	 /* requests of a VM whose (vm, disk, op) found vm_latency full */
	CNT_GUEST_RING_LOST = 9, /* guest mode: records the ring buffer had no room for */
	CNT_GUEST_INFLIGHT_FULL = 10, /* guest mode: requests the in-flight table had no room for */
	CNT_UNDELIVERED =
		11, /* issued requests whose completion never reached us (their tag came back first) */
	CNT_JOIN_DEFERRED =
		12, /* VM completions a signal left for the next (its drain was busy or full) */
	CNT_NESTED_WAKING =
		13, /* sched_waking runs the kernel skipped, run by the second program */
	CNT_NESTED_WAKEUP = 14, /* the same for sched_wakeup (nesting.bpf.h) */
	CNT_ACTING_FULL = 15, /* a VM's SCSI command run with no room to follow it (scsi_target) */
	NR_COUNTERS = 16,
};

/* Value of the hash `vm_pids`, per process (tgid): the VM slot it belongs
 * to and whether its guest runs (VM_PROC_*). */
struct vm_proc {
	__u32 slot;
	__u32 state;
};

/* Before the guest runs the process only opens its images and realizes
 * its devices (format, alignment and geometry probes); after QEMU closes
 * its queue notifiers (the VM stopped or shut down, or the guest reset the
 * device) it may probe or close its images: such requests are QEMU's own,
 * not any virtual disk's. The guest runs from its first kick, a queue
 * notifier made, a vCPU's request, or the agent's word (a VM running when
 * it started, or whose vCPU threads it saw run). */
#define VM_PROC_STARTING 0
#define VM_PROC_RUNNING	 1
#define VM_PROC_STOPPED	 2

/* Value of the per-CPU array `vm_counts`, by VM slot modulo its size
 * (MAX_VM_COUNTS; the agent sums CPUs, and zeroes a gone VM's). */
#define MAX_VM_COUNTS 1024
struct vm_counts {
	__u64 engine_merges; /* guest requests QEMU merged into another */
	__u64 bio_merges; /* guest requests the host block layer merged into another (as bios or whole requests) */
	__u64 submitted; /* requests it started (in flight: submitted less completed) */
	/* The deep tier: interrupts its engine raised for its guest, those after
	 * which the vCPU that ran next had waited, runnable, for a CPU, and
	 * for how long in all from the raise (or its wake-up after the raise)
	 * to its run: the interrupt's injection waiting for a CPU. */
	__u64 raises;
	__u64 vcpu_waits;
	__u64 vcpu_wait_ns;
};

/* Key of the per-CPU hash `vm_latency`: requests a VM's process submitted,
 * per VM slot (assigned in `vm_pids`), host disk and op. */
struct vm_key {
	__u32 vm;
	__u32 dev;
	__u32 op;
	__u32 vdisk; /* 0: the VM process's I/O that is none of its disks */
};

/* Key of the hash `vdisk_files`: a backing file, by the kernel's
 * (superblock dev, inode number). */
struct file_key {
	__u32 dev;
	__u32 _pad;
	__u64 ino;
};

/* Key of the hash `vm_disks`: which virtual disk of a VM a host disk
 * backs. Value: the vdisk slot, or VDISK_SEVERAL when more than one of the
 * VM's disks live there (then each request's file decides). */
struct vm_dev_key {
	__u32 vm;
	__u32 dev;
};

#define VDISK_SEVERAL 0xffffffffu

/* Completion functions of the bios a VM's direct I/O arrives as, in the
 * order of `targ_dio_end_io`: how each leads to what the request is for.
 * iomap (a file on a filesystem): bi_private is the iomap_dio, its kiocb
 * the file and offset. Block devices (QEMU on /dev/…): the async path's
 * bio is inside a blkdev_dio (no bi_private), the multi-bio path's
 * bi_private is one, the synchronous path (aio=threads) waits with
 * submit_bio_wait; the device itself is the bio's bdev, the offset its
 * sector less the partition's start. A device-mapper clone (LVM) leads to
 * neither: its disk is known only where the VM has one on that host disk. */
enum dio_kind {
	DIO_IOMAP = 0,
	DIO_BLKDEV_ASYNC = 1,
	DIO_BLKDEV = 2,
	DIO_BLKDEV_SYNC = 3,
	DIO_DM_CLONE = 4,
};
#define NR_DIO_END_IO 5

/* vdisk_files' key for a block device: dev = VDISK_FILE_BDEV, ino = the
 * device's dev_t (as the kernel encodes it), whatever inode opened it. */
#define VDISK_FILE_BDEV 0xffffffffu

/* The process names that make a process a VM (or a storage engine serving
 * one), matched on the executable's file name at exec. */
#define VM_COMM_PREFIX "qemu-system-"

enum event_kind {
	EVENT_BLK_IO = 1,
	EVENT_VM_IO = 2,
	EVENT_VM_SIGNAL = 3,
	EVENT_GUEST_IO = 4,
	EVENT_GUEST_REAP = 5,
	EVENT_VM_PUSHES = 6,
	EVENT_VM_SPLIT = 7,
};

/* One request as a guest sees it (`iospan agent --guest`), on the guest's
 * clock: the guest's ends of its latency. The kick and interrupt come from
 * kprobes where the guest kernel has them (virtio) or NVMe's tracepoints;
 * without them they are 0 and GUEST_F_NO_KICK / GUEST_F_NO_IRQ say so.
 * The application's ends: the system call that submitted it (sys_ns, its
 * thread and process) and, filled in by the guest agent from a
 * guest_reap_event, the return of the system call that handed its
 * completion back (reap_ns). */
struct guest_io_event {
	__u16 kind;	/* EVENT_GUEST_IO */
	__u8 op;	/* enum blk_op_class */
	__u8 flags;	/* GUEST_F_* */
	__u32 dev;	/* the guest's major << 20 | minor */
	__u64 sector;	/* first sector (512 B): the offset the host sees on a raw image */
	__u64 start_ns; /* block layer start (the kernel's own stamp) */
	__u64 issue_ns; /* to the driver */
	__u64 kick_ns;	/* the driver notified the device */
	__u64 irq_ns;	/* the driver saw the completion (interrupt handler) */
	__u64 done_ns;	/* block layer completion */
	__u32 bytes;
	__u32 queue;   /* hardware queue */
	__u64 sys_ns;  /* entry of the submitting system call (GUEST_F_SYSCALL) */
	__u64 reap_ns; /* return of the reaping system call (GUEST_F_REAPED) */
	__u32 tgid;    /* submitting process, 0 when not known */
	__u32 tid;     /* submitting thread */
};

/* A system call handing completions back to the application: the return
 * of a synchronous read/write (the thread's own request) or of
 * io_getevents / io_uring_enter (any of the process's). Emitted only when a
 * request of that thread or process completed since its last one. */
struct guest_reap_event {
	__u16 kind; /* EVENT_GUEST_REAP */
	__u8 flags; /* GUEST_REAP_SYNC: `id` is a thread, else a process */
	__u8 _pad;
	__u32 id;
	__u64 ts_ns;
};

#define GUEST_REAP_SYNC (1 << 0)

#define GUEST_F_NO_KICK (1 << 0) /* no kick seen after the issue (suppressed or not probed) */
#define GUEST_F_NO_IRQ	(1 << 1) /* no driver completion seen */
#define GUEST_F_NVME	(1 << 2) /* kick and completion from NVMe's tracepoints */
#define GUEST_F_SYSCALL (1 << 3) /* sys_ns, tgid, tid: submitted by a system call */
#define GUEST_F_SYNC	(1 << 4) /* that call was synchronous: the same thread's return reaps it */
#define GUEST_F_STACKED (1 << 5) /* came through a stacked device (device mapper, md) */
#define GUEST_F_REAPED	(1 << 6) /* reap_ns set by the guest agent */

/* A VM's request at its final host completion, with the notification that
 * led to it: the guest's kick (an eventfd write by a vCPU thread) and the
 * engine thread's pickup (its read of that eventfd). */
struct vm_io_event {
	__u16 kind; /* EVENT_VM_IO */
	__u8 op;
	__u8 flags;
	__u32 dev;
	__u64 kick_ns; /* 0 when no kick preceded the request */
	__u64 pick_ns;
	__u64 start_ns;
	__u64 issue_ns;
	__u64 done_ns;
	__u32 bytes;
	__u32 vm;
	__u32 vdisk;
	__u16 queue; /* VQ_*: the guest queue its kick came through (0: none known) */
	__u16 _pad;
	__u64 pos;	   /* file offset of the request (see rq_slot.pos) */
	__u32 hv_wait_ns;  /* CPU waits (runnable, not running) within kick -> pickup */
	__u32 eng_wait_ns; /* and pickup -> start (see rq_slot) */
};

/* A thread's last waits for a CPU (runnable, not running): woken or
 * preempted at start, switched in at end; kept per VM thread, the newest
 * RUN_WAITS. */
#define RUN_WAITS 4

/* A VM's engine raised an interrupt toward the guest (QEMU's msix_notify):
 * the earliest one after a request's host completion ends its host
 * window. With the signalling thread's last two waits for a CPU: the part
 * of host completion -> signal it spent runnable, not running. */
struct vm_signal_event {
	__u16 kind; /* EVENT_VM_SIGNAL */
	__u16 _pad;
	__u32 vm;
	__u64 ts_ns;
	__u64 wait_start[2]; /* newest first; 0: none */
	__u64 wait_end[2];
};

/* A VM engine thread's used-ring pushes (one request each), gathered per
 * thread and sent together when PUSH_BATCH are gathered, when the VM has
 * no completion left waiting, or when the thread leaves its CPU: one
 * record for a burst of pushes instead of one per push. With the
 * thread's last two waits for a CPU as it sends them. */
#define PUSH_BATCH 8

struct vm_pushes_event {
	__u16 kind; /* EVENT_VM_PUSHES */
	__u16 n;    /* pushes in ts, oldest first */
	__u32 vm;
	__u64 ts[PUSH_BATCH];
	__u64 wait_start[2]; /* newest first; 0: none */
	__u64 wait_end[2];
};

/* The always-on tier: each VM request's host window is joined in the
 * kernel (kick, pickup, start, completion, and the VM's next interrupt)
 * and lands in the per-CPU hash `vm_split`, one entry per VM, virtual
 * disk, host disk, op and guest queue. Segments of the host window: */
enum vm_segment {
	VM_SEG_HYPERVISOR = 0,	   /* kick -> pickup */
	VM_SEG_ENGINE = 1,	   /* pickup -> host start, plus host completion -> signal */
	VM_SEG_DEVICE = 2,	   /* host start -> host completion */
	VM_SEG_WINDOW = 3,	   /* kick -> signal: the three above, tiled */
	VM_SEG_PICKUP_TO_DONE = 4, /* pickup -> host completion */
	VM_NR_SEGS = 5,
};

struct vm_split_key {
	__u32 vm;
	__u32 vdisk;
	__u32 dev;
	__u16 op;
	__u16 queue; /* VQ_*: the notifier of its kick (0: none known) */
};

/* Value of `vm_split`, per CPU; the agent sums CPUs. */
struct vm_split_stats {
	__u64 count;
	__u64 bytes;
	__u64 sum_ns[VM_NR_SEGS];
	__u64 max_ns[VM_NR_SEGS];
	__u64 hist[VM_NR_SEGS][HIST_BUCKETS];
};

/* Per VM (array `vm_done`, by slot modulo its size), its requests
 * completed on the host and waiting for its next interrupt (see
 * bpf/include/vm_join.bpf.h). The agent zeroes a VM's ring when the VM is
 * gone. */
#define DONE_RING      256
#define DONE_MASK      (DONE_RING - 1)
/* How long a completed request waits for its VM's interrupt: one later
 * than this is not its own (a guest that polls, or interrupts suppressed),
 * and the request is counted no_signal. The deep tier's correlator holds
 * as long for its push. */
#define SIGNAL_HOLD_NS 50000000ULL
/* A ring is full at half its slots: the rest is room for completions on
 * other CPUs racing past the check (one per CPU at most). */
#define DONE_ROOM      (DONE_RING / 2)
/* Slots one interrupt settles; more wait for the next. */
#define DRAIN_MAX      128

/* One completed request waiting for its VM's signal. */
struct done_ent {
	__u64 seq; /* its index + 1, once written */
	__u64 kick_ns;
	__u64 pick_ns;
	__u64 start_ns;
	__u64 issue_ns;
	__u64 done_ns;
	__u64 pos;
	__u32 bytes;
	__u32 vdisk;
	__u32 dev;
	__u16 queue;
	__u8 op;
	__u8 flags;
};

struct done_ring {
	__u64 head; /* next slot to settle */
	__u64 tail; /* next slot to fill */
	__u32 vm;   /* the VM slot it belongs to (0: free) */
	__u32 _pad;
	struct done_ent ent[DONE_RING];
};

/* Key of `vm_unsplit` and of the per virtual disk tables. */
struct vdisk_key {
	__u32 vm;
	__u32 vdisk;
};

/* Value of `vm_unsplit`: a virtual disk's requests that were counted but
 * whose host window could not be split, by why. */
struct vm_unsplit {
	__u64 no_kick;	 /* no kick was seen before it (a TCG guest's without fentry/kprobes) */
	__u64 no_signal; /* no room to wait for its signal (the VM's table full) */
	__u64 polled;	 /* found by a polling engine, no kick of its own */
	__u64 unordered; /* its stamps out of order */
};

/* Value of the one-entry array `tier`: what the agent asks of the kernel
 * side at the moment (it may change while loaded: an API run of the deep
 * tier). */
struct tier_state {
	__u32 deep;	      /* the deep tier: per-request records, pushes, CPU waits */
	__u32 handoff;	      /* hand kicks to the workers engine threads wake (aio=threads) */
	__u32 one_in;	      /* stream one joined VM request in N (0: none) */
	__u32 pick_at_read;   /* pickups come from eventfd reads (fentry/kprobe), not switch-ins */
	__u64 slower_than_ns; /* stream every joined VM request at least this slow (0: off) */
};

/* The one entry of `vm_gen`: bumped whenever what a process's requests are
 * attributed to changes (vm_pids, its state, vm_disks): the per-CPU caches
 * of the block start (proc_cache) are good only for the generation they
 * were filled in. The agent moves it by VM_GEN_AGENT_STEP, the kernel
 * side by one: two writers never leave it where it was. */
#define VM_GEN_AGENT_STEP 1000

/* Value of `vm_flags`, per VM slot. */
#define VMF_STREAM_ALL	 (1 << 0) /* stream every joined request (a guest agent joins them) */
#define VMF_VHOST	 (1 << 1) /* its kernel vhost workers serve a disk: their interrupts end windows */
#define VMF_VHOST_SIGNAL (1 << 2) /* those are seen at vhost_signal (kprobe), not at their MSI */

/* One VM request joined in the kernel, streamed when sampled: the request
 * (kind EVENT_VM_SPLIT) and the signal that ended its window. */
struct vm_split_event {
	struct vm_io_event io;
	__u64 signal_ns;
	__u32 sampled_by; /* SAMPLED_* */
	__u32 _pad;
};

#define SAMPLED_ALL    (1 << 0) /* its VM streams every request */
#define SAMPLED_SLOW   (1 << 1) /* at least the threshold (global or its disk's) */
#define SAMPLED_ONE_IN (1 << 2) /* one in N */

/* One completed host block request, streamed through the ring buffer
 * `events` when sampling or a latency threshold asks for it. */
struct blk_io_event {
	__u16 kind;	/* EVENT_BLK_IO */
	__u8 op;	/* enum blk_op_class */
	__u8 flags;	/* RQ_F_* */
	__u32 dev;	/* major << 20 | minor */
	__u64 start_ns; /* CLOCK_MONOTONIC; 0 when unknown */
	__u64 issue_ns; /* 0 when unknown */
	__u64 done_ns;
	__u64 sector; /* first sector at the final completion */
	__u32 bytes;
	__u16 requeues;
	__u8 cpu_lo; /* low byte of the completing CPU, a hint only */
	__u8 _pad;
	__u32 vdisk; /* virtual disk slot, 0 when none */
	__u32 vm;    /* VM slot, 0 when not a VM's */
};

_Static_assert(sizeof(struct blk_io_event) == 56, "abi: blk_io_event");
_Static_assert(sizeof(struct guest_io_event) == 88, "abi: guest_io_event");
_Static_assert(sizeof(struct guest_reap_event) == 16, "abi: guest_reap_event");
_Static_assert(sizeof(struct vm_key) == 16, "abi: vm_key");
_Static_assert(sizeof(struct vm_counts) == 48, "abi: vm_counts");
_Static_assert(sizeof(struct vm_proc) == 8, "abi: vm_proc");
_Static_assert(sizeof(struct file_key) == 16, "abi: file_key");
_Static_assert(sizeof(struct vm_dev_key) == 8, "abi: vm_dev_key");
_Static_assert(sizeof(struct vm_io_event) == 80, "abi: vm_io_event");
_Static_assert(sizeof(struct vm_signal_event) == 48, "abi: vm_signal_event");
_Static_assert(sizeof(struct vm_pushes_event) == 104, "abi: vm_pushes_event");
_Static_assert(sizeof(struct rq_slot) == 80, "abi: rq_slot");
_Static_assert(sizeof(struct vm_split_key) == 16, "abi: vm_split_key");
_Static_assert(sizeof(struct vm_split_stats) ==
		       8 * (2 + 2 * VM_NR_SEGS + VM_NR_SEGS * HIST_BUCKETS),
	       "abi: vm_split_stats");
_Static_assert(sizeof(struct vdisk_key) == 8, "abi: vdisk_key");
_Static_assert(sizeof(struct done_ent) == 72, "abi: done_ent");
_Static_assert(sizeof(struct done_ring) == 24 + 72 * DONE_RING, "abi: done_ring");
_Static_assert(sizeof(struct vm_unsplit) == 32, "abi: vm_unsplit");
_Static_assert(sizeof(struct tier_state) == 24, "abi: tier_state");
_Static_assert(sizeof(struct vm_split_event) == 96, "abi: vm_split_event");
_Static_assert(sizeof(struct disk_slot) == 16, "abi: disk_slot");
_Static_assert(sizeof(struct blk_stats) == 8 * (6 + 2 * BLK_NR_SEGS + BLK_NR_SEGS * HIST_BUCKETS),
	       "abi: blk_stats");

#endif /* IOSPAN_AGENT_ABI_H */
