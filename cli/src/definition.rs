//! What a sandbox is made of, as flags: the image and its root, resources, host directories,
//! the network. `krunbox run` and `krunbox mcp` take the same ones.

use std::path::{Path, PathBuf};

use krunbox::fs::{HostDir, MemoryFs, MountOptions};
use krunbox::image::oci::{Credentials, ImageConfig, LocalImages, PullOptions};
use krunbox::{BuiltinImage, Rootfs, Sandbox};

use crate::image::default_image_name;
use crate::network::{network, NetworkArgs};

#[derive(clap::Args)]
pub(crate) struct DefinitionArgs {
    /// Built-in image (`busybox`, `agent`), an image's name (`krunbox image ls`), a path to an
    /// image file (with --image-sha256), or a registry reference starting with its host
    /// (`registry.example.com/team/app:1`), pulled on first use (as `image pull` would name it;
    /// with $KRUNBOX_REGISTRY_USERNAME and $KRUNBOX_REGISTRY_PASSWORD if set).
    #[arg(long, default_value = "agent")]
    image: String,
    /// Pull --image's registry reference over plain HTTP (a registry on loopback or a private
    /// network).
    #[arg(long)]
    plain_http: bool,
    /// SHA-256 the image file must have (required with an image path).
    #[arg(long)]
    image_sha256: Option<String>,
    /// Filesystem type of an image file.
    #[arg(long, default_value = "erofs")]
    image_fstype: String,
    /// Make the root writable for this run: changes live in at most SIZE of host memory
    /// (`512M`, `2G`; at least 16M) and are gone when the command ends. A guest that fills it
    /// gets "no space left on device". Without it the root is read-only.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, conflicts_with_all = ["persist", "store"])]
    ephemeral: Option<u64>,
    /// Make the root writable and keep its changes in the qcow2 file PATH between runs (made
    /// on first use, bound to the image it was made over; one run at a time).
    #[arg(long, value_name = "PATH", conflicts_with = "store")]
    pub(crate) persist: Option<PathBuf>,
    /// Make the root writable and keep its changes, block by block, in a block store in the
    /// directory DIR between runs (made on first use, bound to the image it was made over; one
    /// run at a time). What the command syncs is in DIR when its sync returns; everything is
    /// when the run ends.
    #[arg(long, value_name = "DIR")]
    pub(crate) store: Option<PathBuf>,
    /// With --store: the most changes held in host memory before they go to the store.
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "64M", requires = "store")]
    max_dirty: u64,
    /// vCPUs.
    #[arg(long, default_value_t = 1)]
    cpus: u8,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 512)]
    memory: u32,
    /// The guest's hostname (set, and resolvable in the guest through its /etc/hosts).
    #[arg(long, value_name = "NAME")]
    hostname: Option<String>,
    #[command(flatten)]
    pub(crate) net: NetworkArgs,
    /// Mount the host directory HOST_DIR at GUEST_PATH in the guest (created if missing),
    /// read-write, or read-only with `:ro`. The guest cannot reach anything outside HOST_DIR,
    /// through `..`, symlinks or hard links. Example: --mount ./project:/workspace. Repeatable.
    #[arg(long, value_name = "HOST_DIR:GUEST_PATH[:ro]", value_parser = parse_mount)]
    pub(crate) mount: Vec<HostMount>,
    /// Mount an empty in-memory filesystem at GUEST_PATH (gone when the command ends).
    /// Repeatable.
    #[arg(long, value_name = "GUEST_PATH")]
    pub(crate) memfs: Vec<String>,
}

/// The sandbox the flags define (an image named by reference is pulled first).
pub(crate) async fn sandbox(args: &DefinitionArgs) -> Result<Sandbox, Box<dyn std::error::Error>> {
    sandbox_with(args, None).await
}

