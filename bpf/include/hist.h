/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Log-linear histogram bucketing, shared by the eBPF programs and the native
 * test that pins agent/src/model/hist.rs to the same bucket boundaries.
 * Loop-free so the verifier sees a constant instruction count.
 */
#ifndef IOSPAN_HIST_H
#define IOSPAN_HIST_H

#include "agent_abi.h"

#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif

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

/* Values below 2*HIST_SUB get a bucket of their own; above that each power
 * of two [2^e, 2^(e+1)) is cut into HIST_SUB equal buckets, so a bucket is
 * at most 1/HIST_SUB (12.5%) wide relative to its lower bound. */
static __always_inline __u32 hist_bucket(__u64 v)
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

#endif /* IOSPAN_HIST_H */
