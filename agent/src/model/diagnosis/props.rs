//! The diagnosis on figures nobody measured: zeros, NaN, infinities, huge
//! queue counts, empty histograms, strings with control characters. It may
//! name anything; it must never panic, and what it prints must be text.

use proptest::prelude::*;

use super::*;

/// Any float, the awkward ones often.
fn num() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(-0.0),
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        Just(f64::MAX),
        Just(f64::MIN_POSITIVE),
        -1e3..1e3f64,
        0.0..1e9f64,
        any::<f64>(),
    ]
}

fn stat() -> impl Strategy<Value = Stat> {
    (num(), num()).prop_map(|(mean_us, p99_us)| Stat { mean_us, p99_us })
}

fn count() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(0u32),
        Just(1),
        Just(3),
        Just(256),
        Just(1024),
        Just(u32::MAX),
        any::<u32>()
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("vd0".to_string()),
        Just("\u{1b}[2J; id #".to_string()),
        ".{0,12}",
    ]
}

fn thread() -> impl Strategy<Value = Thread> {
    (
        name(),
        any::<u32>(),
        name(),
        proptest::option::of(any::<u32>()),
        num(),
        num(),
    )
        .prop_map(|(name, tid, cpus, last_cpu, busy, waiting)| Thread {
            name,
            tid,
            cpus,
            last_cpu,
            busy,
            waiting,
        })
}

fn figures() -> impl Strategy<Value = Figures> {
    let basis = proptest::option::of(prop_oneof![
        Just(Basis::GuestObserved),
        Just(Basis::HostWindow),
        Just(Basis::HostDisk),
    ]);
    let tier = prop_oneof![Just(Tier::AlwaysOn), Just(Tier::Deep)];
    let head = (
        basis,
        any::<u64>(),
        num(),
        num(),
        num(),
        num(),
        stat(),
        tier,
    );
    let segments = proptest::array::uniform4(proptest::option::of(stat()));
    let tail = (
        proptest::option::of(proptest::array::uniform4(num())),
        proptest::option::of(num()),
    );
    let host = (
        proptest::option::of(num()),
        proptest::option::of(num()),
        proptest::option::of((num(), num())),
    );
    (head, segments, tail, host).prop_map(
        |((basis, ios, iops, bytes, disk_iops, disk_bytes, total, tier), segments, tail, host)| {
            Figures {
                basis,
                op: Some(Op::Read),
                ios,
                iops,
                bytes_per_s: bytes,
                disk_iops,
                disk_bytes_per_s: disk_bytes,
                total,
                segments,
                tail: tail.0,
                tail_total_us: tail.1,
                host_queue_us: host.0,
                host_service_us: host.1,
                cpu_wait: host.2.map(|(hypervisor_us, engine_us)| CpuWait {
                    hypervisor_us,
                    engine_us,
                }),
                tier,
            }
        },
    )
}

fn host_disk() -> impl Strategy<Value = HostDisk> {
    (
        name(),
        proptest::option::of(name()),
        proptest::option::of(count()),
        proptest::option::of(count()),
        proptest::option::of(num()),
    )
        .prop_map(
            |(name, scheduler, nr_requests, device_depth, in_flight)| HostDisk {
                name,
                scheduler,
                nr_requests,
                device_depth,
                rotational: Some(false),
                in_flight,
                stack: Vec::new(),
            },
        )
}

fn vm_disk() -> impl Strategy<Value = VmDisk> {
    let names = (
        name(),
        name(),
        proptest::option::of(name()),
        proptest::option::of(name()),
    );
    let settings = (
        proptest::option::of(prop_oneof![
            Just("virtio-blk-pci".to_string()),
            Just("nvme".to_string()),
            name()
        ]),
        any::<bool>(),
        proptest::option::of(count()),
        proptest::option::of(name()),
        proptest::option::of(any::<bool>()),
        proptest::option::of(count()),
        proptest::option::of(count()),
    );
    let load = (
        proptest::collection::vec(("iops|bps|iops_rd|x", any::<u64>()), 0..3),
        proptest::option::of(thread()),
        proptest::collection::vec(thread(), 0..3),
        num(),
        proptest::option::of((num(), any::<u64>(), any::<u64>())),
        proptest::option::of(host_disk()),
    );
    (names, settings, load).prop_map(|(names, settings, load)| VmDisk {
        vm: names.0,
        disk: names.1,
        domain: names.2,
        target_dev: names.3,
        model: settings.0,
        kvm: settings.1,
        vcpus: settings.2,
        iothread: settings.3,
        ioeventfd: settings.4,
        queues: settings.5,
        queue_size: settings.6,
        throttle: load.0,
        throttle_from: Some("QMP query-block".into()),
        engine: load.1,
        peers: Vec::new(),
        vcpu_threads: load.2,
        beside: Vec::new(),
        vm_iops: load.3,
        vcpu_waits: load.4.map(|(per_io_us, raises, waited)| VcpuWaits {
            per_io_us,
            raises,
            waited,
        }),
        host_cpus: vec![0, 1],
        host_disk: load.5,
    })
}

/// The property's cases, in a thread of a generous stack: the strategies'
/// values are large in an unoptimized build.
#[test]
fn the_diagnosis_never_panics() {
    let run = || {
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 4096,
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        let inputs = (
            figures(),
            proptest::option::of(vm_disk()),
            proptest::option::of(host_disk()),
        );
        runner
            .run(&inputs, |(f, vm, host)| {
                let d = diagnose(&f, vm.as_ref(), host.as_ref());
                prop_assert!(!d.text().is_empty());
                Ok(())
            })
            .map_err(|e| e.to_string())
    };
    let outcome = std::thread::Builder::new()
        .stack_size(256 << 20)
        .spawn(run)
        .expect("a thread")
        .join()
        .expect("the property's thread panicked");
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

/// The figures of the panic the diagnosis had: a busy guest on a disk of
/// four queues of 256 (a capacity over 512).
#[test]
fn a_full_guest_queue_on_a_disk_of_many_queues_is_named() {
    let total = 4000.0;
    let f = Figures {
        basis: Some(Basis::GuestObserved),
        op: Some(Op::Read),
        ios: 100_000,
        iops: 800_000.0,
        total: Stat {
            mean_us: total,
            p99_us: total * 2.0,
        },
        segments: [
            Some(Stat {
                mean_us: 2500.0,
                p99_us: 5000.0,
            }),
            Some(Stat {
                mean_us: 500.0,
                p99_us: 900.0,
            }),
            Some(Stat {
                mean_us: 500.0,
                p99_us: 900.0,
            }),
            Some(Stat {
                mean_us: 500.0,
                p99_us: 900.0,
            }),
        ],
        ..Default::default()
    };
    let vm = VmDisk {
        vm: "db01".into(),
        disk: "vd0".into(),
        model: Some("virtio-blk-pci".into()),
        queues: Some(4),
        queue_size: Some(256),
        ..Default::default()
    };
    let d = diagnose(&f, Some(&vm), None);
    assert_eq!(d.cause, Cause::GuestQueue, "{}", d.text());
    // 3,200 in flight over four queues: 1,200 a queue asked, virtio's 1,024 given.
    let k = d.knob.expect("a knob");
    assert!(
        k.qemu
            .as_deref()
            .is_some_and(|q| q.contains("queue-size=1024")),
        "{k:?}"
    );
}
