//! Pulling images from an OCI registry (the distribution API, through `oci-client`): the
//! manifest for linux/amd64, then the config and layers into a [`LayerCache`], each checked
//! against its digest as it arrives, then the same build an archive import does.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};

use super::blobs::CommitError;
use super::failure::PullFailure;
use super::{
    assemble, decompress, BuildFailure, LayerCache, Layers, OciImage, MAX_JSON, MAX_LAYERS,
};
use crate::error::{Error, Result};

/// The largest layer a registry may send (compressed): the image disk's size.
const MAX_LAYER_BYTES: u64 = super::merge::MAX_MERGED_BYTES;

/// How many layers download at once.
const PARALLEL_DOWNLOADS: usize = 3;

/// Media types of image configs (OCI's, and Docker's image manifest v2 schema 2).
const CONFIG_TYPES: [&str; 2] = [
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
];

/// How long the authentication and the manifest may take, each.
const REQUEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(300);

/// The most of a registry's error message an error keeps.
const MAX_REASON: usize = 1024;

/// How krunbox identifies itself to registries.
const USER_AGENT: &str = concat!("krunbox/", env!("CARGO_PKG_VERSION"));

/// Who a pull is made as.
///
/// Registries with token authentication (Docker Hub, GHCR, the distribution registry with
/// `auth: token`) answer with a challenge, and krunbox asks the token service it names for a
/// token, anonymously or with these credentials; registries with basic authentication get the
/// credentials on each request.
///
/// ```
/// use krunbox::image::oci::{Credentials, PullOptions};
///
/// // A registry access token used as a password (GHCR, GitLab, Harbor robots).
/// let credentials = Credentials::Basic {
///     username: "ci-bot".into(),
///     password: std::env::var("REGISTRY_TOKEN").unwrap_or_default(),
/// };
/// // Never printed: Debug shows the user only.
/// assert!(!format!("{credentials:?}").contains("REGISTRY_TOKEN"));
/// let options = PullOptions::new().credentials(credentials);
/// # let _ = options;
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub enum Credentials {
    /// No credentials: public images.
    #[default]
    Anonymous,
    /// A user name and password (or access token used as one).
    Basic {
        /// The user name.
        username: String,
        /// The password or access token.
        password: String,
    },
    /// A bearer token the caller got itself, sent as it is.
    Bearer(String),
}

impl fmt::Debug for Credentials {
    // Secrets never reach logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Credentials::Anonymous => f.write_str("Anonymous"),
            Credentials::Basic { username, .. } => f
                .debug_struct("Basic")
                .field("username", username)
                .field("password", &"<redacted>")
                .finish(),
            Credentials::Bearer(_) => f.write_str("Bearer(<redacted>)"),
        }
    }
}

/// How far a pull is: one report per chunk of a layer received.
///
/// ```
/// use krunbox::image::oci::PullOptions;
///
/// let options = PullOptions::new().on_progress(|p| {
///     let percent = p.received * 100 / p.size.max(1);
///     eprintln!("{}: {percent}%", &p.digest[..19]);
/// });
/// # let _ = options;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullProgress {
    /// The layer's digest.
    pub digest: String,
    /// Bytes of it received so far.
    pub received: u64,
    /// Its size, as the manifest gives it.
    pub size: u64,
}

type ProgressFn = dyn Fn(&PullProgress) + Send + Sync;

/// How to pull: credentials, the registry's transport, the layer cache, progress.
///
/// ```
/// use krunbox::image::oci::{Credentials, LayerCache, PullOptions};
///
/// let options = PullOptions::new()
///     .credentials(Credentials::Basic {
///         username: "ci".into(),
///         password: std::env::var("REGISTRY_TOKEN").unwrap_or_default(),
///     })
///     .cache(LayerCache::at("/var/cache/agents/blobs"))
///     .on_progress(|p| eprintln!("{}: {}/{}", p.digest, p.received, p.size));
/// # let _ = options;
/// ```
#[derive(Clone)]
pub struct PullOptions {
    credentials: Credentials,
    plain_http: bool,
    root_certificates: Vec<Vec<u8>>,
    cache: LayerCache,
    progress: Option<Arc<ProgressFn>>,
}

