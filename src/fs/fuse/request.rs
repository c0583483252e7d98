//! Decoding one FUSE request from the guest: sans-IO, bounded, never panicking.
//!
//! The bytes are whatever the guest's kernel (or a hostile program that took over the guest's
//! end of the connection) sent: every length is checked against the message before anything is
//! read, names are validated as single path components, and an unknown or unsupported opcode is
//! an [`Operation::Unsupported`] the session answers with `ENOSYS`.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use fuse_backend_rs::abi::fuse_abi as abi;
use vm_memory::ByteValued;

use crate::fs::WriteData;

/// The FUSE request header's size.
pub(crate) const IN_HEADER_LEN: usize = std::mem::size_of::<abi::InHeader>();

/// A write's opcode, and the length of its own header after the request's (its data follows).
pub(crate) const WRITE_OPCODE: u32 = abi::Opcode::Write as u32;
pub(crate) const WRITE_IN_LEN: usize = std::mem::size_of::<abi::WriteIn>();

/// The largest write the session negotiates (`max_write`): 1 MiB, 256 pages.
pub(crate) const MAX_WRITE: u32 = 1 << 20;

/// The largest request the host accepts: a header, a write's own header, `MAX_WRITE` bytes,
/// with room to spare. Anything longer ends the connection.
pub(crate) const MAX_REQUEST: usize = MAX_WRITE as usize + 4096;

/// The longest name (one path component), as Linux's `NAME_MAX`.
pub(crate) const NAME_MAX: usize = 255;

/// The longest symlink target or extended attribute name list, as Linux's `PATH_MAX`.
pub(crate) const PATH_MAX: usize = 4096;

/// The largest extended attribute value (Linux's `XATTR_SIZE_MAX`).
pub(crate) const XATTR_SIZE_MAX: usize = 64 * 1024;

/// Why a request could not be decoded. The first two end the connection (the stream can no
/// longer be trusted to be framed); the others fail one request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum DecodeError {
    /// The header's length disagrees with the message, or is out of bounds.
    #[error("a FUSE request whose length field says {said} bytes arrived in {got}")]
    BadLength { said: u32, got: usize },
    /// Shorter than a header.
    #[error("a FUSE request of {0} bytes, shorter than its header")]
    Truncated(usize),
    /// The body is shorter than its opcode needs, or a string is not NUL-terminated.
    #[error("a malformed FUSE request (opcode {opcode}): {detail}")]
    Malformed { opcode: u32, detail: &'static str },
    /// A name that is not one valid path component.
    #[error("an invalid name in a FUSE request (opcode {opcode})")]
    BadName { opcode: u32, errno: i32 },
}

impl DecodeError {
    /// The errno a request that failed this way gets.
    pub(crate) fn errno(&self) -> i32 {
        match self {
            DecodeError::BadName { errno, .. } => *errno,
            _ => libc::EINVAL,
        }
    }
}

/// The header fields a reply or an implementation needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

/// One decoded request.
#[derive(Debug)]
pub(crate) struct Request<'a> {
    pub header: Header,
    pub operation: Operation<'a>,
}

