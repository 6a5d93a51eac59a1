//! What QEMU itself counts per virtual disk — operations, bytes and total
//! time per op (its block accounting, `query-blockstats`) — read over the
//! VM's own QMP monitor, or through libvirt for the domains libvirt runs
//! (`virsh domstats --block`: libvirt owns those monitors).
//!
//! QEMU's time for a request runs from its device model taking the request
//! to its completion callback: the engine and device segments together.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    time::Duration,
};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::discover::{
    qmp::{Capped, Session},
    vms::{channel_socket, Vm},
};

/// One virtual disk's counters, as QEMU keeps them (since it started).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskCounts {
    pub rd_ops: u64,
    pub rd_bytes: u64,
    pub rd_ns: u64,
    pub wr_ops: u64,
    pub wr_bytes: u64,
    pub wr_ns: u64,
    pub fl_ops: u64,
    pub fl_ns: u64,
}

impl DiskCounts {
    /// These less `earlier` (a counter that went back — a device
    /// re-plugged — counts from zero).
    pub fn since(&self, earlier: &DiskCounts) -> DiskCounts {
        let d = |a: u64, b: u64| if a >= b { a - b } else { a };
        DiskCounts {
            rd_ops: d(self.rd_ops, earlier.rd_ops),
            rd_bytes: d(self.rd_bytes, earlier.rd_bytes),
            rd_ns: d(self.rd_ns, earlier.rd_ns),
            wr_ops: d(self.wr_ops, earlier.wr_ops),
            wr_bytes: d(self.wr_bytes, earlier.wr_bytes),
            wr_ns: d(self.wr_ns, earlier.wr_ns),
            fl_ops: d(self.fl_ops, earlier.fl_ops),
            fl_ns: d(self.fl_ns, earlier.fl_ns),
        }
    }
}

/// Counters by virtual disk id (the device's `id=`, else its drive's).
pub type Counts = BTreeMap<String, DiskCounts>;

/// Where a VM's own counts can be read, or why they cannot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "via", rename_all = "snake_case")]
pub enum Source {
    /// A QMP monitor of the VM's command line, a socket the VM's process
    /// holds listening.
    Qmp { socket: PathBuf, pid: u32 },
    /// libvirt runs the domain: its counters through libvirt.
    Libvirt { domain: String },
    /// The engine serving some of its disks from outside QEMU
    /// (qemu-storage-daemon), over the engine's own QMP monitor: its
    /// exports' nodes, each the virtual disk it serves.
    Engine {
        program: String,
        pid: u32,
        socket: PathBuf,
        nodes: BTreeMap<String, String>,
    },
    /// Not readable: why.
    None { why: String },
}

impl Source {
    pub fn describe(&self) -> String {
        match self {
            Source::Qmp { socket, .. } => format!("QMP at {}", socket.display()),
            Source::Libvirt { domain } => format!("libvirt (virsh domstats --block {domain})"),
            Source::Engine {
                program,
                pid,
                socket,
                ..
            } => format!("{program} pid {pid}, QMP at {}", socket.display()),
            Source::None { why } => format!("none: {why}"),
        }
    }

    /// Counts from the engine outside QEMU, not from QEMU's device models.
    pub fn is_engine(&self) -> bool {
        matches!(self, Source::Engine { .. })
    }
}

