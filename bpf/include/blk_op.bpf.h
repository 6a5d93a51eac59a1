/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
#ifndef IOSPAN_BLK_OP_BPF_H
#define IOSPAN_BLK_OP_BPF_H

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "agent_abi.h"

/* include/linux/blk_types.h: the low REQ_OP_BITS of cmd_flags are the op;
 * a #define, so not in BTF. */
#define REQ_OP_MASK ((1 << 8) - 1)

/* The reported operation class of a request's cmd_flags. */
static __always_inline __u8 op_class(__u32 cmd_flags)
{
	switch (cmd_flags & REQ_OP_MASK) {
	case REQ_OP_READ:
		return BLK_OP_READ;
	case REQ_OP_WRITE:
		return BLK_OP_WRITE;
	case REQ_OP_FLUSH:
		return BLK_OP_FLUSH;
	case REQ_OP_DISCARD:
	case REQ_OP_SECURE_ERASE:
		return BLK_OP_DISCARD;
	default:
		return BLK_OP_OTHER;
	}
}

#endif
