//! What a running guest is, for an agent (or its prompt) to be told before it acts: how its
//! root was given and whether it is mounted read-write, whether it has a network, its
//! distribution (read from `os-release` as data, never run), its package manager, its shell and
//! the common commands it has. Everything is read through the file API ([`crate::files`]):
//! nothing runs in the guest to find it, so a hostile image can make the facts wrong (they are
//! what the guest says) but cannot run anything through them.

use std::path::Path;

use crate::error::{Error, Result};
use crate::instance::Instance;
use crate::protocol::fs::FsErrorKind;

/// How a sandbox's root was given (from its definition, not the guest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootKind {
    /// An image, read-only ([`Rootfs::builtin`](crate::Rootfs::builtin),
    /// [`Rootfs::image`](crate::Rootfs::image)).
    Image,
    /// Writable for one boot ([`Rootfs::ephemeral`](crate::Rootfs::ephemeral)).
    Ephemeral,
    /// Writable, its changes kept in a block store
    /// ([`Rootfs::cow`](crate::Rootfs::cow)).
    CopyOnWrite,
    /// Writable, its changes kept in a qcow2 file
    /// ([`Rootfs::persistent`](crate::Rootfs::persistent)).
    Persistent,
}

impl RootKind {
    pub(crate) fn of(rootfs: &crate::Rootfs) -> RootKind {
        match rootfs {
            crate::Rootfs::Builtin(_) | crate::Rootfs::Image { .. } => RootKind::Image,
            crate::Rootfs::Ephemeral { .. } => RootKind::Ephemeral,
            crate::Rootfs::Cow { .. } => RootKind::CopyOnWrite,
            crate::Rootfs::Persistent { .. } => RootKind::Persistent,
        }
    }
}

/// A guest's distribution, from its `os-release` file: the fields an agent needs, each
/// checked to be what the file format allows (a line that is not `KEY=value` with a plain or
/// quoted value makes the facts fail, as does an `ID` outside `[a-z0-9._-]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Distro {
    /// `ID`: `debian`, `alpine`, `ubuntu`, ...
    pub id: String,
    /// `VERSION_ID`: `12`, `3.23`, ... (`None` on rolling distributions).
    pub version_id: Option<String>,
    /// `PRETTY_NAME`, for people.
    pub pretty_name: Option<String>,
}

/// The package manager a guest has (the first found, in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackageManager {
    /// Debian's and Ubuntu's `apt-get`.
    Apt,
    /// Alpine's `apk`.
    Apk,
    /// Fedora's `dnf`.
    Dnf,
    /// `yum`.
    Yum,
    /// Arch's `pacman`.
    Pacman,
    /// openSUSE's `zypper`.
    Zypper,
}

/// What [`Instance::facts`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestFacts {
    /// How the root was given.
    pub root: RootKind,
    /// Whether the guest's `/` is mounted read-write (its mount table says so).
    pub root_read_write: bool,
    /// Whether the guest has a network device (every connection still needs the policy's
    /// grant; a deny-all network has a device and grants nothing).
    pub network: bool,
    /// The distribution (`None`: the image has no `os-release`).
    pub distro: Option<Distro>,
    /// The package manager (`None`: none of those known).
    pub package_manager: Option<PackageManager>,
    /// The shell at `/bin/sh`, or `/bin/bash` without one (`None`: neither).
    pub shell: Option<String>,
    /// Those of [`COMMANDS`] the guest has in `/usr/local/bin`, `/usr/bin` or `/bin`.
    pub commands: Vec<String>,
}

/// The commands [`GuestFacts::commands`] looks for: what agents reach for first.
pub const COMMANDS: &[&str] = &[
    "bash", "curl", "wget", "git", "python3", "pip3", "pip", "node", "npm", "gcc", "make", "cargo",
    "go", "java", "tar", "gzip", "unzip", "jq", "ssh", "sudo",
];

