//! What the view shows and how keys change it: rows differenced from two
//! frames, columns that fit, sort, filter, collapse, the screen shown. No
//! terminal here, so every key is tested.

use std::collections::BTreeMap;

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyEventKind};

use crate::{
    model::{diagnosis::FrameDiagnosis, Hist, Op},
    output::live::{self, Frame},
};

/// One row of the view: a VM (its virtual disks together), one of its
/// virtual disks, one queue of a virtual disk, or a host disk. Figures are
/// over the last interval.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    pub kind: Kind,
    pub vm: String,
    pub disk: String,
    /// A queue row's guest queue.
    pub queue: Option<u32>,
    pub r_iops: f64,
    pub w_iops: f64,
    pub mbps: f64,
    pub inflight: u64,
    /// Whether `total` is guest-observed (guest agent) or the host window.
    pub guest_observed: bool,
    /// The interval's histogram per `live::SEGMENTS` name.
    pub segs: BTreeMap<String, Hist>,
    /// What limits it, per op, over the agent's last window (a VM's line:
    /// its disks').
    pub why: Vec<FrameDiagnosis>,
}

impl Item {
    /// The diagnosis its WHY column shows: one that names a bottleneck,
    /// the busiest op's first; else any.
    pub fn why(&self) -> Option<&FrameDiagnosis> {
        self.why
            .iter()
            .find(|d| d.diagnosis.segment.is_some())
            .or_else(|| self.why.first())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Vm,
    VDisk,
    Queue,
    HostDisk,
}

/// The columns, in screen order; each knows how wide it is and how soon
/// it goes when the terminal is narrow (higher: earlier).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Col {
    Name,
    ReadIops,
    WriteIops,
    MBps,
    Out,
    Seg(usize),
    Share,
    /// What limits it, in a word.
    Why,
}

impl Col {
    pub const ALL: [Col; 15] = [
        Col::Name,
        Col::ReadIops,
        Col::WriteIops,
        Col::MBps,
        Col::Out,
        Col::Seg(0),
        Col::Seg(1),
        Col::Seg(2),
        Col::Seg(3),
        Col::Seg(4),
        Col::Seg(5),
        Col::Seg(6),
        Col::Seg(7),
        Col::Share,
        Col::Why,
    ];

    pub(super) fn width(self) -> u16 {
        match self {
            Col::Name => 22,
            Col::ReadIops | Col::WriteIops | Col::MBps => 8,
            Col::Out => 5,
            Col::Seg(_) => 9,
            Col::Share => 22,
            Col::Why => 9,
        }
    }

    /// Which columns go first when they do not fit.
    fn drop_rank(self) -> u8 {
        match self {
            Col::Name => 0,
            Col::Seg(0) => 1,
            Col::Why => 2,
            Col::ReadIops => 3,
            Col::WriteIops => 4,
            Col::Seg(4) => 5,
            Col::Seg(2) => 6,
            Col::Seg(3) => 7,
            Col::Seg(1) => 8,
            Col::MBps => 9,
            Col::Seg(5) => 10,
            Col::Out => 11,
            Col::Share => 12,
            Col::Seg(_) => 13,
        }
    }

    pub(super) fn title(self, p99: bool) -> String {
        let stat = if p99 { "p99" } else { "avg" };
        match self {
            Col::Name => "VM / DISK".into(),
            Col::ReadIops => "R/s".into(),
            Col::WriteIops => "W/s".into(),
            Col::MBps => "MB/s".into(),
            Col::Out => "OUT".into(),
            Col::Seg(i) => format!(
                "{}{}",
                SEG_TITLES[i],
                if i == 0 {
                    format!(" {stat}")
                } else {
                    String::new()
                }
            ),
            Col::Share => "SHARE g/H/E/D".into(),
            Col::Why => "WHY".into(),
        }
    }
}

/// Segment column titles (µs), `live::SEGMENTS` order.
pub(super) const SEG_TITLES: [&str; 8] = [
    "TOTAL", "GUEST", "HV", "ENGINE", "DEVICE", "QUEUE", "HV RDY", "ENG RDY",
];

