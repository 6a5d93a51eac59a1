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
__u8 op_class(__u32 cmd_flags);

#endif
