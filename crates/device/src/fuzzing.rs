//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`, off by default).
//!
//! Not an API: the session type stays private to the crate, and this module only lets a
//! fuzz target drive one vhost-user connection message by message, as the daemon does
//! (`daemon::serve_one`), without a listening socket.
#![doc(hidden)]

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use storage::Backend;
use vhost::vhost_user::{BackendReqHandler, Error as VuError};

use crate::config::DeviceConfig;
use crate::daemon::Error;
use crate::session::Session;

/// One frontend connection served by a real session (with its worker threads) on `disk`.
#[doc(hidden)]
pub struct Connection {
    handler: BackendReqHandler<Mutex<Session>>,
    session: Arc<Mutex<Session>>,
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
        let session = Arc::new(Mutex::new(Session::new(config, disk, conn)?));
        let handler = BackendReqHandler::from_stream(stream, session.clone());
        Ok(Connection { handler, session })
    }

    /// Receive and handle one message. The daemon ends the connection on the first
    /// error, or when [`Connection::poisoned`] says so after a message.
    pub fn handle_one(&mut self) -> Result<(), VuError> {
        self.handler.handle_request()
    }

    /// Whether the frontend truncated guest memory under the device.
    pub fn poisoned(&self) -> bool {
        self.session
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .poisoned()
    }
}
