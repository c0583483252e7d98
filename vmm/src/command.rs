//! The command socket (`Inherited::Command`): the library's way into the running VM.
//!
//! `krun_start_enter` never returns, so the helper serves commands from libkrun's own event
//! loop: once the VM is built, a subscriber on that loop reads one command per packet and
//! answers each before the next (krunbox-protocol's `vmm::command`). Each command is short (a
//! second per vCPU at most), so the loop goes on serving the devices between them.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use krun_sys::machine::{EpollEvent, EventManager, EventSet, RunningVm, Subscriber};
use krunbox_protocol::vmm::command::{VmmCommand, VmmReply, MAX_COMMAND_BYTES, MAX_STATE_BYTES};

/// Serves the library's commands on `socket` (its end of the pair on `Inherited::Command`)
/// once the next VM this process starts runs; the VM's state goes through `state_file`
/// (`Inherited::MachineState`).
/// `private_pages`: where the guest's own pages go
/// ([`VmmCommand::WritePrivatePages`]), and `/proc/self/pagemap` open to find them (opened
/// before the jail), when guest memory is in a file.
pub(crate) fn serve(
    socket: OwnedFd,
    state_file: std::sync::Arc<File>,
    private_pages: Option<PrivatePages>,
) {
    krun_sys::machine::on_built(move |vm, event_manager| {
        if let Err(e) = nix::fcntl::fcntl(
            &socket,
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        ) {
            eprintln!("krunbox-vmm: the command socket: {e}");
            return;
        }
        let server = CommandServer {
            socket,
            vm,
            state_file,
            private_pages,
        };
        if let Err(e) = event_manager.add_subscriber(Arc::new(Mutex::new(server))) {
            eprintln!("krunbox-vmm: cannot serve the command socket: {e:?}");
        }
    });
}

struct CommandServer {
    socket: OwnedFd,
    vm: RunningVm,
    state_file: std::sync::Arc<File>,
    private_pages: Option<PrivatePages>,
}

/// Where [`VmmCommand::WritePrivatePages`] writes (`Inherited::PrivatePages`), and the pagemap
/// that tells which pages (`None`: it could not be opened; the command then fails).
pub(crate) struct PrivatePages {
    pub into: File,
    pub pagemap: Option<File>,
}

impl CommandServer {
    fn carry_out(&mut self, command: VmmCommand) -> VmmReply {
        let done = |result: Result<(), String>| match result {
            Ok(()) => VmmReply::Done,
            Err(reason) => VmmReply::failed(reason),
        };
        match command {
            VmmCommand::PauseVcpus => done(self.vm.pause_vcpus()),
            VmmCommand::ResumeVcpus => done(self.vm.resume_vcpus()),
            VmmCommand::QueuesInFlight => VmmReply::InFlight {
                queues: self.vm.queues_in_flight().len() as u32,
            },
            VmmCommand::SaveMachineState => match self.save() {
                Ok(bytes) => VmmReply::Saved { bytes },
                Err(reason) => VmmReply::failed(reason),
            },
            VmmCommand::RestoreMachineState { bytes } => match self.load(bytes) {
                Ok(state) => done(self.vm.restore_state(&state)),
                Err(reason) => VmmReply::failed(reason),
            },
            VmmCommand::MapPrivately => done(self.vm.map_privately()),
            VmmCommand::WritePrivatePages => match self.write_private_pages() {
                Ok(pages) => VmmReply::Written { pages },
                Err(reason) => VmmReply::failed(reason),
            },
        }
    }

    fn write_private_pages(&self) -> Result<u64, String> {
        match &self.private_pages {
            Some(PrivatePages {
                into,
                pagemap: Some(pagemap),
            }) => self.vm.write_private_pages(pagemap, into),
            Some(PrivatePages { pagemap: None, .. }) => {
                Err("/proc/self/pagemap could not be opened before the jail".into())
            }
            None => Err("guest memory is not in a file of the library's".into()),
        }
    }

    /// Writes the VM's state to the machine-state file; returns its length.
    fn save(&self) -> Result<u64, String> {
        let state = self.vm.save_state()?;
        if state.len() > MAX_STATE_BYTES {
            return Err(format!(
                "the machine state has {} bytes, past the {MAX_STATE_BYTES} the library reads",
                state.len()
            ));
        }
        // No ftruncate: the jail allows it only to a helper whose layer grows (seccomp).
        self.state_file
            .write_all_at(&state, 0)
            .map_err(|e| format!("writing the machine state: {e}"))?;
        Ok(state.len() as u64)
    }

    fn load(&self, len: u64) -> Result<Vec<u8>, String> {
        read_state(&self.state_file, len)
    }

    /// Answers every packet waiting; `false` once the library's end is closed.
    fn answer_waiting(&mut self) -> bool {
        // One byte more than a packet may have: a longer one is seen as such, not cut.
        let mut packet = vec![0u8; MAX_COMMAND_BYTES + 1];
        loop {
            let len = match nix::sys::socket::recv(
                self.socket.as_raw_fd(),
                &mut packet,
                nix::sys::socket::MsgFlags::empty(),
            ) {
                Ok(0) => return false,
                Ok(len) => len,
                Err(nix::errno::Errno::EAGAIN) => return true,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => return false,
            };
            let reply = match VmmCommand::decode(&packet[..len]) {
                Ok(command) => self.carry_out(command),
                Err(e) => VmmReply::failed(e.to_string()),
            };
            // The library waits for this reply before it sends anything else, so the
            // socket's buffer has room for it.
            if nix::sys::socket::send(
                self.socket.as_raw_fd(),
                &reply.encode(),
                nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
            )
            .is_err()
            {
                return false;
            }
        }
    }
}

/// The state in the first `len` bytes of the machine-state file (at most
/// [`MAX_STATE_BYTES`]).
pub(crate) fn read_state(file: &File, len: u64) -> Result<Vec<u8>, String> {
    if len > MAX_STATE_BYTES as u64 {
        return Err(format!(
            "a machine state of {len} bytes is past {MAX_STATE_BYTES}"
        ));
    }
    let mut state = vec![0u8; len as usize];
    file.read_exact_at(&mut state, 0)
        .map_err(|e| format!("reading the machine state: {e}"))?;
    Ok(state)
}

impl Subscriber for CommandServer {
    fn process(&mut self, event: &EpollEvent, event_manager: &mut EventManager) {
        let gone = event.event_set().contains(EventSet::HANG_UP)
            || event.event_set().contains(EventSet::ERROR);
        if !self.answer_waiting() || gone {
            // The library is gone (its lifeline ends this process soon): stop listening
            // rather than wake the loop for a closed socket forever.
            let _ = event_manager.unregister(self.socket.as_raw_fd());
        }
    }

    fn interest_list(&self) -> Vec<EpollEvent> {
        vec![EpollEvent::new(
            EventSet::IN,
            self.socket.as_raw_fd() as u64,
        )]
    }
}
