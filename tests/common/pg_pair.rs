//! A PostgreSQL primary and a streaming standby on loopback, made for one
//! test (`initdb`, `pg_basebackup -R`) and removed after it, and a relay
//! that the test re-points from the primary to the promoted standby, as a
//! virtual IP or a re-pointed PgBouncer would.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Debian's PostgreSQL server binaries.
fn bin(name: &str) -> PathBuf {
    let versions = std::fs::read_dir("/usr/lib/postgresql").expect("PostgreSQL is installed");
    let mut found: Vec<PathBuf> = versions
        .filter_map(Result::ok)
        .map(|v| v.path().join("bin").join(name))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found
        .pop()
        .unwrap_or_else(|| panic!("no {name} under /usr/lib/postgresql"))
}

/// The `postgres` account's uid and gid (the server refuses to run as root).
fn postgres_ids() -> (u32, u32) {
    let id = |flag: &str| -> u32 {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    };
    (id("-u"), id("-g"))
}

fn as_postgres(cmd: &mut Command) -> &mut Command {
    let (uid, gid) = postgres_ids();
    cmd.uid(uid).gid(gid).current_dir("/tmp")
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap()
}

/// How the primary waits for its standby at commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_standby_names = '*'`, `synchronous_commit = on`: a
    /// commit is acknowledged once the standby has flushed it.
    Synchronous,
    /// The default: the standby follows as fast as it can.
    Asynchronous,
}

/// A primary (node 0) and its standby (node 1), which streams through a
/// link the test can [`partition`](Pair::partition).
pub struct Pair {
    dir: PathBuf,
    ports: [u16; 2],
    servers: [Option<Child>; 2],
    link: Link,
}

impl Pair {
    /// `initdb` the primary, start it, create database `test`, take a base
    /// backup into the standby's directory and start it streaming.
    pub fn start(replication: Replication) -> Self {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-pg-pair-{}-{stamp}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let (uid, gid) = postgres_ids();
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
        let ports = [free_port(), free_port()];
        let mut pair = Self {
            dir,
            ports,
            servers: [None, None],
            link: Link::start(SocketAddr::from(([127, 0, 0, 1], ports[0]))),
        };
        let out = as_postgres(&mut Command::new(bin("initdb")))
            .args(["--auth=trust", "--username=postgres", "--no-sync"])
            .arg("-D")
            .arg(pair.data(0))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        pair.launch(0);
        pair.psql(0, "CREATE DATABASE test");
        let out = as_postgres(&mut Command::new(bin("pg_basebackup")))
            .args([
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-R",
                "-X",
                "stream",
                "--no-sync",
                "--checkpoint=fast",
            ])
            .arg(format!("-p{}", pair.link.addr.port()))
            .arg("-D")
            .arg(pair.data(1))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pg_basebackup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        pair.launch(1);
        if replication == Replication::Synchronous {
            // Only now: before a standby streams, every commit would wait.
            pair.psql(0, "ALTER SYSTEM SET synchronous_standby_names = '*'")
                .expect("synchronous_standby_names");
            pair.psql(0, "SELECT pg_reload_conf()").expect("reload");
        }
        // Streaming (and, when synchronous, counted as the sync standby).
        let want = match replication {
            Replication::Synchronous => "sync",
            Replication::Asynchronous => "async",
        };
        pair.wait_for(0, "SELECT sync_state FROM pg_stat_replication", want);
        pair
    }

    fn data(&self, i: usize) -> PathBuf {
        self.dir.join(format!("n{i}"))
    }

