//! TLS for the agent's API and the views that connect to it: one
//! cryptographic provider for the process, whichever side asks first.

/// Makes ring the process's rustls provider (a no-op once one is set).
pub fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}
