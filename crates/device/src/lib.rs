//! The vhost-user-blk device behind `vblk serve`.
//!
//! Module map:
//! - [`config`]: what the user asked for ([`DeviceConfig`]) and how it is checked.
//! - `blk`: what the device offers: features, configuration space, request limits.
//! - [`daemon`]: the process: opens every disk and socket, confines itself, starts the
//!   shared worker threads and one thread per disk, waits for signals.
//! - `disk`: one disk: its socket (a path or an inherited fd), one frontend at a time,
//!   going back to listening when it leaves. `registry`: the disks by name, added and
//!   removed live.
//! - [`control`]: the control socket: statistics, and disks added, removed, listed.
//! - [`socket_file`]: the sockets the daemon creates: stale ones replaced, live ones
//!   refused, owner-only or a group's, removed at exit only if still ours.
//! - `wire`: vhost-user messages on the socket: framing, file descriptors, replies, and
//!   the backend channel.
//! - `session`: one frontend connection — the vhost-user control plane, each message
//!   checked before it changes anything; rings started and stopped; memory tables.
//! - `memory`: guest memory regions, checked (`fstat`, overlaps, slots) and mapped; the
//!   immutable views workers hold.
//! - `inflight`: the inflight region (INFLIGHT_SHMFD) that lets a restarted device
//!   resubmit exactly the requests an earlier one took and did not answer.
//! - `sigbus`: the backstop that keeps a frontend truncating its memory from killing us.
//! - `ring`: the device side of a split virtqueue through host pointers.
//! - `worker`: a worker owns a set of queues of one disk and one storage engine; it pops
//!   chains, has `proto` check them, hands payload iovecs to the engine, publishes
//!   completions and signals the driver once per batch. The daemon's worker threads (its
//!   pool) each run the workers of every disk placed on them, in one polling loop.
//! - `stats`: live per-queue and per-worker counters and latency histograms, served as
//!   JSON on the control socket (`vblk stats`).
//! - `poll`: the adaptive polling window a worker spins in before it sleeps.
//! - [`sandbox`]: the confinement applied once the daemon is set up: no_new_privs, no
//!   capabilities, Landlock, a seccomp allow-list (docs/security.md).
//! - `dirty_log`: the bitmap of guest pages the device wrote, while a live migration
//!   copies memory (VHOST_F_LOG_ALL, LOG_SHMFD).
//! - `fence`: the reset fence: requests from before a reset never land after requests
//!   from after it.
//! - `vring_fd`: the kick, call and error descriptors the frontend hands over, read and
//!   signalled without ever blocking; `watchdog` interrupts the one call that cannot be
//!   made non-blocking per call (an eventfd write).
//!
//! Rules (see DESIGN.md): everything read from the frontend or guest memory is checked; a
//! bad request gets a status, a chain that cannot be answered stops only its queue; no
//! allocation, lock shared between queues or payload copy per request.
#![deny(missing_docs)]

mod blk;
pub mod config;
pub mod control;
pub mod daemon;
mod dirty_log;
mod disk;
mod fence;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod inflight;
pub mod log_context;
mod memory;
mod poll;
mod registry;
mod ring;
pub mod sandbox;
mod session;
mod sigbus;
pub mod socket_file;
mod stats;
#[cfg(test)]
mod tests;
pub mod throttle;
mod vring_fd;
mod watchdog;
mod wire;
mod worker;

pub use config::{DaemonConfig, DeviceConfig, Listen, ServedDisk};
pub use control::DiskParser;
pub use daemon::Controls;
pub use daemon::{serve, serve_files, Error};
