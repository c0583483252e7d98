//! What an image says about the commands it runs (an OCI image's configuration): a sandbox
//! given one uses it for its commands' defaults and its entrypoint. The images that carry one
//! are made above `Sandbox`, in `crate::image`; this is the part a boot reads.

use serde::Deserialize;

/// What an image's configuration says about the commands it runs: what
/// [`Instance::command`](crate::Instance::command) uses by default in a sandbox given it with
/// [`SandboxBuilder::image_config`](crate::SandboxBuilder::image_config), and what
/// [`Instance::entrypoint`](crate::Instance::entrypoint) runs.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct ImageConfig {
    /// The program and first arguments of the image's entrypoint (may be empty).
    pub entrypoint: Vec<String>,
    /// The default arguments after the entrypoint (or the command, without one).
    pub cmd: Vec<String>,
    /// Variables every command gets unless it sets them itself.
    pub env: Vec<(String, String)>,
    /// The directory commands start in, if the image names one.
    pub working_dir: Option<String>,
    /// The user (uid) and group (gid) commands run as, if the image names them: a name is
    /// looked up in the image's `/etc/passwd` (and `/etc/group`), and a user without a group
    /// gets its primary group there, or 0, as a container runtime does.
    pub user: Option<(u32, u32)>,
}
