//! What this host can do, decided by real probes.
//!
//! "Does /dev/kvm exist?" is the wrong question: on nested PVM hosts `/dev/kvm` opens and
//! creates VMs, yet a stock guest kernel hangs and dies. So the probe recognises PVM, and
//! otherwise boots a tiny guest with a short deadline.

use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::artifacts;
use crate::rootfs::{BuiltinImage, Rootfs};
use crate::sandbox::Sandbox;

/// Can this host's KVM boot a libkrun guest?
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvmStatus {
    /// A probe VM booted and ran a command.
    Boots {
        /// The guest kernel release the probe saw.
        kernel_release: String,
    },
    /// KVM is nested PVM (pagetable-based virtualization), which only runs guest kernels built
    /// for PVM: libkrunfw's stock kernel cannot boot here.
    NestedPvm,
    /// `/dev/kvm` is missing, inaccessible, or cannot create a VM.
    Unavailable {
        /// What failed.
        reason: String,
    },
    /// KVM looks usable but the probe VM failed.
    BootFailed {
        /// The boot error.
        error: String,
    },
    /// KVM looks usable, but the boot probe could not run (something it needs is missing).
    NotProbed {
        /// What was missing.
        reason: String,
    },
}

/// The state of one built-in image in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageState {
    /// Built, and its SHA-256 matches the recorded one.
    Ready {
        /// The digest.
        sha256: String,
    },
    /// Not built yet (it is built on first use).
    Missing,
    /// Present but unusable (digest mismatch, unreadable manifest…).
    Broken {
        /// What is wrong.
        reason: String,
    },
}

/// A report of what this host can do.
#[derive(Debug, Clone)]
pub struct HostCapabilities {
    /// KVM's ability to boot guests.
    pub kvm: KvmStatus,
    /// The VMM helper binary, or how to get it.
    pub vmm_helper: Result<PathBuf, String>,
    /// The guest-init binary, or how to get it.
    pub guest_init: Result<PathBuf, String>,
    /// The libkrunfw directory, or how to get it.
    pub libkrunfw: Result<PathBuf, String>,
    /// `mke2fs`, which formats a writable root's layer (`Rootfs::ephemeral`), or how to get
    /// it. Read-only roots do without it.
    pub mke2fs: Result<PathBuf, String>,
    /// Each built-in image.
    pub images: Vec<(BuiltinImage, ImageState)>,
    /// The VMM helper's jail on this host: each isolation layer and canary, as the helper
    /// applies them before a boot (probed without booting, so also where KVM cannot boot
    /// guests), or why it could not be probed.
    pub isolation: Result<crate::Isolation, String>,
}

// ioctl numbers from <linux/kvm.h>: _IO(KVMIO, 0x00) and _IO(KVMIO, 0x01).
const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;
const KVM_CREATE_VM: libc::c_ulong = 0xAE01;
const KVM_API_VERSION: libc::c_int = 12;

