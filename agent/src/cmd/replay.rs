//! `iospan replay`: a recorded run's I/Os (`run --events-out`) exported again
//! over OTLP, as the agent exports them.
//!
//! To show a past run in a
//! tracing backend, or to size a collector tier with real traffic
//! (`--repeat`, `--speed 0`: as fast as the collector takes it).

use std::{
    collections::HashMap,
    io::{BufRead, IsTerminal},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::{
    model::Op,
    model::{span::CpuWait, IoSpan},
    output::export::{ExportCounters, Names, Reason, TraceOpts},
};

pub struct ReplayOpts {
    pub events: PathBuf,
    pub trace: TraceOpts,
    /// Times through the file.
    pub repeat: u64,
    /// 1: the recorded pace; 2: twice as fast; 0: as fast as the
    /// collector accepts.
    pub speed: f64,
    pub quiet: bool,
}

/// One I/O of the event stream (`kind` guest_io or vm_io).
#[derive(Deserialize)]
struct Recorded {
    kind: String,
    vm: String,
    #[serde(default)]
    vdisk: Option<String>,
    #[serde(default)]
    nvme: bool,
    #[serde(default)]
    host_disk: String,
    #[serde(default)]
    queue: Option<u32>,
    op: Op,
    pos: u64,
    bytes: u32,
    begin_ns: u64,
    guest_kick_ns: u64,
    kick_ns: u64,
    pick_ns: u64,
    start_ns: u64,
    issue_ns: u64,
    done_ns: u64,
    signal_ns: u64,
    guest_irq_ns: u64,
    end_ns: u64,
    clock_offset_ns: Option<i64>,
    total_us: f64,
    guest_us: f64,
    hypervisor_us: f64,
    engine_us: f64,
    device_us: f64,
    #[serde(default)]
    app_ends_from_block_layer: bool,
    #[serde(default)]
    hypervisor_cpu_wait_us: f64,
    #[serde(default)]
    engine_cpu_wait_us: f64,
}

/// What a replay sent and what the collector took.
#[derive(Debug, Serialize)]
pub struct ReplaySummary {
    pub ios_in_file: u64,
    pub elapsed_s: f64,
    #[serde(flatten)]
    pub export: ExportCounters,
    pub spans_per_s: f64,
}

/// The I/Os of an event stream, in order, with their names.
fn load(path: &Path) -> Result<Vec<(IoSpan, Names)>> {
    let f = std::fs::File::open(path).with_context(|| {
        format!(
            "{}: the event stream of `iospan run --events-out`",
            path.display()
        )
    })?;
    parse(std::io::BufReader::new(f), path)
}

/// The I/Os of an event stream read from `input` (named `path` in errors).
/// Any text is taken or refused with the line it failed on; stamps are
/// taken as written (the export makes nothing of an out-of-order one but
/// a shorter segment).
pub fn parse(input: impl BufRead, path: &Path) -> Result<Vec<(IoSpan, Names)>> {
    let mut ids: HashMap<String, u32> = HashMap::new();
    let mut id = |s: &str| {
        let n = ids.len() as u32 + 1;
        *ids.entry(s.to_string()).or_insert(n)
    };
    let ns = |us: f64| (us * 1000.0).round().max(0.0) as u64;
    let mut out = Vec::new();
    for (i, line) in input.lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if !line.contains("\"guest_io\"") && !line.contains("\"vm_io\"") {
            continue;
        }
        let r: Recorded = serde_json::from_str(&line).with_context(|| {
            format!(
                "{}:{}: not an I/O record of --events-out",
                path.display(),
                i + 1
            )
        })?;
        if r.kind != "guest_io" && r.kind != "vm_io" {
            continue;
        }
        let vdisk = r.vdisk.unwrap_or_default();
        let span = IoSpan {
            vm: id(&r.vm),
            vdisk: id(&format!("{}\0{vdisk}", r.vm)),
            dev: 0,
            op: r.op,
            pos: r.pos,
            bytes: r.bytes,
            begin_ns: r.begin_ns,
            guest_kick_ns: r.guest_kick_ns,
            guest_irq_ns: r.guest_irq_ns,
            end_ns: r.end_ns,
            kick_ns: r.kick_ns,
            pick_ns: r.pick_ns,
            start_ns: r.start_ns,
            issue_ns: r.issue_ns,
            done_ns: r.done_ns,
            signal_ns: r.signal_ns,
            clock_offset_ns: r.clock_offset_ns,
            guest_ns: ns(r.guest_us),
            hypervisor_ns: ns(r.hypervisor_us),
            engine_ns: ns(r.engine_us),
            device_ns: ns(r.device_us),
            total_ns: ns(r.total_us),
            app_ends_from_block_layer: r.app_ends_from_block_layer,
            has_guest: r.kind == "guest_io",
            queue: r.queue,
            cpu_wait: CpuWait {
                hypervisor_ns: ns(r.hypervisor_cpu_wait_us),
                engine_ns: ns(r.engine_cpu_wait_us),
            },
        };
        let names = Names {
            vm: r.vm,
            vdisk,
            host_disk: r.host_disk,
            nvme: r.nvme,
            ..Default::default()
        };
        out.push((span, names));
    }
    if out.is_empty() {
        bail!(
            "{}: no I/O records (guest_io or vm_io lines); record one with `iospan run --events-out FILE -- CMD` on a host with VMs",
            path.display()
        );
    }
    Ok(out)
}

