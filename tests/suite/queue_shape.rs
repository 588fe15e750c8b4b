//! `pepsi-queue shape` (`src/queue/shape.rs`): a queue whose messages arrived at known
//! times, counted by recipient domain, sender domain and stage into `qshape`'s age
//! buckets, against counts made by hand — a message with recipients in two domains in
//! both, the null sender as `MAILER-DAEMON`, `--top` cutting, the filters — as JSON and
//! as text, a hostile domain escaped in the text and exact in the JSON, and the
//! administrators' role allowed to run it.

use serde_json::{Value, json};

use crate::util::pg::login_role;
use crate::util::queue::{STAGES, expect, json, nothing_raw, queue, set_status};
use crate::util::{Scenario, assert_has, inject, stderr, stdout};

/// A recipient domain a writer of the queue could store: a line break, a right-to-left
/// override, a terminal control (PostgreSQL text holds no NUL).
const HOSTILE: &str = "ev\r\nil\u{202e}x\u{1b}[2j.example";
/// How the text shows [`HOSTILE`].
const HOSTILE_SHOWN: &str = "ev\\r\\nil\\u{202e}x\\u{1b}[2j.example";

/// The header line's labels after the key.
const LABELS: [&str; 11] = [
    "T", "5", "10", "20", "40", "80", "160", "320", "640", "1280", "1280+",
];

/// One message to seed: stage, status, sender, recipients, age in minutes (each well
/// inside its bucket, so a test that takes seconds cannot move it).
struct Seed {
    stage: &'static str,
    status: &'static str,
    from: &'static str,
    to: &'static [&'static str],
    minutes: i32,
}

/// The queue. Buckets (0 under 5 minutes … 9 from 1280 on) in the comments.
const QUEUE: &[Seed] = &[
    // 1: bucket 0.
    Seed {
        stage: "in",
        status: "pending",
        from: "alice@Example.ORG",
        to: &["bob@b.example"],
        minutes: 1,
    },
    // 2: bucket 3; three recipients in two domains: once in each.
    Seed {
        stage: "relay",
        status: "pending",
        from: "carol@example.org",
        to: &["x@B.Example", "y@c.example", "z@b.example"],
        minutes: 30,
    },
    // 3: bucket 1; the null sender.
    Seed {
        stage: "relay",
        status: "paused",
        from: "",
        to: &["postmaster@c.example"],
        minutes: 7,
    },
    // 4: bucket 9.
    Seed {
        stage: "relay",
        status: "failed",
        from: "dave@other.example",
        to: &["u@d.example"],
        minutes: 2000,
    },
    // 5: bucket 5.
    Seed {
        stage: "in",
        status: "held",
        from: "eve@other.example",
        to: &["v@b.example"],
        minutes: 120,
    },
    // 6: bucket 7; the hostile recipient domain (set below).
    Seed {
        stage: "relay",
        status: "pending",
        from: "zed@B.EXAMPLE",
        to: &["r@hostile.example"],
        minutes: 480,
    },
    // 7: bucket 8, at a stage without a section.
    Seed {
        stage: "lost",
        status: "running",
        from: "frank@example.org",
        to: &["w@e.example"],
        minutes: 960,
    },
    // 8: bucket 2; two recipients in two domains.
    Seed {
        stage: "in",
        status: "pending",
        from: "grace@example.org",
        to: &["a@b.example", "b@e.example"],
        minutes: 15,
    },
];

/// Seeds [`QUEUE`], setting what injection would not take directly as the superuser.
fn seed(c: &mut postgres::Client) {
    for m in QUEUE {
        let id = inject(c, m.stage, m.from, m.to);
        set_status(c, id, m.status);
        c.execute(
            "UPDATE pepsi.workqueue SET arrived = now() - make_interval(mins => $2) \
             WHERE workqueue_id = $1",
            &[&id, &m.minutes],
        )
        .unwrap();
        if m.to == ["r@hostile.example"] {
            c.execute(
                "UPDATE pepsi.workqueue SET rcpt_to = ARRAY[$2::text] WHERE workqueue_id = $1",
                &[&id, &format!("r@{HOSTILE}")],
            )
            .unwrap();
        }
    }
}

/// A row's counts: one message at each of the given bucket indexes (0 to 9).
fn at(buckets: &[usize]) -> [i64; 10] {
    let mut counts = [0; 10];
    for b in buckets {
        counts[*b] += 1;
    }
    counts
}

/// The JSON a row (or the total) must have.
fn row(key: &str, counts: [i64; 10]) -> Value {
    json!({"key": key, "total": counts.iter().sum::<i64>(), "counts": counts})
}

/// The whole JSON document `shape --by by` must print.
fn document(by: &str, total: [i64; 10], rows: &[(&str, [i64; 10])], keys: i64) -> Value {
    json!({
        "by": by,
        "buckets_minutes": [5, 10, 20, 40, 80, 160, 320, 640, 1280],
        "rows": rows.iter().map(|(k, c)| row(k, *c)).collect::<Vec<_>>(),
        "total": {"total": total.iter().sum::<i64>(), "counts": total},
        "keys": keys,
    })
}

