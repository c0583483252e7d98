//! OCI images: an image archive (`docker save`'s tarball, or an OCI image layout as a
//! directory or a tar) made into a bootable image, its configuration kept for commands.
//!
//! Every blob is checked against its digest before it is used (a layer of an OCI layout by its
//! compressed bytes; a layer of a legacy `docker save` archive by its uncompressed bytes
//! against the config's `diff_ids`; the config by its own digest). The layers are merged on the
//! host into one tar stream (`merge.rs`: whiteouts, opaque directories, hard links, extended
//! attributes), and a VM of the built-in agent image extracts that stream as root with GNU tar
//! into an empty ext4 the host serves (as `flatten` does), so owners, modes and extended
//! attributes (file capabilities among them) are the image's without host privileges.

mod archive;
mod blobs;
mod build;
pub(crate) mod failure;
mod local;
pub(crate) mod merge;
mod registry;
pub(crate) mod zstd;

pub use blobs::LayerCache;
pub use build::build;
pub use failure::PullFailure;
pub use local::LocalImages;
pub use registry::{fetch, pull, Credentials, Fetched, PullOptions, PullProgress, Pulled};

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use serde::Deserialize;

use super::flatten::{mount_output, unmount_output, FlatImage, ImageBuild, MOUNTED_AT};
use crate::error::{Error, Result};
pub use crate::rootfs::ImageConfig;
use crate::rootfs::Rootfs;

/// The largest JSON document (index, manifest, config) read from an archive.
const MAX_JSON: u64 = 4 << 20;

/// The most layers an image may have.
const MAX_LAYERS: usize = 256;

/// Where the importing VM sees the merged layers.
const LAYERS_AT: &str = "/tmp/.krunbox-layers";

/// An imported image: a bootable image file and its configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OciImage {
    /// The image file (a standalone qcow2 holding ext4) and its SHA-256.
    pub image: FlatImage,
    /// The image's configuration.
    pub config: ImageConfig,
    /// The digest of the image's configuration blob (`sha256:…`): the image's identity, as
    /// registries and `docker images --digests` show the image ID.
    pub config_digest: String,
}

impl OciImage {
    /// The image as a sandbox's root (read-only, like any image).
    pub fn rootfs(&self) -> Rootfs {
        self.image.rootfs()
    }
}

/// Makes the image archive at `archive` (a `docker save` tarball, or an OCI image layout as a
/// directory or a tar) into a bootable image at `output` (a qcow2, replaced if it exists).
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::Sandbox;
///
/// // docker save myapp:latest > myapp.tar
/// let image = krunbox::image::oci::import("myapp.tar", "/var/lib/a/myapp.qcow2").await?;
/// let vm = Sandbox::builder()
///     .rootfs(image.rootfs())
///     .image_config(image.config.clone())
///     .build()?
///     .boot()
///     .await?;
/// let out = vm.entrypoint()?.output().await?;
/// # let _ = out; Ok(()) }
/// ```
pub async fn import(archive: impl AsRef<Path>, output: impl AsRef<Path>) -> Result<OciImage> {
    let archive = archive.as_ref().to_path_buf();
    let broken = |reason: String| Error::ImageArchive {
        path: archive.clone(),
        reason,
    };
    // Reading and checking are blocking work.
    let checked = tokio::task::spawn_blocking({
        let archive = archive.clone();
        move || archive::read(&archive)
    })
    .await
    .map_err(|e| broken(e.to_string()))?
    .map_err(broken)?;
    let layers = Layers {
        config: checked.config().to_vec(),
        config_digest: checked.config_digest().to_string(),
        count: checked.layer_count(),
        diff_ids_checked: checked.diff_ids_checked(),
        open: Box::new(move |i| checked.open_layer(i)),
    };
    assemble(layers, output.as_ref())
        .await
        .map_err(|failure| match failure {
            BuildFailure::Content(reason) | BuildFailure::Unverified(reason) => broken(reason),
            BuildFailure::Other(e) => e,
        })
}

