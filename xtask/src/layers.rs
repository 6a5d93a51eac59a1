//! `cargo xtask layers`: the agent's modules use only the layers below their
//! own, and the units of one layer never reach each other in a circle.
//!
//! A layer is a folder of `agent/src`; a unit is a module directly in it
//! (`pipeline::stitch`); the layer's own `mod.rs` (what its units share, and
//! their re-exports) is left out of circles. Every path a file names through `crate::`, `super::`
//! or one of its own child modules is an edge from its unit to the named one.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};

pub mod bpf;

/// Bottom up. A new folder of `agent/src` goes here, and in
/// docs/architecture.md, at the height of what it may use.
pub const LAYERS: &[&str] = &[
    "abi", "model", "discover", "probes", "pipeline", "output", "api", "cmd",
];

/// The layers that may name aya: the probes, which talk to it, and the
/// records' marker that they are plain data for its maps.
const AYA_USERS: &[&str] = &["abi", "probes"];

/// Files at the root of `agent/src` that belong to no layer.
const ROOTS: &[&str] = &["lib.rs", "main.rs"];

/// A module path inside the crate, e.g. `["pipeline", "stitch"]`.
type ModPath = Vec<String>;

#[derive(Debug, PartialEq, Eq)]
pub struct Violation {
    pub file: String,
    pub line: usize,
    pub what: String,
}

/// Checks `src` (the agent's `src/`), returning every violation found.
pub fn check_tree(src: &Path) -> Result<Vec<String>> {
    let mut files = Vec::new();
    walk(src, &mut files)?;
    files.sort();
    let mut sources = Vec::new();
    for f in &files {
        let rel = f
            .strip_prefix(src)
            .unwrap_or(f)
            .to_string_lossy()
            .into_owned();
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        sources.push((rel, text));
    }
    Ok(check(&sources))
}

