//! What makes the guest a normal Linux system beyond its mounts: its hostname, set and
//! resolvable (`/etc/hostname`, an `/etc/hosts` entry), loopback up with or without a network,
//! `/dev/fd` and `/dev/std{in,out,err}`, POSIX message queues at `/dev/mqueue`, and the
//! cgroup2 hierarchy at `/sys/fs/cgroup`.
//!
//! Each is best effort past `sethostname`: an image without an `/etc` to bind over, or a
//! kernel without cgroup2, costs that item (said on the console), never the boot.

use std::io;
use std::path::Path;

use crate::sys::{c, mount};

/// Sets the hostname and everything else above; runs once the root is in place.
pub fn set_up(hostname: &str) -> io::Result<()> {
    crate::sys::set_hostname(hostname)?;
    let steps: [(&str, &dyn Fn() -> io::Result<()>); 6] = [
        ("/etc/hostname", &|| {
            overlay_file("/etc/hostname", &format!("{hostname}\n"))
        }),
        ("/etc/hosts", &|| {
            overlay_file("/etc/hosts", &hosts(&existing_hosts(), hostname))
        }),
        ("loopback", &|| crate::net::loopback_up()),
        ("/dev/fd and /dev/std*", &dev_links),
        ("/dev/mqueue", &mount_mqueue),
        ("cgroup2", &mount_cgroup2),
    ];
    for (what, step) in steps {
        if let Err(e) = step() {
            eprintln!("guest-init: {what}: {e}");
        }
    }
    Ok(())
}

/// The files guest-init binds its own over; a read-only image lacking one gets an empty one
/// when the root is mounted (`mounts.rs`).
pub const BOUND_FILES: [&str; 2] = ["/etc/hostname", "/etc/hosts"];

/// The most of the image's `/etc/hosts` kept (a hosts file is a few lines).
const HOSTS_MAX: u64 = 64 << 10;

fn existing_hosts() -> String {
    use std::io::Read;
    let mut text = String::new();
    if let Ok(file) = std::fs::File::open("/etc/hosts") {
        let _ = file.take(HOSTS_MAX).read_to_string(&mut text);
    }
    text
}

/// The image's hosts file with the guest's name added on 127.0.1.1 (as Debian's installer
/// does), and `localhost` when the image has none.
pub fn hosts(existing: &str, hostname: &str) -> String {
    let mut text = String::new();
    let names = |line: &str| -> Vec<String> {
        let line = line.split('#').next().unwrap_or("");
        line.split_whitespace().skip(1).map(str::to_owned).collect()
    };
    if !existing
        .lines()
        .any(|l| names(l).iter().any(|n| n == "localhost"))
    {
        text.push_str("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n");
    }
    text.push_str(existing);
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    if !existing
        .lines()
        .any(|l| names(l).iter().any(|n| n == hostname))
    {
        text.push_str(&format!("127.0.1.1\t{hostname}\n"));
    }
    text
}

/// Puts `content` at `target` without writing to the image: a file of guest-init's in `/run`,
/// bound over the target (a writable root's own file is left as it is on its disk). It stays
/// writable, as a container runtime's is: edits last until the VM stops. A missing target is
/// made first where the root is writable.
fn overlay_file(target: &str, content: &str) -> io::Result<()> {
    if !Path::new(target).is_file() {
        std::fs::write(target, b"")?;
    }
    let scratch = format!(
        "/run/.krunbox-{}",
        target.trim_start_matches('/').replace('/', "-")
    );
    std::fs::write(&scratch, content)?;
    let result = mount(&scratch, target, None, libc::MS_BIND, None);
    let scratch = c(&scratch)?;
    // SAFETY: a valid C string; the bind mount keeps the file itself alive.
    unsafe { libc::unlink(scratch.as_ptr()) };
    result
}

/// `/dev/fd` and `/dev/std{in,out,err}`, as udev and systemd make them, where devtmpfs lacks
/// them.
fn dev_links() -> io::Result<()> {
    for (link, to) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        match std::os::unix::fs::symlink(to, link) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// POSIX message queues (`mq_open`), where glibc and musl look for them.
fn mount_mqueue() -> io::Result<()> {
    std::fs::create_dir_all("/dev/mqueue")?;
    match mount(
        "mqueue",
        "/dev/mqueue",
        Some("mqueue"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    ) {
        Err(e) if e.kind() == io::ErrorKind::ResourceBusy => Ok(()),
        other => other,
    }
}

/// The cgroup2 hierarchy at `/sys/fs/cgroup`, where tools look for it.
fn mount_cgroup2() -> io::Result<()> {
    match mount(
        "cgroup2",
        "/sys/fs/cgroup",
        Some("cgroup2"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    ) {
        Err(e) if e.kind() == io::ErrorKind::ResourceBusy => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hostname_is_added_once_and_localhost_only_where_missing() {
        let debian = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n";
        assert_eq!(
            hosts(debian, "lane-7"),
            format!("{debian}127.0.1.1\tlane-7\n")
        );
        assert_eq!(
            hosts("", "lane-7"),
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\tlane-7\n"
        );
        let named = "127.0.0.1 localhost\n10.0.0.5 lane-7 # pinned";
        assert_eq!(hosts(named, "lane-7"), format!("{named}\n"));
        // A comment naming it does not count.
        assert!(hosts("127.0.0.1 localhost # lane-7\n", "lane-7").ends_with("127.0.1.1\tlane-7\n"));
    }
}
