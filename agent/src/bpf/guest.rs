//! The guest-side programs (`bpf/guest.bpf.c`): the block layer's own
//! stamps plus the driver's kick and completion, per request, on the
//! guest's clock.

use aya::{
    maps::{MapData, PerCpuArray, RingBuf},
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
        // io_syscalls is task storage, which the loader creates but has no
        // typed handle for (none is needed: only the programs use it).
        let mut ebpf = EbpfLoader::new()
            .btf(Some(&btf))
            .allow_unsupported_maps()
            .load(OBJECT)
            .map_err(|e| GuestProbeError::Load(error_chain(&e)))?;
        for tp in ["block_rq_issue", "block_rq_complete"] {
            let mut attach = || -> Result<(), String> {
                let p: &mut BtfTracePoint = ebpf
                    .program_mut(tp)
                    .ok_or("missing program")?
                    .try_into()
                    .map_err(|e| error_chain(&e))?;
                p.load(tp, &btf).map_err(|e| error_chain(&e))?;
                p.attach().map_err(|e| error_chain(&e))?;
                Ok(())
            };
            attach().map_err(|why| GuestProbeError::Attach {
                what: "the block tracepoints",
                why,
            })?;
        }
        let mut seen = Vec::new();
        let mut missing = Vec::new();
        // The application's ends: the system calls around each I/O, and
        // bios through stacked devices.
        for (tp, what) in [
            ("sys_enter", "system calls"),
            ("sys_exit", "system calls"),
            ("block_bio_queue", "stacked devices"),
            ("block_bio_remap", "stacked devices"),
        ] {
            let r = (|| -> Result<(), String> {
                let p: &mut BtfTracePoint = ebpf
                    .program_mut(tp)
                    .ok_or("missing program")?
                    .try_into()
                    .map_err(|e| error_chain(&e))?;
                p.load(tp, &btf).map_err(|e| error_chain(&e))?;
                p.attach().map_err(|e| error_chain(&e))?;
                Ok(())
            })();
            match r {
                Ok(()) if !seen.iter().any(|s: &String| s == what) => seen.push(what.to_string()),
                Ok(()) => {}
                Err(e) => missing.push(format!("{what}: {tp} ({e})")),
            }
        }
        for (prog, symbol) in [
            ("virtqueue_notify", "virtqueue_notify"),
            ("blk_mq_complete_request", "blk_mq_complete_request"),
        ] {
            let r = (|| -> Result<(), String> {
                let p: &mut KProbe = ebpf
                    .program_mut(prog)
                    .ok_or("missing program")?
                    .try_into()
                    .map_err(|e| error_chain(&e))?;
                p.load().map_err(|e| error_chain(&e))?;
                p.attach(symbol, 0).map_err(|e| error_chain(&e))?;
                Ok(())
            })();
            match r {
                Ok(()) => seen.push(format!("kprobe {symbol}")),
                Err(e) => missing.push(format!("kprobe {symbol} ({e})")),
            }
        }
        for tp in ["nvme_setup_cmd", "nvme_complete_rq"] {
            let r = (|| -> Result<(), String> {
                let p: &mut RawTracePoint = ebpf
                    .program_mut(tp)
                    .ok_or("missing program")?
                    .try_into()
                    .map_err(|e| error_chain(&e))?;
                p.load().map_err(|e| error_chain(&e))?;
                p.attach(tp).map_err(|e| error_chain(&e))?;
                Ok(())
            })();
            match r {
                Ok(()) => seen.push(format!("nvme:{tp}")),
                Err(e) => missing.push(format!("nvme:{tp} ({e})")),
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

    pub fn take_events(&mut self) -> Result<RingBuf<MapData>, GuestProbeError> {
        let map = self
            .ebpf
            .take_map("guest_events")
            .ok_or_else(|| GuestProbeError::Load("no guest_events map".into()))?;
        RingBuf::try_from(map).map_err(|e| GuestProbeError::Load(error_chain(&e)))
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
