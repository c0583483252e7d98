//! Declarative rules: a list the [`Policy`] callback is built from, for callers (and the
//! command line) who would rather write data than code. What they mean is documented on
//! [`Rules`], the public face of this module.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::policy::{Decide, Flow, Policy, Protocol, Resolver, ResolverKind, Verdict};

/// The longest name DNS carries, as text without the final dot (RFC 1035: 255 bytes on the
/// wire).
const NAME_MAX: usize = 253;

/// The longest label (RFC 1035).
const LABEL_MAX: usize = 63;

/// The most methods one rule may name.
pub(crate) const METHODS_MAX: usize = 16;

/// The longest method a rule may name.
const METHOD_LEN_MAX: usize = 32;

/// Why a rule, or a part of one, was refused.
///
/// ```
/// use krunbox::net::{DomainPattern, RuleError};
///
/// let err = "api.*.example.com".parse::<DomainPattern>().unwrap_err();
/// assert!(matches!(err, RuleError::MisplacedWildcard { .. }));
/// println!("{err}"); // says where a wildcard may go
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RuleError {
    /// A domain pattern with nothing in it.
    #[error("the domain name is empty")]
    EmptyName,
    /// A domain pattern with an empty label: two dots in a row, or a dot at the start.
    #[error("`{pattern}` has an empty label (two dots in a row, or a dot at the start)")]
    EmptyLabel {
        /// The pattern as given.
        pattern: String,
    },
    /// A label longer than 63 characters.
    #[error("`{pattern}` has a label longer than {LABEL_MAX} characters")]
    LabelTooLong {
        /// The pattern as given.
        pattern: String,
    },
    /// A name longer than 253 characters.
    #[error("`{pattern}` is longer than {NAME_MAX} characters")]
    NameTooLong {
        /// The pattern as given.
        pattern: String,
    },
    /// A character DNS names do not have (international names are written in their `xn--`
    /// form).
    #[error(
        "`{pattern}` has {character:?}, which is not a letter, digit, `-` or `_` \
         (write international names in their xn-- form)"
    )]
    InvalidCharacter {
        /// The pattern as given.
        pattern: String,
        /// The first character refused.
        character: char,
    },
    /// A `*` that is not the whole first label.
    #[error("`{pattern}`: `*` may only be the whole first label, as in `*.example.com`")]
    MisplacedWildcard {
        /// The pattern as given.
        pattern: String,
    },
    /// A wildcard with no domain after it (`*`, `*.`).
    #[error("`{pattern}`: a wildcard needs a domain after it, as in `*.example.com`")]
    BareWildcard {
        /// The pattern as given.
        pattern: String,
    },
    /// Not an IP address, nor a CIDR block.
    #[error("`{input}` is not an IP address or CIDR block (such as 192.0.2.7 or 10.0.0.0/8)")]
    InvalidAddress {
        /// The text as given.
        input: String,
    },
    /// A CIDR prefix length that is not a number up to the address's width.
    #[error("`{input}`: the prefix length must be a number from 0 to {max}")]
    InvalidPrefix {
        /// The text as given.
        input: String,
        /// 32 for IPv4, 128 for IPv6.
        max: u8,
    },
    /// A CIDR block whose address has bits set past its prefix (`10.0.0.1/8`): probably a
    /// typing error, so refused rather than guessed.
    #[error("`{input}` has bits set past its prefix length; the block is {network}")]
    HostBitsSet {
        /// The text as given.
        input: String,
        /// The block the prefix length gives.
        network: String,
    },
    /// Not a port, nor a port range.
    #[error("`{input}` is not a port (0 to 65535) or a port range such as 8000-8100")]
    InvalidPort {
        /// The text as given.
        input: String,
    },
    /// A port range whose first port is above its last.
    #[error("the port range `{input}` is empty: its first port is above its last")]
    EmptyPortRange {
        /// The range as given.
        input: String,
    },
    /// An HTTP method that is not one: rules name methods in upper case (`GET`, `POST`,
    /// `PROPFIND`), letters, digits, `-` and `_`, at most 32 of them.
    #[error(
        "`{input}` is not an HTTP method as rules name them: upper-case letters, digits, `-` \
         and `_`, at most {METHOD_LEN_MAX} (such as GET or POST)"
    )]
    InvalidMethod {
        /// The text as given.
        input: String,
    },
    /// A rule naming more methods than a rule may.
    #[error("a rule names {count} methods; at most {METHODS_MAX}")]
    TooManyMethods {
        /// How many it named.
        count: usize,
    },
    /// A DNS server for a resolver that is not an address and port.
    #[error("`{input}` is not a DNS server's address and port (such as 192.0.2.53:53)")]
    InvalidServer {
        /// The text as given.
        input: String,
    },
    /// A rule with no target, or with both a domain and an address.
    #[error("a rule needs exactly one of `domain` and `address`")]
    Target,
    /// A rule whose parts cannot apply together (a resolver on a deny rule, ports on a
    /// DNS-only rule, ...).
    #[error("{reason}: {rule}")]
    Inconsistent {
        /// The rule.
        rule: String,
        /// What cannot apply.
        reason: &'static str,
    },
    /// The JSON text is not a list of rules: bad syntax, a missing, unknown or mistyped field.
    #[error("{message}")]
    Json {
        /// serde_json's description, with the line and column.
        message: String,
        /// The line (from 1) where it went wrong.
        line: usize,
        /// The column (from 1) where it went wrong.
        column: usize,
    },
    /// One rule of a list is invalid.
    #[error("rules[{index}]: {error}")]
    InRule {
        /// The rule's position in the list, from 0.
        index: usize,
        /// What is wrong with it.
        error: Box<RuleError>,
    },
}

/// What a matching rule does with the flow.
///
/// ```
/// use krunbox::net::{Action, Rule};
/// let rule = Rule::deny_domain("ads.example.com").unwrap();
/// assert_eq!(rule.action(), Action::Deny);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Action {
    /// The flow is granted: a DNS query is resolved, a connection dialled.
    Allow,
    /// The flow is blocked, and no later rule is looked at.
    Deny,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Allow => "allow",
            Action::Deny => "deny",
        })
    }
}

/// A domain name, or a wildcard for the names under one: what a domain rule matches.
///
/// `example.com` matches that name only. `*.example.com` matches every name under it
/// (`www.example.com`, `a.b.example.com`) but **not** `example.com` itself: allow both when
/// both are wanted. Names are compared without regard to ASCII case, and one final dot is
/// dropped (`Example.COM.` is `example.com`). A label is letters, digits, `-` and `_`, at most 63
/// long, and a name at most 253; international names are written in their `xn--` form.
///
/// ```
/// use krunbox::net::DomainPattern;
///
/// let pattern: DomainPattern = "*.Example.com".parse().unwrap();
/// assert!(pattern.matches("www.example.com"));
/// assert!(pattern.matches("a.b.example.com"));
/// assert!(!pattern.matches("example.com"), "a wildcard matches subdomains only");
/// assert!(!pattern.matches("badexample.com"));
/// assert_eq!(pattern.to_string(), "*.example.com");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DomainPattern {
    /// `*.` in front: names under `name`, not `name`.
    wildcard: bool,
    /// Lower case, no final dot.
    name: Box<str>,
}

impl DomainPattern {
    /// Reads a pattern, refusing anything that is not a valid name or wildcard.
    ///
    /// ```
    /// use krunbox::net::{DomainPattern, RuleError};
    /// assert!(DomainPattern::parse("api.example.com").is_ok());
    /// assert!(matches!(DomainPattern::parse("a..com"), Err(RuleError::EmptyLabel { .. })));
    /// assert!(matches!(DomainPattern::parse("*."), Err(RuleError::BareWildcard { .. })));
    /// ```
    pub fn parse(pattern: &str) -> Result<Self, RuleError> {
        let given = || pattern.to_owned();
        let trimmed = pattern.strip_suffix('.').unwrap_or(pattern);
        if trimmed.is_empty() {
            return Err(RuleError::EmptyName);
        }
        if trimmed.len() > NAME_MAX {
            return Err(RuleError::NameTooLong { pattern: given() });
        }
        let lower = trimmed.to_ascii_lowercase();
        let (wildcard, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None if lower == "*" => return Err(RuleError::BareWildcard { pattern: given() }),
            None => (false, lower.as_str()),
        };
        if name.is_empty() {
            return Err(RuleError::BareWildcard { pattern: given() });
        }
        for label in name.split('.') {
            if label.is_empty() {
                return Err(RuleError::EmptyLabel { pattern: given() });
            }
            if label.contains('*') {
                return Err(RuleError::MisplacedWildcard { pattern: given() });
            }
            if label.len() > LABEL_MAX {
                return Err(RuleError::LabelTooLong { pattern: given() });
            }
            if let Some(character) = label
                .chars()
                .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
            {
                return Err(RuleError::InvalidCharacter {
                    pattern: given(),
                    character,
                });
            }
        }
        Ok(Self {
            wildcard,
            name: name.into(),
        })
    }

    /// Whether `name` (a hostname, in any case, with or without a final dot) is this name, or
    /// for a wildcard, a name under it.
    ///
    /// ```
    /// let exact: krunbox::net::DomainPattern = "example.com".parse().unwrap();
    /// assert!(exact.matches("EXAMPLE.com."));
    /// assert!(!exact.matches("www.example.com"));
    /// ```
    pub fn matches(&self, name: &str) -> bool {
        let name = name.strip_suffix('.').unwrap_or(name);
        if !self.wildcard {
            return name.eq_ignore_ascii_case(&self.name);
        }
        // `label.` + the pattern's name, with at least one character of label.
        let Some(split) = name.len().checked_sub(self.name.len() + 1) else {
            return false;
        };
        split > 0
            && name.is_char_boundary(split)
            && name.as_bytes()[split] == b'.'
            && name[split + 1..].eq_ignore_ascii_case(&self.name)
    }

    /// Whether this is a wildcard (`*.example.com`).
    ///
    /// ```
    /// let pattern: krunbox::net::DomainPattern = "*.example.com".parse().unwrap();
    /// assert!(pattern.is_wildcard());
    /// ```
    pub fn is_wildcard(&self) -> bool {
        self.wildcard
    }
}

impl FromStr for DomainPattern {
    type Err = RuleError;

    fn from_str(s: &str) -> Result<Self, RuleError> {
        Self::parse(s)
    }
}

impl fmt::Display for DomainPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.wildcard {
            f.write_str("*.")?;
        }
        f.write_str(&self.name)
    }
}

