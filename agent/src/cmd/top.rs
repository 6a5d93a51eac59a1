//! `iospan top`: a live view of where each VM's I/O latency goes, per VM
//! and virtual disk (and host disk), refreshed every interval — esxtop's
//! GAVG/KAVG/DAVG for KVM. Figures are the last interval's, differenced
//! from two cumulative frames (`live`).

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use anyhow::{Context, Result};
use ratatui::{
    crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind},
    layout::{Constraint, Layout, Rect},
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::{Block, Borders, Cell, Clear, Paragraph, Row, Table, TableState},
};
use tokio::sync::watch;

use crate::{
    cmd::run::{self, LiveFeed, RunOptions},
    model::{Hist, Op},
    output::live::{self, Frame},
};

pub struct TopOptions {
    pub disks: Vec<String>,
    pub interval: Duration,
    pub max_disks: u32,
    /// Watch a running agent (`iospan agent`, HOST:PORT of its API)
    /// instead of loading probes here.
    pub connect: Option<String>,
    /// The agent's api.token, where it has one.
    pub token: Option<String>,
    /// Certificates to trust for an https agent.
    pub ca_cert: Option<std::path::PathBuf>,
}

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
}

impl Col {
    pub const ALL: [Col; 12] = [
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
        Col::Share,
    ];

    fn width(self) -> u16 {
        match self {
            Col::Name => 22,
            Col::ReadIops | Col::WriteIops | Col::MBps => 8,
            Col::Out => 5,
            Col::Seg(_) => 9,
            Col::Share => 22,
        }
    }

    /// Which columns go first when they do not fit.
    fn drop_rank(self) -> u8 {
        match self {
            Col::Name => 0,
            Col::Seg(0) => 1,
            Col::ReadIops => 2,
            Col::WriteIops => 3,
            Col::Seg(4) => 4,
            Col::Seg(2) => 5,
            Col::Seg(3) => 6,
            Col::Seg(1) => 7,
            Col::MBps => 8,
            Col::Seg(5) => 9,
            Col::Out => 10,
            Col::Share => 11,
            Col::Seg(_) => 12,
        }
    }

    fn title(self, p99: bool) -> String {
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
        }
    }
}

/// Segment column titles (µs), `live::SEGMENTS` order.
const SEG_TITLES: [&str; 6] = ["TOTAL", "GUEST", "HV", "ENGINE", "DEVICE", "QUEUE"];

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
    Help,
}

