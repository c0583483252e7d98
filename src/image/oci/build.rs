//! [`build`]: a new image made by running setup steps on a sandbox's image, as `docker build`'s
//! `RUN` lines do: the steps run in one VM over a persistent layer, which is then flattened.

use std::path::Path;

use sha2::{Digest, Sha256};

use super::{ImageConfig, OciImage};
use crate::error::{Error, Result};
use crate::image::flatten;
use crate::rootfs::Rootfs;
use crate::Sandbox;

/// How much of a failed step's output its error keeps (the end of it).
const STEP_OUTPUT_TAIL: usize = 8 << 10;

/// Makes a new image at `output` (a qcow2, replaced if it exists): `sandbox`'s image with the
/// changes `steps` make. Each step is a shell command line (`sh -c STEP`), run in order in one
/// VM booted from `sandbox` (its network, mounts, memory and image configuration: a step runs
/// as the image's user, in its directory, with its variables, as a Dockerfile's `RUN` does),
/// over a writable layer that only this build uses. A step that exits non-zero stops the build
/// with [`Error::BuildStep`] and its output. The result boots on its own and keeps `sandbox`'s
/// image configuration; give [`SandboxBuilder::image_config`](crate::SandboxBuilder::image_config)
/// another one to change its entrypoint.
///
/// `sandbox`'s root must be an image ([`Rootfs::Builtin`] or [`Rootfs::Image`]); mounts are
/// not part of the result (only the root is). Steps have no deadline of their own: bound one
/// with `timeout` in the step itself (`timeout 600 make`) if it may hang.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::net::{Network, Rules};
/// use krunbox::{BuiltinImage, Rootfs, Sandbox};
///
/// let base = Sandbox::builder()
///     .rootfs(Rootfs::builtin(BuiltinImage::Agent))
///     .network(Network::with_policy(
///         Rules::new().allow_domain("deb.debian.org").expect("a valid pattern"),
///     ))
///     .build()?;
/// let image = krunbox::image::oci::build(
///     &base,
///     &["apt-get update", "apt-get install -y ripgrep"],
///     "/var/lib/a/tools.qcow2",
/// )
/// .await?;
/// // Every later sandbox starts with ripgrep, without a network.
/// let vm = Sandbox::builder().rootfs(image.rootfs()).build()?.boot().await?;
/// # let _ = vm; Ok(()) }
/// ```
pub async fn build(
    sandbox: &Sandbox,
    steps: &[impl AsRef<str>],
    output: impl AsRef<Path>,
) -> Result<OciImage> {
    let output = output.as_ref();
    let base = sandbox.rootfs().clone();
    if !matches!(base, Rootfs::Builtin(_) | Rootfs::Image { .. }) {
        return Err(Error::InvalidConfig(
            "an image build starts from an image root (Rootfs::builtin or Rootfs::image), not \
             a writable root: flatten that one first"
                .into(),
        ));
    }
    let work = tempfile::Builder::new()
        .prefix(".krunbox-build-")
        .tempdir_in(crate::rootfs::dir_of(output))
        .map_err(Error::io("making a working directory for the build"))?;
    let root = Rootfs::persistent(base, work.path().join("layer.qcow2"));
    let vm = sandbox.with_rootfs(root.clone()).boot().await?;
    for step in steps {
        let step = step.as_ref();
        let ran = vm.command("sh").args(["-c", step]).output().await;
        let failed = match ran {
            Ok(out) if out.status.success() => None,
            Ok(out) => {
                let mut text = out.stdout_text();
                text.push_str(&out.stderr_text());
                let cut = text.len().saturating_sub(STEP_OUTPUT_TAIL);
                let cut = (cut..=text.len())
                    .find(|&i| text.is_char_boundary(i))
                    .unwrap_or(text.len());
                Some(Error::BuildStep {
                    step: step.to_string(),
                    status: out.status.to_string(),
                    output: text[cut..].to_string(),
                })
            }
            Err(e) => Some(e),
        };
        if let Some(error) = failed {
            let _ = vm.shutdown().await;
            return Err(error);
        }
    }
    vm.shutdown().await?;
    let image = flatten(&root, output).await?;
    let config = sandbox.image_config().cloned().unwrap_or_default();
    let config_digest = config_digest(&config, &image.sha256);
    Ok(OciImage {
        image,
        config,
        config_digest,
    })
}

/// The digest of an OCI image config describing a built image: the config's fields, and the
/// image file's SHA-256 as its one layer (a filesystem image rather than a tar), so that two
/// builds with other steps have other identities.
fn config_digest(config: &ImageConfig, image_sha256: &str) -> String {
    let env: Vec<String> = config.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let document = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": config.entrypoint,
            "Cmd": config.cmd,
            "Env": env,
            "WorkingDir": config.working_dir.clone().unwrap_or_default(),
            "User": config.user.map(|(uid, gid)| format!("{uid}:{gid}")).unwrap_or_default(),
        },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{image_sha256}")] },
    });
    format!(
        "sha256:{}",
        hex::encode(Sha256::digest(document.to_string().as_bytes()))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_images_config_digest_follows_its_config() {
        let a = ImageConfig {
            cmd: vec!["sh".into()],
            ..Default::default()
        };
        let mut b = a.clone();
        let image = "a".repeat(64);
        assert_eq!(config_digest(&a, &image), config_digest(&b, &image));
        assert_ne!(
            config_digest(&a, &image),
            config_digest(&a, &"b".repeat(64))
        );
        b.user = Some((1000, 1000));
        assert_ne!(config_digest(&a, &image), config_digest(&b, &image));
        assert!(config_digest(&a, &image).starts_with("sha256:"));
    }

    #[tokio::test]
    async fn a_writable_root_is_refused_before_anything_boots() {
        let sandbox = Sandbox::builder()
            .rootfs(Rootfs::ephemeral(
                Rootfs::builtin(crate::BuiltinImage::Busybox),
                64 << 20,
            ))
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let steps: [&str; 0] = [];
        match build(&sandbox, &steps, dir.path().join("out.qcow2")).await {
            Err(Error::InvalidConfig(reason)) => assert!(reason.contains("image root")),
            other => panic!("{other:?}"),
        }
    }
}
