//! The `agent` image: Debian bookworm minbase with python3 (and pip), curl,
//! git, ca-certificates and procps, made by `mmdebstrap`.
//!
//! Why mmdebstrap: it is Debian's own tool for making a Debian root tree, it
//! resolves and installs packages with apt and dpkg exactly as a Debian system
//! would (maintainer scripts included), needs nothing but the Debian archive,
//! and its output is reproducible when `SOURCE_DATE_EPOCH` is set.
//!
//! Why `--mode=root --skip=chroot/mount`: root mode only needs chroot(2),
//! mknod(2) and file ownership, which a container has by default (Docker's
//! default capability set). The other modes need more: `unshare` needs a new
//! mount namespace (CAP_SYS_ADMIN or user namespaces, which container seccomp
//! profiles usually block), `fakechroot` breaks maintainer scripts that escape
//! LD_PRELOAD, and `chrootless` is not supported by all packages. Root mode
//! would also mount /proc, /sys and bind-mount /dev into the tree, which needs
//! CAP_SYS_ADMIN; none of the packages here needs them while installing, so
//! they are skipped. That also means no host mount can ever be left inside the
//! build tree, which is deleted recursively afterwards.

use crate::cmd::{self, run};
use crate::erofs::SOURCE_DATE_EPOCH;
use crate::tree::{self, write};
use crate::{BuildError, IoContext, PackageInput};
use std::fs;
use std::path::Path;
use std::process::Command;

/// The Debian release the agent image is made from.
const SUITE: &str = "bookworm";

/// Packages on top of minbase (Essential and Priority: required). pip is what
/// agents install Python packages with (into a venv, or with
/// `--break-system-packages`: Debian marks its Python externally managed).
const INCLUDE: &str = "python3,python3-pip,curl,git,ca-certificates,procps,nodejs,npm,gh";

/// The packages the image is asked for: a cached image whose manifest lacks
/// one was made from an older recipe and is rebuilt.
pub(crate) fn requested_packages() -> impl Iterator<Item = &'static str> {
    INCLUDE.split(',')
}

