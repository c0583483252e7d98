//! A cgroup (v2) per instance, where the host lets this process make one: the helper and its VMM
//! run in it, with `memory.max` (guest RAM, a memory-backed writable root, and
//! [`Limits::host_memory_overhead`](crate::Limits::host_memory_overhead)),
//! `pids.max` and `cpu.max` (the definition's vCPUs and half a CPU for the devices), so a
//! compromised helper cannot take the host's memory or threads, and its CPU, memory and I/O are
//! counted in one place ([`Instance::metrics`](crate::Instance::metrics)).
//!
//! Where the cgroups go: under `KRUNBOX_CGROUP_PARENT` (a cgroup directory, absolute or relative
//! to the cgroup2 mount) when it is set, else under this process's own cgroup. Controllers can be
//! given to children only by a cgroup that holds no process itself, or by the root: so this works
//! as root in the root cgroup (the CI's L1), or in a delegated cgroup the caller set up for the
//! purpose (`systemd-run --scope -p Delegate=yes`, then an empty child of it as
//! `KRUNBOX_CGROUP_PARENT`). Elsewhere the layer is reported missing, with the reason, never
//! skipped in silence.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use crate::metrics::ProcessFigures;

/// Tasks (processes and threads) the helper and its VMM may have: libkrun makes one per vCPU
/// and a few per device; a compromised helper gets no more.
pub(crate) const PIDS_MAX: u64 = 512;

/// The CPU period `cpu.max` is given in.
const CPU_PERIOD_MICROS: u64 = 100_000;

/// The controllers an instance's cgroup needs (`cpu` is applied where the host has it).
const NEEDED: [&str; 2] = ["memory", "pids"];

/// Where this process makes its instances' cgroups, or why it cannot.
#[derive(Debug, Clone)]
pub(crate) struct Parent {
    dir: PathBuf,
    cpu: bool,
}

/// This process's cgroup parent, found and prepared once.
pub(crate) fn parent() -> Result<&'static Parent, &'static str> {
    static PARENT: OnceLock<Result<Parent, String>> = OnceLock::new();
    PARENT
        .get_or_init(find_parent)
        .as_ref()
        .map_err(String::as_str)
}

fn find_parent() -> Result<Parent, String> {
    let mount = cgroup2_mount().ok_or("no cgroup2 filesystem is mounted")?;
    let dir = match std::env::var_os("KRUNBOX_CGROUP_PARENT") {
        Some(path) => {
            let path = PathBuf::from(path);
            if path.is_absolute() && path.starts_with(&mount) {
                path
            } else {
                mount.join(path.strip_prefix("/").unwrap_or(&path))
            }
        }
        None => {
            let own = std::fs::read_to_string("/proc/self/cgroup")
                .map_err(|e| format!("reading /proc/self/cgroup: {e}"))?;
            let own = own
                .lines()
                .find_map(|l| l.strip_prefix("0::"))
                .ok_or("this process is in no cgroup v2 (a v1 or hybrid host)")?;
            mount.join(own.trim_start_matches('/'))
        }
    };
    let controllers = std::fs::read_to_string(dir.join("cgroup.controllers")).map_err(|e| {
        format!(
            "{} is not a cgroup this process can read: {e}",
            dir.display()
        )
    })?;
    let available: Vec<&str> = controllers.split_whitespace().collect();
    for needed in NEEDED {
        if !available.contains(&needed) {
            return Err(format!(
                "the {needed} controller is not available in {} (it has: {})",
                dir.display(),
                controllers.trim()
            ));
        }
    }
    let cpu = available.contains(&"cpu");
    let wanted: Vec<&str> = NEEDED.iter().copied().chain(cpu.then_some("cpu")).collect();
    let control = dir.join("cgroup.subtree_control");
    let enabled = std::fs::read_to_string(&control).unwrap_or_default();
    let missing: Vec<String> = wanted
        .iter()
        .filter(|c| !enabled.split_whitespace().any(|e| e == **c))
        .map(|c| format!("+{c}"))
        .collect();
    if !missing.is_empty() {
        std::fs::write(&control, missing.join(" ")).map_err(|e| {
            let why = if e.raw_os_error() == Some(libc::EBUSY) {
                "it holds processes itself (only the root cgroup, or an empty delegated one, can \
                 give controllers to children: set KRUNBOX_CGROUP_PARENT to one)"
                    .to_string()
            } else {
                e.to_string()
            };
            format!(
                "cannot give {} to the children of {}: {why}",
                missing.join(" "),
                dir.display()
            )
        })?;
    }
    Ok(Parent { dir, cpu })
}

