//! [`DirectoryStore`]: a layer's blocks in one sparse file in a host directory.
//!
//! The layout (all ours; nothing else writes here):
//!
//! ```text
//! DIR/krunbox-store        "krunbox-block-store v2", the block size, and the base once attached
//! DIR/lock                 flock()ed while a sandbox has the store attached
//! DIR/blocks.img           block INDEX at byte INDEX * block size; blocks never written are holes
//! ```
//!
//! A write is a `pwrite` into the file; a flush is `fdatasync` (and the file's name was made
//! durable when it was made). Attached to a running VM, the file is its layer disk served in
//! place ([`BlockStore::blocks_file`]): the VMM helper does those `pwrite`s and `fdatasync`s
//! itself, straight from guest memory. So what was flushed is on disk. What a crash leaves of a block
//! written since the last flush is what the host's filesystem and disk leave of an in-place
//! write: on an ordered-data filesystem (ext4's default, XFS) over a disk whose sectors are
//! written whole, each sector old or new, which is all the guest's journalling filesystem
//! relies on. Which blocks were
//! written is the file's data extents (`SEEK_DATA`/`SEEK_HOLE`; on a filesystem without them,
//! every block below the file's end). Blocking work runs on tokio's blocking threads, never on
//! the async ones.
//!
//! Version 1 kept a file per block (`blocks/HI/INDEX`, renamed in from `pending/` by a flush).
//! Storing 32 MiB took 1.4 s there in the nested test L1 (512 files written and renamed, two
//! `syncfs`); a store of version 1 is converted at its next attach (under its lock: its
//! blocks are copied into `blocks.img`, which is synced and renamed into place before the
//! description says version 2; the old files go last, so a crash at any point leaves a store
//! that opens as one version or the other with every flushed block).

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{async_trait, check_block_size, BlockStore, StoreContext, StoreError};
use crate::error::{Error, Result};

const MAGIC: &str = "krunbox-block-store v2";
const MAGIC_V1: &str = "krunbox-block-store v1";
const META: &str = "krunbox-store";
const DATA: &str = "blocks.img";
/// A version 1 store's blocks being copied into a new [`DATA`].
const CONVERTING: &str = ".blocks.img.converting";

