//! Image archives built from files the tests make: a `docker save` tarball and an OCI image
//! layout of two layers (busybox-static from the host and a few files; then an app script, a
//! whiteout and an opaque directory), whose entrypoint prints what the tests check.

use std::io::Write;

use flate2::write::GzEncoder;
use sha2::{Digest, Sha256};

/// A tar stream built entry by entry.
struct Layer(tar::Builder<Vec<u8>>);

impl Layer {
    fn new() -> Self {
        Layer(tar::Builder::new(Vec::new()))
    }
    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(size);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(1_700_000_000);
        header
    }
    fn dir(mut self, path: &str) -> Self {
        let mut header = Self::header(tar::EntryType::Directory, 0o755, 0);
        self.0.append_data(&mut header, path, &[][..]).unwrap();
        self
    }
    fn file(mut self, path: &str, mode: u32, data: &[u8]) -> Self {
        let mut header = Self::header(tar::EntryType::Regular, mode, data.len() as u64);
        self.0.append_data(&mut header, path, data).unwrap();
        self
    }
    /// A file with extended attributes, as PAX `SCHILY.xattr.NAME` records before it (how
    /// Docker and GNU tar write them).
    fn file_with_xattrs(
        mut self,
        path: &str,
        mode: u32,
        data: &[u8],
        xattrs: &[(&str, &[u8])],
    ) -> Self {
        let records: Vec<(String, &[u8])> = xattrs
            .iter()
            .map(|(name, value)| (format!("SCHILY.xattr.{name}"), *value))
            .collect();
        self.0
            .append_pax_extensions(records.iter().map(|(k, v)| (k.as_str(), *v)))
            .unwrap();
        self.file(path, mode, data)
    }
    fn link(mut self, kind: tar::EntryType, path: &str, target: &str) -> Self {
        let mut header = Self::header(kind, 0o777, 0);
        self.0.append_link(&mut header, path, target).unwrap();
        self
    }
    fn bytes(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }
}

/// The entrypoint's script.
const SCRIPT: &[u8] = b"#!/bin/sh
echo \"$GREETING from $(pwd) as $(id -u):$(id -g), args: $*\"
[ -e /etc/gone ] && echo 'a whited-out file is back'
echo \"old: $(ls /opt/old)\"
[ /bin/ash -ef /bin/busybox ] && echo 'ash is a hard link'
";

/// The entrypoint script's extended attributes: one of the `user` namespace, and a file
/// capability (`cap_net_raw`, permitted and effective: `VFS_CAP_REVISION_2`'s 20 bytes).
pub const XATTRS: &[(&str, &[u8])] = &[
    ("user.krunbox", b"imported"),
    (
        "security.capability",
        &[
            1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ],
    ),
];

/// The two layers: busybox and a few files; then the app, a whiteout and an opaque directory.
fn layers() -> [Vec<u8>; 2] {
    let busybox = std::fs::read("/bin/busybox").expect("busybox-static (scripts/setup.sh)");
    let mut first = Layer::new()
        .dir("bin")
        .file("bin/busybox", 0o755, &busybox)
        .link(tar::EntryType::Link, "bin/ash", "bin/busybox");
    for applet in ["sh", "id", "ls", "cat", "echo"] {
        first = first.link(tar::EntryType::Symlink, &format!("bin/{applet}"), "busybox");
    }
    let first = first
        .dir("etc")
        .file("etc/gone", 0o644, b"deleted by the next layer\n")
        .dir("opt")
        .dir("opt/old")
        .file("opt/old/a", 0o644, b"hidden by the next layer\n");
    let second = Layer::new()
        .dir("app")
        .file_with_xattrs("app/run.sh", 0o755, SCRIPT, XATTRS)
        .file("etc/.wh.gone", 0o644, b"")
        .dir("opt/old")
        .file("opt/old/.wh..wh..opq", 0o644, b"")
        .file("opt/old/b", 0o644, b"the new layer's\n");
    [first.bytes(), second.bytes()]
}

fn sha(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn config(layers: &[Vec<u8>]) -> Vec<u8> {
    let diff_ids: Vec<String> = layers
        .iter()
        .map(|l| format!("sha256:{}", sha(l)))
        .collect();
    serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": ["/bin/sh", "/app/run.sh"],
            "Cmd": ["extra"],
            "Env": ["GREETING=hello", "PATH=/bin"],
            "WorkingDir": "/app",
            "User": "1000:1001"
        },
        "rootfs": { "type": "layers", "diff_ids": diff_ids }
    }))
    .unwrap()
}

