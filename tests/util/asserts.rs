//! Assertions that a text holds or lacks some text: [`assert_has!`] and
//! [`assert_lacks!`], for the tests' many checks of a log, an output or a message (a
//! list and an item will do too). On failure they print the needle, the test's context
//! and the whole haystack, escaped when it holds a control or bidirectional character
//! (a log line may hold a test's forged one), so a report cannot be misread. Both test
//! binaries (`integration` and `faults`) include `tests/util/` as `crate::util`, and
//! import the macros from there.

use std::fmt;

/// Asserts that `haystack` contains `needle`: text (a `String`, `&str`, `Cow<str>`)
/// and anything `str::contains` takes, or a slice or `Vec` and a reference to an item.
/// An optional context follows, in `format!` form.
///
/// ```ignore
/// assert_has!(log, "moved 2 messages");
/// assert_has!(stdout(&out), &format!("error: {named}"), "{}", both(&out));
/// ```
// Every test binary includes these helpers; not every one asserts on text.
#[allow(unused_macros)]
macro_rules! assert_has {
    ($haystack:expr, $needle:expr $(,)?) => {
        $crate::util::asserts::assert_has!($haystack, $needle, "")
    };
    ($haystack:expr, $needle:expr, $($context:tt)+) => {
        // A match, not a let, so that the temporaries of `haystack` live to the end.
        match (&$haystack, $needle) {
            (haystack, needle) => {
                if !haystack.contains(needle) {
                    $crate::util::asserts::failed(
                        true,
                        &needle,
                        haystack,
                        ::std::format_args!($($context)+),
                    );
                }
            }
        }
    };
}

/// Asserts that `haystack` does not contain `needle`; the same forms as
/// [`assert_has!`].
#[allow(unused_macros)]
macro_rules! assert_lacks {
    ($haystack:expr, $needle:expr $(,)?) => {
        $crate::util::asserts::assert_lacks!($haystack, $needle, "")
    };
    ($haystack:expr, $needle:expr, $($context:tt)+) => {
        match (&$haystack, $needle) {
            (haystack, needle) => {
                if haystack.contains(needle) {
                    $crate::util::asserts::failed(
                        false,
                        &needle,
                        haystack,
                        ::std::format_args!($($context)+),
                    );
                }
            }
        }
    };
}

// Both binaries include these helpers; not every binary uses both macros.
#[allow(unused_imports)]
pub(crate) use {assert_has, assert_lacks};

/// What [`assert_has!`] looks in, as a failure report shows it.
pub trait Haystack {
    /// The whole of it, escaped when it holds a character a terminal would act on or
    /// reorder.
    fn shown(&self) -> String;
}

impl Haystack for str {
    fn shown(&self) -> String {
        if self.chars().any(needs_escape) {
            format!("{self:?}")
        } else {
            self.to_string()
        }
    }
}

impl Haystack for String {
    fn shown(&self) -> String {
        self.as_str().shown()
    }
}

impl Haystack for std::borrow::Cow<'_, str> {
    fn shown(&self) -> String {
        self.as_ref().shown()
    }
}

impl<T: fmt::Debug> Haystack for [T] {
    fn shown(&self) -> String {
        format!("{self:#?}")
    }
}

impl<T: fmt::Debug> Haystack for Vec<T> {
    fn shown(&self) -> String {
        self.as_slice().shown()
    }
}

impl<T: fmt::Debug, const N: usize> Haystack for [T; N] {
    fn shown(&self) -> String {
        self.as_slice().shown()
    }
}

impl<H: Haystack + ?Sized> Haystack for &H {
    fn shown(&self) -> String {
        (**self).shown()
    }
}

/// Reports a failed [`assert_has!`] (`wanted`) or [`assert_lacks!`]: the needle, the
/// context when there is one, and the whole haystack.
#[track_caller]
pub fn failed(
    wanted: bool,
    needle: &dyn fmt::Debug,
    haystack: &(impl Haystack + ?Sized),
    context: fmt::Arguments,
) -> ! {
    let verb = if wanted { "lacks" } else { "holds" };
    let context = context.to_string();
    let context = if context.is_empty() {
        String::new()
    } else {
        format!("\n{context}")
    };
    panic!(
        "the text below {verb} {needle:?}{context}\n--- the text ---\n{}\n--- end ---",
        haystack.shown()
    )
}

/// A character that must not reach a terminal as it is: a control character but the
/// line feed and the tab, a bidirectional control, a zero-width character or a line
/// or paragraph separator.
fn needs_escape(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t')
        || matches!(
            c,
            '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{feff}'
        )
}
