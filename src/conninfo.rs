//! What a connection string may say about the server it wants (`target_session_attrs`),
//! read before the client library parses it: libpq 14 knows `any`, `read-write`,
//! `read-only`, `primary`, `standby` and `prefer-standby`, the client library only the
//! first three. Every Pepsi program writes to the queue, so `primary` is taken as
//! `read-write` (the server that accepts writes: what a failover manager promotes),
//! and `read-only`, `standby` and `prefer-standby` are refused, naming the key and the
//! value; so is a value libpq does not know.
//!
//! A leaf: `db/mod.rs` prepares every connection string with it, and the configuration
//! (`config/fixed.rs`) checks `CONNECTION` and the per-role keys with it (before any
//! connection, so a refused value is reported with its file and line).

/// The key.
const KEY: &str = "target_session_attrs";

/// The connection string as the client library is to parse it, or why it cannot be
/// used. Both forms: `key=value` pairs (the value bare or single-quoted) and a URL's
/// query (`?target_session_attrs=primary&…`).
pub fn prepared(conninfo: &str) -> Result<String, String> {
    let Some((start, end, value)) = find(conninfo) else {
        return Ok(conninfo.to_string());
    };
    let replacement = match value.as_str() {
        "any" | "read-write" => return Ok(conninfo.to_string()),
        "primary" => "read-write",
        "read-only" | "standby" | "prefer-standby" => {
            return Err(format!(
                "{KEY}={value}: every Pepsi program writes to the queue; use read-write \
                 (or primary, or any)"
            ));
        }
        other => {
            return Err(format!(
                "{KEY}={}: not a value libpq knows (any, read-write, read-only, primary, \
                 standby, prefer-standby)",
                crate::escape::Visible(other)
            ));
        }
    };
    Ok(format!(
        "{}{replacement}{}",
        &conninfo[..start],
        &conninfo[end..]
    ))
}

/// The value of the key and where it stands (byte range of the value as written).
fn find(conninfo: &str) -> Option<(usize, usize, String)> {
    if conninfo.starts_with("postgres://") || conninfo.starts_with("postgresql://") {
        let (_, query) = conninfo.split_once('?')?;
        let query_at = conninfo.len() - query.len();
        let mut at = query_at;
        for pair in query.split('&') {
            if let Some(value) = pair.strip_prefix(KEY).and_then(|v| v.strip_prefix('=')) {
                let start = at + KEY.len() + 1;
                return Some((start, start + value.len(), value.to_string()));
            }
            at += pair.len() + 1;
        }
        return None;
    }
    // key = value pairs: the key at the start or after white space.
    let bytes = conninfo.as_bytes();
    let mut search = 0;
    while let Some(found) = conninfo[search..].find(KEY) {
        let key_at = search + found;
        search = key_at + KEY.len();
        if key_at > 0 && !bytes[key_at - 1].is_ascii_whitespace() {
            continue;
        }
        let rest = &conninfo[search..];
        let after_eq = rest.trim_start().strip_prefix('=')?;
        let value_text = after_eq.trim_start();
        let value_at = conninfo.len() - value_text.len();
        if let Some(quoted) = value_text.strip_prefix('\'') {
            let close = quoted.find('\'')?;
            return Some((value_at, value_at + close + 2, quoted[..close].to_string()));
        }
        let len = value_text
            .find(|c: char| c.is_ascii_whitespace())
            .unwrap_or(value_text.len());
        return Some((value_at, value_at + len, value_text[..len].to_string()));
    }
    None
}

/// The connection string with its user replaced by `user`: a `key=value` string gets
/// `user='…'` at its end (the last of a key wins), a URL a `user=…` query parameter
/// (which libpq and the client library take over the URL's user).
pub fn with_user(conninfo: &str, user: &str) -> String {
    if conninfo.starts_with("postgres://") || conninfo.starts_with("postgresql://") {
        let encoded: String = user
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let sep = if conninfo.contains('?') { '&' } else { '?' };
        return format!("{conninfo}{sep}user={encoded}");
    }
    let quoted = user.replace('\\', "\\\\").replace('\'', "\\'");
    format!("{conninfo} user='{quoted}'")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primary_reads_as_read_write_and_the_others_pass_or_are_named() {
        let multi = "host=/s1,/s2 port=5521,5522 target_session_attrs=primary dbname=pepsi";
        assert_eq!(
            prepared(multi).unwrap(),
            "host=/s1,/s2 port=5521,5522 target_session_attrs=read-write dbname=pepsi"
        );
        assert_eq!(
            prepared("host=/s target_session_attrs = 'primary'").unwrap(),
            "host=/s target_session_attrs = read-write"
        );
        assert_eq!(
            prepared("postgresql://a,b/pepsi?connect_timeout=3&target_session_attrs=primary")
                .unwrap(),
            "postgresql://a,b/pepsi?connect_timeout=3&target_session_attrs=read-write"
        );
        for same in [
            "host=/s",
            "host=/s target_session_attrs=any",
            "host=/s target_session_attrs=read-write",
            "postgresql:///pepsi",
        ] {
            assert_eq!(prepared(same).unwrap(), same);
        }
        for refused in ["standby", "prefer-standby", "read-only"] {
            let e = prepared(&format!("host=/s target_session_attrs={refused}")).unwrap_err();
            assert!(
                e.starts_with(&format!(
                    "target_session_attrs={refused}: every Pepsi program writes"
                )),
                "{e}"
            );
        }
        let e = prepared("postgres://h/d?target_session_attrs=writable").unwrap_err();
        assert!(
            e.starts_with("target_session_attrs=writable: not a value libpq knows"),
            "{e}"
        );
        // A value that would disguise itself is shown escaped.
        let e = prepared("host=/s target_session_attrs=any\u{202e}x").unwrap_err();
        assert!(!e.contains('\u{202e}') && e.contains("\\u{202e}"), "{e}");
        // The key inside another word is not the key.
        assert_eq!(
            prepared("host=/s application_name=xtarget_session_attrs").unwrap(),
            "host=/s application_name=xtarget_session_attrs"
        );
    }

    #[test]
    fn the_user_is_replaced_in_either_form() {
        let kv = with_user(
            "host=/run/postgresql dbname=pepsi user=pepsi",
            "pepsi-worker",
        );
        assert_eq!(
            kv,
            "host=/run/postgresql dbname=pepsi user=pepsi user='pepsi-worker'"
        );
        let parsed: postgres::Config = kv.parse().unwrap();
        assert_eq!(parsed.get_user(), Some("pepsi-worker"));
        let odd: postgres::Config = with_user("dbname=q", "o'b\\x").parse().unwrap();
        assert_eq!(odd.get_user(), Some("o'b\\x"));
        let url = with_user(
            "postgresql://pepsi@/pepsi?host=/run/postgresql",
            "pepsi-worker",
        );
        let parsed: postgres::Config = url.parse().unwrap();
        assert_eq!(parsed.get_user(), Some("pepsi-worker"));
        let bare: postgres::Config = with_user("postgres://pepsi@db/pepsi", "w x")
            .parse()
            .unwrap();
        assert_eq!(bare.get_user(), Some("w x"));
    }
}
