//! Real tracing backends for the tests and for a local stack: built from
//! the Go module proxy (pinned versions), cached outside the checkout, run
//! bound to 127.0.0.1 on ports chosen per instance.

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::{Subcommand, ValueEnum};

use crate::sh;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Jaeger v2 (OTLP in, query API `/api/traces`, `/api/v3/traces`).
    Jaeger,
    /// Prometheus (scrapes /metrics) and promtool (checks PromQL).
    Prometheus,
    /// Grafana Tempo 2.9 (OTLP in, TraceQL search).
    Tempo,
}

impl Backend {
    /// Module, version, and the binaries built from it: (name, package).
    fn module(
        self,
    ) -> (
        &'static str,
        &'static str,
        &'static [(&'static str, &'static str)],
    ) {
        match self {
            Self::Jaeger => (
                "github.com/jaegertracing/jaeger",
                "v1.76.0",
                &[("jaeger", "./cmd/jaeger")],
            ),
            Self::Prometheus => (
                "github.com/prometheus/prometheus",
                "v0.315.0",
                &[
                    ("prometheus", "./cmd/prometheus"),
                    ("promtool", "./cmd/promtool"),
                ],
            ),
            Self::Tempo => (
                "github.com/grafana/tempo",
                "v1.5.1-0.20251008140505-607c7fb69662",
                &[("tempo", "./cmd/tempo")],
            ),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Jaeger => "jaeger",
            Self::Prometheus => "prometheus",
            Self::Tempo => "tempo",
        }
    }
}

#[derive(Subcommand)]
pub enum BackendsCmd {
    /// Build (or find cached) the backends' binaries.
    Build {
        #[arg(value_enum, default_values_t = [Backend::Jaeger])]
        which: Vec<Backend>,
    },
    /// Start one in the foreground, bound to 127.0.0.1, until Ctrl-C;
    /// prints its endpoints.
    Run {
        #[arg(value_enum, default_value_t = Backend::Jaeger)]
        which: Backend,
    },
}

pub fn main(cmd: BackendsCmd) -> Result<()> {
    match cmd {
        BackendsCmd::Build { which } => {
            for b in which {
                let bin = ensure(b)?;
                eprintln!("xtask: {} at {}", b.name(), bin.display());
            }
            Ok(())
        }
        BackendsCmd::Run { which } => {
            if which != Backend::Jaeger {
                bail!("`run` starts jaeger; prometheus is started by the tests with a scrape config of theirs");
            }
            let mut j = Jaeger::start()?;
            eprintln!(
                "xtask: {} running: OTLP grpc {} http {}, query http://{}",
                which.name(),
                j.otlp_grpc,
                j.otlp_http,
                j.query
            );
            let status = j.child.wait()?;
            bail!("{} exited: {status}", which.name())
        }
    }
}

/// Where built backends are kept: $IOSPAN_CACHE, else ~/.cache/iospan
/// (outside any checkout, so a fresh clone reuses them).
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("IOSPAN_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/iospan")
}

/// The backend's (main) binary, built if not cached yet; the others
/// built from the same module lie beside it.
pub fn ensure(b: Backend) -> Result<PathBuf> {
    let (module, version, bins) = b.module();
    let dir = cache_dir()
        .join("backends")
        .join(format!("{}-{version}", b.name()));
    let bin = dir.join(bins[0].0);
    if bins.iter().all(|(name, _)| dir.join(name).exists()) {
        return Ok(bin);
    }
    if !sh::which("go") {
        bail!(
            "building {} needs Go (the go command); install it, or put a built {} at {}",
            b.name(),
            b.name(),
            bin.display()
        );
    }
    eprintln!(
        "xtask: building {} {version} from the Go module proxy (minutes, once; cached in {})",
        b.name(),
        cache_dir().display()
    );
    let out = sh::output(Command::new("go").args([
        "mod",
        "download",
        "-json",
        &format!("{module}@{version}"),
    ]))?;
    let info: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("go mod download {module}@{version}: unreadable answer"))?;
    if let Some(e) = info["Error"].as_str() {
        bail!("go mod download {module}@{version}: {e}");
    }
    let src = info["Dir"]
        .as_str()
        .with_context(|| format!("go mod download {module}@{version}: no Dir"))?;
    // The module cache is read-only and `go install` refuses modules with
    // replace directives: build in a writable copy.
    let work = cache_dir()
        .join("src")
        .join(format!("{}-{version}", b.name()));
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("clearing {}", work.display()))?;
    }
    std::fs::create_dir_all(work.parent().expect("has parent"))?;
    sh::run(Command::new("cp").arg("-r").arg(src).arg(&work))?;
    sh::run(Command::new("chmod").args(["-R", "u+w"]).arg(&work))?;
    std::fs::create_dir_all(&dir)?;
    for (name, pkg) in bins {
        let out = dir.join(name);
        let tmp = out.with_extension("partial");
        sh::run(
            Command::new("go")
                .args(["build", "-o"])
                .arg(&tmp)
                .arg(pkg)
                .current_dir(&work)
                .env("GOWORK", "off")
                .env("GOFLAGS", "-mod=mod"),
        )?;
        std::fs::rename(&tmp, &out)?;
    }
    let _ = std::fs::remove_dir_all(&work);
    Ok(bin)
}

