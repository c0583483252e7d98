//! What each sandbox may take of what every sandbox in this process shares: descriptors the
//! host holds for its guest (a `HostDir`'s inodes and open files, the network's upstream
//! sockets) and threads of tokio's blocking pool (a `HostDir`'s slow calls, the system
//! resolver). Per-sandbox bounds alone (a `HostDir`'s 65,536 inodes, a network's 512
//! connections) let one hostile guest take the whole process's descriptor limit or block every
//! pool thread, and another sandbox's boot, dial or file call then fails (issue 33).
//!
//! So each instance has a [`Budget`]: at most [`Limits::host_descriptors`] descriptors, and
//! never more than half of what the process may open beyond a reserve kept for the library's
//! own work (booting, control channels, logs); at most [`BLOCKING_PER_SANDBOX`] blocking-pool
//! threads at once, a lookup the resolver gave up on still counting until its thread ends.
//! A charge past a bound fails the guest's own call (`ENFILE`, a refused connection, a
//! `SERVFAIL`), never another sandbox's.
//!
//! The caller's filesystems do not know which sandbox calls them: the mount's serving runs each
//! call in [`scope`], and `HostDir` charges the [`current`] budget.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::limits::Limits;

/// Threads of tokio's blocking pool one sandbox's guest can keep busy at once (its default
/// pool has 512).
pub(crate) const BLOCKING_PER_SANDBOX: usize = 32;

/// Descriptors the process keeps beyond every sandbox's reach: at least this many, or an
/// eighth of its limit.
const RESERVE_MIN: usize = 1024;

/// The process's descriptors for guests: what its limit allows beyond the reserve, and what
/// all budgets hold of it.
struct Process {
    capacity: usize,
    held: AtomicUsize,
}

fn process() -> &'static Process {
    static PROCESS: OnceLock<Process> = OnceLock::new();
    PROCESS.get_or_init(|| {
        let limit = raise_descriptor_limit();
        let reserve = RESERVE_MIN.max(limit / 8);
        Process {
            capacity: limit.saturating_sub(reserve),
            held: AtomicUsize::new(0),
        }
    })
}

/// Raises `RLIMIT_NOFILE` as far as this process may and returns the soft limit, at most 2^20:
/// descriptors the guests hold are counted against it, and the common soft limit, 1024, would
/// fail lookups in any sizeable tree. With `CAP_SYS_RESOURCE` (root) the hard limit goes up to
/// the kernel's `fs.nr_open` too; without, the soft one goes up to the hard one. A limit is
/// never lowered.
pub(crate) fn raise_descriptor_limit() -> usize {
    const MOST: u64 = 1 << 20;
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|n| n.trim().parse::<u64>().ok())
        .unwrap_or(MOST)
        .min(MOST);
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain calls on local structs.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return RESERVE_MIN;
        }
        if limit.rlim_max < nr_open {
            let raised = libc::rlimit {
                rlim_cur: nr_open,
                rlim_max: nr_open,
            };
            // Fails (EPERM) without CAP_SYS_RESOURCE: then the hard limit stays.
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit.rlim_cur = limit.rlim_max;
            }
        }
    }
    usize::try_from(limit.rlim_cur.min(MOST)).unwrap_or(usize::MAX)
}

/// One sandbox's share of the process's descriptors and blocking threads.
pub(crate) struct Budget {
    max_descriptors: usize,
    descriptors: AtomicUsize,
    blocking: Arc<Semaphore>,
}

impl std::fmt::Debug for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Budget")
            .field("descriptors", &self.descriptors.load(Ordering::Relaxed))
            .field("max_descriptors", &self.max_descriptors)
            .finish_non_exhaustive()
    }
}

impl Budget {
    /// A budget for one instance with `limits`.
    pub(crate) fn new(limits: &Limits) -> Arc<Self> {
        let process = process();
        Arc::new(Self {
            max_descriptors: limits.host_descriptors.min(process.capacity / 2),
            descriptors: AtomicUsize::new(0),
            blocking: Arc::new(Semaphore::new(BLOCKING_PER_SANDBOX)),
        })
    }

    /// Charges one descriptor the host is about to hold for this sandbox's guest; `None` past
    /// the sandbox's bound or the process's. The charge is given back when dropped.
    pub(crate) fn descriptor(self: &Arc<Self>) -> Option<Descriptor> {
        let process = process();
        let mine = self.descriptors.fetch_add(1, Ordering::AcqRel);
        let all = process.held.fetch_add(1, Ordering::AcqRel);
        if mine >= self.max_descriptors || all >= process.capacity {
            self.descriptors.fetch_sub(1, Ordering::AcqRel);
            process.held.fetch_sub(1, Ordering::AcqRel);
            tracing::debug!(
                target: "krunbox::budget",
                held = mine,
                max = self.max_descriptors,
                process_held = all,
                process_max = process.capacity,
                "a descriptor for the guest was refused"
            );
            return None;
        }
        Some(Descriptor {
            budget: self.clone(),
        })
    }

