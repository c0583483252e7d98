//! [`LayerCache`]: image blobs (compressed layers and configs) kept by digest, so images that
//! share layers download and store each of them once.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use sha2::{Digest, Sha256};
use tokio::io::AsyncWrite;

use crate::error::{Error, Result};

/// Image blobs kept by their digest, shared by every image pulled through the same cache: a
/// layer two images share is downloaded and stored once.
///
/// Blobs live at `DIR/sha256/HEX`. A blob enters the cache only whole and only after its bytes
/// hashed to its digest (it is written to a temporary file first, then renamed into place), and
/// every layer is hashed again before an image is built from it, so a blob damaged on disk
/// afterwards is refused rather than used. Blobs stay when the images made from them are
/// removed; [`LayerCache::retain`] removes those no image needs any more.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::image::oci::{fetch, LayerCache, PullOptions};
///
/// let cache = LayerCache::at("/var/cache/agents/blobs");
/// let options = PullOptions::new().cache(cache.clone());
/// // Download the layers now; a later pull of this or a derived image reuses them.
/// let fetched = fetch("registry.example.com/team/base:1", &options).await?;
/// assert!(fetched.layers.iter().all(|layer| cache.contains(layer)));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerCache {
    dir: PathBuf,
}

impl LayerCache {
    /// The cache in `dir` (made when a blob first enters it).
    ///
    /// ```
    /// use krunbox::image::oci::LayerCache;
    ///
    /// let cache = LayerCache::at("/var/cache/agents/blobs");
    /// assert_eq!(cache.dir(), std::path::Path::new("/var/cache/agents/blobs"));
    /// ```
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        LayerCache { dir: dir.into() }
    }

    /// The cache beside the named images: `blobs/` of
    /// [`LocalImages::default_location`](super::LocalImages::default_location).
    pub fn default_location() -> Self {
        Self::at(super::LocalImages::default_location().dir().join("blobs"))
    }

    /// Where the blobs are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the blob with `digest` (`sha256:…`) is in the cache; `false` for anything that
    /// is not a sha256 digest.
    ///
    /// ```
    /// use krunbox::image::oci::LayerCache;
    ///
    /// let dir = tempfile::tempdir().unwrap();
    /// let cache = LayerCache::at(dir.path());
    /// assert!(!cache.contains(&format!("sha256:{}", "0".repeat(64))));
    /// assert!(!cache.contains("sha256:../../etc/passwd"));
    /// ```
    pub fn contains(&self, digest: &str) -> bool {
        self.path(digest).is_ok_and(|path| path.is_file())
    }

    /// Removes every blob whose digest `keep` does not list; returns how many bytes that freed.
    /// While a pull or fetch uses the cache (they hold a shared lock on it), nothing is removed
    /// and the answer is 0: their blobs are not named by any image yet. Files that are not
    /// blobs (a download in progress) are never touched.
    ///
    /// ```no_run
    /// # fn demo(still_used: Vec<String>) -> krunbox::Result<()> {
    /// use krunbox::image::oci::LayerCache;
    ///
    /// let freed = LayerCache::default_location().retain(&still_used)?;
    /// println!("freed {freed} bytes");
    /// # Ok(()) }
    /// ```
    pub fn retain(&self, keep: &[String]) -> Result<u64> {
        let dir = self.dir.join("sha256");
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(Error::io(format!("listing {}", dir.display()))(e)),
        };
        let Some(_exclusive) = self.lock(nix::fcntl::FlockArg::LockExclusiveNonblock)? else {
            return Ok(0);
        };
        let mut freed = 0;
        for entry in entries {
            let entry = entry.map_err(Error::io(format!("listing {}", dir.display())))?;
            let name = entry.file_name();
            let Some(hex) = name.to_str() else { continue };
            let is_blob = hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit());
            if !is_blob || keep.iter().any(|k| k.strip_prefix("sha256:") == Some(hex)) {
                continue;
            }
            let size = entry.metadata().map_or(0, |m| m.len());
            match std::fs::remove_file(entry.path()) {
                Ok(()) => freed += size,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(format!("removing blob {hex}"))(e)),
            }
        }
        Ok(freed)
    }

    /// Holds the cache for a pull or fetch until dropped: [`LayerCache::retain`] removes
    /// nothing meanwhile.
    pub(super) fn hold(&self) -> std::result::Result<CacheHold, String> {
        self.lock(nix::fcntl::FlockArg::LockShared)
            .map(|held| CacheHold(held.expect("a blocking lock is always taken")))
            .map_err(|e| e.to_string())
    }

    /// The cache's lock file, locked as `how`; `None` if a non-blocking lock is held elsewhere.
    fn lock(&self, how: nix::fcntl::FlockArg) -> Result<Option<nix::fcntl::Flock<std::fs::File>>> {
        std::fs::create_dir_all(&self.dir).map_err(Error::io(format!(
            "making the layer cache {}",
            self.dir.display()
        )))?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join("lock"))
            .map_err(Error::io("opening the layer cache's lock"))?;
        match nix::fcntl::Flock::lock(file, how) {
            Ok(locked) => Ok(Some(locked)),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(Error::io("locking the layer cache")(e.into())),
        }
    }

    /// The file of the blob with `digest`; an error for anything but a `sha256:` digest.
    pub(super) fn path(&self, digest: &str) -> std::result::Result<PathBuf, String> {
        let name = super::archive::blob_name(digest)?;
        // blob_name gives "blobs/sha256/HEX"; the cache keeps "sha256/HEX".
        Ok(self.dir.join(name.strip_prefix("blobs/").unwrap_or(&name)))
    }

    /// A writer for the blob `digest`, at most `limit` bytes; [`BlobWriter::commit`] puts it in
    /// the cache if its bytes hash to `digest`.
    pub(super) async fn writer(
        &self,
        digest: &str,
        limit: u64,
    ) -> std::result::Result<BlobWriter, String> {
        let path = self.path(digest)?;
        let parent = path
            .parent()
            .expect("blob paths have a parent")
            .to_path_buf();
        tokio::fs::create_dir_all(&parent)
            .await
            .map_err(|e| format!("making the layer cache {}: {e}", parent.display()))?;
        let temp = tempfile::Builder::new()
            .prefix(".partial-")
            .tempfile_in(&parent)
            .map_err(|e| format!("writing into the layer cache {}: {e}", parent.display()))?;
        let (file, temp_path) = temp.into_parts();
        Ok(BlobWriter {
            file: tokio::fs::File::from_std(file),
            temp_path,
            path,
            digest: digest.to_string(),
            hasher: Sha256::new(),
            written: 0,
            limit,
            on_write: None,
        })
    }

    /// Hashes the blob `digest` as it is now on disk: an error unless it is there and whole.
    pub(super) fn verify(&self, digest: &str) -> std::result::Result<(), String> {
        let path = self.path(digest)?;
        let file = std::fs::File::open(&path)
            .map_err(|e| format!("the cached blob {}: {e}", path.display()))?;
        let actual = hash_all(file).map_err(|e| format!("reading {}: {e}", path.display()))?;
        if format!("sha256:{actual}") != digest {
            return Err(format!(
                "the cached blob {} now has the digest sha256:{actual}, not {digest}: it was \
                 changed on disk; remove it and pull again",
                path.display()
            ));
        }
        Ok(())
    }
}

