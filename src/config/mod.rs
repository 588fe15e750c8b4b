//! `pepsi.conf` (§4): the fixed sections checked into typed options, and the raw
//! `[stage-*]` sections that [`graph`] turns into the stage graph together with the
//! `pepsi.config_override` overlay.
//!
//! Two phases, as everywhere in Pepsi: [`raw`] reads entries with their file and line;
//! [`Config::from_sections`] checks every value and collects every problem, so an
//! operator sees all mistakes at once, each naming file, line, section and key. Unknown
//! sections and keys are warnings ([`keys`]), kept in [`Config::warnings`] for the
//! caller to log or print.
//!
//! The files, each a concern, lower ones first (none uses a file below it here):
//! - [`raw`]: the parse, [`Section`] and [`ConfigError`]; the search order of §4.
//! - [`program_path`]: `[pepsi] PROGRAM_PATH` and the rule about what an overlay may
//!   run.
//! - [`fixed`]: the table of the fixed sections' keys, one line each, and how each kind
//!   of value is read.
//! - [`overlay`]: laying `pepsi.config_override` over the file's stage sections.
//! - [`graph`]: a stage section checked, and the stage graph; [`cycles`]: its cycles.
//! - [`keys`]: unknown sections and keys, with the nearest known name.
//! - this file: [`Config`], the typed options read through [`fixed`]'s keys.
//! - [`handoff`]: the text of the file a stage worker is handed (its sections and its
//!   own connection, nothing else).
//!
//! `pepsi-dispatch check` and the checks the dispatcher's start and reload share with
//! it are [`crate::check`], a module above this one.
//!
//! Every program reads its configuration here ([`Config::load_or_fail`]). Nothing here
//! touches the database, a stage or another program's state; the one thing it takes
//! from the database module is the type of an overlay row, [`crate::db::OverrideRow`].

pub mod cycles;
pub mod fixed;
pub mod graph;
pub mod handoff;
pub mod ingress;
pub mod keys;
pub mod overlay;
#[cfg(test)]
mod overlay_tests;
pub mod program_path;
pub mod rate;
pub mod raw;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use fixed::{DEFAULT_CONNECTION, host_name};
pub use graph::{ProgramPath, StageGraph, StageSection};
pub use keys::fixed_warnings;
pub use raw::{ConfigError, DEFAULT_PATH, Origin, Problems, Section};

use crate::durability::SynchronousCommit;
use crate::exit::Failure;

/// `[pepsi]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PepsiOptions {
    /// Global switch for stage fusion (§12.6).
    pub allow_fusion: bool,
    /// Read by workers at start (§9).
    pub share_telemetry: bool,
    /// The account a program started as root switches to; `root` keeps root.
    pub run_as: String,
    /// The account the stage workers of a dispatcher started as root run as (§4
    /// "Containment"): one of their own, which reaches only the stage role and cannot
    /// read this file; `root` keeps root.
    pub worker_as: String,
    /// The system's mail host name (`MAILER-DAEMON@` it, the Reporting-MTA of a
    /// delivery status notification); default: the host's name.
    pub hostname: String,
    /// The directories an overlay `PROGRAM` may name a program under (§4 "Least
    /// privilege"); the file's own only, never the overlay's.
    pub program_path: ProgramPath,
    /// `INJECT_STAGES`: the stages an injecting role may inject into (§4
    /// "Containment"), with where it is set; `None` for the default, the graph's entry
    /// stages.
    pub inject_stages: Option<(Vec<String>, Origin)>,
    /// `DELIVERY_LOG`: where the workers write a line per recipient outcome.
    pub delivery_log: MailLogTarget,
    /// `LOG_FORMAT`: that line's form.
    pub log_format: MailLogFormat,
    /// `HISTORY_RETENTION`, in whole days (at least 1, at most 3660): how long
    /// `pepsi.history` keeps what became of a message.
    pub history_days: i32,
    /// `TENANT_KEY`: how a sender's tenant is found (written by `pepsi-setup`).
    pub tenant_key: fixed::TenantKey,
}

/// A retention in whole days, rounded up, within what `pepsi.history_maintain` takes.
fn retention_days(retention: Duration) -> i32 {
    retention.as_secs().div_ceil(86_400).clamp(1, 3660) as i32
}

