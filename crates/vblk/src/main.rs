//! `vblk`: a userspace virtio-blk stack. This file only parses the command line and hands
//! over; see `cli.rs` and the library crates.

mod bench;
mod cli;
mod info;
mod man;
mod serve;
mod stats;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Every vblk error message already names its cause.
            eprintln!("vblk: {e}");
            ExitCode::FAILURE
        }
    }
}
