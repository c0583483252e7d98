//! Why a pull failed, in kinds a caller acts on: a leaf of its own, so that the crate's
//! [`Error`](crate::Error) can name it without importing the registry client.

/// Which way a pull failed, for [`Error::Registry`](crate::Error::Registry).
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::image::oci::{pull, Credentials, PullFailure, PullOptions};
///
/// let reference = "registry.example.com/team/private:1";
/// let mut options = PullOptions::new();
/// let pulled = match pull(reference, "private.qcow2", &options).await {
///     Err(krunbox::Error::Registry { kind: PullFailure::Unauthorized, .. }) => {
///         options = options.credentials(Credentials::Basic {
///             username: "ci".into(),
///             password: std::env::var("REGISTRY_TOKEN").unwrap_or_default(),
///         });
///         pull(reference, "private.qcow2", &options).await?
///     }
///     other => other?,
/// };
/// # let _ = pulled; Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PullFailure {
    /// The reference is not an image reference.
    InvalidReference,
    /// The registry or its token service refused the credentials, or they allow no pull of
    /// this repository: give (other) [`Credentials`](super::Credentials).
    Unauthorized,
    /// The registry has no such repository, tag or digest.
    NotFound,
    /// Content did not match its digest, or broke a bound: the registry (or what lies between)
    /// sent something else than the image it names.
    Unverified,
    /// The image is not one krunbox runs: another platform, an artifact that is not a container
    /// image, a layer format krunbox does not read.
    Unsupported,
    /// The registry could not be reached or answered with an error.
    Unreachable,
    /// The layer cache could not be written.
    Cache,
}