/// Where the delivery log goes (`[pepsi] DELIVERY_LOG`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MailLogTarget {
    /// The system log (`/dev/log`), facility mail, as Postfix logs.
    Syslog,
    /// Appended to this file, one line per record.
    File(PathBuf),
    /// Nowhere.
    Off,
}

/// The delivery log's form (`[pepsi] LOG_FORMAT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MailLogFormat {
    /// Postfix's `key=value` shape, which `pflogsumm` reads.
    Text,
    /// One JSON object a line.
    Json,
}

/// The kinds of program that connect with a database role of their own (§4
/// "Least privilege"), each through its own `[pepsi-postgres]` key, which falls back to
/// `CONNECTION`. `pepsi-setup` always uses `CONNECTION`: the schema's owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DbRole {
    /// `pepsi-dispatch` (`serve` and `check`): `DISPATCH_CONNECTION`.
    Dispatch,
    /// Stage workers: `WORKER_CONNECTION`.
    Worker,
    /// `pepsi-queue` and `pepsi-failure-bouncer`: `ADMIN_CONNECTION`.
    Admin,
    /// `pepsi-queue inject`: `INJECT_CONNECTION`.
    Inject,
}

impl DbRole {
    /// Every kind, in the order of the keys in the file.
    pub const ALL: [DbRole; 4] = [
        DbRole::Dispatch,
        DbRole::Worker,
        DbRole::Admin,
        DbRole::Inject,
    ];

    /// Its `[pepsi-postgres]` key.
    pub fn fixed_key(self) -> &'static fixed::Key<fixed::Conninfo> {
        match self {
            DbRole::Dispatch => &fixed::DISPATCH_CONNECTION,
            DbRole::Worker => &fixed::WORKER_CONNECTION,
            DbRole::Admin => &fixed::ADMIN_CONNECTION,
            DbRole::Inject => &fixed::INJECT_CONNECTION,
        }
    }

    /// Its `[pepsi-postgres]` key's name.
    pub fn key(self) -> &'static str {
        self.fixed_key().name
    }

    /// The group role `pepsi-setup` grants its privileges to.
    pub fn group_role(self) -> &'static str {
        match self {
            DbRole::Dispatch => "pepsi_dispatch",
            DbRole::Worker => "pepsi_worker",
            DbRole::Admin => "pepsi_admin",
            DbRole::Inject => "pepsi_inject",
        }
    }
}

/// `[pepsi-postgres]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostgresOptions {
    /// libpq conninfo or URL: the schema owner's (`pepsi-setup`), and every program's
    /// whose own key is unset.
    pub connection: String,
    /// `DISPATCH_CONNECTION`, `WORKER_CONNECTION`, `ADMIN_CONNECTION` and
    /// `INJECT_CONNECTION` where set, in [`DbRole::ALL`] order.
    pub role_connections: [Option<String>; 4],
    /// `synchronous_commit` of worker connections.
    pub worker_synchronous_commit: bool,
}

impl PostgresOptions {
    /// `role`'s place in [`DbRole::ALL`], the order of its variants.
    fn index(role: DbRole) -> usize {
        role as usize
    }

    /// The connection of `role`'s programs: its own key when set, else `CONNECTION`.
    pub fn connection_for(&self, role: DbRole) -> &str {
        self.role_connections[Self::index(role)]
            .as_deref()
            .unwrap_or(&self.connection)
    }

    /// Does the file set `WORKER_CONNECTION`?
    pub fn sets_worker_connection(&self) -> bool {
        self.role_connections[Self::index(DbRole::Worker)].is_some()
    }

    /// The stage workers' connection when they run as `workers_as` (the dispatcher
    /// started as root switches them to `[pepsi] WORKER_AS`): `WORKER_CONNECTION` when
    /// the file sets it, else `CONNECTION` with that account's name as its user — the
    /// role peer authentication admits the account as — else `CONNECTION` as it is.
    pub fn worker_connection(&self, workers_as: Option<&str>) -> String {
        match (
            &self.role_connections[Self::index(DbRole::Worker)],
            workers_as,
        ) {
            (Some(own), _) => own.clone(),
            (None, Some(account)) => crate::conninfo::with_user(&self.connection, account),
            (None, None) => self.connection.clone(),
        }
    }

