//! The pure part of one message's delivery: grouping its recipients by destination.

use super::*;

#[test]
fn recipients_are_grouped_by_domain_in_lower_case_in_the_order_they_appear() {
    let r: Vec<String> = [
        "a@X.example",
        "b@y.example",
        "c@x.EXAMPLE",
        "nodomain",
        "d@",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let g = by_destination(&r);
    assert_eq!(g.len(), 3);
    assert_eq!(
        g[0],
        (Some("x.example".into()), vec![r[0].clone(), r[2].clone()])
    );
    assert_eq!(g[1], (Some("y.example".into()), vec![r[1].clone()]));
    assert_eq!(g[2], (None, vec![r[3].clone(), r[4].clone()]));
}

#[test]
fn ten_thousand_recipients_in_as_many_domains_make_as_many_groups_in_order() {
    let r: Vec<String> = (0..10_000).map(|i| format!("u{i}@d{i}.example")).collect();
    let g = by_destination(&r);
    assert_eq!(g.len(), 10_000);
    assert_eq!(
        g[9_999],
        (Some("d9999.example".into()), vec![r[9_999].clone()])
    );
    let one: Vec<String> = (0..10_000).map(|i| format!("u{i}@D.example")).collect();
    let g = by_destination(&one);
    assert_eq!(g, vec![(Some("d.example".into()), one.clone())]);
}
