#[test]
fn the_apis_counters_are_named_as_the_runs_in_each_format() {
    use crate::output::metrics::Format;
    let r = super::Refused::default();
    r.connections
        .fetch_add(3, std::sync::atomic::Ordering::Relaxed);
    let prom = r.exposition(Format::Prometheus);
    assert!(
        prom.contains("# TYPE iospan_api_refused_total counter\n"),
        "{prom}"
    );
    assert!(
        prom.contains("iospan_api_refused_total{reason=\"connections\"} 3\n"),
        "{prom}"
    );
    // OpenMetrics names the family without the samples' `_total`.
    let om = r.exposition(Format::OpenMetrics);
    assert!(om.contains("# TYPE iospan_api_refused counter\n"), "{om}");
    assert!(
        om.contains("iospan_api_refused_total{reason=\"runs\"} 0\n"),
        "{om}"
    );
}

#[test]
fn only_loopback_names_pass_the_host_check() {
    for ok in [
        "127.0.0.1",
        "127.0.0.1:9464",
        "localhost:9464",
        "LOCALHOST",
        "[::1]:9464",
        "[::1]",
        "127.1.2.3:80",
    ] {
        assert!(super::server::host_is_loopback(ok), "{ok}");
    }
    for bad in [
        "evil.example:9464",
        "127.0.0.1.evil.example",
        "10.0.0.1:9464",
        "[::2]:9464",
        "localhost.evil:1",
        "[::1",
        "[::1]x",
        "localhost:",
        "localhost:80x",
        "::1",
    ] {
        assert!(!super::server::host_is_loopback(bad), "{bad}");
    }
}
