//! `cargo xtask pictures`: the README's pictures, made from a real run so
//! they stay true: `iospan top` watching the rig guest (its terminal,
//! colours and all, as SVG) and, given a build of the Jaeger UI, one of
//! that guest's traces as Jaeger shows it (PNG, by headless Chromium), and
//! the diagnosis `iospan run` gives a throttled guest (text, which the
//! README quotes).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{backends, guest, setup, sh, tmux::Tmux};

#[derive(clap::Args)]
pub struct PicturesArgs {
    /// Where the pictures go.
    #[arg(long, default_value = "docs/pictures")]
    pub out: PathBuf,
    /// A build of the Jaeger UI (its `packages/jaeger-ui/build`): with it,
    /// a trace's picture too (the Jaeger built here serves no UI of its own).
    #[arg(long)]
    pub jaeger_ui: Option<PathBuf>,
}

pub fn main(a: &PicturesArgs) -> Result<()> {
    setup::ensure(false)?;
    sh::cargo(&["build", "--release", "-p", "iospan"])?;
    let out = sh::root().join(&a.out);
    std::fs::create_dir_all(&out).with_context(|| format!("--out {}", out.display()))?;
    let rig = guest::build()?;
    let image = guest::dir().join("disk.img");
    guest::ensure_image(&image, 256)?;
    let top = out.join("top.svg");
    top_picture(&rig, &image, &top)?;
    eprintln!("xtask: pictures: {}", top.display());
    let diagnosis = out.join(DIAGNOSIS_FILE);
    diagnosis_text(&rig, &image, &diagnosis)?;
    eprintln!("xtask: pictures: {}", diagnosis.display());
    match &a.jaeger_ui {
        Some(ui) => {
            let png = out.join("trace.png");
            trace_picture(&rig, &image, ui, &png)?;
            eprintln!("xtask: pictures: {}", png.display());
        }
        None => eprintln!(
            "xtask: pictures: no trace picture: give --jaeger-ui DIR (a build of the Jaeger UI)"
        ),
    }
    Ok(())
}

/// A child killed when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The rig guest reading at depth 4 until killed.
fn start_guest(rig: &guest::Rig, image: &Path, name: &str, ios: u64) -> Result<Running> {
    let args = guest::RunArgs {
        qd: 4,
        ios,
        name: name.into(),
        ..Default::default()
    };
    let (mut qemu, _) = guest::qemu_command(rig, &args, image);
    let child = qemu
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting the rig guest")?;
    Ok(Running(child))
}

/// `iospan top` beside the rig guest, once the guest's row has every
/// segment filled in and a few intervals behind it.
fn top_picture(rig: &guest::Rig, image: &Path, svg: &Path) -> Result<()> {
    let iospan = sh::target_dir().join("release/iospan");
    let tmux = Tmux::start(
        &format!("{} top --deep --interval 1s", iospan.display()),
        150,
        11,
    )?;
    tmux.until("top's header", Duration::from_secs(60), |s| {
        s.contains("VM / DISK")
    })?;
    let _guest = start_guest(rig, image, "web01", 10_000_000)?;
    tmux.until("the guest's row", Duration::from_secs(120), |s| {
        s.lines().any(|l| l.trim_start().starts_with("web01"))
    })?;
    // A few intervals at a steady rate.
    std::thread::sleep(Duration::from_secs(5));
    let screen = tmux.screen_with_colours()?;
    std::fs::write(svg, ansi_to_svg(&screen)).with_context(|| format!("{}", svg.display()))
}

/// The diagnosis's file among the pictures (the README quotes it whole).
pub const DIAGNOSIS_FILE: &str = "diagnosis.txt";

