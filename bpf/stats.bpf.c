/* SPDX-License-Identifier: GPL-2.0 */
/* Block statistics per disk and per VM disk: each finished request's
 * histograms and sums. */
#include "stats.bpf.h"
#include "linked.h"

#define PLAIN_ADD(dst, v)  ((dst) += (v))
#define ATOMIC_ADD(dst, v) __sync_fetch_and_add(&(dst), (v))
#define PLAIN_MAX(dst, v)            \
	do {                         \
		if ((v) > (dst))     \
			(dst) = (v); \
	} while (0)
/* One attempt: losing to a concurrent nested update on another CPU leaves
 * the smaller of two maxima, and both are rare. */
#define ATOMIC_MAX(dst, v)                                             \
	do {                                                           \
		__u64 __o = (dst);                                     \
		if ((v) > __o)                                         \
			__sync_val_compare_and_swap(&(dst), __o, (v)); \
	} while (0)

#define DEFINE_ACCOUNT(name, ADD, MAX)                                                            \
	static __always_inline void name(struct blk_stats *st, const struct rq_outcome *o,        \
					 const __u64 seg[BLK_NR_SEGS], __u32 nr_bytes, int final) \
	{                                                                                         \
		int i;                                                                            \
                                                                                                  \
		ADD(st->bytes, nr_bytes);                                                         \
		if (!final)                                                                       \
			return;                                                                   \
		ADD(st->ios, 1);                                                                  \
		if (o->flags & RQ_F_ERROR)                                                        \
			ADD(st->errors, 1);                                                       \
		if (o->flags & RQ_F_REQUEUED)                                                     \
			ADD(st->requeued, 1);                                                     \
		if (o->flags & RQ_F_PARTIAL)                                                      \
			ADD(st->partial, 1);                                                      \
		for (i = 0; i < BLK_NR_SEGS; i++) {                                               \
			__u64 v = seg[i];                                                         \
			__u32 b;                                                                  \
                                                                                                  \
			if (v == ~0ULL)                                                           \
				continue;                                                         \
			b = hist_bucket(v);                                                       \
			if (b >= HIST_BUCKETS)                                                    \
				b = HIST_BUCKETS - 1;                                             \
			ADD(st->hist[i][b], 1);                                                   \
			ADD(st->sum_ns[i], v);                                                    \
			MAX(st->max_ns[i], v);                                                    \
		}                                                                                 \
	}

DEFINE_ACCOUNT(account_plain, PLAIN_ADD, PLAIN_MAX)
DEFINE_ACCOUNT(account_atomic, ATOMIC_ADD, ATOMIC_MAX)

/* The entry of a blk_stats table for `key`; in a hash table it is created
 * zeroed when missing (a full table is counted: only the VM tables are
 * hashes, an array entry always exists). */
static __always_inline struct blk_stats *stats_entry(void *map, void *key)
{
	struct blk_stats *st = lookup_or_init(map, key, &zero_stats);

	if (!st)
		count(CNT_VM_TABLE_FULL);
	return st;
}

__inline_linked void account(void *map, void *nested, void *key, const struct rq_outcome *o,
			     const __u64 seg[BLK_NR_SEGS], __u32 nr_bytes, int final)
{
	struct blk_stats *st = stats_entry(map, key);

	if (!st)
		return;
	if (st->busy) {
		st = stats_entry(nested, key);
		if (st)
			account_atomic(st, o, seg, nr_bytes, final);
		return;
	}
	st->busy = 1;
	asm volatile("" ::: "memory");
	account_plain(st, o, seg, nr_bytes, final);
	asm volatile("" ::: "memory");
	st->busy = 0;
}
