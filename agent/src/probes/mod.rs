//! The only module that talks to aya: loading, attaching, reading maps.
//! Everything above it sees `model` types.

pub mod features;
pub mod floor;
pub mod guest;
pub mod host;
pub mod preflight;
pub mod progstats;
pub mod ring;
pub mod uprobe;

use std::os::fd::AsFd;

use aya::{
    programs::{BtfTracePoint, Program, RawTracePoint},
    Btf, Ebpf,
};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("failed to load the eBPF object `{object}`")]
    Object {
        object: &'static str,
        #[source]
        source: aya::EbpfError,
    },
    #[error("program `{program}` is missing from the eBPF object")]
    MissingProgram { program: String },
    #[error("map `{map}` is missing from the eBPF object or has the wrong type")]
    Map {
        map: &'static str,
        #[source]
        source: Option<aya::maps::MapError>,
    },
    /// A kernel iospan cannot run on, in one line.
    #[error("{0}")]
    UnsupportedKernel(String),
    #[error("{given} disks to stream; at most {max} can be named")]
    TooManyStreamDisks { given: usize, max: usize },
    #[error("failed to attach {flavour} program to tracepoint `{tracepoint}`: {reason}")]
    Attach {
        tracepoint: String,
        flavour: &'static str,
        reason: String,
    },
}

impl LoadError {
    /// For `map_err` on an operation of map `map`.
    pub fn map_op(map: &'static str) -> impl Fn(aya::maps::MapError) -> Self {
        move |e| LoadError::Map {
            map,
            source: Some(e),
        }
    }
}

/// Map `name` of `ebpf`, as a `T`.
pub fn map_of<'a, T>(ebpf: &'a Ebpf, name: &'static str) -> Result<T, LoadError>
where
    T: TryFrom<&'a aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.map(name).ok_or(LoadError::Map {
        map: name,
        source: None,
    })?;
    T::try_from(map).map_err(LoadError::map_op(name))
}

/// Map `name` of `ebpf`, as a `T` it can update.
pub fn map_mut_of<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<T, LoadError>
where
    T: TryFrom<&'a mut aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.map_mut(name).ok_or(LoadError::Map {
        map: name,
        source: None,
    })?;
    T::try_from(map).map_err(LoadError::map_op(name))
}

/// How a tracepoint was attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Flavour {
    TpBtf,
    RawTp,
    /// A classic (tracefs) tracepoint, for syscall events.
    Tracepoint,
    /// A uprobe on a function of a VM's QEMU binary.
    Uprobe,
    /// fentry on a kernel function (BPF trampoline), where the kernel allows.
    Fentry,
    /// A kprobe on a kernel function, where fentry is refused.
    Kprobe,
}

impl Flavour {
    pub fn as_str(self) -> &'static str {
        match self {
            Flavour::TpBtf => "tp_btf",
            Flavour::RawTp => "raw_tp",
            Flavour::Tracepoint => "tracepoint",
            Flavour::Uprobe => "uprobe",
            Flavour::Fentry => "fentry",
            Flavour::Kprobe => "kprobe",
        }
    }
}

/// A raw tracepoint program's link, in its flavour: what detaches it.
pub(crate) enum RawLink {
    Btf(aya::programs::tp_btf::BtfTracePointLinkId),
    Raw(aya::programs::raw_trace_point::RawTracePointLinkId),
}

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Attachment {
    pub tracepoint: String,
    pub flavour: Flavour,
    pub program: String,
}

/// Loads and attaches the program for `tracepoint` in the given flavour:
/// `{tracepoint}_btf` on tp_btf, `{tracepoint}` on raw_tp.
pub(crate) fn attach(
    ebpf: &mut Ebpf,
    btf: Option<&Btf>,
    tracepoint: &str,
    flavour: Flavour,
) -> Result<Attachment, LoadError> {
    attach_linked(ebpf, btf, tracepoint, flavour).map(|(a, _)| a)
}