impl fmt::Debug for PullOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PullOptions")
            .field("credentials", &self.credentials)
            .field("plain_http", &self.plain_http)
            .field("root_certificates", &self.root_certificates.len())
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

impl Default for PullOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl PullOptions {
    /// Anonymous, over HTTPS verified against the host's roots, into
    /// [`LayerCache::default_location`].
    pub fn new() -> Self {
        PullOptions {
            credentials: Credentials::Anonymous,
            plain_http: false,
            root_certificates: Vec::new(),
            cache: LayerCache::default_location(),
            progress: None,
        }
    }

    /// Pull as `credentials`.
    pub fn credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = credentials;
        self
    }

    /// Talk to the registry over plain HTTP instead of HTTPS (a registry on loopback or a
    /// private network, like Docker's "insecure registries"). Credentials then cross the
    /// network in the clear; digests are still checked.
    pub fn plain_http(mut self, plain_http: bool) -> Self {
        self.plain_http = plain_http;
        self
    }

    /// Trust `pem` (one or more PEM certificates) as roots for the registry's HTTPS, beside
    /// the host's roots: a registry with a private CA.
    pub fn root_certificate_pem(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.root_certificates.push(pem.into());
        self
    }

    /// Keep blobs in `cache` (by default [`LayerCache::default_location`]).
    pub fn cache(mut self, cache: LayerCache) -> Self {
        self.cache = cache;
        self
    }

    /// Call `report` as layers arrive (from the download tasks: keep it quick).
    pub fn on_progress(mut self, report: impl Fn(&PullProgress) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(report));
        self
    }
}

/// What [`fetch`] brought into the cache.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::image::oci::{fetch, PullOptions};
///
/// let fetched = fetch("registry.example.com/team/app:2", &PullOptions::new()).await?;
/// println!(
///     "{}: {} of {} layers downloaded, {} bytes",
///     fetched.manifest_digest,
///     fetched.layers_fetched,
///     fetched.layers.len(),
///     fetched.bytes_fetched
/// );
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// The digest of the image's manifest (for linux/amd64, when the reference names an index).
    pub manifest_digest: String,
    /// The digest of its config blob: the image's identity.
    pub config_digest: String,
    /// Its layers' digests, bottom first.
    pub layers: Vec<String>,
    /// How many layers were downloaded.
    pub layers_fetched: usize,
    /// How many layers the cache had already (a layer the manifest lists twice counts once as
    /// downloaded, then as cached): `layers_fetched + layers_cached == layers.len()`.
    pub layers_cached: usize,
    /// How many bytes were downloaded (layers and config).
    pub bytes_fetched: u64,
}

/// What [`pull`] made.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::image::oci::{pull, PullOptions};
///
/// let pulled = pull("registry.example.com/team/app:2", "app.qcow2", &PullOptions::new()).await?;
/// println!("{} (config {})", pulled.image.image.path.display(), pulled.image.config_digest);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    /// The image, ready to boot.
    pub image: OciImage,
    /// What was downloaded for it.
    pub fetched: Fetched,
}

