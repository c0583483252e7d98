//! Merging an image's layers into one tar stream: what a container runtime's overlay would show.
//!
//! OCI layers are tar streams applied in order; a later layer's file replaces an earlier one's,
//! a whiteout `DIR/.wh.NAME` deletes `DIR/NAME` (and all under it) from the layers below, an
//! opaque marker `DIR/.wh..wh..opq` hides everything the layers below had under `DIR`. The merge
//! reads each layer twice: top-down first, deciding which entry of which layer is visible; then
//! bottom-up, writing only those, parents before children, as one tar that a plain `tar -x`
//! makes into the image's tree. Layers come from registries and archives we do not trust:
//! paths are normalised and anything that would climb out of the tree is refused, and the entry
//! count and path length are bounded.
//!
//! Extended attributes (file capabilities, SELinux labels, `user.*` ones) travel in layers as
//! PAX records `SCHILY.xattr.NAME` before their entry, as Docker, containerd and GNU tar write
//! them; each written entry gets its own again, checked and bounded ([`MAX_XATTRS`],
//! [`MAX_XATTR_BYTES`]: what the image's ext4 keeps for one file), their bytes counted with
//! the file data the merge bounds. `trusted.*` ones are not carried: that namespace holds the
//! kernel's own records (overlayfs's `trusted.overlay.*` among them), which an image has no
//! business setting. (`LIBARCHIVE.xattr.*`, bsdtar's base64 form, is not read.)

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};

/// The most entries one layer may have.
pub(crate) const MAX_ENTRIES: usize = 1 << 20;

/// The longest path an entry may have.
pub(crate) const MAX_PATH: usize = 4096;

/// The most file data the merged stream may carry: what an image's disk holds.
pub(crate) const MAX_MERGED_BYTES: u64 = crate::image::flatten::FLAT_DISK_BYTES;

/// The most path bytes the merge remembers over all layers (its maps of visible and deleted
/// paths).
pub(crate) const MAX_PATH_BYTES: usize = 256 << 20;

/// The most bytes of hard-linked files (replaced by upper layers) held to give their links
/// their contents.
const MAX_STASHED: u64 = 256 << 20;

/// Files whose merged contents are kept for the caller (the image's users and groups).
pub(crate) const CAPTURED: [&str; 2] = ["etc/passwd", "etc/group"];

/// The largest captured file.
const MAX_CAPTURED: u64 = 1 << 20;

/// The most extended attributes one entry may carry.
pub(crate) const MAX_XATTRS: usize = 64;

/// The most bytes of extended attribute names and values one entry may carry: the image's
/// ext4 (no `ea_inode`) keeps them in the inode and one 4 KiB block, so more could not be
/// applied (GNU tar would only warn, and the image would silently lack them).
pub(crate) const MAX_XATTR_BYTES: usize = 3 << 10;

/// The PAX record prefix of an extended attribute.
const XATTR_PREFIX: &str = "SCHILY.xattr.";

/// An entry's extended attributes, as (PAX key, value) records.
type Xattrs = Vec<(String, Vec<u8>)>;

/// The extended attributes `entry`'s PAX records carry, but `trusted.*` ones. A name that is
/// empty, not UTF-8, holds a NUL or is longer than Linux allows (255 bytes), more than
/// [`MAX_XATTR_BYTES`] of names and values, or more than [`MAX_XATTRS`] attributes refuse the
/// layer: the image could not hold them.
fn xattrs<R: Read>(entry: &mut tar::Entry<R>) -> Result<Xattrs, String> {
    let mut found = Vec::new();
    let mut total = 0;
    let Some(extensions) = entry
        .pax_extensions()
        .map_err(|e| format!("unreadable PAX records: {e}"))?
    else {
        return Ok(found);
    };
    for extension in extensions {
        let extension = extension.map_err(|e| format!("a malformed PAX record: {e}"))?;
        let Some(name) = extension.key_bytes().strip_prefix(XATTR_PREFIX.as_bytes()) else {
            continue;
        };
        let name = std::str::from_utf8(name)
            .ok()
            .filter(|n| !n.is_empty() && n.len() <= 255 && !n.contains('\0'))
            .ok_or_else(|| {
                format!(
                    "an extended attribute named {:?}",
                    String::from_utf8_lossy(name)
                )
            })?;
        if name.starts_with("trusted.") {
            continue;
        }
        let value = extension.value_bytes();
        total += name.len() + value.len();
        if total > MAX_XATTR_BYTES {
            return Err(format!(
                "extended attributes of more than {MAX_XATTR_BYTES} bytes (at {name})"
            ));
        }
        if found.len() == MAX_XATTRS {
            return Err(format!("more than {MAX_XATTRS} extended attributes"));
        }
        found.push((format!("{XATTR_PREFIX}{name}"), value.to_vec()));
    }
    Ok(found)
}

