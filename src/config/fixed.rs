//! The keys of the fixed sections of `pepsi.conf` (§4), one line each in
//! the `fixed_keys!` table: section, name, kind (how its value is read) and default,
//! under a doc line. Everything else about a fixed key comes from that line: the typed
//! [`Key`] constant `Config::from_sections` reads it through, the list of known keys
//! the unknown-key warnings compare with ([`SECTIONS`], `config::known_keys`), and the
//! value `pepsi-dispatch check` falls back to where the file is wrong ([`Key::text`]).
//!
//! Pure: it reads [`Section`]s and records problems in [`Problems`], with the messages
//! of [`Section`]'s own readers. Called by `config/mod.rs` (the options), `keys.rs`
//! (the unknown keys) and `crate::check`; it knows nothing of stages or the database.

use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use super::program_path::{DEFAULT_PROGRAM_PATH, ProgramPath};
use super::raw::{Origin, Problems, Section, Value};
use super::{MailLogFormat, MailLogTarget};
use crate::durability::SynchronousCommit;

/// The default `[pepsi-postgres] CONNECTION`.
pub const DEFAULT_CONNECTION: &str = "host=/var/run/postgresql dbname=pepsi user=pepsi";

/// One key of a fixed section, of kind `K` (which says how it is read, and its
/// default).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key<K> {
    /// The section, e.g. `pepsi-dispatch`.
    pub section: &'static str,
    /// The key, e.g. `MAX_RUNTIME`.
    pub name: &'static str,
    /// How its value is read, with its default.
    pub kind: K,
}

/// A boolean (yes/no, true/false, on/off, 1/0) with its default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Boolean(pub bool);

/// A duration (a bare number is seconds) with its default in seconds; zero allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seconds(pub u64);

/// A duration with its default in seconds; zero is an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PositiveSeconds(pub u64);

/// A whole number within a range, with its default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Number(pub u32, pub RangeInclusive<u32>);

/// Text as written (a name, a path), with its default when it has one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Text(pub Option<&'static str>);

/// A libpq conninfo or URL, checked by the client library's own parser, with its
/// default when it has one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conninfo(pub Option<&'static str>);

/// A mail host name (RFC 1123); by default the host's name ([`host_name`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostName;

/// A [`ProgramPath`], with its default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Programs(pub &'static str);

/// A `synchronous_commit` level, with its default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Durability(pub SynchronousCommit);

/// Stage names separated by commas or blanks; by default worked out from the stage
/// graph (see `Config::inject_stages`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageList;

/// Where the delivery log goes ([`crate::config::MailLogTarget`]); default `syslog`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MailLog;

/// The delivery log's form ([`crate::config::MailLogFormat`]); default `text`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogFormat;

/// How a sender's tenant is found ([`TenantKey`]); default `default`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantRule;

/// `[pepsi] TENANT_KEY` (§7 "Tenants"): the rule `pepsi-setup schema` writes to
/// `pepsi.tenant_rule`, which every row inserted is keyed by (schema 25).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TenantKey {
    /// The authenticated user's domain, else the client's /24 or /48, else the
    /// envelope sender's registrable domain.
    Default,
    /// Each sender key its own tenant: shares between senders alone.
    Sender,
}

impl TenantKey {
    /// As the file and the table write it.
    pub fn as_str(self) -> &'static str {
        match self {
            TenantKey::Default => "default",
            TenantKey::Sender => "sender",
        }
    }
}

/// The kinds whose default is a text as the file would have it.
pub trait TextDefault {
    /// The default as the file would write it; `None` when the key has none.
    fn default_text(&self) -> Option<&'static str>;
}

impl TextDefault for Text {
    fn default_text(&self) -> Option<&'static str> {
        self.0
    }
}

impl TextDefault for Conninfo {
    fn default_text(&self) -> Option<&'static str> {
        self.0
    }
}

impl TextDefault for Programs {
    fn default_text(&self) -> Option<&'static str> {
        Some(self.0)
    }
}

