//! Tests of `keys.rs` and `keyfile.rs` with real key files: every refusal named by the
//! table's line, the key formats accepted, which keys sign a domain, and the DNS record
//! of a key compared with what `openssl` makes of the same key.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use super::keys::{Algorithm, KeyTable};
use super::test_keys::{self, Kind, TempDir, loaded, openssl_spki, table};

#[test]
fn every_problem_of_a_table_is_reported_each_named_by_its_line() {
    let dir = TempDir::new();
    let rsa = test_keys::pem(Kind::Rsa2048);
    dir.write("rsa.pem", rsa, 0o600);
    dir.write("ed.pem", test_keys::pem(Kind::Ed25519), 0o400);
    dir.write("short.pem", test_keys::pem(Kind::Rsa1024), 0o600);
    dir.write("odd.pem", test_keys::pem(Kind::Rsa2560), 0o600);
    dir.write("world.pem", rsa, 0o644);
    dir.write("notpem.pem", b"this is no key\n", 0o600);
    dir.write(
        "invalid.pem",
        b"-----BEGIN RSA PRIVATE KEY-----\naGVsbG8=\n-----END RSA PRIVATE KEY-----\n",
        0o600,
    );
    std::fs::create_dir(dir.path().join("adir")).unwrap();
    let lines = "# DOMAIN SELECTOR ALGORITHM KEYFILE\n\
        \n\
        example.com sel rsa-sha256\n\
        exa_mple.com sel rsa-sha256 rsa.pem\n\
        example.com se.l- rsa-sha256 rsa.pem\n\
        example.com sel rsa-sha1 rsa.pem\n\
        missing.example sel rsa-sha256 nonexistent.pem\n\
        dir.example sel rsa-sha256 adir\n\
        notpem.example sel rsa-sha256 notpem.pem\n\
        invalid.example sel rsa-sha256 invalid.pem\n\
        world.example sel rsa-sha256 world.pem\n\
        ok.example a rsa-sha256 rsa.pem\n\
        OK.example b RSA-SHA256 rsa.pem\n\
        short.example s rsa-sha256 short.pem\n\
        mismatch.example s rsa-sha256 ed.pem\n\
        mismatch.example s ed25519-sha256 rsa.pem\n\
        odd.example s rsa-sha256 odd.pem\n\
        bad..example -s- ed25519-sha256 ed.pem extra\n";
    let path = dir.write("keys", lines.as_bytes(), 0o644);
    let errors = KeyTable::load(&path).unwrap_err();
    let p = path.display().to_string();
    let d = dir.path().display().to_string();
    let want = [
        format!("{p} line 3: expected DOMAIN SELECTOR ALGORITHM KEYFILE, found 3 fields"),
        format!(
            "{p} line 4: bad domain \"exa_mple.com\": only letters, digits, hyphens and dots are allowed (IDNs in their xn-- form)"
        ),
        format!("{p} line 5: bad selector \"se.l-\": a label starting or ending with a hyphen"),
        format!("{p} line 6: unknown algorithm \"rsa-sha1\" (rsa-sha256 or ed25519-sha256)"),
        format!("{p} line 7: key file {d}/nonexistent.pem does not exist"),
        format!("{p} line 8: key file {d}/adir is unreadable: not a regular file"),
        format!("{p} line 9: key file {d}/notpem.pem is not PEM: it has no -----BEGIN line"),
        format!(
            "{p} line 10: key file {d}/invalid.pem: invalid RSA key: not an RSAPrivateKey structure"
        ),
        format!("{p} line 11: key file {d}/world.pem is world-readable: chmod o-r"),
        format!("{p} line 13: a second rsa-sha256 key for ok.example (the first is on line 12)"),
        format!(
            "{p} line 14: key file {d}/short.pem: RSA keys must be 2048 to 4096 bits to sign with; this one is 1024"
        ),
        format!("{p} line 15: key file {d}/ed.pem holds an Ed25519 key, not one for rsa-sha256"),
        format!("{p} line 16: key file {d}/rsa.pem holds an RSA key, not one for ed25519-sha256"),
        format!(
            "{p} line 17: key file {d}/odd.pem: RSA keys must be 2048, 3072 or 4096 bits to sign with; this one is 2560"
        ),
        format!("{p} line 18: expected DOMAIN SELECTOR ALGORITHM KEYFILE, found 5 fields"),
    ];
    let got: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(got, want);
    assert!(errors.iter().all(|e| e.path == path));
    assert_eq!(errors[0].line, Some(3));
}

