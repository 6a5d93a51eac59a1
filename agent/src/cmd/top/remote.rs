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
    http: reqwest::Client,
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
        crate::api::tls::install_provider();
        // The stream lasts as long as the view: a deadline on connecting
        // only.
        let mut http =
            reqwest::Client::builder().connect_timeout(std::time::Duration::from_secs(10));
        if let Some(path) = ca {
            if base.starts_with("http://") {
                anyhow::bail!(
                    "--ca-cert with --connect {addr}: the agent is reached over https://"
                );
            }
            let pem =
                std::fs::read(path).with_context(|| format!("--ca-cert {}", path.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .with_context(|| format!("--ca-cert {}: PEM certificates", path.display()))?;
            if certs.is_empty() {
                anyhow::bail!("--ca-cert {}: no PEM certificate in it", path.display());
            }
            http = http.tls_certs_only(certs);
        }
        let http = http.build().context("the HTTP client")?;
        Ok(Self { base, token, http })
    }

    /// Opens the agent's frame stream (`/api/v1/stream`).
    pub(super) async fn open(&self) -> Result<FrameStream> {
        let url = format!("{}/api/v1/stream", self.base);
        let mut req = self.http.get(&url).header("Accept", "text/event-stream");
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let fail = |e: &dyn std::fmt::Display, hint: &str| {
            anyhow::anyhow!("--connect: {url}: {e} ({hint})")
        };
        let resp = req.send().await.map_err(|e| {
            // The cause of a TLS failure is a few sources down.
            let chain = crate::probes::error_chain(&e);
            let hint = if chain.contains("certificate") || chain.contains("UnknownIssuer") {
                "the agent's certificate is not trusted: --ca-cert with the CA that signed it"
            } else {
                "is `iospan agent` running there?"
            };
            fail(&chain, hint)
        })?;
        match resp.status() {
            s if s.is_success() => Ok(FrameStream { url, resp }),
            reqwest::StatusCode::UNAUTHORIZED => Err(fail(
                &"401 Unauthorized",
                "send the agent's api.token: IOSPAN_TOKEN or --token-file",
            )),
            s => Err(fail(&s, "is `iospan agent` running there?")),
        }
    }
}

pub(super) struct FrameStream {
    url: String,
    resp: reqwest::Response,
}

impl FrameStream {
    /// Hands each frame (server-sent events) to `on_frame` until the
    /// stream ends or `on_frame` says the view is gone.
    pub(super) async fn follow(mut self, mut on_frame: impl FnMut(Frame) -> bool) -> Result<()> {
        let url = self.url;
        let mut pending = Vec::new();
        while let Some(chunk) = self
            .resp
            .chunk()
            .await
            .with_context(|| format!("reading {url}"))?
        {
            pending.extend_from_slice(&chunk);
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
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
