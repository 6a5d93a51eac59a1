/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Block statistics (struct blk_stats) updated per request: per-CPU
 * entries, with a busy mark for the nested case (a program can nest on one
 * CPU across task, softirq and hardirq context), whose update goes,
 * atomically, to a shared table instead.
 */
#ifndef IOSPAN_STATS_BPF_H
#define IOSPAN_STATS_BPF_H

#include "host.bpf.h"
#include "hist.h"
#include "rq_account.h"

/* Updates `map`'s per-CPU entry for `key`, or, when this CPU is already in
 * the middle of updating it (a nested run), `nested`'s shared entry,
 * atomically. Nesting is strictly LIFO on a CPU: a nested run either
 * finishes before we set busy, or sees it set. The barriers keep the
 * compiler from moving the updates outside the busy window. */
void account(void *map, void *nested, void *key, const struct rq_outcome *o,
	     const __u64 seg[BLK_NR_SEGS], __u32 nr_bytes, int final);

#endif /* IOSPAN_STATS_BPF_H */
