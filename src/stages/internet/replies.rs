//! What an exchanger's words say, for `deliver.rs`: the relay's texts made to name the
//! exchanger, a 421 ("closing"), a 4.7.x deferral ("slow down"), a greeting that names
//! this host. Pure functions of text; nothing here talks to a peer.

/// `text` of the relay's, naming the exchanger `peer` where it says "smarthost", or
/// before it when it does not ("host mx.example[192.0.2.1]: cannot connect …").
pub fn relabel(text: &str, peer: &str) -> String {
    if !text.contains("smarthost") {
        return format!("host {peer}: {text}");
    }
    text.replace("the smarthost", &format!("host {peer}"))
        .replace("smarthost", &format!("host {peer}"))
}

/// Does a failure quote a 421 reply ("service not available, closing"), the reply an
/// exchanger that wants fewer connections gives?
pub fn says_421(text: &str) -> bool {
    text.split_whitespace().any(|word| word == "421")
}

/// Does a deferral's text carry a 4.7.x status (RFC 3463 security or policy: rate
/// limits, too many connections)?
pub fn says_slow_down(text: &str) -> bool {
    text.split_whitespace().any(|word| {
        word.strip_prefix("4.7.").is_some_and(|rest| {
            !rest.is_empty() && rest.len() <= 3 && rest.bytes().all(|b| b.is_ascii_digit())
        })
    })
}

/// Does a greeting name this host (`220 NAME ...`)?
pub fn greeted_as(greeting: &str, hostname: &str) -> bool {
    greeting
        .split_whitespace()
        .next()
        .is_some_and(|first| first.eq_ignore_ascii_case(hostname))
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
