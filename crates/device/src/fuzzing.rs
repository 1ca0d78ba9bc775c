//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`, off by default).
//!
//! Not an API: the session type stays private to the crate, and this module only lets a
//! fuzz target drive one vhost-user connection message by message, as the daemon does
//! (`daemon::serve_one`), without a listening socket.
#![doc(hidden)]

use std::os::unix::net::UnixStream;
use std::sync::Arc;

use storage::Backend;

use crate::config::DeviceConfig;
use crate::daemon::Error;
use crate::disk::DiskShared;
use crate::session::Session;
use crate::worker::{Pool, PoolConfig};

/// One frontend connection served by a real session (with its worker threads) on `disk`.
#[doc(hidden)]
pub struct Connection {
    // Dropped first: its workers run on the pool's threads.
    session: Session,
    _shared: DiskShared,
    stream: UnixStream,
}

impl Connection {
    /// A session serving `disk` as `config` says, reading messages from `stream`.
    pub fn new(
        config: &DeviceConfig,
        disk: &Arc<Backend>,
        stream: UnixStream,
    ) -> Result<Connection, Error> {
        let conn = stream
            .try_clone()
            .map_err(|e| Error::VhostUser(format!("cannot clone the connection: {e}")))?;
        let pool = Pool::new(&PoolConfig {
            threads: 1,
            cpus: Vec::new(),
            poll_us: 0,
            coalesce_us: 0,
        })
        .map_err(|e| Error::VhostUser(format!("cannot start the worker threads: {e}")))?;
        let shared = DiskShared::new(
            "fuzz".into(),
            config.clone(),
            disk.clone(),
            Arc::new(pool),
            0,
            "fuzz".into(),
            String::new(),
        );
        let session = Session::new(&shared, conn)?;
        Ok(Connection {
            session,
            _shared: shared,
            stream,
        })
    }

    /// Receive and handle one message. The daemon ends the connection on the first
    /// error (the reason is in the message), or when [`Connection::poisoned`] says so.
    pub fn handle_one(&mut self) -> Result<(), String> {
        self.session
            .handle(&mut self.stream)
            .map_err(|e| e.to_string())
    }

    /// Whether the frontend truncated guest memory under the device.
    pub fn poisoned(&self) -> bool {
        self.session.poisoned()
    }
}
