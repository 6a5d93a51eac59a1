/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * Log-linear histogram bucketing (bpf/hist.c), shared by the eBPF programs
 * and the native test that pins agent/src/model/hist.rs to the same bucket
 * boundaries.
 * Loop-free so the verifier sees a constant instruction count.
 */
#ifndef IOSPAN_HIST_H
#define IOSPAN_HIST_H

#include "agent_abi.h"

/* Values below 2*HIST_SUB get a bucket of their own; above that each power
 * of two [2^e, 2^(e+1)) is cut into HIST_SUB equal buckets, so a bucket is
 * at most 1/HIST_SUB (12.5%) wide relative to its lower bound. */
__u32 hist_bucket(__u64 v);

#endif /* IOSPAN_HIST_H */
