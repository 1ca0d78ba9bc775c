//! NBD: disks that live on a Network Block Device server (nbdkit, qemu-nbd, rbd-nbd, …),
//! through a client of our own.
//!
//! | module | holds |
//! | --- | --- |
//! | `uri` | [`NbdSpec`]: `nbd://HOST[:PORT]/EXPORT` and `nbd+unix:///EXPORT?socket=PATH` |
//! | `wire` | magics, flags, commands, the request header and the simple reply |
//! | `handshake` | connecting, and the fixed newstyle handshake (`NBD_OPT_GO`, falling back to `NBD_OPT_EXPORT_NAME`), blocking with one deadline for the name lookup, the connect and the handshake |
//! | `slots` | one operation in flight: its pieces (requests of at most the server's largest payload), their geometry over the caller's iovecs, and exact reply accounting (cookies with a use counter, each piece answered once) |
//! | `conn` | one connection in transmission: the send queue (`sendmsg` gathering headers and write payloads straight from the iovecs), the receive state machine (`readv` scattering read payloads straight into the iovecs), the times the deadlines read |
//! | `deadline` | every wait on a connection up ends: each request answered within the timeout of being sent, sent within the timeout of the socket filling, a silent server |
//! | `sys` | the engine's epoll set, timerfd and non-blocking sockets |
//! | `dial` | reconnection attempts on a helper thread, handing back a ready socket |
//! | `reconnect` | a connection's life: breaks, held operations, reconnection, and when to give up |
//! | `engine` | the [`Engine`](crate::Engine): operations into slots, completions, the notify fd, a bounded drop |
//!
//! [`Backend::open`](crate::Backend::open) connects once to learn the export (size, flags,
//! block sizes) and hangs up; each engine then opens its own connection (several when the
//! server offers `NBD_FLAG_CAN_MULTI_CONN` and [`NbdOptions::conns`] asks), so no lock is
//! shared between device workers.

mod conn;
mod deadline;
mod dial;
mod engine;
mod handshake;
mod reconnect;
mod slots;
mod sys;
mod uri;
mod wire;

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub(crate) use engine::NbdEngine;
pub use handshake::ExportInfo;
pub use uri::{NbdAddr, NbdSpec, DEFAULT_PORT};

use crate::error::Error;
use crate::spec::SECTOR_SIZE;

/// How an NBD disk behaves when its server goes away or falls silent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NbdOptions {
    /// After a connection breaks, how long to keep reconnecting (and holding the
    /// operations in flight, to replay them) before failing them with `EIO`. It is
    /// counted from the first break since an operation last completed, so a server that
    /// accepts connections and breaks the protocol again and again does not restart it;
    /// and no operation is held longer than this after the first break that caught it.
    pub reconnect: Duration,
    /// The deadline of every wait on the server. A request not answered this long after
    /// it was wholly sent (its reply, and a read's payload, all in), a request the socket
    /// would not take for this long, or no byte at all for this long while replies are
    /// awaited, breaks the connection: its operations are held and replayed as after any
    /// break, and fail with `EIO` after the `reconnect` window. So one request that
    /// legitimately takes longer than this (a 32 MiB write to a very slow server) is
    /// retried and then fails: raise the timeout for such servers. It is also the limit of
    /// one connection attempt as a whole (name lookup, connect and handshake), and how
    /// long dropping an engine waits for the operations in flight before abandoning them.
    pub timeout: Duration,
    /// Connections per engine when the server offers multi-conn (1 otherwise).
    pub conns: u32,
}

impl Default for NbdOptions {
    fn default() -> Self {
        NbdOptions {
            reconnect: Duration::from_secs(30),
            timeout: Duration::from_secs(30),
            conns: 1,
        }
    }
}

/// What a server that hangs up before its greeting may be: one that served its one client.
fn gone_hint(during: &str) -> &'static str {
    if during == "greeting" {
        " (a server that serves one client and exits, as qemu-nbd does without -t \
         (--persistent), is gone after vblk's first connection: vblk connects once to learn \
         the export, then once per worker and after every break)"
    } else {
        ""
    }
}

