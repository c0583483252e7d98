//! Secrets the guest uses without holding them: the guest's environment has a placeholder, and
//! the host puts the real value in its place on intercepted requests to the hosts the secret
//! is bound to, and nowhere else.

use std::fmt;
use std::sync::Arc;

use ::http::header::{HeaderMap, HeaderValue};
use bytes::Bytes;

use crate::error::{Error, Result};

/// A credential bound to hosts. The guest's commands get `env_var` set to a placeholder (a
/// random token, the same for every boot of the definition); when an intercepted request to a
/// bound host carries the placeholder in a header (or, opted in, in its query string), the host
/// replaces it with the real value on the way upstream. The real value never enters the guest.
///
/// A placeholder sent anywhere else goes out as it is (it is worth nothing) and the attempt is
/// reported (`tracing`, target `krunbox::net`). The swap happens only on requests that go
/// upstream over TLS: a plain-HTTP request to a bound host that holds the placeholder (in a
/// header, or in the query of a secret opted in to it) is refused with `403` and goes nowhere,
/// as the value would travel in clear. A connection
/// to a bound host on port 443 that the policy [accepts](crate::net::Verdict::accept) is
/// intercepted, so the swap can happen; on other ports, grant
/// [`Verdict::intercept`](crate::net::Verdict::intercept) yourself.
///
/// ```
/// use krunbox::net::{Network, Secret, Verdict};
///
/// let key = Secret::new("OPENAI_API_KEY", std::env::var("OPENAI_API_KEY").unwrap_or_default())?
///     .bind_to("api.openai.com");
/// assert!(key.placeholder().starts_with("krunbox-secret-"));
/// let network = Network::with_policy(|_| async { Verdict::accept() }).secret(key);
/// # Ok::<(), krunbox::Error>(())
/// ```
#[derive(Clone)]
pub struct Secret {
    env_var: String,
    value: Arc<str>,
    placeholder: String,
    hosts: Vec<String>,
    in_query: bool,
    in_body: bool,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secret")
            .field("env_var", &self.env_var)
            .field("value", &"(hidden)")
            .field("placeholder", &self.placeholder)
            .field("hosts", &self.hosts)
            .field("in_query", &self.in_query)
            .field("in_body", &self.in_body)
            .finish()
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        self.env_var == other.env_var
            && self.placeholder == other.placeholder
            && self.hosts == other.hosts
            && self.in_query == other.in_query
            && self.in_body == other.in_body
            && *self.value == *other.value
    }
}

impl Eq for Secret {}

/// The most bytes a secret's value may have (it goes in a header).
const VALUE_MAX: usize = 16 * 1024;

impl Secret {
    /// A secret whose placeholder the guest sees in `env_var`. Bound to no host yet: add them
    /// with [`Secret::bind_to`]. The variable's name must be a portable one (letters, digits
    /// and `_`, not starting with a digit) and the value a valid header value of at most
    /// 16 KiB.
    ///
    /// ```
    /// let secret = krunbox::net::Secret::new("GITHUB_TOKEN", "ghp_real")?;
    /// # Ok::<(), krunbox::Error>(())
    /// ```
    pub fn new(env_var: impl Into<String>, value: impl Into<String>) -> Result<Self> {
        let env_var = env_var.into();
        let value = value.into();
        let portable = !env_var.is_empty()
            && env_var.len() <= 256
            && !env_var.starts_with(|c: char| c.is_ascii_digit())
            && env_var
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !portable {
            return Err(Error::InvalidConfig(format!(
                "a secret's variable must be at most 256 letters, digits and _, not starting \
                 with a digit: {env_var:?}"
            )));
        }
        if value.len() > VALUE_MAX || HeaderValue::from_str(&value).is_err() {
            return Err(Error::InvalidConfig(format!(
                "the secret for {env_var} is not a header value of at most {VALUE_MAX} bytes \
                 (visible ASCII and spaces)"
            )));
        }
        Ok(Self {
            placeholder: format!("krunbox-secret-{}", random_hex()),
            env_var,
            value: value.into(),
            hosts: Vec::new(),
            in_query: false,
            in_body: false,
        })
    }