/// Pulls `reference` (`registry/repository:tag` or `…@sha256:…`; a bare `name` means Docker
/// Hub's `library/name`) and makes it a bootable image at `output` (a qcow2, replaced if it
/// exists), as [`import`](super::import) does for an archive.
///
/// Every blob is checked against its digest as it arrives, and layers are hashed again before
/// the image is built from them. Layers the cache holds are not downloaded again.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::image::oci::{pull, PullOptions};
/// use krunbox::Sandbox;
///
/// let pulled = pull("ghcr.io/acme/agent-tools:1.4", "/var/lib/a/tools.qcow2", &PullOptions::new())
///     .await?;
/// let vm = Sandbox::builder()
///     .rootfs(pulled.image.rootfs())
///     .image_config(pulled.image.config.clone())
///     .build()?
///     .boot()
///     .await?;
/// let out = vm.entrypoint()?.output().await?;
/// # let _ = out; Ok(()) }
/// ```
pub async fn pull(
    reference: &str,
    output: impl AsRef<Path>,
    options: &PullOptions,
) -> Result<Pulled> {
    let failed = |kind, reason| Error::Registry {
        reference: reference.to_string(),
        kind,
        reason,
    };
    // Held until the image is built: the blobs are not named by any image before that.
    let _hold = options
        .cache
        .hold()
        .map_err(|e| failed(PullFailure::Cache, e))?;
    let fetched = fetch(reference, options).await?;
    let cache = options.cache.clone();
    let config_digest = fetched.config_digest.clone();
    let digests = fetched.layers.clone();
    // Hashed again now, on disk, just before use: a blob changed in the cache since it was
    // stored is refused.
    let config = tokio::task::spawn_blocking(move || {
        for digest in digests.iter().chain([&config_digest]) {
            cache.verify(digest)?;
        }
        // Bounded here too: a config the cache had already (perhaps a layer of another
        // image) was not downloaded with the config's bound.
        let mut config = Vec::new();
        std::fs::File::open(cache.path(&config_digest)?)
            .and_then(|file| {
                std::io::Read::read_to_end(
                    &mut std::io::Read::take(file, MAX_JSON + 1),
                    &mut config,
                )
            })
            .map_err(|e| format!("reading the cached config: {e}"))?;
        if config.len() as u64 > MAX_JSON {
            return Err(format!("the config is larger than {MAX_JSON} bytes"));
        }
        Ok::<_, String>((config, digests, cache))
    })
    .await
    .map_err(|e| failed(PullFailure::Cache, e.to_string()))?
    .map_err(|e| failed(PullFailure::Unverified, e))?;
    let (config, digests, cache) = config;
    let layers = Layers {
        config,
        config_digest: fetched.config_digest.clone(),
        count: digests.len(),
        diff_ids_checked: false,
        open: Box::new(move |i| {
            let path = cache.path(&digests[i]).map_err(std::io::Error::other)?;
            let file = std::fs::File::open(path)?;
            decompress(Box::new(file)).map_err(std::io::Error::other)
        }),
    };
    let image = assemble(layers, output.as_ref())
        .await
        .map_err(|failure| match failure {
            BuildFailure::Content(reason) => failed(PullFailure::Unsupported, reason),
            BuildFailure::Unverified(reason) => failed(PullFailure::Unverified, reason),
            BuildFailure::Other(e) => e,
        })?;
    Ok(Pulled { image, fetched })
}

