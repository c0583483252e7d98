//! The guest's files: whole reads and writes, listings, metadata, removal, renames,
//! directories.

use napi::bindgen_prelude::Buffer;
use napi_derive::napi;

use crate::errors::OrNapi;
use crate::instance::NativeInstance;

/// What `stat` says about a guest file.
#[napi(object)]
pub struct FileStat {
    /// "file", "dir", "symlink" or "other".
    pub kind: String,
    pub size: f64,
    /// Permission bits (e.g. 0o644).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Last modification, in milliseconds since the epoch (the guest's clock).
    pub mtime_ms: f64,
}

/// One entry of a guest directory.
#[napi(object)]
pub struct DirEntry {
    pub name: String,
    /// "file", "dir", "symlink" or "other" (a symlink is not followed).
    pub kind: String,
}

fn kind(file_type: krunbox::FileType) -> String {
    match file_type {
        krunbox::FileType::File => "file",
        krunbox::FileType::Dir => "dir",
        krunbox::FileType::Symlink => "symlink",
        _ => "other",
    }
    .into()
}

#[napi]
impl NativeInstance {
    /// The file at `path` in the guest, whole (at most the library's read limit).
    #[napi]
    pub async fn read_file(&self, path: String) -> napi::Result<Buffer> {
        Ok(self.inner.read_file(path).await.or_napi()?.into())
    }

    /// Writes `data` to `path` in the guest, replacing it; with `mode` if given, making its
    /// directories if asked.
    #[napi]
    pub async fn write_file(
        &self,
        path: String,
        data: Buffer,
        mode: Option<u32>,
        parents: Option<bool>,
    ) -> napi::Result<()> {
        let mut options = krunbox::WriteOptions::new();
        if let Some(mode) = mode {
            options = options.mode(mode);
        }
        options = options.create_parents(parents.unwrap_or(false));
        self.inner
            .write_file_with(path, data.to_vec(), options)
            .await
            .or_napi()
    }

    /// What is at `path` (symlinks followed).
    #[napi]
    pub async fn stat(&self, path: String) -> napi::Result<FileStat> {
        let meta = self.inner.metadata(path).await.or_napi()?;
        let mtime_ms = meta
            .modified
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64() * 1000.0)
            .unwrap_or(0.0);
        Ok(FileStat {
            kind: kind(meta.file_type),
            size: meta.len as f64,
            mode: meta.mode,
            uid: meta.uid,
            gid: meta.gid,
            mtime_ms,
        })
    }

    /// The entries of the directory at `path`.
    #[napi]
    pub async fn list_dir(&self, path: String) -> napi::Result<Vec<DirEntry>> {
        let entries = self.inner.read_dir(path).await.or_napi()?;
        Ok(entries
            .into_iter()
            .map(|entry| DirEntry {
                name: entry.name.to_string_lossy().into_owned(),
                kind: kind(entry.file_type),
            })
            .collect())
    }

    /// Removes the file or empty directory at `path`, or with `recursive` everything under
    /// it.
    #[napi]
    pub async fn remove(&self, path: String, recursive: Option<bool>) -> napi::Result<()> {
        if recursive.unwrap_or(false) {
            self.inner.remove_all(path).await.or_napi()
        } else {
            self.inner.remove(path).await.or_napi()
        }
    }

    /// Renames `from` to `to`, replacing what is there.
    #[napi]
    pub async fn rename(&self, from: String, to: String) -> napi::Result<()> {
        self.inner.rename(from, to).await.or_napi()
    }

    /// Makes the directory `path`, with its parents if asked.
    #[napi]
    pub async fn make_dir(&self, path: String, parents: Option<bool>) -> napi::Result<()> {
        if parents.unwrap_or(false) {
            self.inner.create_dir_all(path).await.or_napi()
        } else {
            self.inner.create_dir(path, 0o755).await.or_napi()
        }
    }
}