/// Everything the screen shows, and the keys change.
pub struct State {
    pub vms: Vec<Item>,
    pub disks: Vec<Item>,
    pub interval_s: f64,
    pub lost: u64,
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
            });
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
        });
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
    fn seg(&self, i: usize, p99: bool) -> Option<f64> {
        let h = self.segs.get(live::SEGMENTS[i])?;
        (h.count > 0).then(|| {
            if p99 {
                h.quantile_ns(0.99)
            } else {
                h.mean_ns()
            }
        })
    }

    fn value(&self, c: Col, p99: bool) -> f64 {
        match c {
            Col::Name => 0.0,
            Col::ReadIops => self.r_iops,
            Col::WriteIops => self.w_iops,
            Col::MBps => self.mbps,
            Col::Out => self.inflight as f64,
            Col::Seg(i) => self.seg(i, p99).unwrap_or(-1.0),
            Col::Share => self.seg(0, false).unwrap_or(-1.0),
        }
    }

    fn label(&self) -> String {
        match self.kind {
            Kind::Vm => self.vm.clone(),
            Kind::VDisk => format!("  {}", self.disk),
            Kind::Queue => format!("    q{}", self.queue.unwrap_or_default()),
            Kind::HostDisk => self.disk.clone(),
        }
    }

    fn matches(&self, filter: &str) -> bool {
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

fn us(ns: f64) -> String {
    if ns < 0.0 {
        "-".into()
    } else if ns < 10_000_000.0 {
        format!("{:.1}", ns / 1e3)
    } else {
        format!("{:.0}ms", ns / 1e6)
    }
}

/// The guest/hypervisor/engine/device shares of the mean as a bar.
fn share_bar(l: &Item, width: usize) -> String {
    let parts: Vec<(char, f64)> = [('g', 1), ('H', 2), ('E', 3), ('D', 4)]
        .iter()
        .filter_map(|&(c, i)| l.seg(i, false).map(|v| (c, v)))
        .collect();
    let sum: f64 = parts.iter().map(|p| p.1).sum();
    if sum <= 0.0 {
        return String::new();
    }
    let mut bar = String::new();
    for (c, v) in parts {
        let n = (v / sum * width as f64).round() as usize;
        bar.extend(std::iter::repeat_n(c, n));
    }
    bar.chars().take(width).collect()
}

/// Draws the whole screen.
pub fn draw(f: &mut ratatui::Frame, st: &State) {
    let [main, footer] =
        Layout::vertical([Constraint::Min(3), Constraint::Length(1)]).areas(f.area());
    let cols = fitting(main.width);
    let header = Row::new(cols.iter().map(|c| {
        let mut t = c.title(st.p99);
        if *c == st.sort {
            t.push(if st.descending { '▼' } else { '▲' });
        }
        Cell::from(t)
    }))
    .style(Style::new().add_modifier(Modifier::BOLD | Modifier::REVERSED));
    let visible = st.visible();
    let rows = visible.iter().map(|l| {
        Row::new(cols.iter().map(|c| {
            Cell::from(match c {
                Col::Name => l.label(),
                Col::ReadIops => format!("{:.0}", l.r_iops),
                Col::WriteIops => format!("{:.0}", l.w_iops),
                Col::MBps => format!("{:.1}", l.mbps),
                Col::Out => match l.kind {
                    Kind::HostDisk => "-".into(),
                    _ => l.inflight.to_string(),
                },
                Col::Seg(0) if !l.guest_observed && l.kind != Kind::HostDisk => l
                    .seg(0, st.p99)
                    .map_or("-".into(), |v| format!("{}*", us(v))),
                Col::Seg(i) => l.seg(*i, st.p99).map_or("-".into(), us),
                Col::Share => share_bar(l, Col::Share.width() as usize),
            })
        }))
        .style(match l.kind {
            Kind::Vm => Style::new().add_modifier(Modifier::BOLD),
            Kind::HostDisk => Style::new().fg(Color::Cyan),
            Kind::VDisk => Style::new(),
            Kind::Queue => Style::new().fg(Color::DarkGray),
        })
    });
    let widths: Vec<Constraint> = cols.iter().map(|c| Constraint::Length(c.width())).collect();
    let table = Table::new(rows, widths)
        .header(header)
        .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED));
    let mut ts =
        TableState::default().with_selected(Some(st.selected.min(visible.len().saturating_sub(1))));
    f.render_stateful_widget(table, main, &mut ts);

    let mut spans = vec![Span::raw(format!(
        " {:.1}s  {}  sort {}{}  ",
        st.interval_s,
        if st.p99 { "p99" } else { "mean" },
        st.sort.title(st.p99),
        if st.descending { "▼" } else { "▲" }
    ))];
    if st.editing || !st.filter.is_empty() {
        spans.push(Span::raw(format!(
            "filter /{}{}  ",
            st.filter,
            if st.editing { "_" } else { "" }
        )));
    }
    if st.paused {
        spans.push(Span::styled("PAUSED  ", Style::new().fg(Color::Yellow)));
    }
    spans.push(if st.lost > 0 {
        Span::styled(format!("lost {}  ", st.lost), Style::new().fg(Color::Red))
    } else {
        Span::raw("lost 0  ")
    });
    spans.push(if st.unmatched > 0 {
        Span::styled(
            format!("unmatched {}  ", st.unmatched),
            Style::new().fg(Color::Yellow),
        )
    } else {
        Span::raw("unmatched 0  ")
    });
    spans.push(Span::raw("* host window only  ? help  q quit"));
    f.render_widget(Paragraph::new(Line::from(spans)), footer);

    match st.screen {
        Screen::Table => {}
        Screen::Help => overlay(f, main, "help", help_text()),
        Screen::Histogram => {
            let text = visible.get(st.selected).map_or_else(
                || vec!["nothing selected".to_string()],
                |l| histogram_text(l),
            );
            overlay(f, main, "histogram", text)
        }
    }
}