/// Downloads `reference`'s config and layers into the options' cache (skipping layers it holds
/// already), without building an image: to warm a cache, or to learn an image's digests.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::image::oci::{fetch, PullOptions};
///
/// let fetched = fetch("registry.example.com/team/base:1", &PullOptions::new()).await?;
/// println!("{} layers, {} downloaded", fetched.layers.len(), fetched.layers_fetched);
/// # Ok(()) }
/// ```
pub async fn fetch(reference: &str, options: &PullOptions) -> Result<Fetched> {
    let failed = |kind, reason: String| Error::Registry {
        reference: reference.to_string(),
        kind,
        reason,
    };
    let parsed: Reference = reference
        .parse()
        .map_err(|e| failed(PullFailure::InvalidReference, format!("{e}")))?;
    let client = client(options)?;
    let _hold = options
        .cache
        .hold()
        .map_err(|e| failed(PullFailure::Cache, e))?;
    let auth = match &options.credentials {
        Credentials::Anonymous => RegistryAuth::Anonymous,
        Credentials::Basic { username, password } => {
            RegistryAuth::Basic(username.clone(), password.clone())
        }
        Credentials::Bearer(token) => RegistryAuth::Bearer(token.clone()),
    };
    // Asked for first, on its own: the client's later requests would drop a token service's
    // refusal and go on unauthenticated, and the registry's answer would then say less.
    // Each has a deadline of its own: oci-client reads these answers whole, and a read
    // timeout alone restarts with every byte a slow registry sends.
    let deadline = |what: &str| {
        failed(
            PullFailure::Unreachable,
            format!("the registry did not answer {what} within {REQUEST_DEADLINE:?}"),
        )
    };
    tokio::time::timeout(
        REQUEST_DEADLINE,
        client.auth(&parsed, &auth, RegistryOperation::Pull),
    )
    .await
    .map_err(|_| deadline("the authentication"))?
    .map_err(|e| classified(reference, e))?;
    let (manifest, manifest_digest) =
        tokio::time::timeout(REQUEST_DEADLINE, client.pull_image_manifest(&parsed, &auth))
            .await
            .map_err(|_| deadline("for the manifest"))?
            .map_err(|e| classified(reference, e))?;
    if manifest.layers.len() > MAX_LAYERS {
        return Err(failed(
            PullFailure::Unsupported,
            format!("{} layers, more than {MAX_LAYERS}", manifest.layers.len()),
        ));
    }
    let config_type = manifest.config.media_type.as_str();
    if !CONFIG_TYPES.contains(&config_type) {
        return Err(failed(
            PullFailure::Unsupported,
            format!("an artifact of type {config_type:?}, not a container image"),
        ));
    }
    let total: u64 = manifest
        .layers
        .iter()
        .map(|l| u64::try_from(l.size).unwrap_or(u64::MAX))
        .fold(0, u64::saturating_add);
    if total > MAX_LAYER_BYTES {
        return Err(failed(
            PullFailure::Unsupported,
            format!("its layers are {total} bytes together, more than the {MAX_LAYER_BYTES} of an image's disk"),
        ));
    }
    for layer in &manifest.layers {
        // Foreign and non-distributable layers live elsewhere (their `urls`): never fetched.
        let elsewhere =
            layer.media_type.contains("foreign") || layer.media_type.contains("nondistributable");
        if !layer.media_type.contains("tar") || elsewhere {
            return Err(failed(
                PullFailure::Unsupported,
                format!(
                    "the layer {} is a {:?}, not a tar layer",
                    layer.digest, layer.media_type
                ),
            ));
        }
    }

    let cache = &options.cache;
    let mut bytes_fetched = 0;
    if !cache.contains(&manifest.config.digest) {
        bytes_fetched += download(&client, &parsed, &manifest.config, MAX_JSON, options, false)
            .await
            .map_err(|e| e.into_error(reference))?;
    }
    let mut layers_cached = 0;
    let mut missing = Vec::new();
    for layer in &manifest.layers {
        let listed_before = missing
            .iter()
            .any(|m: &OciDescriptor| m.digest == layer.digest);
        // A layer listed twice is downloaded once, and cached the second time.
        if listed_before || cache.contains(&layer.digest) {
            layers_cached += 1;
        } else {
            missing.push(layer.clone());
        }
    }
    let layers_fetched = missing.len();
    let permits = Arc::new(tokio::sync::Semaphore::new(PARALLEL_DOWNLOADS));
    let mut downloads = tokio::task::JoinSet::new();
    for layer in missing {
        let (client, parsed, options, permits) = (
            client.clone(),
            parsed.clone(),
            options.clone(),
            permits.clone(),
        );
        downloads.spawn(async move {
            let _permit = permits.acquire_owned().await;
            download(&client, &parsed, &layer, MAX_LAYER_BYTES, &options, true).await
        });
    }
    while let Some(done) = downloads.join_next().await {
        match done {
            Ok(Ok(bytes)) => bytes_fetched += bytes,
            Ok(Err(e)) => return Err(e.into_error(reference)),
            Err(e) => {
                return Err(failed(
                    PullFailure::Cache,
                    format!("a download failed: {e}"),
                ))
            }
        }
    }
    Ok(Fetched {
        manifest_digest,
        config_digest: manifest.config.digest.clone(),
        layers: manifest.layers.iter().map(|l| l.digest.clone()).collect(),
        layers_fetched,
        layers_cached,
        bytes_fetched,
    })
}

/// A download's failure, kept apart until the reference is at hand.
struct DownloadError(PullFailure, String);

