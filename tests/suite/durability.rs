//! `SYNCHRONOUS_COMMIT` (§12.2): each stage's outcomes commit at its level, a
//! worker that may fuse into a stage commits at the strongest level of the stages it
//! runs, and the dispatcher's own queue writes at `[pepsi-dispatch]`'s. Seen from the
//! database: a trigger records, with every queue write, the `synchronous_commit` of the
//! session that makes it.

use std::time::Duration;

use crate::util::dispatcher::Dispatcher;
use crate::util::rows::{count, inject_many, wait_empty};
use crate::util::scenario::conf;
use crate::util::{TempDir, TestDb, bin, run, stderr};

const SEC: Duration = Duration::from_secs(1);

/// Records each claim (`claim`) and each stage outcome (`outcome`, the stage left) with
/// the writing session's `synchronous_commit`.
const RECORD_LEVELS: &str = "
CREATE TABLE public.levels (kind text NOT NULL, stage text NOT NULL, level text NOT NULL);
CREATE FUNCTION public.record_level() RETURNS trigger LANGUAGE plpgsql
    SET search_path = public, pg_catalog AS $$
BEGIN
    IF TG_OP = 'DELETE' OR NEW.stage IS DISTINCT FROM OLD.stage THEN
        INSERT INTO public.levels VALUES ('outcome', OLD.stage, current_setting('synchronous_commit'));
    ELSIF NEW.status = 'running' AND NEW.claim IS DISTINCT FROM OLD.claim THEN
        INSERT INTO public.levels VALUES ('claim', NEW.stage, current_setting('synchronous_commit'));
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER record_level AFTER UPDATE OR DELETE ON pepsi.workqueue
    FOR EACH ROW EXECUTE FUNCTION public.record_level();
";

/// The distinct levels of `kind` writes at `stage`.
fn levels(c: &mut postgres::Client, kind: &str, stage: &str) -> Vec<String> {
    c.query(
        "SELECT DISTINCT level FROM public.levels WHERE kind = $1 AND stage = $2 ORDER BY 1",
        &[&kind, &stage],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[test]
fn each_stage_commits_at_its_level_a_fusing_worker_at_the_strongest_and_claims_at_the_dispatchers()
{
    let db = TestDb::new();
    let dir = TempDir::new("durability");
    // a → b unfused: each commits at its own level. x fuses into y, so x's worker
    // records y's outcome too and commits at y's level.
    let conf = conf(
        &dir,
        &db,
        "SYNCHRONOUS_COMMIT = local",
        "[stage-a]\nPROGRAM = {pass}\nNEXT = b\nFUSION = no\n\n\
         [stage-b]\nPROGRAM = {discard}\nSYNCHRONOUS_COMMIT = on\nFUSION = no\n\n\
         [stage-x]\nPROGRAM = {pass}\nNEXT = y\n\n\
         [stage-y]\nPROGRAM = {discard}\nSYNCHRONOUS_COMMIT = Remote_Write\n",
    );
    let mut c = db.client();
    c.batch_execute(RECORD_LEVELS).unwrap();
    inject_many(&mut c, "a", "a@x.example", 20);
    inject_many(&mut c, "x", "x@x.example", 20);
    let mut d = Dispatcher::start(&conf, &[]);
    wait_empty(&mut c, 60 * SEC);
    assert!(d.terminate().success(), "{}", d.log());
    assert_eq!(levels(&mut c, "outcome", "a"), ["off"]);
    assert_eq!(levels(&mut c, "outcome", "b"), ["on"]);
    assert_eq!(levels(&mut c, "outcome", "x"), ["remote_write"]);
    for stage in ["a", "b", "x"] {
        assert_eq!(
            levels(&mut c, "claim", stage),
            ["local"],
            "claims at {stage}"
        );
    }
    // Nothing was claimed at y: x's workers ran it fused.
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM public.levels WHERE stage = 'y'"
        ),
        0
    );
}

#[test]
fn an_unknown_level_is_an_error_naming_the_file_line_and_the_levels() {
    let db = TestDb::new();
    let dir = TempDir::new("durability-check");
    let conf = conf(
        &dir,
        &db,
        "SYNCHRONOUS_COMMIT = always",
        "[stage-a]\nPROGRAM = {pass}\nSYNCHRONOUS_COMMIT = on; DROP TABLE x\n",
    );
    let out = run(
        &bin("pepsi-dispatch"),
        &["-c", conf.to_str().unwrap(), "check"],
    );
    let err = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    assert_ne!(out.status.code(), Some(0), "{err}");
    let text = std::fs::read_to_string(&conf).unwrap();
    let line_of = |needle: &str| {
        text.lines()
            .position(|l| l.contains(needle))
            .map(|i| i + 1)
            .unwrap()
    };
    for (needle, section, value) in [
        (
            "= always",
            "[pepsi-dispatch] SYNCHRONOUS_COMMIT",
            "\"always\"",
        ),
        (
            "DROP TABLE",
            "[stage-a] SYNCHRONOUS_COMMIT",
            "\"on; DROP TABLE x\"",
        ),
    ] {
        let want = format!(
            "{}:{}: {section}: {value} is not a synchronous_commit level (one of off, local, remote_write, on, remote_apply)",
            conf.display(),
            line_of(needle)
        );
        assert!(err.contains(&want), "{want}\nin\n{err}");
    }
}
