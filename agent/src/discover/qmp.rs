//! QMP sessions bounded in time, bytes and messages. Whoever starts a
//! process named like QEMU writes its command line and holds its monitor:
//! a monitor that never accepts, greets and then streams events, answers a
//! byte at a time, or answers with millions of empty entries costs the
//! agent one exchange's deadline and a few megabytes, never a stalled
//! thread or its memory.

use std::{
    io::{Read, Write},
    os::{fd::AsRawFd, unix::net::UnixStream},
    path::Path,
    time::{Duration, Instant},
};

use serde::de::{DeserializeOwned, IgnoredAny};

/// A whole exchange (connect, greeting, capabilities, one command), at
/// most this long: QEMU answers in about a millisecond.
pub const EXCHANGE: Duration = Duration::from_secs(2);
/// One message (a line), at most this long: QEMU's answers for hundreds
/// of disks fit many times over.
const MAX_MESSAGE: usize = 4 << 20;
/// Everything a session reads, at most.
const MAX_SESSION: usize = 2 * MAX_MESSAGE;
/// Events passed over before a command's answer, at most: QEMU sends a
/// handful at a time (a job's progress, a device's deletion).
const MAX_EVENTS: usize = 256;
/// Entries of a list answer, at most (`Capped`): a disk's block stats is
/// an entry, a node another; a host of hundreds of disks has a few
/// thousand. Without it, a 4 MiB answer of `{}`s is 1.4 million entries.
pub const MAX_ENTRIES: usize = 4096;

/// Why an exchange with a monitor failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("{0}: its backlog is full (it accepts no connection)")]
    Busy(String),
    #[error("{0}: {1}")]
    Connect(String, #[source] std::io::Error),
    #[error("{0} is not served by process {1}")]
    NotServedBy(String, u32),
    #[error("{0}: its peer is in another pid namespace: not known to be process {1}")]
    PeerUnknown(String, u32),
    #[error("{0}: no answer within {1:?} ({2})")]
    Timeout(String, Duration, &'static str),
    #[error("{0}: the monitor closed the connection")]
    Closed(String),
    #[error("{0}: more than {1} bytes ({2})")]
    TooLong(String, usize, &'static str),
    #[error("{0}: {MAX_EVENTS} events and no answer")]
    TooManyEvents(String),
    #[error("{0}: not a QMP monitor: {1}")]
    NotQmp(String, String),
    #[error("{0}: {1}: {2} ({3})")]
    Command(String, String, String, String),
    #[error("{0}: {1}: an answer not as QEMU documents it: {2}")]
    Answer(String, String, String),
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
}

impl QmpError {
    /// The reason as a metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Busy(_) => "busy",
            Self::Connect(..) | Self::Io(..) => "io",
            Self::NotServedBy(..) | Self::PeerUnknown(..) => "not_its_own",
            Self::Timeout(..) => "timeout",
            Self::Closed(_) => "closed",
            Self::TooLong(..) | Self::TooManyEvents(_) => "too_much",
            Self::NotQmp(..) | Self::Answer(..) => "not_qmp",
            Self::Command(..) => "refused",
        }
    }
}

/// QMP's messages, as much of each as is read here (QEMU's QAPI schema
/// names them; its generated bindings would be a large crate for a few
/// messages).
mod wire {
    use serde::Deserialize;

    /// The greeting: `{"QMP": {"version": …, "capabilities": …}}`.
    #[derive(Debug, Deserialize)]
    pub struct Greeting {
        #[serde(rename = "QMP")]
        pub _qmp: serde::de::IgnoredAny,
    }

    /// A message after it: a command's `return` or `error`, or an event
    /// (neither), read as `T` straight away: no `Value` tree of an answer
    /// is ever built.
    #[derive(Debug, Deserialize)]
    #[serde(bound = "T: Deserialize<'de>")]
    pub struct Reply<T> {
        #[serde(rename = "return")]
        pub ret: Option<T>,
        pub error: Option<Error>,
    }

    #[derive(Debug, Deserialize)]
    pub struct Error {
        #[serde(default)]
        pub class: String,
        #[serde(default)]
        pub desc: String,
    }
}

/// A list answer of at most `MAX_ENTRIES` entries: past it the answer is
/// refused as it is read, before the entries are kept.
#[derive(Debug, Default)]
pub struct Capped<T>(pub Vec<T>);

impl<'de, T: serde::Deserialize<'de>> serde::Deserialize<'de> for Capped<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries<T>(std::marker::PhantomData<T>);
        impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for Entries<T> {
            type Value = Capped<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "a list of at most {MAX_ENTRIES} entries")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(e) = seq.next_element()? {
                    if out.len() >= MAX_ENTRIES {
                        return Err(serde::de::Error::custom(format!(
                            "more than {MAX_ENTRIES} entries"
                        )));
                    }
                    out.push(e);
                }
                Ok(Capped(out))
            }
        }
        d.deserialize_seq(Entries(std::marker::PhantomData))
    }
}

/// A QMP session with a monitor, capabilities negotiated, ending by its
/// deadline whatever the monitor does.
pub struct Session {
    name: String,
    stream: UnixStream,
    buf: Vec<u8>,
    /// Of `buf`, the bytes already looked through for a line's end.
    scanned: usize,
    read: usize,
    until: Instant,
    within: Duration,
}

