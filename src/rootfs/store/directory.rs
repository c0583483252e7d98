//! [`DirectoryStore`]: a layer's blocks as files in a host directory.
//!
//! The layout (all ours; nothing else writes here):
//!
//! ```text
//! DIR/krunbox-store        "krunbox-block-store v1", the block size, and the base once attached
//! DIR/lock                 flock()ed while a sandbox has the store attached
//! DIR/blocks/HI/INDEX      one file per block stored (HI = INDEX >> 12, both in hex)
//! DIR/pending/INDEX        blocks written since the last flush
//! ```
//!
//! A write goes to `pending/`; a flush makes the pending files durable (`syncfs`), renames
//! them into `blocks/` and makes the renames durable (`syncfs` again). So after a crash each
//! block is whole, old or new: a block written since the last flush is in `pending/`, which
//! the next attach throws away, or already renamed over, complete. Blocking work runs on
//! tokio's blocking threads, never on the async ones.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{async_trait, check_block_size, BlockStore, StoreContext, StoreError};
use crate::error::{Error, Result};

const MAGIC: &str = "krunbox-block-store v1";
const META: &str = "krunbox-store";

/// A [`BlockStore`] in a host directory: durable across processes and host restarts, one
/// file per block. Held by one running sandbox at a time, across processes too (an exclusive
/// `flock` while attached: a second attach gets [`StoreError::InUse`]).
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::rootfs::DirectoryStore;
/// use krunbox::{BuiltinImage, Rootfs, Sandbox};
///
/// let store = DirectoryStore::open("/var/lib/myagent/root-blocks")?;
/// let root = Rootfs::cow(Rootfs::builtin(BuiltinImage::Agent), store, 64 << 20);
/// let vm = Sandbox::builder().rootfs(root).build()?.boot().await?;
/// // What the guest syncs is in the directory when `sync` returns.
/// vm.command("sh").args(["-c", "echo kept > /etc/motd && sync"]).status().await?;
/// vm.shutdown().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct DirectoryStore {
    state: Arc<Mutex<State>>,
    dir: PathBuf,
    block_size: u32,
}

struct State {
    /// Written since the last flush (in `pending/`).
    pending: HashSet<u64>,
    /// Blocks were renamed into `blocks/` by a flush that failed before syncing the renames.
    renamed_unsynced: bool,
    /// The lock file, locked, while attached.
    lock: Option<nix::fcntl::Flock<File>>,
}

impl std::fmt::Debug for DirectoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectoryStore")
            .field("dir", &self.dir)
            .field("block_size", &self.block_size)
            .finish()
    }
}

impl DirectoryStore {
    /// The block size of a store [`DirectoryStore::open`] makes: 64 KiB.
    pub const DEFAULT_BLOCK_SIZE: u32 = 64 << 10;

    /// Opens the store in `dir`, making it (and the directory) if there is none, with blocks of
    /// [`DirectoryStore::DEFAULT_BLOCK_SIZE`].
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self> {
        Self::open_with(dir.into(), None)
    }

    /// Opens the store in `dir`, making it with `block_size` blocks if there is none; an
    /// existing store of another block size is refused.
    ///
    /// ```
    /// use krunbox::rootfs::{BlockStore, DirectoryStore};
    ///
    /// let dir = tempfile::tempdir().unwrap();
    /// let store = DirectoryStore::with_block_size(dir.path(), 16384).unwrap();
    /// assert_eq!(store.block_size(), 16384);
    /// assert!(DirectoryStore::with_block_size(dir.path(), 4096).is_err());
    /// assert_eq!(DirectoryStore::open(dir.path()).unwrap().block_size(), 16384);
    /// ```
    pub fn with_block_size(dir: impl Into<PathBuf>, block_size: u32) -> Result<Self> {
        Self::open_with(dir.into(), Some(block_size))
    }

