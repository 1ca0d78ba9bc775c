//! qcow2 images (issue 22): the header, table entries and mapping lookups are parsed and
//! checked; images are served read-only through the workers' engines, with backing
//! chains named on the command line. Writing is not built yet. The design is in
//! docs/design-notes.md ("qcow2: a format layer of our own").

pub(crate) mod engine;
pub mod entry;
pub mod header;
pub(crate) mod image;
mod iov;
pub mod meta;
mod owner;
mod table;

pub use header::{Header, HeaderError};
pub use image::{BackingFile, Image};