    /// Binds the secret to `host`: an exact name (`api.example.com`), or `*.example.com` for
    /// its subdomains (not `example.com` itself). Names are compared without case.
    ///
    /// ```
    /// let secret = krunbox::net::Secret::new("TOKEN", "real")?
    ///     .bind_to("api.example.com")
    ///     .bind_to("*.uploads.example.com");
    /// # Ok::<(), krunbox::Error>(())
    /// ```
    pub fn bind_to(mut self, host: impl Into<String>) -> Self {
        self.hosts
            .push(host.into().trim_end_matches('.').to_ascii_lowercase());
        self
    }

    /// Also replaces the placeholder in the query string of requests to bound hosts (for APIs
    /// that take a key as `?key=`).
    ///
    /// ```
    /// let secret = krunbox::net::Secret::new("MAPS_KEY", "real")?
    ///     .bind_to("maps.example.com")
    ///     .in_query_string();
    /// # Ok::<(), krunbox::Error>(())
    /// ```
    pub fn in_query_string(mut self) -> Self {
        self.in_query = true;
        self
    }

    /// Also replaces the placeholder in the body of requests to bound hosts (form posts, JSON:
    /// `client_secret=...`), over TLS only, like headers. The body is streamed, never held
    /// whole: a placeholder split between two pieces is still found (the last bytes of each
    /// piece wait for the next). Since the body's length changes, its `Content-Length` is
    /// dropped and it goes upstream chunked (an origin that insists on a length for request
    /// bodies refuses such requests). A body with a `Content-Encoding` (compressed) is left
    /// alone. Elsewhere the body is only looked at: a placeholder in it going to a host the
    /// secret is not bound to is reported, and goes out as it is.
    ///
    /// ```
    /// let secret = krunbox::net::Secret::new("CLIENT_SECRET", "real")?
    ///     .bind_to("oauth.example.com")
    ///     .in_body();
    /// # Ok::<(), krunbox::Error>(())
    /// ```
    pub fn in_body(mut self) -> Self {
        self.in_body = true;
        self
    }

    /// The same secret with `placeholder` in place of its random one: for a restored guest,
    /// whose environment holds its source's, and for the fuzz harness, whose inputs (and
    /// committed seeds) must be able to name it.
    pub(crate) fn with_placeholder(mut self, placeholder: &str) -> Self {
        self.placeholder = placeholder.to_owned();
        self
    }

    /// The value the guest sees.
    ///
    /// ```
    /// let secret = krunbox::net::Secret::new("TOKEN", "real")?;
    /// assert_ne!(secret.placeholder(), "real");
    /// # Ok::<(), krunbox::Error>(())
    /// ```
    pub fn placeholder(&self) -> &str {
        &self.placeholder
    }

    /// The environment variable the guest finds the placeholder in.
    ///
    /// ```
    /// let secret = krunbox::net::Secret::new("TOKEN", "real")?;
    /// assert_eq!(secret.env_var(), "TOKEN");
    /// # Ok::<(), krunbox::Error>(())
    /// ```
    pub fn env_var(&self) -> &str {
        &self.env_var
    }

    /// Whether the secret is bound to `hostname` (lower case, no final dot).
    pub(crate) fn is_bound_to(&self, hostname: &str) -> bool {
        self.hosts.iter().any(|host| match host.strip_prefix("*.") {
            Some(parent) => hostname
                .strip_suffix(parent)
                .is_some_and(|sub| sub.len() > 1 && sub.ends_with('.')),
            None => host == hostname,
        })
    }
}

/// 128 random bits, hex: from the hasher's random keys, twice.
fn random_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    let half = || {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        hasher.finish()
    };
    format!("{:016x}{:016x}", half(), half())
}

/// What [`swap`] did to one request.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Swapped {
    /// Secrets put in place of their placeholders.
    pub replaced: Vec<String>,
    /// Secrets whose placeholder was left as it was: the host is not one the secret is bound
    /// to, or the placeholder is in a query string the secret did not opt in to.
    pub left: Vec<String>,
}

