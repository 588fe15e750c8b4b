//! Keys and folders for the tests of this folder: a temporary folder removed when
//! dropped, key files written mode 0600, keys generated once per test process with
//! `openssl` (Debian package `openssl`), RFC 8463's Ed25519 key, and a key table
//! loaded from lines.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use super::keys::{KeyTable, KeyTableError};

/// A folder under the system's temporary folder, removed with everything in it when
/// dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    /// A new, empty folder.
    pub fn new() -> TempDir {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!(
            "pepsi-dkim-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&path).expect("create a temporary folder");
        TempDir(path)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes a file into it with this mode; its path.
    pub fn write(&self, name: &str, bytes: &[u8], mode: u32) -> PathBuf {
        let path = self.0.join(name);
        fs::write(&path, bytes).expect("write a test file");
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).expect("chmod a test file");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The kinds of key the tests use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// RSA 2048 in PKCS#8 (`BEGIN PRIVATE KEY`, what OpenSSL 3 writes by default).
    Rsa2048,
    /// The same key in PKCS#1 (`BEGIN RSA PRIVATE KEY`).
    Rsa2048Pkcs1,
    /// RSA 4096 in PKCS#8.
    Rsa4096,
    /// RSA 1024 in PKCS#8, which no key table accepts.
    Rsa1024,
    /// RSA 2560 in PKCS#1, whose primes `ring` refuses.
    Rsa2560,
    /// Ed25519 in PKCS#8, as `openssl genpkey -algorithm ed25519` writes it.
    Ed25519,
}

/// Runs `openssl` with these arguments in `dir`; its standard output.
#[track_caller]
pub fn openssl(dir: &Path, args: &[&str]) -> Vec<u8> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl ({e}): install the Debian package openssl"));
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The PEM text of a key of this kind, generated once per test process.
pub fn pem(kind: Kind) -> &'static [u8] {
    static KEYS: [OnceLock<Vec<u8>>; 6] = [const { OnceLock::new() }; 6];
    let slot = match kind {
        Kind::Rsa2048 => 0,
        Kind::Rsa2048Pkcs1 => 1,
        Kind::Rsa4096 => 2,
        Kind::Rsa1024 => 3,
        Kind::Rsa2560 => 4,
        Kind::Ed25519 => 5,
    };
    KEYS[slot].get_or_init(|| {
        let dir = TempDir::new();
        let d = dir.path();
        match kind {
            Kind::Rsa2048 => openssl(d, &["genrsa", "2048"]),
            Kind::Rsa2048Pkcs1 => {
                fs::write(d.join("k.pem"), pem(Kind::Rsa2048)).expect("write a key");
                openssl(d, &["rsa", "-in", "k.pem", "-traditional"])
            }
            Kind::Rsa4096 => openssl(d, &["genrsa", "4096"]),
            Kind::Rsa1024 => openssl(d, &["genrsa", "1024"]),
            Kind::Rsa2560 => openssl(d, &["genrsa", "-traditional", "2560"]),
            Kind::Ed25519 => openssl(d, &["genpkey", "-algorithm", "ed25519"]),
        }
    })
}

/// The public key of a PEM private key as `openssl pkey -pubout -outform DER` gives
/// it (the SubjectPublicKeyInfo).
pub fn openssl_spki(pem: &[u8]) -> Vec<u8> {
    let dir = TempDir::new();
    dir.write("k.pem", pem, 0o600);
    openssl(
        dir.path(),
        &["pkey", "-in", "k.pem", "-pubout", "-outform", "DER"],
    )
}

/// RFC 8463's Ed25519 key (RFC 8032 §7.1 test 1) as a PKCS#8 PEM file holds it.
pub fn rfc8463_ed25519() -> Vec<u8> {
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend_from_slice(
        &STANDARD
            .decode("nWGxne/9WmC6hEr0kuwsxERJxWl7MmkZcDusAxyuf2A=")
            .expect("the RFC's seed"),
    );
    format!(
        "-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n",
        STANDARD.encode(der)
    )
    .into_bytes()
}

/// A folder with key files (`(file name, PEM)`, mode 0600) and a table `keys` of
/// these lines; the table as loaded.
pub fn table(
    keys: &[(&str, &[u8])],
    lines: &str,
) -> (TempDir, Result<KeyTable, Vec<KeyTableError>>) {
    let dir = TempDir::new();
    for (name, pem) in keys {
        dir.write(name, pem, 0o600);
    }
    let path = dir.write("keys", lines.as_bytes(), 0o644);
    let table = KeyTable::load(&path);
    (dir, table)
}

/// A loaded table of these keys and lines, which must load.
#[track_caller]
pub fn loaded(keys: &[(&str, &[u8])], lines: &str) -> (TempDir, KeyTable) {
    let (dir, table) = table(keys, lines);
    match table {
        Ok(t) => (dir, t),
        Err(errors) => panic!("the table does not load: {errors:?}"),
    }
}