/// Paths dpkg does not install (later path-include wins): documentation except
/// the copyright files, manual and info pages, translations except English,
/// lintian overrides. Filtering at install time keeps dpkg's database
/// consistent, and dpkg keeps honouring the filter (it is written to the
/// image's /etc/dpkg/dpkg.cfg.d/99mmdebstrap).
const DPKG_FILTERS: &[&str] = &[
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/en*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/lintian/*",
];

/// Host apt settings that mmdebstrap's own apt configuration must share to
/// reach the archive the way the machine's apt does (it does not read
/// /etc/apt/apt.conf.d).
const APT_OPTIONS_FROM_HOST: &[&str] = &[
    "Acquire::Check-Valid-Until",
    "Acquire::Check-Date",
    "Acquire::http::Proxy",
    "Acquire::https::Proxy",
];

/// Fills `root` (which must not exist yet) with the agent image's tree.
pub(crate) fn populate(
    root: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<PackageInput>, BuildError> {
    let sources = debian_sources()?;
    for source in &sources {
        progress(&format!("agent: using Debian archive `{source}`"));
    }

    let mut mm = Command::new("mmdebstrap");
    mm.args(["--mode=root", "--variant=minbase", "--skip=chroot/mount"])
        .arg(format!("--include={INCLUDE}"));
    for filter in DPKG_FILTERS {
        mm.arg(format!("--dpkgopt={filter}"));
    }
    // No fsync per unpacked file: the tree is scratch, only the finished image
    // is kept (and synced). Roughly halves install time on slow disks.
    mm.arg("--dpkgopt=force-unsafe-io");
    for option in host_apt_options()? {
        mm.arg(format!("--aptopt={option}"));
    }
    mm.arg(SUITE).arg(root).args(&sources);
    // A clean environment: nothing from the caller leaks into maintainer
    // scripts. SOURCE_DATE_EPOCH makes mmdebstrap clamp timestamps and drop
    // its non-reproducible files (logs, ldconfig aux cache, machine-id).
    mm.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("LC_ALL", "C")
        .env("SOURCE_DATE_EPOCH", SOURCE_DATE_EPOCH.to_string());
    for proxy in ["http_proxy", "https_proxy", "no_proxy"] {
        if let Some(value) = std::env::var_os(proxy) {
            mm.env(proxy, value);
        }
    }
    progress(&format!("agent: {}", cmd::describe(&mm)));
    let mut last = String::new();
    run(&mut mm, &mut |line| {
        // Forward mmdebstrap's step lines, once each.
        if !line.is_empty() && line != last {
            progress(&format!("agent: mmdebstrap: {line}"));
            last = line.to_string();
        }
    })?;

    strip(root, progress)?;
    let inputs = installed_packages(root)?;
    progress(&format!("agent: {} packages installed", inputs.len()));
    Ok(inputs)
}

/// The archive lines for mmdebstrap, taken from the machine's apt sources:
/// the Debian archive's URI for `SUITE`, plus `SUITE-updates` and
/// `SUITE-security` if the machine uses those suites too.
fn debian_sources() -> Result<Vec<String>, BuildError> {
    let mut cmd = Command::new("apt-get");
    cmd.args([
        "indextargets",
        "--format",
        "$(REPO_URI)\t$(RELEASE)\t$(ORIGIN)",
    ]);
    let out = run(&mut cmd, &mut |_| {})?;
    sources_from_indextargets(&String::from_utf8_lossy(&out)).ok_or(BuildError::NoDebianMirror)
}

fn sources_from_indextargets(indextargets: &str) -> Option<Vec<String>> {
    let (mut main, mut updates, mut security) = (None, None, None);
    for line in indextargets.lines() {
        let mut fields = line.split('\t');
        let (Some(uri), Some(release), Some("Debian")) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let slot = if release.ends_with("-security") {
            &mut security
        } else if release.ends_with("-updates") && !release.ends_with("-proposed-updates") {
            &mut updates
        } else if release.contains('-') {
            continue; // backports, proposed-updates, ...
        } else {
            &mut main
        };
        slot.get_or_insert(uri);
    }
    let main = main?;
    let mut sources = vec![format!("deb {main} {SUITE} main")];
    if let Some(uri) = updates {
        sources.push(format!("deb {uri} {SUITE}-updates main"));
    }
    if let Some(uri) = security {
        sources.push(format!("deb {uri} {SUITE}-security main"));
    }
    Some(sources)
}

/// `Key "value";` lines of `apt-config dump` for [`APT_OPTIONS_FROM_HOST`].
fn host_apt_options() -> Result<Vec<String>, BuildError> {
    let out = run(Command::new("apt-config").arg("dump"), &mut |_| {})?;
    Ok(String::from_utf8_lossy(&out)
        .lines()
        .filter(|line| {
            let key = line.split(' ').next().unwrap_or_default();
            APT_OPTIONS_FROM_HOST
                .iter()
                .any(|k| key == *k || key.starts_with(&format!("{k}::")))
        })
        .map(|line| line.trim_end_matches(';').to_string())
        .collect())
}

/// Removes what an agent does not need or what would differ between build
/// hosts, and makes the mount points exist.
fn strip(root: &Path, progress: &mut dyn FnMut(&str)) -> Result<(), BuildError> {
    progress("agent: stripping caches, logs and host-specific files");
    let etc = root.join("etc");
    // Copied from the build host by mmdebstrap, or naming the host's mirror:
    // not reproducible across hosts, and useless on a read-only root without
    // apt lists.
    for file in ["hostname", "resolv.conf", "apt/sources.list"] {
        tree::remove_file(&etc.join(file))?;
    }
    // Empty, so guest-init has a file to bind-mount a generated one over.
    write(&etc.join("resolv.conf"), "", 0o644)?;
    write(&etc.join("hostname"), "", 0o644)?;
    if !etc.join("hosts").exists() {
        write(&etc.join("hosts"), tree::HOSTS, 0o644)?;
    }
    // Device nodes mmdebstrap made for maintainer scripts: guest-init mounts
    // devtmpfs over /dev.
    tree::empty_dir(&root.join("dev"))?;
    // Leftover logs (mmdebstrap already dropped dpkg's and apt's).
    remove_files_under(&root.join("var/log"))?;
    // Package lists and .debs (mmdebstrap cleans these too; belt and braces),
    // and backups of debconf's and dpkg's databases.
    for dir in ["var/lib/apt/lists", "var/cache/apt"] {
        remove_files_under(&root.join(dir))?;
    }
    for dir in ["var/cache/debconf", "var/lib/dpkg"] {
        let dir = root.join(dir);
        for entry in fs::read_dir(&dir).at(&dir)? {
            let path = entry.at(&dir)?.path();
            if path.to_string_lossy().ends_with("-old") && path.is_file() {
                tree::remove_file(&path)?;
            }
        }
    }
    tree::ensure_mount_points(root)?;

    let passwd = fs::read_to_string(etc.join("passwd")).at(&etc.join("passwd"))?;
    for user in ["root:x:0:0:", "nobody:x:65534:65534:"] {
        if !passwd.lines().any(|l| l.starts_with(user)) {
            return Err(BuildError::Unexpected {
                what: "mmdebstrap".into(),
                detail: format!("/etc/passwd has no `{user}` entry"),
            });
        }
    }
    Ok(())
}

/// Deletes regular files and symlinks under `dir`, recursively; keeps the
/// directories (packages expect them).
fn remove_files_under(dir: &Path) -> Result<(), BuildError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).at(dir),
    };
    for entry in entries {
        let path = entry.at(dir)?.path();
        if fs::symlink_metadata(&path).at(&path)?.is_dir() {
            remove_files_under(&path)?;
        } else {
            fs::remove_file(&path).at(&path)?;
        }
    }
    Ok(())
}

/// Every package installed in the tree, from its dpkg database.
fn installed_packages(root: &Path) -> Result<Vec<PackageInput>, BuildError> {
    let mut cmd = Command::new("dpkg-query");
    cmd.arg(format!(
        "--admindir={}",
        root.join("var/lib/dpkg").display()
    ))
    .args([
        "--show",
        "--showformat=${db:Status-Status}\\t${Package}\\t${Version}\\n",
    ]);
    let out = run(&mut cmd, &mut |_| {})?;
    let mut inputs: Vec<PackageInput> = String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|line| match line.split('\t').collect::<Vec<_>>()[..] {
            ["installed", name, version] => Some(PackageInput {
                name: name.to_string(),
                version: version.to_string(),
            }),
            _ => None,
        })
        .collect();
    inputs.sort();
    inputs.dedup();
    if !inputs.iter().any(|p| p.name == "python3") {
        return Err(BuildError::Unexpected {
            what: cmd::describe(&cmd),
            detail: "python3 is not among the installed packages".into(),
        });
    }
    Ok(inputs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_follow_the_machine() {
        let targets = "http://m.example/debian/\tbookworm\tDebian\n\
                       http://m.example/debian/\tbookworm\tDebian\n\
                       http://m.example/debian/\tbookworm-updates\tDebian\n\
                       http://s.example/debian-security/\tbookworm-security\tDebian\n\
                       http://m.example/debian/\tbookworm-backports\tDebian\n\
                       https://other.example/\tstable\tSomeone\n";
        assert_eq!(
            sources_from_indextargets(targets).unwrap(),
            [
                "deb http://m.example/debian/ bookworm main",
                "deb http://m.example/debian/ bookworm-updates main",
                "deb http://s.example/debian-security/ bookworm-security main",
            ]
        );
        // Another release on the host: same archive, our suite.
        let trixie = "http://m.example/debian/\ttrixie\tDebian\n";
        assert_eq!(
            sources_from_indextargets(trixie).unwrap(),
            ["deb http://m.example/debian/ bookworm main"]
        );
        assert_eq!(sources_from_indextargets("x\ty\tUbuntu\n"), None);
        assert_eq!(sources_from_indextargets(""), None);
    }
}
