//! Who is at the other end of a connection, for fair shares of the API's
//! slots and streams: on loopback the user owning the client's socket (the
//! kernel's socket table, asked over sock_diag: TCP carries no
//! credentials), elsewhere the client's address. A flood from one user or
//! one address then takes the slots of that user or address, not those of
//! everyone else.

use std::{
    mem::size_of,
    net::{IpAddr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

/// A connection's owner, as far as the agent can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Peer {
    /// A local user (loopback).
    Uid(u32),
    /// A remote address, or a loopback client whose socket the kernel did
    /// not name.
    Addr(IpAddr),
}

/// The peer of a connection from `client` to our `local` address.
pub fn of(client: SocketAddr, local: SocketAddr) -> Peer {
    if client.ip().is_loopback() {
        if let Some(uid) = owner(client, local) {
            return Peer::Uid(uid);
        }
    }
    Peer::Addr(client.ip())
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;

/// `struct inet_diag_sockid` (linux/inet_diag.h): ports and addresses in
/// network order.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SockId {
    sport: u16,
    dport: u16,
    src: [u32; 4],
    dst: [u32; 4],
    ifindex: u32,
    cookie: [u32; 2],
}

/// `struct inet_diag_req_v2` after its netlink header.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Request {
    len: u32,
    kind: u16,
    flags: u16,
    seq: u32,
    pid: u32,
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: SockId,
}

/// `struct inet_diag_msg` after its netlink header: the fields up to the
/// owner's uid.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Reply {
    len: u32,
    kind: u16,
    flags: u16,
    seq: u32,
    pid: u32,
    family: u8,
    state: u8,
    timer: u8,
    retrans: u8,
    id: SockId,
    expires: u32,
    rqueue: u32,
    wqueue: u32,
    uid: u32,
    inode: u32,
}

fn words(ip: IpAddr) -> [u32; 4] {
    match ip {
        IpAddr::V4(v4) => [u32::from_ne_bytes(v4.octets()), 0, 0, 0],
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            [w(0), w(4), w(8), w(12)]
        }
    }
}

/// The uid owning the client's end, by an exact lookup of its 4-tuple.
fn owner(client: SocketAddr, local: SocketAddr) -> Option<u32> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned
    // at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let family = if client.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let req = Request {
        len: size_of::<Request>() as u32,
        kind: SOCK_DIAG_BY_FAMILY,
        flags: libc::NLM_F_REQUEST as u16,
        family: family as u8,
        protocol: libc::IPPROTO_TCP as u8,
        states: u32::MAX,
        id: SockId {
            sport: client.port().to_be(),
            dport: local.port().to_be(),
            src: words(client.ip()),
            dst: words(local.ip()),
            cookie: [u32::MAX; 2],
            ..SockId::default()
        },
        ..Request::default()
    };
    // SAFETY: `req` is plain data of the length given.
    let sent = unsafe {
        libc::send(
            fd.as_raw_fd(),
            (&req as *const Request).cast(),
            size_of::<Request>(),
            0,
        )
    };
    if sent < 0 {
        return None;
    }
    let mut buf = [0u8; 512];
    // SAFETY: `buf` is writable for its length. The kernel answers within
    // the send: the receive does not wait.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    let n = usize::try_from(n).ok()?;
    if n < size_of::<Reply>() {
        return None;
    }
    // SAFETY: at least `size_of::<Reply>()` bytes were read into `buf`;
    // `Reply` is plain data valid for any bytes, read unaligned.
    let reply: Reply = unsafe { std::ptr::read_unaligned(buf.as_ptr().cast()) };
    (reply.kind == SOCK_DIAG_BY_FAMILY).then_some(reply.uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_client_is_named_by_its_user() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, client) = l.accept().unwrap();
        let me = rustix::process::geteuid().as_raw();
        assert_eq!(of(client, s.local_addr().unwrap()), Peer::Uid(me));
        drop(c);
    }

    #[test]
    fn a_remote_client_is_named_by_its_address() {
        let a: SocketAddr = "192.0.2.7:4444".parse().unwrap();
        let l: SocketAddr = "192.0.2.1:9464".parse().unwrap();
        assert_eq!(of(a, l), Peer::Addr(a.ip()));
    }
}
