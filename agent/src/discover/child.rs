//! Another program's answer, bounded: libvirt's client runs for at most a
//! deadline and prints at most so much, however libvirtd or a domain
//! behaves. Past the deadline it is killed, not waited for.

use std::{
    io::Read,
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

/// `cmd`'s exit and output, within `within`; each stream kept up to `cap`
/// bytes (the rest read and dropped, so the program never blocks on a
/// full pipe).
pub fn output_within(cmd: &mut Command, within: Duration, cap: usize) -> Result<Output> {
    let name = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let until = Instant::now() + within;
    let out = child.stdout.take().map(|s| drain(s, cap));
    let err = child.stderr.take().map(|s| drain(s, cap));
    let status = match wait_until(&mut child, until) {
        Some(s) => s,
        None => {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{name} gave no answer within {within:?} (stopped)");
        }
    };
    // A pipe a program's own child still holds open ends at the deadline.
    let collect = |rx: Option<std::sync::mpsc::Receiver<Vec<u8>>>| {
        rx.and_then(|rx| {
            rx.recv_timeout(until.saturating_duration_since(Instant::now()))
                .ok()
        })
        .unwrap_or_default()
    };
    Ok(Output {
        status,
        stdout: collect(out),
        stderr: collect(err),
    })
}

/// Reads `r` to its end on a thread of its own, keeping `cap` bytes.
fn drain(mut r: impl Read + Send + 'static, cap: usize) -> std::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let mut chunk = [0u8; 16 << 10];
        while let Ok(n) = r.read(&mut chunk) {
            if n == 0 {
                break;
            }
            let room = cap.saturating_sub(kept.len());
            kept.extend_from_slice(chunk.get(..n.min(room)).unwrap_or_default());
        }
        let _ = tx.send(kept);
    });
    rx
}

fn wait_until(child: &mut Child, until: Instant) -> Option<std::process::ExitStatus> {
    let mut pause = Duration::from_millis(1);
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        let now = Instant::now();
        if now >= until {
            return None;
        }
        std::thread::sleep(pause.min(until - now));
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_past_its_deadline_is_stopped() {
        let t = Instant::now();
        let e = output_within(
            Command::new("sleep").arg("30"),
            Duration::from_millis(300),
            1024,
        )
        .unwrap_err();
        assert!(format!("{e}").contains("no answer within"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[test]
    fn a_program_printing_without_end_is_kept_to_the_cap() {
        let out = output_within(
            Command::new("head").args(["-c", "10000000", "/dev/zero"]),
            Duration::from_secs(10),
            4096,
        )
        .unwrap();
        assert!(out.status.success());
        assert_eq!(out.stdout.len(), 4096);
    }
}
