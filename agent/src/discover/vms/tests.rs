use std::{fs, os::unix::fs::MetadataExt, path::Path};

use super::{cmdline::looks_like_qemu, *};
use crate::discover::procfs::mkfifo;

fn args(s: &[&str]) -> Vec<String> {
    s.iter().map(|a| a.to_string()).collect()
}

/// A configfs tree as LIO lays it out: a vhost target whose TPG's LUNs
/// link to file and block backstores.
fn lio_tree(root: &Path, wwpn: &str, luns: &[(&str, &str, &str, &str)]) {
    for (lun, store, udev, info) in luns {
        let core = root.join("target/core").join(store);
        fs::create_dir_all(&core).unwrap();
        fs::write(core.join("udev_path"), udev).unwrap();
        fs::write(core.join("info"), info).unwrap();
        let dir = root
            .join("target/vhost")
            .join(wwpn)
            .join("tpgt_1/lun")
            .join(lun);
        fs::create_dir_all(&dir).unwrap();
        std::os::unix::fs::symlink(&core, dir.join("5f2e8a91c3")).unwrap();
    }
    fs::create_dir_all(root.join("target/vhost").join(wwpn).join("tpgt_1/acls")).unwrap();
}

#[test]
fn a_vhost_scsi_target_becomes_a_disk_per_lun_with_its_backing() {
    let root_held = tempfile::Builder::new()
        .prefix("iospan-lio-")
        .tempdir()
        .unwrap();
    let root = root_held.path().to_path_buf();
    let img = root.join("vm.img");
    fs::write(&img, [0u8; 4096]).unwrap();
    let wwpn = "naa.5001405c0ffee001";
    lio_tree(
        &root,
        wwpn,
        &[
            ("lun_10", "fileio_1/logs", "",
             &format!("Status: ACTIVATED  Max Queue Depth: 128\n        TCM FILEIO ID: 1        File: {}  Size: 4096  Mode: O_DSYNC Async: 1\n", img.display())),
            ("lun_2", "fileio_0/data", &img.display().to_string(), ""),
        ],
    );
    let mut vm = from_args(
        7,
        &args(&["-device", &format!("vhost-scsi-pci,wwpn={wwpn},id=vs0")]),
    );
    assert_eq!(vm.disks.len(), 1);
    assert!(vm.disks[0].kernel_vhost());
    assert_eq!(
        vm.disks[0].split_support(vm.kvm).unwrap_err(),
        "no LUN of its target found in LIO's configfs (target/vhost/WWPN under IOSPAN_CONFIGFS, default /sys/kernel/config) on a host disk"
    );
    vm.find_luns(&root.join("nowhere"));
    assert_eq!(vm.disks.len(), 1, "no configfs: the device stays, unsplit");
    vm.find_luns(&root);
    let ids: Vec<_> = vm.disks.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["vs0/lun_2", "vs0/lun_10"], "in LUN order");
    for d in &vm.disks {
        assert_eq!(d.file.as_deref(), Some(img.as_path()));
        assert_eq!(d.host_dev, host_disk_of(&img));
    }
    assert_eq!(
        vm.disks[1].target.as_deref(),
        Some("naa.5001405c0ffee001/lun_10")
    );
    // On a host disk (not tmpfs) the split is supported.
    assert_eq!(
        vm.disks[0].split_supported(vm.kvm),
        host_disk_of(&img).is_some()
    );
}

#[test]
fn libvirt_style_name_drive_and_device() {
    let vm = from_args(
        7,
        &args(&[
            "-name", "guest=web01,debug-threads=on",
            "-drive", "file=/var/lib/libvirt/images/web01.img,if=none,id=drive-virtio-disk0,format=raw,cache=none,aio=io_uring",
            "-device", "virtio-blk-pci,drive=drive-virtio-disk0,id=virtio-disk0,bootindex=1",
            "-drive", "file=/data/db,,with,,commas.raw,if=none,id=d1",
            "-device", "nvme,drive=d1,serial=abc",
            "-chardev", "socket,id=charchannel0,path=/run/libvirt/qemu/other.sock,server=on,wait=off",
            "-chardev", "socket,id=charchannel1,path=/run/iospan/web01.sock,server=on,wait=off",
            "-device", "virtio-serial-pci,id=virtio-serial0",
            "-device", "virtserialport,bus=virtio-serial0.0,nr=1,chardev=charchannel0,id=channel0,name=org.qemu.guest_agent.0",
            "-device", "virtserialport,bus=virtio-serial0.0,nr=2,chardev=charchannel1,id=channel1,name=org.iospan.0",
        ]),
    );
    assert_eq!(vm.name, "web01");
    assert_eq!(
        vm.channel,
        Some(SocketSource::Path("/run/iospan/web01.sock".into()))
    );
    assert_eq!(vm.serials, [("d1".to_string(), "abc".to_string())]);
    assert_eq!(vm.disks.len(), 2);
    assert_eq!(vm.disks[0].id, "virtio-disk0");
    assert_eq!(vm.disks[0].model.as_deref(), Some("virtio-blk-pci"));
    assert_eq!(
        vm.disks[0].file.as_deref(),
        Some(Path::new("/var/lib/libvirt/images/web01.img"))
    );
    assert_eq!(vm.disks[1].id, "d1", "no device id: the drive's");
    assert_eq!(vm.disks[0].aio.as_deref(), Some("io_uring"));
    assert_eq!(
        vm.disks[1].aio.as_deref(),
        Some("threads"),
        "QEMU's default"
    );
    assert!(
        vm.disks[0].split_supported(vm.kvm),
        "virtio-blk on io_uring"
    );
    assert!(vm.named_threads);
    assert!(
        !vm.disks[1].split_supported(vm.kvm),
        "NVMe without ioeventfd=on"
    );
    assert!(vm.disks[1].worker_submitted());
    assert_eq!(
        vm.disks[1].file.as_deref(),
        Some(Path::new("/data/db,with,commas.raw"))
    );
}