/// A shared hold on a [`LayerCache`] (see [`LayerCache::hold`]).
pub(super) struct CacheHold(#[allow(dead_code)] nix::fcntl::Flock<std::fs::File>);

fn hash_all(reader: impl Read) -> std::io::Result<String> {
    crate::rootfs::sha256_hex(reader)
}

/// A blob on its way into the cache: hashed and counted as it is written.
pub(super) struct BlobWriter {
    file: tokio::fs::File,
    temp_path: tempfile::TempPath,
    path: PathBuf,
    digest: String,
    hasher: Sha256,
    written: u64,
    limit: u64,
    /// Called with the bytes written so far after each write.
    on_write: Option<Box<dyn Fn(u64) + Send>>,
}

impl BlobWriter {
    /// Calls `report` with the bytes written so far after each write.
    pub(super) fn on_write(mut self, report: impl Fn(u64) + Send + 'static) -> Self {
        self.on_write = Some(Box::new(report));
        self
    }

    /// How many bytes were written.
    pub(super) fn written(&self) -> u64 {
        self.written
    }

    /// Puts the blob in the cache if it hashed to its digest; otherwise it is dropped.
    pub(super) async fn commit(mut self) -> std::result::Result<(), CommitError> {
        use tokio::io::AsyncWriteExt;
        let actual = format!("sha256:{}", hex::encode(self.hasher.finalize_reset()));
        if actual != self.digest {
            return Err(CommitError::Mismatch(format!(
                "the blob {} arrived with the digest {actual}",
                self.digest
            )));
        }
        let written = match self.file.flush().await {
            Ok(()) => self.file.sync_all().await,
            Err(e) => Err(e),
        };
        written.map_err(|e| CommitError::Io(format!("writing the blob {}: {e}", self.digest)))?;
        self.temp_path
            .persist(&self.path)
            .map_err(|e| CommitError::Io(format!("keeping the blob {}: {e}", self.digest)))
    }
}

/// Why a blob did not enter the cache.
#[derive(Debug)]
pub(super) enum CommitError {
    /// Its bytes did not hash to its digest.
    Mismatch(String),
    /// The cache's disk failed.
    Io(String),
}

impl AsyncWrite for BlobWriter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let room = self.limit.saturating_sub(self.written);
        if buf.len() as u64 > room {
            // InvalidData: the sender's fault, told apart from the cache's own failures.
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the blob {} is larger than the {} bytes its manifest gives",
                    self.digest, self.limit
                ),
            )));
        }
        let this = &mut *self;
        let written = std::task::ready!(Pin::new(&mut this.file).poll_write(cx, buf))?;
        this.hasher.update(&buf[..written]);
        this.written += written as u64;
        if let Some(report) = &this.on_write {
            report(this.written);
        }
        Poll::Ready(Ok(written))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.file).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.file).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn digest_of(bytes: &[u8]) -> String {
        format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
    }

    #[tokio::test]
    async fn blobs_enter_whole_and_verified_and_leave_by_retain() {
        let dir = tempfile::tempdir().unwrap();
        let cache = LayerCache::at(dir.path());
        let good = b"a layer's bytes".to_vec();
        let digest = digest_of(&good);

        // Bytes that do not hash to the digest never enter.
        let mut writer = cache.writer(&digest, 100).await.unwrap();
        writer.write_all(b"other bytes").await.unwrap();
        assert!(
            matches!(writer.commit().await, Err(CommitError::Mismatch(m)) if m.contains("digest"))
        );
        assert!(!cache.contains(&digest));

        // More than the manifest's size is refused as it arrives.
        let mut writer = cache.writer(&digest, 4).await.unwrap();
        let refused = writer.write_all(&good).await.unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::InvalidData);
        drop(writer);
        assert!(!cache.contains(&digest));

        let mut writer = cache.writer(&digest, good.len() as u64).await.unwrap();
        writer.write_all(&good).await.unwrap();
        assert_eq!(writer.written(), good.len() as u64);
        writer.commit().await.unwrap();
        assert!(cache.contains(&digest));
        cache.verify(&digest).unwrap();
        // No partial files are left behind.
        assert_eq!(
            std::fs::read_dir(dir.path().join("sha256"))
                .unwrap()
                .count(),
            1
        );

        // A blob changed on disk afterwards is caught before use.
        std::fs::write(cache.path(&digest).unwrap(), b"changed").unwrap();
        assert!(cache
            .verify(&digest)
            .unwrap_err()
            .contains("changed on disk"));

        assert_eq!(cache.retain(std::slice::from_ref(&digest)).unwrap(), 0);
        assert!(cache.contains(&digest));
        // While a pull holds the cache, nothing goes; a download in progress never does.
        let held = cache.hold().unwrap();
        assert_eq!(cache.retain(&[]).unwrap(), 0);
        assert!(cache.contains(&digest));
        drop(held);
        let partial = cache.writer(&digest, 100).await.unwrap();
        assert_eq!(cache.retain(&[]).unwrap(), 7);
        assert_eq!(
            std::fs::read_dir(dir.path().join("sha256"))
                .unwrap()
                .count(),
            1
        );
        drop(partial);
        assert!(!cache.contains(&digest));
        // Not a digest: refused, not a path.
        assert!(cache.path("sha256:../../etc/passwd").is_err());
        assert!(!cache.contains("md5:00"));
    }
}