/// Opens /dev/kvm and creates (then drops) a VM.
fn kvm_basic() -> Result<(), String> {
    let kvm = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| format!("cannot open /dev/kvm: {e}"))?;
    // SAFETY: ioctls without pointer arguments on an fd we own.
    let version = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_GET_API_VERSION, 0) };
    if version != KVM_API_VERSION {
        return Err(format!("unexpected KVM API version {version}"));
    }
    // SAFETY: as above; the returned fd is closed right away.
    let vm = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_CREATE_VM, 0) };
    if vm < 0 {
        return Err(format!(
            "KVM_CREATE_VM failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: closing the fd the ioctl returned, exactly once.
    unsafe { libc::close(vm) };
    Ok(())
}

fn is_nested_pvm() -> bool {
    Path::new("/sys/module/kvm_pvm").exists()
}

impl HostCapabilities {
    /// Probes the host: KVM (with a real tiny boot when everything needed is present),
    /// run-time files, and built-in images. Takes up to about a minute when it boots.
    ///
    /// ```no_run
    /// # async fn demo() {
    /// let caps = krunbox::HostCapabilities::probe().await;
    /// if !caps.can_boot_guests() {
    ///     eprintln!("{}", caps.report());
    /// }
    /// # }
    /// ```
    pub async fn probe() -> HostCapabilities {
        Self::probe_with(None, None).await
    }

    /// [`probe`](Self::probe) with the VMM helper and guest-init a program ships itself (as
    /// [`SandboxBuilder::vmm_helper`](crate::SandboxBuilder::vmm_helper) and
    /// [`guest_init`](crate::SandboxBuilder::guest_init) give them): `None` searches as
    /// `probe` does. The Python package probes with the files in its wheel.
    ///
    /// ```no_run
    /// # async fn demo() {
    /// let caps = krunbox::HostCapabilities::probe_with(
    ///     Some("/opt/myagent/krunbox-vmm".into()),
    ///     Some("/opt/myagent/guest-init".into()),
    /// )
    /// .await;
    /// println!("{}", caps.report());
    /// # }
    /// ```
    pub async fn probe_with(
        vmm_helper: Option<PathBuf>,
        guest_init: Option<PathBuf>,
    ) -> HostCapabilities {
        let cache = artifacts::cache_dir();
        let images = tokio::task::spawn_blocking(move || image_states(&cache))
            .await
            .unwrap_or_default();
        let mut caps = HostCapabilities {
            kvm: KvmStatus::NotProbed {
                reason: String::new(),
            },
            vmm_helper: artifacts::locate_vmm_helper(vmm_helper.as_deref())
                .map_err(|e| e.to_string()),
            guest_init: artifacts::locate_guest_init(guest_init.as_deref())
                .map_err(|e| e.to_string()),
            libkrunfw: artifacts::locate_libkrunfw(None).map_err(|e| e.to_string()),
            mke2fs: crate::rootfs::mke2fs().map_err(|e| e.to_string()),
            images,
            isolation: Err("not probed".into()),
        };
        caps.isolation = match (&caps.vmm_helper, &caps.libkrunfw) {
            (Ok(helper), Ok(libkrunfw)) => crate::jail::host::probe(helper, libkrunfw).await,
            _ => Err("needs the VMM helper and libkrunfw (run scripts/setup.sh)".into()),
        };
        caps.kvm = caps.probe_kvm().await;
        caps
    }

    async fn probe_kvm(&self) -> KvmStatus {
        if let Err(reason) = kvm_basic() {
            return KvmStatus::Unavailable { reason };
        }
        if is_nested_pvm() {
            return KvmStatus::NestedPvm;
        }
        let busybox_ready = self
            .images
            .iter()
            .any(|(i, s)| *i == BuiltinImage::Busybox && matches!(s, ImageState::Ready { .. }));
        let missing: Vec<&str> = [
            ("the VMM helper", self.vmm_helper.is_ok()),
            ("guest-init", self.guest_init.is_ok()),
            ("libkrunfw", self.libkrunfw.is_ok()),
            ("the busybox image", busybox_ready),
        ]
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(what, _)| *what)
        .collect();
        if !missing.is_empty() {
            return KvmStatus::NotProbed {
                reason: format!("missing {}", missing.join(", ")),
            };
        }
        let (Ok(helper), Ok(guest_init)) = (&self.vmm_helper, &self.guest_init) else {
            return KvmStatus::NotProbed {
                reason: "missing the VMM helper or guest-init".into(),
            };
        };
        match probe_boot(helper, guest_init).await {
            Ok(kernel_release) => KvmStatus::Boots { kernel_release },
            Err(error) => KvmStatus::BootFailed { error },
        }
    }

    /// True when microVMs can boot natively on this host.
    pub fn can_boot_guests(&self) -> bool {
        matches!(self.kvm, KvmStatus::Boots { .. })
    }

    /// A human-readable report, each problem with its fix.
    pub fn report(&self) -> String {
        let mut out = String::new();
        let kvm = match &self.kvm {
            KvmStatus::Boots { kernel_release } => format!(
                "ok: a probe microVM booted (guest kernel {kernel_release}); VMs run natively on this host"
            ),
            KvmStatus::NestedPvm => "NO: /dev/kvm here is nested PVM (the kvm_pvm module is loaded), which cannot boot stock guest kernels such as libkrunfw's. \
krunbox's test command and example therefore run VMs inside a QEMU-emulated L1 VM with nested SVM (scripts/nested.sh): \
slower, but real microVMs."
                .to_string(),
            KvmStatus::Unavailable { reason } => format!(
                "NO: {reason}. Load KVM (modprobe kvm_intel or kvm_amd), give this user access to /dev/kvm (group kvm), or use the nested harness (scripts/nested.sh)"
            ),
            KvmStatus::BootFailed { error } => format!(
                "NO: KVM opens, but a probe microVM failed: {error}. Use the nested harness (scripts/nested.sh) on this host"
            ),
            KvmStatus::NotProbed { reason } => format!(
                "unknown: /dev/kvm works, but the boot probe could not run ({reason}); run scripts/setup.sh, then `krunbox doctor` again"
            ),
        };
        let _ = writeln!(out, "KVM:          {kvm}");
        let line = |out: &mut String, name: &str, r: &Result<PathBuf, String>| {
            let _ = match r {
                Ok(p) => writeln!(out, "{name:<14}ok: {}", p.display()),
                Err(e) => writeln!(out, "{name:<14}MISSING: {e}"),
            };
        };
        line(&mut out, "VMM helper:", &self.vmm_helper);
        line(&mut out, "guest-init:", &self.guest_init);
        line(&mut out, "libkrunfw:", &self.libkrunfw);
        line(&mut out, "mke2fs:", &self.mke2fs);
        match &self.isolation {
            Ok(isolation) => {
                let breaches = isolation.breaches();
                let verdict = if breaches.is_empty() {
                    "ok: every canary was blocked"
                } else {
                    "BREACHED: a canary got through, so krunbox refuses to boot here"
                };
                let _ = writeln!(
                    out,
                    "Isolation:    {verdict}; the VMM helper's jail on this host:"
                );
                out.push_str(&isolation.to_string());
            }
            Err(e) => {
                let _ = writeln!(out, "Isolation:    unknown: {e}");
            }
        }
        for (image, state) in &self.images {
            let label = format!("image {}:", image.name());
            let _ = match state {
                ImageState::Ready { sha256 } => writeln!(out, "{label:<14}ok: sha256 {sha256}"),
                ImageState::Missing => writeln!(
                    out,
                    "{label:<14}not built (built on first use, or now with `krunbox-rootfs build {}`)",
                    image.name()
                ),
                ImageState::Broken { reason } => writeln!(
                    out,
                    "{label:<14}BROKEN: {reason}; rebuild with `krunbox-rootfs build --force {}`",
                    image.name()
                ),
            };
        }
        out
    }
}

fn image_states(cache: &Path) -> Vec<(BuiltinImage, ImageState)> {
    BuiltinImage::ALL
        .iter()
        .map(|&image| {
            let state = match krunbox_rootfs::load(cache, image) {
                Ok(None) => ImageState::Missing,
                Err(e) => ImageState::Broken {
                    reason: e.to_string(),
                },
                Ok(Some(manifest)) => {
                    let path = krunbox_rootfs::image_path(cache, image);
                    match crate::rootfs::verify(
                        &path,
                        &manifest.format,
                        &manifest.sha256,
                        Some(&crate::rootfs::seal::seals_dir(cache)),
                    ) {
                        Ok(v) => ImageState::Ready { sha256: v.sha256 },
                        Err(e) => ImageState::Broken {
                            reason: e.to_string(),
                        },
                    }
                }
            };
            (image, state)
        })
        .collect()
}

async fn probe_boot(vmm_helper: &Path, guest_init: &Path) -> Result<String, String> {
    let sandbox = Sandbox::builder()
        .rootfs(Rootfs::builtin(BuiltinImage::Busybox))
        .vmm_helper(vmm_helper)
        .guest_init(guest_init)
        .memory_mib(256)
        // Long enough for a slow (nested, or busy) host and one retry of a stalled boot;
        // a host whose KVM hangs guests costs this once.
        .boot_timeout(Duration::from_secs(120))
        .build()
        .map_err(|e| e.to_string())?;
    let vm = sandbox.boot().await.map_err(|e| e.to_string())?;
    let out = vm
        .command("uname")
        .arg("-r")
        .output()
        .await
        .map_err(|e| e.to_string())?;
    let _ = vm.shutdown().await;
    if !out.status.success() {
        return Err(format!("probe command failed: {}", out.status));
    }
    Ok(out.stdout_text().trim().to_string())
}
