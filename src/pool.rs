//! A warm pool: instances of one definition booted ahead of need, each handed out once.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::instance::Instance;
use crate::rootfs::Rootfs;
use crate::sandbox::Sandbox;

/// The largest [`Pool`] size: each ready instance is a running VM holding its memory.
pub const MAX_POOL_SIZE: usize = 64;

/// How long the pool waits after a hand-out from a full pool before it boots the replacement:
/// the caller's first commands in the instance just taken are what someone waits for, and a
/// boot started at the same moment competes with them for the host's CPUs (on a small host or
/// under emulation it more than doubled the first command's time: docs/testing.md). A burst
/// of hand-outs within the delay is served by the instances ready and then by `take`'s own
/// boots, so the delay costs no caller a wait.
const REFILL_DELAY: Duration = Duration::from_secs(1);

/// How often a full pool looks for instances that stopped while they waited (killed from
/// outside, their guest hung), to replace them.
const HEALTH_CHECK: Duration = Duration::from_secs(10);

/// The first wait after a failed boot in the background; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Instances of one [`Sandbox`] booted ahead of need: [`take`](Self::take) hands out one
/// that is running and has never run anything, and the pool boots its replacement in the
/// background.
///
/// The pool's task boots one instance at a time, a second after a hand-out from a full pool
/// (so the replacement's boot does not compete with the first commands in the instance just
/// handed out), and replaces instances that stopped while they waited. `take` with none ready
/// boots one itself, beside the task's, so a pool never makes a caller wait longer than a boot
/// would. An instance is handed out at most once, and the pool never runs a command in one:
/// whatever the previous caller did in its VM happened in another VM. (Mounts in the
/// definition are the definition's: every instance of it, pooled or not, sees the same
/// filesystem there.)
///
/// Pooled instances are booted from the definition as it is: per-boot options
/// ([`BootOptions`](crate::BootOptions): mounts, hostname, working directory) cannot be
/// applied to a VM that is already running, so a pool has none ([`Sandbox::boot_with`] gives
/// them; a command's [`current_dir`](crate::Command::current_dir) sets where it runs). A root
/// that one VM at a time may use (persistent, copy-on-write over a store) cannot be pooled.
///
/// Dropping the pool stops its task and kills the instances still in it;
/// [`shutdown`](Self::shutdown) stops them cleanly. Instances already handed out are the
/// caller's.
///
/// ```no_run
/// # async fn demo() -> krunbox::Result<()> {
/// use krunbox::{BuiltinImage, Pool, Rootfs, Sandbox};
///
/// let sandbox = Sandbox::builder().rootfs(Rootfs::builtin(BuiltinImage::Agent)).build()?;
/// let pool = Pool::new(&sandbox, 2)?;
/// for task in ["echo one", "echo two", "echo three"] {
///     let vm = pool.take().await?; // a running VM that never ran anything
///     let out = vm.command("sh").args(["-c", task]).output().await?;
///     println!("{}", out.stdout_text().trim());
///     vm.shutdown().await?;
/// }
/// pool.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Pool {
    shared: Arc<Shared>,
    filler: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    sandbox: Sandbox,
    size: usize,
    ready: Mutex<VecDeque<Instance>>,
    /// Wakes the filler: an instance was taken.
    taken: Notify,
    /// Why the last boot in the background failed, if it did.
    last_failure: Mutex<Option<String>>,
    /// Set (under the `ready` lock) once the pool is shut down: nothing enters it after.
    closed: std::sync::atomic::AtomicBool,
}

impl Shared {
    fn ready(&self) -> std::sync::MutexGuard<'_, VecDeque<Instance>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Pool {
    /// A pool keeping `size` instances of `sandbox` ready (1 to [`MAX_POOL_SIZE`]); it starts
    /// booting them at once, in the background. Must be called within a tokio runtime.
    ///
    /// Fails with [`Error::InvalidConfig`] for a size out of range, or a root one VM at a time
    /// may use (a persistent root, a copy-on-write root over a store).
    ///
    /// ```no_run
    /// # async fn demo(sandbox: krunbox::Sandbox) -> krunbox::Result<()> {
    /// let pool = krunbox::Pool::new(&sandbox, 4)?;
    /// # Ok(()) }
    /// ```
    pub fn new(sandbox: &Sandbox, size: usize) -> Result<Pool> {
        if !(1..=MAX_POOL_SIZE).contains(&size) {
            return Err(Error::InvalidConfig(format!(
                "a pool's size must be 1 to {MAX_POOL_SIZE}, got {size}"
            )));
        }
        if matches!(
            sandbox.rootfs(),
            Rootfs::Persistent { .. } | Rootfs::Cow { .. }
        ) {
            return Err(Error::InvalidConfig(
                "a pool cannot hold instances of a persistent or copy-on-write root: one VM at a time may use it; pool an image or an ephemeral root".into(),
            ));
        }
        let shared = Arc::new(Shared {
            sandbox: sandbox.clone(),
            size,
            ready: Mutex::new(VecDeque::with_capacity(size)),
            taken: Notify::new(),
            last_failure: Mutex::new(None),
            closed: std::sync::atomic::AtomicBool::new(false),
        });
        let filler = tokio::spawn(fill(shared.clone()));
        Ok(Pool { shared, filler })
    }

