//! The `grid` command: every process group of a Megatron-Core compatible parallel layout.
//!
//! A thin front over [`grid_core`]: it parses the arguments, calls the library and prints the
//! result, as readable text by default or as JSON with `--format json`. Invalid input of any
//! kind is a [`UsageError`]: one line on stderr and exit status 2.
//!
//! ```
//! let mut out = Vec::new();
//! let args: Vec<String> = ["layout", "--world-size", "8", "--tp", "2", "--rank", "5", "--format", "json"]
//!     .iter().map(|s| s.to_string()).collect();
//! grid_cli::run(&args, &mut out).unwrap();
//! let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
//! assert_eq!(v["groups"]["tp"], serde_json::json!([4, 5]));
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod args;
mod comm_grid;
mod commands;
mod out;

use args::usage;

pub use args::UsageError;

use std::io::{self, Write};

/// Why a command did not complete: invalid input (exit status 2) or an output error.
///
/// ```
/// let err = grid_cli::run(&["frob".to_string()], &mut Vec::new()).unwrap_err();
/// assert!(matches!(err, grid_cli::Failure::Usage(_)));
/// ```
#[derive(Debug)]
pub enum Failure {
    /// Invalid input: print the message on one line, exit with status 2.
    Usage(UsageError),
    /// Writing the output failed (for example a closed pipe).
    Io(io::Error),
}

impl From<UsageError> for Failure {
    fn from(e: UsageError) -> Failure {
        Failure::Usage(e)
    }
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Failure {
        Failure::Io(e)
    }
}

impl From<grid_core::Error> for Failure {
    fn from(e: grid_core::Error) -> Failure {
        Failure::Usage(e.into())
    }
}

/// Top-level help (`grid --help`).
///
/// ```
/// assert!(grid_cli::HELP.contains("grid layout --world-size W"));
/// ```
pub const HELP: &str = "grid: every process group of a Megatron-Core compatible parallel layout

usage:
  grid layout --world-size W [--tp N] [--pp N] [--cp N] [--ep N] [--etp N] [--order ORDER]
              [--dist-opt-instances N] [--hcp A,B,...] [--rank-offset O] [--vpp N] [--dp N]
              [--rank R] [--format text|json]
  grid enum --shape S1,S2,... --dims D1,D2,... --group Dx,Dy [--rank-offset O] [--raw]
            [--world-size W] [--rank R] [--format text|json]
  grid hierarchical --ranks R1,R2,... --sizes A,B,... [--rank R] [--format text|json]
  grid rank-generator --order ORDER [--tp N] [--ep N] [--dp N] [--pp N] [--cp N]
                      [--rank-offset O] [--tokens T1,T2,...] [--format text|json]
  grid pipeline SPEC [--format text|json]
  grid comm-grid --shape S1,S2,... --dims D1,D2,... [--rank-offset O] [--world-size W]
                 [--rank R] --queries FILE|- [--format text|json]
  grid help [COMMAND]      grid --version

Run `grid COMMAND --help` for the details of one command. Invalid input exits with status 2.";

/// Runs the command line `args` (without the program name), writing the output to `w`.
///
/// ```
/// // `grid comm-grid`: HyperCommGrid queries replayed in order on one grid.
/// let dir = std::env::temp_dir().join(format!("grid-cli-doc-{}", std::process::id()));
/// std::fs::create_dir_all(&dir).unwrap();
/// let q = dir.join("queries.json");
/// std::fs::write(&q, r#"[{"fn": "create_pg", "dims": ["a", "b"]}, {"fn": "create_pg", "dims": ["b", "a"]}]"#)
///     .unwrap();
/// let args: Vec<String> = ["comm-grid", "--shape", "2,2,2", "--dims", "a,b,c", "--rank", "5",
///                          "--queries", q.to_str().unwrap(), "--format", "json"]
///     .iter().map(|s| s.to_string()).collect();
/// let mut out = Vec::new();
/// grid_cli::run(&args, &mut out).unwrap();
/// let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
/// assert_eq!(v[0]["ok"]["key"], "b-a");
/// assert_eq!(v[0]["ok"]["my_group"], serde_json::json!([4, 5, 6, 7]));
/// assert_eq!(v[1]["error"]["type"], "KeyError"); // the same key twice
/// std::fs::remove_dir_all(&dir).unwrap();
/// ```
pub fn run(args: &[String], w: &mut dyn Write) -> Result<(), Failure> {
    let mut out = out::Out::new(w);
    let Some(cmd) = args.first() else {
        return Err(usage!("missing command: expected layout, enum, hierarchical, rank-generator, pipeline or comm-grid (see grid --help)").into());
    };
    let rest = &args[1..];
    match cmd.as_str() {
        "layout" => commands::layout(rest, &mut out)?,
        "enum" => commands::enumerate(rest, &mut out)?,
        "hierarchical" => commands::hierarchical(rest, &mut out)?,
        "rank-generator" => commands::rank_generator(rest, &mut out)?,
        "pipeline" => commands::pipeline(rest, &mut out)?,
        "comm-grid" => comm_grid::comm_grid(rest, &mut out)?,
        "-h" | "--help" => out.line(HELP)?,
        "help" => match rest.first().map(String::as_str) {
            None => out.line(HELP)?,
            Some(c) => match commands::help_of(c) {
                Some(h) => out.line(h)?,
                None => {
                    return Err(usage!(
                        "help: unknown command '{c}': expected layout, enum, hierarchical, rank-generator, pipeline or comm-grid"
                    )
                    .into())
                }
            },
        },
        "-V" | "--version" => out.line(concat!("grid ", env!("CARGO_PKG_VERSION")))?,
        other => {
            return Err(usage!(
                "unknown command '{other}': expected layout, enum, hierarchical, rank-generator, pipeline or comm-grid (see grid --help)"
            )
            .into())
        }
    }
    out.finish()?;
    Ok(())
}
