//! The command line: the clap definition of `grid` and its subcommands, and the mapping of every
//! clap error to one [`UsageError`] line that names the option, the value and what is valid.

use crate::commands::{
    comm_grid, completions, enumerate, hierarchical, init_plan, layout, pipeline, rank_generator,
    trace,
};
use crate::error::UsageError;
use crate::values::ValueError;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// The usage lines of `grid --help`: one per subcommand.
const USAGE: &str = "
  grid layout --world-size W [--tp N] [--pp N] [--cp N] [--ep N] [--etp N] [--order ORDER]
              [--dist-opt-instances N] [--hcp A,B,...] [--rank-offset O] [--vpp N] [--dp N]
              [--rank R] [--format text|json]
              [--svg FILE [--color-by FAMILY] [--ranks-per-node N]]
  grid enum --shape S1,S2,... --dims D1,D2,... --group Dx,Dy [--rank-offset O] [--raw]
            [--world-size W] [--rank R] [--format text|json]
  grid hierarchical --ranks R1,R2,... --sizes A,B,... [--rank R] [--format text|json]
  grid rank-generator --order ORDER [--tp N] [--ep N] [--dp N] [--pp N] [--cp N]
                      [--rank-offset O] [--tokens T1,T2,...] [--format text|json]
  grid pipeline SPEC [--format text|json] [--svg FILE]
  grid comm-grid --shape S1,S2,... --dims D1,D2,... [--rank-offset O] [--world-size W]
                 [--rank R] --queries FILE|- [--format text|json]
  grid trace DIR [--format text|json]
  grid init-plan --world-size W [layout options as above] [--creation split|members-only]
                 [--rank R | --verify] [--backend nccl|gloo|mpi] [--comm-memory BYTES]
                 [--format text|json]
  grid completions bash|zsh|fish
  grid help [COMMAND]      grid --version";

/// The layout of `grid --help`.
const TOP_TEMPLATE: &str =
    "{about}\n\nusage:{usage}\n\ncommands:\n{subcommands}\n\noptions:\n{options}{after-help}";

/// The layout of `grid COMMAND --help`.
const SUB_TEMPLATE: &str = "{about}\n\nusage: {usage}\n\n{all-args}{after-help}";

/// `grid`: every process group of a Megatron-Core compatible parallel layout.
#[derive(Debug, Parser)]
#[command(
    name = "grid",
    version,
    about = "grid: every process group of a Megatron-Core compatible parallel layout",
    override_usage = USAGE,
    help_template = TOP_TEMPLATE,
    subcommand_required = true,
    after_help = "Run `grid COMMAND --help` for the details of one command. Invalid input exits with status 2."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// One subcommand with its parsed options.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Every process group of a Megatron-Core layout (initialize_model_parallel)
    Layout(layout::Args),
    /// The groups of an N-dimensional grid (Megatron's HyperCommGrid)
    #[command(name = "enum")]
    Enum(enumerate::Args),
    /// Hierarchical sub-groups of one group (Megatron's create_hierarchical_groups)
    Hierarchical(hierarchical::Args),
    /// Megatron's RankGenerator (order strings and masked orthogonal groups)
    RankGenerator(rank_generator::Args),
    /// Stages and bridges of a multi-module pipeline (crate multimodule)
    Pipeline(pipeline::Args),
    /// Replay Megatron HyperCommGrid queries on one grid
    CommGrid(comm_grid::Args),
    /// Read every rank's operation log (GRID_TRACE_DIR) and find where the ranks diverged
    Trace(trace::Args),
    /// Communicators, collective calls and memory of building every rank's groups
    InitPlan(init_plan::Args),
    /// Print a shell completion script for grid (bash, zsh or fish)
    Completions(completions::Args),
}

/// What the command line asks for: run a subcommand, or print a help or version text.
#[derive(Debug)]
pub enum Parsed {
    /// Run this subcommand (boxed: `grid layout`'s options are large).
    Run(Box<Command>),
    /// Print this text (help or version) and exit with status 0.
    Print(String),
}

/// The clap definition of `grid`, as the parser and the completion scripts see it.
///
/// Every option that takes a value accepts one that starts with `-`, as the hand-written parser
/// did: `--tp -2` is a negative value (an error that says so), not a missing one.
pub fn command() -> clap::Command {
    let mut cmd = Cli::command();
    let names: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    for name in names {
        cmd = cmd.mut_subcommand(&name, |sub| {
            sub.help_template(SUB_TEMPLATE).mut_args(|a| {
                if !a.is_positional() && a.get_action().takes_values() {
                    a.allow_hyphen_values(true)
                } else {
                    a
                }
            })
        });
    }
    cmd
}

