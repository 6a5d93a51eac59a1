//! Real tracing backends for the tests and for a local stack: Jaeger and
//! the collector built from the Go module proxy (pinned versions),
//! Prometheus as Debian ships it; cached outside the checkout, run bound to
//! 127.0.0.1 on ports chosen per instance.

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use clap::{Subcommand, ValueEnum};

use crate::{debian, sh};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Jaeger v2 (OTLP in, query API `/api/traces`, `/api/v3/traces`).
    Jaeger,
    /// Prometheus (scrapes /metrics) and promtool (checks PromQL):
    /// Debian's build, unpacked.
    Prometheus,
    /// The fleet collector: collector/builder.yaml built by the
    /// OpenTelemetry Collector builder.
    Otelcol,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Self::Jaeger => "jaeger",
            Self::Prometheus => "prometheus",
            Self::Otelcol => "otelcol",
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
            // Whoever stops us (a terminal's Ctrl-C, `kill -INT` of this
            // process alone, a supervisor's SIGTERM) stops the backend
            // too: the signals are taken by a thread of ours, and the
            // backend dies with us even when we are killed outright.
            let stop = block_stop_signals();
            FOREGROUND.store(true, std::sync::atomic::Ordering::Relaxed);
            let mut j = Jaeger::start()?;
            // The scratch directory is said too: killed outright (SIGKILL),
            // we cannot remove it; whoever killed us can.
            eprintln!(
                "xtask: {} running: OTLP grpc {} http {}, scratch {}, query http://{}",
                which.name(),
                j.otlp_grpc,
                j.otlp_http,
                j.server.scratch().display(),
                j.query
            );
            let waiter = std::thread::spawn(move || {
                let mut sig = 0;
                // SAFETY: `stop` is a valid set; sigwait writes one int.
                unsafe { libc::sigwait(&stop, &mut sig) };
                sig
            });
            loop {
                if let Some(status) = j.server.child.try_wait()? {
                    bail!("{} exited: {status}", which.name());
                }
                if waiter.is_finished() {
                    let sig = waiter.join().unwrap_or(libc::SIGTERM);
                    eprintln!("xtask: {} stopped (signal {sig})", which.name());
                    drop(j);
                    std::process::exit(128 + sig);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Set by `backends run`: servers started from now on die with this
/// process and take the signals it blocked back.
static FOREGROUND: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// SIGINT, SIGTERM and SIGHUP blocked in this thread (and the threads it
/// starts): for `sigwait`.
fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
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

/// The backend's (main) binary, built or fetched if not cached yet; the
/// others of the same build or package (promtool) lie beside it.
pub fn ensure(b: Backend) -> Result<PathBuf> {
    match b {
        Backend::Jaeger => ensure_built(b, JAEGER, &[("jaeger", "./cmd/jaeger")]),
        Backend::Prometheus => ensure_prometheus(),
        Backend::Otelcol => ensure_otelcol(),
    }
}

/// Jaeger's module and version.
const JAEGER: (&str, &str) = ("github.com/jaegertracing/jaeger", "v1.76.0");

/// `b` built from a Go module at a version: its binaries (name, package),
/// the first returned.
fn ensure_built(
    b: Backend,
    (module, version): (&str, &str),
    bins: &[(&str, &str)],
) -> Result<PathBuf> {
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

/// The Debian suite whose Prometheus the suite runs: 2.53, the newest a
/// stable Debian ships (exemplar storage and native histograms behind
/// feature flags; no OTLP receiver, which Debian's build leaves out).
const PROMETHEUS_SUITE: &str = "trixie";

/// Prometheus and promtool side by side, from Debian's packages: fetched
/// and unpacked as the suite's kernels are, cached by version.
fn ensure_prometheus() -> Result<PathBuf> {
    let tools = ["prometheus", "promtool"];
    let whole = |dir: &std::path::Path| tools.iter().all(|t| dir.join(t).exists());
    // Each server's start asks for it: a cached one is taken without apt.
    let backends = cache_dir().join("backends");
    if let Some(dir) = std::fs::read_dir(&backends).ok().and_then(|d| {
        d.flatten().map(|e| e.path()).find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("prometheus-debian-"))
                && whole(p)
        })
    }) {
        return Ok(dir.join("prometheus"));
    }
    let suite = debian::Suite::open(PROMETHEUS_SUITE)?;
    let version = suite.version("prometheus")?;
    let dir = backends.join(format!("prometheus-debian-{version}"));
    let bin = dir.join("prometheus");
    std::fs::create_dir_all(&dir)?;
    for tool in tools {
        let from = suite.unpacked(tool)?.join("usr/bin").join(tool);
        let to = dir.join(tool);
        std::fs::copy(&from, to.with_extension("partial"))
            .with_context(|| format!("Debian's {tool} package has no {}", from.display()))?;
        std::fs::rename(to.with_extension("partial"), &to)?;
    }
    Ok(bin)
}

