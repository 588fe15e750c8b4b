//! Known answers and behaviour of [`super::scheme`]: postsrsd's own test vectors
//! (`run_postsrsd_tests.bats` of postsrsd 1.10: secret `tops3cr3t`, domain
//! `example.com`, 2020-01-01 00:01 UTC), the round trip of its `tests.c`, rotation,
//! ages, separators, case and quoted local parts.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::scheme::{DEFAULT_MAX_AGE_DAYS, Srs, SrsError};
use crate::mailbox;

/// 2020-01-01 00:01:00 UTC, the clock of postsrsd's test vectors.
pub(super) fn vectors_clock() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_577_836_860)
}

/// `days` whole days after (or before, when negative) the vectors' clock.
fn days_later(days: i64) -> SystemTime {
    let shift = Duration::from_secs(days.unsigned_abs() * 86_400);
    if days >= 0 {
        vectors_clock() + shift
    } else {
        vectors_clock() - shift
    }
}

/// The scheme of postsrsd's test vectors.
pub(super) fn vectors_srs() -> Srs {
    Srs::new(
        vec![b"tops3cr3t".to_vec()],
        "example.com",
        DEFAULT_MAX_AGE_DAYS,
    )
    .unwrap()
}

/// The answer for a malformed SRS address.
fn malformed(why: &str) -> Result<Option<String>, SrsError> {
    Err(SrsError::Malformed(why.into()))
}

#[test]
fn postsrsd_forward_vectors_are_reproduced() {
    let srs = vectors_srs();
    let now = vectors_clock();
    // "email address that needs not be rewritten"
    assert_eq!(srs.forward("test@example.com", now), Ok(None));
    assert_eq!(
        srs.forward("test@otherdomain.com", now),
        Ok(Some("SRS0=vmyz=2W=otherdomain.com=test@example.com".into()))
    );
    // "invalid email address without domain part": postsrsd answers "No at sign".
    assert_eq!(srs.forward("bla", now), Ok(None));
    // "Test double-rewrite": "Already rewritten".
    assert_eq!(
        srs.forward("SRS0=XjO9=2V=otherdomain.com=test@example.com", now),
        Ok(None)
    );
    // "Test rewrite of an SRS0 address from somewhere else": the vector checks the
    // prefix; the hash is the one postsrsd 1.10 gives under faketime at that clock.
    assert_eq!(
        srs.forward("SRS0=opaque+string@otherdomain.com", now),
        Ok(Some(
            "SRS1=chaI=otherdomain.com==opaque+string@example.com".into()
        ))
    );
    assert_eq!(
        srs.forward("SRS1=X=thirddomain.com==opaque+string@otherdomain.com", now),
        Ok(Some(
            "SRS1=JIBX=thirddomain.com==opaque+string@example.com".into()
        ))
    );
}

#[test]
fn postsrsd_reverse_vectors_are_reproduced() {
    let srs = vectors_srs();
    let now = vectors_clock();
    for (address, expected) in [
        (
            "SRS0=XjO9=2V=otherdomain.com=test@example.com",
            Ok(Some("test@otherdomain.com".to_string())),
        ),
        (
            "SRS1=JIBX=thirddomain.com==opaque+string@example.com",
            Ok(Some("SRS0=opaque+string@thirddomain.com".into())),
        ),
        ("test@example.com", Ok(None)),
        // Six months in the past, and six months in the future.
        (
            "SRS0=te87=T7=otherdomain.com=test@example.com",
            Err(SrsError::Expired),
        ),
        (
            "SRS0=VcIb=7N=otherdomain.com=test@example.com",
            Err(SrsError::Expired),
        ),
        (
            "SRS0=FAKE=2V=otherdomain.com=test@example.com",
            Err(SrsError::BadHash),
        ),
        (
            "srs0=xjo9=2v=otherdomain.com=test@example.com",
            Ok(Some("test@otherdomain.com".into())),
        ),
        (
            "SRS0=XJO9=2V=OTHERDOMAIN.COM=TEST@EXAMPLE.COM",
            Ok(Some("TEST@OTHERDOMAIN.COM".into())),
        ),
        ("SRS0=@example.com", malformed("no hash in SRS0 address")),
        (
            "SRS0=XjO9@example.com",
            malformed("no timestamp in SRS0 address"),
        ),
        (
            "SRS0=XjO9=2V@example.com",
            malformed("no host in SRS0 address"),
        ),
        (
            "SRS0=XjO9=2V=otherdomain.com@example.com",
            malformed("no user in SRS0 address"),
        ),
    ] {
        assert_eq!(srs.reverse(address, now), expected, "{address}");
    }
}