/// Split a recorded command line as /proc/PID/cmdline would (one
/// argument per element; the recordings keep JSON in single quotes).
fn recorded(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '\'' => quoted = !quoted,
            ' ' | '\n' if !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            _ => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out.remove(0);
    out
}

/// libvirt 9.0 (Debian 12) starting a TCG domain with an iothread, a
/// file disk, a block-device disk and the guest channel passed as an fd.
const LIBVIRT: &str = r#"/usr/bin/qemu-system-x86_64 -name guest=lv-file,debug-threads=on -S
    -object '{"qom-type":"secret","id":"masterKey0","format":"raw","file":"/var/lib/libvirt/qemu/domain-2-lv-file/master-key.aes"}'
    -machine pc-i440fx-7.2,usb=off,dump-guest-core=off,memory-backend=pc.ram -accel tcg -cpu qemu64
    -bios /usr/share/qemu/qboot.rom -m 512 -object '{"qom-type":"memory-backend-ram","id":"pc.ram","size":536870912}'
    -overcommit mem-lock=off -smp 1,sockets=1,cores=1,threads=1 -object '{"qom-type":"iothread","id":"iothread1"}'
    -uuid b40a0dcb-ecba-4afd-97ea-fcc0c6900c2a -display none -no-user-config -nodefaults
    -chardev socket,id=charmonitor,fd=31,server=on,wait=off -mon chardev=charmonitor,id=monitor,mode=control
    -rtc base=utc -no-shutdown -no-acpi -boot strict=on -kernel /srv/rig/vmlinuz -initrd /srv/rig/initrd.cpio.gz
    -append 'console=ttyS0 quiet'
    -device '{"driver":"virtio-serial-pci","id":"virtio-serial0","bus":"pci.0","addr":"0x2"}'
    -blockdev '{"driver":"file","filename":"/var/lib/libvirt/images/lv-file.img","aio":"io_uring","node-name":"libvirt-2-storage","cache":{"direct":true,"no-flush":false},"auto-read-only":true,"discard":"unmap"}'
    -blockdev '{"node-name":"libvirt-2-format","read-only":false,"cache":{"direct":true,"no-flush":false},"driver":"raw","file":"libvirt-2-storage"}'
    -device '{"driver":"virtio-blk-pci","iothread":"iothread1","bus":"pci.0","addr":"0x3","drive":"libvirt-2-format","id":"virtio-disk0","bootindex":1,"write-cache":"on"}'
    -blockdev '{"driver":"host_device","filename":"/dev/vg0/lv-data","aio":"native","node-name":"libvirt-1-storage","cache":{"direct":true,"no-flush":false},"auto-read-only":true,"discard":"unmap"}'
    -blockdev '{"node-name":"libvirt-1-format","read-only":false,"cache":{"direct":true,"no-flush":false},"driver":"raw","file":"libvirt-1-storage"}'
    -device '{"driver":"virtio-blk-pci","bus":"pci.0","addr":"0x4","drive":"libvirt-1-format","id":"virtio-disk1","write-cache":"on"}'
    -add-fd set=0,fd=30,opaque=serial0-source -chardev file,id=charserial0,path=/dev/fdset/0,append=on
    -device '{"driver":"isa-serial","chardev":"charserial0","id":"serial0","index":0}'
    -chardev socket,id=charchannel0,fd=29,server=on,wait=off
    -device '{"driver":"virtserialport","bus":"virtio-serial0.0","nr":1,"chardev":"charchannel0","id":"channel0","name":"org.iospan.0"}'
    -audiodev '{"id":"audio1","driver":"none"}' -sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny -msg timestamp=on"#;

