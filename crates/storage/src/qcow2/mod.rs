//! qcow2 images (issue 22; in progress: the header, table entries and mapping lookups are
//! parsed and checked, nothing is served yet). The design is in docs/design-notes.md ("qcow2: a format layer of our
//! own").

pub mod entry;
pub mod header;
pub mod meta;

pub use header::{Header, HeaderError};
