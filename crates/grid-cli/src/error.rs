//! [`UsageError`], the one-line message of every kind of invalid input.

use std::fmt;

/// Invalid input of any kind: the command prints it on one line and exits with status 2.
///
/// ```
/// let args = vec!["layout".to_string(), "--world-size".into(), "8".into(), "--tp".into(), "3".into()];
/// let err = grid_cli::run(&args, &mut Vec::new()).unwrap_err();
/// assert!(matches!(err, grid_cli::Failure::Usage(e) if e.to_string().contains("not divisible")));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // One line, whatever the source said.
        f.write_str(&self.0.replace('\n', "; "))
    }
}

impl std::error::Error for UsageError {}

impl From<grid_core::Error> for UsageError {
    fn from(e: grid_core::Error) -> UsageError {
        UsageError(e.to_string())
    }
}

/// Shorthand for a result whose error is a usage error.
pub type Result<T> = std::result::Result<T, UsageError>;

/// Builds a [`UsageError`] from a format string.
macro_rules! usage {
    ($($t:tt)*) => { $crate::error::UsageError(format!($($t)*)) };
}
pub(crate) use usage;
