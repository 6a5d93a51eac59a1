//! The systemd unit and the .deb: the unit verifies, the package installs
//! the files it should with sane metadata, and the unit's capabilities are
//! enough for the agent to measure a real guest.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use agent_integration::{agent_config, host_disk_of, iospan_bin, rig_and_image, run, Reap};
use xtask::{
    backends::{free_port, http_get},
    guest::{self, RunArgs},
    sh,
};

fn unit_text() -> String {
    std::fs::read_to_string(sh::root().join("packaging/iospan.service")).unwrap()
}

/// A scratch directory of one test, removed with it.
fn scratch(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("iospan-{tag}-"))
        .tempdir()
        .expect("a scratch directory")
}

/// The unit with its ExecStart pointing at `bin`, written under `dir`.
fn unit_for(bin: &Path, dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let p = dir.join("iospan.service");
    std::fs::write(
        &p,
        unit_text().replace("/usr/bin/iospan", &bin.display().to_string()),
    )
    .unwrap();
    p
}

fn verify(unit: &Path) {
    let out = run(Command::new("systemd-analyze").arg("verify").arg(unit));
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify {}: {}",
        unit.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_unit_verifies_and_asks_for_least_privilege() {
    let tmp = scratch("unit");
    let dir = tmp.path();
    verify(&unit_for(&iospan_bin(), dir));
    let text = unit_text();
    for line in [
        "Type=notify",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        "StateDirectory=iospan",
        "WatchdogSec=",
    ] {
        assert!(text.contains(line), "{line} missing");
    }
    assert!(text.lines().any(|l| l.starts_with("ProtectHome=")));
    for line in [
        "MemoryMax=",
        "TasksMax=",
        "LimitNOFILE=",
        "ProtectKernelTunables=yes",
        "ProtectKernelLogs=yes",
        "SystemCallFilter=",
        "DevicePolicy=closed",
    ] {
        assert!(text.lines().any(|l| l.starts_with(line)), "{line} missing");
    }
    // systemd's own reckoning of the unit's exposure (10 is none at all;
    // 5.1 before the unit was hardened).
    let out = run(Command::new("systemd-analyze")
        .args(["security", "--offline=true"])
        .arg(sh::root().join("packaging/iospan.service")));
    let report = String::from_utf8_lossy(&out.stdout);
    let exposure: f64 = report
        .lines()
        .find_map(|l| l.split("iospan.service: ").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level: {report}"));
    assert!(exposure <= 3.5, "exposure {exposure}: {report}");
    // No capability beyond eBPF's needs.
    let caps = bounding_set();
    for c in &caps {
        assert!(
            [
                "CAP_BPF",
                "CAP_PERFMON",
                "CAP_SYS_RESOURCE",
                "CAP_SYS_PTRACE",
                "CAP_SYSLOG",
                "CAP_SYS_ADMIN"
            ]
            .contains(&c.as_str()),
            "{c}"
        );
    }
    // A broken unit is refused: the check can fail.
    let broken = dir.join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    let bad = broken.join("iospan.service");
    std::fs::write(&bad, unit_text().replace("Type=notify", "Type=notifyy")).unwrap();
    let out = run(Command::new("systemd-analyze").arg("verify").arg(&bad));
    assert!(!out.stderr.is_empty(), "a bad Type= passed verify");
}

fn bounding_set() -> Vec<String> {
    unit_text()
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .unwrap()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Every system call of the unit's SystemCallFilter, its groups expanded
/// by systemd itself.
fn allowed_syscalls() -> std::collections::BTreeSet<String> {
    fn expand(item: &str, out: &mut std::collections::BTreeSet<String>) {
        if !item.starts_with('@') {
            out.insert(item.to_string());
            return;
        }
        let o = run(Command::new("systemd-analyze").args(["syscall-filter", item]));
        assert!(o.status.success(), "systemd-analyze syscall-filter {item}");
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        let members: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("    "))
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_string)
            .collect();
        assert!(!members.is_empty(), "{item}: {text}");
        for m in members {
            expand(&m, out);
        }
    }
    let mut out = std::collections::BTreeSet::new();
    let filter = unit_text()
        .lines()
        .find_map(|l| l.strip_prefix("SystemCallFilter="))
        .expect("the unit has a SystemCallFilter")
        .to_string();
    for item in filter.split_whitespace() {
        expand(item, &mut out);
    }
    out
}

/// The agent as the service runs it, traced by strace through its life: a
/// start, a guest (probes on its QEMU, its I/O), a labelled run, a reload,
/// a stop. Every system call it made is one the unit's filter allows.
#[test]
fn the_units_system_call_filter_allows_every_call_the_agent_makes() {
    let allowed = allowed_syscalls();
    assert!(allowed.contains("bpf") && allowed.contains("read"));
    assert!(!allowed.contains("mount") && !allowed.contains("kexec_load"));
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let tmp = scratch("scf");
    let dir = tmp.path();
    let (conf, token_file) = agent_config(dir, &host, &addr);
    let trace = dir.join("strace.out");
    let mut strace = Reap(
        Command::new("strace")
            .args(["-f", "-qq", "-o"])
            .arg(&trace)
            .arg(iospan_bin())
            .args(["agent", "--config"])
            .arg(&conf)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let status = |p: &str| http_get(&addr, p, &[]).map_or(0, |r| r.0);
    let t = Instant::now();
    while status("/healthz") != 200 {
        assert!(strace.0.try_wait().unwrap().is_none(), "the agent exited");
        assert!(t.elapsed() < Duration::from_secs(60), "never healthy");
        std::thread::sleep(Duration::from_millis(200));
    }
    let token = std::fs::read_to_string(&token_file).unwrap();
    let post = |path: &str| -> String {
        let (status, body) = xtask::backends::http_post(&addr, path, Some(token.trim()))
            .unwrap_or_else(|e| panic!("POST {path}: {e:#}"));
        assert!((200..300).contains(&status), "POST {path}: {status} {body}");
        body
    };
    post(&format!(
        "/api/v1/runs?label=scf{}",
        agent_integration::rig_split_query()
    ));
    let a = RunArgs {
        qd: 2,
        ios: 300,
        name: "scf-rig".into(),
        ..Default::default()
    };
    let (mut qemu, _) = guest::qemu_command(&rig, &a, &image);
    let out = run(&mut qemu);
    assert!(out.status.success(), "the guest failed");
    let report = post("/api/v1/runs/1/stop");
    assert!(
        report.contains("scf-rig"),
        "the guest was not seen: {report}"
    );
    // Reload, then stop: both paths traced too.
    let pid = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .find_map(|l| l.split_whitespace().next()?.parse::<i32>().ok())
        .expect("strace wrote nothing");
    // SAFETY: kill(2) on the traced agent, our grandchild.
    unsafe { libc::kill(pid, libc::SIGHUP) };
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(3) || status("/healthz") != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "not healthy after reload"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let st = agent_integration::wait_limited(&mut strace.0, Duration::from_secs(60))
        .expect("the agent did not stop");
    assert!(st.success(), "{st}");

    let text = std::fs::read_to_string(&trace).unwrap();
    let mut used = std::collections::BTreeSet::new();
    for line in text.lines() {
        // "PID  name(args…) = ret", or "PID  <... name resumed>…".
        let rest = line.split_once(' ').map_or("", |(_, r)| r).trim_start();
        let name = match rest.strip_prefix("<... ") {
            Some(r) => r.split(' ').next().unwrap_or(""),
            None => rest.split('(').next().unwrap_or(""),
        };
        if !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            used.insert(name.to_string());
        }
    }
    assert!(
        used.contains("bpf") && used.contains("perf_event_open"),
        "the trace missed the probes' calls: {used:?}"
    );
    let missing: Vec<_> = used.iter().filter(|c| !allowed.contains(*c)).collect();
    assert!(
        missing.is_empty(),
        "the agent calls {missing:?}, which the unit's SystemCallFilter refuses"
    );
}

/// The agent with only the unit's capabilities (as systemd would start
/// it: root, bounding set cut down) measures a guest exactly.
#[test]
fn the_units_capabilities_are_enough_to_measure_a_guest() {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let tmp = scratch("caps");
    let dir = tmp.path();
    let (conf, token_file) = agent_config(dir, &host, &addr);
    let mut guard = Reap(start_with_the_units_capabilities(&conf, &addr));
    let agent = &mut guard.0;
    holds_the_units_capabilities_only(agent.id());
    // The agent made its token at start, with only the unit's capabilities.
    let token = std::fs::read_to_string(&token_file).unwrap();
    measures_a_guest(&rig, &image, &addr, token.trim());
}

/// The agent under the unit's bounding set, healthy.
fn start_with_the_units_capabilities(conf: &Path, addr: &str) -> std::process::Child {
    let caps: Vec<String> = bounding_set()
        .iter()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    let agent = Command::new("setpriv")
        .arg(format!("--bounding-set=-all,{}", caps.join(",")))
        .arg("--no-new-privs")
        .arg(iospan_bin())
        .args(["agent", "--config"])
        .arg(conf)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut agent = agent;
    let status = |p: &str| http_get(addr, p, &[]).map_or(0, |r| r.0);
    let t = Instant::now();
    while status("/healthz") != 200 {
        if let Some(s) = agent.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(agent.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("the agent exited ({s}) with the unit's capabilities: {err}");
        }
        assert!(t.elapsed() < Duration::from_secs(30), "never healthy");
        std::thread::sleep(Duration::from_millis(200));
    }
    agent
}

/// The process really holds nothing more: the unit's set (CAP_SYS_PTRACE
/// 19, CAP_SYS_ADMIN 21, CAP_SYS_RESOURCE 24, CAP_SYSLOG 34, CAP_PERFMON 38,
/// CAP_BPF 39), less what this machine's root lacks to begin with.
fn holds_the_units_capabilities_only(pid: u32) {
    let bounding = |pid: &str| {
        let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let bnd = st
            .lines()
            .find(|l| l.starts_with("CapBnd:"))
            .unwrap()
            .to_string();
        u64::from_str_radix(bnd.split_whitespace().nth(1).unwrap(), 16).unwrap()
    };
    let unit: u64 = (1 << 19) | (1 << 21) | (1 << 24) | (1 << 34) | (1 << 38) | (1 << 39);
    let ours = bounding("self");
    assert_eq!(bounding(&pid.to_string()), unit & ours);
    if unit & !ours != 0 {
        eprintln!(
            "this machine's root lacks capabilities {:#x} of the unit's",
            unit & !ours
        );
    }
}

/// A labelled run around a guest's reads counts them all, exactly but for
/// what it names as lost.
fn measures_a_guest(rig: &guest::Rig, image: &Path, addr: &str, token: &str) {
    let post = |path: &str| -> serde_json::Value {
        let (status, body) = xtask::backends::http_post(addr, path, Some(token))
            .unwrap_or_else(|e| panic!("POST {path}: {e:#}"));
        assert!((200..300).contains(&status), "POST {path}: {status} {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("POST {path}: {e}: {body}"))
    };
    let id = post(&format!(
        "/api/v1/runs?label=caps{}",
        agent_integration::rig_split_query()
    ))["id"]
        .as_u64()
        .unwrap();
    let a = RunArgs {
        qd: 4,
        ios: 2000,
        name: "caps-rig".into(),
        no_guest_agent: true,
        ..Default::default()
    };
    let (mut qemu, dev) = guest::qemu_command(rig, &a, image);
    let t0 = Instant::now();
    let out = run(&mut qemu);
    let console: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let r = guest::parse(&console, &a, dev, t0.elapsed().as_secs_f64()).unwrap();
    let stopped = post(&format!("/api/v1/runs/{id}/stop"));
    let e = stopped["report"]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["vm"] == "caps-rig" && e["disk"] == "vd0")
        .unwrap_or_else(|| panic!("{stopped:#}"))
        .clone();
    // Exact, but for what the run names as lost: now and then this kernel
    // completes a request without its completion reaching any BPF program
    // (block.rs holds the same); a CI run gave 1,996 reads and `lost` 4 for
    // the guest's 2,000. Nothing may go missing unnamed.
    // The disk's requests whose completion never came are its own, beside
    // the timed ones: together never more than the guest's.
    let ios = e["ios"].as_u64().unwrap();
    let undelivered = e["undelivered"].as_u64().unwrap();
    let lost = stopped["report"]["lost"].as_u64().unwrap();
    assert!(
        ios + undelivered <= r.guest_reads
            && ios + lost >= r.guest_reads
            && lost <= r.guest_reads / 100,
        "{e:#}\n{ios} reads + {undelivered} undelivered, {lost} lost in the run, for the guest's {}\n\
         the agent's losses since its start:\n{}",
        r.guest_reads,
        losses(addr)
    );
    for seg in ["total", "hv", "engine", "device"] {
        assert!(
            e["segments"][seg]["count"].as_u64().unwrap_or(0) > 0,
            "{seg}: {e:#}"
        );
    }
}

#[test]
fn the_deb_installs_the_agent_its_unit_configuration_and_dashboards() {
    let deb = xtask::dist::build().expect("cargo xtask dist");
    let info = run(Command::new("dpkg-deb").arg("--info").arg(&deb));
    let info = String::from_utf8_lossy(&info.stdout).into_owned();
    for field in [
        "Package: iospan",
        &format!("Version: {}", env!("CARGO_PKG_VERSION")),
        "Architecture: amd64",
        "Maintainer: ",
        "Depends: libc6",
        "Section: admin",
        "Description: Where each guest I/O's latency goes",
    ] {
        assert!(info.contains(field), "{field} not in:\n{info}");
    }
    let tmp = scratch("deb");
    let root = tmp.path();
    assert!(run(Command::new("dpkg").arg("-x").arg(&deb).arg(root))
        .status
        .success());
    for f in [
        "usr/bin/iospan",
        "lib/systemd/system/iospan.service",
        "etc/iospan/iospan.toml",
        "usr/share/iospan/dashboards/iospan-fleet.json",
        "usr/share/iospan/dashboards/provisioning/datasources.yaml",
        "usr/share/doc/iospan/README.md",
    ] {
        assert!(root.join(f).is_file(), "{f} not installed");
    }
    // The configuration holds the API token: root's alone.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(root.join("etc/iospan/iospan.toml"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "/etc/iospan/iospan.toml mode {mode:o}");
    // The installed configuration is a conffile, and checks out.
    let ctl = root.join("DEBIAN");
    assert!(run(Command::new("dpkg-deb").arg("-e").arg(&deb).arg(&ctl))
        .status
        .success());
    let conffiles = std::fs::read_to_string(ctl.join("conffiles")).unwrap();
    assert!(
        conffiles.lines().any(|l| l == "/etc/iospan/iospan.toml"),
        "{conffiles}"
    );
    let bin = root.join("usr/bin/iospan");
    let out = run(Command::new(&bin)
        .args(["agent", "--check-config", "--config"])
        .arg(root.join("etc/iospan/iospan.toml")));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // And its unit verifies against its own binary.
    let unit = std::fs::read_to_string(root.join("lib/systemd/system/iospan.service")).unwrap();
    assert_eq!(unit, unit_text());
    verify(&unit_for(&bin, &root.join("verify")));
}

/// The agent's nonzero loss counters (its /metrics), to say which moved.
fn losses(addr: &str) -> String {
    match http_get(addr, "/metrics", &[]) {
        Ok((_, body)) => body
            .lines()
            .filter(|l| l.starts_with("iospan_lost_total{") && !l.ends_with(" 0"))
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) => format!("(/metrics unread: {e:#})"),
    }
}
