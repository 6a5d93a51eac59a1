/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* Kernel layout differences, one getter each, named after the commit that
 * made them. Only here may a program look at two layouts of one struct. */
#ifndef IOSPAN_CORE_FIXES_BPF_H
#define IOSPAN_CORE_FIXES_BPF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

/* f3fa33acca9f ("block: remove the ->rq_disk field in struct request"),
 * v5.17: the disk is reached through the queue from then on. */
struct request___rq_disk {
	struct gendisk *rq_disk;
} __attribute__((preserve_access_index));

#define MINORBITS 20

__u32 rq_dev(struct request *rq);

/* The same for tp_btf programs, whose request pointer is BTF-typed and
 * read directly. */
__u32 rq_dev_btf(struct request *rq);

/* 309dca309fc3 ("block: store a block_device pointer in struct bio"),
 * v5.12: a bio names its block device (a partition's names its disk)
 * rather than the disk. The whole disk, as rq_dev names a request's. */
struct bio___bi_disk {
	struct gendisk *bi_disk;
} __attribute__((preserve_access_index));

__u32 bio_disk_dev(struct bio *bio);

#endif /* IOSPAN_CORE_FIXES_BPF_H */
