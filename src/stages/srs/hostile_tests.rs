//! Hostile input through [`super::scheme`]: whatever comes in, the answer is an
//! `Ok(None)`, an address [`mailbox::check`] accepts, or an error with a reason; never
//! a panic.

use std::time::SystemTime;

use super::scheme::{Srs, SrsError};
use super::scheme_tests::{Rng, vectors_clock, vectors_srs};
use crate::mailbox;

/// One direction's answer.
type Answer = Result<Option<String>, SrsError>;

/// Runs both directions on `input` and checks the invariant: an address produced is a
/// mailbox, an error has a reason. Returns both answers, forward first.
fn both_ways(srs: &Srs, input: &str, now: SystemTime) -> (Answer, Answer) {
    let forward = srs.forward(input, now);
    let reverse = srs.reverse(input, now);
    for (way, result) in [("forward", &forward), ("reverse", &reverse)] {
        match result {
            Ok(Some(out)) => assert_eq!(
                mailbox::check(out),
                Ok(()),
                "{way} of {input:?} gave {out:?}"
            ),
            Ok(None) => {}
            Err(e) => assert!(
                e.to_string().len() > 10,
                "{way} of {input:?}: an error without a reason: {e:?}"
            ),
        }
    }
    (forward, reverse)
}

#[test]
fn a_sender_of_1000_characters_is_refused_with_its_length() {
    let srs = vectors_srs();
    let now = vectors_clock();
    let long = format!("{}@remote.example", "a".repeat(1000 - 15));
    assert_eq!(long.len(), 1000);
    let (forward, reverse) = both_ways(&srs, &long, now);
    assert_eq!(
        forward,
        Err(SrsError::Unusable(
            "the sender is not a valid mailbox: is 1000 octets long; at most 256 are allowed"
                .into()
        ))
    );
    assert_eq!(reverse, Ok(None));
    let long_srs = format!(
        "SRS0=vmyz=2W=otherdomain.com={}@example.com",
        "a".repeat(980)
    );
    assert!(matches!(
        srs.reverse(&long_srs, now),
        Err(SrsError::Malformed(why)) if why.contains("octets long")
    ));
}

