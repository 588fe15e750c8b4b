//! TLS and SMTP AUTH peers for the tests: a certificate authority of a test's own, and a
//! private Postfix (`util::postfix`) as a smarthost that offers STARTTLS with its
//! certificates and takes SMTP AUTH for a user and password the test chooses.
//!
//! [`TestCa`] makes its keys and certificates with the `openssl` command in a private
//! temporary directory: a self-signed CA (P-256, `basicConstraints` critical `CA:TRUE`,
//! `keyUsage` critical `keyCertSign, cRLSign`, a subject key identifier), server
//! certificates it signs for a DNS name or an IP address (`subjectAltName`, `keyUsage`
//! `digitalSignature`, `extendedKeyUsage` `serverAuth`, an authority key identifier),
//! valid for 30 days from now: the profile a strict verifier such as webpki asks for
//! (tests/suite/tls_smarthost.rs checks it with `openssl verify -x509_strict` and
//! Python's `VERIFY_X509_STRICT`); and [`TestCa::long_chain`], a server certificate at the
//! end of a chain of many intermediate CAs, for hostile-peer tests. Keys are PEM
//! PKCS#8, mode 0600, owned by root when the tests run as root: Postfix's `smtpd`
//! reads its key and certificate before it leaves root (in its pre-jail
//! initialization), so the `postfix` account never needs them.
//!
//! [`Smarthost::start`] runs a private Postfix that offers STARTTLS
//! (`smtpd_tls_security_level = may`) with a given certificate, or no TLS at all,
//! optionally a second `smtpd` that speaks TLS from the first byte
//! (`smtpd_tls_wrappermode`, as on port 465), and optionally SMTP AUTH (PLAIN and
//! LOGIN), after STARTTLS only when it has a certificate. It delivers
//! `LOCAL@local.test` into maildirs as every private Postfix does; other domains pass
//! its relay check only after AUTH (and then meet the error transport: nothing leaves
//! the machine); with [`TlsOptions::auth_required`] even `local.test` does. Its
//! `master.cf` gains `tlsmgr`: without it `smtpd` finds "no entropy for TLS key
//! generation" and disables TLS. The `Received:` line of a delivered message names the
//! TLS protocol and, after AUTH, the user (`Authenticated sender:`); its log has a line
//! `… TLS connection established from …` per TLS session and `sasl_username=` per
//! authenticated message.
//!
//! SMTP AUTH is Cyrus SASL's, with a private `sasldb` (Berkeley DB) made by
//! `saslpasswd2`, not Dovecot's: it lives in the `smtpd` process itself, so there is no
//! second daemon to start, wait for and stop, and nothing outside the instance's own
//! directory. Two things make it work. Debian's `smtpd` reads its Cyrus configuration,
//! `smtpd.conf` (after `smtpd_sasl_path`), from `$config_directory/sasl/` and then
//! `/usr/lib/sasl/`, whatever `cyrus_sasl_config_path` says (Debian's patch of the
//! Cyrus glue; `strace` shows the lookup), so the file is written there, and the
//! parameter names the same directory for a Postfix without that patch. And `smtpd`
//! opens the `sasldb` per authentication as the `postfix` account (the configuration
//! is read as root, at its start), so the database is root's, group `postfix`, mode
//! 0640. User names without a realm get `smtpd_sasl_local_domain`, the instance's host
//! name: the log shows `sasl_username=USER@mx.pepsi.test`; a name `USER@DOMAIN` is
//! stored and logged as given.
//!
//! Needs what `util::postfix` needs, plus `openssl`, `saslpasswd2` (`sasl2-bin`) and the
//! PLAIN and LOGIN plug-ins (`libsasl2-modules`); [`available`] says whether a test can
//! run ([`ca_available`] for a CA alone: `openssl`). It asserts nothing about Pepsi
//! itself.

use std::cell::Cell;
use std::io::Write;
use std::net::IpAddr;
use std::ops::Deref;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::postfix::{self, HOSTNAME, Postfix};
use super::{TempDir, stderr, stdout};

/// The name the smarthost's certificates are for: the host name it greets with.
pub const NAME: &str = HOSTNAME;

/// The program that makes the test CA's keys and certificates.
pub const OPENSSL: &str = "openssl";

/// The program that writes a Cyrus `sasldb` (Debian's `sasl2-bin`).
pub const SASLPASSWD2: &str = "/usr/sbin/saslpasswd2";

