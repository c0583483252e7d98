//! Trusted hostnames: the record of a sandbox's accepted DNS answers.
//!
//! A granted name gets an address of the sandbox's own (from 198.18.0.0/15, the benchmarking
//! block no network routes), and the guest is answered with that address, never the real ones.
//! A connection to it is then for that name and nothing else: no other name shares the
//! address (as names share CDN addresses in real DNS), so the flow's hostname is exact, and
//! what the host dials is the answer it recorded itself, never an address the guest chose.
//!
//! Bounded: at most [`MAX_NAMES`] names per sandbox; past that the least recently used is
//! forgotten (a connection to its old address then has no hostname and fails). Addresses are
//! not handed out again before the pool wraps, so a forgotten name's address is not another
//! name's while the guest may still hold it.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::policy::Resolver;

/// Names remembered per sandbox.
pub(crate) const MAX_NAMES: usize = 4096;

/// The pool: 198.18.0.0/15 (RFC 2544), 131072 addresses.
const POOL_BASE: u32 = u32::from_be_bytes([198, 18, 0, 0]);
const POOL_SIZE: u32 = 1 << 17;

/// The longest TTL given to the guest: it asks again at least this often, so a record the host
/// forgot is not held by the guest for long.
pub(crate) const GUEST_TTL_MAX: Duration = Duration::from_secs(300);

/// One name's record.
#[derive(Debug, Clone)]
pub(crate) struct Record {
    pub address: Ipv4Addr,
    /// The answer, as the resolver gave it.
    pub upstream: Vec<IpAddr>,
    /// When the answer stops being good (`None`: never, for fixed answers).
    pub expires: Option<Instant>,
    /// How to ask again when it has expired.
    pub resolver: Resolver,
    last_used: Instant,
}

impl Record {
    /// The answer, if it has not expired at `now`.
    pub fn fresh_upstream(&self, now: Instant) -> Option<&[IpAddr]> {
        match self.expires {
            Some(expires) if expires <= now => None,
            _ => Some(&self.upstream),
        }
    }
}

/// The record of one sandbox.
#[derive(Debug)]
pub(crate) struct Names {
    by_name: HashMap<Arc<str>, Record>,
    by_address: HashMap<Ipv4Addr, Arc<str>>,
    /// The next pool offset to try.
    next: u32,
}

impl Default for Names {
    fn default() -> Self {
        Self::new()
    }
}

impl Names {
    pub(crate) fn new() -> Self {
        Self {
            by_name: HashMap::new(),
            by_address: HashMap::new(),
            next: 1,
        }
    }

    /// Whether `address` is in the sandbox's own pool (whether or not it stands for a name).
    pub(crate) fn is_pool_address(address: Ipv4Addr) -> bool {
        u32::from(address).wrapping_sub(POOL_BASE) < POOL_SIZE
    }

    /// Records `upstream` as `name`'s answer for `ttl` (`None`: for good), and returns the
    /// address the guest is given for it (the one it already had, if it had one).
    pub(crate) fn record(
        &mut self,
        name: &str,
        upstream: Vec<IpAddr>,
        ttl: Option<Duration>,
        resolver: Resolver,
        now: Instant,
    ) -> Ipv4Addr {
        let expires = ttl.map(|ttl| now + ttl);
        if let Some(record) = self.by_name.get_mut(name) {
            record.upstream = upstream;
            record.expires = expires;
            record.resolver = resolver;
            record.last_used = now;
            return record.address;
        }
        if self.by_name.len() >= MAX_NAMES {
            self.forget_least_recently_used();
        }
        let address = self.free_address();
        let name: Arc<str> = name.into();
        self.by_address.insert(address, name.clone());
        self.by_name.insert(
            name,
            Record {
                address,
                upstream,
                expires,
                resolver,
                last_used: now,
            },
        );
        address
    }

    /// The name `address` stands for and its record, marked as used.
    pub(crate) fn lookup(&mut self, address: Ipv4Addr, now: Instant) -> Option<(Arc<str>, Record)> {
        let name = self.by_address.get(&address)?.clone();
        let record = self.by_name.get_mut(&name)?;
        record.last_used = now;
        Some((name, record.clone()))
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_name.len()
    }

    fn forget_least_recently_used(&mut self) {
        let oldest = self
            .by_name
            .iter()
            .min_by_key(|(_, r)| r.last_used)
            .map(|(name, r)| (name.clone(), r.address));
        if let Some((name, address)) = oldest {
            self.by_name.remove(&name);
            self.by_address.remove(&address);
        }
    }

    /// The next address of the pool no name holds, skipping the pool's first and last (its
    /// network and broadcast addresses). There always is one: the pool is far larger than
    /// [`MAX_NAMES`].
    fn free_address(&mut self) -> Ipv4Addr {
        loop {
            let offset = self.next;
            self.next = if offset + 2 >= POOL_SIZE {
                1
            } else {
                offset + 1
            };
            let address = Ipv4Addr::from(POOL_BASE + offset);
            if !self.by_address.contains_key(&address) {
                return address;
            }
        }
    }
}