/// Puts the real values in place of placeholders in `headers` (and, for secrets that opted
/// in, in `path_and_query`) of a request to `hostname`; reports the placeholders it leaves
/// alone.
pub(crate) fn swap(
    secrets: &[Secret],
    hostname: &str,
    headers: &mut HeaderMap,
    path_and_query: &mut String,
) -> Swapped {
    let mut swapped = Swapped::default();
    for secret in secrets {
        let placeholder = secret.placeholder.as_str();
        let in_headers = headers
            .values()
            .any(|v| contains(v.as_bytes(), placeholder.as_bytes()));
        let in_query = path_and_query.contains(placeholder);
        if !in_headers && !in_query {
            continue;
        }
        if !secret.is_bound_to(hostname) {
            swapped.left.push(secret.env_var.clone());
            continue;
        }
        for value in headers.values_mut() {
            if !contains(value.as_bytes(), placeholder.as_bytes()) {
                continue;
            }
            let Ok(text) = value.to_str() else {
                continue;
            };
            // Both parts are valid header text, so the result is too.
            if let Ok(new) = HeaderValue::from_str(&text.replace(placeholder, &secret.value)) {
                let sensitive = true;
                *value = new;
                value.set_sensitive(sensitive);
            }
        }
        if in_query && secret.in_query {
            *path_and_query = path_and_query.replace(placeholder, &percent_encoded(&secret.value));
        } else if in_query {
            swapped.left.push(secret.env_var.clone());
        }
        if in_headers || (in_query && secret.in_query) {
            swapped.replaced.push(secret.env_var.clone());
        }
    }
    swapped
}

/// The shortest value swapped back for its placeholder in responses: a shorter one is too
/// likely to be ordinary text there (`1`, `true`), and no credential worth the name.
pub(crate) const REFLECTED_MIN: usize = 8;

/// The secrets bound to `hostname` whose values are looked for in its responses.
fn reflectable<'a>(secrets: &'a [Secret], hostname: &'a str) -> impl Iterator<Item = &'a Secret> {
    secrets
        .iter()
        .filter(move |s| s.value.len() >= REFLECTED_MIN && s.is_bound_to(hostname))
}

/// Puts the placeholders back in place of the values of the secrets bound to `hostname` in a
/// response's headers (an origin that echoes a request: an error page, a redirect's
/// `Location`): the guest never gets a value. The secrets found, by variable.
pub(crate) fn unswap_headers(
    secrets: &[Secret],
    hostname: &str,
    headers: &mut HeaderMap,
) -> Vec<String> {
    let mut found = Vec::new();
    for secret in reflectable(secrets, hostname) {
        let value = secret.value.as_bytes();
        for header in headers.values_mut() {
            if !contains(header.as_bytes(), value) {
                continue;
            }
            // Replaced bytewise: a header value need not be text.
            let replaced = replace_bytes(header.as_bytes(), value, secret.placeholder.as_bytes());
            *header =
                HeaderValue::from_bytes(&replaced).unwrap_or_else(|_| HeaderValue::from_static(""));
            if !found.contains(&secret.env_var) {
                found.push(secret.env_var.clone());
            }
        }
    }
    found
}

/// `haystack` with every `needle` replaced by `with`.
fn replace_bytes(haystack: &[u8], needle: &[u8], with: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(haystack.len());
    let mut at = 0;
    while at < haystack.len() {
        if haystack[at..].starts_with(needle) {
            out.extend_from_slice(with);
            at += needle.len();
        } else {
            out.push(haystack[at]);
            at += 1;
        }
    }
    out
}

/// The most input a [`StreamSwap`] takes in at once: what it holds is at most this and one
/// placeholder.
pub(crate) const SWAP_STEP: usize = 16 * 1024;

