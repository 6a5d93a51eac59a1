use ratatui::{backend::TestBackend, Terminal};

use ratatui::crossterm::event::{KeyCode, KeyEvent};

use super::*;
use crate::{
    model::{Hist, Op},
    output::live,
};

fn hist(values: &[u64]) -> Hist {
    let mut h = Hist::fine();
    for &v in values {
        h.record(v);
    }
    h
}

fn row(vm: &str, disk: &str, op: Op, ios: u64, seg_ns: u64) -> live::Row {
    let mut segs = BTreeMap::new();
    for (i, name) in live::SEGMENTS.iter().enumerate() {
        segs.insert(
            name.to_string(),
            hist(&vec![seg_ns * (i as u64 + 1); ios as usize]),
        );
    }
    live::Row {
        vm: vm.into(),
        disk: disk.into(),
        queue: None,
        op,
        ios,
        bytes: ios * 4096,
        inflight: 3,
        undelivered: 0,
        guest_observed: true,
        segs,
    }
}

/// A diagnosis of a throttled disk, as the agent's window gives it.
fn throttled(vm: &str, disk: &str, op: Op) -> crate::model::diagnosis::FrameDiagnosis {
    use crate::model::diagnosis::*;
    crate::model::diagnosis::FrameDiagnosis {
        vm: vm.into(),
        disk: disk.into(),
        op,
        seconds: 10.0,
        diagnosis: Diagnosis {
            segment: Some(Segment::Engine),
            basis: Basis::GuestObserved,
            share_mean: 0.9,
            share_p99: None,
            cause: Cause::Throttle,
            summary: "QEMU's throttle holds vd1 at its limit".into(),
            evidence: vec!["limit iops=200".into()],
            knob: Some(Knob {
                now: "throttling.iops-total=200 on vd1".into(),
                qemu: Some("QMP block_set_io_throttle".into()),
                libvirt: Some("virsh blkdeviotune".into()),
                host: None,
                live: true,
                expect: "the engine's wait goes".into(),
            }),
            confidence: Confidence::High,
            to_know: None,
        },
    }
}

fn state() -> State {
    let prev = Frame {
        at_s: 1.0,
        ..Default::default()
    };
    let cur = Frame {
        at_s: 3.0,
        vdisks: vec![
            row("db-primary", "vd0", Op::Read, 2000, 10_000),
            row("db-primary", "vd1", Op::Write, 400, 20_000),
            row("web", "vd0", Op::Read, 100, 50_000),
        ],
        queues: vec![
            live::Row {
                queue: Some(0),
                ..row("db-primary", "vd0", Op::Read, 1500, 8_000)
            },
            live::Row {
                queue: Some(1),
                ..row("db-primary", "vd0", Op::Read, 500, 16_000)
            },
        ],
        disks: vec![row("", "nvme0n1", Op::Read, 2100, 5_000)],
        lost: 0,
        unsplit: 0,
        polled: 0,
        unmatched: 7,
        qemu: None,
        diagnoses: vec![throttled("db-primary", "vd1", Op::Write)],
        monitors: Vec::new(),
    };
    let (vms, disks, secs) = interval(Some(&prev), &cur);
    State {
        vms,
        disks,
        interval_s: secs,
        unmatched: cur.unmatched,
        ..Default::default()
    }
}

fn screen(st: &State, w: u16, h: u16) -> Vec<String> {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| draw(f, st)).unwrap();
    let buf = t.backend().buffer().clone();
    (0..h)
        .map(|y| {
            (0..w)
                .map(|x| buf[(x, y)].symbol().to_string())
                .collect::<String>()
        })
        .collect()
}

#[test]
fn several_agents_rows_are_grouped_under_their_hosts() {
    let frame = |at: f64, ios: u64| {
        Arc::new(Frame {
            at_s: at,
            vdisks: vec![row("db", "vd0", Op::Read, ios, 10_000)],
            disks: vec![row("", "nvme0n1", Op::Read, ios, 5_000)],
            lost: 1,
            unsplit: 4,
            polled: 5,
            ..Default::default()
        })
    };
    let mut fleet = Fleet::new();
    fleet.insert("h1:9464".into(), frame(10.0, 100));
    fleet.insert("h2:9464".into(), frame(50.0, 1000));
    let (mut st, mut src) = (State::default(), Sources::default());
    src.update(&fleet, &mut st);
    // A second frame from h1 only: h2 keeps its interval.
    fleet.insert("h1:9464".into(), frame(12.0, 300));
    src.update(&fleet, &mut st);
    let names: Vec<String> = st.visible().iter().map(|l| l.label()).collect();
    for n in [
        "h1:9464/db",
        "h2:9464/db",
        "h1:9464/nvme0n1",
        "h2:9464/nvme0n1",
    ] {
        assert!(names.iter().any(|l| l == n), "{n} in {names:?}");
    }
    let vm_row = |name: &str| {
        st.vms
            .iter()
            .find(|l| l.kind == Kind::Vm && l.vm == name)
            .unwrap_or_else(|| panic!("no row {name}"))
    };
    assert_eq!(vm_row("h1:9464/db").r_iops, 100.0, "200 more over 2 s");
    assert_eq!(
        vm_row("h2:9464/db").r_iops,
        20.0,
        "its first frame: 1000 over its 50 s"
    );
    assert_eq!(st.lost, 2);
    // Requests found by polling are said apart from losses.
    assert_eq!(st.polled, 10);
    // So are requests counted whole but not split.
    assert_eq!(st.unsplit, 8);
    let shown = screen(&st, 200, 12).join("\n");
    assert!(shown.contains("h2:9464/db"));
    assert!(shown.contains("lost 2  unsplit 8  polled 10"), "{shown}");
}

