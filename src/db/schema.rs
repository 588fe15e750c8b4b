//! The schema files embedded at build time, this release's version and digest, the
//! start-up check every program runs, and the installer behind `pepsi-setup schema`
//! (§3).
//!
//! The version is the number of the last file; the digest of version `n` is a SHA-256
//! over the names and bytes of files `1..=n`, so an older database can be checked
//! against the prefix of this release's files before it is upgraded.
//!
//! The installer also sets up the database roles (§4 "Least privilege") on every
//! run, after the files: roles are cluster-wide and may be created by an administrator
//! after the schema, so that step is not a file applied once but `pepsi.setup_roles()`
//! (schema 7), called each time in the same transaction; so is the revocation of
//! PUBLIC's right to create in the `public` schema (§4 "Containment").
//!
//! Called by `pepsi-setup` ([`install`]) and by every program at start ([`check`]);
//! it runs the embedded files and the statements of [`super::sql`], and knows nothing
//! of the configuration.
//!
//! # Adding a migration
//!
//! A new file `schema/NNN_verb_noun.sql` (the next number) and one
//! `migration!("NNN_verb_noun.sql")` line at the end of [`FILES`]; nothing else here.
//! A released file is never edited, not even its comments: its bytes are in the digest
//! every installed database stores. A migration that adds a function some role calls
//! also, in its own file:
//!
//! - declares it with `SET search_path = pg_catalog, pg_temp` and writes every name in
//!   it schema-qualified (`pepsi.workqueue`), as every function of the schema does (a
//!   test checks them all, §4 "Containment");
//! - grants it by inserting rows into `pepsi.role_grants`, e.g. `INSERT INTO
//!   pepsi.role_grants (role, privilege, object) VALUES ('pepsi_admin', 'EXECUTE',
//!   'FUNCTION pepsi.f(bigint)');` — never a `GRANT` of its own: `pepsi.setup_roles()`,
//!   which `pepsi-setup` runs after the files on every run, revokes everything and
//!   grants exactly those rows, also to a role an administrator creates later.
//!
//! The program's side of it is a named statement in `db/sql.rs`.

use std::fmt;

use crate::db::Client;
use postgres::error::SqlState;

use sha2::{Digest, Sha256};

use super::sql;

/// One embedded schema file.
pub struct SchemaFile {
    /// The number in its name (`001_…` is 1).
    pub number: i32,
    /// The file name under `schema/`.
    pub name: &'static str,
    /// Its SQL.
    pub sql: &'static str,
}

/// The number a schema file's name starts with (`010_containment.sql` is 10), worked
/// out while compiling: a name without leading digits and `_` does not build.
const fn number_of(name: &str) -> i32 {
    let bytes = name.as_bytes();
    let mut i = 0;
    let mut number = 0;
    while i < bytes.len() && bytes[i].is_ascii_digit() {
        number = number * 10 + (bytes[i] - b'0') as i32;
        i += 1;
    }
    assert!(
        i > 0 && i < bytes.len() && bytes[i] == b'_',
        "a schema file's name is NNN_verb_noun.sql"
    );
    number
}

/// A [`SchemaFile`] from its name alone: its number from the name, its SQL embedded
/// from `schema/` under that name.
macro_rules! migration {
    ($name:literal) => {
        SchemaFile {
            number: number_of($name),
            name: $name,
            sql: include_str!(concat!("../../schema/", $name)),
        }
    };
}

/// Every schema file, in order, one line each. A test checks this list against the
/// folder.
pub const FILES: &[SchemaFile] = &[
    migration!("001_create_queue.sql"),
    migration!("002_claim_tokens.sql"),
    migration!("003_hops_and_poison.sql"),
    migration!("004_fair_claim.sql"),
    migration!("005_failure_path.sql"),
    migration!("006_operator_api.sql"),
    migration!("007_roles.sql"),
    migration!("008_sender_key_plpgsql.sql"),
    migration!("009_fair_claim_small_stages.sql"),
    migration!("010_containment.sql"),
    migration!("011_ingress.sql"),
    migration!("012_relay_verdict.sql"),
    migration!("013_claim_floors.sql"),
    migration!("014_claim_proof.sql"),
    migration!("015_hardening.sql"),
    migration!("016_writes_by_id.sql"),
    migration!("017_prepended_headers.sql"),
    migration!("018_claim_sweep.sql"),
    migration!("019_ingress_tls.sql"),
    migration!("020_stage_events.sql"),
    migration!("021_destinations.sql"),
    migration!("022_history.sql"),
    migration!("023_claim_take.sql"),
    migration!("024_claim_one_sender.sql"),
    migration!("025_tenants.sql"),
    migration!("026_claim_tenant_walk.sql"),
];

/// The advisory lock key `pepsi-setup` holds while it installs (a transaction lock).
pub const SETUP_LOCK_KEY: i64 = 0x7065_7073_6953_6574; // "pepsiSet"

