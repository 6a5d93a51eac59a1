//! bpf/ as libbpf-tools keeps it: a header declares (records, maps,
//! prototypes), the file of its concern defines, and no two files take
//! symbols from each other in a circle.
//!
//! What a file takes from another is what the linker would say: each file
//! is compiled to bitcode and `llvm-nm` lists the symbols it defines and
//! the ones it leaves undefined; an undefined symbol is an edge to the one
//! file that defines it.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

/// One file's symbols, as `llvm-nm` lists them.
#[derive(Debug, Default)]
pub struct FileSymbols {
    pub file: String,
    pub defined: BTreeSet<String>,
    pub undefined: BTreeSet<String>,
}

/// Every problem of `bpf` (the repository's `bpf/`) and the number of
/// files and edges checked.
pub fn check_tree(bpf: &Path) -> Result<(Vec<String>, usize, usize)> {
    let mut problems = Vec::new();
    let include = bpf.join("include");
    for h in files_with(&include, &[".h"])? {
        let text =
            std::fs::read_to_string(&h).with_context(|| format!("reading {}", h.display()))?;
        let name = h.file_name().unwrap_or_default().to_string_lossy();
        problems.extend(header_bodies(&name, &text));
    }
    let symbols = files_with(bpf, &[".c"])?
        .iter()
        .map(|f| symbols_of(bpf, f))
        .collect::<Result<Vec<_>>>()?;
    let (edges, unowned) = edges(&symbols);
    problems.extend(unowned);
    for c in super::cycles(&edges) {
        let steps: Vec<String> = c
            .iter()
            .zip(c.iter().cycle().skip(1))
            .map(|(a, b)| format!("{a} takes `{}` from {b}", edges[a][b].0))
            .collect();
        problems.push(format!(
            "bpf/: a circle of files: {}; define the symbols of one concern in one file",
            steps.join(", ")
        ));
    }
    let n_edges = edges.values().map(BTreeMap::len).sum();
    Ok((problems, symbols.len(), n_edges))
}

/// The function bodies in a header: a line that opens one (`{` alone at
/// the left margin, as clang-format lays out a function), or a `static`
/// definition; macros' bodies are left alone.
pub fn header_bodies(name: &str, text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut in_macro = false;
    for (i, line) in text.lines().enumerate() {
        let macro_line = in_macro || line.starts_with('#');
        in_macro = macro_line && line.trim_end().ends_with('\\');
        if macro_line {
            continue;
        }
        if line == "{" || (line.starts_with("static ") && line.contains('(')) {
            found.push(format!(
                "bpf/include/{name}:{}: a function defined in a header: declare it there, define \
                 it in the .bpf.c of its concern (`__inline_linked`, include/linked.h)",
                i + 1
            ));
        }
    }
    found
}

type Edges = BTreeMap<String, BTreeMap<String, (String, usize)>>;

/// File → file edges (with one symbol taken), and the symbols no file or
/// more than one defines.
pub fn edges(files: &[FileSymbols]) -> (Edges, Vec<String>) {
    let wanted: BTreeSet<&String> = files.iter().flat_map(|f| &f.undefined).collect();
    let mut owners: BTreeMap<&String, Vec<&str>> = BTreeMap::new();
    for f in files {
        for s in f.defined.iter().filter(|s| wanted.contains(s)) {
            owners.entry(s).or_default().push(&f.file);
        }
    }
    let mut edges = Edges::new();
    let mut problems = Vec::new();
    for f in files {
        for s in f.undefined.iter().filter(|s| !s.starts_with("llvm.")) {
            match owners.get(s).map(Vec::as_slice) {
                Some([one]) => {
                    edges
                        .entry(f.file.clone())
                        .or_default()
                        .entry(one.to_string())
                        .or_insert_with(|| (s.clone(), 0));
                }
                Some(many) => problems.push(format!(
                    "bpf/{}: `{s}` is defined by {}: one file defines it",
                    f.file,
                    many.join(", ")
                )),
                None => problems.push(format!(
                    "bpf/{}: uses `{s}`, which no file of bpf/ defines",
                    f.file
                )),
            }
        }
    }
    (edges, problems)
}