/// Parses a command line (without the program name).
pub fn parse(args: &[String]) -> Result<Parsed, UsageError> {
    let mut cmd = command();
    reject_double_dash(&cmd, args)?;
    let argv = std::iter::once("grid".to_string()).chain(args.iter().cloned());
    match cmd.try_get_matches_from_mut(argv) {
        Ok(m) => match Cli::from_arg_matches(&m) {
            Ok(cli) => Ok(Parsed::Run(Box::new(cli.command))),
            Err(e) => Err(one_line(&e, &cmd, args)),
        },
        Err(e) => match e.kind() {
            ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                Ok(Parsed::Print(e.render().to_string()))
            }
            _ => Err(one_line(&e, &cmd, args)),
        },
    }
}

/// A bare `--` after the subcommand (not the value of an option) is an error, as it was before
/// clap: no subcommand takes arguments that look like options, so `--` would only hide mistakes.
fn reject_double_dash(cmd: &clap::Command, args: &[String]) -> Result<(), UsageError> {
    let Some(sub) = args.first().and_then(|a| cmd.find_subcommand(a)) else {
        return Ok(());
    };
    let takes_value = |long: &str| {
        sub.get_arguments()
            .any(|a| a.get_long() == Some(long) && a.get_action().takes_values())
    };
    let mut i = 1;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--" {
            let valid = option_names(sub);
            let hint = if valid.is_empty() {
                "it takes no options".to_string()
            } else {
                format!("valid: {valid}")
            };
            return Err(UsageError(format!(
                "grid {}: unexpected argument '--' ({hint})",
                sub.get_name()
            )));
        }
        if let Some(long) = a.strip_prefix("--") {
            if !long.contains('=') && takes_value(long) {
                i += 1;
            }
        }
        i += 1;
    }
    Ok(())
}

/// "a, b or c".
fn listing(items: &[String], last: &str) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., end] => format!("{} {last} {end}", init.join(", ")),
    }
}

/// `--tp` from clap's `--tp <N>`, `SPEC` from `<SPEC>`.
fn arg_name(display: &str) -> String {
    let first = display.split([' ', '=']).next().unwrap_or(display);
    if first.starts_with('-') {
        first.to_string()
    } else {
        first
            .trim_matches(|c| c == '<' || c == '>' || c == '[' || c == ']' || c == '.')
            .to_string()
    }
}

/// `format` from clap's `--format <FORMAT>`: what a value of the argument is called.
fn value_noun(display: &str) -> String {
    match (display.find('<'), display.find('>')) {
        (Some(a), Some(b)) if a < b => display[a + 1..b].to_lowercase(),
        _ => "value".to_string(),
    }
}

/// The subcommands' names: "layout, enum, ... or completions".
fn command_names(cmd: &clap::Command) -> String {
    let names: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .filter(|n| n != "help")
        .collect();
    listing(&names, "or")
}

