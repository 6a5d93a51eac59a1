//! `cargo xtask …`: set-up, tests, the demo and benchmarks.
//!
//! xtask depends on nothing of the agent, so it builds on a machine that
//! still lacks clang and libbpf: `setup` is what installs them.

use xtask::{abi, backends, bench, bench_vm, dist, fuzz, guest, layers, phases, setup, sh};

use std::process::Command;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what this machine lacks to build and test iospan (Debian packages).
    Setup {
        /// Also install what the benchmarks compare against (bpftrace).
        #[arg(long)]
        bench: bool,
        /// Also install what the test suite drives (QEMU, libvirt, a
        /// browser, …): one package install for all of `cargo xtask test`.
        #[arg(long)]
        test: bool,
    },
    /// Set up, build, and run every test: unit tests and the root-only integration suite.
    Test {
        /// Extra arguments for the test harness (e.g. a test name filter).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Generate the Rust side of the eBPF programs' records
    /// (agent/src/abi/generated.rs) from bpf/include/agent_abi.h.
    Abi {
        /// Only say whether the checked-in file is current (exit 1 if not).
        #[arg(long)]
        check: bool,
    },
    /// Set up, build, and run the main job: trace the VMs on this host for a
    /// while, or, with none running, boot the rig guest and trace it.
    Demo,
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
    /// The guest rig: a distribution kernel booted under QEMU (TCG) with a
    /// virtio-blk or NVMe disk and an O_DIRECT workload inside.
    Guest {
        #[command(subcommand)]
        cmd: guest::GuestCmd,
    },
    /// The kernel matrix: iospan inside Debian's cloud kernels (5.10, 6.1,
    /// 6.12) booted under QEMU; each step's output under
    /// target/matrix/SUITE/out. The tests check it (tests/tests/matrix.rs).
    Matrix {
        /// Kernels by series or suite (5.10, bookworm, …); all when none.
        kernels: Vec<String>,
        /// Only these steps (doctor, guest, block, vm-always-on,
        /// vm-avoiding, vm-deep, vhost).
        #[arg(long, value_delimiter = ',')]
        steps: Vec<String>,
    },
    /// Regenerate bpf/include/vmlinux/<arch>/vmlinux.h from this kernel's BTF.
    Vmlinux,
    /// Tracing backends (Jaeger) built from source and cached outside the
    /// checkout: for the tests, and a local stack to export to.
    Backends {
        #[command(subcommand)]
        cmd: backends::BackendsCmd,
    },
    /// Check dashboards/ offline: Grafana's schema types (tsc --strict) and
    /// every PromQL expression (promtool).
    Dashboards,
    /// Check that every module of agent/src uses only the layers below its own
    /// and that no units of one layer reach each other in a circle; and that
    /// bpf/'s headers only declare and its files take nothing from each
    /// other in a circle.
    Layers,
    /// Make the README's pictures from a real run: `iospan top` beside the rig
    /// guest (docs/pictures/top.svg) and, with --jaeger-ui, one of its traces
    /// in Jaeger (docs/pictures/trace.png).
    Pictures(xtask::pictures::PicturesArgs),
    /// Build the .deb (binary, systemd unit, default configuration,
    /// dashboards) into target/debian/.
    Dist,
    /// Fuzz what iospan takes from others (a guest's channel, QEMU command
    /// lines, the configuration) with libFuzzer: each target for --seconds
    /// over its seeds and regressions (tests/fuzz) and its working corpus
    /// (~/.cache/iospan/fuzz-corpus), which takes what the run finds.
    Fuzz(fuzz::FuzzArgs),
}

#[derive(Subcommand)]
enum BenchCmd {
    /// CPU cost per I/O of tracing: no tracing vs `iospan run` vs a biolatency-style
    /// bpftrace one-liner, interleaved, on a scratch loop device at saturation.
    Overhead(bench::OverheadArgs),
    /// The rig guest's own latency with and without iospan on the host, and
    /// iospan's cost per guest I/O.
    Guest(bench::GuestArgs),
    /// Spans per second one fleet gateway (collector/gateway.yaml) takes: a rig run's
    /// recorded I/Os replayed into it as fast as it accepts them.
    Collector(bench::CollectorArgs),
    /// iospan's cost on the VM path at production rates: N KVM VMs x Q queues
    /// (tests/native/vm_load.c) untraced, block-only, with the VM split, and with
    /// OTLP export, interleaved; guest IOPS, CPU per guest I/O, losses, agent RSS
    /// and the tax on a process that is no VM.
    Vm(bench_vm::VmArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Setup { bench, test } => {
            // The suite's set holds the build's: one install, not two.
            if test {
                setup::ensure_test()?;
            }
            setup::ensure(bench)
        }
        Cmd::Test { args } => test(&args),
        Cmd::Abi { check } => abi::run(check),
        Cmd::Demo => demo(),
        Cmd::Bench {
            which: BenchCmd::Overhead(a),
        } => {
            setup::ensure(true)?;
            bench::overhead(&a)
        }
        Cmd::Bench {
            which: BenchCmd::Guest(a),
        } => bench::guest(&a),
        Cmd::Bench {
            which: BenchCmd::Collector(a),
        } => bench::collector(&a),
        Cmd::Bench {
            which: BenchCmd::Vm(a),
        } => {
            setup::ensure(false)?;
            bench_vm::vm(&a)
        }
        Cmd::Guest { cmd } => guest::main(cmd),
        Cmd::Matrix { kernels, steps } => xtask::matrix::main(&kernels, &steps),
        Cmd::Vmlinux => setup::vmlinux(),
        Cmd::Backends { cmd } => backends::main(cmd),
        Cmd::Dashboards => xtask::dashboards::check(),
        Cmd::Layers => layers::main(),
        Cmd::Pictures(a) => xtask::pictures::main(&a),
        Cmd::Fuzz(a) => {
            setup::ensure(false)?;
            fuzz::run(&a)
        }
        Cmd::Dist => {
            setup::ensure(false)?;
            dist::build().map(|_| ())
        }
    }
}