#[test]
fn libvirt_json_devices_blockdevs_iothreads_uuid_and_fd_channel() {
    let vm = from_args(7, &recorded(LIBVIRT));
    assert_eq!(vm.name, "lv-file");
    assert_eq!(
        vm.uuid.as_deref(),
        Some("b40a0dcb-ecba-4afd-97ea-fcc0c6900c2a")
    );
    assert!(vm.named_threads);
    assert_eq!(vm.not_vm, None, "paused at start, but it has disks");
    let d: Vec<_> = vm
        .disks
        .iter()
        .map(|d| {
            (
                d.id.as_str(),
                d.model.as_deref(),
                d.file.as_deref().and_then(Path::to_str),
                d.aio.as_deref(),
                d.iothread.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        d,
        [
            (
                "virtio-disk0",
                Some("virtio-blk-pci"),
                Some("/var/lib/libvirt/images/lv-file.img"),
                Some("io_uring"),
                Some("iothread1")
            ),
            (
                "virtio-disk1",
                Some("virtio-blk-pci"),
                Some("/dev/vg0/lv-data"),
                Some("native"),
                None
            ),
        ]
    );
    assert!(vm.disks.iter().all(|d| d.split_supported(vm.kvm)));
    assert_eq!(vm.channel, Some(SocketSource::Fd(29)));
    assert_eq!(vm.guest_channel, None, "resolved only through the process");
}

#[test]
fn libvirt_capability_probes_are_not_vms() {
    // What libvirtd runs to learn a binary's capabilities.
    let probe = recorded(
        "qemu-system-x86_64 -S -no-user-config -nodefaults -nographic -machine none,accel=kvm:tcg \
         -qmp unix:/var/lib/libvirt/qemu/capabilities.monitor.sock,server=on,wait=off \
         -pidfile /var/lib/libvirt/qemu/capabilities.pidfile -daemonize",
    );
    let vm = from_args(40, &probe);
    assert!(
        vm.not_vm
            .as_deref()
            .is_some_and(|w| w.contains("-machine none")),
        "{vm:?}"
    );
    // -M and JSON-free keyval forms too; paused with nothing to run.
    assert!(from_args(41, &args(&["-M", "none"])).not_vm.is_some());
    assert!(from_args(42, &args(&["-machine", "type=none,accel=tcg"]))
        .not_vm
        .is_some());
    assert!(
        from_args(43, &args(&["-S", "-nodefaults", "-qmp", "stdio"]))
            .not_vm
            .is_some()
    );
    // Paused with a kernel to run, or a disk, is a VM.
    assert!(from_args(44, &args(&["-S", "-kernel", "/boot/vmlinuz"]))
        .not_vm
        .is_none());
    assert!(from_args(45, &args(&["-S", "-drive", "file=/a.img,id=d0"]))
        .not_vm
        .is_none());
}

#[test]
fn rhel_qemu_kvm_and_proxmox_kvm_are_qemu() {
    assert!(is_qemu_comm("qemu-system-x86"));
    assert!(is_qemu_comm("qemu-kvm\n"));
    assert!(is_qemu_comm("kvm"));
    assert!(!is_qemu_comm("kvm-pit/1234"));
    assert!(!is_qemu_comm("qemu-storage-da"));
    assert!(!is_qemu_comm("qemu-ga"));
    // RHEL 9's /usr/libexec/qemu-kvm as libvirt starts it (from libvirt's
    // and RHEL's documentation): q35, a qcow2 on a file, the guest channel.
    let rhel = recorded(
        r#"/usr/libexec/qemu-kvm -name guest=rhel9-db,debug-threads=on -S -machine pc-q35-rhel9.2.0,usb=off,memory-backend=pc.ram
           -accel kvm -uuid 5d2b1cbf-0f6e-4c2a-9d0c-6a7c3f0e1a11 -no-user-config -nodefaults
           -object '{"qom-type":"iothread","id":"iothread1"}'
           -blockdev '{"driver":"file","filename":"/var/lib/libvirt/images/rhel9-db.qcow2","node-name":"libvirt-1-storage","auto-read-only":true,"discard":"unmap","aio":"native","cache":{"direct":true,"no-flush":false}}'
           -blockdev '{"node-name":"libvirt-1-format","read-only":false,"discard":"unmap","cache":{"direct":true,"no-flush":false},"driver":"qcow2","file":"libvirt-1-storage"}'
           -device '{"driver":"virtio-blk-pci","iothread":"iothread1","bus":"pci.4","addr":"0x0","drive":"libvirt-1-format","id":"virtio-disk0","bootindex":1,"write-cache":"on","num-queues":4}'
           -chardev socket,id=charchannel1,fd=35,server=on,wait=off
           -device '{"driver":"virtserialport","bus":"virtio-serial0.0","nr":2,"chardev":"charchannel1","id":"channel1","name":"org.iospan.0"}'"#,
    );
    let vm = from_args(100, &rhel);
    assert_eq!(vm.name, "rhel9-db");
    assert_eq!(vm.disks.len(), 1);
    assert_eq!(vm.disks[0].id, "virtio-disk0");
    assert_eq!(
        vm.disks[0].file.as_deref(),
        Some(Path::new("/var/lib/libvirt/images/rhel9-db.qcow2"))
    );
    assert_eq!(vm.disks[0].aio.as_deref(), Some("native"));
    assert_eq!(vm.disks[0].iothread.as_deref(), Some("iothread1"));
    assert_eq!(vm.channel, Some(SocketSource::Fd(35)));
    assert!(looks_like_qemu("qemu-kvm", &vm));
    // Proxmox VE's qemu-server (from its documentation): /usr/bin/kvm,
    // -id, a bare -name with options, keyval drives on LVM and ZFS.
    let pve = recorded(
        "/usr/bin/kvm -id 100 -name 'web01,debug-threads=on' -no-shutdown \
         -chardev socket,id=qmp,path=/var/run/qemu-server/100.qmp,server=on,wait=off -mon chardev=qmp,mode=control \
         -pidfile /var/run/qemu-server/100.pid -daemonize -smbios type=1,uuid=6b0e1c0a-1f3a-4c55-9d4e-2b7f0c2a9e10 \
         -smp 2,sockets=1,cores=2,maxcpus=2 -m 4096 -object iothread,id=iothread-virtio0 \
         -drive file=/dev/pve/vm-100-disk-0,if=none,id=drive-virtio0,cache=none,aio=io_uring,format=raw,detect-zeroes=on \
         -device virtio-blk-pci,drive=drive-virtio0,id=virtio0,bus=pci.0,addr=0xa,iothread=iothread-virtio0,bootindex=100 \
         -drive file=/dev/zvol/rpool/data/vm-100-disk-1,if=none,id=drive-scsi0,cache=none,aio=native,format=raw \
         -device scsi-hd,bus=scsihw0.0,channel=0,scsi-id=0,lun=0,drive=drive-scsi0,id=scsi0 -machine type=pc+pve0",
    );
    let vm = from_args(200, &pve);
    assert_eq!(vm.name, "web01");
    assert!(vm.named_threads);
    assert_eq!(vm.not_vm, None);
    let ids: Vec<_> = vm.disks.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["virtio0", "scsi0"]);
    assert_eq!(
        vm.disks[0].file.as_deref(),
        Some(Path::new("/dev/pve/vm-100-disk-0"))
    );
    assert_eq!(vm.disks[0].iothread.as_deref(), Some("iothread-virtio0"));
    assert_eq!(vm.disks[1].aio.as_deref(), Some("native"));
    assert!(looks_like_qemu("kvm", &vm));
    // Something else named kvm, with a command line QEMU never takes.
    assert!(!looks_like_qemu(
        "kvm",
        &from_args(300, &args(&["--verbose", "x"]))
    ));
}

/// A recorded sysfs tree: an LVM volume (dm-0) over a partition of a
/// loop device, a striped one (dm-1) over two whole disks, and a plain
/// partition.
fn sysfs_tree(root: &Path) {
    let dev = |p: &str, d: &str| {
        fs::create_dir_all(root.join(p)).unwrap();
        fs::write(root.join(p).join("dev"), format!("{d}\n")).unwrap();
    };
    dev("devices/virtual/block/loop0", "7:0");
    dev("devices/virtual/block/loop0/loop0p1", "259:0");
    fs::write(
        root.join("devices/virtual/block/loop0/loop0p1/partition"),
        "1\n",
    )
    .unwrap();
    dev("devices/pci0000:00/nvme/nvme0n1", "259:1");
    dev("devices/pci0000:00/sda", "8:0");
    dev("devices/virtual/block/dm-0", "253:0");
    dev("devices/virtual/block/dm-1", "253:1");
    let link = |from: &str, to: &str| {
        let p = root.join(from);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(root.join(to), p).unwrap();
    };
    link(
        "devices/virtual/block/dm-0/slaves/loop0p1",
        "devices/virtual/block/loop0/loop0p1",
    );
    link(
        "devices/virtual/block/dm-1/slaves/sda",
        "devices/pci0000:00/sda",
    );
    link(
        "devices/virtual/block/dm-1/slaves/nvme0n1",
        "devices/pci0000:00/nvme/nvme0n1",
    );
    for (n, d) in [
        ("7:0", "devices/virtual/block/loop0"),
        ("259:0", "devices/virtual/block/loop0/loop0p1"),
        ("259:1", "devices/pci0000:00/nvme/nvme0n1"),
        ("8:0", "devices/pci0000:00/sda"),
        ("253:0", "devices/virtual/block/dm-0"),
        ("253:1", "devices/virtual/block/dm-1"),
    ] {
        link(&format!("dev/block/{n}"), d);
    }
}

#[test]
fn device_mapper_stacks_resolve_to_the_physical_disks_under_them() {
    let root_held = tempfile::Builder::new()
        .prefix("iospan-sysfs-")
        .tempdir()
        .unwrap();
    let root = root_held.path().to_path_buf();
    sysfs_tree(&root);
    let lv = host_stack_of_dev(&root, 253, 0).unwrap();
    assert_eq!(lv.top, "dm-0");
    assert!(lv.dm);
    assert_eq!(lv.leaves, [Dev::new(7, 0)], "the partition's whole disk");
    assert_eq!(lv.leaf_names, ["loop0"]);
    let striped = host_stack_of_dev(&root, 253, 1).unwrap();
    assert_eq!(striped.leaf_names, ["nvme0n1", "sda"]);
    assert_eq!(striped.leaves, [Dev::new(259, 1), Dev::new(8, 0)]);
    let part = host_stack_of_dev(&root, 259, 0).unwrap();
    assert_eq!((part.top.as_str(), part.dm), ("loop0p1", false));
    assert_eq!(part.leaves, [Dev::new(7, 0)]);
    assert!(host_stack_of_dev(&root, 1, 1).is_none());
}

#[test]
fn block_devices_are_keyed_by_their_number_not_their_node() {
    let k = file_key(Path::new("/dev/null")).unwrap();
    assert_ne!(
        k.dev,
        crate::abi::VDISK_FILE_BDEV,
        "a character device is a file"
    );
    let loop_node = fs::read_dir("/dev")
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            use std::os::unix::fs::FileTypeExt;
            fs::metadata(p).is_ok_and(|m| m.file_type().is_block_device())
        })
        .expect("a block device node under /dev");
    let k = file_key(&loop_node).unwrap();
    let rdev = fs::metadata(&loop_node).unwrap().rdev();
    assert_eq!(k.dev, crate::abi::VDISK_FILE_BDEV);
    assert_eq!(
        k.ino,
        u64::from((rustix::fs::major(rdev) << 20) | rustix::fs::minor(rdev))
    );
}