/// The program that lists the Cyrus plug-ins installed (`sasl2-bin` too).
pub const SASLPLUGINVIEWER: &str = "/usr/sbin/saslpluginviewer";

/// How long the certificates are valid, from the moment they are made.
const DAYS: &str = "30";

/// The extensions of each kind of certificate, by section: `ca`, `intermediate` and
/// `server` (whose `subjectAltName` is added per certificate).
const OPENSSL_CNF: &str = "\
[req]
distinguished_name = dn
prompt = no

[dn]
CN = unused

[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash

[intermediate]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always

[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
";

/// Why no [`TestCa`] can be made here, if it cannot.
pub fn ca_unavailable() -> Option<String> {
    let missing = Command::new(OPENSSL)
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err();
    missing.then(|| format!("{OPENSSL} is missing (apt-get install openssl)"))
}

/// Why no TLS smarthost can run here, if it cannot.
pub fn unavailable() -> Option<String> {
    if let Some(why) = postfix::unavailable().or_else(ca_unavailable) {
        return Some(why);
    }
    if !Path::new(SASLPASSWD2).is_file() {
        return Some(format!(
            "{SASLPASSWD2} is missing (apt-get install sasl2-bin)"
        ));
    }
    // The plug-ins the smarthost's `mech_list` and `auxprop_plugin` name.
    let plugins = Command::new(SASLPLUGINVIEWER)
        .output()
        .map(|out| stdout(&out))
        .unwrap_or_default();
    let mechanisms = plugins
        .lines()
        .skip_while(|l| !l.starts_with("Installed and properly configured SASL (server"))
        .nth(1)
        .unwrap_or_default();
    let words: Vec<&str> = mechanisms.split_whitespace().collect();
    if !words.contains(&"PLAIN") || !words.contains(&"LOGIN") {
        return Some(
            "Cyrus SASL's PLAIN and LOGIN mechanisms are missing (apt-get install \
             libsasl2-modules)"
                .into(),
        );
    }
    if !plugins.lines().any(|l| l.trim() == "sasldb") {
        return Some(
            "Cyrus SASL's sasldb plug-in is missing (apt-get install libsasl2-modules-db)".into(),
        );
    }
    None
}

/// May a test that needs a TLS smarthost run? Without root, Postfix or the SASL tools
/// it prints a note naming `test` and answers false; with `CI` set it fails instead.
#[track_caller]
pub fn available(test: &str) -> bool {
    may_run(test, unavailable())
}

/// May a test that needs only a [`TestCa`] run? As [`available`], for `openssl`.
#[track_caller]
pub fn ca_available(test: &str) -> bool {
    may_run(test, ca_unavailable())
}

/// True without a reason `why` not; else a note naming `test` and false, or with `CI`
/// set a failure.
#[track_caller]
fn may_run(test: &str, why: Option<String>) -> bool {
    let Some(why) = why else {
        return true;
    };
    assert!(std::env::var_os("CI").is_none(), "{test} cannot run: {why}");
    eprintln!("skipping {test}: {why}");
    false
}

/// A certificate authority of a test's own; its files go when it is dropped.
pub struct TestCa {
    /// Its key, certificate and `openssl.cnf`, and everything it issues.
    dir: TempDir,
    /// The number of the next file it makes, so that no two share a name.
    next: Cell<u32>,
}

impl TestCa {
    /// A new CA, `CN = Pepsi test CA TAG`: a P-256 key and a self-signed certificate.
    #[track_caller]
    pub fn new(tag: &str) -> TestCa {
        let ca = TestCa {
            dir: TempDir::new(&format!("ca-{tag}")),
            next: Cell::new(0),
        };
        ca.dir.write("openssl.cnf", OPENSSL_CNF);
        let key = ca.key("ca");
        ca.issue(
            &IssueArgs {
                section: "ca",
                subject: &format!("Pepsi test CA {tag}"),
                key: &key,
                issuer: None,
                san: None,
            },
            &ca.cert_path(),
        );
        ca
    }

    /// Its certificate (PEM), the trust anchor of a client that trusts it.
    pub fn cert_path(&self) -> PathBuf {
        self.dir.path("ca.pem")
    }

    /// A server certificate for `name`, signed by the CA itself: its `subjectAltName`
    /// is `IP:name` when `name` is an IP address, else `DNS:name`. Returns the paths of
    /// the certificate (PEM, the certificate alone: the CA is the client's trust
    /// anchor, not part of the chain) and of its key (PEM PKCS#8).
    #[track_caller]
    pub fn server_cert(&self, name: &str) -> (PathBuf, PathBuf) {
        let n = self.number();
        let key = self.key(&format!("server-{n}"));
        let cert = self.dir.path(&format!("server-{n}.pem"));
        self.issue(
            &IssueArgs {
                section: "server",
                subject: &common_name(name),
                key: &key,
                issuer: Some((
                    self.cert_path().as_path(),
                    self.dir.path("ca.key").as_path(),
                )),
                san: Some(&subject_alt_name(name)),
            },
            &cert,
        );
        (cert, key)
    }

    /// A server certificate for `name` at the end of a chain of `n` intermediate CAs,
    /// the first signed by this CA, each signing the next, the last signing the
    /// server's. Returns the paths of the chain file (PEM: the server's certificate,
    /// then the intermediates from the last to the first, as a server sends them) and
    /// of the server's key.
    #[track_caller]
    pub fn long_chain(&self, name: &str, n: usize) -> (PathBuf, PathBuf) {
        let chain_n = self.number();
        let mut issuer = (self.cert_path(), self.dir.path("ca.key"));
        let mut intermediates = Vec::with_capacity(n);
        for i in 1..=n {
            let base = format!("chain-{chain_n}-{i}");
            let key = self.key(&base);
            let cert = self.dir.path(&format!("{base}.pem"));
            self.issue(
                &IssueArgs {
                    section: "intermediate",
                    subject: &format!("Pepsi test intermediate {chain_n}-{i}"),
                    key: &key,
                    issuer: Some((issuer.0.as_path(), issuer.1.as_path())),
                    san: None,
                },
                &cert,
            );
            intermediates.push(cert.clone());
            issuer = (cert, key);
        }
        let (leaf, key) = {
            let base = format!("chain-{chain_n}-server");
            let key = self.key(&base);
            let cert = self.dir.path(&format!("{base}.pem"));
            self.issue(
                &IssueArgs {
                    section: "server",
                    subject: &common_name(name),
                    key: &key,
                    issuer: Some((issuer.0.as_path(), issuer.1.as_path())),
                    san: Some(&subject_alt_name(name)),
                },
                &cert,
            );
            (cert, key)
        };
        let mut chain = std::fs::read(&leaf).unwrap();
        for cert in intermediates.iter().rev() {
            chain.extend(std::fs::read(cert).unwrap());
        }
        let path = self.dir.path(&format!("chain-{chain_n}.pem"));
        std::fs::write(&path, chain).unwrap();
        (path, key)
    }

    /// The next file number.
    fn number(&self) -> u32 {
        let n = self.next.get();
        self.next.set(n + 1);
        n
    }

    /// A new P-256 key `BASE.key` (PEM PKCS#8, what `genpkey` writes), mode 0600.
    #[track_caller]
    fn key(&self, base: &str) -> PathBuf {
        let path = self.dir.path(&format!("{base}.key"));
        let mut cmd = Command::new(OPENSSL);
        cmd.args(["genpkey", "-algorithm", "EC"])
            .args(["-pkeyopt", "ec_paramgen_curve:P-256"])
            .arg("-out")
            .arg(&path);
        openssl(cmd);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    }

    /// Writes the certificate `args` describe to `out`: self-signed without an issuer,
    /// else signed by the issuer's key (`req -x509 -CA`, OpenSSL 3).
    #[track_caller]
    fn issue(&self, args: &IssueArgs, out: &Path) {
        let mut cmd = Command::new(OPENSSL);
        cmd.args(["req", "-new", "-x509", "-config"])
            .arg(self.dir.path("openssl.cnf"))
            .args(["-extensions", args.section, "-key"])
            .arg(args.key)
            .args(["-subj", &format!("/CN={}", args.subject), "-days", DAYS])
            .arg("-out")
            .arg(out);
        if let Some((cert, key)) = args.issuer {
            cmd.arg("-CA").arg(cert).arg("-CAkey").arg(key);
        }
        if let Some(san) = args.san {
            cmd.args(["-addext", &format!("subjectAltName = {san}")]);
        }
        openssl(cmd);
    }
}

/// What [`TestCa::issue`] makes.
struct IssueArgs<'a> {
    /// The section of [`OPENSSL_CNF`] with its extensions.
    section: &'a str,
    /// Its `CN`.
    subject: &'a str,
    /// The key it certifies.
    key: &'a Path,
    /// The certificate and key that sign it; none: it signs itself.
    issuer: Option<(&'a Path, &'a Path)>,
    /// Its `subjectAltName` value (`DNS:…` or `IP:…`).
    san: Option<&'a str>,
}

/// The `subjectAltName` of a server certificate for `name`.
fn subject_alt_name(name: &str) -> String {
    if name.parse::<IpAddr>().is_ok() {
        format!("IP:{name}")
    } else {
        format!("DNS:{name}")
    }
}

/// The `CN` of a server certificate for `name`: the name itself when it fits (64
/// characters) and holds nothing `-subj` would read as syntax; verifiers go by the
/// `subjectAltName` alone.
fn common_name(name: &str) -> String {
    if name.len() <= 64 && !name.contains(['/', '=', '+', '\\']) {
        name.to_string()
    } else {
        "Pepsi test server".to_string()
    }
}

/// Runs an `openssl` command, which must succeed.
#[track_caller]
fn openssl(mut cmd: Command) {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {OPENSSL}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}): {}",
        out.status,
        stderr(&out)
    );
}

