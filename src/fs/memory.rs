//! `MemoryFs`: a filesystem in host memory.

use std::ffi::OsStr;

use super::types::*;
use super::VirtualFs;

/// A filesystem held in host memory (placeholder: being written).
#[derive(Clone, Default)]
pub struct MemoryFs {}

impl MemoryFs {
    /// An empty filesystem.
    pub fn new() -> Self {
        MemoryFs {}
    }

    /// Writes a file (placeholder).
    pub fn write_file(&self, _path: &str, _data: &[u8]) -> FsResult<()> {
        Err(FsError::UNSUPPORTED)
    }

    /// Reads a file (placeholder).
    pub fn read_file(&self, _path: &str) -> FsResult<Vec<u8>> {
        Err(FsError::UNSUPPORTED)
    }
}

#[async_trait::async_trait]
impl VirtualFs for MemoryFs {
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