#[test]
fn rates_and_latencies_are_the_intervals() {
    let st = state();
    let db = st
        .vms
        .iter()
        .find(|l| l.kind == Kind::Vm && l.vm == "db-primary")
        .unwrap();
    // 2000 reads and 400 writes over 2 s.
    assert_eq!((db.r_iops, db.w_iops), (1000.0, 200.0));
    let total = db.seg(0, false).unwrap();
    // (2000 × 10 µs + 400 × 20 µs) / 2400.
    assert!((total - 11_666.7).abs() < 200.0, "{total}");
}

#[test]
fn at_200_columns_every_column_shows() {
    let s = screen(&state(), 200, 12).join("\n");
    for t in [
        "VM / DISK",
        "R/s",
        "W/s",
        "MB/s",
        "OUT",
        "TOTAL",
        "GUEST",
        "HV",
        "ENGINE",
        "DEVICE",
        "QUEUE",
        "HV RDY",
        "ENG RDY",
        "SHARE",
        "WHY",
    ] {
        assert!(s.contains(t), "{t} missing:\n{s}");
    }
    // The throttled disk's word, on its line and its VM's.
    for who in ["db-primary", "  vd1"] {
        let line = s.lines().find(|l| l.starts_with(who)).unwrap();
        assert!(line.contains("throttle"), "{line}");
    }
    assert!(
        s.contains("db-primary") && s.contains("  vd1") && s.contains("nvme0n1"),
        "{s}"
    );
    assert!(s.contains("unmatched 7"), "{s}");
}

#[test]
fn at_80_columns_columns_go_whole_and_the_rest_stays_aligned() {
    let lines = screen(&state(), 80, 12);
    let s = lines.join("\n");
    for t in ["VM / DISK", "TOTAL", "R/s", "W/s", "DEVICE"] {
        assert!(s.contains(t), "{t} missing:\n{s}");
    }
    for t in ["SHARE", "QUEUE", "OUT"] {
        assert!(!s.contains(t), "{t} should have gone:\n{s}");
    }
    assert!(lines.iter().all(|l| l.chars().count() == 80));
    // Each shown column's figures start where its title does.
    let header = &lines[0];
    let at = header.find("TOTAL").unwrap();
    let db = lines.iter().find(|l| l.starts_with("db-primary")).unwrap();
    assert_ne!(db.chars().nth(at), Some(' '), "{header}\n{db}");
    assert!(fitting(80).iter().map(|c| c.width() + 1).sum::<u16>() <= 80);
}

#[test]
fn keys_sort_filter_toggle_collapse_and_show_a_histogram() {
    let mut st = state();
    let key = |st: &mut State, c: KeyCode| st.key(KeyEvent::from(c));
    // Sorted by TOTAL, slowest first: web (50 µs) above db-primary.
    let first = |st: &State| st.visible()[0].vm.clone();
    assert_eq!(first(&st), "web");
    key(&mut st, KeyCode::Char('r'));
    assert_eq!(first(&st), "db-primary");
    key(&mut st, KeyCode::Char('m'));
    assert!(screen(&st, 200, 12)[0].contains("TOTAL p99"));
    key(&mut st, KeyCode::Char('/'));
    for c in "web".chars() {
        key(&mut st, KeyCode::Char(c));
    }
    key(&mut st, KeyCode::Enter);
    assert!(st.visible().iter().all(|l| l.vm == "web"));
    key(&mut st, KeyCode::Char('/'));
    key(&mut st, KeyCode::Esc);
    assert_eq!(st.filter, "");
    // A disk's queues show once it is expanded, in queue order.
    let labels = |st: &State| st.visible().iter().map(|l| l.label()).collect::<Vec<_>>();
    assert!(!labels(&st).iter().any(|l| l.trim() == "q0"));
    st.selected = labels(&st).iter().position(|l| l == "  vd0").unwrap();
    key(&mut st, KeyCode::Enter);
    let ls = labels(&st);
    let at = ls.iter().position(|l| l == "  vd0").unwrap();
    assert_eq!(ls[at + 1..at + 3], ["    q0", "    q1"], "{ls:?}");
    let q1 = st.visible()[at + 2];
    // 500 reads over 2 s, each 16 µs in total.
    assert_eq!(q1.r_iops, 250.0);
    assert!((q1.seg(0, false).unwrap() - 16_000.0).abs() < 500.0);
    assert!(screen(&st, 200, 14).join("\n").contains("    q1"));
    key(&mut st, KeyCode::Enter);
    assert!(!labels(&st).iter().any(|l| l.trim() == "q0"));
    st.selected = 0;
    key(&mut st, KeyCode::Enter); // collapse the selected VM
    assert!(!st
        .visible()
        .iter()
        .any(|l| l.kind == Kind::VDisk && l.vm == "db-primary"));
    key(&mut st, KeyCode::Char('h'));
    let s = screen(&st, 120, 40).join("\n");
    assert!(
        s.contains("histogram") && s.contains("TOTAL (2400 I/Os)"),
        "{s}"
    );
    key(&mut st, KeyCode::Char('x'));
    assert_eq!(st.screen, Screen::Table);
    // The selected VM's diagnosis, whole, on `d`.
    key(&mut st, KeyCode::Char('d'));
    let s = screen(&st, 120, 40).join("\n");
    assert!(
        s.contains("what limits it")
            && s.contains("QEMU's throttle holds vd1")
            && s.contains("try (libvirt): virsh blkdeviotune"),
        "{s}"
    );
    key(&mut st, KeyCode::Char('x'));
    assert!(!key(&mut st, KeyCode::Char('q')));
}