/// What a [`Smarthost`] offers.
#[derive(Clone, Debug, Default)]
pub struct TlsOptions<'a> {
    /// The certificate (or chain) file and key file of its STARTTLS, from a
    /// [`TestCa`]; none: it offers no STARTTLS (`smtpd_tls_security_level = none`).
    pub cert: Option<(PathBuf, PathBuf)>,
    /// The user name and password (no line feed in it) of its SMTP AUTH (PLAIN and
    /// LOGIN); none: it offers no AUTH. With a certificate AUTH is offered after
    /// STARTTLS only; without one it is offered in clear text, for a client that must
    /// refuse to send a password so.
    pub auth: Option<(&'a str, &'a str)>,
    /// Refuse every recipient, `local.test` too, before AUTH (`554 5.7.1`), as a
    /// submission server does; needs `auth`.
    pub auth_required: bool,
    /// A second `smtpd` on [`Smarthost::wrapper_port`] that speaks TLS from the first
    /// byte (`smtpd_tls_wrappermode = yes`); needs `cert`.
    pub wrapper_port: bool,
}

/// A running private Postfix with TLS and SMTP AUTH as its [`TlsOptions`] say; stopped
/// when dropped. Everything of [`Postfix`] (its port, log and mailboxes) through
/// `Deref`.
pub struct Smarthost {
    postfix: Postfix,
    /// The port of its implicit-TLS `smtpd`, when it has one.
    pub wrapper_port: Option<u16>,
    /// The name its log gives the authenticated user (`sasl_username=`).
    pub sasl_username: Option<String>,
}

