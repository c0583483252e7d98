//! `krunbox image ...`: pull, import, build, list and remove images kept by name.

use std::path::PathBuf;

use clap::Subcommand;
use krunbox::image::oci::{Credentials, PullOptions};
use krunbox::{BuiltinImage, Rootfs, Sandbox};

use crate::network::{network, NetworkArgs};

#[derive(Subcommand)]
pub(crate) enum ImageCmd {
    /// Make a `docker save` tarball or an OCI image layout (a directory or a tar) into an
    /// image called NAME, for `krunbox run --image NAME` (which runs the image's entrypoint
    /// when no command is given, with its environment, working directory and user).
    Import {
        /// The archive.
        archive: PathBuf,
        /// The name to keep it under (like `myapp:latest`).
        #[arg(long)]
        name: String,
    },
    /// Pull an image from a registry (REF like `registry.example.com/team/app:1`, or
    /// `name@sha256:…`; a bare `alpine` means Docker Hub's `library/alpine`) and keep it as
    /// NAME. Layers are checked against their digests and kept in a cache beside the images,
    /// so another image sharing them does not download them again.
    Pull {
        /// The image reference.
        reference: String,
        /// The name to keep it under (default: the reference's last path part and tag, like
        /// `app:1`).
        #[arg(long)]
        name: Option<String>,
        /// Log in as USER (with --password-stdin, or $KRUNBOX_REGISTRY_PASSWORD).
        #[arg(long, value_name = "USER")]
        username: Option<String>,
        /// Read the password (or access token) from the first line of stdin.
        #[arg(long, requires = "username")]
        password_stdin: bool,
        /// Talk to the registry over plain HTTP (a registry on loopback or a private network).
        #[arg(long)]
        plain_http: bool,
        /// Also trust the PEM certificates in FILE for the registry's HTTPS (a private CA).
        #[arg(long, value_name = "FILE")]
        ca_file: Option<PathBuf>,
    },
    /// Build an image called NAME from the image --from (built-in, or one of `image ls`) by
    /// running each --run step in it with `sh -c`, in order, in one VM (as a Dockerfile's RUN
    /// lines: as the image's user, in its directory). The result keeps --from's entrypoint
    /// and configuration. Network flags as for `run` (none: no network).
    ///
    /// Example: krunbox image build tools --from agent --allow-domain deb.debian.org
    /// --run 'apt-get update' --run 'apt-get install -y ripgrep'
    Build {
        /// The name to keep it under.
        name: String,
        /// The image to start from.
        #[arg(long, default_value = "agent")]
        from: String,
        /// A step (repeatable, at least one).
        #[arg(long = "run", value_name = "STEP", required = true)]
        steps: Vec<String>,
        /// Guest memory in MiB while building.
        #[arg(long, default_value_t = 1024)]
        memory: u32,
        #[command(flatten)]
        net: Box<NetworkArgs>,
    },
    /// List the built-in images, and the images kept by name (pulled ones with their
    /// reference).
    Ls,
    /// Remove an imported image.
    Rm {
        /// Its name.
        name: String,
    },
}

