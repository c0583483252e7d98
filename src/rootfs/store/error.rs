//! Why a store operation failed: a leaf of its own, so that the crate's [`Error`](crate::Error)
//! can name it without importing the stores.

/// Why a store operation failed. krunbox reports it as
/// [`Error::BlockStore`](crate::Error::BlockStore) and the guest's pending I/O as `EIO`; blocks
/// that could not be stored stay in host memory and are offered again at the next sync.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store holds a layer made over another base image.
    #[error("the store holds a layer of the base image with SHA-256 {recorded}, not {expected}")]
    BaseMismatch {
        /// The base this boot lays the layer over.
        expected: String,
        /// The base the store was made for.
        recorded: String,
    },
    /// The store is attached to another running sandbox (in this process or another).
    #[error("the store is attached to another running sandbox")]
    InUse,
    /// An I/O error of the store's own storage.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Any other failure, in the store's words.
    #[error("{0}")]
    Failed(String),
}
