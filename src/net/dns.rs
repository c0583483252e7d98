//! DNS for the guest: its queries parsed and answered (sans-IO), and the host-side resolvers a
//! granted query is resolved with. Messages are parsed and built with hickory-proto only.
//!
//! The guest is answered for `A` queries only: a granted name gets one address, the sandbox's
//! own for it (see [`super::names`]). Other types of a granted name (`AAAA`: the guest has no
//! IPv6; `MX`, `TXT`, ...) are answered with no records, so resolvers move on at once.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, Query as Question, ResponseCode};
use hickory_proto::rr::rdata::{A, CNAME};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};

use super::policy::{ResolverKind, SYSTEM_TTL};
use crate::budget::Budget;

/// The largest DNS message answered over UDP (RFC 1035's limit without EDNS). The guest's
/// answers hold its question and at most one address, far below it.
pub(crate) const UDP_MAX: usize = 512;

/// The longest name (RFC 1035: 255 bytes on the wire, so at most 253 as text).
const NAME_MAX: usize = 253;

/// How long each upstream server gets to answer, and how many times each is asked.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
const UPSTREAM_TRIES: usize = 2;

/// How long one try of one upstream server gets for a whole lookup (its CNAME hops, a TCP
/// retry): at most two tries of each server, so a slow server holds a query at most 12 s.
const LOOKUP_DEADLINE: Duration = Duration::from_secs(6);

/// How long the system resolver gets.
const SYSTEM_TIMEOUT: Duration = Duration::from_secs(10);

/// The most addresses kept from one answer.
const ANSWER_MAX: usize = 16;

/// A guest query the gateway can put to the policy.
#[derive(Debug, Clone)]
pub(crate) struct GuestQuery {
    message: Message,
    /// Lower case, without the final dot.
    pub name: String,
    pub record_type: RecordType,
}

/// What to do with a datagram to the guest's DNS server.
#[derive(Debug)]
pub(crate) enum Incoming {
    /// A well-formed query for one name: ask the policy.
    Query(GuestQuery),
    /// A query that is answered at once, without the policy (this answer).
    Answer(Vec<u8>),
    /// Not a query (a response, or bytes that do not parse): no answer, as a server would.
    Ignore,
}

/// Reads a datagram from the guest.
pub(crate) fn incoming(bytes: &[u8]) -> Incoming {
    let Ok(message) = Message::from_vec(bytes) else {
        return Incoming::Ignore;
    };
    if message.metadata.message_type != MessageType::Query {
        return Incoming::Ignore;
    }
    let code = if message.metadata.op_code != OpCode::Query {
        ResponseCode::NotImp
    } else if message.queries.len() != 1 {
        ResponseCode::FormErr
    } else {
        let question = &message.queries[0];
        let name = question
            .name()
            .to_lowercase()
            .to_ascii()
            .trim_end_matches('.')
            .to_string();
        if question.query_class() != DNSClass::IN || name.is_empty() || name.len() > NAME_MAX {
            ResponseCode::Refused
        } else {
            let record_type = question.query_type();
            return Incoming::Query(GuestQuery {
                message,
                name,
                record_type,
            });
        }
    };
    reply(&message, code, None).map_or(Incoming::Ignore, Incoming::Answer)
}

impl GuestQuery {
    /// The answer: `address` for an `A` query, no records for any other type.
    pub(crate) fn answer(&self, address: Ipv4Addr, ttl: u32) -> Option<Vec<u8>> {
        let record = (self.record_type == RecordType::A).then(|| {
            Record::from_rdata(
                self.message.queries[0].name().clone(),
                ttl,
                RData::A(A(address)),
            )
        });
        reply(&self.message, ResponseCode::NoError, record)
    }

    /// An answer with no records and `code` (`REFUSED`, `NXDOMAIN`, `SERVFAIL`, ...).
    pub(crate) fn fail(&self, code: ResponseCode) -> Option<Vec<u8>> {
        reply(&self.message, code, None)
    }
}

/// The answer to `query` with `code` and at most one record; `None` if it would not fit a UDP
/// answer (it always does for a parsed query of one name).
fn reply(query: &Message, code: ResponseCode, record: Option<Record>) -> Option<Vec<u8>> {
    let mut answer = Message::error_msg(query.metadata.id, query.metadata.op_code, code);
    answer.metadata.recursion_desired = query.metadata.recursion_desired;
    answer.metadata.recursion_available = true;
    answer.add_queries(query.queries.iter().cloned());
    if let Some(record) = record {
        answer.add_answer(record);
    }
    let bytes = answer.to_vec().ok()?;
    (bytes.len() <= UDP_MAX).then_some(bytes)
}

/// A resolver's answer for a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Resolved {
    /// These addresses (possibly none: the name has no address), kept for the TTL (`None`:
    /// for good).
    Addresses(Vec<IpAddr>, Option<Duration>),
    /// The name does not exist.
    NoSuchName,
    /// No answer could be had; the reason, for the log.
    Failed(String),
}

