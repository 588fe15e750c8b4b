//! The Sender Rewriting Scheme's addresses (§19): [`Srs::forward`] turns an envelope
//! sender into an `SRS0`/`SRS1` address in `SRS_DOMAIN`, [`Srs::reverse`] turns such a
//! recipient back. Byte-compatible with postsrsd 1.10 (Debian bookworm's), which uses
//! the libsrs2 code it carries in `srs2.c`, so that either can reverse what the other
//! wrote. Used by the `srs` stage (`stages::srs`), which reads the secrets with
//! [`super::secrets::load`]. Pure: the clock is a parameter; it must not read files,
//! the configuration or the database.
//!
//! The rules, with the file of postsrsd 1.10 each one follows:
//! - Timestamp (`srs2.c`, `srs_timestamp_create`): the whole days since the epoch
//!   modulo 1024, written as two characters of the base32 alphabet
//!   `ABCDEFGHIJKLMNOPQRSTUVWXYZ234567` (upper case), the high five bits first.
//! - Hash (`srs2.c`, `srs_hash_create_v`; HMAC in `sha1.c`): HMAC-SHA1 keyed with the
//!   secret's bytes over the fields concatenated with nothing between them, each field
//!   with its ASCII letters `A`–`Z` lowercased and every other byte kept (postsrsd runs
//!   in the C locale); the first four characters of the standard base64 alphabet of
//!   the result (its first three bytes). The first secret signs.
//! - Forward (`postsrsd.c`, `handle_forward`; `srs2.c`, `srs_forward`,
//!   `srs_compile_guarded`, `srs_compile_shortcut`). The sender stays as it is when it
//!   is the null sender, when it has no `@` (postsrsd answers "No at sign"), when its
//!   domain is `SRS_DOMAIN` compared without regard to ASCII case, and when it is
//!   already an SRS address that reverses with these secrets and this clock, in any
//!   domain ("Already rewritten"). Otherwise, with `local` and `host` the two parts:
//!   - `local` is `SRS1` (any case) followed by `=`, `-`, `+` or nothing: everything
//!     after the separator up to the next `=` is the old hash, from there up to the
//!     next `=` the first host, the rest (a leading `=` included) the user; the result
//!     is `SRS1=HASH=firsthost=user` with the hash over firsthost and user. With no
//!     hash, no first host or no user postsrsd answers an error and the sender stays.
//!   - `local` is `SRS0` (any case) followed by `=`, `-`, `+` or nothing (another
//!     forwarder's address): `SRS1=HASH=host=rest` where `rest` is `local` after its
//!     four-character tag, separator included, and the hash is over host and rest.
//!   - anything else: `SRS0=HASH=TT=host=local`, the hash over TT, host and local.
//!
//!   The separator written after the tag is always `=` (postsrsd's default).
//!   [`Srs::forward`] answers `Ok(None)` exactly where postsrsd's forward table gives
//!   the sender back or answers 500, which leaves Postfix's sender as it was.
//! - Reverse (`srs2.c`, `srs_reverse`, `srs_parse_guarded`, `srs_parse_shortcut`): a
//!   local part is an SRS address when it starts with `SRS0` or `SRS1` in any case
//!   followed by one of `=`, `-`, `+`. After that separator, fields are cut at `=`:
//!   - `SRS1`: the hash (up to the first `=`; none: "no hash"), the first host (up to
//!     the next `=`; no `=`: "no host"), the user (the rest; no `=` before it: "no
//!     user"). The hash is checked over first host and user; the result is `SRS0`
//!     followed by the user, `@`, the first host.
//!   - `SRS0`: hash, timestamp, host, each ended by `=` ("no hash", "no timestamp",
//!     "no host", "no user" when one is missing), the user is the rest. The timestamp
//!     is checked first, then the hash over timestamp, host and user; the result is
//!     `user@host`.
//!
//!   Fields may be empty; what they give must still be a mailbox (below).
//! - Timestamp check (`srs2.c`, `srs_timestamp_check`): each character upper-cased
//!   must be in the base32 alphabet ("bad base32 character"); the day of the stamp is
//!   compared with today modulo 1024, today taken 1024 days later when it is smaller
//!   than the stamp (the wrap-around), and the address is valid when today is at most
//!   `MAX_AGE` days after it. A stamp from the future thus counts as nearly 1024 days
//!   old: expired. A stamp that is not two characters is refused (srs2.c reports it
//!   as out of date; here it is malformed).
//! - Hash check (`srs2.c`, `srs_hash_check`): fewer than four characters is "hash too
//!   short"; only the first four count; they are compared without regard to ASCII case
//!   with the hash of every secret in turn (rotation: the first signs, all verify).
//!
//! Where Pepsi goes beyond postsrsd:
//! - Addresses are in their RFC 5321 form ([`mailbox`] is the judge): a quoted local
//!   part is unquoted first and the scheme works on its content (the address's
//!   unquoted, internal form, which is what postsrsd is given to agree with); an SRS
//!   local part that is not a dot-string is written in quotes.
//!   A local part holding an `@` cannot go through (postsrsd cuts at the first `@`).
//! - Every address produced passes [`mailbox::check`] (at most 256 octets, no control
//!   characters...) or is an error; postsrsd writes whatever fits in 1024 bytes.
//! - [`Srs::reverse`] looks only at recipients in `SRS_DOMAIN`; postsrsd reverses an
//!   SRS address in any domain.