/// A throttle under the rig guest's rate, and the diagnosis `iospan run`
/// gives its virtual disk: the text under its table, that disk's part.
fn diagnosis_text(rig: &guest::Rig, image: &Path, txt: &Path) -> Result<()> {
    let iospan = sh::target_dir().join("release/iospan");
    let args = guest::RunArgs {
        qd: 4,
        ios: 2000,
        name: "web01".into(),
        throttle_iops: Some(200),
        ..Default::default()
    };
    let (qemu, _) = guest::qemu_command(rig, &args, image);
    let out = sh::output(
        Command::new(&iospan)
            .args(["run", "--quiet", "--deep", "--"])
            .arg(qemu.get_program())
            .args(qemu.get_args()),
    )?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "pictures: iospan run around the throttled guest failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let part = vdisk_diagnosis(&text, &args.name, &args.disk_id).with_context(|| {
        format!(
            "pictures: no diagnosis of {} {} in iospan run's output:\n{text}",
            args.name, args.disk_id
        )
    })?;
    std::fs::write(txt, part).with_context(|| format!("{}", txt.display()))
}

/// The diagnosis of `vm`'s `disk` in a report's text: its line and the
/// indented lines under it.
fn vdisk_diagnosis(text: &str, vm: &str, disk: &str) -> Option<String> {
    let head = format!("{vm} {disk} ");
    let mut lines = text
        .lines()
        .skip_while(|l| !l.starts_with("What limits each disk"))
        .skip_while(|l| !l.starts_with(&head));
    let first = lines.next()?;
    let rest = lines.take_while(|l| l.starts_with(' '));
    Some(
        std::iter::once(first)
            .chain(rest)
            .map(|l| format!("{l}\n"))
            .collect(),
    )
}

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> Result<bool>) -> Result<()> {
    let t = Instant::now();
    while !ok()? {
        if t.elapsed() > limit {
            bail!("pictures: waited {limit:?} for {what}");
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Ok(())
}

/// A traced run of the rig guest exported to a Jaeger serving `ui`, and
/// its slowest trace's page shot by headless Chromium.
fn trace_picture(rig: &guest::Rig, image: &Path, ui: &Path, png: &Path) -> Result<()> {
    if !ui.join("index.html").is_file() {
        bail!(
            "--jaeger-ui {}: no index.html there (build the Jaeger UI: npm run build, then its packages/jaeger-ui/build)",
            ui.display()
        );
    }
    let ui = ui.canonicalize()?;
    let jaeger = backends::Jaeger::start_with_ui(Some(&ui))?;
    let iospan = sh::target_dir().join("release/iospan");
    let args = guest::RunArgs {
        qd: 4,
        ios: 4000,
        name: "web01".into(),
        ..Default::default()
    };
    let (qemu, _) = guest::qemu_command(rig, &args, image);
    sh::run(
        Command::new(&iospan)
            .args([
                "run",
                "--quiet",
                "--deep",
                "--trace-slowest",
                "1",
                "--otlp-endpoint",
            ])
            // Jaeger takes traces only.
            .env("OTEL_METRICS_EXPORTER", "none")
            .arg(format!("http://{}", jaeger.otlp_http))
            .arg("--")
            .arg(qemu.get_program())
            .args(qemu.get_args())
            .stdout(Stdio::null()),
    )?;
    let mut trace = None;
    wait_for("trace in Jaeger", Duration::from_secs(30), || {
        let (_, body) = jaeger.get("/api/traces?service=iospan&limit=1")?;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        trace = v["data"][0]["traceID"].as_str().map(str::to_string);
        Ok(trace.is_some())
    })?;
    let id = trace.unwrap_or_default();
    let mut shot = Command::new("chromium");
    shot.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1400,470",
        "--virtual-time-budget=15000",
    ])
    .arg(format!("--screenshot={}", png.display()))
    .arg(format!("http://{}/trace/{id}?uiEmbed=v0", jaeger.query))
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    sh::run(&mut shot)
}

