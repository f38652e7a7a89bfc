//! The kernel NBD driver's generic-netlink interface (`nbd-netlink.h`):
//! connect a device to sockets, give it a new socket for one it closed,
//! disconnect it, ask its status.
//!
//! Written by hand: three fixed messages of a simple TLV format. The
//! `nbd-netlink` crate covers connect only (no device index, timeouts,
//! disconnect or status), and a general netlink crate brings a macro
//! framework for what is here a few dozen lines.
//!
//! ```text
//! nlmsghdr   len u32, type u16 (the family's id), flags u16, seq u32, pid u32   (host byte order)
//! genlmsghdr cmd u8, version u8, reserved u16
//! attributes len u16, type u16, payload, padded to 4 bytes; nested ones hold attributes
//! ```

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLA_F_NESTED: u16 = 1 << 15;
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;

const NBD_CMD_CONNECT: u8 = 1;
const NBD_CMD_DISCONNECT: u8 = 2;
const NBD_CMD_RECONFIGURE: u8 = 3;
const NBD_CMD_STATUS: u8 = 5;
const NBD_ATTR_INDEX: u16 = 1;
const NBD_ATTR_SIZE_BYTES: u16 = 2;
const NBD_ATTR_BLOCK_SIZE_BYTES: u16 = 3;
const NBD_ATTR_TIMEOUT: u16 = 4;
const NBD_ATTR_SERVER_FLAGS: u16 = 5;
const NBD_ATTR_CLIENT_FLAGS: u16 = 6;
const NBD_ATTR_SOCKETS: u16 = 7;
const NBD_ATTR_DEAD_CONN_TIMEOUT: u16 = 8;
const NBD_ATTR_DEVICE_LIST: u16 = 9;
const NBD_SOCK_ITEM: u16 = 1;
const NBD_SOCK_FD: u16 = 1;
const NBD_DEVICE_ITEM: u16 = 1;
const NBD_DEVICE_INDEX: u16 = 1;
const NBD_DEVICE_CONNECTED: u16 = 2;
/// The device disconnects when its last opener closes it (not used here:
/// `dd` or `blkid` would end the attachment).
pub const NBD_CFLAG_DISCONNECT_ON_CLOSE: u64 = 1 << 1;

/// What to connect a device with.
#[derive(Debug, Clone, Default)]
pub struct Connect {
    /// The device's index (`/dev/nbdN`); the kernel picks a free one if none.
    pub index: Option<u32>,
    pub size: u64,
    pub block_size: u64,
    /// The NBD transmission flags (`NBD_FLAG_*`).
    pub server_flags: u64,
    pub client_flags: u64,
    /// Seconds before the kernel gives up on a request (0: it waits, and
    /// warns every 30 s).
    pub timeout: u64,
    /// Seconds the kernel waits for a dead connection to be replaced.
    pub dead_conn_timeout: u64,
    pub sockets: Vec<RawFd>,
}

/// A generic-netlink socket resolved to the `nbd` family.
pub struct NbdNetlink {
    fd: OwnedFd,
    family: u16,
    seq: u32,
}

