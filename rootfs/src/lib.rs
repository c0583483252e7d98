//! Builds krunbox's built-in, read-only guest root images from Debian packages.
//!
//! An image is an [EROFS] file system. krunbox attaches it to the microVM as a
//! read-only virtio-blk disk and the guest mounts it read-only as `/`. The image
//! holds no init: krunbox's static `guest-init` is supplied by the host, and it
//! mounts `/proc`, `/sys`, `/dev`, `/dev/pts` and `/tmp` itself, so an image only
//! needs those directories to exist as mount points.
//!
//! Two images are built in:
//!
//! * [`BuiltinImage::Busybox`]: Debian's `busybox-static` binary plus one symlink
//!   per applet, about 2 MB.
//! * [`BuiltinImage::Agent`]: a minimal Debian bookworm (`mmdebstrap
//!   --variant=minbase`) with python3, pip, curl, git, ca-certificates and procps.
//!
//! Images are built into a cache directory ([`default_cache_dir`]) as
//! `images/<name>.erofs`, next to a JSON [`ImageManifest`] recording the image's
//! SHA-256, its size and the exact Debian package versions used, so a rebuild
//! from the same package versions gives a byte-identical image.
//!
//! Why EROFS: it is designed for read-only images, needs no journal or free-space
//! bookkeeping, is in the guest kernel (libkrunfw's Linux 6.12 has
//! `CONFIG_EROFS_FS=y`), and `mkfs.erofs` builds it from a plain directory
//! without root, loop devices or mounts, with flags that make the output
//! reproducible (fixed timestamp, fixed UUID, all files owned by root, entries in
//! sorted order whatever the source directory's order).
//!
//! Only Debian's own tools and package archive are used, and the Debian mirror
//! is the one the machine's apt configuration already uses. The build tools are
//! not installed by this crate: a missing one gives [`BuildError::MissingTool`].
//!
//! ```no_run
//! use krunbox_rootfs::{build, default_cache_dir, BuiltinImage};
//!
//! let cache = default_cache_dir();
//! let manifest = build(&cache, BuiltinImage::Busybox, &mut |line| eprintln!("{line}"))?;
//! println!("{} sha256={}", manifest.name, manifest.sha256);
//! # Ok::<(), krunbox_rootfs::BuildError>(())
//! ```
//!
//! [EROFS]: https://docs.kernel.org/filesystems/erofs.html

mod agent;
mod busybox;
mod cmd;
mod erofs;
mod tree;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fmt;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The one apt command that installs every tool the builders use.
pub const INSTALL_HINT: &str = "apt-get install erofs-utils mmdebstrap busybox-static";

/// Value of [`ImageManifest::builder`]: this crate's version.
pub const BUILDER_VERSION: &str = concat!("krunbox-rootfs ", env!("CARGO_PKG_VERSION"));

/// Value of [`ImageManifest::format`] for every image built here.
pub const FORMAT_EROFS: &str = "erofs";

/// One of krunbox's built-in root images.
///
/// ```
/// use krunbox_rootfs::BuiltinImage;
///
/// let image: BuiltinImage = "agent".parse().unwrap();
/// assert_eq!(image, BuiltinImage::Agent);
/// assert_eq!(image.name(), "agent");
/// assert_eq!(BuiltinImage::ALL.len(), 2);
/// assert!("ubuntu".parse::<BuiltinImage>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BuiltinImage {
    /// `busybox-static` and its applet symlinks: a tiny shell environment.
    Busybox,
    /// Debian bookworm minbase with python3, pip, curl, git, ca-certificates, procps.
    Agent,
}

impl BuiltinImage {
    /// Every built-in image, in a fixed order.
    pub const ALL: [BuiltinImage; 2] = [BuiltinImage::Busybox, BuiltinImage::Agent];

