//! A detached tmux session: a terminal of a given size for a full-screen
//! program, read back as text (the live view's tests and pictures).

use std::{
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

/// A session, killed when dropped.
pub struct Tmux(String);

impl Tmux {
    /// Starts `cmd` in a `width`×`height` terminal.
    pub fn start(cmd: &str, width: u16, height: u16) -> Result<Self> {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "iospan-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        tmux(&[
            "new-session",
            "-d",
            "-s",
            &name,
            "-x",
            &width.to_string(),
            "-y",
            &height.to_string(),
            cmd,
        ])
        .with_context(|| format!("starting {cmd} in a tmux session"))?;
        Ok(Self(name))
    }

    /// The screen as text.
    pub fn screen(&self) -> Result<String> {
        self.capture(false)
    }

    /// The screen with its SGR escapes (colours, bold) kept.
    pub fn screen_with_colours(&self) -> Result<String> {
        self.capture(true)
    }

    fn capture(&self, colours: bool) -> Result<String> {
        let mut c = Command::new("tmux");
        c.args(["capture-pane", "-p", "-t", &self.0]);
        if colours {
            c.arg("-e");
        }
        let out = c.output().context("tmux capture-pane")?;
        if !out.status.success() {
            bail!(
                "tmux capture-pane: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Types each key (tmux key names: "Enter", "Escape", "m"), giving the
    /// program a moment for each.
    pub fn keys(&self, keys: &[&str]) -> Result<()> {
        for k in keys {
            tmux(&["send-keys", "-t", &self.0, k]).with_context(|| format!("typing {k}"))?;
            std::thread::sleep(Duration::from_millis(150));
        }
        Ok(())
    }

    /// Waits up to `limit` for the screen to satisfy `ok`: that screen, or
    /// an error naming `what` with the last screen.
    pub fn until(&self, what: &str, limit: Duration, ok: impl Fn(&str) -> bool) -> Result<String> {
        let t = Instant::now();
        loop {
            let s = self.screen()?;
            if ok(&s) {
                return Ok(s);
            }
            if t.elapsed() >= limit {
                bail!("waited {limit:?} for {what}; the screen:\n{s}");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Whether the session (its program) still runs.
    pub fn alive(&self) -> bool {
        tmux(&["has-session", "-t", &self.0]).is_ok()
    }
}

/// One tmux command, its failure named by what tmux said.
fn tmux(args: &[&str]) -> Result<()> {
    let out = Command::new("tmux")
        .args(args)
        .output()
        .context("running tmux (is it installed?)")?;
    if !out.status.success() {
        bail!(
            "tmux {}: {}",
            args.first().unwrap_or(&""),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .status();
    }
}
