use super::*;
use crate::model::{
    tails::{bands, Parts},
    Op,
};

fn parts(total: u32, g: u32, h: u32, e: u32, d: u32) -> Parts {
    [total, g, h, e, d]
}

#[test]
fn bands_take_the_slowest_ios_at_each_percentile() {
    // 1000 I/Os: 990 of 100 µs (device), 10 of 1100 µs (engine +1000).
    let mut kept = vec![parts(100_000, 10_000, 10_000, 10_000, 70_000); 990];
    kept.extend(vec![
        parts(1_100_000, 10_000, 10_000, 1_010_000, 70_000);
        10
    ]);
    let b = bands(&kept);
    assert_eq!(b.len(), 5);
    assert_eq!(b[0].ios, 1000);
    assert!((b[0].mean_us[0] - 110.0).abs() < 1e-6);
    let p99 = b.iter().find(|b| b.from_pct == 99.0).unwrap();
    assert_eq!(p99.ios, 10);
    assert_eq!(p99.threshold_us, 1100.0);
    assert_eq!(p99.mean_us, [1100.0, 10.0, 10.0, 1010.0, 70.0]);
    let p999 = b.iter().find(|b| b.from_pct == 99.9).unwrap();
    assert_eq!(p999.ios, 1);
}

fn entry(vm: &str, engine_tail_us: f64) -> TailEntry {
    let band = |pct: f64, eng: f64| Band {
        from_pct: pct,
        ios: 10,
        threshold_us: 0.0,
        mean_us: [100.0 + eng, 10.0, 10.0, eng, 80.0],
    };
    TailEntry {
        vm: vm.into(),
        disk: "vd0".into(),
        op: Op::Read,
        ios: 1000,
        iops: 0.0,
        sampled: false,
        guest_observed: true,
        bands: vec![
            band(0.0, 5.0),
            band(99.0, engine_tail_us),
            band(99.9, engine_tail_us * 2.0),
        ],
        cdf: Vec::new(),
    }
}

fn stored(label: &str, host: &str, t: TailEntry) -> StoredRun {
    StoredRun {
        schema: SCHEMA.into(),
        label: label.into(),
        finished_unix_s: 0,
        report: RunReport {
            schema: crate::output::report::SCHEMA.into(),
            duration_s: 1.0,
            ..Default::default()
        },
        tails: vec![t],
        series: Vec::new(),
        fio: Vec::new(),
        fio_note: None,
        host: HostInfo {
            name: host.into(),
            kernel: "6.1.0".into(),
            cpu: "Some CPU".into(),
            cpus: 8,
            memory_gib: 31.2,
        },
    }
}

#[test]
fn runs_of_one_label_from_two_hosts_are_told_apart_and_paired() {
    let a = stored("mailbox", "hv-a", entry("exch-1", 50.0));
    let mut other = entry("mbx01", 450.0);
    other.disk = "drive-virtio-disk0".into();
    let b = stored("mailbox", "hv-b", other);
    let text = compare_text(&[a.clone(), b]).unwrap();
    assert!(
        text.contains("mailbox@hv-a: hv-a (kernel 6.1.0, 8 × Some CPU, 31.2 GiB)"),
        "{text}"
    );
    assert!(
        text.contains("mailbox@hv-a vs mailbox@hv-b — vd0 read"),
        "{text}"
    );
    assert!(text.contains("at p99: engine explains 100%"), "{text}");
    // One host: no host lines, bare labels.
    let same = stored("other", "hv-a", entry("exch-1", 450.0));
    let text = compare_text(&[a, same]).unwrap();
    assert!(text.starts_with("mailbox vs other — vd0 read"), "{text}");
}

#[test]
fn a_comparison_names_the_segment_that_moved() {
    let d = differences(&entry("a", 50.0), &entry("b", 450.0));
    let p99 = d.iter().find(|d| d.at == "p99").unwrap();
    assert_eq!(p99.segment, "engine");
    assert!((p99.share - 1.0).abs() < 1e-9);
    let mean = d.iter().find(|d| d.at == "mean").unwrap();
    assert_eq!(mean.share, 0.0, "no change at the mean");
}

