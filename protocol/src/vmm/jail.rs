//! The helper's jail as both sides see it: what the library asks of it ([`JailConfig`]), and
//! the report the helper sends back ([`Isolation`], in a [`HelperReport`]).
//!
//! libkrun emulates devices in the helper's process. A bug there, driven by a hostile guest, runs
//! code as the helper; the jail decides what that code can reach. Before it calls
//! `krun_start_enter` (and so before any guest code runs), the helper:
//!
//! 1. enters fresh user, mount, network, IPC, UTS and pid namespaces (where the kernel allows
//!    them; for the pid namespace it forks, and the child, pid 1 there, runs the VM), and pivots into an empty tmpfs root holding only what libkrun opens: `/dev/kvm`, the root
//!    image, the console pipe, the control socket and a custom kernel if one is set;
//! 2. sets rlimits (no core dumps, bounded descriptors, bounded log size);
//! 3. sets `no_new_privs` and drops every capability;
//! 4. restricts itself with Landlock (filesystem, TCP and scopes, as far as the kernel's ABI goes);
//! 5. installs a seccomp allowlist of the system calls libkrun needs to run a VM;
//! 6. runs the canaries: it tries to read a canary file the library created, to connect to a
//!    canary TCP listener on host loopback and to canary unix sockets (by path and abstract),
//!    and to make a system call outside the allowlist. Each must fail.
//!
//! The helper writes what it did as an [`Isolation`] report on a pipe, then either starts the VM
//! or, if a canary got through or a layer the definition requires is missing, exits without
//! starting it. krunbox's `Instance::isolation` returns the report.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Why the helper must not start the VM, if it must not: a canary got through (whatever the
/// definition asked), or a layer the definition requires is missing.
pub fn refusal(config: &JailConfig, isolation: &Isolation) -> Option<String> {
    let breaches = isolation.breaches();
    if !breaches.is_empty() {
        let list: Vec<String> = breaches
            .iter()
            .map(|b| format!("{} ({})", b.canary, b.detail))
            .collect();
        return Some(format!("canaries got through: {}", list.join(", ")));
    }
    let missing = isolation.missing(&config.required);
    if !missing.is_empty() {
        let list: Vec<String> = missing
            .iter()
            .map(|l| format!("{} ({})", l.layer, l.detail))
            .collect();
        return Some(format!("required layers missing: {}", list.join(", ")));
    }
    None
}

/// One layer of the VMM helper's confinement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Layer {
    /// A user namespace of its own: capabilities the helper has apply only inside it.
    UserNamespace,
    /// A mount namespace whose root is an empty tmpfs holding only the files libkrun opens.
    MountNamespace,
    /// A network namespace with no interface but a down loopback: no host network at all.
    NetworkNamespace,
    /// IPC and UTS namespaces of its own (System V IPC, hostname).
    IpcNamespace,
    /// A PID namespace of its own: the VMM is its pid 1 and cannot name a host process by pid.
    PidNamespace,
    /// rlimits: no core dumps, a bounded number of descriptors, bounded log file size.
    Rlimits,
    /// `PR_SET_NO_NEW_PRIVS`: no exec can ever gain privileges.
    NoNewPrivs,
    /// Every capability dropped (effective, permitted, inheritable, ambient, bounding set).
    Capabilities,
    /// Landlock filesystem rules: only the files libkrun opens.
    Landlock,
    /// Landlock network rules: no TCP bind or connect (Landlock ABI 4, Linux 6.7).
    LandlockNetwork,
    /// Landlock scopes: no signals to, and no abstract unix sockets of, processes outside the
    /// jail (Landlock ABI 6, Linux 6.12).
    LandlockScope,
    /// A seccomp-bpf allowlist of the system calls libkrun needs.
    Seccomp,
    /// A cgroup (v2) of the instance's own, made by the library before the helper starts:
    /// `memory.max`, `pids.max` and `cpu.max` bound the helper and its VMM, and account them.
    Cgroup,
}

impl Layer {
    /// Every layer, in the order the helper applies them.
    pub const ALL: [Layer; 13] = [
        Layer::UserNamespace,
        Layer::MountNamespace,
        Layer::NetworkNamespace,
        Layer::IpcNamespace,
        Layer::PidNamespace,
        Layer::Rlimits,
        Layer::NoNewPrivs,
        Layer::Capabilities,
        Layer::Landlock,
        Layer::LandlockNetwork,
        Layer::LandlockScope,
        Layer::Seccomp,
        Layer::Cgroup,
    ];