/// The collector builder's version, and so the collector's (builder.yaml
/// pins its components to the same).
pub const OTELCOL_VERSION: &str = "v0.159.0";

/// The fleet collector, built from collector/builder.yaml by the builder
/// (itself `go install`ed at the same version); cached by the manifest's
/// content, so a changed manifest builds anew.
pub fn ensure_otelcol() -> Result<PathBuf> {
    let manifest = sh::root().join("collector/builder.yaml");
    let text = std::fs::read_to_string(&manifest)
        .with_context(|| format!("reading {}", manifest.display()))?;
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let dir = cache_dir()
        .join("backends")
        .join(format!("otelcol-{OTELCOL_VERSION}-{hash:016x}"));
    let bin = dir.join("iospan-otelcol");
    if bin.exists() {
        return Ok(bin);
    }
    if !sh::which("go") {
        bail!(
            "building the collector needs Go (the go command); install it, or put a built collector at {}",
            bin.display()
        );
    }
    eprintln!(
        "xtask: building the collector {OTELCOL_VERSION} (builder, then its components: minutes, once; cached in {})",
        cache_dir().display()
    );
    let gobin = cache_dir()
        .join("backends")
        .join(format!("builder-{OTELCOL_VERSION}"));
    let builder = gobin.join("builder");
    if !builder.exists() {
        sh::run(
            Command::new("go")
                .args([
                    "install",
                    &format!("go.opentelemetry.io/collector/cmd/builder@{OTELCOL_VERSION}"),
                ])
                .env("GOBIN", &gobin),
        )?;
    }
    // The manifest's output path, made absolute in a copy beside the build.
    let work = cache_dir().join("src").join(format!("otelcol-{hash:016x}"));
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("clearing {}", work.display()))?;
    }
    std::fs::create_dir_all(&work)?;
    let copy = work.join("builder.yaml");
    std::fs::write(
        &copy,
        text.replace(
            "output_path: ./dist",
            &format!("output_path: {}", work.join("dist").display()),
        ),
    )?;
    sh::run(Command::new(&builder).arg("--config").arg(&copy))?;
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(
        work.join("dist/iospan-otelcol"),
        bin.with_extension("partial"),
    )
    .context("the builder's output")?;
    std::fs::rename(bin.with_extension("partial"), &bin)?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(bin)
}

/// A free TCP port on 127.0.0.1 (taken by the next bind, which is racy but
/// fine on a test machine).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A backend process with a directory of its own (config, data, log),
/// stopped and cleaned up when dropped.
pub struct Server {
    child: Child,
    name: &'static str,
    dir: TempDir,
}

