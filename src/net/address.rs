//! What kind of address a guest is dialling: the fact a network policy starts from when it
//! decides a flow.
//!
//! [`classify`] puts any IPv4 or IPv6 address into one [`AddressClass`], following the IANA
//! IPv4 and IPv6 Special-Purpose Address Registries (RFC 6890 and the RFCs each entry cites).
//! Everything that is not [`AddressClass::Public`] is [internal](AddressClass::is_internal):
//! the host itself, its LAN, the provider's network, the cloud's metadata service, or space
//! that routes nowhere. A sandbox should reach none of it unless its policy says so.
//!
//! ```
//! use std::net::IpAddr;
//! use krunbox::net::address::{AddressClass, classify};
//!
//! let metadata: IpAddr = "169.254.169.254".parse().unwrap();
//! assert_eq!(classify(metadata), AddressClass::CloudMetadata);
//! assert!(classify(metadata).is_internal());
//!
//! let public: IpAddr = "1.1.1.1".parse().unwrap();
//! assert!(classify(public).is_public());
//! ```
//!
//! # IPv6 addresses that carry an IPv4 address
//!
//! A guest can spell an IPv4 destination as IPv6: IPv4-mapped (`::ffff:0:0/96`, RFC 4291), the
//! NAT64 well-known prefix (`64:ff9b::/96`, RFC 6052) or 6to4 (`2002::/16`, RFC 3056, the IPv4
//! address in bits 16 to 48). Each is classified as the IPv4 address it carries, so
//! `::ffff:127.0.0.1` is loopback and `64:ff9b::a9fe:a9fe` (169.254.169.254) is the metadata
//! service, not a public IPv6 address. The deprecated IPv4-compatible form (`::/96`, other
//! than `::` and `::1`) is [`Reserved`](AddressClass::Reserved): nothing should route it.
//!
//! Other IPv6 space outside global unicast (`2000::/3`) is reserved; inside it, the
//! documentation and benchmarking blocks are recognised and the rest is public.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The kind of an IP address, as a network policy sees it. Returned by [`classify`].
///
/// Only [`Public`](Self::Public) is outside the host, its networks and its provider;
/// [`is_internal`](Self::is_internal) is true for every other class. More classes may be added,
/// so a `match` needs a wildcard arm.
///
/// Serialized (serde) as its [`name`](Self::name), in kebab case.
///
/// ```
/// use std::net::IpAddr;
/// use krunbox::net::address::{AddressClass, classify};
///
/// let addr: IpAddr = "192.168.1.10".parse().unwrap();
/// match classify(addr) {
///     AddressClass::Public => println!("{addr} is on the internet"),
///     class => println!("{addr} is {class}, internal"),
/// }
/// assert_eq!(
///     serde_json::to_string(&AddressClass::SharedAddressSpace).unwrap(),
///     "\"shared-address-space\"",
/// );
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum AddressClass {
    /// The "no address" address: `0.0.0.0` and `::`. Many systems treat a connection to it as
    /// one to the local host.
    Unspecified,
    /// The local host: `127.0.0.0/8` and `::1`.
    Loopback,
    /// Private networks: `10.0.0.0/8`, `172.16.0.0/12` and `192.168.0.0/16` (RFC 1918), and
    /// IPv6 unique local addresses, `fc00::/7` (RFC 4193).
    Private,
    /// The carrier-grade NAT space between a provider and its customers, `100.64.0.0/10`
    /// (RFC 6598). Some cloud and VPN networks (Tailscale among them) live here.
    SharedAddressSpace,
    /// Link-local addresses: `169.254.0.0/16` (RFC 3927) and `fe80::/10`, other than the
    /// metadata services.
    LinkLocal,
    /// A cloud instance metadata service, where a VM's credentials are served:
    /// `169.254.169.254` (AWS, GCP, Azure and others), `169.254.170.2` (AWS ECS task
    /// credentials), `100.100.100.200` (Alibaba Cloud) and `fd00:ec2::254` (AWS over IPv6).
    /// These take precedence over the link-local, shared and private ranges they sit in.
    CloudMetadata,
    /// Multicast: `224.0.0.0/4` and `ff00::/8`.
    Multicast,
    /// The limited broadcast address, `255.255.255.255`.
    Broadcast,
    /// Documentation examples, never routed: `192.0.2.0/24`, `198.51.100.0/24`,
    /// `203.0.113.0/24` (RFC 5737), `2001:db8::/32` (RFC 3849) and `3fff::/20` (RFC 9637).
    Documentation,
    /// Benchmarking networks: `198.18.0.0/15` (RFC 2544) and `2001:2::/48` (RFC 5180).
    Benchmarking,
    /// Space that routes nowhere or is set aside: the rest of `0.0.0.0/8`, `192.0.0.0/24`
    /// (IETF protocol assignments), `240.0.0.0/4`; in IPv6 the IPv4-compatible `::/96`, the
    /// discard prefix `100::/64`, and everything outside `2000::/3` not named above.
    Reserved,
    /// Any other address: somewhere on the internet.
    Public,
}

