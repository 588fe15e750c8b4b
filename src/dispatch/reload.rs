//! Hot reload (§9): on `config_changed`, SIGHUP or a (re)connected LISTEN session the
//! loop's housekeeping has the thread pool read the reload's inputs — the overlay
//! (`pepsi.config_override`) and the configuration file — off the loop; with them,
//! [`plan`] decides — keep the graph and retry (the file or overlay cannot be read right
//! now), shut down with exit 78 (the new graph is invalid, or a built-in stage's section
//! is, as its workers would find: routing by one pipeline while new workers run another,
//! or refuse to run, is worse than stopping), nothing to do (nothing workers read
//! changed), or apply (logging the new configuration's warnings): rebuild the stage
//! table and retire every worker. Overlay rows the graph leaves out (a `PROGRAM` the
//! overlay may not set) are logged as errors at every reload, and the rest of the
//! overlay applies. `[pepsi-dispatch]` itself is never reloaded.
//!
//! [`plan`] is pure but for its log lines; the handler `Dispatcher::on_reload_read`,
//! called by the loop's event dispatch, carries the plan out through the verbs of the
//! pools ([`super::pools`]), the housekeeping and the loop. The reload's request state
//! lives in [`super::housekeeping`], not here.

use std::time::{Duration, Instant};

use super::event_loop::Dispatcher;
use super::events::{ReloadFile, ReloadInput};
use crate::check;
use crate::config::raw::join_errors;
use crate::config::{Config, StageGraph};
use crate::exit::Failure;

/// A reload that could not read its inputs is tried again after this.
pub const RELOAD_RETRY: Duration = Duration::from_secs(5);

/// What a reload comes to.
#[derive(Debug)]
pub enum Plan {
    /// The inputs cannot be read right now: keep the current graph and retry.
    Retry(String),
    /// The new configuration is invalid: shut down.
    Fatal(Failure),
    /// Nothing a worker reads changed: keep the workers.
    Unchanged,
    /// A new configuration and stage graph.
    Apply(Box<Config>, StageGraph),
}

/// Lays the overlay the reload read over the file it read (at `current.path`).
pub fn plan(current: &Config, graph: &StageGraph, input: ReloadInput) -> Plan {
    let overlay = match input.overlay {
        Ok(rows) => rows,
        Err(e) => return Plan::Retry(format!("cannot read pepsi.config_override ({e})")),
    };
    let file = match input.file {
        ReloadFile::Parsed(c) => *c,
        // A file that cannot be read right now (replaced, briefly missing) is not a
        // broken configuration: keep the graph and try again, as for the overlay.
        ReloadFile::Unreadable(e) => {
            return Plan::Retry(format!("cannot read {} ({e})", current.path.display()));
        }
        ReloadFile::Invalid(errors) => {
            return Plan::Fatal(Failure::config(format!(
                "the reloaded configuration does not parse; shutting down:\n{}",
                join_errors(&errors)
            )));
        }
    };
    let overlay = &overlay[..];
    let programs = &file.pepsi.program_path;
    check::log_refused_rows(&file.stage_sections, programs, overlay);
    let new_graph = match file.graph(overlay) {
        Ok(g) => g,
        Err(errors) => {
            return Plan::Fatal(Failure::config(format!(
                "the reloaded stage graph is invalid; shutting down:\n{}",
                join_errors(&errors)
            )));
        }
    };
    // Checked as each built-in stage's workers will check it: a section they would
    // refuse stalls its mail as surely as a dangling reference.
    let errors = check::builtin_errors(&new_graph);
    if !errors.is_empty() {
        return Plan::Fatal(Failure::config(format!(
            "the reloaded stage configuration is invalid; shutting down:\n{}",
            join_errors(&errors)
        )));
    }
    // What workers read at start: the stage graph and the file's [pepsi] and
    // [pepsi-postgres].
    if &new_graph == graph && file.pepsi == current.pepsi && file.postgres == current.postgres {
        return Plan::Unchanged;
    }
    for w in file.warnings.iter().chain(&check::graph_warnings(
        &file.stage_sections,
        programs,
        overlay,
        Some(&new_graph),
    )) {
        log::warn!("{w}");
    }
    // [pepsi-dispatch] is not reloaded: the pool and timers were made from it.
    let dispatch = current.dispatch.clone();
    Plan::Apply(Box::new(Config { dispatch, ..file }), new_graph)
}

impl Dispatcher {
    /// The reload's inputs were read: plan and carry it out.
    pub(super) fn on_reload_read(&mut self, input: ReloadInput) {
        self.housekeeping.reload_read();
        // The weights apply whatever the plan: a failed read keeps the last ones (the
        // reload is retried, and reads them again).
        match &input.weights {
            Ok(rows) => {
                log::debug!("fair-share weights read: {} patterns", rows.len());
                self.claim_side.ledger().policy().weights(rows.clone());
            }
            // With the overlay unread too, the retry's warning says why.
            Err(e) if input.overlay.is_ok() => {
                log::warn!("cannot read the fair-share weights (pepsi.fair_weights): {e}");
            }
            Err(_) => {}
        }
        let plan = plan(&self.config, &self.graph, input);
        let settled = matches!(plan, Plan::Unchanged | Plan::Apply(..));
        match plan {
            Plan::Retry(why) => {
                log::warn!(
                    "{why}; keeping the current stage graph and retrying the reload in {}s",
                    RELOAD_RETRY.as_secs()
                );
                self.housekeeping
                    .retry_reload(Instant::now() + RELOAD_RETRY);
            }
            Plan::Fatal(failure) => self.fail(failure),
            Plan::Unchanged => log::debug!("configuration re-read: unchanged"),
            Plan::Apply(config, graph) => self.apply_reload(*config, graph),
        }
        // Also when unchanged: a reload follows every reconnect of the LISTEN session,
        // and the write a database outage lost is made good then.
        if settled {
            let stages = self.config.inject_stages(&self.graph);
            self.housekeeping.inject_stages(stages);
        }
    }

