//! What the sender of a message an exec command refused reads (§12.7, §13.2): the
//! RFC 3463 status of a permanent exit status, as Postfix's `pipe(8)` maps the
//! sendmail-compatible exit statuses of `<sysexits.h>`, and the status and diagnostic a
//! command gives on the first line of its stderr (`5.1.1 user unknown`).
//!
//! Used by `exec.rs` only, which decides when an exit is permanent; pure: no I/O. The
//! command is not trusted: what it writes reaches the report only as a short line of
//! printable ASCII (a report's delivery-status part is 7-bit), with a status whose
//! class is the one its exit gave.

use crate::worker::DsnReason;

/// The `Diagnostic-Code` type of a command's own line.
pub const DIAGNOSTIC_TYPE: &str = "x-pepsi";

/// The longest diagnostic text kept from a command, in bytes.
const DIAGNOSTIC_MAX: usize = 200;

/// The RFC 3463 status of a permanent exit status, as Postfix's sysexits table gives it;
/// `None` for a status that is no permanent one (75, EX_TEMPFAIL, and everything outside
/// 64–78). EX_OSERR (71), which Postfix defers with 4.3.0, is permanent here (§12.7)
/// and so reads 5.3.0, as Postfix's other system errors do.
pub fn permanent_status(code: i32) -> Option<&'static str> {
    Some(match code {
        64 => "5.3.0", // EX_USAGE
        65 => "5.6.0", // EX_DATAERR
        66 => "5.3.0", // EX_NOINPUT
        67 => "5.1.1", // EX_NOUSER
        68 => "5.1.2", // EX_NOHOST
        69 => "5.3.0", // EX_UNAVAILABLE
        70 => "5.3.0", // EX_SOFTWARE
        71 => "5.3.0", // EX_OSERR
        72 => "5.3.0", // EX_OSFILE
        73 => "5.2.0", // EX_CANTCREAT
        74 => "5.3.0", // EX_IOERR
        76 => "5.5.0", // EX_PROTOCOL
        77 => "5.7.0", // EX_NOPERM
        78 => "5.3.5", // EX_CONFIG
        _ => return None,
    })
}

/// The enhanced status a line starts with (`4.x.x` or `5.x.x`, each detail one to three
/// digits, then a space or the end), and the line.
fn leading_status(line: &str) -> Option<&str> {
    let code = line.split([' ', '\t']).next()?;
    let parts: Vec<&str> = code.split('.').collect();
    let ok = parts.len() == 3
        && matches!(parts[0], "4" | "5")
        && parts[1..]
            .iter()
            .all(|p| (1..=3).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()));
    ok.then_some(code)
}

/// A line of a command's output as a sender may read it: control characters and
/// anything not ASCII become `?`, runs of blanks one space, at most
/// [`DIAGNOSTIC_MAX`] bytes.
fn printable(line: &str) -> String {
    let mut out = String::new();
    for c in line.trim().chars() {
        let c = match c {
            ' ' | '\t' => ' ',
            c if c.is_ascii_graphic() => c,
            _ => '?',
        };
        if c == ' ' && out.ends_with(' ') {
            continue;
        }
        if out.len() == DIAGNOSTIC_MAX {
            break;
        }
        out.push(c);
    }
    out
}

/// What the sender reads of a command that failed: the status and diagnostic of the
/// first line of its stderr (`head`, its first bytes) when that line starts with an
/// enhanced status code, its class made `class` (`'5'` for a permanent error, `'4'`
/// for a host error, as Postfix does); otherwise `fallback`'s status (the exit's)
/// without a diagnostic; `None` when neither gives one.
pub fn reason(head: &[u8], class: char, fallback: Option<&str>) -> Option<DsnReason> {
    let text = String::from_utf8_lossy(head);
    let first = text.lines().next().unwrap_or("");
    let line = printable(first);
    if let Some(code) = leading_status(&line) {
        let status = format!("{class}{}", &code[1..]);
        return Some(DsnReason {
            status,
            diagnostic: Some(format!("{DIAGNOSTIC_TYPE}; {line}")),
        });
    }
    fallback.map(|status| DsnReason {
        status: status.to_string(),
        diagnostic: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permanent_exits_read_as_postfix_pipe_reports_them() {
        let table: Vec<(i32, &str)> = (64..=78)
            .filter_map(|c| permanent_status(c).map(|s| (c, s)))
            .collect();
        assert_eq!(
            table,
            [
                (64, "5.3.0"),
                (65, "5.6.0"),
                (66, "5.3.0"),
                (67, "5.1.1"),
                (68, "5.1.2"),
                (69, "5.3.0"),
                (70, "5.3.0"),
                (71, "5.3.0"),
                (72, "5.3.0"),
                (73, "5.2.0"),
                (74, "5.3.0"),
                (76, "5.5.0"),
                (77, "5.7.0"),
                (78, "5.3.5"),
            ]
        );
        for code in [-1, 0, 1, 63, 75, 79, 126, 127, 255] {
            assert_eq!(permanent_status(code), None, "{code}");
        }
    }

    #[test]
    fn a_first_stderr_line_with_a_status_gives_status_and_diagnostic() {
        let r = reason(b"5.1.1 user unknown\nmore\n", '5', Some("5.3.0")).unwrap();
        assert_eq!(r.status, "5.1.1");
        assert_eq!(r.diagnostic.as_deref(), Some("x-pepsi; 5.1.1 user unknown"));
        let r = reason(b"4.2.2 mailbox full\r\n", '4', None).unwrap();
        assert_eq!(
            (r.status.as_str(), r.diagnostic.as_deref()),
            ("4.2.2", Some("x-pepsi; 4.2.2 mailbox full"))
        );
        let r = reason(b"5.2.1", '5', None).unwrap();
        assert_eq!(r.diagnostic.as_deref(), Some("x-pepsi; 5.2.1"));
    }

    #[test]
    fn the_status_class_is_the_exits() {
        let r = reason(b"4.2.2 over quota\n", '5', Some("5.3.0")).unwrap();
        assert_eq!(r.status, "5.2.2");
        let r = reason(b"5.1.1 no such user\n", '4', None).unwrap();
        assert_eq!(r.status, "4.1.1");
    }

    #[test]
    fn any_other_first_line_leaves_the_exits_status_and_no_diagnostic() {
        for head in [
            &b""[..],
            b"user unknown: 5.1.1\n",
            b"/etc/secret: permission denied\n5.1.1 late\n",
            b"5.1.1x user\n",
            b"2.0.0 ok\n",
            b"5.1111.1 wide\n",
            b"5.1 short\n",
        ] {
            let r = reason(head, '5', Some("5.1.1")).unwrap();
            assert_eq!(
                (r.status.as_str(), r.diagnostic),
                ("5.1.1", None),
                "{head:?}"
            );
            assert_eq!(reason(head, '5', None), None);
        }
    }

    #[test]
    fn a_hostile_line_reaches_the_report_as_short_printable_ascii() {
        let mut head = b"5.1.1 \x1b[31mred\x1b[0m\tq\xc3\xa9 \xe2\x80\xae evil\r\x00x".to_vec();
        head.extend(std::iter::repeat_n(b'y', 5000));
        let r = reason(&head, '5', None).unwrap();
        let d = r.diagnostic.unwrap();
        assert!(
            d.starts_with("x-pepsi; 5.1.1 ?[31mred?[0m q? ? evil??x"),
            "{d}"
        );
        assert!(d.bytes().all(|b| (0x20..0x7f).contains(&b)), "{d}");
        assert_eq!(d.len(), "x-pepsi; ".len() + DIAGNOSTIC_MAX);
    }
}
