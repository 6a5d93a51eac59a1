/* SPDX-License-Identifier: GPL-2.0 */
/*
 * What the host programs share. One .bpf.c per concern along a request's
 * path — block.bpf.c (block accounting), vms.bpf.c (which processes are
 * VMs, their merges), notifiers.bpf.c (the deep tier's notifier
 * registrations), kicks.bpf.c, pickups.bpf.c, signals.bpf.c, sched.bpf.c
 * (context switches: pickups at switch-in, CPU waits) — linked into one
 * object, host.bpf.o, whose maps and settings are one set. The ones
 * several concerns share are declared here and defined in host.bpf.c; a
 * concern's own are in its header and its file.
 */
#ifndef IOSPAN_HOST_BPF_H
#define IOSPAN_HOST_BPF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "agent_abi.h"
#include "maps.bpf.h"

/* Settings the agent fills in before loading (block.bpf.c, vms.bpf.c). */
extern const volatile __u64 targ_wakeup_bytes;

/* Attribute requests to VMs (processes in vm_pids) and keep vm_latency. */
extern const volatile __u32 targ_track_vms;

/* Split VMs' host windows (kicks, pickups, signals); needs targ_track_vms. */
extern const volatile __u32 targ_vm_segments;

/* Addresses of the direct-I/O completion functions, in enum dio_kind's
 * order (from kallsyms; 0 when absent). */
extern const volatile __u64 targ_dio_end_io[NR_DIO_END_IO];

/* Records to the agent (block.bpf.c). Sized by the agent at load, by the
 * tier (events_ring_bytes). */
typedef struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 16 << 20);
} events_map_t;
extern events_map_t events SEC(".maps");

/* When a record last woke the reader (block.bpf.c). */
extern __u64 events_woken_ns;

/* What the agent asks of the moment (vms.bpf.c): struct tier_state. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct tier_state);
} tier_map_t;
extern tier_map_t tier SEC(".maps");

/* Processes that are VMs: tgid -> its VM slot and state (struct
 * vm_proc). The agent adds the ones running when it starts; exec of a new
 * one adds itself (vms.bpf.c). The agent also adds, under the VM's slot,
 * an engine process that serves the VM's disks from outside QEMU
 * (vhost-user): its requests are the VM's. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct vm_proc);
} vm_pids_map_t;
extern vm_pids_map_t vm_pids SEC(".maps");

/* VM slot -> VMF_* (set by the agent). */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} vm_flags_map_t;
extern vm_flags_map_t vm_flags SEC(".maps");

/* VM slot -> what happened to its requests besides completing: the guest
 * requests that never became host requests of their own because they were
 * merged, by QEMU or by the host block layer, and how many it started.
 * (Those whose completion never reached us are in vm_undelivered.) */
typedef struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_VM_COUNTS);
	__type(key, __u32);
	__type(value, struct vm_counts);
} vm_counts_map_t;
extern vm_counts_map_t vm_counts SEC(".maps");

/* VM slot (modulo MAX_VM_COUNTS) -> when its engine last raised an
 * interrupt for the guest that no vCPU of it has run since (the deep
 * tier): shared, since the raise and the vCPU's run are on other CPUs. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_VM_COUNTS);
	__type(key, __u32);
	__type(value, __u64);
} vm_raised_map_t;
extern vm_raised_map_t vm_raised SEC(".maps");

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
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} vm_gen_map_t;
extern vm_gen_map_t vm_gen SEC(".maps");

/* What a process's requests are attributed to has changed. */
void vm_gen_bump(void);

/* The generation now (see vm_gen). */
__u32 vm_gen_now(void);

/* The VM a process belongs to, if it is one's (or an engine registered
 * under one). */
struct vm_proc *vm_proc_of(__u32 tgid);

/* A VM process's guest changed state: it is written in place, and the
 * block start's caches of it are bumped. */
void vm_proc_set_state(struct vm_proc *p, __u32 state);

/* A kick not yet picked up: when it came (the first since the last
 * pickup) and through which guest queue (VQ_*). */
struct kick {
	__u64 ts_ns;
	__u64 queue;
};

