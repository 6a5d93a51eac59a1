/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
#ifndef IOSPAN_MAPS_BPF_H
#define IOSPAN_MAPS_BPF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "agent_abi.h"

/* Lost and degraded events, per CPU; see enum counter. Defined once per
 * object (`counters_map_t counters SEC(".maps");`): an object linked from
 * several files shares it. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NR_COUNTERS);
	__type(key, __u32);
	__type(value, __u64);
} counters_map_t;
extern counters_map_t counters SEC(".maps");

/* Programs of different contexts (task, softirq, hardirq) share a CPU's
 * counters, hence the atomic add even on per-CPU values. */
static __always_inline void count(__u32 which)
{
	__u64 *c = bpf_map_lookup_elem(&counters, &which);

	if (c)
		__sync_fetch_and_add(c, 1);
}

/* The entry for `key`, made from `init` if there is none yet (NULL when the
 * map is full). Two CPUs racing to make it both end on the one that won. */
static __always_inline void *lookup_or_init(void *map, const void *key, const void *init)
{
	void *v = bpf_map_lookup_elem(map, key);

	if (v)
		return v;
	bpf_map_update_elem(map, key, init, BPF_NOEXIST);
	return bpf_map_lookup_elem(map, key);
}

#endif /* IOSPAN_MAPS_BPF_H */
