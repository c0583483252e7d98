//! The library's commands to its running helper, on the command socket
//! ([`Inherited::Command`](super::Inherited::Command)): a unix `SOCK_SEQPACKET` pair, one JSON
//! message per packet (at most [`MAX_COMMAND_BYTES`]), one [`VmmReply`] per [`VmmCommand`], in
//! order. The helper serves them on libkrun's event loop once the VM runs.
//!
//! ```
//! use krunbox_protocol::vmm::command::{VmmCommand, VmmReply};
//!
//! let packet = VmmCommand::PauseVcpus.encode();
//! assert_eq!(VmmCommand::decode(&packet).unwrap(), VmmCommand::PauseVcpus);
//! let reply = VmmReply::Saved { bytes: 30_000 }.encode();
//! assert_eq!(VmmReply::decode(&reply).unwrap(), VmmReply::Saved { bytes: 30_000 });
//! assert!(VmmReply::decode(b"{\"Saved\":{}}").is_err());
//! ```

use serde::{Deserialize, Serialize};

/// The largest packet either side sends or accepts; a longer one is refused unread.
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;

/// The longest failure text a reply carries; the helper cuts what libkrun says to it.
pub const MAX_REASON_BYTES: usize = 4096;

/// The most bytes of saved machine state either side reads from the machine-state file (a
/// vCPU's state is about 30 KiB as JSON; krunbox has at most 8 vCPUs).
pub const MAX_STATE_BYTES: usize = 8 << 20;

/// What the library asks of its helper.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum VmmCommand {
    /// Take every vCPU out of `KVM_RUN` and keep it out until [`VmmCommand::ResumeVcpus`]
    /// (devices keep running: their queues can drain).
    PauseVcpus,
    /// How many queues of activated devices hold requests the device has not answered yet
    /// (with the vCPUs paused, this reaches 0 once the devices caught up).
    QueuesInFlight,
    /// Write the KVM state of the VM and of its paused vCPUs, and its devices' transports, to
    /// the machine-state file from offset 0 (the reply says how many bytes; the helper cannot
    /// truncate files, so what lies past them is stale).
    SaveMachineState,
    /// Set the state in the first `bytes` bytes of the machine-state file on the paused VM.
    RestoreMachineState {
        /// The state's length.
        bytes: u64,
    },
    /// Let the paused vCPUs run again.
    ResumeVcpus,
    /// Map guest memory copy-on-write from the guest memory file, in place: the file keeps
    /// guest memory as it is now (a fork's source, its vCPUs paused; each fork maps the file
    /// copy-on-write too). Refused when it is mapped so already.
    MapPrivately,
    /// Write every page of guest memory the guest made its own since its memory was mapped
    /// copy-on-write into the private-pages file
    /// ([`Inherited::PrivatePages`](super::Inherited::PrivatePages)), at its offset in the
    /// guest memory file (the reply says how many pages); guest memory is that file overlaid
    /// with these pages.
    WritePrivatePages,
}

/// The helper's answer to one [`VmmCommand`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub enum VmmReply {
    /// The command was carried out.
    Done,
    /// The state was saved: its size.
    Saved {
        /// Bytes of saved state.
        bytes: u64,
    },
    /// The answer to [`VmmCommand::WritePrivatePages`].
    Written {
        /// Pages written.
        pages: u64,
    },
    /// The answer to [`VmmCommand::QueuesInFlight`].
    InFlight {
        /// Queues with requests not answered yet.
        queues: u32,
    },
    /// The command failed; the VM is as the reason says.
    Failed {
        /// What went wrong, at most [`MAX_REASON_BYTES`].
        reason: String,
    },
}

/// A packet that is not a command or reply of this build.
#[derive(Debug, thiserror::Error)]
#[error("a VMM command packet of {len} bytes is not valid: {reason}")]
pub struct CommandError {
    /// The packet's length.
    pub len: usize,
    /// Why it was refused.
    pub reason: String,
}

fn decode<T: for<'de> Deserialize<'de>>(packet: &[u8]) -> Result<T, CommandError> {
    let refuse = |reason: String| CommandError {
        len: packet.len(),
        reason,
    };
    if packet.len() > MAX_COMMAND_BYTES {
        return Err(refuse(format!("longer than {MAX_COMMAND_BYTES} bytes")));
    }
    serde_json::from_slice(packet).map_err(|e| refuse(e.to_string()))
}

impl VmmCommand {
    /// The command as one packet.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a command always serializes")
    }

    /// A command from one packet, refused when it is longer than [`MAX_COMMAND_BYTES`] or
    /// not a command.
    pub fn decode(packet: &[u8]) -> Result<Self, CommandError> {
        decode(packet)
    }
}

impl VmmReply {
    /// A failure, its reason cut to [`MAX_REASON_BYTES`] (at a character boundary).
    pub fn failed(reason: impl Into<String>) -> Self {
        let mut reason = reason.into();
        if reason.len() > MAX_REASON_BYTES {
            let mut end = MAX_REASON_BYTES;
            while !reason.is_char_boundary(end) {
                end -= 1;
            }
            reason.truncate(end);
        }
        VmmReply::Failed { reason }
    }

    /// The reply as one packet (never longer than [`MAX_COMMAND_BYTES`]: reasons are cut).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a reply always serializes")
    }

    /// A reply from one packet, refused when it is longer than [`MAX_COMMAND_BYTES`] or not a
    /// reply: what a compromised helper sends is parsed like anything else.
    pub fn decode(packet: &[u8]) -> Result<Self, CommandError> {
        decode(packet)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_command_and_reply_round_trips() {
        for command in [
            VmmCommand::PauseVcpus,
            VmmCommand::QueuesInFlight,
            VmmCommand::SaveMachineState,
            VmmCommand::RestoreMachineState { bytes: 12 },
            VmmCommand::ResumeVcpus,
        ] {
            assert_eq!(VmmCommand::decode(&command.encode()).unwrap(), command);
        }
        for reply in [
            VmmReply::Done,
            VmmReply::Saved { bytes: u64::MAX },
            VmmReply::InFlight { queues: 3 },
            VmmReply::failed("KVM read 3 of 40 MSRs"),
        ] {
            assert_eq!(VmmReply::decode(&reply.encode()).unwrap(), reply);
        }
    }

    #[test]
    fn a_long_reason_is_cut_at_a_character_and_fits_a_packet() {
        let reply = VmmReply::failed("é".repeat(MAX_COMMAND_BYTES));
        let VmmReply::Failed { reason } = &reply else {
            panic!("{reply:?}")
        };
        assert!(reason.len() <= MAX_REASON_BYTES && reason.len() > MAX_REASON_BYTES - 2);
        assert!(reply.encode().len() <= MAX_COMMAND_BYTES);
    }

    #[test]
    fn oversized_or_foreign_packets_are_refused() {
        let long = vec![b' '; MAX_COMMAND_BYTES + 1];
        assert!(VmmReply::decode(&long).is_err());
        assert!(VmmCommand::decode(b"\"Reboot\"").is_err());
        assert!(VmmReply::decode(b"{\"Done\":1}").is_err());
        assert!(VmmReply::decode(&[0xff, 0xfe]).is_err());
    }
}
