//! Watching agent services instead of local probes: each agent's live
//! frame stream over HTTP(S), several merged into one fleet view.

use std::{collections::BTreeMap, sync::Arc};

use anyhow::{Context, Result};

use super::*;
use crate::output::live::Frame;

/// One source's last interval, named under its host when there are
/// several (`HOST/VM`, `HOST/DISK`): the host groups its rows.
pub(super) fn host_items(
    host: &str,
    prev: Option<&Frame>,
    cur: &Frame,
) -> (Vec<Item>, Vec<Item>, f64) {
    let (mut vms, mut disks, secs) = interval(prev, cur);
    if !host.is_empty() {
        for i in &mut vms {
            i.vm = format!("{host}/{}", i.vm);
        }
        for d in &mut disks {
            d.disk = format!("{host}/{}", d.disk);
        }
    }
    (vms, disks, secs)
}

/// A running agent's API, as `--connect` names it.
pub struct Agent {
    base: String,
    token: Option<String>,
    http: ureq::Agent,
}

impl Agent {
    /// `addr`: HOST:PORT or http(s)://HOST:PORT; `ca`: PEM certificates
    /// to trust over https (the web roots otherwise).
    pub fn new(addr: &str, token: Option<String>, ca: Option<&std::path::Path>) -> Result<Self> {
        let base = if addr.contains("://") {
            addr.trim_end_matches('/').to_string()
        } else {
            format!("http://{addr}")
        };
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            anyhow::bail!("--connect {addr}: use HOST:PORT, http://HOST:PORT or https://HOST:PORT");
        }
        let mut tls = ureq::tls::TlsConfig::builder();
        if let Some(path) = ca {
            if base.starts_with("http://") {
                anyhow::bail!(
                    "--ca-cert with --connect {addr}: the agent is reached over https://"
                );
            }
            let pem =
                std::fs::read(path).with_context(|| format!("--ca-cert {}", path.display()))?;
            let certs = ureq::tls::parse_pem(&pem)
                .filter_map(|i| match i {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c)),
                    Ok(_) => None,
                    Err(e) => Some(Err(e)),
                })
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("--ca-cert {}: PEM certificates", path.display()))?;
            if certs.is_empty() {
                anyhow::bail!("--ca-cert {}: no PEM certificate in it", path.display());
            }
            tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&certs));
        }
        crate::cmd::tls::install_provider();
        let http = ureq::Agent::config_builder()
            .tls_config(tls.build())
            .build()
            .new_agent();
        Ok(Self { base, token, http })
    }

    /// Opens the agent's frame stream (`/api/v1/stream`).
    pub(super) fn open(&self) -> Result<FrameStream> {
        let url = format!("{}/api/v1/stream", self.base);
        let mut req = self.http.get(&url).header("Accept", "text/event-stream");
        if let Some(t) = &self.token {
            req = req.header("Authorization", &format!("Bearer {t}"));
        }
        let resp = req.call().map_err(|e| {
            let hint = match &e {
                ureq::Error::StatusCode(401) => {
                    "send the agent's api.token: IOSPAN_TOKEN or --token-file"
                }
                // TLS failures come wrapped in I/O errors.
                e if e.to_string().contains("certificate") => {
                    "the agent's certificate is not trusted: --ca-cert with the CA that signed it"
                }
                _ => "is `iospan agent` running there?",
            };
            anyhow::anyhow!("--connect: {url}: {e} ({hint})")
        })?;
        Ok(FrameStream {
            url,
            reader: std::io::BufReader::new(Box::new(resp.into_body().into_reader())),
        })
    }
}

pub(super) struct FrameStream {
    url: String,
    reader: std::io::BufReader<Box<dyn std::io::Read + Send>>,
}

impl FrameStream {
    /// Hands each frame (server-sent events) to `on_frame` until the
    /// stream ends or `on_frame` says the view is gone.
    pub(super) fn follow(self, mut on_frame: impl FnMut(Frame) -> bool) -> Result<()> {
        use std::io::BufRead;
        let url = self.url;
        for line in self.reader.lines() {
            let line = line.with_context(|| format!("reading {url}"))?;
            if let Some(data) = line.strip_prefix("data:") {
                let frame: Frame = serde_json::from_str(data.trim())
                    .with_context(|| format!("a frame from {url}"))?;
                if !on_frame(frame) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

/// One source's frame last differenced, and what it gave: VM rows, disk
/// rows, the interval (s).
type Differenced = (Arc<Frame>, Vec<Item>, Vec<Item>, f64);

/// Per source: the frame last differenced, and what it gave.
#[derive(Default)]
pub struct Sources {
    last: BTreeMap<String, Differenced>,
}

impl Sources {
    /// Takes the fleet's frames: sources whose frame changed get their new
    /// interval; the others keep theirs (agents tick on their own clocks).
    pub fn update(&mut self, fleet: &Fleet, st: &mut State) {
        for (host, cur) in fleet {
            let prev = self.last.get(host).map(|l| l.0.clone());
            if prev.as_ref().is_some_and(|p| Arc::ptr_eq(p, cur)) {
                continue;
            }
            let (vms, disks, secs) = host_items(host, prev.as_deref(), cur);
            self.last
                .insert(host.clone(), (cur.clone(), vms, disks, secs));
        }
        if st.paused {
            return;
        }
        st.vms = self.last.values().flat_map(|l| l.1.clone()).collect();
        st.disks = self.last.values().flat_map(|l| l.2.clone()).collect();
        st.interval_s = self.last.values().map(|l| l.3).fold(0.0, f64::max);
        st.lost = self.last.values().map(|l| l.0.lost).sum();
        st.unsplit = self.last.values().map(|l| l.0.unsplit).sum();
        st.polled = self.last.values().map(|l| l.0.polled).sum();
        st.unmatched = self.last.values().map(|l| l.0.unmatched).sum();
    }
}
