//! `pepsi-queue list` and `show` (`src/queue/list.rs`): order, filters and the limit,
//! a row's columns and state with its content only on request, and every value shown
//! escaped in the text while `--json` gives it exactly.

use crate::util::queue::{
    ODD_SENDER, ODD_SENDER_SHOWN, ODD_STAGE, ODD_STAGE_SHOWN, STAGES, expect, json, nothing_raw,
    odd_row, queue, varied_queue,
};
use crate::util::{Scenario, assert_has, assert_lacks, inject, stderr, stdout};

#[test]
fn list_is_oldest_first_and_filters_and_limits() {
    let (s, mut c) = Scenario::new("q-list").stages(STAGES).connect();
    let ids = varied_queue(&mut c);
    let other = inject(&mut c, "in", "b@other.example", &["t@y.example"]);

    let out = queue(&s.conf, &["list", "--json"]);
    expect(&out, 0);
    let j = json(&out);
    let listed: Vec<i64> = j["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_i64().unwrap())
        .collect();
    let mut all = ids.clone();
    all.push(other);
    assert_eq!(listed, all, "every message, oldest (lowest id) first");
    assert_eq!(j["truncated"], false);
    let failed = &j["messages"][3];
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["first_recipient"], "r@y.example");
    assert_eq!(failed["recipients"], 2);
    assert_eq!(
        failed["last_error"],
        "connect to mx.y.example: refused\nagain"
    );
    assert_eq!(failed["sender_key"], "from:x.example");

    let ids_of = |args: &[&str]| -> Vec<i64> {
        let mut a = vec!["list", "--json"];
        a.extend_from_slice(args);
        let out = queue(&s.conf, &a);
        expect(&out, 0);
        json(&out)["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_i64().unwrap())
            .collect()
    };
    assert_eq!(ids_of(&["--stage", "in"]), [other]);
    assert_eq!(ids_of(&["--status", "held"]), [ids[5]]);
    assert_eq!(ids_of(&["--sender", "from:other.example"]), [other]);
    assert_eq!(
        ids_of(&["--stage", "relay", "--status", "pending"]),
        [ids[0]]
    );
    let out = queue(&s.conf, &["list", "--limit", "2", "--json"]);
    let j = json(&out);
    assert_eq!(j["messages"].as_array().unwrap().len(), 2);
    assert_eq!(j["truncated"], true);

    let out = queue(&s.conf, &["list", "--status", "failed"]);
    expect(&out, 0);
    let text = stdout(&out);
    let mut lines = text.lines();
    assert!(lines.next().unwrap().contains("LAST ERROR"), "{text}");
    let line = lines.next().unwrap();
    assert!(line.contains("relay"), "{line}");
    assert!(line.contains("r@y.example (+1 more)"), "{line}");
    assert_has!(
        line,
        "connect to mx.y.example: refused again",
        "the error on one line"
    );
    assert!(line.contains("3h0"), "the age: {line}");
    let out = queue(&s.conf, &["list", "--limit", "1"]);
    assert!(stdout(&out).contains("more messages than --limit 1"));
    expect(&queue(&s.conf, &["list", "--status", "stuck"]), 64);
}

#[test]
fn list_status_and_show_print_senders_and_stages_escaped() {
    let (s, mut c) = Scenario::new("q-escaped").stages(STAGES).connect();
    let id = odd_row(&mut c);

    let out = queue(&s.conf, &["list"]);
    expect(&out, 0);
    let text = stdout(&out);
    nothing_raw(&text);
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(&id.to_string()))
        .unwrap_or_else(|| panic!("no line for {id}:\n{text}"));
    assert!(line.contains(ODD_STAGE_SHOWN), "{line}");
    assert!(line.contains(ODD_SENDER_SHOWN), "{line}");
    assert!(line.contains("boom\\u{1b}]0;owned\\u{7}"), "{line}");

    let out = queue(&s.conf, &["status"]);
    expect(&out, 0);
    let text = stdout(&out);
    nothing_raw(&text);
    assert_has!(text, &format!("{ODD_STAGE_SHOWN} (no section)"));
    assert_has!(text, &format!("are never claimed: {ODD_STAGE_SHOWN} (1)"));

    let out = queue(&s.conf, &["show", &id.to_string()]);
    expect(&out, 0);
    let text = stdout(&out);
    nothing_raw(&text);
    assert_has!(text, &format!("stage        {ODD_STAGE_SHOWN}\n"));
    assert_has!(text, &format!("sender       {ODD_SENDER_SHOWN}\n"));
    assert_has!(text, "\"last_error\": \"boom\\u001b]0;owned\\u0007\"");
    // The header block keeps its line ends (CRLF here) and nothing else raw.
    c.execute(
        "UPDATE pepsi.workqueue_body b SET body = convert_to(E'Hi\\x1b[2J\\r\\nthere\\u202e\\r\\n', 'UTF8') \
           FROM pepsi.workqueue q WHERE q.workqueue_id = $1 AND b.body_id = q.body_id",
        &[&id],
    )
    .unwrap();
    let out = queue(&s.conf, &["show", &id.to_string(), "--headers", "--body"]);
    expect(&out, 0);
    let text = stdout(&out);
    assert!(text.contains("header block:\nSubject: test\r\n"), "{text}");
    assert_has!(text, "body:\nHi\\u{1b}[2J\r\nthere\\u{202e}\r\n");
    nothing_raw(&text.replace("\r\n", "\n"));

    // The JSON gives the values exactly.
    let j = json(&queue(&s.conf, &["list", "--json"]));
    assert_eq!(j["messages"][0]["stage"], ODD_STAGE);
    assert_eq!(j["messages"][0]["mail_from"], ODD_SENDER);
}

