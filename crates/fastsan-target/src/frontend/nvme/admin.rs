//! What the NVMe admin commands answer, as bytes: Identify (controller,
//! namespace, active namespace list, namespace identification descriptors,
//! the NVM command set's controller page), the log pages (error, SMART,
//! firmware, changed namespaces, discovery), and the controller properties
//! (CAP, VS, CC, CSTS). Pure functions of the subsystem's state, so each
//! field a host reads is checked by a unit test; the offsets and the
//! reasons for each value are in docs/nvme-tcp.md section 7.

use super::{Controller, Namespace, Subsystem, DISCOVERY_NQN, IN_CAPSULE, QUEUE_ENTRIES};
use std::net::SocketAddr;

/// Identify and most log pages are 4 KiB.
pub const PAGE: usize = 4096;
/// NVMe 1.3: the host then uses the active namespace list (CNS 2) and the
/// namespace identification descriptors (CNS 3).
pub const VERSION: u32 = 0x0001_0300;
/// Keep-alive granularity the host may use (KAS, in 100 ms units).
const KAS: u16 = 10;
/// Asynchronous events the host may keep outstanding (AERL + 1).
pub const AER_LIMIT: u16 = 4;
/// CAP.TO: how long the host waits for CSTS.RDY (500 ms units): 7.5 s.
const READY_TIMEOUT: u64 = 15;

/// CAP: queue entries (0's based), the timeout, the NVM command set (bit 37),
/// memory page size 4 KiB (MPSMIN = MPSMAX = 0).
pub fn cap() -> u64 {
    (QUEUE_ENTRIES as u64 - 1) | READY_TIMEOUT << 24 | 1 << 37
}

fn put(b: &mut [u8], at: usize, v: &[u8]) {
    b[at..at + v.len()].copy_from_slice(v);
}

/// An ASCII field padded with spaces (SN, MN, FR).
fn ascii(b: &mut [u8], at: usize, len: usize, s: &str) {
    let f = &mut b[at..at + len];
    f.fill(b' ');
    let n = s.len().min(len);
    f[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// A NUL-padded string field (NQNs, addresses).
fn nul(b: &mut [u8], at: usize, len: usize, s: &str) {
    let n = s.len().min(len - 1);
    b[at..at + n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Identify Controller (CNS 1).
pub fn identify_controller(sub: &Subsystem, ctrl: &Controller) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    ascii(&mut b, 4, 20, &sub.serial);
    ascii(&mut b, 24, 40, "fastsan");
    ascii(&mut b, 64, 8, env!("CARGO_PKG_VERSION"));
    b[72] = 6; // RAB
               // CMIC bit 1: the subsystem may have several controllers (one per host connection).
    b[76] = 1 << 1;
    b[77] = sub.mdts;
    put(&mut b, 78, &ctrl.cntlid.to_le_bytes());
    put(&mut b, 80, &VERSION.to_le_bytes());
    // CNTRLTYPE: 1 I/O controller, 2 discovery controller.
    b[111] = if ctrl.discovery { 2 } else { 1 };
    b[259] = (AER_LIMIT - 1) as u8; // AERL
    b[261] = 1 << 2; // LPA: extended data (offsets) for Get Log Page
    put(&mut b, 320, &KAS.to_le_bytes());
    b[512] = 0x66; // SQES: 64-byte entries
    b[513] = 0x44; // CQES: 16-byte entries
    put(&mut b, 514, &QUEUE_ENTRIES.to_le_bytes()); // MAXCMD
    if !ctrl.discovery {
        put(&mut b, 516, &(sub.namespaces.len() as u32).to_le_bytes()); // NN
                                                                        // ONCS: Dataset Management (deallocate) always (a hint: a no-op on a
                                                                        // volume that cannot trim); Write Zeroes when every volume can.
        let zeroes = sub.namespaces.iter().all(|n| n.volume.caps().zero);
        let oncs: u16 = 1 << 2 | if zeroes { 1 << 3 } else { 0 };
        put(&mut b, 520, &oncs.to_le_bytes());
        b[525] = 1; // VWC: a volatile write cache: the host sends FLUSH and FUA
    }
    // SGLS: SGLs supported (bit 0), offsets for in-capsule data (bit 20).
    put(&mut b, 536, &(1u32 | 1 << 20).to_le_bytes());
    let nqn = if ctrl.discovery { DISCOVERY_NQN } else { &sub.nqn };
    nul(&mut b, 768, 256, nqn);
    // Fabrics: IOCCSZ (command plus in-capsule data, 16-byte units), IORCSZ, ICDOFF 0, MSDBD 1.
    put(&mut b, 1792, &((64 + IN_CAPSULE) / 16).to_le_bytes());
    put(&mut b, 1796, &1u32.to_le_bytes());
    b[1803] = 1;
    // One power state, 0 W reported.
    b
}

/// Identify Namespace (CNS 0): one LBA format, no metadata.
pub fn identify_namespace(ns: &Namespace, read_only: bool) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    let blocks = ns.volume.size() >> ns.lba_shift;
    for at in [0, 8, 16] {
        put(&mut b, at, &blocks.to_le_bytes()); // NSZE, NCAP, NUSE
    }
    b[24] = if ns.volume.caps().trim { 1 } else { 0 }; // NSFEAT: thin provisioning
    b[30] = 1; // NMIC: may be attached to several controllers
    b[99] = read_only as u8; // NSATTR: write protected
    put(&mut b, 104, &ns.nguid);
    b[128 + 2] = ns.lba_shift; // LBAF[0].LBADS
    b
}

/// Active namespace list (CNS 2): NSIDs above `after`, ascending.
pub fn active_namespaces(ctrl: &Controller, after: u32) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    let ids = (1..=ctrl.access.len() as u32).filter(|&id| id > after && ctrl.namespace(id).is_some());
    for (i, id) in ids.take(PAGE / 4).enumerate() {
        put(&mut b, 4 * i, &id.to_le_bytes());
    }
    b
}

/// Namespace identification descriptors (CNS 3): NGUID, UUID, CSI (NVM).
pub fn namespace_descriptors(ns: &Namespace) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    let mut at = 0;
    for (nidt, id) in [(2u8, &ns.nguid[..]), (3, &ns.uuid[..]), (4, &[0u8][..])] {
        b[at] = nidt;
        b[at + 1] = id.len() as u8;
        put(&mut b, at + 4, id);
        at += 4 + id.len();
    }
    b
}

