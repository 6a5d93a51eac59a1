//! Drawing: reads the state, never changes it.

use std::collections::BTreeMap;

use ratatui::{
    layout::{Constraint, Layout, Rect},
    style::{Color, Modifier, Style},
    text::{Line, Span},
    widgets::{Block, Borders, Cell, Clear, Paragraph, Row, Table, TableState},
};

use super::{state::SEG_TITLES, *};
use crate::output::live::{self};

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
                Col::Why => l
                    .why()
                    .map_or("-".into(), |d| d.diagnosis.word().to_string()),
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

    f.render_widget(Paragraph::new(Line::from(footer_spans(st))), footer);

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
        Screen::Diagnosis => {
            let text = visible.get(st.selected).map_or_else(
                || vec!["nothing selected".to_string()],
                |l| diagnosis_text(l),
            );
            overlay(f, main, "what limits it", text)
        }
    }
}

/// The selected row's diagnoses, each op's, whole: the finding, its
/// evidence, the setting and what to try.
pub fn diagnosis_text(l: &Item) -> Vec<String> {
    if l.why.is_empty() {
        return vec![format!(
            "{} {}: no diagnosis yet (each covers the agent's last 10 s of I/O)",
            l.vm, l.disk
        )];
    }
    let mut out = Vec::new();
    for d in &l.why {
        out.push(format!(
            "{} {} {} — over the last {:.0} s, {} confidence:",
            d.vm,
            d.disk,
            d.op,
            d.seconds,
            d.diagnosis.confidence.as_str()
        ));
        out.extend(d.diagnosis.text().lines().map(|s| format!("  {s}")));
    }
    out
}

/// The footer: interval, sort, filter, pause, and what was lost,
/// unsplit, polled or unmatched.
fn footer_spans(st: &State) -> Vec<Span<'static>> {
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
    if st.unsplit > 0 {
        spans.push(Span::styled(
            format!("unsplit {}  ", st.unsplit),
            Style::new().fg(Color::Yellow),
        ));
    }
    if st.polled > 0 {
        spans.push(Span::styled(
            format!("polled {}  ", st.polled),
            Style::new().fg(Color::Yellow),
        ));
    }
    spans.push(if st.unmatched > 0 {
        Span::styled(
            format!("unmatched {}  ", st.unmatched),
            Style::new().fg(Color::Yellow),
        )
    } else {
        Span::raw("unmatched 0  ")
    });
    spans.push(Span::raw("* host window only  ? help  q quit"));
    spans
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
        "d           what limits the selected row: its diagnosis, evidence and knob",
        "q           quit;  any key closes this",
        "",
        "TOTAL  guest-observed (guest agent), else the host window (marked *)",
        "GUEST  guest block layer to kick, interrupt to completion",
        "HV     kick to engine pickup, engine signal to interrupt",
        "ENGINE pickup to host submit, host completion to signal",
        "DEVICE host block layer issue to completion; QUEUE host queueing",
        "HV RDY, ENG RDY  of HV and ENGINE, the time their thread (engine,",
        "       worker) was runnable but waited for a CPU (esxtop's %RDY)",
        "WHY    what limits it, in a word (d: the whole diagnosis):",
        "       throttle, eng-rdy, eng-busy, vcpu-kick, device, host-q, guest-q,",
        "       vcpu-rdy, ? (a segment dominates, cause not seen), ok (none)",
        "",
        "q0, q1 … a virtual disk's queues (the guest's, else by the kicks' notifier)",
        "lost: events or requests lost; unsplit: VM requests whose host window",
        "was not split; unmatched: guest or host requests",
        "of a VM with a guest agent that found no partner; polled: requests",
        "a polling engine found with no kick (HV not measurable host-side)",
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