#[test]
fn odd_srs_senders_forward_exactly_as_postsrsd_forwards_them() {
    // Answers of postsrsd 1.10 run under faketime at the vectors' clock.
    let srs = vectors_srs();
    let now = vectors_clock();
    for (sender, expected) in [
        (
            "SRS0@otherdomain.com",
            Some("SRS1=H/b0=otherdomain.com=@example.com"),
        ),
        (
            "SRS0+opaque@otherdomain.com",
            Some("SRS1=uZTp=otherdomain.com=+opaque@example.com"),
        ),
        ("SRS1=x==@other.example", Some("SRS1=0N2Y==@example.com")),
        // "No host in SRS1 address.": the sender stays.
        ("SRS1@otherdomain.com", None),
    ] {
        assert_eq!(
            srs.forward(sender, now),
            Ok(expected.map(String::from)),
            "{sender}"
        );
    }
}

#[test]
fn the_timestamp_is_two_upper_case_base32_characters_of_the_day_modulo_1024() {
    let srs = vectors_srs();
    // 2020-01-01 is day 18262; 18262 mod 1024 = 854 = 26 * 32 + 22: "2" and "W".
    let stamp = |now| {
        let out = srs.forward("u@x.example", now).unwrap().unwrap();
        out.split('=').nth(2).unwrap().to_string()
    };
    assert_eq!(stamp(vectors_clock()), "2W");
    assert_eq!(stamp(days_later(-1)), "2V");
    assert_eq!(stamp(days_later(1)), "2X");
    // Day 854 + 170 = 1024 wraps to 0: "AA"; the epoch's day 0 too.
    assert_eq!(stamp(days_later(170)), "AA");
    assert_eq!(stamp(days_later(169)), "77");
    assert_eq!(stamp(UNIX_EPOCH), "AA");
    assert_eq!(stamp(UNIX_EPOCH - Duration::from_secs(86_400)), "AA");
}

#[test]
fn an_address_reverses_for_max_age_days_and_is_expired_after_or_from_the_future() {
    for max_age in [0, 1, DEFAULT_MAX_AGE_DAYS, 100] {
        let srs = Srs::new(vec![b"s".to_vec()], "fwd.example", max_age).unwrap();
        let signed = srs
            .forward("alice@remote.example", vectors_clock())
            .unwrap()
            .unwrap();
        let at = |days: i64| srs.reverse(&signed, days_later(days));
        let back = Ok(Some("alice@remote.example".to_string()));
        assert_eq!(at(0), back, "max age {max_age}");
        assert_eq!(at(i64::from(max_age)), back, "max age {max_age}");
        assert_eq!(at(i64::from(max_age) + 1), Err(SrsError::Expired));
        assert_eq!(at(-1), Err(SrsError::Expired), "a day in the future");
        // 1024 days on, the stamp is today's again (ten bits of days).
        assert_eq!(at(1024), back, "max age {max_age}");
    }
}

#[test]
fn the_age_counts_across_the_wrap_of_the_1024_days() {
    let srs = Srs::new(vec![b"s".to_vec()], "fwd.example", 21).unwrap();
    // Day 169 after the vectors' clock is slot 1023 ("77"); 10 days later is slot 9.
    let signed = srs
        .forward("u@x.example", days_later(169))
        .unwrap()
        .unwrap();
    assert!(signed.contains("=77="), "{signed}");
    assert_eq!(
        srs.reverse(&signed, days_later(179)),
        Ok(Some("u@x.example".into()))
    );
    assert_eq!(
        srs.reverse(&signed, days_later(169 + 22)),
        Err(SrsError::Expired)
    );
}