impl Server {
    /// Its scratch directory (configuration, data, log), removed with it.
    pub fn scratch(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Runs `b`'s binary with `args` (which may name files in `dir`), and
    /// waits until `GET ready_path` on `ready_at` answers 200.
    fn start(
        b: Backend,
        dir: TempDir,
        args: &[String],
        ready_at: &str,
        ready_path: &str,
        within: Duration,
    ) -> Result<Self> {
        Self::start_env(b, dir, args, &[], ready_at, ready_path, within)
    }

    fn start_env(
        b: Backend,
        dir: TempDir,
        args: &[String],
        envs: &[(String, String)],
        ready_at: &str,
        ready_path: &str,
        within: Duration,
    ) -> Result<Self> {
        let bin = ensure(b)?;
        let log = std::fs::File::create(dir.path().join("log"))?;
        let mut cmd = Command::new(&bin);
        cmd.args(args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log);
        if FOREGROUND.load(std::sync::atomic::Ordering::Relaxed) {
            use std::os::unix::process::CommandExt;
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    let mut none: libc::sigset_t = std::mem::zeroed();
                    libc::sigemptyset(&mut none);
                    libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut server = Self {
            child,
            name: b.name(),
            dir,
        };
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = server.child.try_wait()? {
                bail!(
                    "{} exited at start ({status}):\n{}",
                    server.name,
                    server.log()
                );
            }
            if http_get(ready_at, ready_path, &[]).is_ok_and(|(code, _)| code == 200) {
                return Ok(server);
            }
            if Instant::now() > deadline {
                bail!(
                    "{} not ready after {within:?}:\n{}",
                    server.name,
                    server.log()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// CPU time (user + system) the server has used so far.
    pub fn cpu_time(&self) -> Result<Duration> {
        sh::cpu_time_of(self.child.id())
    }

    /// What it wrote to stderr.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// 127.0.0.1 and a free port.
fn local_addr() -> Result<String> {
    Ok(format!("127.0.0.1:{}", free_port()?))
}

/// A running Jaeger (all in memory).
pub struct Jaeger {
    pub server: Server,
    /// host:port
    pub otlp_grpc: String,
    pub otlp_http: String,
    pub query: String,
}

impl Jaeger {
    pub fn start() -> Result<Self> {
        Self::start_with_ui(None)
    }

    /// With `ui`, a build of the Jaeger UI served on its query port.
    pub fn start_with_ui(ui: Option<&std::path::Path>) -> Result<Self> {
        let dir = TempDir::new("jaeger")?;
        let (grpc, http, query, query_grpc, health) = (
            local_addr()?,
            local_addr()?,
            local_addr()?,
            local_addr()?,
            local_addr()?,
        );
        let config = dir.path().join("config.yaml");
        std::fs::write(
            &config,
            jaeger_config(&grpc, &http, &query, &query_grpc, &health, ui),
        )?;
        let args = ["--config".to_string(), config.display().to_string()];
        Ok(Self {
            server: Server::start(
                Backend::Jaeger,
                dir,
                &args,
                &health,
                "/status",
                Duration::from_secs(60),
            )?,
            otlp_grpc: grpc,
            otlp_http: http,
            query,
        })
    }

    /// GET on the query API: (status, body).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get(&self.query, path, &[])
    }
}

fn jaeger_config(
    grpc: &str,
    http: &str,
    query: &str,
    query_grpc: &str,
    health: &str,
    ui: Option<&std::path::Path>,
) -> String {
    let ui = ui.map_or_else(String::new, |d| {
        format!("    ui:\n      assets_path: \"{}\"\n", d.display())
    });
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
{ui}    storage:
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

/// A plain-HTTP request to a local server, as the suite and the bench
/// make them: its method, path, query and bearer token.
pub struct HttpReq<'a> {
    pub method: reqwest::Method,
    pub path: &'a str,
    pub query: &'a [(&'a str, &'a str)],
    pub bearer: Option<&'a str>,
}

/// Sends `req` to `hostport`: (status, body). Any status is an answer;
/// only an unreachable server (or one silent for 10 s) is an error.
pub fn http(hostport: &str, req: &HttpReq) -> Result<(u16, String)> {
    let url = format!("http://{hostport}{}", req.path);
    // Built with the agent (tests), reqwest takes its TLS without a
    // crypto provider of its own and wants one installed even for plain
    // HTTP: ring, the agent's; an error only says one already is.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .context("building an HTTP client")?;
    let mut b = client
        .request(req.method.clone(), &url)
        .header("Accept", "application/json")
        .query(req.query);
    if let Some(t) = req.bearer {
        b = b.bearer_auth(t);
    }
    let resp = b.send().with_context(|| format!("{} {url}", req.method))?;
    let status = resp.status().as_u16();
    let body = resp
        .text()
        .with_context(|| format!("{} {url}: the body", req.method))?;
    Ok((status, body))
}

/// GET `path` from `hostport` with `query` parameters: (status, body).
pub fn http_get(hostport: &str, path: &str, query: &[(&str, &str)]) -> Result<(u16, String)> {
    http(
        hostport,
        &HttpReq {
            method: reqwest::Method::GET,
            path,
            query,
            bearer: None,
        },
    )
}

/// POST to `path` on `hostport` with no body, with `bearer` as its token
/// where given: (status, body).
pub fn http_post(hostport: &str, path: &str, bearer: Option<&str>) -> Result<(u16, String)> {
    http(
        hostport,
        &HttpReq {
            method: reqwest::Method::POST,
            path,
            query: &[],
            bearer,
        },
    )
}

/// GET with a bearer token: (status, body).
pub fn http_get_as(hostport: &str, path: &str, bearer: &str) -> Result<(u16, String)> {
    http(
        hostport,
        &HttpReq {
            method: reqwest::Method::GET,
            path,
            query: &[],
            bearer: Some(bearer),
        },
    )
}

/// A backend's scratch directory, removed with it.
struct TempDir(tempfile::TempDir);

impl TempDir {
    fn new(tag: &str) -> Result<Self> {
        let d = tempfile::Builder::new()
            .prefix(&format!("iospan-{tag}-"))
            .tempdir()?;
        Ok(Self(d))
    }

    fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

/// A running Prometheus scraping one target every second.
pub struct Prometheus {
    pub server: Server,
    /// host:port of its HTTP API.
    pub api: String,
}

impl Prometheus {
    /// Scrapes `target` (host:port, path /metrics).
    pub fn start(target: &str) -> Result<Self> {
        Self::start_with(&Self::scraping(target), &[])
    }

    /// Scrapes `target` as `start` does, native histograms kept (asked
    /// for in the protobuf exposition).
    pub fn start_native(target: &str) -> Result<Self> {
        Self::start_with(
            &Self::scraping(target),
            &["--enable-feature=native-histograms"],
        )
    }

    fn scraping(target: &str) -> String {
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n  - job_name: iospan\n    static_configs:\n      - targets: [\"{target}\"]\n"
        )
    }

    fn start_with(config_text: &str, extra: &[&str]) -> Result<Self> {
        let dir = TempDir::new("prometheus")?;
        let api = local_addr()?;
        let config = dir.path().join("prometheus.yml");
        std::fs::write(&config, config_text)?;
        let mut args = vec![
            format!("--config.file={}", config.display()),
            format!("--storage.tsdb.path={}", dir.path().join("data").display()),
            format!("--web.listen-address={api}"),
            // Exemplars are kept only with this on.
            "--enable-feature=exemplar-storage".to_string(),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        let server = Server::start(
            Backend::Prometheus,
            dir,
            &args,
            &api,
            "/-/ready",
            Duration::from_secs(60),
        )?;
        Ok(Self { server, api })
    }

    /// The exemplars of a selector's series between two Unix times: the
    /// JSON answer.
    pub fn exemplars(&self, promql: &str, start: f64, end: f64) -> Result<serde_json::Value> {
        let (start, end) = (format!("{start:.3}"), format!("{end:.3}"));
        let (code, body) = http_get(
            &self.api,
            "/api/v1/query_exemplars",
            &[("query", promql), ("start", &start), ("end", &end)],
        )?;
        if code != 200 {
            bail!("exemplars of {promql}: HTTP {code}: {body}");
        }
        Ok(serde_json::from_str(&body)?)
    }

    /// An instant PromQL query at `time` (Unix seconds): the JSON answer.
    pub fn query(&self, promql: &str, time: f64) -> Result<serde_json::Value> {
        let time = format!("{time:.3}");
        let (code, body) = http_get(
            &self.api,
            "/api/v1/query",
            &[("query", promql), ("time", &time)],
        )?;
        if code != 200 {
            bail!("query {promql}: HTTP {code}: {body}");
        }
        Ok(serde_json::from_str(&body)?)
    }
}

/// `Collector::metrics_relay`'s configuration.
const METRICS_RELAY: &str = "\
extensions:
  health_check:
    endpoint: ${env:IOSPAN_HEALTH_ENDPOINT}
receivers:
  otlp:
    protocols:
      http:
        endpoint: ${env:IOSPAN_OTLP_HTTP_ENDPOINT}
exporters:
  prometheus:
    endpoint: ${env:IOSPAN_PROMETHEUS_ENDPOINT}
service:
  extensions: [health_check]
  pipelines:
    metrics:
      receivers: [otlp]
      exporters: [prometheus]
";

/// A running fleet collector: a shipped configuration (collector/NAME.yaml)
/// with its endpoints and policy figures set through the environment.
pub struct Collector {
    pub server: Server,
    pub otlp_grpc: String,
    pub otlp_http: String,
    /// host:port of the Prometheus exporter (gateway).
    pub prometheus: String,
}

impl Collector {
    /// `config`: "gateway" or "lb"; `env`: IOSPAN_* settings beyond the
    /// endpoints this picks.
    pub fn start(config: &str, env: &[(&str, &str)]) -> Result<Self> {
        Self::start_with(&[config], env)
    }

    /// Several of collector/'s files, merged in order (a tier, then
    /// overlays such as "tls").
    pub fn start_with(configs: &[&str], env: &[(&str, &str)]) -> Result<Self> {
        let files: Vec<PathBuf> = configs
            .iter()
            .map(|c| sh::root().join(format!("collector/{c}.yaml")))
            .collect();
        Self::start_files(TempDir::new("otelcol")?, &files, env)
    }

    /// OTLP metrics in (HTTP), its Prometheus exporter out: how OTLP
    /// metrics become series a Prometheus scrapes (exponential histograms
    /// as native histograms, over the protobuf exposition).
    pub fn metrics_relay() -> Result<Self> {
        let dir = TempDir::new("otelcol")?;
        let config = dir.path().join("relay.yaml");
        std::fs::write(&config, METRICS_RELAY)?;
        Self::start_files(dir, &[config], &[])
    }

    fn start_files(dir: TempDir, files: &[PathBuf], env: &[(&str, &str)]) -> Result<Self> {
        let (grpc, http, prom, health) =
            (local_addr()?, local_addr()?, local_addr()?, local_addr()?);
        let mut envs: Vec<(String, String)> = vec![
            ("IOSPAN_OTLP_GRPC_ENDPOINT".into(), grpc.clone()),
            ("IOSPAN_OTLP_HTTP_ENDPOINT".into(), http.clone()),
            ("IOSPAN_PROMETHEUS_ENDPOINT".into(), prom.clone()),
            ("IOSPAN_HEALTH_ENDPOINT".into(), health.clone()),
        ];
        envs.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let args: Vec<String> = files
            .iter()
            .map(|path| format!("--config={}", path.display()))
            .collect();
        let server = Server::start_env(
            Backend::Otelcol,
            dir,
            &args,
            &envs,
            &health,
            "/",
            Duration::from_secs(60),
        )?;
        Ok(Self {
            server,
            otlp_grpc: grpc,
            otlp_http: http,
            prometheus: prom,
        })
    }
}
