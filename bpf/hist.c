/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* Log-linear histogram bucketing (hist.h), compiled into the objects that
 * keep histograms and natively for the tests. */
#ifdef __bpf__
#include "vmlinux.h"
#endif
#include "hist.h"
#include "linked.h"

/* floor(log2(v)) for v > 0, by halving the search window. */
static __always_inline __u32 log2_u64(__u64 v)
{
	__u32 r = 0, s;

	s = (v > 0xFFFFFFFFULL) << 5;
	v >>= s;
	r |= s;
	s = (v > 0xFFFF) << 4;
	v >>= s;
	r |= s;
	s = (v > 0xFF) << 3;
	v >>= s;
	r |= s;
	s = (v > 0xF) << 2;
	v >>= s;
	r |= s;
	s = (v > 0x3) << 1;
	v >>= s;
	r |= s;
	r |= (__u32)(v >> 1);
	return r;
}

__inline_linked __u32 hist_bucket(__u64 v)
{
	__u32 e, sub;

	if (v < 2 * HIST_SUB)
		return (__u32)v;
	e = log2_u64(v);
	if (e > HIST_MAX_LOG2)
		return HIST_BUCKETS - 1;
	sub = (__u32)(v >> (e - HIST_SUB_BITS)) & (HIST_SUB - 1);
	return (e - HIST_SUB_BITS + 1) * HIST_SUB + sub;
}
