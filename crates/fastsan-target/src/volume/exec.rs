//! The one place where a request touches the device: [`Volume::execute`]
//! runs a validated [`Op`] on the volume's backend stack.

use super::{Op, OpKind, Volume};
use crate::pool::PooledBuf;
use crate::request::{Extent, Refusal};
use bytes::Bytes;

/// What a successful operation gives back.
#[derive(Debug)]
pub enum Outcome {
    Done,
    Data(Bytes),
    Extents(Vec<Extent>),
}

impl Volume {
    /// Runs a validated operation. FUA on a backend that cannot do it is a
    /// write followed by a flush (a TRIM with FUA is always one); a volume that cannot map its extents
    /// reports its range as one allocated extent.
    pub fn execute(&self, op: Op) -> Result<Outcome, Refusal> {
        let b = &*self.backend;
        let done = Outcome::Done;
        Ok(match op.kind {
            OpKind::Read { offset, len } => {
                let mut buf = PooledBuf::take(len as usize);
                b.read_at(buf.as_mut(), offset)?;
                Outcome::Data(Bytes::from_owner(buf))
            }
            OpKind::Write { offset, data, fua } => {
                b.write_at(&data, offset, fua && self.caps.fua)?;
                if fua && !self.caps.fua {
                    b.flush()?;
                }
                done
            }
            OpKind::Flush => {
                b.flush()?;
                done
            }
            OpKind::Trim { offset, len, fua } => {
                b.trim(offset, len)?;
                if fua {
                    b.flush()?;
                }
                done
            }
            OpKind::WriteZeroes { offset, len, mut flags } => {
                let emulate_fua = flags.fua && !self.caps.fua;
                flags.fua &= !emulate_fua;
                b.write_zeroes(offset, len, flags)?;
                if emulate_fua {
                    b.flush()?;
                }
                done
            }
            OpKind::Cache { offset, len } => {
                b.cache(offset, len)?;
                done
            }
            OpKind::BlockStatus { offset, len, one } => {
                let mut e = if self.caps.extents {
                    b.extents(offset, len)?
                } else {
                    vec![Extent { len, hole: false }]
                };
                if one {
                    e.truncate(1);
                }
                Outcome::Extents(e)
            }
        })
    }
}