/// The cgroup2 mount point, from this process's mount table.
fn cgroup2_mount() -> Option<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        let (fields, rest) = line.split_once(" - ")?;
        if rest.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        fields.split_whitespace().nth(4).map(PathBuf::from)
    })
}

/// One instance's cgroup: made before its helper starts, emptied and removed when the instance
/// is gone.
#[derive(Debug)]
pub(crate) struct InstanceCgroup {
    dir: PathBuf,
    /// What was set, for the isolation report.
    limits: String,
}

/// What to bound an instance's cgroup at.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CgroupLimits {
    pub memory_bytes: u64,
    pub cpus: u8,
}

impl InstanceCgroup {
    /// Makes the cgroup of instance `id` under [`parent`] with `limits`.
    pub(crate) fn create(id: &str, limits: CgroupLimits) -> Result<Self, String> {
        let parent = parent().map_err(str::to_owned)?;
        let name = format!("krunbox-{id}");
        let dir = parent.dir.join(name);
        std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        // On a failure below, dropping it removes the directory again.
        let mut cgroup = Self {
            dir,
            limits: String::new(),
        };
        let mut applied = vec![
            cgroup.set("memory.max", &limits.memory_bytes.to_string())?,
            cgroup.set("pids.max", &PIDS_MAX.to_string())?,
        ];
        // No swapping the guest's memory out behind the bound (where the host has swap).
        let _ = cgroup.set("memory.swap.max", "0");
        if parent.cpu {
            let quota = u64::from(limits.cpus) * CPU_PERIOD_MICROS + CPU_PERIOD_MICROS / 2;
            applied.push(cgroup.set("cpu.max", &format!("{quota} {CPU_PERIOD_MICROS}"))?);
        }
        cgroup.limits = format!("{} in {}", applied.join(", "), cgroup.dir.display());
        Ok(cgroup)
    }

    /// Writes `value` to the cgroup's file `name`; says what it set.
    fn set(&self, name: &str, value: &str) -> Result<String, String> {
        std::fs::write(self.dir.join(name), value)
            .map_err(|e| format!("setting {name} of {}: {e}", self.dir.display()))?;
        Ok(format!("{name} {value}"))
    }

    /// The cgroup's path as `/proc/PID/cgroup` shows it (below the cgroup2 mount).
    pub(crate) fn path_in_hierarchy(&self) -> String {
        let mount = cgroup2_mount().unwrap_or_default();
        format!(
            "/{}",
            self.dir.strip_prefix(&mount).unwrap_or(&self.dir).display()
        )
    }

    /// What was set, for the isolation report.
    pub(crate) fn limits(&self) -> &str {
        &self.limits
    }

    /// `cgroup.procs`, open for writing: a process that writes `0` to it moves itself in (the
    /// helper, between fork and exec, before it runs anything).
    pub(crate) fn procs(&self) -> std::io::Result<OwnedFd> {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.procs"))
            .map(OwnedFd::from)
    }