impl Smarthost {
    /// Starts a private Postfix (`util::postfix`) with the maildir mailboxes
    /// `LOCAL@local.test` of `mailboxes`, offering what `options` say. Its certificate
    /// and key are copied into its own directory (mode 0600), so the [`TestCa`] may go
    /// first.
    #[track_caller]
    pub fn start(tag: &str, options: &TlsOptions, mailboxes: &[&str]) -> Smarthost {
        assert!(
            !options.auth_required || options.auth.is_some(),
            "a smarthost that requires AUTH needs a user"
        );
        assert!(
            !options.wrapper_port || options.cert.is_some(),
            "a smarthost's implicit-TLS port needs a certificate"
        );
        let main = main_cf(options);
        let wrapper_port = options.wrapper_port.then(super::ingress::free_port);
        let mut master = String::new();
        if options.cert.is_some() {
            // smtpd's TLS takes its key material's entropy from tlsmgr (and disables
            // TLS without it), which the private instance's own master.cf lacks.
            master.push_str("tlsmgr unix - - n 1000? 1 tlsmgr\n");
        }
        if let Some(port) = wrapper_port {
            master.push_str(&format!(
                "127.0.0.1:{port} inet n - n - - smtpd -o smtpd_tls_wrappermode=yes\n"
            ));
        }
        let sasl_username = options.auth.map(|(user, _)| sasl_user(user).0);
        let postfix = Postfix::start_prepared(tag, &main, &master, mailboxes, |conf| {
            if let Some((cert, key)) = &options.cert {
                let tls = conf.join("tls");
                std::fs::create_dir(&tls).unwrap();
                for (from, to) in [(cert, "cert.pem"), (key, "key.pem")] {
                    std::fs::copy(from, tls.join(to))
                        .unwrap_or_else(|e| panic!("{}: {e}", from.display()));
                    std::fs::set_permissions(tls.join(to), std::fs::Permissions::from_mode(0o600))
                        .unwrap();
                }
            }
            if let Some((user, password)) = options.auth {
                write_sasl(&conf.join("sasl"), user, password);
            }
        });
        Smarthost {
            postfix,
            wrapper_port,
            sasl_username,
        }
    }
}

