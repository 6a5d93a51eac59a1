/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/* The reported operation class of a request. */
#include "blk_op.bpf.h"
#include "linked.h"

__inline_linked __u8 op_class(__u32 cmd_flags)
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
