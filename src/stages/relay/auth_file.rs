//! `AUTH_FILE` (§21): the user and password the relay logs in to the smarthost with.
//! One line `USER PASSWORD` (the user up to the first space or tab, the password the
//! rest of the line, spaces included, a CR before the line end dropped); lines that
//! are empty or start with `#` are skipped. The file must be readable by its owner
//! alone (`chmod 600`), read once by the workers' account when they start and by
//! `pepsi-dispatch check`.
//!
//! Errors name the file and the line, never what the line holds. Used by `mod.rs`.

use std::path::Path;

use super::secure::Credentials;
use crate::stages::read_at_start::read_private;

/// The largest file read: one line and comments.
pub const MAX_FILE: u64 = 64 * 1024;

/// Reads `AUTH_FILE`.
pub fn load(path: &Path) -> Result<Credentials, String> {
    let bytes = read_private(path, "AUTH_FILE", MAX_FILE)?;
    parse(&bytes).map_err(|why| format!("AUTH_FILE {}: {why}", path.display()))
}

/// The credentials of a file's bytes; why not (by line number).
fn parse(bytes: &[u8]) -> Result<Credentials, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let line = bytes[..e.valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
            + 1;
        format!("line {line} is not UTF-8")
    })?;
    let mut found: Option<(usize, Credentials)> = None;
    for (n, line) in text.split('\n').enumerate() {
        let number = n + 1;
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line.chars().any(|c| c.is_control() && c != '\t') {
            return Err(format!("line {number} holds a control character"));
        }
        let Some((user, password)) = line.split_once([' ', '\t']) else {
            return Err(format!(
                "line {number} is not USER PASSWORD (no space after the user)"
            ));
        };
        let password = password.trim_start_matches([' ', '\t']);
        if user.is_empty() || password.is_empty() {
            return Err(format!("line {number} is not USER PASSWORD"));
        }
        if let Some((first, _)) = &found {
            return Err(format!(
                "lines {first} and {number} both hold a login; the file holds one"
            ));
        }
        found = Some((
            number,
            Credentials {
                user: user.to_string(),
                password: password.to_string(),
            },
        ));
    }
    found
        .map(|(_, c)| c)
        .ok_or_else(|| "holds no USER PASSWORD line".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(text: &str) -> (String, String) {
        let c = parse(text.as_bytes()).unwrap();
        (c.user, c.password)
    }

    #[test]
    fn one_line_is_the_user_then_the_rest_of_the_line_as_the_password() {
        assert_eq!(
            ok("relay@example.net s3cret\n"),
            ("relay@example.net".into(), "s3cret".into())
        );
        assert_eq!(
            ok("# the hosted smarthost\n\nuser\tpass with spaces \r\n"),
            ("user".into(), "pass with spaces ".into())
        );
        assert_eq!(ok("u  p"), ("u".into(), "p".into()));
    }

    #[test]
    fn bad_files_are_refused_by_line_without_showing_it() {
        for (text, why) in [
            ("", "holds no USER PASSWORD line"),
            ("# only a comment\n", "holds no USER PASSWORD line"),
            ("lonelyuser\n", "line 1 is not USER PASSWORD"),
            ("a b\nc d\n", "lines 1 and 2 both hold a login"),
            ("\nuser pa\u{1b}ss\n", "line 2 holds a control character"),
            ("user \n", "line 1 is not USER PASSWORD"),
        ] {
            let e = parse(text.as_bytes()).unwrap_err();
            assert!(e.starts_with(why), "{text:?}: {e}");
            assert!(
                !e.contains("pa\u{1b}ss") && !e.contains("lonelyuser"),
                "{e}"
            );
        }
        let e = parse(b"user p\xffss\n").unwrap_err();
        assert_eq!(e, "line 1 is not UTF-8");
    }

    #[test]
    fn a_file_open_to_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("pepsi-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("auth");
        std::fs::write(&f, "user secret\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = load(&f).unwrap_err();
        assert!(e.contains("chmod 600") && !e.contains("secret\n"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(load(&f).unwrap().user, "user");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
