//! `pepsi-setup [GLOBAL] schema`: installs or upgrades the database schema (§3).
//!
//! Started as root it switches to the `[pepsi] RUN_AS` account first, like every Pepsi
//! program (so a `CONNECTION` using peer authentication connects as that account, the
//! one that owns the schema), then connects with `[pepsi-postgres] CONNECTION` (never
//! a program's own key: the schema belongs to the owner), applies the missing files
//! and sets up the database roles (§4 "Least privilege"), every run; it says
//! which roles would need `pg_read_all_stats` to name who holds the database's oldest
//! snapshot in full, and grants it to none.

use crate::cli::{Invocation, Program};
use crate::config::Config;
use crate::db::{self, ErrorKind, schema, sql_horizon};
use crate::exit::{self, Failure};

/// The program's description.
pub const PROGRAM: Program = Program {
    name: "pepsi-setup",
    synopsis: "schema",
    about: "Installs or upgrades the Pepsi database schema. Idempotent: a second run does nothing.\n\
            Refuses (exit 78) a schema that is newer than this release or built from other files.",
};

/// Runs `pepsi-setup`.
pub fn run(invocation: Invocation) -> Result<(), Failure> {
    invocation.expect_only(&PROGRAM, &["schema"])?;
    let config = Config::load_or_fail(invocation.globals.config.as_deref())?;
    crate::privilege::drop_to(&config.pepsi.run_as)?;
    let pg = db::connection_config_with(
        &config.postgres.connection,
        "pepsi-setup",
        db::SETUP_STATEMENT_TIMEOUT_OPTION,
    )
    .map_err(|e| Failure::config(format!("[pepsi-postgres] CONNECTION: {}", db::describe(&e))))?;
    // A database out of reach (or that stops answering) is worth trying again: 75.
    let mut client = db::open(&pg).map_err(|e| match e.kind {
        ErrorKind::Connection | ErrorKind::Overload => Failure::new(exit::EX_TEMPFAIL, e.message),
        _ => Failure::general(e.message),
    })?;
    let setup = match schema::install(&mut client) {
        Ok(setup) => setup,
        Err(schema::SchemaError::Mismatch(m)) => return Err(Failure::config(m.to_string())),
        Err(schema::SchemaError::Db(e)) if db::classify(&e) == ErrorKind::Connection => {
            return Err(Failure::new(
                exit::EX_TEMPFAIL,
                format!("the database connection was lost: {}", db::describe(&e)),
            ));
        }
        Err(e) => return Err(Failure::general(e.to_string())),
    };
    match setup.installed {
        schema::Installed::Fresh(v) => log::info!("schema installed at version {v}"),
        schema::Installed::Upgraded(a, b) => {
            log::info!("schema upgraded from version {a} to {b}")
        }
        schema::Installed::UpToDate(v) => log::info!("schema is up to date (version {v})"),
    }
    report_roles(&setup.roles);
    report_read_all_stats(&mut client);
    report_public_schema(setup.public_schema);
    write_inject_stages(&config, &mut client);
    write_tenant_rule(&config, &mut client)?;
    Ok(())
}

/// Writes `[pepsi] TENANT_KEY` (§7 "Tenants"); when it changed, every queue row is
/// keyed again in the same statement.
fn write_tenant_rule(config: &Config, client: &mut crate::db::Client) -> Result<(), Failure> {
    let rule = config.pepsi.tenant_key.as_str();
    let row = client
        .query_one(db::sql_settings::SET_TENANT_RULE, &[&rule])
        .map_err(|e| {
            Failure::general(format!(
                "cannot write [pepsi] TENANT_KEY: {}",
                db::describe(&e)
            ))
        })?;
    match row.get::<_, i64>(0) {
        -1 => log::info!("tenants are keyed by {rule} ([pepsi] TENANT_KEY)"),
        n => log::info!(
            "tenants are keyed by {rule} now ([pepsi] TENANT_KEY): {n} queue rows changed tenant"
        ),
    }
    Ok(())
}

/// Says what became of PUBLIC's right to create in the `public` schema (§4
/// "Containment").
fn report_public_schema(public: schema::PublicSchema) {
    match public {
        schema::PublicSchema::Closed => {}
        schema::PublicSchema::Revoked => log::info!(
            "revoked CREATE on schema public from PUBLIC: no role may plant objects where \
             sessions with the default search_path would find them"
        ),
        schema::PublicSchema::StillOpen => log::warn!(
            "every role may create objects in schema public, and this role may not revoke \
             that; have a superuser run REVOKE CREATE ON SCHEMA public FROM PUBLIC in this \
             database (pepsi-dispatch check reports it until then)"
        ),
    }
}

