//! `HostDir`: a host directory.

use std::ffi::OsStr;

use super::types::*;
use super::VirtualFs;

/// A host directory (placeholder: being written).
#[derive(Clone)]
pub struct HostDir {}

impl HostDir {
    /// A host directory (placeholder).
    pub fn new(_path: impl AsRef<std::path::Path>) -> FsResult<Self> {
        Err(FsError::UNSUPPORTED)
    }
}

#[async_trait::async_trait]
impl VirtualFs for HostDir {
    async fn lookup(&self, _parent: InodeId, _name: &OsStr) -> FsResult<Entry> {
        Err(FsError::UNSUPPORTED)
    }
    async fn getattr(&self, _ino: InodeId) -> FsResult<Attr> {
        Err(FsError::UNSUPPORTED)
    }
    async fn readdir(
        &self,
        _ino: InodeId,
        _fh: FileHandle,
        _offset: u64,
    ) -> FsResult<Vec<DirEntry>> {
        Err(FsError::UNSUPPORTED)
    }
}
