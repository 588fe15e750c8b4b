//! [`super::scheme`] against the real postsrsd (Debian's 1.10 at `/usr/sbin/postsrsd`;
//! `apt-get install postsrsd`): each test starts private instances on free loopback
//! ports and speaks Postfix's tcp_table protocol to them (`get ADDRESS` → `200 VALUE`
//! or `500 REASON`, both URL-encoded). postsrsd sees addresses as Postfix hands them
//! over, in their unquoted form, so a quoted local part goes to it without its quotes.
//! An instance is killed when its guard drops, also when a test fails.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use super::scheme::{Srs, SrsError};
use crate::mailbox;

/// Where Debian installs postsrsd.
const POSTSRSD: &str = "/usr/sbin/postsrsd";

/// The domain both sides rewrite into.
const DOMAIN: &str = "fwd.example";

/// The long secret of postsrsd's own `tests.c` (longer than SHA-1's block, so HMAC
/// hashes it first).
const LONG_SECRET: &str = "string that has 119 bytes, which is excessively long from an \
                           operational point of view but should still work regardless";

/// One postsrsd instance of a test, killed and its directory removed on drop.
struct Postsrsd {
    child: Child,
    dir: PathBuf,
    forward_port: u16,
    reverse_port: u16,
}

/// A free loopback port: bound to port 0, then let go.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("a bound address").port()
}

impl Postsrsd {
    /// Starts postsrsd with these secrets (the first signs) for `domain`, and waits
    /// until both its tables answer. Fails, naming the package, without the binary.
    fn start(secrets: &[&str], domain: &str) -> Postsrsd {
        assert!(
            Path::new(POSTSRSD).exists(),
            "{POSTSRSD} is missing: install postsrsd (apt-get install postsrsd)"
        );
        static COUNT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "pepsi-srs-postsrsd-{}-{}",
            std::process::id(),
            COUNT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let secret_file = dir.join("secrets");
        std::fs::write(&secret_file, format!("{}\n", secrets.join("\n"))).unwrap();
        std::fs::set_permissions(&secret_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut last_failure = String::new();
        // A port let go may be taken by someone else before postsrsd binds it: try
        // again with other ports.
        for _ in 0..3 {
            let (forward_port, reverse_port) = (free_port(), free_port());
            let mut command = Command::new(POSTSRSD);
            command
                .arg("-s")
                .arg(&secret_file)
                .args(["-d", domain, "-l", "127.0.0.1", "-4", "-t", "30"])
                .args(["-f", &forward_port.to_string()])
                .args(["-r", &reverse_port.to_string()])
                .arg("-p")
                .arg(dir.join("pid"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            // As root it drops to an unprivileged account once its ports are bound.
            if unsafe { libc::geteuid() } == 0 {
                command.args(["-u", "nobody"]);
            }
            let child = command.spawn().expect("start postsrsd");
            let mut instance = Postsrsd {
                child,
                dir: dir.clone(),
                forward_port,
                reverse_port,
            };
            match instance.wait_ready() {
                Ok(()) => return instance,
                Err(why) => last_failure = why,
            }
        }
        panic!("postsrsd did not start: {last_failure}");
    }

    /// Waits until both ports accept a connection; the reason when postsrsd exits or
    /// ten seconds pass.
    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                let mut stderr = String::new();
                if let Some(mut pipe) = self.child.stderr.take() {
                    let _ = pipe.read_to_string(&mut stderr);
                }
                return Err(format!("exited with {status}: {stderr}"));
            }
            let up = |port| TcpStream::connect(("127.0.0.1", port)).is_ok();
            if up(self.forward_port) && up(self.reverse_port) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err("no answer within 10 s".into())
    }

    /// Its forward table's answer: `Ok(value)` for 200, `Err(reason)` for 500.
    fn forward(&self, address: &str) -> Result<String, String> {
        query(self.forward_port, address)
    }

    /// Its reverse table's answer: `Ok(value)` for 200, `Err(reason)` for 500.
    fn reverse(&self, address: &str) -> Result<String, String> {
        query(self.reverse_port, address)
    }

    /// What its forward table makes of a sender as Pepsi's API says it: `None` where the
    /// sender stays (a 500, or the sender itself given back).
    fn forwarded(&self, address: &str) -> Option<String> {
        self.forward(address).ok().filter(|out| out != address)
    }
}

impl Drop for Postsrsd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Asks one table about one address on a connection of its own.
fn query(port: u16, address: &str) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to postsrsd");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(format!("get {}\n", url_encode(address)).as_bytes())
        .unwrap();
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).unwrap();
    let line = line.trim_end_matches('\n');
    let value = || String::from_utf8(url_decode(line.get(4..).unwrap_or(""))).unwrap();
    match line.get(..4) {
        Some("200 ") => Ok(value()),
        Some("500 ") => Err(value()),
        _ => panic!("postsrsd answered {line:?} to {address:?}"),
    }
}