#[test]
fn bad_domain_and_selector_on_one_line_are_both_reported() {
    let (_dir, t) = table(&[], "bad..example -s- ed25519-sha256 ed.pem\n");
    let got: Vec<String> = t.unwrap_err().iter().map(|e| e.message.clone()).collect();
    assert_eq!(
        got,
        [
            "bad domain \"bad..example\": an empty label",
            "bad selector \"-s-\": a label starting or ending with a hyphen"
        ]
    );
    let long = format!("{}.example s ed25519-sha256 k.pem\n", "a".repeat(64));
    let (_dir, t) = table(&[], &long);
    assert!(t.unwrap_err()[0].message.contains("a label longer than 63"));
}

#[test]
fn an_unreadable_or_empty_or_non_utf8_table_is_refused() {
    let dir = TempDir::new();
    let missing = dir.path().join("nonesuch");
    let e = KeyTable::load(&missing).unwrap_err();
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].line, None);
    assert!(
        e[0].to_string().starts_with(&format!(
            "{}: cannot read the key table:",
            missing.display()
        )),
        "{}",
        e[0]
    );
    let (_dir, t) = table(&[], "# only a comment\n\n   \n");
    assert_eq!(
        t.unwrap_err()[0].message,
        "no keys: the table has no DOMAIN SELECTOR ALGORITHM KEYFILE line"
    );
    let dir = TempDir::new();
    let path = dir.write(
        "keys",
        b"# ok\nexample.com s\xff ed25519-sha256 k.pem\n",
        0o644,
    );
    let e = KeyTable::load(&path).unwrap_err();
    assert_eq!(
        e[0].to_string(),
        format!("{} line 2: the line is not UTF-8", path.display())
    );
}

#[test]
fn rsa_in_pkcs1_and_pkcs8_and_ed25519_in_pkcs8_load_from_relative_and_absolute_paths() {
    let elsewhere = TempDir::new();
    let absolute = elsewhere.write("ed.pem", test_keys::pem(Kind::Ed25519), 0o600);
    let lines = format!(
        "a.example\tp8 rsa-sha256 rsa8.pem\r\n\
         b.example p1  rsa-sha256 rsa1.pem\n\
           # an indented comment\n\
         c.example ed Ed25519-SHA256 {}\n\
         d.example big rsa-sha256 big.pem",
        absolute.display()
    );
    let (dir, t) = loaded(
        &[
            ("rsa8.pem", test_keys::pem(Kind::Rsa2048)),
            ("rsa1.pem", test_keys::pem(Kind::Rsa2048Pkcs1)),
            ("big.pem", test_keys::pem(Kind::Rsa4096)),
        ],
        &lines,
    );
    assert!(test_keys::pem(Kind::Rsa2048Pkcs1).starts_with(b"-----BEGIN RSA PRIVATE KEY-----"));
    assert!(test_keys::pem(Kind::Rsa2048).starts_with(b"-----BEGIN PRIVATE KEY-----"));
    let got: Vec<(usize, &str, &str, Algorithm)> = t
        .entries()
        .iter()
        .map(|e| (e.line, e.domain.as_str(), e.selector.as_str(), e.algorithm))
        .collect();
    assert_eq!(
        got,
        [
            (1, "a.example", "p8", Algorithm::RsaSha256),
            (2, "b.example", "p1", Algorithm::RsaSha256),
            (4, "c.example", "ed", Algorithm::Ed25519Sha256),
            (5, "d.example", "big", Algorithm::RsaSha256),
        ]
    );
    assert_eq!(t.entries()[0].path, dir.path().join("rsa8.pem"));
    assert_eq!(t.entries()[2].path, absolute);
    assert_eq!(t.path(), dir.path().join("keys"));
    // The PKCS#1 file is the PKCS#8 file's key: one public key.
    assert_eq!(t.entries()[0].dns_record().1, t.entries()[1].dns_record().1);
}