/// The NVM command set's Identify Controller (CNS 6, CSI 0): one range per
/// Dataset Management command (DMRL 1), so a deallocate is one TRIM.
pub fn identify_controller_nvm() -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    b[3] = 1; // DMRL
    b
}

/// SMART / health (log 2, 512 bytes): a healthy device, with the volumes'
/// own counters (units of 1000 blocks of 512 bytes, as the spec counts);
/// once a volume's flush failed (it fails every command until the target
/// reopens it), the critical warning "reliability degraded" (bit 2).
pub fn smart_log(namespaces: &[&Namespace]) -> Vec<u8> {
    let mut b = vec![0u8; 512];
    if namespaces.iter().any(|ns| ns.volume.failed()) {
        b[0] |= 1 << 2;
    }
    put(&mut b, 1, &(273u16 + 25).to_le_bytes()); // 25 C, in kelvins
    b[3] = 100; // available spare
    b[4] = 10; // its threshold
    let (mut read, mut written, mut reads, mut writes) = (0u128, 0u128, 0u128, 0u128);
    for ns in namespaces {
        let s = ns.volume.stats();
        read += s.bytes_read as u128;
        written += s.bytes_written as u128;
        reads += s.reads as u128;
        writes += s.writes as u128;
    }
    put(&mut b, 32, &(read / 512_000).to_le_bytes());
    put(&mut b, 48, &(written / 512_000).to_le_bytes());
    put(&mut b, 64, &reads.to_le_bytes());
    put(&mut b, 80, &writes.to_le_bytes());
    b
}

/// The discovery log page (log 0x70): this discovery controller, then the
/// subsystem, both at `via` (the address the host reached).
pub fn discovery_log(sub: &Subsystem, via: Option<SocketAddr>) -> Vec<u8> {
    const ENTRY: usize = 1024;
    let entries = [(3u8, DISCOVERY_NQN), (2u8, sub.nqn.as_str())];
    let mut b = vec![0u8; ENTRY * (1 + entries.len())];
    put(&mut b, 0, &1u64.to_le_bytes()); // GENCTR: the log never changes while the target runs
    put(&mut b, 8, &(entries.len() as u64).to_le_bytes()); // NUMREC
    let (family, addr, port) = match via {
        Some(SocketAddr::V4(a)) => (1u8, a.ip().to_string(), a.port()),
        Some(SocketAddr::V6(a)) => (2u8, a.ip().to_string(), a.port()),
        None => (1u8, String::new(), 0),
    };
    for (i, (subtype, nqn)) in entries.into_iter().enumerate() {
        let e = &mut b[ENTRY * (i + 1)..ENTRY * (i + 2)];
        e[0] = 3; // TRTYPE: TCP
        e[1] = family;
        e[2] = subtype;
        e[3] = 0x02; // TREQ: secure channel not required
        put(e, 6, &0xffffu16.to_le_bytes()); // CNTLID: dynamic
        put(e, 8, &32u16.to_le_bytes()); // ASQSZ
        ascii(e, 32, 32, &port.to_string());
        nul(e, 256, 256, nqn);
        ascii(e, 512, 256, &addr);
    }
    b
}

/// `page[offset..offset + len]`, zero-filled past its end, or `None` when
/// the offset is beyond the page.
pub fn slice_of(page: &[u8], offset: u64, len: usize) -> Option<Vec<u8>> {
    let start = usize::try_from(offset).ok().filter(|&o| o <= page.len())?;
    let mut v = vec![0u8; len];
    let n = (page.len() - start).min(len);
    v[..n].copy_from_slice(&page[start..start + n]);
    Some(v)
}