#[test]
fn a_sender_that_fits_but_whose_rewriting_does_not_is_refused() {
    let srs = vectors_srs();
    let now = vectors_clock();
    // 64 + 1 + 191 = 256 octets: a mailbox; with the 13 octets of SRS0=HHHH=TT= and
    // another = it is not.
    let label = "d".repeat(63);
    let sender = format!(
        "{}@{label}.{label}.{}.example",
        "l".repeat(64),
        "e".repeat(55)
    );
    assert_eq!(sender.len(), 256);
    assert_eq!(mailbox::check(&sender), Ok(()));
    match srs.forward(&sender, now) {
        Err(SrsError::Unusable(why)) => {
            assert!(
                why.starts_with("the rewritten address is not a valid mailbox: is "),
                "{why}"
            );
            assert!(
                why.ends_with("octets long; at most 256 are allowed"),
                "{why}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn equals_and_at_signs_in_odd_places_give_a_reason_or_nothing() {
    let srs = vectors_srs();
    let now = vectors_clock();
    let malformed = |why: &str| Err(SrsError::Malformed(why.into()));
    for (input, reverse) in [
        ("SRS0==@example.com", malformed("no host in SRS0 address")),
        ("SRS0===@example.com", malformed("no user in SRS0 address")),
        (
            "SRS0=====@example.com",
            malformed("the timestamp is not two characters"),
        ),
        ("SRS0==2W==@example.com", malformed("hash too short")),
        (
            "SRS0=abcd=ZZ=@example.com",
            malformed("no user in SRS0 address"),
        ),
        (
            "SRS0=abcd=Z1=x=y@example.com",
            malformed("bad base32 character in timestamp"),
        ),
        ("SRS0=abcd=2W=dom=@example.com", Err(SrsError::BadHash)),
        ("SRS1=x==@example.com", malformed("hash too short")),
        ("SRS1=xxxx==@example.com", Err(SrsError::BadHash)),
        ("SRS1=@example.com", malformed("no hash in SRS1 address")),
        ("SRS1=x@example.com", malformed("no host in SRS1 address")),
        (
            "SRS1=x=host@example.com",
            malformed("no user in SRS1 address"),
        ),
        ("SRS0=@EXAMPLE.COM", malformed("no hash in SRS0 address")),
        ("=@example.com", Ok(None)),
        ("SRS0@example.com", Ok(None)),
        ("@example.com", Ok(None)),
    ] {
        let (_, got) = both_ways(&srs, input, now);
        assert_eq!(got, reverse, "{input}");
    }
    // The same shapes from another forwarder: signed or left, never an invalid address.
    for input in [
        "SRS0==@x.example",
        "SRS0=abcd=ZZ=@x.example",
        "SRS0=abcd=TT=dom=@x.example",
        "SRS1=x==@x.example",
        "==@x.example",
        "a=b=c@x.example",
    ] {
        let (forward, reverse) = both_ways(&srs, input, now);
        assert!(matches!(forward, Ok(Some(_))), "{input}: {forward:?}");
        assert_eq!(reverse, Ok(None), "{input}");
    }
    // An SRS1 with an empty hash: postsrsd's "No hash in SRS1 address", left alone.
    assert_eq!(srs.forward("SRS1==@x.example", now), Ok(None));
}

#[test]
fn an_srs_address_that_reverses_to_no_mailbox_is_refused_after_its_hash() {
    // Signed by us (so the hash matches) with an empty host or user: the original is
    // no mailbox, so the answer is an error, not an address.
    let srs = vectors_srs();
    let now = vectors_clock();
    let empty_user = srs.forward("\"\"@remote.example", now).unwrap().unwrap();
    assert!(
        empty_user.ends_with("=remote.example=@example.com"),
        "{empty_user}"
    );
    assert_eq!(
        srs.reverse(&empty_user, now),
        Ok(Some("\"\"@remote.example".into()))
    );
    let srs1 = srs.forward("SRS1=x==@x.example", now).unwrap().unwrap();
    match srs.reverse(&srs1, now) {
        Err(SrsError::Unusable(why)) => {
            assert_eq!(
                why,
                "the original address is not a valid mailbox: the domain after @ is empty"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn quoted_local_parts_with_equals_or_at_signs_inside_give_a_reason_or_an_address() {
    let srs = vectors_srs();
    let now = vectors_clock();
    // The original comes back quoted only where it must be.
    for (input, back) in [
        ("\"a=b\"@x.example", "a=b@x.example"),
        ("\"=\"@x.example", "=@x.example"),
        (
            "\"SRS0=abcd=2W=x=y\"@x.example",
            "SRS0=abcd=2W=x=y@x.example",
        ),
        ("\"SRS0=\"@x.example", "SRS0=@x.example"),
        ("\"a b=c\"@x.example", "\"a b=c\"@x.example"),
    ] {
        let (forward, _) = both_ways(&srs, input, now);
        let out = forward.unwrap().unwrap();
        assert_eq!(
            srs.reverse(&out, now).unwrap().as_deref(),
            Some(back),
            "{out}"
        );
    }
    for input in [
        "\"a@b\"@x.example",
        "\"@\"@x.example",
        "\"SRS0=a@b\"@x.example",
    ] {
        let (forward, _) = both_ways(&srs, input, now);
        assert_eq!(
            forward,
            Err(SrsError::Unusable(
                "the sender's quoted local part holds an @, which SRS cannot carry".into()
            )),
            "{input}"
        );
    }
    for input in [
        "\"SRS0=vmyz=2W=otherdomain.com=te@st\"@example.com",
        "\"SRS1=a=b=@c\"@example.com",
    ] {
        let (_, reverse) = both_ways(&srs, input, now);
        assert_eq!(
            reverse,
            Err(SrsError::Malformed(
                "the local part holds an @ inside its quotes".into()
            ))
        );
    }
    // An unclosed or misplaced quote: no mailbox, and no SRS address of ours.
    for input in [
        "\"SRS0=a@example.com",
        "\"SRS0\"=a@example.com",
        "\"@example.com",
    ] {
        let (forward, reverse) = both_ways(&srs, input, now);
        assert!(
            matches!(forward, Err(SrsError::Unusable(_))),
            "{input}: {forward:?}"
        );
        assert!(
            matches!(reverse, Ok(None) | Err(SrsError::Malformed(_))),
            "{input}: {reverse:?}"
        );
    }
}

#[test]
fn nul_line_breaks_and_invisible_characters_never_go_through() {
    let srs = vectors_srs();
    let now = vectors_clock();
    for input in [
        "a\0b@x.example",
        "a@x.example\r\nRCPT TO:<evil@y>",
        "a\n@x.example",
        "\"a\rb\"@x.example",
        "a\u{202e}b@x.example",
        "SRS0=vmyz=2W=otherdomain.com=te\0st@example.com",
        "SRS0=vmyz=2W=otherdomain.com=test\n@example.com",
        "\"SRS0=vmyz=2W=other\ndomain.com=test\"@example.com",
    ] {
        let (forward, reverse) = both_ways(&srs, input, now);
        assert!(
            matches!(forward, Err(SrsError::Unusable(_))),
            "{input:?}: {forward:?}"
        );
        assert!(!matches!(reverse, Ok(Some(_))), "{input:?}: {reverse:?}");
    }
    // A control character in an SRS address of ours is refused before any hash.
    let srs_ctl = srs.reverse("SRS0=vmyz=2W=otherdomain.com=test\u{7f}@example.com", now);
    assert!(
        matches!(srs_ctl, Err(SrsError::Malformed(_))),
        "{srs_ctl:?}"
    );
}

#[test]
fn non_ascii_is_hashed_as_bytes_and_only_ascii_letters_fold() {
    let srs = vectors_srs();
    let now = vectors_clock();
    let out = srs.forward("ÄBC@Bücher.example", now).unwrap().unwrap();
    assert_eq!(
        srs.reverse(&out, now),
        Ok(Some("ÄBC@Bücher.example".into()))
    );
    // ASCII letters fold (the hash is over lowercased ASCII), others do not.
    let folded = out.replace("ÄBC", "Äbc").replace("Bücher", "bücher");
    assert_eq!(
        srs.reverse(&folded, now),
        Ok(Some("Äbc@bücher.example".into()))
    );
    let other = out.replace("ÄBC", "äBC");
    assert_eq!(srs.reverse(&other, now), Err(SrsError::BadHash));
    // A non-ASCII timestamp or hash is refused, not cut inside a character.
    for input in [
        "SRS0=vmyz=2é=otherdomain.com=test@example.com",
        "SRS0=vmy€=2W=otherdomain.com=test@example.com",
        "SRS0=é=2W=otherdomain.com=test@example.com",
        "SRS1=€€€€€=a=b@example.com",
    ] {
        let (_, reverse) = both_ways(&srs, input, now);
        assert!(
            matches!(reverse, Err(SrsError::Malformed(_) | SrsError::BadHash)),
            "{input}: {reverse:?}"
        );
    }
}

#[test]
fn random_strings_of_tricky_characters_never_panic_nor_give_an_invalid_address() {
    let srs = vectors_srs();
    let now = vectors_clock();
    let pieces = [
        "=",
        "@",
        "\"",
        "\\",
        ".",
        "-",
        "+",
        " ",
        "SRS0",
        "SRS1",
        "srs0=",
        "vmyz",
        "2W",
        "example.com",
        "x",
        "é",
        "\0",
        "\n",
        "\r",
        "[",
        "]",
        "IPv6:",
        "::1",
        "€",
    ];
    let mut rng = Rng(0xdead_beef_cafe);
    for _ in 0..20_000 {
        let n = rng.below(12);
        let mut input = String::new();
        for _ in 0..n {
            input.push_str(pieces[rng.below(pieces.len())]);
        }
        if rng.below(2) == 0 {
            input.push_str("@example.com");
        }
        let _ = both_ways(&srs, &input, now);
    }
}
