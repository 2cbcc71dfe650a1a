//! A TCP relay between the service and PostgreSQL that counts round trips
//! and can put the database at a distance, or cut a connection in the
//! middle of a `COMMIT`'s answer.
//!
//! A round trip is a client-to-server burst that follows a server-to-client
//! burst (or opens the connection): what a request pays in latency when the
//! database is on another host. The delay is added once per burst in each
//! direction, as a network would. Plain threads and blocking sockets, so a
//! 250 µs delay is 250 µs, not a timer tick.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

/// Where [`Relay::cut_next_commit`] cuts the connection that sends the next
/// `COMMIT`, in the server's answer to it (PostgreSQL's wire protocol, on
/// an unencrypted connection: `sslmode=disable`). Whatever the server
/// sends before the cut reaches the client, nothing after it does, and
/// both directions are closed at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cut {
    /// Just before the server's acknowledgement of the `COMMIT`
    /// (`CommandComplete` `COMMIT`): the server has committed, the client
    /// never hears it, though it did receive the rows the statements before
    /// the `COMMIT` returned.
    BeforeCommitAck,
    /// Just after the first notice the server sends once the `COMMIT` is
    /// on its way (a `RAISE NOTICE` in a deferred trigger, which PostgreSQL
    /// flushes at once with everything before it): the `COMMIT` is still
    /// running when the client loses the connection.
    AfterNotice,
}

impl Cut {
    fn code(self) -> u8 {
        match self {
            Self::BeforeCommitAck => 1,
            Self::AfterNotice => 2,
        }
    }
}

/// A running relay; dropping it stops accepting (open connections end
/// with their peers).
#[derive(Debug)]
pub struct Relay {
    /// Where clients connect instead of the database.
    pub addr: SocketAddr,
    round_trips: Arc<AtomicU64>,
    /// The armed [`Cut`]'s code, 0 when none.
    armed: Arc<AtomicU8>,
    stop: Arc<AtomicBool>,
}

/// One relayed connection's shared state.
#[derive(Default)]
struct Link {
    /// 0: nothing yet, 1: client spoke last, 2: server spoke last.
    last: AtomicU8,
    /// The [`Cut`] this connection's `COMMIT` answer gets, 0 when none.
    cut: AtomicU8,
}

impl Relay {
    /// Relays to `upstream`, delaying each burst by `delay` each way.
    pub fn start(upstream: SocketAddr, delay: Duration) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let round_trips = Arc::new(AtomicU64::new(0));
        let armed = Arc::new(AtomicU8::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (rt, arm, st) = (
            Arc::clone(&round_trips),
            Arc::clone(&armed),
            Arc::clone(&stop),
        );
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if st.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let link = Arc::new(Link::default());
                let pipe = |from: TcpStream, to: TcpStream, upstream_bound: bool| {
                    let pipe = Pipe {
                        link: Arc::clone(&link),
                        round_trips: Arc::clone(&rt),
                        armed: Arc::clone(&arm),
                        upstream_bound,
                        delay,
                    };
                    std::thread::spawn(move || pipe.copy(from, to));
                };
                pipe(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    true,
                );
                pipe(server, client, false);
            }
        });
        Relay {
            addr,
            round_trips,
            armed,
            stop,
        }
    }

    /// Round trips counted so far.
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    /// Arms a [`Cut`] for the next connection that sends `COMMIT` (as a
    /// word, so `READ COMMITTED` is not one). One connection is cut; every
    /// other connection, before and after, is relayed as usual.
    pub fn cut_next_commit(&self, cut: Cut) {
        self.armed.store(cut.code(), Ordering::SeqCst);
    }

    /// Whether the armed cut is still waiting for its `COMMIT`.
    pub fn cut_pending(&self) -> bool {
        self.armed.load(Ordering::SeqCst) != 0
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

/// One direction of a relayed connection.
struct Pipe {
    link: Arc<Link>,
    round_trips: Arc<AtomicU64>,
    armed: Arc<AtomicU8>,
    upstream_bound: bool,
    delay: Duration,
}

impl Pipe {
    fn copy(self, mut from: TcpStream, mut to: TcpStream) {
        let mut buf = vec![0u8; 64 * 1024];
        // The server's bytes held back while a cut looks for its place:
        // only whole protocol messages are passed on.
        let mut held = Vec::new();
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let me = if self.upstream_bound { 1 } else { 2 };
            if self.link.last.swap(me, Ordering::Relaxed) != me && self.upstream_bound {
                self.round_trips.fetch_add(1, Ordering::Relaxed);
            }
            if self.upstream_bound
                && self.armed.load(Ordering::SeqCst) != 0
                && sends_commit(&buf[..n])
            {
                // Before the COMMIT leaves: its answer must find the cut.
                let cut = self.armed.swap(0, Ordering::SeqCst);
                self.link.cut.store(cut, Ordering::SeqCst);
            }
            if !self.delay.is_zero() {
                std::thread::sleep(self.delay);
            }
            let cut = self.link.cut.load(Ordering::SeqCst);
            if self.upstream_bound || cut == 0 {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
                continue;
            }
            held.extend_from_slice(&buf[..n]);
            let (pass, cut_here) = cut_point(&held, cut);
            if to.write_all(&held[..pass]).is_err() {
                break;
            }
            if cut_here {
                let _ = from.shutdown(Shutdown::Both);
                break;
            }
            held.drain(..pass);
        }
        let _ = to.shutdown(Shutdown::Both);
    }
}

/// Whether a client burst holds the word `COMMIT`.
fn sends_commit(bytes: &[u8]) -> bool {
    let word = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_');
    bytes.windows(6).enumerate().any(|(i, w)| {
        w.eq_ignore_ascii_case(b"COMMIT")
            && !word(i.checked_sub(1).and_then(|p| bytes.get(p)))
            && !word(bytes.get(i + 6))
    })
}

/// How many of the server's `held` bytes (whole messages from its start)
/// to pass on, and whether the connection is cut after them.
fn cut_point(held: &[u8], cut: u8) -> (usize, bool) {
    let mut at = 0;
    while let Some(header) = held.get(at..at + 5) {
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        let end = at + 1 + len;
        let Some(body) = held.get(at + 5..end) else {
            break;
        };
        match (cut, header[0]) {
            // CommandComplete with the tag COMMIT: cut before it.
            (1, b'C') if body.starts_with(b"COMMIT\0") => return (at, true),
            // NoticeResponse: cut after it.
            (2, b'N') => return (end, true),
            _ => at = end,
        }
    }
    (at, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![kind];
        m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    #[test]
    fn commit_is_found_as_a_word() {
        assert!(sends_commit(b"Q\0\0\0\x10RELEASE x; COMMIT; BEGIN\0"));
        assert!(!sends_commit(
            b"SET TRANSACTION ISOLATION LEVEL READ COMMITTED"
        ));
        assert!(!sends_commit(b"SELECT committed_at"));
    }

    #[test]
    fn cuts_fall_between_whole_messages() {
        let select = message(b'C', b"SELECT 1\0");
        let commit = message(b'C', b"COMMIT\0");
        let notice = message(b'N', b"Mhello\0\0");
        let all = [select.clone(), commit.clone(), notice.clone()].concat();
        assert_eq!(cut_point(&all, 1), (select.len(), true));
        assert_eq!(cut_point(&all, 2), (all.len(), true));
        // An unfinished message is held back.
        assert_eq!(
            cut_point(&all[..select.len() + 3], 1),
            (select.len(), false)
        );
    }
}