/// Cell size, px: a 14 px monospace font.
const CELL_W: f64 = 8.4;
const CELL_H: f64 = 18.0;
const BACKGROUND: &str = "#1e1e1e";
const FOREGROUND: &str = "#d4d4d4";

/// What a run of cells looks like.
#[derive(Clone, Debug, Default, PartialEq)]
struct Pen {
    fg: Option<String>,
    bg: Option<String>,
    bold: bool,
    reverse: bool,
}

/// The 16 colours of a dark terminal.
const PALETTE: [&str; 16] = [
    "#000000", "#cd3131", "#0dbc79", "#e5e510", "#2472c8", "#bc3fbc", "#11a8cd", "#e5e5e5",
    "#666666", "#f14c4c", "#23d18b", "#f5f543", "#3b8eea", "#d670d6", "#29b8db", "#ffffff",
];

fn colour256(n: u16) -> String {
    match n {
        0..=15 => PALETTE[usize::from(n)].to_string(),
        16..=231 => {
            let n = n - 16;
            let level = |v: u16| if v == 0 { 0 } else { 55 + v * 40 };
            format!(
                "#{:02x}{:02x}{:02x}",
                level(n / 36),
                level(n / 6 % 6),
                level(n % 6)
            )
        }
        _ => {
            let v = 8 + (n.min(255) - 232) * 10;
            format!("#{v:02x}{v:02x}{v:02x}")
        }
    }
}

impl Pen {
    /// Applies one SGR escape's parameters.
    fn apply(&mut self, params: &str) {
        let mut ps = params.split(';').map(|p| p.parse::<u16>().unwrap_or(0));
        while let Some(p) = ps.next() {
            match p {
                0 => *self = Pen::default(),
                1 => self.bold = true,
                22 => self.bold = false,
                7 => self.reverse = true,
                27 => self.reverse = false,
                30..=37 => self.fg = Some(PALETTE[usize::from(p - 30)].into()),
                90..=97 => self.fg = Some(PALETTE[usize::from(p - 90 + 8)].into()),
                40..=47 => self.bg = Some(PALETTE[usize::from(p - 40)].into()),
                100..=107 => self.bg = Some(PALETTE[usize::from(p - 100 + 8)].into()),
                39 => self.fg = None,
                49 => self.bg = None,
                38 | 48 => {
                    let c = match ps.next() {
                        Some(5) => ps.next().map(colour256),
                        Some(2) => {
                            let (r, g, b) = (ps.next(), ps.next(), ps.next());
                            Some(format!(
                                "#{:02x}{:02x}{:02x}",
                                r.unwrap_or(0),
                                g.unwrap_or(0),
                                b.unwrap_or(0)
                            ))
                        }
                        _ => None,
                    };
                    if p == 38 {
                        self.fg = c;
                    } else {
                        self.bg = c;
                    }
                }
                _ => {}
            }
        }
    }

    /// (foreground, background) as drawn.
    fn colours(&self) -> (String, Option<String>) {
        let fg = self.fg.clone().unwrap_or_else(|| FOREGROUND.into());
        if self.reverse {
            (
                self.bg.clone().unwrap_or_else(|| BACKGROUND.into()),
                Some(fg),
            )
        } else {
            (fg, self.bg.clone())
        }
    }
}

/// One line's runs of cells in one pen: (column, text, pen).
fn runs(line: &str) -> Vec<(usize, String, Pen)> {
    let mut out: Vec<(usize, String, Pen)> = Vec::new();
    let (mut pen, mut col) = (Pen::default(), 0);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\x1b' && chars.peek() == Some(&'[') {
            chars.next();
            let mut params = String::new();
            for p in chars.by_ref() {
                if p.is_ascii_alphabetic() {
                    if p == 'm' {
                        pen.apply(&params);
                    }
                    break;
                }
                params.push(p);
            }
            continue;
        }
        match out.last_mut() {
            Some((_, text, p)) if *p == pen => text.push(c),
            _ => out.push((col, c.to_string(), pen.clone())),
        }
        col += 1;
    }
    out
}