fn overlay(f: &mut ratatui::Frame, area: Rect, title: &str, text: Vec<String>) {
    let w = area.width.saturating_sub(4).min(100);
    let h = area.height.saturating_sub(2).min(text.len() as u16 + 2);
    let r = Rect::new(area.x + (area.width - w) / 2, area.y + 1, w, h);
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(text.into_iter().map(Line::from).collect::<Vec<_>>()).block(
            Block::default()
                .borders(Borders::ALL)
                .title(title.to_string()),
        ),
        r,
    );
}

fn help_text() -> Vec<String> {
    [
        "s / → / ←   sort by the next / previous column;  r  reverse",
        "/           filter by VM or disk name (Enter keeps it, Esc clears)",
        "m           toggle mean / p99",
        "space       pause (the figures stay; the agent keeps counting)",
        "↑ ↓ j k     select a row;  Enter  expand/collapse a VM's disks, a disk's queues",
        "h           histogram of the selected row, per segment",
        "q           quit;  any key closes this",
        "",
        "TOTAL  guest-observed (guest agent), else the host window (marked *)",
        "GUEST  guest block layer to kick, interrupt to completion",
        "HV     kick to engine pickup, engine signal to interrupt",
        "ENGINE pickup to host submit, host completion to signal",
        "DEVICE host block layer issue to completion; QUEUE host queueing",
        "",
        "q0, q1 … a virtual disk's guest queues (VMs with a guest agent)",
        "lost: events or requests lost; unmatched: guest or host requests",
        "of a VM with a guest agent that found no partner",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Per segment, the interval's log-2 buckets as bars.
pub fn histogram_text(l: &Item) -> Vec<String> {
    let mut out = vec![format!("{} {} — last interval, µs", l.vm, l.disk)];
    for (i, name) in live::SEGMENTS.iter().enumerate() {
        let Some(h) = l.segs.get(*name).filter(|h| h.count > 0) else {
            continue;
        };
        out.push(format!("{} ({} I/Os)", SEG_TITLES[i], h.count));
        let mut octaves: BTreeMap<u32, u64> = BTreeMap::new();
        for (lo, _, n) in h.nonzero_buckets() {
            *octaves.entry(63 - lo.max(1).leading_zeros()).or_default() += n;
        }
        let most = octaves.values().copied().max().unwrap_or(1);
        for (e, n) in octaves {
            let bar = "#".repeat(((n * 40).div_ceil(most)) as usize);
            out.push(format!(
                "  {:>9} – {:<9} {bar} {n}",
                us((1u64 << e) as f64),
                us((1u64 << (e + 1)) as f64)
            ));
        }
    }
    out
}

/// The latest frame of each source: one per agent for `--connect A,B,…`
/// (by the address given), or one ("") for the probes loaded here.
pub type Fleet = BTreeMap<String, Arc<Frame>>;

/// Runs the probes and the view until q (or until the probes fail: the
/// view ends when its feed does).
pub async fn top(opts: TopOptions) -> Result<()> {
    let (fleet_tx, fleet_rx) = watch::channel(Fleet::new());
    if let Some(list) = opts.connect {
        let addrs: Vec<&str> = list
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .collect();
        if addrs.is_empty() {
            anyhow::bail!("--connect {list:?}: give HOST:PORT[,HOST:PORT…]");
        }
        // Connected before the terminal is taken: a refusal reads plainly.
        let mut streams = Vec::new();
        for a in &addrs {
            let agent = Agent::new(a, opts.token.clone(), opts.ca_cert.as_deref())?;
            // One agent: its rows as they are; several: under their address.
            let host = if addrs.len() > 1 {
                a.to_string()
            } else {
                String::new()
            };
            streams.push((host, agent.open()?));
        }
        // The agents' frames, as they come; the view ends when all stop.
        let fleet_tx = Arc::new(fleet_tx);
        let feeds: Vec<_> = streams
            .into_iter()
            .map(|(host, stream)| {
                let tx = fleet_tx.clone();
                std::thread::spawn(move || {
                    stream.follow(|f| {
                        tx.send_modify(|m| {
                            m.insert(host.clone(), Arc::new(f));
                        });
                        !tx.is_closed()
                    })
                })
            })
            .collect();
        drop(fleet_tx);
        let shown = tokio::task::spawn_blocking(move || view(fleet_rx))
            .await
            .context("the view")?;
        shown?;
        for f in feeds {
            match f.join() {
                Ok(r) => r?,
                Err(_) => anyhow::bail!("a stream reader panicked"),
            }
        }
        return Ok(());
    }
    let (tx, mut rx) = watch::channel(None);
    // The run's frames into the view's feed; dropped (ending the view)
    // when the run ends.
    tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let f = rx.borrow_and_update().clone();
            if let Some(f) = f {
                fleet_tx.send_modify(|m| {
                    m.insert(String::new(), f);
                });
            }
        }
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let ui = tokio::task::spawn_blocking(move || {
        let shown = view(fleet_rx);
        let _ = stop_tx.send(true);
        shown
    });
    let ran = run::run(RunOptions {
        disks: opts.disks,
        max_disks: opts.max_disks,
        vms: true,
        quiet: true,
        live: Some(LiveFeed {
            tx,
            every: opts.interval,
        }),
        stop: Some(stop_rx),
        ..Default::default()
    })
    .await;
    let shown = ui.await.context("the view")?;
    ran?;
    shown
}

/// One source's last interval, named under its host when there are
/// several (`HOST/VM`, `HOST/DISK`): the host groups its rows.
fn host_items(host: &str, prev: Option<&Frame>, cur: &Frame) -> (Vec<Item>, Vec<Item>, f64) {
    let (mut vms, mut disks, secs) = interval(prev, cur);
    if !host.is_empty() {
        for i in &mut vms {
            i.vm = format!("{host}/{}", i.vm);
        }
        for d in &mut disks {
            d.disk = format!("{host}/{}", d.disk);
        }
    }
    (vms, disks, secs)
}

/// A running agent's API, as `--connect` names it.
pub struct Agent {
    base: String,
    token: Option<String>,
    http: ureq::Agent,
}

impl Agent {
    /// `addr`: HOST:PORT or http(s)://HOST:PORT; `ca`: PEM certificates
    /// to trust over https (the web roots otherwise).
    pub fn new(addr: &str, token: Option<String>, ca: Option<&std::path::Path>) -> Result<Self> {
        let base = if addr.contains("://") {
            addr.trim_end_matches('/').to_string()
        } else {
            format!("http://{addr}")
        };
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            anyhow::bail!("--connect {addr}: use HOST:PORT, http://HOST:PORT or https://HOST:PORT");
        }
        let mut tls = ureq::tls::TlsConfig::builder();
        if let Some(path) = ca {
            if base.starts_with("http://") {
                anyhow::bail!(
                    "--ca-cert with --connect {addr}: the agent is reached over https://"
                );
            }
            let pem =
                std::fs::read(path).with_context(|| format!("--ca-cert {}", path.display()))?;
            let certs = ureq::tls::parse_pem(&pem)
                .filter_map(|i| match i {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c)),
                    Ok(_) => None,
                    Err(e) => Some(Err(e)),
                })
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("--ca-cert {}: PEM certificates", path.display()))?;
            if certs.is_empty() {
                anyhow::bail!("--ca-cert {}: no PEM certificate in it", path.display());
            }
            tls = tls.root_certs(ureq::tls::RootCerts::new_with_certs(&certs));
        }
        crate::cmd::tls::install_provider();
        let http = ureq::Agent::config_builder()
            .tls_config(tls.build())
            .build()
            .new_agent();
        Ok(Self { base, token, http })
    }

    /// Opens the agent's frame stream (`/api/v1/stream`).
    fn open(&self) -> Result<FrameStream> {
        let url = format!("{}/api/v1/stream", self.base);
        let mut req = self.http.get(&url).header("Accept", "text/event-stream");
        if let Some(t) = &self.token {
            req = req.header("Authorization", &format!("Bearer {t}"));
        }
        let resp = req.call().map_err(|e| {
            let hint = match &e {
                ureq::Error::StatusCode(401) => {
                    "send the agent's api.token: --token or IOSPAN_TOKEN"
                }
                // TLS failures come wrapped in I/O errors.
                e if e.to_string().contains("certificate") => {
                    "the agent's certificate is not trusted: --ca-cert with the CA that signed it"
                }
                _ => "is `iospan agent` running there?",
            };
            anyhow::anyhow!("--connect: {url}: {e} ({hint})")
        })?;
        Ok(FrameStream {
            url,
            reader: std::io::BufReader::new(Box::new(resp.into_body().into_reader())),
        })
    }
}

