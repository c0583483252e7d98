//! Image archives on disk: `docker save`'s tarball (its legacy `manifest.json`) and OCI image
//! layouts, as a directory or a tar read in place. [`read`] finds an archive's config and
//! layers and checks every blob against its digest before anything is merged.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{decompress, json, merge, parse_config, sha256_hex, MAX_JSON, MAX_LAYERS};

/// The most members an archive's tar may have.
const MAX_MEMBERS: usize = 1 << 16;

/// An archive whose config and layers were checked against their digests.
pub(super) struct Checked {
    source: Source,
    parts: Parts,
}

impl Checked {
    /// The config blob.
    pub(super) fn config(&self) -> &[u8] {
        &self.parts.config
    }

    /// The config blob's digest (`sha256:…`).
    pub(super) fn config_digest(&self) -> &str {
        &self.parts.config_digest
    }

    /// Whether the layers' uncompressed bytes were checked against the config's `diff_ids`
    /// (a legacy archive's are; an OCI layout's were checked by their compressed bytes).
    pub(super) fn diff_ids_checked(&self) -> bool {
        self.parts.diff_ids_required.is_some()
    }

    /// How many layers the image has.
    pub(super) fn layer_count(&self) -> usize {
        self.parts.layers.len()
    }

    /// Layer `i`'s uncompressed tar stream, read afresh.
    pub(super) fn open_layer(&self, i: usize) -> std::io::Result<Box<dyn Read + Send>> {
        self.source
            .read(&self.parts.layers[i].name)
            .and_then(decompress)
            .map_err(std::io::Error::other)
    }
}

/// Reads the archive at `archive` and checks every layer before any is used: an OCI layout's
/// by its compressed bytes, a legacy archive's by its uncompressed bytes against the config's
/// `diff_ids`.
pub(super) fn read(archive: &Path) -> Result<Checked, String> {
    let source = Source::open(archive)?;
    let parts = source.parts()?;
    if let Some(diff_ids) = &parts.diff_ids_required {
        if diff_ids.len() != parts.layers.len() {
            return Err(format!(
                "the config lists {} layers, the manifest {}",
                diff_ids.len(),
                parts.layers.len()
            ));
        }
    }
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
    Ok(Checked { source, parts })
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
pub(super) fn blob_name(digest: &str) -> std::result::Result<String, String> {
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
}