/// The I/O moved by `by` ns on the host clock (its guest stamps with it
/// when they are on the host clock; otherwise the kick places them).
pub fn shifted(s: &IoSpan, by: u64) -> IoSpan {
    let m = |t: u64| if t == 0 { 0 } else { t.saturating_add(by) };
    let g = |t: u64| if s.clock_offset_ns.is_some() { m(t) } else { t };
    IoSpan {
        begin_ns: g(s.begin_ns),
        guest_kick_ns: g(s.guest_kick_ns),
        guest_irq_ns: g(s.guest_irq_ns),
        end_ns: g(s.end_ns),
        kick_ns: m(s.kick_ns),
        pick_ns: m(s.pick_ns),
        start_ns: m(s.start_ns),
        issue_ns: m(s.issue_ns),
        done_ns: m(s.done_ns),
        signal_ns: m(s.signal_ns),
        ..s.clone()
    }
}

pub async fn replay(o: &ReplayOpts) -> Result<ReplaySummary> {
    if !o.trace.enabled() {
        bail!("no collector: give --otlp-endpoint URL (or set OTEL_EXPORTER_OTLP_ENDPOINT)");
    }
    if !(o.speed >= 0.0 && o.speed.is_finite()) {
        bail!("--speed {}: give 1 for the recorded pace, 2 for twice as fast, 0 for as fast as accepted", o.speed);
    }
    let ios = load(&o.events)?;
    let first = ios.iter().map(|(s, _)| s.kick_ns).min().unwrap_or(0);
    let last = ios
        .iter()
        .map(|(s, _)| s.signal_ns.max(s.kick_ns))
        .max()
        .unwrap_or(0);
    let recorded_ns = last.saturating_sub(first).max(1);
    let exporter = crate::output::export::otlp::Exporter::start(&o.trace)?;
    let started = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let mut shown = Instant::now();
    let total = ios.len() as u64 * o.repeat;
    let mut sent = 0u64;
    for round in 0..o.repeat {
        for (s, names) in &ios {
            // Paced: this I/O's place in the recording, at --speed.
            // In f64: a file's stamps may be anything, and rounds many.
            let at = round as f64 * recorded_ns as f64 + s.kick_ns.saturating_sub(first) as f64;
            if o.speed > 0.0 {
                let due = Duration::from_nanos((at / o.speed) as u64);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
            }
            // Each I/O as if it had just completed.
            let end = s.signal_ns.max(s.end_ns).max(s.kick_ns);
            let by = crate::pipeline::reap::monotonic_ns().saturating_sub(end);
            exporter
                .send_wait(&shifted(s, by), names, Reason::Uniform)
                .await;
            sent += 1;
            if !o.quiet && shown.elapsed() >= Duration::from_secs(if tty { 1 } else { 10 }) {
                shown = Instant::now();
                let c = exporter.shared.stats.snapshot();
                let line = format!(
                    "iospan replay: {sent}/{total} I/Os sent, {} traces taken, {} failed, {:.0} spans/s",
                    c.exported_traces,
                    c.failed_traces,
                    c.exported_spans as f64 / started.elapsed().as_secs_f64().max(1e-9)
                );
                if tty {
                    eprint!("\r{line}");
                } else {
                    eprintln!("{line}");
                }
            }
        }
    }
    let export = exporter.finish(Duration::from_secs(30)).await;
    let elapsed_s = started.elapsed().as_secs_f64();
    if !o.quiet && tty {
        eprintln!();
    }
    Ok(ReplaySummary {
        ios_in_file: ios.len() as u64,
        elapsed_s,
        spans_per_s: export.exported_spans as f64 / elapsed_s.max(1e-9),
        export: ExportCounters {
            offered: total,
            ..export
        },
    })
}

/// `iospan replay`: what the collector took, as JSON; exits 1 if it did not
/// take everything.
pub fn main(opts: &ReplayOpts) -> Result<std::process::ExitCode> {
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let s = rt.block_on(replay(opts))?;
    println!("{}", serde_json::to_string_pretty(&s)?);
    let lost = s.export.failed_traces + s.export.dropped_queue_full;
    if lost > 0 {
        eprintln!("iospan replay: {lost} traces not taken by the collector");
        return Ok(std::process::ExitCode::from(1));
    }
    Ok(std::process::ExitCode::SUCCESS)
}
