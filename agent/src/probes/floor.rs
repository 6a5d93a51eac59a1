//! The floor (bpf/floor.bpf.c): the hooks a run of the always-on tier
//! attached, in the same flavours, with programs that do only what cannot
//! be avoided there. What each hook costs before any work of the tier's.

use aya::{programs::TracePoint, Btf, Ebpf};

use super::{attach_program_linked, error_chain, Attachment, Flavour, LoadError, RawLink};

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/floor.bpf.o"));

/// The floor programs, attached for as long as this lives.
pub struct FloorProbes {
    ebpf: Ebpf,
    _links: Vec<RawLink>,
    /// What was attached, and what could not be mirrored (a flavour the
    /// floor has no program for: uprobes, fentry, kprobes), with why.
    pub attached: Vec<Attachment>,
    pub skipped: Vec<(Attachment, String)>,
}

impl FloorProbes {
    /// Attaches the floor's program of the same name to each hook of `like`.
    pub fn attach_like(like: &[Attachment]) -> Result<Self, LoadError> {
        let mut ebpf = Ebpf::load(OBJECT).map_err(|source| LoadError::Object {
            object: "floor",
            source,
        })?;
        let btf = Btf::from_sys_fs().ok();
        let (mut links, mut attached, mut skipped) = (Vec::new(), Vec::new(), Vec::new());
        for a in like {
            match a.flavour {
                Flavour::TpBtf | Flavour::RawTp => {
                    let base = a.program.strip_suffix("_btf").unwrap_or(&a.program);
                    let (done, link) = attach_program_linked(
                        &mut ebpf,
                        btf.as_ref(),
                        base,
                        &a.tracepoint,
                        a.flavour,
                    )?;
                    links.push(link);
                    attached.push(done);
                }
                Flavour::Tracepoint => {
                    attach_classic(&mut ebpf, a)?;
                    attached.push(a.clone());
                }
                other => skipped.push((
                    a.clone(),
                    format!("no floor program for {}", other.as_str()),
                )),
            }
        }
        Ok(Self {
            ebpf,
            _links: links,
            attached,
            skipped,
        })
    }

    pub fn program_stats(&self) -> Vec<super::progstats::ProgStats> {
        super::program_stats(&self.ebpf)
    }
}

/// A classic tracepoint `category:name` (the program owns its link).
fn attach_classic(ebpf: &mut Ebpf, a: &Attachment) -> Result<(), LoadError> {
    let fail = |reason: String| LoadError::Attach {
        tracepoint: a.tracepoint.clone(),
        flavour: a.flavour.as_str(),
        reason,
    };
    let (category, name) = a
        .tracepoint
        .split_once(':')
        .ok_or_else(|| fail("not category:name".into()))?;
    let p: &mut TracePoint = ebpf
        .program_mut(&a.program)
        .ok_or_else(|| fail(format!("program `{}` not in the floor", a.program)))?
        .try_into()
        .map_err(|e| fail(format!("{e:#}")))?;
    p.load().map_err(|e| fail(error_chain(&e)))?;
    p.attach(category, name)
        .map_err(|e| fail(error_chain(&e)))?;
    Ok(())
}