const PACKAGE_MANAGERS: &[(PackageManager, &str)] = &[
    (PackageManager::Apt, "/usr/bin/apt-get"),
    (PackageManager::Apk, "/sbin/apk"),
    (PackageManager::Dnf, "/usr/bin/dnf"),
    (PackageManager::Yum, "/usr/bin/yum"),
    (PackageManager::Pacman, "/usr/bin/pacman"),
    (PackageManager::Zypper, "/usr/bin/zypper"),
];

const BIN_DIRS: &[&str] = &["/usr/local/bin", "/usr/bin", "/bin"];

/// The most of `os-release` and of the mount table read: a few lines each, and a mount table
/// of thousands of mounts still fits.
const FILE_MAX: usize = 1 << 20;

impl Instance {
    /// What this guest is, for an agent to be told before it acts (see [`GuestFacts`]): read
    /// through the file API, nothing run in the guest. Fails like a file operation, or with
    /// [`FsErrorKind::InvalidInput`] for an `os-release` that is not data.
    ///
    /// ```no_run
    /// # async fn demo(vm: &krunbox::Instance) -> krunbox::Result<()> {
    /// let facts = vm.facts().await?;
    /// if let Some(distro) = &facts.distro {
    ///     println!("{} {:?}, {:?}", distro.id, distro.version_id, facts.package_manager);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn facts(&self) -> Result<GuestFacts> {
        let distro = self.distro().await?;
        let mounts = self
            .read_file_range("/proc/self/mountinfo", 0, FILE_MAX)
            .await?;
        let root_read_write = root_is_read_write(&String::from_utf8_lossy(&mounts));
        let mut package_manager = None;
        for (manager, path) in PACKAGE_MANAGERS {
            if self.exists(path).await? {
                package_manager = Some(*manager);
                break;
            }
        }
        let mut shell = None;
        for candidate in ["/bin/sh", "/bin/bash"] {
            if self.exists(candidate).await? {
                shell = Some(candidate.to_owned());
                break;
            }
        }
        // One lookup per command at a time, the commands all at once: a round trip to the
        // guest each, and there are a score of them.
        let found = futures_util::future::join_all(COMMANDS.iter().map(|command| async move {
            for dir in BIN_DIRS {
                if self.exists(&format!("{dir}/{command}")).await? {
                    return Ok(Some((*command).to_owned()));
                }
            }
            Ok::<_, Error>(None)
        }))
        .await;
        let mut commands = Vec::new();
        for command in found {
            commands.extend(command?);
        }
        Ok(GuestFacts {
            root: self.root_kind(),
            root_read_write,
            network: self.has_network(),
            distro,
            package_manager,
            shell,
            commands,
        })
    }

    /// Whether `path` names something that is (or whose symlink leads to) a file or directory:
    /// any file error (missing, a loop of links, no permission) is "no"; only the instance's
    /// own failures (gone, hung) are errors.
    async fn exists(&self, path: &str) -> Result<bool> {
        match self.metadata(path).await {
            Ok(_) => Ok(true),
            Err(Error::Fs { .. }) => Ok(false),
            Err(err) => Err(err),
        }
    }

    /// The guest's `os-release` (`/etc/os-release`, else `/usr/lib/os-release`), parsed.
    async fn distro(&self) -> Result<Option<Distro>> {
        for path in ["/etc/os-release", "/usr/lib/os-release"] {
            match self.read_file_range(path, 0, FILE_MAX).await {
                Ok(bytes) => {
                    return parse_os_release(&String::from_utf8_lossy(&bytes))
                        .map(Some)
                        .map_err(|why| Error::Fs {
                            op: "facts",
                            path: Path::new(path).to_owned(),
                            kind: FsErrorKind::InvalidInput,
                            message: format!("unsupported guest distro environment fact: {why}"),
                        });
                }
                Err(err) if err.fs_kind() == Some(FsErrorKind::NotFound) => continue,
                Err(err) => return Err(err),
            }
        }
        Ok(None)
    }
}

