//! guest-init: krunbox's first process inside the microVM.
//!
//! The host copies this binary into a per-instance boot directory that libkrun serves read-only
//! over virtio-fs as the guest's first root, where it is `/init.krun` (libkrun's own init is
//! disabled); it runs as PID 1 there, with nothing else of the host in sight. It then:
//!
//! 1. mounts `/dev`, `/proc`, `/sys`;
//! 2. connects to the host over vsock ([`krunbox_protocol::CONTROL_PORT`]) and says hello;
//! 3. receives [`krunbox_protocol::Setup`]: mounts the root image, moves the API filesystems
//!    into it, adds tmpfs scratch space, switches root, sets the hostname;
//! 4. reports ready and supervises processes until told to shut down.
//!
//! The library half holds what a hostile-guest test fixture also needs (the vsock connection).

pub mod files;
pub mod mounts;
pub mod supervisor;
pub mod sys;
pub mod vsock;
