/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* An object's loss counters, and the lookup that makes an entry. */
#include "maps.bpf.h"
#include "linked.h"

counters_map_t counters SEC(".maps");

__inline_linked void count(__u32 which)
{
	__u64 *c = bpf_map_lookup_elem(&counters, &which);

	if (c)
		__sync_fetch_and_add(c, 1);
}

__inline_linked void *lookup_or_init(void *map, const void *key, const void *init)
{
	void *v = bpf_map_lookup_elem(map, key);

	if (v)
		return v;
	bpf_map_update_elem(map, key, init, BPF_NOEXIST);
	return bpf_map_lookup_elem(map, key);
}
