//! Compiles the eBPF side's shared logic natively (tests/native/shim.c),
//! so the tests exercise the same C the kernel runs.

fn main() {
    let include = concat!(env!("CARGO_MANIFEST_DIR"), "/../bpf/include");
    println!("cargo:rerun-if-changed=native/shim.c");
    println!("cargo:rerun-if-changed={include}");
    cc::Build::new()
        .file("native/shim.c")
        .include(include)
        .warnings(true)
        .compile("iospan_shim");
}