/// An IP address block in CIDR notation (`10.0.0.0/8`, `2001:db8::/32`), or one address
/// (`192.0.2.7`, the same as `/32`): what an address rule matches.
///
/// The address must have no bits set past the prefix length (`10.0.0.1/8` is refused, naming
/// `10.0.0.0/8`): such a block is usually a typing error. An IPv4 address written as IPv6
/// (`::ffff:10.0.0.1`) is in the IPv4 blocks that hold it.
///
/// (Written here rather than taken from a crate: a parse and one comparison are all the rules
/// need. `ipnet`, which hickory-proto already pulls in, would be one more direct dependency, and
/// it takes `10.0.0.1/8` as a block.)
///
/// ```
/// use krunbox::net::Cidr;
///
/// let block: Cidr = "10.0.0.0/8".parse().unwrap();
/// assert!(block.contains("10.200.0.1".parse().unwrap()));
/// assert!(block.contains("::ffff:10.0.0.1".parse().unwrap()));
/// assert!(!block.contains("11.0.0.1".parse().unwrap()));
/// assert!("10.0.0.1/8".parse::<Cidr>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    address: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Reads `ADDRESS` or `ADDRESS/PREFIX`.
    ///
    /// ```
    /// use krunbox::net::{Cidr, RuleError};
    /// assert_eq!(Cidr::parse("192.0.2.7").unwrap().prefix_len(), 32);
    /// assert!(matches!(Cidr::parse("10.0.0.0/33"), Err(RuleError::InvalidPrefix { .. })));
    /// assert!(matches!(Cidr::parse("10.0.0/8"), Err(RuleError::InvalidAddress { .. })));
    /// ```
    pub fn parse(input: &str) -> Result<Self, RuleError> {
        let (address, prefix) = match input.split_once('/') {
            Some((address, prefix)) => (address, Some(prefix)),
            None => (input, None),
        };
        let address: IpAddr = address.parse().map_err(|_| RuleError::InvalidAddress {
            input: input.to_owned(),
        })?;
        let max = if address.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(text) => text
                .bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| text.parse::<u8>().ok())
                .flatten()
                .filter(|p| !text.is_empty() && *p <= max)
                .ok_or_else(|| RuleError::InvalidPrefix {
                    input: input.to_owned(),
                    max,
                })?,
        };
        let network = masked(address, prefix);
        if network != address {
            return Err(RuleError::HostBitsSet {
                input: input.to_owned(),
                network: format!("{network}/{prefix}"),
            });
        }
        Ok(Self { address, prefix })
    }

    /// The block's first address.
    ///
    /// ```
    /// let block: krunbox::net::Cidr = "10.0.0.0/8".parse().unwrap();
    /// assert_eq!(block.address(), "10.0.0.0".parse::<std::net::IpAddr>().unwrap());
    /// ```
    pub fn address(&self) -> IpAddr {
        self.address
    }

    /// The prefix length: 32 (IPv4) or 128 (IPv6) for one address.
    ///
    /// ```
    /// let block: krunbox::net::Cidr = "10.0.0.0/8".parse().unwrap();
    /// assert_eq!(block.prefix_len(), 8);
    /// ```
    pub fn prefix_len(&self) -> u8 {
        self.prefix
    }

    /// Whether `address` is in the block.
    ///
    /// ```
    /// let one: krunbox::net::Cidr = "192.0.2.7".parse().unwrap();
    /// assert!(one.contains("192.0.2.7".parse().unwrap()));
    /// assert!(!one.contains("192.0.2.8".parse().unwrap()));
    /// ```
    pub fn contains(&self, address: IpAddr) -> bool {
        let address = match address {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
            v4 => v4,
        };
        address.is_ipv4() == self.address.is_ipv4() && masked(address, self.prefix) == self.address
    }
}

/// `address` with the bits past `prefix` cleared.
fn masked(address: IpAddr, prefix: u8) -> IpAddr {
    match address {
        IpAddr::V4(a) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4((u32::from(a) & mask).into())
        }
        IpAddr::V6(a) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6((u128::from(a) & mask).into())
        }
    }
}

/// Whether `method` is one a rule may name: upper-case letters, digits, `-` and `_`, at most
/// [`METHOD_LEN_MAX`].
fn is_rule_method(method: &str) -> bool {
    !method.is_empty()
        && method.len() <= METHOD_LEN_MAX
        && method
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl FromStr for Cidr {
    type Err = RuleError;

    fn from_str(s: &str) -> Result<Self, RuleError> {
        Self::parse(s)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.address, self.prefix)
    }
}

/// The destination ports a rule covers: all of them, one, or a range.
///
/// ```
/// use krunbox::net::Ports;
///
/// assert!(Ports::from(443).contains(443));
/// assert!(!Ports::from(443).contains(80));
/// let range: Ports = "8000-8100".parse().unwrap();
/// assert!(range.contains(8050));
/// assert!(Ports::any().contains(1));
/// assert!("9000-8000".parse::<Ports>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ports {
    first: u16,
    last: u16,
}

impl Ports {
    /// Every port.
    ///
    /// ```
    /// assert!(krunbox::net::Ports::any().is_any());
    /// ```
    pub fn any() -> Self {
        Self {
            first: 0,
            last: u16::MAX,
        }
    }

    /// The ports from `first` to `last`, both included; refused if `first > last`.
    ///
    /// ```
    /// let ports = krunbox::net::Ports::range(8000, 8100).unwrap();
    /// assert!(ports.contains(8100));
    /// assert!(krunbox::net::Ports::range(2, 1).is_err());
    /// ```
    pub fn range(first: u16, last: u16) -> Result<Self, RuleError> {
        if first > last {
            return Err(RuleError::EmptyPortRange {
                input: format!("{first}-{last}"),
            });
        }
        Ok(Self { first, last })
    }

    /// Reads `PORT` or `FIRST-LAST`.
    ///
    /// ```
    /// let ports = krunbox::net::Ports::parse("443").unwrap();
    /// assert_eq!(ports, krunbox::net::Ports::from(443));
    /// ```
    pub fn parse(input: &str) -> Result<Self, RuleError> {
        let port = |text: &str| {
            // Digits only: `u16::from_str` would also take a sign.
            text.bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| text.parse::<u16>().ok())
                .flatten()
                .ok_or_else(|| RuleError::InvalidPort {
                    input: input.to_owned(),
                })
        };
        match input.split_once('-') {
            None => Ok(Self::from(port(input)?)),
            Some((first, last)) => {
                let (first, last) = (port(first)?, port(last)?);
                Self::range(first, last).map_err(|_| RuleError::EmptyPortRange {
                    input: input.to_owned(),
                })
            }
        }
    }

    /// Whether `port` is one of these.
    ///
    /// ```
    /// assert!(krunbox::net::Ports::from(22).contains(22));
    /// ```
    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }

    /// Whether these are all the ports.
    ///
    /// ```
    /// assert!(!krunbox::net::Ports::from(22).is_any());
    /// ```
    pub fn is_any(&self) -> bool {
        *self == Self::any()
    }
}

impl Default for Ports {
    /// Every port.
    fn default() -> Self {
        Self::any()
    }
}

impl From<u16> for Ports {
    fn from(port: u16) -> Self {
        Self {
            first: port,
            last: port,
        }
    }
}

impl FromStr for Ports {
    type Err = RuleError;

    fn from_str(s: &str) -> Result<Self, RuleError> {
        Self::parse(s)
    }
}

impl fmt::Display for Ports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_any() {
            f.write_str("any")
        } else if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

/// What a rule matches flows by.
///
/// ```
/// use krunbox::net::{Rule, Target};
/// let rule = Rule::allow_address("10.0.0.0/8").unwrap();
/// assert!(matches!(rule.target(), Target::Address(_)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Target {
    /// DNS queries for the names the pattern matches, and connections whose trusted hostname
    /// it matches.
    Domain(DomainPattern),
    /// Connections without a hostname to an address in the block.
    Address(Cidr),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Domain(pattern) => write!(f, "domain {pattern}"),
            Target::Address(block) => write!(f, "address {block}"),
        }
    }
}

/// One rule: an [`Action`] for the flows to a [`Target`], optionally only on some [`Ports`],
/// only for one [`Protocol`], and for an allowed name, the [`Resolver`] its DNS queries are
/// answered with (default [`Resolver::system`]).
///
/// Made with [`allow_domain`](Rule::allow_domain) and its siblings, narrowed with
/// [`ports`](Rule::ports), [`protocol`](Rule::protocol) and [`resolver`](Rule::resolver), and
/// checked as a whole when added with [`Rules::rule`] (or read from JSON).
///
/// ```
/// use krunbox::net::{Resolver, Rule, Rules};
///
/// # fn main() -> Result<(), krunbox::net::RuleError> {
/// let rule = Rule::allow_domain("*.corp.test")?
///     .ports(443)
///     .resolver(Resolver::upstream(["127.0.0.1:5353".parse().unwrap()]));
/// let rules = Rules::new().rule(rule)?;
/// # let _ = rules; Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawRule", into = "RawRule")]
#[non_exhaustive]
pub struct Rule {
    action: Action,
    target: Target,
    ports: Ports,
    /// `None`: DNS and TCP (each where the target applies).
    protocol: Option<Protocol>,
    /// For allowed names; `None`: the system resolver.
    resolver: Option<Resolver>,
    /// The HTTP methods of the requests it decides; `None`: every request (and the connection
    /// as a whole).
    methods: Option<Vec<String>>,
}

impl Rule {
    fn new(action: Action, target: Target) -> Self {
        Self {
            action,
            target,
            ports: Ports::any(),
            protocol: None,
            resolver: None,
            methods: None,
        }
    }

    /// Allows the names `pattern` matches (see [`DomainPattern`]): their DNS queries, and
    /// connections to them on any port.
    ///
    /// ```
    /// let rule = krunbox::net::Rule::allow_domain("example.com").unwrap();
    /// ```
    pub fn allow_domain(pattern: &str) -> Result<Self, RuleError> {
        Ok(Self::new(
            Action::Allow,
            Target::Domain(DomainPattern::parse(pattern)?),
        ))
    }

    /// Denies the names `pattern` matches: their DNS queries and connections to them.
    ///
    /// ```
    /// let rule = krunbox::net::Rule::deny_domain("*.ads.example.com").unwrap();
    /// ```
    pub fn deny_domain(pattern: &str) -> Result<Self, RuleError> {
        Ok(Self::new(
            Action::Deny,
            Target::Domain(DomainPattern::parse(pattern)?),
        ))
    }