/// What an image is built from: its config blob and its layers, bottom first, checked
/// against their digests already.
pub(super) struct Layers {
    config: Vec<u8>,
    config_digest: String,
    count: usize,
    /// Whether each layer's uncompressed bytes were checked against the config's `diff_ids`
    /// already (a legacy archive's are; others are checked before the merge).
    diff_ids_checked: bool,
    /// Layer `i`'s uncompressed tar stream, read afresh (the merge reads each layer twice).
    open: Box<dyn Fn(usize) -> std::io::Result<Box<dyn Read + Send>> + Send>,
}

/// Why building an image failed: its content, or anything else (a VM that did not boot, the
/// host's disk).
enum BuildFailure {
    Content(String),
    /// A layer's content is not what the config names.
    Unverified(String),
    Other(Error),
}

impl From<String> for BuildFailure {
    fn from(reason: String) -> Self {
        BuildFailure::Content(reason)
    }
}

impl From<Error> for BuildFailure {
    fn from(e: Error) -> Self {
        BuildFailure::Other(e)
    }
}

/// Merges `layers` on the host and has a VM extract them into the image at `output`: the agent
/// image's, whose GNU tar applies extended attributes (busybox's tar drops them).
async fn assemble(layers: Layers, output: &Path) -> std::result::Result<OciImage, BuildFailure> {
    let staging = tempfile::Builder::new()
        .prefix(".krunbox-import-")
        .tempdir_in(crate::rootfs::dir_of(output))
        .map_err(Error::io("making a staging directory for the image"))?;
    let merged_path = staging.path().join("merged.tar");
    let config_digest = layers.config_digest.clone();
    // Merging is blocking work.
    let config = tokio::task::spawn_blocking({
        let merged_path = merged_path.clone();
        move || merge_layers(&layers, &merged_path)
    })
    .await
    .map_err(|e| BuildFailure::Content(e.to_string()))??;

    let build = ImageBuild::start(output).await?;
    let served = crate::fs::HostDir::read_only(staging.path())
        .map_err(|e| BuildFailure::Content(format!("serving the merged layers: {e:?}")))?;
    let sandbox = crate::Sandbox::builder()
        .rootfs(Rootfs::builtin(crate::BuiltinImage::Agent))
        .memory_mib(256)
        .output_disk(build.disk())
        .mount_with(
            LAYERS_AT,
            served,
            crate::fs::MountOptions::new().read_only(),
        )
        .build()?;
    let vm = sandbox.boot().await?;
    let script = format!(
        "{}tar -x --numeric-owner --xattrs --xattrs-include='*' -f {LAYERS_AT}/merged.tar \
         -C {MOUNTED_AT}\n{}",
        mount_output(),
        unmount_output()
    );
    let extracted = vm
        .command("sh")
        .args(["-c", &script])
        .timeout(std::time::Duration::from_secs(3600))
        .output()
        .await;
    let shutdown = vm.shutdown().await;
    let extracted = extracted?;
    if !extracted.status.success() {
        return Err(BuildFailure::Content(format!(
            "extracting the merged layers failed ({}): {}{}",
            extracted.status,
            extracted.stdout_text(),
            extracted.stderr_text()
        )));
    }
    shutdown?;
    let image = build.finish().await?;
    Ok(OciImage {
        image,
        config,
        config_digest,
    })
}

