//! `iospan verify`: a short traced window on the live host, then each VM
//! disk's figures beside QEMU's own accounting of the same requests, and
//! a pass or fail line: what an operator runs before trusting iospan on a
//! new host or QEMU version.

use std::{fmt::Write as _, time::Duration};

use anyhow::{bail, Context, Result};

use crate::{
    cmd::run::{self, RunOptions},
    output::{qemu_check::means_agree, report::RunReport},
};

pub struct VerifyOptions {
    /// Only this VM (its name).
    pub vm: Option<String>,
    pub duration: Duration,
    pub json_out: Option<std::path::PathBuf>,
}

/// QEMU's mean and iospan's engine + device agree within this share.
pub const MEAN_SHARE: f64 = 0.10;
/// Fewer requests than this give a mean too rough to hold to `MEAN_SHARE`.
pub const MEAN_MIN_OPS: u64 = 100;

/// The verdict over a run's report: the text, and whether it passed.
pub fn verdict(report: &RunReport, vm: Option<&str>) -> (String, bool) {
    let mut out = String::new();
    let mut pass = true;
    let mut compared = 0;
    let wanted = |name: &str| vm.is_none_or(|v| v == name);
    let _ = writeln!(
        out,
        "QEMU's mean lies between ours from pickup to the host's completion (PICK-DONE) and our engine + device (ENG+DEV), µs\n{:<16} {:<14} {:<6} {:>9} {:>9} {:>7} {:>11} {:>11} {:>11}  VERDICT",
        "VM", "DISK", "OP", "QEMU", "IOSPAN", "DIFF", "QEMU MEAN", "PICK-DONE", "ENG+DEV"
    );
    for e in &report.entries {
        let (Some(name), Some(c)) = (e.vm.as_deref(), &e.qemu) else {
            continue;
        };
        if !wanted(name) {
            continue;
        }
        let means = (c.ops >= MEAN_MIN_OPS)
            .then(|| means_agree(c, MEAN_SHARE))
            .flatten();
        compared += u64::from(!c.uncounted);
        let why = if c.uncounted {
            "not compared: its engine keeps no count of an export's requests".to_string()
        } else if c.mismatch {
            pass = false;
            format!("FAIL: counts differ beyond {}", c.allowances())
        } else if means == Some(false) {
            pass = false;
            format!(
                "FAIL: QEMU's mean outside ours (pickup → completion to engine + device) by more than {:.0} %",
                MEAN_SHARE * 100.0
            )
        } else if means.is_none() {
            "ok (count; too few requests or no split to hold the mean to)".to_string()
        } else {
            "ok".to_string()
        };
        let opt = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
        let _ = writeln!(
            out,
            "{:<16} {:<14} {:<6} {:>9} {:>9} {:>7} {:>11} {:>11} {:>11}  {why}",
            name,
            e.disk,
            e.op.as_str(),
            c.ops,
            c.iospan_ops,
            c.diff,
            opt(c.mean_us),
            opt(c.pickup_to_done_mean_us),
            opt(c.engine_device_mean_us),
        );
    }
    for v in report.vms.iter().filter(|v| wanted(&v.name)) {
        if let Some(s) = &v.qemu_counts {
            if crate::output::report::qemu_counts_worth_saying(s) {
                let _ = writeln!(out, "{}: QEMU's own counts: {s}", v.name);
            }
        }
    }
    if compared == 0 {
        pass = false;
        let _ = writeln!(
            out,
            "FAIL: no VM disk had requests QEMU counted in the window{}",
            vm.map_or_else(String::new, |v| format!(" (VM {v})"))
        );
    } else {
        let _ = writeln!(
            out,
            "{}: {compared} VM disk entr{} against QEMU's own accounting ({})",
            if pass { "PASS" } else { "FAIL" },
            if compared == 1 { "y" } else { "ies" },
            report.lost_line()
        );
    }
    (out, pass)
}

