/* SPDX-License-Identifier: GPL-2.0 */
/* The host object's shared state: the maps and settings host.bpf.h
 * declares, and the functions over them. */
#include "host.bpf.h"
#include "linked.h"

const volatile __u64 targ_wakeup_bytes = 256 << 10; /* wake the reader past this backlog */
events_map_t events SEC(".maps");
__u64 events_woken_ns = 0;
const struct blk_stats zero_stats = {};

/* Attribute requests to VMs (processes in vm_pids) and keep vm_latency. */
const volatile __u32 targ_track_vms = 0;

/* Split VMs' host windows (kicks, pickups, signals); needs targ_track_vms. */
const volatile __u32 targ_vm_segments = 0;

/* Addresses of the direct-I/O completion functions, in enum dio_kind's
 * order (from kallsyms; 0 when absent). */
const volatile __u64 targ_dio_end_io[NR_DIO_END_IO] = {};
tier_map_t tier SEC(".maps");
vm_pids_map_t vm_pids SEC(".maps");
vm_flags_map_t vm_flags SEC(".maps");
vm_counts_map_t vm_counts SEC(".maps");
vm_gen_map_t vm_gen SEC(".maps");
vdisk_files_map_t vdisk_files SEC(".maps");
vm_latency_map_t vm_latency SEC(".maps");
vm_latency_nested_map_t vm_latency_nested SEC(".maps");
vm_undelivered_map_t vm_undelivered SEC(".maps");
vm_disks_map_t vm_disks SEC(".maps");
file_kicks_map_t file_kicks SEC(".maps");
thread_kicks_map_t thread_kicks SEC(".maps");
threads_kicked_map_t threads_kicked SEC(".maps");
thread_picks_map_t thread_picks SEC(".maps");
vm_last_pick_map_t vm_last_pick SEC(".maps");
thread_pops_map_t thread_pops SEC(".maps");
punted_picks_map_t punted_picks SEC(".maps");
thread_waits_map_t thread_waits SEC(".maps");
vhost_kick_files_map_t vhost_kick_files SEC(".maps");
vhost_kicks_map_t vhost_kicks SEC(".maps");
vm_signal_due_map_t vm_signal_due SEC(".maps");
thread_pushes_map_t thread_pushes SEC(".maps");
vm_raised_map_t vm_raised SEC(".maps");

__inline_linked void vm_gen_bump(void)
{
	__u32 zero = 0, *g = bpf_map_lookup_elem(&vm_gen, &zero);

	if (g)
		__sync_fetch_and_add(g, 1);
}

__inline_linked __u32 vm_gen_now(void)
{
	__u32 zero = 0, *g = bpf_map_lookup_elem(&vm_gen, &zero);

	return g ? *g : 0;
}

__inline_linked struct vm_proc *vm_proc_of(__u32 tgid)
{
	return bpf_map_lookup_elem(&vm_pids, &tgid);
}

__inline_linked void vm_proc_set_state(struct vm_proc *p, __u32 state)
{
	if (p->state == state)
		return;
	p->state = state;
	vm_gen_bump();
}

__inline_linked struct tier_state *tier_now(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&tier, &zero);
}

__inline_linked int deep_tier(void)
{
	struct tier_state *t = tier_now();

	return t && t->deep;
}

/* No wakeup per record: the reader drains on a timer while records come,
 * and is woken when the backlog grows past targ_wakeup_bytes or by the
 * first record after a quiet spell (EVENTS_WAKE_AFTER_NS), so that an
 * idle reader can sleep without a timer waking it and still sees a new
 * stream of records at once. `now_ns` is the record's own latest stamp
 * (no clock read of its own); an older one than the last wake's wakes
 * nobody. Two CPUs racing on the stamp wake it twice. */
static __always_inline __u64 wakeup_flags(__u64 now_ns)
{
	if ((__s64)(now_ns - events_woken_ns) >= (__s64)EVENTS_WAKE_AFTER_NS ||
	    bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) >= targ_wakeup_bytes) {
		events_woken_ns = now_ns;
		return BPF_RB_FORCE_WAKEUP;
	}
	return BPF_RB_NO_WAKEUP;
}

__inline_linked int emit(void *rec, __u64 size, __u64 now_ns)
{
	if (bpf_ringbuf_output(&events, rec, size, wakeup_flags(now_ns))) {
		count(CNT_RINGBUF_DROPS);
		return -1;
	}
	return 0;
}

__inline_linked int vcpu_comm(const char *c)
{
	return c[0] == 'C' && c[1] == 'P' && c[2] == 'U' && c[3] == ' ';
}

__inline_linked int in_vcpu(void)
{
	char c[16];

	bpf_get_current_comm(c, sizeof(c));
	return vcpu_comm(c);
}

__inline_linked int in_iothread(void)
{
	char c[16];

	bpf_get_current_comm(c, sizeof(c));
	return c[0] == 'I' && c[1] == 'O' && c[2] == ' ';
}

__inline_linked int vhost_comm(const char *c)
{
	return c[0] == 'v' && c[1] == 'h' && c[2] == 'o' && c[3] == 's' && c[4] == 't' &&
	       c[5] == '-';
}

__inline_linked int in_vhost_worker(void)
{
	char c[16];

	bpf_get_current_comm(c, sizeof(c));
	return vhost_comm(c);
}

__inline_linked struct task_struct *current_task(int btf)
{
	return btf ? bpf_get_current_task_btf() : (struct task_struct *)bpf_get_current_task();
}

__inline_linked __u64 current_nvcsw(void)
{
	struct task_struct *t = (struct task_struct *)bpf_get_current_task();

	return BPF_CORE_READ(t, nvcsw);
}

static __always_inline __u64 *kicked_word(__u32 tid)
{
	__u32 idx = (tid / 64) % (THREADS_KICKED_BITS / 64);

	return bpf_map_lookup_elem(&threads_kicked, &idx);
}

__inline_linked struct thread_kicks *thread_kicks_of(__u32 tid)
{
	__u64 *w = kicked_word(tid);

	if (!w || !(*w & (1ULL << (tid % 64))))
		return 0;
	return bpf_map_lookup_elem(&thread_kicks, &tid);
}

__inline_linked void mark_thread_kicked(__u32 tid)
{
	__u64 *w = kicked_word(tid), bit = 1ULL << (tid % 64);

	if (w && !(*w & bit))
		__sync_fetch_and_or(w, bit);
}

__inline_linked struct vm_counts *vm_counts_of(__u32 vm)
{
	__u32 idx = vm & (MAX_VM_COUNTS - 1);

	return bpf_map_lookup_elem(&vm_counts, &idx);
}