#[test]
fn rotation_the_first_secret_signs_and_every_secret_verifies() {
    let now = vectors_clock();
    let old = Srs::new(vec![b"old".to_vec()], "fwd.example", 21).unwrap();
    let new = Srs::new(vec![b"new".to_vec()], "fwd.example", 21).unwrap();
    let both = Srs::new(vec![b"new".to_vec(), b"old".to_vec()], "fwd.example", 21).unwrap();
    let by_old = old.forward("a@x.example", now).unwrap().unwrap();
    let by_new = new.forward("a@x.example", now).unwrap().unwrap();
    assert_ne!(by_old, by_new);
    assert_eq!(
        both.forward("a@x.example", now),
        Ok(Some(by_new.clone())),
        "the first signs"
    );
    for signed in [&by_old, &by_new] {
        assert_eq!(both.reverse(signed, now), Ok(Some("a@x.example".into())));
    }
    assert_eq!(new.reverse(&by_old, now), Err(SrsError::BadHash));
    assert_eq!(old.reverse(&by_new, now), Err(SrsError::BadHash));
    let by_old_srs1 = old
        .forward("SRS0=h=TT=y=b@x.example", now)
        .unwrap()
        .unwrap();
    assert_eq!(
        both.reverse(&by_old_srs1, now),
        Ok(Some("SRS0=h=TT=y=b@x.example".into()))
    );
}

#[test]
fn only_the_first_four_hash_characters_count_and_fewer_are_too_short() {
    let srs = vectors_srs();
    let now = vectors_clock();
    let good = "test@otherdomain.com";
    for address in [
        "SRS0=vmyzXYZ=2W=otherdomain.com=test@example.com",
        "SRS0=VMYZ=2w=otherdomain.com=test@example.com",
        "SRS0=vmyz=2W=otherdomain.com=test@EXAMPLE.com",
    ] {
        assert_eq!(
            srs.reverse(address, now),
            Ok(Some(good.into())),
            "{address}"
        );
    }
    assert_eq!(
        srs.reverse("SRS0=vmy=2W=otherdomain.com=test@example.com", now),
        malformed("hash too short")
    );
    assert_eq!(
        srs.reverse("SRS0=vmyy=2W=otherdomain.com=test@example.com", now),
        Err(SrsError::BadHash)
    );
}

#[test]
fn the_timestamp_is_checked_before_the_hash_as_srs2_c_does() {
    let srs = vectors_srs();
    let now = vectors_clock();
    for (address, expected) in [
        (
            "SRS0=FAKE=2!=otherdomain.com=test@example.com",
            "bad base32 character in timestamp",
        ),
        (
            "SRS0=FAKE=2W1=otherdomain.com=test@example.com",
            "the timestamp is not two characters",
        ),
        (
            "SRS0=FAKE==otherdomain.com=test@example.com",
            "the timestamp is not two characters",
        ),
        (
            "SRS0=F=2W=otherdomain.com=test@example.com",
            "hash too short",
        ),
    ] {
        assert_eq!(srs.reverse(address, now), malformed(expected), "{address}");
    }
    assert_eq!(
        srs.reverse("SRS0=FAKE=T7=otherdomain.com=test@example.com", now),
        Err(SrsError::Expired)
    );
}

#[test]
fn plus_and_minus_separators_after_the_tag_reverse_like_equals() {
    let srs = vectors_srs();
    let now = vectors_clock();
    for address in [
        "SRS0+vmyz=2W=otherdomain.com=test@example.com",
        "SRS0-vmyz=2W=otherdomain.com=test@example.com",
        "sRs0-vmyz=2W=otherdomain.com=test@example.com",
    ] {
        assert_eq!(
            srs.reverse(address, now),
            Ok(Some("test@otherdomain.com".into())),
            "{address}"
        );
    }
    for address in [
        "SRS1+JIBX=thirddomain.com==opaque+string@example.com",
        "srs1-JIBX=thirddomain.com==opaque+string@example.com",
    ] {
        assert_eq!(
            srs.reverse(address, now),
            Ok(Some("SRS0=opaque+string@thirddomain.com".into())),
            "{address}"
        );
    }
    // Another separator, or none, is no SRS address at all.
    for address in ["SRS0.vmyz=2W=x=y@example.com", "SRS0@example.com"] {
        assert_eq!(srs.reverse(address, now), Ok(None), "{address}");
    }
}