    fn name(self) -> &'static str {
        match self {
            Layer::UserNamespace => "user namespace",
            Layer::MountNamespace => "mount namespace",
            Layer::NetworkNamespace => "network namespace",
            Layer::IpcNamespace => "ipc+uts namespaces",
            Layer::PidNamespace => "pid namespace",
            Layer::Rlimits => "rlimits",
            Layer::NoNewPrivs => "no_new_privs",
            Layer::Capabilities => "capabilities dropped",
            Layer::Landlock => "landlock filesystem",
            Layer::LandlockNetwork => "landlock network",
            Layer::LandlockScope => "landlock scopes",
            Layer::Seccomp => "seccomp allowlist",
            Layer::Cgroup => "cgroup",
        }
    }
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether a layer is in force, and what the helper saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerReport {
    /// The layer.
    pub layer: Layer,
    /// `true` if the layer is in force for the helper and everything it starts.
    pub enforced: bool,
    /// What was applied, or why the host could not provide it.
    pub detail: String,
}

/// Something the confined helper tries and must not be able to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Canary {
    /// Read a file the library created for the purpose, outside the helper's allowed set.
    HostFile,
    /// Connect to a TCP listener the library opened on host loopback.
    HostLoopback,
    /// Connect to a unix socket the library listens on by path (as the session bus, a docker
    /// socket or an ssh agent would): reachable, it would let the helper drive host services.
    HostUnixSocket,
    /// Connect to a unix socket the library listens on in the abstract namespace.
    HostAbstractSocket,
    /// Make a system call outside the seccomp allowlist (`process_vm_readv` on itself).
    DeniedSyscall,
}

impl fmt::Display for Canary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Canary::HostFile => "read a host file",
            Canary::HostLoopback => "connect to host loopback",
            Canary::HostUnixSocket => "connect to a host unix socket",
            Canary::HostAbstractSocket => "connect to an abstract socket",
            Canary::DeniedSyscall => "a denied system call",
        })
    }
}

/// The outcome of one canary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CanaryReport {
    /// The canary.
    pub canary: Canary,
    /// `true` if the attempt failed, as it must.
    pub blocked: bool,
    /// How it failed (the error the helper got), or that it succeeded.
    pub detail: String,
}

/// The VMM helper's confinement, as the helper reported it before it started the VM (krunbox's
/// `Instance::isolation` returns it; `SandboxBuilder::require_isolation` names layers a boot
/// must have).
///
/// ```
/// use krunbox_protocol::vmm::jail::{Canary, Isolation, Layer};
///
/// let mut isolation = Isolation::default();
/// isolation.push_layer(Layer::Seccomp, true, "an allowlist of 80 system calls");
/// isolation.push_canary(Canary::HostFile, true, "EACCES".into());
/// assert!(isolation.is_enforced(Layer::Seccomp));
/// assert!(isolation.missing(&[Layer::Landlock]).len() == 1);
/// assert!(isolation.breaches().is_empty());
/// println!("{isolation}");
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Isolation {
    layers: Vec<LayerReport>,
    canaries: Vec<CanaryReport>,
    /// Microseconds the helper spent on the jail and the canaries.
    #[serde(default)]
    setup_micros: u64,
}

impl Isolation {
    /// Every layer, in force or not.
    pub fn layers(&self) -> &[LayerReport] {
        &self.layers
    }

    /// Every canary's outcome.
    pub fn canaries(&self) -> &[CanaryReport] {
        &self.canaries
    }

