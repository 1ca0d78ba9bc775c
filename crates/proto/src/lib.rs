//! virtio-blk on the wire, as both sides of vblk see it (virtio 1.2, section 5.2).
//!
//! Module map:
//! - [`wire`]: feature bits, request types, statuses, the request header, discard and
//!   write-zeroes segments, the GET_ID length.
//! - [`config`]: the device configuration space (`struct virtio_blk_config`).
//! - [`chain`]: a strict walker of split-ring descriptor chains (direct and indirect) that
//!   checks every field the driver controls and turns guest addresses into host iovecs.
//! - [`ram`]: guest memory as the parser reads it ([`GuestRam`]: the host address of a
//!   guest range), for any `vm_memory` memory or the device's own table of regions.
//! - [`request`]: a checked request parsed from a chain: type, sector range, payload
//!   iovecs and status byte, or the status the device must answer with.
//!
//! Nothing here does I/O, owns a thread or touches a socket. Everything read from guest
//! memory is treated as hostile: every failure is a value, never a panic.
#![deny(missing_docs)]

pub mod chain;
pub mod config;
pub mod ram;
pub mod request;
pub mod wire;

pub use chain::{ChainError, RingInfo};
pub use config::BlkConfig;
pub use ram::GuestRam;
pub use request::{Limits, Parser, Rejected, Request, RequestKind};