    /// The key [`PostgresOptions::connection_for`] takes the connection from, for
    /// messages: `[pepsi-postgres] DISPATCH_CONNECTION` or `[pepsi-postgres] CONNECTION`.
    pub fn key_for(&self, role: DbRole) -> String {
        let key = match self.role_connections[Self::index(role)] {
            Some(_) => role.key(),
            None => fixed::CONNECTION.name,
        };
        format!("[pepsi-postgres] {key}")
    }

    /// The `synchronous_commit` level of a stage's commits: its own
    /// `SYNCHRONOUS_COMMIT`, else `on` or `off` as `WORKER_SYNCHRONOUS_COMMIT` says.
    pub fn stage_durability(&self, stage: &StageSection) -> SynchronousCommit {
        stage
            .synchronous_commit
            .unwrap_or(if self.worker_synchronous_commit {
                SynchronousCommit::On
            } else {
                SynchronousCommit::Off
            })
    }
}

/// `[pepsi-dispatch]`.
#[derive(Clone, Debug)]
pub struct DispatchOptions {
    /// Per-message wall-clock limit (§8.2).
    pub max_runtime: Duration,
    /// An idle worker is stopped after this.
    pub worker_idle_timeout: Duration,
    /// Safety-net heartbeat.
    pub poll_interval: Duration,
    /// Statistics flush and body GC tick.
    pub stats_interval: Duration,
    /// The dispatcher's own connection pool.
    pub db_pool_size: u32,
    /// Passed to workers as `-c FILE`.
    pub config_file: Option<PathBuf>,
    /// §7; `false` = plain oldest-first claim.
    pub fair_scheduling: bool,
    /// Lead half-life (§7).
    pub fair_half_life: Duration,
    /// Share of slots reserved for the oldest rows (§7).
    pub fair_fifo_percent: u32,
    /// The loop limit: a row is claimed at most this many times at a changed stage
    /// (§6 "Hops").
    pub max_hops: u32,
    /// `synchronous_commit` of its queue writes (§12.2).
    pub synchronous_commit: SynchronousCommit,
    /// A snapshot of the database older than this is named in the log once a minute
    /// (who holds it); zero: never.
    pub snapshot_warning: Duration,
}

/// `[pepsi-failure-bouncer]`.
#[derive(Clone, Debug, Default)]
pub struct BouncerOptions {
    /// Where failed rows are moved; required by the bouncer only.
    pub bounce_stage: Option<String>,
    /// Where `BOUNCE_STAGE` is set (a file and line), for messages; `None` when unset.
    pub origin: Option<Origin>,
}

/// The whole configuration file, checked.
#[derive(Clone, Debug)]
pub struct Config {
    /// The file it was read from.
    pub path: PathBuf,
    /// `[pepsi]`.
    pub pepsi: PepsiOptions,
    /// `[pepsi-postgres]`.
    pub postgres: PostgresOptions,
    /// `[pepsi-dispatch]`.
    pub dispatch: DispatchOptions,
    /// `[pepsi-failure-bouncer]`.
    pub bouncer: BouncerOptions,
    /// `[pepsi-ingress]`.
    pub ingress: ingress::IngressOptions,
    /// The file's `[stage-*]` sections, before the overlay.
    pub stage_sections: Vec<Section>,
    /// Unknown sections and unknown keys of the fixed sections, as warnings (logged by
    /// [`Config::load_or_fail`]; printed by `pepsi-dispatch check`).
    pub warnings: Vec<ConfigError>,
    /// The text it was read from (empty when made from sections), for what the
    /// dispatcher hands its workers ([`handoff`]).
    pub source: std::sync::Arc<str>,
}

/// Every fixed section with the keys it knows, in file order: what `pepsi.conf(5)` and
/// the example configuration must document (the stage sections' keys are
/// [`graph::STAGE_KEYS`] and each built-in's `Stage::keys`). One line each in
/// [`fixed`]'s table.
pub fn known_keys() -> &'static [(&'static str, &'static [&'static str])] {
    fixed::SECTIONS
}

impl Config {
    /// Finds, reads and checks the configuration (search order of §4).
    pub fn load(explicit: Option<&Path>) -> Result<Config, Vec<ConfigError>> {
        let path = raw::search(explicit);
        let raw::FileRead {
            sections,
            mut errors,
            text,
        } = raw::read_all(&path)?;
        // The file's syntax errors and those of its values, all in one report.
        match Config::from_sections(path, sections) {
            Ok(mut config) if errors.is_empty() => {
                config.source = text.into();
                Ok(config)
            }
            Ok(_) => Err(errors),
            Err(more) => {
                errors.extend(more);
                Err(errors)
            }
        }
    }