pub async fn verify(o: &VerifyOptions) -> Result<(RunReport, String, bool)> {
    if o.duration.is_zero() {
        bail!("--duration 0: give a window long enough for the VMs to do I/O, e.g. 10s");
    }
    // QEMU times each request from its device model taking it to its
    // completion callback: the deep tier follows each request's own ends.
    let outcome = run::run(RunOptions {
        duration: Some(o.duration),
        json_out: o.json_out.clone(),
        max_disks: crate::abi::DEFAULT_MAX_DISKS,
        vms: true,
        tier: crate::model::Tier::Deep,
        quiet: false,
        until_exit_of: o.vm.clone(),
        ..Default::default()
    })
    .await?;
    if let Some(vm) = &o.vm {
        if !outcome.report.vms.iter().any(|v| &v.name == vm) {
            let seen: Vec<&str> = outcome.report.vms.iter().map(|v| v.name.as_str()).collect();
            bail!(
                "--vm {vm:?}: no such VM ran in the window (VMs seen: {})",
                if seen.is_empty() {
                    "none".to_string()
                } else {
                    seen.join(", ")
                }
            );
        }
    }
    let (text, pass) = verdict(&outcome.report, o.vm.as_deref());
    Ok((outcome.report, text, pass))
}

/// `iospan verify`: exits 1 when the window does not pass.
pub fn main(o: &VerifyOptions) -> Result<std::process::ExitCode> {
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let (_, text, pass) = rt.block_on(verify(o))?;
    print!("{text}");
    Ok(if pass {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::from(1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Op;
    use crate::output::report::{Entry, QemuCheck};

    fn report(check: QemuCheck) -> RunReport {
        let mut e = Entry::empty(Some("db01".into()), "vd0".into(), Op::Read);
        e.ios = check.iospan_ops;
        e.qemu = Some(check);
        RunReport {
            duration_s: 10.0,
            entries: vec![e],
            ..Default::default()
        }
    }

    fn check(ops: u64, ours: u64, q_mean: f64, i_mean: f64, mismatch: bool) -> QemuCheck {
        QemuCheck {
            ops,
            bytes: ops * 4096,
            mean_us: Some(q_mean),
            iospan_ops: ours,
            diff: ours as i64 - ops as i64,
            merged_allowance: 0,
            edge_allowance: 0,
            after_last_read: 0,
            in_flight_at_last_read: 0,
            before_first_read: 0,
            engine_device_mean_us: Some(i_mean),
            engine_device_max_us: Some(i_mean * 4.0),
            pickup_to_done_mean_us: Some(i_mean * 0.8),
            counted_by: "qemu".into(),
            uncounted: false,
            mismatch,
        }
    }

    #[test]
    fn equal_counts_and_close_means_pass() {
        let (text, pass) = verdict(&report(check(2000, 2000, 810.0, 790.0, false)), None);
        assert!(pass, "{text}");
        assert!(text.contains("PASS: 1 VM disk entry"), "{text}");
    }

    #[test]
    fn a_count_mismatch_or_a_far_mean_fails() {
        let (text, pass) = verdict(&report(check(2000, 1990, 810.0, 790.0, true)), None);
        assert!(!pass && text.contains("FAIL: counts differ"), "{text}");
        let (text, pass) = verdict(&report(check(2000, 2000, 1000.0, 790.0, false)), None);
        assert!(!pass && text.contains("QEMU's mean outside ours"), "{text}");
        // Between pickup → completion (632) and engine + device (790),
        // widened by a tenth either way: 570 passes, 560 does not.
        let (text, pass) = verdict(&report(check(2000, 2000, 570.0, 790.0, false)), None);
        assert!(pass, "{text}");
        let (text, pass) = verdict(&report(check(2000, 2000, 560.0, 790.0, false)), None);
        assert!(!pass, "{text}");
        // A handful of requests: the count is held, the mean is not.
        let (text, pass) = verdict(&report(check(5, 5, 1000.0, 100.0, false)), None);
        assert!(pass, "{text}");
    }

    #[test]
    fn an_engine_that_counts_nothing_is_said_and_not_passed() {
        let mut c = check(0, 2000, 0.0, 790.0, false);
        c.mean_us = None;
        c.uncounted = true;
        c.counted_by = "engine".into();
        let (text, pass) = verdict(&report(c), None);
        assert!(!pass, "{text}");
        assert!(
            text.contains("not compared: its engine keeps no count"),
            "{text}"
        );
        assert!(text.contains("FAIL: no VM disk"), "{text}");
    }

    #[test]
    fn nothing_to_compare_is_no_pass() {
        let (text, pass) = verdict(&report(check(2000, 2000, 810.0, 790.0, false)), Some("web"));
        assert!(!pass && text.contains("no VM disk"), "{text}");
    }
}
