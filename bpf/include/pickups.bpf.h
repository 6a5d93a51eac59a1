/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Kicks and their pickups, as the programs that see them hand them on:
 * a kick waits for its engine thread (file_kicks, thread_kicks); the
 * pickup makes it the thread's pick (thread_picks), which the requests the
 * thread then starts take (vm_request.bpf.h).
 */
#ifndef IOSPAN_PICKUPS_BPF_H
#define IOSPAN_PICKUPS_BPF_H

#include "host.bpf.h"
#include "scsi_target.bpf.h"

/* Functions of their own (pickups.bpf.c), each verified once rather
 * than at every caller: their loops over a thread's slots made the
 * programs that inline them among the slowest to load. */

/* How long thread `tid`, running now, waited for a CPU within [from, to]
 * (deep tier only: thread_waits is kept there). */
__u32 waited_within(__u32 tid, __u64 from, __u64 to);

/* Thread `tid`'s earliest kick waiting in thread_kicks, picked up at
 * `now` (0: read the clock): whether there was one. */
int pick_up_thread_kick(__u32 tgid, __u32 tid, __u64 now, __u64 nvcsw);

/* A thread going to sleep with kicks waiting (`k`, its thread_kicks): an
 * engine sleeps only once every notifier ready before it has been read,
 * so each kick waiting for it came before and was taken — by a batch, or
 * by a read that found the queue already served (a guest may queue more
 * requests, and kick again, between the engine's read and its pop). Such a kick never has a submitting call of
 * its own: without this, the queue's next batch would take it. */
void kicks_read_by_sleep(struct thread_kicks *k);

/* The switch-in of thread `tid` after a kick: a pickup if the thread has
 * slept since its last submission (`nvcsw`: its voluntary switches now);
 * one back from a preemption is in the middle of its work, whose requests
 * are not the kick's. */
void pick_after_sleep(__u32 tgid, __u32 tid, __u64 now, __u64 nvcsw);

/* An engine thread submitting under its own pick at `now` (a request's
 * start, or its punt to an io-wq worker): the pick's batch is taken, or,
 * when an earlier call spent it, the request was found by polling. */
int take_pick(struct pick *p, __u64 now, __u64 nvcsw);

/* The stamp of the next request of op `op` that thread `tid` (or a worker
 * it queued requests to) starts under pickup `pick_ns`, or `pick_ns` when
 * it has none. A pickup reads a notifier once for the whole batch, and
 * each request then waits its turn behind the ones taken before it, which
 * is not engine time of its own; a polling iothread takes more requests
 * under one pickup, long after its read. A request takes the oldest stamp
 * of its op (the batch is submitted in sector order, and workers start
 * what they were queued in any order: exact for the batch's sum, not for
 * each request, and never after the request's own start); a batch of more
 * than POPS of an op, and requests the device model took without
 * accounting, keep the pickup. Workers on several CPUs take from one
 * thread's stamps: the take is atomic. */
__u64 take_pop(__u32 tid, __u64 pick_ns, __u32 op);

/* The VM's vhost worker taking its pending kick (deep tier: its kick
 * eventfds known from VHOST_SET_VRING_KICK), if there is one: when it is
 * switched in, or, when the kick came while it ran (no wake-up needed), at
 * its next submission (the worker's queueing then counts as the
 * hypervisor's). */
void claim_vhost_kick(__u32 tgid, __u32 tid);

#endif /* IOSPAN_PICKUPS_BPF_H */
