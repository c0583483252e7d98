//! The library's end of a helper's command socket (krunbox-protocol's `vmm::command`): one
//! command at a time, each answered within a deadline; and the machine-state file the VM's
//! saved state goes through.
//!
//! A unix `SOCK_SEQPACKET` pair keeps each message whole without framing. Commands are rare
//! (a snapshot sends a handful), so each is a blocking exchange on tokio's blocking pool rather
//! than an async reader that would live as long as the instance.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use krunbox_protocol::vmm::command::{VmmCommand, VmmReply, MAX_COMMAND_BYTES, MAX_STATE_BYTES};
use nix::sys::socket::{self, AddressFamily, MsgFlags, SockFlag, SockType};

/// The library's end of one helper's command socket.
pub(crate) struct VmmCommands {
    socket: Mutex<OwnedFd>,
    /// Set when a reply did not come in time: a late one would answer the next command, so
    /// the socket is not used again.
    broken: AtomicBool,
    /// The machine-state file (a memfd; the helper has the same open file).
    state_file: File,
}

/// The helper's ends: the command socket and the machine-state file.
pub(crate) struct HelperEnds {
    pub socket: OwnedFd,
    pub state_file: File,
}

impl VmmCommands {
    /// A new pair: ours, and the helper's ends to hand over as `Inherited::Command` and
    /// `Inherited::MachineState`.
    pub(crate) fn pair() -> std::io::Result<(Arc<VmmCommands>, HelperEnds)> {
        let (ours, helpers) = socket::socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        let state_file = File::from(nix::sys::memfd::memfd_create(
            c"krunbox-machine-state",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )?);
        let commands = VmmCommands {
            socket: Mutex::new(ours),
            broken: AtomicBool::new(false),
            state_file: state_file.try_clone()?,
        };
        let ends = HelperEnds {
            socket: helpers,
            state_file,
        };
        Ok((Arc::new(commands), ends))
    }

    /// The machine-state file (the library writes a restore's state there).
    pub(crate) fn state_file(&self) -> &File {
        &self.state_file
    }

    /// The state the helper saved last ([`VmmCommand::SaveMachineState`] said `bytes`), read
    /// from the machine-state file: what a compromised helper wrote is bounded like anything
    /// it sends.
    pub(crate) fn saved_state(&self, bytes: u64) -> Result<Vec<u8>, String> {
        if bytes > MAX_STATE_BYTES as u64 {
            return Err(format!(
                "the helper saved {bytes} bytes of state, past {MAX_STATE_BYTES}"
            ));
        }
        let mut state = vec![0u8; bytes as usize];
        self.state_file
            .read_exact_at(&mut state, 0)
            .map_err(|e| format!("reading the machine state: {e}"))?;
        Ok(state)
    }

    /// Sends `command` and waits up to `deadline` for the helper's reply. `Err` says why no
    /// valid reply came (a reply that says the command failed is `Ok(VmmReply::Failed)`).
    pub(crate) async fn send(
        self: &Arc<Self>,
        command: VmmCommand,
        deadline: Duration,
    ) -> Result<VmmReply, String> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.exchange(command, deadline))
            .await
            .map_err(|e| format!("the command's thread failed: {e}"))?
    }

    fn exchange(&self, command: VmmCommand, deadline: Duration) -> Result<VmmReply, String> {
        let socket = self.socket.lock().unwrap_or_else(|p| p.into_inner());
        if self.broken.load(Ordering::Acquire) {
            return Err("an earlier command went unanswered".into());
        }
        let timeout = nix::sys::time::TimeVal::new(
            deadline.as_secs() as i64,
            deadline.subsec_micros() as i64,
        );
        socket::setsockopt(&*socket, socket::sockopt::ReceiveTimeout, &timeout)
            .and_then(|()| socket::setsockopt(&*socket, socket::sockopt::SendTimeout, &timeout))
            .map_err(|e| format!("setting the command socket's deadline: {e}"))?;
        socket::send(
            socket.as_raw_fd(),
            &command.encode(),
            MsgFlags::MSG_NOSIGNAL,
        )
        .map_err(|e| format!("sending {command:?}: {e}"))?;
        // One byte more than a packet may have, so that a longer one is seen, not cut.
        let mut packet = vec![0u8; MAX_COMMAND_BYTES + 1];
        let len = loop {
            match socket::recv(socket.as_raw_fd(), &mut packet, MsgFlags::empty()) {
                Err(nix::errno::Errno::EINTR) => continue,
                Err(nix::errno::Errno::EAGAIN) => {
                    self.broken.store(true, Ordering::Release);
                    return Err(format!("no answer to {command:?} within {deadline:?}"));
                }
                Err(e) => return Err(format!("reading the answer to {command:?}: {e}")),
                Ok(0) => return Err("the helper closed its command socket".into()),
                Ok(len) => break len,
            }
        };
        VmmReply::decode(&packet[..len]).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The helper's side played by a thread on the other end, with the protocol's codec.
    #[tokio::test]
    async fn a_command_gets_its_reply_and_a_silent_helper_breaks_the_channel() {
        let (commands, ends) = VmmCommands::pair().unwrap();
        let helper = ends.socket;
        let answering = std::thread::spawn(move || {
            let mut packet = vec![0u8; MAX_COMMAND_BYTES];
            let len = socket::recv(helper.as_raw_fd(), &mut packet, MsgFlags::empty()).unwrap();
            assert_eq!(
                VmmCommand::decode(&packet[..len]).unwrap(),
                VmmCommand::SaveMachineState
            );
            let reply = VmmReply::Saved { bytes: 7 }.encode();
            socket::send(helper.as_raw_fd(), &reply, MsgFlags::empty()).unwrap();
            // The next command is read and never answered.
            socket::recv(helper.as_raw_fd(), &mut packet, MsgFlags::empty()).unwrap();
            helper
        });
        let reply = commands
            .send(VmmCommand::SaveMachineState, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(reply, VmmReply::Saved { bytes: 7 });
        let silent = commands
            .send(VmmCommand::PauseVcpus, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(silent.contains("no answer"), "{silent}");
        let _helper = answering.join().unwrap();
        let after = commands
            .send(VmmCommand::ResumeVcpus, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(after.contains("unanswered"), "{after}");
    }

    #[tokio::test]
    async fn a_reply_that_is_not_one_is_an_error_not_a_panic() {
        let (commands, ends) = VmmCommands::pair().unwrap();
        let helper = ends.socket;
        let answering = std::thread::spawn(move || {
            let mut packet = vec![0u8; MAX_COMMAND_BYTES];
            socket::recv(helper.as_raw_fd(), &mut packet, MsgFlags::empty()).unwrap();
            let junk = vec![b'{'; MAX_COMMAND_BYTES + 10];
            socket::send(helper.as_raw_fd(), &junk, MsgFlags::empty()).unwrap();
            helper
        });
        let err = commands
            .send(VmmCommand::PauseVcpus, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(err.contains("not valid"), "{err}");
        drop(answering.join().unwrap());
        let closed = commands
            .send(VmmCommand::PauseVcpus, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(!closed.is_empty());
    }
}
