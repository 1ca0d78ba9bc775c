//! The `vblk` command line: one subcommand per job.

use std::error::Error;
use std::io::Write as _;

use clap::{Parser, Subcommand, ValueEnum};

use crate::bench::BenchArgs;
use crate::disk::DiskCommand;
use crate::info::InfoArgs;
use crate::man::ManArgs;
use crate::serve::ServeArgs;
use crate::stats::StatsArgs;

/// A userspace virtio-blk stack.
///
/// `vblk serve` is a vhost-user-blk device daemon that QEMU, Cloud Hypervisor and other
/// vhost-user frontends attach virtio-blk disks to; `vblk info` attaches to any
/// vhost-user-blk device and shows what it offers; `vblk bench` benchmarks I/O paths;
/// `vblk stats` reads a running daemon's statistics; `vblk disk` lists, adds and removes
/// its disks while it runs.
#[derive(Debug, Parser)]
#[command(name = "vblk", version)]
pub struct Cli {
    /// How much to log on stderr [default: info for serve (connections, queue summaries),
    /// warn for info, bench and stats, whose output is on stdout].
    #[arg(long, global = true, value_enum)]
    pub log_level: Option<LogLevel>,
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
    Serve(Box<ServeArgs>),
    /// Attach to a vhost-user-blk device and print what it offers (like nbdinfo).
    Info(InfoArgs),
    Bench(Box<BenchArgs>),
    Stats(StatsArgs),
    #[command(subcommand)]
    Disk(DiskCommand),
    #[command(hide = true)]
    Man(ManArgs),
}

impl Command {
    /// The log level when `--log-level` is not given: the daemon reports its connections
    /// and queue summaries (INFO); the commands that print results log only warnings, so
    /// that nothing interleaves with their output.
    pub fn default_log_level(&self) -> LogLevel {
        match self {
            Command::Serve(_) => LogLevel::Info,
            Command::Info(_)
            | Command::Bench(_)
            | Command::Stats(_)
            | Command::Disk(_)
            | Command::Man(_) => LogLevel::Warn,
        }
    }
}

/// Run the parsed command line (`matches`: what clap saw, for which flags were given).
pub fn run(cli: Cli, matches: &clap::ArgMatches) -> Result<(), Box<dyn Error>> {
    let level = match cli
        .log_level
        .unwrap_or_else(|| cli.command.default_log_level())
    {
        LogLevel::Error => log::LevelFilter::Error,
        LogLevel::Warn => log::LevelFilter::Warn,
        LogLevel::Info => log::LevelFilter::Info,
        LogLevel::Debug => log::LevelFilter::Debug,
        LogLevel::Trace => log::LevelFilter::Trace,
    };
    env_logger::Builder::new()
        .filter_level(level)
        .format(|buf, record| {
            // env_logger's own layout, and the disk the thread works for where the line
            // does not name one (a daemon of many disks: log_context.rs).
            let ts = buf.timestamp_micros();
            let (level, target) = (record.level(), record.target());
            let msg = record.args().to_string();
            device::log_context::with_current_disk(|disk| match disk {
                Some(d) if !msg.starts_with("disk ") => {
                    writeln!(buf, "[{ts} {level:<5} {target}] disk {d}: {msg}")
                }
                _ => writeln!(buf, "[{ts} {level:<5} {target}] {msg}"),
            })
        })
        .target(env_logger::Target::Stderr)
        .init();
    match cli.command {
        Command::Serve(args) => {
            let sub = matches
                .subcommand_matches("serve")
                .ok_or("internal: no serve matches")?;
            crate::serve::run(*args, sub)
        }
        Command::Disk(cmd) => crate::disk::run(cmd),
        Command::Info(args) => crate::info::run(args),
        Command::Bench(args) => crate::bench::run(*args),
        Command::Stats(args) => crate::stats::run(args),
        Command::Man(args) => crate::man::run(args),
    }
}

/// Write `args` (and a newline) to stdout; a closed stdout ends the program: quietly for
/// a reader that went away (status 141, as SIGPIPE's), with a message otherwise.
pub fn out(args: std::fmt::Arguments<'_>, newline: bool) {
    let mut o = std::io::stdout().lock();
    let written = o
        .write_fmt(args)
        .and_then(|()| if newline { o.write_all(b"\n") } else { Ok(()) })
        .and_then(|()| o.flush());
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(141),
        Err(e) => {
            eprintln!("vblk: cannot write the output: {e}");
            std::process::exit(1)
        }
    }
}