#[test]
fn show_gives_the_row_and_its_state_and_the_content_only_on_request() {
    let (s, mut c) = Scenario::new("q-show").stages(STAGES).connect();
    let id = inject(&mut c, "in", "a@x.example", &["r@y.example"]);
    c.execute(
        "UPDATE pepsi.workqueue SET state = '{\"strikes\": 2, \"last_error\": \"boom\"}' \
         WHERE workqueue_id = $1",
        &[&id],
    )
    .unwrap();
    let out = queue(&s.conf, &["show", &id.to_string(), "--json"]);
    expect(&out, 0);
    let j = json(&out);
    assert_eq!(j["id"], id);
    assert_eq!(j["stage"], "in");
    assert_eq!(j["rcpt_to"], serde_json::json!(["r@y.example"]));
    assert_eq!(j["state"]["strikes"], 2);
    assert_eq!(j["subject"], "test");
    assert_eq!(j["body_bytes"], 8);
    assert!(j.get("headers").is_none() && j.get("body").is_none(), "{j}");

    let out = queue(
        &s.conf,
        &["show", &id.to_string(), "--json", "--headers", "--body"],
    );
    let j = json(&out);
    assert_eq!(j["headers"], "Subject: test\r\nFrom: <a@b>\r\n");
    assert_eq!(j["body"], "Hello.\r\n");
    // A body that is not UTF-8 travels as base64.
    c.execute(
        "UPDATE pepsi.workqueue_body SET body = '\\xff00'::bytea \
         WHERE body_id = (SELECT body_id FROM pepsi.workqueue WHERE workqueue_id = $1)",
        &[&id],
    )
    .unwrap();
    let j = json(&queue(
        &s.conf,
        &["show", &id.to_string(), "--json", "--body"],
    ));
    assert_eq!(j["body_base64"], "/wA=");

    let out = queue(&s.conf, &["show", &id.to_string()]);
    expect(&out, 0);
    let text = stdout(&out);
    assert!(text.contains("\"strikes\": 2"), "the state, pretty: {text}");
    assert_lacks!(text, "Subject: test", "no header block unasked");
    let out = queue(&s.conf, &["show", &id.to_string(), "--headers"]);
    assert!(stdout(&out).contains("header block:\nSubject: test\r\n"));

    let out = queue(&s.conf, &["show", "999999"]);
    expect(&out, 65);
    assert!(stderr(&out).contains("message 999999: no such message"));
    expect(&queue(&s.conf, &["show", "nine"]), 64);
}
