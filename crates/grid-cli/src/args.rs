//! A small, strict command-line parser: `--name value`, `--name=value` and boolean `--flag`s,
//! each at most once, no positional arguments. Every problem is a one-line [`UsageError`].

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
    ($($t:tt)*) => { $crate::args::UsageError(format!($($t)*)) };
}
pub(crate) use usage;

/// The options one subcommand accepts.
pub struct Spec {
    /// `grid layout`, for messages.
    pub command: &'static str,
    /// Options that take a value (without the leading `--`).
    pub values: &'static [&'static str],
    /// Boolean options.
    pub flags: &'static [&'static str],
    /// Names of the positional arguments, in order (usually none).
    pub positionals: &'static [&'static str],
}

/// Parsed options.
#[derive(Debug, Default)]
pub struct Parsed {
    command: &'static str,
    values: Vec<(&'static str, String)>,
    flags: Vec<&'static str>,
    positionals: Vec<String>,
    /// `-h` or `--help` was given.
    pub help: bool,
}

impl Spec {
    fn valid(&self) -> String {
        let mut all: Vec<String> = self.values.iter().map(|v| format!("--{v}")).collect();
        all.extend(self.flags.iter().map(|f| format!("--{f}")));
        all.join(", ")
    }

    /// Parses `args` (the arguments after the subcommand name).
    pub fn parse(&self, args: &[String]) -> Result<Parsed> {
        let mut p = Parsed {
            command: self.command,
            ..Parsed::default()
        };
        let mut i = 0;
        while i < args.len() {
            let a = &args[i];
            i += 1;
            if a == "-h" || a == "--help" {
                p.help = true;
                continue;
            }
            let Some(body) = a.strip_prefix("--") else {
                if p.positionals.len() < self.positionals.len() {
                    p.positionals.push(a.clone());
                    continue;
                }
                return Err(usage!(
                    "{}: unexpected argument '{a}' (options start with --; valid: {})",
                    self.command,
                    self.valid()
                ));
            };
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (body, None),
            };
            if let Some(&flag) = self.flags.iter().find(|f| **f == name) {
                if inline.is_some() {
                    return Err(usage!("{}: --{flag} takes no value", self.command));
                }
                if p.flags.contains(&flag) {
                    return Err(usage!("{}: --{flag} given more than once", self.command));
                }
                p.flags.push(flag);
                continue;
            }
            let Some(&key) = self.values.iter().find(|v| **v == name) else {
                return Err(usage!(
                    "{}: unknown option '--{name}' (valid: {})",
                    self.command,
                    self.valid()
                ));
            };
            let value = match inline {
                Some(v) => v,
                None => {
                    let Some(v) = args.get(i) else {
                        return Err(usage!("{}: --{key} needs a value", self.command));
                    };
                    i += 1;
                    v.clone()
                }
            };
            if p.values.iter().any(|(k, _)| *k == key) {
                return Err(usage!("{}: --{key} given more than once", self.command));
            }
            p.values.push((key, value));
        }
        Ok(p)
    }
}

fn parse_uint(command: &str, name: &str, s: &str) -> Result<usize> {
    let t = s.trim();
    if t.is_empty() {
        return Err(usage!(
            "{command}: --{name} needs a value, got an empty string"
        ));
    }
    if t.starts_with('-') {
        return Err(usage!(
            "{command}: invalid value '{s}' for --{name}: expected a non-negative integer"
        ));
    }
    if !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(usage!(
            "{command}: invalid value '{s}' for --{name}: expected an integer"
        ));
    }
    t.parse::<usize>().map_err(|_| {
        usage!(
            "{command}: value '{s}' for --{name} is too large (at most {})",
            usize::MAX
        )
    })
}

impl Parsed {
    /// The raw value of an option.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The `i`-th positional argument, if given.
    pub fn positional(&self, i: usize) -> Option<&str> {
        self.positionals.get(i).map(String::as_str)
    }

    /// Whether a boolean option was given.
    pub fn flag(&self, name: &str) -> bool {
        self.flags.contains(&name)
    }

    /// The value of a required option.
    pub fn required(&self, name: &str) -> Result<&str> {
        self.get(name)
            .ok_or_else(|| usage!("{}: --{name} is required", self.command))
    }

