//! `iospan top`: a live view of where each VM's I/O latency goes, per VM,
//! virtual disk and host disk — esxtop's GAVG/KAVG/DAVG for KVM.
//!
//! Figures are the last interval's, differenced from two cumulative frames
//! (`live`), refreshed every interval.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use ratatui::crossterm::event::{self, Event};
use tokio::sync::watch;

use crate::{
    cmd::run::{self, LiveFeed, RunOptions},
    output::live::Frame,
};

mod draw;
mod remote;
mod state;

pub use draw::{draw, histogram_text};
pub use remote::{Agent, Sources};
pub use state::{fitting, interval, Col, Item, Kind, Screen, State};

pub struct TopOptions {
    pub disks: Vec<String>,
    pub interval: Duration,
    pub max_disks: u32,
    /// Watch a running agent (`iospan agent`, HOST:PORT of its API)
    /// instead of loading probes here.
    pub connect: Option<String>,
    /// The agent's api.token, where it has one.
    pub token: Option<String>,
    /// Certificates to trust for an https agent.
    pub ca_cert: Option<std::path::PathBuf>,
    /// The tier of the probes loaded here.
    pub tier: crate::model::Tier,
}

/// The latest frame of each source: one per agent for `--connect A,B,…`
/// (by the address given), or one ("") for the probes loaded here.
pub type Fleet = BTreeMap<String, Arc<Frame>>;

/// `iospan top`, from the command line.
pub fn main(opts: TopOptions) -> Result<()> {
    if opts.interval < Duration::from_millis(100) {
        anyhow::bail!("--interval {:?}: use 100ms or more", opts.interval);
    }
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(top(opts))
}

/// Runs the probes and the view until q (or until the probes fail: the
/// view ends when its feed does).
pub async fn top(opts: TopOptions) -> Result<()> {
    let (fleet_tx, fleet_rx) = watch::channel(Fleet::new());
    if let Some(list) = opts.connect {
        let addrs: Vec<&str> = list
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .collect();
        if addrs.is_empty() {
            anyhow::bail!("--connect {list:?}: give HOST:PORT[,HOST:PORT…]");
        }
        // Connected before the terminal is taken: a refusal reads plainly.
        let mut streams = Vec::new();
        for a in &addrs {
            let agent = Agent::new(a, opts.token.clone(), opts.ca_cert.as_deref())?;
            // One agent: its rows as they are; several: under their address.
            let host = if addrs.len() > 1 {
                a.to_string()
            } else {
                String::new()
            };
            streams.push((host, agent.open().await?));
        }
        // The agents' frames, as they come; the view ends when all stop.
        let fleet_tx = Arc::new(fleet_tx);
        let feeds: Vec<_> = streams
            .into_iter()
            .map(|(host, stream)| {
                let tx = fleet_tx.clone();
                tokio::spawn(stream.follow(move |f| {
                    tx.send_modify(|m| {
                        m.insert(host.clone(), Arc::new(f));
                    });
                    !tx.is_closed()
                }))
            })
            .collect();
        drop(fleet_tx);
        let shown = tokio::task::spawn_blocking(move || view(fleet_rx))
            .await
            .context("the view")?;
        shown?;
        for f in feeds {
            match f.await {
                Ok(r) => r?,
                Err(_) => anyhow::bail!("a stream reader panicked"),
            }
        }
        return Ok(());
    }
    let (tx, mut rx) = watch::channel(None);
    // The run's frames into the view's feed; dropped (ending the view)
    // when the run ends.
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let f = rx.borrow_and_update().clone();
            if let Some(f) = f {
                fleet_tx.send_modify(|m| {
                    m.insert(String::new(), f);
                });
            }
        }
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let ui = tokio::task::spawn_blocking(move || {
        let shown = view(fleet_rx);
        let _ = stop_tx.send(true);
        shown
    });
    let ran = run::run(RunOptions {
        disks: opts.disks,
        max_disks: opts.max_disks,
        vms: true,
        quiet: true,
        tier: opts.tier,
        live: Some(LiveFeed {
            tx,
            every: opts.interval,
        }),
        stop: Some(stop_rx),
        no_report: true,
        ..Default::default()
    })
    .await;
    let shown = ui.await.context("the view")?;
    ran?;
    shown
}

/// The terminal loop: frames in, a screen out; keys between.
fn view(mut rx: watch::Receiver<Fleet>) -> Result<()> {
    let mut terminal =
        ratatui::try_init().context("iospan top needs a terminal (stdin and stdout a tty)")?;
    let result = (|| -> Result<()> {
        let mut st = State::default();
        let mut sources = Sources::default();
        loop {
            // The feed gone: the probes (or every agent's stream) stopped.
            let Ok(changed) = rx.has_changed() else {
                return Ok(());
            };
            if changed {
                let fleet = rx.borrow_and_update().clone();
                sources.update(&fleet, &mut st);
            }
            terminal.draw(|f| draw(f, &st))?;
            if event::poll(Duration::from_millis(100))? {
                if let Event::Key(k) = event::read()? {
                    if !st.key(k) {
                        return Ok(());
                    }
                }
            }
        }
    })();
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests;
