//! `krunbox-rootfs`: build, check and locate krunbox's built-in guest root images.
//!
//! ```text
//! krunbox-rootfs build busybox|agent|all [--cache-dir DIR] [--force]
//! krunbox-rootfs verify busybox|agent [--cache-dir DIR]
//! krunbox-rootfs path busybox|agent [--cache-dir DIR]
//! ```
//!
//! Progress goes to stderr; results (`<sha256>  <path>`, or the path) to stdout.

use krunbox_rootfs::{BuiltinImage, ImageManifest};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

const USAGE: &str = "\
usage: krunbox-rootfs build busybox|agent|all [--cache-dir DIR] [--force]
       krunbox-rootfs verify busybox|agent|all [--cache-dir DIR]
       krunbox-rootfs path busybox|agent [--cache-dir DIR]

Builds krunbox's built-in read-only guest root images (erofs) from Debian
packages into DIR/images/ (default: $KRUNBOX_CACHE_DIR, $XDG_CACHE_HOME/krunbox
or ~/.cache/krunbox). Needs: apt-get install erofs-utils mmdebstrap busybox-static";

struct Args {
    command: String,
    images: Vec<BuiltinImage>,
    cache_dir: PathBuf,
    force: bool,
}

fn parse(mut argv: impl Iterator<Item = String>) -> Result<Args, String> {
    let command = argv.next().ok_or("missing command")?;
    if !matches!(command.as_str(), "build" | "verify" | "path") {
        return Err(format!("unknown command `{command}`"));
    }
    let (mut name, mut cache_dir, mut force) = (None, None, false);
    while let Some(arg) = argv.next() {
        match arg.as_str() {
            "--force" if command == "build" => force = true,
            "--cache-dir" => cache_dir = Some(argv.next().ok_or("--cache-dir needs a value")?),
            _ if arg.starts_with("--cache-dir=") => {
                cache_dir = Some(arg["--cache-dir=".len()..].to_string())
            }
            _ if arg.starts_with('-') => return Err(format!("unknown option `{arg}`")),
            _ if name.is_none() => name = Some(arg),
            _ => return Err(format!("unexpected argument `{arg}`")),
        }
    }
    let name = name.ok_or("missing image name")?;
    let images = if name == "all" && command != "path" {
        BuiltinImage::ALL.to_vec()
    } else {
        vec![name.parse::<BuiltinImage>().map_err(|e| e.to_string())?]
    };
    Ok(Args {
        command,
        images,
        cache_dir: cache_dir.map_or_else(krunbox_rootfs::default_cache_dir, PathBuf::from),
        force,
    })
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let args = match parse(argv.into_iter()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("krunbox-rootfs: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut ok = true;
    for image in args.images {
        let result = match args.command.as_str() {
            "build" => build(&args.cache_dir, image, args.force),
            "verify" => krunbox_rootfs::verify(&args.cache_dir, image)
                .map(|m| print_result(&args.cache_dir, &m, image))
                .map_err(|e| e.to_string()),
            _ => path(&args.cache_dir, image),
        };
        if let Err(e) = result {
            eprintln!("krunbox-rootfs: {e}");
            ok = false;
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn build(cache_dir: &std::path::Path, image: BuiltinImage, force: bool) -> Result<(), String> {
    let start = Instant::now();
    let mut progress = |line: &str| {
        eprintln!("[{:6.1}s] {line}", start.elapsed().as_secs_f64());
    };
    let manifest = if force {
        krunbox_rootfs::rebuild(cache_dir, image, &mut progress)
    } else {
        krunbox_rootfs::build(cache_dir, image, &mut progress)
    }
    .map_err(|e| e.to_string())?;
    print_result(cache_dir, &manifest, image);
    Ok(())
}

fn path(cache_dir: &std::path::Path, image: BuiltinImage) -> Result<(), String> {
    println!("{}", krunbox_rootfs::image_path(cache_dir, image).display());
    match krunbox_rootfs::load(cache_dir, image) {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(format!(
            "image `{image}` is not built; run `krunbox-rootfs build {image}`"
        )),
        Err(e) => Err(e.to_string()),
    }
}

/// `<sha256>  <path>`, the format `sha256sum --check` reads.
fn print_result(cache_dir: &std::path::Path, manifest: &ImageManifest, image: BuiltinImage) {
    println!(
        "{}  {}",
        manifest.sha256,
        krunbox_rootfs::image_path(cache_dir, image).display()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Result<Args, String> {
        parse(s.split_whitespace().map(str::to_string))
    }

    #[test]
    fn parses_commands() {
        let a = args("build agent --cache-dir /c --force").unwrap();
        assert_eq!(
            (a.command.as_str(), a.images, a.cache_dir, a.force),
            (
                "build",
                vec![BuiltinImage::Agent],
                PathBuf::from("/c"),
                true
            )
        );
        assert_eq!(args("build all").unwrap().images, BuiltinImage::ALL);
        assert_eq!(
            args("path busybox --cache-dir=/x").unwrap().cache_dir,
            PathBuf::from("/x")
        );
        assert!(args("path all").is_err());
        assert!(args("verify busybox --force").is_err());
        assert!(args("build").is_err());
        assert!(args("frob busybox").is_err());
        assert!(args("build ubuntu").is_err());
    }
}
