//! Compiles the eBPF side's shared logic natively (tests/native/shim.c),
//! so the tests exercise the same C the kernel runs.

fn main() {
    // Read when the script runs, not when it was compiled: a checkout that
    // moved keeps its compiled script.
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let include = format!("{dir}/../bpf/include");
    println!("cargo:rerun-if-changed=native/shim.c");
    println!("cargo:rerun-if-changed={include}");
    cc::Build::new()
        .file("native/shim.c")
        .include(include)
        .warnings(true)
        .compile("iospan_shim");
}
