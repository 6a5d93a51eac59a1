//! Where a uprobe goes in a process's executable: the file offset of a
//! symbol's first probed instruction, and whether that instruction can be
//! emulated (a single-stepped probe costs ~30× more per hit).

use serde::Serialize;

use crate::discover::procfs;

/// The largest executable read to find a symbol (QEMU's are tens of MB;
/// with debug symbols a few hundred).
const MAX_EXECUTABLE: u64 = 1 << 30;

/// Where a uprobe on `symbol` goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Site {
    /// Offset in the executable's file, as the kernel takes it.
    pub file_offset: u64,
    pub prologue: Prologue,
}

/// Where a uprobe on `symbol` goes in process `pid`'s executable, read
/// through /proc/PID/exe: the file the process runs (even deleted), never a
/// path that something else may sit at now. None when the symbol is not
/// found or the executable cannot be read.
pub fn uprobe_site(pid: u32, symbol: &str) -> Option<Site> {
    // Only the headers, symbol tables and the symbol's first bytes are
    // read: QEMU's executable is tens of MB, and the agent's resident
    // memory is no place for it.
    let file = procfs::open_executable(pid, MAX_EXECUTABLE).ok()?;
    site_in(&object::read::ReadCache::new(file), symbol)
}

/// The kernel's own path to a process's executable, for attaching: it
/// resolves to the file the process runs.
pub fn exe_path(pid: u32) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/proc/{pid}/exe"))
}

/// `symbol` in an ELF image. The probed instruction is emulated when it is
/// a push (cheap), single-stepped out of line otherwise (see `iospan
/// doctor` for both costs here). An endbr64 (CET builds) is stepped over:
/// calls run through it to the push after it.
pub fn site_in<'data, R: object::ReadRef<'data>>(data: R, symbol: &str) -> Option<Site> {
    use object::{Object, ObjectSection, ObjectSymbol};
    let file = object::File::parse(data).ok()?;
    let sym = file
        .dynamic_symbols()
        .chain(file.symbols())
        .find(|s| s.name() == Ok(symbol))?;
    let section = file.section_by_index(sym.section_index()?).ok()?;
    // Its first instruction: up to 8 bytes, fewer at the section's end (a
    // short function placed last).
    let left = (section.address() + section.size()).checked_sub(sym.address())?;
    let bytes = section.data_range(sym.address(), left.min(8)).ok()??;
    let skip = if bytes.starts_with(&[0xf3, 0x0f, 0x1e, 0xfa]) {
        4
    } else {
        0
    };
    let push = matches!(
        &bytes[skip as usize..],
        [0x50..=0x57, ..] | [0x41, 0x50..=0x57, ..]
    );
    // Executables and shared objects are probed by file offset: the
    // symbol's address within its section, from the section's place in
    // the file.
    let (section_offset, _) = section.file_range()?;
    let file_offset = sym
        .address()
        .checked_sub(section.address())?
        .checked_add(section_offset)?
        .checked_add(skip)?;
    Some(Site {
        file_offset,
        prologue: if push {
            Prologue::Push
        } else {
            Prologue::SingleStepped
        },
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Prologue {
    Push,
    SingleStepped,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_site_is_the_symbols_file_offset_and_the_exe_is_read_through_proc() {
        // A symbol of this test binary: the site read through this
        // process's /proc/PID/exe equals the one from the file.
        std::hint::black_box(iospan_uprobe_site_target as extern "C" fn() -> u64);
        let me = std::process::id();
        let data = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let sym = "iospan_uprobe_site_target";
        let from_file = site_in(data.as_slice(), sym);
        assert!(from_file.is_some(), "{sym} in this test binary");
        assert_eq!(uprobe_site(me, sym), from_file);
        // The offset lands on the symbol's bytes in the file.
        let s = from_file.unwrap();
        assert!((s.file_offset as usize) < data.len());
        assert_eq!(site_in(data.as_slice(), "no_such_symbol_anywhere"), None);
        assert_eq!(site_in(&b"not an ELF file"[..], sym), None);
    }

    #[no_mangle]
    #[inline(never)]
    extern "C" fn iospan_uprobe_site_target() -> u64 {
        std::hint::black_box(7)
    }
}
