//! The opening most integration tests share, as a builder: a fresh database, a private
//! temporary directory, a configuration file with the test's sections (the built-in
//! stage programs and the fault worker written as `{pass}`, `{if}`, `{discard}`,
//! `{exec}`, `{bounce}`, `{fault}`), then a client and, when asked, a running
//! dispatcher.
//!
//! ```ignore
//! let (s, mut c) = Scenario::new("d-crash")
//!     .timers("")
//!     .stages("[stage-s]\nPROGRAM = {fault}\nQUEUE_LIMIT = 4\n")
//!     .connect();
//! let id = inject_fault(&mut c, "s", "crash");
//! let mut d = s.start();
//! ```
//!
//! It writes the file as the suites always wrote it ([`write_config`]: `[pepsi]
//! RUN_AS = root`, the connection, then the sections), so a test converted to it runs
//! on the same bytes. It decides nothing about what a test does next: it injects no
//! message and starts the dispatcher only through [`Scenario::start`].

use std::path::{Path, PathBuf};

use postgres::Client;

use super::dispatcher::{Dispatcher, fault_worker};
use super::{TempDir, TestDb, stage, write_config};

/// The `[pepsi-dispatch]` timers the tests run with: short enough that idle workers,
/// polls and flushes happen within a test, long enough not to get in its way.
const TEST_TIMERS: &[(&str, &str)] = &[
    ("POLL_INTERVAL", "1s"),
    ("STATS_INTERVAL", "60s"),
    ("WORKER_IDLE_TIMEOUT", "1s"),
    ("MAX_RUNTIME", "30s"),
];

/// `text` with `{pass}`, `{if}`, `{discard}`, `{exec}` and `{bounce}` replaced by the
/// built-in stage programs and `{fault}` by the fault worker (built on first use).
pub fn programs(text: &str) -> String {
    let mut text = text.to_string();
    for name in [
        "pass",
        "if",
        "discard",
        "exec",
        "bounce",
        "relay",
        "relay-to-internet",
        "dkim-sign",
        "srs",
    ] {
        text = text.replace(&format!("{{{name}}}"), stage(name).to_str().unwrap());
    }
    if text.contains("{fault}") {
        text = text.replace("{fault}", fault_worker().to_str().unwrap());
    }
    text
}

/// The `[pepsi-dispatch]` section with the tests' timers, each `KEY = VALUE` line of
/// `overrides` replacing one or adding one at the end; a blank line after it.
pub fn timers_section(overrides: &str) -> String {
    let mut keys: Vec<(String, String)> = TEST_TIMERS
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for line in overrides.lines().filter(|l| l.contains('=')) {
        let (k, v) = line.split_once('=').unwrap();
        keys.retain(|(key, _)| key != k.trim());
        keys.push((k.trim().to_string(), v.trim().to_string()));
    }
    let mut text = String::from("[pepsi-dispatch]\n");
    for (k, v) in keys {
        text.push_str(&format!("{k} = {v}\n"));
    }
    text.push('\n');
    text
}

/// A configuration file for `db` in `dir`: the `[pepsi-dispatch]` section with the
/// tests' timers overridden by `dispatch` (see [`timers_section`]), then `stages` with
/// its program placeholders replaced (see [`programs`]).
pub fn conf(dir: &TempDir, db: &TestDb, dispatch: &str, stages: &str) -> PathBuf {
    write_config(
        dir,
        db,
        &format!("{}{}", timers_section(dispatch), programs(stages)),
    )
}

/// Adds `lines` (each ending in a line feed) to the `[pepsi]` section of a file
/// [`write_config`] wrote, after its `RUN_AS = root`.
pub fn add_to_pepsi(conf: &Path, lines: &str) {
    let text = std::fs::read_to_string(conf).unwrap().replacen(
        "RUN_AS = root\n",
        &format!("RUN_AS = root\n{lines}"),
        1,
    );
    std::fs::write(conf, text).unwrap();
}

/// Which database a scenario gets.
enum Database {
    /// A fresh database with this release's schema ([`TestDb::new`]).
    Installed,
    /// A fresh database without a schema ([`TestDb::empty`]).
    Empty,
}

/// What a test starts from: its database, its directory and its configuration file.
/// The fields drop in this order: the file's directory before the database, as the
/// suites' locals always did.
pub struct Scenario {
    /// The configuration file, in [`Scenario::dir`].
    pub conf: PathBuf,
    /// The test's private directory.
    pub dir: TempDir,
    /// The test's own database.
    pub db: TestDb,
}

impl Scenario {
    /// A builder for a scenario whose directory is named after `tag`.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(tag: &str) -> Builder {
        Builder {
            dir: TempDir::new(tag),
            database: Database::Installed,
            pepsi: String::new(),
            sections: String::new(),
            stages: String::new(),
        }
    }

    /// A new client of the scenario's database.
    pub fn client(&self) -> Client {
        self.db.client()
    }

    /// Starts `pepsi-dispatch serve` on the configuration.
    pub fn start(&self) -> Dispatcher {
        Dispatcher::start(&self.conf, &[])
    }

    /// Starts `pepsi-dispatch serve` on the configuration with extra environment.
    pub fn start_with(&self, env: &[(&str, &str)]) -> Dispatcher {
        Dispatcher::start(&self.conf, env)
    }
}