/// The TTL the guest is told for a record kept for `ttl`.
pub(crate) fn guest_ttl(ttl: Option<Duration>) -> u32 {
    ttl.unwrap_or(GUEST_TTL_MAX).min(GUEST_TTL_MAX).as_secs() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn each_name_gets_an_address_of_its_own_that_stays_its_own() {
        let mut names = Names::new();
        let now = Instant::now();
        let r = Resolver::system();
        let a = names.record("a.test", vec![ip("192.0.2.1")], None, r.clone(), now);
        // Two names with the same real answer (a CDN) still get two addresses.
        let b = names.record("b.test", vec![ip("192.0.2.1")], None, r.clone(), now);
        assert_ne!(a, b);
        assert!(Names::is_pool_address(a) && Names::is_pool_address(b));
        assert!(!Names::is_pool_address(Ipv4Addr::new(198, 20, 0, 0)));
        assert!(!Names::is_pool_address(Ipv4Addr::new(198, 17, 255, 255)));
        // Asking again keeps the address and takes the new answer.
        let again = names.record("a.test", vec![ip("192.0.2.9")], None, r, now);
        assert_eq!(again, a);
        let (name, record) = names.lookup(a, now).unwrap();
        assert_eq!(&*name, "a.test");
        assert_eq!(record.upstream, vec![ip("192.0.2.9")]);
        assert!(names.lookup(Ipv4Addr::new(198, 18, 9, 9), now).is_none());
    }

    #[test]
    fn answers_expire_with_their_ttl_and_fixed_ones_never() {
        let mut names = Names::new();
        let now = Instant::now();
        let ttl = Some(Duration::from_secs(30));
        let a = names.record(
            "a.test",
            vec![ip("192.0.2.1")],
            ttl,
            Resolver::system(),
            now,
        );
        let (_, record) = names.lookup(a, now).unwrap();
        assert!(record
            .fresh_upstream(now + Duration::from_secs(29))
            .is_some());
        assert!(record
            .fresh_upstream(now + Duration::from_secs(30))
            .is_none());
        let fixed = Resolver::fixed([ip("127.0.0.1")]);
        let b = names.record("b.test", vec![ip("127.0.0.1")], None, fixed, now);
        let (_, record) = names.lookup(b, now).unwrap();
        assert!(record
            .fresh_upstream(now + Duration::from_secs(1 << 30))
            .is_some());
        assert_eq!(guest_ttl(ttl), 30);
        assert_eq!(guest_ttl(None), GUEST_TTL_MAX.as_secs() as u32);
        assert_eq!(guest_ttl(Some(Duration::from_secs(86400))), 300);
    }

    #[test]
    fn the_record_is_bounded_and_forgets_the_least_recently_used() {
        let mut names = Names::new();
        let start = Instant::now();
        let mut first = None;
        for i in 0..MAX_NAMES {
            let at = start + Duration::from_millis(i as u64);
            let addr = names.record(&format!("n{i}.test"), vec![], None, Resolver::system(), at);
            first.get_or_insert(addr);
        }
        let first = first.unwrap();
        // Using the first name makes the second the least recently used.
        let later = start + Duration::from_secs(3600);
        assert!(names.lookup(first, later).is_some());
        let extra = names.record("extra.test", vec![], None, Resolver::system(), later);
        assert_eq!(names.len(), MAX_NAMES);
        assert!(names.lookup(first, later).is_some(), "used recently: kept");
        let second = Ipv4Addr::from(u32::from(first) + 1);
        assert!(names.lookup(second, later).is_none(), "forgotten");
        // The forgotten name's address is not handed out again at once.
        assert_ne!(extra, second);
    }

    #[test]
    fn the_pool_wraps_without_handing_out_a_held_address() {
        let mut names = Names::new();
        let now = Instant::now();
        let kept = names.record("kept.test", vec![], None, Resolver::system(), now);
        names.next = POOL_SIZE - 3;
        let last = names.record("last.test", vec![], None, Resolver::system(), now);
        assert_eq!(last, Ipv4Addr::new(198, 19, 255, 253));
        let edge = names.record("edge.test", vec![], None, Resolver::system(), now);
        assert_eq!(
            edge,
            Ipv4Addr::new(198, 19, 255, 254),
            "the last before broadcast"
        );
        let wrapped = names.record("wrapped.test", vec![], None, Resolver::system(), now);
        assert_eq!(
            wrapped,
            Ipv4Addr::new(198, 18, 0, 2),
            "skips kept.test's 198.18.0.1"
        );
        assert_eq!(kept, Ipv4Addr::new(198, 18, 0, 1));
    }
}