    /// A non-negative integer option.
    pub fn uint(&self, name: &str) -> Result<Option<usize>> {
        self.get(name)
            .map(|s| parse_uint(self.command, name, s))
            .transpose()
    }

    /// A positive integer option.
    pub fn positive(&self, name: &str) -> Result<Option<usize>> {
        match self.uint(name)? {
            Some(0) => Err(usage!(
                "{}: --{name} must be a positive integer, got 0",
                self.command
            )),
            v => Ok(v),
        }
    }

    /// A comma-separated list of non-negative integers.
    pub fn uint_list(&self, name: &str) -> Result<Option<Vec<usize>>> {
        let Some(s) = self.get(name) else {
            return Ok(None);
        };
        if s.trim().is_empty() {
            return Err(usage!(
                "{}: --{name} needs a comma-separated list of integers, got an empty string",
                self.command
            ));
        }
        s.split(',')
            .map(|x| parse_uint(self.command, name, x))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// A comma-separated list of positive integers.
    pub fn positive_list(&self, name: &str) -> Result<Option<Vec<usize>>> {
        let v = self.uint_list(name)?;
        if let Some(list) = &v {
            if list.contains(&0) {
                return Err(usage!(
                    "{}: every entry of --{name} must be a positive integer, got {}",
                    self.command,
                    self.get(name).unwrap_or_default()
                ));
            }
        }
        Ok(v)
    }

    /// A comma-separated list of names (non-empty entries).
    pub fn name_list(&self, name: &str) -> Result<Option<Vec<String>>> {
        let Some(s) = self.get(name) else {
            return Ok(None);
        };
        let parts: Vec<String> = s.split(',').map(|x| x.trim().to_string()).collect();
        if parts.iter().any(String::is_empty) {
            return Err(usage!(
                "{}: --{name} needs a comma-separated list of names without empty entries, got '{s}'",
                self.command
            ));
        }
        Ok(Some(parts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: Spec = Spec {
        command: "grid test",
        values: &["tp", "order", "list"],
        flags: &["raw"],
        positionals: &[],
    };

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn values_flags_and_errors() {
        let p = SPEC
            .parse(&args(&[
                "--tp",
                "4",
                "--order=tp-dp",
                "--raw",
                "--list",
                "1,2,3",
            ]))
            .unwrap();
        assert_eq!(p.positive("tp").unwrap(), Some(4));
        assert_eq!(p.get("order"), Some("tp-dp"));
        assert!(p.flag("raw"));
        assert_eq!(p.uint_list("list").unwrap(), Some(vec![1, 2, 3]));
        let err = |a: &[&str]| SPEC.parse(&args(a)).unwrap_err().0;
        assert_eq!(
            err(&["--pp", "2"]),
            "grid test: unknown option '--pp' (valid: --tp, --order, --list, --raw)"
        );
        assert_eq!(
            err(&["--tp", "2", "--tp", "3"]),
            "grid test: --tp given more than once"
        );
        assert_eq!(err(&["--tp"]), "grid test: --tp needs a value");
        assert_eq!(err(&["--raw=1"]), "grid test: --raw takes no value");
        assert!(err(&["8"]).contains("unexpected argument '8'"));
        let p = SPEC.parse(&args(&["--tp", "0", "--list", "1,,2"])).unwrap();
        assert_eq!(
            p.positive("tp").unwrap_err().0,
            "grid test: --tp must be a positive integer, got 0"
        );
        assert!(p
            .uint_list("list")
            .unwrap_err()
            .0
            .contains("--list needs a value"));
        let p = SPEC.parse(&args(&["--tp", "-1"])).unwrap();
        assert_eq!(
            p.uint("tp").unwrap_err().0,
            "grid test: invalid value '-1' for --tp: expected a non-negative integer"
        );
        let p = SPEC
            .parse(&args(&["--tp", "99999999999999999999999"]))
            .unwrap();
        assert!(p.uint("tp").unwrap_err().0.contains("too large"));
        let p = SPEC.parse(&args(&["--tp", "2x"])).unwrap();
        assert_eq!(
            p.uint("tp").unwrap_err().0,
            "grid test: invalid value '2x' for --tp: expected an integer"
        );
    }
}
