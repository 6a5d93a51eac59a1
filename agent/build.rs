//! Compiles the C eBPF programs in `bpf/` with clang (CO-RE, BTF) into
//! OUT_DIR (the host's linked from several); `src/probes` embeds the
//! objects, so the `iospan` binary is
//! self-contained and clang is needed at build time only.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

/// Each object the agent embeds, and the files it is made of (one per
/// concern; headers only declare). A file defines what its header
/// declares, so an object of several is compiled to LLVM bitcode, linked
/// (llvm-link), its cross-file calls inlined (opt: the functions marked
/// `__inline_linked`, so each program reaches the verifier whole), then
/// made BPF (llc): one BTF for it all, as a single file's compile would give.
const OBJECTS: &[(&str, &[&str])] = &[
    (
        "host",
        &[
            "block.bpf.c",
            "vms.bpf.c",
            "notifiers.bpf.c",
            "kicks.bpf.c",
            "pickups.bpf.c",
            "signals.bpf.c",
            "sched.bpf.c",
            "scsi_target.bpf.c",
            "vm_request.bpf.c",
            "vm_join.bpf.c",
            "stats.bpf.c",
            "nesting.bpf.c",
            "host.bpf.c",
            "core_fixes.bpf.c",
            "blk_op.bpf.c",
            "maps.bpf.c",
            "rq_account.c",
            "hist.c",
        ],
    ),
    ("features", &["features.bpf.c"]),
    ("guest", &["guest.bpf.c", "blk_op.bpf.c", "maps.bpf.c"]),
    ("floor", &["floor.bpf.c"]),
];

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("..");
    let bpf = root.join("bpf");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let arch = match env::var("CARGO_CFG_TARGET_ARCH").unwrap().as_str() {
        "x86_64" => "x86",
        "aarch64" => "arm64",
        other => panic!("no vmlinux.h for target arch {other}: add bpf/include/vmlinux/<arch>/"),
    };
    let tools = Tools::from_env();
    let clang = &tools.clang;

    for entry in walk(&bpf) {
        println!("cargo:rerun-if-changed={}", entry.display());
    }
    for var in ["CLANG", "LLVM_LINK", "LLVM_DIS", "OPT", "LLC"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    for (object, files) in OBJECTS {
        let obj = out.join(format!("{object}.bpf.o"));
        if let [one] = files {
            compile(clang, arch, &bpf, &bpf.join(one), &obj, false);
        } else {
            let mut parts = Vec::new();
            for file in *files {
                let part = out.join(format!("{object}-{file}.bc"));
                compile(clang, arch, &bpf, &bpf.join(file), &part, true);
                parts.push(part);
            }
            link(&tools, &parts, &out.join(object), &obj);
        }
        // DWARF is only for humans; BTF and BTF.ext (what CO-RE needs) stay.
        for strip in ["llvm-strip", "llvm-strip-19", "llvm-strip-14"] {
            if let Ok(s) = Command::new(strip).arg("-g").arg(&obj).status() {
                if s.success() {
                    break;
                }
            }
        }
    }
}

/// The LLVM tools, each overridable by its variable.
struct Tools {
    clang: String,
    llvm_link: String,
    llvm_dis: String,
    opt: String,
    llc: String,
}

impl Tools {
    fn from_env() -> Self {
        let tool = |var: &str, name: &str| env::var(var).unwrap_or_else(|_| name.into());
        Tools {
            clang: tool("CLANG", "clang"),
            llvm_link: tool("LLVM_LINK", "llvm-link"),
            llvm_dis: tool("LLVM_DIS", "llvm-dis"),
            opt: tool("OPT", "opt"),
            llc: tool("LLC", "llc"),
        }
    }
}

