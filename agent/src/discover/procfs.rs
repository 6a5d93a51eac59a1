//! What a process holds, read through /proc: its open unix sockets and the
//! paths they are bound to; files read capped and without following links.
//!
//! iospan acts for a process only with objects
//! that process holds, never with paths its command line names, and reads
//! files it did not make with a cap and without following links.

use std::{
    fs,
    io::Read,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

/// The socket inodes a process holds open (`/proc/PID/fd/N` ->
/// `socket:[INODE]`), by fd.
pub fn sockets_of(pid: u32) -> Vec<(i32, u64)> {
    let Ok(rd) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| {
            let fd = e.file_name().to_str()?.parse().ok()?;
            let link = fs::read_link(e.path()).ok()?;
            Some((fd, socket_inode(&link)?))
        })
        .collect()
}

fn socket_inode(link: &Path) -> Option<u64> {
    link.to_str()?
        .strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// One row of /proc/net/unix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnixSocket {
    pub inode: u64,
    pub listening: bool,
    /// The path it is bound to (None: unbound or abstract).
    pub path: Option<PathBuf>,
}

/// The host's unix sockets (/proc/net/unix: flag __SO_ACCEPTCON, 0x10000,
/// marks a listener). `table` is the file's text.
pub fn parse_unix_table(table: &str) -> Vec<UnixSocket> {
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = u32::from_str_radix(f.get(3)?, 16).ok()?;
            let inode = f.get(6)?.parse().ok()?;
            let path = f.get(7).filter(|p| p.starts_with('/')).map(PathBuf::from);
            Some(UnixSocket {
                inode,
                listening: flags & 0x10000 != 0,
                path,
            })
        })
        .collect()
}

pub fn unix_sockets() -> Vec<UnixSocket> {
    fs::read_to_string("/proc/net/unix")
        .map(|t| parse_unix_table(&t))
        .unwrap_or_default()
}

/// The path of a listening unix socket that process `pid` itself holds:
/// at its descriptor `fd` (a socket libvirt bound and passed in), or bound
/// at `path` (one QEMU bound). None when the process holds no such
/// listener — whatever its command line says.
pub fn held_listener(pid: u32, fd: Option<i32>, path: Option<&Path>) -> Option<PathBuf> {
    let held = sockets_of(pid);
    let table = unix_sockets();
    let listener = |inode: u64| {
        table
            .iter()
            .find(|s| s.inode == inode && s.listening && s.path.is_some())
    };
    match (fd, path) {
        (Some(fd), _) => {
            let (_, inode) = held.iter().find(|(f, _)| *f == fd)?;
            listener(*inode)?.path.clone()
        }
        (None, Some(path)) => held
            .iter()
            .filter_map(|(_, inode)| listener(*inode))
            .find(|s| s.path.as_deref() == Some(path))
            .and_then(|s| s.path.clone()),
        (None, None) => None,
    }
}

/// Reads a file that someone else may have made: not through a final
/// symlink, never blocking (a FIFO is refused, not waited on), a regular
/// file only, at most `cap` bytes (more is an error, not a truncation).
pub fn read_regular(path: &Path, cap: u64) -> std::io::Result<Vec<u8>> {
    read_file(path, cap, libc::O_NOFOLLOW)
}

/// The executable process `pid` runs, through the kernel's own link to it
/// (/proc/PID/exe: the file it mapped, even deleted), with the checks of
/// `read_regular`.
pub fn read_executable(pid: u32, cap: u64) -> std::io::Result<Vec<u8>> {
    read_file(Path::new(&format!("/proc/{pid}/exe")), cap, 0)
}

/// The same file opened, not read: for reading only the parts needed
/// (a symbol table, not tens of MB of code), with `read_file`'s checks.
pub fn open_executable(pid: u32, cap: u64) -> std::io::Result<fs::File> {
    open_checked(Path::new(&format!("/proc/{pid}/exe")), cap, 0)
}

