//! Tenants, weights and rates end to end (§7 "Weights, rates and tenants"): shares of
//! worker time between tenants, not sender keys; a weight-2 tenant twice a weight-1
//! tenant's; a tenant held to its rate while another uses the rest; tenants named,
//! weights and rates written by `pepsi-settings`, hostile values refused and shown
//! escaped. The shares are measured with one worker with one slot at the stage, so the
//! order of completions is the order of claims and a message's worker time is the time from the completion
//! before it to its own. Real PostgreSQL, real processes (the fault worker, whose
//! messages cost their `state.cost_ms`).

use std::time::Duration;

use postgres::Client;

use crate::util::dispatcher::Dispatcher;
use crate::util::fairness::{
    finished_between, finished_count, inject, now_epoch, record_finishes, worker_times,
};
use crate::util::queue::{both, expect, json, queue};
use crate::util::scenario::conf;
use crate::util::{TempDir, TestDb, stdout};

const SEC: Duration = Duration::from_secs(1);
const ONE_SLOT: &str = "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 1\nQUEUE_LIMIT = 1\n";

/// Runs the stage until `n` messages finished; the dispatcher goes on running.
fn run_until(conf: &std::path::Path, c: &mut Client, n: i64) -> Dispatcher {
    let d = Dispatcher::start(conf, &[]);
    crate::util::wait_until(120 * SEC, "the window of messages", || {
        finished_count(c) >= n
    });
    d
}

/// `pepsi-queue status --json`'s fair shares of stage `s`, once the dispatcher wrote
/// figures for every one of `tenants`.
fn shares_of(conf: &std::path::Path, tenants: &[&str]) -> serde_json::Value {
    let mut found = serde_json::Value::Null;
    crate::util::wait_until(30 * SEC, "the tenants' figures in status", || {
        let out = queue(conf, &["status", "--json"]);
        let doc = json(&out);
        let Some(stage) = doc["fair_shares"]
            .as_array()
            .and_then(|a| a.iter().find(|s| s["stage"] == "s"))
        else {
            return false;
        };
        let named = |t: &str| {
            stage["tenants"]
                .as_array()
                .is_some_and(|l| l.iter().any(|x| x["tenant"] == t))
        };
        found = stage.clone();
        tenants.iter().all(|t| named(t))
    });
    found
}