/// Encodes as postsrsd decodes: `%XX` for `%` and every byte that is not printable
/// ASCII other than space.
fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_graphic() && b != b'%' {
                char::from(b).to_string()
            } else {
                format!("%{b:02x}")
            }
        })
        .collect()
}

/// Decodes postsrsd's `%XX`.
fn url_decode(s: &str) -> Vec<u8> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        if let (b'%', Some(hex)) = (bytes[i], hex) {
            out.push(u8::from_str_radix(hex, 16).expect("two hex digits after %"));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    out
}

/// An address as Postfix hands it to postsrsd: a quoted local part without its quotes
/// and with its quoted pairs resolved.
fn unquoted(address: &str) -> String {
    let Some(inner) = address.strip_prefix('"') else {
        return address.to_string();
    };
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.extend(chars.next()),
            '"' => break,
            c => out.push(c),
        }
    }
    out.push_str(chars.as_str());
    out
}

/// An address postsrsd wrote, in its RFC 5321 form: its local part quoted when it
/// is not a dot-string.
fn quoted(address: &str) -> String {
    if mailbox::check(address).is_ok() {
        return address.to_string();
    }
    let (local, domain) = address.rsplit_once('@').unwrap();
    let escaped: String = local
        .chars()
        .flat_map(|c| {
            (c == '"' || c == '\\')
                .then_some('\\')
                .into_iter()
                .chain([c])
        })
        .collect();
    format!("\"{escaped}\"@{domain}")
}

/// The scheme with these secrets for [`DOMAIN`] and the default age.
fn pepsi(secrets: &[&str]) -> Srs {
    Srs::new(
        secrets.iter().map(|s| s.as_bytes().to_vec()).collect(),
        DOMAIN,
        21,
    )
    .unwrap()
}

/// Pepsi's forward of `sender` and postsrsd's of its unquoted form, checked to be the
/// same address (Pepsi asked before and after, in case the day turns meanwhile).
/// Returns Pepsi's.
#[track_caller]
fn forward_alike(srs: &Srs, postsrsd: &Postsrsd, sender: &str) -> Option<String> {
    let before = srs.forward(sender, SystemTime::now()).unwrap();
    let theirs = postsrsd.forwarded(&unquoted(sender));
    let after = srs.forward(sender, SystemTime::now()).unwrap();
    let ours = |o: &Option<String>| o.as_deref().map(unquoted);
    assert!(
        theirs == ours(&before) || theirs == ours(&after),
        "{sender:?}: postsrsd {theirs:?}, Pepsi {before:?}"
    );
    after
}

/// The reason postsrsd gives (srs2.c's `srs_strerror`) for the error Pepsi gives.
fn postsrsd_reason(e: &SrsError) -> &'static str {
    match e {
        SrsError::BadHash => "Hash invalid in SRS address.",
        SrsError::Expired => "Time stamp out of date.",
        SrsError::Malformed(why) => match why.as_str() {
            "no hash in SRS0 address" => "No hash in SRS0 address.",
            "no timestamp in SRS0 address" => "No timestamp in SRS0 address.",
            "no host in SRS0 address" => "No host in SRS0 address.",
            "no user in SRS0 address" => "No user in SRS0 address.",
            "no hash in SRS1 address" => "No hash in SRS1 address.",
            "no host in SRS1 address" => "No host in SRS1 address.",
            "no user in SRS1 address" => "No user in SRS1 address.",
            "bad base32 character in timestamp" => "Bad base32 character in timestamp.",
            "hash too short" => "Hash too short in SRS address.",
            "the timestamp is not two characters" => "Time stamp out of date.",
            other => panic!("no postsrsd reason for {other:?}"),
        },
        SrsError::Unusable(why) => panic!("no postsrsd reason for {why:?}"),
    }
}

#[test]
fn pepsi_and_postsrsd_forward_alike_and_each_reverses_what_the_other_wrote() {
    let postsrsd = Postsrsd::start(&["tops3cr3t"], DOMAIN);
    let srs = pepsi(&["tops3cr3t"]);
    for sender in [
        "alice@remote.example",
        "Bob.Smith+Tag@Sub.Remote.EXAMPLE",
        "x=y-z@a-b.example",
        "=@remote.example",
        "jörg@bücher.example",
        "用户@例子.广告",
        "u@[192.0.2.1]",
        "u@[IPv6:2001:db8::1]",
        "\"john smith\"@remote.example",
        "\"a \\\"quoted\\\" one\"@remote.example",
    ] {
        let ours = forward_alike(&srs, &postsrsd, sender).expect(sender);
        assert_eq!(mailbox::check(&ours), Ok(()), "{ours}");
        assert_eq!(
            postsrsd.reverse(&unquoted(&ours)),
            Ok(unquoted(sender)),
            "postsrsd reversing {ours}"
        );
        let theirs = postsrsd.forward(&unquoted(sender)).unwrap();
        assert_eq!(
            srs.reverse(&quoted(&theirs), SystemTime::now()),
            Ok(Some(sender.to_string())),
            "Pepsi reversing {theirs}"
        );
    }
}

