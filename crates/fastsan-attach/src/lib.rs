//! `fastsan attach`: a volume used by the local host, with the initiator
//! underneath (merging into BATCH frames, several connections, credits,
//! transparent retries after the target's fence).
//!
//! - [`kernel`]: `/dev/nbdN`, the kernel's NBD client talking to a
//!   [`bridge`] over a socket pair per queue, configured through
//!   [`netlink`] (or the NBD ioctls);
//! - [`fuse`]: one file on a FUSE mount, where the kernel has no NBD driver;
//! - [`registry`]: what is attached, for `attach --list` and `detach`;

pub mod bridge;
pub mod fuse;
pub mod kernel;
pub mod netlink;
pub mod registry;

pub use fastsan_initiator::Remote;

use fastsan_initiator::{Error, Status};

/// The errno a user of the device or file sees for an initiator error.
pub fn errno(e: &Error) -> i32 {
    match e {
        Error::Status(s) if *s == Status::READ_ONLY => libc::EROFS,
        Error::Status(s) if *s == Status::NO_SPACE => libc::ENOSPC,
        Error::Status(s) if *s == Status::UNSUPPORTED => libc::EOPNOTSUPP,
        Error::Status(s) if *s == Status::SHUTTING_DOWN => libc::ESHUTDOWN,
        Error::Status(s) if *s == Status::OUT_OF_RANGE => libc::ENOSPC,
        Error::Status(s) if [Status::INVALID, Status::MISALIGNED, Status::TOO_LARGE].contains(s) => {
            libc::EINVAL
        }
        Error::InvalidArgument(_) => libc::EINVAL,
        _ => libc::EIO,
    }
}