    /// Like [`Config::load`], as a program's start-up failure (exit 1); logs the
    /// warnings.
    pub fn load_or_fail(explicit: Option<&Path>) -> Result<Config, Failure> {
        let config = Config::load(explicit).map_err(|errors| {
            Failure::general(format!(
                "configuration error:\n{}",
                raw::join_errors(&errors)
            ))
        })?;
        for w in &config.warnings {
            log::warn!("{w}");
        }
        Ok(config)
    }

    /// Checks parsed sections.
    pub fn from_sections(
        path: PathBuf,
        sections: Vec<Section>,
    ) -> Result<Config, Vec<ConfigError>> {
        let warnings = fixed_warnings(&sections);
        let mut p = Problems::default();
        let f = &sections;

        let pepsi = PepsiOptions {
            allow_fusion: fixed::ALLOW_FUSION.read(f, &mut p),
            share_telemetry: fixed::SHARE_TELEMETRY.read(f, &mut p),
            run_as: fixed::RUN_AS.read(f).unwrap_or_default().to_string(),
            worker_as: fixed::WORKER_AS.read(f).unwrap_or_default().to_string(),
            hostname: fixed::HOSTNAME.read(f, &mut p),
            program_path: fixed::PROGRAM_PATH.read(f, &mut p),
            inject_stages: fixed::INJECT_STAGES.read(f),
            delivery_log: fixed::DELIVERY_LOG.read(f, &mut p),
            log_format: fixed::LOG_FORMAT.read(f, &mut p),
            history_days: retention_days(fixed::HISTORY_RETENTION.read(f, &mut p)),
            tenant_key: fixed::TENANT_KEY.read(f, &mut p),
        };

        // Read first: its problem is listed before the connections', as it always was.
        let worker_synchronous_commit = fixed::WORKER_SYNCHRONOUS_COMMIT.read(f, &mut p);
        let postgres = PostgresOptions {
            connection: fixed::CONNECTION.read(f, &mut p).unwrap_or_default(),
            role_connections: DbRole::ALL.map(|r| r.fixed_key().read(f, &mut p)),
            worker_synchronous_commit,
        };

        let dispatch = DispatchOptions {
            max_runtime: fixed::MAX_RUNTIME.read(f, &mut p),
            worker_idle_timeout: fixed::WORKER_IDLE_TIMEOUT.read(f, &mut p),
            poll_interval: fixed::POLL_INTERVAL.read(f, &mut p),
            stats_interval: fixed::STATS_INTERVAL.read(f, &mut p),
            db_pool_size: fixed::DB_POOL_SIZE.read(f, &mut p),
            config_file: fixed::CONFIG_FILE.read(f).map(PathBuf::from),
            fair_scheduling: fixed::FAIR_SCHEDULING.read(f, &mut p),
            fair_half_life: fixed::FAIR_HALF_LIFE.read(f, &mut p),
            fair_fifo_percent: fixed::FAIR_FIFO_PERCENT.read(f, &mut p),
            max_hops: fixed::MAX_HOPS.read(f, &mut p),
            synchronous_commit: fixed::SYNCHRONOUS_COMMIT.read(f, &mut p),
            snapshot_warning: fixed::SNAPSHOT_WARNING.read(f, &mut p),
        };

        let bouncer = BouncerOptions {
            bounce_stage: fixed::BOUNCE_STAGE.read(f).map(str::to_string),
            origin: fixed::BOUNCE_STAGE.value(f).map(|v| v.origin.clone()),
        };

        let ingress = ingress::IngressOptions::read(f, &mut p);

        let stage_sections = sections
            .iter()
            .filter(|s| s.name.starts_with(graph::STAGE_PREFIX))
            .cloned()
            .collect();
        if p.is_empty() {
            Ok(Config {
                path,
                pepsi,
                postgres,
                dispatch,
                bouncer,
                ingress,
                stage_sections,
                warnings,
                source: "".into(),
            })
        } else {
            Err(p.0)
        }
    }

    /// The stage graph from the file alone.
    pub fn file_graph(&self) -> Result<StageGraph, Vec<ConfigError>> {
        self.graph(&[])
    }

