//! A scripted NBD server: the fixed newstyle handshake (`NBD_OPT_GO` with
//! `NBD_INFO_EXPORT` and `NBD_INFO_BLOCK_SIZE`, or `NBD_OPT_EXPORT_NAME`), simple replies,
//! and a RAM disk shared by every connection. Each accepted connection runs the test's
//! script on a thread of its own, numbered from 0 (the connection `Backend::open` makes
//! to learn the export; an engine's first connection is 1). A script does the handshake,
//! then answers, forges, repeats or withholds replies as it likes.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

const INIT_MAGIC: u64 = 0x4e42_444d_4147_4943;
const OPTS_MAGIC: u64 = 0x4948_4156_454f_5054;
const REP_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const REPLY_MAGIC: u32 = 0x6744_6698;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) | 1;
pub const REP_ERR_INVALID: u32 = (1 << 31) | 3;
pub const REP_ERR_PLATFORM: u32 = (1 << 31) | 4;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) | 6;
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
/// `NBD_FLAG_HAS_FLAGS` only: no FLUSH, FUA, TRIM or multi-conn.
const TRANSMISSION_FLAGS: u16 = 1;

/// The export the server offers.
#[derive(Clone, Copy, Debug)]
pub struct Export {
    pub size: usize,
    /// The largest payload it states.
    pub max_payload: u32,
}

/// What a test script gets: one connection.
pub struct Session {
    /// The connection's number (0: the first the server accepted).
    pub n: usize,
    stream: Box<dyn Stream>,
    /// The stream's descriptor, for `quiet_for`.
    fd: RawFd,
    disk: Arc<Mutex<Vec<u8>>>,
    export: Export,
    /// Bytes written one at a time, this far apart.
    trickle: Option<Duration>,
}

trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

/// One request.
#[derive(Clone, Debug)]
pub struct Req {
    pub cmd: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
    pub data: Vec<u8>,
}

impl Session {
    /// From now on, every byte is sent alone, `every` after the last.
    pub fn trickle(&mut self, every: Duration) {
        self.trickle = Some(every);
    }

    fn send(&mut self, b: &[u8]) -> io::Result<()> {
        match self.trickle {
            None => self.stream.write_all(b),
            Some(every) => {
                for byte in b {
                    self.stream.write_all(std::slice::from_ref(byte))?;
                    std::thread::sleep(every);
                }
                Ok(())
            }
        }
    }

