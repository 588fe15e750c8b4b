//! What a new operator met first, each held to what it must be now: a discard is
//! logged (id, sender, recipients, the stage: in the delivery log, or without one in
//! the stage's own log), `check` warns about a key a built-in
//! stage does not read, SIGHUP leaves the failure bouncer running, and `systemctl
//! reload pepsi-dispatch` checks the configuration before it signals the dispatcher.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::util::bouncer::Bouncer;
use crate::util::rows::wait_empty;
use crate::util::scenario::Scenario;
use crate::util::{assert_has, bin, inject, run, stderr, stdout, wait_until};

const WAIT: Duration = Duration::from_secs(20);

#[test]
fn every_discarded_message_is_logged_with_its_id_sender_recipients_and_stage() {
    // With a delivery log: a line per recipient there, as Postfix's discard(8) logs.
    let scenario = Scenario::new("op-discard");
    let maillog = scenario.dir().path("mail.log");
    let (s, mut c) = scenario
        .timers("")
        .pepsi(&format!("DELIVERY_LOG = {}\n", maillog.display()))
        .stages(
            "[stage-filter]\nPROGRAM = {if}\nMATCH = recipient-domain is kept.example\n\
             NEXT = drop\nELSE_STAGE = drop\n\n[stage-drop]\nPROGRAM = {discard}\n",
        )
        .connect();
    let id = inject(
        &mut c,
        "filter",
        "alice@x.example",
        &["bob@y.example", "carol@y.example"],
    );
    let d = s.start();
    wait_empty(&mut c, WAIT);
    wait_until(WAIT, "a delivery log line for each recipient", || {
        std::fs::read_to_string(&maillog).is_ok_and(|t| t.lines().count() >= 2)
    });
    let text = std::fs::read_to_string(&maillog).unwrap();
    for rcpt in ["bob@y.example", "carol@y.example"] {
        let line = text
            .lines()
            .find(|l| l.contains(&format!(" {id}: to=<{rcpt}>")))
            .unwrap_or_else(|| panic!("no line for {rcpt}:\n{text}"));
        for part in [
            "status=discarded (discarded by drop)",
            "stage=drop",
            "from=<alice@x.example>",
        ] {
            assert_has!(line, part);
        }
    }
    drop(d);
    // Without one: the stage's own line in the log.
    let (s, mut c) = Scenario::new("op-discard-nolog")
        .timers("")
        .pepsi("DELIVERY_LOG = no\n")
        .stages(
            "[stage-filter]\nPROGRAM = {if}\nMATCH = recipient-domain is kept.example\n\
             NEXT = drop\nELSE_STAGE = drop\n\n[stage-drop]\nPROGRAM = {discard}\n",
        )
        .connect();
    let id = inject(
        &mut c,
        "filter",
        "alice@x.example",
        &["bob@y.example", "carol@y.example"],
    );
    let d = s.start();
    wait_empty(&mut c, WAIT);
    d.wait_log(
        &format!(
            "drop: message {id} from <alice@x.example> to <bob@y.example>, <carol@y.example>: discarded"
        ),
        WAIT,
    );
}

#[test]
fn check_warns_about_a_key_a_built_in_stage_does_not_read() {
    let (s, _c) = Scenario::new("op-ignored")
        .timers("")
        .stages("[stage-drop]\nPROGRAM = {discard}\nNEXT = elsewhere\n\n[stage-elsewhere]\nPROGRAM = {discard}\n")
        .connect();
    let out = run(
        &bin("pepsi-dispatch"),
        &["-c", s.conf.to_str().unwrap(), "check"],
    );
    let report = stdout(&out) + &stderr(&out);
    assert_has!(
        report,
        "[stage-drop] NEXT: pepsi-stage-discard does not read NEXT (it deletes every message it gets); ignored"
    );
    let line = std::fs::read_to_string(&s.conf)
        .unwrap()
        .lines()
        .position(|l| l == "NEXT = elsewhere")
        .unwrap()
        + 1;
    assert_has!(
        report,
        &format!("{}:{line}: [stage-drop] NEXT", s.conf.display())
    );
}

