//! FUSE: the wire format between the guest kernel and this module.
//!
//! The library takes the guest kernel's FUSE requests off a mount's queues (`super::served`);
//! here each is decoded (`request.rs`: bounded, validated, never panicking), answered by the mount's
//! [`VirtualFs`](crate::fs::VirtualFs) (`session.rs`) and encoded (`reply.rs`). The kernel ABI's
//! structures come from the `fuse-backend-rs` crate; what is ours is the decoding of hostile
//! bytes into typed requests and the async dispatch, which no crate offers over an
//! implementation-defined transport and an async trait.

pub(crate) mod fuzz;
pub(crate) mod reply;
pub(crate) mod request;
pub(crate) mod session;

pub(crate) use request::{is_unanswered, IN_HEADER_LEN, MAX_REQUEST, WRITE_IN_LEN, WRITE_OPCODE};
pub(crate) use session::{Session, MAX_IN_FLIGHT};
