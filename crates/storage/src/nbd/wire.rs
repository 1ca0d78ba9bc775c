//! NBD wire format: the magics, flags and command numbers of the protocol
//! (`doc/proto.md` of the NBD project), the 28-byte request header, the 16-byte simple
//! reply, and NBD errors as errnos. Everything is big-endian on the wire.

/// `NBDMAGIC`: the first eight bytes a server sends.
pub(crate) const INIT_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle negotiation, and the prefix of every option the client sends.
pub(crate) const OPTS_MAGIC: u64 = 0x4948_4156_454f_5054;
/// The oldstyle negotiation's second magic (not supported).
pub(crate) const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
/// The prefix of every option reply.
pub(crate) const REP_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// The prefix of every request.
pub(crate) const REQUEST_MAGIC: u32 = 0x2560_9513;
/// The prefix of a simple reply.
pub(crate) const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// The prefix of a structured reply chunk (never negotiated: seeing one is an error).
pub(crate) const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server).
pub(crate) const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub(crate) const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags.
pub(crate) const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub(crate) const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Options.
pub(crate) const OPT_EXPORT_NAME: u32 = 1;
pub(crate) const OPT_ABORT: u32 = 2;
pub(crate) const OPT_LIST: u32 = 3;
pub(crate) const OPT_GO: u32 = 7;

/// Option reply types.
pub(crate) const REP_ACK: u32 = 1;
pub(crate) const REP_SERVER: u32 = 2;
pub(crate) const REP_INFO: u32 = 3;
pub(crate) const REP_FLAG_ERROR: u32 = 1 << 31;
pub(crate) const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
pub(crate) const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;

/// Information types of `NBD_REP_INFO`.
pub(crate) const INFO_EXPORT: u16 = 0;
pub(crate) const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub(crate) const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub(crate) const FLAG_READ_ONLY: u16 = 1 << 1;
pub(crate) const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub(crate) const FLAG_SEND_FUA: u16 = 1 << 3;
pub(crate) const FLAG_SEND_TRIM: u16 = 1 << 5;
pub(crate) const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub(crate) const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Command flags.
pub(crate) const CMD_FLAG_FUA: u16 = 1 << 0;
pub(crate) const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Commands.
pub(crate) const CMD_READ: u16 = 0;
pub(crate) const CMD_WRITE: u16 = 1;
pub(crate) const CMD_DISC: u16 = 2;
pub(crate) const CMD_FLUSH: u16 = 3;
pub(crate) const CMD_TRIM: u16 = 4;
pub(crate) const CMD_WRITE_ZEROES: u16 = 6;

/// Bytes in a request header.
pub(crate) const REQUEST_LEN: usize = 28;
/// Bytes in a simple reply header.
pub(crate) const REPLY_LEN: usize = 16;
/// The largest payload a client may send or ask for when the server states no maximum.
pub(crate) const DEFAULT_MAX_PAYLOAD: u32 = 32 << 20;

/// The NBD error `ESHUTDOWN`: the server is going away; the request was not done.
pub(crate) const NBD_ESHUTDOWN: u32 = 108;

/// Encodes a request header.
pub(crate) fn request(flags: u16, cmd: u16, cookie: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut h = [0u8; REQUEST_LEN];
    h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&flags.to_be_bytes());
    h[6..8].copy_from_slice(&cmd.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    h[16..24].copy_from_slice(&offset.to_be_bytes());
    h[24..28].copy_from_slice(&len.to_be_bytes());
    h
}

/// A decoded simple reply header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reply {
    /// The NBD error (0: success).
    pub error: u32,
    /// The request's cookie.
    pub cookie: u64,
}

/// Decodes a simple reply header; `Err(magic)` when the magic is not the simple reply's.
pub(crate) fn reply(b: &[u8; REPLY_LEN]) -> Result<Reply, u32> {
    let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(magic);
    }
    Ok(Reply {
        error: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
        cookie: u64::from_be_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
    })
}

/// An NBD error as an errno (the protocol's numbers are Linux's, but a server may send
/// anything: what is not known is EIO).
pub(crate) fn errno_of(error: u32) -> i32 {
    match error {
        1 => libc::EPERM,
        5 => libc::EIO,
        12 => libc::ENOMEM,
        22 => libc::EINVAL,
        28 => libc::ENOSPC,
        75 => libc::EOVERFLOW,
        95 => libc::EOPNOTSUPP,
        _ => libc::EIO,
    }
}

/// The name of an option reply error, for messages.
pub(crate) fn rep_name(rep: u32) -> String {
    match rep {
        REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP".into(),
        0x8000_0002 => "NBD_REP_ERR_POLICY".into(),
        0x8000_0003 => "NBD_REP_ERR_INVALID".into(),
        0x8000_0004 => "NBD_REP_ERR_PLATFORM".into(),
        0x8000_0005 => {
            "NBD_REP_ERR_TLS_REQD (the server requires TLS, which vblk does not speak: serve \
             the export without it, e.g. on a Unix socket)"
                .into()
        }
        REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN".into(),
        0x8000_0007 => "NBD_REP_ERR_SHUTDOWN".into(),
        0x8000_0008 => "NBD_REP_ERR_BLOCK_SIZE_REQD".into(),
        0x8000_0009 => "NBD_REP_ERR_TOO_BIG".into(),
        other => format!("reply type {other:#x}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_layout() {
        let h = request(CMD_FLAG_FUA, CMD_WRITE, 0x0102_0304_0506_0708, 4096, 512);
        assert_eq!(&h[0..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(&h[4..8], &[0, 1, 0, 1]);
        assert_eq!(&h[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(u64::from_be_bytes(h[16..24].try_into().unwrap()), 4096);
        assert_eq!(u32::from_be_bytes(h[24..28].try_into().unwrap()), 512);
    }

    #[test]
    fn reply_decodes_and_checks_magic() {
        let mut b = [0u8; REPLY_LEN];
        b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        b[4..8].copy_from_slice(&5u32.to_be_bytes());
        b[8..16].copy_from_slice(&77u64.to_be_bytes());
        assert_eq!(
            reply(&b),
            Ok(Reply {
                error: 5,
                cookie: 77
            })
        );
        b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        assert_eq!(reply(&b), Err(STRUCTURED_REPLY_MAGIC));
        assert_eq!(errno_of(5), libc::EIO);
        assert_eq!(errno_of(12345), libc::EIO);
        assert_eq!(errno_of(28), libc::ENOSPC);
    }
}