    fn read_n<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        let mut b = [0u8; N];
        self.stream.read_exact(&mut b)?;
        Ok(b)
    }

    fn option_reply(&mut self, opt: u32, rep: u32, data: &[u8]) -> io::Result<()> {
        let mut b = Vec::new();
        b.extend_from_slice(&REP_MAGIC.to_be_bytes());
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&rep.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b)
    }

    /// The greeting, and the client's flags.
    fn greeting(&mut self) -> io::Result<()> {
        let mut hello = Vec::new();
        hello.extend_from_slice(&INIT_MAGIC.to_be_bytes());
        hello.extend_from_slice(&OPTS_MAGIC.to_be_bytes());
        hello.extend_from_slice(&3u16.to_be_bytes()); // FIXED_NEWSTYLE | NO_ZEROES
        self.send(&hello)?;
        let _client_flags = self.read_n::<4>()?;
        Ok(())
    }

    /// The next option: its number and data.
    fn option(&mut self) -> io::Result<(u32, Vec<u8>)> {
        let magic = u64::from_be_bytes(self.read_n::<8>()?);
        assert_eq!(magic, OPTS_MAGIC, "option magic");
        let opt = u32::from_be_bytes(self.read_n::<4>()?);
        let len = u32::from_be_bytes(self.read_n::<4>()?) as usize;
        let mut data = vec![0u8; len];
        self.stream.read_exact(&mut data)?;
        Ok((opt, data))
    }

    /// A handshake in which the server answers `NBD_OPT_GO` with error `rep` and
    /// `message`, and `NBD_OPT_LIST` with `exports`; until the client aborts.
    pub fn refuse_go(&mut self, rep: u32, message: &str, exports: &[&str]) -> io::Result<()> {
        self.greeting()?;
        loop {
            let (opt, _) = self.option()?;
            match opt {
                OPT_GO => self.option_reply(opt, rep, message.as_bytes())?,
                OPT_LIST => {
                    for name in exports {
                        let mut b = (name.len() as u32).to_be_bytes().to_vec();
                        b.extend_from_slice(name.as_bytes());
                        self.option_reply(opt, REP_SERVER, &b)?;
                    }
                    self.option_reply(opt, REP_ACK, &[])?;
                }
                OPT_ABORT => return self.option_reply(opt, REP_ACK, &[]),
                _ => self.option_reply(opt, REP_ERR_UNSUP, &[])?,
            }
        }
    }

    /// The fixed newstyle handshake, as an honest server does it.
    pub fn handshake(&mut self) -> io::Result<()> {
        self.greeting()?;
        loop {
            let (opt, _) = self.option()?;
            let size = (self.export.size as u64).to_be_bytes();
            let flags = TRANSMISSION_FLAGS.to_be_bytes();
            match opt {
                OPT_GO => {
                    let mut info = vec![0, 0];
                    info.extend_from_slice(&size);
                    info.extend_from_slice(&flags);
                    self.option_reply(opt, REP_INFO, &info)?;
                    let mut bs = vec![0, 3];
                    for v in [512, 4096, self.export.max_payload] {
                        bs.extend_from_slice(&v.to_be_bytes());
                    }
                    self.option_reply(opt, REP_INFO, &bs)?;
                    return self.option_reply(opt, REP_ACK, &[]);
                }
                OPT_EXPORT_NAME => {
                    let mut b = size.to_vec();
                    b.extend_from_slice(&flags);
                    return self.send(&b);
                }
                _ => self.option_reply(opt, REP_ERR_UNSUP, &[])?,
            }
        }
    }

    /// The next request; None when the client disconnects (or hangs up).
    pub fn request(&mut self) -> io::Result<Option<Req>> {
        let h = match self.read_n::<28>() {
            Ok(h) => h,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        };
        let magic = u32::from_be_bytes(h[0..4].try_into().unwrap());
        assert_eq!(magic, REQUEST_MAGIC, "request magic");
        let r = Req {
            cmd: u16::from_be_bytes(h[6..8].try_into().unwrap()),
            cookie: u64::from_be_bytes(h[8..16].try_into().unwrap()),
            offset: u64::from_be_bytes(h[16..24].try_into().unwrap()),
            len: u32::from_be_bytes(h[24..28].try_into().unwrap()),
            data: Vec::new(),
        };
        if r.cmd == CMD_DISC {
            return Ok(None);
        }
        let mut r = r;
        if r.cmd == CMD_WRITE {
            r.data = vec![0u8; r.len as usize];
            self.stream.read_exact(&mut r.data)?;
        }
        Ok(Some(r))
    }

    /// Does what `r` asks on the disk; the payload of its reply.
    pub fn serve(&self, r: &Req) -> Vec<u8> {
        let mut disk = self.disk.lock().unwrap();
        let range = r.offset as usize..r.offset as usize + r.len as usize;
        match r.cmd {
            CMD_READ => disk[range].to_vec(),
            CMD_WRITE => {
                disk[range].copy_from_slice(&r.data);
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    /// Sends a simple reply with `cookie`, `error` and `payload`.
    pub fn reply(&mut self, cookie: u64, error: u32, payload: &[u8]) -> io::Result<()> {
        let mut b = Vec::with_capacity(16 + payload.len());
        b.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
        b.extend_from_slice(&error.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(payload);
        self.send(&b)
    }

    /// Sends `b` as it is (a reply's payload after its header, say).
    pub fn send_raw(&mut self, b: &[u8]) -> io::Result<()> {
        self.send(b)
    }

    /// Does `r` and answers it.
    pub fn answer(&mut self, r: &Req) -> io::Result<()> {
        let payload = self.serve(r);
        self.reply(r.cookie, 0, &payload)
    }

    /// Answers every request until the client disconnects.
    pub fn honest(&mut self) {
        while let Ok(Some(r)) = self.request() {
            if self.answer(&r).is_err() {
                return;
            }
        }
    }

    /// Whether the client sends nothing for `d`.
    pub fn quiet_for(&self, d: Duration) -> bool {
        let mut p = libc::pollfd {
            fd: self.fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd on the session's open stream.
        unsafe { libc::poll(&mut p, 1, d.as_millis() as i32) == 0 }
    }

    /// Reads and ignores requests until the client hangs up.
    pub fn until_closed(&mut self) {
        while let Ok(Some(_)) = self.request() {}
    }
}

type Script = dyn Fn(&mut Session) + Send + Sync;

/// The server; stopped (no more connections accepted) when dropped.
pub struct Server {
    uri: String,
    /// The socket's directory, removed on drop.
    _dir: Option<tempfile::TempDir>,
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    pub disk: Arc<Mutex<Vec<u8>>>,
    thread: Option<JoinHandle<()>>,
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Server {
    /// A server on a Unix socket in a temporary directory.
    pub fn unix(export: Export, script: impl Fn(&mut Session) + Send + Sync + 'static) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let path: PathBuf = dir.path().join("nbd.sock");
        let l = UnixListener::bind(&path).unwrap();
        let uri = format!("nbd+unix:///?socket={}", path.display());
        Server::start(Listener::Unix(l), uri, Some(dir), export, Arc::new(script))
    }

    /// A server on TCP, 127.0.0.1 and a free port, named `localhost` in its URI (so the
    /// client looks the name up).
    pub fn tcp(export: Export, script: impl Fn(&mut Session) + Send + Sync + 'static) -> Server {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let uri = format!("nbd://localhost:{}/", l.local_addr().unwrap().port());
        Server::start(Listener::Tcp(l), uri, None, export, Arc::new(script))
    }

    fn start(
        l: Listener,
        uri: String,
        dir: Option<tempfile::TempDir>,
        export: Export,
        script: Arc<Script>,
    ) -> Server {
        let stop = Arc::new(AtomicBool::new(false));
        let accepted = Arc::new(AtomicUsize::new(0));
        let disk = Arc::new(Mutex::new(vec![0u8; export.size]));
        let (st, acc, dk) = (stop.clone(), accepted.clone(), disk.clone());
        match &l {
            Listener::Unix(l) => l.set_nonblocking(true).unwrap(),
            Listener::Tcp(l) => l.set_nonblocking(true).unwrap(),
        }
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Acquire) {
                // A session thread gives up on a client silent for a minute.
                let idle = Some(Duration::from_secs(60));
                let stream: io::Result<(Box<dyn Stream>, RawFd)> = match &l {
                    Listener::Unix(l) => l.accept().and_then(|(s, _)| {
                        s.set_nonblocking(false)?;
                        s.set_read_timeout(idle)?;
                        let fd = s.as_raw_fd();
                        Ok((Box::new(s) as Box<dyn Stream>, fd))
                    }),
                    Listener::Tcp(l) => l.accept().and_then(|(s, _): (TcpStream, _)| {
                        s.set_nonblocking(false)?;
                        s.set_read_timeout(idle)?;
                        let fd = s.as_raw_fd();
                        Ok((Box::new(s) as Box<dyn Stream>, fd))
                    }),
                };
                match stream {
                    Ok((stream, fd)) => {
                        let n = acc.fetch_add(1, Ordering::AcqRel);
                        let mut s = Session {
                            n,
                            stream,
                            fd,
                            disk: dk.clone(),
                            export,
                            trickle: None,
                        };
                        let script = script.clone();
                        std::thread::spawn(move || script(&mut s));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => panic!("accept: {e}"),
                }
            }
        });
        Server {
            uri,
            _dir: dir,
            stop,
            accepted,
            disk,
            thread: Some(thread),
        }
    }

    pub fn uri(&self) -> &str {
        &self.uri
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.accepted.load(Ordering::Acquire)
    }

    /// A copy of `len` bytes of the disk at `offset`.
    pub fn bytes(&self, offset: usize, len: usize) -> Vec<u8> {
        self.disk.lock().unwrap()[offset..offset + len].to_vec()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
