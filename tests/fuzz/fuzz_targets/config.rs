//! The configuration file: any text is accepted or refused with a message,
//! never a panic, and a refusal never repeats a token's value.
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
    if let Err(e) = Config::parse(text) {
        let msg = format!("{e:#}");
        for line in text.lines() {
            let Some((k, v)) = line.split_once('=') else { continue };
            let v = v.trim().trim_matches('"');
            if k.trim() == "token" && v.len() >= 8 && !k.trim().is_empty() {
                assert!(!msg.contains(v), "the token {v:?} in: {msg}");
            }
        }
    }
});