/// The check over (path relative to `src/`, contents) pairs.
pub fn check(sources: &[(String, String)]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut edges: BTreeMap<String, BTreeMap<String, (String, usize)>> = BTreeMap::new();
    for (rel, text) in sources {
        if ROOTS.contains(&rel.as_str()) {
            continue;
        }
        let Some(me) = module_of(rel) else {
            continue;
        };
        let Some(my_layer) = layer_of(&me) else {
            problems.push(format!(
                "{rel}: `{}` is in no layer: move it into one of {LAYERS:?}, or add its folder to \
                 LAYERS in xtask/src/layers.rs and to docs/architecture.md",
                me[0]
            ));
            continue;
        };
        if !AYA_USERS.contains(&LAYERS[my_layer]) {
            let code = strip_comments(text);
            if let Some(i) = code.find("aya::") {
                let line = code[..i].matches('\n').count() + 1;
                problems.push(format!(
                    "{rel}:{line}: `{}` (layer {}) names aya: only {AYA_USERS:?} may; put what it \
                     needs behind `probes`",
                    me.join("::"),
                    LAYERS[my_layer]
                ));
            }
        }
        let children = child_mods(text);
        for (line, target) in references(text, &me, &children) {
            let Some(their_layer) = layer_of(&target) else {
                continue; // a crate-root item, or a name that is not a module
            };
            if their_layer > my_layer {
                problems.push(format!(
                    "{rel}:{line}: `{}` (layer {}) uses `{}` (layer {}, above it): move what it \
                     needs down, or the user up",
                    me.join("::"),
                    LAYERS[my_layer],
                    target.join("::"),
                    LAYERS[their_layer]
                ));
            }
            let (a, b) = (unit_of(&me), unit_of(&target));
            // A layer's own mod.rs holds what its units share and re-exports
            // them: it is no unit of its own for circles.
            if their_layer == my_layer && a != b && a.contains("::") && b.contains("::") {
                edges
                    .entry(a)
                    .or_default()
                    .entry(b)
                    .or_insert((rel.clone(), line));
            }
        }
    }
    for cycle in cycles(&edges) {
        let mut text = String::from("circle between units of one layer: ");
        for (i, u) in cycle.iter().enumerate() {
            let next = &cycle[(i + 1) % cycle.len()];
            let (file, line) = &edges[u][next];
            let _ = write!(text, "{u} → {next} ({file}:{line}); ");
        }
        problems.push(text.trim_end_matches("; ").to_string());
    }
    problems
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        if p.is_dir() {
            walk(&p, out)?;
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    Ok(())
}

/// `pipeline/stitch.rs` → pipeline::stitch; `probes/mod.rs` → probes.
fn module_of(rel: &str) -> Option<ModPath> {
    let rel = rel.strip_suffix(".rs")?;
    let mut parts: ModPath = rel.split('/').map(str::to_string).collect();
    if parts.last().is_some_and(|l| l == "mod") {
        parts.pop();
    }
    (!parts.is_empty()).then_some(parts)
}

fn layer_of(m: &[String]) -> Option<usize> {
    LAYERS
        .iter()
        .position(|l| m.first().is_some_and(|f| f == l))
}

/// The layer's own root, or the module directly inside it.
fn unit_of(m: &[String]) -> String {
    m.iter().take(2).cloned().collect::<Vec<_>>().join("::")
}

/// `mod x;` / `pub mod x;` declared in this file (inline test modules too:
/// a path through them stays in the file's unit anyway).
fn child_mods(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let l = line.trim_start();
        let l = l.strip_prefix("pub ").unwrap_or(l);
        let l = l.strip_prefix("pub(crate) ").unwrap_or(l);
        if let Some(rest) = l.strip_prefix("mod ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

/// Every module path the file names, with its line: `crate::a::b`,
/// `crate::{a::b, c}`, `super::x`, and `child::x` for its own children.
fn references(text: &str, me: &ModPath, children: &BTreeSet<String>) -> Vec<(usize, ModPath)> {
    let code = strip_comments(text);
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let mut counted = 0;
    while i < bytes.len() {
        if !code.is_char_boundary(i) {
            i += 1;
            continue;
        }
        line += bytes[counted..i].iter().filter(|&&b| b == b'\n').count();
        counted = i;
        let at_word = i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b':');
        if !at_word {
            i += 1;
            continue;
        }
        let rest = &code[i..];
        let (base, j): (ModPath, usize) = if rest.starts_with("crate::") {
            (Vec::new(), i + "crate::".len())
        } else if rest.starts_with("self::") {
            (me.clone(), i + "self::".len())
        } else if rest.starts_with("super::") {
            let mut up = me.clone();
            up.pop();
            let mut j = i + "super::".len();
            while code[j..].starts_with("super::") {
                up.pop();
                j += "super::".len();
            }
            (up, j)
        } else {
            let word: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if children.contains(&word) && rest[word.len()..].starts_with("::") {
                (me.clone(), i)
            } else {
                i += 1;
                continue;
            }
        };
        for path in paths_at(&code[j..]) {
            let mut full = base.clone();
            full.extend(path);
            out.push((line, full));
        }
        i = j.max(i + 1);
    }
    out
}

/// The module-like leading segments of the path (or use-group) at the start
/// of `s`: `a::b::C` gives [a, b]; `{a::X, b}` gives [a] and [b].
fn paths_at(s: &str) -> Vec<ModPath> {
    if let Some(inner) = s.strip_prefix('{') {
        let mut depth = 1;
        let mut end = inner.len();
        for (k, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k;
                        break;
                    }
                }
                _ => {}
            }
        }
        let group = &inner[..end];
        let mut out = Vec::new();
        let mut depth = 0;
        let mut start = 0;
        for (k, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.extend(paths_at(group[start..k].trim_start()));
                    start = k + 1;
                }
                _ => {}
            }
        }
        out.extend(paths_at(group[start..].trim_start()));
        return out;
    }
    let mut segs = Vec::new();
    let mut rest = s;
    loop {
        let word: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // Modules are snake_case; a type, trait or constant ends the path.
        if word.is_empty()
            || word == "self"
            || !word.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        {
            break;
        }
        let after = &rest[word.len()..];
        match after.strip_prefix("::") {
            Some(next) if next.starts_with('{') => {
                segs.push(word);
                return paths_at(next)
                    .into_iter()
                    .map(|p| segs.iter().cloned().chain(p).collect())
                    .chain(std::iter::once(segs.clone()))
                    .collect();
            }
            Some(next) => {
                segs.push(word);
                rest = next;
            }
            // The last segment: a module itself (`use crate::abi;`) or a function.
            None => {
                segs.push(word);
                break;
            }
        }
    }
    if segs.is_empty() {
        Vec::new()
    } else {
        vec![segs]
    }
}

/// Line comments out (doc comments name paths that are not uses), line
/// count kept.
fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(k) => &l[..k],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Elementary circles of the unit graph, each once (smallest unit first).
fn cycles(edges: &BTreeMap<String, BTreeMap<String, (String, usize)>>) -> Vec<Vec<String>> {
    let mut found = BTreeSet::new();
    for start in edges.keys() {
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, path)) = stack.pop() {
            for next in edges.get(&at).into_iter().flat_map(|m| m.keys()) {
                if next == start {
                    let mut c = path.clone();
                    let k = (0..c.len()).min_by_key(|&k| &c[k]).unwrap_or(0);
                    c.rotate_left(k);
                    found.insert(c);
                } else if !path.contains(next) && next > start {
                    let mut p = path.clone();
                    p.push(next.clone());
                    stack.push((next.clone(), p));
                }
            }
        }
    }
    found.into_iter().collect()
}