    /// The stage graph of the file with `overlay` laid over it, under this file's
    /// `[pepsi] PROGRAM_PATH` (the refused overlay rows left out; see
    /// [`graph::lay_over`]). `[pepsi] INJECT_STAGES` must name stages of it.
    pub fn graph(&self, overlay: &[graph::OverrideRow]) -> Result<StageGraph, Vec<ConfigError>> {
        let graph = StageGraph::build(&self.stage_sections, overlay, &self.pepsi.program_path)?;
        let errors = self.inject_stage_errors(&graph);
        if errors.is_empty() {
            Ok(graph)
        } else {
            Err(errors)
        }
    }

    /// `[pepsi] INJECT_STAGES` entries that name no stage of `graph`, each an error.
    pub fn inject_stage_errors(&self, graph: &StageGraph) -> Vec<ConfigError> {
        let Some((names, origin)) = &self.pepsi.inject_stages else {
            return Vec::new();
        };
        let mut errors: Vec<ConfigError> = names
            .iter()
            .filter(|name| !graph.contains(name))
            .map(|name| ConfigError {
                section: Some(fixed::INJECT_STAGES.section.into()),
                key: Some(fixed::INJECT_STAGES.name.into()),
                ..ConfigError::at(
                    origin.clone(),
                    format!("names stage {name:?}, which has no [stage-{name}] section"),
                )
            })
            .collect();
        if names.is_empty() {
            errors.push(ConfigError {
                section: Some(fixed::INJECT_STAGES.section.into()),
                key: Some(fixed::INJECT_STAGES.name.into()),
                ..ConfigError::at(
                    origin.clone(),
                    "names no stage (leave it out for the stages no stage routes to)",
                )
            });
        }
        errors
    }

    /// The stages an injecting role may inject into with `graph` (§4
    /// "Containment"): `[pepsi] INJECT_STAGES`, else the graph's entry stages but the
    /// failure bouncer's `BOUNCE_STAGE` (a notification is made there, never injected).
    pub fn inject_stages(&self, graph: &StageGraph) -> Vec<String> {
        match &self.pepsi.inject_stages {
            Some((names, _)) => names.clone(),
            None => graph
                .entry_stages()
                .into_iter()
                .filter(|s| Some(*s) != self.bouncer.bounce_stage.as_deref())
                .map(str::to_string)
                .collect(),
        }
    }

