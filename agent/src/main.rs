use std::{path::PathBuf, process::ExitCode, time::Duration};

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use iospan::{
    abi::DEFAULT_MAX_DISKS,
    cmd::{bench, demo, doctor, run},
    output::export::{Policy, TraceOpts},
};

/// Where each guest I/O's latency goes: eBPF latency attribution for KVM hosts.
#[derive(Parser)]
#[command(name = "iospan", version, propagate_version = true)]
struct Cli {
    /// More log output (-v info, -vv debug); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Report what this kernel lets iospan measure: program types tried here, and segments.
    Doctor {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// For `cargo xtask bench vm`: programs that do only what cannot be avoided on the hooks
    /// a run of the always-on tier attached (its report, --like), until interrupted; then
    /// their kernel statistics (--json-out).
    #[command(hide = true)]
    Floor {
        /// A report of `iospan run --json-out` whose hooks to mirror.
        #[arg(long, value_name = "REPORT")]
        like: PathBuf,
        /// Where to write the floor programs' statistics (JSON).
        #[arg(long, value_name = "FILE")]
        json_out: PathBuf,
    },
    /// Trace block I/O while CMD runs (or for --duration, or until Ctrl-C), then report
    /// IOPS, MB/s and latency percentiles per disk and op, split into queue and service.
    Run(Box<RunArgs>),
    /// On a host: the agent service (continuous measurement, HTTP API, OTLP export; see
    /// --config). Inside a VM (--guest): send each request's guest-side stamps to the host
    /// agent over the guest channel (a virtio-serial port named org.iospan.0, or TCP).
    Agent {
        /// Run as the guest agent, inside a VM.
        #[arg(long)]
        guest: bool,
        /// Host agent: the configuration file (TOML; every key is documented in the shipped
        /// /etc/iospan/iospan.toml). Default: /etc/iospan/iospan.toml if it exists.
        #[arg(long, value_name = "FILE", conflicts_with = "guest")]
        config: Option<PathBuf>,
        /// Host agent: check the configuration and exit.
        #[arg(long, conflicts_with = "guest")]
        check_config: bool,
        /// The virtio-serial port to write to (default: the one named org.iospan.0).
        #[arg(long, value_name = "PATH")]
        port: Option<PathBuf>,
        /// Send over TCP to a host agent listening at HOST:PORT instead.
        #[arg(long, value_name = "HOST:PORT")]
        connect: Option<String>,
        /// Create FILE once the probes are attached.
        #[arg(long, value_name = "FILE")]
        ready_file: Option<PathBuf>,
        /// Run at normal CPU priority. By default the agent runs as SCHED_IDLE, only when the
        /// guest has nothing else to run, so it never delays the guest's own work (if the guest
        /// is never idle, its records wait in the kernel's buffer and what overflows is counted).
        #[arg(long)]
        normal_priority: bool,
    },
    /// Live view: per VM and virtual disk (and host disk), IOPS, MB/s, requests in flight and
    /// where the latency goes (total, guest, hypervisor, engine, device, host queue), refreshed
    /// every interval. Keys: s sort, / filter, m mean/p99, space pause, h histogram, ? help.
    #[cfg(feature = "tui")]
    Top(TopArgs),
    /// Export a recorded run's I/Os (`run --events-out FILE`) over OTLP again, each as the
    /// agent exports it (a trace, a child span per segment), as if it had just completed: a past
    /// run in a tracing backend, or real traffic to size a collector tier (--repeat, --speed 0).
    /// Prints what the collector took as JSON.
    #[cfg(feature = "otlp")]
    Replay {
        /// The event stream (JSON lines) of `iospan run --events-out`.
        #[arg(value_name = "EVENTS")]
        events: PathBuf,
        /// The collector (e.g. http://127.0.0.1:4318, or :4317 with --otlp-protocol grpc).
        /// Default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT.
        #[arg(long, value_name = "URL")]
        otlp_endpoint: Option<String>,
        /// grpc or http/protobuf. Default: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else http/protobuf.
        #[arg(long, value_name = "P")]
        otlp_protocol: Option<String>,
        /// PEM CA certificate(s) to trust for an https:// collector, instead of the system's
        /// roots. Default: OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE.
        #[arg(long, value_name = "FILE")]
        otlp_ca_cert: Option<PathBuf>,
        /// Times through the file (each time new trace ids).
        #[arg(long, default_value_t = 1, value_name = "N")]
        repeat: u64,
        /// Pace: 1 the recorded one, 2 twice as fast, 0 as fast as the collector takes it.
        #[arg(long, default_value_t = 1.0, value_name = "X")]
        speed: f64,
        /// A label on every span (iospan.run.label).
        #[arg(long, value_name = "LABEL")]
        label: Option<String>,
        /// No progress line on stderr.
        #[arg(short, long)]
        quiet: bool,
    },
    /// A stored run (`run --label`): its summary in the terminal (each VM disk's tail: where
    /// its slowest I/Os spend their time), and as a self-contained HTML page with plots.
    Report {
        /// A run's label (in --runs-dir), or its directory.
        #[arg(value_name = "RUN")]
        run: String,
        /// Also write the HTML report to FILE.
        #[arg(long, value_name = "FILE")]
        html: Option<PathBuf>,
        /// Pass/fail threshold (see `run --check`); a failed check exits with 1.
        #[arg(long = "check", value_name = "EXPR")]
        checks: Vec<iospan::output::store::Check>,
        #[arg(long, env = "IOSPAN_RUNS_DIR", value_name = "DIR", default_value_os_t = iospan::output::store::default_runs_dir())]
        runs_dir: PathBuf,
    },
    /// Stored runs side by side, each against the first: per virtual disk, which segment
    /// explains the difference at the mean, the p99 tail and the p99.9 tail.
    Compare {
        /// Two runs or more (labels in --runs-dir, or their directories).
        #[arg(value_name = "RUN", num_args = 2.., required = true)]
        runs: Vec<String>,
        #[arg(long, env = "IOSPAN_RUNS_DIR", value_name = "DIR", default_value_os_t = iospan::output::store::default_runs_dir())]
        runs_dir: PathBuf,
    },
    /// Run a workload at increasing queue depth (or job count) and find its saturation
    /// point: the knee past which IOPS stop growing while latency rises, and the segment
    /// that grows there. Each level is a labelled run (LABEL-qdN); CMD holds {qd} (or {jobs}).
    Sweep {
        /// Queue depths to run at, e.g. 1,2,4,8,16,32 ({qd} in CMD).
        #[arg(
            long,
            value_delimiter = ',',
            value_name = "N,N,…",
            conflicts_with = "jobs",
            required_unless_present = "jobs"
        )]
        qd: Vec<u32>,
        /// Job counts to run at ({jobs} in CMD).
        #[arg(long, value_delimiter = ',', value_name = "N,N,…")]
        jobs: Vec<u32>,
        /// Prefix of the levels' run labels, and the sweep's name.
        #[arg(long, value_name = "LABEL")]
        label: String,
        /// Report only this disk; repeatable.
        #[arg(long = "disk", value_name = "NAME")]
        disks: Vec<String>,
        #[arg(long, env = "IOSPAN_RUNS_DIR", value_name = "DIR", default_value_os_t = iospan::output::store::default_runs_dir())]
        runs_dir: PathBuf,
        /// The workload, after `--`.
        #[arg(last = true, value_name = "CMD", required = true)]
        command: Vec<String>,
        /// The deep tier (see `run --deep` and docs/tiers.md).
        #[arg(long)]
        deep: bool,
    },
    /// Check iospan against QEMU's own accounting on this host: trace for --duration, then
    /// each VM disk's count and mean beside QEMU's (read over the VM's QMP monitor, or
    /// libvirt's client for libvirt's domains), and PASS or FAIL (exit 1). Counts must match
    /// but for merges and the requests in flight at the window's edges; QEMU's mean (its
    /// device model to its completion callback) within 10 % of iospan's engine + device.
    Verify {
        /// Only this VM (its name, as `doctor` lists it); the window also ends a second
        /// after it exits (a benchmark VM that powers off when done).
        #[arg(long, value_name = "NAME")]
        vm: Option<String>,
        /// The traced window.
        #[arg(short, long, value_parser = humantime::parse_duration, value_name = "D", default_value = "10s")]
        duration: Duration,
        /// Also write the window's report as JSON (entries[].qemu: QEMU's side).
        #[arg(long, value_name = "FILE")]
        json_out: Option<PathBuf>,
    },
    /// Built-in default job: fio on a scratch loop device, traced, with the table printed.
    Demo {
        /// Also write the report as JSON (schema iospan.run/v1).
        #[arg(long, value_name = "FILE")]
        json_out: Option<PathBuf>,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Stop after this long (e.g. 30s, 2m); with CMD, CMD is terminated then.
    #[arg(short, long, value_parser = humantime::parse_duration, value_name = "D")]
    duration: Option<Duration>,
    /// Report only this disk (e.g. nvme0n1, loop0); repeatable. Default: all disks.
    #[arg(long = "disk", value_name = "NAME")]
    disks: Vec<String>,
    /// Write the report as JSON (schema iospan.run/v1) to FILE.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// Write per-request records as JSON lines to FILE (all requests unless
    /// --sample or --slower-than narrow it).
    #[arg(long, value_name = "FILE")]
    events_out: Option<PathBuf>,
    /// With --events-out: stream one request in N (histograms still count all).
    #[arg(long, value_name = "N", default_value_t = 0)]
    sample: u32,
    /// With --events-out: stream every request at least this slow (e.g. 5ms).
    #[arg(long, value_parser = humantime::parse_duration, value_name = "D")]
    slower_than: Option<Duration>,
    /// Disk slots in the kernel tables (requests of disks beyond them are counted as lost).
    #[arg(long, default_value_t = DEFAULT_MAX_DISKS, value_parser = clap::value_parser!(u32).range(1..=4096))]
    max_disks: u32,
    /// Measure the eBPF programs' own run time (kernel BPF stats) and add it to the JSON report.
    #[arg(long)]
    bpf_stats: bool,
    /// Stamp request starts with our own probe even where the kernel keeps
    /// start times (it does when iostats or an I/O scheduler is on; disks
    /// without either get the probe automatically).
    #[arg(long)]
    start_stamps: bool,
    /// Do not attribute requests to VMs (QEMU processes); block-layer only.
    #[arg(long)]
    no_vms: bool,
    /// The deep tier: each virtio request ended at its own used-ring push,
    /// QEMU's device model taking each request, CPU waits (HV RDY, ENG
    /// RDY), every VM request's record. Costs more than the always-on tier
    /// (system-call tracepoints while it runs): see docs/tiers.md.
    #[arg(long)]
    deep: bool,
    /// Never use these program flavours (tp_btf, fentry, kprobe): iospan
    /// then takes what a kernel without them gets (raw_tp for tp_btf; the
    /// engine's wake-up for its eventfd read). For a kernel where one of
    /// them misbehaves.
    #[arg(long, value_delimiter = ',', value_name = "FLAVOUR,…")]
    avoid: Vec<Avoid>,
    /// No progress line on stderr.
    #[arg(short, long)]
    quiet: bool,
    /// Export per-I/O traces over OTLP to this collector (e.g.
    /// http://127.0.0.1:4318, or :4317 with --otlp-protocol grpc). Default:
    /// OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; neither set, no traces.
    #[arg(long, value_name = "URL", help_heading = "Traces (OTLP)")]
    otlp_endpoint: Option<String>,
    /// grpc or http/protobuf. Default: OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else http/protobuf.
    #[arg(long, value_name = "P", help_heading = "Traces (OTLP)")]
    otlp_protocol: Option<String>,
    /// PEM CA certificate(s) to trust for an https:// collector, instead of the system's roots.
    /// Default: OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE. Credentials for the collector go in
    /// OTEL_EXPORTER_OTLP_HEADERS (e.g. "authorization=Bearer …"), never on the command line.
    #[arg(long, value_name = "FILE", help_heading = "Traces (OTLP)")]
    otlp_ca_cert: Option<PathBuf>,
    /// Export the slowest K I/Os of each virtual disk per second.
    #[arg(
        long,
        value_name = "K",
        default_value_t = 5,
        help_heading = "Traces (OTLP)"
    )]
    trace_slowest: usize,
    /// Also export every I/O at least this long (e.g. 2ms); per virtual
    /// disk as [VM/]VDISK=D (e.g. vd0=500us, db1/vd0=2ms). Repeatable.
    #[arg(long, value_name = "[VM/VDISK=]D", help_heading = "Traces (OTLP)")]
    trace_slower_than: Vec<SlowerThan>,
    /// Also export one I/O in N, whatever its latency.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        help_heading = "Traces (OTLP)"
    )]
    trace_one_in: u64,
    /// Traces waiting for the collector; more are dropped and counted.
    #[arg(long, value_name = "N", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=1_000_000), help_heading = "Traces (OTLP)")]
    trace_queue: u64,
    /// A label for this run (the benchmark's name), on every exported span.
    #[arg(long, value_name = "LABEL", help_heading = "Traces (OTLP)")]
    run_label: Option<String>,
    /// Serve Prometheus metrics (latency histograms per disk and per VM,
    /// virtual disk, op and segment; losses; the agent's cost) on
    /// http://ADDR/metrics, e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Store this run under LABEL in the runs directory (report, each VM disk's tail
    /// composition, a time series, fio's JSON output when CMD is fio writing it), for
    /// `iospan report` and `iospan compare`.
    #[arg(long, value_name = "LABEL", help_heading = "Benchmark runs")]
    label: Option<String>,
    /// Where labelled runs are stored.
    #[arg(long, env = "IOSPAN_RUNS_DIR", value_name = "DIR", default_value_os_t = iospan::output::store::default_runs_dir(), help_heading = "Benchmark runs")]
    runs_dir: PathBuf,
    /// Pass/fail threshold, e.g. read.p99<20ms, vd1:write.p99<10ms, read.mean.device<2ms
    /// ([VDISK:]OP.STAT[.SEGMENT]<DURATION); repeatable. A failed check exits with 1.
    #[arg(long = "check", value_name = "EXPR", help_heading = "Benchmark runs")]
    checks: Vec<iospan::output::store::Check>,
    /// Command to trace, after `--`.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<String>,
}