/// A [`BlockStore`] in a host directory: durable across processes and host restarts, the
/// blocks in one sparse file. Held by one running sandbox at a time, across processes too (an
/// exclusive `flock` while attached: a second attach gets [`StoreError::InUse`]).
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
    /// The blocks' file, open while attached.
    data: Option<Arc<File>>,
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
    /// The block size of a store [`DirectoryStore::open`] makes: 4 KiB, the layer disk's own
    /// block, so that no write needs a block read back first.
    pub const DEFAULT_BLOCK_SIZE: u32 = 4 << 10;

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
        std::fs::create_dir_all(&dir).map_err(fail("making the directory".into()))?;
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
                    version: 2,
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
                data: None,
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
        let converting = self.dir.join(CONVERTING);
        if meta.version == 1 {
            let converted = self.convert_v1(&converting);
            if converted.is_err() {
                let _ = std::fs::remove_file(&converting);
            }
            converted?;
            meta.version = 2;
            write_durably(&self.dir, META, meta.render().as_bytes())?;
        }
        // What a conversion interrupted after its new description left behind, or one that
        // crashed before it.
        for old in ["blocks", "pending"] {
            match std::fs::remove_dir_all(self.dir.join(old)) {
                Err(e) if e.kind() != ErrorKind::NotFound => return Err(e.into()),
                _ => {}
            }
        }
        match std::fs::remove_file(&converting) {
            Err(e) if e.kind() != ErrorKind::NotFound => return Err(e.into()),
            _ => {}
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
        let path = self.dir.join(DATA);
        let data = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(data) => data,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                let data = OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .read(true)
                    .write(true)
                    .open(&path)?;
                // The file's name made durable before anything flushed into it counts on it.
                File::open(&self.dir)?.sync_all()?;
                data
            }
            Err(e) => return Err(e.into()),
        };
        let mut state = self.lock();
        state.data = Some(Arc::new(data));
        state.lock = Some(locked);
        Ok(())
    }

    /// Copies a version 1 store's flushed blocks (`blocks/HI/INDEX`, one file each) into a new
    /// `blocks.img`, synced and renamed into place. `pending/` held writes never flushed: not
    /// durable, so not copied. The caller then writes the new description and removes the old
    /// files.
    fn convert_v1(&self, temp: &Path) -> Result<(), StoreError> {
        let size = self.block_size as usize;
        let data = File::create(temp)?;
        let mut block = vec![0u8; size];
        let groups = match std::fs::read_dir(self.dir.join("blocks")) {
            Ok(groups) => groups.collect::<std::io::Result<Vec<_>>>()?,
            Err(e) if e.kind() == ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        for group in groups {
            for entry in std::fs::read_dir(group.path())? {
                let entry = entry?;
                let index = entry
                    .file_name()
                    .to_str()
                    .and_then(|n| u64::from_str_radix(n, 16).ok())
                    .ok_or_else(|| {
                        StoreError::Failed(format!(
                            "{} is not a block of this store",
                            entry.path().display()
                        ))
                    })?;
                let mut file = File::open(entry.path())?;
                let mut at = 0;
                while at < size {
                    match file.read(&mut block[at..])? {
                        0 => break,
                        n => at += n,
                    }
                }
                if at != size || file.read(&mut [0u8; 1])? != 0 {
                    return Err(StoreError::Failed(format!(
                        "the block file {} does not hold one block of {size} bytes",
                        entry.path().display()
                    )));
                }
                data.write_all_at(&block, self.offset(index)?)?;
            }
        }
        data.sync_all()?;
        std::fs::rename(temp, self.dir.join(DATA))?;
        File::open(&self.dir)?.sync_all()?;
        Ok(())
    }

    /// The blocks' file, or an error before `attach`.
    fn data(&self) -> Result<Arc<File>, StoreError> {
        self.lock()
            .data
            .clone()
            .ok_or_else(|| StoreError::Failed("the store is not attached".into()))
    }

    fn written_blocking(&self) -> Result<Vec<u64>, StoreError> {
        let data = self.data()?;
        let size = u64::from(self.block_size);
        let extents = match crate::rootfs::layer::data_extents(&data) {
            Ok(extents) => extents,
            // No SEEK_DATA here (a FUSE or other filesystem that refuses it): every block below
            // the end may have been written.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS)
                ) =>
            {
                vec![(0, data.metadata()?.len())]
            }
            Err(e) => return Err(e.into()),
        };
        let mut written = Vec::new();
        for (start, end) in extents {
            written.extend(start / size..end.div_ceil(size));
        }
        written.dedup();
        Ok(written)
    }

    fn read_blocking(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let data = self.data()?;
        let offset = self.offset(first)?;
        let mut at = 0;
        while at < buf.len() {
            match data.read_at(&mut buf[at..], offset + at as u64) {
                Ok(0) => break,
                Ok(n) => at += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        // Past the file's end: blocks never written.
        buf[at..].fill(0);
        Ok(())
    }

    fn write_blocking(&self, first: u64, bytes: &[u8]) -> Result<(), StoreError> {
        self.data()?.write_all_at(bytes, self.offset(first)?)?;
        Ok(())
    }

    fn flush_blocking(&self) -> Result<(), StoreError> {
        self.data()?.sync_data()?;
        Ok(())
    }

    /// Where block `index` starts in the file.
    fn offset(&self, index: u64) -> Result<u64, StoreError> {
        index
            .checked_mul(u64::from(self.block_size))
            .filter(|offset| *offset <= i64::MAX as u64)
            .ok_or_else(|| StoreError::Failed(format!("a block index {index:#x} past any disk")))
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

    fn blocks_file(&self) -> Option<Arc<File>> {
        self.data().ok()
    }

    async fn detach(&self) -> Result<(), StoreError> {
        // Dropping the guard unlocks.
        let mut state = self.lock();
        state.data = None;
        drop(state.lock.take());
        Ok(())
    }
}

/// The store's description file.
#[derive(Debug, PartialEq, Eq)]
struct Meta {
    /// 1 (a file per block) or 2 (one sparse file).
    version: u8,
    block_size: u32,
    base: Option<String>,
}

impl Meta {
    fn render(&self) -> String {
        let magic = if self.version == 1 { MAGIC_V1 } else { MAGIC };
        let mut text = format!("{magic}\nblock-size {}\n", self.block_size);
        if let Some(base) = &self.base {
            text.push_str(&format!("base sha256:{base}\n"));
        }
        text
    }

    fn parse(text: &str) -> std::result::Result<Meta, String> {
        let mut lines = text.lines();
        let version = match lines.next() {
            Some(MAGIC) => 2,
            Some(MAGIC_V1) => 1,
            _ => return Err(format!("not a krunbox block store (no {MAGIC:?} line)")),
        };
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
        Ok(Meta {
            version,
            block_size,
            base,
        })
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
    async fn blocks_read_back_across_processes_and_never_written_ones_are_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let store = DirectoryStore::with_block_size(dir.path(), 8192).unwrap();
        store.attach(&context('a')).await.unwrap();
        let mut data = vec![7u8; 16384];
        data[8192..].fill(9);
        store.write_blocks(10, &data).await.unwrap();
        let mut back = vec![1u8; 3 * 8192];
        store.read_blocks(9, &mut back).await.unwrap();
        assert!(back[..8192].iter().all(|b| *b == 0));
        assert_eq!(&back[8192..], &data[..]);
        store.flush().await.unwrap();
        store.write_blocks(40, &[5u8; 8192]).await.unwrap();
        store.flush().await.unwrap();
        // Past the file's end, too: zeros.
        let mut far = vec![1u8; 8192];
        store.read_blocks(1000, &mut far).await.unwrap();
        assert!(far.iter().all(|b| *b == 0));
        store.detach().await.unwrap();
        assert!(
            store.read_blocks(10, &mut far).await.is_err(),
            "read while detached"
        );
        // Another process opens the store.
        drop(store);
        let again = DirectoryStore::open(dir.path()).unwrap();
        assert_eq!(again.block_size(), 8192);
        again.attach(&context('a')).await.unwrap();
        let written = again.written_blocks().await.unwrap();
        for index in [10, 11, 40] {
            assert!(written.contains(&index), "{index} in {written:?}");
        }
        assert!(
            !written.iter().any(|i| (12..40).contains(i)),
            "holes listed: {written:?}"
        );
        let mut block = vec![0u8; 8192];
        again.read_blocks(11, &mut block).await.unwrap();
        assert!(block.iter().all(|b| *b == 9));
    }

    /// A store of version 1 (a file per block; `pending/` never flushed) becomes version 2
    /// at its next attach, with every flushed block and nothing else.
    #[tokio::test]
    async fn a_version_1_store_is_converted_with_its_flushed_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let base = "a".repeat(64);
        std::fs::write(
            dir.path().join(META),
            format!("{MAGIC_V1}\nblock-size 4096\nbase sha256:{base}\n"),
        )
        .unwrap();
        for (group, index, byte) in [("0", "3", 3u8), ("1", "1002", 2)] {
            std::fs::create_dir_all(dir.path().join("blocks").join(group)).unwrap();
            std::fs::write(
                dir.path().join("blocks").join(group).join(index),
                [byte; 4096],
            )
            .unwrap();
        }
        std::fs::create_dir_all(dir.path().join("pending")).unwrap();
        std::fs::write(dir.path().join("pending/4"), [4u8; 4096]).unwrap();

        let store = DirectoryStore::open(dir.path()).unwrap();
        assert_eq!(store.block_size(), 4096);
        store.attach(&context('a')).await.unwrap();
        let mut written = store.written_blocks().await.unwrap();
        written.sort();
        assert_eq!(written, [3, 0x1002]);
        let mut blocks = vec![0u8; 2 * 4096];
        store.read_blocks(3, &mut blocks).await.unwrap();
        assert!(blocks[..4096].iter().all(|b| *b == 3));
        assert!(blocks[4096..].iter().all(|b| *b == 0), "an unflushed block");
        store
            .read_blocks(0x1002, &mut blocks[..4096])
            .await
            .unwrap();
        assert!(blocks[..4096].iter().all(|b| *b == 2));
        let meta = std::fs::read_to_string(dir.path().join(META)).unwrap();
        assert!(meta.starts_with(MAGIC), "{meta}");
        assert!(!dir.path().join("blocks").exists() && !dir.path().join("pending").exists());
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
        store.detach().await.unwrap();
        std::fs::write(dir.path().join(META), "something else\n").unwrap();
        assert!(DirectoryStore::open(dir.path()).is_err());
        // A version 1 store whose block file is short: its conversion fails, and says why.
        std::fs::write(
            dir.path().join(META),
            format!("{MAGIC_V1}\nblock-size 4096\n"),
        )
        .unwrap();
        std::fs::create_dir_all(dir.path().join("blocks/0")).unwrap();
        std::fs::write(dir.path().join("blocks/0/3"), b"short").unwrap();
        let old = DirectoryStore::open(dir.path()).unwrap();
        match old.attach(&context('a')).await {
            Err(StoreError::Failed(message)) => {
                assert!(message.contains("does not hold one block"), "{message}")
            }
            other => panic!("expected a failed conversion, got {other:?}"),
        }
        assert!(
            !dir.path().join(CONVERTING).exists(),
            "a half conversion left"
        );
    }

    #[test]
    fn descriptions_round_trip() {
        for version in [1, 2] {
            let meta = Meta {
                version,
                block_size: 65536,
                base: Some("c".repeat(64)),
            };
            assert_eq!(Meta::parse(&meta.render()).unwrap(), meta);
        }
        assert!(Meta::parse("krunbox-block-store v1\nblock-size 3\n").is_err());
        assert!(Meta::parse("krunbox-block-store v1\nblock-size 4096\nbase sha256:xyz\n").is_err());
    }
}