/// Every queue row's tenant, by id.
fn tenants(c: &mut Client) -> Vec<String> {
    c.query(
        "SELECT tenant_key FROM pepsi.workqueue ORDER BY workqueue_id",
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// `pepsi-setup -c conf schema`.
fn pepsi_setup(conf: &std::path::Path) -> std::process::Output {
    std::process::Command::new(crate::util::bin("pepsi-setup"))
        .arg("-c")
        .arg(conf)
        .arg("schema")
        .output()
        .unwrap()
}

/// A tenant's entry in a stage's fair shares.
fn tenant<'a>(stage: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    stage["tenants"]
        .as_array()
        .and_then(|l| l.iter().find(|x| x["tenant"] == name))
        .unwrap_or_else(|| panic!("{name} in {stage}"))
}

#[test]
fn two_tenants_weighted_two_and_one_get_two_thirds_and_one_third_of_the_worker_time() {
    let db = TestDb::new();
    let dir = TempDir::new("t-weight");
    // The FIFO reserve hands slots out by age alone: left out here.
    let conf = conf(
        &dir,
        &db,
        "FAIR_FIFO_PERCENT = 0\nSTATS_INTERVAL = 1s",
        ONE_SLOT,
    );
    let out = queue(&conf, &["settings", "weight", "domain:paying.example", "2"]);
    expect(&out, 0);
    let mut c = db.client();
    record_finishes(&mut c);
    // Interleaved ids, so age favours neither; the same cost per message.
    for _ in 0..250 {
        inject(&mut c, "x@paying.example", 1, 8);
        inject(&mut c, "x@free.example", 1, 8);
    }
    let d = run_until(&conf, &mut c, 230);
    // What status shows: both waiting, their weights, the weighted index near 1.
    let stage = shares_of(&conf, &["domain:paying.example", "domain:free.example"]);
    drop(d);
    assert_eq!(stage["tenants_waiting"], 2, "{stage}");
    let (p, f) = (
        tenant(&stage, "domain:paying.example"),
        tenant(&stage, "domain:free.example"),
    );
    assert_eq!(
        (p["weight"].as_f64(), f["weight"].as_f64()),
        (Some(2.0), Some(1.0))
    );
    let seconds = |t: &serde_json::Value| t["worker_seconds"].as_f64().unwrap();
    assert!(seconds(p) > 1.4 * seconds(f), "{stage}");
    let jain = stage["jain_index"].as_f64().unwrap();
    assert!(jain > 0.9, "{stage}");
    // Past the first messages (charged the start average), over a window in which both
    // still wait.
    let tenants = ["domain:paying.example", "domain:free.example"];
    let (paying, free) = match worker_times(&mut c, &tenants, 21, 230)[..] {
        [a, b] => (a, b),
        _ => unreachable!(),
    };
    let ratio = paying / free.max(1e-9);
    eprintln!("weights 2 and 1: worker time {paying:.3} s and {free:.3} s, {ratio:.2} : 1");
    assert!(
        (1.6..=2.4).contains(&ratio),
        "the weight-2 tenant got {paying:.3} s of worker time, the weight-1 tenant {free:.3} s: \
         {ratio:.2} times as much, not 2 ± 20 %"
    );
}

#[test]
fn a_tenant_sending_through_a_hundred_sender_keys_gets_one_tenants_share() {
    let db = TestDb::new();
    let dir = TempDir::new("t-keys");
    let conf = conf(&dir, &db, "FAIR_FIFO_PERCENT = 0", ONE_SLOT);
    let mut c = db.client();
    record_finishes(&mut c);
    // `big.example` sends from a hundred subdomains (a hundred sender keys, one tenant:
    // its registrable domain), `small.example` from one.
    for i in 0..300 {
        inject(&mut c, &format!("x@s{}.big.example", i % 100), 1, 8);
        inject(&mut c, "x@small.example", 1, 8);
    }
    let senders: i64 = c
        .query_one(
            "SELECT count(DISTINCT sender_key) FROM pepsi.workqueue \
              WHERE tenant_key = 'domain:big.example'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(senders, 100);
    drop(run_until(&conf, &mut c, 230));
    let tenants = ["domain:big.example", "domain:small.example"];
    let (big, small) = match worker_times(&mut c, &tenants, 21, 230)[..] {
        [a, b] => (a, b),
        _ => unreachable!(),
    };
    let ratio = big / small.max(1e-9);
    eprintln!("100 keys against 1: worker time {big:.3} s and {small:.3} s, {ratio:.2} : 1");
    // As sender keys, the hundred would get 100 shares to the one's 1.
    assert!(
        (0.8..=1.2).contains(&ratio),
        "the tenant of 100 sender keys got {big:.3} s of worker time, the tenant of one \
         {small:.3} s: {ratio:.2} times as much"
    );
}

#[test]
fn tenants_are_named_by_pattern_and_the_queue_follows_at_once() {
    let db = TestDb::new();
    let dir = TempDir::new("t-name");
    let conf = conf(&dir, &db, "", ONE_SLOT);
    let mut c = db.client();
    inject(&mut c, "x@one.acme.example", 1, 1);
    inject(&mut c, "x@acme-two.example", 1, 1);
    inject(&mut c, "x@other.example", 1, 1);
    assert_eq!(
        tenants(&mut c),
        [
            "domain:acme.example",
            "domain:acme-two.example",
            "domain:other.example"
        ]
    );
    for pattern in ["from:*acme.example", "from:acme-two.example"] {
        expect(&queue(&conf, &["settings", "tenant", pattern, "acme"]), 0);
    }
    assert_eq!(
        tenants(&mut c),
        ["tenant:acme", "tenant:acme", "domain:other.example"]
    );
    // A row inserted now belongs to it too; tenant-of and tenants say so.
    inject(&mut c, "x@new.acme.example", 1, 1);
    assert_eq!(tenants(&mut c)[3], "tenant:acme");
    let out = queue(&conf, &["settings", "tenant-of", "from:mail.acme.example"]);
    expect(&out, 0);
    assert_eq!(stdout(&out), "from:mail.acme.example\ttenant:acme\n");
    let out = queue(&conf, &["settings", "tenants"]);
    expect(&out, 0);
    let listed = stdout(&out);
    assert!(
        listed.contains("from:*acme.example\ttenant:acme\t"),
        "{listed}"
    );
    // Unnamed again: the default tenants.
    expect(
        &queue(
            &conf,
            &["settings", "tenant", "--unset", "from:*acme.example"],
        ),
        0,
    );
    assert_eq!(
        tenants(&mut c),
        [
            "domain:acme.example",
            "tenant:acme",
            "domain:other.example",
            "domain:acme.example"
        ]
    );
    let out = queue(
        &conf,
        &["settings", "tenant", "--unset", "from:*acme.example"],
    );
    expect(&out, 65);
}

#[test]
fn the_most_literal_pattern_names_the_tenant_then_the_lower_pattern_and_waiting_rows_follow() {
    let db = TestDb::new();
    let mut c = db.client();
    let from = |c: &mut Client, addr: &str| -> i64 {
        c.query_one(
            "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to) \
             VALUES ('s', $1, ARRAY['r@y.example']) RETURNING workqueue_id",
            &[&addr],
        )
        .unwrap()
        .get(0)
    };
    let waiting = from(&mut c, "x@mxl.acme.example");
    // 120 patterns that match none of these keys, then the ones that do: the lookup
    // reads the patterns most literal first and stops at the first that matches.
    c.batch_execute(
        "INSERT INTO pepsi.tenants (pattern, tenant) \
         SELECT 'from:*.filler' || g || '.example', 'filler' || g FROM generate_series(1, 120) g; \
         INSERT INTO pepsi.tenants (pattern, tenant) VALUES \
           ('from:*', 'any'), ('from:*.example', 'ex'), ('from:mail.acme.example', 'mail'), \
           ('from:*l.acme.example', 'l'), ('from:m*.acme.example', 'm')",
    )
    .unwrap();
    let of = |c: &mut Client, key: &str| -> String {
        c.query_one("SELECT pepsi.tenant_of($1)", &[&key])
            .unwrap()
            .get(0)
    };
    for (key, want) in [
        // 22 literal characters against 19, 13 and 5.
        ("from:mail.acme.example", "tenant:mail"),
        // *l… and m*… both match with 19: the lower pattern ('*' before 'm').
        ("from:mxl.acme.example", "tenant:l"),
        ("from:mx.acme.example", "tenant:m"),
        ("from:x.example", "tenant:ex"),
        ("from:x.test", "tenant:any"),
        ("ip:192.0.2.1", "net:192.0.2.0/24"),
    ] {
        assert_eq!(of(&mut c, key), want, "{key}");
    }
    // The row that waited follows; a new row is keyed the same way.
    let new = from(&mut c, "x@mail.acme.example");
    let keyed: Vec<(i64, String)> = c
        .query(
            "SELECT workqueue_id, tenant_key FROM pepsi.workqueue ORDER BY workqueue_id",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        keyed,
        [
            (waiting, "tenant:l".to_string()),
            (new, "tenant:mail".to_string())
        ]
    );
}

#[test]
fn hostile_patterns_weights_and_names_are_refused_and_shown_escaped() {
    let db = TestDb::new();
    let dir = TempDir::new("t-hostile");
    let conf = conf(&dir, &db, "", ONE_SLOT);
    let cases: &[&[&str]] = &[
        &["settings", "weight", "from:\u{1b}[2Jx.example", "2"],
        &["settings", "weight", "from:a b", "2"],
        &["settings", "weight", "from:\u{202e}evil", "2"],
        &["settings", "weight", "domain:x.example", "1e9"],
        &["settings", "weight", "domain:x.example", "NaN"],
        &["settings", "weight", "domain:x.example", "0"],
        &["settings", "weight", "domain:x.example", "\u{1b}[31m2"],
        &["settings", "rate", "domain:x.example", "\u{1b}[2J10/s"],
        &["settings", "rate", "domain:x.example", "0/s"],
        &["settings", "rate", "domain:x.example", "10"],
        &["settings", "tenant", "from:x.example", "evil\nname"],
        &[
            "settings",
            "tenant",
            "from:x.example",
            "\u{1b}]0;owned\u{7}",
        ],
        &["settings", "tenant", "from:x\u{7f}.example", "acme"],
    ];
    for args in cases {
        let out = queue(&conf, args);
        let text = both(&out);
        assert_eq!(out.status.code(), Some(65), "{args:?}: {text}");
        assert!(text.contains("refused"), "{args:?}: {text}");
        assert!(
            !text.chars().any(|ch| ch.is_control() && ch != '\n') && !text.contains('\u{202e}'),
            "{args:?}: shown raw: {text:?}"
        );
    }
    let mut c = db.client();
    let rows: i64 = c
        .query_one(
            "SELECT (SELECT count(*) FROM pepsi.fair_weights) + (SELECT count(*) FROM pepsi.tenants)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "nothing written");
    // Behind the tool, the tables refuse the same.
    for sql in [
        "INSERT INTO pepsi.fair_weights (pattern, weight) VALUES ('x', 1000)",
        "INSERT INTO pepsi.fair_weights (pattern, weight) VALUES ('x', 'NaN')",
        "INSERT INTO pepsi.fair_weights (pattern, weight) VALUES (E'a\\nb', 1)",
        "INSERT INTO pepsi.tenants (pattern, tenant) VALUES ('x', E'a\\u001b')",
        "INSERT INTO pepsi.fair_weights (pattern, rate) VALUES ('x', 0)",
        "INSERT INTO pepsi.fair_weights (pattern, rate) VALUES ('x', 'Infinity')",
    ] {
        assert!(c.batch_execute(sql).is_err(), "{sql}");
    }
}

#[test]
fn a_tenant_held_to_ten_a_second_runs_at_that_rate_and_the_other_is_not_slowed() {
    let db = TestDb::new();
    let dir = TempDir::new("t-rate");
    let stage = "[stage-s]\nPROGRAM = {fault}\nPARALLELISM = 2\nQUEUE_LIMIT = 1\n";
    let conf = conf(&dir, &db, "STATS_INTERVAL = 1s", stage);
    let out = queue(
        &conf,
        &["settings", "rate", "domain:limited.example", "10/s"],
    );
    expect(&out, 0);
    let mut c = db.client();
    record_finishes(&mut c);
    inject(&mut c, "x@free.example", 2000, 10);
    let d = Dispatcher::start(&conf, &[]);
    crate::util::wait_until(60 * SEC, "the free tenant under way", || {
        finished_count(&mut c) >= 20
    });
    // The free tenant alone, for its pace.
    let alone_from = now_epoch(&mut c);
    std::thread::sleep(2 * SEC);
    let alone = finished_between(&mut c, "domain:free.example", alone_from, 2.0) as f64 / 2.0;
    // Then 2,000 messages of the limited tenant, interleaved with what is left.
    inject(&mut c, "x@limited.example", 2000, 10);
    // Past the first second (the bucket starts full: a burst of ten), six seconds.
    std::thread::sleep(SEC);
    let from = now_epoch(&mut c);
    std::thread::sleep(6 * SEC);
    let limited = finished_between(&mut c, "domain:limited.example", from, 6.0) as f64 / 6.0;
    let free = finished_between(&mut c, "domain:free.example", from, 6.0) as f64 / 6.0;
    // Status and metrics show the rate's hold.
    let stage = shares_of(&conf, &["domain:limited.example", "domain:free.example"]);
    let metrics = crate::util::stdout(&queue(&conf, &["metrics"]));
    drop(d);
    let held = tenant(&stage, "domain:limited.example")["throttled_seconds"]
        .as_f64()
        .unwrap();
    assert!(held > 1.0, "{stage}");
    assert_eq!(
        tenant(&stage, "domain:free.example")["throttled_seconds"],
        0.0
    );
    assert!(stage["jain_index"].as_f64().is_some(), "{stage}");
    for line in [
        "pepsi_tenant_throttled_seconds{stage=\"s\",tenant=\"domain:limited.example\"} ",
        "pepsi_stage_fairness_jain{stage=\"s\"} ",
        "pepsi_stage_tenants_waiting{stage=\"s\"} 2\n",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    eprintln!(
        "rate 10/s: the limited tenant {limited:.1}/s; the free one {free:.1}/s, alone {alone:.1}/s"
    );
    // The order of magnitude here (the benchmark measures the accuracy over a minute):
    // without the rate the two would share the stage, each at half of it.
    assert!(
        (5.0..=15.0).contains(&limited),
        "the limited tenant finished {limited:.1} messages a second"
    );
    assert!(
        free >= 0.6 * alone && free >= 5.0 * limited,
        "the free tenant finished {free:.1} a second beside it, {alone:.1} alone"
    );
}

#[test]
fn tenant_key_sender_makes_each_sender_its_own_tenant_once_pepsi_setup_wrote_it() {
    let db = TestDb::new();
    let dir = TempDir::new("t-rule");
    let conf = conf(&dir, &db, "", ONE_SLOT);
    let mut c = db.client();
    inject(&mut c, "x@a.big.example", 1, 1);
    inject(&mut c, "x@b.big.example", 1, 1);
    assert_eq!(
        tenants(&mut c),
        ["domain:big.example", "domain:big.example"]
    );
    let setup = |conf: &std::path::Path| {
        let out = pepsi_setup(conf);
        assert!(out.status.success(), "{}", both(&out));
        both(&out)
    };
    crate::util::scenario::add_to_pepsi(&conf, "TENANT_KEY = sender\n");
    let said = setup(&conf);
    assert!(said.contains("2 queue rows changed tenant"), "{said}");
    assert_eq!(
        tenants(&mut c),
        ["from:a.big.example", "from:b.big.example"]
    );
    inject(&mut c, "x@c.big.example", 1, 1);
    assert_eq!(tenants(&mut c)[2], "from:c.big.example");
    // Again: nothing changes; a named tenant still wins; back to the default rule.
    assert!(setup(&conf).contains("tenants are keyed by sender ([pepsi] TENANT_KEY)"));
    expect(
        &queue(&conf, &["settings", "tenant", "from:a.*", "alpha"]),
        0,
    );
    assert_eq!(tenants(&mut c)[0], "tenant:alpha");
    let text = std::fs::read_to_string(&conf).unwrap();
    std::fs::write(
        &conf,
        text.replace("TENANT_KEY = sender\n", "TENANT_KEY = default\n"),
    )
    .unwrap();
    setup(&conf);
    assert_eq!(
        tenants(&mut c),
        ["tenant:alpha", "domain:big.example", "domain:big.example"]
    );
    // A value that is neither is a configuration error naming its file, line and key
    // (pepsi-setup exits 1 on a configuration error, pepsi-setup(8)).
    let text = std::fs::read_to_string(&conf).unwrap();
    std::fs::write(
        &conf,
        text.replace("TENANT_KEY = default\n", "TENANT_KEY = \u{1b}[2Jx\n"),
    )
    .unwrap();
    let out = pepsi_setup(&conf);
    assert_eq!(out.status.code(), Some(1), "{}", both(&out));
    let said = both(&out);
    let named = "pepsi.conf:3: [pepsi] TENANT_KEY: \\u{1b}[2Jx is neither default nor sender";
    assert!(said.contains(named) && !said.contains('\u{1b}'), "{said:?}");
}

#[test]
fn hostile_sender_domains_and_pattern_metacharacters_stay_bounded_literal_and_escaped() {
    let db = TestDb::new();
    let dir = TempDir::new("t-hostile-keys");
    let conf = conf(&dir, &db, "STATS_INTERVAL = 1s", ONE_SLOT);
    let mut c = db.client();
    record_finishes(&mut c);
    // Senders whose domains carry a forged line, a bidi override, a 100 KB label and
    // LIKE's own wildcards.
    let long = format!("x@{}.example", "a".repeat(100_000));
    let froms = [
        "x@a.example\r\nX-Forged: 1",
        "x@mail.evil.exa\u{202e}elpm",
        long.as_str(),
        "x@a_b.example",
        "x@axb.example",
        "x@p%q.example",
    ];
    // Written straight into the table, as a role that inserts rows could (the
    // injector refuses control characters in a sender; the tenant must not rely on it).
    for from in froms {
        c.execute(
            "INSERT INTO pepsi.workqueue (stage, mail_from, rcpt_to, state) \
             SELECT 's', $1, ARRAY['r@y.example'], '{\"cost_ms\": 5}' FROM generate_series(1, 3)",
            &[&from],
        )
        .unwrap();
    }
    let keys = tenants(&mut c);
    assert!(
        keys.iter().all(|k| k.len() <= 220),
        "tenant keys stay as bounded as sender keys: {:?}",
        keys.iter().map(String::len).collect::<Vec<_>>()
    );
    // `_` and `%` in a pattern are the characters themselves, not LIKE's wildcards.
    expect(
        &queue(&conf, &["settings", "tenant", "from:a_b.example", "under"]),
        0,
    );
    expect(
        &queue(&conf, &["settings", "tenant", "from:%", "percent"]),
        0,
    );
    let named: Vec<String> = tenants(&mut c)
        .into_iter()
        .filter(|k| k.starts_with("tenant:"))
        .collect();
    assert_eq!(
        named, ["tenant:under"; 3],
        "only a_b.example's rows are named"
    );
    // Run them, and read the shares back through status and metrics: every hostile
    // key shown escaped, in text, JSON and label values alike.
    let d = Dispatcher::start(&conf, &[]);
    crate::util::wait_until(60 * SEC, "every message run", || {
        finished_count(&mut c) >= 18
    });
    let waiting: Vec<&str> = keys[..2].iter().map(String::as_str).collect();
    let stage = shares_of(&conf, &waiting);
    let text = crate::util::stdout(&queue(&conf, &["status"]));
    let metrics = crate::util::stdout(&queue(&conf, &["metrics"]));
    drop(d);
    assert!(stage["tenants"].as_array().unwrap().len() >= 5, "{stage}");
    for (what, out) in [("status", &text), ("metrics", &metrics)] {
        assert!(
            !out.chars()
                .any(|ch| (ch.is_control() && ch != '\n') || ch == '\u{202e}'),
            "{what} shows a hostile tenant raw"
        );
        assert!(!out.contains("\nX-Forged"), "{what}: a forged line");
    }
    assert!(text.contains("\\u{202e}"), "{text}");
    assert!(metrics.contains("\\\\u{202e}"), "{metrics}");
}
