/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Wake-ups nested in a wake-up. A task waking itself runs the sched_waking
 * and sched_wakeup tracepoints with interrupts on: an interrupt's own
 * wake-up nested there finds the program already running on that CPU, and
 * the kernel skips it (a recursion miss). A second program on the same
 * tracepoint acts only then — while the first one's mark is up on this
 * CPU — so a wake-up is lost only at a third level, and that program's
 * misses are the ones counted.
 */
#ifndef IOSPAN_NESTING_BPF_H
#define IOSPAN_NESTING_BPF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

enum wake_nest {
	NEST_WAKING,
	NEST_WAKEUP,
	NEST_SLOTS,
};

/* Per CPU and tracepoint: the first program is running. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NEST_SLOTS);
	__type(key, __u32);
	__type(value, __u32);
} wake_nesting_map_t;
extern wake_nesting_map_t wake_nesting SEC(".maps");

/* The first program's mark, up while it runs (no two of it run on one
 * CPU: the kernel sees to that). */
__u32 *nest_enter(__u32 slot);

void nest_leave(__u32 *mark);

/* In the second program: whether the first is running below it. */
int nested_in(__u32 slot);

/*
 * A wake-up tracepoint's two programs: `first` marks its CPU while `body`
 * runs; `second` runs `body` only under that mark, counting `counter`.
 * `body` sees the tracepoint's task as `p`.
 */
#define NESTED_WAKE_PROGRAMS(sec, first, second, slot, counter, body) \
	SEC(sec)                                                      \
	int BPF_PROG(first, struct task_struct *p)                    \
	{                                                             \
		__u32 *mark = nest_enter(slot);                       \
		body;                                                 \
		nest_leave(mark);                                     \
		return 0;                                             \
	}                                                             \
	SEC(sec)                                                      \
	int BPF_PROG(second, struct task_struct *p)                   \
	{                                                             \
		if (nested_in(slot)) {                                \
			count(counter);                               \
			body;                                         \
		}                                                     \
		return 0;                                             \
	}

#endif /* IOSPAN_NESTING_BPF_H */