#[test]
fn blockdev_chains_json_and_keyval() {
    let vm = from_args(
        8,
        &args(&[
            "-name",
            "db",
            "-blockdev",
            r#"{"driver":"file","filename":"/img/db.qcow2","node-name":"libvirt-1-storage"}"#,
            "-blockdev",
            r#"{"node-name":"libvirt-1-format","driver":"qcow2","file":"libvirt-1-storage"}"#,
            "-device",
            "virtio-blk-pci,drive=libvirt-1-format,id=virtio-disk0",
            "-blockdev",
            "driver=file,node-name=f2,filename=/img/log.raw",
            "-blockdev",
            "driver=raw,node-name=r2,file=f2",
            "-device",
            "scsi-hd,drive=r2,id=scsi0-0-0-0",
        ]),
    );
    assert_eq!(vm.name, "db");
    let files: Vec<_> = vm
        .disks
        .iter()
        .map(|d| (d.id.as_str(), d.file.clone()))
        .collect();
    assert_eq!(
        files,
        [
            ("virtio-disk0", Some(PathBuf::from("/img/db.qcow2"))),
            ("scsi0-0-0-0", Some(PathBuf::from("/img/log.raw")))
        ]
    );
}

#[test]
fn vhost_user_disks_are_served_by_the_daemon_exporting_on_their_socket() {
    let mut vm = from_args(
        12,
        &args(&[
            "-name",
            "guest=vu",
            "-object",
            "memory-backend-memfd,id=mem0,size=512M,share=on",
            "-chardev",
            "socket,id=vu0,path=/run/vu/a.sock",
            "-device",
            "vhost-user-blk-pci,chardev=vu0,id=vd0,num-queues=1",
            "-chardev",
            "socket,id=vu1,path=rel.sock",
            "-device",
            "vhost-user-blk-pci,chardev=vu1",
        ]),
    );
    assert_eq!(vm.disks.len(), 2);
    assert_eq!(vm.disks[0].id, "vd0");
    assert_eq!(vm.disks[1].id, "vu1", "no device id: the chardev's");
    assert_eq!(
        vm.disks[0].socket.as_deref(),
        Some(Path::new("/run/vu/a.sock"))
    );
    assert!(!vm.disks[0].split_supported(vm.kvm), "no engine found yet");
    let exports = exports_from_args(
        &args(&[
            "--blockdev", "driver=file,node-name=file0,filename=/img/a.raw,cache.direct=on,aio=io_uring",
            "--blockdev", "driver=raw,node-name=disk0,file=file0",
            "--blockdev=driver=file,node-name=f1,filename=/img/b.raw",
            "--export", "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path=/run/vu/a.sock,writable=on",
            "--export=type=vhost-user-blk,id=exp1,node-name=f1,addr.type=unix,addr.path=rel.sock",
            "--export", "type=nbd,id=n0,node-name=disk0",
        ]),
        Path::new("/srv"),
    );
    assert_eq!(
        exports,
        [
            Export {
                id: "exp0".into(),
                node: "disk0".into(),
                socket: "/run/vu/a.sock".into(),
                file: Some("/img/a.raw".into()),
                aio: "io_uring".into()
            },
            Export {
                id: "exp1".into(),
                node: "f1".into(),
                socket: "/srv/rel.sock".into(),
                file: Some("/img/b.raw".into()),
                aio: "threads".into()
            },
        ]
    );
    let engine = EngineRef {
        pid: 40,
        program: "qemu-storage-daemon".into(),
        export: String::new(),
        exe: None,
        comm: STORAGE_DAEMON_COMM.into(),
        node: String::new(),
        monitor: None,
    };
    vm.find_engines(&[(engine, exports)], Path::new("/srv"));
    let e = vm.disks[0].engine.as_ref().expect("served");
    assert_eq!(
        (e.pid, e.export.as_str(), e.node.as_str()),
        (40, "exp0", "disk0")
    );
    assert_eq!(vm.disks[0].file.as_deref(), Some(Path::new("/img/a.raw")));
    assert_eq!(vm.disks[0].aio.as_deref(), Some("io_uring"));
    assert!(vm.disks[0].split_supported(vm.kvm));
    assert_eq!(
        vm.disks[1].engine.as_ref().map(|e| e.export.as_str()),
        Some("exp1")
    );
    assert_eq!(vm.engines().len(), 1, "one process, two exports");
}