fn demo() -> Result<()> {
    // One build serves both sides: the static agent the demo guest runs
    // also traces the host (the exporters, the API and the live view are
    // not part of the demo): a fresh machine builds iospan once, not twice.
    if vms_running()? {
        setup::ensure(false)?;
        let iospan = guest::build_guest_agent()?;
        eprintln!("xtask: demo: tracing the VMs running on this host for 10 s");
        return sh::run(Command::new(iospan).args(["run", "--deep", "--duration", "10s"]));
    }
    // The demo guest's packages come with the build's, in one install; its
    // kernel downloads while iospan builds.
    setup::ensure_rig()?;
    let kernel = std::thread::spawn(guest::fetch_kernel);
    let built = guest::build_guest_agent();
    kernel
        .join()
        .map_err(|_| anyhow::anyhow!("fetching the rig's kernel panicked"))??;
    let iospan = built?;
    eprintln!("xtask: demo: no VM running here; booting the rig guest (4k random reads, QD4) under iospan");
    let rig = guest::build()?;
    let image = guest::dir().join("disk.img");
    guest::ensure_image(&image, 256)?;
    let args = guest::RunArgs {
        qd: 4,
        ios: 5000,
        name: "demo-guest".into(),
        ..Default::default()
    };
    let (qemu, _) = guest::qemu_command(&rig, &args, &image);
    // The deep tier: the host window split on any kernel (without fentry
    // or kprobes the always-on tier cannot split it: docs/tiers.md).
    let mut cmd = Command::new(iospan);
    cmd.args(["run", "--deep", "--"])
        .arg(qemu.get_program())
        .args(qemu.get_args());
    sh::run(&mut cmd)
}

fn vms_running() -> Result<bool> {
    Ok(std::fs::read_dir("/proc")?.flatten().any(|e| {
        std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| {
            let c = c.trim_end();
            c.starts_with("qemu-system-") || c == "qemu-kvm" || c == "kvm"
        })
    }))
}

/// Seconds each fuzz target runs in the suite.
const FUZZ_SECONDS: u64 = 10;

fn test(args: &[String]) -> Result<()> {
    let start = std::time::Instant::now();
    let r = test_phases(args);
    // The budget, read: at the end whether the suite passed or not.
    eprintln!(
        "\nxtask: test: time per phase\n{}",
        phases::table(&phases::all(), start.elapsed())
    );
    r
}

fn test_phases(args: &[String]) -> Result<()> {
    phases::time("packages", setup::ensure_test)?;
    // The rig's kernel and initramfs, before the tests that boot it.
    phases::time("rig guest", guest::build)?;
    // The tracing backends the export tests send to (cached outside the
    // checkout: minutes on a fresh machine, nothing after).
    for b in [
        backends::Backend::Jaeger,
        backends::Backend::Prometheus,
        backends::Backend::Otelcol,
    ] {
        phases::time(&format!("backend {b:?}").to_lowercase(), || {
            backends::ensure(b)
        })?;
    }
    // The packaging test builds the .deb.
    phases::time("cargo-deb", dist::ensure_cargo_deb)?;
    phases::time("build iospan", || {
        sh::cargo(&["build", "--release", "-p", "iospan"])
    })?;
    // One test thread: the integration tests share the kernel's tracepoints
    // and the machine's two CPUs, and compare latencies. Every test binary
    // runs even after one fails: the closing count is the whole suite's.
    let mut cmd = vec![
        "test",
        "--release",
        "--no-fail-fast",
        "--workspace",
        "--lib",
        "--bins",
        "--tests",
        "--",
        "--test-threads=1",
    ];
    cmd.extend(args.iter().map(String::as_str));
    let (mut passed, mut failed) = sh::cargo_test(&cmd)?;
    // The whole suite also fuzzes what others control, briefly: each
    // target over its kept corpus (every earlier finding replayed) and
    // then new inputs for `FUZZ_SECONDS`. A filtered run is about its tests.
    if args.is_empty() {
        let (p, f) = fuzz::smoke(FUZZ_SECONDS)?;
        passed += p;
        failed += f;
    } else {
        eprintln!("xtask: test: a test filter was given: the fuzz targets not run");
    }
    // One closing line for the whole suite, after the per-binary ones.
    println!("{passed} passed, {failed} failed");
    if failed > 0 || passed == 0 {
        anyhow::bail!("{failed} tests failed, {passed} passed");
    }
    Ok(())
}
