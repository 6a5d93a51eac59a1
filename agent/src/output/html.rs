//! A stored run as one self-contained HTML page: plots drawn as inline
//! SVG (no scripts, nothing fetched), so it opens anywhere and can be
//! mailed or attached to a ticket as is.

use std::fmt::Write as _;

use crate::output::store::{band_name, Series, StoredRun, TailEntry, PARTS};

/// One colour per part, in `PARTS` order (total, guest, hypervisor,
/// engine, device); the tests look for them in a screenshot.
pub const COLOURS: [&str; 5] = ["#333333", "#4e79a7", "#f28e2b", "#e15759", "#59a14f"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A disk's diagnosis: the finding, its evidence, the setting and what to
/// try (docs/diagnosis.md).
fn diagnosis_section(run: &StoredRun, t: &TailEntry) -> String {
    let Some(d) = run
        .report
        .entries
        .iter()
        .find(|e| e.vm.as_deref() == Some(t.vm.as_str()) && e.disk == t.disk && e.op == t.op)
        .and_then(|e| e.diagnosis.as_ref())
    else {
        return String::new();
    };
    let mut h = format!(
        "<h3>What limits it</h3><p><b>{}</b> ({} confidence)</p><ul>",
        esc(&d.summary),
        d.confidence.as_str()
    );
    for e in &d.evidence {
        let _ = write!(h, "<li>{}</li>", esc(e));
    }
    h += "</ul>";
    if let Some(k) = &d.knob {
        let _ = write!(h, "<p>now: {}</p><ul>", esc(&k.now));
        for (who, what) in [
            ("QEMU", &k.qemu),
            ("libvirt", &k.libvirt),
            ("host", &k.host),
        ] {
            if let Some(w) = what {
                let _ = write!(h, "<li>try ({who}): <code>{}</code></li>", esc(w));
            }
        }
        let _ = write!(h, "</ul><p>expect: {}</p>", esc(&k.expect));
    }
    if let Some(x) = &d.to_know {
        let _ = write!(h, "<p>to know more: {}</p>", esc(x));
    }
    h
}

pub fn render(run: &StoredRun) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>iospan run {}</title>\
         <style>body{{font:14px sans-serif;margin:24px;color:#222}} h2{{margin-top:32px}} \
         table{{border-collapse:collapse}} td,th{{padding:2px 8px;text-align:right;border-bottom:1px solid #ddd}} \
         th:first-child,td:first-child{{text-align:left}} .legend span{{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px}} \
         svg{{background:#fff}}</style></head><body>",
        esc(&run.label)
    );
    let _ = write!(
        h,
        "<h1>iospan run {}</h1><p>{:.1} s{}</p>",
        esc(&run.label),
        run.report.duration_s,
        run.report
            .command
            .as_ref()
            .map(|c| format!(" — <code>{}</code>", esc(&c.join(" "))))
            .unwrap_or_default()
    );
    if !run.host.name.is_empty() {
        let _ = write!(h, "<p>on {}</p>", esc(&run.host.describe()));
    }
    h += &legend();
    if run.tails.is_empty() {
        h += "<p>No VM I/O was split in this run: no segments to plot.</p>";
    }
    for t in &run.tails {
        let _ = write!(
            h,
            "<h2>{} {} {} — {} I/Os{}</h2>",
            esc(&t.vm),
            esc(&t.disk),
            t.op,
            t.ios,
            if t.guest_observed {
                ""
            } else {
                " (host window only)"
            }
        );
        h += &diagnosis_section(run, t);
        h += "<h3>Where the time goes, by tail</h3>";
        h += &tail_bars(t);
        h += &tail_table(t);
        h += "<h3>Latency distribution per segment</h3>";
        h += &cdf_plot(t);
        if let Some(s) = run
            .series
            .iter()
            .find(|s| s.vm == t.vm && s.disk == t.disk && s.op == t.op)
        {
            h += "<h3>Over time</h3>";
            h += &series_plots(s);
        }
    }
    h += &fio_table(run);
    h += &qemu_table(run);
    h += "<h2>Report</h2><pre>";
    h += &esc(&run.report.table());
    h += "</pre></body></html>\n";
    h
}

/// fio's own figures, where the run has them.
fn fio_table(run: &StoredRun) -> String {
    let mut h = String::new();
    if !run.fio.is_empty() {
        h += "<h2>fio's own figures</h2><table><tr><th>job</th><th>op</th><th>I/Os</th><th>IOPS</th><th>mean µs</th><th>p99 µs</th><th>p99.9 µs</th></tr>";
        for f in &run.fio {
            let o = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.0}</td><td>{:.1}</td><td>{}</td><td>{}</td></tr>",
                esc(&f.job),
                f.op,
                f.ios,
                f.iops,
                f.mean_us,
                o(f.p99_us),
                o(f.p999_us)
            );
        }
        h += "</table>";
    }
    h
}

/// QEMU's own accounting beside ours, where the run read it.
fn qemu_table(run: &StoredRun) -> String {
    let mut h = String::new();
    let checked: Vec<_> = run
        .report
        .entries
        .iter()
        .filter_map(|e| Some((e, e.qemu.as_ref()?)))
        .collect();
    if !checked.is_empty() {
        h += "<h2>QEMU's own accounting beside ours</h2><p>QEMU times a request from its device model taking it to its completion callback: beside our engine + device.</p><table><tr><th>VM</th><th>disk</th><th>op</th><th>QEMU</th><th>iospan</th><th>diff</th><th>QEMU mean µs</th><th>engine + device µs</th><th></th></tr>";
        let o = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"));
        for (e, c) in checked {
            let note = if c.mismatch {
                "MISMATCH"
            } else if c.uncounted {
                "not counted by its engine"
            } else {
                ""
            };
            h += &format!(
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{note}</td></tr>",
                esc(e.vm.as_deref().unwrap_or("-")),
                esc(&e.disk),
                e.op.as_str(),
                c.ops,
                c.iospan_ops,
                c.diff,
                o(c.mean_us),
                o(c.engine_device_mean_us)
            );
        }
        h += "</table>";
    }
    h
}

fn legend() -> String {
    let mut s = String::from("<p class=\"legend\">");
    for (name, c) in PARTS.iter().zip(COLOURS).skip(1) {
        let _ = write!(s, "<span style=\"background:{c}\"></span>{name}");
    }
    s + "</p>"
}

/// A horizontal stacked bar per band: the band's mean, split by segment.
fn tail_bars(t: &TailEntry) -> String {
    let (w, row, left) = (900.0, 34.0, 90.0);
    let h = row * t.bands.len() as f64 + 30.0;
    let max = t
        .bands
        .iter()
        .map(|b| b.mean_us[1..].iter().sum::<f64>())
        .fold(0.0, f64::max)
        .max(1e-9);
    let mut s = format!(
        "<svg class=\"tails\" width=\"{w}\" height=\"{h}\" xmlns=\"http://www.w3.org/2000/svg\">"
    );
    for (i, b) in t.bands.iter().enumerate() {
        let y = 10.0 + i as f64 * row;
        let _ = write!(
            s,
            "<text x=\"0\" y=\"{}\">{}</text>",
            y + 18.0,
            band_name(b.from_pct)
        );
        let mut x = left;
        for (k, v) in b.mean_us.iter().enumerate().skip(1) {
            let bw = v / max * (w - left - 140.0);
            if bw > 0.0 {
                let _ = write!(
                    s,
                    "<rect x=\"{x:.1}\" y=\"{y}\" width=\"{bw:.1}\" height=\"24\" fill=\"{}\"><title>{}: {v:.1} µs</title></rect>",
                    COLOURS[k], PARTS[k]
                );
            }
            x += bw;
        }
        let _ = write!(
            s,
            "<text x=\"{:.1}\" y=\"{}\">{:.1} µs</text>",
            x + 6.0,
            y + 18.0,
            b.mean_us[1..].iter().sum::<f64>()
        );
    }
    s + "</svg>"
}

fn tail_table(t: &TailEntry) -> String {
    let mut s = String::from(
        "<table><tr><th>I/Os</th><th>count</th><th>from µs</th><th>total</th><th>guest</th><th>hypervisor</th><th>engine</th><th>device</th></tr>",
    );
    for b in &t.bands {
        let _ = write!(
            s,
            "<tr><td>{}</td><td>{}</td><td>{:.1}</td>",
            band_name(b.from_pct),
            b.ios,
            b.threshold_us
        );
        for v in b.mean_us {
            let _ = write!(s, "<td>{v:.1}</td>");
        }
        s += "</tr>";
    }
    s + "</table>"
}

/// x on a log scale from the smallest to the largest latency shown.
struct LogAxis {
    lo: f64,
    hi: f64,
    x0: f64,
    width: f64,
}

impl LogAxis {
    fn x(&self, v: f64) -> f64 {
        let v = v.max(self.lo).min(self.hi);
        self.x0 + (v / self.lo).ln() / (self.hi / self.lo).ln().max(1e-9) * self.width
    }
}

fn cdf_plot(t: &TailEntry) -> String {
    let (w, h, x0, y0) = (900.0, 300.0, 50.0, 20.0);
    let pw = w - x0 - 20.0;
    let ph = h - y0 - 40.0;
    let all = t.cdf.iter().flatten().map(|p| p.0).filter(|v| *v > 0.0);
    let lo = all.clone().fold(f64::INFINITY, f64::min);
    let hi = all.fold(0.0, f64::max);
    if !lo.is_finite() || hi <= 0.0 {
        return "<p>No latencies.</p>".into();
    }
    let ax = LogAxis {
        lo: lo.max(0.1),
        hi: hi.max(lo * 1.01),
        x0,
        width: pw,
    };
    let mut s = format!(
        "<svg class=\"cdf\" width=\"{w}\" height=\"{h}\" xmlns=\"http://www.w3.org/2000/svg\">"
    );
    let _ = write!(
        s,
        "<rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>"
    );
    // Decades on the x axis.
    let mut d = 10f64.powf(ax.lo.log10().floor());
    while d <= ax.hi {
        if d >= ax.lo {
            let x = ax.x(d);
            let _ = write!(
                s,
                "<line x1=\"{x:.1}\" y1=\"{y0}\" x2=\"{x:.1}\" y2=\"{}\" stroke=\"#eee\"/><text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{} µs</text>",
                y0 + ph,
                y0 + ph + 16.0,
                d
            );
        }
        d *= 10.0;
    }
    for q in [0.5, 0.9, 0.99] {
        let y = y0 + ph * (1.0 - q);
        let _ = write!(
            s,
            "<line x1=\"{x0}\" y1=\"{y:.1}\" x2=\"{}\" y2=\"{y:.1}\" stroke=\"#eee\"/><text x=\"2\" y=\"{:.1}\">{q}</text>",
            x0 + pw,
            y + 4.0
        );
    }
    for (k, pts) in t.cdf.iter().enumerate() {
        let line: Vec<String> = pts
            .iter()
            .filter(|p| p.0 > 0.0)
            .map(|&(v, f)| format!("{:.1},{:.1}", ax.x(v), y0 + ph * (1.0 - f)))
            .collect();
        if line.len() < 2 {
            continue;
        }
        let _ = write!(
            s,
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"{}\" points=\"{}\"><title>{}</title></polyline>",
            COLOURS[k],
            if k == 0 { 3 } else { 2 },
            line.join(" "),
            PARTS[k]
        );
    }
    s + "</svg>"
}

fn series_plots(s: &Series) -> String {
    let pts = &s.points;
    if pts.len() < 2 {
        return "<p>Too short for a time series.</p>".into();
    }
    let t_hi = pts.last().map_or(1.0, |p| p.t_s).max(1e-3);
    let plot = |title: &str, lines: Vec<(&str, Vec<(f64, f64)>)>| -> String {
        let (w, h, x0, y0) = (900.0, 200.0, 60.0, 20.0);
        let (pw, ph) = (w - x0 - 20.0, h - y0 - 30.0);
        let hi = lines
            .iter()
            .flat_map(|l| l.1.iter().map(|p| p.1))
            .fold(0.0, f64::max)
            .max(1e-9);
        let mut o = format!(
            "<svg class=\"series\" width=\"{w}\" height=\"{h}\" xmlns=\"http://www.w3.org/2000/svg\"><text x=\"{x0}\" y=\"14\">{title} (max {hi:.1})</text><rect x=\"{x0}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/><text x=\"{x0}\" y=\"{}\">0 s</text><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{t_hi:.0} s</text>",
            y0 + ph + 16.0,
            x0 + pw,
            y0 + ph + 16.0
        );
        for (colour, l) in lines {
            let p: Vec<String> = l
                .iter()
                .map(|&(t, v)| format!("{:.1},{:.1}", x0 + t / t_hi * pw, y0 + ph * (1.0 - v / hi)))
                .collect();
            let _ = write!(
                o,
                "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>",
                p.join(" ")
            );
        }
        o + "</svg>"
    };
    let iops = vec![(COLOURS[0], pts.iter().map(|p| (p.t_s, p.iops)).collect())];
    let seg_names = ["total", "guest", "hv", "engine", "device"];
    let p99 = seg_names
        .iter()
        .enumerate()
        .map(|(k, name)| {
            (
                COLOURS[k],
                pts.iter()
                    .filter_map(|p| Some((p.t_s, *p.p99_us.get(*name)?)))
                    .collect::<Vec<_>>(),
            )
        })
        .filter(|l| l.1.len() > 1)
        .collect();
    plot("IOPS", iops) + &plot("p99 per segment, µs", p99)
}
