//! Root filesystems as JavaScript defines them: a built-in or given image, and the writable
//! roots over one (ephemeral, persistent, copy-on-write over a block store, which may be
//! written in JavaScript).

use std::sync::Arc;

use krunbox::rootfs::{StoreContext, StoreError};
use napi::bindgen_prelude::{Buffer, Function, Promise};
use napi_derive::napi;

use crate::callback::{calls_bound, Callback};
use crate::errors::{invalid, OrNapi};

/// A root filesystem definition, made by its factories.
#[napi]
pub struct NativeRootfs {
    pub(crate) inner: krunbox::Rootfs,
}

/// The built-in image of `name`.
pub(crate) fn builtin(name: &str) -> napi::Result<krunbox::BuiltinImage> {
    match name {
        "busybox" => Ok(krunbox::BuiltinImage::Busybox),
        "agent" => Ok(krunbox::BuiltinImage::Agent),
        other => Err(invalid(format!(
            "{other:?} is not a built-in image: say \"agent\" (Debian with python3, node, git, \
             curl) or \"busybox\""
        ))),
    }
}

fn bytes(value: f64, what: &str) -> napi::Result<u64> {
    if value.is_finite() && value >= 0.0 && value <= u64::MAX as f64 {
        Ok(value as u64)
    } else {
        Err(invalid(format!("{what}={value}: give a number of bytes")))
    }
}

#[napi]
impl NativeRootfs {
    /// The built-in image `name` ("agent" or "busybox"), read-only.
    #[napi(factory)]
    pub fn builtin(name: String) -> napi::Result<Self> {
        Ok(NativeRootfs {
            inner: krunbox::Rootfs::builtin(builtin(&name)?),
        })
    }

    /// The filesystem image at `path` (`fstype`, e.g. "ext4"), read-only, checked against
    /// its `sha256` at each boot.
    #[napi(factory)]
    pub fn image(path: String, sha256: String, fstype: String) -> Self {
        NativeRootfs {
            inner: krunbox::Rootfs::image(path, &fstype, &sha256),
        }
    }

    /// `base` made writable; changes live in memory (at most `max_dirty_bytes` of them) and
    /// are gone with the instance.
    #[napi(factory)]
    pub fn ephemeral(base: &NativeRootfs, max_dirty_bytes: f64) -> napi::Result<Self> {
        Ok(NativeRootfs {
            inner: krunbox::Rootfs::ephemeral(
                base.inner.clone(),
                bytes(max_dirty_bytes, "maxDirtyBytes")?,
            ),
        })
    }

    /// `base` made writable; changes kept in the file at `path` across boots.
    #[napi(factory)]
    pub fn persistent(base: &NativeRootfs, path: String) -> Self {
        NativeRootfs {
            inner: krunbox::Rootfs::persistent(base.inner.clone(), path),
        }
    }

    /// `base` made writable; changes kept in `store`, at most `max_dirty_bytes` of them in
    /// memory before they are written there.
    #[napi(factory)]
    pub fn cow(
        base: &NativeRootfs,
        store: &NativeStore,
        max_dirty_bytes: f64,
    ) -> napi::Result<Self> {
        Ok(NativeRootfs {
            inner: krunbox::Rootfs::cow(
                base.inner.clone(),
                store.handle.clone(),
                bytes(max_dirty_bytes, "maxDirtyBytes")?,
            ),
        })
    }
}

/// A block store: one of the library's, or a JavaScript object's. One handle per store, so
/// that every root made over it shares its "attached" guard.
#[napi]
pub struct NativeStore {
    handle: krunbox::rootfs::StoreHandle,
}

/// One call into a JavaScript store.
#[napi(object)]
pub struct StoreCall {
    /// "attach", "list", "read", "write", "flush" or "detach".
    pub op: String,
    /// "attach": the base image's SHA-256 (lowercase hex).
    pub base: Option<String>,
    /// "attach": the layer disk's size in bytes.
    pub disk_bytes: Option<f64>,
    /// "read", "write": the first block.
    pub first: Option<f64>,
    /// "read": how many blocks.
    pub count: Option<u32>,
    /// "write": the blocks' bytes, `first` on.
    pub data: Option<Buffer>,
}

/// A JavaScript store's answer.
#[napi(object)]
pub struct StoreReply {
    /// "list": the indexes of the blocks it holds.
    pub blocks: Option<Vec<f64>>,
    /// "read": the blocks' bytes, exactly `count` blocks of them.
    pub data: Option<Buffer>,
}

