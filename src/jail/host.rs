//! The library's side of the jail: what it prepares for the helper (an empty directory for the
//! jail's root, the canary file, the canary listener) and how it reads the helper's report.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use super::{HelperReport, Isolation, JailConfig, Layer, REPORT_MAX_BYTES};
use crate::error::{Error, Result};

/// What one boot's jail needs on the host side. The canary listeners live as long as this.
#[derive(Debug)]
pub(crate) struct JailHost {
    /// The helper's part, for its configuration.
    pub config: JailConfig,
    _canary_listener: std::net::TcpListener,
    _canary_socket: std::os::unix::net::UnixListener,
    _canary_abstract: std::os::unix::net::UnixListener,
}

/// Prepares the jail of a helper whose instance directory is `dir`.
pub(crate) fn prepare(dir: &Path, required: &[Layer]) -> Result<JailHost> {
    let root_dir = dir.join("jail-root");
    if !root_dir.is_dir() {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&root_dir)
            .map_err(Error::io("creating the jail's root directory"))?;
    }
    let canary_file = dir.join("canary");
    let mut token = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut token))
        .map_err(Error::io("reading /dev/urandom"))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&canary_file)
        .and_then(|mut f| std::io::Write::write_all(&mut f, hex::encode(token).as_bytes()))
        .map_err(Error::io("writing the canary file"))?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(Error::io("opening the loopback canary listener"))?;
    let canary_port = listener
        .local_addr()
        .map_err(Error::io("reading the canary listener's port"))?
        .port();
    let canary_socket = dir.join("canary.sock");
    let _ = std::fs::remove_file(&canary_socket);
    let socket_listener = std::os::unix::net::UnixListener::bind(&canary_socket)
        .map_err(Error::io("opening the unix socket canary listener"))?;
    let canary_abstract = format!("krunbox-canary-{}", hex::encode(token));
    let abstract_listener = {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(canary_abstract.as_bytes())
            .and_then(|addr| std::os::unix::net::UnixListener::bind_addr(&addr))
            .map_err(Error::io("opening the abstract socket canary listener"))?
    };
    Ok(JailHost {
        config: JailConfig {
            root_dir,
            canary_file,
            canary_port,
            canary_socket,
            canary_abstract,
            required: required.to_vec(),
            cgroup: super::CgroupPlacement::Unavailable {
                reason: "not placed in one".into(),
            },
        },
        _canary_listener: listener,
        _canary_socket: socket_listener,
        _canary_abstract: abstract_listener,
    })
}

/// Reads the helper's report from the read end of its report pipe, to EOF (the helper closes
/// its end before it starts the VM or refuses to). `None` if the helper wrote none (it failed
/// earlier) or wrote something that is not a report.
pub(crate) async fn read_report(pipe: OwnedFd) -> Option<HelperReport> {
    tokio::task::spawn_blocking(move || {
        let mut bytes = Vec::new();
        std::fs::File::from(pipe)
            .take(REPORT_MAX_BYTES)
            .read_to_end(&mut bytes)
            .ok()?;
        serde_json::from_slice(&bytes).ok()
    })
    .await
    .ok()
    .flatten()
}

/// Runs the helper in probe mode (`--probe-isolation`): it applies the whole jail and runs the
/// canaries exactly as before a boot, reports, and exits without starting a VM. Needs no KVM
/// and no image, so `krunbox doctor` can show what this host provides even where guests cannot
/// boot.
pub(crate) async fn probe(
    helper: &Path,
    libkrunfw_dir: &Path,
) -> std::result::Result<Isolation, String> {
    use std::os::fd::AsRawFd;
    let dir = tempfile::Builder::new()
        .prefix("krunbox-probe-")
        .tempdir_in(crate::artifacts::runtime_dir())
        .map_err(|e| format!("creating a probe directory: {e}"))?;
    // What the jail binds into its root must exist, as at a boot.
    let console = dir.path().join(crate::logs::CONSOLE_FIFO);
    nix::unistd::mkfifo(
        &console,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .map_err(|e| format!("creating the probe's console FIFO: {e}"))?;
    let socket = dir.path().join("control.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket)
        .map_err(|e| format!("binding the probe's control socket: {e}"))?;
    let mut jail = prepare(dir.path(), &[]).map_err(|e| e.to_string())?;
    // A cgroup as a boot would make one (removed when the probe ends).
    let (cgroup, placement) = crate::cgroup::for_instance(
        &format!("probe-{}", std::process::id()),
        128,
        0,
        crate::DEFAULT_HOST_MEMORY_OVERHEAD,
        1,
    );
    jail.config.cgroup = placement;
    let cgroup_procs = match &cgroup {
        Some(cgroup) => Some(
            cgroup
                .procs()
                .map_err(|e| format!("opening the cgroup's procs: {e}"))?,
        ),
        None => None,
    };
    let config = krunbox_protocol::vmm::VmmConfig {
        cpus: 1,
        memory_mib: 128,
        root_fstype: "erofs".into(),
        root_qcow2: false,
        root_image: "/dev/null".into(),
        control_socket: socket,
        fs_devices: 0,
        guest_memory_file: false,
        guest_memory_private: false,
        command_socket: false,
        restore: false,
        served_disks: Vec::new(),
        console,
        jail: jail.config.clone(),
        kernel: None,
        log_level: 1,
        network: None,
        virtiofs_passthrough: None,
        writable_layer: None,
    };
    let config_path = dir.path().join("vmm.json");
    std::fs::write(
        &config_path,
        serde_json::to_vec(&config).expect("VmmConfig serialises"),
    )
    .map_err(|e| format!("writing the probe configuration: {e}"))?;
    let log_path = dir.path().join("vmm.log");
    let log =
        std::fs::File::create(&log_path).map_err(|e| format!("creating the probe log: {e}"))?;
    let (report_read, report_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| format!("creating the report pipe: {e}"))?;
    let mut child = crate::helper::spawn(
        helper,
        libkrunfw_dir,
        &["--probe-isolation".as_ref(), config_path.as_os_str()],
        &[(
            report_write.as_raw_fd(),
            krunbox_protocol::vmm::Inherited::Report,
        )],
        log.into(),
        cgroup_procs.as_ref(),
    )
    .map_err(|e| e.to_string())?;
    drop(report_write);
    let report = read_report(report_read).await;
    let status = child.wait().await.map_err(|e| e.to_string())?;
    report.map(|r| r.isolation).ok_or_else(|| {
        format!(
            "the VMM helper wrote no isolation report ({status}): {}",
            crate::helper::log_tail(&[&log_path], 5).trim()
        )
    })
}
