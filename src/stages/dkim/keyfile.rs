//! One DKIM private key file: its checks (it exists, is a readable file, not readable
//! by others), its PEM armour (`ring` has no PEM reader: the armour is stripped and the
//! base64 decoded here), what it holds (PKCS#1 RSA, PKCS#8 RSA or PKCS#8 Ed25519), and
//! the `ring` key loaded from it, ready to sign.
//!
//! Used by `keys.rs`, which reads the table naming these files and puts each refusal
//! in the words of its line. Reads the one file it is given, at most [`MAX_KEY_FILE`]
//! bytes of it; never writes, never logs, and never puts key material in an error.

use std::fmt;
use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::str::FromStr;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use ring::signature::{Ed25519KeyPair, KeyPair, RsaKeyPair};

use super::der;

/// A DKIM signing algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// RSA PKCS#1 v1.5 over SHA-256 (RFC 6376).
    RsaSha256,
    /// Ed25519 over the SHA-256 digest (RFC 8463).
    Ed25519Sha256,
}

impl Algorithm {
    /// The key type as a key record's `k=` names it.
    pub fn key_type(self) -> &'static str {
        match self {
            Algorithm::RsaSha256 => "rsa",
            Algorithm::Ed25519Sha256 => "ed25519",
        }
    }

    /// The key type as a sentence names it.
    pub fn key_type_name(self) -> &'static str {
        match self {
            Algorithm::RsaSha256 => "RSA",
            Algorithm::Ed25519Sha256 => "Ed25519",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Algorithm::RsaSha256 => "rsa-sha256",
            Algorithm::Ed25519Sha256 => "ed25519-sha256",
        })
    }
}

impl FromStr for Algorithm {
    type Err = String;

    /// `rsa-sha256` or `ed25519-sha256`, in any case.
    fn from_str(s: &str) -> Result<Algorithm, String> {
        match s.to_ascii_lowercase().as_str() {
            "rsa-sha256" => Ok(Algorithm::RsaSha256),
            "ed25519-sha256" => Ok(Algorithm::Ed25519Sha256),
            _ => Err(format!(
                "unknown algorithm \"{}\" (rsa-sha256 or ed25519-sha256)",
                s.escape_debug()
            )),
        }
    }
}

/// The largest key file read (a 4096-bit RSA key in PEM is about 3.3 KiB).
pub const MAX_KEY_FILE: u64 = 64 * 1024;

/// The shortest RSA key `ring` signs with, in bits.
const RSA_MIN_BITS: usize = 2048;
/// The longest RSA key `ring` signs with, in bits.
const RSA_MAX_BITS: usize = 4096;

/// A loaded private key.
pub enum SigningKey {
    /// An RSA key (`rsa-sha256`).
    Rsa(RsaKeyPair),
    /// An Ed25519 key (`ed25519-sha256`).
    Ed25519(Ed25519KeyPair),
}

impl SigningKey {
    /// The signing algorithm of this key.
    pub fn algorithm(&self) -> Algorithm {
        match self {
            SigningKey::Rsa(_) => Algorithm::RsaSha256,
            SigningKey::Ed25519(_) => Algorithm::Ed25519Sha256,
        }
    }

    /// The public key as a DKIM key record's `p=` holds it before base64: the DER
    /// SubjectPublicKeyInfo of an RSA key, the 32 raw bytes of an Ed25519 key.
    pub fn public_key(&self) -> Vec<u8> {
        match self {
            SigningKey::Rsa(k) => der::rsa_spki(k.public().as_ref()),
            SigningKey::Ed25519(k) => k.public_key().as_ref().to_vec(),
        }
    }
}

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SigningKey({})", self.algorithm())
    }
}

/// What a key file holds once its armour is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `BEGIN RSA PRIVATE KEY`: a PKCS#1 RSAPrivateKey.
    Pkcs1Rsa,
    /// `BEGIN PRIVATE KEY` holding an rsaEncryption key.
    Pkcs8Rsa,
    /// `BEGIN PRIVATE KEY` holding an Ed25519 key.
    Pkcs8Ed25519,
}

impl Kind {
    /// The algorithm a key of this kind signs with.
    fn algorithm(self) -> Algorithm {
        match self {
            Kind::Pkcs1Rsa | Kind::Pkcs8Rsa => Algorithm::RsaSha256,
            Kind::Pkcs8Ed25519 => Algorithm::Ed25519Sha256,
        }
    }
}

