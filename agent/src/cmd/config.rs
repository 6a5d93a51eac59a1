//! The host agent's configuration file (TOML, default
//! `/etc/iospan/iospan.toml`), parsed and checked.
//!
//! Every key is optional; unknown keys and bad
//! values are refused with the key's name. `packaging/iospan.toml` is the
//! documented default.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::api::Tls;
use crate::output::export::{DiskThreshold, Policy, TraceOpts};

pub const DEFAULT_PATH: &str = "/etc/iospan/iospan.toml";

/// The file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct File {
    agent: AgentSection,
    api: ApiSection,
    otlp: OtlpSection,
    traces: TracesSection,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct AgentSection {
    disks: Vec<String>,
    max_disks: u32,
    vms: bool,
}

impl Default for AgentSection {
    fn default() -> Self {
        Self {
            disks: Vec::new(),
            max_disks: crate::abi::DEFAULT_MAX_DISKS,
            vms: true,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct ApiSection {
    listen: String,
    token: Option<String>,
    token_file: PathBuf,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    open: bool,
}

impl Default for ApiSection {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9464".into(),
            token: None,
            token_file: PathBuf::from(crate::cmd::token::DEFAULT_FILE),
            tls_cert: None,
            tls_key: None,
            open: false,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct OtlpSection {
    endpoint: Option<String>,
    protocol: Option<String>,
    ca_cert: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct TracesSection {
    slowest: usize,
    slower_than: Option<String>,
    /// virtual disk (`vd0` or `vm/vd0`) -> duration.
    disk_slower_than: std::collections::BTreeMap<String, String>,
    one_in: u64,
    queue: usize,
    run_label: Option<String>,
}

impl Default for TracesSection {
    fn default() -> Self {
        let p = Policy::default();
        Self {
            slowest: p.slowest,
            slower_than: None,
            disk_slower_than: Default::default(),
            one_in: p.one_in,
            queue: p.queue,
            run_label: None,
        }
    }
}

/// The configuration, checked.
#[derive(Clone, Debug)]
pub struct Config {
    pub disks: Vec<String>,
    pub max_disks: u32,
    pub vms: bool,
    pub listen: SocketAddr,
    pub token: Option<String>,
    /// Where the generated token lives when `api.token` is not set.
    pub token_file: PathBuf,
    pub open: bool,
    pub tls: Option<Tls>,
    pub traces: TraceOpts,
}

impl Config {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the configuration {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("configuration {}", path.display()))
    }

    /// The defaults, as if the file were empty.
    pub fn defaults() -> Self {
        Self::parse("").expect("the defaults are valid")
    }

    pub fn parse(text: &str) -> Result<Self> {
        let f: File = toml::from_str(text).map_err(|e| anyhow::anyhow!(describe(&e, text)))?;
        let listen: SocketAddr = f.api.listen.parse().map_err(|e| {
            anyhow::anyhow!(
                "api.listen = {:?}: {e} (an IP address and port, e.g. 127.0.0.1:9464)",
                f.api.listen
            )
        })?;
        let token = f.api.token.filter(|t| !t.is_empty());
        let tls = match (f.api.tls_cert, f.api.tls_key) {
            (Some(cert), Some(key)) => {
                for (k, p) in [("api.tls_cert", &cert), ("api.tls_key", &key)] {
                    std::fs::File::open(p)
                        .map_err(|e| anyhow::anyhow!("{k} = {}: {e}", p.display()))?;
                }
                Some(Tls { cert, key })
            }
            (None, None) => None,
            (Some(_), None) => bail!("api.tls_cert without api.tls_key: set both (PEM files)"),
            (None, Some(_)) => bail!("api.tls_key without api.tls_cert: set both (PEM files)"),
        };
        // Off the host, the token must not cross the network in clear.
        if !listen.ip().is_loopback() && !f.api.open {
            if token.is_none() {
                bail!(
                    "api.listen = {listen}: not a loopback address, and no api.token: set \
                     api.token (clients send it as a bearer token) with api.tls_cert and \
                     api.tls_key, or api.open = true to serve everyone"
                );
            }
            if tls.is_none() {
                bail!(
                    "api.listen = {listen}: not a loopback address, and no api.tls_cert / \
                     api.tls_key: the token would cross the network in clear; set both, or \
                     api.open = true to serve everyone without TLS"
                );
            }
        }
        if f.agent.max_disks == 0 || f.agent.max_disks > 4096 {
            bail!("agent.max_disks = {}: use 1 to 4096", f.agent.max_disks);
        }
        if f.traces.queue == 0 {
            bail!("traces.queue = 0: use at least 1");
        }
        let dur = |key: &str, v: &str| -> Result<Duration> {
            humantime::parse_duration(v)
                .map_err(|e| anyhow::anyhow!("{key} = {v:?}: {e} (e.g. \"2ms\", \"500us\")"))
        };
        let slower_than_ns = match &f.traces.slower_than {
            Some(v) => dur("traces.slower_than", v)?.as_nanos() as u64,
            None => 0,
        };
        let per_disk = f
            .traces
            .disk_slower_than
            .iter()
            .map(|(disk, v)| {
                format!("{disk}={v}")
                    .parse::<DiskThreshold>()
                    .map_err(|e| anyhow::anyhow!("traces.disk_slower_than.{disk}: {e}"))
            })
            .collect::<Result<_>>()?;
        if let Some(p) = &f.otlp.protocol {
            if !matches!(p.as_str(), "grpc" | "http/protobuf") {
                bail!("otlp.protocol = {p:?}: use \"grpc\" or \"http/protobuf\"");
            }
        }
        Ok(Self {
            disks: f.agent.disks,
            max_disks: f.agent.max_disks,
            vms: f.agent.vms,
            listen,
            token,
            token_file: f.api.token_file,
            open: f.api.open,
            tls,
            traces: TraceOpts {
                endpoint: f.otlp.endpoint.filter(|e| !e.is_empty()),
                protocol: f.otlp.protocol,
                ca_cert: f.otlp.ca_cert,
                policy: Policy {
                    slowest: f.traces.slowest,
                    slower_than_ns,
                    per_disk,
                    one_in: f.traces.one_in,
                    queue: f.traces.queue,
                    ..Default::default()
                },
                run_label: f.traces.run_label,
            },
        })
    }
}

/// A parse error said by line and key, never by the line's text: a
/// configuration holds secrets, and errors reach the journal.
fn describe(e: &toml::de::Error, text: &str) -> String {
    let Some(span) = e.span() else {
        return e.message().to_string();
    };
    let start = span.start.min(text.len());
    let line_no = text[..start].matches('\n').count() + 1;
    let line = text.lines().nth(line_no - 1).unwrap_or("");
    let key = line
        .split_once('=')
        .map(|(k, _)| k.trim())
        // Only what can be a key: anything else is the line's text.
        .filter(|k| {
            !k.is_empty()
                && k.len() <= 64
                && k.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        });
    // serde's messages quote the value; a secret's value is not repeated.
    let secret = key.is_some_and(|k| k.contains("token")) || line.trim_start().starts_with("token");
    let message = if secret {
        "not a valid value (not repeated here: it is a secret)".to_string()
    } else {
        e.message().trim().to_string()
    };
    match key {
        Some(k) => format!("line {line_no}, {k}: {message}"),
        None => format!("line {line_no}: {message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_file_is_the_defaults() {
        let shipped = include_str!("../../../packaging/iospan.toml");
        let c = Config::parse(shipped).unwrap();
        let d = Config::defaults();
        assert_eq!(c.listen, d.listen);
        assert_eq!(c.max_disks, d.max_disks);
        assert_eq!(c.traces.policy.slowest, d.traces.policy.slowest);
        assert_eq!(c.traces.policy.queue, d.traces.policy.queue);
    }

    #[test]
    fn errors_name_the_line_and_key_but_never_quote_a_token() {
        for text in [
            "[api]\ntoken = \"s3cret\nlisten = \"127.0.0.1:1\"\n",
            "[api]\ntoken = s3cret\n",
            "[api]\ntoken = [\"s3cret\"]\n",
            "[api]\ntoken = \"\"\"s3cret\n",
        ] {
            let e = format!("{:#}", Config::parse(text).unwrap_err());
            assert!(!e.contains("s3cret"), "{text:?}: {e}");
            assert!(e.contains("line "), "{text:?}: {e}");
        }
        let e = format!(
            "{:#}",
            Config::parse("[agent]\nvms = true\nmax_disks = \"many\"\n").unwrap_err()
        );
        assert!(e.contains("line 3, max_disks"), "{e}");
    }

    #[test]
    fn bad_keys_and_values_are_named() {
        for (text, names) in [
            ("[agent]\nmax_disk = 3\n", "max_disk"),
            ("[agent]\nmax_disks = \"many\"\n", "max_disks"),
            ("[api]\nlisten = \"localhost\"\n", "api.listen"),
            ("[api]\nlisten = \"0.0.0.0:9464\"\n", "api.token"),
            ("[traces]\nslower_than = \"soon\"\n", "traces.slower_than"),
            (
                "[traces.disk_slower_than]\nvd0 = \"x\"\n",
                "traces.disk_slower_than.vd0",
            ),
            ("[otlp]\nprotocol = \"udp\"\n", "otlp.protocol"),
            ("[nope]\n", "nope"),
        ] {
            let e = format!("{:#}", Config::parse(text).unwrap_err());
            assert!(e.contains(names), "{text:?}: {e}");
        }
        let open = Config::parse("[api]\nlisten = \"0.0.0.0:9464\"\nopen = true\n").unwrap();
        assert!(open.token.is_none());
        // A token alone off the host: refused (it would cross in clear).
        let e = format!(
            "{:#}",
            Config::parse("[api]\nlisten = \"0.0.0.0:9464\"\ntoken = \"s3cret\"\n").unwrap_err()
        );
        assert!(e.contains("api.tls_cert"), "{e}");
        let dir_held = tempfile::Builder::new()
            .prefix("iospan-config-tls-")
            .tempdir()
            .unwrap();
        let dir = dir_held.path().to_path_buf();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert, "").unwrap();
        std::fs::write(&key, "").unwrap();
        let tls = |extra: &str| {
            Config::parse(&format!(
                "[api]\nlisten = \"0.0.0.0:9464\"\ntoken = \"s3cret\"\n{extra}"
            ))
        };
        let both = format!(
            "tls_cert = {:?}\ntls_key = {:?}\n",
            cert.display().to_string(),
            key.display().to_string()
        );
        let ok = tls(&both).unwrap();
        assert_eq!(ok.token.as_deref(), Some("s3cret"));
        assert_eq!(ok.tls.as_ref().map(|t| &t.cert), Some(&cert));
        let only_cert = format!("tls_cert = {:?}\n", cert.display().to_string());
        let e = format!("{:#}", tls(&only_cert).unwrap_err());
        assert!(e.contains("api.tls_key"), "{e}");
        let missing = both.replace("key.pem", "gone.pem");
        let e = format!("{:#}", tls(&missing).unwrap_err());
        assert!(e.contains("api.tls_key") && e.contains("gone.pem"), "{e}");
    }
}