/// Replaces placeholders with values in a stream cut anywhere, holding at most one piece of
/// input (of at most [`SWAP_STEP`] bytes) and the tail of the one before it: a placeholder's
/// first bytes at the end of one piece wait there for the rest. For each secret that opted in
/// to bodies, the replacement is its value (on a request it may be swapped into) or the
/// placeholder itself (only looked for, so it can be reported).
#[derive(Debug)]
pub(crate) struct StreamSwap {
    patterns: Vec<Pattern>,
    /// The longest placeholder, less one byte: what may be the start of a placeholder whose
    /// rest has not come yet.
    hold: usize,
    /// Input not yet decided.
    pending: Vec<u8>,
    /// The bytes a placeholder starts with.
    first: [bool; 256],
}

#[derive(Debug)]
struct Pattern {
    placeholder: Vec<u8>,
    replacement: Arc<[u8]>,
    /// The secret's variable.
    name: String,
    /// Whether the replacement is the value (not the placeholder again).
    swaps: bool,
    found: bool,
}

impl StreamSwap {
    /// Swaps the placeholders of the `secrets` that opted in to bodies, for a request to
    /// `hostname` (empty: a request no secret may be swapped into, such as one over plain
    /// HTTP). `None`: no secret opted in.
    pub(crate) fn for_body(secrets: &[Secret], hostname: &str) -> Option<Self> {
        let patterns: Vec<(&str, &[u8], &str, bool)> = secrets
            .iter()
            .filter(|s| s.in_body)
            .map(|s| {
                let swaps = s.is_bound_to(hostname);
                let replacement = if swaps {
                    s.value.as_bytes()
                } else {
                    s.placeholder.as_bytes()
                };
                (
                    s.placeholder.as_str(),
                    replacement,
                    s.env_var.as_str(),
                    swaps,
                )
            })
            .collect();
        if patterns.is_empty() {
            return None;
        }
        Some(Self::new(patterns))
    }

    /// Swaps the values of the secrets bound to `hostname` back for their placeholders, in a
    /// response on its way to the guest. `None`: no secret is bound to it.
    pub(crate) fn for_response(secrets: &[Secret], hostname: &str) -> Option<Self> {
        let patterns: Vec<(&str, &[u8], &str, bool)> = reflectable(secrets, hostname)
            .map(|s| {
                (
                    &*s.value,
                    s.placeholder.as_bytes(),
                    s.env_var.as_str(),
                    true,
                )
            })
            .collect();
        (!patterns.is_empty()).then(|| Self::new(patterns))
    }

    /// Replaces each `(placeholder, replacement, name, swaps)`.
    pub(crate) fn new(patterns: Vec<(&str, &[u8], &str, bool)>) -> Self {
        let patterns: Vec<Pattern> = patterns
            .into_iter()
            .filter(|(placeholder, ..)| !placeholder.is_empty())
            .map(|(placeholder, replacement, name, swaps)| Pattern {
                placeholder: placeholder.as_bytes().to_vec(),
                replacement: replacement.into(),
                name: name.to_owned(),
                swaps,
                found: false,
            })
            .collect();
        let hold = patterns
            .iter()
            .map(|p| p.placeholder.len() - 1)
            .max()
            .unwrap_or(0);
        let mut first = [false; 256];
        for pattern in &patterns {
            first[usize::from(pattern.placeholder[0])] = true;
        }
        Self {
            patterns,
            hold,
            pending: Vec::new(),
            first,
        }
    }

    /// Whether any placeholder will be replaced by a value (so lengths change).
    pub(crate) fn swaps(&self) -> bool {
        self.patterns.iter().any(|p| p.swaps)
    }

    /// Whether it holds no input.
    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Whether it can take more input: it holds no more than the tail of earlier input.
    pub(crate) fn wants_input(&self) -> bool {
        self.pending.len() <= self.hold
    }

    /// Takes the next piece of input (at most [`SWAP_STEP`] bytes of `input`; the rest stays).
    pub(crate) fn push(&mut self, input: &mut Bytes) {
        let piece = input.split_to(input.len().min(SWAP_STEP));
        self.pending.extend_from_slice(&piece);
    }

