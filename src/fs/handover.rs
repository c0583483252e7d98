//! The library's side of a mount device's hand-over (the message: `krunbox_virtio::handover`):
//! the helper's one message received as a compromised helper could have sent it, with exactly
//! its eventfds and nothing more taken into this process.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

pub(crate) use krunbox_virtio::handover::{HandOver, FDS, LEN, QUEUE_SIZE, RINGS};

/// The most fds one `SCM_RIGHTS` message carries (Linux's `SCM_MAX_FD`).
const SCM_MAX_FD: usize = 253;

/// Queues and memory the helper handed over, with the eventfds.
#[derive(Debug)]
pub(crate) struct Received {
    pub hand_over: HandOver,
    /// Each ring's notification eventfd.
    pub notifications: [OwnedFd; RINGS],
    /// The device's interrupt eventfd.
    pub interrupt: OwnedFd,
}

/// Receives a hand-over from the helper on `socket` (the library's side): the message and
/// exactly [`FDS`] fds, or an error saying what was wrong. `Ok(None)` when the helper closed the
/// socket first.
pub(crate) async fn receive(
    socket: &tokio::net::UnixStream,
    max_ring_size: u16,
) -> std::io::Result<Option<Received>> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let mut bytes = [0u8; LEN];
    let mut filled = 0;
    let mut fds: Vec<OwnedFd> = Vec::new();
    while filled < LEN {
        socket.readable().await?;
        let got = socket.try_io(tokio::io::Interest::READABLE, || {
            // Room for as many fds as one message can carry (`SCM_MAX_FD`), so the kernel
            // never truncates the control data: fds it installed for a truncated message
            // could not be closed.
            let mut space = nix::cmsg_space!([RawFd; SCM_MAX_FD]);
            let mut iov = [std::io::IoSliceMut::new(&mut bytes[filled..])];
            let message = recvmsg::<()>(
                socket.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
            )?;
            let truncated = message.flags.contains(MsgFlags::MSG_CTRUNC);
            let mut received = Vec::new();
            for control in message.cmsgs().map_err(std::io::Error::from)? {
                if let ControlMessageOwned::ScmRights(raw) = control {
                    // SAFETY: the kernel just installed these fds in this process for us;
                    // nothing else owns them.
                    received.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            Ok((message.bytes, truncated, received))
        });
        let (count, truncated, received) = match got {
            Ok(got) => got,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(err) => return Err(err),
        };
        fds.extend(received);
        // Counted as they come: a helper sending a byte at a time with fds each would
        // otherwise fill this process's descriptor table before the message ends.
        if truncated || fds.len() > FDS {
            return Err(invalid(
                "the helper sent more fds than a hand-over has".into(),
            ));
        }
        if count == 0 {
            return if filled == 0 {
                Ok(None)
            } else {
                Err(invalid(
                    "the helper closed the socket within a hand-over".into(),
                ))
            };
        }
        filled += count;
    }
    if fds.len() != FDS {
        return Err(invalid(format!(
            "a hand-over with {} fds ({FDS} expected)",
            fds.len()
        )));
    }
    for fd in &fds {
        if !is_eventfd(fd) {
            return Err(invalid(
                "a hand-over with an fd that is not an eventfd".into(),
            ));
        }
    }
    let hand_over = HandOver::decode(&bytes, max_ring_size).map_err(invalid)?;
    let mut fds = fds.into_iter();
    let mut take = || fds.next().expect("counted");
    Ok(Some(Received {
        hand_over,
        notifications: [take(), take()],
        interrupt: take(),
    }))
}

/// Whether `fd` is an eventfd (the kernel names its file `anon_inode:[eventfd]`).
fn is_eventfd(fd: &OwnedFd) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|target| target.as_os_str() == "anon_inode:[eventfd]")
}

#[cfg(test)]
mod tests {
    use super::*;
    use krunbox_virtio::handover::{sample, send};

    #[tokio::test]
    async fn a_hand_over_arrives_with_its_eventfds_and_nothing_else_is_taken_for_one() {
        let (helper, library) = std::os::unix::net::UnixStream::pair().unwrap();
        library.set_nonblocking(true).unwrap();
        let library = tokio::net::UnixStream::from_std(library).unwrap();
        let events: Vec<OwnedFd> = (0..3)
            .map(|_| OwnedFd::from(nix::sys::eventfd::EventFd::new().unwrap()))
            .collect();
        let raw: Vec<RawFd> = events.iter().map(|fd| fd.as_raw_fd()).collect();
        send(&helper, &sample(), [raw[0], raw[1]], raw[2]).unwrap();
        let received = receive(&library, 1024).await.unwrap().unwrap();
        assert_eq!(received.hand_over, sample());
        // The interrupt fd is the same eventfd: what is written to ours is read from theirs.
        nix::unistd::write(&received.interrupt, &1u64.to_ne_bytes()).unwrap();
        let mut count = [0u8; 8];
        nix::unistd::read(&events[2], &mut count).unwrap();
        assert_eq!(u64::from_ne_bytes(count), 1);

        // A socket instead of an eventfd is refused.
        let (helper, library) = std::os::unix::net::UnixStream::pair().unwrap();
        library.set_nonblocking(true).unwrap();
        let library = tokio::net::UnixStream::from_std(library).unwrap();
        let stranger = std::os::unix::net::UnixStream::pair().unwrap().0;
        send(&helper, &sample(), [raw[0], stranger.as_raw_fd()], raw[2]).unwrap();
        assert!(receive(&library, 1024).await.is_err());

        // A helper that sends fds with every byte is stopped at the fourth fd.
        let (helper, library) = std::os::unix::net::UnixStream::pair().unwrap();
        library.set_nonblocking(true).unwrap();
        let library = tokio::net::UnixStream::from_std(library).unwrap();
        for _ in 0..2 {
            let control = [nix::sys::socket::ControlMessage::ScmRights(&raw)];
            nix::sys::socket::sendmsg::<()>(
                helper.as_raw_fd(),
                &[std::io::IoSlice::new(&sample().encode()[..1])],
                &control,
                nix::sys::socket::MsgFlags::empty(),
                None,
            )
            .unwrap();
        }
        let err = receive(&library, 1024).await.unwrap_err();
        assert!(err.to_string().contains("more fds"), "{err}");

        // A helper that closes first sends nothing.
        let (helper, library) = std::os::unix::net::UnixStream::pair().unwrap();
        library.set_nonblocking(true).unwrap();
        let library = tokio::net::UnixStream::from_std(library).unwrap();
        drop(helper);
        assert!(receive(&library, 1024).await.unwrap().is_none());
    }
}
