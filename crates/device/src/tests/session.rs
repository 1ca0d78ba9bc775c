//! The control plane through its socket: a session on one end of a socket pair, raw
//! vhost-user messages written to the other.

use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::*;
use crate::session::{Session, SessionEnd};
use crate::wire::{protocol, req};

const NEED_REPLY: u32 = 0x8;

/// A session and the frontend's end of its socket.
struct Front {
    // Dropped first: its workers run on the pool's threads.
    session: Session,
    shared: crate::disk::DiskShared,
    ours: UnixStream,
    theirs: UnixStream,
    _file: tempfile::NamedTempFile,
}

impl Front {
    fn new(read_only: bool) -> Front {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), vec![0u8; DISK_BYTES as usize]).unwrap();
        let config = DeviceConfig {
            disk: DiskSpec::File(file.path().to_path_buf()),
            read_only,
            num_queues: 2,
            ..Default::default()
        };
        let disk = Arc::new(
            Backend::open(
                &config.disk,
                &OpenOptions {
                    read_only,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let (ours, theirs) = UnixStream::pair().unwrap();
        let clone = theirs.try_clone().unwrap();
        let pool = crate::worker::Pool::new(&crate::worker::PoolConfig::default()).unwrap();
        let shared = crate::disk::DiskShared::new(
            "test".into(),
            config,
            disk,
            Arc::new(pool),
            0,
            "test".into(),
            String::new(),
        );
        Front {
            session: Session::new(&shared, clone).unwrap(),
            shared,
            ours,
            theirs,
            _file: file,
        }
    }

    fn send(&mut self, code: u32, flags: u32, payload: &[u8], fds: &[RawFd]) {
        let mut buf = Vec::new();
        buf.extend_from_slice(&code.to_le_bytes());
        buf.extend_from_slice(&(1 | flags).to_le_bytes());
        buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        buf.extend_from_slice(payload);
        self.ours.send_with_fds(&[&buf[..]], fds).unwrap();
    }

    /// Send a request and have the session handle it.
    fn request(
        &mut self,
        code: u32,
        flags: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> Result<(), SessionEnd> {
        self.send(code, flags, payload, fds);
        self.session.handle(&mut self.theirs)
    }

    /// Read one reply: its payload.
    fn reply(&mut self, code: u32) -> Vec<u8> {
        let mut hdr = [0u8; 12];
        self.ours.read_exact(&mut hdr).unwrap();
        assert_eq!(u32::from_le_bytes(hdr[0..4].try_into().unwrap()), code);
        assert_eq!(
            u32::from_le_bytes(hdr[4..8].try_into().unwrap()),
            0x5,
            "a version-1 reply"
        );
        let len = u32::from_le_bytes(hdr[8..12].try_into().unwrap()) as usize;
        let mut p = vec![0u8; len];
        self.ours.read_exact(&mut p).unwrap();
        p
    }

    fn get_u64(&mut self, code: u32) -> u64 {
        self.request(code, 0, &[], &[]).unwrap();
        u64::from_le_bytes(self.reply(code).try_into().unwrap())
    }

    fn set_u64(&mut self, code: u32, v: u64) -> Result<(), SessionEnd> {
        self.request(code, 0, &v.to_le_bytes(), &[])
    }

    /// GET_CONFIG of `size` bytes at `offset`: the bytes.
    fn get_config(&mut self, offset: u32, size: u32) -> Result<Vec<u8>, SessionEnd> {
        let mut p = Vec::new();
        p.extend_from_slice(&offset.to_le_bytes());
        p.extend_from_slice(&size.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend(std::iter::repeat_n(0u8, size as usize));
        self.request(req::GET_CONFIG, 0, &p, &[])?;
        Ok(self.reply(req::GET_CONFIG)[12..].to_vec())
    }

    fn set_config(&mut self, offset: u32, data: &[u8]) -> Result<(), SessionEnd> {
        let mut p = Vec::new();
        p.extend_from_slice(&offset.to_le_bytes());
        p.extend_from_slice(&(data.len() as u32).to_le_bytes());
        p.extend_from_slice(&1u32.to_le_bytes());
        p.extend_from_slice(data);
        self.request(req::SET_CONFIG, 0, &p, &[])
    }

    /// The handshake QEMU does: features, protocol features (CONFIG, REPLY_ACK, …).
    fn handshake(&mut self, protocol: u64, features: u64) {
        let offered = self.get_u64(req::GET_FEATURES);
        assert_ne!(
            offered & (1 << 30),
            0,
            "VHOST_USER_F_PROTOCOL_FEATURES offered"
        );
        let offered_proto = self.get_u64(req::GET_PROTOCOL_FEATURES);
        assert_eq!(offered_proto & protocol, protocol);
        self.set_u64(req::SET_PROTOCOL_FEATURES, protocol).unwrap();
        self.request(req::SET_OWNER, 0, &[], &[]).unwrap();
        self.set_u64(req::SET_FEATURES, features | (1 << 30))
            .unwrap();
    }
}

#[test]
fn driver_write_of_writeback_through_set_config_takes_effect() {
    let mut f = Front::new(false);
    f.handshake(protocol::CONFIG, all_features());
    let wb = |f: &mut Front| {
        f.get_config(proto::config::WRITEBACK_OFFSET as u32, 1)
            .unwrap()[0]
    };
    assert_eq!(wb(&mut f), 1, "writeback by default");
    f.set_config(32, &[0]).unwrap();
    assert_eq!(wb(&mut f), 0, "the driver switched to writethrough");
    f.set_config(32, &[1]).unwrap();
    assert_eq!(wb(&mut f), 1);
    assert_eq!(f.get_config(0, 8).unwrap(), CAPACITY.to_le_bytes().to_vec());
    // Other fields are read-only: refused, and the session ends.
    assert!(matches!(
        f.set_config(0, &[0; 8]),
        Err(SessionEnd::Refused(_))
    ));

    // Without CONFIG_WCE the write is ignored.
    let mut f = Front::new(false);
    f.handshake(
        protocol::CONFIG,
        all_features() & !feature::bit(feature::CONFIG_WCE),
    );
    f.set_config(32, &[0]).unwrap();
    assert_eq!(wb(&mut f), 1);
}

#[test]
fn config_space_reports_the_disk_and_limits() {
    let mut f = Front::new(false);
    f.handshake(protocol::CONFIG | protocol::MQ, all_features());
    let c =
        proto::BlkConfig::from_bytes(&f.get_config(0, proto::config::CONFIG_LEN as u32).unwrap());
    assert_eq!(c.capacity, CAPACITY);
    assert_eq!(
        c.seg_max,
        crate::config::SEG_MAX,
        "whatever queue size comes"
    );
    assert_eq!(c.size_max, crate::config::SIZE_MAX);
    assert_eq!(c.blk_size, 512);
    assert_eq!(c.num_queues, 2);
    assert_eq!((c.max_discard_seg, c.max_write_zeroes_seg), (1, 1));
    assert!(c.max_discard_sectors > 0 && c.max_write_zeroes_sectors > 0);
    assert_eq!(c.write_zeroes_may_unmap, 1);
    // Reads past the defined fields are zero-filled.
    assert_eq!(f.get_config(72, 24).unwrap(), vec![0; 24]);
    assert_eq!(f.get_u64(req::GET_QUEUE_NUM), 2);
    // Absurd ranges are refused.
    assert!(f.get_config(1000, 4).is_err());
}

#[test]
fn protocol_requests_need_their_feature() {
    let mut f = Front::new(false);
    f.handshake(protocol::MQ, all_features());
    assert!(matches!(f.get_config(0, 8), Err(SessionEnd::Refused(_))));
    let mut f = Front::new(false);
    f.handshake(protocol::MQ, all_features());
    assert!(matches!(
        f.request(req::GET_MAX_MEM_SLOTS, 0, &[], &[]),
        Err(SessionEnd::Refused(_))
    ));
}

#[test]
fn refusals_are_nacked_with_reply_ack() {
    let mut f = Front::new(false);
    f.handshake(protocol::REPLY_ACK | protocol::MQ, all_features());
    let mut p = Vec::new();
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&3u32.to_le_bytes());
    assert!(f.request(req::SET_VRING_NUM, NEED_REPLY, &p, &[]).is_err());
    assert_eq!(f.reply(req::SET_VRING_NUM), 1u64.to_le_bytes(), "NACK");
    let mut f = Front::new(false);
    f.handshake(protocol::REPLY_ACK, all_features());
    let mut p = Vec::new();
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&64u32.to_le_bytes());
    f.request(req::SET_VRING_NUM, NEED_REPLY, &p, &[]).unwrap();
    assert_eq!(f.reply(req::SET_VRING_NUM), 0u64.to_le_bytes(), "ACK");
}

/// A resize is announced on the backend channel with CONFIG_CHANGE_MSG (no answer asked:
/// the frontend reads the new configuration first); the new capacity is in the config
/// space.
#[test]
fn a_new_capacity_is_announced_on_the_backend_channel() {
    let mut f = Front::new(false);
    f.handshake(
        protocol::CONFIG | protocol::BACKEND_REQ | protocol::REPLY_ACK,
        all_features(),
    );
    let (mut fe, be) = UnixStream::pair().unwrap();
    f.request(req::SET_BACKEND_REQ_FD, 0, &[], &[be.as_raw_fd()])
        .unwrap();
    drop(be);
    f.session.capacity_changed(2 * CAPACITY);
    let mut hdr = [0u8; 12];
    fe.read_exact(&mut hdr).unwrap();
    let code = u32::from_le_bytes(hdr[0..4].try_into().unwrap());
    let flags = u32::from_le_bytes(hdr[4..8].try_into().unwrap());
    assert_eq!(code, 2, "VHOST_USER_BACKEND_CONFIG_CHANGE_MSG");
    assert_eq!(flags, 1, "version 1, no answer asked");
    assert_eq!(
        f.get_config(0, 8).unwrap(),
        (2 * CAPACITY).to_le_bytes().to_vec()
    );
}

#[test]
fn a_backend_channel_must_be_a_unix_stream_socket() {
    let mut f = Front::new(false);
    f.handshake(protocol::BACKEND_REQ, all_features());
    let efd = EventFd::new(0).unwrap();
    assert!(matches!(
        f.request(req::SET_BACKEND_REQ_FD, 0, &[], &[efd.as_raw_fd()]),
        Err(SessionEnd::Refused(_))
    ));
}

/// Dirty logging for a migration: SET_LOG_BASE is answered with a message of its own
/// code (QEMU waits for it), and logging is on while VHOST_F_LOG_ALL is acked and a bitmap
/// is mapped; the statistics say so.
#[test]
fn dirty_logging_goes_on_and_off_with_log_all() {
    use std::os::fd::FromRawFd;
    let mut f = Front::new(false);
    f.handshake(protocol::LOG_SHMFD, all_features());
    let active = |f: &Front| {
        f.shared
            .stats
            .lifecycle
            .log_active
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    assert_eq!(active(&f), 0);
    // SAFETY: memfd_create with a static name; the fd is owned by the File below.
    let fd = unsafe { libc::memfd_create(c"log".as_ptr(), libc::MFD_CLOEXEC) };
    // SAFETY: just created, owned by nothing else.
    let log = unsafe { std::fs::File::from_raw_fd(fd) };
    log.set_len(16384).unwrap();
    let p = [16384u64.to_le_bytes(), 0u64.to_le_bytes()].concat();
    f.request(req::SET_LOG_BASE, 0, &p, &[log.as_raw_fd()])
        .unwrap();
    assert_eq!(
        f.reply(req::SET_LOG_BASE).len(),
        8,
        "answered, as QEMU waits"
    );
    assert_eq!(active(&f), 0, "a bitmap alone does not turn logging on");
    let log_all = 1u64 << 26;
    f.set_u64(req::SET_FEATURES, all_features() | (1 << 30) | log_all)
        .unwrap();
    assert_eq!(active(&f), 1);
    f.set_u64(req::SET_FEATURES, all_features() | (1 << 30))
        .unwrap();
    assert_eq!(active(&f), 0);
    // A bitmap on a disk file is refused.
    let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/tmp");
    std::fs::create_dir_all(target).unwrap();
    let disk = tempfile::tempfile_in(target).unwrap();
    disk.set_len(16384).unwrap();
    assert!(matches!(
        f.request(req::SET_LOG_BASE, 0, &p, &[disk.as_raw_fd()]),
        Err(SessionEnd::Refused(_))
    ));
}