    /// CPU, memory and I/O of everything in the cgroup.
    pub(crate) fn figures(&self) -> Option<ProcessFigures> {
        let read = |name: &str| std::fs::read_to_string(self.dir.join(name)).ok();
        let cpu = read("cpu.stat")?;
        let usage = crate::metrics::field_value(&cpu, "usage_usec")?;
        let current: u64 = read("memory.current")?.trim().parse().ok()?;
        // memory.peak is Linux 5.19's: before it, no peak is known but the current figure.
        let peak = read("memory.peak")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or(current);
        let (mut rbytes, mut wbytes) = (0u64, 0u64);
        let io = read("io.stat");
        for line in io.as_deref().unwrap_or("").lines() {
            for field in line.split_whitespace() {
                if let Some(n) = field.strip_prefix("rbytes=") {
                    rbytes += n.parse::<u64>().unwrap_or(0);
                } else if let Some(n) = field.strip_prefix("wbytes=") {
                    wbytes += n.parse::<u64>().unwrap_or(0);
                }
            }
        }
        Some(ProcessFigures {
            cpu_time: Duration::from_micros(usage),
            memory_bytes: current,
            memory_peak_bytes: peak.max(current),
            disk_read_bytes: io.as_ref().map(|_| rbytes),
            disk_written_bytes: io.as_ref().map(|_| wbytes),
        })
    }

    /// How often the cgroup's processes were killed for its memory bound.
    pub(crate) fn oom_kills(&self) -> u64 {
        std::fs::read_to_string(self.dir.join("memory.events"))
            .ok()
            .and_then(|events| crate::metrics::field_value(&events, "oom_kill"))
            .unwrap_or(0)
    }
}

/// The cgroup for an instance with `memory_mib` of guest RAM, `layer_bytes` of memory-backed
/// writable root, `overhead` bytes for the VMM itself and `cpus` vCPUs, and where the helper is
/// to find itself: `None` and the reason where the host lets this process make none.
pub(crate) fn for_instance(
    id: &str,
    memory_mib: u32,
    layer_bytes: u64,
    overhead: u64,
    cpus: u8,
) -> (Option<InstanceCgroup>, crate::jail::CgroupPlacement) {
    let limits = CgroupLimits {
        memory_bytes: (u64::from(memory_mib) << 20)
            .saturating_add(layer_bytes)
            .saturating_add(overhead),
        cpus,
    };
    match InstanceCgroup::create(id, limits) {
        Ok(cgroup) => {
            let placement = crate::jail::CgroupPlacement::Placed {
                path: cgroup.path_in_hierarchy(),
                limits: cgroup.limits().to_owned(),
            };
            (Some(cgroup), placement)
        }
        Err(reason) => {
            tracing::debug!("no cgroup for the instance: {reason}");
            (None, crate::jail::CgroupPlacement::Unavailable { reason })
        }
    }
}

impl Drop for InstanceCgroup {
    /// Kills what is left in the cgroup (nothing, normally: the helper was killed and reaped,
    /// its VMM followed) and removes it once empty, in a thread of its own: an exiting process
    /// leaves its cgroup a moment after it is reaped.
    fn drop(&mut self) {
        let dir = self.dir.clone();
        if std::fs::remove_dir(&dir).is_ok() {
            return;
        }
        if let Ok(mut kill) = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("cgroup.kill"))
        {
            let _ = kill.write_all(b"1");
        }
        let removed = std::thread::Builder::new()
            .name("krunbox-cgroup".into())
            .spawn(move || remove_when_empty(&dir));
        if let Err(e) = removed {
            tracing::warn!("cannot wait to remove an instance's cgroup: {e}");
        }
    }
}

/// Removes `dir` once its last process has left it, for at most 30 s.
fn remove_when_empty(dir: &Path) {
    for _ in 0..300 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    tracing::warn!(cgroup = %dir.display(), "an instance's cgroup is still busy after 30 s: left in place");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_and_this_processs_parent_are_found_or_refused_with_a_reason() {
        match parent() {
            Ok(parent) => assert!(parent.dir.join("cgroup.procs").exists()),
            Err(reason) => assert!(!reason.is_empty()),
        }
        if let Some(mount) = cgroup2_mount() {
            assert!(mount.is_absolute());
        }
    }
}