struct FrameStream {
    url: String,
    reader: std::io::BufReader<Box<dyn std::io::Read + Send>>,
}

impl FrameStream {
    /// Hands each frame (server-sent events) to `on_frame` until the
    /// stream ends or `on_frame` says the view is gone.
    fn follow(self, mut on_frame: impl FnMut(Frame) -> bool) -> Result<()> {
        use std::io::BufRead;
        let url = self.url;
        for line in self.reader.lines() {
            let line = line.with_context(|| format!("reading {url}"))?;
            if let Some(data) = line.strip_prefix("data:") {
                let frame: Frame = serde_json::from_str(data.trim())
                    .with_context(|| format!("a frame from {url}"))?;
                if !on_frame(frame) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

/// One source's frame last differenced, and what it gave: VM rows, disk
/// rows, the interval (s).
type Differenced = (Arc<Frame>, Vec<Item>, Vec<Item>, f64);

/// Per source: the frame last differenced, and what it gave.
#[derive(Default)]
pub struct Sources {
    last: BTreeMap<String, Differenced>,
}

impl Sources {
    /// Takes the fleet's frames: sources whose frame changed get their new
    /// interval; the others keep theirs (agents tick on their own clocks).
    pub fn update(&mut self, fleet: &Fleet, st: &mut State) {
        for (host, cur) in fleet {
            let prev = self.last.get(host).map(|l| l.0.clone());
            if prev.as_ref().is_some_and(|p| Arc::ptr_eq(p, cur)) {
                continue;
            }
            let (vms, disks, secs) = host_items(host, prev.as_deref(), cur);
            self.last
                .insert(host.clone(), (cur.clone(), vms, disks, secs));
        }
        if st.paused {
            return;
        }
        st.vms = self.last.values().flat_map(|l| l.1.clone()).collect();
        st.disks = self.last.values().flat_map(|l| l.2.clone()).collect();
        st.interval_s = self.last.values().map(|l| l.3).fold(0.0, f64::max);
        st.lost = self.last.values().map(|l| l.0.lost).sum();
        st.unmatched = self.last.values().map(|l| l.0.unmatched).sum();
    }
}

/// The terminal loop: frames in, a screen out; keys between.
fn view(mut rx: watch::Receiver<Fleet>) -> Result<()> {
    let mut terminal =
        ratatui::try_init().context("iospan top needs a terminal (stdin and stdout a tty)")?;
    let result = (|| -> Result<()> {
        let mut st = State::default();
        let mut sources = Sources::default();
        loop {
            // The feed gone: the probes (or every agent's stream) stopped.
            let Ok(changed) = rx.has_changed() else {
                return Ok(());
            };
            if changed {
                let fleet = rx.borrow_and_update().clone();
                sources.update(&fleet, &mut st);
            }
            terminal.draw(|f| draw(f, &st))?;
            if event::poll(Duration::from_millis(100))? {
                if let Event::Key(k) = event::read()? {
                    if !st.key(k) {
                        return Ok(());
                    }
                }
            }
        }
    })();
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use ratatui::{backend::TestBackend, Terminal};

    use super::*;

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
            guest_observed: true,
            segs,
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
            unmatched: 7,
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
        assert!(screen(&st, 200, 12).join("\n").contains("h2:9464/db"));
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
            "SHARE",
        ] {
            assert!(s.contains(t), "{t} missing:\n{s}");
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
        assert!(!key(&mut st, KeyCode::Char('q')));
    }
}
