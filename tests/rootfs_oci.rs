//! OCI images: a `docker save` archive and an OCI image layout, both built here from files this
//! test makes (busybox-static from the host, a script, a whiteout, an opaque directory, a hard
//! link, extended attributes), imported with `krunbox::image::oci::import` (the attributes
//! checked in the image's ext4 with `debugfs`) and booted; the image's entrypoint runs
//! with its environment, working directory and user. A tampered blob is refused before any VM.

mod common;
#[path = "common/oci.rs"]
mod oci;

use krunbox::image::oci::{build, import, ImageConfig};
use krunbox::{BuiltinImage, Error, Rootfs, Sandbox};
use oci::{boot_and_run_entrypoint, docker_save, oci_layout};

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
    // The entrypoint script's extended attributes reached the image's ext4.
    let listed = ext4_xattrs(&dir.path().join("image.qcow2"), "/app/run.sh");
    assert!(
        listed.contains("user.krunbox (8) = \"imported\""),
        "{listed}"
    );
    assert!(
        listed.contains("security.capability (20) = 01 00 00 02 00 20 00 00"),
        "{listed}"
    );
    boot_and_run_entrypoint(&image).await;
}

/// What `debugfs` (e2fsprogs) lists as `path`'s extended attributes in the ext4 of the qcow2
/// `image` (converted to a raw copy beside it with `qemu-img`).
fn ext4_xattrs(image: &std::path::Path, path: &str) -> String {
    let raw = image.with_extension("raw");
    let converted = std::process::Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(image)
        .arg(&raw)
        .status()
        .expect("qemu-img (Debian's qemu-utils; scripts/setup.sh installs it)");
    assert!(converted.success(), "qemu-img convert failed");
    let debugfs = ["/usr/sbin/debugfs", "/sbin/debugfs"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("debugfs (Debian's e2fsprogs; scripts/setup.sh installs it)");
    let listed = std::process::Command::new(debugfs)
        .args(["-R", &format!("ea_list {path}")])
        .arg(&raw)
        .output()
        .expect("debugfs runs");
    std::fs::remove_file(&raw).unwrap();
    String::from_utf8_lossy(&listed.stdout).into_owned()
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

/// `oci::build` runs its steps on a sandbox's image (as the image's user: root here) and makes
/// an image that boots alone with their changes and keeps the sandbox's image configuration.
#[test]
fn an_image_built_by_steps_keeps_their_changes_and_its_config() {
    common::run(async {
        let config = ImageConfig {
            entrypoint: vec!["/bin/sh".into(), "-c".into()],
            cmd: vec!["cat /etc/marker; ls /opt".into()],
            working_dir: Some("/etc".into()),
            ..Default::default()
        };
        let base = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .image_config(config.clone())
            .memory_mib(256)
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let image = build(
            &base,
            &[
                "echo \"built in $(pwd) as $(id -u)\" > /etc/marker",
                "mkdir -p /opt/tool && touch /opt/tool/bin",
            ],
            dir.path().join("built.qcow2"),
        )
        .await
        .expect("build");
        assert_eq!(image.config, config);
        let vm = oci::boot(&image).await;
        let out = vm.entrypoint().unwrap().output().await.unwrap();
        assert_eq!(
            out.stdout_text(),
            "built in /etc as 0\ntool\n",
            "{}",
            out.stderr_text()
        );
        vm.shutdown().await.unwrap();
    });
}

/// A step that fails stops the build with its exit status and output; no image is made.
#[test]
fn a_failing_build_step_stops_the_build_with_its_output() {
    common::run(async {
        let base = Sandbox::builder()
            .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
            .memory_mib(256)
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let output = dir.path().join("built.qcow2");
        let steps = [
            "true",
            "echo half done; echo broken >&2; exit 3",
            "touch /never",
        ];
        match build(&base, &steps, &output).await {
            Err(Error::BuildStep {
                step,
                status,
                output,
            }) => {
                assert_eq!(step, steps[1]);
                assert!(status.contains('3'), "{status}");
                assert_eq!(output, "half done\nbroken\n");
            }
            other => panic!("expected the step's failure, got {other:?}"),
        }
        assert!(!output.exists());
    });
}