/// Loads the key file at `path` for `algorithm`; the error says what is wrong with it
/// in a sentence that starts with the file's name (the caller adds the table's line).
pub fn load(path: &Path, algorithm: Algorithm) -> Result<SigningKey, String> {
    let shown = path.display();
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("key file {shown} does not exist"));
        }
        Err(e) => return Err(format!("key file {shown} is unreadable: {e}")),
    };
    if !meta.is_file() {
        return Err(format!(
            "key file {shown} is unreadable: not a regular file"
        ));
    }
    if meta.permissions().mode() & 0o004 != 0 {
        return Err(format!("key file {shown} is world-readable: chmod o-r"));
    }
    let text = read_limited(path).map_err(|e| format!("key file {shown} is unreadable: {e}"))?;
    let (kind, der) = unarmour(&text).map_err(|e| format!("key file {shown} {e}"))?;
    if kind.algorithm() != algorithm {
        return Err(format!(
            "key file {shown} holds an {} key, not one for {algorithm}",
            kind.algorithm().key_type_name()
        ));
    }
    parse(kind, &der).map_err(|e| format!("key file {shown}: {e}"))
}

/// The file's bytes, refusing one larger than [`MAX_KEY_FILE`].
fn read_limited(path: &Path) -> Result<Vec<u8>, String> {
    let file = fs::File::open(path).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    file.take(MAX_KEY_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_KEY_FILE {
        return Err(format!(
            "larger than {} KiB, which no key file is",
            MAX_KEY_FILE / 1024
        ));
    }
    Ok(bytes)
}

/// The kind and DER bytes of the first PEM block of a key file; the error completes
/// "key file PATH …".
fn unarmour(text: &[u8]) -> Result<(Kind, Vec<u8>), String> {
    let mut lines = text
        .split(|&b| b == b'\n')
        .map(|l| l.trim_ascii())
        .skip_while(|l| !l.starts_with(b"-----BEGIN "));
    let begin = lines
        .next()
        .ok_or("is not PEM: it has no -----BEGIN line")?;
    let label = begin
        .strip_prefix(b"-----BEGIN ")
        .and_then(|l| l.strip_suffix(b"-----"))
        .ok_or("is not PEM: its -----BEGIN line is malformed")?;
    let kind = match label {
        b"RSA PRIVATE KEY" => Kind::Pkcs1Rsa,
        b"PRIVATE KEY" => Kind::Pkcs8Rsa,
        b"ENCRYPTED PRIVATE KEY" => {
            return Err("holds an encrypted key: store it decrypted (openssl pkey)".into());
        }
        other => {
            return Err(format!(
                "holds a \"{}\" block, not an RSA or Ed25519 private key",
                String::from_utf8_lossy(other)
            ));
        }
    };
    let mut end_line = b"-----END ".to_vec();
    end_line.extend_from_slice(label);
    end_line.extend_from_slice(b"-----");
    let mut encoded = Vec::with_capacity(text.len());
    let mut ended = false;
    for line in lines {
        if line == &end_line[..] {
            ended = true;
            break;
        }
        // RFC 1421 headers (Proc-Type, DEK-Info) mark an encrypted PKCS#1 key.
        if line.contains(&b':') {
            return Err("holds an encrypted key: store it decrypted (openssl pkey)".into());
        }
        encoded.extend(line.iter().filter(|b| !b.is_ascii_whitespace()));
    }
    if !ended {
        return Err(format!(
            "is not PEM: it has no {} line",
            String::from_utf8_lossy(&end_line)
        ));
    }
    let der = STANDARD
        .decode(&encoded)
        .map_err(|_| "is not PEM: its base64 is invalid".to_string())?;
    if kind == Kind::Pkcs1Rsa {
        return Ok((kind, der));
    }
    let kind = match der::pkcs8_parts(&der) {
        Some((der::RSA_ENCRYPTION, _)) => Kind::Pkcs8Rsa,
        Some((der::ED25519, _)) => Kind::Pkcs8Ed25519,
        Some(_) => return Err("holds a key of another algorithm than RSA or Ed25519".into()),
        None => return Err("holds an invalid key: not a PKCS#8 structure".into()),
    };
    Ok((kind, der))
}

/// The `ring` key of these DER bytes.
fn parse(kind: Kind, der: &[u8]) -> Result<SigningKey, String> {
    match kind {
        Kind::Pkcs8Ed25519 => Ed25519KeyPair::from_pkcs8_maybe_unchecked(der)
            .map(SigningKey::Ed25519)
            .map_err(|e| format!("invalid Ed25519 key ({e})")),
        Kind::Pkcs1Rsa | Kind::Pkcs8Rsa => {
            let pkcs1 = if kind == Kind::Pkcs8Rsa {
                der::pkcs8_parts(der).map(|(_, key)| key)
            } else {
                Some(der)
            };
            let bits = pkcs1
                .and_then(der::rsa_modulus_bits)
                .ok_or("invalid RSA key: not an RSAPrivateKey structure")?;
            if !(RSA_MIN_BITS..=RSA_MAX_BITS).contains(&bits) {
                return Err(format!(
                    "RSA keys must be {RSA_MIN_BITS} to {RSA_MAX_BITS} bits to sign with; this one is {bits}"
                ));
            }
            let key = if kind == Kind::Pkcs8Rsa {
                RsaKeyPair::from_pkcs8(der)
            } else {
                RsaKeyPair::from_der(der)
            };
            key.map(SigningKey::Rsa)
                .map_err(|e| match e.to_string().as_str() {
                    // The primes of a key must be whole multiples of 512 bits.
                    "PrivateModulusLenNotMultipleOf512Bits" => format!(
                        "RSA keys must be 2048, 3072 or 4096 bits to sign with; this one is {bits}"
                    ),
                    other => format!("invalid RSA key ({other})"),
                })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DER bytes in PEM armour with this label.
    fn armour(label: &str, der: &[u8]) -> Vec<u8> {
        let b64 = STANDARD.encode(der);
        let mut out = format!("-----BEGIN {label}-----\n");
        for chunk in b64.as_bytes().chunks(64) {
            out.push_str(std::str::from_utf8(chunk).unwrap());
            out.push('\n');
        }
        out.push_str(&format!("-----END {label}-----\n"));
        out.into_bytes()
    }

    #[test]
    fn pem_armour_is_stripped_with_text_before_it_and_crlf_line_ends() {
        let der = [0x30, 0x03, 0x02, 0x01, 0x00];
        let mut text = b"a comment line\r\n".to_vec();
        text.extend(armour("RSA PRIVATE KEY", &der).iter().flat_map(|&b| {
            if b == b'\n' {
                vec![b'\r', b'\n']
            } else {
                vec![b]
            }
        }));
        assert_eq!(unarmour(&text), Ok((Kind::Pkcs1Rsa, der.to_vec())));
    }

    #[test]
    fn what_is_not_a_usable_pem_key_is_named() {
        let cases: &[(&[u8], &str)] = &[
            (b"just text", "is not PEM: it has no -----BEGIN line"),
            (b"-----BEGIN PRIVATE KEY\nAAAA\n", "malformed"),
            (
                b"-----BEGIN PRIVATE KEY-----\nAAAA\n",
                "no -----END PRIVATE KEY----- line",
            ),
            (
                b"-----BEGIN PRIVATE KEY-----\n!!!!\n-----END PRIVATE KEY-----\n",
                "base64",
            ),
            (
                b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
                "PKCS#8",
            ),
            (
                b"-----BEGIN ENCRYPTED PRIVATE KEY-----\nAAAA\n",
                "encrypted",
            ),
            (
                b"-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\n\nAAAA\n",
                "encrypted",
            ),
            (
                b"-----BEGIN EC PRIVATE KEY-----\nAAAA\n",
                "holds a \"EC PRIVATE KEY\" block",
            ),
            (
                b"-----BEGIN PUBLIC KEY-----\nAAAA\n",
                "not an RSA or Ed25519 private key",
            ),
        ];
        for (text, want) in cases {
            let e = unarmour(text).unwrap_err();
            assert!(e.contains(want), "{e:?} lacks {want:?}");
        }
        // An X25519 PKCS#8 key (OID 1.3.101.110): another algorithm.
        let mut x25519 = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x6e, 0x04, 0x22,
            0x04, 0x20,
        ];
        x25519.extend_from_slice(&[1; 32]);
        let e = unarmour(&armour("PRIVATE KEY", &x25519)).unwrap_err();
        assert!(e.contains("another algorithm"), "{e}");
    }

    #[test]
    fn an_ed25519_seed_in_pkcs8_loads_and_gives_its_public_key() {
        // RFC 8032 §7.1 test 1 (the key of RFC 8463's example).
        let seed = STANDARD
            .decode("nWGxne/9WmC6hEr0kuwsxERJxWl7MmkZcDusAxyuf2A=")
            .unwrap();
        let mut der = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        der.extend_from_slice(&seed);
        let (kind, der) = unarmour(&armour("PRIVATE KEY", &der)).unwrap();
        assert_eq!(kind, Kind::Pkcs8Ed25519);
        let key = parse(kind, &der).unwrap();
        assert_eq!(key.algorithm(), Algorithm::Ed25519Sha256);
        assert_eq!(
            STANDARD.encode(key.public_key()),
            "11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo="
        );
        let e = parse(Kind::Pkcs8Ed25519, &der[..20]).unwrap_err();
        assert!(e.starts_with("invalid Ed25519 key"), "{e}");
    }
}