/// The columns that fit `width`, in screen order.
pub fn fitting(width: u16) -> Vec<Col> {
    let mut cols: Vec<Col> = Col::ALL.to_vec();
    let need = |cols: &[Col]| cols.iter().map(|c| c.width() + 1).sum::<u16>();
    while need(&cols) > width && cols.len() > 1 {
        let worst = cols
            .iter()
            .copied()
            .max_by_key(|c| c.drop_rank())
            .expect("non-empty");
        cols.retain(|c| *c != worst);
    }
    cols
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Screen {
    Table,
    Histogram,
    Diagnosis,
    Help,
}

/// Everything the screen shows, and the keys change.
pub struct State {
    pub vms: Vec<Item>,
    pub disks: Vec<Item>,
    pub interval_s: f64,
    pub lost: u64,
    /// VM requests counted whose host window was not split.
    pub unsplit: u64,
    pub polled: u64,
    pub unmatched: u64,
    pub sort: Col,
    pub descending: bool,
    pub filter: String,
    /// Typing a filter: keys go to it.
    pub editing: bool,
    pub p99: bool,
    pub paused: bool,
    pub selected: usize,
    /// VMs whose disks are hidden.
    pub collapsed: std::collections::BTreeSet<String>,
    /// Virtual disks (VM, disk) whose queues are shown.
    pub expanded: std::collections::BTreeSet<(String, String)>,
    pub screen: Screen,
}

impl Default for State {
    fn default() -> Self {
        Self {
            vms: Vec::new(),
            disks: Vec::new(),
            interval_s: 0.0,
            lost: 0,
            unsplit: 0,
            polled: 0,
            unmatched: 0,
            sort: Col::Seg(0),
            descending: true,
            filter: String::new(),
            editing: false,
            p99: false,
            paused: false,
            selected: 0,
            collapsed: Default::default(),
            expanded: Default::default(),
            screen: Screen::Table,
        }
    }
}

/// The last interval: `cur` less `prev` (all of `cur` when there is none).
pub fn interval(prev: Option<&Frame>, cur: &Frame) -> (Vec<Item>, Vec<Item>, f64) {
    let secs = prev.map_or(cur.at_s, |p| cur.at_s - p.at_s).max(1e-3);
    let key = |r: &live::Row| (r.vm.clone(), r.disk.clone(), r.queue, r.op);
    let before: BTreeMap<_, &live::Row> = prev
        .map(|p| {
            p.vdisks
                .iter()
                .chain(&p.queues)
                .chain(&p.disks)
                .map(|r| (key(r), r))
                .collect()
        })
        .unwrap_or_default();
    // Per (vm, disk, queue): both ops together.
    let mut lines: BTreeMap<(String, String, Option<u32>), Item> = BTreeMap::new();
    for r in cur.vdisks.iter().chain(&cur.queues).chain(&cur.disks) {
        let d = r.since(before.get(&key(r)).copied());
        let l = lines
            .entry((r.vm.clone(), r.disk.clone(), r.queue))
            .or_insert_with(|| Item {
                kind: if r.vm.is_empty() {
                    Kind::HostDisk
                } else if r.queue.is_some() {
                    Kind::Queue
                } else {
                    Kind::VDisk
                },
                vm: r.vm.clone(),
                disk: r.disk.clone(),
                queue: r.queue,
                r_iops: 0.0,
                w_iops: 0.0,
                mbps: 0.0,
                inflight: r.inflight,
                guest_observed: r.guest_observed,
                segs: BTreeMap::new(),
                why: Vec::new(),
            });
        if r.queue.is_none() {
            l.why.extend(
                cur.diagnoses
                    .iter()
                    .filter(|x| x.vm == r.vm && x.disk == r.disk && x.op == r.op)
                    .cloned(),
            );
        }
        match r.op {
            Op::Read => l.r_iops += d.ios as f64 / secs,
            Op::Write => l.w_iops += d.ios as f64 / secs,
            _ => {}
        }
        l.mbps += d.bytes as f64 / secs / 1e6;
        l.guest_observed |= r.guest_observed;
        merge_into(&mut l.segs, d.segs);
    }
    let (mut vdisks, mut queues, mut disks) = (Vec::new(), Vec::new(), Vec::new());
    for l in lines.into_values() {
        match l.kind {
            Kind::HostDisk => disks.push(l),
            Kind::Queue => queues.push(l),
            _ => vdisks.push(l),
        }
    }
    // A VM's line: its disks together.
    let mut vms: BTreeMap<String, Item> = BTreeMap::new();
    for d in &vdisks {
        let v = vms.entry(d.vm.clone()).or_insert_with(|| Item {
            kind: Kind::Vm,
            vm: d.vm.clone(),
            disk: String::new(),
            queue: None,
            r_iops: 0.0,
            w_iops: 0.0,
            mbps: 0.0,
            inflight: d.inflight,
            guest_observed: false,
            segs: BTreeMap::new(),
            why: Vec::new(),
        });
        v.why.extend(d.why.iter().cloned());
        v.r_iops += d.r_iops;
        v.w_iops += d.w_iops;
        v.mbps += d.mbps;
        v.guest_observed |= d.guest_observed;
        merge_into(&mut v.segs, d.segs.clone());
    }
    let mut out = Vec::new();
    for (name, v) in vms {
        out.push(v);
        for d in vdisks.iter().filter(|d| d.vm == name) {
            out.push(d.clone());
            out.extend(
                queues
                    .iter()
                    .filter(|q| q.vm == name && q.disk == d.disk)
                    .cloned(),
            );
        }
    }
    (out, disks, secs)
}

/// Adds each segment's histogram to the one of the same name.
fn merge_into(acc: &mut BTreeMap<String, Hist>, more: BTreeMap<String, Hist>) {
    for (name, h) in more {
        match acc.get_mut(&name) {
            Some(a) => a.merge(&h),
            None => {
                acc.insert(name, h);
            }
        }
    }
}

impl Item {
    /// The segment's mean or p99 over the interval, ns.
    pub(super) fn seg(&self, i: usize, p99: bool) -> Option<f64> {
        let h = self.segs.get(live::SEGMENTS[i])?;
        (h.count > 0).then(|| {
            if p99 {
                h.quantile_ns(0.99)
            } else {
                h.mean_ns()
            }
        })
    }

    pub(super) fn value(&self, c: Col, p99: bool) -> f64 {
        match c {
            Col::Name => 0.0,
            Col::ReadIops => self.r_iops,
            Col::WriteIops => self.w_iops,
            Col::MBps => self.mbps,
            Col::Out => self.inflight as f64,
            Col::Seg(i) => self.seg(i, p99).unwrap_or(-1.0),
            Col::Share => self.seg(0, false).unwrap_or(-1.0),
            // A bottleneck's share of the latency sorts it first.
            Col::Why => self
                .why()
                .filter(|d| d.diagnosis.segment.is_some())
                .map_or(-1.0, |d| d.diagnosis.share_mean),
        }
    }

    pub(super) fn label(&self) -> String {
        match self.kind {
            Kind::Vm => self.vm.clone(),
            Kind::VDisk => format!("  {}", self.disk),
            Kind::Queue => format!("    q{}", self.queue.unwrap_or_default()),
            Kind::HostDisk => self.disk.clone(),
        }
    }

    pub(super) fn matches(&self, filter: &str) -> bool {
        filter.is_empty() || self.vm.contains(filter) || self.disk.contains(filter)
    }
}

impl State {
    /// The rows on screen, in order: VMs sorted (their disks under them,
    /// unless collapsed), then the host disks.
    pub fn visible(&self) -> Vec<&Item> {
        let by = |a: &&Item, b: &&Item| {
            let o = if self.sort == Col::Name {
                a.label().cmp(&b.label())
            } else {
                a.value(self.sort, self.p99)
                    .total_cmp(&b.value(self.sort, self.p99))
            };
            if self.descending {
                o.reverse()
            } else {
                o
            }
        };
        let mut vms: Vec<&Item> =
            self.vms
                .iter()
                .filter(|l| l.kind == Kind::Vm)
                .filter(|v| {
                    v.matches(&self.filter)
                        || self.vms.iter().any(|d| {
                            d.kind == Kind::VDisk && d.vm == v.vm && d.matches(&self.filter)
                        })
                })
                .collect();
        vms.sort_by(by);
        let mut out = Vec::new();
        for v in vms {
            out.push(v);
            if self.collapsed.contains(&v.vm) {
                continue;
            }
            let mut ds: Vec<&Item> = self
                .vms
                .iter()
                .filter(|d| d.kind == Kind::VDisk && d.vm == v.vm)
                .collect();
            ds.sort_by(by);
            for d in ds {
                out.push(d);
                if !self.expanded.contains(&(d.vm.clone(), d.disk.clone())) {
                    continue;
                }
                let mut qs: Vec<&Item> = self
                    .vms
                    .iter()
                    .filter(|q| q.kind == Kind::Queue && q.vm == d.vm && q.disk == d.disk)
                    .collect();
                qs.sort_by_key(|q| q.queue);
                out.extend(qs);
            }
        }
        let mut disks: Vec<&Item> = self
            .disks
            .iter()
            .filter(|d| d.matches(&self.filter))
            .collect();
        disks.sort_by(by);
        out.extend(disks);
        out
    }

    /// A key: false to quit.
    pub fn key(&mut self, k: KeyEvent) -> bool {
        if k.kind != KeyEventKind::Press {
            return true;
        }
        if self.editing {
            match k.code {
                KeyCode::Enter => self.editing = false,
                KeyCode::Esc => {
                    self.editing = false;
                    self.filter.clear();
                }
                KeyCode::Backspace => {
                    self.filter.pop();
                }
                KeyCode::Char(c) => self.filter.push(c),
                _ => {}
            }
            self.selected = 0;
            return true;
        }
        if self.screen != Screen::Table {
            return match k.code {
                KeyCode::Char('q') => false,
                _ => {
                    self.screen = Screen::Table;
                    true
                }
            };
        }
        let rows = self.visible().len();
        match k.code {
            KeyCode::Char('q') | KeyCode::Esc => return false,
            KeyCode::Char('s') | KeyCode::Right => {
                let i = Col::ALL.iter().position(|c| *c == self.sort).unwrap_or(0);
                self.sort = Col::ALL[(i + 1) % Col::ALL.len()];
            }
            KeyCode::Left => {
                let i = Col::ALL.iter().position(|c| *c == self.sort).unwrap_or(0);
                self.sort = Col::ALL[(i + Col::ALL.len() - 1) % Col::ALL.len()];
            }
            KeyCode::Char('r') => self.descending = !self.descending,
            KeyCode::Char('/') => {
                self.editing = true;
                self.filter.clear();
            }
            KeyCode::Char('m') => self.p99 = !self.p99,
            KeyCode::Char(' ') => self.paused = !self.paused,
            KeyCode::Down | KeyCode::Char('j') => {
                self.selected = (self.selected + 1).min(rows.saturating_sub(1))
            }
            KeyCode::Up | KeyCode::Char('k') => self.selected = self.selected.saturating_sub(1),
            KeyCode::Enter => {
                let row = self
                    .visible()
                    .get(self.selected)
                    .map(|l| (l.kind, l.vm.clone(), l.disk.clone()));
                match row {
                    Some((Kind::Vm, vm, _)) => toggle(&mut self.collapsed, vm),
                    Some((Kind::VDisk, vm, disk)) => toggle(&mut self.expanded, (vm, disk)),
                    _ => {}
                }
            }
            KeyCode::Char('h') => self.screen = Screen::Histogram,
            KeyCode::Char('d') => self.screen = Screen::Diagnosis,
            KeyCode::Char('?') => self.screen = Screen::Help,
            _ => {}
        }
        true
    }
}

/// In the set if it was not, out if it was.
fn toggle<T: Ord>(set: &mut std::collections::BTreeSet<T>, v: T) {
    if !set.remove(&v) {
        set.insert(v);
    }
}