/// Declares every fixed key from one line each: a [`Key`] constant named after the
/// key, and [`SECTIONS`], the sections with their keys in the order written.
macro_rules! fixed_keys {
    ($(
        [$section:literal]
        $( $(#[doc = $doc:literal])* $name:ident = $kind:ident $(($($args:tt)*))?, )*
    )*) => {
        $($(
            $(#[doc = $doc])*
            pub const $name: Key<$kind> = Key {
                section: $section,
                name: stringify!($name),
                kind: $kind $(($($args)*))?,
            };
        )*)*

        /// Every fixed section with the keys it knows, in file order.
        pub const SECTIONS: &[(&str, &[&str])] = &[$(($section, &[$(stringify!($name)),*])),*];
    };
}

fixed_keys! {
    ["pepsi"]
    /// Global switch for stage fusion (§12.6).
    ALLOW_FUSION = Boolean(true),
    /// Read by workers at start (§9).
    SHARE_TELEMETRY = Boolean(false),
    /// The account a program started as root switches to; `root` keeps root.
    RUN_AS = Text(Some("pepsi")),
    /// The account the stage workers of a dispatcher started as root run as.
    WORKER_AS = Text(Some("pepsi-worker")),
    /// The system's mail host name; default: the host's name.
    HOSTNAME = HostName,
    /// The directories an overlay `PROGRAM` may name a program under.
    PROGRAM_PATH = Programs(DEFAULT_PROGRAM_PATH),
    /// The stages an injecting role may inject into; default: the entry stages.
    INJECT_STAGES = StageList,
    /// Where the workers write the delivery log: `syslog`, `no` or a file's path.
    DELIVERY_LOG = MailLog,
    /// The delivery log's form: `text` (Postfix's shape) or `json`.
    LOG_FORMAT = LogFormat,
    /// How long `pepsi.history` keeps what became of a message.
    HISTORY_RETENTION = PositiveSeconds(7 * 86_400),
    /// How a sender's tenant is found: `default` or `sender`.
    TENANT_KEY = TenantRule,

    ["pepsi-postgres"]
    /// libpq conninfo or URL: the schema owner's, and every program's without its own.
    CONNECTION = Conninfo(Some(DEFAULT_CONNECTION)),
    /// `pepsi-dispatch`'s connection; default: `CONNECTION`.
    DISPATCH_CONNECTION = Conninfo(None),
    /// The stage workers' connection; default: `CONNECTION`.
    WORKER_CONNECTION = Conninfo(None),
    /// `pepsi-queue`'s and the failure bouncer's connection; default: `CONNECTION`.
    ADMIN_CONNECTION = Conninfo(None),
    /// `pepsi-queue inject`'s connection; default: `CONNECTION`.
    INJECT_CONNECTION = Conninfo(None),
    /// `synchronous_commit` of worker connections.
    WORKER_SYNCHRONOUS_COMMIT = Boolean(false),

    ["pepsi-dispatch"]
    /// Per-message wall-clock limit (§8.2).
    MAX_RUNTIME = PositiveSeconds(300),
    /// An idle worker is stopped after this.
    WORKER_IDLE_TIMEOUT = Seconds(5),
    /// Safety-net heartbeat.
    POLL_INTERVAL = PositiveSeconds(30),
    /// Statistics flush and body GC tick.
    STATS_INTERVAL = PositiveSeconds(10),
    /// The dispatcher's own connection pool.
    DB_POOL_SIZE = Number(8, 1..=1000),
    /// The file the workers' configuration is made from; default: the file read.
    CONFIG_FILE = Text(None),
    /// §7; `no` = plain oldest-first claim.
    FAIR_SCHEDULING = Boolean(true),
    /// Lead half-life (§7).
    FAIR_HALF_LIFE = PositiveSeconds(60),
    /// Share of slots reserved for the oldest rows (§7).
    FAIR_FIFO_PERCENT = Number(10, 0..=100),
    /// The loop limit of §6 "Hops".
    MAX_HOPS = Number(100, 1..=100_000),
    /// `synchronous_commit` of the dispatcher's queue writes (claims, requeues, strikes).
    SYNCHRONOUS_COMMIT = Durability(SynchronousCommit::Off),
    /// A snapshot older than this is named in the log once a minute; 0 = never.
    SNAPSHOT_WARNING = Seconds(60),

    ["pepsi-failure-bouncer"]
    /// Where failed rows are moved; required by the bouncer only.
    BOUNCE_STAGE = Text(None),

    ["pepsi-ingress"]
    /// Where `pepsi-ingress` listens: `unix:PATH` (LMTP), `lmtp:HOST:PORT`,
    /// `smtp:HOST:PORT`, separated by blanks or commas; by default LMTP on the loopback
    /// interface, for a Postfix `content_filter`.
    LISTEN = Text(Some("lmtp:127.0.0.1:10025")),
    /// The stage mail enters at; required by `pepsi-ingress` only.
    STAGE = Text(None),
    /// The largest message accepted, in bytes (SIZE).
    MAX_MESSAGE_SIZE = Number(10_240_000, 1..=2_000_000_000),
    /// The most recipients of one message.
    MAX_RECIPIENTS = Number(1000, 1..=100_000),
    /// The most sessions at once.
    MAX_SESSIONS = Number(100, 1..=10_000),
    /// The most sessions of one client at once (an address, an IPv6 /64, a Unix
    /// socket's user); the clients of `XFORWARD_FROM` are not held to it.
    MAX_CLIENT_SESSIONS = Number(50, 1..=10_000),
    /// Of `MAX_SESSIONS`, how many only the clients of `XFORWARD_FROM` may take.
    TRUSTED_SESSIONS = Number(20, 0..=10_000),
    /// How long a client has for each command line, and at least for the data.
    TIMEOUT = PositiveSeconds(300),
    /// The slowest the data may come, in bytes per second: the data's time is
    /// `TIMEOUT` and a second more per this many bytes.
    MIN_DATA_RATE = Number(500, 1..=1_000_000_000),
    /// Errors (5xx replies) a session may cause before it is closed.
    MAX_ERRORS = Number(20, 1..=10_000),
    /// The clients whose XFORWARD is believed: addresses, networks (`/bits`) and
    /// `unix`; none by default.
    XFORWARD_FROM = Text(None),
    /// The certificate chain (PEM, the server's first) STARTTLS presents; with
    /// `TLS_KEY`, every listener offers STARTTLS. Read as `[pepsi] RUN_AS` at start
    /// and on SIGHUP.
    TLS_CERT = Text(None),
    /// The private key of `TLS_CERT` (PEM).
    TLS_KEY = Text(None),
    /// The listeners (as `LISTEN` writes them) that refuse mail before STARTTLS
    /// (530 5.7.0), or `none` (the default).
    REQUIRE_TLS = Text(None),
}

impl<K> Key<K> {
    /// The key's section among `sections`, when the file has it.
    fn section<'a>(&self, sections: &'a [Section]) -> Option<&'a Section> {
        sections.iter().find(|s| s.name == self.section)
    }

    /// The key's section and text, when the file sets it.
    fn set_in<'a>(&self, sections: &'a [Section]) -> Option<(&'a Section, &'a str)> {
        let section = self.section(sections)?;
        Some((section, section.get(self.name)?))
    }

    /// The key's value as the file sets it, with where.
    pub fn value<'a>(&self, sections: &'a [Section]) -> Option<&'a Value> {
        self.section(sections)?.value(self.name)
    }
}