/* Kicks on an eventfd, keyed by its open file: a vCPU's write (the deep
 * tier's system-call tracepoint, or eventfd_write where fentry or kprobes
 * reach it) or a registered KVM notify address; picked up by the read of
 * that file. Keyed by the file, not (process, fd): the engine reading the
 * kick may be another process holding the same eventfd (qemu-storage-
 * daemon, an SPDK target, served over vhost-user). */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct kick);
} file_kicks_map_t;
extern file_kicks_map_t file_kicks SEC(".maps");

/* Kicks waiting for the engine thread they are for (tid): KVM
 * notifications whose thread was learnt from the wake-up the kick made
 * (kicks.bpf.h), one slot per queue notifier of the thread (its slot
 * assigned when learnt), each the first kick since its last pickup. An
 * engine serving its queues in turn picks them up in the order they came
 * (an epoll's ready list keeps that order): at its switch-in after a kick
 * woke it, at an eventfd read, or as it starts its next submitting call. */
#define KICK_SLOTS 16

struct thread_kicks {
	__u64 ts[KICK_SLOTS];	 /* 0: none waiting */
	__u16 queue[KICK_SLOTS]; /* VQ_*: the slot's notifier (0: slot unused) */
	__u32 pending;		 /* slots with a kick, a hint (ts decides) */
	__u32 _pad;
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct thread_kicks);
} thread_kicks_map_t;
extern thread_kicks_map_t thread_kicks SEC(".maps");

/* A bit per thread id (modulo THREADS_KICKED_BITS) that has ever had an
 * entry in thread_kicks: a context switch or a request start of any other
 * thread (most of a host's) looks no further than this one word, where a
 * miss in the hash costs it a lookup. Never cleared: a bit left by a gone
 * thread, or shared by two ids, costs that thread the lookup, no more. */
#define THREADS_KICKED_BITS (1 << 16)

typedef struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, THREADS_KICKED_BITS / 64);
	__type(key, __u32);
	__type(value, __u64);
} threads_kicked_map_t;
extern threads_kicked_map_t threads_kicked SEC(".maps");

/* Thread `tid`'s kicks waiting, if it may have any (threads_kicked). */
struct thread_kicks *thread_kicks_of(__u32 tid);

/* Thread `tid` has an entry in thread_kicks. */
void mark_thread_kicked(__u32 tid);

/* The last kick each engine thread picked up: tid -> {kick, pickup}. The
 * requests that thread submits next belong to that notification: those of
 * all it submits until it picks up the next. A polling engine (QEMU's
 * iothreads, in_iothread) also finds requests with no kick at all, by
 * reading the queue's ring: for those threads a pick is spent once the
 * thread went round its loop after submitting the pick's batch (it
 * delivered completions, or made its next submitting call), and what it
 * submits then is declared polled, never given an older batch's kick. */
struct pick {
	__u64 kick_ns;
	__u64 pick_ns;
	__u64 flags;	     /* PICK_* */
	__u64 last_start_ns; /* the thread's latest request start (own reads) */
	__u64 nvcsw;	     /* its voluntary context switches then */
	__u32 queue;	     /* VQ_*: the notifier the kick came through */
	__u32 hv_wait_ns;    /* the picking thread's CPU waits within kick -> pickup */
	__u64 call;	     /* the io_uring call that last punted under it */
	__u32 engine;	     /* the thread that picked it up (its pops: see take_pop) */
	__u32 _pad;
};

#define PICK_HANDED  (1 << 0) /* handed to a worker it woke (aio=threads) */
#define PICK_USED    (1 << 1) /* a worker submitted with it */
#define PICK_READ    (1 << 2) /* the thread's own pickup of the notifier */
#define PICK_TAKEN   (1 << 3) /* a request of its batch was submitted */
#define PICK_SPENT   (1 << 4) /* its batch is over: what follows was polled */
#define PICK_POLLS   (1 << 5) /* the thread has submitted polled requests */
#define PICK_ENTERED (1 << 6) /* a submitting call began since the pickup */

typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct pick);
} thread_picks_map_t;
extern thread_picks_map_t thread_picks SEC(".maps");

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