/// Whether the mount table (`/proc/self/mountinfo`) has `/` mounted read-write: the options of
/// the last mount on `/` (the one on top).
fn root_is_read_write(mountinfo: &str) -> bool {
    mountinfo
        .lines()
        .rfind(|line| line.split(' ').nth(4) == Some("/"))
        .and_then(|line| line.split(' ').nth(5))
        .is_some_and(|options| options.split(',').any(|o| o == "rw"))
}

/// Reads `os-release` as data (its format: `KEY=value` lines, the value plain or in single or
/// double quotes, `#` comments), never as a shell script: a value with shell syntax in it
/// (`$`, a backquote, a backslash outside quotes) is refused, as is an `ID` outside
/// `[a-z0-9._-]` or a missing one.
fn parse_os_release(text: &str) -> std::result::Result<Distro, String> {
    let mut fields = std::collections::HashMap::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| format!("a line that is not KEY=value: {line:?}"))?;
        if key.is_empty()
            || !key
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(format!("a key that is not a name: {key:?}"));
        }
        fields.insert(key, unquote(value)?);
    }
    let id = fields.remove("ID").ok_or("no ID")?;
    if id.is_empty()
        || !id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
    {
        return Err(format!("ID={id:?} is not a distribution's id"));
    }
    Ok(Distro {
        id,
        version_id: fields.remove("VERSION_ID"),
        pretty_name: fields.remove("PRETTY_NAME"),
    })
}

/// An `os-release` value: plain, or in quotes (the other kind of quote may be inside); shell
/// syntax is refused rather than read.
fn unquote(value: &str) -> std::result::Result<String, String> {
    let (inner, quote) = match value.as_bytes() {
        [q @ (b'"' | b'\''), .., last] if value.len() >= 2 && last == q => {
            (&value[1..value.len() - 1], Some(char::from(*q)))
        }
        _ => (value, None),
    };
    let forbidden = |c: char| matches!(c, '$' | '`' | '\\') || Some(c) == quote;
    if inner.contains(forbidden) || (quote.is_none() && inner.contains(['"', '\''])) {
        return Err(format!("a value with shell syntax: {value:?}"));
    }
    if inner.len() != value.len() || !inner.contains(char::is_whitespace) {
        Ok(inner.to_owned())
    } else {
        Err(format!("an unquoted value with spaces: {value:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_release_is_read_as_data() {
        let debian = "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nNAME=\"Debian GNU/Linux\"\n\
                      VERSION_ID=\"12\"\nID=debian\n# a comment\n\nHOME_URL=\"https://www.debian.org/\"\n";
        assert_eq!(
            parse_os_release(debian),
            Ok(Distro {
                id: "debian".into(),
                version_id: Some("12".into()),
                pretty_name: Some("Debian GNU/Linux 12 (bookworm)".into()),
            })
        );
        let alpine = "ID=alpine\nVERSION_ID=3.23.0\nPRETTY_NAME='Alpine Linux v3.23'\n\
                      NAME=\"Foo's Linux\"\n";
        assert_eq!(
            parse_os_release(alpine).unwrap().version_id.as_deref(),
            Some("3.23.0")
        );
        for hostile in [
            "ID=$(touch /tmp/os-release-executed)\nVERSION_ID=3.23\n",
            "ID=`id`\n",
            "ID=debian\nVERSION_ID=\"12$(reboot)\"\n",
            "ID=Debian\n",
            "ID=debian linux\n",
            "VERSION_ID=12\n",
            "ID=debian\nnot a line\n",
        ] {
            assert!(parse_os_release(hostile).is_err(), "{hostile:?}");
        }
    }

    #[test]
    fn the_root_mode_is_the_top_mount_on_slash() {
        let info = "1 0 0:1 / / ro,relatime - erofs /dev/vda ro\n\
                    22 1 0:22 / / rw,noatime - overlay root rw,lowerdir=/l\n\
                    23 22 0:5 / /dev rw - devtmpfs devtmpfs rw\n";
        assert!(root_is_read_write(info));
        assert!(!root_is_read_write(
            "1 0 0:1 / / ro,noatime - overlay root ro\n"
        ));
        assert!(!root_is_read_write(""));
    }
}