/// `--avoid`: a program flavour a run may be told never to use.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Avoid {
    #[value(name = "tp_btf")]
    TpBtf,
    Fentry,
    Kprobe,
}

impl Avoid {
    fn flavour(self) -> iospan::probes::Flavour {
        match self {
            Avoid::TpBtf => iospan::probes::Flavour::TpBtf,
            Avoid::Fentry => iospan::probes::Flavour::Fentry,
            Avoid::Kprobe => iospan::probes::Flavour::Kprobe,
        }
    }
}

/// `--trace-slower-than`: for every disk, or for one.
#[derive(Clone, Debug)]
enum SlowerThan {
    All(Duration),
    Disk(iospan::output::export::DiskThreshold),
}

impl std::str::FromStr for SlowerThan {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.contains('=') {
            return s.parse().map(Self::Disk);
        }
        humantime::parse_duration(s)
            .map(Self::All)
            .map_err(|e| format!("{s:?}: {e} (a duration, e.g. 2ms, or [VM/]VDISK=DURATION)"))
    }
}

#[cfg(feature = "serve")]
fn host_agent(config: Option<PathBuf>, check: bool) -> Result<ExitCode> {
    iospan::cmd::service::main(iospan::cmd::service::ServiceOptions { config }, check)
}

#[cfg(not(feature = "serve"))]
fn host_agent(_: Option<PathBuf>, _: bool) -> Result<ExitCode> {
    anyhow::bail!("this iospan is the guest agent's build: add --guest (the host agent needs the `serve` feature)")
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = match cli.verbose {
        // The live view owns the terminal: log lines would tear it.
        #[cfg(feature = "tui")]
        0 if matches!(cli.command, Cmd::Top { .. }) => "off",
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(level)).init();
    match real_main(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            if let Some(hint) = hint_for(&e) {
                eprintln!("hint: {hint}");
            }
            ExitCode::from(1)
        }
    }
}

