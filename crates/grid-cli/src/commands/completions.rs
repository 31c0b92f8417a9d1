//! `grid completions`: a shell completion script for `grid` (clap_complete).

use crate::out::Out;
use crate::Failure;

const AFTER_HELP: &str = "The script goes to stdout. For example:
  bash: grid completions bash > ~/.local/share/bash-completion/completions/grid
  zsh:  grid completions zsh > ~/.zfunc/_grid   (with ~/.zfunc in $fpath before compinit)
  fish: grid completions fish > ~/.config/fish/completions/grid.fish";

/// The shells `grid completions` writes a script for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Shell {
    /// Bash (bash-completion).
    Bash,
    /// Zsh (compsys).
    Zsh,
    /// Fish.
    Fish,
}

impl From<Shell> for clap_complete::Shell {
    fn from(s: Shell) -> clap_complete::Shell {
        match s {
            Shell::Bash => clap_complete::Shell::Bash,
            Shell::Zsh => clap_complete::Shell::Zsh,
            Shell::Fish => clap_complete::Shell::Fish,
        }
    }
}

/// Options of `grid completions`.
#[derive(Debug, clap::Args)]
#[command(after_help = AFTER_HELP)]
pub struct Args {
    /// The shell: bash, zsh or fish
    #[arg(value_enum, value_name = "SHELL", hide_possible_values = true)]
    shell: Shell,
}

/// `grid completions`.
pub fn run(a: &Args, out: &mut Out<'_>) -> Result<(), Failure> {
    let mut script = Vec::new();
    let shell: clap_complete::Shell = a.shell.into();
    // Writing into a Vec cannot fail, so the generator has nothing to report.
    clap_complete::generate(shell, &mut crate::cli::command(), "grid", &mut script);
    let script = String::from_utf8(script).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the {shell} completion script is not UTF-8: {e}"),
        )
    })?;
    out.raw(&script)?;
    Ok(())
}
