//! Per-program kernel statistics (`struct bpf_prog_info`): run time, run
//! count and recursion misses.
//!
//! Run time and count are kept while BPF stats are enabled; recursion misses
//! always (each an invocation the kernel skipped because the program was already
//! running on that CPU — a lost event).

use std::{
    io,
    os::fd::{AsRawFd, BorrowedFd},
};

use serde::{Deserialize, Serialize};

/// Has the kernel keep every program's run time and count while the
/// returned descriptor is open (they cost a clock read per run).
pub fn keep_run_times() -> Result<std::os::fd::OwnedFd, aya::sys::SyscallError> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime)
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ProgStats {
    pub name: String,
    pub run_time_ns: u64,
    pub run_count: u64,
    pub recursion_misses: u64,
}

/// Offsets in `struct bpf_prog_info` (include/uapi/linux/bpf.h), stable
/// since v5.12; the kernel copies only as much as we ask for.
const INFO_WORDS: usize = 27;
const RUN_TIME_NS: usize = 192 / 8;
const RUN_CNT: usize = 200 / 8;
const RECURSION_MISSES: usize = 208 / 8;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

pub fn read(fd: BorrowedFd<'_>) -> io::Result<ProgStats> {
    let mut info = [0u64; INFO_WORDS];
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: std::mem::size_of_val(&info) as u32,
        info: info.as_mut_ptr() as u64,
    };
    // SAFETY: attr points at a live buffer of info_len bytes; the kernel
    // writes at most that many.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            &mut attr as *mut InfoAttr,
            std::mem::size_of::<InfoAttr>() as u32,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ProgStats {
        name: String::new(),
        run_time_ns: info[RUN_TIME_NS],
        run_count: info[RUN_CNT],
        recursion_misses: info[RECURSION_MISSES],
    })
}
