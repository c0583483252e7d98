//! [`MemoryStore`]: a layer's blocks in this process's memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::{async_trait, check_block_size, BlockStore, StoreContext, StoreError};

/// A [`BlockStore`] in host memory: it outlives boots (clone it and hand it to the next
/// sandbox) but not the process. Its memory grows with what the guest writes, up to the layer
/// disk's size: bound a root that uses it by how much its guest may change.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::rootfs::MemoryStore;
/// use krunbox::{BuiltinImage, Rootfs, Sandbox};
///
/// let store = MemoryStore::new();
/// let root = Rootfs::cow(Rootfs::builtin(BuiltinImage::Agent), store.clone(), 64 << 20);
/// let sandbox = Sandbox::builder().rootfs(root).build()?;
/// let vm = sandbox.boot().await?;
/// vm.command("sh").args(["-c", "echo kept > /etc/motd"]).status().await?;
/// vm.shutdown().await?;
/// assert!(store.stored_bytes() > 0); // and the next boot sees /etc/motd
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    block_size: u32,
}

struct Inner {
    blocks: HashMap<u64, Box<[u8]>>,
    base: Option<String>,
    attached: bool,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("block_size", &self.block_size)
            .field("stored_bytes", &self.stored_bytes())
            .finish()
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// The block size of [`MemoryStore::new`]: 64 KiB.
    pub const DEFAULT_BLOCK_SIZE: u32 = 64 << 10;

    /// An empty store of [`MemoryStore::DEFAULT_BLOCK_SIZE`] blocks.
    pub fn new() -> Self {
        Self::with_block_size(Self::DEFAULT_BLOCK_SIZE).expect("the default is valid")
    }

    /// An empty store of `block_size` blocks (a power of two from 4 KiB to 1 MiB).
    ///
    /// ```
    /// use krunbox::rootfs::MemoryStore;
    ///
    /// assert!(MemoryStore::with_block_size(4096).is_ok());
    /// assert!(MemoryStore::with_block_size(5000).is_err());
    /// ```
    pub fn with_block_size(block_size: u32) -> crate::Result<Self> {
        check_block_size(block_size).map_err(crate::Error::InvalidConfig)?;
        Ok(MemoryStore {
            inner: Arc::new(Mutex::new(Inner {
                blocks: HashMap::new(),
                base: None,
                attached: false,
            })),
            block_size,
        })
    }

    /// Bytes of blocks held.
    pub fn stored_bytes(&self) -> u64 {
        self.lock().blocks.len() as u64 * u64::from(self.block_size)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait]
impl BlockStore for MemoryStore {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    async fn attach(&self, context: &StoreContext) -> Result<(), StoreError> {
        let mut inner = self.lock();
        if inner.attached {
            return Err(StoreError::InUse);
        }
        match &inner.base {
            Some(recorded) if *recorded != context.base_sha256 => {
                return Err(StoreError::BaseMismatch {
                    expected: context.base_sha256.clone(),
                    recorded: recorded.clone(),
                })
            }
            Some(_) => {}
            None => inner.base = Some(context.base_sha256.clone()),
        }
        inner.attached = true;
        Ok(())
    }

    async fn written_blocks(&self) -> Result<Vec<u64>, StoreError> {
        Ok(self.lock().blocks.keys().copied().collect())
    }

    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let inner = self.lock();
        for (i, block) in buf.chunks_mut(self.block_size as usize).enumerate() {
            match inner.blocks.get(&(first + i as u64)) {
                Some(data) => block.copy_from_slice(data),
                None => block.fill(0),
            }
        }
        Ok(())
    }

    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
        let mut inner = self.lock();
        for (i, block) in data.chunks(self.block_size as usize).enumerate() {
            inner.blocks.insert(first + i as u64, block.into());
        }
        Ok(())
    }

    async fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn detach(&self) -> Result<(), StoreError> {
        self.lock().attached = false;
        Ok(())
    }
}