impl<K: TextDefault> Key<K> {
    /// The key's text as the file sets it, else its default: the value a program
    /// reads, unchecked (`pepsi-dispatch check` falls back to it where the file's
    /// other values are wrong).
    pub fn text<'a>(&self, sections: &'a [Section]) -> Option<&'a str> {
        self.section(sections)
            .and_then(|s| s.get(self.name))
            .or(self.kind.default_text())
    }
}

impl Key<Boolean> {
    /// The value, or the default after recording a problem.
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> bool {
        let default = self.kind.0;
        self.section(sections)
            .and_then(|s| p.ok(s.boolean(self.name, default)))
            .unwrap_or(default)
    }
}

impl Key<Seconds> {
    /// The value, or the default after recording a problem.
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> Duration {
        let default = Duration::from_secs(self.kind.0);
        self.section(sections)
            .and_then(|s| p.ok(s.duration(self.name, default)))
            .unwrap_or(default)
    }
}

impl Key<PositiveSeconds> {
    /// The value, or the default after recording a problem (zero is one).
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> Duration {
        let default = Duration::from_secs(self.kind.0);
        self.section(sections)
            .and_then(|s| {
                p.ok(match s.duration(self.name, default) {
                    Ok(v) if v.is_zero() => Err(s.error(self.name, "must be greater than zero")),
                    other => other,
                })
            })
            .unwrap_or(default)
    }
}

