//! The `busybox` image: Debian's `busybox-static` and one symlink per applet.
//!
//! Made from a single package, without a chroot or root: `apt-get download`
//! fetches the package through the machine's apt configuration, `dpkg-deb -x`
//! unpacks it, and the tree is assembled by hand.

use crate::cmd::{self, run};
use crate::tree::{self, mkdir, write};
use crate::{BuildError, IoContext, PackageInput};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

const PACKAGE: &str = "busybox-static";

/// Debian's names and ids for root and the unprivileged user/group (gid 65534
/// is `nogroup` in Debian), so both images agree.
const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                      nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n";
const GROUP: &str = "root:x:0:\nnogroup:x:65534:\n";

/// Fills `root` with the busybox image's tree, using `work` for downloads.
pub(crate) fn populate(
    work: &Path,
    root: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<PackageInput>, BuildError> {
    let deb = download(work, progress)?;
    let input = package_input(&deb)?;
    progress(&format!("busybox: unpacking {input}"));
    let unpacked = work.join("pkg");
    run(
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked),
        &mut |_| {},
    )?;
    let busybox = unpacked.join("bin/busybox");

    // The applet list comes from the binary itself; the package is static, so
    // it runs on the host. --list-full gives each applet's canonical directory
    // (bin/sh, usr/bin/env, sbin/ip, ...).
    let list = run(Command::new(&busybox).arg("--list-full"), &mut |_| {})?;
    let list = String::from_utf8_lossy(&list);
    let applets = applet_paths(&list);

    tree::ensure_mount_points(root)?;
    mkdir(&root.join("bin"), 0o755)?;
    let target = root.join("bin/busybox");
    fs::copy(&busybox, &target).at(&target)?;
    fs::set_permissions(&target, fs::Permissions::from_mode(0o755)).at(&target)?;
    for applet in &applets {
        let link = root.join(applet);
        if let Some(parent) = link.parent() {
            if !parent.is_dir() {
                mkdir(parent, 0o755)?;
            }
        }
        std::os::unix::fs::symlink("/bin/busybox", &link).at(&link)?;
    }
    for required in ["bin/sh", "usr/bin/env"] {
        if !applets.iter().any(|a| a == required) {
            return Err(BuildError::Unexpected {
                what: format!("{} --list-full", busybox.display()),
                detail: format!("no `{required}` applet"),
            });
        }
    }
    progress(&format!("busybox: linked {} applets", applets.len()));

    // Keep the licence next to the binary, as Debian does.
    let doc = root.join("usr/share/doc").join(PACKAGE);
    mkdir(&doc, 0o755)?;
    let copyright = doc.join("copyright");
    fs::copy(
        unpacked
            .join("usr/share/doc")
            .join(PACKAGE)
            .join("copyright"),
        &copyright,
    )
    .at(&copyright)?;
    fs::set_permissions(&copyright, fs::Permissions::from_mode(0o644)).at(&copyright)?;

    let etc = root.join("etc");
    write(&etc.join("passwd"), PASSWD, 0o644)?;
    write(&etc.join("group"), GROUP, 0o644)?;
    write(&etc.join("hosts"), tree::HOSTS, 0o644)?;
    // Empty, so guest-init has a file to bind the guest's hostname over.
    write(&etc.join("hostname"), "", 0o644)?;
    // Empty, so guest-init has a file to bind-mount a generated one over.
    write(&etc.join("resolv.conf"), "", 0o644)?;
    Ok(vec![input])
}

/// `apt-get download busybox-static` into `work/dl`; returns the .deb's path.
fn download(work: &Path, progress: &mut dyn FnMut(&str)) -> Result<std::path::PathBuf, BuildError> {
    let dl = work.join("dl");
    mkdir(&dl, 0o755)?;
    progress(&format!("busybox: apt-get download {PACKAGE}"));
    let mut apt = Command::new("apt-get");
    apt.current_dir(&dl)
        // apt would drop to its `_apt` user, which cannot write into our private
        // directory, and then fall back to root with a warning: say so upfront.
        .args(["-o", "APT::Sandbox::User=root", "download", PACKAGE]);
    match run(&mut apt, &mut |_| {}) {
        Err(BuildError::Command { stderr_tail, .. })
            if stderr_tail.contains("Unable to locate package")
                || stderr_tail.contains("has no installation candidate") =>
        {
            return Err(BuildError::PackageUnavailable {
                package: PACKAGE.into(),
                stderr_tail,
            })
        }
        other => {
            other?;
        }
    }
    let mut debs = Vec::new();
    for entry in fs::read_dir(&dl).at(&dl)? {
        let path = entry.at(&dl)?.path();
        if path.extension().is_some_and(|e| e == "deb") {
            debs.push(path);
        }
    }
    match <[_; 1]>::try_from(debs) {
        Ok([deb]) => Ok(deb),
        Err(debs) => Err(BuildError::Unexpected {
            what: cmd::describe(&apt),
            detail: format!(
                "expected one .deb in {}, found {}",
                dl.display(),
                debs.len()
            ),
        }),
    }
}

/// Name and version from the .deb's control file.
fn package_input(deb: &Path) -> Result<PackageInput, BuildError> {
    let mut cmd = Command::new("dpkg-deb");
    cmd.arg("--showformat=${Package}\\t${Version}\\n")
        .arg("--show")
        .arg(deb);
    let out = run(&mut cmd, &mut |_| {})?;
    let out = String::from_utf8_lossy(&out);
    match out.trim_end().split_once('\t') {
        Some((name, version)) if !name.is_empty() && !version.is_empty() => Ok(PackageInput {
            name: name.to_string(),
            version: version.to_string(),
        }),
        _ => Err(BuildError::Unexpected {
            what: cmd::describe(&cmd),
            detail: format!("cannot parse {out:?}"),
        }),
    }
}

/// Applet paths relative to `/` from `busybox --list-full`, sorted, without
/// `bin/busybox` itself and without top-level entries such as `linuxrc`
/// (an initramfs init; krunbox has its own).
fn applet_paths(list: &str) -> Vec<String> {
    let mut paths: Vec<String> = list
        .lines()
        .map(|l| l.trim().trim_start_matches('/'))
        .filter(|l| l.contains('/') && *l != "bin/busybox")
        .filter(|l| l.split('/').all(|c| !c.is_empty() && c != "." && c != ".."))
        .map(str::to_string)
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applet_list_is_cleaned() {
        let list = "usr/bin/env\nlinuxrc\nbin/sh\nbin/busybox\n/sbin/ip\nbin/../etc\nbin/sh\n";
        assert_eq!(applet_paths(list), ["bin/sh", "sbin/ip", "usr/bin/env"]);
    }

    #[test]
    fn accounts_have_root_and_nobody() {
        assert!(PASSWD.lines().any(|l| l.starts_with("root:x:0:0:")));
        assert!(PASSWD
            .lines()
            .any(|l| l.starts_with("nobody:x:65534:65534:")));
        assert!(GROUP.lines().any(|l| l == "root:x:0:"));
        assert!(GROUP.lines().any(|l| l.ends_with(":65534:")));
    }
}
