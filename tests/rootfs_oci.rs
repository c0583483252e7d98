//! OCI images: a `docker save` archive and an OCI image layout, both built here from files this
//! test makes (busybox-static from the host, a script, a whiteout, an opaque directory, a hard
//! link), imported with `krunbox::rootfs::oci::import` and booted; the image's entrypoint runs
//! with its environment, working directory and user. A tampered blob is refused before any VM.

mod common;
#[path = "common/oci.rs"]
mod oci;

use krunbox::rootfs::oci::{import, ImageConfig};
use krunbox::{Error, Sandbox};
use oci::{docker_save, oci_layout, ENTRYPOINT_OUTPUT};

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
        ENTRYPOINT_OUTPUT,
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