    /// Allows connections without a hostname to an address in `block` (an address or CIDR
    /// block, see [`Cidr`]).
    ///
    /// ```
    /// let rule = krunbox::net::Rule::allow_address("192.0.2.0/24").unwrap().ports(22);
    /// ```
    pub fn allow_address(block: &str) -> Result<Self, RuleError> {
        Ok(Self::new(
            Action::Allow,
            Target::Address(Cidr::parse(block)?),
        ))
    }

    /// Denies connections without a hostname to an address in `block`.
    ///
    /// ```
    /// let rule = krunbox::net::Rule::deny_address("169.254.0.0/16").unwrap();
    /// ```
    pub fn deny_address(block: &str) -> Result<Self, RuleError> {
        Ok(Self::new(
            Action::Deny,
            Target::Address(Cidr::parse(block)?),
        ))
    }

    /// Limits the rule to connections to `ports` (a `u16`, or [`Ports::range`]). DNS queries
    /// are not limited: an allow rule still grants the name (see [`Rules`]).
    ///
    /// ```
    /// use krunbox::net::{Ports, Rule};
    /// let rule = Rule::allow_domain("example.com").unwrap().ports(Ports::range(8000, 8100).unwrap());
    /// assert!(rule.port_range().contains(8080));
    /// ```
    pub fn ports(mut self, ports: impl Into<Ports>) -> Self {
        self.ports = ports.into();
        self
    }

    /// Limits the rule to one protocol: a domain rule for [`Protocol::Dns`] only answers the
    /// name (connections need another rule), one for [`Protocol::Tcp`] only decides
    /// connections. UDP flows are decided only by rules for [`Protocol::Udp`]: a rule without
    /// a protocol is for DNS and TCP.
    ///
    /// ```
    /// use krunbox::net::{Protocol, Rule};
    /// let rule = Rule::deny_domain("example.com").unwrap().protocol(Protocol::Tcp);
    /// assert_eq!(rule.only_protocol(), Some(Protocol::Tcp));
    /// ```
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = Some(protocol);
        self
    }

    /// The resolver that answers the DNS queries this (allow, domain) rule grants.
    ///
    /// ```
    /// use krunbox::net::{Resolver, Rule};
    /// let rule = Rule::allow_domain("origin.test")
    ///     .unwrap()
    ///     .resolver(Resolver::fixed(["127.0.0.1".parse().unwrap()]));
    /// assert!(rule.dns_resolver().is_some());
    /// ```
    pub fn resolver(mut self, resolver: Resolver) -> Self {
        self.resolver = Some(resolver);
        self
    }

    /// Limits the rule to HTTP requests with these methods (`GET`, `POST`, ...: upper case,
    /// at most 16): the connections it matches are intercepted, and each request on them is
    /// decided by the first rule that matches its host, port *and* method (see [`Rules`],
    /// "HTTP methods"). Only for domain rules on TCP. A request's method is compared without
    /// case, so `post` cannot slip past a rule for `POST`.
    ///
    /// ```
    /// use krunbox::net::{Rule, Rules};
    /// let rules = Rules::new()
    ///     .rule(Rule::allow_domain("api.example.com").unwrap().ports(443).methods(["GET", "HEAD"]))
    ///     .unwrap();
    /// assert_eq!(rules.rules()[0].only_methods(), Some(&["GET".to_owned(), "HEAD".to_owned()][..]));
    /// ```
    pub fn methods<M: Into<String>>(mut self, methods: impl IntoIterator<Item = M>) -> Self {
        let mut list: Vec<String> = Vec::new();
        for method in methods {
            let method = method.into();
            if !list.contains(&method) {
                list.push(method);
            }
        }
        self.methods = Some(list);
        self
    }

    /// The HTTP methods it is limited to, if it is.
    ///
    /// ```
    /// use krunbox::net::Rule;
    /// assert_eq!(Rule::allow_domain("a.test").unwrap().only_methods(), None);
    /// ```
    pub fn only_methods(&self) -> Option<&[String]> {
        self.methods.as_deref()
    }

    /// What the rule does.
    ///
    /// ```
    /// use krunbox::net::{Action, Rule};
    /// assert_eq!(Rule::allow_domain("a.test").unwrap().action(), Action::Allow);
    /// ```
    pub fn action(&self) -> Action {
        self.action
    }

    /// What the rule matches.
    ///
    /// ```
    /// use krunbox::net::{Rule, Target};
    /// let rule = Rule::allow_domain("a.test").unwrap();
    /// assert!(matches!(rule.target(), Target::Domain(p) if p.matches("a.test")));
    /// ```
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The destination ports of the connections it matches.
    ///
    /// ```
    /// use krunbox::net::Rule;
    /// assert!(Rule::allow_domain("a.test").unwrap().port_range().is_any());
    /// ```
    pub fn port_range(&self) -> Ports {
        self.ports
    }

    /// The one protocol it is limited to, if it is.
    ///
    /// ```
    /// use krunbox::net::Rule;
    /// assert_eq!(Rule::allow_domain("a.test").unwrap().only_protocol(), None);
    /// ```
    pub fn only_protocol(&self) -> Option<Protocol> {
        self.protocol
    }

    /// The resolver it names for the names it allows (`None`: the system resolver).
    ///
    /// ```
    /// use krunbox::net::Rule;
    /// assert!(Rule::allow_domain("a.test").unwrap().dns_resolver().is_none());
    /// ```
    pub fn dns_resolver(&self) -> Option<&Resolver> {
        self.resolver.as_ref()
    }

    /// Refuses parts that cannot apply together.
    fn check(&self) -> Result<(), RuleError> {
        let inconsistent = |reason| {
            Err(RuleError::Inconsistent {
                rule: self.to_string(),
                reason,
            })
        };
        let is_domain = matches!(self.target, Target::Domain(_));
        if !is_domain && self.protocol == Some(Protocol::Dns) {
            return inconsistent("an address rule cannot be for DNS (DNS is asked by name)");
        }
        if self.protocol == Some(Protocol::Dns) && !self.ports.is_any() {
            return inconsistent("ports cannot limit a DNS-only rule");
        }
        if self.resolver.is_some() {
            if self.action != Action::Allow {
                return inconsistent("only an allow rule answers DNS, so has a resolver");
            }
            if !is_domain {
                return inconsistent("only a domain rule answers DNS, so has a resolver");
            }
            if matches!(self.protocol, Some(Protocol::Tcp | Protocol::Udp)) {
                return inconsistent("a TCP- or UDP-only rule answers no DNS, so has no resolver");
            }
        }
        if let Some(methods) = &self.methods {
            if methods.len() > METHODS_MAX {
                return Err(RuleError::TooManyMethods {
                    count: methods.len(),
                });
            }
            if let Some(bad) = methods.iter().find(|m| !is_rule_method(m)) {
                return Err(RuleError::InvalidMethod { input: bad.clone() });
            }
            if methods.is_empty() {
                return inconsistent(
                    "an empty method list matches no request (leave `methods` out for all)",
                );
            }
            if !is_domain {
                return inconsistent(
                    "methods need a domain rule: only connections to names are intercepted",
                );
            }
            if matches!(self.protocol, Some(Protocol::Dns | Protocol::Udp)) {
                return inconsistent("methods decide HTTP requests, on TCP only");
            }
        }
        Ok(())
    }

    /// Whether this rule (one that matched the connection) decides a request with `method`.
    fn matches_method(&self, method: &str) -> bool {
        match &self.methods {
            None => true,
            Some(methods) => methods.iter().any(|m| m.eq_ignore_ascii_case(method)),
        }
    }

    /// Whether this rule decides a DNS query for `name`.
    fn matches_dns(&self, name: &str) -> bool {
        if matches!(self.protocol, Some(Protocol::Tcp | Protocol::Udp)) {
            return false;
        }
        // A deny rule with ports or methods restricts connections or requests, not the name.
        if self.action == Action::Deny && (!self.ports.is_any() || self.methods.is_some()) {
            return false;
        }
        matches!(&self.target, Target::Domain(pattern) if pattern.matches(name))
    }

    /// Whether this rule decides a connection with `hostname` to `destination`.
    fn matches_tcp(&self, hostname: Option<&str>, destination: SocketAddr) -> bool {
        if matches!(self.protocol, Some(Protocol::Dns | Protocol::Udp)) {
            return false;
        }
        self.matches_target(hostname, destination)
    }

    /// Whether this rule (one for UDP) decides a UDP flow with `hostname` to `destination`.
    fn matches_udp(&self, hostname: Option<&str>, destination: SocketAddr) -> bool {
        self.protocol == Some(Protocol::Udp) && self.matches_target(hostname, destination)
    }

    fn matches_target(&self, hostname: Option<&str>, destination: SocketAddr) -> bool {
        if !self.ports.contains(destination.port()) {
            return false;
        }
        match (&self.target, hostname) {
            (Target::Domain(pattern), Some(name)) => pattern.matches(name),
            (Target::Address(block), None) => block.contains(destination.ip()),
            _ => false,
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.action, self.target)?;
        if !self.ports.is_any() {
            write!(f, " port {}", self.ports)?;
        }
        if let Some(methods) = &self.methods {
            write!(f, " methods {}", methods.join(","))?;
        }
        if let Some(protocol) = self.protocol {
            write!(f, " ({protocol} only)")?;
        }
        if let Some(resolver) = &self.resolver {
            match &resolver.0 {
                ResolverKind::Fixed(addresses) => write!(f, " resolved as {addresses:?}")?,
                ResolverKind::Upstream(servers) => write!(f, " resolved by {servers:?}")?,
                ResolverKind::System => f.write_str(" resolved by the system")?,
            }
        }
        Ok(())
    }
}

