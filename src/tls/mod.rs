//! Transport security (§21), one crypto stack for TLS and DKIM: rustls with the `ring`
//! provider. What the relay (a client) and the ingress (a server) share: the levels a
//! client may ask for ([`Level`]), the trust store (the system's bundle or a `CA_FILE`,
//! [`roots`]), the client and server configurations, certificates and keys read from
//! PEM files ([`server_config`]), and what a session negotiated, as logs show it
//! ([`Negotiated`]).
//!
//! Blocking: a session is a [`rustls::StreamOwned`] over the caller's socket, whose
//! reads and writes the caller bounds; the handshake ([`handshake`]) is driven over it
//! and ends, like every other wait, at the caller's deadline. Nothing here opens a
//! socket or decides anything about mail.

mod any_cert;

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig};

/// Where Debian's `ca-certificates` puts the system's trust store, one PEM bundle.
pub const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// The largest certificate or key file read, in bytes (the system bundle is about
/// 200 KB).
pub const MAX_PEM_FILE: u64 = 4 * 1024 * 1024;

/// The most certificates a server's chain file may hold: a leaf and a few
/// intermediates are what any server sends.
pub const MAX_CHAIN: usize = 16;

/// A client's TLS security level, Postfix's `smtp_tls_security_level`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Level {
    /// Clear text, STARTTLS never asked for.
    None,
    /// STARTTLS when offered, the certificate not checked; a handshake that fails is
    /// retried in clear text.
    May,
    /// TLS or nothing (the message waits); the certificate not checked.
    Encrypt,
    /// TLS with a certificate that chains to a trusted root and names the server.
    Verify,
}

impl Level {
    /// Reads a level's name.
    pub fn parse(text: &str) -> Result<Level, String> {
        match text {
            "none" => Ok(Level::None),
            "may" => Ok(Level::May),
            "encrypt" => Ok(Level::Encrypt),
            "verify" => Ok(Level::Verify),
            other => Err(format!(
                "{other:?} is not a TLS level (none, may, encrypt or verify)"
            )),
        }
    }

    /// Its name, as written in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            Level::None => "none",
            Level::May => "may",
            Level::Encrypt => "encrypt",
            Level::Verify => "verify",
        }
    }
}

/// The provider: rustls's `ring`, the crate DKIM and SRS sign with. rustls marks it
/// deprecated because `ring` has no post-quantum key exchange (ML-KEM); the provider
/// that has one, `aws-lc-rs`, is a second C crypto library of its own (and cmake at
/// build time), which one crypto stack for TLS and DKIM rules out. The key exchange is
/// X25519 or the NIST curves, as every MTA of today offers.
#[allow(deprecated)]
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a PEM file of at most [`MAX_PEM_FILE`] bytes; errors name it.
fn read_pem(path: &Path) -> Result<Vec<u8>, String> {
    let name = path.display();
    // Non-blocking, so that a FIFO planted at the path fails the check below instead
    // of holding the open (and the ingress's main thread with it).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("{name}: cannot open: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("{name}: cannot read: {e}"))?;
    if !meta.is_file() {
        return Err(format!("{name}: not a regular file"));
    }
    let mut bytes = Vec::new();
    file.take(MAX_PEM_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{name}: cannot read: {e}"))?;
    if bytes.len() as u64 > MAX_PEM_FILE {
        return Err(format!("{name}: larger than {MAX_PEM_FILE} bytes"));
    }
    Ok(bytes)
}

/// The certificates of a PEM file, in order; errors name the file.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = read_pem(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not PEM certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: holds no certificate", path.display()));
    }
    Ok(certs)
}

/// The trust store: the certificates of `ca_file`, or without one the system's
/// ([`SYSTEM_ROOTS`]). A file whose certificates are all unusable is an error; one
/// unusable certificate in the system's bundle is skipped, as every client skips it.
pub fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, String> {
    let path = ca_file.unwrap_or(Path::new(SYSTEM_ROOTS));
    let mut store = RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(certificates(path)?);
    if added == 0 {
        return Err(format!(
            "{}: none of its certificates is a usable trust anchor",
            path.display()
        ));
    }
    Ok(store)
}

/// A client's configuration for `level` (not [`Level::None`]): for
/// [`Level::Verify`] the chain checked against `roots` and the name against the
/// server's; below it, any certificate taken (the handshake's signatures are still
/// checked, so the session is encrypted to whoever holds the certificate's key).
pub fn client_config(
    level: Level,
    roots: Option<RootCertStore>,
) -> Result<Arc<ClientConfig>, String> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let config = match (level, roots) {
        (Level::Verify, Some(roots)) => builder.with_root_certificates(roots).with_no_client_auth(),
        (Level::Verify, None) => return Err("TLS = verify needs a trust store".into()),
        _ => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(any_cert::AnyCert::new(provider)))
            .with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// The name a client checks the server's certificate against (a DNS name or an IP