impl NbdNetlink {
    /// Opens the socket and resolves the family. `Ok(None)` when the kernel
    /// has no `nbd` family (the module is not loaded, or too old for netlink).
    pub fn open() -> io::Result<Option<NbdNetlink>> {
        // SAFETY: plain socket(2); the result is checked.
        let fd = unsafe {
            libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_GENERIC)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut nl = NbdNetlink { fd, family: GENL_ID_CTRL, seq: 0 };
        let mut attrs = Vec::new();
        put(&mut attrs, CTRL_ATTR_FAMILY_NAME, b"nbd\0");
        match nl.request(CTRL_CMD_GETFAMILY, 1, &attrs) {
            Ok(reply) => {
                let id = find(&reply, CTRL_ATTR_FAMILY_ID).and_then(u16_of).ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidData, "the kernel's family reply has no id")
                })?;
                nl.family = id;
                Ok(Some(nl))
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Connects a device; returns its index.
    pub fn connect(&mut self, c: &Connect) -> io::Result<u32> {
        let mut attrs = Vec::new();
        if let Some(i) = c.index {
            put(&mut attrs, NBD_ATTR_INDEX, &i.to_ne_bytes());
        }
        put(&mut attrs, NBD_ATTR_SIZE_BYTES, &c.size.to_ne_bytes());
        put(&mut attrs, NBD_ATTR_BLOCK_SIZE_BYTES, &c.block_size.to_ne_bytes());
        put(&mut attrs, NBD_ATTR_SERVER_FLAGS, &c.server_flags.to_ne_bytes());
        put(&mut attrs, NBD_ATTR_CLIENT_FLAGS, &c.client_flags.to_ne_bytes());
        if c.timeout > 0 {
            put(&mut attrs, NBD_ATTR_TIMEOUT, &c.timeout.to_ne_bytes());
        }
        if c.dead_conn_timeout > 0 {
            put(&mut attrs, NBD_ATTR_DEAD_CONN_TIMEOUT, &c.dead_conn_timeout.to_ne_bytes());
        }
        put_sockets(&mut attrs, &c.sockets);
        let reply = self.request(NBD_CMD_CONNECT, 1, &attrs)?;
        find(&reply, NBD_ATTR_INDEX)
            .and_then(u32_of)
            .or(c.index)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "the kernel did not say which device"))
    }

    /// Gives connected device `index` a socket in place of one it took for
    /// dead (a request past its timeout shuts that socket): the kernel puts
    /// it in its first dead slot and starts reading replies there. With no
    /// dead slot, the kernel drops the socket and still says yes.
    pub fn reconfigure(&mut self, index: u32, socket: RawFd) -> io::Result<()> {
        let mut attrs = Vec::new();
        put(&mut attrs, NBD_ATTR_INDEX, &index.to_ne_bytes());
        put_sockets(&mut attrs, &[socket]);
        self.request(NBD_CMD_RECONFIGURE, 1, &attrs).map(drop)
    }

    /// Disconnects device `index`: the kernel sends NBD_CMD_DISC on its sockets.
    pub fn disconnect(&mut self, index: u32) -> io::Result<()> {
        let mut attrs = Vec::new();
        put(&mut attrs, NBD_ATTR_INDEX, &index.to_ne_bytes());
        self.request(NBD_CMD_DISCONNECT, 1, &attrs).map(drop)
    }

    /// Whether device `index` is connected (`None`: no such device).
    pub fn connected(&mut self, index: u32) -> io::Result<Option<bool>> {
        let mut attrs = Vec::new();
        put(&mut attrs, NBD_ATTR_INDEX, &index.to_ne_bytes());
        let reply = match self.request(NBD_CMD_STATUS, 1, &attrs) {
            Ok(r) => r,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(None),
            Err(e) => return Err(e),
        };
        let Some(list) = find(&reply, NBD_ATTR_DEVICE_LIST) else { return Ok(None) };
        for (kind, item) in attrs_of(list) {
            if kind != NBD_DEVICE_ITEM {
                continue;
            }
            if find(item, NBD_DEVICE_INDEX).and_then(u32_of) == Some(index) {
                return Ok(Some(find(item, NBD_DEVICE_CONNECTED).is_some_and(|v| v.first() == Some(&1))));
            }
        }
        Ok(None)
    }

    /// Sends one request and returns the attributes of its reply (empty
    /// when the kernel only acknowledged it). A kernel error is returned
    /// with its errno.
    fn request(&mut self, cmd: u8, version: u8, attrs: &[u8]) -> io::Result<Vec<u8>> {
        self.seq = self.seq.wrapping_add(1);
        let len = 16 + 4 + attrs.len();
        let mut msg = Vec::with_capacity(len);
        msg.extend_from_slice(&(len as u32).to_ne_bytes());
        msg.extend_from_slice(&self.family.to_ne_bytes());
        msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        msg.extend_from_slice(&self.seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(&[cmd, version, 0, 0]);
        msg.extend_from_slice(attrs);
        // SAFETY: the buffer is valid for its length; the kernel is the
        // default destination of a netlink socket.
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut data = Vec::new();
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            // SAFETY: the buffer is valid for its length.
            let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let mut rest = &buf[..n as usize];
            while rest.len() >= 16 {
                let mlen = u32::from_ne_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
                let kind = u16::from_ne_bytes(rest[4..6].try_into().expect("2 bytes"));
                let seq = u32::from_ne_bytes(rest[8..12].try_into().expect("4 bytes"));
                if mlen < 16 || mlen > rest.len() {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "malformed netlink reply"));
                }
                let body = &rest[16..mlen];
                rest = &rest[align(mlen).min(rest.len())..];
                if seq != self.seq {
                    continue;
                }
                match kind {
                    NLMSG_ERROR => {
                        let code = body.get(0..4).map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")));
                        return match code {
                            Some(0) => Ok(data),
                            Some(c) => Err(io::Error::from_raw_os_error(-c)),
                            None => Err(io::Error::new(io::ErrorKind::InvalidData, "short netlink error")),
                        };
                    }
                    NLMSG_DONE => return Ok(data),
                    _ if body.len() >= 4 => data.extend_from_slice(&body[4..]),
                    _ => {}
                }
            }
        }
    }
}

