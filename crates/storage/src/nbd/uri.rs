//! The NBD URI grammar (the NBD project's `doc/uri.md`), the part vblk speaks:
//! `nbd://HOST[:PORT][/EXPORT]` and `nbd+unix:///[EXPORT]?socket=PATH`. The export name
//! and the socket path are percent-decoded; `[::1]` is an IPv6 host; the port defaults to
//! 10809. TLS (`nbds://`) and vsock are refused with a message that says so.

use std::fmt;
use std::path::PathBuf;

/// The IANA port of NBD.
pub const DEFAULT_PORT: u16 = 10809;

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NbdAddr {
    /// TCP: a host name or address, and a port.
    Tcp {
        /// Host name, IPv4 address, or IPv6 address (without brackets).
        host: String,
        /// Port.
        port: u16,
    },
    /// A Unix domain socket.
    Unix(PathBuf),
}

/// An NBD export: where the server is and the export's name (`""` is the default export).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdSpec {
    /// The server's address.
    pub addr: NbdAddr,
    /// The export name.
    pub export: String,
}

impl NbdSpec {
    /// The server's TCP port, for a server reached over TCP.
    pub fn tcp_port(&self) -> Option<u16> {
        match &self.addr {
            NbdAddr::Tcp { port, .. } => Some(*port),
            NbdAddr::Unix(_) => None,
        }
    }

    /// Whether `s` is meant as an NBD URI (it starts with an `nbd` scheme).
    pub fn looks_like_uri(s: &str) -> bool {
        let lower = s.get(..4).map(|p| p.to_ascii_lowercase());
        lower.as_deref() == Some("nbd:") || lower.as_deref() == Some("nbd+") || {
            let l = s.get(..5).map(|p| p.to_ascii_lowercase());
            l.as_deref() == Some("nbds:") || l.as_deref() == Some("nbds+")
        }
    }

    /// Parses an NBD URI; `Err` says what is wrong with it.
    pub fn parse(s: &str) -> Result<NbdSpec, String> {
        let (scheme, rest) = s
            .split_once("://")
            .ok_or("expected nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH")?;
        let scheme = scheme.to_ascii_lowercase();
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let rest = rest.split('#').next().unwrap_or(rest);
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let export = decode(path.strip_prefix('/').unwrap_or(path))?;
        let mut socket = None;
        for param in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = param.split_once('=').unwrap_or((param, ""));
            match k {
                "socket" => socket = Some(PathBuf::from(decode(v)?)),
                _ if k.starts_with("tls") => {
                    return Err(format!("query parameter {k:?}: TLS is not supported"))
                }
                _ => {
                    return Err(format!(
                        "unknown query parameter {k:?} (vblk knows socket=)"
                    ))
                }
            }
        }
        let addr = match scheme.as_str() {
            "nbd" => {
                if socket.is_some() {
                    return Err("socket= belongs to nbd+unix:// URIs".into());
                }
                let (host, port) = host_port(authority)?;
                if host.is_empty() {
                    return Err("nbd:// needs a host (nbd://HOST[:PORT]/EXPORT)".into());
                }
                NbdAddr::Tcp { host, port }
            }
            "nbd+unix" => {
                if !authority.is_empty() {
                    return Err(format!(
                        "nbd+unix:// takes no host (found {authority:?}): nbd+unix:///EXPORT?socket=PATH"
                    ));
                }
                match socket {
                    Some(p) if !p.as_os_str().is_empty() => NbdAddr::Unix(p),
                    _ => return Err("nbd+unix:// needs ?socket=PATH".into()),
                }
            }
            "nbds" | "nbds+unix" => return Err(format!("{scheme}://: TLS is not supported")),
            "nbd+vsock" | "nbds+vsock" => {
                return Err(format!("{scheme}://: vsock is not supported"))
            }
            other => {
                return Err(format!(
                    "unknown scheme {other:?} (expected nbd:// or nbd+unix://)"
                ))
            }
        };
        Ok(NbdSpec { addr, export })
    }
}

