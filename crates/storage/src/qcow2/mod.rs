//! qcow2 images (issue 22): the header, table entries and mapping lookups are parsed and
//! checked; images are served through the workers' engines, with backing chains named on
//! the command line; the metadata owner allocates and writes metadata (write.rs). The
//! design is in docs/design-notes.md ("qcow2: a format layer of our own").

pub(crate) mod engine;
pub mod entry;
mod fileio;
mod handoff;
pub mod header;
mod hold;
pub(crate) mod image;
mod iov;
pub mod meta;
mod owner;
mod refcount;
mod resize;
mod table;
mod write;

pub use header::{Header, HeaderError};
pub use hold::MappingsHeld;
pub use image::{BackingFile, Image, ImageStats, DEFAULT_CACHE_BYTES};