/// An ordered list of [`Rule`]s, and a [`Policy`]. The **first rule that matches a flow decides
/// it**; a flow no rule matches is **denied** (so `Rules::new()` denies everything). Each rule
/// allows or denies flows to a [`Target`]:
///
/// - a [`DomainPattern`]: a name (`example.com`, that name only) or a wildcard
///   (`*.example.com`: every name under `example.com`, **not** `example.com` itself). Names are
///   compared without regard to case and without a final dot. A domain rule matches a DNS query
///   for the name, and a connection whose [trusted hostname](Flow::hostname) is the name (the
///   guest dialled the address the gateway's DNS answer gave it for that name);
/// - a [`Cidr`] block (`10.0.0.0/8`, or one address): matches connections **without** a
///   hostname (the guest dialled an address it had from elsewhere) whose destination is in the
///   block. It never matches a DNS query, nor a connection to a name.
///
/// A rule may also name [`Ports`] (connections to other ports do not match it), a
/// [`Protocol`] it is limited to, and, on an allow rule for names, the [`Resolver`] that answers
/// its DNS queries (the host's own resolver, [`Resolver::system`], unless it says otherwise).
///
/// How each kind of flow is decided:
///
/// - **A DNS query** for a name is granted, with [`Verdict::resolve`] and the rule's resolver,
///   when the first domain rule that matches the name allows it. Ports are ignored here: an
///   allow rule for `example.com` port 443 grants the name's DNS, since the guest needs the
///   address to connect. A *deny* rule with ports only restricts connections, so it is skipped
///   for DNS (it does not hide the name from the allow rules after it).
/// - **A TCP connection** is accepted ([`Verdict::accept`]: the host dials the recorded answer)
///   when the first rule that matches its hostname (or, without one, its destination address)
///   *and* its destination port allows it. A name resolved by a DNS server (not a
///   `dns_static` answer) reaches only public addresses: if its answer is loopback, private,
///   link-local or the cloud metadata address, the connection is denied (DNS rebinding gets
///   nothing).
///
/// **HTTP methods.** A domain rule may name the HTTP methods of the requests it decides
/// ([`Rule::methods`], `"methods": ["GET", "HEAD"]`). For a connection, the rules that match
/// it by name, port and protocol are taken in order up to the first without methods; if any
/// of them names methods, it is each *request* that is decided, by the first of those rules
/// whose methods include the request's (a rule without methods includes them all; a request
/// none includes is denied). The connection is then intercepted as HTTP(S) (see
/// [`Verdict::intercept`]: the guest trusts the sandbox CA; bytes that are not HTTP end it),
/// and a refused request is answered `403` with a line naming the rule, goes nowhere, and
/// leaves the connection usable. When the method cannot change the outcome (every request
/// would be allowed, or every one denied) the connection is accepted or denied as a whole
/// instead. Methods are compared without case; `GET` does not include `HEAD`. A deny rule with
/// methods does not hide the name's DNS.
///
/// ```
/// use krunbox::net::{Network, Rule, Rules};
///
/// # fn main() -> Result<(), krunbox::net::RuleError> {
/// let rules = Rules::new()
///     // A name of the test's own: resolved to loopback, without asking any DNS server, and
///     // connections to it on port 8080.
///     .dns_static("api.test", "127.0.0.1".parse().unwrap())?
///     // Only reading: any other request is answered 403 (the connection is intercepted).
///     .rule(Rule::allow_domain("api.test")?.ports(8080).methods(["GET", "HEAD"]))?
///     // Everything under pythonhosted.org but one name, on 443.
///     .deny_domain("evil.files.pythonhosted.org")?
///     .allow_domain_ports("*.pythonhosted.org", 443)?
///     // An address block reached without DNS.
///     .allow_tcp("192.0.2.0/24", 22)?;
/// let network = Network::with_policy(rules.clone());
///
/// // The same rules as JSON (`Rules::from_json`, or any serde format).
/// let json = r#"{"rules": [
///   {"action": "allow", "domain": "api.test", "protocol": "dns",
///    "resolver": {"static": ["127.0.0.1"]}},
///   {"action": "allow", "domain": "api.test", "ports": 8080, "methods": ["GET", "HEAD"]},
///   {"action": "deny", "domain": "evil.files.pythonhosted.org"},
///   {"action": "allow", "domain": "*.pythonhosted.org", "ports": 443},
///   {"action": "allow", "address": "192.0.2.0/24", "ports": 22}
/// ]}"#;
/// assert_eq!(Rules::from_json(json)?, rules);
/// # let _ = network; Ok(()) }
/// ```
///
/// Every field is checked when the rules are built or read: a pattern with an empty label, a
/// `*` anywhere but the whole first label, a name longer than DNS allows, a malformed address
/// or CIDR block, an empty port range, a method that is not upper case (or more than 16 of
/// them), or a field that cannot apply (a resolver on a deny rule, methods on an address rule)
/// is refused with a [`RuleError`], never ignored. Unknown JSON fields are refused too, so a
/// misspelt `"prots"` does not silently widen a rule.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawRules", into = "RawRules")]
pub struct Rules {
    rules: Vec<Rule>,
}

