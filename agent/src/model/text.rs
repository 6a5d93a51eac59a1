//! Strings from outside — a guest's HELLO, another user's command line —
//! made safe for a terminal, a log line or a page before anything keeps
//! them: no escape sequence can move a cursor, rewrite a line or reorder
//! text, and none is longer than a name needs to be.

use std::borrow::Cow;

/// Characters kept of one name; the rest is cut (marked `…`).
pub const MAX_NAME: usize = 256;

/// Whether `c` cannot be shown as itself: controls (C0, DEL, C1) and the
/// bidirectional overrides and isolates that reorder what follows them.
pub fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

/// `s` with each such character written as its escape (`\u{1b}`), and at
/// most `MAX_NAME` characters.
pub fn printable(s: &str) -> Cow<'_, str> {
    if s.chars().count() <= MAX_NAME && !s.chars().any(hidden) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len().min(4 * MAX_NAME));
    for (i, c) in s.chars().enumerate() {
        if i == MAX_NAME {
            out.push('…');
            break;
        }
        if hidden(c) {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `s` as one word of a shell command: printable, and quoted where a
/// shell would read it as more than a word (`'db 01'`, `'a'\''b'`), so a
/// suggested command copied from a report runs on the name it names and
/// nothing else.
pub fn shell_word(s: &str) -> Cow<'_, str> {
    let p = printable(s);
    let plain = |c: char| c.is_ascii_alphanumeric() || "_@%+=:,./-".contains(c);
    if !p.is_empty() && p.chars().all(plain) {
        return p;
    }
    Cow::Owned(format!("'{}'", p.replace('\'', "'\\''")))
}

/// `printable`, owned, in place.
pub fn make_printable(s: &mut String) {
    if let Cow::Owned(p) = printable(s) {
        *s = p;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_overrides_are_shown_not_obeyed() {
        assert!(matches!(printable("vda"), Cow::Borrowed("vda")));
        assert_eq!(printable("web\u{1b}[2J01"), "web\\u{1b}[2J01");
        assert_eq!(
            printable("a\nb\rc\u{7f}\u{9b}"),
            "a\\u{a}b\\u{d}c\\u{7f}\\u{9b}"
        );
        assert_eq!(printable("x\u{202e}gpj.exe"), "x\\u{202e}gpj.exe");
        // Other scripts stay as they are.
        assert_eq!(printable("диск-ü"), "диск-ü");
        let long = "n".repeat(10_000);
        let p = printable(&long);
        assert_eq!(p.chars().count(), MAX_NAME + 1);
        assert!(p.ends_with('…'));
        let mut s = String::from("\u{1b}]0;title\u{7}");
        make_printable(&mut s);
        assert_eq!(s, "\\u{1b}]0;title\\u{7}");
    }

    #[test]
    fn a_name_is_one_shell_word_whatever_it_holds() {
        assert_eq!(shell_word("web01"), "web01");
        assert_eq!(shell_word("/dev/vda"), "/dev/vda");
        assert_eq!(shell_word("db; id #"), "'db; id #'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
        assert_eq!(shell_word(""), "''");
        assert_eq!(shell_word("x\u{1b}[2J$(id)"), "'x\\u{1b}[2J$(id)'");
    }
}
