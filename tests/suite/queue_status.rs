//! `pepsi-queue status` (`src/queue/status.rs`): every stage and status, the age
//! shape, stages without a section and the statistics, as text and as `--json`.

use serde_json::Value;

use crate::util::queue::{STAGES, expect, json, queue, varied_queue};
use crate::util::{Scenario, stdout};

#[test]
fn status_shows_every_stage_and_status_the_age_shape_unknown_stages_and_statistics() {
    let (s, mut c) = Scenario::new("q-status").stages(STAGES).connect();
    varied_queue(&mut c);
    let out = queue(&s.conf, &["status", "--json"]);
    expect(&out, 0);
    let j = json(&out);
    assert_eq!(j["rows"], 7);
    for (status, n) in [
        ("pending", 2),
        ("running", 1),
        ("paused", 1),
        ("failed", 1),
        ("timeout", 1),
        ("held", 1),
    ] {
        assert_eq!(j["statuses"][status], n, "{status}");
    }
    let stage = |name: &str| -> Value {
        j["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stage"] == name)
            .unwrap_or_else(|| panic!("no stage {name} in {j}"))
            .clone()
    };
    let relay = stage("relay");
    assert_eq!(relay["configured"], true);
    assert_eq!(relay["rows"], 6);
    assert_eq!(relay["statuses"]["held"]["rows"], 1);
    assert!(relay["oldest_age_seconds"].as_f64().unwrap() >= 3.0 * 3600.0 - 5.0);
    assert!(
        relay["statuses"]["paused"]["oldest_age_seconds"]
            .as_f64()
            .unwrap()
            >= 420.0
    );
    assert_eq!(
        relay["age_buckets"],
        serde_json::json!([4, 1, 0, 0, 0, 0, 1]),
        "0-5m, 5-10m (7 minutes), …, 160m+ (3 hours)"
    );
    assert_eq!(stage("in")["rows"], 0, "a configured stage without rows");
    assert_eq!(stage("lost")["configured"], false);
    assert_eq!(
        j["unknown_stages"],
        serde_json::json!([{"stage": "lost", "rows": 1}])
    );
    assert_eq!(j["stage_stats"][0]["stage"], "relay");
    assert_eq!(j["stage_stats"][0]["busy_us"], 2_500_000);
    assert_eq!(j["stage_stats"][0]["senders_served"], 17);
    assert_eq!(j["dispatch_stats"]["rows_claimed"], 45);
    assert!(j["dispatch_stats"]["updated_age_seconds"].as_f64().unwrap() >= 29.0);
    assert_eq!(j["dispatcher_running"], false);

    let out = queue(&s.conf, &["status"]);
    expect(&out, 0);
    let text = stdout(&out);
    assert!(text.starts_with("queue: 7 messages ("), "{text}");
    assert!(text.contains("lost (no section)"), "{text}");
    assert!(
        text.contains("without a [stage-NAME] section are never claimed: lost (1)"),
        "{text}"
    );
    assert!(text.contains("0-5m  5-10m  10-20m"), "{text}");
    assert!(text.contains("dispatcher: NOT RUNNING"), "{text}");
    assert!(text.contains("37 stages executed, 12 claims, 45 rows claimed, 6 worker starts"));
}