/// Where `vm`'s counts are read: QEMU's own (for the disks its device
/// models serve), and each engine outside QEMU that serves some of its
/// disks (vhost-user). libvirt's domains through libvirt, never its own
/// monitor; others through a QMP monitor their process holds listening (a
/// path on the command line alone is not trusted: whoever wrote the
/// command line may not own it).
pub fn sources_of(vm: &Vm) -> Vec<Source> {
    let mut out = Vec::new();
    let served_by_qemu = vm.disks.iter().any(|d| d.engine.is_none());
    if served_by_qemu || vm.disks.is_empty() {
        out.push(qemu_source(vm));
    }
    let mut engines: BTreeMap<u32, (&crate::discover::vms::EngineRef, BTreeMap<String, String>)> =
        BTreeMap::new();
    for d in &vm.disks {
        if let Some(e) = &d.engine {
            let entry = engines.entry(e.pid).or_insert_with(|| (e, BTreeMap::new()));
            if !e.node.is_empty() {
                entry.1.insert(e.node.clone(), d.id.clone());
            }
        }
    }
    for (pid, (e, nodes)) in engines {
        let socket = e.monitor.as_ref().and_then(|m| channel_socket(pid, m));
        out.push(match (socket, &e.monitor) {
            (Some(socket), _) if !nodes.is_empty() => Source::Engine {
                program: e.program.clone(),
                pid,
                socket,
                nodes,
            },
            (Some(_), _) => Source::None {
                why: format!("{} pid {pid} serves its disks through no export iospan can name", e.program),
            },
            (None, Some(_)) => Source::None {
                why: format!(
                    "the QMP monitor of {} pid {pid} is not a unix socket it listens on",
                    e.program
                ),
            },
            (None, None) => Source::None {
                why: format!(
                    "{} pid {pid} serves its disks and has no QMP monitor (add --chardev socket,id=m,path=PATH,server=on,wait=off --monitor chardev=m)",
                    e.program
                ),
            },
        });
    }
    out
}

/// QEMU's own monitor of `vm`, or why there is none to use.
fn qemu_source(vm: &Vm) -> Source {
    if let Some(d) = &vm.libvirt {
        return Source::Libvirt {
            domain: d.name.clone(),
        };
    }
    let Some(mon) = &vm.monitor else {
        return Source::None {
            why: "no QMP monitor on its command line (add -qmp unix:PATH,server=on,wait=off)"
                .into(),
        };
    };
    match channel_socket(vm.pid, mon) {
        Some(socket) => Source::Qmp {
            socket,
            pid: vm.pid,
        },
        None => Source::None {
            why: "its QMP monitor is not a unix socket the VM's process listens on".into(),
        },
    }
}

/// What `sources_of` says, in one line.
pub fn describe_all(sources: &[Source]) -> String {
    sources
        .iter()
        .map(Source::describe)
        .collect::<Vec<_>>()
        .join("; ")
}

/// libvirt's client, for a domain's counters: at most this long, this
/// much output (a domain of hundreds of disks prints a few hundred KiB).
const VIRSH_WITHIN: Duration = Duration::from_secs(2);
const VIRSH_OUTPUT: usize = 4 << 20;

/// The counters of `vm`'s virtual disks that `source` serves, now, read
/// `within` this long. Each QMP read is a session of its own, closed at
/// once: a QMP monitor serves one client at a time, and the VM's manager
/// (Proxmox's `qm`, a script, an operator) must find it free; a session
/// costs QEMU about a millisecond.
pub fn read(source: &Source, vm: &Vm, within: Duration) -> Result<Counts> {
    match source {
        Source::Qmp { socket, pid } => {
            let stats: Capped<qmp_answers::BlockStats> = Session::open(socket, *pid, within)?
                .execute("{\"execute\":\"query-blockstats\"}")?;
            Ok(parse_blockstats(&stats.0, vm))
        }
        Source::Engine {
            socket, pid, nodes, ..
        } => {
            // An export's block backend has no name: its node is found
            // only among the nodes.
            let stats: Capped<qmp_answers::BlockStats> = Session::open(socket, *pid, within)?
                .execute(
                    "{\"execute\":\"query-blockstats\",\"arguments\":{\"query-nodes\":true}}",
                )?;
            Ok(parse_node_blockstats(&stats.0, nodes))
        }
        Source::Libvirt { domain } => {
            let mut cmd = std::process::Command::new("virsh");
            cmd.args(["-q", "domstats", "--block", "--", domain]);
            let out = crate::discover::child::output_within(
                &mut cmd,
                within.min(VIRSH_WITHIN),
                VIRSH_OUTPUT,
            )
            .context("virsh domstats (libvirt's client)")?;
            if !out.status.success() {
                bail!(
                    "virsh domstats --block {}: {}",
                    crate::model::text::printable(domain),
                    crate::model::text::printable(String::from_utf8_lossy(&out.stderr).trim())
                );
            }
            Ok(parse_domstats(&String::from_utf8_lossy(&out.stdout), vm))
        }
        Source::None { why } => bail!("{why}"),
    }
}

/// QMP's answers, as much of each as is read here (QEMU's QAPI schema
/// names them).
mod qmp_answers {
    use serde::Deserialize;

