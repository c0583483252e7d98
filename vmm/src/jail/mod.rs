//! The jail, in the helper: the layers that confine `krunbox-vmm` (`confine.rs`), its seccomp
//! allowlist (`seccomp.rs`) and the canaries that prove them at every boot (`canary.rs`). What
//! the library asks of it and the report it gets back are `krunbox_protocol::vmm::jail`'s.

mod canary;
mod confine;
mod seccomp;

pub(crate) use canary::run as run_canaries;
pub(crate) use confine::{
    build_root, enter_namespaces, fork_into_pid_namespace, report_cgroup, restrict, JailPaths,
    LayerPath,
};