/// This release's schema version.
pub fn version() -> i32 {
    FILES.last().map_or(0, |f| f.number)
}

/// The digest of the files up to and including version `upto`.
pub fn digest(upto: i32) -> String {
    let mut h = Sha256::new();
    for f in FILES.iter().filter(|f| f.number <= upto) {
        // Each file as its name, a NUL, its length (64 bits, big-endian) and its bytes:
        // no two lists of files feed the hash the same bytes.
        h.update(f.name.as_bytes());
        h.update([0]);
        h.update((f.sql.len() as u64).to_be_bytes());
        h.update(f.sql.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// How the database's schema differs from this release's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// No Pepsi schema at all.
    NotInstalled,
    /// The database is at an older version.
    Older {
        /// The database's version.
        database: i32,
    },
    /// The database is at a newer version.
    Newer {
        /// The database's version.
        database: i32,
    },
    /// The same (or a prefix) version, built from other files.
    OtherFiles {
        /// The database's version.
        database: i32,
        /// The database's digest.
        digest: String,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ours = version();
        match self {
            Mismatch::NotInstalled => write!(
                f,
                "the Pepsi schema is not installed in this database (this release needs version {ours}): run pepsi-setup schema"
            ),
            Mismatch::Older { database } => write!(
                f,
                "the database schema is older (version {database}) than this release's (version {ours}): run pepsi-setup schema"
            ),
            Mismatch::Newer { database } => write!(
                f,
                "the database schema is newer (version {database}) than this release's (version {ours}): this binary is older than the database schema; install the matching release"
            ),
            Mismatch::OtherFiles { database, digest } => write!(
                f,
                "the database schema (version {database}, digest {digest}) was built from other files than this release's (digest {}): it belongs to another build; install the matching release",
                super::schema::digest(*database)
            ),
        }
    }
}

/// A failure of the check or the installer.
#[derive(Debug)]
pub enum SchemaError {
    /// The database's schema does not match this release.
    Mismatch(Mismatch),
    /// The database failed.
    Db(postgres::Error),
}

impl fmt::Display for SchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SchemaError::Mismatch(m) => m.fmt(f),
            SchemaError::Db(e) => write!(
                f,
                "database error while checking the schema: {}",
                super::describe(e)
            ),
        }
    }
}

impl From<postgres::Error> for SchemaError {
    fn from(e: postgres::Error) -> Self {
        SchemaError::Db(e)
    }
}

/// Compares an installed (version, digest) with this release.
pub fn compare(installed: Option<(i32, String)>) -> Result<(), Mismatch> {
    let Some((database, digest_db)) = installed else {
        return Err(Mismatch::NotInstalled);
    };
    let ours = version();
    if database > ours {
        return Err(Mismatch::Newer { database });
    }
    if digest(database) != digest_db {
        return Err(Mismatch::OtherFiles {
            database,
            digest: digest_db,
        });
    }
    if database < ours {
        return Err(Mismatch::Older { database });
    }
    Ok(())
}

/// Reads the installed (version, digest), `None` when there is no schema.
fn installed(
    client: &mut impl crate::db::Queries,
) -> Result<Option<(i32, String)>, postgres::Error> {
    match client.query_opt(sql::READ_SCHEMA_VERSION, &[]) {
        Ok(row) => Ok(row.map(|r| (r.get(0), r.get(1)))),
        Err(e)
            if e.code() == Some(&SqlState::UNDEFINED_TABLE)
                || e.code() == Some(&SqlState::INVALID_SCHEMA_NAME) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The start-up check every program runs (one round trip).
pub fn check(client: &mut impl crate::db::Queries) -> Result<(), SchemaError> {
    compare(installed(client)?).map_err(SchemaError::Mismatch)
}

/// What `pepsi-setup schema` did.
#[derive(Debug, PartialEq, Eq)]
pub enum Installed {
    /// A fresh install at this version.
    Fresh(i32),
    /// An upgrade from the first version to the second.
    Upgraded(i32, i32),
    /// Nothing to do.
    UpToDate(i32),
}

/// What `pepsi.setup_roles()` found or did for one group role.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoleStatus {
    /// The group role (`pepsi_dispatch`, `pepsi_worker`, `pepsi_admin`, `pepsi_inject`).
    pub role: String,
    /// `created`, `present` (both: granted its privileges) or `missing` (it does not
    /// exist and the session may not create roles: nothing granted).
    pub status: String,
}

impl RoleStatus {
    /// Does the role exist now (so it holds its privileges)?
    pub fn exists(&self) -> bool {
        self.status != "missing"
    }
}

/// Whether PUBLIC may create objects in the database's `public` schema (the default of
/// PostgreSQL 14 and older), where an operator or function planted by any role would be
/// found by sessions that resolve names through the default `search_path`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublicSchema {
    /// PUBLIC may not create there (or there is no `public` schema).
    Closed,
    /// PUBLIC could; `pepsi-setup` revoked it in this run.
    Revoked,
    /// PUBLIC can, and this session may not revoke it (the schema belongs to another
    /// role): a superuser must.
    StillOpen,
}

