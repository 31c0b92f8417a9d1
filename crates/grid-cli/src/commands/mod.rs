//! The subcommands, one module each: its clap options (`Args`) and its `run`.

pub mod comm_grid;
pub mod completions;
pub mod enumerate;
pub mod hierarchical;
pub mod init_plan;
pub mod layout;
pub mod pipeline;
pub mod rank_generator;
pub mod trace;