impl Key<MailLog> {
    /// The target, or the default after recording a problem: `syslog`, `no` (none) or
    /// an absolute path.
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> MailLogTarget {
        let Some((section, text)) = self.set_in(sections) else {
            return MailLogTarget::Syslog;
        };
        match text {
            "syslog" => MailLogTarget::Syslog,
            "no" | "off" | "none" => MailLogTarget::Off,
            path if path.starts_with('/') && !path.contains('\0') => {
                MailLogTarget::File(PathBuf::from(path))
            }
            other => {
                p.push(section.error(
                    self.name,
                    format!(
                        "{} is neither syslog, no nor an absolute path",
                        crate::escape::Visible(other)
                    ),
                ));
                MailLogTarget::Syslog
            }
        }
    }
}

impl Key<LogFormat> {
    /// The form, or the default after recording a problem.
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> MailLogFormat {
        let Some((section, text)) = self.set_in(sections) else {
            return MailLogFormat::Text;
        };
        match text {
            "text" => MailLogFormat::Text,
            "json" => MailLogFormat::Json,
            other => {
                p.push(section.error(
                    self.name,
                    format!("{} is neither text nor json", crate::escape::Visible(other)),
                ));
                MailLogFormat::Text
            }
        }
    }
}

impl Key<TenantRule> {
    /// The rule, or the default after recording a problem.
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> TenantKey {
        let Some((section, text)) = self.set_in(sections) else {
            return TenantKey::Default;
        };
        match text {
            "default" => TenantKey::Default,
            "sender" => TenantKey::Sender,
            other => {
                p.push(section.error(
                    self.name,
                    format!(
                        "{} is neither default nor sender",
                        crate::escape::Visible(other)
                    ),
                ));
                TenantKey::Default
            }
        }
    }
}

impl Key<Number> {
    /// The value, or the default after recording a problem.
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> u32 {
        let Number(default, range) = &self.kind;
        self.section(sections)
            .and_then(|s| p.ok(s.number(self.name, *default, range.clone())))
            .unwrap_or(*default)
    }
}

impl Key<Durability> {
    /// The level, or the default after recording a problem.
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> SynchronousCommit {
        let default = self.kind.0;
        self.section(sections)
            .and_then(|s| p.ok(s.optional_synchronous_commit(self.name)))
            .flatten()
            .unwrap_or(default)
    }
}

impl Key<Text> {
    /// The text as the file sets it, else the default.
    pub fn read<'a>(&self, sections: &'a [Section]) -> Option<&'a str> {
        self.text(sections)
    }
}