    /// The image's name, used in file names and on the command line.
    ///
    /// ```
    /// assert_eq!(krunbox_rootfs::BuiltinImage::Busybox.name(), "busybox");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            BuiltinImage::Busybox => "busybox",
            BuiltinImage::Agent => "agent",
        }
    }
}

impl fmt::Display for BuiltinImage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The error of parsing an unknown image name.
///
/// ```
/// let err = "nope".parse::<krunbox_rootfs::BuiltinImage>().unwrap_err();
/// assert!(err.to_string().contains("busybox, agent"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown built-in image `{0}`; expected one of: busybox, agent")]
pub struct UnknownImage(pub String);

impl FromStr for BuiltinImage {
    type Err = UnknownImage;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        BuiltinImage::ALL
            .into_iter()
            .find(|image| image.name() == s)
            .ok_or_else(|| UnknownImage(s.to_string()))
    }
}

/// A Debian package that went into an image, at its exact version.
///
/// ```
/// let input = krunbox_rootfs::PackageInput {
///     name: "busybox-static".into(),
///     version: "1:1.35.0-4+b1".into(),
/// };
/// assert_eq!(input.to_string(), "busybox-static=1:1.35.0-4+b1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PackageInput {
    /// Debian package name, e.g. `busybox-static`.
    pub name: String,
    /// Exact Debian version, e.g. `1:1.35.0-4+deb12u1+b1`.
    pub version: String,
}

impl fmt::Display for PackageInput {
    /// The `name=version` form that `apt-get install` accepts.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.name, self.version)
    }
}

/// What was built: stored as `images/<name>.json` next to the image.
///
/// ```
/// use krunbox_rootfs::{ImageManifest, PackageInput};
///
/// let manifest = ImageManifest {
///     name: "busybox".into(),
///     format: "erofs".into(),
///     sha256: "00".repeat(32),
///     size: 4096,
///     inputs: vec![PackageInput { name: "busybox-static".into(), version: "1:1.35.0-4".into() }],
///     builder: krunbox_rootfs::BUILDER_VERSION.into(),
///     tools: vec![PackageInput { name: "erofs-utils".into(), version: "1.5-1".into() }],
/// };
/// let json = serde_json::to_string(&manifest).unwrap();
/// assert_eq!(serde_json::from_str::<ImageManifest>(&json).unwrap(), manifest);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageManifest {
    /// The image's name ([`BuiltinImage::name`]).
    pub name: String,
    /// File system format of the image: always `"erofs"` ([`FORMAT_EROFS`]).
    pub format: String,
    /// SHA-256 of the whole image file, lowercase hex.
    pub sha256: String,
    /// Size of the image file in bytes.
    pub size: u64,
    /// Every Debian package used, sorted by name, with its exact version.
    pub inputs: Vec<PackageInput>,
    /// The builder that made the image ([`BUILDER_VERSION`]).
    pub builder: String,
    /// Host Debian packages of the tools that made the image (`erofs-utils`,
    /// and `mmdebstrap` for the agent image): another version of them may lay
    /// out the same files differently. Version `unknown` if not installed by dpkg.
    #[serde(default)]
    pub tools: Vec<PackageInput>,
}

