//! `vblk`: a userspace virtio-blk stack. This file only parses the command line and hands
//! over; see `cli.rs` and the library crates.

/// `println!` for what a command prints on stdout: a reader that goes away (`vblk stats |
/// head -1`) ends the program quietly, with SIGPIPE's status, as it ends other tools
/// (`println!` panicked with a backtrace).
macro_rules! outln {
    () => { $crate::cli::out(format_args!(""), true) };
    ($($t:tt)*) => { $crate::cli::out(format_args!($($t)*), true) };
}

/// `print!` likewise.
macro_rules! out {
    ($($t:tt)*) => { $crate::cli::out(format_args!($($t)*), false) };
}

mod bench;
mod cli;
mod disk;
mod disk_args;
mod info;
mod man;
mod serve;
mod stats;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

fn main() -> ExitCode {
    let matches = cli::Cli::command().get_matches();
    let args = match cli::Cli::from_arg_matches(&matches) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    match cli::run(args, &matches) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Every vblk error message already names its cause.
            eprintln!("vblk: {e}");
            ExitCode::FAILURE
        }
    }
}
