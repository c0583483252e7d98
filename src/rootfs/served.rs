//! A disk the host serves: a copy-on-write root's layer disk (`cow.rs`), which reaches the
//! guest as a virtio-blk device of ours (`device/`), and a flatten's output disk
//! (`flatten.rs`), which reaches it as the one file of a FUSE filesystem over the workspace
//! transport (`src/fs/`) that the guest mounts with `mount -o loop`.

use std::ffi::OsStr;
use std::sync::Arc;
use std::time::SystemTime;

use krunbox_protocol::LAYER_FILE_NAME;

use crate::fs::{
    async_trait, Attr, Caller, DirEntry, Entry, FileHandle, FileKind, FsError, FsResult, InodeId,
    OpenFlags, SetAttr, VirtualFs,
};

/// A disk the host serves: a fixed size, reads, writes and syncs at byte offsets.
#[async_trait]
pub(crate) trait ServedDisk: Send + Sync + 'static {
    /// The disk's size in bytes.
    fn size(&self) -> u64;
    /// Up to `size` bytes at `offset` (fewer at the disk's end).
    async fn read(&self, offset: u64, size: u32) -> FsResult<Vec<u8>>;
    /// Writes `data` at `offset` (`ENOSPC` past the end).
    async fn write(&self, offset: u64, data: &[u8]) -> FsResult<u32>;
    /// Makes every write durable (the guest's flush).
    async fn sync(&self) -> FsResult<()>;
}

/// Runs one disk operation in a task of its own, so that it runs to its end even when the
/// request that asked for it is dropped (its connection closed, the instance going): a disk's
/// calls into a store then never overlap or stop halfway.
pub(super) async fn run_whole<T: Send + 'static>(
    operation: impl std::future::Future<Output = FsResult<T>> + Send + 'static,
) -> FsResult<T> {
    tokio::spawn(operation).await.unwrap_or(Err(FsError::IO))
}

/// The disk file's inode in the served filesystem (the root directory is 1).
const DISK_INODE: InodeId = InodeId(2);

/// The filesystem the guest mounts to reach a served disk: a root directory holding the one
/// file [`LAYER_FILE_NAME`], the disk, readable and writable only by the guest's root.
pub(crate) struct DiskFs<D>(pub Arc<D>);

impl<D: ServedDisk> DiskFs<D> {
    fn attr(&self, ino: InodeId) -> FsResult<Attr> {
        let (kind, perm, size) = match ino {
            InodeId::ROOT => (FileKind::Directory, 0o700, 0),
            DISK_INODE => (FileKind::File, 0o600, self.0.size()),
            _ => return Err(FsError::NOT_FOUND),
        };
        Ok(Attr {
            ino,
            kind,
            perm,
            nlink: 1,
            uid: 0,
            gid: 0,
            size,
            blocks: 0,
            atime: SystemTime::UNIX_EPOCH,
            mtime: SystemTime::UNIX_EPOCH,
            ctime: SystemTime::UNIX_EPOCH,
            rdev: 0,
        })
    }

    fn disk(ino: InodeId) -> FsResult<()> {
        if ino == DISK_INODE {
            Ok(())
        } else {
            Err(FsError::IS_DIRECTORY)
        }
    }
}

#[async_trait]
impl<D: ServedDisk> VirtualFs for DiskFs<D> {
    async fn lookup(&self, parent: InodeId, name: &OsStr) -> FsResult<Entry> {
        if parent != InodeId::ROOT {
            return Err(FsError::NOT_DIRECTORY);
        }
        if name != OsStr::new(LAYER_FILE_NAME) {
            return Err(FsError::NOT_FOUND);
        }
        Ok(Entry {
            attr: self.attr(DISK_INODE)?,
            generation: 0,
        })
    }

    async fn getattr(&self, ino: InodeId) -> FsResult<Attr> {
        self.attr(ino)
    }

    async fn setattr(&self, ino: InodeId, change: SetAttr, _caller: Caller) -> FsResult<Attr> {
        // The disk's size and owner are fixed; time updates are accepted and forgotten.
        if change.size.is_some() || change.perm.is_some() || change.uid.is_some() {
            return Err(FsError::NOT_PERMITTED);
        }
        self.attr(ino)
    }

    async fn open(&self, ino: InodeId, _flags: OpenFlags) -> FsResult<FileHandle> {
        Self::disk(ino)?;
        Ok(FileHandle(0))
    }

    async fn read(
        &self,
        ino: InodeId,
        _handle: FileHandle,
        offset: u64,
        size: u32,
    ) -> FsResult<Vec<u8>> {
        Self::disk(ino)?;
        let disk = self.0.clone();
        run_whole(async move { disk.read(offset, size).await }).await
    }

    async fn write(
        &self,
        ino: InodeId,
        _handle: FileHandle,
        offset: u64,
        data: &[u8],
    ) -> FsResult<u32> {
        Self::disk(ino)?;
        let disk = self.0.clone();
        let data = data.to_vec();
        run_whole(async move { disk.write(offset, &data).await }).await
    }

    async fn fsync(&self, ino: InodeId, _handle: FileHandle, _data_only: bool) -> FsResult<()> {
        Self::disk(ino)?;
        let disk = self.0.clone();
        run_whole(async move { disk.sync().await }).await
    }

    async fn readdir(
        &self,
        ino: InodeId,
        _handle: FileHandle,
        offset: u64,
    ) -> FsResult<Vec<DirEntry>> {
        if ino != InodeId::ROOT {
            return Err(FsError::NOT_DIRECTORY);
        }
        if offset > 0 {
            return Ok(Vec::new());
        }
        Ok(vec![DirEntry {
            ino: DISK_INODE,
            offset: 1,
            kind: FileKind::File,
            name: LAYER_FILE_NAME.into(),
        }])
    }
}