/// NBD_ATTR_SOCKETS: one NBD_SOCK_ITEM holding NBD_SOCK_FD per socket.
fn put_sockets(attrs: &mut Vec<u8>, sockets: &[RawFd]) {
    let mut socks = Vec::new();
    for fd in sockets {
        let mut item = Vec::new();
        put(&mut item, NBD_SOCK_FD, &(*fd as u32).to_ne_bytes());
        put(&mut socks, NBD_SOCK_ITEM | NLA_F_NESTED, &item);
    }
    put(attrs, NBD_ATTR_SOCKETS | NLA_F_NESTED, &socks);
}

fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// Appends one attribute.
fn put(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    out.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    out.resize(align(out.len()), 0);
}

/// The attributes in `buf`, as (type without flags, payload); stops at the
/// first malformed one.
fn attrs_of(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & 0x3fff;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        buf = &buf[align(len).min(buf.len())..];
        Some((kind, payload))
    })
}

fn find(buf: &[u8], kind: u16) -> Option<&[u8]> {
    attrs_of(buf).find(|(k, _)| *k == kind).map(|(_, p)| p)
}

fn u16_of(b: &[u8]) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(0..2)?.try_into().ok()?))
}

fn u32_of(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(0..4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_padded_and_read_back() {
        let mut b = Vec::new();
        put(&mut b, 2, b"nbd\0");
        put(&mut b, 1, &[7u8]);
        let mut inner = Vec::new();
        put(&mut inner, NBD_SOCK_FD, &9u32.to_ne_bytes());
        put(&mut b, NBD_ATTR_SOCKETS | NLA_F_NESTED, &inner);
        assert_eq!(b.len() % 4, 0);
        assert_eq!(find(&b, 2), Some(&b"nbd\0"[..]));
        assert_eq!(find(&b, 1), Some(&[7u8][..]));
        let socks = find(&b, NBD_ATTR_SOCKETS).expect("nested attribute");
        assert_eq!(find(socks, NBD_SOCK_FD).and_then(u32_of), Some(9));
        assert_eq!(find(&b, 5), None);
    }

    #[test]
    fn malformed_attributes_end_the_walk() {
        // A length past the end, then a length below the header's.
        assert_eq!(attrs_of(&[40, 0, 1, 0, 0, 0]).count(), 0);
        assert_eq!(attrs_of(&[2, 0, 1, 0]).count(), 0);
        assert_eq!(attrs_of(&[]).count(), 0);
    }

    #[test]
    fn the_generic_netlink_controller_answers() {
        // Every Linux kernel has the controller; it knows the nbd family
        // exactly when the nbd driver is loaded (else it answers ENOENT).
        let loaded = std::path::Path::new("/sys/module/nbd").exists();
        match NbdNetlink::open() {
            Ok(found) => assert_eq!(found.is_some(), loaded),
            Err(e) => panic!("generic netlink is unusable here: {e}"),
        }
    }
}