/// What `pepsi-setup schema` did: the schema, then the roles.
#[derive(Debug, PartialEq, Eq)]
pub struct Setup {
    /// The schema files.
    pub installed: Installed,
    /// Each group role, in the order `pepsi.setup_roles()` reports them.
    pub roles: Vec<RoleStatus>,
    /// The `public` schema, after this run.
    pub public_schema: PublicSchema,
}

/// Installs or upgrades the schema in one transaction under an advisory lock, then
/// sets up the database roles in the same transaction (every run, also when the
/// schema is up to date).
pub fn install(client: &mut Client) -> Result<Setup, SchemaError> {
    let mut tx = client.transaction()?;
    tx.execute(sql::SETUP_LOCK, &[&SETUP_LOCK_KEY])?;
    let exists: bool = tx.query_one(sql::SCHEMA_VERSION_EXISTS, &[])?.get(0);
    let current = if exists { installed(&mut tx)? } else { None };
    let from = match compare(current) {
        Ok(()) => version(),
        Err(Mismatch::NotInstalled) => 0,
        Err(Mismatch::Older { database }) => database,
        Err(m) => return Err(SchemaError::Mismatch(m)),
    };
    for file in FILES.iter().filter(|f| f.number > from) {
        tx.batch_execute(file.sql).inspect_err(|e| {
            log::error!("schema file {} failed: {}", file.name, super::describe(e));
        })?;
    }
    if from < version() {
        tx.execute(sql::WRITE_SCHEMA_VERSION, &[&version(), &digest(version())])?;
    }
    let roles = tx
        .query(sql::SETUP_ROLES, &[])
        .inspect_err(|e| {
            log::error!(
                "setting up the database roles failed: {}",
                super::describe(e)
            )
        })?
        .iter()
        .map(|r| RoleStatus {
            role: r.get(0),
            status: r.get(1),
        })
        .collect();
    // No role may create where every session would find its objects (§4
    // "Containment"). A REVOKE the session has no right to is only a warning of the
    // server's, so the state is read again afterwards.
    let public_schema = if tx.query_one(sql::PUBLIC_SCHEMA_OPEN, &[])?.get(0) {
        tx.batch_execute(sql::CLOSE_PUBLIC_SCHEMA)?;
        if tx.query_one(sql::PUBLIC_SCHEMA_OPEN, &[])?.get(0) {
            PublicSchema::StillOpen
        } else {
            PublicSchema::Revoked
        }
    } else {
        PublicSchema::Closed
    };
    tx.commit()?;
    let installed = if from == version() {
        Installed::UpToDate(version())
    } else if from == 0 {
        Installed::Fresh(version())
    } else {
        Installed::Upgraded(from, version())
    };
    Ok(Setup {
        installed,
        roles,
        public_schema,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_list_matches_the_schema_folder() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/schema");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        on_disk.sort();
        let embedded: Vec<&str> = FILES.iter().map(|f| f.name).collect();
        assert_eq!(on_disk, embedded);
        for (i, f) in FILES.iter().enumerate() {
            assert_eq!(f.number, i as i32 + 1, "{} is out of sequence", f.name);
            assert!(f.name.starts_with(&format!("{:03}_", f.number)));
            let text = std::fs::read_to_string(format!("{dir}/{}", f.name)).unwrap();
            assert_eq!(text, f.sql, "{} differs from what is embedded", f.name);
        }
    }

    #[test]
    fn compare_names_each_case() {
        let v = version();
        assert_eq!(compare(Some((v, digest(v)))), Ok(()));
        assert_eq!(compare(None), Err(Mismatch::NotInstalled));
        assert_eq!(
            compare(Some((v + 1, "x".into()))),
            Err(Mismatch::Newer { database: v + 1 })
        );
        assert!(matches!(
            compare(Some((v, "x".into()))),
            Err(Mismatch::OtherFiles { .. })
        ));
        assert_eq!(
            compare(Some((0, digest(0)))),
            Err(Mismatch::Older { database: 0 })
        );
    }

    #[test]
    fn the_digest_is_stable_and_depends_on_the_files() {
        assert_eq!(digest(version()), digest(version()));
        assert_ne!(digest(version()), digest(0));
        assert_eq!(digest(version()).len(), 64);
    }

    #[test]
    fn the_digests_of_released_versions_never_change() {
        // Databases store these (pepsi.schema_version): a change of the hash or of how
        // the files are fed to it would make every installed schema "built from other
        // files".
        assert_eq!(
            digest(0),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            digest(1),
            "f4cb88d4442efa6d95fa7b6c8842e7068d5795e61179f20553b7a3efe5cde982"
        );
        assert_eq!(
            digest(10),
            "a6600fa7ddf4e5fcdcfd4fbfb0305982be34e96f7bcbbe6b9204856a7912b909"
        );
    }
}
