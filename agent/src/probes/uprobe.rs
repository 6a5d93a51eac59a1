//! Where a uprobe goes in an executable: a symbol's file offset, and
//! whether its first instruction can run out of line (a single-stepped
//! probe costs ~30× more per hit).

use std::{fs, path::Path};

use serde::Serialize;

/// Where a uprobe on `symbol` in `exe` goes, and how the kernel will run
/// the probed instruction: emulated when it is a push (cheap), single-
/// stepped out of line otherwise (see `iospan doctor` for both costs here).
/// An endbr64 (CET builds) is stepped over: calls run through it to the
/// push after it. None when the symbol is not found.
pub fn uprobe_site(exe: &Path, symbol: &str) -> Option<(u64, Prologue)> {
    use object::{Object, ObjectSection, ObjectSymbol};
    let data = fs::read(exe).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let sym = file
        .dynamic_symbols()
        .chain(file.symbols())
        .find(|s| s.name() == Ok(symbol))?;
    let section = file.section_by_index(sym.section_index()?).ok()?;
    let bytes = section.data_range(sym.address(), 8).ok()??;
    let offset = if bytes.starts_with(&[0xf3, 0x0f, 0x1e, 0xfa]) {
        4
    } else {
        0
    };
    let push = matches!(
        &bytes[offset as usize..],
        [0x50..=0x57, ..] | [0x41, 0x50..=0x57, ..]
    );
    Some((
        offset,
        if push {
            Prologue::Push
        } else {
            Prologue::SingleStepped
        },
    ))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Prologue {
    Push,
    SingleStepped,
}
