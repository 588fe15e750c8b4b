//! The `KEY_TABLE` of `dkim-sign` (§18): lines `DOMAIN SELECTOR ALGORITHM KEYFILE`,
//! each key file loaded once, at worker start, and kept as a `ring` key; which keys sign
//! a `From:` domain; the DNS record to publish for each key.
//!
//! Used by the stage (which loads the table when it is configured and hands
//! [`KeyTable::keys_for`]'s answer to `sign.rs`) and by the checks that report a bad
//! table. It reads the table and the key files it names (`keyfile.rs` reads one key
//! file), and nothing else; every problem is reported, each naming the table file and
//! its line, and none carries key material.

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use ring::digest;
use ring::rand::SystemRandom;
use ring::signature::RSA_PKCS1_SHA256;

pub use super::keyfile::Algorithm;
use super::keyfile::{self, SigningKey};

/// The largest key table read.
const MAX_TABLE: u64 = 1024 * 1024;

/// One key of the table, loaded.
pub struct KeyEntry {
    /// The table's line (from 1).
    pub line: usize,
    /// The signing domain (`d=`), lower case.
    pub domain: String,
    /// The selector (`s=`), lower case.
    pub selector: String,
    /// The algorithm (`a=`).
    pub algorithm: Algorithm,
    /// The key file (a relative name in the table taken from the table's folder).
    pub path: PathBuf,
    /// The loaded key.
    key: SigningKey,
}

impl fmt::Debug for KeyEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyEntry")
            .field("line", &self.line)
            .field("domain", &self.domain)
            .field("selector", &self.selector)
            .field("algorithm", &self.algorithm)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl KeyEntry {
    /// The DNS TXT record to publish for this key: its name
    /// `SELECTOR._domainkey.DOMAIN` and its text `v=DKIM1; k=rsa; p=…` (the base64
    /// DER SubjectPublicKeyInfo) or `v=DKIM1; k=ed25519; p=…` (the 32 raw bytes).
    pub fn dns_record(&self) -> (String, String) {
        (
            format!("{}._domainkey.{}", self.selector, self.domain),
            format!(
                "v=DKIM1; k={}; p={}",
                self.algorithm.key_type(),
                STANDARD.encode(self.key.public_key())
            ),
        )
    }

    /// The signature of a header hash input (RFC 6376 §3.7): RSA PKCS#1 v1.5 over its
    /// SHA-256 digest, or Ed25519 over that 32-byte digest (RFC 8463 §3). `None` only
    /// if `ring` fails, which it does not for a key it loaded.
    pub fn signature(&self, data: &[u8]) -> Option<Vec<u8>> {
        match &self.key {
            SigningKey::Rsa(k) => {
                let mut out = vec![0; k.public().modulus_len()];
                // `sign` hashes its input itself.
                k.sign(&RSA_PKCS1_SHA256, &SystemRandom::new(), data, &mut out)
                    .ok()?;
                Some(out)
            }
            SigningKey::Ed25519(k) => {
                let digest = digest::digest(&digest::SHA256, data);
                Some(k.sign(digest.as_ref()).as_ref().to_vec())
            }
        }
    }
}

/// A problem of the key table, named by the file and (most often) its line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyTableError {
    /// The table file.
    pub path: PathBuf,
    /// Its line (from 1), when the problem is one line's.
    pub line: Option<usize>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for KeyTableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(n) => write!(f, "{} line {n}: {}", self.path.display(), self.message),
            None => write!(f, "{}: {}", self.path.display(), self.message),
        }
    }
}

impl std::error::Error for KeyTableError {}

/// The loaded key table.
#[derive(Debug)]
pub struct KeyTable {
    /// The table file.
    path: PathBuf,
    /// Its keys, in table order.
    entries: Vec<KeyEntry>,
    /// Each domain's entries (indexes into `entries`, in table order).
    by_domain: HashMap<String, Vec<usize>>,
}