impl DownloadError {
    fn into_error(self, reference: &str) -> Error {
        Error::Registry {
            reference: reference.to_string(),
            kind: self.0,
            reason: self.1,
        }
    }
}

/// Downloads the blob `descriptor` into the cache (at most `limit` bytes, and no more than
/// the descriptor's size); how many bytes came.
async fn download(
    client: &Client,
    reference: &Reference,
    descriptor: &OciDescriptor,
    limit: u64,
    options: &PullOptions,
    report: bool,
) -> std::result::Result<u64, DownloadError> {
    let size = u64::try_from(descriptor.size)
        .ok()
        .filter(|&size| size <= limit)
        .ok_or_else(|| {
            DownloadError(
                PullFailure::Unsupported,
                format!(
                    "the blob {} is {} bytes, more than the {limit} krunbox takes",
                    descriptor.digest, descriptor.size
                ),
            )
        })?;
    let mut writer = options
        .cache
        .writer(&descriptor.digest, size)
        .await
        .map_err(|e| DownloadError(PullFailure::Cache, e))?;
    if let Some(progress) = report.then(|| options.progress.clone()).flatten() {
        let digest = descriptor.digest.clone();
        writer = writer.on_write(move |received| {
            progress(&PullProgress {
                digest: digest.clone(),
                received,
                size,
            })
        });
    }
    // Only from this registry: a descriptor's `urls` would send oci-client elsewhere.
    let descriptor = &OciDescriptor {
        urls: None,
        ..descriptor.clone()
    };
    let pulled = client.pull_blob(reference, descriptor, &mut writer).await;
    let written = writer.written();
    match pulled {
        Ok(()) => {}
        Err(OciDistributionError::IoError(e)) => {
            // Our writer's refusal of more bytes than the manifest gives (InvalidData), or the
            // cache's own failures.
            let kind = if e.kind() == std::io::ErrorKind::InvalidData {
                PullFailure::Unverified
            } else {
                PullFailure::Cache
            };
            return Err(DownloadError(kind, e.to_string()));
        }
        Err(e) => {
            let (kind, reason) = classify(e);
            return Err(DownloadError(kind, reason));
        }
    }
    if written != size {
        return Err(DownloadError(
            PullFailure::Unverified,
            format!(
                "the blob {} arrived with {written} bytes, not the {size} its manifest gives",
                descriptor.digest
            ),
        ));
    }
    writer.commit().await.map_err(|e| match e {
        CommitError::Mismatch(reason) => DownloadError(PullFailure::Unverified, reason),
        CommitError::Io(reason) => DownloadError(PullFailure::Cache, reason),
    })?;
    Ok(written)
}

/// The registry client for these options.
fn client(options: &PullOptions) -> Result<Client> {
    // reqwest needs a process-wide rustls provider (krunbox builds rustls with ring only). If
    // the program installed one already, that one stays.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut config = ClientConfig {
        protocol: if options.plain_http {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        },
        user_agent: USER_AGENT,
        // An index resolves to linux/amd64, the only platform krunbox boots.
        platform_resolver: Some(Box::new(oci_client::client::linux_amd64_resolver)),
        max_concurrent_download: PARALLEL_DOWNLOADS,
        connect_timeout: Some(std::time::Duration::from_secs(30)),
        read_timeout: Some(std::time::Duration::from_secs(300)),
        ..ClientConfig::default()
    };
    for pem in &options.root_certificates {
        check_certificates(pem).map_err(Error::InvalidConfig)?;
        config.extra_root_certificates.push(Certificate {
            encoding: CertificateEncoding::Pem,
            data: pem.clone(),
        });
    }
    // Not Client::new, which falls back to a default client (HTTPS, no extra roots) on error.
    Client::try_from(config)
        .map_err(|e| Error::InvalidConfig(format!("setting up the registry client: {e}")))
}

/// Checks that `pem` holds certificates and nothing unreadable: reqwest would take a file of
/// none as an empty bundle, and the registry's TLS would then fail with less to say.
fn check_certificates(pem: &[u8]) -> std::result::Result<(), String> {
    use rustls::pki_types::pem::PemObject;
    let certificates = rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| format!("a root certificate given is not readable PEM: {e}"))?;
    if certificates.is_empty() {
        return Err("a root certificate given holds no PEM certificate".into());
    }
    Ok(())
}

