//! The HTTP API's routes, query strings and run labels as any local client
//! may send them (method, path and query, Host, Authorization): never a
//! panic, nothing changed without the token, no run whose label could move
//! a cursor or reorder text, and no other site's name served on loopback.
#![no_main]

use std::{net::SocketAddr, sync::Arc, sync::OnceLock};

use axum::{body::Body, http::Request};
use iospan::{
    api::{router, Access, Shared, MAX_LABEL},
    model::text::printable,
    output::live::Frame,
};
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

const TOKEN: &str = "fuzz-token-0123456789";

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&m, rest)) = data.split_first() else {
        return;
    };
    let method = ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS"][usize::from(m) % 6];
    let text = String::from_utf8_lossy(rest);
    let mut parts = text.splitn(3, '\n');
    let uri = parts.next().unwrap_or("/");
    let host = parts.next().unwrap_or("");
    let auth = parts.next();
    let mut req = Request::builder().method(method).uri(uri);
    if !host.is_empty() {
        req = req.header("host", host);
    }
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let Ok(req) = req.body(Body::empty()) else {
        return;
    };
    let authorized = auth == Some(&format!("Bearer {TOKEN}"));
    let addr: SocketAddr = ([127, 0, 0, 1], 9464).into();
    let shared = Shared::new(Access::TokenToChange(TOKEN.to_string()));
    let app = router(shared.clone(), addr);
    runtime().block_on(async {
        // A measuring run's frames, as fast as the handlers wait for them.
        let frames = async {
            let mut at = 0.0;
            loop {
                at += 1.0;
                shared.frames.send_replace(Some(Arc::new(Frame {
                    at_s: at,
                    ..Frame::default()
                })));
                // And looks at the tier the runs want, as the agent's loop does.
                shared.tier_looks.send_modify(|n| *n = n.wrapping_add(1));
                tokio::task::yield_now().await;
            }
        };
        let resp = tokio::select! {
            r = app.oneshot(req) => r.expect("the router is infallible"),
            () = frames => unreachable!(),
        };
        let status = resp.status().as_u16();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap_or_default();
        if !host.is_empty()
            && !["localhost", "127.", "[::1]", "LOCALHOST"].iter().any(|p| {
                host.to_ascii_lowercase()
                    .starts_with(&p.to_ascii_lowercase())
            })
        {
            assert!(
                status >= 400,
                "{method} {uri} with Host {host:?} answered {status}"
            );
        }
        if method != "GET" && method != "HEAD" && (200..300).contains(&status) {
            assert!(
                authorized,
                "{method} {uri} changed something without the token"
            );
        }
        if method == "POST" && status == 201 {
            let run: serde_json::Value = serde_json::from_slice(&body).expect("a run as JSON");
            let label = run["label"].as_str().expect("a label");
            assert!(label.len() <= MAX_LABEL, "{label:?}");
            assert_eq!(printable(label), label, "a label taken unprintable");
        }
    });
});