/// Why an image could not be built or its manifest not read.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// A command-line tool the builder runs is not installed.
    #[error(
        "`{tool}` (Debian package `{package}`) is not installed; install krunbox's image \
         build tools with: {INSTALL_HINT}"
    )]
    MissingTool {
        /// The executable that was looked for in `PATH`.
        tool: &'static str,
        /// The Debian package that provides it.
        package: &'static str,
    },
    /// A command ran and failed.
    #[error("`{cmd}` failed ({status}); its last output lines:\n{stderr_tail}")]
    Command {
        /// The command line, for humans.
        cmd: String,
        /// How it ended, e.g. `exit status: 100`.
        status: String,
        /// The last lines it printed (stderr, or stdout if stderr was empty).
        stderr_tail: String,
    },
    /// apt does not know a package: its package lists are missing or stale.
    #[error(
        "apt cannot find package `{package}`; run `apt-get update` first \
         (apt said: {stderr_tail})"
    )]
    PackageUnavailable {
        /// The package that was asked for.
        package: String,
        /// What apt printed.
        stderr_tail: String,
    },
    /// The machine's apt configuration lists no usable Debian archive.
    #[error(
        "no Debian archive found in this machine's apt configuration (`apt-get indextargets` \
         lists no source whose origin is Debian); add a Debian entry under \
         /etc/apt/sources.list.d/ and run `apt-get update`"
    )]
    NoDebianMirror,
    /// The agent image needs root (`mmdebstrap --mode=root`).
    #[error(
        "building the `{image}` image needs root (it runs `mmdebstrap --mode=root`); \
         run `krunbox-rootfs build {image}` as root"
    )]
    NotRoot {
        /// The image that was asked for.
        image: BuiltinImage,
    },
    /// A tool's output was not what the builder expects.
    #[error("unexpected result from `{what}`: {detail}")]
    Unexpected {
        /// The step or command.
        what: String,
        /// What was wrong.
        detail: String,
    },
    /// A manifest file exists but is not a valid manifest.
    #[error("{path} is not a valid image manifest ({source}); rebuild with `krunbox-rootfs build NAME --force`")]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Why [`verify`] rejected an image.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// No manifest or no image file in the cache.
    #[error("image `{image}` is not built; run `krunbox-rootfs build {image}`")]
    NotBuilt {
        /// The image that was checked.
        image: BuiltinImage,
    },
    /// The image file's size differs from the manifest's: truncated or replaced.
    #[error(
        "image `{image}` is {actual} bytes but its manifest says {expected}; \
         rebuild it with `krunbox-rootfs build {image} --force`"
    )]
    SizeMismatch {
        /// The image that was checked.
        image: BuiltinImage,
        /// Size recorded in the manifest.
        expected: u64,
        /// Size of the file on disk.
        actual: u64,
    },
    /// The image file's SHA-256 differs from the manifest's: it was modified.
    #[error(
        "image `{image}` has sha256 {actual} but its manifest says {expected}; \
         rebuild it with `krunbox-rootfs build {image} --force`"
    )]
    DigestMismatch {
        /// The image that was checked.
        image: BuiltinImage,
        /// SHA-256 recorded in the manifest.
        expected: String,
        /// SHA-256 of the file on disk.
        actual: String,
    },
    /// The manifest could not be read or parsed.
    #[error(transparent)]
    Load(#[from] BuildError),
    /// The image file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The image file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Attaches a path to an [`io::Error`].
pub(crate) trait IoContext<T> {
    fn at(self, path: &Path) -> Result<T, BuildError>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn at(self, path: &Path) -> Result<T, BuildError> {
        self.map_err(|source| BuildError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// The cache directory images are built into.
///
/// `$KRUNBOX_CACHE_DIR` if set, else `$XDG_CACHE_HOME/krunbox`, else
/// `~/.cache/krunbox` (or `krunbox` in the temp directory if `$HOME` is unset).
///
/// ```
/// let dir = krunbox_rootfs::default_cache_dir();
/// assert!(dir.is_absolute() || std::env::var_os("KRUNBOX_CACHE_DIR").is_some());
/// ```
pub fn default_cache_dir() -> PathBuf {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(dir) = var("KRUNBOX_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    // The XDG spec says relative values are invalid and must be ignored.
    if let Some(xdg) = var("XDG_CACHE_HOME").map(PathBuf::from) {
        if xdg.is_absolute() {
            return xdg.join("krunbox");
        }
    }
    match var("HOME") {
        Some(home) => PathBuf::from(home).join(".cache").join("krunbox"),
        None => std::env::temp_dir().join("krunbox"),
    }
}

fn images_dir(cache_dir: &Path) -> PathBuf {
    cache_dir.join("images")
}

/// Where `image` is stored: `<cache_dir>/images/<name>.erofs`.
///
/// ```
/// use std::path::Path;
/// use krunbox_rootfs::{image_path, BuiltinImage};
///
/// assert_eq!(
///     image_path(Path::new("/c"), BuiltinImage::Busybox),
///     Path::new("/c/images/busybox.erofs")
/// );
/// ```
pub fn image_path(cache_dir: &Path, image: BuiltinImage) -> PathBuf {
    images_dir(cache_dir).join(format!("{}.erofs", image.name()))
}

/// Where `image`'s manifest is stored: `<cache_dir>/images/<name>.json`.
///
/// ```
/// use std::path::Path;
/// use krunbox_rootfs::{manifest_path, BuiltinImage};
///
/// assert_eq!(
///     manifest_path(Path::new("/c"), BuiltinImage::Agent),
///     Path::new("/c/images/agent.json")
/// );
/// ```
pub fn manifest_path(cache_dir: &Path, image: BuiltinImage) -> PathBuf {
    images_dir(cache_dir).join(format!("{}.json", image.name()))
}

/// The manifest of a built image, or `None` if it is not (completely) built.
///
/// `None` when the manifest or the image file is missing, or when the image's
/// size is not the one recorded (a truncated or replaced file). This does not
/// hash the image; [`verify`] does. A manifest that exists but cannot be parsed
/// is an error.
///
/// ```
/// use krunbox_rootfs::{load, BuiltinImage};
///
/// let empty = tempfile::tempdir()?;
/// assert!(load(empty.path(), BuiltinImage::Busybox)?.is_none());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn load(cache_dir: &Path, image: BuiltinImage) -> Result<Option<ImageManifest>, BuildError> {
    let Some(manifest) = read_manifest(cache_dir, image)? else {
        return Ok(None);
    };
    let image_file = image_path(cache_dir, image);
    match fs::metadata(&image_file) {
        Ok(meta) if meta.len() == manifest.size => Ok(Some(manifest)),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).at(&image_file),
    }
}

/// Reads and parses the manifest file; `None` if it does not exist. A manifest parsed before
/// by this process is taken from memory while its file's state (device, inode, size, mtime,
/// ctime) is unchanged: the agent image's lists every package (40 KB of JSON), and parsing it
/// on every boot made a boot's host work grow with the image. Only a file whose ctime is
/// [`MANIFEST_SETTLED`] old is remembered: a rewrite within the same clock tick could leave its
/// state as it was, but not once the tick is long past.
fn read_manifest(
    cache_dir: &Path,
    image: BuiltinImage,
) -> Result<Option<ImageManifest>, BuildError> {
    use std::collections::HashMap;
    use std::os::unix::fs::MetadataExt;
    use std::sync::Mutex;
    type Stamp = (u64, u64, u64, i64, i64, i64, i64);
    static PARSED: Mutex<Option<HashMap<PathBuf, (Stamp, ImageManifest)>>> = Mutex::new(None);
    let path = manifest_path(cache_dir, image);
    let mut file = match File::open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).at(&path),
    };
    let meta = file.metadata().at(&path)?;
    let stamp: Stamp = (
        meta.dev(),
        meta.ino(),
        meta.len(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ctime(),
        meta.ctime_nsec(),
    );
    let parsed = |cache: &mut Option<HashMap<PathBuf, (Stamp, ImageManifest)>>| {
        let (known, manifest) = cache.as_ref()?.get(&path)?;
        (*known == stamp).then(|| manifest.clone())
    };
    if let Some(manifest) = parsed(&mut PARSED.lock().unwrap_or_else(|e| e.into_inner())) {
        return Ok(Some(manifest));
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).at(&path)?;
    let manifest: ImageManifest =
        serde_json::from_slice(&bytes).map_err(|source| BuildError::Manifest {
            path: path.clone(),
            source,
        })?;
    if manifest.name != image.name() || manifest.format != FORMAT_EROFS {
        return Err(BuildError::Unexpected {
            what: path.display().to_string(),
            detail: format!(
                "manifest is for `{}` ({}), not `{}` (erofs)",
                manifest.name, manifest.format, image
            ),
        });
    }
    let changed = std::time::UNIX_EPOCH
        + std::time::Duration::new(stamp.5.max(0) as u64, stamp.6.clamp(0, 999_999_999) as u32);
    let settled = changed.elapsed().is_ok_and(|age| age >= MANIFEST_SETTLED);
    if settled {
        let mut parsed = PARSED.lock().unwrap_or_else(|e| e.into_inner());
        let parsed = parsed.get_or_insert_with(HashMap::new);
        // One per image and cache directory: a caller making many directories starts over.
        if parsed.len() >= MANIFESTS_REMEMBERED {
            parsed.clear();
        }
        parsed.insert(path, (stamp, manifest.clone()));
    }
    Ok(Some(manifest))
}

/// The most manifests [`read_manifest`] remembers.
const MANIFESTS_REMEMBERED: usize = 64;

/// How old a manifest file's last change must be before [`read_manifest`] remembers it.
const MANIFEST_SETTLED: std::time::Duration = std::time::Duration::from_secs(2);

/// Builds `image` into `cache_dir` unless it is already built; returns its manifest.
///
/// Idempotent: if the image and its manifest exist and the image's size matches,
/// the existing manifest is returned without rebuilding (use [`rebuild`] to force).
/// Progress lines (one step per line, no trailing newline) go to `progress`.
///
/// The image is written atomically: it is made in a temporary directory inside
/// `<cache_dir>/images`, renamed into place, and only then is the manifest
/// written (also by rename). The old manifest is removed before the new image
/// lands, so a crash at any point leaves either no manifest or a manifest that
/// matches its image. Concurrent builds of the same image wait for each other
/// (an advisory lock on `images/.<name>.lock`).
///
/// ```no_run
/// use krunbox_rootfs::{build, BuiltinImage};
///
/// let cache = tempfile::tempdir()?;
/// let manifest = build(cache.path(), BuiltinImage::Busybox, &mut |line| eprintln!("{line}"))?;
/// assert_eq!(manifest.format, "erofs");
/// // The second call finds the image and returns at once.
/// assert_eq!(build(cache.path(), BuiltinImage::Busybox, &mut |_| {})?, manifest);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn build(
    cache_dir: &Path,
    image: BuiltinImage,
    progress: &mut dyn FnMut(&str),
) -> Result<ImageManifest, BuildError> {
    build_impl(cache_dir, image, false, progress)
}

/// Builds `image` into `cache_dir` even if it is already built, replacing it.
///
/// Otherwise the same as [`build`].
///
/// ```no_run
/// use krunbox_rootfs::{rebuild, BuiltinImage};
///
/// let cache = krunbox_rootfs::default_cache_dir();
/// rebuild(&cache, BuiltinImage::Agent, &mut |line| eprintln!("{line}"))?;
/// # Ok::<(), krunbox_rootfs::BuildError>(())
/// ```
pub fn rebuild(
    cache_dir: &Path,
    image: BuiltinImage,
    progress: &mut dyn FnMut(&str),
) -> Result<ImageManifest, BuildError> {
    build_impl(cache_dir, image, true, progress)
}

/// Checks that every tool needed to build `image` is installed.
///
/// ```no_run
/// use krunbox_rootfs::{check_tools, BuiltinImage};
///
/// if let Err(e) = check_tools(BuiltinImage::Agent) {
///     eprintln!("{e}"); // says: apt-get install erofs-utils mmdebstrap busybox-static
/// }
/// ```
pub fn check_tools(image: BuiltinImage) -> Result<(), BuildError> {
    let tools: &[(&'static str, &'static str)] = match image {
        BuiltinImage::Busybox => &[
            ("apt-get", "apt"),
            ("dpkg-deb", "dpkg"),
            ("dpkg-query", "dpkg"),
            ("mkfs.erofs", "erofs-utils"),
        ],
        BuiltinImage::Agent => &[
            ("apt-get", "apt"),
            ("dpkg-query", "dpkg"),
            ("mmdebstrap", "mmdebstrap"),
            ("mkfs.erofs", "erofs-utils"),
        ],
    };
    for &(tool, package) in tools {
        if !cmd::in_path(tool) {
            return Err(BuildError::MissingTool { tool, package });
        }
    }
    Ok(())
}

/// Whether `manifest` lists every package `image`'s recipe asks for (an image
/// built before a package was added to the recipe does not).
fn has_requested_packages(image: BuiltinImage, manifest: &ImageManifest) -> bool {
    let has = |name: &str| manifest.inputs.iter().any(|p| p.name == name);
    match image {
        BuiltinImage::Busybox => true,
        BuiltinImage::Agent => agent::requested_packages().all(has),
    }
}

fn build_impl(
    cache_dir: &Path,
    image: BuiltinImage,
    force: bool,
    progress: &mut dyn FnMut(&str),
) -> Result<ImageManifest, BuildError> {
    let dir = images_dir(cache_dir);
    fs::create_dir_all(&dir).at(&dir)?;
    let _lock = lock(
        &dir.join(format!(".{}.lock", image.name())),
        image,
        progress,
    )?;

    if !force {
        match load(cache_dir, image) {
            Ok(Some(manifest)) if !has_requested_packages(image, &manifest) => {
                progress(&format!(
                    "{image}: the cached image lacks packages the recipe now asks for: rebuilding"
                ));
            }
            Ok(Some(manifest)) => {
                progress(&format!(
                    "{image}: already built ({}, sha256 {})",
                    image_path(cache_dir, image).display(),
                    manifest.sha256
                ));
                return Ok(manifest);
            }
            Ok(None) => {}
            // A corrupt manifest is just "not built": the rebuild replaces it.
            Err(e @ (BuildError::Manifest { .. } | BuildError::Unexpected { .. })) => {
                progress(&format!("{image}: ignoring bad manifest: {e}"));
            }
            Err(e) => return Err(e),
        }
    }

    check_tools(image)?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    if image == BuiltinImage::Agent && unsafe { libc::geteuid() } != 0 {
        return Err(BuildError::NotRoot { image });
    }

    // Leftovers of builds that crashed (we hold the lock, so none is running).
    let stale_prefix = format!(".tmp-{}-", image.name());
    for entry in fs::read_dir(&dir).at(&dir)? {
        let entry = entry.at(&dir)?;
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(&stale_prefix)
        {
            let path = entry.path();
            progress(&format!("{image}: removing stale {}", path.display()));
            if entry.file_type().at(&path)?.is_dir() {
                fs::remove_dir_all(&path).at(&path)?;
            } else {
                fs::remove_file(&path).at(&path)?;
            }
        }
    }

    // Everything is made inside images/ so the final rename stays on one file system.
    let work = tempfile::Builder::new()
        .prefix(&stale_prefix)
        .tempdir_in(&dir)
        .at(&dir)?;
    let root = work.path().join("root");
    let inputs = match image {
        BuiltinImage::Busybox => busybox::populate(work.path(), &root, progress)?,
        BuiltinImage::Agent => agent::populate(&root, progress)?,
    };

    let built = work.path().join("image.erofs");
    erofs::mkfs(image, &root, &built, progress)?;
    let sha256 = sha256_file(&built).at(&built)?;
    let size = fs::metadata(&built).at(&built)?.len();
    File::open(&built).and_then(|f| f.sync_all()).at(&built)?;

    let manifest = ImageManifest {
        name: image.name().to_string(),
        format: FORMAT_EROFS.to_string(),
        sha256,
        size,
        inputs,
        builder: BUILDER_VERSION.to_string(),
        tools: tool_packages(image),
    };

    // Order matters for crash safety: no manifest -> image put in place -> manifest.
    let manifest_file = manifest_path(cache_dir, image);
    match fs::remove_file(&manifest_file) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e).at(&manifest_file),
        _ => {}
    }
    sync_dir(&dir)?;
    let image_file = image_path(cache_dir, image);
    fs::rename(&built, &image_file).at(&image_file)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(&stale_prefix)
        .suffix(".json")
        .tempfile_in(&dir)
        .at(&dir)?;
    let mut json = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
    json.push(b'\n');
    // NamedTempFile is 0600; the manifest is as readable as the image.
    tmp.as_file()
        .set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .and_then(|()| tmp.write_all(&json))
        .and_then(|()| tmp.as_file().sync_all())
        .at(tmp.path())?;
    tmp.persist(&manifest_file)
        .map_err(|e| e.error)
        .at(&manifest_file)?;
    sync_dir(&dir)?;

    progress(&format!(
        "{image}: wrote {} ({} bytes, sha256 {})",
        image_file.display(),
        manifest.size,
        manifest.sha256
    ));
    // Dropping `work` deletes the build tree.
    Ok(manifest)
}

