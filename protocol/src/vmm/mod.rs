//! The contract between the library and its `krunbox-vmm` helper, one per running VM: the
//! helper's configuration ([`VmmConfig`], JSON on a file the library writes), the descriptors
//! it inherits, each by its role ([`Inherited`]), its exit codes, and its jail's contract and
//! report ([`jail`]). Both sides are built from the same sources: the format is private to one
//! build, and everything the helper says is still read as a compromised helper could say it.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use jail::JailConfig;

pub mod command;
pub mod jail;

/// A descriptor the helper inherits, by its role; [`Inherited::fd`] is the number it has in
/// the helper. The library passes each at exactly that number and the helper takes each back
/// by its role, so neither side writes a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Inherited {
    /// The verified root image, read-only.
    RootImage,
    /// The read end of the lifeline pipe: EOF means the instance is gone.
    Lifeline,
    /// guest-init's binary.
    GuestInit,
    /// The write end of the pipe the isolation report goes on.
    Report,
    /// The helper's end of the guest's network link.
    Network,
    /// A writable root's layer disk.
    WritableLayer,
    /// The guest's memory file.
    GuestMemory,
    /// Served disk `i` ([`VmmConfig::served_disks`]): a socket to the library, or the file
    /// served in place.
    ServedDisk(usize),
    /// Served disk `i`'s failure count, for a disk served in place.
    ServedDiskFailures(usize),
    /// Mount `i`'s socket ([`VmmConfig::fs_devices`]).
    FsDevice(usize),
    /// The helper's end of the command socket ([`command`]).
    Command,
    /// The file the VM's saved state goes through ([`command`]).
    MachineState,
    /// A restore's gate: the helper's end of a socket pair on which the library writes the
    /// machine state's length once the guest memory and the machine-state file hold the
    /// snapshot (EOF: they never will).
    RestoreGate,
    /// The file the helper writes the guest's own pages to, for a snapshot or fork of a VM
    /// whose memory is mapped copy-on-write ([`command::VmmCommand::WritePrivatePages`]).
    PrivatePages,
}

impl Inherited {
    /// The descriptor's number in the helper, or `None` for an index past what the helper
    /// takes ([`MAX_SERVED_DISKS`] disks, [`MAX_FS_DEVICES`] mounts).
    pub const fn fd(self) -> Option<i32> {
        match self {
            Inherited::RootImage => Some(ROOT_IMAGE_FD),
            Inherited::Lifeline => Some(LIFELINE_FD),
            Inherited::GuestInit => Some(GUEST_INIT_FD),
            Inherited::Report => Some(REPORT_FD),
            Inherited::Network => Some(NET_FD),
            Inherited::WritableLayer => Some(WRITABLE_LAYER_FD),
            Inherited::GuestMemory => Some(GUEST_MEMORY_FD),
            Inherited::Command => Some(COMMAND_FD),
            Inherited::MachineState => Some(MACHINE_STATE_FD),
            Inherited::RestoreGate => Some(RESTORE_GATE_FD),
            Inherited::PrivatePages => Some(PRIVATE_PAGES_FD),
            Inherited::ServedDisk(i) if i < MAX_SERVED_DISKS => {
                Some(SERVED_DISK_FD_BASE + i as i32)
            }
            Inherited::ServedDiskFailures(i) if i < MAX_SERVED_DISKS => {
                Some(SERVED_DISK_FAILURES_FD_BASE + i as i32)
            }
            Inherited::FsDevice(i) if i < MAX_FS_DEVICES => Some(FS_DEVICE_FD_BASE + i as i32),
            _ => None,
        }
    }
}

/// The most mounts' sockets the helper takes: a VM has 11 device interrupts, of which libkrun's
/// own devices take 6 (krunbox's `fs::MAX_MOUNTS` is 5).
pub const MAX_FS_DEVICES: usize = 5;

/// The file descriptor number the root image is passed on.
const ROOT_IMAGE_FD: i32 = 3;

/// The file descriptor of the helper's lifeline: the read end of a pipe whose write end only the
/// library's instance holds. EOF means the instance (or the whole library process) is gone, and
/// the helper exits at once. Unlike `PR_SET_PDEATHSIG`, this follows the process, not the thread
/// that happened to spawn the helper.
const LIFELINE_FD: i32 = 4;

/// The file descriptor guest-init's binary is passed on. The helper reads it into memory and
/// serves it as the guest's `/init.krun` from a virtio-fs device that has no host directory
/// behind it (see `configure`).
const GUEST_INIT_FD: i32 = 5;

/// The file descriptor of the pipe the helper writes its [`Isolation`] report to (JSON), before
/// it starts the VM or refuses to.
const REPORT_FD: i32 = 6;

/// The file descriptor of the helper's end of the guest's network link (a connected unix
/// stream socket; the library serves the other end), passed only when the definition has a
/// network. The helper hands it to libkrun as the virtio-net device's backend.
const NET_FD: i32 = 7;