/// Merges the layers into `merged_path` and reads the image's configuration, its user looked
/// up in the merged tree's `/etc/passwd` and `/etc/group`.
fn merge_layers(
    layers: &Layers,
    merged_path: &Path,
) -> std::result::Result<ImageConfig, BuildFailure> {
    let (mut config, diff_ids, user) = parse_config(&layers.config)?;
    if diff_ids.len() != layers.count {
        return Err(BuildFailure::Content(format!(
            "the config lists {} layers, the manifest {}",
            diff_ids.len(),
            layers.count
        )));
    }
    // The config names each layer's uncompressed content: a manifest that pairs this config
    // with other layers (which their own digests would not show) is refused, as container
    // runtimes refuse it when they unpack.
    if !layers.diff_ids_checked {
        for (i, expected) in diff_ids.iter().enumerate() {
            let actual = sha256_hex((layers.open)(i).map_err(|e| format!("layer {i}: {e}"))?)?;
            if *expected != format!("sha256:{actual}") {
                return Err(BuildFailure::Unverified(format!(
                    "layer {i}'s content has the digest sha256:{actual}, not the config's {expected}"
                )));
            }
        }
    }
    let out = File::create(merged_path).map_err(|e| format!("staging the merge: {e}"))?;
    let merged = merge::merge(layers.count, &layers.open, std::io::BufWriter::new(out))
        .map_err(|e| e.to_string())?;
    if let Some(user) = user {
        let text = |path: &str| {
            String::from_utf8_lossy(merged.captured.get(path).map_or(&[][..], |d| d)).into_owned()
        };
        config.user = Some(resolve_user(
            &user,
            &text("etc/passwd"),
            &text("etc/group"),
        )?);
    }
    Ok(config)
}

fn json<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    what: &str,
) -> std::result::Result<T, String> {
    serde_json::from_slice(bytes).map_err(|e| format!("{what}: {e}"))
}

/// The image's configuration (its user not resolved yet), its layers' content digests, and
/// the user it names.
fn parse_config(
    bytes: &[u8],
) -> std::result::Result<(ImageConfig, Vec<String>, Option<String>), String> {
    #[derive(Deserialize)]
    struct File {
        #[serde(default)]
        architecture: Option<String>,
        #[serde(default)]
        os: Option<String>,
        #[serde(default)]
        config: Option<Config>,
        rootfs: RootfsDigests,
    }
    #[derive(Deserialize, Default)]
    #[serde(rename_all = "PascalCase")]
    struct Config {
        #[serde(default)]
        entrypoint: Option<Vec<String>>,
        #[serde(default)]
        cmd: Option<Vec<String>>,
        #[serde(default)]
        env: Option<Vec<String>>,
        #[serde(default)]
        working_dir: Option<String>,
        #[serde(default)]
        user: Option<String>,
    }
    #[derive(Deserialize)]
    struct RootfsDigests {
        diff_ids: Vec<String>,
    }
    let file: File = json(bytes, "the image config")?;
    if let Some(arch) = file.architecture.filter(|a| a != "amd64") {
        return Err(format!("an image for {arch}, not amd64"));
    }
    if let Some(os) = file.os.filter(|o| o != "linux") {
        return Err(format!("an image for {os}, not linux"));
    }
    let config = file.config.unwrap_or_default();
    let env = config
        .env
        .unwrap_or_default()
        .into_iter()
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (pair, String::new()),
        })
        .collect();
    Ok((
        ImageConfig {
            entrypoint: config.entrypoint.unwrap_or_default(),
            cmd: config.cmd.unwrap_or_default(),
            env,
            working_dir: config.working_dir.filter(|d| !d.is_empty()),
            user: None,
        },
        file.rootfs.diff_ids,
        config.user.filter(|u| !u.is_empty()),
    ))
}

/// The image's `User` (`user`, `uid`, `user:group`, `uid:gid`, ...) as numbers, looked up in
/// the image's own `/etc/passwd` and `/etc/group` as a container runtime does: a user without a
/// group gets its primary group from `passwd`, or 0 when `passwd` does not list it.
fn resolve_user(user: &str, passwd: &str, group: &str) -> std::result::Result<(u32, u32), String> {
    // name:password:uid:gid:...
    let users: Vec<(&str, u32, u32)> = passwd
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            Some((
                *fields.first()?,
                fields.get(2)?.parse().ok()?,
                fields.get(3)?.parse().ok()?,
            ))
        })
        .collect();
    // name:password:gid:members
    let groups: Vec<(&str, u32)> = group
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            Some((*fields.first()?, fields.get(2)?.parse().ok()?))
        })
        .collect();
    let (user_part, group_part) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let (uid, primary) = match user_part.parse::<u32>() {
        Ok(uid) => (uid, users.iter().find(|u| u.1 == uid).map_or(0, |u| u.2)),
        Err(_) => users
            .iter()
            .find(|u| u.0 == user_part)
            .map(|u| (u.1, u.2))
            .ok_or_else(|| format!("the image's user {user_part:?} is not in its /etc/passwd"))?,
    };
    let gid = match group_part {
        None => primary,
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => groups
                .iter()
                .find(|x| x.0 == g)
                .map(|x| x.1)
                .ok_or_else(|| format!("the image's group {g:?} is not in its /etc/group"))?,
        },
    };
    Ok((uid, gid))
}

