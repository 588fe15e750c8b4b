//! A private Postfix for the tests, and the Postfix recipe read from the guide that
//! gives it, doc/postfix.md.
//!
//! [`Postfix::start`] runs an instance of its own, apart from any Postfix of the
//! machine: its own `config_directory` (a `main.cf` and a `master.cf` written here,
//! plus the lines a test adds), `queue_directory` and `data_directory` in a private
//! temporary directory, `inet_interfaces = 127.0.0.1`, an `smtpd` on a free loopback
//! port instead of 25, and the virtual mailbox domain `local.test` whose mailboxes are
//! maildirs in that directory, so that every delivered message is a file the test
//! reads. Its log goes to a file there (`maillog_file`, through `postlogd`) and is
//! printed when a test fails. Queue timers are short, so a deferred message is retried
//! within seconds. Nothing leaves the machine: every domain but `local.test` goes to
//! the `error` transport. `postfix -c DIR check`, then `start`; `stop` when the value is
//! dropped, also when a test fails.
//!
//! [`Recipe::from_guide`] takes the recipe's `main.cf` lines, its `master.cf` server
//! on 10026, its `[pepsi-ingress]` section, its `[stage-reinject]` section (the relay
//! stage) and its `[pepsi]` lines out of doc/postfix.md, word for word, so a test runs
//! exactly what a reader copies; [`Recipe::on_ports`] moves them to a test's ports.
//!
//! Postfix needs root (its master switches to `mail_owner`); [`available`] says
//! whether a test can run, and fails instead of skipping when `CI` is set. Used by the
//! Postfix loop suite; it asserts nothing about Pepsi itself.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::TempDir;

/// The `postfix` command of Debian's package.
pub const POSTFIX: &str = "/usr/sbin/postfix";

/// The virtual mailbox domain every private instance delivers locally.
pub const DOMAIN: &str = "local.test";

/// The name the instances greet with and write into their `Received:` lines.
pub const HOSTNAME: &str = "mx.pepsi.test";

/// The mailbox every instance has besides the test's own: where Postfix's notices
/// to the postmaster (a double bounce) would land.
pub const POSTMASTER: &str = "postmaster";

/// Why no private Postfix can run here, if it cannot.
pub fn unavailable() -> Option<String> {
    if !super::is_root() {
        return Some("it needs root (Postfix's master switches to its mail_owner)".into());
    }
    if !Path::new(POSTFIX).is_file() {
        return Some(format!(
            "{POSTFIX} is missing (apt-get install postfix, with postfix/main_mailer_type \
             preseeded to \"No configuration\")"
        ));
    }
    if !account_exists("postfix") {
        return Some("the account postfix is missing (reinstall the postfix package)".into());
    }
    None
}

/// May a test that needs a private Postfix run? Without root or Postfix it prints a
/// note naming `test` and answers false; with `CI` set it fails instead.
#[track_caller]
pub fn available(test: &str) -> bool {
    let Some(why) = unavailable() else {
        return true;
    };
    assert!(std::env::var_os("CI").is_none(), "{test} cannot run: {why}");
    eprintln!("skipping {test}: {why}");
    false
}

fn account_exists(name: &str) -> bool {
    let name = std::ffi::CString::new(name).unwrap();
    // SAFETY: getpwnam reads a NUL-terminated name; the result is only tested for null.
    !unsafe { libc::getpwnam(name.as_ptr()) }.is_null()
}

/// The account the virtual mailboxes belong to (`virtual_uid_maps`,
/// `virtual_gid_maps`): `nobody`, whose id is above `virtual_minimum_uid`.
fn mailbox_owner() -> (u32, u32) {
    let name = std::ffi::CString::new("nobody").unwrap();
    // SAFETY: getpwnam reads a NUL-terminated name; the entry is read at once, before
    // any other call could reuse its storage.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(!pw.is_null(), "the account nobody is missing");
    // SAFETY: pw is a valid entry (checked above).
    unsafe { ((*pw).pw_uid, (*pw).pw_gid) }
}

