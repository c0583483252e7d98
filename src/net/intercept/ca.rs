//! The sandbox's certificate authority: made at boot, its certificate installed in the guest's
//! trust store, its key never leaving the host (a snapshot keeps it, [`SavedCa`], in the
//! user's snapshot directory: a restored guest trusts this very certificate). It issues the
//! certificates the host presents to the guest when it terminates TLS for a granted name, one
//! per name, on demand.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;

use crate::error::{Error, Result};

/// Certificates kept per sandbox; past it the cache starts over (issuing one takes about a
/// millisecond).
const CACHE_MAX: usize = 256;

/// How long an issued certificate is valid, from an hour before its issue (clocks differ).
const LEAF_VALIDITY: Duration = Duration::from_secs(7 * 24 * 3600);

/// A sandbox's authority as a snapshot keeps it: the guest it is restored into trusts this
/// certificate, so its new network service must sign with this key.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SavedCa {
    /// The sandbox name in its certificate's common name.
    pub sandbox: String,
    /// Its key, PKCS#8 PEM.
    pub key_pem: String,
    /// Its certificate, PEM.
    pub certificate_pem: String,
}

impl std::fmt::Debug for SavedCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedCa")
            .field("sandbox", &self.sandbox)
            .finish_non_exhaustive()
    }
}

/// One sandbox's authority.
pub(crate) struct CertificateAuthority {
    issuer: Issuer<'static, KeyPair>,
    sandbox: String,
    certificate_pem: String,
    certificate_der: CertificateDer<'static>,
    issued: Mutex<HashMap<String, Arc<CertifiedKey>>>,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .finish_non_exhaustive()
    }
}

/// What the authority's certificate says of it: its name, a CA for leaves only, ten years
/// from yesterday.
fn authority_params(sandbox: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut name = DistinguishedName::new();
    name.push(DnType::OrganizationName, "krunbox");
    name.push(
        DnType::CommonName,
        format!("krunbox sandbox CA ({sandbox})"),
    );
    params.distinguished_name = name;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let now = time_now();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(3650);
    params
}

fn tls_error(what: &'static str) -> impl Fn(rcgen::Error) -> Error {
    move |err| Error::NetworkSetup(format!("{what}: {err}"))
}

impl CertificateAuthority {
    /// A new authority with a fresh key (ECDSA P-256), valid for ten years from yesterday.
    pub(crate) fn generate(sandbox: &str) -> Result<Self> {
        let key = KeyPair::generate().map_err(tls_error("generating the sandbox CA's key"))?;
        let params = authority_params(sandbox);
        let certificate = params
            .self_signed(&key)
            .map_err(tls_error("signing the sandbox CA"))?;
        Ok(Self {
            certificate_pem: certificate.pem(),
            certificate_der: certificate.der().clone(),
            sandbox: sandbox.to_owned(),
            issuer: Issuer::new(params, key),
            issued: Mutex::new(HashMap::new()),
        })
    }

    /// The authority as a snapshot keeps it.
    pub(crate) fn saved(&self) -> SavedCa {
        SavedCa {
            sandbox: self.sandbox.clone(),
            key_pem: self.issuer.key().serialize_pem(),
            certificate_pem: self.certificate_pem.clone(),
        }
    }

    /// The authority a snapshot kept: the same key and certificate (the issuer's name and
    /// constraints made as [`generate`](Self::generate) made them).
    pub(crate) fn from_saved(saved: &SavedCa) -> Result<Self> {
        use rustls::pki_types::pem::PemObject;
        let key =
            KeyPair::from_pem(&saved.key_pem).map_err(tls_error("reading the saved CA's key"))?;
        let certificate_der = CertificateDer::from_pem_slice(saved.certificate_pem.as_bytes())
            .map_err(|e| Error::NetworkSetup(format!("reading the saved CA's certificate: {e}")))?;
        Ok(Self {
            certificate_pem: saved.certificate_pem.clone(),
            certificate_der,
            sandbox: saved.sandbox.clone(),
            issuer: Issuer::new(authority_params(&saved.sandbox), key),
            issued: Mutex::new(HashMap::new()),
        })
    }