/// What a request asks, with its arguments validated.
#[derive(Debug)]
pub(crate) enum Operation<'a> {
    Init {
        major: u32,
        minor: u32,
        max_readahead: u32,
        flags: u64,
    },
    Destroy,
    Lookup {
        name: &'a OsStr,
    },
    Forget {
        count: u64,
    },
    BatchForget {
        /// (nodeid, count) pairs.
        forgets: Vec<(u64, u64)>,
    },
    Getattr,
    Setattr(abi::SetattrIn),
    Readlink,
    Symlink {
        name: &'a OsStr,
        target: &'a OsStr,
    },
    Mknod {
        name: &'a OsStr,
        mode: u32,
        rdev: u32,
    },
    Mkdir {
        name: &'a OsStr,
        mode: u32,
    },
    Unlink {
        name: &'a OsStr,
    },
    Rmdir {
        name: &'a OsStr,
    },
    Rename {
        name: &'a OsStr,
        new_parent: u64,
        new_name: &'a OsStr,
        flags: u32,
    },
    Link {
        target: u64,
        new_name: &'a OsStr,
    },
    Open {
        flags: u32,
        /// Clear set-user-ID and set-group-ID first (an `O_TRUNC` open by a caller without
        /// `CAP_FSETID`, under `HANDLE_KILLPRIV_V2`).
        kill_suid_sgid: bool,
    },
    Create {
        name: &'a OsStr,
        mode: u32,
        flags: u32,
        /// As for [`Operation::Open`], when the name exists and is truncated.
        kill_suid_sgid: bool,
    },
    Read {
        handle: u64,
        offset: u64,
        size: u32,
    },
    Write {
        handle: u64,
        offset: u64,
        data: WriteData<'a>,
        /// Clear set-user-ID and set-group-ID first (a caller without `CAP_FSETID`, under
        /// `HANDLE_KILLPRIV_V2`).
        kill_suid_sgid: bool,
    },
    Flush {
        handle: u64,
    },
    Release {
        handle: u64,
    },
    Fsync {
        handle: u64,
        data_only: bool,
    },
    Fallocate {
        handle: u64,
        offset: u64,
        length: u64,
        mode: u32,
    },
    Opendir,
    Readdir {
        handle: u64,
        offset: u64,
        size: u32,
    },
    Releasedir {
        handle: u64,
    },
    Fsyncdir {
        handle: u64,
        data_only: bool,
    },
    Statfs,
    Setxattr {
        name: &'a OsStr,
        value: &'a [u8],
        flags: u32,
    },
    Getxattr {
        name: &'a OsStr,
        size: u32,
    },
    Listxattr {
        size: u32,
    },
    Removexattr {
        name: &'a OsStr,
    },
    /// The guest gives up the request `unique` (a signal reached the process waiting for
    /// it): its call is dropped and it is answered `EINTR`, if it is still running.
    Interrupt {
        unique: u64,
    },
    /// An opcode this session does not serve (locks are the guest kernel's, `ioctl`, `poll`,
    /// `bmap`, `fallocate`, `lseek`, `copy_file_range`, readdirplus, DAX mappings, anything
    /// newer): answered with `ENOSYS`.
    Unsupported,
}

/// Reads fixed-size structures and NUL-terminated strings off a request body, in order.
struct Body<'a> {
    bytes: &'a [u8],
    opcode: u32,
}

impl<'a> Body<'a> {
    fn malformed(&self, detail: &'static str) -> DecodeError {
        DecodeError::Malformed {
            opcode: self.opcode,
            detail,
        }
    }

    /// The next `T`, copied out (the body carries no alignment guarantee).
    fn take<T: ByteValued + Default>(&mut self) -> Result<T, DecodeError> {
        let size = std::mem::size_of::<T>();
        if self.bytes.len() < size {
            return Err(self.malformed("body shorter than its arguments"));
        }
        let mut value = T::default();
        value.as_mut_slice().copy_from_slice(&self.bytes[..size]);
        self.bytes = &self.bytes[size..];
        Ok(value)
    }

    /// The next NUL-terminated string (without its NUL), at most `max` bytes.
    fn string(&mut self, max: usize) -> Result<&'a [u8], DecodeError> {
        let Some(end) = self.bytes.iter().position(|&b| b == 0) else {
            return Err(self.malformed("a string without its NUL"));
        };
        if end > max {
            return Err(DecodeError::BadName {
                opcode: self.opcode,
                errno: libc::ENAMETOOLONG,
            });
        }
        let (string, rest) = self.bytes.split_at(end);
        self.bytes = &rest[1..];
        Ok(string)
    }

    /// The next string, which must be one path component: not empty, `.` or `..`, no `/`.
    fn name(&mut self) -> Result<&'a OsStr, DecodeError> {
        let name = self.string(NAME_MAX)?;
        if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') {
            return Err(DecodeError::BadName {
                opcode: self.opcode,
                errno: libc::EINVAL,
            });
        }
        Ok(OsStr::from_bytes(name))
    }

    /// An extended attribute's name: not empty, at most 255 bytes.
    fn xattr_name(&mut self) -> Result<&'a OsStr, DecodeError> {
        let name = self.string(NAME_MAX)?;
        if name.is_empty() {
            return Err(DecodeError::BadName {
                opcode: self.opcode,
                errno: libc::EINVAL,
            });
        }
        Ok(OsStr::from_bytes(name))
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.bytes)
    }
}

/// Whether requests with this opcode get no reply (forgets, interrupts).
pub(crate) fn is_unanswered(opcode: u32) -> bool {
    use abi::Opcode as Op;
    [
        Op::Forget as u32,
        Op::BatchForget as u32,
        Op::Interrupt as u32,
    ]
    .contains(&opcode)
}

