//! The run's clock and its command: progress on the terminal, the
//! deadline, the traced command stopped on the way out.

use std::{
    io::IsTerminal,
    time::{Duration, Instant},
};

pub(super) async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// SIGTERM, then SIGKILL if it has not gone after a grace period.
pub(super) async fn terminate(child: &mut tokio::process::Child) {
    if let Some(pid) = child
        .id()
        .and_then(|p| rustix::process::Pid::from_raw(p as i32))
    {
        // Gone already is what we want.
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    if tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

pub(super) struct Progress {
    /// One line redrawn in place (a terminal of its own), else a line
    /// every `every`.
    in_place: bool,
    every: Duration,
    quiet: bool,
    last_line: std::cell::Cell<Option<Instant>>,
}

impl Progress {
    /// `beside_command`: a traced command writes to the same terminal (it
    /// inherits it), and a line redrawn in place would share a line with
    /// its output; whole lines are written then, every few seconds.
    pub(super) fn new(quiet: bool, beside_command: bool) -> Self {
        let tty = std::io::stderr().is_terminal();
        Self {
            in_place: tty && !beside_command,
            // Logs and CI get a line every ten seconds, not a
            // carriage-return stream.
            every: Duration::from_secs(if tty { 5 } else { 10 }),
            quiet,
            last_line: std::cell::Cell::new(None),
        }
    }

    pub(super) fn show(&self, elapsed: Duration, ios: u64) {
        if self.quiet {
            return;
        }
        let secs = elapsed.as_secs_f64();
        let line = format!(
            "iospan: {secs:6.1} s  {ios:>12} I/Os  {:>10.0} IOPS",
            ios as f64 / secs.max(1e-9)
        );
        if self.in_place {
            eprint!("\r{line}");
        } else if self
            .last_line
            .get()
            .is_none_or(|t| t.elapsed() >= self.every)
        {
            eprintln!("{line}");
            self.last_line.set(Some(Instant::now()));
        }
    }

    pub(super) fn done(&self) {
        if self.in_place && !self.quiet {
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The demo's first screen: QEMU's console shares the terminal, and
    /// a line redrawn in place ran into its lines.
    #[test]
    fn beside_a_command_progress_is_whole_lines() {
        let p = Progress::new(false, true);
        assert!(!p.in_place);
        assert!(p.every >= Duration::from_secs(5));
        let alone = Progress::new(false, false);
        assert_eq!(alone.in_place, std::io::stderr().is_terminal());
    }
}
