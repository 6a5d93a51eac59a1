/* SPDX-License-Identifier: GPL-2.0 */
/* Programs run inside another one on the same CPU (nesting.bpf.h). */
#include "nesting.bpf.h"
#include "linked.h"

wake_nesting_map_t wake_nesting SEC(".maps");

__inline_linked __u32 *nest_enter(__u32 slot)
{
	__u32 *mark = bpf_map_lookup_elem(&wake_nesting, &slot);

	if (mark)
		*mark = 1;
	return mark;
}

__inline_linked void nest_leave(__u32 *mark)
{
	if (mark)
		*mark = 0;
}

__inline_linked int nested_in(__u32 slot)
{
	__u32 *mark = bpf_map_lookup_elem(&wake_nesting, &slot);

	return mark && *mark;
}
