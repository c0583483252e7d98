//! OCI images: an image archive (`docker save`'s tarball, or an OCI image layout as a
//! directory or a tar) made into a bootable image, its configuration kept for commands.
//!
//! Every blob is checked against its digest before it is used (a layer of an OCI layout by its
//! compressed bytes; a layer of a legacy `docker save` archive by its uncompressed bytes
//! against the config's `diff_ids`; the config by its own digest). The layers are merged on the
//! host into one tar stream (`merge.rs`: whiteouts, opaque directories, hard links), and a VM
//! of the built-in busybox image extracts that stream as root into an empty ext4 the host
//! serves (as `flatten` does), so owners and modes are the image's without host privileges.

mod local;
pub(crate) mod merge;

pub use local::LocalImages;

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::flatten::{mount_output, unmount_output, FlatImage, ImageBuild, MOUNTED_AT};
use super::Rootfs;
use crate::error::{Error, Result};

/// The largest JSON document (index, manifest, config) read from an archive.
const MAX_JSON: u64 = 4 << 20;

/// The most layers an image may have.
const MAX_LAYERS: usize = 256;

/// The most members an archive's tar may have.
const MAX_MEMBERS: usize = 1 << 16;

/// Where the importing VM sees the merged layers.
const LAYERS_AT: &str = "/tmp/.krunbox-layers";

