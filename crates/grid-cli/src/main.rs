//! The `grid` binary; see the `grid_cli` library for the commands.

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    // A panic would be a bug in grid; never show a stack trace, one line is enough.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        eprintln!(
            "grid: internal error: {} (please report this bug)",
            msg.replace('\n', "; ")
        );
    }));
    let args: Vec<String> = match std::env::args_os()
        .skip(1)
        .map(|a| a.into_string())
        .collect::<Result<_, _>>()
    {
        Ok(a) => a,
        Err(bad) => {
            eprintln!("grid: argument {bad:?} is not valid UTF-8");
            return ExitCode::from(2);
        }
    };
    let stdout = std::io::stdout();
    let mut lock = stdout.lock();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        grid_cli::run(&args, &mut lock)
    }));
    match result {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(grid_cli::Failure::Usage(e))) => {
            let _ = lock.flush();
            eprintln!("grid: error: {e}");
            ExitCode::from(2)
        }
        Ok(Err(grid_cli::Failure::Io(e))) => {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                // `grid ... | head`: the reader has what it wanted.
                ExitCode::SUCCESS
            } else {
                eprintln!("grid: cannot write the output: {e}");
                ExitCode::from(1)
            }
        }
        Err(_) => ExitCode::from(70),
    }
}
