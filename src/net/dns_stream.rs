//! DNS over TCP to the guest's resolver (RFC 7766): the queries a guest sends over UDP, sent
//! instead as messages behind a two-byte length on a connection to port 53, as resolvers do
//! for answers too large for a datagram or when told to (`options use-vc`, `dig +tcp`). Each
//! query is put to the policy exactly as a datagram's is (the service's `ask`); answers go back
//! in order on the same connection, which stays open for more until the guest closes it or
//! leaves it idle.
//!
//! Bounded: one query at a time per connection (the next is not read before the answer is
//! sent), a message of at most [`MESSAGE_MAX`] bytes (a longer one ends the connection), and
//! [`IDLE`] without a query, or with an answer the guest does not take, ends it too. Connections count against the sandbox's
//! (`MAX_CONNECTIONS` in the stack).

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::codec::{Framed, LengthDelimitedCodec};

use super::dns::{self, GuestQuery, Incoming};

/// The longest message read: a query holds one name (at most 255 bytes on the wire) and
/// perhaps an EDNS record; a kilobyte is plenty, and more is not a query we answer.
pub(crate) const MESSAGE_MAX: usize = 1024;

/// How long a connection may wait for its next query before it is closed (RFC 7766 asks
/// servers to close idle connections, in seconds rather than minutes).
pub(crate) const IDLE: Duration = Duration::from_secs(10);

/// Serves DNS on `stream`, the guest's end of a connection to the resolver's port 53, until
/// the guest closes it, leaves it idle, or sends what is not a query. `ask` answers one
/// query (`None`: the service is stopping). An error (a message past [`MESSAGE_MAX`], the
/// stream cut mid-message) resets the connection.
pub(crate) async fn serve<S, F, Fut>(stream: S, mut ask: F) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: FnMut(GuestQuery) -> Fut,
    Fut: Future<Output = Option<Vec<u8>>>,
{
    let codec = LengthDelimitedCodec::builder()
        .length_field_length(2)
        .max_frame_length(MESSAGE_MAX)
        .new_codec();
    let mut messages = Framed::new(stream, codec);
    loop {
        let message = match tokio::time::timeout(IDLE, messages.next()).await {
            // Idle, or closed by the guest.
            Err(_) | Ok(None) => break,
            Ok(Some(message)) => message?,
        };
        let answer = match dns::incoming(&message) {
            // Not a query (a response, or bytes that do not parse): a server closes.
            Incoming::Ignore => break,
            Incoming::Answer(answer) => answer,
            Incoming::Query(query) => match ask(query).await {
                Some(answer) => answer,
                None => break,
            },
        };
        // A guest that stops reading holds its answer and the connection only this long.
        tokio::time::timeout(IDLE, messages.send(Bytes::from(answer)))
            .await
            .map_err(|_| unread())??;
    }
    tokio::time::timeout(IDLE, SinkExt::<Bytes>::close(&mut messages))
        .await
        .map_err(|_| unread())?
}

fn unread() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "the guest did not take its DNS answer in time",
    )
}