/// What went wrong talking to an NBD server; [`Error::Nbd`] carries it with the URI.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NbdError {
    /// The URI does not follow the NBD URI grammar.
    #[error("not a usable NBD URI: {0}")]
    Uri(String),
    /// The server could not be reached.
    #[error("cannot connect: {source}")]
    Connect {
        /// What `connect(2)` or the name lookup said.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the socket failed (a timeout included).
    #[error("{during}: {source}{}", gone_hint(during))]
    Io {
        /// The step of the handshake.
        during: &'static str,
        /// What the socket said.
        #[source]
        source: std::io::Error,
    },
    /// The server hung up.
    #[error(
        "the server closed the connection during {during}{}",
        gone_hint(during)
    )]
    Closed {
        /// The step of the handshake.
        during: &'static str,
    },
    /// A connection attempt did not finish in time.
    #[error("{during} did not finish within {} s, the time limit of a connection attempt and handshake", limit.as_secs_f64())]
    Timeout {
        /// The step it was at.
        during: &'static str,
        /// The limit.
        limit: Duration,
    },
    /// The server broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// No export of that name: the server answered `NBD_OPT_GO` with
    /// `NBD_REP_ERR_UNKNOWN` and does not list the name among its exports.
    #[error(
        "server offers no export named '{}' (exports: {}): it answered NBD_OPT_GO with \
         NBD_REP_ERR_UNKNOWN{}",
        printable(name),
        list_names(exports),
        said(message)
    )]
    NoExport {
        /// The name asked for.
        name: String,
        /// What the server lists (empty when it lists nothing, or will not list).
        exports: Vec<String>,
        /// The server's message (empty: none).
        message: String,
    },
    /// The server answered `NBD_OPT_GO` with an error: any error but
    /// `NBD_REP_ERR_UNKNOWN`, or that one for an export the server lists (nbdkit answers
    /// so when its plugin fails to open the export).
    #[error(
        "server answered NBD_OPT_GO for export '{}' with {reply}{}{}",
        printable(export),
        said(message),
        listed.as_deref().map_or(String::new(), |l| format!(
            ", though it lists that export (exports: {}): it failed to open it, and its \
             log should say why",
            list_names(l)
        ))
    )]
    GoRefused {
        /// The name asked for.
        export: String,
        /// The error reply's name (`NBD_REP_ERR_*`, or its number).
        reply: String,
        /// The server's message (empty: none).
        message: String,
        /// With `NBD_REP_ERR_UNKNOWN`: what the server lists, which names the export.
        listed: Option<Vec<String>>,
    },
    /// A read-only export opened for writing.
    #[error(
        "the export is read-only (the server sets NBD_FLAG_READ_ONLY); serve it with --read-only"
    )]
    ReadOnly,
    /// The export has no bytes.
    #[error("the export is empty (its size is 0): there is nothing to serve")]
    Empty,
    /// The export's size is not a whole number of blocks.
    #[error("export size {size} is not a multiple of {block}")]
    Unaligned {
        /// Bytes.
        size: u64,
        /// The block size.
        block: u32,
    },
    /// Block size constraints vblk cannot honour.
    #[error("unusable block size constraints: minimum {min}, preferred {pref}, maximum {max} (expected a power-of-two minimum up to 65536 and a maximum of at least {need})")]
    BlockSize {
        /// Minimum.
        min: u32,
        /// Preferred.
        pref: u32,
        /// Maximum.
        max: u32,
        /// The smallest maximum usable.
        need: u32,
    },
    /// A second connection for writing to a server without multi-conn.
    #[error("the server does not offer multi-conn (NBD_FLAG_CAN_MULTI_CONN), so a flush on one connection would not cover writes on another: serve it writable with one worker (--threads 1), or read-only")]
    NoMultiConn,
}