/// Checks a built image against its manifest: size, then full SHA-256.
///
/// ```no_run
/// use krunbox_rootfs::{verify, BuiltinImage, VerifyError};
///
/// match verify(&krunbox_rootfs::default_cache_dir(), BuiltinImage::Busybox) {
///     Ok(manifest) => println!("ok {}", manifest.sha256),
///     Err(VerifyError::DigestMismatch { expected, actual, .. }) => {
///         eprintln!("corrupt image: {actual} != {expected}")
///     }
///     Err(e) => eprintln!("{e}"),
/// }
/// ```
pub fn verify(cache_dir: &Path, image: BuiltinImage) -> Result<ImageManifest, VerifyError> {
    let manifest = read_manifest(cache_dir, image)?.ok_or(VerifyError::NotBuilt { image })?;
    let path = image_path(cache_dir, image);
    let io_err = |source| VerifyError::Io {
        path: path.clone(),
        source,
    };
    let actual_size = match fs::metadata(&path) {
        Ok(meta) => meta.len(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(VerifyError::NotBuilt { image })
        }
        Err(e) => return Err(io_err(e)),
    };
    if actual_size != manifest.size {
        return Err(VerifyError::SizeMismatch {
            image,
            expected: manifest.size,
            actual: actual_size,
        });
    }
    let actual = sha256_file(&path).map_err(io_err)?;
    if actual != manifest.sha256 {
        return Err(VerifyError::DigestMismatch {
            image,
            expected: manifest.sha256,
            actual,
        });
    }
    Ok(manifest)
}

