//! The messages between the layer disk's device in the helper and the library (sans-IO).
//!
//! The device turns each virtio-blk request it forwards into a [`RequestHeader`] (followed by
//! the data of a write), and the library answers each with a [`ReplyHeader`] (followed by the
//! data of a successful read). The guest's own request header is parsed by the device, never
//! by the library, and the library checks every header it gets as if the helper were hostile
//! too: a known operation, data within [`MAX_DATA`], a range inside the disk.

/// The most data one request reads or writes: the device offers the guest's driver 256
/// segments of at most 4 KiB.
pub const MAX_DATA: u32 = 1 << 20;

/// The encoded size of a [`RequestHeader`].
pub const REQUEST_HEADER_LEN: usize = 24;

/// The encoded size of a [`ReplyHeader`].
pub const REPLY_HEADER_LEN: usize = 16;

/// What a forwarded request asks of the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// `length` bytes at `offset`, into the reply.
    Read,
    /// The `length` bytes after the header, at `offset`.
    Write,
    /// Every write completed before it, made durable.
    Flush,
}

impl Operation {
    fn code(self) -> u32 {
        match self {
            Operation::Read => 1,
            Operation::Write => 2,
            Operation::Flush => 3,
        }
    }
}

/// A request as the device forwards it: `id` names it in the reply (the device's own numbers,
/// unique among its requests waiting for a reply).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub id: u32,
    pub operation: Operation,
    /// Bytes from the disk's start.
    pub offset: u64,
    /// Bytes read or written; 0 for a flush.
    pub length: u32,
}

/// Why a request header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("an unknown operation {0}")]
    UnknownOperation(u32),
    #[error("{0} bytes of data (at most {MAX_DATA})")]
    TooLong(u32),
    #[error("a flush with {0} bytes of data")]
    FlushWithData(u32),
}

impl RequestHeader {
    /// The header's bytes: `id`, operation, `offset`, `length`, 4 bytes of zeros (all
    /// little-endian).
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut bytes = [0u8; REQUEST_HEADER_LEN];
        bytes[0..4].copy_from_slice(&self.id.to_le_bytes());
        bytes[4..8].copy_from_slice(&self.operation.code().to_le_bytes());
        bytes[8..16].copy_from_slice(&self.offset.to_le_bytes());
        bytes[16..20].copy_from_slice(&self.length.to_le_bytes());
        bytes
    }

    /// Reads a header, refusing one no device sends. Whether its range lies inside the disk is
    /// the caller's check (it knows the disk).
    pub fn decode(bytes: &[u8; REQUEST_HEADER_LEN]) -> Result<Self, WireError> {
        let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let operation = match word(4) {
            1 => Operation::Read,
            2 => Operation::Write,
            3 => Operation::Flush,
            other => return Err(WireError::UnknownOperation(other)),
        };
        let length = word(16);
        if length > MAX_DATA {
            return Err(WireError::TooLong(length));
        }
        if operation == Operation::Flush && length != 0 {
            return Err(WireError::FlushWithData(length));
        }
        Ok(RequestHeader {
            id: word(0),
            operation,
            offset: u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")),
            length,
        })
    }

    /// Whether the request's bytes lie inside a disk of `size` bytes.
    pub fn fits(&self, size: u64) -> bool {
        self.offset
            .checked_add(u64::from(self.length))
            .is_some_and(|end| end <= size)
    }
}

/// How a request ended, as the guest's driver is told (virtio-blk's status byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    IoError,
    Unsupported,
}

impl Status {
    /// virtio-blk's `VIRTIO_BLK_S_OK`, `_IOERR`, `_UNSUPP`.
    pub fn byte(self) -> u8 {
        match self {
            Status::Ok => 0,
            Status::IoError => 1,
            Status::Unsupported => 2,
        }
    }
}

/// A reply: the request's `id`, its status, and how many bytes of data follow (a successful
/// read's `length`, otherwise 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyHeader {
    pub id: u32,
    pub status: Status,
    pub length: u32,
}

impl ReplyHeader {
    /// The header's bytes: `id`, the status byte and 3 zeros, `length`, 4 zeros.
    pub fn encode(&self) -> [u8; REPLY_HEADER_LEN] {
        let mut bytes = [0u8; REPLY_HEADER_LEN];
        bytes[0..4].copy_from_slice(&self.id.to_le_bytes());
        bytes[4] = self.status.byte();
        bytes[8..12].copy_from_slice(&self.length.to_le_bytes());
        bytes
    }

    /// Reads a reply header; `None` for one the library never sends (an unknown status, data
    /// past [`MAX_DATA`], or data with a failure).
    pub fn decode(bytes: &[u8; REPLY_HEADER_LEN]) -> Option<Self> {
        let status = match bytes[4] {
            0 => Status::Ok,
            1 => Status::IoError,
            2 => Status::Unsupported,
            _ => return None,
        };
        let length = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if length > MAX_DATA || (status != Status::Ok && length != 0) {
            return None;
        }
        Some(ReplyHeader {
            id: u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes")),
            status,
            length,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_what_no_device_sends_is_refused() {
        let read = RequestHeader {
            id: 7,
            operation: Operation::Read,
            offset: 1 << 33,
            length: 4096,
        };
        assert_eq!(RequestHeader::decode(&read.encode()), Ok(read));
        let mut bytes = read.encode();
        bytes[4] = 9;
        assert_eq!(
            RequestHeader::decode(&bytes),
            Err(WireError::UnknownOperation(9))
        );
        let long = RequestHeader {
            length: MAX_DATA + 1,
            ..read
        };
        assert_eq!(
            RequestHeader::decode(&long.encode()),
            Err(WireError::TooLong(MAX_DATA + 1))
        );
        let flush = RequestHeader {
            operation: Operation::Flush,
            length: 512,
            ..read
        };
        assert_eq!(
            RequestHeader::decode(&flush.encode()),
            Err(WireError::FlushWithData(512))
        );

        assert!(read.fits((1 << 33) + 4096));
        assert!(!read.fits((1 << 33) + 4095));
        let wrapping = RequestHeader {
            offset: u64::MAX - 10,
            ..read
        };
        assert!(!wrapping.fits(u64::MAX));

        let reply = ReplyHeader {
            id: 3,
            status: Status::Ok,
            length: 512,
        };
        assert_eq!(ReplyHeader::decode(&reply.encode()), Some(reply));
        let failed_with_data = ReplyHeader {
            status: Status::IoError,
            ..reply
        };
        assert_eq!(ReplyHeader::decode(&failed_with_data.encode()), None);
        let mut unknown = reply.encode();
        unknown[4] = 3;
        assert_eq!(ReplyHeader::decode(&unknown), None);
    }
}