    /// Waits for one of this sandbox's blocking-pool threads; the permit goes into the
    /// blocking closure, so a call abandoned by its waiter still counts until its thread ends.
    pub(crate) async fn blocking(&self) -> OwnedSemaphorePermit {
        // The semaphore is never closed.
        self.blocking
            .clone()
            .acquire_owned()
            .await
            .expect("the blocking semaphore is never closed")
    }

    /// Blocking-pool threads this sandbox may start now without waiting.
    #[cfg(test)]
    pub(crate) fn blocking_available(&self) -> usize {
        self.blocking.available_permits()
    }

    /// Descriptors this sandbox's guest holds now.
    pub(crate) fn descriptors_held(&self) -> usize {
        self.descriptors.load(Ordering::Acquire)
    }

    /// The most it may hold.
    pub(crate) fn max_descriptors(&self) -> usize {
        self.max_descriptors
    }
}

/// One descriptor charged to a [`Budget`]: held beside the descriptor, given back with it.
#[derive(Debug)]
pub(crate) struct Descriptor {
    budget: Arc<Budget>,
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        self.budget.descriptors.fetch_sub(1, Ordering::AcqRel);
        process().held.fetch_sub(1, Ordering::AcqRel);
    }
}

tokio::task_local! {
    static CURRENT: Arc<Budget>;
}

/// Runs `future` with `budget` as the [`current`] one (none: no budget, as in unit tests and
/// for a filesystem called outside a sandbox).
pub(crate) async fn scope<F: Future>(budget: Option<Arc<Budget>>, future: F) -> F::Output {
    match budget {
        Some(budget) => CURRENT.scope(budget, future).await,
        None => future.await,
    }
}

/// Runs `call` with `budget` as the [`current`] one, on this thread: for work moved to the
/// blocking pool, where the task's budget is not seen.
pub(crate) fn sync_scope<T>(budget: Option<Arc<Budget>>, call: impl FnOnce() -> T) -> T {
    match budget {
        Some(budget) => CURRENT.sync_scope(budget, call),
        None => call(),
    }
}

/// The budget of the sandbox whose call this is, if any.
pub(crate) fn current() -> Option<Arc<Budget>> {
    CURRENT.try_with(Arc::clone).ok()
}

/// Charges one descriptor to the [`current`] budget: `Ok(None)` outside any, `Err(())` past its
/// bound.
pub(crate) fn charge_current() -> Result<Option<Descriptor>, ()> {
    match current() {
        Some(budget) => budget.descriptor().map(Some).ok_or(()),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_holds_at_most_its_bound_and_gives_back_what_it_drops() {
        let budget = Budget::new(&Limits::new().host_descriptors(3));
        assert_eq!(budget.max_descriptors(), 3);
        let held: Vec<Descriptor> = (0..3).map(|_| budget.descriptor().unwrap()).collect();
        assert!(budget.descriptor().is_none(), "past its bound");
        assert_eq!(budget.descriptors_held(), 3);
        drop(held);
        assert_eq!(budget.descriptors_held(), 0);
        assert!(budget.descriptor().is_some());
    }

    #[test]
    fn no_sandbox_takes_more_than_half_of_what_the_process_can_give() {
        let budget = Budget::new(&Limits::new().host_descriptors(usize::MAX));
        assert!(budget.max_descriptors() <= process().capacity / 2);
        assert!(process().capacity > 0);
    }

    #[tokio::test]
    async fn the_current_budget_is_the_scopes_and_charges_go_to_it() {
        assert!(current().is_none());
        assert_eq!(charge_current().map(|c| c.is_some()), Ok(false));
        let budget = Budget::new(&Limits::new().host_descriptors(1));
        let inner = budget.clone();
        scope(Some(budget.clone()), async move {
            let first = charge_current().unwrap();
            assert!(first.is_some());
            assert_eq!(inner.descriptors_held(), 1);
            assert!(charge_current().is_err(), "past its bound");
        })
        .await;
        assert_eq!(budget.descriptors_held(), 0);
        let permit = budget.blocking().await;
        assert_eq!(budget.blocking_available(), BLOCKING_PER_SANDBOX - 1);
        drop(permit);
    }
}