    /// Rebuilds the stage table from a new graph and retires every worker: the next
    /// message claimed runs with the new values. A removed stage's waiting claims go
    /// back; the stage goes when its last worker does.
    fn apply_reload(&mut self, config: Config, graph: StageGraph) {
        log::info!(
            "stage configuration reloaded: {} stages; retiring every worker",
            graph.stages().count()
        );
        let back = self.pools.adopt(&graph);
        self.adopt(config, graph);
        self.requeue(back);
        self.pools.retire_all(self.poll.registry());
        self.pools.drop_removed();
        self.claim_side.want();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::graph::OverrideRow;
    use crate::dispatch::background::read_config_file;

    /// The plan for a reload that read `overlay` and the file as it is now.
    fn plan(current: &Config, graph: &StageGraph, overlay: &[OverrideRow]) -> Plan {
        let input = ReloadInput {
            overlay: Ok(overlay.to_vec()),
            weights: Ok(Vec::new()),
            file: read_config_file(&current.path),
        };
        super::plan(current, graph, input)
    }

    fn config_at(dir: &std::path::Path, text: &str) -> Config {
        let path = dir.join("pepsi.conf");
        std::fs::write(&path, text).unwrap();
        Config::load(Some(&path)).unwrap()
    }

    #[test]
    fn a_reload_keeps_retries_stops_or_applies() {
        let dir = std::env::temp_dir().join(format!("pepsi-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = "[pepsi-dispatch]\nMAX_RUNTIME = 60s\n[stage-a]\nPROGRAM = /bin/true\n";
        let current = config_at(&dir, base);
        let graph = current.file_graph().unwrap();
        assert!(matches!(plan(&current, &graph, &[]), Plan::Unchanged));
        let row = OverrideRow {
            section: "stage-a".into(),
            key: "PARALLELISM".into(),
            value: "2".into(),
        };
        match plan(&current, &graph, std::slice::from_ref(&row)) {
            Plan::Apply(config, new) => {
                assert_eq!(new.get("a").unwrap().parallelism, 2);
                assert_eq!(config.dispatch.max_runtime, Duration::from_secs(60));
            }
            other => panic!("{other:?}"),
        }
        // [pepsi-dispatch] changes alone are not a new configuration for workers, and
        // are never taken over.
        config_at(&dir, &base.replace("60s", "5s"));
        assert!(matches!(plan(&current, &graph, &[]), Plan::Unchanged));
        config_at(&dir, "[stage-a]\nNEXT = nowhere\n");
        assert!(matches!(plan(&current, &graph, &[]), Plan::Fatal(f) if f.code == 78));
        // A built-in stage's section its workers would refuse stops the dispatcher too.
        config_at(&dir, base);
        let bad_match = [
            OverrideRow {
                section: "stage-a".into(),
                key: "PROGRAM".into(),
                value: "/usr/bin/pepsi-stage-if".into(),
            },
            OverrideRow {
                section: "stage-a".into(),
                key: "MATCH".into(),
                value: "sender is x or".into(),
            },
        ];
        match plan(&current, &graph, &bad_match) {
            Plan::Fatal(f) => {
                assert_eq!(f.code, 78);
                assert!(
                    f.message.contains(
                        "pepsi.config_override: [stage-a] MATCH: ends with a dangling \"or\""
                    ),
                    "{}",
                    f.message
                );
            }
            other => panic!("{other:?}"),
        }
        // An overlay PROGRAM outside [pepsi] PROGRAM_PATH is left out, and the rest of
        // the overlay applies.
        let outside = [
            OverrideRow {
                section: "stage-a".into(),
                key: "PROGRAM".into(),
                value: "/tmp/x".into(),
            },
            row.clone(),
        ];
        match plan(&current, &graph, &outside) {
            Plan::Apply(_, new) => {
                assert_eq!(new.get("a").unwrap().program, "/bin/true");
                assert_eq!(new.get("a").unwrap().parallelism, 2);
            }
            other => panic!("{other:?}"),
        }
        // A PROGRAM_PATH the file widens is the file's to widen.
        config_at(&dir, &format!("[pepsi]\nPROGRAM_PATH = /tmp\n{base}"));
        match plan(&current, &graph, &outside) {
            Plan::Apply(_, new) => assert_eq!(new.get("a").unwrap().program, "/tmp/x"),
            other => panic!("{other:?}"),
        }
        // An overlay that cannot be read is not a new configuration either.
        let unread = ReloadInput {
            overlay: Err("the database is away".into()),
            weights: Err("the database is away".into()),
            file: read_config_file(&current.path),
        };
        assert!(matches!(
            super::plan(&current, &graph, unread),
            Plan::Retry(why) if why.contains("pepsi.config_override")
        ));
        std::fs::remove_file(dir.join("pepsi.conf")).unwrap();
        assert!(matches!(plan(&current, &graph, &[]), Plan::Retry(_)));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
