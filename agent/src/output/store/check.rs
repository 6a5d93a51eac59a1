//! Thresholds a stored run is held to (`--check`), and their verdicts.

use std::fmt::Write as _;

use anyhow::{bail, Result};

use crate::{
    model::{tails::PARTS, Op},
    output::report::RunReport,
};

/// A threshold: `[VDISK:]OP.STAT[.SEGMENT]<DURATION`, e.g. `read.p99<20ms`,
/// `vd1:write.p99<10ms`, `read.mean.device<2ms`.
#[derive(Clone, Debug, PartialEq)]
pub struct Check {
    pub text: String,
    pub disk: Option<String>,
    pub op: Op,
    pub stat: String,
    pub segment: String,
    pub limit_us: f64,
}

impl std::str::FromStr for Check {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!("{s:?}: {why} (e.g. read.p99<20ms, vd1:write.p99<10ms, read.mean.device<2ms)")
        };
        let (lhs, limit) = s.split_once('<').ok_or_else(|| bad("no '<'"))?;
        let limit_us = humantime::parse_duration(limit.trim())
            .map_err(|e| bad(&format!("{limit}: {e}")))?
            .as_nanos() as f64
            / 1e3;
        let (disk, rest) = match lhs.split_once(':') {
            Some((d, r)) => (Some(d.to_string()), r),
            None => (None, lhs),
        };
        let mut parts = rest.trim().split('.');
        let op = match parts.next() {
            Some("read") => Op::Read,
            Some("write") => Op::Write,
            _ => return Err(bad("the op is read or write")),
        };
        let stat = parts.next().unwrap_or("");
        // p99.9 is written p999 (or p99.9, whose ".9" is taken back here).
        let (stat, mut next) = match (stat, parts.next()) {
            ("p99", Some("9")) => ("p999".to_string(), parts.next()),
            (st, n) => (st.to_string(), n),
        };
        if !matches!(
            stat.as_str(),
            "mean" | "p50" | "p90" | "p99" | "p999" | "max"
        ) {
            return Err(bad("the statistic is mean, p50, p90, p99, p999 or max"));
        }
        let segment = next.take().unwrap_or("total").to_string();
        if !PARTS.contains(&segment.as_str()) || parts.next().is_some() {
            return Err(bad(
                "the segment is total, guest, hypervisor, engine or device",
            ));
        }
        Ok(Self {
            text: s.to_string(),
            disk,
            op,
            stat,
            segment,
            limit_us,
        })
    }
}

/// One check against one VM disk: its value and whether it passed.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub check: String,
    pub vm: String,
    pub disk: String,
    pub value_us: f64,
    pub pass: bool,
}

impl Check {
    /// The check against every matching VM entry of the report: the
    /// guest-observed figures where joined, else the host's (window and
    /// split). Error when nothing matches.
    pub fn evaluate(&self, report: &RunReport) -> Result<Vec<Verdict>> {
        let mut out = Vec::new();
        for e in &report.entries {
            let Some(vm) = &e.vm else { continue };
            if e.op != self.op || self.disk.as_ref().is_some_and(|d| *d != e.disk) {
                continue;
            }
            let seg = match (&e.stitched, self.segment.as_str()) {
                (Some(s), name) => s.segments.get(name),
                (None, "total") => e.segments.get("host_window"),
                (None, name) => e.segments.get(name),
            };
            let Some(sum) = seg else { continue };
            let value_us = match self.stat.as_str() {
                "mean" => sum.mean_us,
                "p50" => sum.p50_us,
                "p90" => sum.p90_us,
                "p99" => sum.p99_us,
                "p999" => sum.p999_us,
                _ => sum.max_us,
            };
            out.push(Verdict {
                check: self.text.clone(),
                vm: vm.clone(),
                disk: e.disk.clone(),
                value_us,
                pass: value_us < self.limit_us,
            });
        }
        if out.is_empty() {
            bail!(
                "check {}: no VM {} entry{} with that segment in the run",
                self.text,
                self.op,
                self.disk
                    .as_ref()
                    .map(|d| format!(" on disk {d}"))
                    .unwrap_or_default()
            );
        }
        Ok(out)
    }
}

/// Verdicts as lines, and whether all passed.
pub fn verdict_text(v: &[Verdict]) -> (String, bool) {
    let mut out = String::new();
    for x in v {
        let _ = writeln!(
            out,
            "{} {}  ({} {}: {:.1} µs)",
            if x.pass { "PASS" } else { "FAIL" },
            x.check,
            x.vm,
            x.disk,
            x.value_us
        );
    }
    (out, v.iter().all(|x| x.pass))
}
