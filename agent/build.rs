//! Compiles the C eBPF programs in `bpf/` with clang (CO-RE, BTF) into
//! OUT_DIR (the host's linked from several); `src/probes` embeds the
//! objects, so the `iospan` binary is
//! self-contained and clang is needed at build time only.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

/// Each object the agent embeds, and the programs (one `.bpf.c` per concern)
/// in it. The host's concerns share maps and settings, so they are one
/// object: compiled to LLVM bitcode, linked (llvm-link), then to BPF (llc),
/// which gives one BTF for it all as a single file's compile would.
const OBJECTS: &[(&str, &[&str])] = &[
    (
        "host",
        &[
            "block",
            "vms",
            "notifiers",
            "kicks",
            "pickups",
            "signals",
            "sched",
            "scsi_target",
        ],
    ),
    ("features", &["features"]),
    ("guest", &["guest"]),
    ("floor", &["floor"]),
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
    let clang = env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let llvm_link = env::var("LLVM_LINK").unwrap_or_else(|_| "llvm-link".into());
    let llc = env::var("LLC").unwrap_or_else(|_| "llc".into());

    for entry in walk(&bpf) {
        println!("cargo:rerun-if-changed={}", entry.display());
    }
    for var in ["CLANG", "LLVM_LINK", "LLC"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    for (object, programs) in OBJECTS {
        let obj = out.join(format!("{object}.bpf.o"));
        if let [one] = programs {
            compile(
                &clang,
                arch,
                &bpf,
                &bpf.join(format!("{one}.bpf.c")),
                &obj,
                false,
            );
        } else {
            let mut parts = Vec::new();
            for prog in *programs {
                let part = out.join(format!("{prog}.bc"));
                compile(
                    &clang,
                    arch,
                    &bpf,
                    &bpf.join(format!("{prog}.bpf.c")),
                    &part,
                    true,
                );
                parts.push(part);
            }
            let linked = out.join(format!("{object}.bc"));
            run(
                Command::new(&llvm_link).args(&parts).arg("-o").arg(&linked),
                &llvm_link,
                &linked,
            );
            run(
                Command::new(&llc)
                    .args(["-march=bpf", "-mcpu=v3", "-filetype=obj"])
                    .arg(&linked)
                    .arg("-o")
                    .arg(&obj),
                &llc,
                &obj,
            );
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
        cmd.arg("-emit-llvm");
    }
    cmd.arg("-c").arg(src).arg("-o").arg(out);
    run(&mut cmd, clang, src);
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
