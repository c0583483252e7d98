//! What a restored instance offers beyond a booted one: the processes its snapshot held, to
//! take over ([`Instance::attach`]).

use super::Instance;
use crate::error::{Error, Result};
use crate::process::Child;

impl Instance {
    /// The guest pids of the processes a restored instance's snapshot held and no one has
    /// [`attach`](Self::attach)ed yet (empty for a booted instance).
    pub fn processes(&self) -> Vec<u32> {
        self.inner
            .control
            .adopted()
            .iter()
            .filter_map(|p| p.pid)
            .collect()
    }

    /// Takes over process `pid` (a guest pid, as [`Child::id`] gave it before the snapshot) of
    /// a restored instance: its stdin, its output from the snapshot on (what the snapshotted
    /// instance had received and not read stays there), its end. Once per process.
    ///
    /// ```no_run
    /// # async fn demo(sandbox: &krunbox::Sandbox, snapshot: &krunbox::Snapshot) -> Result<(), Box<dyn std::error::Error>> {
    /// use tokio::io::AsyncWriteExt;
    /// let vm = sandbox.restore(snapshot).await?;
    /// for pid in vm.processes() {
    ///     let mut shell = vm.attach(pid)?;
    ///     shell.stdin.take().unwrap().write_all(b"echo still here\n").await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub fn attach(&self, pid: u32) -> Result<Child> {
        let control = self.control()?;
        let key = control
            .adopted()
            .iter()
            .find(|p| p.pid == Some(pid))
            .map(|p| p.key)
            .ok_or_else(|| {
                Error::InvalidConfig(format!(
                    "no process {pid} to attach: Instance::processes lists those a restored snapshot holds"
                ))
            })?;
        let (saved, channels) = control
            .take_adopted(key)
            .ok_or_else(|| Error::InvalidConfig(format!("process {pid} was attached already")))?;
        Ok(crate::process::adopt(
            self.inner.clone(),
            &control,
            &saved,
            channels,
        ))
    }
}