impl Rules {
    /// No rules: everything is denied.
    ///
    /// ```
    /// assert!(krunbox::net::Rules::new().is_empty());
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `rule` after the others, once it is checked whole (a resolver on a deny rule,
    /// ports on a DNS-only rule and the like are refused).
    ///
    /// ```
    /// use krunbox::net::{Rule, Rules};
    /// let rules = Rules::new().rule(Rule::allow_domain("a.test").unwrap().ports(80)).unwrap();
    /// assert_eq!(rules.len(), 1);
    /// ```
    pub fn rule(mut self, rule: Rule) -> Result<Self, RuleError> {
        rule.check()?;
        self.rules.push(rule);
        Ok(self)
    }

    /// Allows the names `pattern` matches, their DNS (by the system resolver) and connections
    /// to them on any port.
    ///
    /// ```
    /// let rules = krunbox::net::Rules::new().allow_domain("*.example.com").unwrap();
    /// ```
    pub fn allow_domain(self, pattern: &str) -> Result<Self, RuleError> {
        self.rule(Rule::allow_domain(pattern)?)
    }

    /// Allows the names `pattern` matches, their DNS and connections to them on `ports` (a
    /// `u16`, or [`Ports::range`]).
    ///
    /// ```
    /// let rules = krunbox::net::Rules::new().allow_domain_ports("example.com", 443).unwrap();
    /// ```
    pub fn allow_domain_ports(
        self,
        pattern: &str,
        ports: impl Into<Ports>,
    ) -> Result<Self, RuleError> {
        self.rule(Rule::allow_domain(pattern)?.ports(ports))
    }

    /// Denies the names `pattern` matches: their DNS and connections to them.
    ///
    /// ```
    /// let rules = krunbox::net::Rules::new()
    ///     .deny_domain("tracker.example.com").unwrap()
    ///     .allow_domain("*.example.com").unwrap();
    /// ```
    pub fn deny_domain(self, pattern: &str) -> Result<Self, RuleError> {
        self.rule(Rule::deny_domain(pattern)?)
    }

    /// Allows connections without a hostname to `block` (an address or CIDR block) on
    /// `ports` (a `u16`, [`Ports::range`] or [`Ports::any`]).
    ///
    /// ```
    /// let rules = krunbox::net::Rules::new().allow_tcp("192.0.2.0/24", 22).unwrap();
    /// ```
    pub fn allow_tcp(self, block: &str, ports: impl Into<Ports>) -> Result<Self, RuleError> {
        self.rule(Rule::allow_address(block)?.ports(ports))
    }

    /// Denies connections without a hostname to `block` on `ports`.
    ///
    /// ```
    /// use krunbox::net::{Ports, Rules};
    /// let rules = Rules::new()
    ///     .deny_tcp("10.0.0.1", Ports::any()).unwrap()
    ///     .allow_tcp("10.0.0.0/8", 80).unwrap();
    /// ```
    pub fn deny_tcp(self, block: &str, ports: impl Into<Ports>) -> Result<Self, RuleError> {
        self.rule(Rule::deny_address(block)?.ports(ports))
    }

    /// Answers DNS queries for the names `pattern` matches with `address`, like a hosts file
    /// (no DNS server is asked). Only DNS: connections to the name need an allow rule too.
    /// Called again for the same pattern, adds `address` to the answer.
    ///
    /// ```
    /// let rules = krunbox::net::Rules::new()
    ///     .dns_static("origin.test", "127.0.0.1".parse().unwrap()).unwrap()
    ///     .allow_domain_ports("origin.test", 8080).unwrap();
    /// ```
    pub fn dns_static(mut self, pattern: &str, address: IpAddr) -> Result<Self, RuleError> {
        let pattern = DomainPattern::parse(pattern)?;
        let existing = self.rules.iter_mut().find(|rule| {
            rule.action == Action::Allow
                && rule.protocol == Some(Protocol::Dns)
                && rule.target == Target::Domain(pattern.clone())
                && matches!(&rule.resolver, Some(r) if matches!(r.0, ResolverKind::Fixed(_)))
        });
        if let Some(rule) = existing {
            if let Some(Resolver(ResolverKind::Fixed(addresses))) = &rule.resolver {
                let mut addresses = addresses.to_vec();
                if !addresses.contains(&address) {
                    addresses.push(address);
                }
                rule.resolver = Some(Resolver::fixed(addresses));
            }
            return Ok(self);
        }
        self.rule(
            Rule::new(Action::Allow, Target::Domain(pattern))
                .protocol(Protocol::Dns)
                .resolver(Resolver::fixed([address])),
        )
    }

    /// Adds `other`'s rules after these, in their order.
    ///
    /// ```
    /// use krunbox::net::Rules;
    /// let first = Rules::new().deny_domain("a.test").unwrap();
    /// let both = first.extend(Rules::new().allow_domain("*.test").unwrap());
    /// assert_eq!(both.len(), 2);
    /// ```
    pub fn extend(mut self, other: Rules) -> Self {
        self.rules.extend(other.rules);
        self
    }

    /// The rules, in order.
    ///
    /// ```
    /// let rules = krunbox::net::Rules::new().allow_domain("a.test").unwrap();
    /// for rule in rules.rules() {
    ///     println!("{rule}");
    /// }
    /// ```
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// How many rules there are.
    ///
    /// ```
    /// assert_eq!(krunbox::net::Rules::new().len(), 0);
    /// ```
    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// Whether there are none (so everything is denied).
    ///
    /// ```
    /// assert!(krunbox::net::Rules::new().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// The verdict on `flow`: what [`Policy::decide`] answers, without the future.
    ///
    /// ```
    /// # fn f(rules: &krunbox::net::Rules, flow: &krunbox::net::Flow) {
    /// if !rules.verdict(flow).is_grant() {
    ///     println!("{flow} is denied");
    /// }
    /// # }
    /// ```
    pub fn verdict(&self, flow: &Flow) -> Verdict {
        let rule = match flow.protocol() {
            Protocol::Dns => match flow.hostname() {
                Some(name) => self.rules.iter().find(|r| r.matches_dns(name)),
                None => None,
            },
            Protocol::Tcp => return self.tcp_verdict(flow),
            Protocol::Udp => self
                .rules
                .iter()
                .find(|r| r.matches_udp(flow.hostname(), flow.destination())),
        };
        match (rule.map(|r| r.action), flow.protocol()) {
            (Some(Action::Allow), Protocol::Dns) => {
                let resolver = rule.and_then(|r| r.resolver.clone());
                Verdict::resolve(resolver.unwrap_or_else(Resolver::system))
            }
            (Some(Action::Allow), _) => self.allowed(flow, Verdict::accept()),
            _ => Verdict::deny(),
        }
    }

    /// A TCP connection: the rules that match it by target, port and protocol, in order, up to
    /// the first that names no methods (which decides every method the ones before it leave).
    /// Without methods among them the first decides; with them, a connection whose requests
    /// are all allowed is accepted, one whose requests are all denied is denied, and any other
    /// is intercepted so each request meets [`MethodGate`].
    fn tcp_verdict(&self, flow: &Flow) -> Verdict {
        let mut candidates = Vec::new();
        for (index, rule) in self.rules.iter().enumerate() {
            if rule.matches_tcp(flow.hostname(), flow.destination()) {
                candidates.push((index, rule.clone()));
                if rule.methods.is_none() {
                    break;
                }
            }
        }
        // The default denial, for the methods no rule names.
        let falls_through = candidates.last().is_none_or(|(_, r)| r.methods.is_some());
        let allows = candidates.iter().any(|(_, r)| r.action == Action::Allow);
        let denies = falls_through || candidates.iter().any(|(_, r)| r.action == Action::Deny);
        match (allows, denies, flow.hostname()) {
            (false, _, _) => Verdict::deny(),
            (true, false, _) => self.allowed(flow, Verdict::accept()),
            // Methods are on domain rules only (checked), so a candidate with them means a
            // hostname; without one there is nothing to intercept.
            (true, true, None) => Verdict::deny(),
            (true, true, Some(hostname)) => {
                let gate = MethodGate {
                    hostname: hostname.to_owned(),
                    port: flow.destination().port(),
                    rules: candidates,
                };
                self.allowed(
                    flow,
                    Verdict::intercept(super::Intercept::new().middleware(gate)),
                )
            }
        }
    }

    /// `grant` for an allowed connection or UDP flow, unless it is to a name resolved by a
    /// DNS server (not a fixed answer) whose addresses are not public: DNS rebinding to
    /// loopback, a private range or the cloud metadata address reaches nothing.
    fn allowed(&self, flow: &Flow, grant: Verdict) -> Verdict {
        match flow.hostname() {
            Some(name) if !self.has_fixed_answer(name) && !flow.upstream_class().is_public() => {
                tracing::info!(
                    target: "krunbox::net",
                    flow = %flow,
                    class = %flow.upstream_class(),
                    "an allowed name resolved to a non-public address: denied"
                );
                Verdict::deny()
            }
            _ => grant,
        }
    }

    /// Whether the rule that answers `name`'s DNS gives a fixed answer (`dns_static`).
    fn has_fixed_answer(&self, name: &str) -> bool {
        self.rules
            .iter()
            .find(|r| r.matches_dns(name))
            .and_then(|r| r.resolver.as_ref())
            .is_some_and(|r| matches!(r.0, ResolverKind::Fixed(_)))
    }

    /// Reads rules from JSON (`{"rules": [...]}`, see [`Rules`]). Refused
    /// with [`RuleError::Json`] when the text is not such a list, and [`RuleError::InRule`]
    /// when a rule is invalid.
    ///
    /// ```
    /// use krunbox::net::{RuleError, Rules};
    ///
    /// let rules = Rules::from_json(r#"{"rules": [
    ///     {"action": "allow", "domain": "*.example.com", "ports": "443"},
    ///     {"action": "allow", "address": "10.0.0.0/8", "ports": "8000-8100"}
    /// ]}"#).unwrap();
    /// assert_eq!(rules.len(), 2);
    ///
    /// let err = Rules::from_json(r#"{"rules": [{"action": "allow", "domain": "a.*.com"}]}"#);
    /// assert!(matches!(err, Err(RuleError::InRule { index: 0, .. })));
    /// ```
    pub fn from_json(text: &str) -> Result<Self, RuleError> {
        let raw: RawRules = serde_json::from_str(text).map_err(|e| RuleError::Json {
            message: e.to_string(),
            line: e.line(),
            column: e.column(),
        })?;
        Self::try_from(raw)
    }

    /// The rules as JSON, as [`Rules::from_json`] reads them.
    ///
    /// ```
    /// use krunbox::net::Rules;
    /// let rules = Rules::new().allow_tcp("10.0.0.0/8", 80).unwrap();
    /// assert_eq!(Rules::from_json(&rules.to_json()).unwrap(), rules);
    /// ```
    pub fn to_json(&self) -> String {
        // Only strings, numbers and lists: serializing cannot fail.
        serde_json::to_string_pretty(self).expect("rules serialize as JSON")
    }
}

/// The middleware of a connection the rules intercept because methods decide its requests:
/// each request is allowed or answered `403` by the first of the connection's rules whose
/// methods include the request's (a rule without methods includes them all), and a request
/// none includes is denied.
struct MethodGate {
    hostname: String,
    port: u16,
    /// The rules that matched the connection, with their place in the list, in order.
    rules: Vec<(usize, Rule)>,
}

#[async_trait::async_trait]
impl super::Middleware for MethodGate {
    async fn handle(&self, request: &mut super::RequestHead) -> Option<super::Answer> {
        let method = request.method().as_str();
        let (hostname, port) = (&self.hostname, self.port);
        match self.rules.iter().find(|(_, r)| r.matches_method(method)) {
            Some((_, rule)) if rule.action == Action::Allow => None,
            Some((index, rule)) => Some(super::Answer::forbidden(format!(
                "krunbox: {method} to {hostname}:{port} refused by network rule {index} \
                 ({rule})\n"
            ))),
            None => Some(super::Answer::forbidden(format!(
                "krunbox: {method} to {hostname}:{port} refused: no network rule allows it\n"
            ))),
        }
    }
}

impl Policy for Rules {
    fn decide(&self, flow: Flow) -> Decide {
        Box::pin(std::future::ready(self.verdict(&flow)))
    }
}

// Serde shapes: plain strings and numbers, checked into the types above with typed errors (and
// written back from them). Unknown fields are refused: a misspelt field must not widen a rule.

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRules {
    rules: Vec<RawRule>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    action: Action,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    domain: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    address: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ports: Option<RawPorts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    protocol: Option<RawProtocol>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    resolver: Option<RawResolver>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    methods: Option<Vec<String>>,
}

/// `443` or `"443"` or `"8000-8100"`.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum RawPorts {
    Number(u64),
    Text(String),
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum RawProtocol {
    Dns,
    Tcp,
    Udp,
}

/// `"system"`, `{"static": ["127.0.0.1"]}` or `{"upstream": ["192.0.2.53:53"]}`.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum RawResolver {
    System,
    Static(Vec<String>),
    Upstream(Vec<String>),
}

impl TryFrom<RawRule> for Rule {
    type Error = RuleError;