/// A running private Postfix; stopped when dropped.
pub struct Postfix {
    /// Everything of the instance: `conf/`, `queue/`, `data/`, `mail/` and `maillog`.
    dir: TempDir,
    /// The port of its `smtpd`, where the test submits mail.
    pub port: u16,
    /// The loopback address its `smtpd` listens on (127.0.0.1 but for
    /// [`Postfix::start_at`]).
    pub address: std::net::Ipv4Addr,
    running: bool,
}

impl Postfix {
    /// Writes the instance's configuration, with `main` and `master` (lines, each
    /// ending in a line feed) after its own `main.cf` and `master.cf`, and a maildir
    /// mailbox `LOCAL@local.test` for each of `mailboxes` and [`POSTMASTER`]; checks it
    /// (`postfix check`) and starts it, and returns once its `smtpd` greets.
    #[track_caller]
    pub fn start(tag: &str, main: &str, master: &str, mailboxes: &[&str]) -> Postfix {
        Postfix::start_prepared(tag, main, master, mailboxes, |_| {})
    }

    /// [`Postfix::start`], with `prepare` called on the configuration directory once
    /// the instance's own files are written there and before `postfix check`: for the
    /// files that `main` names as `$config_directory/…` (a private Postfix's directory
    /// is known only here, and Debian's `smtpd` reads its Cyrus SASL configuration from
    /// `$config_directory/sasl/` and nowhere else of the instance's).
    #[track_caller]
    pub fn start_prepared(
        tag: &str,
        main: &str,
        master: &str,
        mailboxes: &[&str],
        prepare: impl FnOnce(&Path),
    ) -> Postfix {
        let port = super::ingress::free_port();
        let at = std::net::Ipv4Addr::LOCALHOST;
        Postfix::start_at(tag, (at, port), main, master, mailboxes, prepare)
    }

    /// [`Postfix::start_prepared`] with its `smtpd` on another loopback address and
    /// port (a mail exchanger among several on one port: 127.0.0.2, 127.0.0.3 …).
    #[track_caller]
    pub fn start_at(
        tag: &str,
        (address, port): (std::net::Ipv4Addr, u16),
        main: &str,
        master: &str,
        mailboxes: &[&str],
        prepare: impl FnOnce(&Path),
    ) -> Postfix {
        static STALE: std::sync::Once = std::sync::Once::new();
        STALE.call_once(remove_stale);
        let dir = TempDir::new(&format!("{DIR_TAG}-{tag}"));
        // Postfix takes only an interface's own address for inet_interfaces, and the
        // loopback interface has 127.0.0.1 alone (the rest of 127/8 reaches it by its
        // netmask): another loopback address is the master.cf listener's alone.
        let interfaces = if address.is_loopback() && address != std::net::Ipv4Addr::LOCALHOST {
            "all".to_string()
        } else {
            address.to_string()
        };
        let conf = dir.path("conf");
        let data = dir.path("data");
        let mail = dir.path("mail");
        // The queue directory must exist (root's); `postfix check` makes its
        // subdirectories.
        for d in [&conf, &dir.path("queue"), &data, &mail] {
            std::fs::create_dir_all(d).unwrap();
        }
        let (uid, gid) = mailbox_owner();
        std::os::unix::fs::chown(&mail, Some(uid), Some(gid)).unwrap();
        chown_to_postfix(&data);
        let mut map = String::new();
        for local in mailboxes.iter().chain([&POSTMASTER]) {
            // A value ending in `/` is a maildir under virtual_mailbox_base.
            map.push_str(&format!("{local}@{DOMAIN} {local}/\n"));
        }
        std::fs::write(conf.join("vmailbox"), map).unwrap();
        std::fs::write(
            conf.join("main.cf"),
            format!(
                "{}inet_interfaces = {interfaces}\n{main}",
                main_cf(&dir.0, uid, gid)
            ),
        )
        .unwrap();
        std::fs::write(
            conf.join("master.cf"),
            format!("{}{master}", master_cf(address, port)),
        )
        .unwrap();
        // The value exists before Postfix does, so that a failed start still stops
        // whatever did start, and shows the log.
        let mut postfix = Postfix {
            dir,
            port,
            address,
            running: false,
        };
        prepare(&postfix.config_dir());
        postfix.postfix("check");
        postfix.running = true;
        postfix.postfix("start");
        postfix.wait_for_greeting(Duration::from_secs(30));
        postfix
    }

