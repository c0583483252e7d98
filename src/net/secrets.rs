//! Secrets the guest uses without holding them: the guest's environment has a placeholder, and
//! the host puts the real value in its place on intercepted requests to the hosts the secret
//! is bound to, and nowhere else.

use std::fmt;
use std::sync::Arc;

use ::http::header::{HeaderMap, HeaderValue};

use crate::error::{Error, Result};

/// A credential bound to hosts. The guest's commands get `env_var` set to a placeholder (a
/// random token, the same for every boot of the definition); when an intercepted request to a
/// bound host carries the placeholder in a header (or, opted in, in its query string), the host
/// replaces it with the real value on the way upstream. The real value never enters the guest.
///
/// A placeholder sent anywhere else goes out as it is (it is worth nothing) and the attempt is
/// reported (`tracing`, target `krunbox::net`). The swap happens only on requests that go
/// upstream over TLS: on plain HTTP the placeholder stays, even to a bound host. A connection
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
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secret")
            .field("env_var", &self.env_var)
            .field("value", &"(hidden)")
            .field("placeholder", &self.placeholder)
            .field("hosts", &self.hosts)
            .field("in_query", &self.in_query)
            .finish()
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        self.env_var == other.env_var
            && self.placeholder == other.placeholder
            && self.hosts == other.hosts
            && self.in_query == other.in_query
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

    /// The same secret with `placeholder` in place of its random one: for the fuzz harness,
    /// whose inputs (and committed seeds) must be able to name it.
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