/// Resolves `name` as `resolver` says, charging what it takes to `budget`: a blocking-pool
/// thread for the system resolver, a descriptor for an upstream query's socket.
pub(crate) async fn resolve(resolver: &ResolverKind, name: &str, budget: &Arc<Budget>) -> Resolved {
    match resolver {
        ResolverKind::Fixed(addresses) if addresses.is_empty() => Resolved::NoSuchName,
        ResolverKind::Fixed(addresses) => Resolved::Addresses(addresses.to_vec(), None),
        ResolverKind::System => {
            // getaddrinfo blocks a pool thread, past our timeout too: the thread keeps the
            // sandbox's permit until it returns, so a flood of slow lookups holds at most the
            // sandbox's share of the pool, never every other sandbox's.
            let permit = budget.blocking().await;
            let host = name.to_owned();
            let lookup = tokio::task::spawn_blocking(move || {
                let _permit = permit;
                std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), 0))
                    .map(|found| found.collect::<Vec<_>>())
            });
            let lookup = async {
                lookup
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e)))
            };
            match tokio::time::timeout(SYSTEM_TIMEOUT, lookup).await {
                Ok(Ok(found)) => {
                    let mut addresses: Vec<IpAddr> = Vec::new();
                    for a in found.iter().map(|a| a.ip()) {
                        if !addresses.contains(&a) && addresses.len() < ANSWER_MAX {
                            addresses.push(a);
                        }
                    }
                    Resolved::Addresses(addresses, Some(SYSTEM_TTL))
                }
                // getaddrinfo does not say whether the name is missing or the lookup failed.
                Ok(Err(err)) => Resolved::Failed(format!("the system resolver: {err}")),
                Err(_) => Resolved::Failed("the system resolver timed out".into()),
            }
        }
        ResolverKind::Upstream(servers) => {
            let mut failures = Vec::new();
            for server in servers.iter() {
                for _ in 0..UPSTREAM_TRIES {
                    let Some(_charge) = budget.descriptor() else {
                        failures
                            .push("the sandbox holds as many host descriptors as it may".into());
                        continue;
                    };
                    // One deadline for the whole lookup: its CNAME hops and TCP retries each
                    // have their own, which add up.
                    match tokio::time::timeout(LOOKUP_DEADLINE, ask_upstream(*server, name)).await {
                        Ok(Ok(resolved)) => return resolved,
                        Ok(Err(err)) => failures.push(format!("{server}: {err}")),
                        Err(_) => failures.push(format!(
                            "{server}: no whole answer within {LOOKUP_DEADLINE:?}"
                        )),
                    }
                }
            }
            if failures.is_empty() {
                failures.push("no servers".into());
            }
            Resolved::Failed(failures.join("; "))
        }
    }
}

/// Asks `server` for the addresses of `name` (over UDP, over TCP if the answer is truncated),
/// following its CNAME chain: when an answer
/// names an alias's target without its addresses, the target is asked for in turn (at most
/// [`CHAIN_MAX`] names in all).
async fn ask_upstream(server: SocketAddr, name: &str) -> Result<Resolved, String> {
    let mut asked = Name::from_ascii(format!("{name}.")).map_err(|e| format!("bad name: {e}"))?;
    let mut chain_ttl = u32::MAX;
    let mut passed = 0;
    loop {
        let answer = query_upstream(server, &asked).await?;
        match read_answer(&answer, &asked, CHAIN_MAX - passed) {
            Chain::End(Resolved::Addresses(addresses, Some(ttl))) => {
                let ttl = ttl.min(Duration::from_secs(u64::from(chain_ttl)));
                return Ok(Resolved::Addresses(addresses, Some(ttl)));
            }
            Chain::End(resolved) => return Ok(resolved),
            Chain::Alias {
                target,
                passed: more,
                ttl,
            } => {
                passed += more;
                if passed >= CHAIN_MAX {
                    return Err(format!("a CNAME chain of more than {CHAIN_MAX} names"));
                }
                chain_ttl = chain_ttl.min(ttl);
                asked = target;
            }
        }
    }
}

/// The largest answer read over TCP: DNS's own limit there (a two-byte length).
const TCP_ANSWER_MAX: usize = u16::MAX as usize;

/// One `A` query for `fqdn` to `server`: over UDP, and once more over TCP when the UDP answer
/// came truncated (the server's way of saying the answer needs TCP, RFC 7766).
async fn query_upstream(server: SocketAddr, fqdn: &Name) -> Result<Message, String> {
    let answer = query_udp(server, fqdn).await?;
    if !answer.metadata.truncation {
        return Ok(answer);
    }
    // A server (or a firewall) without DNS over TCP: what the truncated answer holds is
    // still the server's answer, often with the addresses needed.
    Ok(query_tcp(server, fqdn).await.unwrap_or(answer))
}