/// SHA-256 of a file's contents, as lowercase hex.
///
/// ```
/// let dir = tempfile::tempdir()?;
/// let file = dir.path().join("abc");
/// std::fs::write(&file, "abc")?;
/// assert_eq!(
///     krunbox_rootfs::sha256_file(&file)?,
///     "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
/// );
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file = File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Versions of the host packages whose tools shaped the image.
fn tool_packages(image: BuiltinImage) -> Vec<PackageInput> {
    let names: &[&str] = match image {
        BuiltinImage::Busybox => &["erofs-utils"],
        BuiltinImage::Agent => &["erofs-utils", "mmdebstrap"],
    };
    names
        .iter()
        .map(|&name| {
            let mut query = std::process::Command::new("dpkg-query");
            query.args(["--show", "--showformat=${Version}", name]);
            let version = cmd::run(&mut query, &mut |_| {})
                .ok()
                .map(|v| String::from_utf8_lossy(&v).trim().to_string())
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| "unknown".to_string());
            PackageInput {
                name: name.to_string(),
                version,
            }
        })
        .collect()
}

/// An exclusive `flock` held until dropped (the kernel drops it if we crash).
struct Lock(#[allow(dead_code)] File);

fn lock(
    path: &Path,
    image: BuiltinImage,
    progress: &mut dyn FnMut(&str),
) -> Result<Lock, BuildError> {
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .at(path)?;
    let fd = file.as_raw_fd();
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        progress(&format!(
            "{image}: waiting for another build of it to finish"
        ));
        loop {
            // SAFETY: as above.
            if unsafe { libc::flock(fd, libc::LOCK_EX) } == 0 {
                break;
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err).at(path);
            }
        }
    }
    Ok(Lock(file))
}