/// The file descriptor of a writable root's layer disk (a sealed memfd holding ext4; see
/// `rootfs/layer.rs`), passed only when the root is writable. libkrun opens it read-write as
/// the guest's second disk, through the helper's `/proc/self/fd`.
const WRITABLE_LAYER_FD: i32 = 8;

/// The first of the helper's ends of the served disks' sockets (connected unix stream sockets;
/// the library serves the other ends), one per [`VmmConfig::served_disks`] entry, at most
/// [`MAX_SERVED_DISKS`]. The helper's virtio-blk devices forward the guest's requests on them,
/// or, for a disk served in place, read and write the regular file open there.
const SERVED_DISK_FD_BASE: i32 = 9;

/// The most served disks: a copy-on-write root's layer disk and an image build's output disk.
pub const MAX_SERVED_DISKS: usize = 2;

/// For a disk served in place, the first of its failure counts: an eventfd per such disk
/// (`SERVED_DISK_FAILURES_FD_BASE + i` for [`VmmConfig::served_disks`] entry `i`), to which
/// the helper's device adds one for every read, write or flush of the file that failed, so
/// that the library, which sees none of the I/O, can report them once the VM has stopped.
const SERVED_DISK_FAILURES_FD_BASE: i32 = SERVED_DISK_FD_BASE + MAX_SERVED_DISKS as i32;

/// The first of the helper's filesystem device sockets (see [`VmmConfig::fs_devices`]); one
/// per mount (at most krunbox's `fs::MAX_MOUNTS`, fewer beside a network, a writable
/// root's layer or an output disk, which take devices too).
const FS_DEVICE_FD_BASE: i32 = 16;

/// The guest's memory: a sealed memfd of the library's (see [`VmmConfig::guest_memory_file`]).
const GUEST_MEMORY_FD: i32 = 13;

/// The helper's end of its command socket (a unix `SOCK_SEQPACKET` pair; [`command`]), passed
/// to every helper that starts a VM: the library's way to pause the vCPUs and read or set the
/// VM's state once the VM runs.
const COMMAND_FD: i32 = 14;

/// A memfd of the library's, passed with the command socket: the helper writes the VM's
/// saved state there ([`command::VmmCommand::SaveMachineState`]) and reads the state to set
/// from it, at most [`command::MAX_STATE_BYTES`].
const MACHINE_STATE_FD: i32 = 15;

/// A restore's gate ([`Inherited::RestoreGate`]), passed with [`VmmConfig::restore`]: the
/// helper jails itself and builds the VM while the library copies the snapshot into the guest
/// memory, and reads the state only once the gate opens: the library writes the state's
/// length there, a little-endian `u64` (EOF first: the restore failed).
const RESTORE_GATE_FD: i32 = FS_DEVICE_FD_BASE + MAX_FS_DEVICES as i32;

/// A memfd of the library's as long as the guest memory file, its size sealed, passed with
/// the command socket when the guest memory file is: the helper writes the pages the guest
/// made its own there ([`command::VmmCommand::WritePrivatePages`]), at their offsets in the
/// guest memory file.
const PRIVATE_PAGES_FD: i32 = RESTORE_GATE_FD + 1;

/// The helper's exit code when it refused to start the VM because its jail did not hold (a
/// canary got through) or a required isolation layer is missing. The report says which.
pub const ISOLATION_EXIT_CODE: i32 = 71;

/// The helper's exit code when its lifeline broke (the instance or the library process went).
pub const LIFELINE_EXIT_CODE: i32 = 70;

