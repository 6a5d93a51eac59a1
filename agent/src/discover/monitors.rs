//! The VMs' monitors as the agent has found them, shared by everyone who
//! reads them (the observer's throttles, an API run's edges): one that
//! failed is tried again only after a back-off that doubles to a minute,
//! so a hostile or wedged monitor costs one bounded exchange a minute at
//! most. Each failure is counted by reason, each misbehaving monitor shown.

use std::{
    collections::BTreeMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::discover::{
    qemu_counts::{self, Counts, Source, Throttle},
    qmp::QmpError,
    vms::Vm,
};

/// The first wait after a failure, doubled at each failure in a row ...
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// ... up to this.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// Monitors remembered, at most (a host's VMs, with room): past it the
/// one tried longest ago is forgotten.
const MAX_REMEMBERED: usize = 4096;

/// A monitor that failed, as shown in frames and reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Misbehaving {
    pub vm: String,
    /// Where it is read (`Source::describe`).
    pub source: String,
    /// Failures in a row.
    pub failures: u32,
    pub error: String,
    /// When it is tried next, from now.
    pub retry_in_s: f64,
}

struct Health {
    vm: String,
    failures: u32,
    next_try: Instant,
    error: String,
}

#[derive(Default)]
struct Inner {
    health: BTreeMap<String, Health>,
    failures: BTreeMap<&'static str, u64>,
}

#[derive(Default)]
pub struct Monitors {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Monitors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitors").finish_non_exhaustive()
    }
}

/// The reason of a failed read, as a metric label.
fn reason(e: &anyhow::Error) -> &'static str {
    e.chain()
        .find_map(|c| c.downcast_ref::<QmpError>())
        .map_or("other", QmpError::reason)
}

impl Monitors {
    /// `vm`'s counters from `source`, unless its monitor waits out a
    /// back-off (an error saying so, at once).
    pub fn read(&self, source: &Source, vm: &Vm, within: Duration) -> Result<Counts> {
        self.guarded(source, vm, || qemu_counts::read(source, vm, within))
    }

    /// `vm`'s disks' throttles from `source` (QMP only), likewise.
    pub fn throttles(
        &self,
        source: &Source,
        vm: &Vm,
        within: Duration,
    ) -> Option<Result<BTreeMap<String, Throttle>>> {
        if !matches!(source, Source::Qmp { .. }) {
            return None;
        }
        Some(self.guarded(source, vm, || {
            qemu_counts::throttles(source, vm, within).unwrap_or_else(|| Ok(BTreeMap::new()))
        }))
    }

    fn guarded<T>(&self, source: &Source, vm: &Vm, read: impl FnOnce() -> Result<T>) -> Result<T> {
        let key = source.describe();
        let now = Instant::now();
        if let Some(h) = self.lock().health.get(&key).filter(|h| now < h.next_try) {
            anyhow::bail!(
                "its monitor failed {} time{} in a row ({}): tried again in {:.0} s",
                h.failures,
                if h.failures == 1 { "" } else { "s" },
                h.error,
                h.next_try
                    .saturating_duration_since(now)
                    .as_secs_f64()
                    .ceil()
            );
        }
        // The exchange itself holds no lock: a slow monitor delays only
        // its own reader.
        let out = read();
        let mut inner = self.lock();
        match &out {
            Ok(_) => {
                inner.health.remove(&key);
            }
            Err(e) => {
                let n = inner.failures.entry(reason(e)).or_default();
                *n = n.saturating_add(1);
                let failures = inner
                    .health
                    .get(&key)
                    .map_or(0, |h| h.failures)
                    .saturating_add(1);
                let wait = FIRST_BACKOFF
                    .saturating_mul(1u32 << failures.saturating_sub(1).min(6))
                    .min(MAX_BACKOFF);
                if failures == 1 {
                    log::warn!(
                        "QEMU's monitor of {}: {e:#} (tried again less and less often)",
                        vm.name
                    );
                }
                inner.health.insert(
                    key,
                    Health {
                        vm: vm.name.clone(),
                        failures,
                        next_try: Instant::now() + wait,
                        error: format!("{e:#}"),
                    },
                );
                forget_oldest(&mut inner.health);
            }
        }
        out
    }

    /// The monitors failing now.
    pub fn misbehaving(&self) -> Vec<Misbehaving> {
        let now = Instant::now();
        self.lock()
            .health
            .iter()
            .map(|(source, h)| Misbehaving {
                vm: h.vm.clone(),
                source: source.clone(),
                failures: h.failures,
                error: h.error.clone(),
                retry_in_s: h.next_try.saturating_duration_since(now).as_secs_f64(),
            })
            .collect()
    }

    /// Failed exchanges so far, by reason.
    pub fn failures(&self) -> Vec<(&'static str, u64)> {
        self.lock().failures.iter().map(|(r, n)| (*r, *n)).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn forget_oldest(health: &mut BTreeMap<String, Health>) {
    while health.len() > MAX_REMEMBERED {
        let Some(oldest) = health
            .iter()
            .min_by_key(|(_, h)| h.next_try)
            .map(|(k, _)| k.clone())
        else {
            return;
        };
        health.remove(&oldest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_monitor_waits_out_its_backoff_and_is_shown() {
        let m = Monitors::default();
        let vm = crate::discover::vms::from_args(1, &["qemu-system-x86_64".to_string()]);
        let dir = tempfile::tempdir().unwrap();
        let source = Source::Qmp {
            socket: dir.path().join("none.sock"),
            pid: 1,
        };
        let first = m
            .read(&source, &vm, Duration::from_millis(100))
            .unwrap_err();
        assert!(
            !format!("{first:#}").contains("tried again in"),
            "{first:#}"
        );
        // At once again: not tried, the back-off said.
        let second = m
            .read(&source, &vm, Duration::from_millis(100))
            .unwrap_err();
        assert!(
            format!("{second:#}").contains("tried again in 1 s"),
            "{second:#}"
        );
        let shown = m.misbehaving();
        assert_eq!(shown.len(), 1);
        assert_eq!(shown[0].failures, 1);
        assert_eq!(m.failures(), vec![("io", 1)]);
    }
}