use std::borrow::Cow;
use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use ring::hmac;

use crate::mailbox;

/// `MAX_AGE`'s default in days (srs2.c's `srs_init`).
pub const DEFAULT_MAX_AGE_DAYS: u32 = 21;

/// The characters of a hash written and compared (srs2.c's default `hashlength` and
/// `hashmin`).
const HASH_LENGTH: usize = 4;

/// The base32 alphabet of timestamps (srs2.c's `SRS_TIME_BASECHARS`).
const TIME_BASECHARS: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

/// The timestamps there are: two base32 characters, ten bits of days.
const TIME_SLOTS: u64 = 1024;

/// Seconds in a timestamp's day (srs2.c's `SRS_TIME_PRECISION`).
const SECONDS_PER_DAY: u64 = 86_400;

/// The separators an SRS tag may be followed by (srs2.c's `srs_separators`).
const SEPARATORS: [char; 3] = ['=', '-', '+'];

/// Why an address was not rewritten; its `Display` is a short reason fit for a
/// delivery status notification's diagnostic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SrsError {
    /// The hash matches none of the secrets.
    BadHash,
    /// The timestamp is more than `MAX_AGE` days old, or from the future.
    Expired,
    /// An SRS address that is not well formed: what is wrong with it.
    Malformed(String),
    /// The address cannot be rewritten into a valid mailbox, or an SRS address does not
    /// reverse into one: why.
    Unusable(String),
}

impl fmt::Display for SrsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SrsError::BadHash => f.write_str("SRS hash does not match"),
            SrsError::Expired => f.write_str("SRS address expired"),
            SrsError::Malformed(why) => write!(f, "malformed SRS address: {why}"),
            SrsError::Unusable(why) => write!(f, "address cannot be rewritten: {why}"),
        }
    }
}

impl std::error::Error for SrsError {}

/// Which SRS tag a local part starts with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tag {
    /// `SRS0`: the original address, signed with a timestamp.
    Zero,
    /// `SRS1`: another forwarder's `SRS0` address, signed again.
    One,
}

/// The rewriting scheme of one `srs` stage: its secrets, `SRS_DOMAIN` and `MAX_AGE`.
pub struct Srs {
    /// One HMAC key per secret, in the order given; the first signs.
    keys: Vec<hmac::Key>,
    /// `SRS_DOMAIN`, as written (the domain of every address written).
    domain: String,
    /// `MAX_AGE`: how many days after its timestamp an address still reverses.
    max_age_days: u32,
}