    /// The file's stage sections with `overlay` laid over them, under this file's
    /// `[pepsi] PROGRAM_PATH`, before their values are checked.
    pub fn lay_over(&self, overlay: &[graph::OverrideRow]) -> graph::LaidOver {
        graph::lay_over(&self.stage_sections, overlay, &self.pepsi.program_path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(text: &str) -> Result<Config, Vec<ConfigError>> {
        let path = PathBuf::from("/t.conf");
        Config::from_sections(path.clone(), raw::parse(&path, text)?)
    }

    #[test]
    fn target_session_attrs_primary_is_taken_and_a_reading_one_refused_by_name() {
        let c = cfg("[pepsi-postgres]\nCONNECTION = host=/s1,/s2 port=5521,5522 target_session_attrs=primary\n").unwrap();
        assert!(
            c.postgres
                .connection_for(DbRole::Dispatch)
                .contains("primary")
        );
        let text = |conf: &str| {
            cfg(conf)
                .unwrap_err()
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n")
        };
        let e =
            text("[pepsi-postgres]\nWORKER_CONNECTION = host=/s target_session_attrs=standby\n");
        assert!(
            e.contains("/t.conf:2: [pepsi-postgres] WORKER_CONNECTION: target_session_attrs=standby: every Pepsi program writes"),
            "{e}"
        );
        let e = text("[pepsi-postgres]\nCONNECTION = host=/s port=x\n");
        assert!(
            e.contains("invalid value for option `port`"),
            "the library's words: {e}"
        );
    }

    #[test]
    fn defaults_for_every_key() {
        let c = cfg("").unwrap();
        assert!(c.pepsi.allow_fusion);
        assert!(!c.pepsi.share_telemetry);
        assert_eq!(c.pepsi.run_as, "pepsi");
        assert_eq!(c.postgres.connection, DEFAULT_CONNECTION);
        assert!(!c.postgres.worker_synchronous_commit);
        assert_eq!(c.dispatch.max_runtime, Duration::from_secs(300));
        assert_eq!(c.dispatch.worker_idle_timeout, Duration::from_secs(5));
        assert_eq!(c.dispatch.poll_interval, Duration::from_secs(30));
        assert_eq!(c.dispatch.stats_interval, Duration::from_secs(10));
        assert_eq!(c.dispatch.max_hops, 100);
        assert_eq!(c.dispatch.db_pool_size, 8);
        assert_eq!(c.dispatch.config_file, None);
        assert!(c.dispatch.fair_scheduling);
        assert_eq!(c.dispatch.fair_half_life, Duration::from_secs(60));
        assert_eq!(c.dispatch.fair_fifo_percent, 10);
        assert_eq!(c.bouncer.bounce_stage, None);
        assert_eq!(c.pepsi.hostname, host_name());
        assert!(!c.pepsi.hostname.is_empty());
        assert_eq!(c.pepsi.program_path.to_string(), "builtin:/usr/lib/pepsi");
        assert_eq!(c.pepsi.inject_stages, None);
    }

    #[test]
    fn program_path_is_read_and_checked_with_file_and_line() {
        let c = cfg("[pepsi]\nPROGRAM_PATH = /usr/bin:/srv/pepsi/bin/\n").unwrap();
        assert_eq!(c.pepsi.program_path.to_string(), "/usr/bin:/srv/pepsi/bin");
        let c = cfg("[pepsi]\nPROGRAM_PATH = none\n").unwrap();
        assert_eq!(c.pepsi.program_path, ProgramPath::none());
        let errs = cfg("[pepsi]\nRUN_AS = root\nPROGRAM_PATH = /usr/bin:bin\n").unwrap_err();
        assert!(
            errs[0]
                .to_string()
                .starts_with("/t.conf:3: [pepsi] PROGRAM_PATH: \"bin\" is not a directory for it"),
            "{}",
            errs[0]
        );
    }

    #[test]
    fn inject_stages_default_to_the_entry_stages_but_the_bounce_stage() {
        let pipe = "[pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n\
                    [stage-in]\nPROGRAM = p\nNEXT = out\n[stage-out]\nPROGRAM = p\n\
                    [stage-bounce]\nPROGRAM = p\nNEXT = out\n[stage-side]\nPROGRAM = p\n";
        let c = cfg(pipe).unwrap();
        let g = c.file_graph().unwrap();
        assert_eq!(c.inject_stages(&g), ["in", "side"]);
        let c = cfg(&format!("[pepsi]\nINJECT_STAGES = in, out\n{pipe}")).unwrap();
        assert_eq!(c.inject_stages(&c.file_graph().unwrap()), ["in", "out"]);
        let c = cfg(&format!("[pepsi]\nINJECT_STAGES = in nowhere\n{pipe}")).unwrap();
        let errs = c.file_graph().unwrap_err();
        assert_eq!(
            errs[0].to_string(),
            "/t.conf:2: [pepsi] INJECT_STAGES: names stage \"nowhere\", which has no [stage-nowhere] section"
        );
    }

    #[test]
    fn a_host_name_is_checked() {
        let c = cfg("[pepsi]\nHOSTNAME = mail.example.org.\n").unwrap();
        assert_eq!(c.pepsi.hostname, "mail.example.org");
        for bad in [
            "mail example",
            "-x.example",
            "a..b",
            "mäil.example",
            "x_y.example",
        ] {
            let errs = cfg(&format!("[pepsi]\nHOSTNAME = {bad}\n")).unwrap_err();
            assert!(
                errs[0]
                    .to_string()
                    .starts_with("/t.conf:2: [pepsi] HOSTNAME:"),
                "{bad}: {}",
                errs[0]
            );
        }
    }

    #[test]
    fn values_are_read() {
        let c = cfg("[pepsi]\nALLOW_FUSION = off\nRUN_AS = root\n[pepsi-dispatch]\nMAX_RUNTIME = 2m\nCONFIG_FILE = /etc/x.conf\n[pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n").unwrap();
        assert!(!c.pepsi.allow_fusion);
        assert_eq!(c.pepsi.run_as, "root");
        assert_eq!(c.dispatch.max_runtime, Duration::from_secs(120));
        assert_eq!(c.dispatch.config_file, Some(PathBuf::from("/etc/x.conf")));
        assert_eq!(c.bouncer.bounce_stage.as_deref(), Some("bounce"));
        assert_eq!(
            c.bouncer.origin.map(|o| o.to_string()).as_deref(),
            Some("/t.conf:8")
        );
    }

    #[test]
    fn all_value_errors_are_reported_together() {
        let errs = cfg("[pepsi]\nALLOW_FUSION = perhaps\n[pepsi-dispatch]\nMAX_RUNTIME = 0s\nDB_POOL_SIZE = 0\nFAIR_FIFO_PERCENT = 150\n").unwrap_err();
        let text = raw::join_errors(&errs);
        assert_eq!(errs.len(), 4, "{text}");
        assert!(text.contains("/t.conf:2: [pepsi] ALLOW_FUSION:"));
        assert!(
            text.contains("/t.conf:4: [pepsi-dispatch] MAX_RUNTIME: must be greater than zero")
        );
        assert!(text.contains("/t.conf:5: [pepsi-dispatch] DB_POOL_SIZE:"));
        assert!(
            text.contains(
                "/t.conf:6: [pepsi-dispatch] FAIR_FIFO_PERCENT: \"150\" is above the maximum 100"
            ),
            "{text}"
        );
    }

    #[test]
    fn unknown_sections_and_keys_are_warnings_with_the_nearest_name() {
        let c = cfg("[pepsi]\nRUN_AS = root\nALLOW_FUSON = no\nMAX_RUNTIME = 5s\n[pepsi-dispath]\nX = 1\n[pepsi-dispatch]\nMAX_HOP = 5\nCOLOUR = red\n[stage-a]\nPARALLELSIM = 4\n").unwrap();
        let text: Vec<String> = c.warnings.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "/t.conf:3: [pepsi] ALLOW_FUSON: unknown key, ignored; did you mean ALLOW_FUSION?",
                "/t.conf:4: [pepsi] MAX_RUNTIME: unknown key, ignored; MAX_RUNTIME belongs in [pepsi-dispatch]",
                "/t.conf:5: [pepsi-dispath] unknown section, ignored (a stage is [stage-NAME]); did you mean [pepsi-dispatch]?",
                "/t.conf:9: [pepsi-dispatch] COLOUR: unknown key, ignored",
                "/t.conf:8: [pepsi-dispatch] MAX_HOP: unknown key, ignored; did you mean MAX_HOPS?",
            ],
            "stage sections are the stage graph's to check"
        );
        assert!(c.pepsi.allow_fusion, "the misspelt key is not read");
    }

