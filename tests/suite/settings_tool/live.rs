//! `pepsi-settings` and `pepsi-config` with the rest of the system: `pepsi-config
//! check` is `pepsi-queue config check`, a running dispatcher's workers use a new
//! setting at once, and the database roles decide who may write the settings.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use postgres::Client;

use super::{STAGES, linked, row, settings, table};
use crate::util::pg::login_role;
use crate::util::queue::{both, expect, queue};
use crate::util::{Scenario, assert_has, inject, stderr, stdout, wait_until};

#[test]
fn pepsi_config_check_json_prints_what_pepsi_queue_config_check_json_prints() {
    let s = Scenario::new("settings-config").stages(STAGES).build();
    let bad = s.dir.write(
        "bad.conf",
        "[stage-a]\nNEXT = nowhere\n\n[stage-b]\nPROGRAM = /bin/true\nFROB = 1\n",
    );
    for (conf, code) in [(s.conf.clone(), 0), (bad, 78)] {
        for extra in [&["--json"][..], &[]] {
            let mut args = vec!["config", "check"];
            args.extend_from_slice(extra);
            let theirs = queue(&conf, &args);
            let ours: Vec<OsString> = args[1..].iter().map(OsString::from).collect();
            let ours = linked("pepsi-config", &conf, &ours, b"");
            expect(&ours, code);
            assert_eq!(ours.status.code(), theirs.status.code(), "{}", both(&ours));
            assert_eq!(stdout(&ours), stdout(&theirs), "{}", both(&ours));
            assert!(!stdout(&ours).is_empty());
        }
    }
    let help = linked("pepsi-config", &s.conf, &[OsString::from("--help")], b"");
    expect(&help, 0);
    assert!(
        stdout(&help).starts_with("usage: pepsi-config "),
        "{}",
        both(&help)
    );
    let out = linked("pepsi-config", &s.conf, &[OsString::from("frob")], b"");
    expect(&out, 64);
    assert_has!(stderr(&out), "usage: pepsi-config [GLOBAL OPTIONS]");
}

#[test]
fn a_running_dispatchers_workers_use_a_new_setting_after_set_without_restart() {
    let scenario = Scenario::new("settings-live");
    let out = scenario.dir().path("out");
    let mut stages = String::from(
        "[stage-route]\nPROGRAM = {if}\nMATCH = recipient-domain is a.example\nNEXT = ta\nELSE_STAGE = tb\n\n",
    );
    for stage in ["ta", "tb"] {
        let dir = out.join(stage);
        crate::util::shared_dir(&dir);
        let script = scenario.dir().write(
            &format!("{stage}.sh"),
            &format!("#!/bin/sh\ncat > {}/$PEPSI_ID\n", dir.display()),
        );
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        stages.push_str(&format!(
            "[stage-{stage}]\nPROGRAM = {{exec}}\nCOMMAND = {}\n\n",
            script.display()
        ));
    }
    let (s, mut c) = scenario.timers("").stages(&stages).connect();
    let mut d = s.start();
    let went = |c: &mut Client, id: i64| -> &'static str {
        wait_until(Duration::from_secs(30), "the message is delivered", || {
            crate::util::row_at(c, id).is_none()
        });
        match (
            out.join("ta").join(id.to_string()).exists(),
            out.join("tb").join(id.to_string()).exists(),
        ) {
            (true, false) => "ta",
            (false, true) => "tb",
            other => panic!("message {id} went to {other:?}"),
        }
    };
    let first = inject(&mut c, "route", "s@x.example", &["r@b.example"]);
    assert_eq!(went(&mut c, first), "tb", "{}", d.log());
    let pid = d.pid();
    let out_set = settings(
        &s.conf,
        &[
            "set",
            "R@B.example",
            "route",
            "MATCH",
            "recipient-domain is b.example",
        ],
    );
    expect(&out_set, 0);
    let second = inject(&mut c, "route", "s@x.example", &["r@b.example"]);
    assert_eq!(
        went(&mut c, second),
        "ta",
        "the new setting applies: {}",
        d.log()
    );
    let other = inject(&mut c, "route", "s@x.example", &["q@b.example"]);
    assert_eq!(went(&mut c, other), "tb", "only for that address");
    expect(
        &settings(&s.conf, &["unset", "r@b.example", "route", "MATCH"]),
        0,
    );
    let third = inject(&mut c, "route", "s@x.example", &["r@b.example"]);
    assert_eq!(went(&mut c, third), "tb", "and no more once unset");
    assert_eq!(d.pid(), pid);
    assert!(d.terminate().success(), "{}", d.log());
}

#[test]
fn a_member_of_pepsi_admin_writes_the_settings_and_an_injecting_role_may_not() {
    let (s, mut c) = Scenario::new("settings-roles").stages(STAGES).connect();
    // The configuration with ADMIN_CONNECTION as `role`.
    let as_role = |role: &str| -> PathBuf {
        let text = std::fs::read_to_string(&s.conf).unwrap().replace(
            "[pepsi-postgres]\n",
            &format!(
                "[pepsi-postgres]\nADMIN_CONNECTION = {}\n",
                s.db.conninfo_as(role)
            ),
        );
        s.dir.write(&format!("{role}.conf"), &text)
    };
    let admin = as_role(&login_role("pepsi_t_admin", &["pepsi_admin"]));
    let injector = as_role(&login_role("pepsi_t_inject", &["pepsi_inject"]));
    expect(
        &settings(
            &admin,
            &["set", "bob@b.example", "route", "MAX_LIFETIME", "2h"],
        ),
        0,
    );
    let file = s.dir.write(
        "settings.tsv",
        "carol@c.example\troute\tMATCH\tsender is x@y.example\n",
    );
    let out = settings(&admin, &["import", "--replace", file.to_str().unwrap()]);
    expect(&out, 0);
    assert_has!(stdout(&out), "1 added, 0 changed, 0 unchanged, 1 removed");
    expect(&settings(&admin, &["list"]), 0);
    for args in [
        &["set", "dave@d.example", "route", "MAX_LIFETIME", "1h"][..],
        &["unset", "carol@c.example", "route", "MATCH"],
        &["list"],
    ] {
        let out = settings(&injector, args);
        expect(&out, 77);
        assert_has!(stderr(&out), "42501", "{}", both(&out));
    }
    assert_eq!(
        table(&mut c),
        [row(
            "carol@c.example",
            "route",
            "MATCH",
            "sender is x@y.example"
        )]
    );
}
