//! The built-in stages (§12.7), compiled into the one unified `pepsi-stage`
//! binary so that they can be fused. Each file is one stage (`dsn.rs` writes the
//! reports `bounce.rs` sends; `sysexits.rs` reads what an `exec.rs` command's exit
//! tells the sender; `read_at_start.rs` keeps what a stage's worker read from files
//! when it started; `relay/`, `dkim/` and `srs/` are stages in folders of their files);
//! [`BUILTINS`]
//! lists them and [`REGISTRY`] hands that
//! list to the worker runtime (`src/bin/pepsi-stage.rs` gives it to
//! `worker::runtime::run`). [`find`] maps a name (`pass` for `pepsi-stage-pass`) to
//! its stage, [`for_program`] a `PROGRAM`, and [`check_section`] checks a section with
//! its built-in's own `configure` — the one check the dispatcher (at start, at a
//! reload, in `pepsi-dispatch check`) and the worker share (§4 "Strictness").
//!
//! Used by `pepsi-stage`, `pepsi-dispatch` (its checks) and `pepsi-queue`. The stages
//! use the worker library (each implements its `Stage`); the worker library never uses
//! this module: what it needs to know of the built-ins it is given as [`REGISTRY`].
//! This file lists and looks up; it must not run a stage nor parse a command line.
//!
//! To add a built-in stage `NAME`:
//! 1. write `src/stages/NAME.rs`: a unit struct implementing `worker::Stage` (its
//!    name, what it loads, its fusion default, its keys and those a correspondent may
//!    override, `configure`), the `worker::Configured` body that `configure` returns,
//!    and its unit tests;
//! 2. add its `pub mod NAME;` and its one line in [`BUILTINS`] here.
//!
//! Nothing else in `src/` reads a stage by name: the worker gets the list through
//! [`REGISTRY`], `pepsi-dispatch check` and `pepsi-queue` read it here, and the
//! package links `/usr/bin/pepsi-stage-NAME` for every name `pepsi-stage list` prints.
//! Its documentation goes in pepsi.conf(5) (its keys) and pepsi-stage(8) (its entry),
//! which `tests/man.rs` holds to [`BUILTINS`]. One copy of the names remains outside:
//! `config::program_path::BUILTIN_STAGES` (what `PROGRAM_PATH`'s `builtin` entry
//! allows), which the test below holds to [`BUILTINS`] until it reads them from here.

pub mod bounce;
pub mod discard;
pub mod dkim;
pub mod dsn;
pub mod exec;
pub mod if_stage;
pub mod internet;
pub mod pass;
pub mod read_at_start;
pub mod relay;
pub mod srs;
pub mod sysexits;

use crate::config::{ConfigError, StageSection};
use crate::worker::{Registry, Stage};

/// Every built-in stage, in the order `pepsi-stage list` prints them.
pub const BUILTINS: &[&dyn Stage] = &[
    &pass::Pass,
    &if_stage::If,
    &discard::Discard,
    &exec::Exec,
    &bounce::Bounce,
    &relay::Relay,
    &internet::RelayToInternet,
    &dkim::DkimSign,
    &srs::SrsStage,
];

/// The built-in stages as the worker runtime takes them.
pub const REGISTRY: Registry = Registry::new(BUILTINS);

/// The built-in stage of this name.
pub fn find(name: &str) -> Option<&'static dyn Stage> {
    REGISTRY.find(name)
}

/// The built-in a `PROGRAM` names by its file name (`pepsi-stage-NAME`, on `PATH` or
/// at any absolute path), whatever binary it resolves to.
pub fn for_program(program: &str) -> Option<&'static dyn Stage> {
    REGISTRY.for_program(program)
}

/// The keys a `PROGRAM`'s built-in declares; `None` for a program that is not a
/// built-in (its options are its own business).
pub fn program_keys(program: &str) -> Option<&'static [&'static str]> {
    for_program(program).map(|b| b.keys())
}

/// The keys of every stage section a `PROGRAM`'s built-in does not read, with why;
/// none for a program that is not a built-in.
pub fn ignored_keys(program: &str) -> &'static [(&'static str, &'static str)] {
    for_program(program).map_or(&[], |b| b.ignored())
}

/// Checks a stage's section exactly as its worker will, with the `configure` of the
/// built-in its `PROGRAM` names; `None` when the program is not a built-in.
pub fn check_section(section: &StageSection) -> Option<Result<(), ConfigError>> {
    for_program(&section.program).map(|b| b.configure(section).map(drop))
}