/// The bytes `xattrs` take, as the merge counts them against its bounds.
fn xattr_bytes(xattrs: &Xattrs) -> u64 {
    xattrs.iter().map(|(k, v)| (k.len() + v.len()) as u64).sum()
}

/// Writes `xattrs` as the PAX records of the entry written next.
fn append_xattrs<W: Write>(builder: &mut tar::Builder<W>, xattrs: &Xattrs) -> std::io::Result<()> {
    builder.append_pax_extensions(xattrs.iter().map(|(key, value)| (key.as_str(), &value[..])))
}

/// Why a merge failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MergeError {
    /// A layer is not a readable tar stream.
    #[error("layer {layer}: {source}")]
    Read {
        layer: usize,
        source: std::io::Error,
    },
    /// A layer holds an entry that cannot be part of an image's tree.
    #[error("layer {layer}: {reason}")]
    Refused { layer: usize, reason: String },
    /// Writing the merged stream failed.
    #[error("writing the merged layers: {0}")]
    Write(std::io::Error),
}

/// What a merge wrote.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Merged {
    /// Entries written.
    pub entries: usize,
    /// Entries of lower layers that upper layers replaced or deleted.
    pub hidden: usize,
    /// The merged contents of the [`CAPTURED`] files the image has (at most 1 MiB each).
    pub captured: HashMap<String, Vec<u8>>,
}

/// An entry's path inside the image: relative, `/`-separated, no `.`/`..`/empty components;
/// the empty string is the root itself. `None` for a path that climbs out.
pub(crate) fn normalise(raw: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(raw).ok()?;
    let mut parts = Vec::new();
    for part in text.split('/') {
        match part {
            "" | "." => {}
            ".." => return None,
            other => parts.push(other),
        }
    }
    Some(parts.join("/"))
}

/// Every strict ancestor of `path` ("a/b/c": "a", "a/b").
fn ancestors(path: &str) -> impl Iterator<Item = &str> {
    path.match_indices('/').map(move |(at, _)| &path[..at])
}

/// What a whiteout entry says, if it is one: `Opaque(dir)` or `Deleted(path)`.
enum Whiteout {
    Opaque(String),
    Deleted(String),
}

fn whiteout(path: &str) -> Option<Whiteout> {
    let (dir, name) = match path.rsplit_once('/') {
        Some((dir, name)) => (dir, name),
        None => ("", path),
    };
    if name == ".wh..wh..opq" {
        return Some(Whiteout::Opaque(dir.to_string()));
    }
    let deleted = name.strip_prefix(".wh.")?;
    Some(Whiteout::Deleted(if dir.is_empty() {
        deleted.to_string()
    } else {
        format!("{dir}/{deleted}")
    }))
}