#[test]
fn forward_always_writes_equals_and_keeps_a_foreign_separator_in_the_user() {
    let srs = vectors_srs();
    let now = vectors_clock();
    let srs1 = srs
        .forward("SRS0+opaque@otherdomain.com", now)
        .unwrap()
        .unwrap();
    assert!(srs1.starts_with("SRS1="), "{srs1}");
    assert!(
        srs1.ends_with("=otherdomain.com=+opaque@example.com"),
        "{srs1}"
    );
    assert_eq!(
        srs.reverse(&srs1, now),
        Ok(Some("SRS0+opaque@otherdomain.com".into()))
    );
    let again = srs
        .forward("srs1-X=third.example==opaque@otherdomain.com", now)
        .unwrap()
        .unwrap();
    assert!(again.starts_with("SRS1="), "{again}");
    assert!(
        again.ends_with("=third.example==opaque@example.com"),
        "{again}"
    );
    // A bare SRS0 tag is another forwarder's address with an empty rest (srs2.c's
    // separator test accepts the end of the string).
    let bare = srs.forward("SRS0@otherdomain.com", now).unwrap().unwrap();
    assert!(bare.ends_with("=otherdomain.com=@example.com"), "{bare}");
    assert_eq!(
        srs.reverse(&bare, now),
        Ok(Some("SRS0@otherdomain.com".into()))
    );
}

#[test]
fn forward_leaves_what_postsrsd_leaves() {
    let srs = vectors_srs();
    let now = vectors_clock();
    for sender in [
        "",
        "bla",
        "test@example.com",
        "test@EXAMPLE.COM",
        // Ours and valid, in another domain: postsrsd's "Already rewritten".
        "SRS0=vmyz=2W=otherdomain.com=test@elsewhere.example",
        "SRS1=JIBX=thirddomain.com==opaque+string@elsewhere.example",
        // An SRS1 postsrsd cannot parse: no hash, no first host, no user.
        "SRS1@otherdomain.com",
        "SRS1=@otherdomain.com",
        "SRS1=hash@otherdomain.com",
        "SRS1=hash=host@otherdomain.com",
    ] {
        assert_eq!(srs.forward(sender, now), Ok(None), "{sender:?}");
    }
    // Ours but expired, or with a wrong hash: another forwarder's SRS0 as far as the
    // scheme can tell.
    for sender in [
        "SRS0=te87=T7=otherdomain.com=test@elsewhere.example",
        "SRS0=FAKE=2W=otherdomain.com=test@elsewhere.example",
    ] {
        let out = srs.forward(sender, now).unwrap().unwrap();
        assert!(out.starts_with("SRS1="), "{out}");
    }
}

#[test]
fn an_srs1_with_empty_fields_is_signed_as_srs2_c_signs_it() {
    let srs = vectors_srs();
    let now = vectors_clock();
    let out = srs.forward("SRS1=x==@other.example", now).unwrap().unwrap();
    assert!(
        out.starts_with("SRS1=") && out.ends_with("==@example.com"),
        "{out}"
    );
    assert_eq!(mailbox::check(&out), Ok(()));
    // It reverses to "SRS0@": no mailbox.
    assert!(matches!(srs.reverse(&out, now), Err(SrsError::Unusable(_))));
}

#[test]
fn a_quoted_local_part_is_rewritten_in_quotes_and_reversed_in_quotes() {
    let srs = vectors_srs();
    let now = vectors_clock();
    for original in [
        "\"john smith\"@remote.example",
        "\"a=b \\\"c\\\\\"@remote.example",
        "\"ünï cödé\"@remote.example",
    ] {
        let out = srs.forward(original, now).unwrap().unwrap();
        assert!(out.starts_with("\"SRS0="), "{out}");
        assert_eq!(mailbox::check(&out), Ok(()), "{out}");
        assert_eq!(srs.reverse(&out, now), Ok(Some(original.into())), "{out}");
    }
    // Quotes that need not be there are dropped: the content is what is signed.
    let quoted = srs.forward("\"test\"@otherdomain.com", now).unwrap();
    assert_eq!(
        quoted.as_deref(),
        Some("SRS0=vmyz=2W=otherdomain.com=test@example.com")
    );
    assert_eq!(
        srs.reverse("\"SRS0=vmyz=2W=otherdomain.com=test\"@example.com", now),
        Ok(Some("test@otherdomain.com".into()))
    );
}

#[test]
fn address_literals_and_international_domains_go_through() {
    let srs = vectors_srs();
    let now = vectors_clock();
    for original in [
        "u@[192.0.2.1]",
        "u@[IPv6:2001:db8::1]",
        "jörg@bücher.example",
        "用户@例子.广告",
    ] {
        let out = srs.forward(original, now).unwrap().unwrap();
        assert_eq!(mailbox::check(&out), Ok(()), "{out}");
        assert_eq!(srs.reverse(&out, now), Ok(Some(original.into())), "{out}");
    }
}

