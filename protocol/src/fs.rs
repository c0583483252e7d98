//! File operations on the guest's filesystem, as request/response pairs.
//!
//! Large files move as a sequence of bounded chunks ([`MAX_FILE_CHUNK`]); the host keeps a
//! small number of requests in flight, which is the flow control. Every path is bytes (Linux
//! paths are not UTF-8) without NUL, at most [`crate::limits::MAX_TEXT`] bytes.

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::limits::MAX_TEXT;
use crate::search::{SearchFound, SearchSpec};
use crate::ProtocolError;

/// The largest data chunk of one read or write.
pub const MAX_FILE_CHUNK: usize = 512 * 1024;

/// Directory entries in one [`FsOk::Entries`] reply; a larger directory is listed in pages.
pub const MAX_DIR_ENTRIES: usize = 1024;

/// The longest entry name in a listing: Linux's `NAME_MAX`. A page therefore holds at most
/// about 256 KiB of names, and a listing the host collects is bounded by its entry count.
pub const MAX_NAME: usize = 255;

/// A file-system request, answered by exactly one [`FsReply`] with the same id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsRequest {
    /// Host-chosen id, unique among outstanding file requests (an id space of its own: guest-init
    /// only echoes it in the reply).
    pub id: u32,
    /// The operation.
    pub op: FsOp,
}

/// What to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsOp {
    /// Read up to `len` (≤ [`MAX_FILE_CHUNK`]) bytes at `offset`. Replies [`FsOk::Data`]; an
    /// empty chunk means end of file.
    Read {
        /// The file.
        path: ByteBuf,
        /// Byte offset.
        offset: u64,
        /// Bytes wanted.
        len: u32,
    },
    /// Write `data` at `offset`. With `create`, the file is created with `mode` if missing;
    /// with `truncate`, it is truncated to zero first. Replies [`FsOk::Done`].
    Write {
        /// The file.
        path: ByteBuf,
        /// Byte offset.
        offset: u64,
        /// At most [`MAX_FILE_CHUNK`] bytes.
        data: ByteBuf,
        /// Permission bits for a created file.
        mode: u32,
        /// Create if missing.
        create: bool,
        /// Truncate first.
        truncate: bool,
    },
    /// `fsync` the file. Replies [`FsOk::Done`].
    Sync {
        /// The file.
        path: ByteBuf,
    },
    /// `lstat` (or `stat` with `follow`). Replies [`FsOk::Metadata`].
    Metadata {
        /// The path.
        path: ByteBuf,
        /// Follow a final symlink.
        follow: bool,
    },
    /// List a directory, entries sorted by name, starting after `after` (exclusive) for
    /// paging. Replies [`FsOk::Entries`].
    ReadDir {
        /// The directory.
        path: ByteBuf,
        /// Resume after this name (the last one of the previous page).
        after: Option<ByteBuf>,
    },
    /// Remove a file, symlink or empty directory; with `recursive`, a whole tree (symlinks are
    /// removed, never followed). Replies [`FsOk::Done`].
    Remove {
        /// The path.
        path: ByteBuf,
        /// Remove directories with their contents.
        recursive: bool,
    },
    /// Create a directory (and, with `parents`, its missing ancestors). Replies [`FsOk::Done`].
    CreateDir {
        /// The path.
        path: ByteBuf,
        /// Permission bits.
        mode: u32,
        /// Create missing parents; an existing directory is then not an error.
        parents: bool,
    },
    /// Rename `from` to `to` (`rename(2)`: an existing file at `to` is replaced, atomically;
    /// a missing parent of `to` is an error). Replies [`FsOk::Done`]. Since protocol 13.
    Rename {
        /// The path renamed.
        from: ByteBuf,
        /// Its new path.
        to: ByteBuf,
    },
    /// Walk a tree, listing files or searching their contents. Replies [`FsOk::Found`].
    /// Since protocol 14.
    Search(SearchSpec),
}

/// The answer to one [`FsRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsReply {
    /// The request's id.
    pub id: u32,
    /// Success or a typed error.
    pub result: Result<FsOk, FsError>,
}

/// Successful results.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsOk {
    /// Done, nothing to return.
    Done,
    /// Bytes read (empty at end of file).
    Data(ByteBuf),
    /// File metadata.
    Metadata(FileMeta),
    /// One page of a directory listing; `complete` is false when more pages follow.
    Entries {
        /// At most [`MAX_DIR_ENTRIES`] entries, sorted by name.
        entries: Vec<DirEntry>,
        /// Whether this is the last page.
        complete: bool,
    },
    /// A search's hits.
    Found(SearchFound),
}

/// Kinds of file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FileType {
    /// Regular file.
    File,
    /// Directory.
    Dir,
    /// Symbolic link.
    Symlink,
    /// Device, FIFO, socket.
    Other,
}

/// What `stat` says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMeta {
    /// Kind of file.
    pub file_type: FileType,
    /// Size in bytes.
    pub len: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time, seconds since the epoch.
    pub mtime_secs: i64,
    /// Modification time, nanoseconds part.
    pub mtime_nanos: u32,
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// File name (no `/`).
    pub name: ByteBuf,
    /// Kind of file (from `lstat`).
    pub file_type: FileType,
}