    /// One entry of `query-blockstats` (`BlockStats`): a block backend by
    /// its drive and device, or with `query-nodes` a node by its name.
    #[derive(Debug, Default, Deserialize)]
    #[serde(default)]
    pub struct BlockStats {
        pub device: String,
        pub qdev: String,
        #[serde(rename = "node-name")]
        pub node_name: String,
        pub stats: BlockDeviceStats,
    }

    /// One entry of `query-block` (`BlockInfo`): a block backend and, with
    /// a medium, its settings.
    #[derive(Debug, Default, Deserialize)]
    #[serde(default)]
    pub struct BlockInfo {
        pub device: String,
        pub qdev: String,
        pub inserted: Option<BlockDeviceInfo>,
    }

    /// Its throttle limits (`BlockDeviceInfo`): 0 is none.
    #[derive(Debug, Default, Deserialize)]
    #[serde(default)]
    pub struct BlockDeviceInfo {
        pub iops: u64,
        pub iops_rd: u64,
        pub iops_wr: u64,
        pub bps: u64,
        pub bps_rd: u64,
        pub bps_wr: u64,
        pub group: Option<String>,
    }

    /// Its counters (`BlockDeviceStats`), since QEMU started.
    #[derive(Debug, Default, Deserialize)]
    #[serde(default)]
    pub struct BlockDeviceStats {
        pub rd_operations: u64,
        pub rd_bytes: u64,
        pub rd_total_time_ns: u64,
        pub wr_operations: u64,
        pub wr_bytes: u64,
        pub wr_total_time_ns: u64,
        pub flush_operations: u64,
        pub flush_total_time_ns: u64,
    }
}

/// A virtual disk's throttle as QEMU holds it now: limits by QMP's names
/// (none set: empty) and its group.
pub type Throttle = (Vec<(String, u64)>, Option<String>);

/// Each virtual disk's throttle as QEMU holds it now (QMP `query-block`),
/// through its own monitor; None for a source that is not one (libvirt's
/// domains carry theirs in their XML, `<iotune>`).
pub fn throttles(
    source: &Source,
    vm: &Vm,
    within: Duration,
) -> Option<Result<BTreeMap<String, Throttle>>> {
    let Source::Qmp { socket, pid } = source else {
        return None;
    };
    let read = || -> Result<BTreeMap<String, Throttle>> {
        let info: Capped<qmp_answers::BlockInfo> =
            Session::open(socket, *pid, within)?.execute("{\"execute\":\"query-block\"}")?;
        Ok(info
            .0
            .iter()
            .filter_map(|b| {
                let id = vdisk_of(vm, &b.device, &b.qdev)?;
                let i = b.inserted.as_ref()?;
                let limits = [
                    ("iops", i.iops),
                    ("iops_rd", i.iops_rd),
                    ("iops_wr", i.iops_wr),
                    ("bps", i.bps),
                    ("bps_rd", i.bps_rd),
                    ("bps_wr", i.bps_wr),
                ]
                .into_iter()
                .filter(|(_, v)| *v > 0)
                .map(|(k, v)| (k.to_string(), v))
                .collect();
                let group = i
                    .group
                    .as_deref()
                    .map(|g| crate::model::text::printable(g).into_owned());
                Some((id.to_string(), (limits, group)))
            })
            .collect())
    };
    Some(read())
}

/// The virtual disk a blockstats entry belongs to: by the device's QOM
/// path (`/machine/peripheral/ID/…`, or the id itself), else by its drive
/// (`device`: a `-drive` id, which is the disk's id when its device has
/// none).
fn vdisk_of<'a>(vm: &'a Vm, device: &str, qdev: &str) -> Option<&'a str> {
    let by_id = |id: &str| vm.disks.iter().find(|d| d.id == id).map(|d| d.id.as_str());
    let peripheral = qdev
        .split_once("/peripheral/")
        .map(|(_, rest)| rest.split('/').next().unwrap_or(rest))
        .or((!qdev.is_empty() && !qdev.contains('/')).then_some(qdev));
    peripheral
        .and_then(by_id)
        .or_else(|| (!device.is_empty()).then(|| by_id(device)).flatten())
}