    /// The output that is decided: input that cannot be the start of a placeholder still
    /// coming (all of it once `end`), with placeholders replaced; about `limit` bytes at most
    /// (it may pass `limit` by one replacement). Empty when nothing is decided.
    pub(crate) fn pull(&mut self, limit: usize, end: bool) -> Vec<u8> {
        let decided = if end {
            self.pending.len()
        } else {
            self.pending.len().saturating_sub(self.hold)
        };
        let mut out = Vec::new();
        let mut at = 0;
        while at < decided && out.len() < limit {
            // The next placeholder starting before `decided`: there, every placeholder fits in
            // what is pending (or, at the end, there is nothing more to wait for).
            let next = (at..decided).find_map(|start| {
                let rest = &self.pending[start..];
                if !self.first[usize::from(rest[0])] {
                    return None;
                }
                self.patterns
                    .iter()
                    .position(|p| rest.starts_with(&p.placeholder))
                    .map(|index| (start, index))
            });
            let until = next.map_or(decided, |(start, _)| start);
            let until = until.min(at + limit.saturating_sub(out.len()).max(1));
            out.extend_from_slice(&self.pending[at..until]);
            at = until;
            if let Some((start, index)) = next {
                if start == at {
                    let pattern = &mut self.patterns[index];
                    out.extend_from_slice(&pattern.replacement);
                    pattern.found = true;
                    at += pattern.placeholder.len();
                }
            }
        }
        self.pending.drain(..at);
        out
    }