/// The typed error for what the registry client reported about `reference`.
fn classified(reference: &str, error: OciDistributionError) -> Error {
    let (kind, reason) = classify(error);
    Error::Registry {
        reference: reference.to_string(),
        kind,
        reason,
    }
}

/// What kind of failure the registry client reported, and its message made fit to print: at
/// most [`MAX_REASON`] bytes, control characters (a hostile registry's terminal escapes among
/// them) replaced.
fn classify(error: OciDistributionError) -> (PullFailure, String) {
    use OciDistributionError as E;
    let kind = match &error {
        E::AuthenticationFailure(_) | E::UnauthorizedError { .. } => PullFailure::Unauthorized,
        E::RegistryError { envelope, .. } => {
            if envelope
                .errors
                .iter()
                .any(|e| matches!(e.code, OciErrorCode::Unauthorized | OciErrorCode::Denied))
            {
                PullFailure::Unauthorized
            } else if envelope.errors.iter().any(|e| {
                matches!(
                    e.code,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NotFound
                )
            }) {
                PullFailure::NotFound
            } else {
                PullFailure::Unreachable
            }
        }
        E::ServerError { code: 404, .. } | E::ImageManifestNotFoundError(_) => {
            PullFailure::NotFound
        }
        E::ServerError {
            code: 401 | 403, ..
        } => PullFailure::Unauthorized,
        E::DigestError(_) | E::SpecViolationError(_) => PullFailure::Unverified,
        E::UnsupportedMediaTypeError(_)
        | E::UnsupportedSchemaVersionError(_)
        | E::IncompatibleLayerMediaTypeError(_)
        | E::ManifestParsingError(_)
        | E::VersionedParsingError(_) => PullFailure::Unsupported,
        _ => PullFailure::Unreachable,
    };
    let mut reason: String = error
        .to_string()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if reason.len() > MAX_REASON {
        let cut = (0..=MAX_REASON)
            .rev()
            .find(|&i| reason.is_char_boundary(i))
            .unwrap_or(0);
        reason.truncate(cut);
        reason.push('…');
    }
    (kind, reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_never_print_their_secrets() {
        let basic = Credentials::Basic {
            username: "ci".into(),
            password: "hunter2".into(),
        };
        let bearer = Credentials::Bearer("tok-123".into());
        let shown = format!(
            "{basic:?} {bearer:?} {:?}",
            PullOptions::new().credentials(basic.clone())
        );
        assert!(shown.contains("ci"), "{shown}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("tok-123"),
            "{shown}"
        );
    }

    #[tokio::test]
    async fn a_reference_that_is_not_one_is_refused_before_any_request() {
        let options = PullOptions::new().cache(LayerCache::at("/nonexistent"));
        // None of these reaches the network: each fails to parse.
        for bad in ["", "name@sha256:short", "a b", "name:", ":tag"] {
            match fetch(bad, &options).await {
                Err(Error::Registry {
                    kind: PullFailure::InvalidReference,
                    ..
                }) => {}
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_root_certificate_must_be_pem() {
        let options = PullOptions::new().root_certificate_pem(b"not a certificate".to_vec());
        assert!(matches!(client(&options), Err(Error::InvalidConfig(_))));
        let cert = rcgen::generate_simple_self_signed(vec!["registry.test".into()]).unwrap();
        let options = PullOptions::new().root_certificate_pem(cert.cert.pem().into_bytes());
        assert!(client(&options).is_ok());
    }

    #[test]
    fn a_registrys_message_is_bounded_and_printable() {
        let (kind, reason) = classify(OciDistributionError::AuthenticationFailure(format!(
            "\u{1b}[31mdenied{}",
            "x".repeat(5000)
        )));
        assert_eq!(kind, PullFailure::Unauthorized);
        assert!(!reason.chars().any(char::is_control), "{reason:?}");
        assert!(reason.len() <= MAX_REASON + 3);
    }
}
