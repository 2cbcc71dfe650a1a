//! A TCP relay between the service and PostgreSQL that counts round trips
//! and can put the database at a distance.
//!
//! A round trip is a client-to-server burst that follows a server-to-client
//! burst (or opens the connection): what a request pays in latency when the
//! database is on another host. The delay is added once per burst in each
//! direction, as a network would. Plain threads and blocking sockets, so a
//! 250 µs delay is 250 µs, not a timer tick.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

/// A running relay; dropping it stops accepting (open connections end
/// with their peers).
#[derive(Debug)]
pub struct Relay {
    /// Where clients connect instead of the database.
    pub addr: SocketAddr,
    round_trips: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Relay {
    /// Relays to `upstream`, delaying each burst by `delay` each way.
    pub fn start(upstream: SocketAddr, delay: Duration) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let round_trips = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (rt, st) = (Arc::clone(&round_trips), Arc::clone(&stop));
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
                // 0: nothing yet, 1: client spoke last, 2: server spoke last.
                let last = Arc::new(AtomicU8::new(0));
                let pipe = |from: TcpStream, to: TcpStream, upstream_bound: bool| {
                    let (last, rt) = (Arc::clone(&last), Arc::clone(&rt));
                    std::thread::spawn(move || copy(from, to, upstream_bound, &last, &rt, delay));
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
            stop,
        }
    }

    /// Round trips counted so far.
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

fn copy(
    mut from: TcpStream,
    mut to: TcpStream,
    upstream_bound: bool,
    last: &AtomicU8,
    round_trips: &AtomicU64,
    delay: Duration,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let me = if upstream_bound { 1 } else { 2 };
        if last.swap(me, Ordering::Relaxed) != me && upstream_bound {
            round_trips.fetch_add(1, Ordering::Relaxed);
        }
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}
