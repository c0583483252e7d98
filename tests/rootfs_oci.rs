//! OCI images: a `docker save` archive and an OCI image layout, both built here from files this
//! test makes (busybox-static from the host, a script, a whiteout, an opaque directory, a hard
//! link), imported with `krunbox::rootfs::oci::import` and booted; the image's entrypoint runs
//! with its environment, working directory and user. A tampered blob is refused before any VM.

mod common;

use std::io::Write;

use flate2::write::GzEncoder;
use sha2::{Digest, Sha256};

use krunbox::rootfs::oci::{import, ImageConfig};
use krunbox::{Error, Sandbox};

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
fn docker_save() -> Vec<u8> {
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
fn oci_layout(tamper: bool) -> Vec<u8> {
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

/// Imports `archive_bytes`, boots the image with its configuration, runs the entrypoint.
async fn import_and_run(archive_bytes: Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("image.tar");
    std::fs::write(&archive, archive_bytes).unwrap();
    let image = import(&archive, dir.path().join("image.qcow2"))
        .await
        .expect("import");
    assert_eq!(
        image.config,
        ImageConfig {
            entrypoint: vec!["/bin/sh".into(), "/app/run.sh".into()],
            cmd: vec!["extra".into()],
            env: vec![
                ("GREETING".into(), "hello".into()),
                ("PATH".into(), "/bin".into())
            ],
            working_dir: Some("/app".into()),
            user: Some((1000, 1001)),
        }
    );
    let vm = Sandbox::builder()
        .rootfs(image.rootfs())
        .image_config(image.config.clone())
        .memory_mib(256)
        .build()
        .unwrap()
        .boot()
        .await
        .expect("boot the imported image");
    let out = vm
        .entrypoint()
        .expect("the image has an entrypoint")
        .output()
        .await
        .expect("run the entrypoint");
    assert!(
        out.status.success(),
        "{}{}",
        out.stdout_text(),
        out.stderr_text()
    );
    assert_eq!(
        out.stdout_text(),
        "hello from /app as 1000:1001, args: extra\nold: b\nash is a hard link\n",
        "{}",
        out.stderr_text()
    );
    vm.shutdown().await.expect("shutdown");
}

#[test]
fn a_docker_save_archive_imports_boots_and_runs_its_entrypoint() {
    common::run(import_and_run(docker_save()));
}

#[test]
fn an_oci_image_layout_imports_boots_and_runs_its_entrypoint() {
    common::run(import_and_run(oci_layout(false)));
}

/// A layer whose bytes do not match the digest the manifest gives is refused before anything
/// boots.
#[test]
fn a_tampered_layer_is_refused() {
    common::run(async {
        let bytes = oci_layout(true);
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("image.tar");
        std::fs::write(&archive, bytes).unwrap();
        match import(&archive, dir.path().join("image.qcow2")).await {
            Err(Error::ImageArchive { reason, .. }) => {
                assert!(reason.contains("digest"), "{reason}")
            }
            other => panic!("expected the tampered layer refused, got {other:?}"),
        }
        assert!(!dir.path().join("image.qcow2").exists());
    });
}
