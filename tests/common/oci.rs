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
        .file("app/run.sh", 0o755, SCRIPT)
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
fn archive(members: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Layer::new();
    for (name, data) in members {
        out = out.file(name, 0o644, data);
    }
    out.bytes()
}

/// `docker save`'s legacy layout: manifest.json, the config named by its digest, layer tars.
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

/// An OCI image layout (as a tar): gzip'd layers, the config and manifest as blobs. `tamper`:
/// the second layer's blob has a byte changed after the manifest named its digest.
pub fn oci_layout(tamper: bool) -> Vec<u8> {
    let layers = layers();
    let config = config(&layers);
    let gzipped: Vec<Vec<u8>> = layers
        .iter()
        .map(|l| {
            let mut gz = GzEncoder::new(Vec::new(), flate2::Compression::fast());
            gz.write_all(l).unwrap();
            gz.finish().unwrap()
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
        "layers": gzipped.iter().map(|g| serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": format!("sha256:{}", sha(g)),
            "size": g.len(),
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
        }],
    }))
    .unwrap();
    let mut members = vec![
        (
            "oci-layout".to_string(),
            br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
        ),
        ("index.json".to_string(), index),
        (format!("blobs/sha256/{}", sha(&manifest)), manifest),
        (format!("blobs/sha256/{}", sha(&config)), config),
    ];
    for (i, mut g) in gzipped.into_iter().enumerate() {
        let name = format!("blobs/sha256/{}", sha(&g));
        if tamper && i == 1 {
            let middle = g.len() / 2;
            g[middle] ^= 0xff;
        }
        members.push((name, g));
    }
    archive(&members)
}

/// What the entrypoint prints, run as the image's user in its directory with its variables.
pub const ENTRYPOINT_OUTPUT: &str =
    "hello from /app as 1000:1001, args: extra\nold: b\nash is a hard link\n";