    /// The authority's certificate, PEM: what the guest trusts.
    pub(crate) fn certificate_pem(&self) -> &str {
        &self.certificate_pem
    }

    /// The authority's certificate, DER.
    #[cfg(test)]
    pub(crate) fn certificate_der(&self) -> &CertificateDer<'static> {
        &self.certificate_der
    }

    /// The certificate and key presented to the guest for `hostname` (issued on first use).
    pub(crate) fn certified_key(&self, hostname: &str) -> Result<Arc<CertifiedKey>> {
        let mut issued = self.issued.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(key) = issued.get(hostname) {
            return Ok(key.clone());
        }
        let key = Arc::new(self.issue(hostname)?);
        if issued.len() >= CACHE_MAX {
            issued.clear();
        }
        issued.insert(hostname.to_owned(), key.clone());
        Ok(key)
    }

    fn issue(&self, hostname: &str) -> Result<CertifiedKey> {
        let key = KeyPair::generate().map_err(tls_error("generating a certificate key"))?;
        let mut params = CertificateParams::new(vec![hostname.to_owned()])
            .map_err(tls_error("naming a certificate"))?;
        params
            .distinguished_name
            .push(DnType::CommonName, hostname.to_owned());
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = time_now();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::try_from(LEAF_VALIDITY).unwrap_or_default();
        let certificate = params
            .signed_by(&key, &self.issuer)
            .map_err(tls_error("issuing a certificate"))?;
        let private = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = rustls::crypto::ring::sign::any_supported_type(&private)
            .map_err(|e| Error::NetworkSetup(format!("loading an issued key: {e}")))?;
        Ok(CertifiedKey::new(
            vec![certificate.der().clone(), self.certificate_der.clone()],
            signing,
        ))
    }
}

fn time_now() -> time::OffsetDateTime {
    time::OffsetDateTime::now_utc()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{ServerName, UnixTime};

    fn verify(ca: &CertificateAuthority, key: &CertifiedKey, name: &str) -> bool {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.certificate_der().clone()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        verifier
            .verify_server_cert(
                &key.cert[0],
                &key.cert[1..],
                &ServerName::try_from(name.to_owned()).unwrap(),
                &[],
                UnixTime::now(),
            )
            .is_ok()
    }

    #[test]
    fn issued_certificates_verify_for_their_name_only_and_are_kept() {
        let ca = CertificateAuthority::generate("test").unwrap();
        assert!(ca
            .certificate_pem()
            .starts_with("-----BEGIN CERTIFICATE-----"));
        let key = ca.certified_key("origin.test").unwrap();
        assert!(verify(&ca, &key, "origin.test"));
        assert!(!verify(&ca, &key, "other.test"), "another name");
        // Another sandbox's CA does not vouch for it.
        let other = CertificateAuthority::generate("other").unwrap();
        assert!(!verify(&other, &key, "origin.test"));
        // Issued once per name.
        assert!(Arc::ptr_eq(&key, &ca.certified_key("origin.test").unwrap()));
        assert!(!Arc::ptr_eq(&key, &ca.certified_key("other.test").unwrap()));
    }

    #[test]
    fn a_saved_authority_issues_what_the_guest_trusting_the_original_accepts() {
        let ca = CertificateAuthority::generate("test").unwrap();
        let saved = ca.saved();
        assert!(
            !format!("{saved:?}").contains("PRIVATE KEY"),
            "the key in a log"
        );
        let json = serde_json::to_string(&saved).unwrap();
        let restored =
            CertificateAuthority::from_saved(&serde_json::from_str(&json).unwrap()).unwrap();
        assert_eq!(restored.certificate_pem(), ca.certificate_pem());
        let key = restored.certified_key("origin.test").unwrap();
        assert!(verify(&ca, &key, "origin.test"));
        // Another key under the same certificate is not the authority.
        let mut forged = saved.clone();
        forged.key_pem = KeyPair::generate().unwrap().serialize_pem();
        let impostor = CertificateAuthority::from_saved(&forged).unwrap();
        let key = impostor.certified_key("origin.test").unwrap();
        assert!(!verify(&ca, &key, "origin.test"));
    }
}
