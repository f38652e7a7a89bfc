//! Mirroring across targets (issue 10). This crate has its first piece so
//! far: [`DirtyLog`], the dirty-region log a mirrored volume keeps on the
//! initiator's host (md's write-intent bitmap, DRBD's activity log and
//! bitmap, simplified). The mirrored volume, resync and `fastsan mirror`
//! are still to come.

pub mod dirty_log;

pub use dirty_log::{DirtyLog, DirtyLogError, DirtyStats, WriteIntent};
