/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* Reads whose fields moved between kernel releases (CO-RE). */
#include "core_fixes.bpf.h"
#include "linked.h"

__inline_linked __u32 rq_dev(struct request *rq)
{
	struct gendisk *disk;

	if (bpf_core_field_exists(struct request___rq_disk, rq_disk))
		disk = BPF_CORE_READ((struct request___rq_disk *)rq, rq_disk);
	else
		disk = BPF_CORE_READ(rq, q, disk);
	if (!disk)
		return 0;
	return ((__u32)BPF_CORE_READ(disk, major) << MINORBITS) |
	       (__u32)BPF_CORE_READ(disk, first_minor);
}

__inline_linked __u32 rq_dev_btf(struct request *rq)
{
	struct gendisk *disk;

	if (bpf_core_field_exists(struct request___rq_disk, rq_disk))
		disk = ((struct request___rq_disk *)rq)->rq_disk;
	else
		disk = rq->q->disk;
	if (!disk)
		return 0;
	return ((__u32)disk->major << MINORBITS) | (__u32)disk->first_minor;
}

__inline_linked __u32 bio_disk_dev(struct bio *bio)
{
	struct gendisk *disk;

	if (bpf_core_field_exists(struct bio___bi_disk, bi_disk))
		disk = BPF_CORE_READ((struct bio___bi_disk *)bio, bi_disk);
	else
		disk = BPF_CORE_READ(bio, bi_bdev, bd_disk);
	if (!disk)
		return 0;
	return ((__u32)BPF_CORE_READ(disk, major) << MINORBITS) |
	       (__u32)BPF_CORE_READ(disk, first_minor);
}