impl AddressClass {
    /// Whether the address is on the internet at large: true for [`Public`](Self::Public)
    /// only.
    ///
    /// ```
    /// use krunbox::net::address::AddressClass;
    ///
    /// assert!(AddressClass::Public.is_public());
    /// assert!(!AddressClass::Private.is_public());
    /// ```
    pub fn is_public(self) -> bool {
        self == Self::Public
    }

    /// Whether the address is one a sandbox should not reach unless its policy allows it:
    /// the host, its networks, its provider's, a metadata service, or space that routes
    /// nowhere. True for every class but [`Public`](Self::Public); always the opposite of
    /// [`is_public`](Self::is_public).
    ///
    /// ```
    /// use std::net::IpAddr;
    /// use krunbox::net::address::classify;
    ///
    /// let addr: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
    /// assert!(classify(addr).is_internal());
    /// ```
    pub fn is_internal(self) -> bool {
        !self.is_public()
    }

    /// A short lowercase name, as used in logs and in serialized form: `"cloud-metadata"`,
    /// `"link-local"`, `"public"` and so on.
    ///
    /// ```
    /// use krunbox::net::address::AddressClass;
    ///
    /// assert_eq!(AddressClass::CloudMetadata.name(), "cloud-metadata");
    /// assert_eq!(AddressClass::Public.name(), "public");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::Loopback => "loopback",
            Self::Private => "private",
            Self::SharedAddressSpace => "shared-address-space",
            Self::LinkLocal => "link-local",
            Self::CloudMetadata => "cloud-metadata",
            Self::Multicast => "multicast",
            Self::Broadcast => "broadcast",
            Self::Documentation => "documentation",
            Self::Benchmarking => "benchmarking",
            Self::Reserved => "reserved",
            Self::Public => "public",
        }
    }
}

/// Writes the class's [`name`](AddressClass::name).
///
/// ```
/// use krunbox::net::address::AddressClass;
///
/// assert_eq!(AddressClass::LinkLocal.to_string(), "link-local");
/// assert_eq!(format!("{}", AddressClass::Loopback), "loopback");
/// ```
impl fmt::Display for AddressClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The class of an IPv4 or IPv6 address. Total and cheap: every address has exactly one class,
/// found with a few comparisons and no allocation.
///
/// IPv6 addresses that carry an IPv4 address (IPv4-mapped, NAT64 `64:ff9b::/96`, 6to4) get the
/// class of the IPv4 address; see the [module documentation](self).
///
/// ```
/// use std::net::IpAddr;
/// use krunbox::net::address::{AddressClass, classify};
///
/// let class = |s: &str| classify(s.parse::<IpAddr>().unwrap());
/// assert_eq!(class("127.0.0.1"), AddressClass::Loopback);
/// assert_eq!(class("172.16.0.1"), AddressClass::Private);
/// assert_eq!(class("100.64.0.1"), AddressClass::SharedAddressSpace);
/// assert_eq!(class("169.254.1.1"), AddressClass::LinkLocal);
/// assert_eq!(class("169.254.169.254"), AddressClass::CloudMetadata);
/// assert_eq!(class("fd00:ec2::254"), AddressClass::CloudMetadata);
/// assert_eq!(class("::ffff:127.0.0.1"), AddressClass::Loopback);
/// assert_eq!(class("64:ff9b::a9fe:a9fe"), AddressClass::CloudMetadata);
/// assert_eq!(class("2001:db8::1"), AddressClass::Documentation);
/// assert_eq!(class("2606:4700::1111"), AddressClass::Public);
/// ```
pub fn classify(addr: IpAddr) -> AddressClass {
    match addr {
        IpAddr::V4(v4) => classify_v4(v4),
        IpAddr::V6(v6) => classify_v6(v6),
    }
}