/// Writes `[pepsi] INJECT_STAGES` of the file's stage graph with the overlay, so that
/// injecting roles may inject before the dispatcher first runs. The dispatcher writes it
/// again at every start and reload; a graph that does not build is its to refuse, so
/// here it is only a warning.
fn write_inject_stages(config: &Config, client: &mut crate::db::Client) {
    let written = db::read_overlay(client)
        .map_err(|e| db::describe(&e))
        .and_then(|overlay| {
            let graph = config
                .graph(&overlay)
                .map_err(|errors| crate::config::raw::join_errors(&errors))?;
            let stages = config.inject_stages(&graph);
            db::write_inject_stages(client, &stages)
                .map(|_| stages)
                .map_err(|e| db::describe(&e))
        });
    match written {
        Ok(stages) => log::info!(
            "stages an injecting role may inject into ([pepsi] INJECT_STAGES): {}",
            if stages.is_empty() {
                "none".to_string()
            } else {
                stages.join(", ")
            }
        ),
        Err(e) => log::warn!(
            "[pepsi] INJECT_STAGES not written (the dispatcher writes it when it starts): {e}"
        ),
    }
}

/// Says what became of the group roles: which were created, which hold their
/// privileges, and which are missing because this session may not create roles. All
/// missing is the one-role setup (the Debian package's default), so it is said calmly;
/// some missing is a split half done, a warning.
fn report_roles(roles: &[schema::RoleStatus]) {
    let names = |f: &dyn Fn(&schema::RoleStatus) -> bool| {
        roles
            .iter()
            .filter(|r| f(r))
            .map(|r| r.role.as_str())
            .collect::<Vec<_>>()
    };
    let created = names(&|r| r.status == "created");
    let granted = names(&|r| r.exists());
    let missing = names(&|r| !r.exists());
    if !created.is_empty() {
        log::info!("database roles created: {}", created.join(", "));
    }
    if !granted.is_empty() {
        log::info!(
            "database roles granted their privileges: {}",
            granted.join(", ")
        );
    }
    if missing.is_empty() {
        return;
    }
    let how = missing
        .iter()
        .map(|r| format!("CREATE ROLE {r} NOLOGIN;"))
        .collect::<Vec<_>>()
        .join(" ");
    let text = format!(
        "database roles {} do not exist, and the role running pepsi-setup may not create \
         roles (it needs CREATEROLE), so their privileges are not granted; for separate \
         roles per program, have a superuser run {how} and run pepsi-setup schema again \
         (doc/roles-and-containment.md, \"Database roles\")",
        missing.join(", ")
    );
    if granted.is_empty() {
        log::info!("{text}; until then every program connects as one role");
    } else {
        log::warn!("{text}");
    }
}

/// Says which of the roles that read who holds the database's oldest snapshot
/// (`pepsi_dispatch`, `pepsi_admin`; in the one-role setup this session's) may not see
/// another role's session in full, and the statement that would let them. It grants
/// nothing itself: `pg_read_all_stats` is a cluster-wide membership that also shows
/// every session's query text, a decision for the server's administrator, not for the
/// setup of one database.
fn report_read_all_stats(client: &mut crate::db::Client) {
    let lacking = client
        .query(sql_horizon::LACKING_READ_ALL_STATS, &[])
        .map(|rows| rows.iter().map(|r| r.get(0)).collect::<Vec<String>>());
    match lacking {
        Ok(roles) if roles.is_empty() => {}
        Ok(roles) => log::info!(
            "{} may not see another role's session in full: the dispatcher's oldest-snapshot \
             warning and pepsi-queue status name such a holder by pid, application, role and \
             age in transactions only; for its state, client and age in time, have a superuser \
             run GRANT pg_read_all_stats TO {} (cluster-wide; it also shows every session's \
             query text; doc/operating.md, \"The oldest snapshot, and pg_dump\")",
            roles.join(", "),
            roles.join(", ")
        ),
        Err(e) => log::warn!(
            "cannot tell which roles may see every session: {}",
            db::describe(&e)
        ),
    }
}