/// `cargo xtask layers`.
pub fn main() -> Result<()> {
    let root = crate::sh::root();
    let mut problems = check_tree(&root.join("agent/src"))?;
    let (bpf_problems, files, edges) = bpf::check_tree(&root.join("bpf"))?;
    problems.extend(bpf_problems);
    if problems.is_empty() {
        eprintln!(
            "xtask: layers: every module of agent/src uses only the layers below it ({})",
            LAYERS.join(" < ")
        );
        eprintln!(
            "xtask: layers: bpf/'s headers declare, its {files} files define, and their \
             {edges} uses of each other make no circle"
        );
        return Ok(());
    }
    for p in &problems {
        eprintln!("{p}");
    }
    bail!(
        "{} layering problem(s) in agent/src and bpf/ (see docs/architecture.md)",
        problems.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(files: &[(&str, &str)]) -> Vec<String> {
        let s: Vec<(String, String)> = files
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        check(&s)
    }

    #[test]
    fn a_downward_use_passes() {
        let p = run(&[
            ("model/mod.rs", "use crate::abi::Rec;\n"),
            (
                "pipeline/stitch.rs",
                "use crate::{abi, model::{hist::Hist, Op}};\n",
            ),
            ("cmd/run.rs", "fn f() { crate::pipeline::stitch::go(); }\n"),
        ]);
        assert_eq!(p, Vec::<String>::new());
    }

    #[test]
    fn an_upward_use_fails_in_every_spelling() {
        for src in [
            "use crate::pipeline::stitch::IoSpan;",
            "use crate::{abi, pipeline::stitch::IoSpan};",
            "use crate::{abi, pipeline::{stitch, correlate}};",
            "fn f() -> crate::cmd::run::Outcome { todo!() }",
            "use crate::output;",
        ] {
            let p = run(&[("model/mod.rs", src)]);
            assert!(!p.is_empty(), "{src}: passed");
            for v in &p {
                assert!(
                    v.starts_with("model/mod.rs:1: `model` (layer model) uses `"),
                    "{v}"
                );
                assert!(v.contains("above it"), "{v}");
            }
        }
    }

    #[test]
    fn super_is_resolved_from_the_files_module() {
        // probes/block.rs's super is probes: same layer, no violation.
        assert!(run(&[("probes/block.rs", "use super::attach;")]).is_empty());
        // model/hist.rs's super::super is the crate root.
        assert!(run(&[("model/hist.rs", "use super::super::abi::X;")]).is_empty());
    }

    #[test]
    fn aya_is_named_only_below_the_pipeline() {
        assert!(run(&[("probes/ring.rs", "use aya::maps::RingBuf;\n")]).is_empty());
        let found = run(&[(
            "cmd/run.rs",
            "fn f() {}\nfn g() { aya::sys::enable_stats(); }\n",
        )]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("cmd/run.rs:2: "), "{found:?}");
        assert!(run(&[("output/x.rs", "// aya::maps is below\n")]).is_empty());
    }

    #[test]
    fn comments_are_not_uses() {
        assert!(run(&[(
            "model/mod.rs",
            "// see crate::cmd::run\n/// crate::output::report\n"
        )])
        .is_empty());
    }

    #[test]
    fn a_circle_inside_a_layer_fails_and_is_named() {
        let p = run(&[
            ("pipeline/stitch.rs", "use crate::pipeline::channel::Stats;"),
            ("pipeline/channel.rs", "use crate::pipeline::correlate::C;"),
            (
                "pipeline/correlate.rs",
                "\n\nuse crate::pipeline::stitch::S;",
            ),
        ]);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].contains("pipeline::channel → pipeline::correlate"),
            "{}",
            p[0]
        );
        assert!(p[0].contains("pipeline/correlate.rs:3"), "{}", p[0]);
    }

    #[test]
    fn a_parent_and_its_children_are_one_unit() {
        let p = run(&[
            (
                "output/export/mod.rs",
                "pub mod otlp;\nfn f() { otlp::go() }",
            ),
            ("output/export/otlp.rs", "use super::Policy;"),
        ]);
        assert!(p.is_empty(), "{p:?}");
    }

    #[test]
    fn a_child_named_without_crate_counts() {
        let p = run(&[
            (
                "discover/mod.rs",
                "pub mod vms;\npub mod disks;\nfn f() { vms::scan() }",
            ),
            ("discover/vms.rs", "use super::disks::Dev;"),
            (
                "discover/disks.rs",
                "fn g() { crate::discover::vms::scan() }",
            ),
        ]);
        // vms → disks → vms; discover (the root) → vms is no circle.
        assert_eq!(p.len(), 1, "{p:?}");
    }

    #[test]
    fn a_folder_in_no_layer_is_named() {
        let p = run(&[("util/mod.rs", "")]);
        assert_eq!(p.len(), 1);
        assert!(p[0].contains("`util` is in no layer"), "{}", p[0]);
    }

    #[test]
    fn the_agent_itself_passes() {
        let src = crate::sh::root().join("agent/src");
        let p = check_tree(&src).expect("agent/src readable");
        assert!(p.is_empty(), "{}", p.join("\n"));
    }
}