/// The options of a subcommand: "--world-size, --tp, ...".
fn option_names(sub: &clap::Command) -> String {
    sub.get_arguments()
        .filter(|a| !a.is_positional() && a.get_id() != "help")
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The help line of the argument named `name` (`--world-size` or `SPEC`) in `sub`.
fn help_of(sub: &clap::Command, name: &str) -> Option<String> {
    let arg = sub
        .get_arguments()
        .find(|a| match name.strip_prefix("--") {
            Some(long) => a.get_long() == Some(long),
            None => {
                a.is_positional()
                    && a.get_value_names()
                        .is_some_and(|v| v.iter().any(|n| n == name))
            }
        })?;
    let help = arg.get_help()?.to_string();
    // Help lines start with a capital; inside a message they follow a parenthesis.
    let mut chars = help.chars();
    let first = chars.next()?;
    Some(first.to_lowercase().chain(chars).collect())
}

/// One line for any clap error: the subcommand (`grid layout: `), the option, the value, and
/// what would be valid.
fn one_line(e: &clap::Error, cmd: &clap::Command, args: &[String]) -> UsageError {
    let sub = args
        .first()
        .and_then(|a| cmd.find_subcommand(a))
        .filter(|s| s.get_name() != "help");
    let prefix = sub.map_or(String::new(), |s| format!("grid {}: ", s.get_name()));
    let string = |k| match e.get(k) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        _ => None,
    };
    let strings = |k| match e.get(k) {
        Some(ContextValue::String(s)) => vec![s.clone()],
        Some(ContextValue::Strings(v)) => v.clone(),
        _ => Vec::new(),
    };
    let raw_arg = string(ContextKind::InvalidArg).unwrap_or_default();
    let arg = arg_name(&raw_arg);
    let value = string(ContextKind::InvalidValue);
    let commands = command_names(cmd);
    let msg = match e.kind() {
        ErrorKind::ValueValidation => {
            let source = std::error::Error::source(e);
            match source.and_then(|s| s.downcast_ref::<ValueError>()) {
                Some(v) => v.message(&arg),
                None => format!(
                    "invalid value '{}' for {arg}: {}",
                    value.unwrap_or_default(),
                    source.map_or(String::new(), |s| s.to_string())
                ),
            }
        }
        ErrorKind::InvalidValue => {
            let valid = strings(ContextKind::ValidValue);
            match value.filter(|v| !v.is_empty()) {
                Some(v) => {
                    let noun = value_noun(&raw_arg);
                    format!(
                        "unknown {noun} '{v}': valid {noun}s are {}",
                        listing(&valid, "and")
                    )
                }
                None if valid.is_empty() => format!("{arg} needs a value"),
                None => format!("{arg} needs a value ({})", listing(&valid, "or")),
            }
        }
        ErrorKind::ArgumentConflict => {
            let prior = strings(ContextKind::PriorArg);
            if prior.len() == 1 && prior[0] == raw_arg {
                format!("{arg} given more than once")
            } else {
                let others: Vec<String> = prior.iter().map(|p| arg_name(p)).collect();
                format!("{arg} cannot be used with {}", listing(&others, "or"))
            }
        }
        ErrorKind::TooManyValues => {
            format!("{arg} takes no value, got '{}'", value.unwrap_or_default())
        }
        ErrorKind::MissingRequiredArgument => {
            let missing: Vec<String> = strings(ContextKind::InvalidArg)
                .iter()
                .map(|a| arg_name(a))
                .collect();
            match (missing.as_slice(), sub) {
                ([one], Some(s)) => match help_of(s, one) {
                    Some(h) => format!("{one} is required ({h})"),
                    None => format!("{one} is required"),
                },
                _ => format!("{} are required", listing(&missing, "and")),
            }
        }
        ErrorKind::UnknownArgument => {
            let given = raw_arg.clone();
            match sub {
                None => format!("unknown command '{given}': expected {commands} (see grid --help)"),
                Some(s) => {
                    let valid = option_names(s);
                    if let Some(body) = given.strip_prefix("--").filter(|b| !b.is_empty()) {
                        let name = body.split('=').next().unwrap_or(body);
                        let tip = match string(ContextKind::SuggestedArg) {
                            Some(t) => format!("did you mean {}? ", arg_name(&t)),
                            None => String::new(),
                        };
                        format!("unknown option '--{name}' ({tip}valid: {valid})")
                    } else if valid.is_empty() {
                        format!(
                            "unexpected argument '{given}' ({} takes no options)",
                            s.get_name()
                        )
                    } else {
                        format!(
                            "unexpected argument '{given}' (options start with --; valid: {valid})"
                        )
                    }
                }
            }
        }
        ErrorKind::InvalidSubcommand => {
            let given = string(ContextKind::InvalidSubcommand).unwrap_or_default();
            let help = if args.first().is_some_and(|a| a == "help") {
                "help: "
            } else {
                ""
            };
            format!("{help}unknown command '{given}': expected {commands} (see grid --help)")
        }
        ErrorKind::MissingSubcommand | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            format!("missing command: expected {commands} (see grid --help)")
        }
        _ => {
            // Any other kind: clap's own first paragraph, on one line.
            let text = e.render().to_string();
            let body: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.is_empty())
                .collect();
            body.join(" ").trim_start_matches("error: ").to_string()
        }
    };
    UsageError(format!("{prefix}{msg}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_definition_is_consistent() {
        command().debug_assert();
    }

    #[test]
    fn names_of_arguments() {
        assert_eq!(arg_name("--world-size <W>"), "--world-size");
        assert_eq!(arg_name("--raw"), "--raw");
        assert_eq!(arg_name("<SPEC>"), "SPEC");
        assert_eq!(value_noun("--format <FORMAT>"), "format");
        assert_eq!(value_noun("<SHELL>"), "shell");
        assert_eq!(value_noun("--raw"), "value");
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(listing(&v(&["a", "b", "c"]), "or"), "a, b or c");
        assert_eq!(listing(&v(&["a"]), "or"), "a");
    }
}