/// An `A` query for `fqdn`, with a fresh random id: the id and the bytes.
fn a_query(fqdn: &Name) -> Result<(u16, Vec<u8>), String> {
    let id = random_id();
    let mut query = Message::new(id, MessageType::Query, OpCode::Query);
    query.metadata.recursion_desired = true;
    query.add_query(Question::query(fqdn.clone(), RecordType::A));
    Ok((id, query.to_vec().map_err(|e| e.to_string())?))
}

/// One `A` query for `fqdn` to `server` over TCP: length-prefixed messages (tokio-util's
/// codec), within [`UPSTREAM_TIMEOUT`] for the connection and the answer together.
async fn query_tcp(server: SocketAddr, fqdn: &Name) -> Result<Message, String> {
    use futures_util::{SinkExt, StreamExt};
    let (id, bytes) = a_query(fqdn)?;
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(server)
            .await
            .map_err(|e| format!("over TCP: {e}"))?;
        let codec = tokio_util::codec::LengthDelimitedCodec::builder()
            .length_field_length(2)
            .max_frame_length(TCP_ANSWER_MAX)
            .new_codec();
        let mut messages = tokio_util::codec::Framed::new(stream, codec);
        messages
            .send(bytes::Bytes::from(bytes))
            .await
            .map_err(|e| format!("over TCP: {e}"))?;
        while let Some(message) = messages.next().await {
            let message = message.map_err(|e| format!("over TCP: {e}"))?;
            match Message::from_vec(&message) {
                Ok(answer) if is_answer_to(&answer, id, fqdn) => return Ok(answer),
                _ => continue,
            }
        }
        Err("over TCP: the server closed the connection without an answer".to_string())
    };
    tokio::time::timeout(UPSTREAM_TIMEOUT, exchange)
        .await
        .map_err(|_| "over TCP: no answer in time".to_string())?
}

/// One `A` query for `fqdn` to `server` over UDP: its answer.
async fn query_udp(server: SocketAddr, fqdn: &Name) -> Result<Message, String> {
    let (id, bytes) = a_query(fqdn)?;
    let local: SocketAddr = match server {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = tokio::net::UdpSocket::bind(local)
        .await
        .map_err(|e| e.to_string())?;
    socket.connect(server).await.map_err(|e| e.to_string())?;
    socket.send(&bytes).await.map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 4096];
    let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
    loop {
        let n = tokio::time::timeout_at(deadline, socket.recv(&mut buf))
            .await
            .map_err(|_| "no answer in time".to_string())?
            .map_err(|e| e.to_string())?;
        // Anything that is not the answer to this query (a stray or spoofed datagram) is
        // skipped, not believed.
        match Message::from_vec(&buf[..n]) {
            Ok(answer) if is_answer_to(&answer, id, fqdn) => return Ok(answer),
            _ => continue,
        }
    }
}

fn is_answer_to(answer: &Message, id: u16, name: &Name) -> bool {
    answer.metadata.message_type == MessageType::Response
        && answer.metadata.id == id
        && answer.queries.len() == 1
        && answer.queries[0].query_type() == RecordType::A
        // Case-insensitive, as names compare in DNS.
        && answer.queries[0].name() == name
}

/// The most names of one CNAME chain (the name asked for included) followed: a longer chain,
/// or a loop, is a failure. Resolvers stop at about as many.
const CHAIN_MAX: usize = 8;

/// What an upstream answer says of the name asked for.
#[derive(Debug, PartialEq, Eq)]
enum Chain {
    /// The name's addresses (those of the end of its chain), or its failure.
    End(Resolved),
    /// The name is an alias of `target`, whose addresses the answer does not hold, through
    /// `passed` names (the one asked for and the aliases after it); `ttl` is the shortest of
    /// the chain's records.
    Alias {
        target: Name,
        passed: usize,
        ttl: u32,
    },
}

/// Reads an upstream answer for `asked`: its `A` records, or those of the name its CNAME chain
/// ends at, from the answer section or the additional one (servers put the target's records in
/// either); the TTL is the shortest on the way. Only records on the chain count: an answer
/// cannot give the name asked for the addresses of a name it does not lead to. At most
/// `names_left` names are walked.
fn read_answer(answer: &Message, asked: &Name, names_left: usize) -> Chain {
    match answer.metadata.response_code {
        ResponseCode::NoError => {}
        ResponseCode::NXDomain => return Chain::End(Resolved::NoSuchName),
        code => return Chain::End(Resolved::Failed(format!("the server answered {code}"))),
    }
    let records = || answer.answers.iter().chain(&answer.additionals);
    let mut owner = asked;
    let mut ttl = u32::MAX;
    for length in 1..=names_left {
        let mut addresses = Vec::new();
        let mut address_ttl = ttl;
        for record in records().filter(|r| &r.name == owner) {
            if let RData::A(A(address)) = record.data {
                let address = IpAddr::V4(address);
                if addresses.len() < ANSWER_MAX && !addresses.contains(&address) {
                    addresses.push(address);
                    address_ttl = address_ttl.min(record.ttl);
                }
            }
        }
        if !addresses.is_empty() {
            let ttl = Duration::from_secs(u64::from(address_ttl));
            return Chain::End(Resolved::Addresses(addresses, Some(ttl)));
        }
        let alias = records().find_map(|r| match &r.data {
            RData::CNAME(CNAME(target)) if &r.name == owner => Some((target, r.ttl)),
            _ => None,
        });
        match alias {
            Some((target, record_ttl)) => {
                ttl = ttl.min(record_ttl);
                owner = target;
            }
            // The end of the chain, and no addresses for it here: the name asked for has
            // none, or its alias's are to be asked for.
            None if owner == asked => {
                return Chain::End(Resolved::Addresses(Vec::new(), Some(Duration::ZERO)))
            }
            None => {
                return Chain::Alias {
                    target: owner.clone(),
                    passed: length - 1,
                    ttl,
                }
            }
        }
    }
    Chain::End(Resolved::Failed(format!(
        "a CNAME chain of more than {CHAIN_MAX} names"
    )))
}