#[test]
fn sighup_leaves_the_failure_bouncer_running_and_says_so() {
    let (s, _c) = Scenario::new("op-hup")
        .timers("")
        .stages("[stage-bounce]\nPROGRAM = {bounce}\nNEXT = drop\n\n[stage-drop]\nPROGRAM = {discard}\n\n[pepsi-failure-bouncer]\nBOUNCE_STAGE = bounce\n")
        .connect();
    let mut b = Bouncer::ready(&s.conf, &[]);
    b.signal(libc::SIGHUP);
    b.wait_log(
        "SIGHUP: pepsi-failure-bouncer reads its configuration when it starts",
        WAIT,
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        b.try_wait().is_none(),
        "still running after SIGHUP:\n{}",
        b.log()
    );
    b.signal(libc::SIGTERM);
    assert!(b.wait(WAIT).success(), "{}", b.log());
}

/// The unit's `ExecReload=` lines, in order, as systemd runs them: each a command line,
/// `$MAINPID` the main process.
fn exec_reload() -> Vec<String> {
    let unit = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("packaging/systemd/pepsi-dispatch.service"),
    )
    .unwrap();
    unit.lines()
        .filter_map(|l| l.strip_prefix("ExecReload="))
        .map(str::to_string)
        .collect()
}

/// Runs the reload as systemd would for the configuration `conf` and main process
/// `pid`: each line in turn (`/usr/bin/pepsi-dispatch` being this build's), stopping
/// at the first that fails. Whether every line succeeded.
fn reload(conf: &std::path::Path, pid: u32) -> bool {
    for line in exec_reload() {
        let line = line
            .replace(
                "/usr/bin/pepsi-dispatch",
                bin("pepsi-dispatch").to_str().unwrap(),
            )
            .replace("$MAINPID", &pid.to_string());
        let status = Command::new("sh")
            .arg("-c")
            .arg(&line)
            .env("PEPSI_CONFIG", conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        if !status.success() {
            return false;
        }
    }
    true
}

#[test]
fn systemctl_reload_checks_the_configuration_before_it_signals_the_dispatcher() {
    let (s, _c) = Scenario::new("op-reload")
        .timers("")
        .stages("[stage-drop]\nPROGRAM = {discard}\n")
        .connect();
    let lines = exec_reload();
    assert!(lines.len() >= 2, "{lines:?}");
    // A process standing for the dispatcher: SIGHUP ends it, even when this test runs
    // under `nohup` (an ignored signal stays ignored across exec).
    let mut sleeper = Command::new("sleep");
    sleeper.arg("60");
    // SAFETY: signal(2) with constant arguments, between fork and exec.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut sleeper, || {
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut main = sleeper.spawn().unwrap();
    // A broken file: the reload fails before the signal, the process lives on.
    let good = std::fs::read_to_string(&s.conf).unwrap();
    std::fs::write(&s.conf, format!("{good}\n[stage-broken]\nNEXT = drop\n")).unwrap();
    assert!(!reload(&s.conf, main.id()));
    std::thread::sleep(Duration::from_millis(300));
    assert!(main.try_wait().unwrap().is_none(), "not signalled");
    // The file fixed: the reload signals.
    std::fs::write(&s.conf, good).unwrap();
    assert!(reload(&s.conf, main.id()));
    wait_until(WAIT, "the process ended by SIGHUP", || {
        main.try_wait().unwrap().is_some()
    });
}

#[test]
fn check_says_once_that_an_exec_stage_may_not_run_as_root() {
    let (s, _c) = Scenario::new("op-root")
        .timers("")
        .stages("[stage-deliver]\nPROGRAM = {exec}\nCOMMAND = /bin/true\nUSER = root\n")
        .connect();
    let out = run(
        &bin("pepsi-dispatch"),
        &["-c", s.conf.to_str().unwrap(), "check"],
    );
    assert!(!out.status.success());
    let report = stdout(&out) + &stderr(&out);
    assert_eq!(
        report.matches("root is refused").count(),
        1,
        "one error for USER = root:\n{report}"
    );
}