/// A free TCP port on 127.0.0.1 (taken by the next bind, which is racy but
/// fine on a test machine).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A running Jaeger (all in memory), stopped when dropped.
pub struct Jaeger {
    pub child: Child,
    /// host:port
    pub otlp_grpc: String,
    pub otlp_http: String,
    pub query: String,
    _dir: TempDir,
}

impl Jaeger {
    pub fn start() -> Result<Self> {
        let bin = ensure(Backend::Jaeger)?;
        let dir = TempDir::new("jaeger")?;
        let port = || free_port().map(|p| format!("127.0.0.1:{p}"));
        let (grpc, http, query, query_grpc, health) = (port()?, port()?, port()?, port()?, port()?);
        let config = dir.0.join("config.yaml");
        std::fs::write(
            &config,
            jaeger_config(&grpc, &http, &query, &query_grpc, &health),
        )?;
        let log = std::fs::File::create(dir.0.join("jaeger.log"))?;
        let child = Command::new(&bin)
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut j = Self {
            child,
            otlp_grpc: grpc,
            otlp_http: http,
            query,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = j.child.try_wait()? {
                let log = std::fs::read_to_string(j._dir.0.join("jaeger.log")).unwrap_or_default();
                bail!("jaeger exited at start ({status}):\n{log}");
            }
            if http_get(&health, "/status").is_ok_and(|(code, _)| code == 200) {
                return Ok(j);
            }
            if Instant::now() > deadline {
                bail!("jaeger not healthy after 60 s");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// GET on the query API: (status, body).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get(&self.query, path)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.0.join("jaeger.log")).unwrap_or_default()
    }
}

impl Drop for Jaeger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn jaeger_config(grpc: &str, http: &str, query: &str, query_grpc: &str, health: &str) -> String {
    format!(
        r#"service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  healthcheckv2:
    use_v2: true
    http:
      endpoint: "{health}"
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: "{query}"
    grpc:
      endpoint: "{query_grpc}"
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: "{grpc}"
      http:
        endpoint: "{http}"
processors:
  batch:
    timeout: 200ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
"#
    )
}

/// A minimal HTTP/1.1 GET (the query APIs are plain JSON over HTTP).
pub fn http_get(hostport: &str, path: &str) -> Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(hostport)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\nAccept: application/json\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Ok((code, body))
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Result<Self> {
        let p = std::env::temp_dir().join(format!(
            "iospan-{tag}-{}-{}",
            std::process::id(),
            Instant::now().elapsed().as_nanos() ^ u128::from(free_port()?)
        ));
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running Prometheus scraping one target every second, stopped when
/// dropped.
pub struct Prometheus {
    pub child: Child,
    /// host:port of its HTTP API.
    pub api: String,
    dir: TempDir,
}

impl Prometheus {
    /// Scrapes `target` (host:port, path /metrics).
    pub fn start(target: &str) -> Result<Self> {
        let bin = ensure(Backend::Prometheus)?;
        let dir = TempDir::new("prometheus")?;
        let api = format!("127.0.0.1:{}", free_port()?);
        let config = dir.0.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
                 scrape_configs:\n  - job_name: iospan\n    static_configs:\n      - targets: [\"{target}\"]\n"
            ),
        )?;
        let log = std::fs::File::create(dir.0.join("prometheus.log"))?;
        let child = Command::new(&bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.0.join("data").display()
            ))
            .arg(format!("--web.listen-address={api}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut p = Self { child, api, dir };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = p.child.try_wait()? {
                bail!("prometheus exited at start ({status}):\n{}", p.log());
            }
            if http_get(&p.api, "/-/ready").is_ok_and(|(code, _)| code == 200) {
                return Ok(p);
            }
            if Instant::now() > deadline {
                bail!("prometheus not ready after 60 s:\n{}", p.log());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// An instant PromQL query at `time` (Unix seconds): the JSON answer.
    pub fn query(&self, promql: &str, time: f64) -> Result<serde_json::Value> {
        let path = format!("/api/v1/query?query={}&time={time:.3}", urlencode(promql));
        let (code, body) = http_get(&self.api, &path)?;
        if code != 200 {
            bail!("query {promql}: HTTP {code}: {body}");
        }
        Ok(serde_json::from_str(&body)?)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("prometheus.log")).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A running Tempo (single binary, local storage), stopped when dropped.
pub struct Tempo {
    pub child: Child,
    pub otlp_grpc: String,
    pub otlp_http: String,
    /// host:port of its HTTP API (search, traces by id).
    pub api: String,
    dir: TempDir,
}

impl Tempo {
    pub fn start() -> Result<Self> {
        let bin = ensure(Backend::Tempo)?;
        let dir = TempDir::new("tempo")?;
        let (http, grpc) = (free_port()?, free_port()?);
        let (otlp_grpc, otlp_http) = (
            format!("127.0.0.1:{}", free_port()?),
            format!("127.0.0.1:{}", free_port()?),
        );
        let memberlist = free_port()?;
        let d = dir.0.display();
        let config = dir.0.join("tempo.yaml");
        std::fs::write(
            &config,
            format!(
                r#"stream_over_http_enabled: true
server:
  http_listen_address: 127.0.0.1
  http_listen_port: {http}
  grpc_listen_address: 127.0.0.1
  grpc_listen_port: {grpc}
  log_level: warn
memberlist:
  bind_addr: [127.0.0.1]
  bind_port: {memberlist}
  join_members: []
usage_report:
  reporting_enabled: false
distributor:
  receivers:
    otlp:
      protocols:
        grpc:
          endpoint: "{otlp_grpc}"
        http:
          endpoint: "{otlp_http}"
ingester:
  trace_idle_period: 1s
  max_block_duration: 1m
  lifecycler:
    address: 127.0.0.1
    ring:
      kvstore:
        store: inmemory
      replication_factor: 1
storage:
  trace:
    backend: local
    wal:
      path: {d}/wal
    local:
      path: {d}/blocks
"#
            ),
        )?;
        let log = std::fs::File::create(dir.0.join("tempo.log"))?;
        let child = Command::new(&bin)
            .arg(format!("-config.file={}", config.display()))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let api = format!("127.0.0.1:{http}");
        let mut t = Self {
            child,
            otlp_grpc,
            otlp_http,
            api,
            dir,
        };
        // /ready answers 503 for its first ~15 s.
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if let Some(status) = t.child.try_wait()? {
                bail!("tempo exited at start ({status}):\n{}", t.log());
            }
            if http_get(&t.api, "/ready").is_ok_and(|(code, _)| code == 200) {
                return Ok(t);
            }
            if Instant::now() > deadline {
                bail!("tempo not ready after 90 s:\n{}", t.log());
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// GET on the API with a query string built from `params`.
    pub fn get(&self, path: &str, params: &[(&str, &str)]) -> Result<(u16, String)> {
        let q: Vec<String> = params
            .iter()
            .map(|(k, v)| format!("{k}={}", urlencode(v)))
            .collect();
        let full = if q.is_empty() {
            path.to_string()
        } else {
            format!("{path}?{}", q.join("&"))
        };
        http_get(&self.api, &full)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("tempo.log")).unwrap_or_default()
    }
}

impl Drop for Tempo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