/// address).
pub fn server_name(name: &str) -> Result<ServerName<'static>, String> {
    ServerName::try_from(name.to_string())
        .map_err(|_| format!("{name:?} is not a host name or address a certificate can name"))
}

/// A server's configuration from a certificate chain file (the server's certificate
/// first) and its private key file (PKCS#8, PKCS#1 or SEC1 PEM); errors name the files,
/// and a key that does not belong to the certificate is one.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, String> {
    let chain = certificates(cert)?;
    if chain.len() > MAX_CHAIN {
        return Err(format!(
            "{}: holds {} certificates, more than the {MAX_CHAIN} a chain needs",
            cert.display(),
            chain.len()
        ));
    }
    let bytes = read_pem(key)?;
    let private = PrivateKeyDer::from_pem_slice(&bytes)
        .map_err(|e| format!("{}: not a PEM private key: {e}", key.display()))?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| {
            format!(
                "{} and {}: not a certificate and its key: {e}",
                cert.display(),
                key.display()
            )
        })?;
    Ok(Arc::new(config))
}

/// Starts a client session over `io` for the server `name`.
pub fn client(
    config: &Arc<ClientConfig>,
    name: ServerName<'static>,
) -> Result<ClientConnection, String> {
    ClientConnection::new(Arc::clone(config), name).map_err(|e| format!("TLS: {e}"))
}

/// Drives a handshake over `io` to its end; the error says why it failed (the peer's
/// alert, a certificate problem, a timeout of `io`).
pub fn handshake<C, S, T>(connection: &mut C, io: &mut T) -> Result<(), String>
where
    C: std::ops::DerefMut<Target = rustls::ConnectionCommon<S>>,
    S: rustls::SideData,
    T: Read + Write,
{
    while connection.is_handshaking() {
        connection
            .complete_io(io)
            .map_err(|e| format!("TLS handshake failed: {e}"))?;
    }
    Ok(())
}

/// What a session negotiated, for the logs (as Postfix logs "Verified TLS connection
/// established to …: TLSv1.3 with cipher …").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// `TLSv1.2` or `TLSv1.3`.
    pub version: String,
    /// The cipher suite's name.
    pub cipher: String,
    /// Whether the peer's certificate was verified (a client at [`Level::Verify`]).
    pub verified: bool,
}

impl Negotiated {
    /// What `connection` negotiated; `verified` as the caller's level says.
    pub fn of<S: rustls::SideData>(
        connection: &rustls::ConnectionCommon<S>,
        verified: bool,
    ) -> Negotiated {
        let version = match connection.protocol_version() {
            Some(rustls::ProtocolVersion::TLSv1_3) => "TLSv1.3".to_string(),
            Some(rustls::ProtocolVersion::TLSv1_2) => "TLSv1.2".to_string(),
            Some(other) => format!("{other:?}"),
            None => "none".to_string(),
        };
        let cipher = connection
            .negotiated_cipher_suite()
            .map(|s| format!("{:?}", s.suite()))
            .unwrap_or_default();
        Negotiated {
            version,
            cipher,
            verified,
        }
    }

    /// `Verified` or `Untrusted`, as Postfix says it.
    pub fn trust(&self) -> &'static str {
        if self.verified {
            "Verified"
        } else {
            "Untrusted"
        }
    }
}

impl std::fmt::Display for Negotiated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} with cipher {}", self.version, self.cipher)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_read_by_name_and_ordered_by_strength() {
        for level in [Level::None, Level::May, Level::Encrypt, Level::Verify] {
            assert_eq!(Level::parse(level.name()), Ok(level));
        }
        assert!(Level::parse("secure").unwrap_err().contains("none, may"));
        assert!(Level::May < Level::Encrypt && Level::Encrypt < Level::Verify);
    }

    #[test]
    fn the_system_trust_store_is_read_and_a_missing_file_is_named() {
        if Path::new(SYSTEM_ROOTS).exists() {
            assert!(!roots(None).unwrap().is_empty());
        }
        let e = roots(Some(Path::new("/nonexistent/ca.pem"))).unwrap_err();
        assert!(e.starts_with("/nonexistent/ca.pem: cannot open"), "{e}");
    }

    #[test]
    fn a_file_without_certificates_is_refused_naming_it() {
        let dir = std::env::temp_dir().join(format!("pepsi-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not pem at all\n").unwrap();
        let e = roots(Some(&empty)).unwrap_err();
        assert!(e.contains("holds no certificate"), "{e}");
        let e = server_config(&empty, &empty).unwrap_err();
        assert!(e.contains("empty.pem"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_fifo_planted_at_a_path_is_refused_at_once() {
        let dir = std::env::temp_dir().join(format!("pepsi-tls-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("ca.pem");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path and a mode.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = roots(Some(&fifo)).unwrap_err();
        assert!(e.ends_with("not a regular file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn names_and_addresses_are_server_names_and_garbage_is_not() {
        assert!(server_name("mx.example").is_ok());
        assert!(server_name("192.0.2.1").is_ok());
        assert!(server_name("a b").is_err());
    }
}