#[test]
fn reverse_leaves_addresses_outside_srs_domain_and_non_srs_ones() {
    let srs = vectors_srs();
    let now = vectors_clock();
    for recipient in [
        "",
        "postmaster@example.com",
        "SRS0=vmyz=2W=otherdomain.com=test@elsewhere.example",
        "SRS0=vmyz=2W=otherdomain.com=test@sub.example.com",
        "SRS2=vmyz=2W=otherdomain.com=test@example.com",
        "SRSX@example.com",
        "SRS@example.com",
        "no-at-sign",
    ] {
        assert_eq!(srs.reverse(recipient, now), Ok(None), "{recipient:?}");
    }
}

#[test]
fn new_refuses_no_secret_an_empty_or_nul_secret_and_a_bad_domain() {
    let err = |secrets: Vec<Vec<u8>>, domain: &str| Srs::new(secrets, domain, 21).unwrap_err();
    assert_eq!(
        err(vec![], "x.example"),
        "no secret: at least one is needed to sign"
    );
    assert_eq!(
        err(vec![b"a".to_vec(), vec![]], "x.example"),
        "secret 2 is empty"
    );
    assert!(err(vec![b"a\0b".to_vec()], "x.example").contains("secret 1 holds a NUL"));
    for domain in ["", "a@b", "x..example", "-x.example", "x example"] {
        assert!(
            err(vec![b"s".to_vec()], domain).starts_with("SRS_DOMAIN"),
            "{domain:?}"
        );
    }
    let srs = Srs::new(vec![b"not shown".to_vec()], "x.example", 21).unwrap();
    assert_eq!(srs.domain(), "x.example");
    let shown = format!("{srs:?}");
    assert!(
        shown.contains("x.example") && !shown.contains("not shown"),
        "{shown}"
    );
}

#[test]
fn errors_read_as_short_reasons() {
    assert_eq!(SrsError::BadHash.to_string(), "SRS hash does not match");
    assert_eq!(SrsError::Expired.to_string(), "SRS address expired");
    assert_eq!(
        SrsError::Malformed("no hash in SRS0 address".into()).to_string(),
        "malformed SRS address: no hash in SRS0 address"
    );
    assert_eq!(
        SrsError::Unusable("the rewritten address is long".into()).to_string(),
        "address cannot be rewritten: the rewritten address is long"
    );
}

/// A small deterministic generator (xorshift64*), so every run checks the same
/// addresses.
pub(super) struct Rng(pub u64);

impl Rng {
    /// The next number below `n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }

    /// `len` characters of `chars`, a dot now and then, never first, last or doubled.
    fn part(&mut self, len: usize, chars: &[u8]) -> String {
        let mut out = String::with_capacity(len);
        for i in 0..len {
            let dot = i > 0 && i + 1 < len && !out.ends_with('.') && self.below(16) == 0;
            let c = if dot {
                b'.'
            } else {
                chars[self.below(chars.len())]
            };
            out.push(char::from(c));
        }
        out
    }
}

#[test]
fn random_addresses_round_trip_and_any_changed_character_is_refused() {
    // postsrsd's tests.c: every length of local part and domain from 1 to 63; the
    // reversal of the forwarded address is the original, and adding one to any byte
    // before the @ makes it fail.
    let srs = vectors_srs();
    let now = vectors_clock();
    let mut rng = Rng(0x5eed_0f5e_c7e7);
    let local_chars = b"abcdefghijklmnopqrstuvwxyzABCXYZ0123456789-+=";
    for l1 in 1..=63 {
        for l2 in 1..=63 {
            let address = format!(
                "{}@{}",
                rng.part(l1, local_chars),
                rng.part(l2, b"abcdefghijklmnopqrstuvwxyz")
            );
            let out = srs.forward(&address, now).unwrap().unwrap();
            assert_eq!(mailbox::check(&out), Ok(()), "{out}");
            assert_eq!(srs.reverse(&out, now), Ok(Some(address.clone())), "{out}");
            if (l1 + l2) % 7 != 0 {
                continue;
            }
            let at = out.find('@').unwrap();
            for i in 0..at {
                let mut changed = out.clone().into_bytes();
                changed[i] += 1;
                let changed = String::from_utf8(changed).unwrap();
                let back = srs.reverse(&changed, now);
                assert!(!matches!(back, Ok(Some(_))), "{changed} reversed: {back:?}");
            }
        }
    }
}
