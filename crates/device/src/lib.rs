//! The vhost-user-blk device behind `vblk serve`.
//!
//! Module map:
//! - [`config`]: what the user asked for ([`DeviceConfig`]) and how it is checked.
//! - `blk`: [`BlkDevice`], the `VhostUserBackend`: features offered, config space, queue to
//!   worker mapping, stopping queues.
//! - `worker`: one worker per thread owns a set of queues and one storage engine; it pops
//!   chains, has `proto` check them, hands payload iovecs to the engine, publishes
//!   completions and signals the driver once per batch.
//! - `poll`: the adaptive polling window a worker spins in before it sleeps.
//! - `used`: publishing a pass's completions with one used-index update and deciding
//!   whether the driver wants a notification (EVENT_IDX or NO_INTERRUPT).
//! - [`daemon`]: listening (a path or an inherited fd), one frontend at a time, going back
//!   to listening when it leaves.
//!
//! Rules (see DESIGN.md): everything read from the frontend or guest memory is checked; a
//! bad request gets a status, a broken ring stops only its queue; no allocation, lock shared
//! between queues or payload copy per request.
#![deny(missing_docs)]

mod blk;
pub mod config;
pub mod daemon;
mod poll;
#[cfg(test)]
mod tests;
mod used;
mod worker;

pub use blk::BlkDevice;
pub use config::{DeviceConfig, Listen};
pub use daemon::{serve, Error};