/// `path` opened if it is a regular file (never a FIFO that would block)
/// no larger than `cap`.
fn open_checked(path: &Path, cap: u64, flags: i32) -> std::io::Result<fs::File> {
    use std::io::{Error, ErrorKind};
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.file_type().is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    if meta.len() > cap {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("larger than {cap} bytes"),
        ));
    }
    Ok(f)
}

/// The first `head` bytes of a file someone else may have made, with
/// `read_regular`'s checks (the whole at most `cap` bytes).
pub fn read_head(path: &Path, cap: u64, head: u64) -> std::io::Result<Vec<u8>> {
    let f = open_checked(path, cap, libc::O_NOFOLLOW)?;
    let mut buf = Vec::new();
    f.take(head).read_to_end(&mut buf)?;
    Ok(buf)
}

fn read_file(path: &Path, cap: u64, flags: i32) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind};
    let f = open_checked(path, cap, flags)?;
    let meta = f.metadata()?;
    let mut buf = Vec::with_capacity(meta.len() as usize);
    f.take(cap + 1).read_to_end(&mut buf)?;
    if buf.len() as u64 > cap {
        return Err(Error::new(
            ErrorKind::InvalidData,
            format!("larger than {cap} bytes"),
        ));
    }
    Ok(buf)
}

/// A named pipe at `path` (tests: a reader of it would block forever).
#[cfg(test)]
pub(crate) fn mkfifo(path: &Path) {
    use rustix::fs::{mknodat, FileType, Mode, CWD};
    mknodat(CWD, path, FileType::Fifo, Mode::from_raw_mode(0o600), 0)
        .unwrap_or_else(|e| panic!("mkfifo {}: {e}", path.display()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_table_rows_give_listeners_and_their_paths() {
        let t = "Num       RefCount Protocol Flags    Type St Inode Path\n\
                 0000000000000000: 00000002 00000000 00010000 0001 01 21746 /var/lib/libvirt/qemu/channel/target/domain-2-x/org.iospan.0\n\
                 0000000000000000: 00000003 00000000 00000000 0001 03 21747\n\
                 0000000000000000: 00000002 00000000 00010000 0001 01 30001 @abstract\n";
        let v = parse_unix_table(t);
        assert_eq!(v.len(), 3);
        assert!(v[0].listening);
        assert_eq!(v[0].inode, 21746);
        assert_eq!(
            v[0].path.as_deref(),
            Some(Path::new(
                "/var/lib/libvirt/qemu/channel/target/domain-2-x/org.iospan.0"
            ))
        );
        assert!(!v[1].listening && v[1].path.is_none());
        assert!(v[2].path.is_none(), "abstract names are no paths");
    }

    #[test]
    fn a_listener_this_process_holds_is_found_by_fd_and_by_path_and_no_other() {
        let dir_held = tempfile::Builder::new()
            .prefix("iospan-procfs-")
            .tempdir()
            .unwrap();
        let dir = dir_held.path().to_path_buf();
        let path = dir.join("chan.sock");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&l);
        let me = std::process::id();
        assert_eq!(held_listener(me, Some(fd), None), Some(path.clone()));
        assert_eq!(held_listener(me, None, Some(&path)), Some(path.clone()));
        // A path bound by nobody here, or a descriptor that is no listener.
        assert_eq!(held_listener(me, None, Some(&dir.join("other.sock"))), None);
        assert_eq!(held_listener(me, Some(0), None), None);
        drop(l);
    }

    #[test]
    fn reading_refuses_fifos_links_and_oversize_files() {
        let dir_held = tempfile::Builder::new()
            .prefix("iospan-read-")
            .tempdir()
            .unwrap();
        let dir = dir_held.path().to_path_buf();
        let file = dir.join("f");
        fs::write(&file, b"hello").unwrap();
        assert_eq!(read_regular(&file, 5).unwrap(), b"hello");
        assert!(read_regular(&file, 4).is_err(), "over the cap");
        let fifo = dir.join("fifo");
        mkfifo(&fifo);
        assert!(
            read_regular(&fifo, 1 << 20).is_err(),
            "a FIFO never blocks us"
        );
        let link = dir.join("l");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        assert!(read_regular(&link, 1 << 20).is_err(), "no link followed");
    }
}