#[test]
fn both_leave_the_same_senders_alone() {
    let postsrsd = Postsrsd::start(&["tops3cr3t"], DOMAIN);
    let srs = pepsi(&["tops3cr3t"]);
    let own = srs
        .forward("carol@remote.example", SystemTime::now())
        .unwrap()
        .unwrap();
    // Ours and valid, moved to another domain: "Already rewritten".
    let moved = own.replace(DOMAIN, "elsewhere.example");
    for sender in [
        "test@fwd.example",
        "test@FWD.Example",
        "no-at-sign",
        own.as_str(),
        moved.as_str(),
        "SRS1@other.example",
        "SRS1=@other.example",
        "SRS1=hash@other.example",
        "SRS1=hash=host@other.example",
    ] {
        assert_eq!(forward_alike(&srs, &postsrsd, sender), None, "{sender}");
    }
}

#[test]
fn an_srs0_forwarded_again_gives_the_same_srs1_in_both() {
    let postsrsd = Postsrsd::start(&["tops3cr3t"], DOMAIN);
    let srs = pepsi(&["tops3cr3t"]);
    // A first forwarder (Pepsi, another secret and domain) signs; the second hop is
    // done by both.
    let first = Srs::new(vec![b"first".to_vec()], "first.example", 21).unwrap();
    let srs0 = first
        .forward("alice@orig.example", SystemTime::now())
        .unwrap()
        .unwrap();
    for sender in [
        srs0.as_str(),
        "SRS0=opaque+string@other.example",
        "srs0+Opaque@Other.Example",
        "SRS0-x@other.example",
        "SRS0@other.example",
        "SRS1=X=thirddomain.com==opaque+string@other.example",
        "SRS1=x==@other.example",
        "sRs1-abcd=orig.example=-user@other.example",
    ] {
        let srs1 = forward_alike(&srs, &postsrsd, sender).expect(sender);
        assert!(srs1.starts_with("SRS1="), "{srs1}");
        let back = postsrsd.reverse(&srs1).unwrap();
        assert!(back.starts_with("SRS0"), "{back}");
        assert_eq!(
            srs.reverse(&srs1, SystemTime::now())
                .map(|o| o.map(|a| unquoted(&a))),
            match mailbox::check(&back) {
                Ok(()) => Ok(Some(back.clone())),
                Err(why) => Err(SrsError::Unusable(format!(
                    "the original address is not a valid mailbox: {why}"
                ))),
            },
            "{srs1}"
        );
    }
    // The whole way back: the second hop returns the first's SRS0, the first the
    // original.
    let srs1 = srs.forward(&srs0, SystemTime::now()).unwrap().unwrap();
    let hop = postsrsd.reverse(&srs1).unwrap();
    assert_eq!(hop, srs0);
    assert_eq!(
        first.reverse(&hop, SystemTime::now()),
        Ok(Some("alice@orig.example".into()))
    );
}

