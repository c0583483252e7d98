//! The running VM's KVM state, for snapshots: pause its vCPUs, read or set the state of the VM
//! and of each vCPU (not guest memory, not devices), resume.
//!
//! `krun_start_enter` never returns, and its thread then runs libkrun's event loop, so the one
//! way in is a callback: [`on_built`] is called on that thread once the VM is built and its
//! vCPUs run, with the VM and the loop. The caller registers a [`Subscriber`] there (krunbox's
//! helper: a command socket to the library) and drives the VM from its events. The patch to
//! krun-vmm behind it (`hook/krun-vmm.patch`) makes libkrun's own (Firecracker's)
//! `save_state`/`restore_state` reachable; each vCPU reads and writes its state on its own
//! thread while paused, as Firecracker does.
//!
//! ```no_run
//! krun_sys::machine::on_built(|vm, _event_manager| {
//!     vm.pause_vcpus().unwrap();
//!     let state = vm.save_state().unwrap();
//!     vm.restore_state(&state).unwrap();
//!     vm.resume_vcpus().unwrap();
//! });
//! // ... then Context::start_enter() builds the VM and calls it.
//! ```

use std::sync::{Arc, Mutex};

mod private_memory;

pub use krun_utils::epoll::{EpollEvent, EventSet};
pub use polly::event_manager::{EventManager, Subscriber};

/// The most bytes a saved state may have (a vCPU's is about 30 KiB as JSON; krunbox has at
/// most 8 vCPUs): a longer one is refused before it is parsed.
pub const MAX_STATE_BYTES: usize = 8 << 20;

/// The VM libkrun built, as [`on_built`] hands it over. Every method runs on the event loop's
/// thread and waits at most a second for each vCPU.
#[derive(Clone)]
pub struct RunningVm(Arc<Mutex<krun_vmm::Vmm>>);

impl RunningVm {
    fn vmm(&self) -> std::sync::MutexGuard<'_, krun_vmm::Vmm> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Takes every vCPU out of `KVM_RUN` and keeps it out until [`RunningVm::resume_vcpus`].
    pub fn pause_vcpus(&self) -> Result<(), String> {
        self.vmm().pause_vcpus()
    }

    /// The queues of activated devices with requests the device has not answered yet, each
    /// as `device:queue` (receive queues left out: they hold the driver's buffers for later).
    /// With the vCPUs paused, empty once the devices caught up.
    pub fn queues_in_flight(&self) -> Vec<String> {
        self.vmm()
            .queues_in_flight()
            .into_iter()
            .map(|q| format!("{}:{}", q.device, q.queue))
            .collect()
    }

    /// Lets the paused vCPUs run again.
    pub fn resume_vcpus(&self) -> Result<(), String> {
        self.vmm().resume_vcpus().map_err(|e| e.to_string())
    }

    /// The KVM state of the VM (irqchip, PIT, clock) and of each paused vCPU (registers,
    /// FPU/xsave, LAPIC, MSRs, pending events), and each virtio device's transport as the
    /// driver set it up, as bytes [`RunningVm::restore_state`] takes.
    pub fn save_state(&self) -> Result<Vec<u8>, String> {
        let state = self.vmm().save_machine_state()?;
        serde_json::to_vec(&state).map_err(|e| e.to_string())
    }

    /// Sets the state [`RunningVm::save_state`] returned on the paused VM. Bytes from
    /// anywhere else are parsed as such: a wrong or oversized state is an error.
    pub fn restore_state(&self, bytes: &[u8]) -> Result<(), String> {
        self.vmm().restore_machine_state(parse_state(bytes)?)
    }

    /// Maps guest memory copy-on-write from the file it is in
    /// ([`crate::device::use_guest_memory_file`]), in place (same addresses, so KVM's memory
    /// slots stay; its MMU notifier drops the old translations): from now on the file keeps
    /// guest memory as it is now, and the guest's writes stay in this process. Call it with
    /// the vCPUs paused and the devices idle, so that what the file keeps is one moment's.
    pub fn map_privately(&self) -> Result<(), String> {
        let vmm = self.vmm();
        for region in private_memory::file_regions(vmm.guest_memory())? {
            region.map_privately()?;
        }
        Ok(())
    }

    /// Writes every page of guest memory that is this process's own (written since guest
    /// memory was mapped copy-on-write: not the file's any more) into `into`, at its offset in
    /// the guest memory file, as [`/proc/self/pagemap`](https://docs.kernel.org/admin-guide/mm/pagemap.html)
    /// (open on `pagemap`) tells them; returns how many pages. With memory mapped shared, no
    /// page is. Call it with the vCPUs paused and the devices idle.
    pub fn write_private_pages(
        &self,
        pagemap: &std::fs::File,
        into: &std::fs::File,
    ) -> Result<u64, String> {
        let vmm = self.vmm();
        let mut pages = 0;
        for region in private_memory::file_regions(vmm.guest_memory())? {
            pages += region.write_private_pages(pagemap, into)?;
        }
        Ok(pages)
    }
}

/// A machine state from `bytes`, refused past [`MAX_STATE_BYTES`] or when it is not one.
fn parse_state(bytes: &[u8]) -> Result<krun_vmm::MachineState, String> {
    if bytes.len() > MAX_STATE_BYTES {
        return Err(format!(
            "a machine state of {} bytes is past the {MAX_STATE_BYTES} accepted",
            bytes.len()
        ));
    }
    serde_json::from_slice(bytes).map_err(|e| format!("not a machine state: {e}"))
}

/// Makes the next VM this process starts a restore of the state [`RunningVm::save_state`]
/// returned (in the VM that was saved): the VM must be configured as that one was. Once the VM
/// is built (its memory mapped, its devices made), `load` is called for the state's bytes; it
/// returns only when the guest memory file ([`crate::device::use_guest_memory_file`]) and
/// `own_pages` hold the saved VM's memory, so that whoever fills them can do so while the VM
/// is being built. Then `own_pages`' data (pages at their offsets in the guest memory file,
/// as [`RunningVm::write_private_pages`] writes them) is laid over guest memory mapped
/// copy-on-write: a fork of a VM so mapped starts from its source's file and the pages its
/// source had made its own. No kernel or boot table is written into guest memory; the VM's,
/// vCPUs' and devices' state is set before the vCPUs first run, and the vsock driver is told
/// its connections are gone. The bytes are parsed as if from anywhere else; an error from
/// `load`, the pages or the parse fails the start.
pub fn restore_on_build(
    load: impl FnOnce() -> Result<Vec<u8>, String> + Send + 'static,
    own_pages: Option<std::fs::File>,
) {
    *krun_vmm::builder::EMBEDDER_RESTORE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(Box::new(move |memory| {
        let bytes = load()?;
        if let Some(pages) = own_pages {
            for region in private_memory::file_regions(memory)? {
                region.read_pages(&pages)?;
            }
        }
        parse_state(&bytes)
    }));
}

/// Has `callback` called once the next VM this process starts is built and its vCPUs run, on
/// the thread that then runs the event loop (where a [`Subscriber`] added to the loop runs).
pub fn on_built(callback: impl FnOnce(RunningVm, &mut EventManager) + Send + 'static) {
    *krun_vmm::builder::EMBEDDER_ON_BUILT
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(Box::new(
        move |vmm: &Arc<Mutex<krun_vmm::Vmm>>, event_manager: &mut EventManager| {
            callback(RunningVm(vmm.clone()), event_manager)
        },
    ));
}