/// Checks every built-in stage's section of these; every problem.
pub fn check_sections<'a>(
    sections: impl IntoIterator<Item = &'a StageSection>,
) -> Vec<ConfigError> {
    sections
        .into_iter()
        .filter_map(check_section)
        .filter_map(Result::err)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::program_path::{BUILTIN_STAGES, STAGE_PROGRAM_PREFIX};
    use crate::worker::PROGRAM_PREFIX;
    use crate::worker::settings::{self, SettingRow};

    #[test]
    fn program_path_knows_every_built_in_stage_by_its_program_name() {
        let names: Vec<&str> = BUILTINS.iter().map(|s| s.name()).collect();
        assert_eq!(names, BUILTIN_STAGES);
        assert_eq!(STAGE_PROGRAM_PREFIX, PROGRAM_PREFIX);
    }

    #[test]
    fn a_built_in_is_found_by_its_program_on_path_or_at_any_absolute_path() {
        for program in [
            "pepsi-stage-if",
            "/usr/bin/pepsi-stage-if",
            "/opt/x/pepsi-stage-if",
        ] {
            assert_eq!(for_program(program).map(|s| s.name()), Some("if"));
        }
        assert!(for_program("pepsi-stage-nonesuch").is_none());
        assert!(for_program("/usr/lib/pepsi/relay").is_none());
        assert!(
            for_program("if").is_none(),
            "a bare name is no program of it"
        );
        assert_eq!(program_keys("pepsi-stage-pass"), Some(&[][..]));
        assert_eq!(program_keys("/usr/lib/pepsi/relay"), None);
    }

    fn row(address: &str, stage: &str, key: &str) -> SettingRow {
        SettingRow {
            address: address.into(),
            stage: stage.into(),
            key: key.into(),
            value: "v".into(),
        }
    }

    #[test]
    fn each_built_in_declares_its_overridable_keys_and_max_lifetime_is_everyones() {
        let keys = |program: &str| settings::overridable_keys(REGISTRY, program);
        assert_eq!(keys("pepsi-stage-if"), ["MAX_LIFETIME", "MATCH"]);
        assert_eq!(
            keys("/usr/bin/pepsi-stage-exec"),
            ["MAX_LIFETIME", "TIMEOUT"]
        );
        assert_eq!(
            keys("pepsi-stage-bounce"),
            ["MAX_LIFETIME", "BOUNCE_SIZE_LIMIT"]
        );
        assert_eq!(keys("pepsi-stage-pass"), ["MAX_LIFETIME"]);
        assert_eq!(keys("pepsi-stage-discard"), ["MAX_LIFETIME"]);
        assert_eq!(
            keys("/usr/lib/pepsi/relay"),
            ["MAX_LIFETIME"],
            "not a built-in"
        );
    }

    #[test]
    fn no_built_in_declares_a_key_the_common_deny_rule_refuses_or_not_its_own() {
        for stage in BUILTINS {
            for key in stage.overridable() {
                assert!(
                    !settings::never_overridable(key),
                    "pepsi-stage-{} declares {key}",
                    stage.name()
                );
                assert!(
                    stage.keys().contains(key),
                    "pepsi-stage-{} declares {key} overridable but not as its key",
                    stage.name()
                );
            }
        }
    }

    #[test]
    fn a_refused_row_is_named_by_address_stage_and_key() {
        let if_stage = Some("pepsi-stage-if");
        for key in ["PROGRAM", "NEXT", "COMMAND", "PARALLELISM", "ELSE_STAGE"] {
            let e = settings::refusal(REGISTRY, &row("r@y", "route", key), if_stage).unwrap();
            assert_eq!(
                e.to_string(),
                format!(
                    "pepsi.settings for r@y: [stage-route] {key}: {key} is never overridable per address; ignored"
                )
            );
            assert!(
                settings::refusal(REGISTRY, &row("r@y", "gone", key), None).is_some(),
                "refused for a stage without a section too"
            );
        }
        assert_eq!(
            settings::refusal(REGISTRY, &row("r@y", "route", "TIMEOUT"), if_stage)
                .unwrap()
                .to_string(),
            "pepsi.settings for r@y: [stage-route] TIMEOUT: TIMEOUT is not overridable per address at stage route (pepsi-stage-if allows only MAX_LIFETIME, MATCH); ignored"
        );
        let e = settings::refusal(
            REGISTRY,
            &row("r@y", "relay", "SMARTHOST"),
            Some("/usr/lib/pepsi/relay"),
        )
        .unwrap()
        .to_string();
        assert!(
            e.contains("relay is not a built-in stage, which allows only MAX_LIFETIME"),
            "{e}"
        );
        assert_eq!(
            settings::refusal(REGISTRY, &row("r@y", "route", "MATCH"), if_stage),
            None
        );
        assert_eq!(
            settings::refusal(REGISTRY, &row("r@y", "route", "MAX_LIFETIME"), if_stage),
            None
        );
        assert_eq!(
            settings::refusal(
                REGISTRY,
                &row("r@y", "relay", "TIMEOUT"),
                Some("/usr/bin/pepsi-stage-exec")
            ),
            None
        );
        assert_eq!(
            settings::refusal(
                REGISTRY,
                &row("r@y", "relay", "MAX_LIFETIME"),
                Some("/usr/lib/pepsi/relay")
            ),
            None
        );
        assert_eq!(
            settings::refusal(REGISTRY, &row("r@y", "gone", "TIMEOUT"), None),
            None,
            "a stage without a section: only the common rule"
        );
    }
}