impl KeyTable {
    /// Reads the key table at `path` and every key file it names. Lines are
    /// `DOMAIN SELECTOR ALGORITHM KEYFILE`, separated by spaces or tabs; blank lines and
    /// lines starting with `#` are skipped; a relative `KEYFILE` is taken from the
    /// table's folder. Every problem is reported, each as `PATH line N: …`: the number
    /// of fields, the domain's or selector's syntax, an unknown algorithm, a second key
    /// of one algorithm for one domain, and each key file that is missing, unreadable,
    /// world-readable, not PEM, not a key, of another type than its algorithm, or an
    /// RSA key `ring` cannot sign with. A table that cannot be read, or that has no
    /// key at all, is a problem too.
    pub fn load(path: &Path) -> Result<KeyTable, Vec<KeyTableError>> {
        let error = |line: Option<usize>, message: String| KeyTableError {
            path: path.to_path_buf(),
            line,
            message,
        };
        let text = read_table(path).map_err(|e| vec![error(None, e)])?;
        let folder = path.parent().unwrap_or(Path::new("."));
        let mut errors = Vec::new();
        let mut entries: Vec<KeyEntry> = Vec::new();
        // The line of each domain's key of each algorithm, for the second one's error.
        let mut seen: HashMap<(String, Algorithm), usize> = HashMap::new();
        for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
            let n = i + 1;
            let Ok(line) = std::str::from_utf8(raw) else {
                errors.push(error(Some(n), "the line is not UTF-8".into()));
                continue;
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            match parse_line(line) {
                Err(problems) => {
                    errors.extend(problems.into_iter().map(|m| error(Some(n), m)));
                }
                Ok((domain, selector, algorithm, file)) => {
                    if let Some(first) = seen.get(&(domain.clone(), algorithm)) {
                        errors.push(error(
                            Some(n),
                            format!(
                                "a second {algorithm} key for {domain} (the first is on line {first})"
                            ),
                        ));
                        continue;
                    }
                    seen.insert((domain.clone(), algorithm), n);
                    let full = folder.join(file);
                    match keyfile::load(&full, algorithm) {
                        Ok(key) => entries.push(KeyEntry {
                            line: n,
                            domain,
                            selector,
                            algorithm,
                            path: full,
                            key,
                        }),
                        Err(e) => errors.push(error(Some(n), e)),
                    }
                }
            }
        }
        if errors.is_empty() && entries.is_empty() {
            errors.push(error(
                None,
                "no keys: the table has no DOMAIN SELECTOR ALGORITHM KEYFILE line".into(),
            ));
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let mut by_domain: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, e) in entries.iter().enumerate() {
            by_domain.entry(e.domain.clone()).or_default().push(i);
        }
        Ok(KeyTable {
            path: path.to_path_buf(),
            entries,
            by_domain,
        })
    }

    /// The table file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every key, in table order.
    pub fn entries(&self) -> &[KeyEntry] {
        &self.entries
    }

    /// The keys that sign mail from `domain` (compared in ASCII lower case, a final dot
    /// ignored), in table order: the domain's own keys; with `subdomains` and none of
    /// its own, those of its nearest parent domain in the table. Each entry's `domain`
    /// is the `d=` to sign with. Empty when no key signs for it.
    pub fn keys_for(&self, domain: &str, subdomains: bool) -> Vec<&KeyEntry> {
        let domain = domain
            .strip_suffix('.')
            .unwrap_or(domain)
            .to_ascii_lowercase();
        let found = |d: &str| {
            self.by_domain
                .get(d)
                .map(|ix| ix.iter().filter_map(|&i| self.entries.get(i)).collect())
        };
        if let Some(own) = found(&domain) {
            return own;
        }
        if subdomains {
            let mut rest = domain.as_str();
            while let Some(dot) = rest.find('.') {
                rest = &rest[dot + 1..];
                if let Some(parent) = found(rest) {
                    return parent;
                }
            }
        }
        Vec::new()
    }
}

/// The table file's bytes, refusing one larger than [`MAX_TABLE`].
fn read_table(path: &Path) -> Result<Vec<u8>, String> {
    let file = fs::File::open(path).map_err(|e| format!("cannot read the key table: {e}"))?;
    let mut bytes = Vec::new();
    file.take(MAX_TABLE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read the key table: {e}"))?;
    if bytes.len() as u64 > MAX_TABLE {
        return Err(format!(
            "the key table is larger than {} MiB",
            MAX_TABLE / 1024 / 1024
        ));
    }
    Ok(bytes)
}

/// The parts of one table line, or every problem of it.
fn parse_line(line: &str) -> Result<(String, String, Algorithm, &str), Vec<String>> {
    let words: Vec<&str> = line.split_ascii_whitespace().collect();
    let [domain, selector, algorithm, file] = words[..] else {
        return Err(vec![format!(
            "expected DOMAIN SELECTOR ALGORITHM KEYFILE, found {} field{}",
            words.len(),
            if words.len() == 1 { "" } else { "s" }
        )]);
    };
    let mut problems = Vec::new();
    if let Err(e) = check_dns_name(domain) {
        problems.push(format!("bad domain \"{}\": {e}", domain.escape_debug()));
    }
    if let Err(e) = check_dns_name(selector) {
        problems.push(format!("bad selector \"{}\": {e}", selector.escape_debug()));
    }
    let algorithm = algorithm.parse::<Algorithm>().map_err(|e| problems.push(e));
    let record = selector.len() + "._domainkey.".len() + domain.len();
    if problems.is_empty() && record > 253 {
        problems.push(format!(
            "SELECTOR._domainkey.DOMAIN is {record} characters long, longer than a DNS name may be (253)"
        ));
    }
    match algorithm {
        Ok(a) if problems.is_empty() => Ok((
            domain.to_ascii_lowercase(),
            selector.to_ascii_lowercase(),
            a,
            file,
        )),
        _ => Err(problems),
    }
}

/// Checks a domain or selector: dot-separated labels of letters, digits and hyphens,
/// each 1 to 63 long and not starting or ending with a hyphen; 253 characters at most.
pub fn check_dns_name(name: &str) -> Result<(), String> {
    if name.len() > 253 {
        return Err("longer than 253 characters".into());
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err("an empty label".into());
        }
        if label.len() > 63 {
            return Err("a label longer than 63 characters".into());
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(
                "only letters, digits, hyphens and dots are allowed (IDNs in their xn-- form)"
                    .into(),
            );
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("a label starting or ending with a hyphen".into());
        }
    }
    Ok(())
}