/* When an engine thread's device model took each request of its latest
 * pickup's batch (QEMU's block_acct_start, where its clock for the request
 * starts), reads and writes apart (deep tier): see take_pop. */
#define POPS	  32
#define POPS_MASK (POPS - 1)

struct pops {
	__u64 pick_ns; /* the pickup the stamps follow */
	__u32 head[2]; /* per op (read, write): next to take */
	__u32 tail[2]; /* next free */
	__u64 ts[2][POPS];
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, struct pops);
} thread_pops_map_t;
extern thread_pops_map_t thread_pops SEC(".maps");

/* io_uring requests an engine thread punted to an io-wq worker (a busy
 * device refused them without waiting): request (its kiocb, the first
 * member of io_kiocb) -> the submitting thread's pick, for the worker
 * that issues it. Per-CPU LRU lists: no lock shared by the CPUs. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(map_flags, BPF_F_NO_COMMON_LRU);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct pick);
} punted_picks_map_t;
extern punted_picks_map_t punted_picks SEC(".maps");

/* A VM thread's waits for a CPU (sched.bpf.c, deep tier): since when it is
 * runnable and not running (0: running or asleep), and its last RUN_WAITS
 * waits. */
struct run_waits {
	__u64 runnable_since;
	__u64 start[RUN_WAITS];
	__u64 end[RUN_WAITS];
	__u32 next; /* where the next wait goes, modulo RUN_WAITS */
	__u32 _pad;
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 8192);
	__type(key, __u32);
	__type(value, struct run_waits);
} thread_waits_map_t;
extern thread_waits_map_t thread_waits SEC(".maps");

/* The eventfds QEMU hands the kernel's vhost as a queue's kick
 * (VHOST_SET_VRING_KICK, deep tier): open file -> 1. A kick on one reaches
 * the worker inside the kernel (eventfd wake-up -> vhost_task), with no
 * read. */
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

/* The deep tier's signals: per VM slot, its requests completed on the
 * host and not yet made visible by a signal (signals.bpf.h). */
typedef struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} vm_signal_due_map_t;
extern vm_signal_due_map_t vm_signal_due SEC(".maps");

/* Each engine thread's pushes not yet sent (struct vm_pushes_event). */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct vm_pushes_event);
} thread_pushes_map_t;
extern thread_pushes_map_t thread_pushes SEC(".maps");

/* Source of a zeroed blk_stats for new vm_latency entries (too big for the
 * stack). */
extern const struct blk_stats zero_stats;

/* The tier of the moment (see struct tier_state). */
struct tier_state *tier_now(void);

int deep_tier(void);

/* Longer than the reader's own drain period while records come (25 ms), so
 * that a steady stream adds few wakeups to its timer's. */
#define EVENTS_WAKE_AFTER_NS (100 * 1000 * 1000ULL)

/* One record into the ring buffer, stamped last at `now_ns`; no room is
 * counted, never silent. */
int emit(void *rec, __u64 size, __u64 now_ns);

/* vCPU threads are named "CPU <n>/KVM" or "CPU <n>/TCG" (debug-threads=on,
 * as libvirt runs QEMU). */
int vcpu_comm(const char *c);

int in_vcpu(void);

/* QEMU's iothreads are named "IO <id>" (debug-threads=on, as libvirt runs
 * QEMU). They poll their queues before they sleep (poll-max-ns, 32 µs by
 * default): the only engine threads whose requests may come with no kick. */
int in_iothread(void);

/* The kernel's vhost workers are named "vhost-<owner pid>"; since v6.4
 * (vhost_task) they are threads of the owner, QEMU, so its requests and
 * signals reach the VM's slot through its tgid. */
int vhost_comm(const char *c);

int in_vhost_worker(void);

/* A field through a kernel pointer: a direct load in tp_btf programs
 * (their pointers are typed), a probe read in raw_tp ones. `btf` is a
 * constant at each inlined call site. */
#define READ(btf, p, f) ((btf) ? (p)->f : BPF_CORE_READ(p, f))

struct task_struct *current_task(int btf);

__u64 current_nvcsw(void);

struct vm_counts *vm_counts_of(__u32 vm);

#endif /* IOSPAN_HOST_BPF_H */