#[test]
fn sort_selection_help_and_pause_are_state_alone() {
    let mut st = state();
    let key = |st: &mut State, c: KeyCode| st.key(KeyEvent::from(c));
    // `s` walks every column and comes back; ← walks back.
    let start = st.sort;
    let mut seen = Vec::new();
    for _ in 0..Col::ALL.len() {
        key(&mut st, KeyCode::Char('s'));
        seen.push(st.sort);
    }
    assert_eq!(st.sort, start);
    seen.sort_by_key(|c| Col::ALL.iter().position(|x| x == c));
    assert_eq!(seen, Col::ALL.to_vec());
    key(&mut st, KeyCode::Left);
    assert_eq!(
        st.sort,
        Col::ALL[(Col::ALL.iter().position(|c| *c == start).unwrap() + Col::ALL.len() - 1)
            % Col::ALL.len()]
    );
    key(&mut st, KeyCode::Right);
    assert_eq!(st.sort, start);
    // The selection stays on a row.
    let rows = st.visible().len();
    for _ in 0..rows + 5 {
        key(&mut st, KeyCode::Down);
    }
    assert_eq!(st.selected, rows - 1);
    for _ in 0..rows + 5 {
        key(&mut st, KeyCode::Char('k'));
    }
    assert_eq!(st.selected, 0);
    // While a filter is typed, keys are its text, not commands.
    key(&mut st, KeyCode::Char('/'));
    key(&mut st, KeyCode::Char('q'));
    key(&mut st, KeyCode::Char('s'));
    key(&mut st, KeyCode::Backspace);
    assert!(st.editing);
    assert_eq!((st.filter.as_str(), st.sort), ("q", start));
    key(&mut st, KeyCode::Esc);
    assert!(!st.editing);
    // Help, drawn twice: the same screen, and drawing changed nothing.
    key(&mut st, KeyCode::Char('?'));
    assert_eq!(st.screen, Screen::Help);
    let before = (
        st.sort,
        st.selected,
        st.filter.clone(),
        st.screen,
        st.visible().len(),
    );
    let (a, b) = (screen(&st, 120, 40), screen(&st, 120, 40));
    assert_eq!(a, b);
    assert!(a.join("\n").contains("sort"), "{}", a.join("\n"));
    assert_eq!(
        before,
        (
            st.sort,
            st.selected,
            st.filter.clone(),
            st.screen,
            st.visible().len()
        )
    );
    // Any key but q closes an overlay, and does nothing else.
    key(&mut st, KeyCode::Char(' '));
    assert_eq!((st.screen, st.paused), (Screen::Table, false));
    // Paused, new frames are taken in but the rows shown stay.
    key(&mut st, KeyCode::Char(' '));
    assert!(st.paused);
    let shown: Vec<String> = st.visible().iter().map(|l| l.label()).collect();
    let mut fleet = Fleet::new();
    fleet.insert(
        "h9:9464".into(),
        Arc::new(Frame {
            at_s: 5.0,
            vdisks: vec![row("new-vm", "vd0", Op::Read, 10, 1_000)],
            ..Default::default()
        }),
    );
    let mut src = Sources::default();
    src.update(&fleet, &mut st);
    assert_eq!(
        st.visible().iter().map(|l| l.label()).collect::<Vec<_>>(),
        shown
    );
    key(&mut st, KeyCode::Char(' '));
    src.update(&fleet, &mut st);
    assert!(
        st.visible().iter().any(|l| l.label() == "h9:9464/new-vm"),
        "{:?}",
        st.visible().iter().map(|l| l.label()).collect::<Vec<_>>()
    );
}