/// The fuzz entry point over what the guest controls in DNS over TCP (see
/// [`crate::fuzzing::dns_stream`]): `data` is everything the guest sends on one connection (cut
/// into writes by its own bytes), then it closes its end; every query is answered with one
/// address. Checks that nothing panics, that the service ends (no hang: the guest's close or
/// the idle bound), and that everything it sent back is whole length-prefixed messages, each a
/// response that parses (hickory-proto).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_stream(data: &[u8]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Real time (paused time needs tokio's test-util, which a fuzzing build does not have):
    // the guest closes its end after writing, so nothing here waits out the idle bound.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let (guest, host) = tokio::io::duplex(64 * 1024);
        let ask = |query: GuestQuery| {
            std::future::ready(query.answer(std::net::Ipv4Addr::new(192, 0, 2, 1), 60))
        };
        let served = tokio::spawn(serve(host, ask));
        let (mut from_host, mut to_host) = tokio::io::split(guest);
        let mut rest = data.to_vec();
        // The guest writes and reads at once: answers past the pipe's room never block it.
        tokio::spawn(async move {
            while !rest.is_empty() {
                let cut = usize::from(rest[0]).clamp(1, rest.len());
                let piece: Vec<u8> = rest.drain(..cut).collect();
                if to_host.write_all(&piece).await.is_err() {
                    break;
                }
            }
            let _ = to_host.shutdown().await;
        });
        let read = tokio::spawn(async move {
            let mut sent_back = Vec::new();
            let _ = from_host.read_to_end(&mut sent_back).await;
            sent_back
        });
        let deadline = IDLE * 4;
        let served = tokio::time::timeout(deadline, served).await;
        let served = served.expect("the service ended");
        assert!(served.is_ok(), "the service panicked");
        let mut sent_back = &read.await.expect("the guest's side")[..];
        while !sent_back.is_empty() {
            assert!(sent_back.len() >= 2, "a cut length");
            let length = usize::from(u16::from_be_bytes([sent_back[0], sent_back[1]]));
            assert!(sent_back.len() >= 2 + length, "a cut message");
            let message = hickory_proto::op::Message::from_vec(&sent_back[2..2 + length])
                .expect("an answer parses");
            assert_eq!(
                message.metadata.message_type,
                hickory_proto::op::MessageType::Response
            );
            sent_back = &sent_back[2 + length..];
        }
    });
}

