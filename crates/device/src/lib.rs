//! The vhost-user-blk device behind `vblk serve`.
//!
//! Module map:
//! - [`config`]: what the user asked for ([`DeviceConfig`]) and how it is checked.
//! - `blk`: what the device offers: features, configuration space, request limits.
//! - [`daemon`]: listening (a path or an inherited fd), one frontend at a time, going back
//!   to listening when it leaves.
//! - `session`: one frontend connection — the vhost-user control plane, each message
//!   checked before it changes anything; rings started and stopped; memory tables.
//! - `memory`: guest memory regions, checked (`fstat`, overlaps, slots) and mapped; the
//!   immutable views workers hold.
//! - `sigbus`: the backstop that keeps a frontend truncating its memory from killing us.
//! - `ring`: the device side of a split virtqueue through host pointers.
//! - `worker`: one thread per worker owns a set of queues and one storage engine; it pops
//!   chains, has `proto` check them, hands payload iovecs to the engine, publishes
//!   completions and signals the driver once per batch.
//! - `poll`: the adaptive polling window a worker spins in before it sleeps.
//!
//! Rules (see DESIGN.md): everything read from the frontend or guest memory is checked; a
//! bad request gets a status, a chain that cannot be answered stops only its queue; no
//! allocation, lock shared between queues or payload copy per request.
#![deny(missing_docs)]

mod blk;
pub mod config;
pub mod daemon;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod memory;
mod poll;
mod ring;
mod session;
mod sigbus;
#[cfg(test)]
mod tests;
mod worker;

pub use config::{DeviceConfig, Listen};
pub use daemon::{serve, Error};