    /// The secrets swapped in so far, and those whose placeholders were found and left.
    pub(crate) fn found(&self) -> (Vec<String>, Vec<String>) {
        let mut swapped = Vec::new();
        let mut left = Vec::new();
        for pattern in self.patterns.iter().filter(|p| p.found) {
            if pattern.swaps {
                swapped.push(pattern.name.clone());
            } else {
                left.push(pattern.name.clone());
            }
        }
        (swapped, left)
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// `value` with everything but unreserved characters (RFC 3986) percent-encoded, for a query.
fn percent_encoded(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_values_are_checked() {
        assert!(Secret::new("OPENAI_API_KEY", "sk-1").is_ok());
        for bad in ["", "1KEY", "KEY-NAME", "KEY=", "KÉY"] {
            assert!(Secret::new(bad, "x").is_err(), "{bad:?}");
        }
        assert!(Secret::new("K", "line\nbreak").is_err());
        assert!(Secret::new("K", "x".repeat(VALUE_MAX + 1)).is_err());
        let a = Secret::new("K", "v").unwrap();
        let b = Secret::new("K", "v").unwrap();
        assert_ne!(a.placeholder(), b.placeholder(), "placeholders are random");
        assert!(
            !format!("{a:?}").contains("\"v\""),
            "the value is not printed"
        );
    }

    #[test]
    fn binding_is_exact_or_to_subdomains() {
        let s = Secret::new("K", "v")
            .unwrap()
            .bind_to("API.example.com.")
            .bind_to("*.uploads.test");
        assert!(s.is_bound_to("api.example.com"));
        assert!(!s.is_bound_to("example.com"));
        assert!(!s.is_bound_to("evilapi.example.com"));
        assert!(s.is_bound_to("a.uploads.test"));
        assert!(s.is_bound_to("a.b.uploads.test"));
        assert!(!s.is_bound_to("uploads.test"));
        assert!(!s.is_bound_to("xuploads.test"));
    }

    /// Everything `swap` gives for `input` cut at `cuts`, pulled `limit` bytes at most at a
    /// time.
    fn streamed(swap: &mut StreamSwap, input: &[u8], cuts: &[usize], limit: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut from = 0;
        for &cut in cuts.iter().chain([&input.len()]) {
            let mut piece = Bytes::copy_from_slice(&input[from..cut]);
            from = cut;
            while !piece.is_empty() {
                while !swap.wants_input() {
                    let more = swap.pull(limit, false);
                    assert!(!more.is_empty(), "it holds more than a tail, so it gives");
                    out.extend(more);
                }
                swap.push(&mut piece);
                assert!(swap.pending.len() <= SWAP_STEP + swap.hold, "bounded");
                loop {
                    let more = swap.pull(limit, false);
                    assert!(more.len() <= limit.max(1) + 64, "a pull is bounded");
                    if more.is_empty() {
                        break;
                    }
                    out.extend(more);
                }
            }
        }
        loop {
            let more = swap.pull(limit, true);
            if more.is_empty() {
                break;
            }
            out.extend(more);
        }
        assert!(swap.is_empty());
        out
    }

    fn replaced(input: &[u8], placeholder: &[u8], value: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut at = 0;
        while at < input.len() {
            if input[at..].starts_with(placeholder) {
                out.extend_from_slice(value);
                at += placeholder.len();
            } else {
                out.push(input[at]);
                at += 1;
            }
        }
        out
    }

    #[test]
    fn a_placeholder_split_at_every_offset_is_swapped() {
        let s = Secret::new("TOKEN", "real-value-that-is-longer-than-the-placeholder-is")
            .unwrap()
            .bind_to("api.test")
            .in_body();
        let placeholder = s.placeholder().as_bytes();
        let input = format!("key={0}&again={0}&end", s.placeholder()).into_bytes();
        let expected = replaced(&input, placeholder, s.value.as_bytes());
        assert_ne!(expected, input);
        for cut in 0..=input.len() {
            for limit in [1, 7, 64 * 1024] {
                let mut swap = StreamSwap::for_body(std::slice::from_ref(&s), "api.test").unwrap();
                assert!(swap.swaps());
                let out = streamed(&mut swap, &input, &[cut], limit);
                assert_eq!(out, expected, "cut at {cut}, limit {limit}");
                assert_eq!(swap.found(), (vec!["TOKEN".to_owned()], vec![]));
            }
        }
        // Cut into single bytes.
        let mut swap = StreamSwap::for_body(std::slice::from_ref(&s), "api.test").unwrap();
        let cuts: Vec<usize> = (1..input.len()).collect();
        assert_eq!(streamed(&mut swap, &input, &cuts, 5), expected);
        // Another host: only looked for, reported, and the bytes are the input's.
        let mut swap = StreamSwap::for_body(std::slice::from_ref(&s), "other.test").unwrap();
        assert!(!swap.swaps());
        assert_eq!(streamed(&mut swap, &input, &[10], 1024), input);
        assert_eq!(swap.found(), (vec![], vec!["TOKEN".to_owned()]));
        // Secrets that did not opt in: nothing to do.
        let plain = Secret::new("PLAIN", "v").unwrap().bind_to("api.test");
        assert!(StreamSwap::for_body(&[plain], "api.test").is_none());
    }

    #[test]
    fn partial_placeholders_and_near_misses_go_through_unchanged() {
        let s = Secret::new("TOKEN", "v")
            .unwrap()
            .bind_to("a.test")
            .in_body();
        let placeholder = s.placeholder().to_owned();
        let almost = &placeholder[..placeholder.len() - 1];
        for input in [
            almost.to_owned(),
            format!("{almost}x{placeholder}"),
            format!("kkk{almost}{placeholder}{almost}"),
            String::new(),
        ] {
            let expected = replaced(input.as_bytes(), placeholder.as_bytes(), b"v");
            for cut in 0..=input.len() {
                let mut swap = StreamSwap::for_body(std::slice::from_ref(&s), "a.test").unwrap();
                let out = streamed(&mut swap, input.as_bytes(), &[cut], 3);
                assert_eq!(out, expected, "{input:?} cut at {cut}");
            }
        }
    }

    /// Random bodies full of placeholders and their prefixes, cut at random, against a plain
    /// replace of the whole.
    #[test]
    fn streamed_swaps_equal_a_whole_replace_on_random_input() {
        let mut next = crate::fuzzing::xorshift(0x9e37_79b9_7f4a_7c15);
        let a = Secret::new("A", "AAAA-value")
            .unwrap()
            .bind_to("h.test")
            .in_body();
        let b = Secret::new("B", "b").unwrap().bind_to("h.test").in_body();
        let c = Secret::new("C", "c-value")
            .unwrap()
            .bind_to("elsewhere.test")
            .in_body();
        let pieces = [
            a.placeholder().to_owned(),
            b.placeholder().to_owned(),
            c.placeholder().to_owned(),
            a.placeholder()[..20].to_owned(),
            "krunbox-".to_owned(),
            "k".to_owned(),
            "x=1&".to_owned(),
        ];
        let secrets = [a.clone(), b.clone(), c.clone()];
        for _ in 0..300 {
            let mut input = Vec::new();
            for _ in 0..(next() % 40) {
                input.extend_from_slice(pieces[(next() % pieces.len() as u64) as usize].as_bytes());
            }
            let mut expected = input.clone();
            for secret in [&a, &b] {
                expected = replaced(
                    &expected,
                    secret.placeholder().as_bytes(),
                    secret.value.as_bytes(),
                );
            }
            let mut cuts: Vec<usize> = (0..(next() % 6))
                .map(|_| (next() % (input.len() as u64 + 1)) as usize)
                .collect();
            cuts.sort_unstable();
            let limit = 1 + (next() % 100) as usize;
            let mut swap = StreamSwap::for_body(&secrets, "h.test").unwrap();
            assert_eq!(streamed(&mut swap, &input, &cuts, limit), expected);
        }
    }

    #[test]
    fn a_large_body_is_taken_a_step_at_a_time() {
        let s = Secret::new("T", "v").unwrap().bind_to("a.test").in_body();
        let mut swap = StreamSwap::for_body(&[s], "a.test").unwrap();
        let mut input = Bytes::from(vec![b'x'; 5 * SWAP_STEP]);
        swap.push(&mut input);
        assert_eq!(input.len(), 4 * SWAP_STEP, "one step taken");
        assert!(!swap.wants_input());
        let out = swap.pull(usize::MAX, false);
        assert_eq!(
            out.len(),
            SWAP_STEP - swap.hold,
            "all but a placeholder's length"
        );
        assert!(swap.wants_input());
    }

    #[test]
    fn placeholders_are_swapped_only_for_bound_hosts() {
        let s = Secret::new("TOKEN", "real value")
            .unwrap()
            .bind_to("api.test");
        let bearer = format!("Bearer {}", s.placeholder());
        let headers = || {
            let mut h = HeaderMap::new();
            h.insert("authorization", bearer.parse().unwrap());
            h.insert("x-other", "untouched".parse().unwrap());
            h
        };
        let mut h = headers();
        let mut path = format!("/v1?key={}", s.placeholder());
        let swapped = swap(std::slice::from_ref(&s), "api.test", &mut h, &mut path);
        assert_eq!(h["authorization"], "Bearer real value");
        assert!(h["authorization"].is_sensitive());
        assert_eq!(h["x-other"], "untouched");
        // The query was not opted in: left, and reported.
        assert!(path.contains(s.placeholder()));
        assert_eq!(swapped.replaced, ["TOKEN"]);
        assert_eq!(swapped.left, ["TOKEN"]);
        // Another host: nothing replaced, reported.
        let mut h = headers();
        let mut path = "/".to_owned();
        let swapped = swap(
            std::slice::from_ref(&s),
            "elsewhere.test",
            &mut h,
            &mut path,
        );
        assert_eq!(h["authorization"], bearer.as_str());
        assert!(swapped.replaced.is_empty());
        assert_eq!(swapped.left, ["TOKEN"]);
        // Opted in: the query gets the value, encoded.
        let q = s.clone().in_query_string();
        let mut h = HeaderMap::new();
        let mut path = format!("/v1?key={}&x=1", q.placeholder());
        let swapped = swap(&[q], "api.test", &mut h, &mut path);
        assert_eq!(path, "/v1?key=real%20value&x=1");
        assert_eq!(swapped.replaced, ["TOKEN"]);
        // No placeholder: nothing to say.
        let mut h = HeaderMap::new();
        let mut path = "/".to_owned();
        assert_eq!(
            swap(&[s], "api.test", &mut h, &mut path),
            Swapped::default()
        );
    }
}