/// A tar archive of `members`.
#[allow(dead_code)] // each test binary uses some
fn archive(members: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Layer::new();
    for (name, data) in members {
        out = out.file(name, 0o644, data);
    }
    out.bytes()
}

/// `docker save`'s legacy layout: manifest.json, the config named by its digest, layer tars.
#[allow(dead_code)]
pub fn docker_save() -> Vec<u8> {
    let layers = layers();
    let config = config(&layers);
    let config_name = format!("{}.json", sha(&config));
    let manifest = serde_json::to_vec(&serde_json::json!([{
        "Config": config_name,
        "RepoTags": ["krunbox-test:latest"],
        "Layers": ["one/layer.tar", "two/layer.tar"],
    }]))
    .unwrap();
    let [one, two] = layers;
    archive(&[
        ("manifest.json".into(), manifest),
        (config_name, config),
        ("one/layer.tar".into(), one),
        ("two/layer.tar".into(), two),
    ])
}

/// An OCI image layout (as a tar): a gzip'd and a zstd'd layer, the config and manifest as
/// blobs. `tamper`:
/// the second layer's blob has a byte changed after the manifest named its digest.
#[allow(dead_code)]
pub fn oci_layout(tamper: bool) -> Vec<u8> {
    archive(&oci_layout_members(&layers(), tamper).0)
}

/// Which image an OCI layout directory holds.
#[allow(dead_code)] // each test binary uses some
#[derive(Clone, Copy)]
pub enum Image {
    /// Only the first layer (busybox and a few files): what the app is built on.
    Base,
    /// Both layers, the entrypoint printing [`ENTRYPOINT_OUTPUT`].
    App,
}

/// Writes an OCI image layout of `image` into `dir`, its manifest tagged `latest` (for
/// `skopeo copy oci:DIR:latest ...`); returns the digests of its config and of its layers'
/// blobs.
#[allow(dead_code)] // each test binary uses some
pub fn oci_layout_dir(dir: &std::path::Path, image: Image) -> (String, Vec<String>) {
    let mut layers = layers().to_vec();
    if let Image::Base = image {
        layers.truncate(1);
    }
    let (members, config_digest, layer_digests) = oci_layout_members(&layers, false);
    for (name, data) in members {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, data).unwrap();
    }
    (config_digest, layer_digests)
}

/// Two images for two platforms in one OCI image layout, and the image index listing them.
#[allow(dead_code)] // each test binary uses some
pub struct MultiPlatform {
    /// The index: linux/arm64 listed first, then linux/amd64.
    pub index: Vec<u8>,
    /// The digests of the arm64 and the amd64 manifests.
    pub arm64_manifest: String,
    pub amd64_manifest: String,
    /// The digest of the amd64 image's config.
    pub amd64_config: String,
}

/// Writes the app for linux/amd64 and the same layers with a config saying arm64 into the
/// OCI layout `dir` (`latest` names the amd64 manifest; [`tag_latest`] moves it), and the
/// index of the two.
#[allow(dead_code)] // each test binary uses some
pub fn multi_platform_layout_dir(dir: &std::path::Path) -> MultiPlatform {
    let (amd64_config, _) = oci_layout_dir(dir, Image::App);
    let read_json = |path: std::path::PathBuf| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    };
    let write_blob = |bytes: &[u8]| -> (String, usize) {
        std::fs::write(dir.join("blobs/sha256").join(sha(bytes)), bytes).unwrap();
        (format!("sha256:{}", sha(bytes)), bytes.len())
    };
    let amd64 = read_json(dir.join("index.json"))["manifests"][0].clone();
    let amd64_manifest = amd64["digest"].as_str().unwrap().to_string();
    let blob = |digest: &str| {
        dir.join("blobs/sha256")
            .join(digest.strip_prefix("sha256:").unwrap())
    };
    let mut config = read_json(blob(&amd64_config));
    config["architecture"] = "arm64".into();
    let (arm_config, arm_config_size) = write_blob(&serde_json::to_vec(&config).unwrap());
    let mut manifest = read_json(blob(&amd64_manifest));
    manifest["config"]["digest"] = arm_config.into();
    manifest["config"]["size"] = arm_config_size.into();
    let (arm64_manifest, arm_manifest_size) = write_blob(&serde_json::to_vec(&manifest).unwrap());
    let mut amd64_entry = amd64.clone();
    amd64_entry.as_object_mut().unwrap().remove("annotations");
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": arm64_manifest,
                "size": arm_manifest_size,
                "platform": { "architecture": "arm64", "os": "linux" },
            },
            amd64_entry,
        ],
    }))
    .unwrap();
    MultiPlatform {
        index,
        arm64_manifest,
        amd64_manifest,
        amd64_config,
    }
}

