//! What the library tells the helper about its jail, as part of the helper's configuration.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::Layer;

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