impl Deref for Smarthost {
    type Target = Postfix;

    fn deref(&self) -> &Postfix {
        &self.postfix
    }
}

/// The `main.cf` lines of a smarthost with `options`, after the private Postfix's own.
/// Files are named under `$config_directory`, which Postfix expands.
fn main_cf(options: &TlsOptions) -> String {
    let mut main = String::from("# The TLS and SMTP AUTH of tests/util/tls_peer.rs.\n");
    if options.cert.is_some() {
        main.push_str(
            "\
smtpd_tls_security_level = may
smtpd_tls_cert_file = $config_directory/tls/cert.pem
smtpd_tls_key_file = $config_directory/tls/key.pem
smtpd_tls_loglevel = 1
smtpd_tls_received_header = yes
",
        );
    } else {
        main.push_str("smtpd_tls_security_level = none\n");
    }
    if options.auth.is_some() {
        // Debian's smtpd reads $config_directory/sasl/smtpd.conf whatever
        // cyrus_sasl_config_path says; the parameter names the same directory for a
        // Postfix that reads it.
        main.push_str(&format!(
            "\
smtpd_sasl_auth_enable = yes
smtpd_sasl_type = cyrus
smtpd_sasl_path = smtpd
cyrus_sasl_config_path = $config_directory/sasl
smtpd_sasl_local_domain = {HOSTNAME}
smtpd_sasl_security_options = noanonymous
smtpd_sasl_authenticated_header = yes
smtpd_tls_auth_only = {}
",
            if options.cert.is_some() { "yes" } else { "no" }
        ));
    }
    // The base instance's mynetworks holds loopback, where every test client is:
    // without these lines anyone there could relay.
    main.push_str(match (options.auth.is_some(), options.auth_required) {
        (_, true) => "smtpd_relay_restrictions = permit_sasl_authenticated, reject\n",
        (true, false) => {
            "smtpd_relay_restrictions = permit_sasl_authenticated, reject_unauth_destination\n"
        }
        (false, false) => "smtpd_relay_restrictions = reject_unauth_destination\n",
    });
    main
}

/// The user name and realm `user` is stored under in the `sasldb`: `USER@DOMAIN` as
/// given, split at its last `@`; a name without one in the instance's
/// `smtpd_sasl_local_domain`. The first is the full name the log shows.
fn sasl_user(user: &str) -> (String, String, String) {
    match user.rsplit_once('@') {
        Some((local, realm)) => (user.to_string(), local.to_string(), realm.to_string()),
        None => (
            format!("{user}@{HOSTNAME}"),
            user.to_string(),
            HOSTNAME.to_string(),
        ),
    }
}

/// Writes the Cyrus configuration `smtpd.conf` and the `sasldb` with `user` and
/// `password` into `dir`.
#[track_caller]
fn write_sasl(dir: &Path, user: &str, password: &str) {
    assert!(
        !password.contains('\n'),
        "saslpasswd2 -p reads a password up to its line feed"
    );
    std::fs::create_dir(dir).unwrap();
    let db = dir.join("sasldb2");
    std::fs::write(
        dir.join("smtpd.conf"),
        format!(
            "pwcheck_method: auxprop\nauxprop_plugin: sasldb\nsasldb_path: {}\n\
             mech_list: PLAIN LOGIN\n",
            db.display()
        ),
    )
    .unwrap();
    let (_, local, realm) = sasl_user(user);
    // -p: the password is read from standard input, up to its line feed or end.
    let mut child = Command::new(SASLPASSWD2)
        .arg("-f")
        .arg(&db)
        .args(["-c", "-p", "-u", &realm, &local])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {SASLPASSWD2}: {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(password.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{SASLPASSWD2} failed ({}): {}",
        out.status,
        stderr(&out)
    );
    // smtpd opens the database as the postfix account, per authentication.
    let status = Command::new("chgrp")
        .arg("postfix")
        .arg(&db)
        .status()
        .expect("run chgrp");
    assert!(status.success(), "chgrp postfix {}", db.display());
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o640)).unwrap();
}
