/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The deep tier's signals: each used-ring push (virtqueue_flush,
 * vu_queue_push) ends one request, the oldest completed without one; an
 * interrupt (NVMe's msix_notify, a vhost worker's irqfd) ends every
 * completion before it. Per VM slot, vm_signal_due counts its requests
 * completed on the host and not yet made visible by a signal. Pushes are
 * recorded one by one (the correlator gives each to one request),
 * gathered per thread and sent when none waits any more; an interrupt
 * makes a record only when any waits, and clears them.
 */
#ifndef IOSPAN_SIGNALS_BPF_H
#define IOSPAN_SIGNALS_BPF_H

#include "host.bpf.h"

/* `n` more of a VM's pushes to wait for: a request completed on the host
 * (one), or guest requests merged into another (one each). */
void signal_due_n(__u32 vm, __u32 n);

void signal_due(__u32 vm);

/* The thread leaving its CPU sends what it gathered: it may not push
 * again for a while. */
void send_pushes_of(__u32 tid);

#endif /* IOSPAN_SIGNALS_BPF_H */