#[test]
fn a_tail_of_a_handful_of_ios_is_said_to_be_one() {
    let a = stored("a", "hv-a", entry("vm", 50.0));
    let mut t = entry("vm", 450.0);
    t.bands[2].ios = 1;
    let text = compare_text(&[a, stored("b", "hv-a", t)]).unwrap();
    let line = |at: &str| {
        text.lines()
            .find(|l| l.contains(&format!("→ at {at}:")))
            .unwrap_or_else(|| panic!("{text}"))
            .to_string()
    };
    assert!(line("p99").ends_with("µs); 10 and 10 I/Os"), "{text}");
    assert!(
        line("p99.9").ends_with(
            "; 10 and 1 I/Os: too few to speak for the runs' tails (at p99.9 they need 10000 I/Os or more each)"
        ),
        "{text}"
    );
    assert!(!line("mean").contains("I/Os"), "{text}");
}

#[test]
fn checks_parse_and_say_what_is_wrong() {
    let c: Check = "read.p99<20ms".parse().unwrap();
    assert_eq!(
        (c.op, c.stat.as_str(), c.segment.as_str()),
        (Op::Read, "p99", "total")
    );
    assert_eq!(c.limit_us, 20_000.0);
    let c: Check = "vd1:write.p99.9.device<500us".parse().unwrap();
    assert_eq!(c.disk.as_deref(), Some("vd1"));
    assert_eq!((c.stat.as_str(), c.segment.as_str()), ("p999", "device"));
    for (bad, says) in [
        ("read.p99", "'<'"),
        ("trim.p99<1ms", "read or write"),
        ("read.p42<1ms", "statistic"),
        ("read.p99.disk<1ms", "segment"),
        ("read.p99<soon", "soon"),
    ] {
        let e = bad.parse::<Check>().unwrap_err();
        assert!(e.contains(says), "{bad}: {e}");
    }
}

#[test]
fn fio_output_is_found_on_its_command_line() {
    let cmd = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    assert_eq!(
        fio_json_output(&cmd(
            "fio --name=x --output-format=json --output=/tmp/f.json"
        )),
        Some(PathBuf::from("/tmp/f.json"))
    );
    assert_eq!(
        fio_json_output(&cmd(
            "/usr/bin/fio --output-format normal,json+ --output o.json job.fio"
        )),
        Some(PathBuf::from("o.json"))
    );
    assert_eq!(fio_json_output(&cmd("fio --output=o.txt job.fio")), None);
    assert_eq!(
        fio_json_output(&cmd("dd --output-format=json --output=x")),
        None
    );
}

#[test]
fn labels_are_directory_names() {
    assert!(check_label("virtio-qd16_2026.11").is_ok());
    for bad in ["", "../x", "a/b", ".hidden", "a b"] {
        assert!(check_label(bad).is_err(), "{bad:?}");
    }
}

fn level(value: u32, iops: f64, p99: f64, engine: f64) -> Level {
    Level {
        value,
        label: format!("s-qd{value}"),
        iops,
        p99_us: p99,
        mean_us: [100.0 + engine, 10.0, 10.0, engine, 80.0],
    }
}

#[test]
fn the_knee_is_where_iops_stop_and_latency_climbs() {
    let levels = [
        level(1, 1000.0, 200.0, 10.0),
        level(2, 1900.0, 220.0, 12.0),
        level(4, 3000.0, 300.0, 20.0),
        level(8, 3100.0, 600.0, 300.0),
        level(16, 3150.0, 1200.0, 900.0),
    ];
    let k = knee(&levels).expect("a knee");
    assert_eq!((k.at, k.next), (4, 8));
    assert_eq!(k.segment, "engine");
    assert!((k.segment_growth_us - 280.0).abs() < 1e-9);
    // Still scaling: none.
    assert_eq!(knee(&levels[..3]), None);
}