/// A query id nobody off the host can guess (RFC 5452): from the hasher's random keys.
fn random_id() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish() as u16
}

/// The fuzz entry point over what the guest controls in DNS (see
/// [`crate::fuzzing::dns_query`]): `data` is one datagram to the gateway's port 53, read by
/// [`incoming`]; a [`GuestQuery`] is then answered every way the service answers one
/// ([`GuestQuery::answer`] with a few addresses and TTLs, [`GuestQuery::fail`] with each code
/// it uses). Checks that nothing panics and that every answer is at most [`UDP_MAX`] bytes and
/// parses back (hickory-proto) as a response to this query: its id, its opcode and its
/// questions, exactly (names compared case-sensitively). An `A` answer holds exactly one
/// record, `A` with the given address and TTL for the question's name; every other answer
/// holds none. A datagram that parses as a query of at most one question is always answered.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_query(data: &[u8]) {
    let sent = Message::from_vec(data).ok();
    let incoming = incoming(data);
    if let Some(sent) = &sent {
        if sent.metadata.message_type == MessageType::Query && sent.queries.len() <= 1 {
            assert!(
                !matches!(incoming, Incoming::Ignore),
                "a query of one question got no answer"
            );
        }
    }
    match incoming {
        Incoming::Ignore => {}
        Incoming::Answer(answer) => {
            let sent = sent.expect("only a message that parses is answered");
            let answer = check_reply(&answer, &sent);
            assert!(answer.answers.is_empty());
            assert!(matches!(
                answer.metadata.response_code,
                ResponseCode::NotImp | ResponseCode::FormErr | ResponseCode::Refused
            ));
        }
        Incoming::Query(query) => {
            let sent = sent.expect("only a message that parses is a query");
            assert_eq!(sent.queries.len(), 1);
            let question = &sent.queries[0];
            assert_eq!(question.query_class(), DNSClass::IN);
            assert_eq!(query.record_type, question.query_type());
            assert!(!query.name.is_empty() && query.name.len() <= NAME_MAX);
            assert!(!query.name.ends_with('.'));
            assert_eq!(query.name, query.name.to_ascii_lowercase());
            let id = sent.metadata.id;
            let address = Ipv4Addr::new(198, 18 | (id >> 15) as u8, (id >> 8) as u8, id as u8);
            for (address, ttl) in [
                (address, 0),
                (address, 300),
                (Ipv4Addr::BROADCAST, u32::MAX),
            ] {
                let answer = query.answer(address, ttl).expect("an answer always fits");
                let answer = check_reply(&answer, &sent);
                assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
                if query.record_type == RecordType::A {
                    assert_eq!(answer.answers.len(), 1, "one record");
                    let record = &answer.answers[0];
                    assert!(record.name.eq_case(question.name()));
                    assert_eq!(record.dns_class, DNSClass::IN);
                    assert_eq!(record.ttl, ttl);
                    assert_eq!(record.data, RData::A(A(address)));
                } else {
                    assert!(answer.answers.is_empty(), "no records for another type");
                }
            }
            for code in [
                ResponseCode::Refused,
                ResponseCode::NoError,
                ResponseCode::NXDomain,
                ResponseCode::ServFail,
            ] {
                let answer = query.fail(code).expect("a failure always fits");
                let answer = check_reply(&answer, &sent);
                assert_eq!(answer.metadata.response_code, code);
                assert!(answer.answers.is_empty());
            }
        }
    }
}