/// Merges `layers` (bottom first; `open(i)` gives a fresh reader of layer `i`'s uncompressed
/// tar stream, and is called twice per layer) into `out` as one tar stream.
pub(crate) fn merge<R: Read>(
    count: usize,
    mut open: impl FnMut(usize) -> std::io::Result<R>,
    out: impl Write,
) -> Result<Merged, MergeError> {
    let read = |layer| move |source| MergeError::Read { layer, source };
    let refused = |layer, reason: String| MergeError::Refused { layer, reason };

    // Top-down: which entry (by its ordinal in its layer) is visible.
    let mut keep: Vec<HashSet<usize>> = vec![HashSet::new(); count];
    // The targets of each layer's visible hard links: a target an upper layer replaced or
    // deleted is not written itself, and its links get its contents instead.
    let mut link_targets: Vec<HashSet<String>> = vec![HashSet::new(); count];
    let mut deleted: HashSet<String> = HashSet::new();
    let mut opaque: HashSet<String> = HashSet::new();
    // Paths an upper layer provides: the layer, and whether it is a directory.
    let mut taken: HashMap<String, (usize, bool)> = HashMap::new();
    let mut hidden = 0;
    let mut path_bytes = 0usize;
    for layer in (0..count).rev() {
        let mut archive = tar::Archive::new(open(layer).map_err(read(layer))?);
        // path -> (ordinal, is a directory, a hard link's target)
        let mut this_layer: HashMap<String, (usize, bool, Option<String>)> = HashMap::new();
        let (mut layer_deleted, mut layer_opaque) = (Vec::new(), Vec::new());
        for (ordinal, entry) in archive.entries().map_err(read(layer))?.enumerate() {
            if ordinal >= MAX_ENTRIES {
                return Err(refused(layer, format!("more than {MAX_ENTRIES} entries")));
            }
            let entry = entry.map_err(read(layer))?;
            let raw = entry.path_bytes();
            if raw.len() > MAX_PATH {
                return Err(refused(layer, format!("a path of {} bytes", raw.len())));
            }
            let path = normalise(&raw).ok_or_else(|| {
                refused(
                    layer,
                    format!(
                        "the path {:?} leaves the tree",
                        String::from_utf8_lossy(&raw)
                    ),
                )
            })?;
            let kind = entry.header().entry_type();
            if kind.is_gnu_sparse() {
                // Its stored size is not its size: refused rather than misframed.
                return Err(refused(layer, format!("{path} is a sparse file")));
            }
            path_bytes += path.len();
            if path_bytes > MAX_PATH_BYTES {
                return Err(refused(
                    layer,
                    format!("more than {MAX_PATH_BYTES} bytes of paths"),
                ));
            }
            if path.is_empty()
                || kind.is_pax_global_extensions()
                || kind.is_pax_local_extensions()
                || kind.is_gnu_longname()
                || kind.is_gnu_longlink()
            {
                // The root itself (the tree's top exists already), or metadata of the stream.
                continue;
            }
            let mut link_target = None;
            if let Some(link) = entry.link_name_bytes() {
                if kind.is_hard_link() {
                    let target = normalise(&link).filter(|l| !l.is_empty()).ok_or_else(|| {
                        refused(layer, format!("the hard link {path} leaves the tree"))
                    })?;
                    link_target = Some(target);
                }
            }
            match whiteout(&path) {
                Some(Whiteout::Opaque(dir)) => {
                    layer_opaque.push(dir);
                    continue;
                }
                Some(Whiteout::Deleted(gone)) => {
                    layer_deleted.push(gone);
                    continue;
                }
                None => {}
            }
            // A root-level opaque marker hides every path of the layers below.
            let shadowed = opaque.contains("")
                || taken.contains_key(&path)
                || deleted.contains(&path)
                || ancestors(&path).any(|a| {
                    deleted.contains(a)
                        || opaque.contains(a)
                        || taken.get(a).is_some_and(|(_, is_dir)| !is_dir)
                });
            if shadowed {
                hidden += 1;
                continue;
            }
            // Within one layer the later of two entries for a path is the one that counts.
            if this_layer
                .insert(path, (ordinal, kind.is_dir(), link_target))
                .is_some()
            {
                hidden += 1;
            }
        }
        for (path, (ordinal, is_dir, link_target)) in this_layer {
            keep[layer].insert(ordinal);
            taken.insert(path, (layer, is_dir));
            link_targets[layer].extend(link_target);
        }
        deleted.extend(layer_deleted);
        opaque.extend(layer_opaque);
    }

    // Bottom-up: write the visible entries, lower layers first.
    let mut builder = tar::Builder::new(out);
    builder.follow_symlinks(false);
    let mut entries = 0;
    let mut data_bytes = 0u64;
    let mut captured = HashMap::new();
    let mut written_paths: HashSet<String> = HashSet::new();
    let mut stashed_bytes = 0u64;
    for (layer, keep) in keep.iter().enumerate() {
        // This layer's hidden link targets (header and contents), and the path each one's
        // contents went to first.
        let mut stash: HashMap<String, (tar::Header, Vec<u8>, Xattrs)> = HashMap::new();
        let mut materialised: HashMap<String, String> = HashMap::new();
        let mut archive = tar::Archive::new(open(layer).map_err(read(layer))?);
        for (ordinal, entry) in archive.entries().map_err(read(layer))?.enumerate() {
            let mut entry = entry.map_err(read(layer))?;
            if !keep.contains(&ordinal) {
                let kind = entry.header().entry_type();
                let path = normalise(&entry.path_bytes()).unwrap_or_default();
                if kind.is_file() && link_targets[layer].contains(&path) {
                    let attributes = xattrs(&mut entry).map_err(|e| refused(layer, e))?;
                    stashed_bytes += entry.size() + xattr_bytes(&attributes);
                    if stashed_bytes > MAX_STASHED {
                        return Err(refused(
                            layer,
                            format!(
                                "more than {MAX_STASHED} bytes of hard-linked files replaced above"
                            ),
                        ));
                    }
                    let mut data = Vec::new();
                    entry.read_to_end(&mut data).map_err(read(layer))?;
                    stash.insert(path, (entry.header().clone(), data, attributes));
                }
                continue;
            }
            let path = normalise(&entry.path_bytes()).expect("checked in the first pass");
            let attributes =
                xattrs(&mut entry).map_err(|e| refused(layer, format!("{path}: {e}")))?;
            let mut header = entry.header().clone();
            let kind = header.entry_type();
            let written = if kind.is_symlink() || kind.is_hard_link() {
                use std::os::unix::ffi::OsStrExt;
                let target = entry
                    .link_name_bytes()
                    .map(|l| l.into_owned())
                    .unwrap_or_default();
                let target = if kind.is_hard_link() {
                    let target = normalise(&target).expect("checked in the first pass");
                    // A hard link needs its target written before it. A target an upper layer
                    // deleted or replaced, or one that comes later in the stream, is not (rare:
                    // tar writers put a link after its target), and neither is the link then.
                    if !written_paths.contains(&target) {
                        // Its target was replaced or deleted above: the link keeps the old
                        // contents, as the overlay would show it.
                        if let Some(first) = materialised.get(&target) {
                            first.clone().into_bytes()
                        } else if let Some((target_header, data, target_xattrs)) =
                            stash.get(&target)
                        {
                            let mut file = target_header.clone();
                            append_xattrs(&mut builder, target_xattrs)
                                .map_err(MergeError::Write)?;
                            builder
                                .append_data(&mut file, &path, &data[..])
                                .map_err(MergeError::Write)?;
                            materialised.insert(target, path.clone());
                            written_paths.insert(path);
                            entries += 1;
                            continue;
                        } else {
                            return Err(refused(
                                layer,
                                format!("the hard link {path} names {target}, which comes after it or nowhere"),
                            ));
                        }
                    } else {
                        target.into_bytes()
                    }
                } else {
                    target
                };
                header.set_size(0);
                append_xattrs(&mut builder, &attributes).map_err(MergeError::Write)?;
                builder.append_link(
                    &mut header,
                    &path,
                    std::path::Path::new(std::ffi::OsStr::from_bytes(&target)),
                )
            } else {
                data_bytes += header.size().unwrap_or(0) + xattr_bytes(&attributes);
                if data_bytes > MAX_MERGED_BYTES {
                    return Err(refused(
                        layer,
                        format!("more than {MAX_MERGED_BYTES} bytes of files"),
                    ));
                }
                append_xattrs(&mut builder, &attributes).map_err(MergeError::Write)?;
                if kind.is_file()
                    && CAPTURED.contains(&path.as_str())
                    && entry.size() <= MAX_CAPTURED
                {
                    let mut data = Vec::new();
                    entry.read_to_end(&mut data).map_err(read(layer))?;
                    captured.insert(path.clone(), data.clone());
                    builder.append_data(&mut header, &path, &data[..])
                } else {
                    builder.append_data(&mut header, &path, &mut entry)
                }
            };
            written.map_err(MergeError::Write)?;
            written_paths.insert(path);
            entries += 1;
        }
    }
    builder.into_inner().map_err(MergeError::Write)?;
    Ok(Merged {
        entries,
        hidden,
        captured,
    })
}

