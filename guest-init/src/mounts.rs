//! Filesystem setup: API filesystems first, then the switch into the root image.

use std::io;

use krunbox_protocol::{LayerDevice, RootMount, WritableLayer};

use crate::sys::{c, check, mount};

/// Where libkrun's root virtio-fs provides an empty directory for the real root.
const NEW_ROOT: &str = "/newroot";

/// Mounts `/dev`, `/proc` and `/sys` on the initial (virtio-fs) root. Already-mounted targets
/// are fine: the kernel may have mounted devtmpfs itself.
pub fn mount_early() -> io::Result<()> {
    for (src, target, fstype) in [
        ("devtmpfs", "/dev", "devtmpfs"),
        ("proc", "/proc", "proc"),
        ("sysfs", "/sys", "sysfs"),
    ] {
        match mount(src, target, Some(fstype), libc::MS_NOSUID, None) {
            Ok(()) => {}
            // The kernel may have mounted devtmpfs itself (CONFIG_DEVTMPFS_MOUNT).
            Err(e) if e.kind() == io::ErrorKind::ResourceBusy => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Where the initial root has an empty directory for the layers of an overlay root: a writable
/// root (see [`mount_writable`]), or a read-only one that needs mount points the image lacks
/// (see [`add_to_image`]).
const LAYERS: &str = "/layers";

/// The directories that get a tmpfs of scratch space on a read-only image, where the image has
/// them (`/tmp` always). A writable root keeps what is written elsewhere, so it gets only the
/// first two ([`WRITABLE_SCRATCH`]): what is scratch on any Linux system.
const SCRATCH: [(&str, &str); 5] = [
    // `/tmp` and `/run` first: the scratch a writable root keeps too.
    ("/tmp", "1777"),
    ("/run", "755"),
    ("/var/tmp", "1777"),
    ("/root", "700"),
    ("/home", "755"),
];

/// How many of [`SCRATCH`] a writable root gets: `/tmp` and `/run`.
const WRITABLE_SCRATCH: usize = 2;

/// Mounts the root image, moves the API filesystems into it, adds scratch tmpfs, and makes it
/// `/`. The old (virtio-fs) root is detached so nothing in the guest can reach it by path.
/// `mount_points` are the directories the host's filesystems will be mounted on (see
/// [`add_to_image`]).
pub fn switch_root(
    root: &RootMount,
    mount_points: &[&str],
    bound_files: &[&str],
) -> io::Result<()> {
    let mut flags = libc::MS_NOATIME;
    if root.read_only {
        flags |= libc::MS_RDONLY;
    }
    if let Some(layer) = &root.writable_layer {
        mount_writable(root, layer, mount_points)?;
    } else {
        mount(&root.device, NEW_ROOT, Some(&root.fstype), flags, None)?;
    }
    if root.read_only && root.writable_layer.is_none() {
        let in_image = |path: &str| std::path::Path::new(&format!("{NEW_ROOT}{path}")).exists();
        let missing: Vec<&str> = mount_points
            .iter()
            .copied()
            .filter(|point| needs_creating(point, &SCRATCH, in_image))
            .collect();
        // The files guest-init binds its own over (`identity.rs`, `trust.rs`): a bind needs a
        // file there.
        let etc_is_dir = std::path::Path::new(&format!("{NEW_ROOT}/etc")).is_dir();
        let missing_files: Vec<&str> = bound_files
            .iter()
            .copied()
            .filter(|file| etc_is_dir && creatable_in_image(file))
            .collect();
        if !missing.is_empty() || !missing_files.is_empty() {
            add_to_image(flags, &missing, &missing_files)?;
        }
    }

    for dir in ["/dev", "/proc", "/sys"] {
        let target = format!("{NEW_ROOT}{dir}");
        mount(dir, &target, None, libc::MS_MOVE, None)?;
    }

    let nosuid_nodev = libc::MS_NOSUID | libc::MS_NODEV;
    // /dev is the devtmpfs moved in above, so the mount point can always be made.
    std::fs::create_dir_all(format!("{NEW_ROOT}/dev/pts"))?;
    mount(
        "devpts",
        &format!("{NEW_ROOT}/dev/pts"),
        Some("devpts"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("mode=620,ptmxmode=666,gid=5"),
    )?;
    std::fs::create_dir_all(format!("{NEW_ROOT}/dev/shm"))?;
    mount(
        "shm",
        &format!("{NEW_ROOT}/dev/shm"),
        Some("tmpfs"),
        nosuid_nodev,
        Some("mode=1777"),
    )?;
    // Scratch space on a read-only image. /tmp is required; the others only where the image
    // has the directory.
    let scratch = if root.writable_layer.is_some() {
        &SCRATCH[..WRITABLE_SCRATCH]
    } else {
        &SCRATCH[..]
    };
    for &(dir, mode) in scratch {
        let target = format!("{NEW_ROOT}{dir}");
        if dir == "/tmp" || std::path::Path::new(&target).is_dir() {
            mount(
                "tmpfs",
                &target,
                Some("tmpfs"),
                nosuid_nodev,
                Some(&format!("mode={mode}")),
            )?;
        }
    }

    // pivot_root(".", ".") stacks the old root under the new one at "/", and the detach
    // then drops it: the documented way to pivot without a spare mount-point directory.
    let new_root = c(NEW_ROOT)?;
    let dot = c(".")?;
    let slash = c("/")?;
    // SAFETY: valid C strings; plain syscalls.
    unsafe {
        check("chdir /newroot", libc::chdir(new_root.as_ptr()))?;
        check(
            "pivot_root",
            libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) as libc::c_int,
        )?;
        check(
            "umount old root",
            libc::umount2(dot.as_ptr(), libc::MNT_DETACH),
        )?;
        check("chdir /", libc::chdir(slash.as_ptr()))?;
    }
    Ok(())
}

/// A writable root: the image, read-only, is the lower layer of an overlay whose upper layer
/// (and overlayfs's work directory) lives on the writable layer's device. What the guest writes
/// lands on that device, never on the image, which stays the verified bytes every boot shares.
/// A layer used before already holds `upper/` and `work/`; a fresh one gets them.
///
/// The host's `mount_points` that neither the image nor the layer has are made in a small layer
/// of their own between the two, never on the writable layer: a root that outlives the boot
/// (copy-on-write, persistent) keeps no directory that only this boot's mounts needed.
fn mount_writable(
    root: &RootMount,
    layer: &WritableLayer,
    mount_points: &[&str],
) -> io::Result<()> {
    let context =
        |what: String| move |e: io::Error| io::Error::new(e.kind(), format!("{what}: {e}"));
    let lower = format!("{LAYERS}/lower");
    let disk = format!("{LAYERS}/disk");
    mount_layers("1m")?;
    for dir in [&lower, &disk] {
        std::fs::create_dir(dir)?;
    }
    mount(
        &root.device,
        &lower,
        Some(&root.fstype),
        libc::MS_RDONLY | libc::MS_NOATIME,
        None,
    )
    .map_err(context(format!("mounting the image {}", root.device)))?;
    let device = match &layer.device {
        LayerDevice::Disk(device) => device.clone(),
        LayerDevice::HostBlock { serial } => disk_by_serial(serial)?,
    };
    mount(&device, &disk, Some(&layer.fstype), libc::MS_NOATIME, None).map_err(context(
        format!("mounting the writable layer {device} ({})", layer.fstype),
    ))?;
    for dir in ["upper", "work"] {
        std::fs::create_dir_all(format!("{disk}/{dir}"))
            .map_err(context(format!("making {dir}/ on the writable layer")))?;
    }
    let in_root = |path: &str| {
        std::path::Path::new(&format!("{lower}{path}")).exists()
            || std::path::Path::new(&format!("{disk}/upper{path}")).exists()
    };
    let missing: Vec<&str> = mount_points
        .iter()
        .copied()
        .filter(|point| needs_creating(point, &SCRATCH[..WRITABLE_SCRATCH], in_root))
        .collect();
    let lowers = if missing.is_empty() {
        lower
    } else {
        let points = format!("{LAYERS}/points");
        for point in &missing {
            std::fs::create_dir_all(format!("{points}{point}"))
                .map_err(context(format!("making the mount point {point}")))?;
        }
        // The leftmost lower layer is the uppermost.
        format!("{points}:{lower}")
    };
    let options = format!("lowerdir={lowers},upperdir={disk}/upper,workdir={disk}/work");
    mount(
        "root",
        NEW_ROOT,
        Some("overlay"),
        libc::MS_NOATIME,
        Some(&options),
    )
    .map_err(context("mounting the overlay root".into()))
}

/// The block device whose serial (`/sys/block/NAME/serial`) is `serial`, as `/dev/NAME`. The
/// kernel probes its virtio devices before it starts init; the short wait covers a disk whose
/// probe finishes late.
fn disk_by_serial(serial: &str) -> io::Result<String> {
    const WAIT: std::time::Duration = std::time::Duration::from_secs(5);
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        for entry in std::fs::read_dir("/sys/block")? {
            let entry = entry?;
            let Ok(shown) = std::fs::read_to_string(entry.path().join("serial")) else {
                continue;
            };
            if shown.trim_end_matches(['\n', '\0']) == serial {
                return Ok(format!("/dev/{}", entry.file_name().to_string_lossy()));
            }
        }
        if std::time::Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no disk with the serial {serial:?} in /sys/block after {WAIT:?}"),
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Whether `file` is missing from the image and can be made there: neither it nor any of its
/// directories is a symlink (which, before the switch, would resolve against the first root:
/// the file is left to the image, and a bind over it to what it leads to once switched) or
/// anything but a directory.
fn creatable_in_image(file: &str) -> bool {
    let mut path = std::path::PathBuf::from(NEW_ROOT);
    let components: Vec<&str> = file.split('/').filter(|c| !c.is_empty()).collect();
    for (i, component) in components.iter().enumerate() {
        path.push(component);
        match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return true,
            Ok(meta) if meta.is_dir() && i + 1 < components.len() => continue,
            _ => return false,
        }
    }
    false
}

/// Whether a mount point must be made before the root is assembled: `exists` says whether a
/// path is in the root as it will be, and a point inside one of `scratch` (a tmpfs guest-init
/// mounts later, where the mount makes its point itself) never must.
fn needs_creating(point: &str, scratch: &[(&str, &str)], exists: impl Fn(&str) -> bool) -> bool {
    if exists(point) {
        return false;
    }
    !scratch
        .iter()
        .any(|(dir, _)| point.starts_with(&format!("{dir}/")) && (*dir == "/tmp" || exists(dir)))
}

/// Gives a read-only image the mount points and the files to bind over that it lacks: the
/// image becomes the lower layer of an overlay whose upper layer (a small tmpfs) holds just
/// those empty directories and files, and the overlay is then made read-only too. The guest
/// still cannot write to its root; the host filesystems get their directories wherever the
/// host asked.
fn add_to_image(flags: libc::c_ulong, points: &[&str], files: &[&str]) -> io::Result<()> {
    let lower = format!("{LAYERS}/lower");
    mount_layers("1m")?;
    for dir in ["lower", "upper", "work"] {
        std::fs::create_dir(format!("{LAYERS}/{dir}"))?;
    }
    mount(NEW_ROOT, &lower, None, libc::MS_MOVE, None)?;
    let options = format!("lowerdir={lower},upperdir={LAYERS}/upper,workdir={LAYERS}/work");
    mount(
        "root",
        NEW_ROOT,
        Some("overlay"),
        flags & !libc::MS_RDONLY,
        Some(&options),
    )?;
    for point in points {
        std::fs::create_dir_all(format!("{NEW_ROOT}{point}")).map_err(|e| {
            io::Error::new(e.kind(), format!("creating the mount point {point}: {e}"))
        })?;
    }
    for file in files {
        let path = std::path::PathBuf::from(format!("{NEW_ROOT}{file}"));
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| {
                io::Error::new(e.kind(), format!("creating {file}'s directory: {e}"))
            })?;
        }
        std::fs::write(&path, b"")
            .map_err(|e| io::Error::new(e.kind(), format!("creating {file}: {e}")))?;
    }
    mount("root", NEW_ROOT, None, libc::MS_REMOUNT | flags, None)
}

/// A private tmpfs of `size` on [`LAYERS`] (on the first root), for the layers of an overlay
/// root: it holds their mount points, or a read-only root's few new directories.
fn mount_layers(size: &str) -> io::Result<()> {
    mount(
        "layers",
        LAYERS,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some(&format!("size={size},mode=700")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A point the root has, or one inside a scratch tmpfs the root has (or `/tmp`, always
    /// made), is left to the mount; anything else is made before the root is assembled.
    #[test]
    fn only_points_outside_the_root_and_its_scratch_are_made_first() {
        let root = ["/srv", "/srv/data", "/root", "/run"];
        let exists = |path: &str| root.contains(&path);
        let made = |point: &str, scratch: &[(&str, &str)]| needs_creating(point, scratch, exists);
        assert!(!made("/srv/data", &SCRATCH), "in the root");
        assert!(made("/workspace", &SCRATCH));
        assert!(made("/srv/new", &SCRATCH));
        assert!(!made("/tmp/work", &SCRATCH), "/tmp is always a tmpfs");
        assert!(
            !made("/root/work", &SCRATCH),
            "a scratch tmpfs the root has"
        );
        assert!(
            made("/home/agent", &SCRATCH),
            "the root has no /home: no tmpfs there"
        );
        let writable = &SCRATCH[..WRITABLE_SCRATCH];
        assert!(made("/root/work", writable), "a writable root keeps /root");
        assert!(!made("/run/user", writable));
    }
}