/// `iospan top`'s options.
#[cfg(feature = "tui")]
#[derive(clap::Args)]
struct TopArgs {
    /// Only these host disks (name, /dev path or MAJ:MIN); all by default.
    #[arg(short, long = "disk", value_name = "DISK")]
    disks: Vec<String>,
    /// Refresh interval.
    #[arg(short, long, default_value = "1s", value_parser = humantime::parse_duration, value_name = "D")]
    interval: Duration,
    /// Block-layer table size (disks).
    #[arg(long, default_value_t = DEFAULT_MAX_DISKS, value_parser = clap::value_parser!(u32).range(1..=4096))]
    max_disks: u32,
    /// Watch the agent service at HOST:PORT (its api.listen) instead of loading probes here;
    /// https://HOST:PORT for an agent with api.tls_cert. Several, comma-separated: one view
    /// of them all, each agent's rows under its address (HOST:PORT/VM).
    #[arg(long, value_name = "HOST:PORT[,…]")]
    connect: Option<String>,
    /// A file holding the agent's api.token (or set IOSPAN_TOKEN). Never the token itself on
    /// the command line: every user can read a process's arguments.
    #[arg(long, value_name = "FILE", requires = "connect")]
    token_file: Option<PathBuf>,
    /// Refused: the token would show in every user's process list. Use IOSPAN_TOKEN or
    /// --token-file.
    #[arg(long, value_name = "TOKEN", hide = true)]
    token: Option<String>,
    /// PEM certificate(s) to trust for an https agent (its own, or the CA that signed it);
    /// the system's web roots otherwise.
    #[arg(long, value_name = "FILE", requires = "connect")]
    ca_cert: Option<PathBuf>,
    /// The deep tier here (see `run --deep` and docs/tiers.md); an agent's tier is set by
    /// its runs.
    #[arg(long, conflicts_with = "connect")]
    deep: bool,
}

