//! DKIM for the tests: keys made by `openssl`, a `KEY_TABLE` naming them, the records
//! `pepsi-stage-dkim-sign dns` prints for it, and the verdict of an independent
//! verifier, dkimpy (Debian's `python3-dkim`, run by `dkim_verify.py` beside this file),
//! on a message as it was delivered.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{Map, Value};

use super::{TempDir, run, stage, stderr, stdout};

/// The interpreter that has dkimpy (another `python3` may come first on PATH).
const PYTHON: &str = "/usr/bin/python3";

/// The checker script.
const VERIFY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/util/dkim_verify.py");

/// A private key of `kind` made by openssl in `dir` as `name`, mode 0600: `rsa2048`
/// (PKCS#8), `rsa2048-pkcs1` (the traditional `BEGIN RSA PRIVATE KEY`), `rsa1024`,
/// `rsa4096` or `ed25519` (PKCS#8).
pub fn make_key(dir: &TempDir, name: &str, kind: &str) -> PathBuf {
    let path = dir.path(name);
    let p = path.to_str().unwrap();
    let args: Vec<&str> = match kind {
        "rsa2048" => vec![
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            p,
        ],
        "rsa4096" => vec![
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:4096",
            "-out",
            p,
        ],
        "rsa1024" => vec![
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:1024",
            "-out",
            p,
        ],
        "rsa2048-pkcs1" => vec!["genrsa", "-traditional", "-out", p, "2048"],
        "ed25519" => vec!["genpkey", "-algorithm", "ed25519", "-out", p],
        other => panic!("no key kind {other}"),
    };
    let out = Command::new("openssl")
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run openssl: {e}"));
    assert!(out.status.success(), "openssl {args:?}: {}", stderr(&out));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// A `KEY_TABLE` in `dir`: one `DOMAIN SELECTOR ALGORITHM KEYFILE` line per entry.
pub fn key_table(dir: &TempDir, lines: &[(&str, &str, &str, &Path)]) -> PathBuf {
    let mut text = String::from("# domain selector algorithm key\n");
    for (domain, selector, algorithm, key) in lines {
        text.push_str(&format!(
            "{domain} {selector} {algorithm} {}\n",
            key.display()
        ));
    }
    dir.write("keys", &text)
}

/// The records `pepsi-stage-dkim-sign -c conf dns` prints, by name: what the
/// verifier's DNS answers. Fails the test if the command fails.
#[track_caller]
pub fn published(conf: &Path) -> Value {
    let out = run(&stage("dkim-sign"), &["-c", conf.to_str().unwrap(), "dns"]);
    assert!(out.status.success(), "dns: {}", stderr(&out));
    records(&stdout(&out))
}

/// Zone file lines `NAME. IN TXT ( "…" "…" )` read back: the name and the strings
/// joined.
pub fn records(zone: &str) -> Value {
    let mut map = Map::new();
    for line in zone.lines().filter(|l| !l.trim().is_empty()) {
        let name = line
            .split_whitespace()
            .next()
            .unwrap()
            .trim_end_matches('.');
        let text: String = line.split('"').skip(1).step_by(2).collect();
        map.insert(name.to_string(), Value::String(text));
    }
    Value::Object(map)
}

/// dkimpy's verdict on each signature of `message`, top down (`true`, or why not),
/// with `records` as the only DNS.
#[track_caller]
pub fn verify(message: &[u8], records: &Value) -> Vec<Value> {
    let mut child = Command::new(PYTHON)
        .arg(VERIFY)
        .arg(records.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {PYTHON}: {e}"));
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(message).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "dkim_verify.py failed (install python3-dkim and python3-nacl): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed: Value = serde_json::from_slice(&out.stdout).unwrap();
    parsed.as_array().unwrap().clone()
}

/// Whether dkimpy finds `n` signatures on `message`, all valid.
#[track_caller]
pub fn all_verify(message: &[u8], records: &Value, n: usize) -> bool {
    let verdicts = verify(message, records);
    verdicts.len() == n && verdicts.iter().all(|v| v == &Value::Bool(true))
}