/// Everything the helper needs to configure libkrun. Written as JSON by the library, read by
/// `krunbox-vmm`; both are built from the same sources, so the format is private to one build.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VmmConfig {
    /// vCPUs.
    pub cpus: u8,
    /// Guest RAM in MiB.
    pub memory_mib: u32,
    /// Filesystem type of the root image (on fd [`ROOT_IMAGE_FD`]).
    pub root_fstype: String,
    /// The root image is a qcow2 (a flattened root), not a raw filesystem image. The library
    /// checked that it names no other file.
    #[serde(default)]
    pub root_qcow2: bool,
    /// The root image's path, only to find it again inside the helper's mount namespace: the
    /// file opened there must be the very file of [`ROOT_IMAGE_FD`] (same device and inode).
    pub root_image: PathBuf,
    /// Host unix socket bridged to guest vsock port [`CONTROL_PORT`](crate::CONTROL_PORT).
    pub control_socket: PathBuf,
    /// Host filesystems: a virtio-fs device each, tagged
    /// [`mount_tag`](crate::mount_tag)`(i)`, forwarding to the socket on fd
    /// [`FS_DEVICE_FD_BASE`]` + i`.
    #[serde(default)]
    pub fs_devices: u32,
    /// The guest's memory is the file on [`GUEST_MEMORY_FD`] (every region, the kernel's
    /// too), which the library maps as well; the filesystem devices then hand their queues
    /// over to the library when the guest activates them, instead of forwarding each request.
    #[serde(default)]
    pub guest_memory_file: bool,
    /// The guest memory file is mapped copy-on-write (the file is only read; it may be
    /// read-only): a restore from a snapshot's memory or from a fork's source's frozen memory.
    /// No filesystem device then: the library could not see the guest's writes.
    #[serde(default)]
    pub guest_memory_private: bool,
    /// The helper serves the library's commands on [`COMMAND_FD`] ([`command`]) once the VM
    /// runs, the VM's state going through [`MACHINE_STATE_FD`].
    #[serde(default)]
    pub command_socket: bool,
    /// Restore the VM from a snapshot instead of booting it: once the library opens the gate
    /// on [`RESTORE_GATE_FD`], the guest memory file holds the snapshot's memory and the file
    /// on [`MACHINE_STATE_FD`] its state, of the length the gate says.
    #[serde(default)]
    pub restore: bool,
    /// The FIFO the guest console goes to; the library drains it into a bounded log.
    pub console: PathBuf,
    /// The helper's jail.
    pub jail: JailConfig,
    /// A custom kernel instead of libkrunfw's.
    pub kernel: Option<KernelConfig>,
    /// libkrun log level (0 off … 5 trace).
    pub log_level: u32,
    /// A virtio-net device on [`NET_FD`], or none at all.
    pub network: Option<NetDeviceConfig>,
    /// Benchmarks only: a host directory served by libkrun's own virtio-fs passthrough
    /// (krunbox's `SandboxBuilder::virtiofs_passthrough_for_benchmarks`).
    #[serde(default)]
    pub virtiofs_passthrough: Option<PassthroughShare>,
    /// A writable root's layer disk on [`WRITABLE_LAYER_FD`], or none for a read-only root.
    #[serde(default)]
    pub writable_layer: Option<LayerDisk>,
    /// Disks the library serves over [`SERVED_DISK_FD_BASE`]` + i` (a copy-on-write root's
    /// layer disk, an image build's output): a virtio-blk device of ours each, after the
    /// filesystems'.
    #[serde(default)]
    pub served_disks: Vec<ServedDiskConfig>,
}

/// A disk the library serves, as the helper's device shows it to the guest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ServedDiskConfig {
    /// The disk's size in bytes.
    pub size: u64,
    /// The serial guest-init finds it by.
    pub serial: String,
    /// Its fd is a regular file the device reads and writes in place (a block store's file,
    /// an image build's output), not a socket to the library. The helper's `RLIMIT_FSIZE`
    /// is then at least `size`.
    #[serde(default)]
    pub in_place: bool,
}

/// A writable root's layer disk, as the helper attaches it.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct LayerDisk {
    /// The most bytes the disk's file may take on the host (the helper's `RLIMIT_FSIZE`).
    pub max_file_bytes: u64,
    /// qcow2 (a persistent layer) or raw (an ephemeral one).
    pub qcow2: bool,
}

/// Benchmarks only: a host directory the guest can mount as virtio-fs `tag`, served by
/// libkrun's passthrough server inside the helper. Not a way to share a directory: that server
/// does not jail itself (see `SandboxBuilder::virtiofs_passthrough_for_benchmarks`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PassthroughShare {
    /// The virtio-fs tag the guest mounts (`mount -t virtiofs TAG DIR`).
    pub tag: String,
    /// The host directory (absolute).
    pub dir: PathBuf,
}

/// The guest's network device.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NetDeviceConfig {
    /// The guest's MAC address.
    pub mac: [u8; 6],
}

/// A custom guest kernel.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct KernelConfig {
    /// Kernel image.
    pub path: PathBuf,
    /// libkrun's `KRUN_KERNEL_FORMAT_*` number.
    pub format: u32,
    /// The whole kernel command line, or `None` for libkrun's default.
    pub cmdline: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every role has its own number, above the standard three, and indexes past what the
    /// helper takes have none.
    #[test]
    fn each_inherited_descriptor_has_a_number_of_its_own() {
        let mut roles = vec![
            Inherited::RootImage,
            Inherited::Lifeline,
            Inherited::GuestInit,
            Inherited::Report,
            Inherited::Network,
            Inherited::WritableLayer,
            Inherited::GuestMemory,
            Inherited::Command,
            Inherited::MachineState,
            Inherited::RestoreGate,
            Inherited::PrivatePages,
        ];
        for i in 0..MAX_SERVED_DISKS {
            roles.push(Inherited::ServedDisk(i));
            roles.push(Inherited::ServedDiskFailures(i));
        }
        roles.extend((0..MAX_FS_DEVICES).map(Inherited::FsDevice));
        let fds: Vec<i32> = roles.iter().map(|r| r.fd().expect("a number")).collect();
        let distinct: std::collections::HashSet<i32> = fds.iter().copied().collect();
        assert_eq!(
            distinct.len(),
            fds.len(),
            "two roles share a number: {fds:?}"
        );
        assert!(fds.iter().all(|fd| *fd > 2));
        assert_eq!(Inherited::ServedDisk(MAX_SERVED_DISKS).fd(), None);
        assert_eq!(Inherited::ServedDiskFailures(MAX_SERVED_DISKS).fd(), None);
        assert_eq!(Inherited::FsDevice(MAX_FS_DEVICES).fd(), None);
    }
}