#[test]
fn bare_drive_and_unnamed_vm() {
    let vm = from_args(
        9,
        &args(&["-m", "512", "-drive", "file=/tmp/a.img,id=hd0,if=virtio"]),
    );
    assert_eq!(vm.name, "qemu-9");
    assert_eq!(vm.disks.len(), 1);
    assert_eq!(vm.disks[0].id, "hd0");
    assert_eq!(vm.disks[0].model, None);
}

#[test]
fn registry_gives_disks_slots_and_marks_shared_host_disks() {
    let (a, b) = (Dev::new(8, 0), Dev::new(259, 0));
    let disk = |id: &str, dev| VDisk {
        id: id.into(),
        host_dev: Some(dev),
        ..Default::default()
    };
    let mut r = Registry::default();
    let m1 = r.add(
        1,
        Vm {
            pid: 10,
            name: "one".into(),
            disks: vec![disk("x", a)],
            named_threads: true,
            ..Default::default()
        },
    );
    let m2 = r.add(
        2,
        Vm {
            pid: 11,
            name: "two".into(),
            disks: vec![disk("y", a), disk("z", a), disk("w", b)],
            named_threads: true,
            ..Default::default()
        },
    );
    assert_eq!(m1.disks, [(crate::abi::VmDevKey { vm: 1, dev: a.0 }, 1)]);
    assert_eq!(
        m2.disks,
        [
            (
                crate::abi::VmDevKey { vm: 2, dev: a.0 },
                crate::abi::VDISK_SEVERAL
            ),
            (crate::abi::VmDevKey { vm: 2, dev: b.0 }, 4)
        ]
    );
    assert_eq!(
        (r.vdisk(1), r.vdisk(3), r.vdisk(4), r.vdisk(9)),
        (Some("x"), Some("z"), Some("w"), None)
    );
    assert_eq!(
        (r.name(2), r.name(7)),
        ("two".to_string(), "vm#7".to_string())
    );
}