    /// A running instance that has never run anything, from the pool if one is ready (its
    /// replacement then boots in the background), else booted now.
    ///
    /// ```no_run
    /// # async fn demo(pool: &krunbox::Pool) -> krunbox::Result<()> {
    /// let vm = pool.take().await?;
    /// vm.command("true").status().await?;
    /// # Ok(()) }
    /// ```
    pub async fn take(&self) -> Result<Instance> {
        loop {
            if self.shared.closed.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(Error::InvalidConfig(
                    "this pool was shut down: make a new one, or boot the sandbox".into(),
                ));
            }
            let next = self.shared.ready().pop_front();
            match next {
                // One that stopped while it waited (killed from outside, its guest hung) is
                // dropped, not handed out.
                Some(instance) if instance.is_running() && !instance.is_paused() => {
                    self.shared.taken.notify_one();
                    return Ok(instance);
                }
                Some(_) => self.shared.taken.notify_one(),
                None => {
                    self.shared.taken.notify_one();
                    return self.shared.sandbox.boot().await;
                }
            }
        }
    }

    /// How many instances are ready now.
    ///
    /// ```no_run
    /// # fn demo(pool: &krunbox::Pool) {
    /// println!("{} of the pool's VMs are ready", pool.ready());
    /// # }
    /// ```
    pub fn ready(&self) -> usize {
        self.shared.ready().len()
    }

    /// Why the last boot in the background failed, if the last one did (it is retried after a
    /// wait that doubles, up to 30 s; `take` boots in the caller's task meanwhile, with the
    /// error to the caller).
    ///
    /// ```no_run
    /// # fn demo(pool: &krunbox::Pool) {
    /// if let Some(why) = pool.last_failure() {
    ///     eprintln!("the pool cannot boot: {why}");
    /// }
    /// # }
    /// ```
    pub fn last_failure(&self) -> Option<String> {
        self.shared
            .last_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stops the background task and shuts down the instances still in the pool (each as
    /// [`Instance::shutdown`] does, at once).
    ///
    /// ```no_run
    /// # async fn demo(pool: krunbox::Pool) {
    /// pool.shutdown().await;
    /// # }
    /// ```
    pub async fn shutdown(self) {
        self.close().await;
    }

    /// [`shutdown`](Self::shutdown) through a shared reference: for a pool others hold too
    /// (an `Arc`, a binding's object). `take` fails after it; an instance the background task
    /// was booting is shut down as its boot ends.
    ///
    /// ```no_run
    /// # async fn demo(pool: std::sync::Arc<krunbox::Pool>) {
    /// pool.close().await;
    /// # }
    /// ```
    pub async fn close(&self) {
        self.filler.abort();
        let idle: Vec<Instance> = {
            let mut ready = self.shared.ready();
            self.shared
                .closed
                .store(true, std::sync::atomic::Ordering::SeqCst);
            ready.drain(..).collect()
        };
        futures_util::future::join_all(idle.iter().map(|vm| vm.shutdown())).await;
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // The filler holds the shared state too: stopped, it lets the idle instances go.
        self.filler.abort();
        self.shared.ready().clear();
    }
}

/// The pool's task: keeps `size` instances ready, one boot at a time.
async fn fill(shared: Arc<Shared>) {
    let mut backoff = FIRST_BACKOFF;
    loop {
        if shared.ready().len() >= shared.size {
            tokio::select! {
                _ = shared.taken.notified() => tokio::time::sleep(REFILL_DELAY).await,
                _ = tokio::time::sleep(HEALTH_CHECK) => {}
            }
            shared.ready().retain(|vm| vm.is_running());
            continue;
        }
        match shared.sandbox.boot().await {
            Ok(instance) => {
                backoff = FIRST_BACKOFF;
                *shared
                    .last_failure
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = None;
                shared.ready().push_back(instance);
            }
            Err(e) => {
                tracing::warn!(
                    "the pool could not boot an instance (retrying in {backoff:?}): {e}"
                );
                *shared
                    .last_failure
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}