    /// Runs `postfix -c CONF command`, which must succeed.
    #[track_caller]
    fn postfix(&self, command: &str) {
        self.run(POSTFIX, &[command]);
    }

    /// Runs one of Postfix's programs (`postfix`, `postqueue`, `postsuper` …) with `-c
    /// CONF` and `args`, no standard input; it must succeed (else the instance's log
    /// is shown).
    #[track_caller]
    pub fn run(&self, program: &str, args: &[&str]) {
        let out = Command::new(program)
            .arg("-c")
            .arg(self.config_dir())
            .args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
        assert!(
            out.status.success(),
            "{program} {args:?} failed ({}):\n{}{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.maillog()
        );
    }

    /// Waits until the `smtpd` on [`Postfix::port`] answers with its greeting.
    #[track_caller]
    fn wait_for_greeting(&self, timeout: Duration) {
        use std::io::Read;
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect((self.address, self.port)) {
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut greeting = [0u8; 3];
                if s.read_exact(&mut greeting).is_ok() && &greeting == b"220" {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the private Postfix did not greet on port {} within {timeout:?} (its log \
                 follows the test's output)",
                self.port,
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The instance's `config_directory`.
    pub fn config_dir(&self) -> PathBuf {
        self.dir.path("conf")
    }

    /// Its log so far.
    pub fn maillog(&self) -> String {
        std::fs::read_to_string(self.dir.path("maillog")).unwrap_or_default()
    }

    /// The messages delivered to `LOCAL@local.test` so far, each the bytes of its
    /// maildir file, in the order of their names (the time of delivery first).
    pub fn mailbox(&self, local: &str) -> Vec<Vec<u8>> {
        let mut files: Vec<PathBuf> = ["new", "cur"]
            .iter()
            .flat_map(|sub| {
                std::fs::read_dir(self.dir.path("mail").join(local).join(sub))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path())
            })
            .collect();
        files.sort();
        files.iter().map(|f| std::fs::read(f).unwrap()).collect()
    }

    /// Waits until `LOCAL@local.test` holds at least `n` messages and returns them;
    /// fails with the log after `timeout`.
    #[track_caller]
    pub fn wait_mailbox(&self, local: &str, n: usize, timeout: Duration) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        loop {
            let messages = self.mailbox(local);
            if messages.len() >= n {
                return messages;
            }
            assert!(
                Instant::now() < deadline,
                "{local}@{DOMAIN} holds {} messages, not {n}, after {timeout:?} \
                 (Postfix's log follows the test's output)",
                messages.len(),
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// How many messages are in the instance's queue (incoming, active, deferred,
    /// held, or dropped by a local submission and not yet picked up).
    pub fn queued(&self) -> usize {
        ["maildrop", "incoming", "active", "deferred", "hold"]
            .iter()
            .map(|q| count_files(&self.dir.path("queue").join(q)))
            .sum()
    }

    /// Stops the instance (`postfix stop`) and waits until its master has exited.
    pub fn stop(&mut self) {
        if !std::mem::take(&mut self.running) {
            return;
        }
        let master = std::fs::read_to_string(self.dir.path("queue/pid/master.pid"))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok());
        let _ = Command::new(POSTFIX)
            .arg("-c")
            .arg(self.config_dir())
            .arg("stop")
            .output();
        let Some(pid) = master else { return };
        // The master ends its children before it exits itself; its temporary
        // directory goes only after that.
        let deadline = Instant::now() + Duration::from_secs(10);
        // SAFETY: signal 0 only asks whether the process exists.
        while unsafe { libc::kill(pid, 0) } == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = Command::new(POSTFIX)
            .arg("-c")
            .arg(self.config_dir())
            .arg("abort")
            .output();
    }
}

impl Drop for Postfix {
    fn drop(&mut self) {
        if std::thread::panicking() && self.running {
            eprintln!("the private Postfix's log:\n{}", self.maillog());
        }
        self.stop();
    }
}

/// What the name of every instance's directory starts with, after `pepsi-t-`.
const DIR_TAG: &str = "postfix";

/// Stops the instances of test processes that ended without stopping theirs (a test
/// binary killed at a time limit), and removes their directories: a Postfix master
/// outlives the test that started it. A directory is named
/// `pepsi-t-postfix-TAG-PID-N` ([`TempDir::new`]), PID the test process's.
fn remove_stale() {
    for dir in super::stale_dirs(DIR_TAG) {
        if dir.join("queue/pid/master.pid").exists() {
            let _ = Command::new(POSTFIX)
                .arg("-c")
                .arg(dir.join("conf"))
                .arg("stop")
                .output();
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The files in a queue directory and its hashed subdirectories.
pub fn count_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => count_files(&e.path()),
            Ok(_) => 1,
            Err(_) => 0,
        })
        .sum()
}

fn chown_to_postfix(path: &Path) {
    let status = Command::new("chown")
        .arg("postfix:postfix")
        .arg(path)
        .status()
        .expect("run chown");
    assert!(status.success(), "chown postfix {}", path.display());
}

/// The instance's own `main.cf` for the private directory `dir`.
fn main_cf(dir: &Path, uid: u32, gid: u32) -> String {
    let dir = dir.display();
    format!(
        "\
compatibility_level = 3.6
config_directory = {dir}/conf
queue_directory = {dir}/queue
data_directory = {dir}/data
mail_owner = postfix
setgid_group = postdrop
myhostname = {HOSTNAME}
mydomain = pepsi.test
myorigin = {DOMAIN}
inet_protocols = ipv4
mynetworks = 127.0.0.0/8
smtputf8_enable = yes
biff = no
# Nothing is delivered by local(8): every mailbox is a virtual one, a maildir.
mydestination =
alias_maps =
alias_database =
local_recipient_maps =
virtual_mailbox_domains = {DOMAIN}
virtual_mailbox_base = {dir}/mail
virtual_mailbox_maps = texthash:{dir}/conf/vmailbox
virtual_uid_maps = static:{uid}
virtual_gid_maps = static:{gid}
# Nothing leaves the machine.
relayhost =
default_transport = error:no mail leaves a test instance
relay_transport = error:no mail leaves a test instance
# Retries within seconds, not minutes.
queue_run_delay = 1s
minimal_backoff_time = 1s
maximal_backoff_time = 2s
# The log, in a file of the test's own.
maillog_file = {dir}/maillog
maillog_file_prefixes = {dir}
"
    )
}

/// The instance's own `master.cf`: its `smtpd` on `127.0.0.1:port` and the services
/// of Debian's `master.cf`, none of them chrooted (the private queue directory holds
/// no copies of the system's files).
fn master_cf(address: std::net::Ipv4Addr, port: u16) -> String {
    format!(
        "\
{address}:{port} inet n - n - - smtpd
pickup    unix  n  -  n  60    1  pickup
cleanup   unix  n  -  n  -     0  cleanup
qmgr      unix  n  -  n  300   1  qmgr
rewrite   unix  -  -  n  -     -  trivial-rewrite
bounce    unix  -  -  n  -     0  bounce
defer     unix  -  -  n  -     0  bounce
trace     unix  -  -  n  -     0  bounce
verify    unix  -  -  n  -     1  verify
flush     unix  n  -  n  1000? 0  flush
proxymap  unix  -  -  n  -     -  proxymap
smtp      unix  -  -  n  -     -  smtp
relay     unix  -  -  n  -     -  smtp
showq     unix  n  -  n  -     -  showq
error     unix  -  -  n  -     -  error
retry     unix  -  -  n  -     -  error
discard   unix  -  -  n  -     -  discard
virtual   unix  -  n  n  -     -  virtual
lmtp      unix  -  -  n  -     -  lmtp
anvil     unix  -  -  n  -     1  anvil
scache    unix  -  -  n  -     1  scache
postlog   unix-dgram n - n - 1 postlogd
"
    )
}

/// The Postfix recipe of doc/postfix.md ("Postfix: `pepsi-ingress` as its content
/// filter"), each piece exactly as the guide gives it.
#[derive(Clone, Debug)]
pub struct Recipe {
    /// The `main.cf` lines (`content_filter = lmtp:inet:127.0.0.1:10025` and the rest).
    pub main_cf: String,
    /// The `master.cf` entry of the server that takes the mail back (10026).
    pub master_cf: String,
    /// The body of the `[pepsi-ingress]` section (after its header line).
    pub ingress: String,
    /// The `[stage-reinject]` section, header line included: `pepsi-stage-relay`
    /// with `SMARTHOST` the server that takes the mail back.
    pub reinject_stage: String,
    /// The lines of the `[pepsi]` section (after its header line): `HOSTNAME`.
    pub pepsi: String,
}

/// Where the recipe sends the filter's mail and takes it back.
pub const FILTER_ADDRESS: &str = "127.0.0.1:10025";
/// See [`FILTER_ADDRESS`].
pub const BACK_ADDRESS: &str = "127.0.0.1:10026";
/// The `PROGRAM` of the recipe's `[stage-reinject]`.
pub const RELAY_PROGRAM: &str = "pepsi-stage-relay";
/// The guide that gives the recipe, relative to the source tree (scripts/mta-loop-bench
/// reads the same file).
pub const GUIDE: &str = "doc/postfix.md";

impl Recipe {
    /// Reads the recipe from [`GUIDE`] (the README points there): the indented blocks
    /// that begin with `content_filter = `, `127.0.0.1:10026 inet`, `[pepsi-ingress]`
    /// and `[stage-reinject]`, and the one that begins with `[pepsi]\nHOSTNAME = `.
    #[track_caller]
    pub fn from_guide() -> Recipe {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(GUIDE);
        let guide =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let blocks = indented_blocks(&guide);
        let block = |first: &str| -> String {
            let found: Vec<&String> = blocks.iter().filter(|b| b.starts_with(first)).collect();
            assert_eq!(
                found.len(),
                1,
                "{GUIDE} has one indented block beginning with {first:?}"
            );
            found[0].clone()
        };
        let ingress = block("[pepsi-ingress]\n");
        Recipe {
            main_cf: block("content_filter = "),
            master_cf: block(&format!("{BACK_ADDRESS} inet")),
            ingress: ingress["[pepsi-ingress]\n".len()..].to_string(),
            reinject_stage: block("[stage-reinject]\n"),
            pepsi: block("[pepsi]\nHOSTNAME = ")["[pepsi]\n".len()..].to_string(),
        }
    }

    /// The recipe with its addresses moved to loopback ports of a test:
    /// `pepsi-ingress` on `filter` instead of 10025, the server that takes the mail
    /// back on `back` instead of 10026 (the relay's `SMARTHOST` with it), the stage
    /// program where the tests have it (`pepsi-stage-relay` is `relay`). Every piece
    /// must name what it is moved from: a recipe that changed shape fails here.
    #[track_caller]
    pub fn on_ports(&self, filter: u16, back: u16, relay: &Path) -> Recipe {
        let filter_to = format!("127.0.0.1:{filter}");
        let back_to = format!("127.0.0.1:{back}");
        let moved = |text: &str, from: &str, to: &str| -> String {
            assert!(
                text.contains(from),
                "the recipe's piece names {from}:\n{text}"
            );
            text.replace(from, to)
        };
        Recipe {
            main_cf: moved(&self.main_cf, FILTER_ADDRESS, &filter_to),
            master_cf: moved(&self.master_cf, BACK_ADDRESS, &back_to),
            ingress: moved(&self.ingress, FILTER_ADDRESS, &filter_to),
            reinject_stage: moved(
                &moved(
                    &self.reinject_stage,
                    &format!("SMARTHOST = {BACK_ADDRESS}\n"),
                    &format!("SMARTHOST = {back_to}\n"),
                ),
                &format!("PROGRAM = {RELAY_PROGRAM}\n"),
                &format!("PROGRAM = {}\n", relay.display()),
            ),
            pepsi: self.pepsi.clone(),
        }
    }
}

/// The guide's indented code blocks (four spaces), each with that indentation
/// removed and a line feed after every line.
fn indented_blocks(text: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        match (line.strip_prefix("    "), current.as_mut()) {
            (Some(code), Some(block)) => {
                block.push_str(code);
                block.push('\n');
            }
            (Some(code), None) => current = Some(format!("{code}\n")),
            (None, _) => blocks.extend(current.take()),
        }
    }
    blocks.extend(current);
    blocks
}