impl Key<Conninfo> {
    /// The conninfo as the file sets it, else the default; one the client library does
    /// not parse is a problem (and still returned).
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> Option<String> {
        let value = self.text(sections)?;
        let problem = match crate::conninfo::prepared(value) {
            Err(why) => Some(why),
            Ok(prepared) => prepared.parse::<postgres::Config>().err().map(|e| {
                // The library's own words name the option ("invalid value for option
                // `port`"); they are the error's source.
                let cause = std::error::Error::source(&e)
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default();
                format!("is not a valid conninfo or URL: {e}{cause}")
            }),
        };
        if let Some(problem) = problem {
            let section = self
                .section(sections)
                .cloned()
                .unwrap_or_else(|| Section::new(self.section, Origin::Default));
            p.push(section.error(self.name, problem));
        }
        Some(value.to_string())
    }
}

impl Key<HostName> {
    /// The host name as the file sets it (checked; empty after recording a problem),
    /// else the host's name.
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> String {
        match self.set_in(sections) {
            Some((section, name)) => p
                .ok(checked_hostname(name).map_err(|why| section.error(self.name, why)))
                .unwrap_or_default(),
            None => host_name(),
        }
    }
}

impl Key<Programs> {
    /// The program path as the file sets it, else the default; the default after
    /// recording a problem.
    pub fn read(&self, sections: &[Section], p: &mut Problems) -> ProgramPath {
        match self.set_in(sections) {
            Some((section, text)) => p
                .ok(ProgramPath::parse(text).map_err(|why| section.error(self.name, why)))
                .unwrap_or_default(),
            None => ProgramPath::default(),
        }
    }
}

impl Key<StageList> {
    /// The stage names as the file lists them, with where; `None` when unset.
    pub fn read(&self, sections: &[Section]) -> Option<(Vec<String>, Origin)> {
        self.value(sections).map(|v| {
            let names = v
                .text
                .split(|c: char| c == ',' || c.is_whitespace())
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .collect();
            (names, v.origin.clone())
        })
    }
}

/// A mail host name: dot-separated labels of letters, digits and hyphens (RFC 1123),
/// at most 253 characters, as written (a trailing dot dropped).
fn checked_hostname(name: &str) -> Result<String, String> {
    let name = name.strip_suffix('.').unwrap_or(name);
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
        return Err(format!(
            "{name:?} is not a host name (letters, digits and hyphens, labels joined by dots)"
        ));
    }
    Ok(name.to_string())
}

/// The host's name as the kernel has it (`gethostname`), or `localhost` when it is not
/// a usable host name.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it
    // or truncates, and the last byte stays 0.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    let len = buf.iter().position(|&b| b == 0).unwrap_or(0);
    let name = if rc == 0 {
        String::from_utf8_lossy(&buf[..len]).into_owned()
    } else {
        String::new()
    };
    checked_hostname(&name).unwrap_or_else(|_| "localhost".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_listed_once_under_its_own_section() {
        let mut seen = std::collections::BTreeSet::new();
        for (section, keys) in SECTIONS {
            for key in *keys {
                assert!(seen.insert(*key), "{key} is declared twice");
                assert!(!section.is_empty());
            }
        }
        assert_eq!(MAX_RUNTIME.section, "pepsi-dispatch");
        assert_eq!(MAX_RUNTIME.name, "MAX_RUNTIME");
        assert_eq!(
            SECTIONS.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            [
                "pepsi",
                "pepsi-postgres",
                "pepsi-dispatch",
                "pepsi-failure-bouncer",
                "pepsi-ingress"
            ]
        );
    }

    #[test]
    fn a_text_falls_back_to_its_default_only_where_the_file_is_silent() {
        let path = std::path::Path::new("/f.conf");
        let file = super::super::raw::parse(path, "[pepsi]\nRUN_AS = mail\n").unwrap();
        assert_eq!(RUN_AS.text(&file), Some("mail"));
        assert_eq!(RUN_AS.text(&[]), Some("pepsi"));
        assert_eq!(PROGRAM_PATH.text(&file), Some(DEFAULT_PROGRAM_PATH));
        assert_eq!(CONNECTION.text(&file), Some(DEFAULT_CONNECTION));
        assert_eq!(WORKER_CONNECTION.text(&file), None);
    }
}