impl Session {
    /// Connects to the monitor at `socket`, which process `pid` must
    /// serve; the session ends `within` from now.
    pub fn open(socket: &Path, pid: u32, within: Duration) -> Result<Session, QmpError> {
        let name = socket.display().to_string();
        let until = Instant::now() + within;
        let stream = connect(socket, &name)?;
        // The socket is the VM's (or its engine's) own, not one put in its place.
        match peer_pid(&stream) {
            Some(0) => return Err(QmpError::PeerUnknown(name, pid)),
            Some(p) if p == pid => {}
            _ => return Err(QmpError::NotServedBy(name, pid)),
        }
        let mut s = Session {
            name,
            stream,
            buf: Vec::new(),
            scanned: 0,
            read: 0,
            until,
            within,
        };
        // A monitor takes one client at a time: another one's session shows
        // as no greeting by the deadline.
        let greeting = s.next_message("its greeting (another client may hold the monitor)")?;
        if let Err(e) = serde_json::from_slice::<wire::Greeting>(&greeting) {
            return Err(QmpError::NotQmp(s.name, e.to_string()));
        }
        s.execute::<IgnoredAny>("{\"execute\":\"qmp_capabilities\"}")?;
        Ok(s)
    }

    /// One command's `return`, as `T`; events before it are passed over,
    /// `MAX_EVENTS` at most.
    pub fn execute<T: DeserializeOwned>(&mut self, cmd: &str) -> Result<T, QmpError> {
        self.send(cmd)?;
        for _ in 0..MAX_EVENTS {
            let line = self.next_message("an answer")?;
            let reply: wire::Reply<T> = serde_json::from_slice(&line)
                .map_err(|e| QmpError::Answer(self.name.clone(), cmd.into(), e.to_string()))?;
            if let Some(e) = reply.error {
                return Err(QmpError::Command(
                    self.name.clone(),
                    cmd.into(),
                    e.desc,
                    e.class,
                ));
            }
            if let Some(ret) = reply.ret {
                return Ok(ret);
            }
        }
        Err(QmpError::TooManyEvents(self.name.clone()))
    }

    fn left(&self, what: &'static str) -> Result<Duration, QmpError> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left < Duration::from_millis(1) {
            return Err(QmpError::Timeout(self.name.clone(), self.within, what));
        }
        Ok(left)
    }

    fn send(&mut self, cmd: &str) -> Result<(), QmpError> {
        let left = self.left("taking a command")?;
        let io = |e| QmpError::Io(self.name.clone(), e);
        self.stream.set_write_timeout(Some(left)).map_err(io)?;
        match self.stream.write_all(format!("{cmd}\n").as_bytes()) {
            Ok(()) => Ok(()),
            Err(e) if timed_out(&e) => Err(QmpError::Timeout(
                self.name.clone(),
                self.within,
                "taking a command",
            )),
            Err(e) => Err(QmpError::Io(self.name.clone(), e)),
        }
    }

    /// The next line, read by the session's deadline: each read waits
    /// only for what is left of it, however the bytes trickle in.
    fn next_message(&mut self, what: &'static str) -> Result<Vec<u8>, QmpError> {
        loop {
            let unseen = self.buf.get(self.scanned..).unwrap_or_default();
            if let Some(i) = unseen.iter().position(|&b| b == b'\n') {
                let end = self.scanned.saturating_add(i).saturating_add(1);
                let line: Vec<u8> = self.buf.drain(..end).collect();
                self.scanned = 0;
                return Ok(line);
            }
            self.scanned = self.buf.len();
            if self.buf.len() > MAX_MESSAGE {
                return Err(QmpError::TooLong(
                    self.name.clone(),
                    MAX_MESSAGE,
                    "one message",
                ));
            }
            let left = self.left(what)?;
            self.fill(left, what)?;
        }
    }

    fn fill(&mut self, left: Duration, what: &'static str) -> Result<(), QmpError> {
        let mut chunk = [0u8; 64 << 10];
        if let Err(e) = self.stream.set_read_timeout(Some(left)) {
            return Err(QmpError::Io(self.name.clone(), e));
        }
        match self.stream.read(&mut chunk) {
            Ok(0) => Err(QmpError::Closed(self.name.clone())),
            Ok(n) => {
                self.read = self.read.saturating_add(n);
                if self.read > MAX_SESSION {
                    return Err(QmpError::TooLong(
                        self.name.clone(),
                        MAX_SESSION,
                        "a session",
                    ));
                }
                self.buf
                    .extend_from_slice(chunk.get(..n).unwrap_or_default());
                Ok(())
            }
            Err(e) if timed_out(&e) => Err(QmpError::Timeout(self.name.clone(), self.within, what)),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(QmpError::Io(self.name.clone(), e)),
        }
    }
}

fn timed_out(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// A connection made without waiting: a listener whose backlog is full
/// (one that never accepts) answers at once, not never.
fn connect(socket: &Path, name: &str) -> Result<UnixStream, QmpError> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let io = |e: rustix::io::Errno| QmpError::Connect(name.into(), e.into());
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )
    .map_err(io)?;
    let addr = SocketAddrUnix::new(socket).map_err(io)?;
    match rustix::net::connect(&fd, &addr) {
        Ok(()) => {}
        Err(rustix::io::Errno::AGAIN) => return Err(QmpError::Busy(name.into())),
        Err(e) => return Err(io(e)),
    }
    let stream = UnixStream::from(fd);
    stream
        .set_nonblocking(false)
        .map_err(|e| QmpError::Io(name.into(), e))?;
    Ok(stream)
}

/// The pid of the process at the other end (0: one the kernel cannot
/// name in our pid namespace).
fn peer_pid(s: &UnixStream) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for the call and describe `cred`;
    // the socket is open for as long as `s` lives.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(u32::try_from(cred.pid).unwrap_or(0))
}

#[cfg(test)]
mod tests;