/// `attach`, with the link that detaches it again.
pub(crate) fn attach_linked(
    ebpf: &mut Ebpf,
    btf: Option<&Btf>,
    tracepoint: &str,
    flavour: Flavour,
) -> Result<(Attachment, RawLink), LoadError> {
    attach_program_linked(ebpf, btf, tracepoint, tracepoint, flavour)
}

/// Program `base` (`base_btf` for tp_btf) on `tracepoint`: a tracepoint
/// may carry a second program (`bpf/include/nesting.bpf.h`).
pub(crate) fn attach_program_linked(
    ebpf: &mut Ebpf,
    btf: Option<&Btf>,
    base: &str,
    tracepoint: &str,
    flavour: Flavour,
) -> Result<(Attachment, RawLink), LoadError> {
    let name = match flavour {
        Flavour::TpBtf => format!("{base}_btf"),
        _ => base.to_string(),
    };
    let result = program(ebpf, &name).and_then(|p| match flavour {
        Flavour::TpBtf => {
            let btf = btf.ok_or("no kernel BTF (/sys/kernel/btf/vmlinux)")?;
            let p: &mut BtfTracePoint = p.try_into().map_err(|e| format!("{e:#}"))?;
            if p.fd().is_err() {
                p.load(tracepoint, btf).map_err(|e| error_chain(&e))?;
            }
            p.attach().map(RawLink::Btf).map_err(|e| error_chain(&e))
        }
        Flavour::RawTp => {
            let p: &mut RawTracePoint = p.try_into().map_err(|e| format!("{e:#}"))?;
            if p.fd().is_err() {
                p.load().map_err(|e| error_chain(&e))?;
            }
            p.attach(tracepoint)
                .map(RawLink::Raw)
                .map_err(|e| error_chain(&e))
        }
        _ => Err("not a raw tracepoint".to_string()),
    });
    match result {
        Ok(link) => Ok((
            Attachment {
                tracepoint: tracepoint.into(),
                flavour,
                program: name,
            },
            link,
        )),
        Err(reason) => Err(LoadError::Attach {
            tracepoint: tracepoint.into(),
            flavour: flavour.as_str(),
            reason,
        }),
    }
}

fn program<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut Program, String> {
    ebpf.program_mut(name)
        .ok_or_else(|| format!("program `{name}` not in object"))
}

/// `e: source: source…` on one line, for errors kept as strings.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Run-time statistics of every loaded program of an object.
pub(crate) fn program_stats(ebpf: &Ebpf) -> Vec<progstats::ProgStats> {
    ebpf.programs()
        .filter_map(|(name, p)| {
            let fd = p.fd().ok()?;
            progstats::read(fd.as_fd())
                .ok()
                .map(|s| progstats::ProgStats {
                    name: name.to_string(),
                    ..s
                })
        })
        .collect()
}

/// Entries of a hash map, walked with BPF_MAP_GET_NEXT_KEY (aya offers key
/// iteration only with the key's type; this needs none). Stops at the
/// first error: a map changing under the walk may be counted short.
pub fn count_keys(fd: std::os::fd::BorrowedFd<'_>, key_size: u32) -> u32 {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct NextKey {
        map_fd: u32,
        _pad: u32,
        key: u64,
        next_key: u64,
    }
    const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
    let size = key_size as usize;
    let (mut key, mut next) = (vec![0u8; size], vec![0u8; size]);
    let mut n = 0u32;
    let mut first = true;
    loop {
        let attr = NextKey {
            map_fd: fd.as_raw_fd() as u32,
            _pad: 0,
            key: if first { 0 } else { key.as_ptr() as u64 },
            next_key: next.as_mut_ptr() as u64,
        };
        // SAFETY: bpf(2) with an attribute the size of the command's
        // fields; the kernel writes key_size bytes to next_key.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_GET_NEXT_KEY,
                &attr as *const NextKey,
                std::mem::size_of::<NextKey>(),
            )
        };
        if r != 0 {
            return n;
        }
        n += 1;
        first = false;
        std::mem::swap(&mut key, &mut next);
    }
}