/// The `oci_layers` fuzz property: `data` cut into layers (at each `\n--layer--\n`, at most 4),
/// each a tar stream, merged. Never panics; a merge that succeeds writes a tar stream that reads
/// back whole, holding no path twice, no whiteout, nothing absolute or climbing out, and no
/// hard link to a path not written before it.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_oci_layers(data: &[u8]) {
    let separator = b"\n--layer--\n";
    let mut layers: Vec<&[u8]> = Vec::new();
    let mut rest = data;
    while layers.len() < 3 {
        match rest.windows(separator.len()).position(|w| w == separator) {
            Some(at) => {
                layers.push(&rest[..at]);
                rest = &rest[at + separator.len()..];
            }
            None => break,
        }
    }
    layers.push(rest);
    let mut out = Vec::new();
    let merged = merge(layers.len(), |i| Ok(layers[i]), &mut out);
    let Ok(merged) = merged else {
        return;
    };
    let mut archive = tar::Archive::new(&out[..]);
    let mut seen = HashSet::new();
    let mut count = 0;
    for entry in archive.entries().expect("the merged stream reads") {
        let entry = entry.expect("every merged entry reads");
        let raw = entry.path_bytes().into_owned();
        let path = normalise(&raw).expect("no merged path climbs out");
        assert!(!raw.starts_with(b"/"), "an absolute path {path}");
        assert!(!path.is_empty(), "the root written as an entry");
        assert!(whiteout(&path).is_none(), "a whiteout written: {path}");
        if entry.header().entry_type().is_hard_link() {
            let target = entry.link_name_bytes().expect("a link has a target");
            let target = normalise(&target).expect("no link climbs out");
            assert!(
                seen.contains(&target),
                "{path} links to {target}, not written before"
            );
        }
        assert!(seen.insert(path.clone()), "{path} written twice");
        count += 1;
    }
    assert_eq!(count, merged.entries);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(entries: &[(&str, tar::EntryType, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, kind, data) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(*kind);
            header.set_mode(0o644);
            header.set_size(if kind.is_file() { data.len() as u64 } else { 0 });
            if kind.is_hard_link() || kind.is_symlink() {
                let target = std::str::from_utf8(data).unwrap();
                builder.append_link(&mut header, path, target).unwrap();
            } else {
                builder.append_data(&mut header, path, *data).unwrap();
            }
        }
        builder.into_inner().unwrap()
    }

    /// Merges `layers` and reads each written entry back: its path and what `read` makes of it.
    fn merged_with<T>(
        layers: &[Vec<u8>],
        mut read: impl FnMut(&mut tar::Entry<&[u8]>) -> T,
    ) -> Result<Vec<(String, T)>, MergeError> {
        let mut out = Vec::new();
        merge(layers.len(), |i| Ok(&layers[i][..]), &mut out)?;
        let mut archive = tar::Archive::new(&out[..]);
        Ok(archive
            .entries()
            .unwrap()
            .map(|e| {
                let mut e = e.unwrap();
                let path = String::from_utf8(e.path_bytes().into_owned()).unwrap();
                (path.trim_end_matches('/').to_string(), read(&mut e))
            })
            .collect())
    }

    fn merged(layers: &[Vec<u8>]) -> Result<Vec<(String, Vec<u8>)>, MergeError> {
        merged_with(layers, |e| {
            let mut data = Vec::new();
            std::io::Read::read_to_end(e, &mut data).unwrap();
            data
        })
    }

    use tar::EntryType as T;

    /// Upper files replace lower ones, whiteouts delete (with everything under them), an
    /// opaque directory hides what lower layers had in it but not its own files, a file
    /// replacing a directory hides the directory's contents; lower layers come first.
    #[test]
    fn whiteouts_opaque_directories_and_replacements_merge_as_an_overlay_shows_them() {
        let lower = layer(&[
            ("etc", T::Directory, b""),
            ("etc/keep", T::Regular, b"old"),
            ("etc/gone", T::Regular, b"x"),
            ("var", T::Directory, b""),
            ("var/lib", T::Directory, b""),
            ("var/lib/deep", T::Regular, b"x"),
            ("opt", T::Directory, b""),
            ("opt/a", T::Regular, b"x"),
            ("srv", T::Directory, b""),
            ("srv/inside", T::Regular, b"x"),
        ]);
        let upper = layer(&[
            ("etc/keep", T::Regular, b"new"),
            ("etc/.wh.gone", T::Regular, b""),
            ("var/.wh.lib", T::Regular, b""),
            ("opt/.wh..wh..opq", T::Regular, b""),
            ("opt/b", T::Regular, b"b"),
            ("srv", T::Regular, b"now a file"),
        ]);
        let out = merged(&[lower, upper]).unwrap();
        let paths: Vec<&str> = out.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(paths, ["etc", "var", "opt", "etc/keep", "opt/b", "srv"]);
        let get = |p: &str| &out.iter().find(|(q, _)| q == p).unwrap().1;
        assert_eq!(get("etc/keep"), b"new");
        assert_eq!(get("srv"), b"now a file");
    }

    /// A one-entry tar stream whose header holds `name` (and `link`) as raw bytes, which the
    /// tar crate's builder would refuse to write.
    fn raw_entry(name: &str, kind: tar::EntryType, link: &str) -> Vec<u8> {
        let mut header = tar::Header::new_old();
        header.set_size(0);
        header.set_entry_type(kind);
        let mut raw = header.as_bytes().to_vec();
        raw[..name.len()].copy_from_slice(name.as_bytes());
        raw[157..157 + link.len()].copy_from_slice(link.as_bytes());
        let mut header = tar::Header::from_byte_slice(&raw).clone();
        header.set_cksum();
        let mut bytes = header.as_bytes().to_vec();
        bytes.extend([0u8; 1024]);
        bytes
    }

    #[test]
    fn paths_that_leave_the_tree_are_refused() {
        for bad in ["../etc/passwd", "a/../../b"] {
            let bytes = raw_entry(bad, T::Regular, "");
            assert!(
                matches!(merged(&[bytes]), Err(MergeError::Refused { .. })),
                "{bad}"
            );
        }
        let link_out = raw_entry("evil", T::Link, "../../etc/shadow");
        assert!(matches!(
            merged(&[link_out]),
            Err(MergeError::Refused { .. })
        ));
        // "/abs" is taken as "abs" inside the tree, as tar -x does.
        let out = merged(&[raw_entry("/abs", T::Regular, "")]).unwrap();
        assert_eq!(out[0].0, "abs");
    }

    /// Hard links whose target an upper layer deleted or replaced keep the old contents (as the
    /// overlay shows them): the first becomes a file, the others links to it. A link to nothing
    /// is refused.
    #[test]
    fn hard_links_to_replaced_targets_keep_the_old_contents() {
        let lower = layer(&[
            ("a", T::Regular, b"old"),
            ("b", T::Link, b"a"),
            ("c", T::Link, b"a"),
        ]);
        let out = merged(&[lower.clone(), layer(&[(".wh.a", T::Regular, b"")])]).unwrap();
        assert_eq!(
            out,
            [
                ("b".to_string(), b"old".to_vec()),
                ("c".to_string(), Vec::new())
            ]
        );
        let out = merged(&[lower.clone(), layer(&[("a", T::Regular, b"new")])]).unwrap();
        let get = |p: &str| out.iter().find(|(q, _)| q == p).unwrap().1.clone();
        assert_eq!(get("a"), b"new");
        assert_eq!(get("b"), b"old");
        let out = merged(&[lower]).unwrap();
        assert_eq!(out.len(), 3);
        let dangling = layer(&[("b", T::Link, b"nowhere")]);
        assert!(matches!(
            merged(&[dangling]),
            Err(MergeError::Refused { .. })
        ));
    }

    #[test]
    fn sparse_entries_are_refused() {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(T::GNUSparse);
        header.set_size(0);
        let gnu = header.as_gnu_mut().unwrap();
        gnu.set_real_size(1 << 31);
        // One chunk of 0 bytes at 2 GiB (octal, NUL-terminated, as GNU tar writes them).
        gnu.sparse[0].offset = *b"20000000000\0";
        gnu.sparse[0].numbytes = *b"00000000000\0";
        header.set_path("s").unwrap();
        header.set_cksum();
        let mut sparse = header.as_bytes().to_vec();
        sparse.extend([0u8; 1024]);
        let result = merged(&[sparse]);
        assert!(
            matches!(result, Err(MergeError::Refused { .. })),
            "{result:?}"
        );
    }

    #[test]
    fn the_fuzz_property_holds_on_seeds_and_their_mutations() {
        let seeds = seeds();
        for seed in &seeds {
            fuzz_oci_layers(seed);
        }
        crate::fuzzing::mutate_seeds(&seeds, 500, 0x0c1_1a7e, fuzz_oci_layers);
        crate::fuzzing::replay_corpus("oci_layers", fuzz_oci_layers);
    }

    /// `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_oci_layers_seeds` writes them.
    #[test]
    fn committed_oci_layers_seeds_are_the_generated_ones() {
        crate::fuzzing::assert_committed_seeds("oci_layers", &seeds());
    }

    /// Seeds: two layers with a whiteout, an opaque directory and a hard link; one layer with a
    /// symbolic link and a long name.
    fn seeds() -> Vec<Vec<u8>> {
        let join = |layers: &[Vec<u8>]| layers.join(&b"\n--layer--\n"[..]);
        vec![
            join(&[
                layer(&[
                    ("etc", T::Directory, b""),
                    ("etc/a", T::Regular, b"a"),
                    ("etc/h", T::Link, b"etc/a"),
                    ("opt/x", T::Regular, b"x"),
                ]),
                layer(&[
                    ("etc/.wh.a", T::Regular, b""),
                    ("opt/.wh..wh..opq", T::Regular, b""),
                    ("opt/y", T::Regular, b"y"),
                ]),
            ]),
            layer(&[
                ("bin/sh", T::Symlink, b"busybox"),
                (&"d/".repeat(60), T::Directory, b""),
            ]),
        ]
    }

    /// PAX records: (key, value).
    type Records<'a> = Vec<(&'a str, Vec<u8>)>;

    /// A layer of files, each with PAX records before it.
    fn layer_with_records(files: &[(&str, Records)]) -> Vec<u8> {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, records) in files {
            builder
                .append_pax_extensions(records.iter().map(|(k, v)| (*k, &v[..])))
                .unwrap();
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(tar::EntryType::Regular);
            header.set_mode(0o755);
            header.set_size(2);
            builder.append_data(&mut header, path, &b"x\n"[..]).unwrap();
        }
        builder.into_inner().unwrap()
    }

    /// Each merged entry's path and its extended attributes' PAX records.
    fn merged_xattrs(layers: &[Vec<u8>]) -> Result<HashMap<String, Xattrs>, MergeError> {
        Ok(merged_with(layers, |e| xattrs(e).unwrap())?
            .into_iter()
            .collect())
    }

    #[test]
    fn extended_attributes_travel_with_their_entries_and_impossible_ones_refuse_the_layer() {
        let capability = vec![1u8, 0, 0, 2, 0x20, 0, 0, 0, 0, 0, 0, 0];
        let first = layer_with_records(&[
            (
                "bin/ping",
                vec![
                    ("SCHILY.xattr.security.capability", capability.clone()),
                    ("SCHILY.xattr.user.role", b"net".to_vec()),
                    ("SCHILY.xattr.trusted.overlay.opaque", b"y".to_vec()),
                    ("comment", b"not an attribute".to_vec()),
                ],
            ),
            ("etc/plain", vec![]),
            (
                "etc/replaced",
                vec![("SCHILY.xattr.user.old", b"1".to_vec())],
            ),
        ]);
        let second = layer_with_records(&[(
            "etc/replaced",
            vec![("SCHILY.xattr.user.new", b"2".to_vec())],
        )]);
        let merged = merged_xattrs(&[first, second]).unwrap();
        assert_eq!(
            merged["bin/ping"],
            vec![
                ("SCHILY.xattr.security.capability".to_string(), capability),
                ("SCHILY.xattr.user.role".to_string(), b"net".to_vec()),
            ]
        );
        assert!(merged["etc/plain"].is_empty());
        // The upper layer's file, with its own attributes only.
        assert_eq!(
            merged["etc/replaced"],
            vec![("SCHILY.xattr.user.new".to_string(), b"2".to_vec())]
        );

        for (records, says) in [
            (
                vec![("SCHILY.xattr.user.big", vec![0u8; MAX_XATTR_BYTES])],
                "more than 3072 bytes (at user.big)",
            ),
            (
                vec![("SCHILY.xattr.", b"v".to_vec())],
                "an extended attribute named \"\"",
            ),
            (
                vec![("SCHILY.xattr.user.nul\0x", b"v".to_vec())],
                "an extended attribute named",
            ),
        ] {
            let bad = layer_with_records(&[("f", records)]);
            match merged_xattrs(&[bad]) {
                Err(MergeError::Refused { reason, .. }) => {
                    assert!(reason.contains(says), "{reason}")
                }
                other => panic!("expected a refusal saying {says:?}, got {other:?}"),
            }
        }
        let many: Vec<(String, Vec<u8>)> = (0..=MAX_XATTRS)
            .map(|i| (format!("SCHILY.xattr.user.a{i}"), b"v".to_vec()))
            .collect();
        let records: Vec<(&str, Vec<u8>)> =
            many.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        assert!(matches!(
            merged_xattrs(&[layer_with_records(&[("f", records)])]),
            Err(MergeError::Refused { .. })
        ));
    }
}
