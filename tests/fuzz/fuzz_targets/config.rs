//! The configuration file: any text is accepted or refused with a message,
//! never a panic, and a refusal on a `token` line never repeats its value.
#![no_main]

use iospan::cmd::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Paths in the file would be opened: keep to text that names none.
    if text.contains("tls_") {
        return;
    }
    let Err(e) = Config::parse(text) else {
        return;
    };
    let msg = format!("{e:#}");
    // "line N, …": the line the error is on.
    let Some(n) = msg
        .strip_prefix("line ")
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|d| d.parse::<usize>().ok())
    else {
        return;
    };
    let line = text.lines().nth(n.saturating_sub(1)).unwrap_or("");
    if line.trim_start().starts_with("token") {
        assert!(
            msg.contains("not repeated here"),
            "an error on the token's line quoted it: {msg}"
        );
    }
});