/// What an image's configuration says about the commands it runs: what
/// [`Instance::command`](crate::Instance::command) uses by default in a sandbox given it with
/// [`SandboxBuilder::image_config`](crate::SandboxBuilder::image_config), and what
/// [`Instance::entrypoint`](crate::Instance::entrypoint) runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct ImageConfig {
    /// The program and first arguments of the image's entrypoint (may be empty).
    pub entrypoint: Vec<String>,
    /// The default arguments after the entrypoint (or the command, without one).
    pub cmd: Vec<String>,
    /// Variables every command gets unless it sets them itself.
    pub env: Vec<(String, String)>,
    /// The directory commands start in, if the image names one.
    pub working_dir: Option<String>,
    /// The user (uid) and group (gid) commands run as, if the image names them: a name is
    /// looked up in the image's `/etc/passwd` (and `/etc/group`), and a user without a group
    /// gets its primary group there, or 0, as a container runtime does.
    pub user: Option<(u32, u32)>,
}

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
/// let image = krunbox::rootfs::oci::import("myapp.tar", "/var/lib/a/myapp.qcow2").await?;
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
    let output = output.as_ref().to_path_buf();
    let broken = |reason: String| Error::ImageArchive {
        path: archive.clone(),
        reason,
    };
    // Reading, checking and merging are blocking work.
    let staging = tempfile::Builder::new()
        .prefix(".krunbox-import-")
        .tempdir_in(super::dir_of(&output))
        .map_err(Error::io("making a staging directory for the import"))?;
    let merged_path = staging.path().join("merged.tar");
    let (config, config_digest) = tokio::task::spawn_blocking({
        let archive = archive.clone();
        let merged_path = merged_path.clone();
        move || prepare(&archive, &merged_path)
    })
    .await
    .map_err(|e| broken(e.to_string()))?
    .map_err(broken)?;

    let build = ImageBuild::start(&output).await?;
    let layers = crate::fs::HostDir::read_only(staging.path())
        .map_err(|e| broken(format!("serving the merged layers: {e:?}")))?;
    let sandbox = crate::Sandbox::builder()
        .rootfs(Rootfs::builtin(crate::BuiltinImage::Busybox))
        .memory_mib(256)
        .mount(super::flatten::SERVED_AT, build.disk())
        .mount_with(
            LAYERS_AT,
            layers,
            crate::fs::MountOptions::new().read_only(),
        )
        .build()?;
    let vm = sandbox.boot().await?;
    let script = format!(
        "{}tar -x --numeric-owner -f {LAYERS_AT}/merged.tar -C {MOUNTED_AT}\n{}",
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
        return Err(broken(format!(
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

/// Reads and checks the archive, and merges its layers into `merged_path`.
fn prepare(
    archive: &Path,
    merged_path: &Path,
) -> std::result::Result<(ImageConfig, String), String> {
    let source = Source::open(archive)?;
    let parts = source.parts()?;
    let (mut config, _, user) = parse_config(&parts.config)?;
    if let Some(diff_ids) = &parts.diff_ids_required {
        if diff_ids.len() != parts.layers.len() {
            return Err(format!(
                "the config lists {} layers, the manifest {}",
                diff_ids.len(),
                parts.layers.len()
            ));
        }
    }
    // Every layer checked before any is used.
    for (i, layer) in parts.layers.iter().enumerate() {
        match &parts.diff_ids_required {
            None => {
                let digest = layer.digest.as_deref().expect("OCI layers have digests");
                let actual = sha256_hex(source.read(&layer.name)?)?;
                if digest != format!("sha256:{actual}") {
                    return Err(format!(
                        "layer {} has the digest sha256:{actual}, not {digest}",
                        layer.name
                    ));
                }
            }
            Some(diff_ids) => {
                let actual = sha256_hex(decompress(source.read(&layer.name)?)?)?;
                if diff_ids[i] != format!("sha256:{actual}") {
                    return Err(format!(
                        "layer {} has the content digest sha256:{actual}, not {}",
                        layer.name, diff_ids[i]
                    ));
                }
            }
        }
    }
    let out = File::create(merged_path).map_err(|e| format!("staging the merge: {e}"))?;
    let merged = merge::merge(
        parts.layers.len(),
        |i| {
            source
                .read(&parts.layers[i].name)
                .and_then(decompress)
                .map_err(std::io::Error::other)
        },
        std::io::BufWriter::new(out),
    )
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
    Ok((config, parts.config_digest))
}

/// An archive: a directory, or a tar file read in place (members found by one scan).
enum Source {
    Dir(PathBuf),
    Tar {
        path: PathBuf,
        members: HashMap<String, (u64, u64)>,
    },
}

struct LayerRef {
    name: String,
    /// The compressed blob's digest (OCI layouts), checked against its bytes.
    digest: Option<String>,
}

struct Parts {
    config: Vec<u8>,
    config_digest: String,
    layers: Vec<LayerRef>,
    /// A legacy `docker save` archive: layers are checked against the config's diff_ids.
    diff_ids_required: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize)]
struct Platform {
    architecture: String,
    os: String,
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Manifest {
    config: Descriptor,
    layers: Vec<Descriptor>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct LegacyManifest {
    config: String,
    layers: Vec<String>,
}

impl Source {
    fn open(path: &Path) -> std::result::Result<Source, String> {
        if path.is_dir() {
            return Ok(Source::Dir(path.to_path_buf()));
        }
        let file = File::open(path).map_err(|e| format!("opening it: {e}"))?;
        let mut archive = tar::Archive::new(file);
        let mut members = HashMap::new();
        // Older `docker save` writes a layer it has written before as a symbolic link to it.
        let mut links = Vec::new();
        for (count, entry) in archive
            .entries()
            .map_err(|e| format!("not a tar archive: {e}"))?
            .enumerate()
        {
            let entry = entry.map_err(|e| format!("not a readable tar archive: {e}"))?;
            if count >= MAX_MEMBERS {
                return Err(format!("more than {MAX_MEMBERS} members"));
            }
            let Some(name) = merge::normalise(&entry.path_bytes()) else {
                continue;
            };
            let kind = entry.header().entry_type();
            if kind.is_symlink() {
                if let Some(target) = entry.link_name_bytes() {
                    if let Some(target) = resolve_link(&name, &target) {
                        links.push((name, target));
                    }
                }
            } else if kind.is_file() {
                members.insert(name, (entry.raw_file_position(), entry.size()));
            }
        }
        for (name, target) in links {
            if let Some(&found) = members.get(&target) {
                members.insert(name, found);
            }
        }
        Ok(Source::Tar {
            path: path.to_path_buf(),
            members,
        })
    }

    fn has(&self, name: &str) -> bool {
        match self {
            Source::Dir(dir) => dir.join(name).is_file(),
            Source::Tar { members, .. } => members.contains_key(name),
        }
    }

    /// The member `name` (a normalised relative path).
    fn read(&self, name: &str) -> std::result::Result<Box<dyn Read + Send>, String> {
        let name = merge::normalise(name.as_bytes())
            .filter(|n| !n.is_empty())
            .ok_or_else(|| format!("the archive names a member {name:?} outside it"))?;
        match self {
            Source::Dir(dir) => File::open(dir.join(&name))
                .map(|f| Box::new(f) as Box<dyn Read + Send>)
                .map_err(|e| format!("{name}: {e}")),
            Source::Tar { path, members } => {
                let &(offset, size) = members
                    .get(&name)
                    .ok_or_else(|| format!("the archive has no {name}"))?;
                let mut file = File::open(path).map_err(|e| format!("{name}: {e}"))?;
                file.seek(SeekFrom::Start(offset))
                    .map_err(|e| format!("{name}: {e}"))?;
                Ok(Box::new(file.take(size)))
            }
        }
    }

    fn read_json(&self, name: &str) -> std::result::Result<Vec<u8>, String> {
        let mut bytes = Vec::new();
        self.read(name)?
            .take(MAX_JSON + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| format!("{name}: {e}"))?;
        if bytes.len() as u64 > MAX_JSON {
            return Err(format!("{name} is larger than {MAX_JSON} bytes"));
        }
        Ok(bytes)
    }

    /// A blob of an OCI layout, read and checked against its digest.
    fn blob(&self, digest: &str) -> std::result::Result<Vec<u8>, String> {
        let bytes = self.read_json(&blob_name(digest)?)?;
        let actual = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
        if actual != digest {
            return Err(format!("the blob {digest} has the digest {actual}"));
        }
        Ok(bytes)
    }

    fn parts(&self) -> std::result::Result<Parts, String> {
        if self.has("index.json") {
            let mut index: Index = json(&self.read_json("index.json")?, "index.json")?;
            // An index of indexes (multi-platform): one level down, at most two.
            for _ in 0..2 {
                let Some(chosen) = choose(&index.manifests) else {
                    return Err("the index lists no linux/amd64 image".into());
                };
                let bytes = self.blob(&chosen.digest)?;
                if chosen.media_type.contains("index") || chosen.media_type.contains("list") {
                    index = json(&bytes, &chosen.digest)?;
                    continue;
                }
                let manifest: Manifest = json(&bytes, &chosen.digest)?;
                if manifest.layers.len() > MAX_LAYERS {
                    return Err(format!("more than {MAX_LAYERS} layers"));
                }
                let config = self.blob(&manifest.config.digest)?;
                let layers = manifest
                    .layers
                    .iter()
                    .map(|l| {
                        Ok(LayerRef {
                            name: blob_name(&l.digest)?,
                            digest: Some(l.digest.clone()),
                        })
                    })
                    .collect::<std::result::Result<_, String>>()?;
                return Ok(Parts {
                    config,
                    config_digest: manifest.config.digest,
                    layers,
                    diff_ids_required: None,
                });
            }
            return Err("image indexes nest too deep".into());
        }
        if self.has("manifest.json") {
            let manifests: Vec<LegacyManifest> =
                json(&self.read_json("manifest.json")?, "manifest.json")?;
            let manifest = manifests
                .into_iter()
                .next()
                .ok_or("manifest.json lists no image")?;
            if manifest.layers.len() > MAX_LAYERS {
                return Err(format!("more than {MAX_LAYERS} layers"));
            }
            let config = self.read_json(&manifest.config)?;
            let actual = hex::encode(Sha256::digest(&config));
            // The config's file is named by its digest ("<hex>.json" or "blobs/sha256/<hex>").
            let named = manifest
                .config
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .trim_end_matches(".json");
            if named != actual {
                return Err(format!(
                    "the config {} has the digest sha256:{actual}",
                    manifest.config
                ));
            }
            let diff_ids = parse_config(&config)?.1;
            return Ok(Parts {
                config,
                config_digest: format!("sha256:{actual}"),
                layers: manifest
                    .layers
                    .into_iter()
                    .map(|name| LayerRef { name, digest: None })
                    .collect(),
                diff_ids_required: Some(diff_ids),
            });
        }
        Err(
            "neither an OCI image layout (index.json) nor a docker save archive (manifest.json)"
                .into(),
        )
    }
}

/// Where a symbolic link member `name` pointing at `target` leads, relative to the link's
/// directory (`..` steps up; `None` past the archive's top or for an absolute target).
fn resolve_link(name: &str, target: &[u8]) -> Option<String> {
    let target = std::str::from_utf8(target).ok()?;
    if target.starts_with('/') {
        return None;
    }
    let mut parts: Vec<&str> = name.split('/').collect();
    parts.pop(); // the link's own name
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            other => parts.push(other),
        }
    }
    Some(parts.join("/"))
}

/// The blob path of a `sha256:` digest.
fn blob_name(digest: &str) -> std::result::Result<String, String> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| format!("the digest {digest:?} is not a sha256 digest"))?;
    Ok(format!("blobs/sha256/{hex}"))
}

/// The linux/amd64 entry of an index (or its only entry, when it names no platform).
fn choose(manifests: &[Descriptor]) -> Option<&Descriptor> {
    manifests
        .iter()
        .find(|m| {
            m.platform
                .as_ref()
                .is_some_and(|p| p.architecture == "amd64" && p.os == "linux")
        })
        .or_else(|| match manifests {
            [only] if only.platform.is_none() => Some(only),
            _ => None,
        })
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
        Err("a zstd-compressed layer (not supported yet: only gzip and uncompressed)".into())
    } else {
        Ok(Box::new(reader.take(bound)))
    }
}

fn sha256_hex(reader: impl Read) -> std::result::Result<String, String> {
    super::sha256_hex(reader).map_err(|e| format!("reading a layer: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Older `docker save` writes a repeated layer as a symbolic link to the first: it reads as
    /// its target. A link out of the archive reads as nothing.
    #[test]
    fn an_archive_member_written_as_a_symbolic_link_reads_as_its_target() {
        let mut builder = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(5);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, "aaa/layer.tar", &b"layer"[..])
            .unwrap();
        for (name, target) in [
            ("bbb/layer.tar", "../aaa/layer.tar"),
            ("ccc/layer.tar", "../../etc/passwd"),
        ] {
            let mut header = tar::Header::new_gnu();
            header.set_size(0);
            header.set_entry_type(tar::EntryType::Symlink);
            builder.append_link(&mut header, name, target).unwrap();
        }
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), builder.into_inner().unwrap()).unwrap();
        let source = Source::open(file.path()).unwrap();
        let mut read = String::new();
        source
            .read("bbb/layer.tar")
            .unwrap()
            .read_to_string(&mut read)
            .unwrap();
        assert_eq!(read, "layer");
        assert!(source.read("ccc/layer.tar").is_err());
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