/// `krunbox image ...`.
pub(crate) async fn image(action: ImageCmd) -> Result<(), Box<dyn std::error::Error>> {
    let images = krunbox::image::oci::LocalImages::default_location();
    match action {
        ImageCmd::Import { archive, name } => {
            let spinner = indicatif::ProgressBar::new_spinner().with_message(format!(
                "importing {} as {name} (checking digests, merging layers, building the image in a VM)",
                archive.display()
            ));
            spinner.enable_steady_tick(std::time::Duration::from_millis(120));
            let imported = images.import(&name, &archive).await;
            spinner.finish_and_clear();
            let image = imported?;
            println!(
                "{name}: {} (sha256 {}, config {})",
                image.image.path.display(),
                image.image.sha256,
                image.config_digest
            );
        }
        ImageCmd::Pull {
            reference,
            name,
            username,
            password_stdin,
            plain_http,
            ca_file,
        } => {
            let name = match name {
                Some(name) => name,
                None => default_image_name(&reference)?,
            };
            let mut options = PullOptions::new().plain_http(plain_http);
            if let Some(username) = username {
                let password = if password_stdin {
                    let mut line = String::new();
                    std::io::stdin().read_line(&mut line)?;
                    let password = line.trim_end_matches(['\r', '\n']).to_string();
                    if password.is_empty() {
                        return Err("--password-stdin read no password".into());
                    }
                    password
                } else {
                    std::env::var("KRUNBOX_REGISTRY_PASSWORD").map_err(|_| {
                        "--username needs --password-stdin or $KRUNBOX_REGISTRY_PASSWORD"
                    })?
                };
                options = options.credentials(Credentials::Basic { username, password });
            }
            if let Some(file) = ca_file {
                let pem = std::fs::read(&file)
                    .map_err(|e| format!("reading --ca-file {}: {e}", file.display()))?;
                options = options.root_certificate_pem(pem);
            }
            // One pull (one manifest: what is downloaded is what is kept), a bar per layer as it
            // downloads, and a spinner line for the whole, which goes on while a VM builds.
            let bars = indicatif::MultiProgress::new();
            let spinner = bars.add(indicatif::ProgressBar::new_spinner().with_message(format!(
                "pulling {reference} as {name} (downloading layers, then building in a VM)"
            )));
            spinner.enable_steady_tick(std::time::Duration::from_millis(120));
            let style = indicatif::ProgressStyle::with_template(
                "{msg:19} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
            )
            .expect("a valid template")
            .progress_chars("=> ");
            let by_layer = std::sync::Mutex::new(std::collections::HashMap::new());
            let options = options.on_progress({
                let bars = bars.clone();
                move |p| {
                    let mut by_layer = by_layer.lock().expect("not poisoned");
                    let bar = by_layer.entry(p.digest.clone()).or_insert_with(|| {
                        let bar = bars.add(indicatif::ProgressBar::new(p.size));
                        bar.set_style(style.clone());
                        bar.set_message(p.digest.chars().take(19).collect::<String>());
                        bar
                    });
                    bar.set_position(p.received);
                }
            });
            let pulled = images.pull(&name, &reference, &options).await;
            spinner.finish_and_clear();
            bars.clear()?;
            let pulled = pulled?;
            let fetched = &pulled.fetched;
            eprintln!(
                "{reference}: {} layers, {} downloaded ({} MiB), {} cached",
                fetched.layers.len(),
                fetched.layers_fetched,
                fetched.bytes_fetched >> 20,
                fetched.layers_cached
            );
            let image = pulled.image;
            println!(
                "{name}: {} (sha256 {}, config {})",
                image.image.path.display(),
                image.image.sha256,
                image.config_digest
            );
        }
        ImageCmd::Build {
            name,
            from,
            steps,
            memory,
            net,
        } => {
            let mut sandbox = Sandbox::builder().memory_mib(memory);
            if let Ok(builtin) = from.parse::<BuiltinImage>() {
                sandbox = sandbox.rootfs(Rootfs::builtin(builtin));
            } else {
                let base = images.get(&from)?.ok_or_else(|| {
                    format!("--from {from}: neither a built-in image nor one of `image ls`")
                })?;
                sandbox = sandbox.rootfs(base.rootfs()).image_config(base.config);
            }
            if let Some(network) = network(&net)? {
                sandbox = sandbox.network(network);
            }
            let spinner = indicatif::ProgressBar::new_spinner().with_message(format!(
                "building {name} from {from}: {} step(s) in a VM, then flattening",
                steps.len()
            ));
            spinner.enable_steady_tick(std::time::Duration::from_millis(120));
            let built = images.build(&name, &sandbox.build()?, &steps).await;
            spinner.finish_and_clear();
            let image = built?;
            println!(
                "{name}: {} (sha256 {})",
                image.image.path.display(),
                image.image.sha256
            );
        }
        ImageCmd::Ls => {
            let cache = krunbox::cache_dir();
            for builtin in [BuiltinImage::Busybox, BuiltinImage::Agent] {
                let state = match krunbox_rootfs::load(&cache, builtin) {
                    Ok(Some(manifest)) => format!("built, sha256 {}", manifest.sha256),
                    Ok(None) => "not built yet (built on first use)".to_string(),
                    Err(e) => format!("unreadable: {e}"),
                };
                println!("{:<24} built-in  {state}", builtin.name());
            }
            for (name, image) in images.list()? {
                let size = std::fs::metadata(&image.image.path)
                    .map(|m| format!("{} MiB", m.len() >> 20))
                    .unwrap_or_else(|_| "missing".into());
                let origin = match images.pulled_reference(&name)? {
                    Some(reference) => format!("pulled    from {reference}, "),
                    None => "local     ".to_string(),
                };
                println!(
                    "{name:<24} {origin}sha256 {}, {size}, config {}",
                    image.image.sha256, image.config_digest
                );
            }
        }
        ImageCmd::Rm { name } => {
            if !images.remove(&name)? {
                return Err(format!("there is no imported image called {name}").into());
            }
        }
    }
    Ok(())
}

/// The name `image pull` keeps REF under by default: its last path part and its tag (`app:1`
/// for `registry.example.com/team/app:1`), `latest` without one.
pub(crate) fn default_image_name(reference: &str) -> Result<String, String> {
    let without_digest = reference.split('@').next().unwrap_or(reference);
    let last = without_digest.rsplit('/').next().unwrap_or(without_digest);
    let name = if last.contains(':') {
        last.to_string()
    } else {
        format!("{last}:latest")
    };
    if name.starts_with(':') || name.starts_with('.') {
        return Err(format!(
            "cannot name an image after `{reference}`: give --name"
        ));
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pulled_images_are_named_after_their_last_path_part_and_tag() {
        assert_eq!(
            default_image_name("registry.example.com:5000/team/app:1").unwrap(),
            "app:1"
        );
        assert_eq!(default_image_name("alpine").unwrap(), "alpine:latest");
        assert_eq!(
            default_image_name("ghcr.io/a/tools@sha256:abc").unwrap(),
            "tools:latest"
        );
        assert!(default_image_name("host/:tag").is_err());
    }
}