    #[test]
    fn each_program_connection_falls_back_to_connection() {
        let c = cfg("[pepsi-postgres]\nCONNECTION = dbname=q user=owner\nWORKER_CONNECTION = dbname=q user=w\nINJECT_CONNECTION = dbname=q user=i\n").unwrap();
        let pg = &c.postgres;
        assert_eq!(pg.connection_for(DbRole::Worker), "dbname=q user=w");
        assert_eq!(pg.connection_for(DbRole::Inject), "dbname=q user=i");
        assert_eq!(pg.connection_for(DbRole::Dispatch), "dbname=q user=owner");
        assert_eq!(pg.connection_for(DbRole::Admin), "dbname=q user=owner");
        assert_eq!(
            pg.key_for(DbRole::Worker),
            "[pepsi-postgres] WORKER_CONNECTION"
        );
        assert_eq!(pg.key_for(DbRole::Admin), "[pepsi-postgres] CONNECTION");
        let d = cfg("").unwrap();
        for role in DbRole::ALL {
            assert_eq!(d.postgres.connection_for(role), DEFAULT_CONNECTION);
        }
        let errs = cfg("[pepsi-postgres]\nADMIN_CONNECTION = host='open\n").unwrap_err();
        assert!(
            errs[0]
                .to_string()
                .starts_with("/t.conf:2: [pepsi-postgres] ADMIN_CONNECTION: is not a valid"),
            "{}",
            errs[0]
        );
    }

    #[test]
    fn a_bad_connection_string_is_named() {
        let errs = cfg("[pepsi-postgres]\nCONNECTION = host='unterminated\n").unwrap_err();
        assert!(
            errs[0]
                .to_string()
                .starts_with("/t.conf:2: [pepsi-postgres] CONNECTION:")
        );
    }
}