fn sync_dir(dir: &Path) -> Result<(), BuildError> {
    File::open(dir).and_then(|d| d.sync_all()).at(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for image in BuiltinImage::ALL {
            assert_eq!(image.name().parse::<BuiltinImage>(), Ok(image));
            assert_eq!(image.to_string(), image.name());
        }
    }

    #[test]
    fn a_manifest_is_parsed_again_only_when_its_file_changed() {
        let cache = tempfile::tempdir().unwrap();
        let image = BuiltinImage::Busybox;
        let write = |sha: &str| {
            let manifest = ImageManifest {
                name: "busybox".into(),
                format: FORMAT_EROFS.into(),
                sha256: sha.repeat(32),
                size: 4096,
                inputs: Vec::new(),
                builder: BUILDER_VERSION.into(),
                tools: Vec::new(),
            };
            let path = manifest_path(cache.path(), image);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(&path, serde_json::to_vec(&manifest).unwrap()).unwrap();
        };
        write("aa");
        let first = read_manifest(cache.path(), image).unwrap().unwrap();
        assert_eq!(first.sha256, "aa".repeat(32));
        // Remembered once settled.
        std::thread::sleep(MANIFEST_SETTLED + std::time::Duration::from_millis(100));
        assert_eq!(read_manifest(cache.path(), image).unwrap().unwrap(), first);
        assert_eq!(read_manifest(cache.path(), image).unwrap().unwrap(), first);
        // Rewritten (same length, same inode): its ctime moved, read again.
        write("bb");
        let second = read_manifest(cache.path(), image).unwrap().unwrap();
        assert_eq!(second.sha256, "bb".repeat(32));
        fs::remove_file(manifest_path(cache.path(), image)).unwrap();
        assert!(read_manifest(cache.path(), image).unwrap().is_none());
    }

    #[test]
    fn an_agent_image_from_an_older_recipe_is_not_taken_as_built() {
        let manifest = |names: &[&str]| ImageManifest {
            name: "agent".into(),
            format: FORMAT_EROFS.into(),
            sha256: "00".repeat(32),
            size: 4096,
            inputs: names
                .iter()
                .map(|n| PackageInput {
                    name: (*n).into(),
                    version: "1".into(),
                })
                .collect(),
            builder: BUILDER_VERSION.into(),
            tools: Vec::new(),
        };
        let all: Vec<&str> = agent::requested_packages().collect();
        assert!(all.contains(&"python3-pip"));
        assert!(has_requested_packages(BuiltinImage::Agent, &manifest(&all)));
        let older: Vec<&str> = all
            .iter()
            .copied()
            .filter(|p| *p != "python3-pip")
            .collect();
        assert!(!has_requested_packages(
            BuiltinImage::Agent,
            &manifest(&older)
        ));
        assert!(has_requested_packages(
            BuiltinImage::Busybox,
            &manifest(&[])
        ));
    }

    #[test]
    fn missing_tool_message_says_what_to_install() {
        let e = BuildError::MissingTool {
            tool: "mkfs.erofs",
            package: "erofs-utils",
        };
        let msg = e.to_string();
        assert!(msg.contains("mkfs.erofs"), "{msg}");
        assert!(
            msg.contains("apt-get install erofs-utils mmdebstrap busybox-static"),
            "{msg}"
        );
    }
}