/// [`sandbox`], its instances snapshottable with the key in `snapshot_key_dir` when given.
pub(crate) async fn sandbox_with(
    args: &DefinitionArgs,
    snapshot_key_dir: Option<&std::path::Path>,
) -> Result<Sandbox, Box<dyn std::error::Error>> {
    let (image, config) = image_of(args).await?;
    let mut sandbox = Sandbox::builder()
        .rootfs(root(args, image)?)
        .cpus(args.cpus)
        .memory_mib(args.memory);
    if let Some(hostname) = &args.hostname {
        sandbox = sandbox.hostname(hostname);
    }
    if let Some(config) = config {
        sandbox = sandbox.image_config(config);
    }
    if let Some(network) = network(&args.net)? {
        sandbox = sandbox.network(network);
    }
    for mount in &args.mount {
        let dir = if mount.read_only {
            HostDir::read_only(&mount.host_dir)
        } else {
            HostDir::new(&mount.host_dir)
        }
        .map_err(|e| format!("--mount {}: {e}", mount.host_dir.display()))?;
        let mut options = MountOptions::new();
        if mount.read_only {
            options = options.read_only();
        }
        sandbox = sandbox.mount_with(mount.guest_path.clone(), dir, options);
    }
    for path in &args.memfs {
        sandbox = sandbox.mount(path.clone(), MemoryFs::new());
    }
    if let Some(dir) = snapshot_key_dir {
        sandbox = sandbox.snapshots(true).snapshot_key_dir(dir);
    }
    Ok(sandbox.build()?)
}

/// The image `--image` names, and its configuration if it has one: a built-in image, an image
/// of `image ls` by name, an image file (with --image-sha256), or a registry reference (its
/// first part a host: `registry.example.com/team/app:1`, `localhost:5000/app`), pulled the
/// first time and run from the local copy after.
async fn image_of(args: &DefinitionArgs) -> Result<(Rootfs, Option<ImageConfig>), String> {
    if let Ok(image) = args.image.parse::<BuiltinImage>() {
        return Ok((Rootfs::builtin(image), None));
    }
    if let Some(sha) = &args.image_sha256 {
        return Ok((Rootfs::image(&args.image, &args.image_fstype, sha), None));
    }
    let images = LocalImages::default_location();
    let found = if args.image.contains('/') {
        images
            .pulled_from(&args.image)
            .map(|f| f.map(|(_, image)| image))
    } else {
        images.get(&args.image)
    };
    match found {
        Ok(Some(image)) => return Ok((image.rootfs(), Some(image.config))),
        Ok(None) | Err(krunbox::Error::InvalidConfig(_)) => {}
        Err(e) => return Err(e.to_string()),
    }
    if !names_a_registry(&args.image) {
        return Err(format!(
            "`{}` is not a built-in image (busybox, agent), an image of `krunbox image ls`, or \
             a registry reference (like registry.example.com/team/app:1); an image file needs \
             --image-sha256",
            args.image
        ));
    }
    let name = default_image_name(&args.image)?;
    let mut options = PullOptions::new().plain_http(args.plain_http);
    if let (Ok(username), Ok(password)) = (
        std::env::var("KRUNBOX_REGISTRY_USERNAME"),
        std::env::var("KRUNBOX_REGISTRY_PASSWORD"),
    ) {
        options = options.credentials(Credentials::Basic { username, password });
    }
    let spinner = indicatif::ProgressBar::new_spinner()
        .with_message(format!("pulling {} as {name}", args.image));
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let pulled = images.pull(&name, &args.image, &options).await;
    spinner.finish_and_clear();
    let image = pulled.map_err(|e| e.to_string())?.image;
    eprintln!("krunbox: pulled {} as {name}", args.image);
    Ok((image.rootfs(), Some(image.config)))
}

/// Whether `reference` starts with a registry host (a name with a dot or a port, or
/// `localhost`), as `docker` tells a registry from a Docker Hub user. A bare name never goes
/// to a registry by itself.
fn names_a_registry(reference: &str) -> bool {
    match reference.split_once('/') {
        Some((host, rest)) => {
            !rest.is_empty()
                && (host.contains('.') || host.contains(':') || host == "localhost")
                && !Path::new(reference).exists()
        }
        None => false,
    }
}

/// `--image` with `--ephemeral`, `--persist` or `--store`: the image, writable if asked.
fn root(args: &DefinitionArgs, image: Rootfs) -> Result<Rootfs, String> {
    Ok(match (args.ephemeral, &args.persist, &args.store) {
        (Some(bytes), _, _) => Rootfs::ephemeral(image, bytes),
        (None, Some(path), _) => Rootfs::persistent(image, path),
        (None, None, Some(dir)) => {
            let store = krunbox::rootfs::DirectoryStore::open(dir).map_err(|e| e.to_string())?;
            Rootfs::cow(image, store, args.max_dirty)
        }
        (None, None, None) => image,
    })
}

/// A size: bytes, or a number with `K`, `M`, `G` or `T` (powers of 1024).
fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last() {
        Some((at, unit)) if unit.is_ascii_alphabetic() => {
            let shift = match unit.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("`{text}`: the unit must be K, M, G or T")),
            };
            (&text[..at], shift)
        }
        _ => (text, 0),
    };
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a size (examples: 512M, 2G)"))?;
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("`{text}` is too large"))
}

