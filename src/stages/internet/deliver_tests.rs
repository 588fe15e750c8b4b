//! The pure parts of one message's delivery: grouping by destination, the texts that
//! name the exchanger, the greeting that names this host.

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
fn the_relays_texts_name_the_exchanger_and_a_greeting_with_our_name_is_a_loop() {
    assert_eq!(
        relabel("smarthost refused <a@b>: 550 no", "mx.b[192.0.2.1]"),
        "host mx.b[192.0.2.1] refused <a@b>: 550 no"
    );
    assert_eq!(
        relabel("the smarthost greeted with 421 busy", "mx[::1]"),
        "host mx[::1] greeted with 421 busy"
    );
    assert_eq!(
        relabel("cannot connect to 192.0.2.1:25: refused", "mx.b[192.0.2.1]"),
        "host mx.b[192.0.2.1]: cannot connect to 192.0.2.1:25: refused"
    );
    assert!(says_421(
        "the smarthost greeted with 421 4.7.0 too many connections"
    ));
    assert!(!says_421("cannot connect to 192.0.2.1:4210: refused"));
    assert!(says_slow_down(
        "host mx[192.0.2.1] deferred the sender: 451 4.7.1 rate limited"
    ));
    assert!(!says_slow_down(
        "host mx[192.0.2.1] deferred <a@b>: 452 4.2.2 mailbox full"
    ));
    assert!(!says_slow_down("4.7.x 4.7. 4.7.1234"));
    assert!(greeted_as("MX.Pepsi.test ESMTP Postfix", "mx.pepsi.test"));
    assert!(!greeted_as(
        "mx.other.test ESMTP mx.pepsi.test",
        "mx.pepsi.test"
    ));
    assert!(!greeted_as("", "mx.pepsi.test"));
}