/// Links an object's bitcode `parts` (`stem`.bc), inlines each
/// `__inline_linked` function where it is called and drops its definition
/// (internalized, then dead): BPF has no calls of more than five
/// arguments, and a global function is verified alone, without its
/// caller's pointers. Everything else keeps its linkage: the programs, the
/// maps, the settings the agent patches and the `__noinline` functions meant
/// to be verified once.
fn link(tools: &Tools, parts: &[PathBuf], stem: &Path, obj: &Path) {
    let linked = stem.with_extension("bc");
    run(
        Command::new(&tools.llvm_link)
            .args(parts)
            .arg("-o")
            .arg(&linked),
        &tools.llvm_link,
        &linked,
    );
    let ir = output(
        Command::new(&tools.llvm_dis).arg(&linked).args(["-o", "-"]),
        &tools.llvm_dis,
        &linked,
    );
    let keep = kept_symbols(&ir).join(",");
    let inlined = stem.with_extension("inlined.bc");
    run(
        Command::new(&tools.opt)
            .arg("-passes=internalize,default<O2>")
            .arg(format!("-internalize-public-api-list={keep}"))
            .arg(&linked)
            .arg("-o")
            .arg(&inlined),
        &tools.opt,
        &inlined,
    );
    run(
        Command::new(&tools.llc)
            .args(["-march=bpf", "-mcpu=v3", "-filetype=obj"])
            .arg(&inlined)
            .arg("-o")
            .arg(obj),
        &tools.llc,
        obj,
    );
}

/// The module's external definitions (functions and globals) other than
/// the functions marked always-inline: in a linked module those are the
/// `__inline_linked` ones, as a header's static inlines are internal.
fn kept_symbols(ir: &str) -> Vec<String> {
    let inline_groups: Vec<&str> = ir
        .lines()
        .filter_map(|l| l.strip_prefix("attributes #"))
        .filter(|l| l.contains(" alwaysinline "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    let external = |rest: &str| !rest.starts_with("internal ") && !rest.starts_with("private ");
    let mut kept = Vec::new();
    for line in ir.lines() {
        if let Some(rest) = line.strip_prefix("define ") {
            let Some(name) = symbol_name(rest) else {
                continue;
            };
            let group = rest.rsplit(" #").next().and_then(|g| g.split(' ').next());
            if external(rest) && !group.is_some_and(|g| inline_groups.contains(&g)) {
                kept.push(name);
            }
        } else if let Some(rest) = line.strip_prefix('@') {
            let (name, def) = rest.split_once(" = ").unwrap_or((rest, ""));
            if external(def) && !def.starts_with("external ") {
                kept.push(name.trim_matches('"').to_string());
            }
        }
    }
    kept
}

/// The `@name` a `define` line defines.
fn symbol_name(define: &str) -> Option<String> {
    let at = define.find('@')?;
    let rest = &define[at + 1..];
    let end = rest.find('(')?;
    Some(rest[..end].trim_matches('"').to_string())
}

fn compile(clang: &str, arch: &str, bpf: &Path, src: &Path, out: &Path, bitcode: bool) {
    let mut cmd = Command::new(clang);
    cmd.args([
        "-target", "bpf", "-O2", "-g", "-mcpu=v3", "-Wall", "-Werror",
    ])
    .arg(format!("-D__TARGET_ARCH_{arch}"))
    .arg("-I")
    .arg(bpf.join("include"))
    .arg("-I")
    .arg(bpf.join("include/vmlinux").join(arch));
    if bitcode {
        // Optimized once, linked (link): as one file's compile would be.
        cmd.args(["-emit-llvm", "-Xclang", "-disable-llvm-passes"]);
    }
    cmd.arg("-c").arg(src).arg("-o").arg(out);
    run(&mut cmd, clang, src);
}

/// Runs a build tool on `what` for its standard output.
fn output(cmd: &mut Command, tool: &str, what: &Path) -> String {
    let out = cmd.output().unwrap_or_else(|e| {
        panic!(
            "running `{tool}` on {}: {e}\n\
             hint: install llvm (`apt-get install llvm`), or run `cargo xtask setup`",
            what.display()
        )
    });
    assert!(
        out.status.success(),
        "`{tool}` failed on {}",
        what.display()
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a build tool on `what`, naming the package that has it on failure.
fn run(cmd: &mut Command, tool: &str, what: &Path) {
    let status = cmd.status().unwrap_or_else(|e| {
        panic!(
            "running `{tool}` on {}: {e}\n\
             hint: install clang, llvm and libbpf-dev (`apt-get install clang llvm libbpf-dev`), \
             or run `cargo xtask setup`",
            what.display()
        )
    });
    assert!(status.success(), "`{tool}` failed on {}", what.display());
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                files.extend(walk(&p));
            } else {
                files.push(p);
            }
        }
    }
    files
}