impl fmt::Debug for Srs {
    /// Shows the domain, the age and how many secrets there are, never a secret.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Srs")
            .field("domain", &self.domain)
            .field("max_age_days", &self.max_age_days)
            .field("secrets", &self.keys.len())
            .finish()
    }
}

impl Srs {
    /// `secrets`: at least one, the first signs. `domain`: `SRS_DOMAIN`.
    /// `max_age_days`: `MAX_AGE`. Refuses no secret, an empty secret or one holding a
    /// NUL byte (postsrsd's secrets end at the first NUL), and a domain that no mailbox
    /// may have.
    pub fn new(secrets: Vec<Vec<u8>>, domain: &str, max_age_days: u32) -> Result<Srs, String> {
        if secrets.is_empty() {
            return Err("no secret: at least one is needed to sign".into());
        }
        for (n, secret) in secrets.iter().enumerate() {
            if secret.is_empty() {
                return Err(format!("secret {} is empty", n + 1));
            }
            if secret.contains(&0) {
                return Err(format!(
                    "secret {} holds a NUL byte, where postsrsd's secret would end",
                    n + 1
                ));
            }
        }
        if let Err(why) = mailbox::check(&format!("postmaster@{domain}")) {
            return Err(format!("SRS_DOMAIN {domain:?} is not a domain: {why}"));
        }
        let keys = secrets
            .iter()
            .map(|s| hmac::Key::new(hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY, s))
            .collect();
        Ok(Srs {
            keys,
            domain: domain.to_string(),
            max_age_days,
        })
    }

