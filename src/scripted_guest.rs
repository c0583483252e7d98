//! A scripted guest for unit tests: the host's real [`Control`] on one end of an in-memory
//! stream, and on the other a fake guest-init that answers pings by itself and every other
//! message as the test's script says (or not at all: the point of most of these tests).
//! Run in tokio's paused time, minutes of waiting take no time and deadlines are exact.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::control::{Control, Liveness};
use crate::limits::Limits;
use crate::protocol::{FrameDecoder, GuestMessage, HostMessage, Pong};

/// What the script was sent, in order (pings left out).
pub(crate) type Log = Arc<Mutex<Vec<HostMessage>>>;

/// Starts a control channel with `limits` whose guest answers each host message (other than a
/// ping) with what `script` returns for it. The guest answers pings, so it is never hung.
pub(crate) fn start(
    limits: Limits,
    mut script: impl FnMut(&HostMessage) -> Vec<GuestMessage> + Send + 'static,
) -> (Arc<Control>, Log) {
    let (host, guest) = tokio::io::duplex(4 << 20);
    let control = Control::start(
        host,
        FrameDecoder::new(),
        Liveness::new(Duration::from_secs(30)),
        limits,
    );
    let log: Log = Arc::default();
    let seen = log.clone();
    tokio::spawn(async move {
        let (mut reader, mut writer) = tokio::io::split(guest);
        let mut decoder = FrameDecoder::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            while let Some(frame) = decoder.next_frame().unwrap() {
                let message = HostMessage::decode(&frame).unwrap();
                let answers = match &message {
                    HostMessage::Ping(ping) => vec![GuestMessage::Pong(Pong { seq: ping.seq })],
                    other => {
                        let answers = script(other);
                        seen.lock().unwrap().push(message);
                        answers
                    }
                };
                for answer in answers {
                    if writer.write_all(&answer.encode().unwrap()).await.is_err() {
                        return;
                    }
                }
            }
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => decoder.push(&buf[..n]).unwrap(),
            }
        }
    });
    (control, log)
}