fn list_names(names: &[String]) -> String {
    if names.is_empty() {
        return "none listed".into();
    }
    names
        .iter()
        .map(|n| {
            if n.is_empty() {
                "'' (default)".to_owned()
            } else {
                printable(n)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A server's message, quoted, after its error's name ("(no message)" when it sent none).
fn said(message: &str) -> String {
    if message.is_empty() {
        " (no message)".into()
    } else {
        format!(": \"{}\"", printable(message))
    }
}

/// A string from the server, fit for a log line: control characters escaped, at most 256
/// characters (NBD asks servers to keep strings that short).
fn printable(s: &str) -> String {
    const MAX: usize = 256;
    let mut out = String::with_capacity(s.len().min(MAX));
    for (i, c) in s.chars().enumerate() {
        if i == MAX {
            out.push_str("...");
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// An opened NBD export, held by its [`Backend`](crate::Backend).
#[derive(Debug)]
pub(crate) struct Export {
    pub spec: NbdSpec,
    pub info: ExportInfo,
    pub opts: NbdOptions,
    pub read_only: bool,
    /// The logical block size: the server's minimum block size, at least 512.
    pub block: u32,
    /// The largest payload of one request (a multiple of `block`).
    pub max_payload: u32,
    /// Writable engines alive (a server without multi-conn gets one).
    writers: AtomicUsize,
    /// Writes fail from now on (reconnect.rs, "a break that vblk made"): a connection was
    /// given up with writes sent and unanswered, which the server may still apply, after
    /// newer ones. Shared by every engine of the disk; lifted only by opening it again.
    pub(crate) writes_fenced: std::sync::atomic::AtomicBool,
}

impl Export {
    /// Connects once to learn what the export is, and checks that vblk can serve it.
    pub(crate) fn open(spec: &NbdSpec, read_only: bool, opts: NbdOptions) -> Result<Export, Error> {
        let fail = |source| Error::Nbd {
            uri: spec.to_string(),
            source,
        };
        let (fd, info) = handshake::connect(spec, opts.timeout).map_err(fail)?;
        conn::disconnect(&fd);
        drop(fd);
        let export_ro = info.has(wire::FLAG_READ_ONLY);
        if export_ro && !read_only {
            return Err(fail(NbdError::ReadOnly));
        }
        let (min, pref, max) = (info.min_block, info.pref_block, info.max_payload);
        let block = min.max(SECTOR_SIZE as u32);
        let max_payload = (max.min(wire::DEFAULT_MAX_PAYLOAD) / block) * block;
        if !min.is_power_of_two() || min > 65536 || max_payload < block {
            return Err(fail(NbdError::BlockSize {
                min,
                pref,
                max,
                need: block,
            }));
        }
        if info.size == 0 {
            return Err(fail(NbdError::Empty));
        }
        if !info.size.is_multiple_of(u64::from(block)) {
            return Err(fail(NbdError::Unaligned {
                size: info.size,
                block,
            }));
        }
        Ok(Export {
            spec: spec.clone(),
            info,
            opts,
            read_only,
            block,
            max_payload,
            writers: AtomicUsize::new(0),
            writes_fenced: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// A connection for an engine: connected and negotiated within `opts.timeout`,
    /// non-blocking, and checked to serve the export `open` found.
    pub(crate) fn connect(&self) -> Result<OwnedFd, NbdError> {
        let (fd, info) = handshake::connect(&self.spec, self.opts.timeout)?;
        if info.size != self.info.size {
            return Err(NbdError::Protocol(format!(
                "the export's size is now {} bytes, it was {}",
                info.size, self.info.size
            )));
        }
        if info.has(wire::FLAG_READ_ONLY) && !self.read_only {
            return Err(NbdError::ReadOnly);
        }
        Ok(fd)
    }

    /// Whether the server sets transmission flag `f`.
    pub(crate) fn has(&self, f: u16) -> bool {
        self.info.has(f)
    }

    /// Whether the server takes NBD_CMD_TRIM.
    pub(crate) fn can_trim(&self) -> bool {
        self.has(wire::FLAG_SEND_TRIM)
    }

    /// Connections each engine opens.
    pub(crate) fn conns(&self) -> usize {
        if self.has(wire::FLAG_CAN_MULTI_CONN) {
            self.opts.conns.clamp(1, 64) as usize
        } else {
            1
        }
    }

    /// Writable, on a server without multi-conn: one engine at a time.
    pub(crate) fn one_writer_only(&self) -> bool {
        !self.read_only && !self.has(wire::FLAG_CAN_MULTI_CONN)
    }

    /// Registers a new engine; a second writer on a server without multi-conn is refused.
    pub(crate) fn add_engine(&self) -> Result<(), Error> {
        if self.read_only || self.has(wire::FLAG_CAN_MULTI_CONN) {
            return Ok(());
        }
        if self
            .writers
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(Error::Nbd {
                uri: self.spec.to_string(),
                source: NbdError::NoMultiConn,
            });
        }
        Ok(())
    }

    /// An engine registered with `add_engine` is gone.
    pub(crate) fn remove_engine(&self) {
        if !self.read_only && !self.has(wire::FLAG_CAN_MULTI_CONN) {
            self.writers.store(0, Ordering::Release);
        }
    }
}
