//! A volume as one file on a FUSE mount, for `losetup`, `mkfs` and
//! databases where the kernel has no NBD driver. fsync is FLUSH, O_SYNC
//! writes are FUA, fallocate punch-hole and zero-range are WRITE_ZEROES,
//! O_DIRECT goes straight to the volume; a write of part of a block is a
//! read-merge-write under a lock.

use crate::Remote;
use bytes::{Bytes, BytesMut};
use fastsan_initiator::Error;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, LockOwner, MountOption,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, WriteFlags,
};
use parking_lot::RwLock;
use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, SystemTime};
use tracing::warn;

/// Mounts `dir` holding one file, `name`, backed by `vol`, served by
/// `threads` FUSE threads.
pub fn mount(
    vol: Remote,
    name: &str,
    dir: &Path,
    threads: usize,
) -> std::io::Result<fuser::BackgroundSession> {
    let fs = VolumeFile::new(vol, name.to_owned(), tokio::runtime::Handle::current());
    let mut cfg = fuser::Config::default();
    cfg.mount_options =
        vec![MountOption::FSName(format!("fastsan:{name}")), MountOption::Subtype("fastsan".into())];
    cfg.n_threads = Some(threads);
    fuser::spawn_mount(fs, dir, &cfg)
}

/// Unmounts `dir` (EBUSY while a loop device or an open file holds it);
/// not as root, through fusermount3 -u.
pub fn umount(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: a valid NUL-terminated path; no flags.
    if unsafe { libc::umount2(path.as_ptr(), 0) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EPERM) {
        return Err(e);
    }
    // Not root: the setuid helper unmounts for us, and not lazily (a lazy
    // unmount of a file in use hid the mount while it stayed in use, and
    // the detach that asked for it waited in vain).
    for helper in ["fusermount3", "fusermount"] {
        match std::process::Command::new(helper).arg("-u").arg(dir).output() {
            Ok(out) if out.status.success() => return Ok(()),
            Ok(out) if String::from_utf8_lossy(&out.stderr).contains("busy") => {
                return Err(std::io::Error::from_raw_os_error(libc::EBUSY))
            }
            Ok(out) => {
                return Err(std::io::Error::other(format!(
                    "{helper} -u: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )))
            }
            Err(_) => continue,
        }
    }
    Err(e)
}

const DIR: INodeNo = INodeNo::ROOT;
const FILE: INodeNo = INodeNo(2);
const TTL: Duration = Duration::from_secs(1);

/// The volume as one file in one directory.
struct VolumeFile {
    vol: Remote,
    name: String,
    rt: tokio::runtime::Handle,
    /// Writes that cover whole blocks share it; a write of part of a block
    /// (read, merge, write back) holds it alone, so no other write to that
    /// block can slip in between its read and its write.
    partial: RwLock<()>,
    started: SystemTime,
    uid: u32,
    gid: u32,
}

impl VolumeFile {
    fn new(vol: Remote, name: String, rt: tokio::runtime::Handle) -> Self {
        // SAFETY: getuid and getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        VolumeFile { vol, name, rt, partial: RwLock::new(()), started: SystemTime::now(), uid, gid }
    }

    fn attr(&self, ino: INodeNo) -> FileAttr {
        let file = ino == FILE;
        let size = if file { self.size() } else { 0 };
        let perm = match (file, self.vol.read_only()) {
            (false, _) => 0o755,
            (true, false) => 0o644,
            (true, true) => 0o444,
        };
        FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind: if file { FileType::RegularFile } else { FileType::Directory },
            perm,
            nlink: if file { 1 } else { 2 },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            flags: 0,
            // What stdio buffers by: at least a page, never the 512-byte sector.
            blksize: self.vol.block_size().max(4096),
        }
    }

    fn block(&self) -> u64 {
        self.vol.block_size() as u64
    }

    /// The file's size: the volume's whole blocks (an NBD export may end
    /// inside its minimum block, which can be neither read nor written; the
    /// last bytes read as an error before), as the kernel's device has.
    fn size(&self) -> u64 {
        self.vol.size() / self.block() * self.block()
    }

    /// `[offset, offset + len)` widened to whole blocks.
    fn widen(&self, offset: u64, len: u64) -> (u64, u64) {
        let bs = self.block();
        let start = offset / bs * bs;
        (start, (offset + len).div_ceil(bs) * bs - start)
    }

    fn read(&self, offset: u64, size: u64) -> Result<Bytes, Errno> {
        let end = (offset + size).min(self.size());
        if offset >= end {
            return Ok(Bytes::new());
        }
        let (start, len) = self.widen(offset, end - offset);
        let data = self.rt.block_on(self.vol.read(start, len)).map_err(errno)?;
        Ok(data.slice((offset - start) as usize..(end - start) as usize))
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), Errno> {
        if offset + data.len() as u64 > self.size() {
            return Err(Errno::ENOSPC);
        }
        let bs = self.block();
        if offset.is_multiple_of(bs) && (data.len() as u64).is_multiple_of(bs) {
            let _shared = self.partial.read();
            return self.rt.block_on(self.vol.write_at(data, offset, fua)).map_err(errno);
        }
        // Part of a block: read the whole blocks, merge, write them back.
        let _alone = self.partial.write();
        let (start, len) = self.widen(offset, data.len() as u64);
        let old = self.rt.block_on(self.vol.read(start, len)).map_err(errno)?;
        let mut merged = BytesMut::from(&old[..]);
        let at = (offset - start) as usize;
        merged[at..at + data.len()].copy_from_slice(data);
        self.rt.block_on(self.vol.write_bytes(merged.freeze(), start, fua)).map_err(errno)
    }

    /// fallocate: PUNCH_HOLE (with KEEP_SIZE) and ZERO_RANGE are both
    /// WRITE_ZEROES (a punched hole must read as zeros, which BRP's TRIM does
    /// not promise; without NO_HOLE the target may still free the space);
    /// the edges of partial blocks are written with zeros. With KEEP_SIZE a
    /// range past the end is cut at the end, as files do; plain allocation
    /// inside the volume has nothing to do.
    fn fallocate(&self, offset: u64, len: u64, mode: i32) -> Result<(), Errno> {
        let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let size = self.size();
        let len = match offset.checked_add(len) {
            Some(end) if end <= size => len,
            Some(_) | None if keep => size.saturating_sub(offset),
            _ => return Err(Errno::ENOSPC),
        };
        match mode & !libc::FALLOC_FL_KEEP_SIZE {
            0 => return Ok(()),
            libc::FALLOC_FL_PUNCH_HOLE if keep => {}
            libc::FALLOC_FL_ZERO_RANGE => {}
            _ => return Err(Errno::EOPNOTSUPP),
        }
        if len == 0 {
            return Ok(());
        }
        let bs = self.block();
        let (first, last) = (offset.div_ceil(bs) * bs, (offset + len) / bs * bs);
        if first >= last {
            return self.write(offset, &vec![0; len as usize], false);
        }
        // The whole blocks first: if the volume cannot, nothing has changed.
        {
            let _shared = self.partial.read();
            self.rt.block_on(self.vol.write_zeroes(first, last - first, false)).map_err(errno)?;
        }
        if offset < first {
            self.write(offset, &vec![0; (first - offset) as usize], false)?;
        }
        if offset + len > last {
            self.write(last, &vec![0; (offset + len - last) as usize], false)?;
        }
        Ok(())
    }
}

/// The errno a caller of the file sees for an initiator error.
fn errno(e: Error) -> Errno {
    warn!(error = &e as &dyn std::error::Error, "I/O on the attached volume failed");
    Errno::from_i32(crate::errno(&e))
}

impl Filesystem for VolumeFile {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == DIR && name.to_str() == Some(self.name.as_str()) {
            reply.entry(&TTL, &self.attr(FILE), fuser::Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match ino {
            DIR | FILE => reply.attr(&TTL, &self.attr(ino)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // A volume's size is fixed: like a block device, the file ignores
        // truncation (O_TRUNC) and keeps its size and its data.
        let _ = size;
        reply.attr(&TTL, &self.attr(ino))
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE {
            return reply.error(Errno::EISDIR);
        }
        let writes = flags.0 & libc::O_ACCMODE != libc::O_RDONLY;
        if writes && self.vol.read_only() {
            return reply.error(Errno::EROFS);
        }
        // O_DIRECT: every read and write goes to the volume, none through the page cache.
        let direct = flags.0 & libc::O_DIRECT != 0;
        let f = if direct {
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES
        } else {
            FopenFlags::empty()
        };
        reply.opened(FileHandle(0), f);
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.read(offset, size as u64) {
            Ok(d) => reply.data(&d),
            Err(e) => reply.error(e),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // O_SYNC and O_DSYNC: the write is durable when it returns.
        let fua = flags.0 & (libc::O_SYNC | libc::O_DSYNC) != 0;
        match self.write(offset, data, fua) {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2): nothing buffered here; durability is fsync's.
        reply.ok();
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.rt.block_on(self.vol.flush()) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if ino != DIR {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (DIR, FileType::Directory, "."),
            (DIR, FileType::Directory, ".."),
            (FILE, FileType::RegularFile, self.name.as_str()),
        ];
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn getxattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, _size: u32, reply: fuser::ReplyXattr) {
        // ENOSYS, not ENODATA: the kernel then stops asking before every write.
        reply.error(Errno::ENOSYS);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOSYS);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // The space is all the file's: reported as used, none free.
        let bs = self.vol.block_size().max(4096);
        let blocks = self.vol.size() / bs as u64;
        reply.statfs(blocks, 0, 0, 2, 0, bs, 255, bs);
    }

    #[allow(clippy::too_many_arguments)]
    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        match self.fallocate(offset, length, mode) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}
