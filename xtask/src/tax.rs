//! What tracing costs work that is not a VM's, measured from inside it:
//! a thread living on system calls, and two threads handing a byte back
//! and forth (every hand-over a wake-up and a context switch, where the
//! scheduler's tracepoints run). Each rate is per second of the threads'
//! own CPU time, free of how the scheduler shares the CPUs with the load
//! beside them.

use std::{
    io::{Read, Write},
    os::unix::net::UnixStream,
    time::{Duration, Instant},
};

/// This thread's CPU time, seconds.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// 1-byte reads of /dev/zero and writes to /dev/null for `d`: pairs per
/// second of this thread's own CPU time (what the kernel's slow system-call
/// path would add to).
pub fn syscall_pairs_per_cpu_s(d: Duration) -> std::io::Result<f64> {
    use std::os::fd::AsRawFd;
    let zero = std::fs::File::open("/dev/zero")?;
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    let mut b = [0u8; 1];
    let (t0, c0) = (Instant::now(), thread_cpu_s());
    let mut pairs = 0u64;
    while t0.elapsed() < d {
        for _ in 0..1000 {
            // SAFETY: reads and writes one byte of a live buffer on open fds.
            unsafe {
                libc::read(zero.as_raw_fd(), b.as_mut_ptr().cast(), 1);
                libc::write(null.as_raw_fd(), b.as_ptr().cast(), 1);
            }
        }
        pairs += 1000;
    }
    Ok(pairs as f64 / (thread_cpu_s() - c0).max(1e-9))
}

/// Round trips of one byte between this thread and a partner for `d`
/// (each side blocks in its read until the other writes): round trips per
/// second of the two threads' CPU time.
pub fn round_trips_per_cpu_s(d: Duration) -> std::io::Result<f64> {
    let (mut near, mut far) = UnixStream::pair()?;
    let partner = std::thread::Builder::new().name("tax-pong".into()).spawn(
        move || -> std::io::Result<f64> {
            let c0 = thread_cpu_s();
            let mut b = [0u8; 1];
            loop {
                far.read_exact(&mut b)?;
                if b[0] == 0 {
                    return Ok(thread_cpu_s() - c0);
                }
                far.write_all(&b)?;
            }
        },
    )?;
    let (t0, c0) = (Instant::now(), thread_cpu_s());
    let mut trips = 0u64;
    let mut b = [1u8; 1];
    while t0.elapsed() < d {
        for _ in 0..100 {
            near.write_all(&[1])?;
            near.read_exact(&mut b)?;
        }
        trips += 100;
    }
    let mine = thread_cpu_s() - c0;
    near.write_all(&[0])?;
    let theirs = partner
        .join()
        .map_err(|_| std::io::Error::other("the partner thread panicked"))??;
    Ok(trips as f64 / (mine + theirs).max(1e-9))
}