    /// `SRS_DOMAIN`, as given to [`Srs::new`].
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The rewritten envelope sender, or `Ok(None)` when it stays as it is (the null
    /// sender, no `@`, already in `SRS_DOMAIN`, already an SRS address these secrets
    /// sign, an `SRS1` address postsrsd cannot parse). The caller has already excluded
    /// `LOCAL_DOMAINS`. A sender that is no mailbox, or that cannot be rewritten into a
    /// valid one (too long, an `@` inside its quoted local part), is
    /// [`SrsError::Unusable`].
    pub fn forward(&self, sender: &str, now: SystemTime) -> Result<Option<String>, SrsError> {
        if sender.is_empty() || !sender.contains('@') {
            return Ok(None);
        }
        mailbox::check(sender).map_err(|why| {
            SrsError::Unusable(format!("the sender is not a valid mailbox: {why}"))
        })?;
        let Some((local, host)) = split(sender) else {
            return Err(SrsError::Unusable("the sender has no domain".into()));
        };
        if host.eq_ignore_ascii_case(&self.domain) {
            return Ok(None);
        }
        let local = unquote(local);
        if local.contains('@') {
            return Err(SrsError::Unusable(
                "the sender's quoted local part holds an @, which SRS cannot carry".into(),
            ));
        }
        // postsrsd asks its own reverse table first: a valid SRS address of ours, in
        // whatever domain, is not signed twice.
        if matches!(self.parse(&local, now), Ok(Some(_))) {
            return Ok(None);
        }
        let Some(rewritten) = self.compile(&local, host, now) else {
            return Ok(None);
        };
        mailbox_of(&rewritten, &self.domain)
            .map(Some)
            .map_err(|why| {
                SrsError::Unusable(format!(
                    "the rewritten address is not a valid mailbox: {why}"
                ))
            })
    }

    /// For a recipient: `Ok(None)` when it is not an SRS address in `SRS_DOMAIN` (left
    /// alone), `Ok(Some(original))` when its hash matches a secret and its timestamp is
    /// valid, an [`SrsError`] with the reason otherwise (bad hash, expired, malformed,
    /// or an original that is no mailbox).
    pub fn reverse(&self, recipient: &str, now: SystemTime) -> Result<Option<String>, SrsError> {
        let Some((local, domain)) = split(recipient) else {
            return Ok(None);
        };
        if !domain.eq_ignore_ascii_case(&self.domain) {
            return Ok(None);
        }
        let local = unquote(local);
        if srs_tag(&local).is_none() {
            return Ok(None);
        }
        mailbox::check(recipient).map_err(|why| {
            SrsError::Malformed(format!("the address is not a valid mailbox: {why}"))
        })?;
        if local.contains('@') {
            return Err(SrsError::Malformed(
                "the local part holds an @ inside its quotes".into(),
            ));
        }
        let Some((user, host)) = self.parse(&local, now)? else {
            return Ok(None);
        };
        mailbox_of(&user, host).map(Some).map_err(|why| {
            SrsError::Unusable(format!(
                "the original address is not a valid mailbox: {why}"
            ))
        })
    }

    /// The SRS local part for a sender's `local` and `host`, or `None` where postsrsd
    /// answers an error and leaves the sender (an `SRS1` it cannot parse). srs2.c's
    /// `srs_compile_guarded` and `srs_compile_shortcut`.
    fn compile(&self, local: &str, host: &str, now: SystemTime) -> Option<String> {
        match forward_tag(local) {
            Some((Tag::One, rest)) => {
                // After the separator: old hash `=` first host `=` user. A bare `SRS1`
                // has no separator; srs2.c then reads on into the domain, which holds no
                // `=`, and finds no host.
                let fields = rest.get(1..).filter(|f| !f.is_empty())?;
                let (_, after_hash) = fields.split_once('=')?;
                let (first_host, user) = after_hash.split_once('=')?;
                let hash = self.sign(&[first_host, user]);
                Some(format!("SRS1={hash}={first_host}={user}"))
            }
            Some((Tag::Zero, rest)) => {
                let hash = self.sign(&[host, rest]);
                Some(format!("SRS1={hash}={host}={rest}"))
            }
            None => {
                let stamp = timestamp(now);
                let hash = self.sign(&[&stamp, host, local]);
                Some(format!("SRS0={hash}={stamp}={host}={local}"))
            }
        }
    }

    /// The original of an SRS local part as (local part, domain), `Ok(None)` when it
    /// is no SRS address, or why it does not reverse. srs2.c's `srs_parse_guarded` and
    /// `srs_parse_shortcut`, fields in the same order and checks in the same order.
    fn parse<'a>(
        &self,
        local: &'a str,
        now: SystemTime,
    ) -> Result<Option<(String, &'a str)>, SrsError> {
        let Some((tag, fields)) = srs_tag(local) else {
            return Ok(None);
        };
        let missing = |what: &str| {
            let tag = if tag == Tag::One { "SRS1" } else { "SRS0" };
            SrsError::Malformed(format!("no {what} in {tag} address"))
        };
        if fields.is_empty() {
            return Err(missing("hash"));
        }
        match tag {
            Tag::One => {
                let (hash, rest) = fields.split_once('=').ok_or_else(|| missing("host"))?;
                let (host, user) = rest.split_once('=').ok_or_else(|| missing("user"))?;
                self.check_hash(hash, &[host, user])?;
                Ok(Some((format!("SRS0{user}"), host)))
            }
            Tag::Zero => {
                let (hash, rest) = fields.split_once('=').ok_or_else(|| missing("timestamp"))?;
                let (stamp, rest) = rest.split_once('=').ok_or_else(|| missing("host"))?;
                let (host, user) = rest.split_once('=').ok_or_else(|| missing("user"))?;
                self.check_timestamp(stamp, now)?;
                self.check_hash(hash, &[stamp, host, user])?;
                Ok(Some((user.to_string(), host)))
            }
        }
    }

    /// The hash of these fields with the first secret.
    fn sign(&self, fields: &[&str]) -> String {
        match self.keys.first() {
            Some(key) => hash(key, fields),
            // `new` refuses an empty list of secrets; no key signs nothing.
            None => String::new(),
        }
    }

    /// Checks a hash as written against every secret (srs2.c's `srs_hash_check`).
    fn check_hash(&self, written: &str, fields: &[&str]) -> Result<(), SrsError> {
        let Some(written) = written.as_bytes().get(..HASH_LENGTH) else {
            return Err(SrsError::Malformed("hash too short".into()));
        };
        let matches = self
            .keys
            .iter()
            .any(|key| same_ignoring_case(written, hash(key, fields).as_bytes()));
        if matches {
            Ok(())
        } else {
            Err(SrsError::BadHash)
        }
    }