#[test]
fn a_vm_that_creates_its_kvm_vm_after_its_naming_is_learnt_as_one() {
    // No accelerator on its command line: named before its KVM VM exists.
    let vm = from_args(
        12,
        &args(&[
            "-drive",
            "file=/img/a.raw,if=none,id=d0,format=raw",
            "-device",
            "nvme,drive=d0,id=n0,serial=s0",
        ]),
    );
    assert!(!vm.kvm);
    let mut r = Registry::default();
    r.add(3, vm);
    assert!(r.split.is_empty(), "NVMe doorbells off KVM are not split");
    assert!(r.kvm_unsure.contains_key(&3));
    assert!(r.learn_kvm(3));
    let vm = &r.vms[&3];
    assert!(vm.kvm && vm.disks[0].split_supported(vm.kvm));
    assert_eq!(r.split.iter().copied().collect::<Vec<_>>(), [1]);
    assert!(r.kvm_unsure.is_empty());
    assert!(!r.learn_kvm(3), "learnt once");
    assert!(!r.learn_kvm(9), "no such VM");
}

#[test]
fn file_key_uses_the_kernels_dev_encoding() {
    let exe = std::env::current_exe().unwrap();
    let k = file_key(&exe).unwrap();
    let m = fs::metadata(&exe).unwrap();
    assert_eq!(k.ino, m.ino());
    assert_eq!(k.dev >> 20, rustix::fs::major(m.dev()));
    assert_eq!(k.dev & 0xfffff, rustix::fs::minor(m.dev()));
    assert!(file_key(Path::new("/nonexistent/file")).is_none());
}