    fn open_with(dir: PathBuf, wanted: Option<u32>) -> Result<Self> {
        let fail = |what: String| {
            let dir = dir.clone();
            move |e: std::io::Error| Error::BlockStore {
                operation: "open",
                source: StoreError::Failed(format!("{what} in {}: {e}", dir.display())),
            }
        };
        if let Some(size) = wanted {
            check_block_size(size).map_err(Error::InvalidConfig)?;
        }
        for sub in ["blocks", "pending"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(fail(format!("making {sub}/")))?;
        }
        let meta_path = dir.join(META);
        let block_size = match std::fs::read_to_string(&meta_path) {
            Ok(text) => {
                let meta = Meta::parse(&text).map_err(|reason| Error::BlockStore {
                    operation: "open",
                    source: StoreError::Failed(format!("{}: {reason}", meta_path.display())),
                })?;
                if let Some(size) = wanted.filter(|size| *size != meta.block_size) {
                    return Err(Error::InvalidConfig(format!(
                        "the block store in {} has blocks of {} bytes, not {size}",
                        dir.display(),
                        meta.block_size
                    )));
                }
                meta.block_size
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let meta = Meta {
                    block_size: wanted.unwrap_or(Self::DEFAULT_BLOCK_SIZE),
                    base: None,
                };
                write_durably(&dir, META, meta.render().as_bytes())
                    .map_err(fail("writing the store's description".into()))?;
                meta.block_size
            }
            Err(e) => return Err(fail("reading the store's description".into())(e)),
        };
        Ok(DirectoryStore {
            state: Arc::new(Mutex::new(State {
                pending: HashSet::new(),
                renamed_unsynced: false,
                lock: None,
            })),
            dir,
            block_size,
        })
    }