/// Every message once: one in each bucket but 4 (40–80 minutes) and 6 (160–320).
const TOTAL: [i64; 10] = [1, 1, 1, 1, 0, 1, 0, 1, 1, 1];

/// Where each word of a line ends (the index of its last character).
fn word_ends(line: &str) -> Vec<usize> {
    let chars: Vec<char> = line.chars().collect();
    (0..chars.len())
        .filter(|&i| chars[i] != ' ' && chars.get(i + 1).is_none_or(|c| *c == ' '))
        .collect()
}

/// The text's lines as (key, numbers), after asserting the header and that every
/// column is right-aligned: each number ends where its header label ends.
#[track_caller]
fn table(text: &str) -> Vec<(String, Vec<i64>)> {
    let mut lines = text.lines();
    let header = lines.next().unwrap();
    assert_eq!(
        header.split_whitespace().collect::<Vec<_>>(),
        LABELS,
        "{text}"
    );
    let label_ends = word_ends(header);
    let mut rows = Vec::new();
    let mut key_ends = std::collections::BTreeSet::new();
    for line in lines.take_while(|l| !l.starts_with('…')) {
        let ends = word_ends(line);
        let (key_end, number_ends) = ends.split_at(ends.len() - LABELS.len());
        assert_eq!(
            number_ends, label_ends,
            "each number right-aligned under its label:\n{text}"
        );
        key_ends.insert(*key_end.last().unwrap());
        let words: Vec<&str> = line.split_whitespace().collect();
        let (key, numbers) = words.split_at(words.len() - LABELS.len());
        rows.push((
            key.join(" "),
            numbers.iter().map(|n| n.parse().unwrap()).collect(),
        ));
    }
    assert_eq!(key_ends.len(), 1, "the keys right-aligned:\n{text}");
    rows
}

/// The expected text rows: TOTAL, then the keys as the text shows them.
fn text_rows(total: [i64; 10], rows: &[(&str, [i64; 10])]) -> Vec<(String, Vec<i64>)> {
    let line = |key: &str, counts: [i64; 10]| {
        let mut numbers = vec![counts.iter().sum()];
        numbers.extend(counts);
        (key.to_string(), numbers)
    };
    std::iter::once(line("TOTAL", total))
        .chain(rows.iter().map(|(k, c)| line(k, *c)))
        .collect()
}

#[test]
fn shape_counts_messages_by_recipient_domain_sender_and_stage_into_qshape_buckets() {
    let (s, mut c) = Scenario::new("q-shape").stages(STAGES).connect();
    seed(&mut c);

    // By recipient domain (the default), counted by hand: b.example has messages 1
    // (bucket 0), 2 (3, once for its two b.example recipients), 5 (5) and 8 (2);
    // c.example 2 (3) and 3 (1); e.example 7 (8) and 8 (2); d.example 4 (9); the
    // hostile domain 6 (7). Ties by key in byte order: c before e, d before "ev…".
    let domains = [
        ("b.example", at(&[0, 3, 5, 2])),
        ("c.example", at(&[3, 1])),
        ("e.example", at(&[8, 2])),
        ("d.example", at(&[9])),
        (HOSTILE, at(&[7])),
    ];
    let out = queue(&s.conf, &["shape", "--json"]);
    expect(&out, 0);
    assert_eq!(
        json(&out),
        document("recipient-domain", TOTAL, &domains, 5),
        "the total counts 8 messages, the rows 10 (message, domain) pairs"
    );
    let out = queue(&s.conf, &["shape", "--by", "recipient-domain"]);
    expect(&out, 0);
    let text = stdout(&out);
    nothing_raw(&text);
    assert_has!(text, HOSTILE_SHOWN);
    let shown: Vec<(&str, [i64; 10])> = domains
        .iter()
        .map(|(k, c)| (if *k == HOSTILE { HOSTILE_SHOWN } else { *k }, *c))
        .collect();
    assert_eq!(table(&text), text_rows(TOTAL, &shown), "{text}");
    assert!(!text.contains('…'), "nothing left out:\n{text}");

    // By sender domain: example.org has 1 (0), 2 (3), 7 (8), 8 (2); other.example 4
    // (9), 5 (5); the null sender 3 (1); b.example 6 (7). "MAILER-DAEMON" sorts before
    // "b.example" (upper case first).
    let senders = [
        ("example.org", at(&[0, 3, 8, 2])),
        ("other.example", at(&[9, 5])),
        ("MAILER-DAEMON", at(&[1])),
        ("b.example", at(&[7])),
    ];
    let out = queue(&s.conf, &["shape", "--by=sender", "--json"]);
    expect(&out, 0);
    assert_eq!(json(&out), document("sender", TOTAL, &senders, 4));
    let out = queue(&s.conf, &["shape", "--by", "sender"]);
    expect(&out, 0);
    assert_eq!(
        table(&stdout(&out)),
        text_rows(TOTAL, &senders),
        "{}",
        stdout(&out)
    );

    // By stage: relay has 2 (3), 3 (1), 4 (9), 6 (7); in 1 (0), 5 (5), 8 (2); lost 7
    // (8).
    let stages = [
        ("relay", at(&[3, 1, 9, 7])),
        ("in", at(&[0, 5, 2])),
        ("lost", at(&[8])),
    ];
    let out = queue(&s.conf, &["shape", "--by", "stage", "--json"]);
    expect(&out, 0);
    assert_eq!(json(&out), document("stage", TOTAL, &stages, 3));
    let out = queue(&s.conf, &["shape", "--by", "stage"]);
    assert_eq!(table(&stdout(&out)), text_rows(TOTAL, &stages));
}

