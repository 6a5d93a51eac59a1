//! How long each phase of `cargo xtask test` took (packages, each backend,
//! builds, each test binary, each fuzz target): printed at its end, so the
//! suite's budget is read, not guessed.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One phase and how long it took.
#[derive(Clone, Debug)]
pub struct Phase {
    pub name: String,
    pub took: Duration,
}

static PHASES: Mutex<Vec<Phase>> = Mutex::new(Vec::new());

/// Records that `name` took `took`.
pub fn record(name: impl Into<String>, took: Duration) {
    PHASES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Phase {
            name: name.into(),
            took,
        });
}

/// Runs `f` as phase `name`, recording its time whether it succeeds or not.
pub fn time<T>(name: &str, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    record(name, t.elapsed());
    out
}

/// The phases so far, in the order they ran.
pub fn all() -> Vec<Phase> {
    PHASES.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The table: a row per phase (minutes and seconds, share of the whole),
/// then the whole since `since`.
pub fn table(phases: &[Phase], whole: Duration) -> String {
    let mmss = |d: Duration| format!("{}:{:02}", d.as_secs() / 60, d.as_secs() % 60);
    let w = phases
        .iter()
        .map(|p| p.name.len())
        .max()
        .unwrap_or(0)
        .max(5);
    let mut out = format!("{:<w$} {:>7} {:>6}\n", "phase", "m:ss", "share");
    for p in phases {
        let share = 100.0 * p.took.as_secs_f64() / whole.as_secs_f64().max(1e-9);
        out += &format!("{:<w$} {:>7} {:>5.1}%\n", p.name, mmss(p.took), share);
    }
    let counted: Duration = phases.iter().map(|p| p.took).sum();
    out += &format!(
        "{:<w$} {:>7}\n{:<w$} {:>7}\n",
        "other",
        mmss(whole.saturating_sub(counted)),
        "total",
        mmss(whole)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_adds_up_to_the_whole() {
        let phases = [
            Phase {
                name: "packages".into(),
                took: Duration::from_secs(90),
            },
            Phase {
                name: "test block".into(),
                took: Duration::from_secs(30),
            },
        ];
        let t = table(&phases, Duration::from_secs(150));
        assert!(t.contains("packages      1:30  60.0%"), "{t}");
        assert!(t.contains("test block    0:30  20.0%"), "{t}");
        assert!(t.contains("other         0:30"), "{t}");
        assert!(t.contains("total         2:30"), "{t}");
    }
}
