//! Front ends: one module per wire protocol, each turning its frames into
//! validated operations on the same volumes.

pub mod brp;
pub mod nbd;