#[napi]
impl NativeStore {
    /// The library's store keeping blocks as files in the directory `path` (served in
    /// place: blocks never pass through JavaScript).
    #[napi(factory)]
    pub fn directory(path: String) -> napi::Result<Self> {
        let store = krunbox::rootfs::DirectoryStore::open(path).or_napi()?;
        Ok(NativeStore {
            handle: krunbox::rootfs::StoreHandle::new(store),
        })
    }

    /// The library's store keeping blocks in this process's memory.
    #[napi(factory)]
    pub fn memory() -> Self {
        NativeStore {
            handle: krunbox::rootfs::StoreHandle::new(krunbox::rootfs::MemoryStore::new()),
        }
    }

    /// A store written in JavaScript: `call` does each operation, with blocks of
    /// `block_size` bytes.
    #[napi(factory)]
    pub fn javascript(
        block_size: u32,
        call: Function<'_, StoreCall, Promise<StoreReply>>,
    ) -> napi::Result<Self> {
        if !(block_size.is_power_of_two()
            && (krunbox::rootfs::MIN_BLOCK_SIZE..=krunbox::rootfs::MAX_BLOCK_SIZE)
                .contains(&block_size))
        {
            return Err(invalid(format!(
                "blockSize={block_size}: a power of two from {} to {}",
                krunbox::rootfs::MIN_BLOCK_SIZE,
                krunbox::rootfs::MAX_BLOCK_SIZE
            )));
        }
        let store = JsStore {
            block_size,
            call: Arc::new(Callback::new(&call, calls_bound())?),
        };
        Ok(NativeStore {
            handle: krunbox::rootfs::StoreHandle::new(store),
        })
    }
}

/// A JavaScript object's store as the library's `BlockStore`. What a method throws or
/// rejects fails that operation (the guest's I/O gets EIO; the boot fails for attach).
struct JsStore {
    block_size: u32,
    call: Arc<Callback<StoreCall, StoreReply>>,
}

impl JsStore {
    async fn call(&self, op: &str, call: StoreCall) -> Result<StoreReply, StoreError> {
        self.call
            .call(call)
            .await
            .map_err(|error| StoreError::Failed(format!("the block store's {op}(): {error}")))
    }
}

fn call(op: &str) -> StoreCall {
    StoreCall {
        op: op.into(),
        base: None,
        disk_bytes: None,
        first: None,
        count: None,
        data: None,
    }
}

#[krunbox::rootfs::async_trait]
impl krunbox::rootfs::BlockStore for JsStore {
    fn block_size(&self) -> u32 {
        self.block_size
    }

    async fn attach(&self, context: &StoreContext) -> Result<(), StoreError> {
        let attach = StoreCall {
            base: Some(context.base_sha256.clone()),
            disk_bytes: Some(context.disk_bytes as f64),
            ..call("attach")
        };
        self.call("attach", attach).await.map(drop)
    }

    async fn written_blocks(&self) -> Result<Vec<u64>, StoreError> {
        let reply = self.call("list", call("list")).await?;
        reply
            .blocks
            .unwrap_or_default()
            .into_iter()
            .map(|index| {
                if index.is_finite() && index >= 0.0 && index.fract() == 0.0 {
                    Ok(index as u64)
                } else {
                    Err(StoreError::Failed(format!(
                        "the block store's list() gave {index}, not a block index"
                    )))
                }
            })
            .collect()
    }

    async fn read_blocks(&self, first: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let count = (buf.len() / self.block_size as usize) as u32;
        let read = StoreCall {
            first: Some(first as f64),
            count: Some(count),
            ..call("read")
        };
        let reply = self.call("read", read).await?;
        let data = reply.data.map(|d| d.to_vec()).unwrap_or_default();
        if data.len() != buf.len() {
            return Err(StoreError::Failed(format!(
                "the block store's read() of {count} blocks from {first} gave {} bytes, not {}",
                data.len(),
                buf.len()
            )));
        }
        buf.copy_from_slice(&data);
        Ok(())
    }

    async fn write_blocks(&self, first: u64, data: &[u8]) -> Result<(), StoreError> {
        let write = StoreCall {
            first: Some(first as f64),
            data: Some(Buffer::from(data.to_vec())),
            ..call("write")
        };
        self.call("write", write).await.map(drop)
    }

    async fn flush(&self) -> Result<(), StoreError> {
        self.call("flush", call("flush")).await.map(drop)
    }

    async fn detach(&self) -> Result<(), StoreError> {
        self.call("detach", call("detach")).await.map(drop)
    }
}