/// `query-blockstats`'s answer as counters per virtual disk of `vm`
/// (entries that are no disk of its command line are left out).
fn parse_blockstats(ret: &[qmp_answers::BlockStats], vm: &Vm) -> Counts {
    let mut out = Counts::new();
    for e in ret {
        let Some(id) = vdisk_of(vm, &e.device, &e.qdev) else {
            continue;
        };
        out.insert(id.to_string(), counts_of(&e.stats));
    }
    out
}

/// `query-blockstats` with `query-nodes` as counters per virtual disk:
/// each entry whose node is one of `nodes` (node name → virtual disk).
fn parse_node_blockstats(
    ret: &[qmp_answers::BlockStats],
    nodes: &BTreeMap<String, String>,
) -> Counts {
    let mut out = Counts::new();
    for e in ret {
        let Some(vdisk) = nodes.get(&e.node_name) else {
            continue;
        };
        out.insert(vdisk.clone(), counts_of(&e.stats));
    }
    out
}

/// One entry's `stats` as counters. Each guest request is counted in
/// `*_operations`, one merged into another (virtio-blk merges adjacent
/// ones it takes from the ring together) as well: `*_merged` counts the
/// merges, not more requests.
fn counts_of(s: &qmp_answers::BlockDeviceStats) -> DiskCounts {
    DiskCounts {
        rd_ops: s.rd_operations,
        rd_bytes: s.rd_bytes,
        rd_ns: s.rd_total_time_ns,
        wr_ops: s.wr_operations,
        wr_bytes: s.wr_bytes,
        wr_ns: s.wr_total_time_ns,
        fl_ops: s.flush_operations,
        fl_ns: s.flush_total_time_ns,
    }
}