    /// Checks a timestamp as written against today (srs2.c's `srs_timestamp_check`).
    fn check_timestamp(&self, stamp: &str, now: SystemTime) -> Result<(), SrsError> {
        let [high, low] = stamp.as_bytes() else {
            return Err(SrsError::Malformed(
                "the timestamp is not two characters".into(),
            ));
        };
        let mut then = 0u64;
        for c in [high, low] {
            let Some(value) = TIME_BASECHARS
                .iter()
                .position(|b| *b == c.to_ascii_uppercase())
            else {
                return Err(SrsError::Malformed(
                    "bad base32 character in timestamp".into(),
                ));
            };
            then = (then << 5) | value as u64;
        }
        let mut today = day(now) % TIME_SLOTS;
        if today < then {
            today += TIME_SLOTS;
        }
        if today <= then + u64::from(self.max_age_days) {
            Ok(())
        } else {
            Err(SrsError::Expired)
        }
    }
}

/// The whole days since the epoch at `now` (0 before it).
fn day(now: SystemTime) -> u64 {
    now.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
        / SECONDS_PER_DAY
}

/// The two-character timestamp of `now` (srs2.c's `srs_timestamp_create`).
fn timestamp(now: SystemTime) -> String {
    let day = day(now);
    [(day >> 5) & 31, day & 31]
        .iter()
        .filter_map(|&i| TIME_BASECHARS.get(i as usize).map(|&b| char::from(b)))
        .collect()
}

/// The four-character hash of `fields` with one key: HMAC-SHA1 over the fields, ASCII
/// letters lowercased, then base64 (srs2.c's `srs_hash_create_v`).
fn hash(key: &hmac::Key, fields: &[&str]) -> String {
    let mut context = hmac::Context::with_key(key);
    for field in fields {
        context.update(field.to_ascii_lowercase().as_bytes());
    }
    let tag = context.sign();
    // Four base64 characters are the first 24 bits: the first three bytes.
    let first = tag.as_ref().get(..3).unwrap_or_default();
    base64::engine::general_purpose::STANDARD.encode(first)
}

/// Are these equal without regard to ASCII case? Looks at every byte whatever it finds.
fn same_ignoring_case(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).fold(0u8, |d, (x, y)| {
            d | (x.to_ascii_lowercase() ^ y.to_ascii_lowercase())
        }) == 0
}

/// The tag of an SRS address and what follows its separator: the local part starts
/// with `SRS0` or `SRS1` in any case and then one of `=`, `-`, `+` (srs2.h's
/// `SRS_IS_SRS_ADDRESS`).
fn srs_tag(local: &str) -> Option<(Tag, &str)> {
    let (tag, rest) = forward_tag(local)?;
    Some((tag, rest.strip_prefix(SEPARATORS)?))
}

/// The tag as forwarding judges it, and the rest from the separator on: `SRS0` or
/// `SRS1` in any case followed by `=`, `-`, `+` or by nothing (srs2.c's
/// `srs_compile_guarded`, whose separator test also accepts the string's end).
fn forward_tag(local: &str) -> Option<(Tag, &str)> {
    let bytes = local.as_bytes();
    if !bytes.get(..3)?.eq_ignore_ascii_case(b"SRS") {
        return None;
    }
    let tag = match bytes.get(3)? {
        b'0' => Tag::Zero,
        b'1' => Tag::One,
        _ => return None,
    };
    let rest = local.get(4..)?;
    match rest.chars().next() {
        None => Some((tag, rest)),
        Some(c) if SEPARATORS.contains(&c) => Some((tag, rest)),
        Some(_) => None,
    }
}