    /// How long the helper took to apply the jail and run the canaries (part of every boot).
    pub fn setup_time(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.setup_micros)
    }

    /// Adds the time the jail took (the helper, as it goes).
    #[doc(hidden)]
    pub fn add_setup_time(&mut self, spent: std::time::Duration) {
        self.setup_micros += spent.as_micros() as u64;
    }

    /// Whether `layer` is in force.
    pub fn is_enforced(&self, layer: Layer) -> bool {
        self.layers.iter().any(|l| l.layer == layer && l.enforced)
    }

    /// The layers of `required` that are not in force, with the reason for each.
    pub fn missing(&self, required: &[Layer]) -> Vec<LayerReport> {
        required
            .iter()
            .filter(|layer| !self.is_enforced(**layer))
            .map(|layer| {
                self.layers
                    .iter()
                    .find(|l| l.layer == *layer)
                    .cloned()
                    .unwrap_or(LayerReport {
                        layer: *layer,
                        enforced: false,
                        detail: "not reported by the helper".into(),
                    })
            })
            .collect()
    }

    /// The canaries that got through (empty when the jail holds).
    pub fn breaches(&self) -> Vec<CanaryReport> {
        self.canaries
            .iter()
            .filter(|c| !c.blocked)
            .cloned()
            .collect()
    }

    /// The report of `layer`, to be completed by the step that learns more about it.
    #[doc(hidden)]
    pub fn layer_mut(&mut self, layer: Layer) -> Option<&mut LayerReport> {
        self.layers.iter_mut().find(|l| l.layer == layer)
    }

    #[doc(hidden)]
    pub fn push_layer(&mut self, layer: Layer, enforced: bool, detail: impl Into<String>) {
        self.layers.push(LayerReport {
            layer,
            enforced,
            detail: detail.into(),
        });
    }

    #[doc(hidden)]
    pub fn push_canary(&mut self, canary: Canary, blocked: bool, detail: String) {
        self.canaries.push(CanaryReport {
            canary,
            blocked,
            detail,
        });
    }
}

impl fmt::Display for Isolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for l in &self.layers {
            let mark = if l.enforced { "on " } else { "OFF" };
            writeln!(f, "  [{mark}] {:<22} {}", l.layer.to_string(), l.detail)?;
        }
        for c in &self.canaries {
            let mark = if c.blocked { "blocked" } else { "REACHED" };
            writeln!(
                f,
                "  canary {:<26} {mark}: {}",
                c.canary.to_string(),
                c.detail
            )?;
        }
        writeln!(
            f,
            "  jail and canaries took {:.1} ms of the boot",
            self.setup_micros as f64 / 1000.0
        )
    }
}

/// What the helper writes on its report pipe.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HelperReport {
    /// The pid of the process that runs the VM, as the host sees it (with a pid namespace it is
    /// a child of the process the library started).
    pub vmm_pid: u32,
    /// The jail.
    pub isolation: Isolation,
}

/// The largest report the library reads from the helper's report pipe.
pub const REPORT_MAX_BYTES: u64 = 64 * 1024;

/// What the library tells the helper about its jail (part of the VMM configuration).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct JailConfig {
    /// An empty directory the helper mounts its new root on (inside its own mount namespace, so
    /// nothing of that mount is visible outside).
    pub root_dir: PathBuf,
    /// A file only the library should be able to read: the host-file canary.
    pub canary_file: PathBuf,
    /// A TCP port on 127.0.0.1 where the library listens: the loopback canary.
    pub canary_port: u16,
    /// A unix socket the library listens on by path: the host-unix-socket canary.
    pub canary_socket: PathBuf,
    /// The name of a unix socket the library listens on in the abstract namespace.
    pub canary_abstract: String,
    /// Layers the definition requires: the helper refuses to start the VM without them.
    pub required: Vec<Layer>,
    /// The cgroup the library put the helper in, or why it could not.
    pub cgroup: CgroupPlacement,
}

/// Where the library placed the helper (`JailConfig::cgroup`): the helper checks it is there
/// before it reports the layer in force.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum CgroupPlacement {
    /// In this cgroup (its path as `/proc/self/cgroup` shows it), with these limits.
    Placed {
        /// The path below the cgroup2 mount.
        path: String,
        /// What was set, for the report.
        limits: String,
    },
    /// In none of its own, for this reason.
    Unavailable {
        /// Why, for the report.
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_layers_carry_the_helpers_reason() {
        let mut iso = Isolation::default();
        iso.push_layer(Layer::Seccomp, true, "42 system calls");
        iso.push_layer(Layer::Landlock, false, "the kernel has no Landlock");
        let missing = iso.missing(&[Layer::Seccomp, Layer::Landlock, Layer::PidNamespace]);
        assert_eq!(missing.len(), 2);
        assert_eq!(missing[0].detail, "the kernel has no Landlock");
        assert_eq!(missing[1].detail, "not reported by the helper");
        assert!(iso.is_enforced(Layer::Seccomp));
    }

    #[test]
    fn a_canary_that_got_through_is_a_breach() {
        let mut iso = Isolation::default();
        iso.push_canary(Canary::HostFile, true, "EACCES".into());
        iso.push_canary(Canary::HostLoopback, false, "connected".into());
        let breaches = iso.breaches();
        assert_eq!(breaches.len(), 1);
        assert_eq!(breaches[0].canary, Canary::HostLoopback);
        assert!(iso.to_string().contains("REACHED"));
    }
}