/// Whether an open (or create) asks the filesystem to clear set-user-ID and set-group-ID: the
/// kernel's `FUSE_OPEN_KILL_SUIDGID`, which only means something with `O_TRUNC`.
fn kills_on_open(flags: u32, fuse_flags: u32) -> bool {
    flags & libc::O_TRUNC as u32 != 0 && fuse_flags & abi::FOPEN_IN_KILL_SUIDGID != 0
}

/// Decodes one whole request (exactly the bytes its header's length covers).
#[cfg(test)]
pub(crate) fn decode(message: &[u8]) -> Result<Request<'_>, DecodeError> {
    decode_with(message, None)
}

/// Decodes one request whose write data, if `data_elsewhere` is given, is not in `message`
/// but follows it (the request's bytes in guest memory, of which `message` is the copied
/// head: the headers). Only a write may have data elsewhere, and then none in `message`.
pub(crate) fn decode_with<'a>(
    message: &'a [u8],
    data_elsewhere: Option<WriteData<'a>>,
) -> Result<Request<'a>, DecodeError> {
    if message.len() < IN_HEADER_LEN {
        return Err(DecodeError::Truncated(message.len()));
    }
    let mut header = abi::InHeader::default();
    header
        .as_mut_slice()
        .copy_from_slice(&message[..IN_HEADER_LEN]);
    let total = message
        .len()
        .saturating_add(data_elsewhere.map_or(0, |data| data.len()));
    if header.len as usize != total || total > MAX_REQUEST {
        return Err(DecodeError::BadLength {
            said: header.len,
            got: total,
        });
    }
    let opcode = header.opcode;
    let head = Header {
        opcode,
        unique: header.unique,
        nodeid: header.nodeid,
        uid: header.uid,
        gid: header.gid,
        pid: header.pid,
    };
    let mut body = Body {
        bytes: &message[IN_HEADER_LEN..],
        opcode,
    };
    if data_elsewhere.is_some() && opcode != WRITE_OPCODE {
        return Err(body.malformed("data after the headers of a request that is not a write"));
    }
    // Matched as numbers: fuse-backend-rs's `From<u32> for Opcode` transmutes any value below
    // its last opcode, and the numbers FUSE skips (0, 7, 19) are no variant of the enum.
    use abi::Opcode as Op;
    const BATCH_FORGET: u32 = Op::BatchForget as u32;
    const CREATE: u32 = Op::Create as u32;
    const DESTROY: u32 = Op::Destroy as u32;
    const FLUSH: u32 = Op::Flush as u32;
    const FORGET: u32 = Op::Forget as u32;
    const FALLOCATE: u32 = Op::Fallocate as u32;
    const FSYNC: u32 = Op::Fsync as u32;
    const FSYNCDIR: u32 = Op::Fsyncdir as u32;
    const GETATTR: u32 = Op::Getattr as u32;
    const GETXATTR: u32 = Op::Getxattr as u32;
    const INIT: u32 = Op::Init as u32;
    const INTERRUPT: u32 = Op::Interrupt as u32;
    const LINK: u32 = Op::Link as u32;
    const LISTXATTR: u32 = Op::Listxattr as u32;
    const LOOKUP: u32 = Op::Lookup as u32;
    const MKDIR: u32 = Op::Mkdir as u32;
    const MKNOD: u32 = Op::Mknod as u32;
    const OPEN: u32 = Op::Open as u32;
    const OPENDIR: u32 = Op::Opendir as u32;
    const READ: u32 = Op::Read as u32;
    const READDIR: u32 = Op::Readdir as u32;
    const READLINK: u32 = Op::Readlink as u32;
    const RELEASE: u32 = Op::Release as u32;
    const RELEASEDIR: u32 = Op::Releasedir as u32;
    const REMOVEXATTR: u32 = Op::Removexattr as u32;
    const RENAME: u32 = Op::Rename as u32;
    const RENAME2: u32 = Op::Rename2 as u32;
    const RMDIR: u32 = Op::Rmdir as u32;
    const SETATTR: u32 = Op::Setattr as u32;
    const SETXATTR: u32 = Op::Setxattr as u32;
    const STATFS: u32 = Op::Statfs as u32;
    const SYMLINK: u32 = Op::Symlink as u32;
    const UNLINK: u32 = Op::Unlink as u32;
    const WRITE: u32 = Op::Write as u32;
    let operation = match opcode {
        INIT => {
            let init: abi::InitIn = body.take()?;
            // Kernels of protocol 7.36 and later append flags2 (the high half of the flags).
            let high = if body.bytes.len() >= 4 {
                u64::from(u32::from_le_bytes([
                    body.bytes[0],
                    body.bytes[1],
                    body.bytes[2],
                    body.bytes[3],
                ]))
            } else {
                0
            };
            Operation::Init {
                major: init.major,
                minor: init.minor,
                max_readahead: init.max_readahead,
                flags: u64::from(init.flags) | (high << 32),
            }
        }
        DESTROY => Operation::Destroy,
        LOOKUP => Operation::Lookup { name: body.name()? },
        FORGET => {
            let forget: abi::ForgetIn = body.take()?;
            Operation::Forget {
                count: forget.nlookup,
            }
        }
        BATCH_FORGET => {
            let batch: abi::BatchForgetIn = body.take()?;
            let one = std::mem::size_of::<abi::ForgetOne>();
            // The count is the guest's: bounded by what the message really holds.
            if (batch.count as usize).saturating_mul(one) > body.bytes.len() {
                return Err(body.malformed("a batch forget longer than its message"));
            }
            let mut forgets = Vec::with_capacity(batch.count as usize);
            for _ in 0..batch.count {
                let item: abi::ForgetOne = body.take()?;
                forgets.push((item.nodeid, item.nlookup));
            }
            Operation::BatchForget { forgets }
        }
        GETATTR => Operation::Getattr,
        SETATTR => Operation::Setattr(body.take()?),
        READLINK => Operation::Readlink,
        SYMLINK => {
            let name = body.name()?;
            let target = body.string(PATH_MAX - 1)?;
            if target.is_empty() {
                return Err(DecodeError::BadName {
                    opcode,
                    errno: libc::ENOENT,
                });
            }
            Operation::Symlink {
                name,
                target: OsStr::from_bytes(target),
            }
        }
        MKNOD => {
            let args: abi::MknodIn = body.take()?;
            Operation::Mknod {
                name: body.name()?,
                mode: args.mode,
                rdev: args.rdev,
            }
        }
        MKDIR => {
            let args: abi::MkdirIn = body.take()?;
            Operation::Mkdir {
                name: body.name()?,
                mode: args.mode,
            }
        }
        UNLINK => Operation::Unlink { name: body.name()? },
        RMDIR => Operation::Rmdir { name: body.name()? },
        RENAME => {
            let args: abi::RenameIn = body.take()?;
            Operation::Rename {
                name: body.name()?,
                new_parent: args.newdir,
                new_name: body.name()?,
                flags: 0,
            }
        }
        RENAME2 => {
            let args: abi::Rename2In = body.take()?;
            Operation::Rename {
                name: body.name()?,
                new_parent: args.newdir,
                new_name: body.name()?,
                flags: args.flags,
            }
        }
        LINK => {
            let args: abi::LinkIn = body.take()?;
            Operation::Link {
                target: args.oldnodeid,
                new_name: body.name()?,
            }
        }
        OPEN => {
            let args: abi::OpenIn = body.take()?;
            Operation::Open {
                flags: args.flags,
                kill_suid_sgid: kills_on_open(args.flags, args.fuse_flags),
            }
        }
        CREATE => {
            let args: abi::CreateIn = body.take()?;
            Operation::Create {
                name: body.name()?,
                mode: args.mode,
                flags: args.flags,
                kill_suid_sgid: kills_on_open(args.flags, args.fuse_flags),
            }
        }
        READ => {
            let args: abi::ReadIn = body.take()?;
            Operation::Read {
                handle: args.fh,
                offset: args.offset,
                size: args.size.min(MAX_WRITE),
            }
        }
        WRITE => {
            let args: abi::WriteIn = body.take()?;
            let data = match data_elsewhere {
                None => WriteData::from_bytes(body.rest()),
                Some(data) if body.rest().is_empty() => data,
                Some(_) => {
                    return Err(body.malformed("a write with data both in and after its headers"))
                }
            };
            if data.len() != args.size as usize {
                return Err(body.malformed("a write whose size disagrees with its data"));
            }
            Operation::Write {
                handle: args.fh,
                offset: args.offset,
                data,
                kill_suid_sgid: args.fuse_flags & abi::WRITE_KILL_PRIV != 0,
            }
        }
        FLUSH => {
            let args: abi::FlushIn = body.take()?;
            Operation::Flush { handle: args.fh }
        }
        RELEASE => {
            let args: abi::ReleaseIn = body.take()?;
            Operation::Release { handle: args.fh }
        }
        FSYNC | FSYNCDIR => {
            let args: abi::FsyncIn = body.take()?;
            let data_only = args.fsync_flags & abi::FSYNC_FDATASYNC != 0;
            if opcode == FSYNC {
                Operation::Fsync {
                    handle: args.fh,
                    data_only,
                }
            } else {
                Operation::Fsyncdir {
                    handle: args.fh,
                    data_only,
                }
            }
        }
        FALLOCATE => {
            let args: abi::FallocateIn = body.take()?;
            Operation::Fallocate {
                handle: args.fh,
                offset: args.offset,
                length: args.length,
                mode: args.mode,
            }
        }
        OPENDIR => Operation::Opendir,
        READDIR => {
            let args: abi::ReadIn = body.take()?;
            Operation::Readdir {
                handle: args.fh,
                offset: args.offset,
                size: args.size.min(MAX_WRITE),
            }
        }
        RELEASEDIR => {
            let args: abi::ReleaseIn = body.take()?;
            Operation::Releasedir { handle: args.fh }
        }
        STATFS => Operation::Statfs,
        SETXATTR => {
            let args: abi::SetxattrIn = body.take()?;
            let name = body.xattr_name()?;
            let value = body.rest();
            if value.len() != args.size as usize || value.len() > XATTR_SIZE_MAX {
                return Err(body.malformed("an xattr value whose size disagrees with its data"));
            }
            Operation::Setxattr {
                name,
                value,
                flags: args.flags,
            }
        }
        GETXATTR => {
            let args: abi::GetxattrIn = body.take()?;
            Operation::Getxattr {
                name: body.xattr_name()?,
                size: args.size,
            }
        }
        LISTXATTR => {
            let args: abi::GetxattrIn = body.take()?;
            Operation::Listxattr { size: args.size }
        }
        REMOVEXATTR => Operation::Removexattr {
            name: body.xattr_name()?,
        },
        INTERRUPT => {
            let args: abi::InterruptIn = body.take()?;
            Operation::Interrupt {
                unique: args.unique,
            }
        }
        _ => Operation::Unsupported,
    };
    Ok(Request {
        header: head,
        operation,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A request as the guest kernel frames it: header (length filled in) and body.
    pub(crate) fn message(opcode: u32, unique: u64, nodeid: u64, body: &[u8]) -> Vec<u8> {
        let header = abi::InHeader {
            len: (IN_HEADER_LEN + body.len()) as u32,
            opcode,
            unique,
            nodeid,
            uid: 1000,
            gid: 1000,
            pid: 42,
            padding: 0,
        };
        let mut bytes = header.as_slice().to_vec();
        bytes.extend_from_slice(body);
        bytes
    }

    #[test]
    fn opcodes_fuse_skips_and_unknown_ones_are_unsupported() {
        // 0, 7 (the old GETDIR) and 19 are gaps in the opcode enum: never transmuted into it.
        for opcode in [0, 7, 19, 50, 4096, u32::MAX] {
            let bytes = message(opcode, 1, 1, b"whatever");
            let request = decode(&bytes).unwrap();
            assert!(
                matches!(request.operation, Operation::Unsupported),
                "{opcode}"
            );
        }
    }

    #[test]
    fn framing_errors_are_caught_before_anything_is_read() {
        assert!(matches!(decode(&[0; 10]), Err(DecodeError::Truncated(10))));
        let mut bytes = message(1, 1, 1, b"name\0");
        bytes[0] = 200;
        assert!(matches!(
            decode(&bytes),
            Err(DecodeError::BadLength { said: 200, .. })
        ));
        let mut huge = message(16, 1, 1, &[]);
        huge.resize(MAX_REQUEST + 1, 0);
        let len = huge.len() as u32;
        huge[..4].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(decode(&huge), Err(DecodeError::BadLength { .. })));
    }

    #[test]
    fn names_must_be_one_component() {
        let lookup = |name: &[u8]| {
            decode(&message(1, 1, 1, name)).map(|r| match r.operation {
                Operation::Lookup { name } => name.to_owned(),
                other => panic!("{other:?}"),
            })
        };
        assert_eq!(lookup(b"file.txt\0").unwrap(), "file.txt");
        for bad in [&b"\0"[..], b".\0", b"..\0", b"a/b\0", b"/etc\0"] {
            let err = lookup(bad).unwrap_err();
            assert_eq!(err.errno(), libc::EINVAL, "{bad:?}");
        }
        assert_eq!(lookup(b"no-terminator").unwrap_err().errno(), libc::EINVAL);
        let long = [vec![b'x'; 256], vec![0]].concat();
        assert_eq!(lookup(&long).unwrap_err().errno(), libc::ENAMETOOLONG);
        let longest = [vec![b'x'; 255], vec![0]].concat();
        assert!(lookup(&longest).is_ok());
    }

    #[test]
    fn lengths_inside_the_body_are_checked_against_it() {
        // A write whose declared size is not its data's.
        let args = abi::WriteIn {
            size: 100,
            ..Default::default()
        };
        let body = [args.as_slice(), b"short"].concat();
        assert!(matches!(
            decode(&message(16, 1, 2, &body)),
            Err(DecodeError::Malformed { .. })
        ));
        // A batch forget claiming more entries than it carries allocates nothing for them.
        let batch = abi::BatchForgetIn {
            count: u32::MAX,
            dummy: 0,
        };
        assert!(matches!(
            decode(&message(42, 0, 0, batch.as_slice())),
            Err(DecodeError::Malformed { .. })
        ));
        // A body shorter than its fixed arguments.
        assert!(matches!(
            decode(&message(15, 1, 2, &[0; 8])),
            Err(DecodeError::Malformed { .. })
        ));
    }

    /// A write whose data follows its headers in guest memory: its header's length counts
    /// the data, its size must match it, and only a write may have any.
    #[test]
    fn data_after_the_headers_is_a_writes_alone_and_its_length_is_checked() {
        let data = [7u8; 100];
        let args = abi::WriteIn {
            fh: 3,
            offset: 4096,
            size: 100,
            ..Default::default()
        };
        // The header's length says headers plus data, as the guest's does.
        let mut head = message(16, 1, 2, args.as_slice());
        let said = (head.len() + data.len()) as u32;
        head[..4].copy_from_slice(&said.to_le_bytes());
        let request = decode_with(&head, Some(WriteData::from_bytes(&data))).unwrap();
        match request.operation {
            Operation::Write {
                handle,
                offset,
                data: written,
                ..
            } => {
                assert_eq!((handle, offset), (3, 4096));
                assert_eq!(written.to_vec().unwrap(), data);
            }
            other => panic!("{other:?}"),
        }
        // A header's length that counts only the headers.
        let unframed = message(16, 1, 2, args.as_slice());
        assert!(matches!(
            decode_with(&unframed, Some(WriteData::from_bytes(&data))),
            Err(DecodeError::BadLength { .. })
        ));
        // A size that is not the data's.
        assert!(matches!(
            decode_with(&head, Some(WriteData::from_bytes(&data[..99]))),
            Err(DecodeError::BadLength { .. })
        ));
        let mut short = head.clone();
        short[..4].copy_from_slice(&((head.len() + 99) as u32).to_le_bytes());
        assert!(matches!(
            decode_with(&short, Some(WriteData::from_bytes(&data[..99]))),
            Err(DecodeError::Malformed { .. })
        ));
        // Data both in the message and after it.
        let mut both = message(16, 1, 2, &[args.as_slice(), &data].concat());
        let said = (both.len() + 100) as u32;
        both[..4].copy_from_slice(&said.to_le_bytes());
        assert!(matches!(
            decode_with(&both, Some(WriteData::from_bytes(&data))),
            Err(DecodeError::Malformed { .. })
        ));
        // Data after a read's headers.
        let read = abi::ReadIn {
            size: 100,
            ..Default::default()
        };
        let mut head = message(15, 1, 2, read.as_slice());
        let said = (head.len() + data.len()) as u32;
        head[..4].copy_from_slice(&said.to_le_bytes());
        assert!(matches!(
            decode_with(&head, Some(WriteData::from_bytes(&data))),
            Err(DecodeError::Malformed { .. })
        ));
    }

    #[test]
    fn a_rename_carries_both_names_and_its_flags() {
        let args = abi::Rename2In {
            newdir: 9,
            flags: libc::RENAME_EXCHANGE,
            padding: 0,
        };
        let body = [args.as_slice(), b"old\0new\0"].concat();
        let bytes = message(45, 7, 3, &body);
        let request = decode(&bytes).unwrap();
        assert_eq!(request.header.unique, 7);
        assert_eq!(request.header.nodeid, 3);
        match request.operation {
            Operation::Rename {
                name,
                new_parent,
                new_name,
                flags,
            } => {
                assert_eq!(
                    (name, new_parent, new_name),
                    (OsStr::new("old"), 9, OsStr::new("new"))
                );
                assert_eq!(flags, libc::RENAME_EXCHANGE);
            }
            other => panic!("{other:?}"),
        }
    }
}
