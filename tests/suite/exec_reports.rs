//! What an exec stage's command tells the sender and how its recipients reach it
//! (§12.7): a refusing exit status read as Postfix's `pipe(8)` reads it, the
//! status and diagnostic of the command's first stderr line, `RECIPIENT_LIMIT` (one
//! invocation and one outcome per group) and a recipient list far beyond what one
//! environment variable holds. Real commands, real workers, the reports parsed by the
//! bounce suite's independent parser.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use postgres::Client;

use super::bounce::{
    BODY, HEADERS, bounce, dsn_of, field, move_failed, parse, with_bounce,
    with_exec_relay_and_reports,
};
use crate::util::bouncer::Bouncer;
use crate::util::rows::queue_len;
use crate::util::scenario::Scenario;
use crate::util::worker::{Worker, code};
use crate::util::{assert_lacks, claim, row_at, shared_dir, stage, state_of, wait_until};

/// A shell script in `dir`, executable by every account.
fn script(dir: &crate::util::TempDir, name: &str, text: &str) -> PathBuf {
    let path = dir.write(name, text);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Injects a message from alice@origin.example to `to` at `stage`, pending.
fn inject_at(c: &mut Client, stage: &str, to: &[String]) -> i64 {
    c.query_one(
        "SELECT pepsi.workqueue_inject($1, 'alice@origin.example', $2, $3, $4)",
        &[&stage, &to, &HEADERS, &BODY],
    )
    .unwrap()
    .get(0)
}

/// The files of a folder, by name.
fn files(dir: &Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read_to_string(&p).unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_refusing_exit_reaches_the_sender_as_postfix_pipe_reports_it() {
    let b = Scenario::new("exec-status");
    // Exit 67 (EX_NOUSER) for both; one says why on its first stderr line, the other
    // writes something only the system may read.
    let refuse = script(
        b.dir(),
        "refuse",
        "#!/bin/sh\ncat >/dev/null\ncase \"$PEPSI_RECIPIENTS\" in\n\
         full@*) printf '5.2.2 mailbox \\033[31mfull\\n/var/mail/full: quota\\n' >&2; exit 67 ;;\n\
         esac\necho '/etc/pepsi/users.db: no such user' >&2\nexit 67\n",
    );
    let (s, mut c) = with_bounce(
        b,
        &format!(
            "\n[stage-relay]\nPROGRAM = {{exec}}\nCOMMAND = {}\n",
            refuse.display()
        ),
    )
    .connect();
    let unknown = inject_at(&mut c, "relay", &["nobody@dest.example".into()]);
    let full = inject_at(&mut c, "relay", &["full@dest.example".into()]);
    claim(&mut c, &[unknown, full]);
    let mut w = Worker::ready(&stage("exec"), &s.conf);
    for line in w.run(&[unknown, full]) {
        assert_eq!(code(&line), 65, "failed permanently: {line}");
    }
    w.finish();
    let st = state_of(&mut c, unknown);
    assert_eq!(st["failure_class"], "permanent");
    assert_eq!(st["dsn_status"], "5.1.1", "{st}");
    assert_eq!(st.get("dsn_diagnostic"), None, "{st}");
    let st = state_of(&mut c, full);
    assert_eq!(st["dsn_status"], "5.2.2", "{st}");
    assert_eq!(
        st["dsn_diagnostic"], "x-pepsi; 5.2.2 mailbox ?[31mfull",
        "one line, printable: {st}"
    );

    assert_eq!(move_failed(&mut c), 2);
    claim(&mut c, &[unknown, full]);
    bounce(&s.conf, &[unknown, full]);
    let report = |c: &mut Client, id: i64| {
        let raw = dsn_of(c, id).expect("a report").raw;
        let text = String::from_utf8_lossy(&raw).into_owned();
        assert_lacks!(text, "/etc/pepsi");
        assert_lacks!(text, "/var/mail");
        let p = parse(&raw);
        assert_eq!(p.per_recipient.len(), 1);
        let r = &p.per_recipient[0];
        (
            field(r, "Status").map(str::to_string),
            field(r, "Diagnostic-Code").map(str::to_string),
        )
    };
    assert_eq!(report(&mut c, unknown), (Some("5.1.1".into()), None));
    assert_eq!(
        report(&mut c, full),
        (
            Some("5.2.2".into()),
            Some("x-pepsi; 5.2.2 mailbox ?[31mfull".into())
        )
    );
}

#[test]
fn recipient_limit_1_gives_each_recipient_its_own_invocation_and_outcome() {
    let b = Scenario::new("exec-limit");
    let mail = b.dir().path("mail");
    let bounces = b.dir().path("bounces");
    shared_dir(&mail);
    shared_dir(&bounces);
    let relay = script(
        b.dir(),
        "relay",
        &format!(
            "#!/bin/sh\ncat >/dev/null\ncase \",$PEPSI_RECIPIENTS,\" in\n\
             *,unknown@dest.example,*) exit 67 ;;\nesac\n\
             echo \"$PEPSI_RECIPIENTS\" > {}/$PEPSI_ID\n",
            mail.display()
        ),
    );
    let deliver = script(
        b.dir(),
        "deliver-bounce",
        &format!("#!/bin/sh\ncat > {}/$PEPSI_ID.eml\n", bounces.display()),
    );
    let s = with_exec_relay_and_reports(b, &relay, "RECIPIENT_LIMIT = 1\n", &deliver);
    let mut c = s.client();
    let to: Vec<String> = ["a@dest.example", "unknown@dest.example", "c@dest.example"]
        .iter()
        .map(|r| r.to_string())
        .collect();
    inject_at(&mut c, "relay", &to);

    let mut d = s.start();
    let mut b = Bouncer::ready(&s.conf, &[]);
    wait_until(Duration::from_secs(60), "the queue is empty", || {
        queue_len(&mut c) == 0
    });
    assert!(d.terminate().success(), "{}", d.log());
    assert!(b.terminate().success(), "{}", b.log());

    let delivered: Vec<String> = files(&mail).into_iter().map(|(_, t)| t).collect();
    let mut delivered: Vec<&str> = delivered.iter().map(|t| t.trim()).collect();
    delivered.sort();
    assert_eq!(
        delivered,
        ["a@dest.example", "c@dest.example"],
        "one invocation per recipient"
    );
    let reports = files(&bounces);
    assert_eq!(reports.len(), 1, "one report: {reports:?}");
    let p = parse(reports[0].1.as_bytes());
    assert_eq!(p.top("To"), Some("<alice@origin.example>"));
    assert_eq!(p.per_recipient.len(), 1, "only the refused recipient");
    let r = &p.per_recipient[0];
    assert_eq!(
        field(r, "Final-Recipient"),
        Some("rfc822; unknown@dest.example")
    );
    assert_eq!(field(r, "Status"), Some("5.1.1"));
}

#[test]
fn six_thousand_recipients_reach_the_command_in_full_never_paused() {
    let (s, mut c) = {
        let b = Scenario::new("exec-many");
        let out = b.dir().path("out");
        shared_dir(&out);
        // Each invocation writes its recipients as it reads them on descriptor 3 and
        // as PEPSI_RECIPIENTS gives them.
        let relay = script(
            b.dir(),
            "relay",
            &format!(
                "#!/bin/sh\ncat >/dev/null\n[ \"$PEPSI_RECIPIENTS_FD\" = 3 ] || exit 70\n\
                 cat <&3 > {o}/$PEPSI_ID.$$.fd\n\
                 printf '%s\\n' \"$PEPSI_RECIPIENTS\" | tr , '\\n' > {o}/$PEPSI_ID.$$.env\n",
                o = out.display()
            ),
        );
        let stages = format!(
            "[stage-relay]\nPROGRAM = {{exec}}\nCOMMAND = {}\n",
            relay.display()
        );
        b.stages(&stages).connect()
    };
    // About 186 KB of PEPSI_RECIPIENTS: beyond the 128 KiB one variable may hold.
    let to: Vec<String> = (0..6000)
        .map(|i| format!("rcpt-{i:05}@destination.example"))
        .collect();
    let id = inject_at(&mut c, "relay", &to);

    let mut d = s.start();
    // A host error would pause the row for a minute at least.
    wait_until(Duration::from_secs(40), "the queue is empty", || {
        queue_len(&mut c) == 0
    });
    assert!(d.terminate().success(), "{}", d.log());
    assert!(!d.log().contains("host error"), "{}", d.log());
    assert_eq!(row_at(&mut c, id), None);

    let written = files(&s.dir.path("out"));
    let mut seen: Vec<String> = Vec::new();
    for pair in written.chunks(2) {
        let [(env_name, env), (fd_name, fd)] = pair else {
            panic!("{written:?}")
        };
        assert_eq!(
            env_name.trim_end_matches(".env"),
            fd_name.trim_end_matches(".fd")
        );
        assert_eq!(env, fd, "the variable and the descriptor agree");
        seen.extend(fd.lines().map(str::to_string));
    }
    seen.sort();
    assert_eq!(seen, to, "every recipient exactly once");
}