/// Arguments to each command's options; the commands are `iospan::cmd`'s.
fn real_main(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Cmd::Doctor { json } => doctor::main(json),
        Cmd::Floor { like, json_out } => {
            iospan::cmd::floor::main(&like, &json_out)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Run(a) => {
            let a = *a;
            let labelled = a.label.clone().map(|label| bench::Labelled {
                label,
                runs_dir: a.runs_dir.clone(),
            });
            let checks = a.checks.clone();
            bench::run_command(a.into_options(), labelled, &checks)
        }
        #[cfg(feature = "otlp")]
        Cmd::Replay {
            events,
            otlp_endpoint,
            otlp_protocol,
            otlp_ca_cert,
            repeat,
            speed,
            label,
            quiet,
        } => iospan::cmd::replay::main(&iospan::cmd::replay::ReplayOpts {
            events,
            trace: TraceOpts {
                endpoint: otlp_endpoint,
                protocol: otlp_protocol,
                ca_cert: otlp_ca_cert,
                policy: Policy::default(),
                run_label: label,
            },
            repeat,
            speed,
            quiet,
        }),
        Cmd::Report {
            run,
            html,
            checks,
            runs_dir,
        } => bench::report(&run, &runs_dir, html.as_deref(), &checks),
        Cmd::Sweep {
            qd,
            jobs,
            label,
            disks,
            runs_dir,
            command,
            deep,
        } => bench::sweep_command(
            bench::Sweep {
                qd,
                jobs,
                label,
                disks,
                tier: iospan::model::Tier::of_deep(deep),
            },
            &runs_dir,
            &command,
        ),
        Cmd::Compare { runs, runs_dir } => bench::compare(&runs, &runs_dir),
        Cmd::Agent {
            guest,
            config,
            check_config,
            port,
            connect,
            ready_file,
            normal_priority,
        } => {
            if !guest {
                return host_agent(config, check_config);
            }
            iospan::cmd::guest::run(&iospan::cmd::guest::GuestOptions {
                port,
                connect,
                ready_file,
                idle_priority: !normal_priority,
            })?;
            Ok(ExitCode::SUCCESS)
        }
        #[cfg(feature = "tui")]
        Cmd::Top(a) => top(a),
        Cmd::Demo { json_out } => demo::main(json_out),
        Cmd::Verify {
            vm,
            duration,
            json_out,
        } => iospan::cmd::verify::main(&iospan::cmd::verify::VerifyOptions {
            vm,
            duration,
            json_out,
        }),
    }
}

