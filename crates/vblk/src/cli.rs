//! The `vblk` command line: one subcommand per job.

use std::error::Error;

use clap::{Parser, Subcommand, ValueEnum};

use crate::bench::BenchArgs;
use crate::info::InfoArgs;
use crate::serve::ServeArgs;
use crate::stats::StatsArgs;

/// vblk — a userspace virtio-blk stack.
///
/// `vblk serve` is a vhost-user-blk device daemon that QEMU, Cloud Hypervisor and other
/// vhost-user frontends attach virtio-blk disks to; `vblk info` attaches to any
/// vhost-user-blk device and shows what it offers.
#[derive(Debug, Parser)]
#[command(name = "vblk", version, about, long_about = None)]
pub struct Cli {
    /// How much to log on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogLevel::Info)]
    pub log_level: LogLevel,
    #[command(subcommand)]
    pub command: Command,
}

/// Log verbosity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogLevel {
    /// Only errors.
    Error,
    /// Errors and warnings (bad requests, disk errors).
    Warn,
    /// Plus connections, queue summaries.
    Info,
    /// Plus negotiation details.
    Debug,
    /// Everything.
    Trace,
}

/// What to do.
#[derive(Debug, Subcommand)]
pub enum Command {
    // The subcommands' help comes from their argument structs' doc comments.
    Serve(ServeArgs),
    /// Attach to a vhost-user-blk device and print what it offers (like nbdinfo).
    Info(InfoArgs),
    Bench(Box<BenchArgs>),
    Stats(StatsArgs),
}

/// Run the parsed command line.
pub fn run(cli: Cli) -> Result<(), Box<dyn Error>> {
    let level = match cli.log_level {
        LogLevel::Error => log::LevelFilter::Error,
        LogLevel::Warn => log::LevelFilter::Warn,
        LogLevel::Info => log::LevelFilter::Info,
        LogLevel::Debug => log::LevelFilter::Debug,
        LogLevel::Trace => log::LevelFilter::Trace,
    };
    env_logger::Builder::new()
        .filter_level(level)
        .format_timestamp_micros()
        .target(env_logger::Target::Stderr)
        .init();
    match cli.command {
        Command::Serve(args) => crate::serve::run(args),
        Command::Info(args) => crate::info::run(args),
        Command::Bench(args) => crate::bench::run(*args),
        Command::Stats(args) => crate::stats::run(args),
    }
}
