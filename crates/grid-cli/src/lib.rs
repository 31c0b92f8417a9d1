//! The `grid` command: every process group of a Megatron-Core compatible parallel layout.
//!
//! A thin front over [`grid_core`]: it parses the arguments (clap, see [`command`]), calls the
//! library and prints the result, as readable text by default or as JSON with `--format json`.
//! Invalid input of any kind is a [`UsageError`]: one line on stderr and exit status 2.
//! `grid completions bash|zsh|fish` prints a shell completion script.
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

mod cli;
mod commands;
mod error;
mod out;
pub mod picture;
mod values;

pub use error::UsageError;

use cli::{Command, Parsed};
use commands::{
    comm_grid, completions, enumerate, hierarchical, init_plan, layout, pipeline, rank_generator,
    trace,
};
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

/// The clap definition of the `grid` command: its subcommands, options and help texts, as the
/// parser and the completion scripts (`grid completions`) see them.
///
/// ```
/// let cmd = grid_cli::command();
/// assert_eq!(cmd.get_name(), "grid");
/// assert!(cmd.get_subcommands().any(|s| s.get_name() == "layout"));
/// ```
pub fn command() -> clap::Command {
    cli::command()
}

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
    match cli::parse(args)? {
        Parsed::Print(text) => out.raw(&text)?,
        Parsed::Run(cmd) => match cmd.as_ref() {
            Command::Layout(a) => layout::run(a, &mut out)?,
            Command::Enum(a) => enumerate::run(a, &mut out)?,
            Command::Hierarchical(a) => hierarchical::run(a, &mut out)?,
            Command::RankGenerator(a) => rank_generator::run(a, &mut out)?,
            Command::Pipeline(a) => pipeline::run(a, &mut out)?,
            Command::CommGrid(a) => comm_grid::run(a, &mut out)?,
            Command::Trace(a) => trace::run(a, &mut out)?,
            Command::InitPlan(a) => init_plan::run(a, &mut out)?,
            Command::Completions(a) => completions::run(a, &mut out)?,
        },
    }
    out.finish()?;
    Ok(())
}