/// A vhost-scsi `wwpn` from a command line anyone can write: never a path
/// (absolute, `..`), and a LUN whose link leads out of configfs's
/// `target/core`, or to a FIFO or a device, gives nothing and never blocks.
#[test]
fn a_hostile_wwpn_or_backstore_is_refused_without_blocking() {
    let base_held = tempfile::Builder::new()
        .prefix("iospan-lio-hostile-")
        .tempdir()
        .unwrap();
    let base = base_held.path().to_path_buf();
    let root = base.join("configfs");
    let img = base.join("vm.img");
    fs::write(&img, [0u8; 4096]).unwrap();
    // A tree the attacker made outside configfs, reachable by `..` or an
    // absolute wwpn: its LUN's backstore has a FIFO for udev_path.
    let evil = base.join("evil");
    let store = base.join("store");
    fs::create_dir_all(evil.join("tpgt_1/lun/lun_0")).unwrap();
    fs::create_dir_all(&store).unwrap();
    let fifo = store.join("udev_path");
    mkfifo(&fifo);
    std::os::unix::fs::symlink(&store, evil.join("tpgt_1/lun/lun_0/x")).unwrap();
    // Inside configfs: a real target whose LUN links out of target/core,
    // one whose udev_path is a link to /dev/zero, one good.
    lio_tree(
        &root,
        "naa.good",
        &[("lun_0", "fileio_0/good", &img.display().to_string(), "")],
    );
    fs::create_dir_all(root.join("target/vhost/naa.out/tpgt_1/lun/lun_0")).unwrap();
    std::os::unix::fs::symlink(&store, root.join("target/vhost/naa.out/tpgt_1/lun/lun_0/x"))
        .unwrap();
    let zero = root.join("target/core/fileio_1/zero");
    fs::create_dir_all(&zero).unwrap();
    std::os::unix::fs::symlink("/dev/zero", zero.join("udev_path")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", zero.join("info")).unwrap();
    fs::create_dir_all(root.join("target/vhost/naa.zero/tpgt_1/lun/lun_0")).unwrap();
    std::os::unix::fs::symlink(&zero, root.join("target/vhost/naa.zero/tpgt_1/lun/lun_0/x"))
        .unwrap();

    let started = std::time::Instant::now();
    let rel = format!("../../../{}", evil.strip_prefix(&base).unwrap().display());
    for wwpn in [
        evil.to_str().unwrap(),
        rel.as_str(),
        "..",
        ".",
        "",
        "a/b",
        "naa.out",
        "naa.zero",
    ] {
        assert_eq!(lio_luns(&root, wwpn), Vec::new(), "wwpn {wwpn:?}");
    }
    assert_eq!(
        lio_luns(&root, "naa.good"),
        vec![("lun_0".to_string(), img.clone())]
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(2),
        "nothing blocked"
    );
    for (name, plain) in [
        ("naa.5001", true),
        ("..", false),
        (".", false),
        ("", false),
        ("/x", false),
        ("a/..", false),
    ] {
        assert_eq!(is_plain_name(name), plain, "{name:?}");
    }
}

/// A command line anyone may write, with thousands of disks: the VM keeps
/// `MAX_VDISKS`, says how many more it had, and parsing stays quick.
#[test]
fn thousands_of_disks_on_one_command_line_are_capped() {
    let mut a = vec!["-name".to_string(), "guest=many".to_string()];
    for i in 0..3000 {
        a.push("-drive".into());
        a.push(format!(
            "file=/nonexistent/d{i}.img,if=none,id=d{i},format=raw"
        ));
        a.push("-device".into());
        a.push(format!(
            "virtio-blk-pci,drive=d{i},id=vd{i},num-queues=99999"
        ));
    }
    let t = std::time::Instant::now();
    let vm = from_args(9, &a);
    assert!(
        t.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(vm.disks.len(), MAX_VDISKS);
    assert_eq!(vm.vdisks_over_cap, 3000 - MAX_VDISKS);
    // A queue count past QEMU's own maximum is not believed either.
    assert_eq!(vm.disks[0].queues, Some(1024));
}

#[test]
fn queue_counts_come_from_the_device_else_the_vcpus() {
    let vm = from_args(
        9,
        &args(&[
            "-smp",
            "cpus=4,sockets=1",
            "-drive",
            "file=/x/a.img,if=none,id=a",
            "-device",
            "virtio-blk-pci,drive=a,id=va",
            "-drive",
            "file=/x/b.img,if=none,id=b",
            "-device",
            "virtio-blk-pci,drive=b,id=vb,num-queues=2",
            "-drive",
            "file=/x/c.img,if=none,id=c",
            "-device",
            "nvme,drive=c,id=nc,serial=1",
        ]),
    );
    let q: Vec<_> = vm.disks.iter().map(|d| (d.id.as_str(), d.queues)).collect();
    assert_eq!(q, [("va", Some(4)), ("vb", Some(2)), ("nc", Some(64))]);
    let one = from_args(
        9,
        &args(&[
            "-drive",
            "file=/x/a.img,if=none,id=a",
            "-device",
            "virtio-blk-pci,drive=a",
        ]),
    );
    assert_eq!(one.disks[0].queues, Some(1), "no -smp: one vCPU");
}

#[test]
fn a_storage_daemons_monitor_is_read_from_its_arguments() {
    let m = monitor_from_args(&args(&[
        "--chardev",
        "socket,id=h,path=/run/client.sock",
        "--chardev",
        "socket,id=qmp0,path=/run/qsd.qmp,server=on,wait=off",
        "--monitor",
        "chardev=qmp0",
    ]));
    assert_eq!(m, Some(SocketSource::Path("/run/qsd.qmp".into())));
    // The short form, an fd passed in, and `--opt=value`.
    let m = monitor_from_args(&args(&[
        "--chardev=socket,id=m,fd=7,server=on",
        "--monitor=m",
    ]));
    assert_eq!(m, Some(SocketSource::Fd(7)));
    // A client socket is not one the daemon listens on; no monitor at all.
    assert_eq!(
        monitor_from_args(&args(&[
            "--chardev",
            "socket,id=c,path=/x",
            "--monitor",
            "c"
        ])),
        None
    );
    assert_eq!(
        monitor_from_args(&args(&[
            "--blockdev",
            "driver=file,node-name=f,filename=/a"
        ])),
        None
    );
}

#[test]
fn qemu_served_disks_get_a_request_taken_probe_only_with_the_split() {
    let vm = from_args(
        7,
        &args(&[
            "-drive",
            "file=/img/a.raw,if=none,id=d0,format=raw",
            "-device",
            "virtio-blk-pci,drive=d0,id=vd0",
            "-drive",
            "file=/img/b.raw,if=none,id=d1,format=raw",
            "-device",
            "nvme,drive=d1,serial=s1",
        ]),
    );
    let deep = ProbeChoice {
        split: true,
        deep: true,
        interrupts_in_qemu: false,
    };
    let with = vm.uprobe_symbols(deep);
    let roles: Vec<_> = with.iter().map(|&(s, r)| (s, r)).collect();
    assert_eq!(
        roles,
        [
            ("virtqueue_flush", ProbeRole::Completion),
            ("msix_notify", ProbeRole::Completion),
            ("block_acct_merge_done", ProbeRole::Merge),
            ("block_acct_start", ProbeRole::Taken),
        ]
    );
    // Only the request-taken probe may be missing from a binary: the
    // split stands on the batch's read without it.
    assert!(with
        .iter()
        .all(|&(_, r)| r.optional() == (r == ProbeRole::Taken)));
    assert!(with
        .iter()
        .all(|&(_, r)| r.hot() == (r != ProbeRole::Merge)));
    assert_eq!(
        vm.uprobe_symbols(ProbeChoice::default()),
        [("block_acct_merge_done", ProbeRole::Merge)]
    );
    // The always-on tier probes no request of QEMU's: its merges only,
    // and its interrupts where no kernel event shows them (no KVM) and its
    // kicks are seen.
    let always_on = ProbeChoice {
        split: true,
        deep: false,
        interrupts_in_qemu: false,
    };
    assert_eq!(
        vm.uprobe_symbols(always_on),
        [("block_acct_merge_done", ProbeRole::Merge)]
    );
    assert_eq!(
        vm.uprobe_symbols(ProbeChoice {
            interrupts_in_qemu: true,
            ..always_on
        }),
        [
            ("msix_notify", ProbeRole::Completion),
            ("block_acct_merge_done", ProbeRole::Merge)
        ]
    );
    // A vhost-user disk is served by its daemon, whose export keeps no
    // accounting: nothing of QEMU's to probe for it.
    let relay = from_args(
        8,
        &args(&[
            "-chardev",
            "socket,id=c0,path=/run/vu.sock",
            "-device",
            "vhost-user-blk-pci,chardev=c0,id=vu0",
        ]),
    );
    assert!(relay.uprobe_symbols(deep).is_empty());
}

#[test]
fn kvm_is_read_off_the_command_line_in_each_form() {
    let a = |v: &[&str]| args(v);
    assert!(kvm_on_command_line("qemu-system-x86", &a(&["-enable-kvm"])));
    assert!(kvm_on_command_line(
        "qemu-system-x86",
        &a(&["-accel", "kvm"])
    ));
    assert!(kvm_on_command_line(
        "qemu-system-x86",
        &a(&["-accel", "kvm,kernel-irqchip=split"])
    ));
    assert!(kvm_on_command_line(
        "qemu-system-x86",
        &a(&["-machine", "pc-q35-7.2,usb=off,accel=kvm"])
    ));
    assert!(kvm_on_command_line(
        "qemu-system-x86",
        &a(&["-M", "q35,accel=kvm:tcg"])
    ));
    assert!(kvm_on_command_line("qemu-kvm", &[]));
    assert!(kvm_on_command_line("kvm\n", &[]));
    assert!(!kvm_on_command_line(
        "qemu-system-x86",
        &a(&["-accel", "tcg"])
    ));
    assert!(!kvm_on_command_line(
        "qemu-system-x86",
        &a(&["-machine", "q35,accel=tcg:kvm"])
    ));
    assert!(!kvm_on_command_line(
        "qemu-system-x86",
        &a(&["-name", "enable-kvm"])
    ));
}

/// The settings a diagnosis names, from the command line: throttle limits
/// by QMP's names, queue size, ioeventfd, vCPUs; a LUKS drive's file
/// through its protocol node's options.
#[test]
fn disk_settings_come_from_the_command_line() {
    let vm = cmdline::from_args(
        42,
        &args(&[
            "qemu-system-x86_64",
            "-smp",
            "4",
            "-drive",
            "file=/images/a.img,if=none,id=vd0,format=raw,cache=none,aio=io_uring,throttling.iops-total=50,throttling.bps-read=1048576,throttling.group=g1",
            "-device",
            "virtio-blk-pci,drive=vd0,queue-size=64,ioeventfd=off",
            "-drive",
            "driver=luks,key-secret=sec0,file.filename=/images/b.luks,file.aio=native,if=none,id=vd1",
            "-device",
            "virtio-blk-pci,drive=vd1",
        ]),
    );
    assert_eq!(vm.vcpus, Some(4));
    let a = &vm.disks[0].knobs;
    assert_eq!(a.limit("iops"), Some(50));
    assert_eq!(a.limit("bps_rd"), Some(1 << 20));
    assert_eq!(a.limit("iops_rd"), None);
    assert_eq!(a.throttle_group.as_deref(), Some("g1"));
    assert_eq!(a.queue_size, Some(64));
    assert_eq!(a.ioeventfd, Some(false));
    assert_eq!(a.cache.as_deref(), Some("none"));
    let b = &vm.disks[1];
    assert_eq!(b.file.as_deref(), Some(Path::new("/images/b.luks")));
    assert_eq!(b.aio.as_deref(), Some("native"));
    assert_eq!(b.knobs.ioeventfd, None);
    assert!(b.knobs.throttle.is_empty());
}

#[test]
fn a_vcpu_thread_is_seen_running_and_other_threads_are_not() {
    let busy = |name: &str, ms: u64| {
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let t = std::time::Instant::now();
                while t.elapsed() < std::time::Duration::from_millis(ms) {
                    std::hint::black_box(0u64);
                }
                std::thread::park();
            })
            .unwrap()
    };
    let pid = std::process::id();
    // An engine thread's work is not a vCPU's: it alone makes no runtime.
    let worker = busy("worker", 20);
    std::thread::sleep(std::time::Duration::from_millis(40));
    assert_eq!(vcpu_runtime(pid), None);
    let vcpu = busy("CPU 0/KVM", 20);
    std::thread::sleep(std::time::Duration::from_millis(40));
    let ran = vcpu_runtime(pid).expect("a vCPU thread");
    assert!(ran >= VCPU_RAN, "{ran:?}");
    assert!(ran < std::time::Duration::from_secs(1), "{ran:?}");
    worker.thread().unpark();
    vcpu.thread().unpark();
    assert!(vcpu_runtime(u32::MAX).is_none());
}