/// `iospan top`: here, or watching agents; a token only from a file or
/// the environment.
#[cfg(feature = "tui")]
fn top(a: TopArgs) -> Result<ExitCode> {
    let TopArgs {
        disks,
        interval,
        max_disks,
        connect,
        token_file,
        token,
        ca_cert,
        deep,
    } = a;
    if token.is_some() {
        anyhow::bail!(
            "--token: a token on the command line shows in every user's process list \
             (ps, /proc/PID/cmdline); set IOSPAN_TOKEN, or --token-file FILE (mode 0600)"
        );
    }
    let token = match (token_file, std::env::var("IOSPAN_TOKEN")) {
        (Some(f), _) => Some(
            iospan::cmd::token::read(&f)
                .map_err(|e| e.context(format!("--token-file {}", f.display())))?,
        ),
        (None, Ok(t)) if !t.trim().is_empty() => Some(t.trim().to_string()),
        _ => None,
    };
    iospan::cmd::top::main(iospan::cmd::top::TopOptions {
        disks,
        interval,
        max_disks,
        connect,
        token,
        ca_cert,
        tier: iospan::model::Tier::of_deep(deep),
    })?;
    Ok(ExitCode::SUCCESS)
}

impl RunArgs {
    fn into_options(self) -> run::RunOptions {
        let a = self;
        run::RunOptions {
            duration: a.duration,
            disks: a.disks,
            json_out: a.json_out,
            events_out: a.events_out,
            sample_every: a.sample,
            slower_than: a.slower_than,
            max_disks: a.max_disks,
            bpf_stats: a.bpf_stats,
            start_stamps: a.start_stamps,
            vms: !a.no_vms,
            tier: iospan::model::Tier::of_deep(a.deep),
            avoid: a.avoid.iter().map(|f| f.flavour()).collect(),
            quiet: a.quiet,
            command: a.command,
            traces: TraceOpts {
                endpoint: a.otlp_endpoint,
                protocol: a.otlp_protocol,
                ca_cert: a.otlp_ca_cert,
                policy: Policy {
                    slowest: a.trace_slowest,
                    slower_than_ns: a
                        .trace_slower_than
                        .iter()
                        .find_map(|t| match t {
                            SlowerThan::All(d) => Some(d.as_nanos() as u64),
                            SlowerThan::Disk(_) => None,
                        })
                        .unwrap_or(0),
                    per_disk: a
                        .trace_slower_than
                        .iter()
                        .filter_map(|t| match t {
                            SlowerThan::Disk(d) => Some(d.clone()),
                            SlowerThan::All(_) => None,
                        })
                        .collect(),
                    one_in: a.trace_one_in,
                    queue: a.trace_queue as usize,
                    ..Default::default()
                },
                run_label: a.run_label,
            },
            metrics_listen: a.metrics_listen,
            api: None,
            live: None,
            stop: None,
            no_report: false,
            // The deep tier's per-request records give the diagnosis the
            // p99 tail's composition.
            tails: a.deep,
            until_exit_of: None,
        }
    }
}

/// One hint for failures with a known cause.
fn hint_for(e: &anyhow::Error) -> Option<&'static str> {
    for cause in e.chain() {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::PermissionDenied {
                return Some("run as root or grant CAP_BPF and CAP_PERFMON");
            }
        }
        let text = cause.to_string();
        if text.contains("Operation not permitted") {
            return Some("run as root or grant CAP_BPF and CAP_PERFMON");
        }
    }
    None
}