    fn try_from(raw: RawRule) -> Result<Self, RuleError> {
        let target = match (raw.domain, raw.address) {
            (Some(domain), None) => Target::Domain(DomainPattern::parse(&domain)?),
            (None, Some(address)) => Target::Address(Cidr::parse(&address)?),
            _ => return Err(RuleError::Target),
        };
        let mut rule = Rule::new(raw.action, target);
        rule.ports = match raw.ports {
            None => Ports::any(),
            Some(RawPorts::Number(n)) => {
                u16::try_from(n)
                    .map(Ports::from)
                    .map_err(|_| RuleError::InvalidPort {
                        input: n.to_string(),
                    })?
            }
            Some(RawPorts::Text(text)) => Ports::parse(&text)?,
        };
        rule.protocol = raw.protocol.map(|p| match p {
            RawProtocol::Dns => Protocol::Dns,
            RawProtocol::Tcp => Protocol::Tcp,
            RawProtocol::Udp => Protocol::Udp,
        });
        rule.resolver = match raw.resolver {
            None => None,
            Some(RawResolver::System) => Some(Resolver::system()),
            Some(RawResolver::Static(addresses)) => {
                let addresses = addresses
                    .iter()
                    .map(|a| {
                        a.parse::<IpAddr>()
                            .map_err(|_| RuleError::InvalidAddress { input: a.clone() })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Some(Resolver::fixed(addresses))
            }
            Some(RawResolver::Upstream(servers)) => {
                let servers = servers
                    .iter()
                    .map(|s| {
                        s.parse::<SocketAddr>()
                            .map_err(|_| RuleError::InvalidServer { input: s.clone() })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Some(Resolver::upstream(servers))
            }
        };
        if let Some(methods) = raw.methods {
            // Checked before they are kept: a list of any length must not be deduplicated.
            if methods.len() > METHODS_MAX {
                return Err(RuleError::TooManyMethods {
                    count: methods.len(),
                });
            }
            rule = rule.methods(methods);
        }
        rule.check()?;
        Ok(rule)
    }
}

impl From<Rule> for RawRule {
    fn from(rule: Rule) -> Self {
        let (domain, address) = match &rule.target {
            Target::Domain(pattern) => (Some(pattern.to_string()), None),
            Target::Address(block) => (None, Some(block.to_string())),
        };
        let ports = match rule.ports {
            p if p.is_any() => None,
            p if p.first == p.last => Some(RawPorts::Number(p.first.into())),
            p => Some(RawPorts::Text(p.to_string())),
        };
        let protocol = rule.protocol.map(|p| match p {
            Protocol::Dns => RawProtocol::Dns,
            Protocol::Tcp => RawProtocol::Tcp,
            Protocol::Udp => RawProtocol::Udp,
        });
        let resolver = rule.resolver.map(|r| match r.0 {
            ResolverKind::System => RawResolver::System,
            ResolverKind::Fixed(addresses) => {
                RawResolver::Static(addresses.iter().map(IpAddr::to_string).collect())
            }
            ResolverKind::Upstream(servers) => {
                RawResolver::Upstream(servers.iter().map(SocketAddr::to_string).collect())
            }
        });
        RawRule {
            action: rule.action,
            domain,
            address,
            ports,
            protocol,
            resolver,
            methods: rule.methods,
        }
    }
}

impl TryFrom<RawRules> for Rules {
    type Error = RuleError;

    fn try_from(raw: RawRules) -> Result<Self, RuleError> {
        let rules = raw
            .rules
            .into_iter()
            .enumerate()
            .map(|(index, rule)| {
                Rule::try_from(rule).map_err(|error| RuleError::InRule {
                    index,
                    error: Box::new(error),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { rules })
    }
}

impl From<Rules> for RawRules {
    fn from(rules: Rules) -> Self {
        RawRules {
            rules: rules.rules.into_iter().map(RawRule::from).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn dns(name: &str) -> Flow {
        Flow {
            protocol: Protocol::Dns,
            source: "10.0.2.15:40000".parse().unwrap(),
            destination: "10.0.2.2:53".parse().unwrap(),
            hostname: Some(name.into()),
            upstream: Vec::new(),
        }
    }

    /// A connection to `name` (through its sandbox address) on `port`.
    fn tcp_name(name: &str, port: u16) -> Flow {
        Flow {
            protocol: Protocol::Tcp,
            source: "10.0.2.15:40000".parse().unwrap(),
            destination: SocketAddr::new("198.18.0.1".parse().unwrap(), port),
            hostname: Some(Arc::from(name)),
            upstream: vec!["93.184.215.14".parse().unwrap()],
        }
    }

    #[test]
    fn udp_flows_are_decided_only_by_rules_for_udp() {
        let rules = Rules::new()
            .allow_domain("a.test")
            .unwrap()
            .rule(
                Rule::allow_domain("udp.test")
                    .unwrap()
                    .protocol(Protocol::Udp)
                    .ports(3478),
            )
            .unwrap();
        let udp = |name: &str, port: u16| Flow {
            protocol: Protocol::Udp,
            ..tcp_name(name, port)
        };
        assert_eq!(rules.verdict(&udp("udp.test", 3478)), Verdict::accept());
        assert_eq!(rules.verdict(&udp("udp.test", 3479)), Verdict::deny());
        assert_eq!(
            rules.verdict(&udp("a.test", 3478)),
            Verdict::deny(),
            "a rule without a protocol is for DNS and TCP"
        );
        assert_eq!(rules.verdict(&tcp_name("udp.test", 3478)), Verdict::deny());
        assert_eq!(rules.verdict(&dns("udp.test")), Verdict::deny());
        let json = rules.to_json();
        assert!(json.contains("\"udp\""), "{json}");
        assert_eq!(Rules::from_json(&json).unwrap(), rules);
    }

    #[test]
    fn a_resolved_name_reaches_only_public_addresses_and_a_static_one_its_answer() {
        let rules = Rules::new()
            .dns_static("local.test", ip("127.0.0.1"))
            .unwrap()
            .allow_domain("local.test")
            .unwrap()
            .allow_domain("*.example.com")
            .unwrap();
        let with_upstream = |name: &str, upstream: &str| Flow {
            upstream: vec![ip(upstream)],
            ..tcp_name(name, 443)
        };
        assert_eq!(
            rules.verdict(&with_upstream("local.test", "127.0.0.1")),
            Verdict::accept(),
            "a fixed answer is what the rules said"
        );
        for internal in ["127.0.0.1", "10.0.0.1", "169.254.169.254", "192.168.1.1"] {
            assert_eq!(
                rules.verdict(&with_upstream("api.example.com", internal)),
                Verdict::deny(),
                "{internal}"
            );
        }
        assert_eq!(
            rules.verdict(&with_upstream("api.example.com", "93.184.215.14")),
            Verdict::accept()
        );
    }

    /// A connection to an address dialled directly.
    fn tcp_addr(destination: &str) -> Flow {
        let destination: SocketAddr = destination.parse().unwrap();
        Flow {
            protocol: Protocol::Tcp,
            source: "10.0.2.15:40000".parse().unwrap(),
            destination,
            hostname: None,
            upstream: vec![destination.ip()],
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn exact_and_wildcard_patterns_match_as_documented() {
        let exact = DomainPattern::parse("Example.COM.").unwrap();
        assert_eq!(exact.to_string(), "example.com");
        assert!(exact.matches("example.com"));
        assert!(exact.matches("EXAMPLE.com."));
        assert!(!exact.matches("www.example.com"));
        assert!(!exact.matches("example.co"));
        assert!(!exact.matches("xexample.com"));

        let wild = DomainPattern::parse("*.example.com").unwrap();
        assert!(wild.is_wildcard());
        assert!(wild.matches("a.example.com"));
        assert!(wild.matches("A.B.Example.Com."));
        assert!(!wild.matches("example.com"), "the apex is not a subdomain");
        assert!(
            !wild.matches(".example.com"),
            "an empty label is no subdomain"
        );
        assert!(!wild.matches("badexample.com"));
        assert!(!wild.matches("example.com.evil.test"));
        assert!(!wild.matches(""));
        // Names that are not ASCII are compared byte for byte, without panicking.
        assert!(!wild.matches("é.example.co"));
        assert!(!wild.matches("ééééééééééééé"));
        assert!(DomainPattern::parse("_dmarc.example.com").is_ok());
        assert!(DomainPattern::parse("*.com")
            .unwrap()
            .matches("example.com"));
    }

    #[test]
    fn invalid_patterns_are_refused_with_their_reason() {
        let refused = |p: &str| DomainPattern::parse(p).unwrap_err();
        assert_eq!(refused(""), RuleError::EmptyName);
        assert_eq!(refused("."), RuleError::EmptyName);
        assert!(matches!(refused("a..com"), RuleError::EmptyLabel { .. }));
        assert!(matches!(refused(".a.com"), RuleError::EmptyLabel { .. }));
        assert!(matches!(refused("a.com.."), RuleError::EmptyLabel { .. }));
        assert!(matches!(refused("*"), RuleError::BareWildcard { .. }));
        assert!(matches!(refused("*."), RuleError::BareWildcard { .. }));
        assert!(matches!(
            refused("*.*.a.com"),
            RuleError::MisplacedWildcard { .. }
        ));
        assert!(matches!(
            refused("a.*.com"),
            RuleError::MisplacedWildcard { .. }
        ));
        assert!(matches!(
            refused("a*.com"),
            RuleError::MisplacedWildcard { .. }
        ));
        assert!(matches!(
            refused("*a.com"),
            RuleError::MisplacedWildcard { .. }
        ));
        assert!(matches!(
            refused("a.com*"),
            RuleError::MisplacedWildcard { .. }
        ));
        assert!(matches!(
            refused("a b.com"),
            RuleError::InvalidCharacter { character: ' ', .. }
        ));
        assert!(matches!(
            refused("bücher.de"),
            RuleError::InvalidCharacter {
                character: 'ü', ..
            }
        ));
        assert!(matches!(
            refused("a.com:80"),
            RuleError::InvalidCharacter { character: ':', .. }
        ));
        let label = "a".repeat(64);
        assert!(matches!(
            refused(&format!("{label}.com")),
            RuleError::LabelTooLong { .. }
        ));
        assert!(DomainPattern::parse(&format!("{}.com", "a".repeat(63))).is_ok());
        // 4 * 63 + 3 dots = 255 characters; 253 is the most.
        let long = [&"a".repeat(63)[..]; 4].join(".");
        assert!(matches!(refused(&long), RuleError::NameTooLong { .. }));
        let longest = format!("{}.{}", "a".repeat(61), [&"a".repeat(63)[..]; 3].join("."));
        assert_eq!(longest.len(), 253);
        assert!(DomainPattern::parse(&longest).is_ok());
        assert!(DomainPattern::parse(&format!("{longest}.")).is_ok());
        // Megabytes of input: refused at once, no panic.
        assert!(matches!(
            refused(&"a".repeat(1 << 20)),
            RuleError::NameTooLong { .. }
        ));
        // Every message names what is wrong.
        assert!(refused("a.*.com").to_string().contains("*.example.com"));
    }

    #[test]
    fn cidr_blocks_parse_strictly_and_contain_what_they_should() {
        let block = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(block.contains(ip("10.0.0.0")));
        assert!(block.contains(ip("10.255.255.255")));
        assert!(!block.contains(ip("11.0.0.0")));
        assert!(!block.contains(ip("9.255.255.255")));
        assert!(block.contains(ip("::ffff:10.1.2.3")), "IPv4-mapped");
        assert!(
            !block.contains(ip("::a01:203")),
            "IPv4-compatible is not IPv4"
        );
        let all = Cidr::parse("0.0.0.0/0").unwrap();
        assert!(all.contains(ip("203.0.113.9")));
        assert!(
            !all.contains(ip("2001:db8::1")),
            "an IPv4 block holds no IPv6"
        );
        let one = Cidr::parse("192.0.2.7").unwrap();
        assert_eq!(one.prefix_len(), 32);
        assert!(one.contains(ip("192.0.2.7")) && !one.contains(ip("192.0.2.6")));
        let v6 = Cidr::parse("2001:db8::/32").unwrap();
        assert!(v6.contains(ip("2001:db8:ffff::1")));
        assert!(!v6.contains(ip("2001:db9::1")));
        assert!(Cidr::parse("::/0").unwrap().contains(ip("::1")));
        assert_eq!(Cidr::parse("::1").unwrap().prefix_len(), 128);

        let refused = |s: &str| Cidr::parse(s).unwrap_err();
        for bad in [
            "",
            "10.0.0",
            "10.0.0.0.0/8",
            "host.test",
            "10.0.0.256",
            "/8",
            "[::1]",
        ] {
            assert!(
                matches!(refused(bad), RuleError::InvalidAddress { .. }),
                "{bad}"
            );
        }
        for bad in [
            "10.0.0.0/33",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "10.0.0.0/-1",
            "10.0.0.0/8/8",
        ] {
            assert!(
                matches!(refused(bad), RuleError::InvalidPrefix { max: 32, .. }),
                "{bad}"
            );
        }
        assert!(matches!(
            refused("::/129"),
            RuleError::InvalidPrefix { max: 128, .. }
        ));
        assert_eq!(
            refused("10.0.0.1/8"),
            RuleError::HostBitsSet {
                input: "10.0.0.1/8".into(),
                network: "10.0.0.0/8".into()
            }
        );
        assert!(matches!(
            refused("2001:db8::1/32"),
            RuleError::HostBitsSet { .. }
        ));
    }

    #[test]
    fn ports_parse_as_one_or_a_range() {
        assert_eq!(Ports::parse("443").unwrap(), Ports::from(443));
        assert_eq!(Ports::parse("0-65535").unwrap(), Ports::any());
        let range = Ports::parse("8000-8100").unwrap();
        assert!(range.contains(8000) && range.contains(8100) && !range.contains(8101));
        assert_eq!(range.to_string(), "8000-8100");
        for bad in [
            "", "-", "80-", "-80", "65536", "+80", "80 ", "http", "1-2-3",
        ] {
            assert!(
                matches!(Ports::parse(bad), Err(RuleError::InvalidPort { .. })),
                "{bad:?}"
            );
        }
        assert!(matches!(
            Ports::parse("90-80"),
            Err(RuleError::EmptyPortRange { .. })
        ));
    }

    #[test]
    fn the_first_matching_rule_decides_and_nothing_matching_is_denied() {
        let rules = Rules::new()
            .allow_domain("a.test")
            .unwrap()
            .deny_domain("a.test")
            .unwrap();
        assert!(rules.verdict(&dns("a.test")).is_grant());
        assert!(rules.verdict(&tcp_name("a.test", 80)).is_grant());
        assert_eq!(rules.verdict(&dns("b.test")), Verdict::deny());
        assert_eq!(rules.verdict(&tcp_name("b.test", 80)), Verdict::deny());
        assert_eq!(Rules::new().verdict(&dns("a.test")), Verdict::deny());
        assert_eq!(
            Rules::new().verdict(&tcp_addr("192.0.2.1:80")),
            Verdict::deny()
        );
        // The other way round, the deny comes first and wins.
        let rules = Rules::new()
            .deny_domain("a.test")
            .unwrap()
            .allow_domain("a.test")
            .unwrap();
        assert_eq!(rules.verdict(&dns("a.test")), Verdict::deny());
        assert_eq!(rules.verdict(&tcp_name("a.test", 80)), Verdict::deny());
    }

    #[test]
    fn a_deny_before_a_wildcard_allow_carves_out_one_name() {
        let rules = Rules::new()
            .deny_domain("internal.example.com")
            .unwrap()
            .allow_domain("*.example.com")
            .unwrap();
        assert_eq!(rules.verdict(&dns("internal.example.com")), Verdict::deny());
        assert_eq!(
            rules.verdict(&tcp_name("INTERNAL.example.com", 443)),
            Verdict::deny()
        );
        assert_eq!(
            rules.verdict(&dns("www.example.com")),
            Verdict::resolve(Resolver::system())
        );
        // Below the denied name is another name: the exact deny does not cover it.
        assert!(rules.verdict(&dns("a.internal.example.com")).is_grant());
        // The apex is not under the wildcard.
        assert_eq!(rules.verdict(&dns("example.com")), Verdict::deny());
    }

    #[test]
    fn ports_limit_connections_but_not_the_names_dns() {
        let rules = Rules::new()
            .allow_domain_ports("a.test", 443)
            .unwrap()
            .allow_domain_ports("b.test", Ports::range(8000, 8100).unwrap())
            .unwrap();
        assert!(
            rules.verdict(&dns("a.test")).is_grant(),
            "ports ignored for DNS"
        );
        assert_eq!(rules.verdict(&tcp_name("a.test", 443)), Verdict::accept());
        assert_eq!(rules.verdict(&tcp_name("a.test", 80)), Verdict::deny());
        assert_eq!(rules.verdict(&tcp_name("b.test", 8000)), Verdict::accept());
        assert_eq!(rules.verdict(&tcp_name("b.test", 8100)), Verdict::accept());
        assert_eq!(rules.verdict(&tcp_name("b.test", 8101)), Verdict::deny());

        // A deny with ports blocks those connections, and not the name nor other ports.
        let rules = Rules::new()
            .rule(Rule::deny_domain("a.test").unwrap().ports(25))
            .unwrap()
            .allow_domain("a.test")
            .unwrap();
        assert!(rules.verdict(&dns("a.test")).is_grant());
        assert_eq!(rules.verdict(&tcp_name("a.test", 25)), Verdict::deny());
        assert_eq!(rules.verdict(&tcp_name("a.test", 443)), Verdict::accept());
    }

    #[test]
    fn address_rules_match_connections_without_a_hostname_only() {
        let rules = Rules::new()
            .deny_tcp("10.0.0.1", Ports::any())
            .unwrap()
            .allow_tcp("10.0.0.0/8", 80)
            .unwrap()
            .allow_tcp("192.0.2.7", Ports::range(1, 1024).unwrap())
            .unwrap();
        assert_eq!(rules.verdict(&tcp_addr("10.2.3.4:80")), Verdict::accept());
        assert_eq!(rules.verdict(&tcp_addr("10.2.3.4:81")), Verdict::deny());
        assert_eq!(
            rules.verdict(&tcp_addr("10.0.0.1:80")),
            Verdict::deny(),
            "deny first"
        );
        assert_eq!(rules.verdict(&tcp_addr("11.0.0.1:80")), Verdict::deny());
        assert_eq!(rules.verdict(&tcp_addr("192.0.2.7:22")), Verdict::accept());
        assert_eq!(rules.verdict(&tcp_addr("192.0.2.7:2222")), Verdict::deny());
        // A connection to a name is matched by name, never by its addresses (sandbox or real).
        let mut named = tcp_name("x.test", 80);
        named.destination = "10.2.3.4:80".parse().unwrap();
        named.upstream = vec![ip("10.2.3.4")];
        assert_eq!(rules.verdict(&named), Verdict::deny());
        // An address rule decides no DNS.
        assert_eq!(rules.verdict(&dns("10.2.3.4")), Verdict::deny());
        // And a domain rule does not match an address dialled directly.
        let rules = Rules::new().allow_domain("*.test").unwrap();
        assert_eq!(rules.verdict(&tcp_addr("192.0.2.1:80")), Verdict::deny());
    }

    #[test]
    fn a_static_name_answers_dns_only_and_its_addresses_accumulate() {
        let rules = Rules::new()
            .dns_static("origin.test", ip("127.0.0.1"))
            .unwrap()
            .dns_static("ORIGIN.test.", ip("127.0.0.2"))
            .unwrap()
            .dns_static("origin.test", ip("127.0.0.1"))
            .unwrap()
            .dns_static("other.test", ip("127.0.0.1"))
            .unwrap()
            .allow_domain_ports("origin.test", 8080)
            .unwrap();
        assert_eq!(rules.len(), 3);
        assert_eq!(
            rules.verdict(&dns("origin.test")),
            Verdict::resolve(Resolver::fixed([ip("127.0.0.1"), ip("127.0.0.2")]))
        );
        assert_eq!(
            rules.verdict(&dns("other.test")),
            Verdict::resolve(Resolver::fixed([ip("127.0.0.1")]))
        );
        // DNS is answered; a connection needs its own allow.
        assert_eq!(
            rules.verdict(&tcp_name("origin.test", 8080)),
            Verdict::accept()
        );
        assert_eq!(
            rules.verdict(&tcp_name("origin.test", 8081)),
            Verdict::deny()
        );
        assert_eq!(
            rules.verdict(&tcp_name("other.test", 8080)),
            Verdict::deny()
        );
        // An allow rule with a resolver answers with it; without one, with the system's.
        let upstream = Resolver::upstream(["127.0.0.1:5353".parse().unwrap()]);
        let rules = Rules::new()
            .rule(
                Rule::allow_domain("*.corp.test")
                    .unwrap()
                    .resolver(upstream.clone()),
            )
            .unwrap();
        assert_eq!(
            rules.verdict(&dns("git.corp.test")),
            Verdict::resolve(upstream)
        );
        assert!(matches!(
            Rules::new().dns_static("a..test", ip("127.0.0.1")),
            Err(RuleError::EmptyLabel { .. })
        ));
    }

    #[test]
    fn protocol_limited_rules_apply_to_their_protocol_only() {
        let rules = Rules::new()
            .rule(Rule::deny_domain("a.test").unwrap().protocol(Protocol::Tcp))
            .unwrap()
            .allow_domain("a.test")
            .unwrap();
        assert!(rules.verdict(&dns("a.test")).is_grant());
        assert_eq!(rules.verdict(&tcp_name("a.test", 80)), Verdict::deny());
    }

    #[test]
    fn parts_that_cannot_apply_together_are_refused() {
        let fixed = Resolver::fixed([ip("127.0.0.1")]);
        let refused = |rule: Rule| match Rules::new().rule(rule) {
            Err(RuleError::Inconsistent { reason, .. }) => reason,
            other => panic!("accepted: {other:?}"),
        };
        refused(Rule::deny_domain("a.test").unwrap().resolver(fixed.clone()));
        refused(
            Rule::allow_address("10.0.0.0/8")
                .unwrap()
                .resolver(fixed.clone()),
        );
        refused(
            Rule::allow_address("10.0.0.0/8")
                .unwrap()
                .protocol(Protocol::Dns),
        );
        refused(
            Rule::allow_domain("a.test")
                .unwrap()
                .protocol(Protocol::Dns)
                .ports(80),
        );
        refused(
            Rule::allow_domain("a.test")
                .unwrap()
                .protocol(Protocol::Tcp)
                .resolver(fixed),
        );
    }

    #[tokio::test]
    async fn rules_are_a_policy() {
        let network = crate::Network::with_policy(Rules::new().allow_domain("a.test").unwrap());
        let policy = network.policy().unwrap();
        assert!(crate::net::policy::ask(&*policy, dns("a.test"))
            .await
            .is_grant());
        assert_eq!(
            crate::net::policy::ask(&*policy, dns("b.test")).await,
            Verdict::deny()
        );
    }

    #[test]
    fn rules_round_trip_through_json() {
        let rules = Rules::new()
            .dns_static("origin.test", ip("127.0.0.1"))
            .unwrap()
            .deny_domain("internal.example.com")
            .unwrap()
            .allow_domain_ports("*.example.com", 443)
            .unwrap()
            .rule(
                Rule::allow_domain("git.corp.test")
                    .unwrap()
                    .ports(Ports::range(22, 23).unwrap())
                    .resolver(Resolver::upstream(["127.0.0.1:5353".parse().unwrap()])),
            )
            .unwrap()
            .rule(
                Rule::allow_domain("sys.test")
                    .unwrap()
                    .resolver(Resolver::system()),
            )
            .unwrap()
            .rule(Rule::deny_domain("a.test").unwrap().protocol(Protocol::Tcp))
            .unwrap()
            .allow_tcp("10.0.0.0/8", 80)
            .unwrap()
            .deny_tcp("2001:db8::/32", Ports::any())
            .unwrap();
        let json = rules.to_json();
        assert_eq!(Rules::from_json(&json).unwrap(), rules);
        assert_eq!(serde_json::from_str::<Rules>(&json).unwrap(), rules);
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(
            value["rules"][0],
            serde_json::json!({
                "action": "allow", "domain": "origin.test", "protocol": "dns",
                "resolver": {"static": ["127.0.0.1"]}
            })
        );
        assert_eq!(
            value["rules"][3]["ports"],
            serde_json::json!("22-23"),
            "{json}"
        );
        assert_eq!(value["rules"][2]["ports"], serde_json::json!(443));
        assert_eq!(
            value["rules"][6]["address"],
            serde_json::json!("10.0.0.0/8")
        );
        assert_eq!(value["rules"][4]["resolver"], serde_json::json!("system"));
        // Ports as a number or a string; an address without a prefix.
        let read = Rules::from_json(
            r#"{"rules": [{"action": "allow", "domain": "a.test", "ports": "443"},
                          {"action": "allow", "address": "192.0.2.7", "ports": 22}]}"#,
        )
        .unwrap();
        assert_eq!(
            read,
            Rules::new()
                .allow_domain_ports("a.test", 443)
                .unwrap()
                .allow_tcp("192.0.2.7/32", 22)
                .unwrap()
        );
        assert!(Rules::from_json(r#"{"rules": []}"#).unwrap().is_empty());
    }

    fn is_intercept(verdict: &Verdict) -> bool {
        verdict.interception().is_some()
    }

    #[test]
    fn methods_are_checked_and_read_and_written_as_json() {
        let rule = |methods: &[&str]| {
            Rules::new().rule(
                Rule::allow_domain("a.test")
                    .unwrap()
                    .methods(methods.iter().copied()),
            )
        };
        let rules = rule(&["GET", "HEAD", "GET", "VERSION-CONTROL"]).unwrap();
        assert_eq!(
            rules.rules()[0].only_methods().unwrap(),
            ["GET", "HEAD", "VERSION-CONTROL"],
            "kept once each, in order"
        );
        assert_eq!(
            rules.rules()[0].to_string(),
            "allow domain a.test methods GET,HEAD,VERSION-CONTROL"
        );
        for bad in ["get", "G ET", "", "GET\r\n", "POST;", &"A".repeat(33)] {
            assert!(
                matches!(rule(&[bad]), Err(RuleError::InvalidMethod { .. })),
                "{bad:?}"
            );
        }
        let many: Vec<String> = (0..17).map(|i| format!("M{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(matches!(
            rule(&many),
            Err(RuleError::TooManyMethods { count: 17 })
        ));
        assert!(rule(&many[..16]).is_ok());
        let inconsistent =
            |rule: Rule| matches!(Rules::new().rule(rule), Err(RuleError::Inconsistent { .. }));
        assert!(inconsistent(
            Rule::allow_domain("a.test")
                .unwrap()
                .methods(Vec::<String>::new())
        ));
        assert!(inconsistent(
            Rule::allow_address("10.0.0.0/8").unwrap().methods(["GET"])
        ));
        assert!(inconsistent(
            Rule::allow_domain("a.test")
                .unwrap()
                .protocol(Protocol::Dns)
                .methods(["GET"])
        ));
        assert!(inconsistent(
            Rule::allow_domain("a.test")
                .unwrap()
                .protocol(Protocol::Udp)
                .methods(["GET"])
        ));
        // JSON: read, written back the same, and checked.
        let rules = Rules::from_json(
            r#"{"rules": [{"action": "deny", "domain": "a.test", "methods": ["POST", "PUT"]},
                          {"action": "allow", "domain": "a.test", "ports": 443,
                           "methods": ["GET"]}]}"#,
        )
        .unwrap();
        assert_eq!(
            rules,
            Rules::new()
                .rule(
                    Rule::deny_domain("a.test")
                        .unwrap()
                        .methods(["POST", "PUT"])
                )
                .unwrap()
                .rule(
                    Rule::allow_domain("a.test")
                        .unwrap()
                        .ports(443)
                        .methods(["GET"])
                )
                .unwrap()
        );
        let json = rules.to_json();
        assert_eq!(Rules::from_json(&json).unwrap(), rules);
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(
            value["rules"][0]["methods"],
            serde_json::json!(["POST", "PUT"])
        );
        for (json, expected) in [
            (r#""methods": ["get"]"#, "InvalidMethod"),
            (r#""methods": []"#, "Inconsistent"),
            (r#""methods": "GET""#, "Json"),
        ] {
            let text =
                format!(r#"{{"rules": [{{"action": "allow", "domain": "a.test", {json}}}]}}"#);
            let err = Rules::from_json(&text).unwrap_err();
            let err = match err {
                RuleError::InRule { error, .. } => *error,
                other => other,
            };
            assert!(format!("{err:?}").starts_with(expected), "{json}: {err:?}");
        }
        let many = format!(
            r#"{{"rules": [{{"action": "allow", "domain": "a.test", "methods": [{}]}}]}}"#,
            vec!["\"GET\""; 100_000].join(",")
        );
        assert!(matches!(
            Rules::from_json(&many),
            Err(RuleError::InRule { error, .. }) if matches!(*error, RuleError::TooManyMethods { count: 100_000 })
        ));
    }

    #[test]
    fn a_connection_is_intercepted_only_when_the_method_can_change_its_outcome() {
        let post_denied = Rules::new()
            .rule(Rule::deny_domain("a.test").unwrap().methods(["POST"]))
            .unwrap()
            .allow_domain("a.test")
            .unwrap();
        assert!(is_intercept(&post_denied.verdict(&tcp_name("a.test", 443))));
        assert!(
            post_denied.verdict(&dns("a.test")).is_grant(),
            "a deny with methods does not hide the name"
        );
        // Only GET, the rest denied by default: intercepted.
        let get_only = Rules::new()
            .rule(
                Rule::allow_domain("a.test")
                    .unwrap()
                    .ports(443)
                    .methods(["GET"]),
            )
            .unwrap();
        assert!(is_intercept(&get_only.verdict(&tcp_name("a.test", 443))));
        assert!(get_only.verdict(&dns("a.test")).is_grant());
        assert_eq!(
            get_only.verdict(&tcp_name("a.test", 80)),
            Verdict::deny(),
            "no rule matches port 80"
        );
        // Every method allowed: accepted, not intercepted.
        let all_allowed = Rules::new()
            .rule(Rule::allow_domain("a.test").unwrap().methods(["GET"]))
            .unwrap()
            .allow_domain("a.test")
            .unwrap();
        assert_eq!(
            all_allowed.verdict(&tcp_name("a.test", 443)),
            Verdict::accept()
        );
        // Every method denied: denied.
        let all_denied = Rules::new()
            .rule(Rule::deny_domain("a.test").unwrap().methods(["POST"]))
            .unwrap()
            .deny_domain("a.test")
            .unwrap()
            .allow_domain("a.test")
            .unwrap();
        assert_eq!(
            all_denied.verdict(&tcp_name("a.test", 443)),
            Verdict::deny()
        );
        // A rule without methods first decides the connection as before.
        let plain_first = Rules::new()
            .allow_domain("a.test")
            .unwrap()
            .rule(Rule::deny_domain("a.test").unwrap().methods(["POST"]))
            .unwrap();
        assert_eq!(
            plain_first.verdict(&tcp_name("a.test", 443)),
            Verdict::accept()
        );
        // Other names are not touched by the methods of a.test.
        assert_eq!(
            post_denied.verdict(&tcp_name("b.test", 443)),
            Verdict::deny()
        );
        // DNS rebinding: an intercepted name resolved to a private address reaches nothing.
        let mut private = tcp_name("a.test", 443);
        private.upstream = vec![ip("10.0.0.1")];
        assert_eq!(get_only.verdict(&private), Verdict::deny());
    }

    #[test]
    fn invalid_json_is_refused_with_a_typed_error_naming_the_rule() {
        let in_rule = |json: &str| match Rules::from_json(json) {
            Err(RuleError::InRule { index, error }) => (index, *error),
            other => panic!("{json}: {other:?}"),
        };
        let (index, error) = in_rule(
            r#"{"rules": [{"action": "allow", "domain": "ok.test"},
                          {"action": "allow", "domain": "a.*.test"}]}"#,
        );
        assert_eq!(index, 1);
        assert!(matches!(error, RuleError::MisplacedWildcard { .. }));
        for (json, expected) in [
            (r#"{"action": "allow"}"#, "Target"),
            (
                r#"{"action": "allow", "domain": "a.test", "address": "10.0.0.0/8"}"#,
                "Target",
            ),
            (
                r#"{"action": "allow", "address": "10.0.0.1/8"}"#,
                "HostBitsSet",
            ),
            (
                r#"{"action": "allow", "address": "10.0.0.0/40"}"#,
                "InvalidPrefix",
            ),
            (r#"{"action": "allow", "domain": "*."}"#, "BareWildcard"),
            (
                r#"{"action": "allow", "domain": "a.test", "ports": 70000}"#,
                "InvalidPort",
            ),
            (
                r#"{"action": "allow", "domain": "a.test", "ports": "9-1"}"#,
                "EmptyPortRange",
            ),
            (
                r#"{"action": "allow", "domain": "a.test", "resolver": {"static": ["x"]}}"#,
                "InvalidAddress",
            ),
            (
                r#"{"action": "allow", "domain": "a.test", "resolver": {"upstream": ["1.1.1.1"]}}"#,
                "InvalidServer",
            ),
            (
                r#"{"action": "deny", "domain": "a.test", "resolver": "system"}"#,
                "Inconsistent",
            ),
        ] {
            let (index, error) = in_rule(&format!(r#"{{"rules": [{json}]}}"#));
            assert_eq!(index, 0);
            assert!(
                format!("{error:?}").starts_with(expected),
                "{json}: {error:?}"
            );
        }
        // Not a list of rules at all: syntax, unknown or misspelt fields, wrong types.
        for json in [
            "",
            "[",
            r#"[{"action": "allow", "domain": "a.test"}]"#,
            r#"{"rules": [{"action": "allow", "domain": "a.test", "prots": 80}]}"#,
            r#"{"rules": [{"action": "permit", "domain": "a.test"}]}"#,
            r#"{"rules": [{"action": "allow", "domain": 7}]}"#,
            r#"{"rules": [], "default": "allow"}"#,
            r#"{"rules": [{"action": "allow", "domain": "a.test", "protocol": "sctp"}]}"#,
        ] {
            assert!(
                matches!(Rules::from_json(json), Err(RuleError::Json { .. })),
                "{json}"
            );
        }
        // Through serde directly, the same checks apply (as serde errors).
        let err = serde_json::from_str::<Rules>(
            r#"{"rules": [{"action": "allow", "domain": "a..test"}]}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("empty label"), "{err}");
        assert!(serde_json::from_str::<Rule>(r#"{"action": "allow", "domain": "*"}"#).is_err());
    }
}
