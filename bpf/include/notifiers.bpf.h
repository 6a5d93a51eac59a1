/* SPDX-License-Identifier: GPL-2.0 */
/*
 * A VM's queue notifiers as the deep tier learns them from their
 * registration (notifiers.bpf.c): the eventfds a vCPU thread creates, or
 * any thread once the guest ran, and the notify addresses QEMU registers
 * with KVM (KVM_IOEVENTFD). System-call tracepoints: attached only while
 * the deep tier runs.
 */
#ifndef IOSPAN_NOTIFIERS_BPF_H
#define IOSPAN_NOTIFIERS_BPF_H

#include "host.bpf.h"

struct fd_key {
	__u32 tgid;
	__u32 fd;
};

/* The open file behind the current process's `fd` (0 if none). */
__u64 fd_file(__u32 fd);

/* The queue notifiers of VMs started while the deep tier runs: (tgid, fd)
 * of each eventfd a vCPU thread created or any thread created once the
 * guest ran. QEMU makes its loop notifiers (main loop, iothreads) before
 * the guest runs; a queue's host notifier when the guest driver starts the
 * device (virtio-blk, in the vCPU thread) or sets up doorbell buffers
 * (NVMe with ioeventfd=on, in the engine). A vCPU also writes the loop
 * notifiers (timer changes wake the main loop): counted as kicks, they
 * would hand a request held in the engine a later notification. */
struct notifier {
	__u8 kicked; /* a guest kicked it: it counts as open (vm_open_notifiers) */
	__u8 _pad;
	__u16 queue; /* VQ_*: which guest queue it notifies */
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct fd_key);
	__type(value, struct notifier);
} vq_notifiers_map_t;
extern vq_notifiers_map_t vq_notifiers SEC(".maps");

/* Open queue notifiers per VM (tgid -> count): the VM has stopped when the
 * last one closes, not at any one (QEMU re-creates some while running).
 * Only notifiers a guest has kicked count: QEMU also makes and closes
 * eventfds of its own while the guest runs (event notifiers of new
 * contexts), which must not make a running VM look stopped. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __s64);
} vm_open_notifiers_map_t;
extern vm_open_notifiers_map_t vm_open_notifiers SEC(".maps");

/* VMs whose notifiers are known (exec'd while the deep tier watched):
 * tgid -> 1. A VM found already running has kicks taken from any eventfd
 * its vCPUs write. */
typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u8);
} vm_notifiers_known_map_t;
extern vm_notifiers_known_map_t vm_notifiers_known SEC(".maps");

/* Under KVM, a notify address QEMU registered (KVM_IOEVENTFD): (tgid,
 * guest physical address) -> eventfd. */
struct gpa_key {
	__u32 tgid;
	__u32 _pad;
	__u64 gpa;
};

typedef struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct gpa_key);
	__type(value, __u32);
} kvm_notify_addrs_map_t;
extern kvm_notify_addrs_map_t kvm_notify_addrs SEC(".maps");

/* A queue notifier's first kick: from now on it counts as open. */
void note_kicked(const struct fd_key *k, struct notifier *n);

/* A kick on `file`: pending for the engine reading it, or, on a vhost
 * kick eventfd, for the VM's vhost worker. */
void note_file_kick(__u32 tgid, __u64 file, __u16 queue);

/* A guest's first kick: it runs (a stopped VM runs again only when a
 * queue notifier is made again). */
void mark_started(__u32 tgid);

#endif /* IOSPAN_NOTIFIERS_BPF_H */