/// Makes `latest` in the OCI layout `dir` name the manifest `digest` (one of its blobs).
#[allow(dead_code)] // each test binary uses some
pub fn tag_latest(dir: &std::path::Path, digest: &str) {
    let manifest = std::fs::read(
        dir.join("blobs/sha256")
            .join(digest.strip_prefix("sha256:").unwrap()),
    )
    .unwrap();
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest,
            "size": manifest.len(),
            "annotations": { "org.opencontainers.image.ref.name": "latest" },
        }],
    });
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
}

/// An archive's members: names and contents.
type Members = Vec<(String, Vec<u8>)>;

/// The members of an OCI layout of `layers`, the config's digest and the layer blobs' digests.
fn oci_layout_members(layers: &[Vec<u8>], tamper: bool) -> (Members, String, Vec<String>) {
    let config = config(layers);
    // The first layer gzip'd, the second zstd'd: both kinds registries serve.
    let compressed: Vec<(Vec<u8>, &str)> = layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            if i == 0 {
                let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::fast());
                gz.write_all(l).unwrap();
                (
                    gz.finish().unwrap(),
                    "application/vnd.oci.image.layer.v1.tar+gzip",
                )
            } else {
                let zstd = ruzstd::encoding::compress_to_vec(
                    &l[..],
                    ruzstd::encoding::CompressionLevel::Fastest,
                );
                (zstd, "application/vnd.oci.image.layer.v1.tar+zstd")
            }
        })
        .collect();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{}", sha(&config)),
            "size": config.len(),
        },
        "layers": compressed.iter().map(|(blob, media_type)| serde_json::json!({
            "mediaType": media_type,
            "digest": format!("sha256:{}", sha(blob)),
            "size": blob.len(),
        })).collect::<Vec<_>>(),
    }))
    .unwrap();
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{}", sha(&manifest)),
            "size": manifest.len(),
            "platform": { "architecture": "amd64", "os": "linux" },
            "annotations": { "org.opencontainers.image.ref.name": "latest" },
        }],
    }))
    .unwrap();
    let config_digest = format!("sha256:{}", sha(&config));
    let layer_digests = compressed
        .iter()
        .map(|(blob, _)| format!("sha256:{}", sha(blob)))
        .collect();
    let mut members = vec![
        (
            "oci-layout".to_string(),
            br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
        ),
        ("index.json".to_string(), index),
        (format!("blobs/sha256/{}", sha(&manifest)), manifest),
        (format!("blobs/sha256/{}", sha(&config)), config),
    ];
    for (i, (mut g, _)) in compressed.into_iter().enumerate() {
        let name = format!("blobs/sha256/{}", sha(&g));
        if tamper && i == 1 {
            let middle = g.len() / 2;
            g[middle] ^= 0xff;
        }
        members.push((name, g));
    }
    (members, config_digest, layer_digests)
}

/// What the entrypoint prints, run as the image's user in its directory with its variables.
pub const ENTRYPOINT_OUTPUT: &str =
    "hello from /app as 1000:1001, args: extra\nold: b\nash is a hard link\n";

/// Boots `image` (256 MiB) with its configuration as every command's defaults.
#[allow(dead_code)] // each test binary uses some
pub async fn boot(image: &krunbox::image::oci::OciImage) -> krunbox::Instance {
    krunbox::Sandbox::builder()
        .rootfs(image.rootfs())
        .image_config(image.config.clone())
        .memory_mib(256)
        .build()
        .unwrap()
        .boot()
        .await
        .expect("boot the image")
}

/// Boots `image` with its configuration, runs its entrypoint, and checks it printed
/// [`ENTRYPOINT_OUTPUT`] and succeeded.
#[allow(dead_code)] // each test binary uses some
pub async fn boot_and_run_entrypoint(image: &krunbox::image::oci::OciImage) {
    let vm = boot(image).await;
    let out = vm
        .entrypoint()
        .expect("the image has an entrypoint")
        .output()
        .await
        .expect("run the entrypoint");
    assert_eq!(
        out.stdout_text(),
        ENTRYPOINT_OUTPUT,
        "{}",
        out.stderr_text()
    );
    assert!(out.status.success(), "{}", out.stderr_text());
    vm.shutdown().await.expect("shutdown");
}
