//! guest-init: krunbox's first process inside the microVM.
//!
//! The host's VMM helper serves this binary from memory as the guest's `/init.krun` (libkrun's
//! own init is disabled), so it runs as PID 1 on a root virtio-fs that has no host directory
//! behind it. It then:
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
