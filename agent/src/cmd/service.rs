//! `iospan agent`: the host agent as a systemd service, measuring
//! continuously, serving the API and exporting.
//!
//! It measures continuously what `iospan run` measures, serves the HTTP API (`api`), exports over OTLP
//! when configured, tells systemd when it is ready and that it is alive
//! (`Type=notify`, watchdog), reloads its configuration on SIGHUP and
//! flushes its exports on SIGTERM.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result};
use sd_notify::NotifyState;
use tokio::{
    signal::unix::{signal, SignalKind},
    sync::watch,
};

use crate::{
    api::{self, Shared},
    cmd::config::{Config, DEFAULT_PATH},
    cmd::run::{self, RunOptions},
};

pub struct ServiceOptions {
    /// The configuration file; `None`: the default path, if it exists.
    pub config: Option<PathBuf>,
}

fn load(opts: &ServiceOptions) -> Result<(Config, Option<PathBuf>)> {
    match &opts.config {
        Some(p) => Ok((Config::load(p)?, Some(p.clone()))),
        None => {
            let p = PathBuf::from(DEFAULT_PATH);
            if p.exists() {
                Ok((Config::load(&p)?, Some(p)))
            } else {
                log::info!("no {DEFAULT_PATH}: running on the defaults");
                Ok((Config::defaults(), None))
            }
        }
    }
}

/// Who may use the API: everyone with `api.token` set carries it; on
/// loopback without one, changes carry the token of `api.token_file` (made
/// at the first start); `api.open` alone serves everyone.
fn access(cfg: &Config) -> Result<api::Access> {
    Ok(match (&cfg.token, cfg.open) {
        (Some(t), _) => api::Access::Token(t.clone()),
        (None, true) => api::Access::Open,
        (None, false) => api::Access::TokenToChange(
            crate::cmd::token::load_or_create(&cfg.token_file)
                .context("api.token_file (the token that starting and stopping runs needs)")?,
        ),
    })
}

/// systemd's notification socket, where there is one (no-op elsewhere).
fn notify(state: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(state) {
        log::debug!("sd_notify: {e}");
    }
}

pub async fn serve(opts: ServiceOptions) -> Result<()> {
    let (mut cfg, path) = load(&opts)?;
    let shared = Shared::new(access(&cfg)?);
    api::serve(cfg.listen, cfg.tls.as_ref(), shared.clone())
        .await
        .context("api.listen")?;
    log::info!(
        "HTTP API on {}://{}",
        if cfg.tls.is_some() { "https" } else { "http" },
        cfg.listen
    );
    let mut hup = signal(SignalKind::hangup()).context("handling SIGHUP")?;
    // Held for the agent's whole life: a stop asked while a run starts
    // (after a reload, its own handlers not yet made) is not lost.
    let mut term = signal(SignalKind::terminate()).context("handling SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("handling SIGINT")?;
    let watchdog = sd_notify::watchdog_enabled();
    let mut ping = tokio::time::interval(watchdog.map_or(Duration::from_secs(3600), |d| d / 2));
    let mut ready = false;
    // The frame the watchdog was last told of: alive means a newer one.
    let mut pinged_at_s = f64::NEG_INFINITY;
    loop {
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut frames = shared.frames.subscribe();
        let run = run::run(RunOptions {
            disks: cfg.disks.clone(),
            max_disks: cfg.max_disks,
            vms: cfg.vms,
            quiet: true,
            traces: cfg.traces.clone(),
            api: Some(shared.clone()),
            stop: Some(stop_rx),
            ..Default::default()
        });
        tokio::pin!(run);
        loop {
            tokio::select! {
                // SIGTERM or SIGINT: the run flushes its exports and ends.
                r = &mut run => {
                    notify(&[NotifyState::Stopping]);
                    return r.map(|_| ());
                }
                _ = term.recv() => {
                    notify(&[NotifyState::Stopping]);
                    let _ = stop_tx.send(true);
                    return (&mut run).await.map(|_| ());
                }
                _ = int.recv() => {
                    notify(&[NotifyState::Stopping]);
                    let _ = stop_tx.send(true);
                    return (&mut run).await.map(|_| ());
                }
                _ = frames.changed() => {
                    // Probes attached and measuring: ready (again).
                    if !ready {
                        ready = true;
                        notify(&[NotifyState::Ready, NotifyState::Status("measuring")]);
                    }
                }
                _ = ping.tick(), if watchdog.is_some() => {
                    // Alive only while the run still makes frames: a stalled
                    // loop is restarted by systemd, not covered for.
                    let at_s = frames.borrow().as_ref().map(|f| f.at_s);
                    if let Some(at_s) = at_s.filter(|&t| t > pinged_at_s) {
                        pinged_at_s = at_s;
                        notify(&[NotifyState::Watchdog]);
                    }
                }
                _ = hup.recv() => {
                    let Some(p) = path.as_ref() else {
                        log::warn!("SIGHUP: no configuration file to reload");
                        continue;
                    };
                    match Config::load(p) {
                        Ok(new) => {
                            if new.listen != cfg.listen
                                || new.token != cfg.token
                                || new.token_file != cfg.token_file
                                || new.open != cfg.open
                                || new.tls != cfg.tls
                            {
                                log::warn!("{}: api.listen, api.token, api.token_file, api.open and api.tls_* take effect at the next start", p.display());
                            }
                            notify(&[NotifyState::Reloading]);
                            let _ = stop_tx.send(true);
                            let _ = (&mut run).await;
                            log::info!("{}: reloaded", p.display());
                            cfg = Config {
                                listen: cfg.listen,
                                token: cfg.token.clone(),
                                token_file: cfg.token_file.clone(),
                                open: cfg.open,
                                tls: cfg.tls.clone(),
                                ..new
                            };
                            ready = false;
                            break;
                        }
                        Err(e) => log::error!("SIGHUP: {e:#}; the running configuration stays"),
                    }
                }
            }
        }
    }
}

/// The config file checked, for `iospan agent --check-config`.
pub fn check(opts: &ServiceOptions) -> Result<String> {
    let (cfg, path) = load(opts)?;
    Ok(format!(
        "{}: ok (API on {}, {})",
        path.map_or("defaults".to_string(), |p| p.display().to_string()),
        cfg.listen,
        if cfg.traces.any_enabled() {
            "exporting over OTLP"
        } else {
            "no OTLP export"
        }
    ))
}

/// `iospan agent` on a host: check the configuration, or serve.
pub fn main(opts: ServiceOptions, check_only: bool) -> Result<std::process::ExitCode> {
    if check_only {
        println!("{}", check(&opts)?);
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let served = rt.block_on(serve(opts));
    // A blocking read still under way (a monitor's exchange, which ends by
    // its own deadline) does not hold the stop up.
    rt.shutdown_timeout(Duration::from_secs(1));
    served?;
    Ok(std::process::ExitCode::SUCCESS)
}