/// Checks that `bytes` is an answer to `query` (size, response, id, opcode, the same questions
/// and nothing but answers), and returns it parsed.
#[cfg(any(test, feature = "fuzzing"))]
fn check_reply(bytes: &[u8], query: &Message) -> Message {
    assert!(bytes.len() <= UDP_MAX, "{} bytes", bytes.len());
    let answer = Message::from_vec(bytes).expect("an answer parses");
    assert_eq!(answer.metadata.message_type, MessageType::Response);
    assert_eq!(answer.metadata.id, query.metadata.id);
    assert_eq!(answer.metadata.op_code, query.metadata.op_code);
    assert_eq!(answer.queries.len(), query.queries.len());
    for (ours, theirs) in answer.queries.iter().zip(&query.queries) {
        assert!(ours.name().eq_case(theirs.name()), "{ours} for {theirs}");
        assert_eq!(ours.query_type(), theirs.query_type());
        assert_eq!(ours.query_class(), theirs.query_class());
    }
    assert!(answer.authorities.is_empty() && answer.additionals.is_empty());
    assert!(answer.edns.is_none() && answer.signature.is_none());
    answer
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn budget() -> Arc<Budget> {
        Budget::new(&crate::Limits::new())
    }

    pub(crate) fn query(name: &str, record_type: RecordType) -> Vec<u8> {
        let mut query = Message::new(0x1234, MessageType::Query, OpCode::Query);
        query.metadata.recursion_desired = true;
        query.add_query(Question::query(name.parse().unwrap(), record_type));
        query.to_vec().unwrap()
    }

    fn parsed(bytes: &[u8]) -> Message {
        Message::from_vec(bytes).unwrap()
    }

    #[test]
    fn a_query_is_read_with_its_name_in_lower_case() {
        let Incoming::Query(q) = incoming(&query("Origin.TEST.", RecordType::A)) else {
            panic!()
        };
        assert_eq!(q.name, "origin.test");
        assert_eq!(q.record_type, RecordType::A);
        let answer = parsed(&q.answer(Ipv4Addr::new(198, 18, 0, 1), 60).unwrap());
        assert_eq!(answer.metadata.id, 0x1234);
        assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
        assert_eq!(answer.answers.len(), 1);
        assert_eq!(answer.answers[0].ttl, 60);
        assert_eq!(
            answer.answers[0].data,
            RData::A(A(Ipv4Addr::new(198, 18, 0, 1)))
        );
        // Any other type of a granted name: no records.
        let Incoming::Query(q) = incoming(&query("origin.test.", RecordType::AAAA)) else {
            panic!()
        };
        let answer = parsed(&q.answer(Ipv4Addr::new(198, 18, 0, 1), 60).unwrap());
        assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
        assert!(answer.answers.is_empty());
        let answer = parsed(&q.fail(ResponseCode::NXDomain).unwrap());
        assert_eq!(answer.metadata.response_code, ResponseCode::NXDomain);
    }

    #[test]
    fn odd_queries_are_answered_without_the_policy_and_garbage_is_ignored() {
        let mut two = Message::new(7, MessageType::Query, OpCode::Query);
        two.add_query(Question::query("a.test.".parse().unwrap(), RecordType::A));
        two.add_query(Question::query("b.test.".parse().unwrap(), RecordType::A));
        let mut update = Message::new(8, MessageType::Query, OpCode::Update);
        update.add_query(Question::query("a.test.".parse().unwrap(), RecordType::A));
        let mut chaos = Message::new(9, MessageType::Query, OpCode::Query);
        let mut q = Question::query("version.bind.".parse().unwrap(), RecordType::TXT);
        q.set_query_class(DNSClass::CH);
        chaos.add_query(q);
        let root = query(".", RecordType::NS);
        for (bytes, code) in [
            (two.to_vec().unwrap(), ResponseCode::FormErr),
            (update.to_vec().unwrap(), ResponseCode::NotImp),
            (chaos.to_vec().unwrap(), ResponseCode::Refused),
            (root, ResponseCode::Refused),
        ] {
            let Incoming::Answer(answer) = incoming(&bytes) else {
                panic!("{code}")
            };
            assert_eq!(parsed(&answer).metadata.response_code, code);
        }
        let response = Message::error_msg(7, OpCode::Query, ResponseCode::NoError);
        for bytes in [&b"\x00\x01garbage"[..], &[], &response.to_vec().unwrap()] {
            assert!(matches!(incoming(bytes), Incoming::Ignore));
        }
    }

    fn name(text: &str) -> Name {
        text.parse().unwrap()
    }

    fn a(owner: &str, ttl: u32, ip: [u8; 4]) -> Record {
        Record::from_rdata(name(owner), ttl, RData::A(A(Ipv4Addr::from(ip))))
    }

    fn cname(owner: &str, ttl: u32, target: &str) -> Record {
        Record::from_rdata(name(owner), ttl, RData::CNAME(CNAME(name(target))))
    }

    fn response(asked: &str, answers: Vec<Record>, additionals: Vec<Record>) -> Message {
        let mut answer = Message::response(1, OpCode::Query);
        answer.add_query(Question::query(name(asked), RecordType::A));
        answer.add_answers(answers);
        answer.add_additionals(additionals);
        answer
    }

    fn addresses(ips: &[&str], ttl: u64) -> Chain {
        Chain::End(Resolved::Addresses(
            ips.iter().map(|ip| ip.parse().unwrap()).collect(),
            Some(Duration::from_secs(ttl)),
        ))
    }

    #[test]
    fn upstream_answers_give_their_a_records_and_shortest_ttl() {
        let asked = name("www.origin.test.");
        let answer = response(
            "www.origin.test.",
            vec![
                cname("www.origin.test.", 300, "cdn.test."),
                a("cdn.test.", 120, [192, 0, 2, 1]),
                a("cdn.test.", 60, [192, 0, 2, 2]),
                // Off the chain: not an address of the name asked for.
                a("elsewhere.test.", 10, [203, 0, 113, 9]),
            ],
            vec![],
        );
        assert_eq!(
            read_answer(&answer, &asked, CHAIN_MAX),
            addresses(&["192.0.2.1", "192.0.2.2"], 60)
        );
        assert!(is_answer_to(&answer, 1, &asked));
        assert!(!is_answer_to(&answer, 2, &asked), "another id");
        assert!(!is_answer_to(&answer, 1, &name("other.test.")));
        let missing = Message::error_msg(1, OpCode::Query, ResponseCode::NXDomain);
        assert_eq!(
            read_answer(&missing, &asked, CHAIN_MAX),
            Chain::End(Resolved::NoSuchName)
        );
        let failed = Message::error_msg(1, OpCode::Query, ResponseCode::ServFail);
        assert!(matches!(
            read_answer(&failed, &asked, CHAIN_MAX),
            Chain::End(Resolved::Failed(_))
        ));
    }

    /// A chain whose target's addresses are in the additional section (as CDNs' servers send
    /// them), one whose target's are not in the answer at all, and chains too long or looped.
    #[test]
    fn cname_chains_are_followed_through_both_sections_and_bounded() {
        let asked = name("registry.test.");
        let additional = response(
            "registry.test.",
            vec![
                cname("registry.test.", 300, "edge.cdn.test."),
                cname("Edge.CDN.test.", 200, "pop.cdn.test."),
            ],
            vec![a("pop.cdn.test.", 250, [192, 0, 2, 5])],
        );
        assert_eq!(
            read_answer(&additional, &asked, CHAIN_MAX),
            addresses(&["192.0.2.5"], 200),
            "the chain's shortest TTL, names compared without case"
        );
        let alias_only = response(
            "registry.test.",
            vec![cname("registry.test.", 30, "edge.cdn.test.")],
            vec![],
        );
        assert_eq!(
            read_answer(&alias_only, &asked, CHAIN_MAX),
            Chain::Alias {
                target: name("edge.cdn.test."),
                passed: 1,
                ttl: 30
            }
        );
        let no_address = response("registry.test.", vec![], vec![]);
        assert_eq!(
            read_answer(&no_address, &asked, CHAIN_MAX),
            addresses(&[], 0)
        );
        let looped = response(
            "registry.test.",
            vec![
                cname("registry.test.", 30, "b.test."),
                cname("b.test.", 30, "registry.test."),
            ],
            vec![],
        );
        assert!(matches!(
            read_answer(&looped, &asked, CHAIN_MAX),
            Chain::End(Resolved::Failed(_))
        ));
        let long: Vec<Record> = (0..CHAIN_MAX)
            .map(|i| {
                let owner = if i == 0 {
                    "registry.test.".to_string()
                } else {
                    format!("n{i}.test.")
                };
                cname(&owner, 30, &format!("n{}.test.", i + 1))
            })
            .chain([a(&format!("n{CHAIN_MAX}.test."), 30, [192, 0, 2, 9])])
            .collect();
        let long = response("registry.test.", long, vec![]);
        assert!(matches!(
            read_answer(&long, &asked, CHAIN_MAX),
            Chain::End(Resolved::Failed(_))
        ));
    }

    /// A server that answers the name asked for with an alias only: the target is asked for
    /// next, and its addresses are the name's, with the chain's shortest TTL.
    #[tokio::test]
    async fn an_alias_without_its_addresses_is_asked_for_next() {
        let server = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().unwrap();
        let serve = tokio::spawn(async move {
            let mut asked = Vec::new();
            let mut buf = [0u8; 512];
            for _ in 0..2 {
                let (n, peer) = server.recv_from(&mut buf).await.unwrap();
                let query = Message::from_vec(&buf[..n]).unwrap();
                let question = query.queries[0].name().to_ascii();
                let mut answer = Message::response(query.metadata.id, OpCode::Query);
                answer.add_queries(query.queries.clone());
                answer.add_answer(if question == "alias.test." {
                    cname("alias.test.", 20, "target.test.")
                } else {
                    a(&question, 600, [192, 0, 2, 8])
                });
                server
                    .send_to(&answer.to_vec().unwrap(), peer)
                    .await
                    .unwrap();
                asked.push(question);
            }
            asked
        });
        let resolved = resolve(
            &ResolverKind::Upstream([addr].into()),
            "alias.test",
            &budget(),
        )
        .await;
        assert_eq!(
            resolved,
            Resolved::Addresses(
                vec!["192.0.2.8".parse().unwrap()],
                Some(Duration::from_secs(20))
            )
        );
        assert_eq!(serve.await.unwrap(), ["alias.test.", "target.test."]);
    }

    #[tokio::test]
    async fn fixed_answers_need_no_server_and_none_means_no_such_name() {
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(
            resolve(&ResolverKind::Fixed([a].into()), "x.test", &budget()).await,
            Resolved::Addresses(vec![a], None)
        );
        assert_eq!(
            resolve(&ResolverKind::Fixed([].into()), "x.test", &budget()).await,
            Resolved::NoSuchName
        );
    }

    /// A DNS server on loopback that answers every `A` query with 192.0.2.7 (TTL 42), after
    /// first sending a datagram with the wrong id, which the client must skip.
    #[tokio::test]
    async fn an_upstream_server_on_loopback_is_asked_and_a_wrong_id_is_skipped() {
        let server = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().unwrap();
        let serve = tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let (n, peer) = server.recv_from(&mut buf).await.unwrap();
            let query = Message::from_vec(&buf[..n]).unwrap();
            let mut answer = Message::response(query.metadata.id, OpCode::Query);
            answer.add_queries(query.queries.clone());
            answer.add_answer(Record::from_rdata(
                query.queries[0].name().clone(),
                42,
                RData::A(A(Ipv4Addr::new(192, 0, 2, 7))),
            ));
            let mut spoof = answer.clone();
            spoof.metadata.id = query.metadata.id.wrapping_add(1);
            server
                .send_to(&spoof.to_vec().unwrap(), peer)
                .await
                .unwrap();
            server
                .send_to(&answer.to_vec().unwrap(), peer)
                .await
                .unwrap();
            query.queries[0].name().to_ascii()
        });
        let resolved = resolve(
            &ResolverKind::Upstream([addr].into()),
            "origin.test",
            &budget(),
        )
        .await;
        assert_eq!(
            resolved,
            Resolved::Addresses(
                vec!["192.0.2.7".parse().unwrap()],
                Some(Duration::from_secs(42))
            )
        );
        assert_eq!(serve.await.unwrap(), "origin.test.");
        // A server that does not answer: a failure naming it, after the retries.
        let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let silent_addr = silent.local_addr().unwrap();
        tokio::time::pause();
        let resolved = resolve(
            &ResolverKind::Upstream([silent_addr].into()),
            "x.test",
            &budget(),
        )
        .await;
        let Resolved::Failed(why) = resolved else {
            panic!("{resolved:?}")
        };
        assert!(why.contains(&silent_addr.to_string()), "{why}");
    }

    /// A server whose UDP answer is truncated (no records, the TC bit) is asked again over TCP,
    /// on the same port, and its TCP answer is the name's.
    #[tokio::test]
    async fn a_truncated_answer_is_asked_again_over_tcp() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (udp, tcp) = loop {
            let udp = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            if let Ok(tcp) = tokio::net::TcpListener::bind(udp.local_addr().unwrap()).await {
                break (udp, tcp);
            }
        };
        let addr = udp.local_addr().unwrap();
        let serve = tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let (n, peer) = udp.recv_from(&mut buf).await.unwrap();
            let query = Message::from_vec(&buf[..n]).unwrap();
            let mut truncated = Message::response(query.metadata.id, OpCode::Query);
            truncated.add_queries(query.queries.clone());
            truncated.metadata.truncation = true;
            udp.send_to(&truncated.to_vec().unwrap(), peer)
                .await
                .unwrap();
            let (mut conn, _) = tcp.accept().await.unwrap();
            let length = conn.read_u16().await.unwrap();
            let mut query = vec![0; usize::from(length)];
            conn.read_exact(&mut query).await.unwrap();
            let query = Message::from_vec(&query).unwrap();
            let mut answer = Message::response(query.metadata.id, OpCode::Query);
            answer.add_queries(query.queries.clone());
            answer.add_answer(a("big.test.", 90, [192, 0, 2, 44]));
            let answer = answer.to_vec().unwrap();
            conn.write_u16(answer.len() as u16).await.unwrap();
            conn.write_all(&answer).await.unwrap();
        });
        let resolved = resolve(
            &ResolverKind::Upstream([addr].into()),
            "big.test",
            &budget(),
        )
        .await;
        assert_eq!(
            resolved,
            Resolved::Addresses(
                vec!["192.0.2.44".parse().unwrap()],
                Some(Duration::from_secs(90))
            )
        );
        serve.await.unwrap();
    }

    /// Datagrams a guest's resolver sends, and a few it should not: each is a `dns_query`
    /// input. Fixed ids: the seeds are committed and must come out the same every time.
    pub(crate) fn dns_query_seeds() -> Vec<Vec<u8>> {
        let message = |id: u16, op_code: OpCode, questions: &[(&str, RecordType, DNSClass)]| {
            let mut message = Message::new(id, MessageType::Query, op_code);
            message.metadata.recursion_desired = true;
            for (name, record_type, class) in questions {
                let mut q = Question::query(name.parse().unwrap(), *record_type);
                q.set_query_class(*class);
                message.add_query(q);
            }
            message
        };
        let one = |id, name: &str, record_type| {
            message(id, OpCode::Query, &[(name, record_type, DNSClass::IN)])
        };
        let bytes = |m: &Message| m.to_vec().unwrap();
        let a = bytes(&one(0x5e00, "Origin.TEST.", RecordType::A));
        let mut response = Message::response(0x5e06, OpCode::Query);
        response.add_query(Question::query(
            "origin.test.".parse().unwrap(),
            RecordType::A,
        ));
        response.add_answer(Record::from_rdata(
            "origin.test.".parse().unwrap(),
            60,
            RData::A(A(Ipv4Addr::new(192, 0, 2, 1))),
        ));
        let mut edns = one(0x5e07, "origin.test.", RecordType::A);
        let mut opt = hickory_proto::op::Edns::new();
        opt.set_max_payload(4096).set_dnssec_ok(true);
        edns.set_edns(opt);
        // The additional record's owner is written as a pointer to the question's name.
        let mut compressed = one(0x5e08, "www.origin.test.", RecordType::A);
        compressed.add_additional(Record::from_rdata(
            "www.origin.test.".parse().unwrap(),
            60,
            RData::A(A(Ipv4Addr::new(192, 0, 2, 1))),
        ));
        // The longest name: four labels, 253 characters as text.
        let longest = format!("{0}.{0}.{0}.{1}.", "a".repeat(63), "b".repeat(61));
        // A question whose name is a label and then a pointer back to its own start.
        let mut looped = a[..12].to_vec();
        looped.extend_from_slice(&[3, b'w', b'w', b'w', 0xc0, 12, 0, 1, 0, 1]);
        vec![
            a.clone(),
            bytes(&one(0x5e01, "origin.test.", RecordType::AAAA)),
            bytes(&one(0x5e02, "origin.test.", RecordType::TXT)),
            bytes(&message(
                0x5e03,
                OpCode::Query,
                &[
                    ("a.origin.test.", RecordType::A, DNSClass::IN),
                    ("b.origin.test.", RecordType::A, DNSClass::IN),
                ],
            )),
            bytes(&message(
                0x5e04,
                OpCode::Update,
                &[("origin.test.", RecordType::SOA, DNSClass::IN)],
            )),
            bytes(&message(
                0x5e05,
                OpCode::Query,
                &[("version.bind.", RecordType::TXT, DNSClass::CH)],
            )),
            bytes(&response),
            bytes(&edns),
            bytes(&compressed),
            a[..a.len() - 3].to_vec(),
            bytes(&one(0x5e0a, &longest, RecordType::A)),
            looped,
        ]
    }

    #[test]
    fn the_query_seeds_hold_the_fuzz_property_and_take_each_path() {
        let seeds = dns_query_seeds();
        for seed in &seeds {
            fuzz_query(seed);
        }
        let path = |seed: &[u8]| match incoming(seed) {
            Incoming::Query(_) => "query",
            Incoming::Answer(_) => "answer",
            Incoming::Ignore => "ignore",
        };
        let paths: Vec<&str> = seeds.iter().map(|s| path(s)).collect();
        assert_eq!(
            paths,
            [
                "query", "query", "query", "answer", "answer", "answer", "ignore", "query",
                "query", "ignore", "query", "ignore"
            ]
        );
        // The two-question and additional-record seeds hold compressed names (a pointer's
        // first byte: no byte of their ASCII names is 0xc0).
        for i in [3, 8] {
            assert!(seeds[i][12..].contains(&0xc0), "seed {i}");
        }
        let Incoming::Query(longest) = incoming(&seeds[10]) else {
            panic!()
        };
        assert_eq!(longest.name.len(), NAME_MAX);
    }

    /// The fuzz property on a replayable sample: the seeds with bytes overwritten, cut short
    /// and repeated.
    #[test]
    fn the_query_fuzz_property_holds_on_mutated_seeds() {
        crate::fuzzing::mutate_seeds(
            &dns_query_seeds(),
            20_000,
            0x9e37_79b9_7f4a_7c15,
            fuzz_query,
        );
    }

    /// The committed corpus, replayed on every test run.
    #[test]
    fn the_dns_fuzz_corpus_holds_the_property() {
        crate::fuzzing::replay_corpus("dns_query", fuzz_query);
    }

    /// The corpus holds the seeds as they are generated now (`seed-NN`). After changing them,
    /// write them with `KRUNBOX_WRITE_FUZZ_SEEDS=1 cargo test --lib committed_dns_query_seeds`.
    #[test]
    fn committed_dns_query_seeds_are_the_generated_ones() {
        crate::fuzzing::assert_committed_seeds("dns_query", &dns_query_seeds());
    }
}
