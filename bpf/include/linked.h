/* SPDX-License-Identifier: (GPL-2.0 OR Apache-2.0) */
/*
 * The mark of a function one file defines and others call. The objects are
 * linked from their files, then each such function inlined where it is
 * called (agent/build.rs), so the verifier sees every program whole, as it
 * would a static inline of a header. Not `inline`: C would then leave the
 * linker no definition. Natively (the tests' shim) it is a plain function.
 */
#ifndef IOSPAN_LINKED_H
#define IOSPAN_LINKED_H

#ifdef __bpf__
#define __inline_linked __attribute__((always_inline))
#else
#define __inline_linked
#endif

/* A file's own helpers, inlined where they are called (libbpf's, for the
 * pure files compiled without it). */
#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif

#endif /* IOSPAN_LINKED_H */