/// Connections a guest's resolver opens, and a few it should not: each is a `dns_stream`
/// input (the datagram seeds, framed, two to a connection; a length past the bound; a length
/// with its message cut short).
#[cfg(test)]
pub(crate) fn dns_stream_seeds() -> Vec<Vec<u8>> {
    let framed = |message: &[u8]| {
        let mut bytes = (message.len() as u16).to_be_bytes().to_vec();
        bytes.extend_from_slice(message);
        bytes
    };
    let datagrams = dns::tests::dns_query_seeds();
    let mut seeds: Vec<Vec<u8>> = datagrams
        .chunks(2)
        .map(|pair| pair.iter().flat_map(|m| framed(m)).collect())
        .collect();
    seeds.push(framed(&vec![0; MESSAGE_MAX + 1]));
    seeds.push(framed(&datagrams[0])[..8].to_vec());
    seeds
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{Message, ResponseCode};
    use hickory_proto::rr::RecordType;
    use std::net::Ipv4Addr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn framed(message: &[u8]) -> Vec<u8> {
        let mut bytes = (message.len() as u16).to_be_bytes().to_vec();
        bytes.extend_from_slice(message);
        bytes
    }

    async fn read_answer(guest: &mut tokio::io::DuplexStream) -> Message {
        let length = guest.read_u16().await.unwrap();
        let mut answer = vec![0; usize::from(length)];
        guest.read_exact(&mut answer).await.unwrap();
        Message::from_vec(&answer).unwrap()
    }

    /// The answer `ask` gives here: 192.0.2.N for the Nth query asked.
    fn numbered() -> impl FnMut(GuestQuery) -> std::future::Ready<Option<Vec<u8>>> {
        let mut asked = 0;
        move |query: GuestQuery| {
            asked += 1;
            std::future::ready(query.answer(Ipv4Addr::new(192, 0, 2, asked), 60))
        }
    }

    /// Two queries in one write and a third later, on one connection: each answered in
    /// order, through `ask`; a query `incoming` answers itself (two questions) does not reach
    /// `ask`; the guest's close ends the service cleanly.
    #[tokio::test]
    async fn queries_are_answered_in_order_on_one_connection() {
        let (mut guest, host) = tokio::io::duplex(4096);
        let served = tokio::spawn(serve(host, numbered()));
        let a = dns::tests::query("one.test.", RecordType::A);
        let b = dns::tests::query("two.test.", RecordType::A);
        guest
            .write_all(&[framed(&a), framed(&b)].concat())
            .await
            .unwrap();
        for expected in [1, 2] {
            let answer = read_answer(&mut guest).await;
            assert_eq!(
                answer.answers[0].data,
                hickory_proto::rr::RData::A(hickory_proto::rr::rdata::A(Ipv4Addr::new(
                    192, 0, 2, expected
                )))
            );
        }
        let mut two = Message::from_vec(&a).unwrap();
        two.add_query(Message::from_vec(&b).unwrap().queries[0].clone());
        guest
            .write_all(&framed(&two.to_vec().unwrap()))
            .await
            .unwrap();
        assert_eq!(
            read_answer(&mut guest).await.metadata.response_code,
            ResponseCode::FormErr
        );
        guest.write_all(&framed(&a)).await.unwrap();
        let third = read_answer(&mut guest).await;
        assert_eq!(third.answers.len(), 1, "the third query reached `ask`");
        guest.shutdown().await.unwrap();
        served.await.unwrap().unwrap();
    }

    /// A message past the bound resets the connection before anything is asked; a response
    /// (not a query) closes it; an idle connection is closed after [`IDLE`].
    #[tokio::test]
    async fn long_messages_responses_and_idle_connections_end_it() {
        let never = |_: GuestQuery| async { panic!("nothing is asked") };
        let (mut guest, host) = tokio::io::duplex(4096);
        let served = tokio::spawn(serve(host, never));
        guest
            .write_all(&framed(&vec![0; MESSAGE_MAX + 1]))
            .await
            .unwrap();
        assert!(served.await.unwrap().is_err());

        let (mut guest, host) = tokio::io::duplex(4096);
        let served = tokio::spawn(serve(host, never));
        let mut response = Message::from_vec(&dns::tests::query("x.test.", RecordType::A)).unwrap();
        response.metadata.message_type = hickory_proto::op::MessageType::Response;
        guest
            .write_all(&framed(&response.to_vec().unwrap()))
            .await
            .unwrap();
        served.await.unwrap().unwrap();
        assert_eq!(
            guest.read(&mut [0; 8]).await.unwrap(),
            0,
            "closed, no answer"
        );

        tokio::time::pause();
        let (mut guest, host) = tokio::io::duplex(4096);
        let served = tokio::spawn(serve(host, never));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        tokio::time::advance(IDLE - Duration::from_secs(1)).await;
        assert!(!served.is_finished(), "closed before the idle bound");
        tokio::time::advance(Duration::from_secs(2)).await;
        served.await.unwrap().unwrap();
        assert_eq!(
            guest.read(&mut [0; 8]).await.unwrap(),
            0,
            "closed when idle"
        );
    }

    /// A guest that sends a query and never reads holds the connection only for the idle
    /// bound: the answer it does not take times out and the connection is reset.
    #[tokio::test(start_paused = true)]
    async fn a_guest_that_does_not_read_its_answers_is_cut_off() {
        // Room for less than one answer.
        let (mut guest, host) = tokio::io::duplex(16);
        let served = tokio::spawn(serve(host, numbered()));
        let query = dns::tests::query("one.test.", RecordType::A);
        guest.write_all(&framed(&query)).await.unwrap();
        let result = tokio::time::timeout(IDLE * 3, served)
            .await
            .expect("the service ended")
            .unwrap();
        assert_eq!(
            result.unwrap_err().kind(),
            std::io::ErrorKind::TimedOut,
            "reset, not closed"
        );
    }

    #[test]
    fn the_stream_fuzz_property_holds_on_the_seeds_and_mutations() {
        let seeds = dns_stream_seeds();
        for seed in &seeds {
            fuzz_stream(seed);
        }
        crate::fuzzing::mutate_seeds(&seeds, 2_000, 0x2545_f491_4f6c_dd1d, fuzz_stream);
    }

    /// The committed corpus, replayed on every test run.
    #[test]
    fn the_dns_stream_fuzz_corpus_holds_the_property() {
        crate::fuzzing::replay_corpus("dns_stream", fuzz_stream);
    }

    /// The corpus holds the seeds as they are generated now (`seed-NN`). After changing them,
    /// write them with `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_dns_stream_seeds`.
    #[test]
    fn committed_dns_stream_seeds_are_the_generated_ones() {
        crate::fuzzing::assert_committed_seeds("dns_stream", &dns_stream_seeds());
    }
}