/// `file`'s symbols, from its bitcode.
fn symbols_of(bpf: &Path, file: &Path) -> Result<FileSymbols> {
    let out = tempfile::Builder::new()
        .suffix(".bc")
        .tempfile()
        .context("a temporary file for bitcode")?;
    let arch = if cfg!(target_arch = "aarch64") {
        "arm64"
    } else {
        "x86"
    };
    let status = Command::new(std::env::var("CLANG").unwrap_or_else(|_| "clang".into()))
        .args([
            "-target",
            "bpf",
            "-O2",
            "-g",
            "-mcpu=v3",
            "-emit-llvm",
            "-c",
        ])
        .arg(format!("-D__TARGET_ARCH_{arch}"))
        .arg("-I")
        .arg(bpf.join("include"))
        .arg("-I")
        .arg(bpf.join("include/vmlinux").join(arch))
        .arg(file)
        .arg("-o")
        .arg(out.path())
        .status()
        .context("running clang (install clang, or `cargo xtask setup`)")?;
    if !status.success() {
        bail!("clang failed on {}", file.display());
    }
    let nm = Command::new("llvm-nm")
        .arg(out.path())
        .output()
        .context("running llvm-nm (install llvm, or `cargo xtask setup`)")?;
    if !nm.status.success() {
        bail!("llvm-nm failed on the bitcode of {}", file.display());
    }
    let mut syms = FileSymbols {
        file: file
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned(),
        ..Default::default()
    };
    for line in String::from_utf8_lossy(&nm.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["U", name] | [_, "U", name] => syms.undefined.insert(name.to_string()),
            [_, kind, name] if *kind != "U" => syms.defined.insert(name.to_string()),
            _ => false,
        };
    }
    Ok(syms)
}

fn files_with(dir: &Path, ends: &[&str]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        if p.is_file() && ends.iter().any(|x| name.ends_with(x)) {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, defined: &[&str], undefined: &[&str]) -> FileSymbols {
        FileSymbols {
            file: name.into(),
            defined: defined.iter().map(|s| s.to_string()).collect(),
            undefined: undefined.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn a_header_that_only_declares_passes() {
        let h = "struct x {\n\tint a;\n};\n#define F(a) \\\n\tstatic int f(void) \\\n{ \\\n}\n\
                 int f(int a);\nextern m_t m SEC(\".maps\");\n";
        assert_eq!(header_bodies("x.h", h), Vec::<String>::new());
    }

    #[test]
    fn a_function_body_in_a_header_is_refused() {
        let h = "/* doc */\nstatic __always_inline int f(int a)\n{\n\treturn a;\n}\n";
        let p = header_bodies("x.h", h);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].contains("/x.h:2: a function defined"), "{p:?}");
        let plain = "int g(int a)\n{\n\treturn a;\n}\n";
        assert_eq!(header_bodies("y.h", plain).len(), 1);
    }

    #[test]
    fn files_taking_from_each_other_are_a_circle() {
        let files = [
            file("a.bpf.c", &["fa", "prog"], &["fb"]),
            file("b.bpf.c", &["fb"], &["fc"]),
            file("c.bpf.c", &["fc"], &["fa", "llvm.memcpy.p0i8.p0i8.i64"]),
        ];
        let (e, problems) = edges(&files);
        assert_eq!(problems, Vec::<String>::new());
        let circles = crate::layers::cycles(&e);
        assert_eq!(circles, vec![vec!["a.bpf.c", "b.bpf.c", "c.bpf.c"]]);
    }

    #[test]
    fn a_downward_chain_is_no_circle_and_strays_are_named() {
        let files = [
            file("a.bpf.c", &["fa"], &["fb", "nowhere"]),
            file("b.bpf.c", &["fb", "LICENSE"], &[]),
            file("c.bpf.c", &["fb", "LICENSE"], &[]),
        ];
        let (e, problems) = edges(&files);
        assert!(crate::layers::cycles(&e).is_empty());
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems
            .iter()
            .any(|p| p.contains("`fb` is defined by b.bpf.c, c.bpf.c")));
        assert!(problems.iter().any(|p| p.contains("`nowhere`")));
    }

    #[test]
    fn the_repositorys_bpf_files_declare_in_headers_and_make_no_circle() {
        let bpf = crate::sh::root().join("bpf");
        let (problems, files, edges) = check_tree(&bpf).expect("checking bpf/");
        assert_eq!(problems, Vec::<String>::new());
        assert!(files > 10 && edges > 10, "{files} files, {edges} edges");
    }
}