    /// The store's directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn block_path(&self, index: u64) -> PathBuf {
        self.dir
            .join("blocks")
            .join(format!("{:x}", index >> 12))
            .join(format!("{index:x}"))
    }

    fn pending_path(&self, index: u64) -> PathBuf {
        self.dir.join("pending").join(format!("{index:x}"))
    }

    /// Runs blocking store work off the async threads.
    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&DirectoryStore) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || work(&store))
            .await
            .map_err(|e| StoreError::Failed(format!("a store task failed: {e}")))?
    }

    fn attach_blocking(&self, context: &StoreContext) -> Result<(), StoreError> {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join("lock"))?;
        // The guard unlocks when dropped: the store holds it from attach to detach.
        let locked =
            match nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusiveNonblock) {
                Ok(locked) => locked,
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Err(StoreError::InUse),
                Err((_, e)) => return Err(std::io::Error::from(e).into()),
            };
        let meta_text = std::fs::read_to_string(self.dir.join(META))?;
        let mut meta = Meta::parse(&meta_text).map_err(StoreError::Failed)?;
        if meta.block_size != self.block_size {
            return Err(StoreError::Failed(format!(
                "the store's description says blocks of {} bytes, this handle uses {}",
                meta.block_size, self.block_size
            )));
        }
        match &meta.base {
            Some(recorded) if *recorded != context.base_sha256 => {
                return Err(StoreError::BaseMismatch {
                    expected: context.base_sha256.clone(),
                    recorded: recorded.clone(),
                })
            }
            Some(_) => {}
            None => {
                meta.base = Some(context.base_sha256.clone());
                write_durably(&self.dir, META, meta.render().as_bytes())?;
            }
        }
        // Writes a crashed run never flushed: not durable, so never there.
        for entry in std::fs::read_dir(self.dir.join("pending"))? {
            std::fs::remove_file(entry?.path())?;
        }
        let mut state = self.lock();
        state.pending.clear();
        state.lock = Some(locked);
        Ok(())
    }

    fn written_blocking(&self) -> Result<Vec<u64>, StoreError> {
        let mut written = Vec::new();
        for group in std::fs::read_dir(self.dir.join("blocks"))? {
            let group = group?;
            for entry in std::fs::read_dir(group.path())? {
                let entry = entry?;
                let name = entry.file_name();
                let index = name
                    .to_str()
                    .and_then(|n| u64::from_str_radix(n, 16).ok())
                    .ok_or_else(|| {
                        StoreError::Failed(format!(
                            "{} is not a block of this store",
                            entry.path().display()
                        ))
                    })?;
                written.push(index);
            }
        }
        written.extend(self.lock().pending.iter().copied());
        Ok(written)
    }

    fn read_blocking(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let size = self.block_size as usize;
        for (i, block) in buf.chunks_mut(size).enumerate() {
            let index = first + i as u64;
            let pending = self.lock().pending.contains(&index);
            let (path, opened) = match pending.then(|| self.pending_path(index)) {
                Some(path) => match File::open(&path) {
                    // Renamed by a flush since we looked.
                    Err(e) if e.kind() == ErrorKind::NotFound => {
                        let path = self.block_path(index);
                        let opened = File::open(&path);
                        (path, opened)
                    }
                    opened => (path, opened),
                },
                None => {
                    let path = self.block_path(index);
                    let opened = File::open(&path);
                    (path, opened)
                }
            };
            match opened {
                Ok(mut file) => {
                    let mut at = 0;
                    while at < size {
                        match file.read(&mut block[at..])? {
                            0 => break,
                            n => at += n,
                        }
                    }
                    let longer = file.read(&mut [0u8; 1])? != 0;
                    if at != size || longer {
                        return Err(StoreError::Failed(format!(
                            "the block file {} does not hold one block of {size} bytes",
                            path.display()
                        )));
                    }
                }
                Err(e) if e.kind() == ErrorKind::NotFound => block.fill(0),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn write_blocking(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
        for (i, block) in data.chunks(self.block_size as usize).enumerate() {
            let index = first + i as u64;
            let path = self.pending_path(index);
            let file = File::create(&path)?;
            file.write_all_at(block, 0)?;
            self.lock().pending.insert(index);
        }
        Ok(())
    }

    fn flush_blocking(&self) -> Result<(), StoreError> {
        let (pending, renamed_unsynced) = {
            let state = self.lock();
            let pending: Vec<u64> = state.pending.iter().copied().collect();
            (pending, state.renamed_unsynced)
        };
        if pending.is_empty() && !renamed_unsynced {
            return Ok(());
        }
        let dir = File::open(&self.dir)?;
        // The pending files' data first, so that a rename never exposes a block that is not
        // on disk; then the renames themselves. Each block leaves `pending` as soon as it is
        // renamed, so a flush that fails halfway leaves every block readable where it is, and
        // the next flush syncs the renames this one could not.
        nix::unistd::syncfs(dir.as_fd()).map_err(std::io::Error::from)?;
        for index in pending {
            let target = self.block_path(index);
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::rename(self.pending_path(index), target)?;
            let mut state = self.lock();
            state.pending.remove(&index);
            state.renamed_unsynced = true;
        }
        nix::unistd::syncfs(dir.as_fd()).map_err(std::io::Error::from)?;
        self.lock().renamed_unsynced = false;
        Ok(())
    }
}

#[async_trait]
impl BlockStore for DirectoryStore {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    async fn attach(&self, context: &StoreContext) -> Result<(), StoreError> {
        let context = context.clone();
        self.blocking(move |store| store.attach_blocking(&context))
            .await
    }

    async fn written_blocks(&self) -> Result<Vec<u64>, StoreError> {
        self.blocking(|store| store.written_blocking()).await
    }

    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let len = buf.len();
        let data = self
            .blocking(move |store| {
                let mut data = vec![0u8; len];
                store.read_blocking(first, &mut data).map(|()| data)
            })
            .await?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
        let data = data.to_vec();
        self.blocking(move |store| store.write_blocking(first, &data))
            .await
    }

    async fn flush(&self) -> Result<(), StoreError> {
        self.blocking(|store| store.flush_blocking()).await
    }

    async fn detach(&self) -> Result<(), StoreError> {
        // Dropping the guard unlocks.
        drop(self.lock().lock.take());
        Ok(())
    }
}

/// The store's description file.
#[derive(Debug, PartialEq, Eq)]
struct Meta {
    block_size: u32,
    base: Option<String>,
}

impl Meta {
    fn render(&self) -> String {
        let mut text = format!("{MAGIC}\nblock-size {}\n", self.block_size);
        if let Some(base) = &self.base {
            text.push_str(&format!("base sha256:{base}\n"));
        }
        text
    }

    fn parse(text: &str) -> std::result::Result<Meta, String> {
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err(format!("not a krunbox block store (no {MAGIC:?} line)"));
        }
        let block_size = lines
            .next()
            .and_then(|l| l.strip_prefix("block-size "))
            .and_then(|n| n.parse::<u32>().ok())
            .ok_or("no block-size line")?;
        check_block_size(block_size)?;
        let base = match lines.next() {
            None => None,
            Some(line) => {
                let hex = line
                    .strip_prefix("base sha256:")
                    .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
                    .ok_or_else(|| format!("a malformed base line {line:?}"))?;
                Some(hex.to_string())
            }
        };
        Ok(Meta { block_size, base })
    }
}

