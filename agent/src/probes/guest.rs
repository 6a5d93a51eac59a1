//! The guest-side programs (`bpf/guest.bpf.c`): the block layer's own
//! stamps plus the driver's kick and completion, per request, on the
//! guest's clock.

use aya::{
    maps::{PerCpuArray, RingBuf},
    programs::{BtfTracePoint, KProbe, RawTracePoint},
    Btf, Ebpf, EbpfLoader,
};

use super::error_chain;
use crate::abi::counter;

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/guest.bpf.o"));

#[derive(Debug, thiserror::Error)]
pub enum GuestProbeError {
    #[error("loading the guest probes: {0}")]
    Load(String),
    #[error("attaching {what}: {why}")]
    Attach { what: &'static str, why: String },
}

/// How a guest program attaches; each is named after what it attaches to.
#[derive(Clone, Copy)]
enum Kind {
    BtfTracePoint,
    KProbe,
    RawTracePoint,
}

fn attach(ebpf: &mut Ebpf, btf: &Btf, kind: Kind, name: &str) -> Result<(), String> {
    fn why(e: impl std::error::Error) -> String {
        error_chain(&e)
    }
    let prog = ebpf.program_mut(name).ok_or("missing program")?;
    match kind {
        Kind::BtfTracePoint => {
            let p: &mut BtfTracePoint = prog.try_into().map_err(why)?;
            p.load(name, btf).map_err(why)?;
            p.attach().map(drop).map_err(why)
        }
        Kind::KProbe => {
            let p: &mut KProbe = prog.try_into().map_err(why)?;
            p.load().map_err(why)?;
            p.attach(name, 0).map(drop).map_err(why)
        }
        Kind::RawTracePoint => {
            let p: &mut RawTracePoint = prog.try_into().map_err(why)?;
            p.load().map_err(why)?;
            p.attach(name).map(drop).map_err(why)
        }
    }
}

pub struct GuestProbes {
    ebpf: Ebpf,
    /// What the guest kernel lets us see beyond the block layer, in words.
    pub coverage: String,
}

impl GuestProbes {
    /// The block layer is required; the kick and completion probes are
    /// taken where the kernel has them, and `coverage` says which.
    pub fn load() -> Result<Self, GuestProbeError> {
        let btf = Btf::from_sys_fs()
            .map_err(|e| GuestProbeError::Load(format!("no kernel BTF: {}", error_chain(&e))))?;
        // The same floor as the host's: below it the task storage and
        // atomics the programs use are missing, and one line says so.
        crate::probes::features::check_atomics().map_err(GuestProbeError::Load)?;
        // io_syscalls is task storage, which the loader creates but has no
        // typed handle for (none is needed: only the programs use it).
        let mut ebpf = EbpfLoader::new()
            .btf(Some(&btf))
            .allow_unsupported_maps()
            .load(OBJECT)
            .map_err(|e| GuestProbeError::Load(error_chain(&e)))?;
        for tp in ["block_rq_issue", "block_rq_complete"] {
            attach(&mut ebpf, &btf, Kind::BtfTracePoint, tp).map_err(|why| {
                GuestProbeError::Attach {
                    what: "the block tracepoints",
                    why,
                }
            })?;
        }
        let mut seen: Vec<String> = Vec::new();
        let mut missing = Vec::new();
        // The application's ends (the system calls around each I/O, bios
        // through stacked devices), then the driver's kick and completion.
        for (kind, name, what) in [
            (Kind::BtfTracePoint, "sys_enter", "system calls"),
            (Kind::BtfTracePoint, "sys_exit", "system calls"),
            (Kind::BtfTracePoint, "block_bio_queue", "stacked devices"),
            (Kind::BtfTracePoint, "block_bio_remap", "stacked devices"),
            (Kind::KProbe, "virtqueue_notify", "kprobe virtqueue_notify"),
            (
                Kind::KProbe,
                "blk_mq_complete_request",
                "kprobe blk_mq_complete_request",
            ),
            (Kind::RawTracePoint, "nvme_setup_cmd", "nvme:nvme_setup_cmd"),
            (
                Kind::RawTracePoint,
                "nvme_complete_rq",
                "nvme:nvme_complete_rq",
            ),
        ] {
            match attach(&mut ebpf, &btf, kind, name) {
                Ok(()) if !seen.iter().any(|s| s == what) => seen.push(what.to_string()),
                Ok(()) => {}
                Err(e) => missing.push(format!("{what}: {name} ({e})")),
            }
        }
        let coverage = if missing.is_empty() {
            format!("block layer, {}", seen.join(", "))
        } else {
            format!(
                "block layer, {}; not available: {} (the guest segment then runs from and to the block \
                 layer's own stamps instead)",
                if seen.is_empty() { "nothing else".to_string() } else { seen.join(", ") },
                missing.join(", ")
            )
        };
        Ok(Self { ebpf, coverage })
    }

    pub fn take_events(&mut self) -> Result<super::ring::Ring, GuestProbeError> {
        let map = self
            .ebpf
            .take_map("guest_events")
            .ok_or_else(|| GuestProbeError::Load("no guest_events map".into()))?;
        RingBuf::try_from(map)
            .map(super::ring::Ring::new)
            .map_err(|e| GuestProbeError::Load(error_chain(&e)))
    }

    /// (records the ring had no room for, requests the in-flight table had
    /// no room for), cumulative.
    pub fn lost(&self) -> (u64, u64) {
        let Some(map) = self.ebpf.map("counters") else {
            return (0, 0);
        };
        let Ok(arr) = PerCpuArray::<_, u64>::try_from(map) else {
            return (0, 0);
        };
        let sum = |i: u32| arr.get(&i, 0).map(|v| v.iter().sum()).unwrap_or(0);
        (
            sum(counter::GUEST_RING_LOST),
            sum(counter::GUEST_INFLIGHT_FULL),
        )
    }
}
