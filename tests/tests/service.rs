//! `iospan agent`, the host agent service: its configuration checked key by
//! key, its HTTP API (token, health, snapshot, runs), SIGHUP reloads, and
//! `top --connect` watching it, on a real guest.

use std::{
    io::Write,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use agent_integration::{host_disk_of, iospan_bin, rig_and_image, run, run_around, Tmux};
use serde_json::Value;
use xtask::{
    backends::{free_port, http_get},
    guest::{self, RunArgs},
};

/// A configuration file, removed when the test drops it.
fn config_file(tag: &str, text: &str) -> tempfile::TempPath {
    let mut f = tempfile::Builder::new()
        .prefix(&format!("iospan-{tag}-"))
        .suffix(".toml")
        .tempfile()
        .unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.into_temp_path()
}

#[test]
fn a_bad_configuration_is_refused_naming_its_key() {
    for (text, key) in [
        ("[agent]\nmax_disk = 3\n", "max_disk"),
        ("[traces]\nslowest = \"five\"\n", "slowest"),
        ("[api]\nlisten = \"127.0.0.1\"\n", "api.listen"),
        ("[api]\nlisten = \"0.0.0.0:9464\"\n", "api.token"),
    ] {
        let p = config_file("bad", text);
        for args in [&["--check-config"][..], &[]] {
            let out = run(Command::new(iospan_bin())
                .args(["agent", "--config"])
                .arg(&p)
                .args(args));
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{text:?} {args:?} was accepted");
            assert!(err.contains(key), "{text:?}: {err}");
        }
    }
}

struct Agent(Child);

impl Agent {
    /// `iospan agent --config CONFIG`, its log discarded.
    fn start(config: &std::path::Path) -> Self {
        Agent(
            Command::new(iospan_bin())
                .args(["agent", "--config"])
                .arg(config)
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(addr: &str, path: &str, token: Option<&str>) -> (u16, String) {
    match token {
        // Not listening (yet, or any more): 0.
        None => http_get(addr, path, &[]).unwrap_or((0, String::new())),
        Some(t) => xtask::backends::http_get_as(addr, path, t).unwrap_or_else(|e| panic!("{e:#}")),
    }
}

fn post(addr: &str, path: &str, token: &str) -> Value {
    let (status, body) = xtask::backends::http_post(addr, path, Some(token))
        .unwrap_or_else(|e| panic!("POST {path}: {e:#}"));
    assert!((200..300).contains(&status), "POST {path}: {status} {body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("POST {path}: {e}: {body}"))
}

#[test]
fn the_service_measures_a_guest_reports_a_run_and_reloads() {
    let (rig, image) = rig_and_image();
    let host = host_disk_of(&image);
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let token = "s3cret";
    let conf = |slowest: u32| {
        format!(
            "[agent]\ndisks = [\"{host}\"]\n[api]\nlisten = \"{addr}\"\ntoken = \"{token}\"\n\
             [traces]\nslowest = {slowest}\n"
        )
    };
    let path = config_file("svc", &conf(5));
    let mut agent = Agent(
        Command::new(iospan_bin())
            .args(["-v", "agent", "--config"])
            .arg(&path)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_healthy(&addr);
    // Everything but health wants the token.
    assert_eq!(get(&addr, "/api/v1/snapshot", None).0, 401);
    assert_eq!(get(&addr, "/api/v1/snapshot", Some("wrong")).0, 401);
    assert_eq!(get(&addr, "/api/v1/snapshot", Some(token)).0, 200);
    check_reloads(&mut agent, &path, &addr, token, &conf(7));

    // top --connect, in a terminal, watching the service.
    let tmux = Tmux::start(
        &format!(
            "IOSPAN_TOKEN={token} {} top --connect {addr}",
            iospan_bin().display()
        ),
        200,
        40,
    );
    tmux.until("the header", |s| s.contains("VM / DISK"));
    let svc = Service {
        addr: &addr,
        token,
        tmux: &tmux,
    };
    svc.labelled_run_counts_as_a_standalone_one(&rig, &image, &host);
    // SIGTERM: a clean stop.
    tmux.keys(&["q"]);
    stop_cleanly(&mut agent, token);
}

fn wait_healthy(addr: &str) {
    let t = Instant::now();
    while get(addr, "/healthz", None).0 != 200 {
        assert!(t.elapsed() < Duration::from_secs(30), "never healthy");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// SIGHUP with a broken file: refused, the service stays. And one broken
/// on the token's line: the log names the line, never the token. With a
/// good one, `good`, it restarts measuring on the new settings.
fn check_reloads(agent: &mut Agent, path: &std::path::Path, addr: &str, token: &str, good: &str) {
    for broken in [
        "[agent]\nmax_disk = 1\n".to_string(),
        format!("[api]\nlisten = \"{addr}\"\ntoken = \"{token}\n"),
    ] {
        std::fs::write(path, broken).unwrap();
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(agent.0.id() as i32, libc::SIGHUP) };
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            agent.0.try_wait().unwrap().is_none(),
            "a bad reload stopped the agent"
        );
    }
    std::fs::write(path, good).unwrap();
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGHUP) };
    let t = Instant::now();
    while get(addr, "/healthz", None).0 != 200 || t.elapsed() < Duration::from_secs(2) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "not healthy after reload"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The service as a client sees it, with `top --connect` watching.
struct Service<'s> {
    addr: &'s str,
    token: &'s str,
    tmux: &'s Tmux,
}

impl Service<'_> {
    /// A labelled run around a guest's workload counts what a standalone
    /// `iospan run` around the same boot counts.
    fn labelled_run_counts_as_a_standalone_one(
        &self,
        rig: &guest::Rig,
        image: &std::path::Path,
        host: &str,
    ) {
        let (addr, token, tmux) = (self.addr, self.token, self.tmux);
        let started = post(
            addr,
            &format!(
                "/api/v1/runs?label=qd4{}",
                agent_integration::rig_split_query()
            ),
            token,
        );
        let id = started["id"].as_u64().unwrap();
        assert_eq!(started["label"], "qd4");
        let a = RunArgs {
            qd: 4,
            ios: 3000,
            name: "svc-rig".into(),
            no_guest_agent: true,
            ..Default::default()
        };
        // The same boot under a standalone `iospan run` as well: the two count
        // the same requests.
        let (qemu, dev) = guest::qemu_command(rig, &a, image);
        let tmp = tempfile::tempdir().unwrap();
        let standalone = tmp.path().join("svc-standalone.json");
        let t0 = Instant::now();
        let out = run_around(
            Command::new(iospan_bin())
                .args(["run", "--quiet", "--disk", host])
                .args(agent_integration::rig_split_args())
                .arg("--json-out")
                .arg(&standalone),
            &qemu,
        );
        let console: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        let r = guest::parse(&console, &a, dev, t0.elapsed().as_secs_f64()).unwrap();
        let rep: Value = serde_json::from_slice(&std::fs::read(&standalone).unwrap()).unwrap();
        let standalone_ios = rep["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["vm"] == "svc-rig" && e["disk"] == "vd0" && e["op"] == "read")
            .and_then(|e| e["ios"].as_u64())
            .unwrap_or_else(|| panic!("{rep:#}"));
        tmux.until("the guest's row", |s| s.contains("svc-rig"));
        let stopped = post(addr, &format!("/api/v1/runs/{id}/stop"), token);
        let report = &stopped["report"];
        let entry = report["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["vm"] == "svc-rig" && e["disk"] == "vd0" && e["op"] == "read")
            .unwrap_or_else(|| panic!("{stopped:#}"));
        // Exactly what the standalone run counted (and the guest itself, merges
        // aside: the rig tests hold that).
        assert_eq!(entry["ios"].as_u64(), Some(standalone_ios), "{entry:#}");
        assert!(
            standalone_ios <= r.guest_reads,
            "{standalone_ios} vs {}",
            r.guest_reads
        );
        for seg in ["total", "hv", "engine", "device", "queue"] {
            assert!(
                entry["segments"][seg]["count"].as_u64().unwrap_or(0) > 0,
                "{seg}: {entry:#}"
            );
        }
        let (_, runs) = get(addr, "/api/v1/runs", Some(token));
        assert!(runs.contains("\"qd4\""), "{runs}");
    }
}

fn stop_cleanly(agent: &mut Agent, token: &str) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
    let status = agent_integration::wait_limited(&mut agent.0, Duration::from_secs(30))
        .expect("the agent did not stop on SIGTERM");
    let mut log = String::new();
    std::io::Read::read_to_string(agent.0.stderr.as_mut().unwrap(), &mut log).unwrap();
    assert!(status.success(), "{log}");
    assert!(log.contains("max_disk") && log.contains("stays"), "{log}");
    assert!(log.contains("line 3, token"), "{log}");
    assert!(!log.contains(token), "the token reached the log: {log}");
    assert!(log.contains("reloaded"), "{log}");
}

fn post_status(addr: &str, path: &str, token: Option<&str>) -> u16 {
    xtask::backends::http_post(addr, path, token)
        .unwrap_or_else(|e| panic!("POST {path}: {e:#}"))
        .0
}

/// The default on loopback: reads open, starting and stopping runs only
/// with the token the agent made at its first start in a 0600 file; no
/// token on `top`'s command line; `iospan run`'s API the same.
#[test]
fn on_loopback_runs_start_only_with_the_agents_own_token() {
    use std::os::unix::fs::PermissionsExt;
    let dir_held = tempfile::Builder::new()
        .prefix("iospan-cred-")
        .tempdir()
        .unwrap();
    let dir = dir_held.path().to_path_buf();
    let token_file = dir.join("state/api-token");
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let conf = config_file(
        "cred",
        &format!(
            "[agent]\nmax_disks = 4\n[api]\nlisten = \"{addr}\"\ntoken_file = \"{}\"\n",
            token_file.display()
        ),
    );
    let mut agent = Agent::start(&conf);
    wait_healthy(&addr);
    let meta = std::fs::metadata(&token_file).expect("the agent made no token file");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let token = std::fs::read_to_string(&token_file)
        .unwrap()
        .trim()
        .to_string();
    assert_eq!(token.len(), 64, "{token}");

    assert_eq!(get(&addr, "/api/v1/snapshot", None).0, 200);
    assert_eq!(post_status(&addr, "/api/v1/runs?label=x", None), 401);
    assert_eq!(
        post_status(&addr, "/api/v1/runs?label=x", Some("wrong")),
        401
    );
    assert_eq!(
        post_status(&addr, "/api/v1/runs?label=x", Some(&token)),
        201
    );
    assert_eq!(post_status(&addr, "/api/v1/runs/1/stop", None), 401);
    assert_eq!(post_status(&addr, "/api/v1/runs/1/stop", Some(&token)), 200);
    let (_, metrics) = get(&addr, "/metrics", None);
    assert!(
        metrics.contains("iospan_api_refused_total{reason=\"unauthorized\"} 3"),
        "{metrics}"
    );

    top_refuses_a_token_seen_by_others(&addr, &token, &dir);

    // The next start keeps the token.
    let _ = agent.0.kill();
    let _ = agent.0.wait();
    let _agent = Agent::start(&conf);
    wait_healthy(&addr);
    assert_eq!(std::fs::read_to_string(&token_file).unwrap().trim(), token);
    assert_eq!(
        post_status(&addr, "/api/v1/runs?label=y", Some(&token)),
        201
    );

    a_standalone_run_keeps_the_same_rule();
}

/// `top`: never the token in argv; a token file must be private.
fn top_refuses_a_token_seen_by_others(addr: &str, token: &str, dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    let out = run(Command::new(iospan_bin()).args(["top", "--connect", addr, "--token", token]));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("IOSPAN_TOKEN"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let open = dir.join("open-token");
    std::fs::write(&open, token).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = run(Command::new(iospan_bin())
        .args(["top", "--connect", addr, "--token-file"])
        .arg(&open));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("chmod 600"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `iospan run --metrics-listen`: the same rule, with the token of the
/// agent's default file.
fn a_standalone_run_keeps_the_same_rule() {
    use std::os::unix::fs::PermissionsExt;
    let addr2 = format!("127.0.0.1:{}", free_port().unwrap());
    let mut standalone = Command::new(iospan_bin())
        .args([
            "run",
            "--quiet",
            "--max-disks",
            "4",
            "--metrics-listen",
            &addr2,
            "--",
            "sleep",
            "30",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_healthy(&addr2);
    assert_eq!(get(&addr2, "/api/v1/snapshot", None).0, 200);
    let default = std::fs::read_to_string("/var/lib/iospan/api-token").unwrap();
    assert_eq!(
        std::fs::metadata("/var/lib/iospan/api-token")
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    assert_eq!(post_status(&addr2, "/api/v1/runs?label=z", None), 401);
    assert_eq!(
        post_status(&addr2, "/api/v1/runs?label=z", Some(default.trim())),
        201
    );
    let _ = standalone.kill();
    let _ = standalone.wait();
}

/// SIGTERM while a reload restarts the measuring run (the run's own
/// handlers not made yet): the agent still stops, at once and cleanly.
#[test]
fn a_stop_during_a_reload_is_not_lost() {
    let dir_held = tempfile::Builder::new()
        .prefix("iospan-hupterm-")
        .tempdir()
        .unwrap();
    let dir = dir_held.path().to_path_buf();
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let conf = config_file(
        "hupterm",
        &format!(
            "[agent]\nmax_disks = 4\n[api]\nlisten = \"{addr}\"\ntoken_file = \"{}\"\n",
            dir.join("api-token").display()
        ),
    );
    for delay_ms in [0u64, 20, 200] {
        let mut agent = Agent::start(&conf);
        let t = Instant::now();
        // Measuring: the first frame is out.
        while !get(&addr, "/api/v1/snapshot", None).1.contains("\"at_s\"") {
            assert!(t.elapsed() < Duration::from_secs(30), "never measuring");
            std::thread::sleep(Duration::from_millis(100));
        }
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(agent.0.id() as i32, libc::SIGHUP) };
        std::thread::sleep(Duration::from_millis(delay_ms));
        unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
        let status = agent_integration::wait_limited(&mut agent.0, Duration::from_secs(20))
            .unwrap_or_else(|| panic!("SIGTERM {delay_ms} ms after SIGHUP was lost"));
        assert!(status.success(), "{status}");
    }
}

#[test]
fn off_the_host_the_api_is_https_with_a_token_and_top_connects_over_it() {
    let dir_held = tempfile::Builder::new()
        .prefix("iospan-svc-tls-")
        .tempdir()
        .unwrap();
    let dir = dir_held.path().to_path_buf();
    // A CA, and the agent's certificate signed by it (for 127.0.0.1).
    let (ca, cert, key) = agent_integration::test_ca(&dir, "api");
    let port = free_port().unwrap();
    let token = "t0ken";
    let listen = format!("0.0.0.0:{port}");
    // Off the host with a token but no TLS: refused, naming the keys.
    let p = config_file(
        "tls-none",
        &format!("[api]\nlisten = \"{listen}\"\ntoken = \"{token}\"\n"),
    );
    let out = run(Command::new(iospan_bin())
        .args(["agent", "--config"])
        .arg(&p));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("api.tls_cert"),
        "{err}"
    );

    let p = config_file(
        "tls",
        &format!(
            "[agent]\nmax_disks = 8\n[api]\nlisten = \"{listen}\"\ntoken = \"{token}\"\n\
             tls_cert = {:?}\ntls_key = {:?}\n",
            cert.display().to_string(),
            key.display().to_string()
        ),
    );
    let _agent = Agent::start(&p);
    let base = format!("https://127.0.0.1:{port}");
    let t = Instant::now();
    while agent_integration::curl_tls(&format!("{base}/healthz"), &ca, None).0 != 200 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "never healthy over https"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let snap = format!("{base}/api/v1/snapshot");
    assert_eq!(agent_integration::curl_tls(&snap, &ca, None).0, 401);
    let (code, body) = agent_integration::curl_tls(&snap, &ca, Some(token));
    assert_eq!(code, 200, "{body}");
    serde_json::from_str::<Value>(&body).expect("the snapshot is JSON");
    // Plain HTTP on the TLS port gets no answer.
    assert_ne!(get(&format!("127.0.0.1:{port}"), "/healthz", None).0, 200);

    // top: without trusting the agent's certificate it refuses, saying why;
    // trusting it, it shows the agent's frames.
    let out = run(Command::new(iospan_bin())
        .args(["top", "--connect", &base])
        .env("IOSPAN_TOKEN", token));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "an untrusted certificate was accepted"
    );
    assert!(
        err.contains("--connect") && err.to_lowercase().contains("certificate"),
        "{err}"
    );
    let tmux = Tmux::start(
        &format!(
            "IOSPAN_TOKEN={token} {} top --connect {base} --ca-cert {}",
            iospan_bin().display(),
            ca.display()
        ),
        160,
        30,
    );
    // The footer's interval is 0.0 s until a frame has come.
    tmux.until("a frame over https", |s| {
        s.contains("VM / DISK")
            && s.lines()
                .any(|l| l.contains("lost ") && !l.trim_start().starts_with("0.0s"))
    });
    tmux.keys(&["q"]);
}

/// Two agents (two hosts' worth), one `top --connect A,B`: each agent's
/// rows under its address.
#[test]
fn top_connects_to_several_agents_and_groups_their_rows() {
    let (_, image) = rig_and_image();
    let host = host_disk_of(&image);
    let addrs: Vec<String> = (0..2)
        .map(|_| format!("127.0.0.1:{}", free_port().unwrap()))
        .collect();
    // Each agent with its configuration, kept while it runs.
    let _agents: Vec<(Agent, tempfile::TempPath)> = addrs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let p = config_file(
                &format!("fleet{i}"),
                &format!("[agent]\ndisks = [\"{host}\"]\nvms = false\n[api]\nlisten = \"{a}\"\n"),
            );
            (Agent::start(&p), p)
        })
        .collect();
    for a in &addrs {
        let t = Instant::now();
        while get(a, "/healthz", None).0 != 200 {
            assert!(t.elapsed() < Duration::from_secs(30), "{a} never healthy");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let tmux = Tmux::start(
        &format!(
            "{} top --connect {}",
            iospan_bin().display(),
            addrs.join(",")
        ),
        200,
        30,
    );
    // Reads on the traced disk, seen by both agents.
    let reader = std::thread::spawn({
        let image = image.clone();
        move || {
            for _ in 0..20 {
                let _ = Command::new("dd")
                    .arg(format!("if={}", image.display()))
                    .args([
                        "of=/dev/null",
                        "bs=4k",
                        "count=200",
                        "iflag=direct",
                        "status=none",
                    ])
                    .status();
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    });
    // Each agent's row of the disk, under its address, with reads.
    let rate = |s: &str, a: &str| -> Option<f64> {
        let at = s.lines().next()?.find("R/s")?;
        let row = s.lines().find(|l| l.starts_with(&format!("{a}/{host}")))?;
        row.get(at..)?.split_whitespace().next()?.parse().ok()
    };
    let s = tmux.until("both agents' rows reading", |s| {
        addrs.iter().all(|a| rate(s, a).is_some_and(|r| r > 0.0))
    });
    eprintln!("{s}");
    tmux.keys(&["q"]);
    let _ = reader.join();
}
