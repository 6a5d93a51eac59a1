//! A QEMU command line as any local user may write it (arguments split at
//! NUL, as /proc/PID/cmdline gives them): parsed without a panic, at most
//! `MAX_VDISKS` disks kept, and every name printable. The same arguments
//! read as qemu-storage-daemon's (its exports and its QMP monitor).
#![no_main]

use iospan::discover::vms::{exports_from_args, from_args, monitor_from_args, MAX_VDISKS};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let args: Vec<String> = text.split('\0').map(str::to_string).collect();
    let vm = from_args(4242, &args);
    assert!(vm.disks.len() <= MAX_VDISKS);
    let shown = |s: &str| !s.chars().any(char::is_control);
    assert!(shown(&vm.name), "{:?}", vm.name);
    assert!(vm.disks.iter().all(|d| shown(&d.id)));
    let exports = exports_from_args(&args, std::path::Path::new("/srv"));
    assert!(exports.iter().all(|e| e.socket.is_absolute()));
    let _ = monitor_from_args(&args);
});