/// The layer's tar stream, decompressed by what its first bytes say it is.
fn decompress(reader: Box<dyn Read + Send>) -> std::result::Result<Box<dyn Read + Send>, String> {
    let mut reader = BufReader::new(reader);
    let head = reader
        .fill_buf()
        .map_err(|e| format!("reading a layer: {e}"))?;
    // However it unpacks, a layer larger than an image's disk (twice over, for headers) is
    // cut short, and its tar stream then fails to read: a compression bomb costs time, never
    // memory or disk.
    let bound = 2 * merge::MAX_MERGED_BYTES;
    if head.starts_with(&[0x1f, 0x8b]) {
        Ok(Box::new(
            flate2::read::MultiGzDecoder::new(reader).take(bound),
        ))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Ok(Box::new(zstd::Frames::new(reader).take(bound)))
    } else {
        Ok(Box::new(reader.take(bound)))
    }
}

fn sha256_hex(reader: impl Read) -> std::result::Result<String, String> {
    crate::rootfs::sha256_hex(reader).map_err(|e| format!("reading a layer: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config whose `diff_ids` name other content than the layers hold is refused before the
    /// merge (a manifest pairing a known config with other layers); the right ones merge.
    #[test]
    fn layers_must_be_what_the_config_names() {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(2);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, "etc/a", &b"hi"[..])
            .unwrap();
        let layer = builder.into_inner().unwrap();
        let config = |diff_id: &str| {
            serde_json::to_vec(&serde_json::json!({
                "architecture": "amd64", "os": "linux",
                "rootfs": { "type": "layers", "diff_ids": [diff_id] },
            }))
            .unwrap()
        };
        let layers = |config: Vec<u8>| Layers {
            config,
            config_digest: String::new(),
            count: 1,
            diff_ids_checked: false,
            open: Box::new({
                let layer = layer.clone();
                move |_| Ok(Box::new(std::io::Cursor::new(layer.clone())) as Box<dyn Read + Send>)
            }),
        };
        let dir = tempfile::tempdir().unwrap();
        let merged = dir.path().join("merged.tar");
        let other = format!("sha256:{}", "0".repeat(64));
        match merge_layers(&layers(config(&other)), &merged) {
            Err(BuildFailure::Unverified(reason)) => assert!(reason.contains(&other), "{reason}"),
            Err(BuildFailure::Content(reason)) => panic!("{reason}"),
            Err(BuildFailure::Other(e)) => panic!("{e}"),
            Ok(_) => panic!("other layers were merged"),
        }
        let right = format!("sha256:{}", sha256_hex(&layer[..]).unwrap());
        assert!(merge_layers(&layers(config(&right)), &merged).is_ok());
    }

    #[test]
    fn users_resolve_as_a_container_runtime_resolves_them() {
        let passwd = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1002::/app:/bin/sh\n";
        let group = "root:x:0:\napp:x:1002:\nstaff:x:50:\n";
        let resolve = |user| resolve_user(user, passwd, group);
        assert_eq!(resolve("app"), Ok((1000, 1002)));
        assert_eq!(resolve("1000"), Ok((1000, 1002)));
        assert_eq!(resolve("4242"), Ok((4242, 0)));
        assert_eq!(resolve("app:staff"), Ok((1000, 50)));
        assert_eq!(resolve("0:7"), Ok((0, 7)));
        assert!(resolve("nobody").unwrap_err().contains("passwd"));
        assert!(resolve("app:nogroup").unwrap_err().contains("group"));
    }
}