#[test]
fn shape_top_cuts_the_keys_and_the_filters_narrow_the_messages() {
    let (s, mut c) = Scenario::new("q-shape-top").stages(STAGES).connect();
    seed(&mut c);

    // The two domains with the most messages; the total still counts every message.
    let out = queue(&s.conf, &["shape", "--top", "2", "--json"]);
    expect(&out, 0);
    let top = [("b.example", at(&[0, 3, 5, 2])), ("c.example", at(&[3, 1]))];
    assert_eq!(json(&out), document("recipient-domain", TOTAL, &top, 5));
    let out = queue(&s.conf, &["shape", "--top=2"]);
    expect(&out, 0);
    let text = stdout(&out);
    assert_eq!(table(&text), text_rows(TOTAL, &top), "{text}");
    assert_has!(
        text,
        "\n… 3 more recipient domains not shown (--top 2; --top 5 shows them all)\n"
    );
    assert!(text.ends_with("all)\n"), "the last line:\n{text}");
    assert!(!text.contains(HOSTILE_SHOWN), "cut: {text}");

    // At stage relay (messages 2, 3, 4, 6), one message per sender domain: by key.
    let out = queue(
        &s.conf,
        &["shape", "--by", "sender", "--stage", "relay", "--json"],
    );
    expect(&out, 0);
    assert_eq!(
        json(&out),
        document(
            "sender",
            at(&[3, 1, 9, 7]),
            &[
                ("MAILER-DAEMON", at(&[1])),
                ("b.example", at(&[7])),
                ("example.org", at(&[3])),
                ("other.example", at(&[9])),
            ],
            4
        )
    );
    // Pending messages (1, 2, 6, 8) by stage: a tie, by name.
    let out = queue(
        &s.conf,
        &["shape", "--by", "stage", "--status", "pending", "--json"],
    );
    expect(&out, 0);
    assert_eq!(
        json(&out),
        document(
            "stage",
            at(&[0, 3, 7, 2]),
            &[("in", at(&[0, 2])), ("relay", at(&[3, 7]))],
            2
        )
    );
    // Nothing matches: the header and a TOTAL of zeros, as qshape prints them.
    let out = queue(&s.conf, &["shape", "--stage", "nowhere", "--json"]);
    expect(&out, 0);
    assert_eq!(json(&out), document("recipient-domain", [0; 10], &[], 0));
    let out = queue(&s.conf, &["shape", "--stage", "nowhere"]);
    assert_eq!(table(&stdout(&out)), text_rows([0; 10], &[]));
}

#[test]
fn shape_refuses_a_bad_key_or_top_naming_the_value_escaped() {
    let (s, _c) = Scenario::new("q-shape-usage").stages(STAGES).connect();
    for (args, named) in [
        (
            &["shape", "--by", "dom\r\nain\u{202e}"][..],
            "--by: unknown key \"dom\\r\\nain\\u{202e}\" (recipient-domain, sender, stage)",
        ),
        (
            &["shape", "--top", "0"][..],
            "--top: \"0\" is not a positive number",
        ),
        (
            &["shape", "--top", "x\u{1b}[2J"][..],
            "--top: \"x\\u{1b}[2J\" is not a positive number",
        ),
        (
            &["shape", "--status", "stuck"][..],
            "--status: unknown status",
        ),
    ] {
        let out = queue(&s.conf, args);
        expect(&out, 64);
        let err = stderr(&out);
        assert_has!(err, named);
        nothing_raw(&err);
        assert!(stdout(&out).is_empty(), "{}", stdout(&out));
    }
}

#[test]
fn shape_runs_as_the_administrators_role() {
    let (s, mut c) = Scenario::new("q-shape-admin").stages(STAGES).connect();
    seed(&mut c);
    let role = login_role("pepsi_t_admin", &["pepsi_admin"]);
    let conf = std::fs::read_to_string(&s.conf).unwrap().replacen(
        "[pepsi-postgres]\n",
        &format!(
            "[pepsi-postgres]\nADMIN_CONNECTION = {}\n",
            s.db.conninfo_as(&role)
        ),
        1,
    );
    let admin_conf = s.dir.write("admin.conf", &conf);
    for by in ["recipient-domain", "sender", "stage"] {
        let as_admin = queue(&admin_conf, &["shape", "--by", by, "--json"]);
        expect(&as_admin, 0);
        let as_owner = queue(&s.conf, &["shape", "--by", by, "--json"]);
        assert_eq!(json(&as_admin), json(&as_owner), "{by}");
    }
}