/// Splits an address into its local part (quotes kept) and its domain: after the
/// closing quote of a quoted local part, else at the last `@`. `None` without an `@`
/// there.
fn split(address: &str) -> Option<(&str, &str)> {
    if let Some(inner) = address.strip_prefix('"') {
        let mut escaped = false;
        for (i, c) in inner.char_indices() {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => {
                    let end = 1 + i + 1;
                    let domain = address.get(end..)?.strip_prefix('@')?;
                    return Some((address.get(..end)?, domain));
                }
                _ => {}
            }
        }
        return None;
    }
    address.rsplit_once('@')
}

/// A local part's content: a quoted one without its quotes and with each quoted pair
/// `\x` as `x`; a dot-string as it is.
fn unquote(local: &str) -> Cow<'_, str> {
    let Some(inner) = local.strip_prefix('"').and_then(|l| l.strip_suffix('"')) else {
        return Cow::Borrowed(local);
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => out.extend(chars.next()),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// The mailbox with this local part content and domain: the local part as a
/// dot-string when it is one, else quoted (`"` and `\` escaped); the reason when
/// [`mailbox::check`] refuses it either way.
fn mailbox_of(local: &str, domain: &str) -> Result<String, String> {
    if !local.starts_with('"') && !local.contains('@') {
        let plain = format!("{local}@{domain}");
        if mailbox::check(&plain).is_ok() {
            return Ok(plain);
        }
    }
    let mut quoted = String::with_capacity(local.len() + domain.len() + 8);
    quoted.push('"');
    for c in local.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    quoted.push('@');
    quoted.push_str(domain);
    mailbox::check(&quoted)?;
    Ok(quoted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quoted_local_part_is_split_after_its_closing_quote_and_unquoted() {
        assert_eq!(split("\"a@b\"@x.example"), Some(("\"a@b\"", "x.example")));
        assert_eq!(split("\"a\\\"@\"@x"), Some(("\"a\\\"@\"", "x")));
        assert_eq!(split("a@b@x"), Some(("a@b", "x")));
        assert_eq!(split("\"open@x"), None);
        assert_eq!(split("\"a\"b@x"), None);
        assert_eq!(split("nodomain"), None);
        assert_eq!(unquote("\"a\\\"b\\\\c d\""), "a\"b\\c d");
        assert_eq!(unquote("\"\""), "");
        assert_eq!(unquote("\""), "\"", "a lone quote is no quoted string");
        assert_eq!(unquote("plain.dot"), "plain.dot");
    }

    #[test]
    fn a_local_part_is_written_plain_when_it_can_be_and_quoted_otherwise() {
        assert_eq!(mailbox_of("a.b", "x").as_deref(), Ok("a.b@x"));
        assert_eq!(mailbox_of("a b", "x").as_deref(), Ok("\"a b\"@x"));
        assert_eq!(mailbox_of("a\"b\\", "x").as_deref(), Ok("\"a\\\"b\\\\\"@x"));
        assert_eq!(mailbox_of("\"a\"", "x").as_deref(), Ok("\"\\\"a\\\"\"@x"));
        assert_eq!(mailbox_of("", "x").as_deref(), Ok("\"\"@x"));
        assert!(mailbox_of("a\nb", "x").unwrap_err().contains("U+000A"));
        assert!(mailbox_of("a", "").unwrap_err().contains("domain"));
    }

    #[test]
    fn the_tag_needs_a_separator_to_reverse_but_not_to_forward() {
        assert_eq!(srs_tag("SRS0=x"), Some((Tag::Zero, "x")));
        assert_eq!(srs_tag("srs1+x"), Some((Tag::One, "x")));
        assert_eq!(srs_tag("Srs0-"), Some((Tag::Zero, "")));
        assert_eq!(srs_tag("SRS0"), None);
        assert_eq!(srs_tag("SRS0x"), None);
        assert_eq!(srs_tag("SRS2=x"), None);
        assert_eq!(srs_tag("SRé"), None);
        assert_eq!(forward_tag("SRS0"), Some((Tag::Zero, "")));
        assert_eq!(forward_tag("SRS1=a"), Some((Tag::One, "=a")));
        assert_eq!(forward_tag("SRS0.a"), None);
    }
}
