//! The API's token file: made by the agent at its first start (the
//! package's unit runs it as root), read by root's tools. A secret kept in
//! a file is out of argv, out of the configuration and out of the journal.

use std::{
    io::{Read, Write},
    os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt},
    path::Path,
};

use anyhow::{bail, Context, Result};

/// Where the agent keeps its generated token (the unit's StateDirectory).
pub const DEFAULT_FILE: &str = "/var/lib/iospan/api-token";

/// A token file's size, at most.
const MAX_LEN: u64 = 4096;

/// The token in `path`; made there (256 random bits, hex, mode 0600, in a
/// 0700 directory when that is missing) when no file exists.
pub fn load_or_create(path: &Path) -> Result<String> {
    match read(path) {
        Ok(t) => return Ok(t),
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::NotFound) => {}
        Err(e) => return Err(e),
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| {
                format!("api.token_file = {}: making its directory", path.display())
            })?;
    }
    let token = generate()?;
    // Written aside, then linked into place: a second agent starting at the
    // same moment finds either no file or the whole token, never a part.
    let aside = path.with_extension(format!("new-{}-{}", std::process::id(), &token[..16]));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&aside)
        .with_context(|| format!("api.token_file = {}: creating", path.display()))?;
    f.write_all(format!("{token}\n").as_bytes())
        .and_then(|_| f.sync_all())
        .with_context(|| format!("api.token_file = {}: writing", path.display()))?;
    drop(f);
    // link(2) never replaces: whoever links first, its token stands.
    let linked = std::fs::hard_link(&aside, path);
    let _ = std::fs::remove_file(&aside);
    match linked {
        Ok(()) => {
            log::info!(
                "API token made in {} (send it as \"Authorization: Bearer …\" to start and \
                 stop runs)",
                path.display()
            );
            Ok(token)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read(path),
        Err(e) => Err(e).with_context(|| format!("api.token_file = {}: creating", path.display())),
    }
}

/// The token in `path`, which must be a regular file (not a link) owned by
/// this user and closed to everyone else.
pub fn read(path: &Path) -> Result<String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| format!("token file {}", path.display()))?;
    let meta = f
        .metadata()
        .with_context(|| format!("token file {}", path.display()))?;
    if !meta.file_type().is_file() {
        bail!("token file {}: not a regular file", path.display());
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        bail!(
            "token file {}: owned by uid {}, not by this user (uid {me}): a file someone else \
             controls is not a credential",
            path.display(),
            meta.uid()
        );
    }
    if meta.mode() & 0o077 != 0 {
        bail!(
            "token file {}: mode {:04o} lets others read it: chmod 600 {}",
            path.display(),
            meta.mode() & 0o7777,
            path.display()
        );
    }
    let mut text = String::new();
    f.take(MAX_LEN + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("token file {}: text", path.display()))?;
    if text.len() as u64 > MAX_LEN {
        bail!("token file {}: longer than {MAX_LEN} bytes", path.display());
    }
    let token = text.trim();
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        bail!(
            "token file {}: empty, or not one line of printable characters",
            path.display()
        );
    }
    Ok(token.to_string())
}

fn generate() -> Result<String> {
    let mut buf = [0u8; 32];
    let mut got = 0;
    while got < buf.len() {
        match rustix::rand::getrandom(&mut buf[got..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => got += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(std::io::Error::from(e)).context("getrandom for the API token"),
        }
    }
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discover::procfs::mkfifo;
    use std::os::unix::fs::PermissionsExt;

    /// A directory not made yet, in a scratch one removed with the guard.
    fn dir(name: &str) -> (tempfile::TempDir, std::path::PathBuf) {
        let held = tempfile::Builder::new()
            .prefix(&format!("iospan-token-{name}-"))
            .tempdir()
            .unwrap();
        let d = held.path().join("state");
        (held, d)
    }

    #[test]
    fn a_token_is_made_once_private_and_read_back() {
        let (_held, d) = dir("made");
        let path = d.join("state/api-token");
        let t = load_or_create(&path).unwrap();
        assert_eq!(t.len(), 64);
        assert!(t.bytes().all(|b| b.is_ascii_hexdigit()));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dmode = std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dmode, 0o700);
        // The second start reads the same one.
        assert_eq!(load_or_create(&path).unwrap(), t);
        assert_ne!(load_or_create(&d.join("other")).unwrap(), t);
    }

    #[test]
    fn agents_starting_together_get_one_token() {
        let (_held, d) = dir("race");
        let path = d.join("api-token");
        for _ in 0..20 {
            let _ = std::fs::remove_file(&path);
            let got: Vec<String> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..8)
                    .map(|_| s.spawn(|| load_or_create(&path).unwrap()))
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert!(got.iter().all(|t| *t == got[0]), "{got:?}");
        }
        // Nothing left aside.
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
    }

    #[test]
    fn open_linked_and_odd_token_files_are_refused() {
        let (_held, d) = dir("refused");
        std::fs::create_dir_all(&d).unwrap();
        let open = d.join("open");
        std::fs::write(&open, "abc\n").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = format!("{:#}", read(&open).unwrap_err());
        assert!(e.contains("chmod 600"), "{e}");
        // Not even to make a new one over it.
        assert!(load_or_create(&open).is_err());
        let link = d.join("link");
        std::os::unix::fs::symlink(&open, &link).unwrap();
        assert!(read(&link).is_err());
        assert!(load_or_create(&link).is_err());
        let blank = d.join("blank");
        std::fs::write(&blank, "\n").unwrap();
        std::fs::set_permissions(&blank, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(format!("{:#}", read(&blank).unwrap_err()).contains("empty"));
        let fifo = d.join("fifo");
        mkfifo(&fifo);
        assert!(format!("{:#}", read(&fifo).unwrap_err()).contains("regular"));
        let good = d.join("good");
        std::fs::write(&good, "  s3cret \n").unwrap();
        std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read(&good).unwrap(), "s3cret");
    }
}