/// `virsh domstats --block` output (`block.N.name=vda`, `block.N.rd.reqs=…`)
/// as counters per virtual disk: libvirt names a disk by its target dev,
/// which the domain's status gives the device alias (the disk's id) of.
/// A disk listed without its counters (libvirt answers so while QEMU
/// cannot give them: a domain stopping) is no reading, not a reading of 0.
pub fn parse_domstats(text: &str, vm: &Vm) -> Counts {
    let mut by_index: BTreeMap<u32, (String, DiskCounts)> = BTreeMap::new();
    let mut counted: BTreeSet<u32> = BTreeSet::new();
    for line in text.lines() {
        let Some((key, value)) = line.trim().split_once('=') else {
            continue;
        };
        let Some(rest) = key.strip_prefix("block.") else {
            continue;
        };
        let Some((n, field)) = rest.split_once('.') else {
            continue;
        };
        let Ok(n) = n.parse::<u32>() else {
            continue;
        };
        let e = by_index.entry(n).or_default();
        let v = value.parse::<u64>().unwrap_or(0);
        if field == "rd.reqs" || field == "wr.reqs" {
            counted.insert(n);
        }
        match field {
            "name" => e.0 = value.to_string(),
            "rd.reqs" => e.1.rd_ops = v,
            "rd.bytes" => e.1.rd_bytes = v,
            "rd.times" => e.1.rd_ns = v,
            "wr.reqs" => e.1.wr_ops = v,
            "wr.bytes" => e.1.wr_bytes = v,
            "wr.times" => e.1.wr_ns = v,
            "fl.reqs" => e.1.fl_ops = v,
            "fl.times" => e.1.fl_ns = v,
            _ => {}
        }
    }
    let mut out = Counts::new();
    for (n, (target, c)) in by_index {
        if !counted.contains(&n) {
            continue;
        }
        if let Some(d) = vm
            .disks
            .iter()
            .find(|d| d.target_dev.as_deref() == Some(target.as_str()))
        {
            out.insert(d.id.clone(), c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::{
        io::{BufRead, BufReader, Write},
        os::unix::net::UnixStream,
        path::Path,
    };

    use super::*;
    use crate::discover::vms::from_args;

    fn vm(args: &str) -> Vm {
        let a: Vec<String> = args.split(' ').map(str::to_string).collect();
        from_args(1, &a)
    }

    #[test]
    fn blockstats_map_to_the_disks_of_the_command_line() {
        let v = vm(
            "qemu-system-x86_64 -drive file=/a.img,if=none,id=d0,format=raw \
             -device virtio-blk-pci,drive=d0,id=vd0 \
             -blockdev driver=file,filename=/b.img,node-name=f1 \
             -blockdev driver=raw,file=f1,node-name=n1 -device nvme,drive=n1,serial=x,id=nv0 \
             -drive file=/c.img,if=virtio,id=bare",
        );
        let ret = serde_json::json!([
            {"device": "d0", "qdev": "/machine/peripheral/vd0/virtio-backend",
             "stats": {"rd_operations": 2000, "rd_bytes": 8192000, "rd_total_time_ns": 1600000000,
                       "wr_operations": 3, "flush_operations": 1}},
            {"device": "", "qdev": "/machine/peripheral/nv0", "node-name": "n1",
             "stats": {"rd_operations": 5}},
            {"device": "bare", "qdev": "/machine/peripheral-anon/device[0]/virtio-backend",
             "stats": {"wr_operations": 7}},
            {"device": "", "qdev": "/machine/peripheral/other", "stats": {"rd_operations": 9}}
        ]);
        let c = parse_blockstats(&serde_json::from_value::<Vec<_>>(ret).unwrap(), &v);
        assert_eq!(c.len(), 3, "{c:?}");
        assert_eq!(c["vd0"].rd_ops, 2000);
        assert_eq!(c["vd0"].rd_ns, 1_600_000_000);
        assert_eq!(c["vd0"].fl_ops, 1);
        assert_eq!(c["nv0"].rd_ops, 5);
        assert_eq!(c["bare"].wr_ops, 7);
    }

    #[test]
    fn domstats_name_disks_by_their_target() {
        let mut v = vm(
            "qemu-system-x86_64 -blockdev driver=file,filename=/a.img,node-name=f0 \
             -device virtio-blk-pci,drive=f0,id=virtio-disk0",
        );
        v.disks[0].target_dev = Some("vda".into());
        let text = "Domain: 'db01'\n  block.count=2\n  block.0.name=vda\n  block.0.rd.reqs=1504\n  \
                    block.0.rd.bytes=6160384\n  block.0.rd.times=1203000000\n  block.0.fl.reqs=2\n  \
                    block.1.name=sdz\n  block.1.rd.reqs=1\n";
        let c = parse_domstats(text, &v);
        assert_eq!(c.len(), 1);
        assert_eq!(c["virtio-disk0"].rd_ops, 1504);
        assert_eq!(c["virtio-disk0"].rd_ns, 1_203_000_000);
        assert_eq!(c["virtio-disk0"].fl_ops, 2);
        // A stopping domain's disk, listed without counters: no reading.
        let stopping = "Domain: 'db01'\n  block.count=1\n  block.0.name=vda\n  \
                        block.0.path=/var/lib/libvirt/images/db01.img\n  block.0.capacity=1073741824\n";
        assert!(parse_domstats(stopping, &v).is_empty());
    }

    #[test]
    fn counters_that_went_back_count_from_zero() {
        let a = DiskCounts {
            rd_ops: 10,
            ..Default::default()
        };
        let b = DiskCounts {
            rd_ops: 4,
            ..Default::default()
        };
        assert_eq!(a.since(&b).rd_ops, 6);
        assert_eq!(b.since(&a).rd_ops, 4);
    }

    #[test]
    fn a_monitor_is_read_from_the_command_line() {
        assert!(matches!(
            vm("qemu-system-x86_64 -qmp unix:/run/q.sock,server=on,wait=off").monitor,
            Some(crate::discover::vms::SocketSource::Path(ref p)) if p == Path::new("/run/q.sock")
        ));
        assert!(matches!(
            vm("qemu-system-x86_64 -chardev socket,id=m,path=/run/m.sock,server=on,wait=off \
                -mon chardev=m,mode=control")
            .monitor,
            Some(crate::discover::vms::SocketSource::Path(ref p)) if p == Path::new("/run/m.sock")
        ));
        // A human monitor, a client socket, TCP: none is QMP we may use.
        assert!(vm(
            "qemu-system-x86_64 -chardev socket,id=h,path=/run/h.sock,server=on \
                -mon chardev=h"
        )
        .monitor
        .is_none());
        assert!(vm("qemu-system-x86_64 -qmp tcp:127.0.0.1:4444,server=on")
            .monitor
            .is_none());
        assert!(vm("qemu-system-x86_64 -qmp unix:/run/c.sock")
            .monitor
            .is_none());
    }

    #[test]
    fn an_engines_nodes_are_its_exports_disks() {
        let nodes = BTreeMap::from([("disk0".to_string(), "vd0".to_string())]);
        let ret = serde_json::json!([
            {"node-name": "file0", "stats": {"rd_operations": 1}},
            {"node-name": "disk0", "stats": {"rd_operations": 0, "rd_merged": 0}},
        ]);
        let c = parse_node_blockstats(&serde_json::from_value::<Vec<_>>(ret).unwrap(), &nodes);
        assert_eq!(c.len(), 1);
        assert_eq!(c["vd0"], DiskCounts::default());
    }

    /// A monitor of our own, one client at a time as QEMU's: greets, sends
    /// an event before each answer, answers; counts the sessions.
    fn fake_monitor(path: &Path) -> std::thread::JoinHandle<usize> {
        let l = std::os::unix::net::UnixListener::bind(path).unwrap();
        std::thread::spawn(move || {
            let mut sessions = 0;
            let mut answered = 0;
            for c in l.incoming() {
                let Ok(c) = c else { break };
                sessions += 1;
                let mut w = c.try_clone().unwrap();
                let mut r = BufReader::new(c);
                // A client that hung up at once (the refused one) is gone.
                if writeln!(w, "{{\"QMP\": {{\"version\": {{}}}}}}").is_err() {
                    continue;
                }
                let mut line = String::new();
                while r.read_line(&mut line).unwrap_or(0) > 0 {
                    if line.contains("quit") {
                        return sessions;
                    }
                    answered += 1;
                    let _ = writeln!(w, "{{\"event\": \"RESUME\"}}");
                    let _ = if line.contains("blockstats") {
                        writeln!(w, "{{\"return\": [{{\"device\": \"d0\", \"qdev\": \"/machine/peripheral/vd0/virtio-backend\", \"stats\": {{\"rd_operations\": {answered}}}}}]}}")
                    } else {
                        writeln!(w, "{{\"return\": {{}}}}")
                    };
                    line.clear();
                }
            }
            sessions
        })
    }

    #[test]
    fn each_read_is_a_session_that_leaves_the_monitor_free() {
        let dir_held = tempfile::Builder::new()
            .prefix("iospan-qmp-")
            .tempdir()
            .unwrap();
        let dir = dir_held.path().to_path_buf();
        let path = dir.join("m.sock");
        let server = fake_monitor(&path);
        let v = vm("qemu-system-x86_64 -drive file=/a.img,if=none,id=d0 -device virtio-blk-pci,drive=d0,id=vd0");
        let source = Source::Qmp {
            socket: path.clone(),
            pid: std::process::id(),
        };
        // The monitor serves one client at a time: were a session kept, the
        // other client here (a VM manager) would wait for ever.
        let within = crate::discover::qmp::EXCHANGE;
        drop(Session::open(&path, std::process::id(), within).expect("the monitor greets"));
        let ops: Vec<u64> = (0..3)
            .map(|_| read(&source, &v, within).unwrap()["vd0"].rd_ops)
            .collect();
        // Capabilities then blockstats in each, after the manager's
        // capabilities: answers 3, 5, 7.
        assert_eq!(ops, [3, 5, 7]);
        let mut m = Session::open(&path, std::process::id(), within).expect("the monitor is free");
        let stats: Capped<qmp_answers::BlockStats> =
            m.execute("{\"execute\":\"query-blockstats\"}").unwrap();
        assert_eq!(stats.0[0].stats.rd_operations, 9);
        drop(m);
        // A monitor not served by the process named is refused.
        let other = Source::Qmp {
            socket: path.clone(),
            pid: 1,
        };
        let e = read(&other, &v, within).unwrap_err();
        assert!(
            format!("{e:#}").contains("not served by process 1"),
            "{e:#}"
        );
        let mut s = UnixStream::connect(&path).unwrap();
        writeln!(s, "quit").unwrap();
        // The manager's, three reads, the manager's again, the refused one,
        // the last.
        assert_eq!(server.join().unwrap(), 7);
    }
}
