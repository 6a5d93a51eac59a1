//! What the documentation and the code's comments point a reader at is
//! there: every repository path they name exists, the README stays a
//! newcomer's page with its pictures, and each eBPF header compiles on
//! its own (a header that only compiles after another is a trap for the
//! next file that includes it).

use std::{
    path::{Path, PathBuf},
    process::Command,
};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace")
        .to_path_buf()
}

/// Files under version control whose text may name paths.
fn texts() -> Vec<PathBuf> {
    let out = Command::new("git")
        .args(["ls-files"])
        .current_dir(root())
        .output()
        .expect("git ls-files");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|f| {
            !f.starts_with("tests/fuzz/seeds/") && !f.starts_with("tests/fuzz/regressions/")
        })
        .filter(|f| {
            [
                ".md", ".rs", ".c", ".h", ".toml", ".yaml", ".yml", ".service",
            ]
            .iter()
            .any(|e| f.ends_with(e))
                || *f == ".ci/run"
        })
        .map(|f| root().join(f))
        .collect()
}

const TOP_DIRS: [&str; 8] = [
    "agent/",
    "bpf/",
    "collector/",
    "dashboards/",
    "docs/",
    "packaging/",
    "tests/",
    "xtask/",
];

/// Made at run time, ignored by git.
const MADE_AT_RUN_TIME: [&str; 4] = [
    "tests/fuzz/artifacts",
    "tests/fuzz/corpus",
    "tests/fuzz/target",
    "tests/fuzz/coverage",
];

/// The repository paths `text` names: a top directory's name and what
/// follows it, up to the first character no path here has.
fn named_paths(text: &str) -> Vec<String> {
    let is_path = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    let mut out = Vec::new();
    for (i, _) in text.char_indices() {
        let rest = &text[i..];
        let Some(dir) = TOP_DIRS.iter().find(|d| rest.starts_with(*d)) else {
            continue;
        };
        // Only at the start of a word: not "bpf/" of "libbpf/".
        let before = text[..i].chars().next_back();
        if before.is_some_and(|c| is_path(c) || c == '<') {
            continue;
        }
        let len = rest.find(|c: char| !is_path(c)).unwrap_or(rest.len());
        let p = rest[..len].trim_end_matches(['.', '-', '/']);
        if p.len() > dir.len() {
            out.push(p.to_string());
        }
    }
    out
}

/// A placeholder a reader fills in (TARGET, NAME): no file of its own.
fn is_placeholder(p: &str) -> bool {
    p.split('/').any(|c| {
        let stem = c.split('.').next().unwrap_or(c);
        stem.len() > 1 && stem.chars().all(|ch| ch.is_ascii_uppercase() || ch == '_')
    })
}

#[test]
fn every_path_the_docs_and_comments_name_exists() {
    let mut missing = Vec::new();
    let mut seen = 0;
    for f in texts() {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        for p in named_paths(&text) {
            if is_placeholder(&p) || MADE_AT_RUN_TIME.iter().any(|m| p.starts_with(m)) {
                continue;
            }
            seen += 1;
            // A test binary's path as cargo prints it is the package's.
            let found = [root(), root().join("tests")]
                .iter()
                .any(|base| base.join(&p).exists());
            if !found {
                missing.push(format!(
                    "{}: {p}",
                    f.strip_prefix(root()).unwrap_or(&f).display()
                ));
            }
        }
    }
    assert!(seen > 100, "only {seen} paths found: the scan is broken");
    assert!(
        missing.is_empty(),
        "named but not there:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_scan_finds_paths_and_skips_what_is_not_one() {
    let t = "see `docs/rig.md`, agent/src/abi/mod.rs: and libbpf/src or <bpf/bpf_helpers.h>; tests/fuzz/seeds/TARGET.";
    assert_eq!(
        named_paths(t),
        [
            "docs/rig.md",
            "agent/src/abi/mod.rs",
            "tests/fuzz/seeds/TARGET"
        ]
    );
    assert!(is_placeholder("tests/fuzz/seeds/TARGET"));
    assert!(is_placeholder("collector/NAME.yaml"));
    assert!(!is_placeholder("docs/rig.md"));
}

#[test]
fn the_readme_is_a_newcomers_page_with_its_pictures() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 200,
        "README.md is {lines} lines: the rest belongs in docs/"
    );
    for pic in ["docs/pictures/top.svg", "docs/pictures/trace.png"] {
        assert!(
            readme.contains(&format!("]({pic})")),
            "README.md shows no {pic}"
        );
        let len = std::fs::metadata(root().join(pic))
            .map(|m| m.len())
            .unwrap_or(0);
        assert!(len > 1000, "{pic}: {len} bytes");
    }
    let svg = std::fs::read_to_string(root().join("docs/pictures/top.svg")).unwrap_or_default();
    assert!(
        svg.contains("VM / DISK"),
        "top.svg is no picture of iospan top"
    );
    // The diagnosis it quotes is the one `cargo xtask pictures` took from a
    // real run, whole: a throttle named with its knob in both words.
    let diagnosis = std::fs::read_to_string(root().join("docs/pictures/diagnosis.txt"))
        .expect("docs/pictures/diagnosis.txt (cargo xtask pictures)");
    assert!(
        readme.contains(&format!("```text\n{diagnosis}```")),
        "README.md does not quote docs/pictures/diagnosis.txt as it is"
    );
    for part in ["throttle", "try (QEMU):", "try (libvirt):", "expect:"] {
        assert!(diagnosis.contains(part), "{part:?} not in {diagnosis}");
    }
}

#[test]
fn each_ebpf_header_compiles_on_its_own() {
    let include = root().join("bpf/include");
    let arch = root().join("bpf/include/vmlinux/x86");
    let dir = tempfile::tempdir().expect("a scratch directory");
    let mut checked = 0;
    for e in std::fs::read_dir(&include).expect("bpf/include").flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".h") {
            continue;
        }
        let src = dir.path().join("alone.c");
        std::fs::write(&src, format!("#include \"{name}\"\n")).expect("alone.c");
        // A .bpf.h is the eBPF programs'; the others are shared with the
        // agent's native tests, so they compile natively too.
        let mut cc = if name.ends_with(".bpf.h") {
            let mut c = Command::new("clang");
            c.args(["-target", "bpf", "-O2", "-g", "-D__TARGET_ARCH_x86"])
                .arg("-I")
                .arg(&arch);
            c
        } else {
            Command::new("cc")
        };
        let out = cc
            .args(["-Wall", "-Werror", "-fsyntax-only", "-I"])
            .arg(&include)
            .arg(&src)
            .output()
            .expect("the C compiler");
        assert!(
            out.status.success(),
            "bpf/include/{name} does not compile on its own:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} headers in bpf/include");
}

#[test]
fn the_ebpf_sources_keep_their_layout() {
    let out = Command::new("git")
        .args(["ls-files", "bpf/*.c", "bpf/*.h"])
        .current_dir(root())
        .output()
        .expect("git ls-files");
    let files: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|f| !f.contains("/vmlinux/"))
        .map(str::to_string)
        .collect();
    assert!(files.len() >= 10, "only {} eBPF sources", files.len());
    let out = Command::new("clang-format")
        .args(["--dry-run", "--Werror"])
        .args(&files)
        .current_dir(root())
        .output()
        .expect("clang-format (cargo xtask setup installs it)");
    assert!(
        out.status.success(),
        "bpf/ differs from bpf/.clang-format: run clang-format -i on these\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