#[test]
fn a_domain_is_signed_by_its_own_keys_or_with_subdomains_by_its_nearest_parents() {
    let ed = test_keys::rfc8463_ed25519();
    let rsa = test_keys::pem(Kind::Rsa2048);
    let (_dir, t) = loaded(
        &[("ed.pem", &ed), ("rsa.pem", rsa)],
        "example.com e1 ed25519-sha256 ed.pem\n\
         example.com r1 rsa-sha256 rsa.pem\n\
         mail.example.com e2 ed25519-sha256 ed.pem\n",
    );
    let selectors = |domain: &str, sub: bool| -> Vec<String> {
        t.keys_for(domain, sub)
            .iter()
            .map(|e| format!("{}/{}", e.domain, e.selector))
            .collect()
    };
    assert_eq!(
        selectors("example.com", false),
        ["example.com/e1", "example.com/r1"]
    );
    assert_eq!(
        selectors("EXAMPLE.Com.", false),
        ["example.com/e1", "example.com/r1"]
    );
    assert_eq!(selectors("mail.example.com", true), ["mail.example.com/e2"]);
    assert!(selectors("a.b.example.com", false).is_empty());
    assert_eq!(
        selectors("a.b.example.com", true),
        ["example.com/e1", "example.com/r1"]
    );
    assert_eq!(
        selectors("x.mail.example.com", true),
        ["mail.example.com/e2"]
    );
    assert!(selectors("example.org", true).is_empty());
    assert!(selectors("otherexample.com", true).is_empty());
    assert!(selectors("", true).is_empty());
}

#[test]
fn the_dns_record_of_a_key_holds_the_public_key_openssl_derives() {
    for kind in [
        Kind::Rsa2048,
        Kind::Rsa2048Pkcs1,
        Kind::Rsa4096,
        Kind::Ed25519,
    ] {
        let pem = test_keys::pem(kind);
        let algorithm = if kind == Kind::Ed25519 {
            "ed25519-sha256"
        } else {
            "rsa-sha256"
        };
        let (_dir, t) = loaded(
            &[("k.pem", pem)],
            &format!("Example.ORG Sel {algorithm} k.pem\n"),
        );
        let (name, text) = t.entries()[0].dns_record();
        assert_eq!(name, "sel._domainkey.example.org");
        let spki = openssl_spki(pem);
        let want = if kind == Kind::Ed25519 {
            // The raw key: the last 32 bytes of the SubjectPublicKeyInfo.
            format!(
                "v=DKIM1; k=ed25519; p={}",
                STANDARD.encode(&spki[spki.len() - 32..])
            )
        } else {
            format!("v=DKIM1; k=rsa; p={}", STANDARD.encode(&spki))
        };
        assert_eq!(text, want, "{kind:?}");
    }
}

#[test]
fn a_key_entry_shows_no_key_material_when_debugged() {
    let (_dir, t) = loaded(
        &[("k.pem", &test_keys::rfc8463_ed25519())],
        "example.com s ed25519-sha256 k.pem\n",
    );
    let shown = format!("{t:?}");
    assert!(
        shown.contains("example.com") && shown.contains("Ed25519Sha256"),
        "{shown}"
    );
    assert!(
        !shown.contains("11qYAYKx") && !shown.contains("nWGxne"),
        "{shown}"
    );
}
