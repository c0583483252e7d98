//! What a process needs of the instance it runs in ([`Guest`]), and nothing more.
//!
//! [`Command`](super::Command) and [`Child`](super::Child) hold this rather than an
//! `Instance`: the instance builds commands, so processes naming it back would make the two
//! depend on each other, and all they use of it is the control channel and fresh process ids.
//! The instance implements it.

use std::fmt;
use std::panic::RefUnwindSafe;
use std::sync::Arc;

use crate::control::Control;
use crate::error::Result;

/// The running VM as its processes see it. Holding one keeps the VM alive, as an `Instance`
/// handle does: a [`Child`](super::Child) outliving every handle still runs.
///
/// `RefUnwindSafe` because the instance's state is, and [`Command`](super::Command), which
/// holds this, is therefore `UnwindSafe` like the `Instance` it used to hold: a public promise.
pub(crate) trait Guest: fmt::Debug + Send + Sync + RefUnwindSafe {
    /// The control channel, or the error that says why the instance takes no more requests
    /// (it hung, stopped, or broke the protocol).
    fn control(&self) -> Result<Arc<Control>>;

    /// An id for a new process on the control channel, unused by any other of this instance.
    fn next_process_id(&self) -> u32;

    /// The instance's span (`instance`, with its id): what the process does is traced in it.
    fn span(&self) -> tracing::Span;
}