/// Replaces `dir/name` with `bytes`, durably: a temporary file, synced, renamed, and the
/// directory synced.
fn write_durably(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    // A temporary file of its own: two processes making a store at once do not share one.
    let mut temp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .tempfile_in(dir)?;
    temp.write_all(bytes)?;
    temp.as_file().sync_all()?;
    temp.persist(dir.join(name)).map_err(|e| e.error)?;
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn context(base: char) -> StoreContext {
        StoreContext {
            base_sha256: base.to_string().repeat(64),
            disk_bytes: 1 << 30,
        }
    }

    #[tokio::test]
    async fn blocks_are_durable_after_flush_and_unflushed_ones_vanish_at_the_next_attach() {
        let dir = tempfile::tempdir().unwrap();
        let store = DirectoryStore::with_block_size(dir.path(), 4096).unwrap();
        store.attach(&context('a')).await.unwrap();
        let mut data = vec![7u8; 8192];
        data[4096..].fill(9);
        store.write_blocks(10, &data).await.unwrap();
        let mut back = vec![0u8; 3 * 4096];
        store.read_blocks(9, &mut back).await.unwrap();
        assert!(back[..4096].iter().all(|b| *b == 0));
        assert_eq!(&back[4096..], &data[..]);
        store.flush().await.unwrap();
        store.write_blocks(12, &[5u8; 4096]).await.unwrap();
        let mut written = store.written_blocks().await.unwrap();
        written.sort();
        assert_eq!(written, [10, 11, 12]);
        // A crash now: block 12 was never flushed. A new process opens the store.
        drop(store);
        let again = DirectoryStore::open(dir.path()).unwrap();
        assert_eq!(again.block_size(), 4096);
        again.attach(&context('a')).await.unwrap();
        let mut written = again.written_blocks().await.unwrap();
        written.sort();
        assert_eq!(written, [10, 11]);
        let mut block = vec![0u8; 4096];
        again.read_blocks(11, &mut block).await.unwrap();
        assert!(block.iter().all(|b| *b == 9));
    }

    #[tokio::test]
    async fn a_store_serves_one_attach_at_a_time_and_only_its_base() {
        let dir = tempfile::tempdir().unwrap();
        let first = DirectoryStore::open(dir.path()).unwrap();
        let second = DirectoryStore::open(dir.path()).unwrap();
        first.attach(&context('a')).await.unwrap();
        assert!(matches!(
            second.attach(&context('a')).await,
            Err(StoreError::InUse)
        ));
        first.detach().await.unwrap();
        match second.attach(&context('b')).await {
            Err(StoreError::BaseMismatch { expected, recorded }) => {
                assert_eq!(expected, "b".repeat(64));
                assert_eq!(recorded, "a".repeat(64));
            }
            other => panic!("expected a base mismatch, got {other:?}"),
        }
        second.attach(&context('a')).await.unwrap();
    }

    #[tokio::test]
    async fn damage_is_an_error_not_data() {
        let dir = tempfile::tempdir().unwrap();
        let store = DirectoryStore::with_block_size(dir.path(), 4096).unwrap();
        store.attach(&context('a')).await.unwrap();
        store.write_blocks(3, &[1u8; 4096]).await.unwrap();
        store.flush().await.unwrap();
        std::fs::write(store.block_path(3), b"short").unwrap();
        let mut block = vec![0u8; 4096];
        assert!(matches!(
            store.read_blocks(3, &mut block).await,
            Err(StoreError::Failed(_))
        ));
        std::fs::write(dir.path().join("blocks/0/zz"), b"").unwrap();
        assert!(store.written_blocks().await.is_err());
        std::fs::write(dir.path().join(META), "something else\n").unwrap();
        assert!(DirectoryStore::open(dir.path()).is_err());
    }

    #[test]
    fn descriptions_round_trip() {
        let meta = Meta {
            block_size: 65536,
            base: Some("c".repeat(64)),
        };
        assert_eq!(Meta::parse(&meta.render()).unwrap(), meta);
        assert!(Meta::parse("krunbox-block-store v1\nblock-size 3\n").is_err());
        assert!(Meta::parse("krunbox-block-store v1\nblock-size 4096\nbase sha256:xyz\n").is_err());
    }
}
