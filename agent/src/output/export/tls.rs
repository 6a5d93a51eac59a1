//! TLS to the collector: an `https://` endpoint is verified against the
//! system's roots, or only against the CA named by `--otlp-ca-cert`,
//! `otlp.ca_cert` or OTEL_EXPORTER_OTLP_[SIGNAL_]CERTIFICATE. Tokens in
//! OTEL_EXPORTER_OTLP_HEADERS then never cross the network in clear.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::TraceOpts;

/// What one signal's exporter needs to know about TLS.
pub struct Secure {
    /// The endpoint is `https://` (flag, else the signal's variable, else
    /// the general one).
    pub https: bool,
    /// PEM certificates to trust instead of the system's roots.
    pub ca: Option<(PathBuf, Vec<u8>)>,
}

fn env(signal: &str, what: &str) -> Option<String> {
    [
        format!("OTEL_EXPORTER_OTLP_{}_{what}", signal.to_uppercase()),
        format!("OTEL_EXPORTER_OTLP_{what}"),
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
}

/// `signal`: "traces" or "metrics".
pub fn secure(opts: &TraceOpts, signal: &str) -> Result<Secure> {
    let endpoint = opts.endpoint.clone().or_else(|| env(signal, "ENDPOINT"));
    let https = endpoint
        .as_deref()
        .is_some_and(|e| e.trim().to_ascii_lowercase().starts_with("https://"));
    let path = opts
        .ca_cert
        .clone()
        .or_else(|| env(signal, "CERTIFICATE").map(PathBuf::from));
    let ca = match path {
        None => None,
        Some(p) => {
            if !https {
                bail!(
                    "OTLP CA certificate {} given, but the collector's endpoint ({}) is not \
                     https://: use https://HOST:PORT",
                    p.display(),
                    endpoint.as_deref().unwrap_or("none")
                );
            }
            let pem = std::fs::read(&p)
                .with_context(|| format!("OTLP CA certificate {}", p.display()))?;
            Some((p, pem))
        }
    };
    Ok(Secure { https, ca })
}

/// The HTTP client for `http/protobuf`: rustls, the CA's roots when given.
pub fn http_client(sec: &Secure, timeout: std::time::Duration) -> Result<reqwest::Client> {
    // reqwest is built without a provider of its own: ring, as the API's.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut b = reqwest::Client::builder().timeout(timeout);
    if let Some((path, pem)) = &sec.ca {
        let certs = reqwest::Certificate::from_pem_bundle(pem)
            .with_context(|| format!("OTLP CA certificate {}: PEM certificates", path.display()))?;
        if certs.is_empty() {
            bail!(
                "OTLP CA certificate {}: no PEM certificate in it",
                path.display()
            );
        }
        b = b.tls_certs_only(certs);
    }
    b.build().context("the OTLP HTTP client")
}

/// gRPC's TLS settings: `None` for a plain `http://` endpoint.
pub fn grpc_tls(
    sec: &Secure,
) -> Result<Option<opentelemetry_otlp::tonic_types::transport::ClientTlsConfig>> {
    use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig};
    if !sec.https {
        return Ok(None);
    }
    Ok(Some(match &sec.ca {
        Some((path, pem)) => {
            if !String::from_utf8_lossy(pem).contains("-----BEGIN CERTIFICATE-----") {
                bail!(
                    "OTLP CA certificate {}: no PEM certificate in it",
                    path.display()
                );
            }
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem))
        }
        None => ClientTlsConfig::new().with_native_roots(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_needs_https_and_a_certificate() {
        let dir_held = tempfile::Builder::new()
            .prefix("iospan-otlp-tls-")
            .tempdir()
            .unwrap();
        let dir = dir_held.path().to_path_buf();
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, "not a certificate\n").unwrap();
        let opts = |endpoint: &str| TraceOpts {
            endpoint: Some(endpoint.to_string()),
            ca_cert: Some(ca.clone()),
            ..Default::default()
        };
        let e = format!(
            "{:#}",
            secure(&opts("http://127.0.0.1:4318"), "traces")
                .err()
                .unwrap()
        );
        assert!(e.contains("https://"), "{e}");
        let s = secure(&opts("HTTPS://collector:4318"), "traces").unwrap();
        assert!(s.https);
        let e = format!(
            "{:#}",
            http_client(&s, std::time::Duration::from_secs(1)).unwrap_err()
        );
        assert!(e.contains("ca.pem"), "{e}");
        let e = format!("{:#}", grpc_tls(&s).unwrap_err());
        assert!(e.contains("no PEM certificate"), "{e}");
        let plain = secure(
            &TraceOpts {
                endpoint: Some("http://127.0.0.1:4317".into()),
                ..Default::default()
            },
            "traces",
        )
        .unwrap();
        assert!(grpc_tls(&plain).unwrap().is_none());
    }
}
