//! A DNS server for the network tests, on 127.0.0.1 over UDP: each query that parses is
//! answered by the test's `answer` function (given the question's name, `origin.test.`, and a
//! `NOERROR` response holding the question, to add records to or change the code of), and its
//! name is kept, in arrival order, for the test to count.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use hickory_proto::op::{Message, OpCode};

/// The names asked, in arrival order.
pub type Asked = Arc<Mutex<Vec<String>>>;

/// Starts the server: its address and the names it is asked.
pub async fn start(answer: impl Fn(&str, &mut Message) + Send + 'static) -> (SocketAddr, Asked) {
    let socket = tokio::net::UdpSocket::bind((IpAddr::V4(Ipv4Addr::LOCALHOST), 0))
        .await
        .unwrap();
    let addr = socket.local_addr().unwrap();
    let asked = Asked::default();
    let kept = asked.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 512];
        while let Ok((n, peer)) = socket.recv_from(&mut buf).await {
            let Ok(query) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let Some(question) = query.queries.first() else {
                continue;
            };
            let name = question.name().to_ascii();
            kept.lock().unwrap().push(name.clone());
            let mut response = Message::response(query.metadata.id, OpCode::Query);
            response.add_queries(query.queries.clone());
            answer(&name, &mut response);
            let _ = socket.send_to(&response.to_vec().unwrap(), peer).await;
        }
    });
    (addr, asked)
}

/// An `A` record for `owner`.
pub fn a(owner: &str, ttl: u32, ip: Ipv4Addr) -> hickory_proto::rr::Record {
    use hickory_proto::rr::{rdata::A, Name, RData, Record};
    Record::from_rdata(Name::from_ascii(owner).unwrap(), ttl, RData::A(A(ip)))
}