/// The cloud metadata services reachable over IPv4: AWS/GCP/Azure, AWS ECS, Alibaba Cloud.
const METADATA_V4: [Ipv4Addr; 3] = [
    Ipv4Addr::new(169, 254, 169, 254),
    Ipv4Addr::new(169, 254, 170, 2),
    Ipv4Addr::new(100, 100, 100, 200),
];

/// AWS's instance metadata service over IPv6 (Nitro instances).
const METADATA_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254);

fn classify_v4(addr: Ipv4Addr) -> AddressClass {
    use AddressClass::*;

    // Before link-local and shared: the metadata services sit inside those ranges.
    if METADATA_V4.contains(&addr) {
        return CloudMetadata;
    }
    if addr.is_unspecified() {
        return Unspecified;
    }
    // "This network" (RFC 791): only 0.0.0.0 itself has a meaning as a source.
    if in_prefix_v4(addr, Ipv4Addr::new(0, 0, 0, 0), 8) {
        return Reserved;
    }
    if addr.is_loopback() {
        return Loopback;
    }
    // 10/8, 172.16/12, 192.168/16 (RFC 1918).
    if addr.is_private() {
        return Private;
    }
    if in_prefix_v4(addr, Ipv4Addr::new(100, 64, 0, 0), 10) {
        return SharedAddressSpace;
    }
    if addr.is_link_local() {
        return LinkLocal;
    }
    if addr.is_multicast() {
        return Multicast;
    }
    // Before 240/4, which holds it.
    if addr.is_broadcast() {
        return Broadcast;
    }
    // TEST-NET-1, -2 and -3 (RFC 5737).
    if addr.is_documentation() {
        return Documentation;
    }
    if in_prefix_v4(addr, Ipv4Addr::new(198, 18, 0, 0), 15) {
        return Benchmarking;
    }
    // IETF protocol assignments (RFC 6890) and the former class E (RFC 1112).
    if in_prefix_v4(addr, Ipv4Addr::new(192, 0, 0, 0), 24)
        || in_prefix_v4(addr, Ipv4Addr::new(240, 0, 0, 0), 4)
    {
        return Reserved;
    }
    Public
}

fn classify_v6(addr: Ipv6Addr) -> AddressClass {
    use AddressClass::*;

    // Before the embedded forms: an IPv6 destination spelling an IPv4 one is that destination.
    if let Some(v4) = embedded_ipv4(addr) {
        return classify_v4(v4);
    }
    // Before unique local, which holds it.
    if addr == METADATA_V6 {
        return CloudMetadata;
    }
    if addr.is_unspecified() {
        return Unspecified;
    }
    if addr.is_loopback() {
        return Loopback;
    }
    // IPv4-compatible (RFC 4291, deprecated): :: and ::1 are handled above.
    if in_prefix_v6(addr, Ipv6Addr::UNSPECIFIED, 96) {
        return Reserved;
    }
    // Discard-only (RFC 6666).
    if in_prefix_v6(addr, Ipv6Addr::new(0x0100, 0, 0, 0, 0, 0, 0, 0), 64) {
        return Reserved;
    }
    // fc00::/7 (RFC 4193).
    if addr.is_unique_local() {
        return Private;
    }
    // fe80::/10.
    if addr.is_unicast_link_local() {
        return LinkLocal;
    }
    // ff00::/8.
    if addr.is_multicast() {
        return Multicast;
    }
    if in_prefix_v6(addr, Ipv6Addr::new(0x2001, 0x0db8, 0, 0, 0, 0, 0, 0), 32)
        || in_prefix_v6(addr, Ipv6Addr::new(0x3fff, 0, 0, 0, 0, 0, 0, 0), 20)
    {
        return Documentation;
    }
    if in_prefix_v6(addr, Ipv6Addr::new(0x2001, 0x0002, 0, 0, 0, 0, 0, 0), 48) {
        return Benchmarking;
    }
    // Global unicast is the only IPv6 space allocated for use on the internet.
    if !in_prefix_v6(addr, Ipv6Addr::new(0x2000, 0, 0, 0, 0, 0, 0, 0), 3) {
        return Reserved;
    }
    Public
}

