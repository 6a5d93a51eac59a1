//! Compiles the eBPF side's shared logic natively (tests/native/shim.c),
//! so the tests exercise the same C the kernel runs.

fn main() {
    // Read when the script runs, not when it was compiled: a checkout that
    // moved keeps its compiled script.
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let include = format!("{dir}/../bpf/include");
    // The pure files of bpf/ (no kernel types), which the shim calls.
    let pure = ["hist.c", "rq_account.c"].map(|f| format!("{dir}/../bpf/{f}"));
    println!("cargo:rerun-if-changed=native/shim.c");
    println!("cargo:rerun-if-changed={include}");
    for f in &pure {
        println!("cargo:rerun-if-changed={f}");
    }
    cc::Build::new()
        .file("native/shim.c")
        .files(&pure)
        .include(include)
        .warnings(true)
        .compile("iospan_shim");
}
