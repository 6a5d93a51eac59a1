//! The events file `iospan replay` reads (`run --events-out`), as anyone who
//! hands an operator a file may write it: taken or refused naming its line,
//! never a panic, and every I/O taken becomes a trace whose spans end no
//! earlier than they start, wherever the replay moves it in time.
#![no_main]

use std::path::Path;

use iospan::{
    cmd::replay::{parse, shifted},
    output::export::{otlp::Traces, otlp::WallClock, Reason},
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(ios) = parse(data, Path::new("fuzz.jsonl")) else {
        return;
    };
    assert!(!ios.is_empty(), "an empty stream is refused");
    let traces = Traces::new(WallClock::now(), Some("fuzz".to_string()));
    for (s, names) in ios.iter().take(64) {
        for by in [0, 1 << 40, u64::MAX / 2, u64::MAX] {
            let s = shifted(s, by);
            let root = traces.new_root();
            let spans = traces.of(&s, names, Reason::Uniform, &root, &[]);
            assert!(!spans.is_empty());
            for sp in &spans {
                assert!(
                    sp.end_time >= sp.start_time,
                    "{:?} ends before it starts",
                    sp.name
                );
            }
        }
    }
});
