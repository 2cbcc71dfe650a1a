//! A TCP relay between a service and PostgreSQL that can hold back the
//! server's answer to one `COMMIT` (its `CommandComplete` `COMMIT`, on an
//! unencrypted connection: `sslmode=disable`) for as long as the test
//! likes, and then close that connection: a `COMMIT` that landed and whose
//! answer was lost late, as a partition without a reset loses it. Every
//! other connection, before and after, is relayed as usual.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A running relay; dropped, it stops accepting.
pub struct CommitHold {
    pub addr: SocketAddr,
    armed: Arc<AtomicBool>,
    holding: Arc<AtomicBool>,
    release: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl CommitHold {
    /// Relays to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let armed = Arc::new(AtomicBool::new(false));
        let holding = Arc::new(AtomicBool::new(false));
        let (release, _) = tokio::sync::watch::channel(false);
        let (arm, hold, rel) = (Arc::clone(&armed), Arc::clone(&holding), release.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (arm, hold, rel) = (Arc::clone(&arm), Arc::clone(&hold), rel.subscribe());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        pipe(client, server, arm, hold, rel).await;
                    }
                });
            }
        });
        Self {
            addr,
            armed,
            holding,
            release,
            task,
        }
    }

    /// The next answer to a `COMMIT` is held back.
    pub fn hold_next_commit(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Whether an answer to a `COMMIT` is held back now.
    pub fn holding(&self) -> bool {
        self.holding.load(Ordering::SeqCst)
    }

    /// Closes the held connection (both ways); its answer is never sent.
    pub fn release(&self) {
        self.release.send_replace(true);
    }

    /// `database` through the relay.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}?sslmode=disable",
            self.addr.port()
        )
    }
}

impl Drop for CommitHold {
    fn drop(&mut self) {
        self.task.abort();
        self.release.send_replace(true);
    }
}

async fn pipe(
    mut client: TcpStream,
    mut server: TcpStream,
    armed: Arc<AtomicBool>,
    holding: Arc<AtomicBool>,
    mut release: tokio::sync::watch::Receiver<bool>,
) {
    let (mut cr, mut cw) = client.split();
    let (mut sr, mut sw) = server.split();
    let (mut up, mut down) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    loop {
        tokio::select! {
            n = cr.read(&mut up) => {
                let Ok(n @ 1..) = n else { return };
                if sw.write_all(&up[..n]).await.is_err() {
                    return;
                }
            }
            n = sr.read(&mut down) => {
                let Ok(n @ 1..) = n else { return };
                let chunk = &down[..n];
                if chunk.windows(7).any(|w| w == b"COMMIT\0")
                    && armed.swap(false, Ordering::SeqCst)
                {
                    holding.store(true, Ordering::SeqCst);
                    // Nothing more either way until released; then both
                    // sockets close as this returns.
                    let _ = release.wait_for(|r| *r).await;
                    holding.store(false, Ordering::SeqCst);
                    return;
                }
                if cw.write_all(chunk).await.is_err() {
                    return;
                }
            }
        }
    }
}