fn xml(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A terminal screen (lines with SGR escapes) as an SVG picture.
pub fn ansi_to_svg(screen: &str) -> String {
    let lines: Vec<Vec<(usize, String, Pen)>> = screen.lines().map(runs).collect();
    let cols = lines
        .iter()
        .flatten()
        .map(|r| r.0 + r.1.chars().count())
        .max()
        .unwrap_or(0)
        .max(1);
    let (w, h) = (
        cols as f64 * CELL_W + 16.0,
        lines.len() as f64 * CELL_H + 16.0,
    );
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w:.0}\" height=\"{h:.0}\" \
         font-family=\"DejaVu Sans Mono, Menlo, Consolas, monospace\" font-size=\"14\">\n\
         <rect width=\"100%\" height=\"100%\" rx=\"6\" fill=\"{BACKGROUND}\"/>\n"
    );
    for (row, line) in lines.into_iter().enumerate() {
        let y = 8.0 + row as f64 * CELL_H;
        for (col, text, pen) in line {
            let x = 8.0 + col as f64 * CELL_W;
            let n = text.chars().count() as f64;
            let (fg, bg) = pen.colours();
            if let Some(bg) = bg {
                svg.push_str(&format!(
                    "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{CELL_H}\" fill=\"{bg}\"/>\n",
                    n * CELL_W
                ));
            }
            if text.trim().is_empty() {
                continue;
            }
            let weight = if pen.bold {
                " font-weight=\"bold\""
            } else {
                ""
            };
            svg.push_str(&format!(
                "<text x=\"{x:.1}\" y=\"{:.1}\" fill=\"{fg}\"{weight} xml:space=\"preserve\" \
                 textLength=\"{:.1}\" lengthAdjust=\"spacingAndGlyphs\">{}</text>\n",
                y + 14.0,
                n * CELL_W,
                xml(&text)
            ));
        }
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disks_diagnosis_is_cut_from_the_report() {
        let text = "table\n\nWhat limits each disk (docs/diagnosis.md):\nweb01 vd0 read — engine\n    now: x\n    try (QEMU): y\nweb01 vd1 read — none\n";
        assert_eq!(
            vdisk_diagnosis(text, "web01", "vd0").as_deref(),
            Some("web01 vd0 read — engine\n    now: x\n    try (QEMU): y\n")
        );
        assert_eq!(vdisk_diagnosis(text, "web02", "vd0"), None);
    }

    #[test]
    fn escapes_become_runs_of_cells_in_their_colours() {
        let r = runs("ab\x1b[1;31mcd\x1b[0m e\x1b[38;5;46mf\x1b[7mg");
        let cols: Vec<(usize, &str)> = r.iter().map(|(c, t, _)| (*c, t.as_str())).collect();
        assert_eq!(cols, [(0, "ab"), (2, "cd"), (4, " e"), (6, "f"), (7, "g")]);
        assert!(r[1].2.bold);
        assert_eq!(r[1].2.colours().0, "#cd3131");
        assert_eq!(r[3].2.colours().0, "#00ff00");
        // Reversed: the foreground becomes the background.
        assert_eq!(
            r[4].2.colours(),
            (BACKGROUND.into(), Some("#00ff00".into()))
        );
    }

    #[test]
    fn the_svg_holds_every_cell_and_escapes_markup() {
        let svg = ansi_to_svg("VM / DISK  <x> & y\n\x1b[42m  \x1b[0mok\n");
        assert!(
            svg.contains(">VM / DISK  &lt;x&gt; &amp; y</text>"),
            "{svg}"
        );
        assert!(svg.contains("fill=\"#0dbc79\""), "{svg}");
        assert!(svg.contains(">ok</text>"), "{svg}");
        assert!(svg.starts_with("<svg ") && svg.ends_with("</svg>\n"));
    }
}
