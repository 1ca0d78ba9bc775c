//! Following the device's configuration changes: the backend channel
//! (VHOST_USER_PROTOCOL_F_BACKEND_REQ). The device sends CONFIG_CHANGE_MSG when, for
//! instance, its disk grew; a thread of the driver's answers it and then reads the
//! configuration space again, so that [`Disk::capacity_bytes`](crate::Disk::capacity_bytes)
//! and the queues' range checks see the new capacity.
//!
//! The configuration is read after the answer, not in the handler: the device waits for
//! the answer before it takes its next request, so reading first would deadlock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use log::{debug, info, warn};
use proto::BlkConfig;
use vhost::vhost_user::message::VhostUserConfigFlags;
use vhost::vhost_user::{
    Frontend, FrontendReqHandler, HandlerResult, VhostUserFrontend, VhostUserFrontendReqHandlerMut,
};

use crate::disk::Shared;
use crate::error::{Error, ErrorKind};

/// What the handler records; the thread acts on it after answering.
#[derive(Default)]
pub(crate) struct Changes {
    config: AtomicBool,
}

/// The handler the vhost crate calls for backend requests.
pub(crate) struct Handler(Arc<Changes>);

impl VhostUserFrontendReqHandlerMut for Handler {
    fn handle_config_change(&mut self) -> HandlerResult<u64> {
        self.0.config.store(true, Ordering::SeqCst);
        Ok(0)
    }
}

/// The backend channel, before the thread that serves it starts.
pub(crate) struct Channel {
    handler: FrontendReqHandler<Mutex<Handler>>,
    changes: Arc<Changes>,
}

impl Channel {
    /// Make the channel and hand the device its end (SET_BACKEND_REQ_FD).
    pub(crate) fn open(fe: &mut Frontend, reply_ack: bool) -> Result<Channel, Error> {
        let changes = Arc::new(Changes::default());
        let mut handler =
            FrontendReqHandler::new(Arc::new(Mutex::new(Handler(changes.clone()))))
                .map_err(|e| Error::new(ErrorKind::Connect, format!("backend channel: {e}")))?;
        handler.set_reply_ack_flag(reply_ack);
        fe.set_backend_request_fd(&handler.get_tx_raw_fd())
            .map_err(|e| Error::new(ErrorKind::Connect, format!("SET_BACKEND_REQ_FD: {e}")))?;
        Ok(Channel { handler, changes })
    }

    /// Serve the channel on a thread until the device goes away. `cfg_len` bytes of
    /// configuration are read after each change.
    pub(crate) fn spawn(mut self, shared: Weak<Shared>, cfg_len: usize) {
        let spawned = std::thread::Builder::new()
            .name("vblk-config".into())
            .spawn(move || loop {
                if let Err(e) = self.handler.handle_request() {
                    debug!("backend channel closed: {e}");
                    return;
                }
                if !self.changes.config.swap(false, Ordering::SeqCst) {
                    continue;
                }
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                let read = {
                    let mut fe = shared.frontend.lock().unwrap_or_else(|p| p.into_inner());
                    fe.get_config(
                        0,
                        cfg_len as u32,
                        VhostUserConfigFlags::WRITABLE,
                        &vec![0u8; cfg_len],
                    )
                };
                match read {
                    Ok((_, bytes)) => {
                        let cfg = BlkConfig::from_bytes(&bytes);
                        let bytes = cfg.capacity.saturating_mul(512);
                        let old = shared.capacity.swap(bytes, Ordering::SeqCst);
                        if old != bytes {
                            info!("the device's capacity changed from {old} to {bytes} bytes");
                        }
                    }
                    Err(e) => warn!("cannot read the changed configuration: {e}"),
                }
            });
        if let Err(e) = spawned {
            warn!(
                "cannot start the backend channel thread: {e}; capacity changes are not followed"
            );
        }
    }
}
