//! The value parsers of the options (integers, lists, names, `--format`) and their errors.
//!
//! Clap calls these while it parses; a failure is a [`ValueError`], which does not know the
//! option's name. [`crate::cli`] finds the name in clap's error and words the one-line message
//! with [`ValueError::message`].

use std::fmt;

/// Output format of every subcommand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    /// Readable text.
    #[default]
    Text,
    /// JSON (one document).
    Json,
}

/// `--format text|json`, shared by every subcommand that prints.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct FormatArg {
    /// Readable text (default) or JSON
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = Format::Text, hide_default_value = true, hide_possible_values = true)]
    pub format: Format,
}

/// Why a value of an option was rejected (the option's name is added by [`Self::message`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueError {
    /// The value is empty or blank (or a list has an empty entry).
    Empty,
    /// An integer with a minus sign.
    Negative(String),
    /// Not a decimal integer.
    NotInteger(String),
    /// More than `usize::MAX`.
    TooLarge(String),
    /// 0 where a positive integer is needed.
    Zero,
    /// A list option given an empty string.
    EmptyList,
    /// A list of positive integers with a 0 in it (the whole list).
    ZeroEntry(String),
    /// A list of names with an empty entry (the whole list).
    EmptyName(String),
}

impl ValueError {
    /// The message for the option named `name` (`--tp`), without the command's prefix.
    pub fn message(&self, name: &str) -> String {
        match self {
            ValueError::Empty => format!("{name} needs a value, got an empty string"),
            ValueError::Negative(s) => {
                format!("invalid value '{s}' for {name}: expected a non-negative integer")
            }
            ValueError::NotInteger(s) => {
                format!("invalid value '{s}' for {name}: expected an integer")
            }
            ValueError::TooLarge(s) => format!(
                "value '{s}' for {name} is too large (at most {})",
                usize::MAX
            ),
            ValueError::Zero => format!("{name} must be a positive integer, got 0"),
            ValueError::EmptyList => {
                format!("{name} needs a comma-separated list of integers, got an empty string")
            }
            ValueError::ZeroEntry(s) => {
                format!("every entry of {name} must be a positive integer, got {s}")
            }
            ValueError::EmptyName(s) => format!(
                "{name} needs a comma-separated list of names without empty entries, got '{s}'"
            ),
        }
    }
}

impl fmt::Display for ValueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message("the option"))
    }
}

impl std::error::Error for ValueError {}

/// A non-negative integer (surrounding blanks allowed).
pub fn uint(s: &str) -> Result<usize, ValueError> {
    let t = s.trim();
    if t.is_empty() {
        return Err(ValueError::Empty);
    }
    if t.starts_with('-') {
        return Err(ValueError::Negative(s.to_string()));
    }
    if !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ValueError::NotInteger(s.to_string()));
    }
    t.parse::<usize>()
        .map_err(|_| ValueError::TooLarge(s.to_string()))
}

/// A positive integer.
pub fn positive(s: &str) -> Result<usize, ValueError> {
    match uint(s)? {
        0 => Err(ValueError::Zero),
        n => Ok(n),
    }
}

/// A comma-separated list of non-negative integers.
pub fn uint_list(s: &str) -> Result<Vec<usize>, ValueError> {
    if s.trim().is_empty() {
        return Err(ValueError::EmptyList);
    }
    s.split(',').map(uint).collect()
}

/// A comma-separated list of positive integers.
pub fn positive_list(s: &str) -> Result<Vec<usize>, ValueError> {
    let v = uint_list(s)?;
    if v.contains(&0) {
        return Err(ValueError::ZeroEntry(s.to_string()));
    }
    Ok(v)
}

/// A comma-separated list of names, each trimmed and non-empty.
pub fn name_list(s: &str) -> Result<Vec<String>, ValueError> {
    let parts: Vec<String> = s.split(',').map(|x| x.trim().to_string()).collect();
    if parts.iter().any(String::is_empty) {
        return Err(ValueError::EmptyName(s.to_string()));
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers() {
        assert_eq!(uint(" 8 "), Ok(8));
        assert_eq!(uint("0"), Ok(0));
        assert_eq!(positive("0"), Err(ValueError::Zero));
        assert_eq!(uint(""), Err(ValueError::Empty));
        assert_eq!(uint("  "), Err(ValueError::Empty));
        assert_eq!(uint("-1"), Err(ValueError::Negative("-1".into())));
        assert_eq!(uint("-0"), Err(ValueError::Negative("-0".into())));
        assert_eq!(uint("+2"), Err(ValueError::NotInteger("+2".into())));
        assert_eq!(uint("1.5"), Err(ValueError::NotInteger("1.5".into())));
        assert_eq!(uint("2x"), Err(ValueError::NotInteger("2x".into())));
        assert_eq!(uint("18446744073709551615"), Ok(usize::MAX));
        assert_eq!(
            uint("18446744073709551616"),
            Err(ValueError::TooLarge("18446744073709551616".into()))
        );
    }

    #[test]
    fn lists() {
        assert_eq!(uint_list("1, 2,3"), Ok(vec![1, 2, 3]));
        assert_eq!(uint_list(""), Err(ValueError::EmptyList));
        assert_eq!(uint_list("1,,2"), Err(ValueError::Empty));
        assert_eq!(uint_list("1,-2"), Err(ValueError::Negative("-2".into())));
        assert_eq!(
            positive_list("2,0"),
            Err(ValueError::ZeroEntry("2,0".into()))
        );
        assert_eq!(positive_list("2,4"), Ok(vec![2, 4]));
        assert_eq!(
            name_list(" a ,b"),
            Ok(vec!["a".to_string(), "b".to_string()])
        );
        assert_eq!(name_list("a,"), Err(ValueError::EmptyName("a,".into())));
        assert_eq!(name_list(""), Err(ValueError::EmptyName("".into())));
    }

    #[test]
    fn messages_name_the_option_and_the_valid_values() {
        assert_eq!(
            ValueError::Zero.message("--tp"),
            "--tp must be a positive integer, got 0"
        );
        assert_eq!(
            ValueError::Negative("-2".into()).message("--tp"),
            "invalid value '-2' for --tp: expected a non-negative integer"
        );
        assert_eq!(
            ValueError::TooLarge("99999999999999999999999".into()).message("--rank"),
            "value '99999999999999999999999' for --rank is too large (at most 18446744073709551615)"
        );
        assert_eq!(
            ValueError::ZeroEntry("2,0".into()).message("--hcp"),
            "every entry of --hcp must be a positive integer, got 2,0"
        );
    }
}
