//! guest-init: krunbox's first process inside the microVM.
//!
//! The host's VMM helper serves this binary from memory as `/init.krun` on the guest's first
//! root, a virtio-fs device with no host directory behind it (libkrun's own init is disabled);
//! it runs as PID 1 there, with nothing of the host in sight. It then:
//!
//! 1. mounts `/dev`, `/proc`, `/sys`;
//! 2. connects to the host over vsock ([`krunbox_protocol::CONTROL_PORT`]) and says hello;
//! 3. receives [`krunbox_protocol::Setup`]: mounts the root image, moves the API filesystems
//!    into it, adds tmpfs scratch space, switches root, sets the hostname and the rest of a
//!    normal system's identity ([`identity`]: hosts entry, loopback, `/dev/fd`, cgroup2);
//! 4. mounts the host filesystems (virtio-fs devices the host serves: [`host_fs`]);
//! 5. reports ready and supervises processes until told to shut down.
//!
//! The library half holds what a hostile-guest test fixture also needs (the vsock connection).

pub mod files;
pub mod host_fs;
pub mod identity;
pub mod mounts;
pub mod net;
pub mod outbox;
pub mod search;
pub mod supervisor;
pub mod sys;
pub mod trust;
pub mod vsock;