/// A `--mount` flag's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostMount {
    host_dir: PathBuf,
    pub(crate) guest_path: String,
    read_only: bool,
}

/// `--mount HOST_DIR:GUEST_PATH[:ro]`.
fn parse_mount(value: &str) -> Result<HostMount, String> {
    let (rest, read_only) = match value.strip_suffix(":ro") {
        Some(rest) => (rest, true),
        None => (value, false),
    };
    let Some((host_dir, guest_path)) = rest.rsplit_once(':') else {
        return Err(format!(
            "{value:?} must look like HOST_DIR:GUEST_PATH or HOST_DIR:GUEST_PATH:ro"
        ));
    };
    if host_dir.is_empty() || !guest_path.starts_with('/') {
        return Err(format!(
            "{value:?}: the host directory must be named and the guest path absolute"
        ));
    }
    Ok(HostMount {
        host_dir: host_dir.into(),
        guest_path: guest_path.into(),
        read_only,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{args, refused};

    #[test]
    fn only_references_that_start_with_a_host_go_to_a_registry() {
        assert!(names_a_registry("registry.example.com/team/app:1"));
        assert!(names_a_registry("127.0.0.1:5000/public/app:1"));
        assert!(names_a_registry("localhost/app"));
        // A bare name, a Docker Hub user's image, a file: never pulled by themselves.
        assert!(!names_a_registry("alpine:3"));
        assert!(!names_a_registry("library/alpine"));
        assert!(!names_a_registry("no-such-image"));
        assert!(!names_a_registry("host.example/"));
    }

    #[test]
    fn ephemeral_takes_a_size_with_a_unit() {
        assert_eq!(
            args(&["--ephemeral", "512M"]).unwrap().sandbox.ephemeral,
            Some(512 << 20)
        );
        assert_eq!(
            args(&["--ephemeral", "2g"]).unwrap().sandbox.ephemeral,
            Some(2 << 30)
        );
        assert_eq!(
            args(&["--ephemeral", "65536"]).unwrap().sandbox.ephemeral,
            Some(65536)
        );
        assert_eq!(args(&[]).unwrap().sandbox.ephemeral, None);
        let persist = args(&["--persist", "/var/lib/x/root.qcow2"])
            .unwrap()
            .sandbox
            .persist;
        assert_eq!(persist, Some(PathBuf::from("/var/lib/x/root.qcow2")));
        let both = refused(&["--ephemeral", "1G", "--persist", "x.qcow2"]);
        assert!(both.contains("cannot be used with"), "{both}");
        let both = refused(&["--persist", "x.qcow2", "--store", "blocks"]);
        assert!(both.contains("cannot be used with"), "{both}");
        let alone = refused(&["--max-dirty", "64M"]);
        assert!(alone.contains("--store"), "{alone}");
        let store = args(&["--store", "/var/lib/x/blocks", "--max-dirty", "32M"]).unwrap();
        assert_eq!(
            store.sandbox.store,
            Some(PathBuf::from("/var/lib/x/blocks"))
        );
        assert_eq!(store.sandbox.max_dirty, 32 << 20);
        for bad in ["", "M", "12Q", "1.5G", "99999999999T"] {
            let message = refused(&["--ephemeral", bad]);
            assert!(
                message.contains("size") || message.contains("unit") || message.contains("large"),
                "{bad}: {message}"
            );
        }
    }

    #[test]
    fn mount_and_memfs_parse_and_bad_values_are_usage_errors() {
        let parsed = args(&[
            "--mount",
            "./project:/workspace",
            "--mount",
            "/srv/data:/data:ro",
            "--memfs",
            "/scratch",
        ])
        .unwrap();
        assert_eq!(
            parsed.sandbox.mount,
            [
                HostMount {
                    host_dir: "./project".into(),
                    guest_path: "/workspace".into(),
                    read_only: false,
                },
                HostMount {
                    host_dir: "/srv/data".into(),
                    guest_path: "/data".into(),
                    read_only: true,
                },
            ]
        );
        assert_eq!(parsed.sandbox.memfs, ["/scratch"]);
        for bad in ["/srv/data", ":/data", "/srv/data:data", "/srv/data:ro"] {
            let message = refused(&["--mount", bad]);
            assert!(message.contains("GUEST_PATH"), "{bad}: {message}");
        }
    }
}