/// The IPv4 address an IPv6 address stands for, if it is IPv4-mapped (`::ffff:0:0/96`), in the
/// NAT64 well-known prefix (`64:ff9b::/96`), or 6to4 (`2002::/16`, the address in bits 16..48).
fn embedded_ipv4(addr: Ipv6Addr) -> Option<Ipv4Addr> {
    let bits = addr.to_bits();
    if let Some(v4) = addr.to_ipv4_mapped() {
        return Some(v4);
    }
    if in_prefix_v6(addr, Ipv6Addr::new(0x0064, 0xff9b, 0, 0, 0, 0, 0, 0), 96) {
        // Truncation keeps the low 32 bits: the IPv4 address.
        return Some(Ipv4Addr::from_bits(bits as u32));
    }
    if in_prefix_v6(addr, Ipv6Addr::new(0x2002, 0, 0, 0, 0, 0, 0, 0), 16) {
        return Some(Ipv4Addr::from_bits((bits >> 80) as u32));
    }
    None
}

/// Whether the first `len` bits of `addr` are those of `prefix` (`len` at most 32).
fn in_prefix_v4(addr: Ipv4Addr, prefix: Ipv4Addr, len: u32) -> bool {
    // A shift by the full width (len 0) would overflow: the mask is then empty.
    let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
    addr.to_bits() & mask == prefix.to_bits() & mask
}

/// Whether the first `len` bits of `addr` are those of `prefix` (`len` at most 128).
fn in_prefix_v6(addr: Ipv6Addr, prefix: Ipv6Addr, len: u32) -> bool {
    let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
    addr.to_bits() & mask == prefix.to_bits() & mask
}

#[cfg(test)]
mod tests {
    use super::AddressClass::*;
    use super::*;