fn host_port(authority: &str) -> Result<(String, u16), String> {
    if authority.contains('@') {
        return Err("user names are not supported in NBD URIs".into());
    }
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6
            .split_once(']')
            .ok_or_else(|| format!("unclosed '[' in host {authority:?}"))?;
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| format!("unexpected {p:?} after the IPv6 address"))?,
            ),
        };
        (h.to_owned(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (decode(h)?, Some(p)),
            None => (decode(authority)?, None),
        }
    };
    let port = match port {
        None | Some("") => DEFAULT_PORT,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| format!("port {p:?} is not a number from 1 to 65535"))?,
    };
    Ok((host, port))
}

/// Percent-decoding; the result must be UTF-8.
fn decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent escape in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} does not decode to UTF-8"))
}

/// Percent-encoding of everything but RFC 3986's unreserved characters and `/`.
fn encode(s: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    for &c in s.as_bytes() {
        if c.is_ascii_alphanumeric() || b"-._~/".contains(&c) {
            write!(f, "{}", c as char)?;
        } else {
            write!(f, "%{c:02X}")?;
        }
    }
    Ok(())
}

impl fmt::Display for NbdSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.addr {
            NbdAddr::Tcp { host, port } => {
                if host.contains(':') {
                    write!(f, "nbd://[{host}]")?;
                } else {
                    f.write_str("nbd://")?;
                    encode(host, f)?;
                }
                if *port != DEFAULT_PORT {
                    write!(f, ":{port}")?;
                }
                f.write_str("/")?;
                encode(&self.export, f)
            }
            NbdAddr::Unix(path) => {
                f.write_str("nbd+unix:///")?;
                encode(&self.export, f)?;
                f.write_str("?socket=")?;
                encode(&path.to_string_lossy(), f)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16, export: &str) -> NbdSpec {
        NbdSpec {
            addr: NbdAddr::Tcp {
                host: host.into(),
                port,
            },
            export: export.into(),
        }
    }

    #[test]
    fn parses_the_standard_forms() {
        assert_eq!(NbdSpec::parse("nbd://h/x").unwrap(), tcp("h", 10809, "x"));
        assert_eq!(NbdSpec::parse("nbd://h").unwrap(), tcp("h", 10809, ""));
        assert_eq!(NbdSpec::parse("nbd://h:1234/").unwrap(), tcp("h", 1234, ""));
        assert_eq!(
            NbdSpec::parse("nbd://[::1]:99/a%20b/c").unwrap(),
            tcp("::1", 99, "a b/c")
        );
        assert_eq!(
            NbdSpec::parse("nbd+unix:///e?socket=/tmp/s%20k").unwrap(),
            NbdSpec {
                addr: NbdAddr::Unix("/tmp/s k".into()),
                export: "e".into()
            }
        );
        assert_eq!(NbdSpec::parse("NBD+UNIX:///?socket=/s").unwrap().export, "");
    }

    #[test]
    fn refuses_with_reasons() {
        let e = |s| NbdSpec::parse(s).unwrap_err();
        assert!(e("nbd+unix:///x").contains("needs ?socket=PATH"));
        assert!(e("nbd+unix://h/x?socket=/s").contains("takes no host"));
        assert!(e("nbds://h/x").contains("TLS"));
        assert!(e("nbd://h:0/x").contains("port \"0\""));
        assert!(e("nbd://h:99999/x").contains("1 to 65535"));
        assert!(e("nbd:///x").contains("needs a host"));
        assert!(e("nbd://h/x?sockt=1").contains("unknown query parameter \"sockt\""));
        assert!(e("nbd://h/%zz").contains("percent"));
        assert!(e("nbd:h").contains("expected nbd://"));
    }

    #[test]
    fn display_round_trips() {
        for s in [
            "nbd://h/x",
            "nbd://h:1234/a%20b",
            "nbd://[::1]/",
            "nbd+unix:///?socket=/tmp/a.sock",
            "nbd+unix:///e%3Fx?socket=/tmp/with%20space",
        ] {
            let spec = NbdSpec::parse(s).unwrap();
            assert_eq!(spec.to_string(), s);
            assert_eq!(NbdSpec::parse(&spec.to_string()).unwrap(), spec);
        }
        assert!(NbdSpec::looks_like_uri("nbd://x"));
        assert!(NbdSpec::looks_like_uri("NBD+unix:///"));
        assert!(NbdSpec::looks_like_uri("nbds://x"));
        assert!(!NbdSpec::looks_like_uri("nbd.img"));
        assert!(!NbdSpec::looks_like_uri("./nbd:x"));
    }
}