#[test]
fn a_wrong_hash_and_an_expired_timestamp_are_refused_by_both() {
    let postsrsd = Postsrsd::start(&["tops3cr3t"], DOMAIN);
    let srs = pepsi(&["tops3cr3t"]);
    let now = SystemTime::now();
    let day = Duration::from_secs(86_400);
    for signed_at in [
        now - 22 * day,
        now - 300 * day,
        now + 2 * day,
        now + 300 * day,
    ] {
        let old = srs
            .forward("alice@remote.example", signed_at)
            .unwrap()
            .unwrap();
        assert_eq!(
            postsrsd.reverse(&old),
            Err("Time stamp out of date.".into()),
            "{old}"
        );
        assert_eq!(srs.reverse(&old, now), Err(SrsError::Expired), "{old}");
    }
    let theirs = postsrsd.forward("alice@remote.example").unwrap();
    assert_eq!(srs.reverse(&theirs, now + 40 * day), Err(SrsError::Expired));
    // Every hash character changed to one that differs also in case.
    let wrong: String = theirs
        .char_indices()
        .map(|(i, c)| match i {
            5..=8 if c == '0' => '1',
            5..=8 if c.is_ascii_digit() || !c.is_ascii_alphanumeric() => '0',
            5..=8 if c.eq_ignore_ascii_case(&'a') => 'b',
            5..=8 => 'a',
            _ => c,
        })
        .collect();
    assert_ne!(wrong.to_ascii_lowercase(), theirs.to_ascii_lowercase());
    assert_eq!(
        postsrsd.reverse(&wrong),
        Err("Hash invalid in SRS address.".into())
    );
    assert_eq!(srs.reverse(&wrong, now), Err(SrsError::BadHash));
    let stranger = pepsi(&["another secret"]);
    let by_stranger = stranger
        .forward("alice@remote.example", now)
        .unwrap()
        .unwrap();
    assert_eq!(
        postsrsd.reverse(&by_stranger),
        Err("Hash invalid in SRS address.".into())
    );
    let srs1_by_stranger = stranger
        .forward("SRS0=x@other.example", now)
        .unwrap()
        .unwrap();
    assert_eq!(
        postsrsd.reverse(&srs1_by_stranger),
        Err("Hash invalid in SRS address.".into())
    );
    assert_eq!(srs.reverse(&srs1_by_stranger, now), Err(SrsError::BadHash));
}

#[test]
fn malformed_srs_addresses_are_refused_for_the_same_reason_by_both() {
    let postsrsd = Postsrsd::start(&["tops3cr3t"], DOMAIN);
    let srs = pepsi(&["tops3cr3t"]);
    let theirs = postsrsd.forward("test@remote.example").unwrap();
    let stamp = theirs.split('=').nth(2).unwrap().to_string();
    for recipient in [
        "SRS0=@fwd.example".to_string(),
        "SRS0=x@fwd.example".into(),
        "SRS0==@fwd.example".into(),
        "SRS0===@fwd.example".into(),
        "SRS0=====@fwd.example".into(),
        format!("SRS0=abc={stamp}=h=u@fwd.example"),
        format!("SRS0=={stamp}==@fwd.example"),
        "SRS0=abcd=Z1=h=u@fwd.example".into(),
        "SRS0=abcd=2W1=h=u@fwd.example".into(),
        "SRS0=abcd==h=u@fwd.example".into(),
        "SRS0+abcd=A=h=u@fwd.example".into(),
        format!("SRS0-abcd={stamp}=h=u@fwd.example"),
        theirs.clone(),
        "SRS1=@fwd.example".into(),
        "SRS1=x@fwd.example".into(),
        "SRS1=x=h@fwd.example".into(),
        "SRS1=x==@fwd.example".into(),
        "SRS1=abcd=h==u@fwd.example".into(),
        "srs1+abcdef=h==u@fwd.example".into(),
    ] {
        let ours = srs.reverse(&recipient, SystemTime::now());
        let theirs = postsrsd.reverse(&recipient);
        match ours {
            Err(e) => assert_eq!(theirs, Err(postsrsd_reason(&e).into()), "{recipient}"),
            Ok(back) => assert_eq!(theirs.ok(), back, "{recipient}"),
        }
    }
}

#[test]
fn rotation_each_side_verifies_with_the_old_secret_what_the_other_signed_with_it() {
    let new = "n3w-s3cr3t";
    let postsrsd_old = Postsrsd::start(&[LONG_SECRET], DOMAIN);
    let postsrsd_both = Postsrsd::start(&[new, LONG_SECRET], DOMAIN);
    let pepsi_old = pepsi(&[LONG_SECRET]);
    let pepsi_both = pepsi(&[new, LONG_SECRET]);
    let now = SystemTime::now();
    for sender in ["alice@remote.example", "SRS0=opaque@other.example"] {
        let by_pepsi_old = pepsi_old.forward(sender, now).unwrap().unwrap();
        assert_eq!(postsrsd_both.reverse(&by_pepsi_old), Ok(sender.into()));
        let by_postsrsd_old = postsrsd_old.forward(sender).unwrap();
        assert_eq!(
            pepsi_both.reverse(&by_postsrsd_old, now),
            Ok(Some(sender.into()))
        );
        // The new secret signs on both sides; a side with the old one alone refuses it.
        let by_new = forward_alike(&pepsi_both, &postsrsd_both, sender).unwrap();
        assert_eq!(
            postsrsd_old.reverse(&by_new),
            Err("Hash invalid in SRS address.".into())
        );
        assert_eq!(pepsi_old.reverse(&by_new, now), Err(SrsError::BadHash));
    }
    // The long secret (hashed by HMAC first) signs alike too.
    forward_alike(&pepsi_old, &postsrsd_old, "bob@remote.example").unwrap();
}