    /// Every class, with the first and last address of each range and the neighbours just
    /// outside it.
    const TABLE: &[(&str, AddressClass)] = &[
        // 0.0.0.0/8: unspecified, then reserved.
        ("0.0.0.0", Unspecified),
        ("0.0.0.1", Reserved),
        ("0.255.255.255", Reserved),
        ("1.0.0.0", Public),
        // 10/8.
        ("9.255.255.255", Public),
        ("10.0.0.0", Private),
        ("10.255.255.255", Private),
        ("11.0.0.0", Public),
        // 100.64/10, holding Alibaba's metadata service.
        ("100.63.255.255", Public),
        ("100.64.0.0", SharedAddressSpace),
        ("100.100.100.199", SharedAddressSpace),
        ("100.100.100.200", CloudMetadata),
        ("100.100.100.201", SharedAddressSpace),
        ("100.127.255.255", SharedAddressSpace),
        ("100.128.0.0", Public),
        // 127/8.
        ("126.255.255.255", Public),
        ("127.0.0.0", Loopback),
        ("127.0.0.1", Loopback),
        ("127.255.255.255", Loopback),
        ("128.0.0.0", Public),
        // 169.254/16, holding the AWS/GCP/Azure and ECS metadata services.
        ("169.253.255.255", Public),
        ("169.254.0.0", LinkLocal),
        ("169.254.169.253", LinkLocal),
        ("169.254.169.254", CloudMetadata),
        ("169.254.169.255", LinkLocal),
        ("169.254.170.2", CloudMetadata),
        ("169.254.170.3", LinkLocal),
        ("169.254.255.255", LinkLocal),
        ("169.255.0.0", Public),
        // 172.16/12.
        ("172.15.255.255", Public),
        ("172.16.0.0", Private),
        ("172.31.255.255", Private),
        ("172.32.0.0", Public),
        // 192.0.0/24 and TEST-NET-1 next to it.
        ("191.255.255.255", Public),
        ("192.0.0.0", Reserved),
        ("192.0.0.255", Reserved),
        ("192.0.1.255", Public),
        ("192.0.2.0", Documentation),
        ("192.0.2.255", Documentation),
        ("192.0.3.0", Public),
        // 192.168/16.
        ("192.167.255.255", Public),
        ("192.168.0.0", Private),
        ("192.168.255.255", Private),
        ("192.169.0.0", Public),
        // 198.18/15 and TEST-NET-2.
        ("198.17.255.255", Public),
        ("198.18.0.0", Benchmarking),
        ("198.19.255.255", Benchmarking),
        ("198.20.0.0", Public),
        ("198.51.99.255", Public),
        ("198.51.100.0", Documentation),
        ("198.51.100.255", Documentation),
        ("198.51.101.0", Public),
        // TEST-NET-3.
        ("203.0.112.255", Public),
        ("203.0.113.0", Documentation),
        ("203.0.113.255", Documentation),
        ("203.0.114.0", Public),
        // 224/4, 240/4, broadcast.
        ("223.255.255.255", Public),
        ("224.0.0.0", Multicast),
        ("239.255.255.255", Multicast),
        ("240.0.0.0", Reserved),
        ("255.255.255.254", Reserved),
        ("255.255.255.255", Broadcast),
        // Ordinary public addresses.
        ("1.1.1.1", Public),
        ("8.8.8.8", Public),
        // IPv6: ::, ::1 and the IPv4-compatible ::/96 around them.
        ("::", Unspecified),
        ("::1", Loopback),
        ("::2", Reserved),
        ("::1.2.3.4", Reserved),
        ("::ffff:ffff", Reserved),
        ("::1:0:0", Reserved),
        // IPv4-mapped ::ffff:0:0/96.
        ("::fffe:ffff:ffff", Reserved),
        ("::ffff:0.0.0.0", Unspecified),
        ("::ffff:127.0.0.1", Loopback),
        ("::ffff:10.1.2.3", Private),
        ("::ffff:169.254.169.254", CloudMetadata),
        ("::ffff:8.8.8.8", Public),
        ("::ffff:255.255.255.255", Broadcast),
        ("::1:0:0:0", Reserved),
        // NAT64 64:ff9b::/96; 64:ff9b:1::/48 (local-use) is outside 2000::/3.
        ("64:ff9b::", Unspecified),
        ("64:ff9b::a9fe:a9fe", CloudMetadata),
        ("64:ff9b::7f00:1", Loopback),
        ("64:ff9b::6464:64c8", CloudMetadata),
        ("64:ff9b::808:808", Public),
        ("64:ff9b::1:0:0", Reserved),
        ("64:ff9b:1::808:808", Reserved),
        ("64:ff9a:ffff:ffff:ffff:ffff:ffff:ffff", Reserved),
        // Discard-only 100::/64.
        ("100::", Reserved),
        ("100::ffff:ffff:ffff:ffff", Reserved),
        ("100:0:0:1::", Reserved),
        // fc00::/7, holding AWS's metadata service.
        ("fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Reserved),
        ("fc00::", Private),
        ("fd00:ec2::253", Private),
        ("fd00:ec2::254", CloudMetadata),
        ("fd00:ec2::255", Private),
        ("fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Private),
        // fe80::/10; fec0::/10 (deprecated site-local) is outside 2000::/3.
        ("fe00::", Reserved),
        ("fe7f:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Reserved),
        ("fe80::", LinkLocal),
        ("fe80::1", LinkLocal),
        ("febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff", LinkLocal),
        ("fec0::", Reserved),
        // ff00::/8.
        ("feff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Reserved),
        ("ff00::", Multicast),
        ("ff02::1", Multicast),
        ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Multicast),
        // 2000::/3 and its edges.
        ("1fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Reserved),
        ("2000::", Public),
        ("3fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Public),
        ("4000::", Reserved),
        // 2001:2::/48 benchmarking.
        ("2001:1:ffff:ffff:ffff:ffff:ffff:ffff", Public),
        ("2001:2::", Benchmarking),
        ("2001:2:0:ffff:ffff:ffff:ffff:ffff", Benchmarking),
        ("2001:2:1::", Public),
        // 2001:db8::/32 documentation.
        ("2001:db7:ffff:ffff:ffff:ffff:ffff:ffff", Public),
        ("2001:db8::", Documentation),
        ("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff", Documentation),
        ("2001:db9::", Public),
        // 3fff::/20 documentation.
        ("3ffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Public),
        ("3fff::", Documentation),
        ("3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff", Documentation),
        ("3fff:1000::", Public),
        // 6to4 2002::/16: the IPv4 address in bits 16..48, whatever follows.
        ("2001:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Public),
        ("2002::", Unspecified),
        ("2002:7f00:1::", Loopback),
        ("2002:a9fe:a9fe::1", CloudMetadata),
        ("2002:c0a8:101:1:2:3:4:5", Private),
        ("2002:808:808::", Public),
        ("2002:ffff:ffff:ffff:ffff:ffff:ffff:ffff", Broadcast),
        ("2003::", Public),
        // Ordinary public addresses.
        ("2606:4700:4700::1111", Public),
        ("2a00:1450:4001::200e", Public),
    ];

    #[test]
    fn table() {
        let mut wrong = Vec::new();
        for &(text, expected) in TABLE {
            let addr: IpAddr = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            let got = classify(addr);
            if got != expected {
                wrong.push(format!("{text}: {got}, expected {expected}"));
            }
        }
        assert!(wrong.is_empty(), "misclassified:\n{}", wrong.join("\n"));
    }

    #[test]
    fn table_covers_every_class() {
        for class in ALL {
            assert!(
                TABLE.iter().any(|&(_, c)| c == class),
                "no address of class {class} in the table"
            );
        }
    }

    /// Every class, to check the table and the names against.
    const ALL: [AddressClass; 12] = [
        Unspecified,
        Loopback,
        Private,
        SharedAddressSpace,
        LinkLocal,
        CloudMetadata,
        Multicast,
        Broadcast,
        Documentation,
        Benchmarking,
        Reserved,
        Public,
    ];

    #[test]
    fn names_display_and_serde_agree() {
        let mut names = std::collections::HashSet::new();
        for class in ALL {
            let name = class.name();
            assert!(names.insert(name), "{name} used twice");
            assert_eq!(class.to_string(), name);
            let json = serde_json::to_string(&class).unwrap();
            assert_eq!(json, format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<AddressClass>(&json).unwrap(), class);
            assert_eq!(class.is_public(), class == Public);
            assert_eq!(class.is_internal(), !class.is_public());
        }
    }

    #[test]
    fn in_prefix_edges() {
        let v4 = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        assert!(in_prefix_v4(v4("1.2.3.4"), v4("0.0.0.0"), 0));
        assert!(in_prefix_v4(v4("1.2.3.4"), v4("1.2.3.4"), 32));
        assert!(!in_prefix_v4(v4("1.2.3.5"), v4("1.2.3.4"), 32));
        assert!(in_prefix_v4(v4("1.2.3.5"), v4("1.2.3.4"), 31));
        let v6 = |s: &str| s.parse::<Ipv6Addr>().unwrap();
        assert!(in_prefix_v6(v6("2001:db8::1"), v6("::"), 0));
        assert!(in_prefix_v6(v6("2001:db8::1"), v6("2001:db8::1"), 128));
        assert!(!in_prefix_v6(v6("2001:db8::1"), v6("2001:db8::"), 128));
        assert!(in_prefix_v6(v6("2001:db8::1"), v6("2001:db8::"), 127));
    }

    /// xorshift64*: deterministic, so a failure reproduces.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn v4(&mut self) -> Ipv4Addr {
            Ipv4Addr::from_bits(self.next() as u32)
        }

        fn v6(&mut self) -> Ipv6Addr {
            Ipv6Addr::from_bits((u128::from(self.next()) << 64) | u128::from(self.next()))
        }
    }

    /// The three IPv6 spellings of an IPv4 address.
    fn embeddings(v4: Ipv4Addr, rest: u64) -> [Ipv6Addr; 3] {
        let v4 = u128::from(v4.to_bits());
        [
            Ipv6Addr::from_bits((0xffff << 32) | v4),
            Ipv6Addr::from_bits((0x0064_ff9b << 96) | v4),
            // 6to4: the address after 2002::/16; the subnet and interface bits are arbitrary.
            Ipv6Addr::from_bits((0x2002 << 112) | (v4 << 80) | u128::from(rest)),
        ]
    }

    #[test]
    fn random_addresses() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..100_000 {
            let v4 = rng.v4();
            let class4 = classify(IpAddr::V4(v4));
            assert_eq!(class4.is_internal(), !class4.is_public(), "{v4}");
            seen.insert(class4);

            // An IPv4 address spelled as IPv6 is classified as itself.
            for v6 in embeddings(v4, rng.next()) {
                assert_eq!(classify(IpAddr::V6(v6)), class4, "{v6} carrying {v4}");
            }

            let v6 = rng.v6();
            let class6 = classify(IpAddr::V6(v6));
            assert_eq!(class6.is_internal(), !class6.is_public(), "{v6}");
            seen.insert(class6);
            // Uniform IPv6 addresses are reserved unless in 2000::/3 (a 1-in-8 chance), or in
            // one of the IPv6 ranges above (ULA, link-local, multicast).
            let top = v6.segments()[0];
            if top >> 13 != 0b001 && top >> 9 != 0x7e && top >> 6 != 0x3fa && top >> 8 != 0xff {
                assert_eq!(class6, Reserved, "{v6}");
            }
        }
        // Uniform IPv4 lands in the large ranges often; the /24s and /32s are in the table.
        for class in [
            Reserved,
            Loopback,
            Private,
            SharedAddressSpace,
            Multicast,
            Public,
        ] {
            assert!(seen.contains(&class), "no random address was {class}");
        }
    }
}