/// A [`Scenario`] being described; its directory exists already, its database and
/// file once it is built.
pub struct Builder {
    dir: TempDir,
    database: Database,
    /// Lines for the `[pepsi]` section, after `RUN_AS = root`.
    pepsi: String,
    /// Whole sections before the stages, as written.
    sections: String,
    /// The stage sections (and anything else that follows), placeholders unreplaced.
    stages: String,
}

impl Builder {
    /// The scenario's directory, for files the sections name (scripts, output folders).
    pub fn dir(&self) -> &TempDir {
        &self.dir
    }

    /// A database without the schema, for upgrade and schema-mismatch tests.
    pub fn empty(mut self) -> Builder {
        self.database = Database::Empty;
        self
    }

    /// `lines` (each ending in a line feed) added to the `[pepsi]` section after
    /// `RUN_AS = root`: `ALLOW_FUSION = no`, `HOSTNAME = …`.
    pub fn pepsi(mut self, lines: &str) -> Builder {
        self.pepsi.push_str(lines);
        self
    }

    /// The `[pepsi-dispatch]` section with the tests' timers (`POLL_INTERVAL = 1s`,
    /// `STATS_INTERVAL = 60s`, `WORKER_IDLE_TIMEOUT = 1s`, `MAX_RUNTIME = 30s`), each
    /// `KEY = VALUE` line of `overrides` replacing or adding one (`""` for none).
    pub fn timers(mut self, overrides: &str) -> Builder {
        self.sections.push_str(&timers_section(overrides));
        self
    }

    /// A section `[name]` with `body` (its lines, each ending in a line feed) and a
    /// blank line after it, before the stages.
    pub fn section(mut self, name: &str, body: &str) -> Builder {
        self.sections.push_str(&format!("[{name}]\n{body}\n"));
        self
    }

    /// The stage sections, with `{pass}`, `{if}`, `{discard}`, `{exec}`, `{bounce}` and
    /// `{fault}` standing for the programs (see [`programs`]); called again, appends.
    pub fn stages(mut self, text: &str) -> Builder {
        self.stages.push_str(text);
        self
    }

    /// Makes the database and writes the configuration file.
    pub fn build(self) -> Scenario {
        let db = match self.database {
            Database::Installed => TestDb::new(),
            Database::Empty => TestDb::empty(),
        };
        let conf = write_config(
            &self.dir,
            &db,
            &format!("{}{}", self.sections, programs(&self.stages)),
        );
        if !self.pepsi.is_empty() {
            add_to_pepsi(&conf, &self.pepsi);
        }
        Scenario {
            conf,
            dir: self.dir,
            db,
        }
    }

    /// [`Builder::build`], and a client of the database.
    pub fn connect(self) -> (Scenario, Client) {
        let s = self.build();
        let c = s.client();
        (s, c)
    }
}

/// A configuration in which the dispatcher, started as root, switches to `nobody`
/// (`RUN_AS`), runs its workers as the tests' worker account (`WORKER_AS`,
/// [`super::accounts::worker_account`]) and runs stage `e`, an exec stage whose
/// `command` runs as `daemon` (`USER`): the accounts of production, where the launcher
/// switches. The stage program is a copy of `pepsi-stage` in `dir` (reachable by every
/// account), `dir` itself is searchable by everyone, and the file is `nobody`'s alone
/// to read (and root's). Root only.
pub fn switched_accounts(dir: &TempDir, db: &TestDb, command: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    mode(&dir.0, 0o755);
    let program = dir.path("pepsi-stage-exec");
    std::fs::copy(env!("CARGO_BIN_EXE_pepsi-stage"), &program).unwrap();
    mode(&program, 0o755);
    let conf = conf(
        dir,
        db,
        "",
        &format!(
            "[stage-e]\nPROGRAM = {}\nCOMMAND = {}\nUSER = daemon\n",
            program.display(),
            command.display()
        ),
    );
    // The test cluster trusts its local connections: the workers log in as the
    // tests' role, which the test account would not be by default (its own name).
    let text = std::fs::read_to_string(&conf)
        .unwrap()
        .replace(
            "RUN_AS = root",
            &format!(
                "RUN_AS = nobody\nWORKER_AS = {}",
                super::accounts::worker_account()
            ),
        )
        .replace(
            "[pepsi-postgres]\n",
            &format!(
                "[pepsi-postgres]\nWORKER_CONNECTION = {}\n",
                db.connection()
            ),
        );
    std::fs::write(&conf, text).unwrap();
    let chown = std::process::Command::new("chown")
        .arg("nobody:nogroup")
        .arg(&conf)
        .status()
        .unwrap();
    assert!(chown.success());
    mode(&conf, 0o600);
    conf
}
