/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
#ifndef IOSPAN_MAPS_BPF_H
#define IOSPAN_MAPS_BPF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "agent_abi.h"

/* Lost and degraded events, per CPU; see enum counter. Defined in
 * maps.bpf.c, which each object that counts links. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NR_COUNTERS);
	__type(key, __u32);
	__type(value, __u64);
} counters_map_t;
extern counters_map_t counters SEC(".maps");

/* Programs of different contexts (task, softirq, hardirq) share a CPU's
 * counters, hence the atomic add even on per-CPU values. */
void count(__u32 which);

/* The entry for `key`, made from `init` if there is none yet (NULL when the
 * map is full). Two CPUs racing to make it both end on the one that won. */
void *lookup_or_init(void *map, const void *key, const void *init);

#endif /* IOSPAN_MAPS_BPF_H */