/// Error classes the host maps to typed errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsErrorKind {
    /// ENOENT.
    NotFound,
    /// EACCES, EPERM, EROFS.
    PermissionDenied,
    /// EISDIR.
    IsADirectory,
    /// ENOTDIR.
    NotADirectory,
    /// EEXIST.
    AlreadyExists,
    /// ENOTEMPTY.
    DirectoryNotEmpty,
    /// EINVAL and bad arguments.
    InvalidInput,
    /// Anything else.
    Other,
    /// Not a regular file where one is required: reads (and writes) refuse FIFOs, devices and
    /// sockets, which could block guest-init or never end (`/dev/zero`).
    NotAFile,
    /// Past a size bound: a file larger than `read_file` reads into memory, a directory with
    /// more entries than `read_dir` collects (the host's [`Limits`], named in the message).
    ///
    /// [`Limits`]: https://docs.rs/krunbox/latest/krunbox/struct.Limits.html
    TooLarge,
}

/// A failed file operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsError {
    /// Classification.
    pub kind: FsErrorKind,
    /// The errno, 0 if none applies.
    pub errno: i32,
    /// Description, e.g. `open /etc/x: Read-only file system`.
    pub message: String,
}

fn path_ok(field: &'static str, path: &[u8]) -> Result<(), ProtocolError> {
    if path.is_empty() || path.len() > MAX_TEXT || path.contains(&0) {
        return Err(ProtocolError::OutOfBounds {
            field,
            detail: format!("{} bytes, must be 1..={MAX_TEXT} without NUL", path.len()),
        });
    }
    Ok(())
}

fn chunk_ok(field: &'static str, len: usize) -> Result<(), ProtocolError> {
    if len > MAX_FILE_CHUNK {
        return Err(ProtocolError::OutOfBounds {
            field,
            detail: format!("{len} > {MAX_FILE_CHUNK}"),
        });
    }
    Ok(())
}

impl FsRequest {
    /// Checks bounds (both ends call it).
    pub fn validate(&self) -> Result<(), ProtocolError> {
        match &self.op {
            FsOp::Read { path, len, .. } => {
                path_ok("read path", path)?;
                chunk_ok("read length", *len as usize)
            }
            FsOp::Write { path, data, .. } => {
                path_ok("write path", path)?;
                chunk_ok("write data", data.len())
            }
            FsOp::Sync { path } | FsOp::Metadata { path, .. } | FsOp::CreateDir { path, .. } => {
                path_ok("path", path)
            }
            FsOp::Remove { path, .. } => path_ok("remove path", path),
            FsOp::Rename { from, to } => {
                path_ok("rename from", from)?;
                path_ok("rename to", to)
            }
            FsOp::Search(spec) => spec.validate(),
            FsOp::ReadDir { path, after } => {
                path_ok("read_dir path", path)?;
                match after {
                    Some(name) => path_ok("read_dir after", name),
                    None => Ok(()),
                }
            }
        }
    }
}

impl FsReply {
    /// Checks bounds (both ends call it).
    pub fn validate(&self) -> Result<(), ProtocolError> {
        match &self.result {
            Ok(FsOk::Data(data)) => chunk_ok("read data", data.len()),
            Ok(FsOk::Entries { entries, .. }) => {
                if entries.len() > MAX_DIR_ENTRIES {
                    return Err(ProtocolError::OutOfBounds {
                        field: "directory page",
                        detail: format!("{} > {MAX_DIR_ENTRIES} entries", entries.len()),
                    });
                }
                for entry in entries {
                    if entry.name.is_empty() || entry.name.len() > MAX_NAME {
                        return Err(ProtocolError::OutOfBounds {
                            field: "entry name",
                            detail: format!("{} bytes, must be 1..={MAX_NAME}", entry.name.len()),
                        });
                    }
                    path_ok("entry name", &entry.name)?;
                    if entry.name.contains(&b'/') {
                        return Err(ProtocolError::OutOfBounds {
                            field: "entry name",
                            detail: "contains '/'".into(),
                        });
                    }
                }
                Ok(())
            }
            Ok(FsOk::Found(found)) => found.validate(),
            Ok(FsOk::Done) | Ok(FsOk::Metadata(_)) => Ok(()),
            Err(err) => {
                if err.message.len() > MAX_TEXT {
                    return Err(ProtocolError::OutOfBounds {
                        field: "fs error message",
                        detail: format!("{} > {MAX_TEXT}", err.message.len()),
                    });
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(name: &[u8]) -> FsReply {
        FsReply {
            id: 1,
            result: Ok(FsOk::Entries {
                entries: vec![DirEntry {
                    name: ByteBuf::from(name.to_vec()),
                    file_type: FileType::File,
                }],
                complete: true,
            }),
        }
    }

    /// A listing's names are Linux names: at most NAME_MAX bytes, so a page of entries is
    /// bounded by its count (a forged 4 KiB name per entry would make it 16 times larger).
    #[test]
    fn entry_names_are_at_most_name_max() {
        assert!(page(&[b'x'; MAX_NAME]).validate().is_ok());
        assert!(matches!(
            page(&[b'x'; MAX_NAME + 1]).validate(),
            Err(ProtocolError::OutOfBounds {
                field: "entry name",
                ..
            })
        ));
        assert!(page(b"").validate().is_err());
        assert!(page(b"a/b").validate().is_err());
    }
}
