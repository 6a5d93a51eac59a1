//! Compiles the C eBPF programs in `bpf/` with clang (CO-RE, BTF) into
//! OUT_DIR; `src/bpf/mod.rs` embeds the objects, so the `iospan` binary is
//! self-contained and clang is needed at build time only.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

const PROGRAMS: &[&str] = &["block", "features", "guest"];

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

    for entry in walk(&bpf) {
        println!("cargo:rerun-if-changed={}", entry.display());
    }
    println!("cargo:rerun-if-env-changed=CLANG");

    for prog in PROGRAMS {
        let src = bpf.join(format!("{prog}.bpf.c"));
        let obj = out.join(format!("{prog}.bpf.o"));
        let status = Command::new(&clang)
            .args([
                "-target", "bpf", "-O2", "-g", "-mcpu=v3", "-Wall", "-Werror",
            ])
            .arg(format!("-D__TARGET_ARCH_{arch}"))
            .arg("-I")
            .arg(bpf.join("include"))
            .arg("-I")
            .arg(bpf.join("include/vmlinux").join(arch))
            .arg("-c")
            .arg(&src)
            .arg("-o")
            .arg(&obj)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "running `{clang}` to build {}: {e}\n\
                     hint: install clang and libbpf-dev (`apt-get install clang llvm libbpf-dev`), \
                     or run `cargo xtask setup`",
                    src.display()
                )
            });
        assert!(status.success(), "clang failed on {}", src.display());
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