    fn launch(&mut self, i: usize) {
        let log = std::fs::File::create(self.dir.join(format!("n{i}.log"))).unwrap();
        let child = as_postgres(&mut Command::new(bin("postgres")))
            .arg("-D")
            .arg(self.data(i))
            .arg("-p")
            .arg(self.ports[i].to_string())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "shared_buffers=32MB",
                "-c",
                "max_connections=100",
                "-c",
                "wal_level=replica",
                "-c",
                "max_wal_senders=4",
                "-c",
                "hot_standby=on",
            ])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", self.dir.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("postgres starts");
        self.servers[i] = Some(child);
        self.wait_for(i, "SELECT 1", "1");
    }

    /// Runs `sql` on node `i` with psql; its output.
    pub fn psql(&self, i: usize, sql: &str) -> Option<String> {
        let out = Command::new(bin("psql"))
            .args([
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-XAtq",
            ])
            .arg(format!("-p{}", self.ports[i]))
            .args(["-c", sql])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    fn wait_for(&self, i: usize, sql: &str, want: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let got = self.psql(i, sql);
            if got.as_deref() == Some(want) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {i}: {sql} gave {got:?}, not {want:?}, in 60 s (see {})",
                self.dir.join(format!("n{i}.log")).display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The address of node `i`.
    pub fn addr(&self, i: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.ports[i]))
    }

    /// The URL of database `test` on node `i`.
    pub fn url(&self, i: usize) -> String {
        format!("postgres://postgres@127.0.0.1:{}/test", self.ports[i])
    }

    /// SIGKILLs the primary's postmaster and every process it started, as
    /// a machine that dies would leave them: nothing is flushed or sent.
    pub fn kill_primary(&mut self) {
        let Some(mut postmaster) = self.servers[0].take() else {
            return;
        };
        let pid = postmaster.id();
        let children = children_of(pid);
        let _ = postmaster.kill();
        for child in children {
            let _ = Command::new("kill")
                .args(["-KILL", &child.to_string()])
                .status();
        }
        let _ = postmaster.wait();
    }

    /// Waits until the standby has replayed everything the primary wrote
    /// so far (a schema the service created at start, say).
    pub fn wait_caught_up(&self) {
        let lsn = self
            .psql(0, "SELECT pg_current_wal_lsn()")
            .expect("the primary's WAL position");
        let sql = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn");
        self.wait_for(1, &sql, "t");
    }

    /// Cuts the standby off the primary: what the primary commits from
    /// now on never reaches it (with synchronous replication, commits
    /// wait).
    pub fn partition(&self) {
        self.link.cut();
    }

    /// Promotes the standby and waits until it takes writes.
    pub fn promote_standby(&self) {
        self.psql(1, "SELECT pg_promote(true, 60)")
            .expect("pg_promote");
        self.wait_for(1, "SELECT pg_is_in_recovery()", "f");
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for server in self.servers.iter_mut().flatten() {
            let pid = server.id();
            let children = children_of(pid);
            let _ = server.kill();
            for child in children {
                let _ = Command::new("kill")
                    .args(["-KILL", &child.to_string()])
                    .status();
            }
            let _ = server.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The pids whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(Path::new("/proc").join(child.to_string()).join("stat"))
                .ok()
                .and_then(|stat| {
                    // pid (comm) state ppid …: comm may hold spaces.
                    let after = &stat[stat.rfind(')')? + 1..];
                    after.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// The standby's replication connection to the primary: a relay of plain
/// threads that [`cut`](Link::cut) closes for good.
struct Link {
    addr: SocketAddr,
    cut: Arc<std::sync::atomic::AtomicBool>,
    open: Arc<Mutex<Vec<std::net::TcpStream>>>,
}

impl Link {
    fn start(upstream: SocketAddr) -> Self {
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open = Arc::new(Mutex::new(Vec::new()));
        let (is_cut, streams) = (Arc::clone(&cut), Arc::clone(&open));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                if is_cut.load(Ordering::SeqCst) {
                    continue;
                }
                let Ok(server) = std::net::TcpStream::connect(upstream) else {
                    continue;
                };
                let mut list = streams.lock().unwrap();
                list.push(client.try_clone().unwrap());
                list.push(server.try_clone().unwrap());
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Self { addr, cut, open }
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        for stream in self.open.lock().unwrap().drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A TCP relay whose upstream can be changed: connections made after
/// [`repoint`](Self::repoint) go to the new address, and every connection
/// to the old one is cut.
pub struct Relay {
    pub addr: SocketAddr,
    upstream: Arc<Mutex<SocketAddr>>,
    epoch: tokio::sync::watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let upstream = Arc::new(Mutex::new(upstream));
        let (epoch, _) = tokio::sync::watch::channel(0u64);
        let (to, tx) = (Arc::clone(&upstream), epoch.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let target = *to.lock().unwrap();
                let mut cut = tx.subscribe();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Self {
            addr,
            upstream,
            epoch,
            task,
        }
    }

    /// Sends new connections to `upstream` and cuts the open ones.
    pub fn repoint(&self, upstream: SocketAddr) {
        *self.upstream.lock().unwrap() = upstream;
        self.epoch.send_modify(|e| *e += 1);
    }

    /// The URL of database `test` through the relay.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/test?sslmode=disable",
            self.addr.port()
        )
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}
