//! A three-node Patroni cluster (one etcd, three agents, HAProxy) made for
//! one test by `tests/patroni/cluster.py`, and the faults a test inflicts
//! on it: SIGKILL of a node's PostgreSQL or of its agent, a switchover, a
//! node cut off from etcd. Dropped, every process the script started is
//! stopped and its directory removed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How the leader waits for its replicas at commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_mode: true`: Patroni keeps one replica synchronous and
    /// only ever promotes that one.
    Synchronous,
    /// Asynchronous replicas, promoted when within
    /// `maximum_lag_on_failover` (1 MiB here).
    Asynchronous,
}

/// A member as Patroni's `/cluster` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    /// `leader`, `sync_standby` or `replica`.
    pub role: String,
    pub state: String,
    pub timeline: i64,
}

/// A running cluster.
pub struct Cluster {
    dir: PathBuf,
    state: Value,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/patroni/cluster.py")
}

/// Runs the script with `args`; its stdout, or a panic with its stderr.
fn run(args: &[&str]) -> String {
    let out = Command::new("/usr/bin/python3")
        .arg(script())
        .args(args)
        .output()
        .expect("/usr/bin/python3 runs tests/patroni/cluster.py");
    assert!(
        out.status.success(),
        "cluster.py {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Cluster {
    /// Starts the cluster (within 120 s, or a panic saying what was
    /// missing) with database `test` on the leader.
    pub fn start(replication: Replication) -> Self {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-patroni-{}-{stamp}",
            std::process::id()
        ));
        let mode = match replication {
            Replication::Synchronous => "sync",
            Replication::Asynchronous => "async",
        };
        let path = dir.to_string_lossy().into_owned();
        let out = run(&["start", &path, "--mode", mode, "--timeout", "120"]);
        let state = serde_json::from_str(out.trim()).expect("cluster.py prints the cluster");
        Self { dir, state }
    }

    fn port(&self, name: &str) -> u64 {
        self.state[name].as_u64().expect("a port")
    }

    fn node(&self, name: &str) -> &Value {
        let i: usize = name[1..].parse().expect("a node name n0, n1, n2");
        &self.state["nodes"][i]
    }

    /// Database `test` through HAProxy's write port (the leader).
    pub fn write_url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/test?sslmode=disable",
            self.port("write")
        )
    }

    /// HAProxy's write port.
    pub fn write_addr(&self) -> std::net::SocketAddr {
        let port = u16::try_from(self.port("write")).expect("a port");
        std::net::SocketAddr::from(([127, 0, 0, 1], port))
    }

    /// Database `test` on node `name` directly.
    pub fn url(&self, name: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/test?sslmode=disable",
            self.node(name)["pg"]
        )
    }

    /// The members as the first agent that answers sees them (empty when
    /// none answers).
    pub fn members(&self) -> Vec<Member> {
        let out = run(&["status", &self.dir.to_string_lossy()]);
        let Ok(Value::Array(members)) = serde_json::from_str::<Value>(out.trim()) else {
            return Vec::new();
        };
        members
            .iter()
            .map(|m| Member {
                name: m["name"].as_str().unwrap_or_default().to_string(),
                role: m["role"].as_str().unwrap_or_default().to_string(),
                state: m["state"].as_str().unwrap_or_default().to_string(),
                timeline: m["timeline"].as_i64().unwrap_or_default(),
            })
            .collect()
    }

    /// The running leader, if there is one.
    pub fn leader(&self) -> Option<Member> {
        self.members()
            .into_iter()
            .find(|m| m.role == "leader" && m.state == "running")
    }

    /// Waits (at most `within`) until a leader runs, every node is back
    /// and streaming, and (synchronous) one replica is the synchronous
    /// standby; the leader.
    pub fn wait_whole(&self, within: Duration) -> Member {
        let deadline = Instant::now() + within;
        loop {
            let members = self.members();
            let leader = members
                .iter()
                .find(|m| m.role == "leader" && m.state == "running");
            let replicas = members
                .iter()
                .filter(|m| m.role != "leader" && m.state == "running")
                .count();
            let sync_ok =
                self.state["mode"] != "sync" || members.iter().any(|m| m.role == "sync_standby");
            if let Some(leader) = leader
                && replicas == 2
                && sync_ok
                && self.leader_streams_to(leader, 2)
            {
                return leader.clone();
            }
            assert!(
                Instant::now() < deadline,
                "the cluster is not whole again within {within:?}: {members:?} (logs in {})",
                self.dir.display()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    fn leader_streams_to(&self, leader: &Member, n: usize) -> bool {
        self.psql(
            &leader.name,
            "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'",
        )
        .as_deref()
            == Some(&n.to_string())
    }

    /// Waits (at most `within`) until a running leader other than `old`
    /// holds the key; the new leader.
    pub fn wait_new_leader(&self, old: &str, within: Duration) -> Member {
        let deadline = Instant::now() + within;
        loop {
            if let Some(leader) = self.leader()
                && leader.name != old
            {
                return leader;
            }
            assert!(
                Instant::now() < deadline,
                "no leader other than {old} within {within:?}: {:?} (logs in {})",
                self.members(),
                self.dir.display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Waits (at most `within`) until node `name` takes transactions:
    /// Patroni names a leader before its promotion ends.
    pub fn wait_promoted(&self, name: &str, within: Duration) {
        let port = self.node(name)["pg"].as_u64().expect("a port");
        self.wait_out_of_recovery(port, within, &format!("{name} did not leave recovery"));
    }

    /// Runs `sql` in database `test` of node `name` with psql; its
    /// output, `None` on an error.
    pub fn psql(&self, name: &str, sql: &str) -> Option<String> {
        self.query(name, sql).ok()
    }

    /// Runs `sql` in database `test` of node `name` with psql; its output,
    /// or the error psql printed.
    pub fn query(&self, name: &str, sql: &str) -> Result<String, String> {
        let port = self.node(name)["pg"].as_u64().expect("a port");
        self.query_port(port, sql)
    }

    /// Waits (at most `within`) until HAProxy's write port reaches a
    /// server that takes writes.
    pub fn wait_writable(&self, within: Duration) {
        let port = self.port("write");
        self.wait_out_of_recovery(port, within, "the write port reaches no leader");
    }

    /// Waits (at most `within`, else panics with `failure`) until the
    /// server at `port` is out of recovery.
    fn wait_out_of_recovery(&self, port: u64, within: Duration, failure: &str) {
        let deadline = Instant::now() + within;
        let sql = "SELECT NOT pg_is_in_recovery()";
        while self.query_port(port, sql).as_deref() != Ok("t") {
            assert!(Instant::now() < deadline, "{failure} within {within:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn query_port(&self, port: u64, sql: &str) -> Result<String, String> {
        let bin = Path::new(self.state["bin_dir"].as_str().expect("bin_dir")).join("psql");
        let out = Command::new(bin)
            .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "test", "-XAtq"])
            .arg(format!("-p{port}"))
            .args(["-c", sql])
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
        }
    }

    /// Waits (at most 60 s) until every other node has replayed what the
    /// leader `name` wrote so far.
    pub fn wait_caught_up(&self, name: &str) {
        let lsn = self
            .psql(name, "SELECT pg_current_wal_lsn()")
            .expect("the leader's WAL position");
        let sql = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn");
        let deadline = Instant::now() + Duration::from_secs(60);
        for other in ["n0", "n1", "n2"].into_iter().filter(|n| *n != name) {
            while self.psql(other, &sql).as_deref() != Some("t") {
                assert!(
                    Instant::now() < deadline,
                    "{other} has not replayed {lsn} within 60 s"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// SIGKILLs node `name`'s PostgreSQL (the postmaster and its process
    /// group), as a crashed server: its agent lives on.
    pub fn kill_postgres(&self, name: &str) {
        let pidfile = self.dir.join(name).join("data").join("postmaster.pid");
        let pid: i32 = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.lines().next()?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no postmaster.pid in {}", pidfile.display()));
        // Stopped first, so it starts no process while its children die.
        signal("-STOP", pid);
        let _ = Command::new("pkill")
            .args(["-KILL", "-P", &pid.to_string()])
            .status();
        signal("-KILL", pid);
    }

    /// SIGKILLs node `name`'s Patroni agent: its PostgreSQL runs on,
    /// unmanaged, until the agent is [started again](Self::start_agent).
    pub fn kill_agent(&self, name: &str) {
        signal("-KILL", self.agent_pid(name));
    }

    fn agent_pid(&self, name: &str) -> i32 {
        let state: Value = std::fs::read(self.dir.join("cluster.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .expect("cluster.json");
        state["pids"][format!("patroni_{name}")]
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .expect("the agent's pid")
    }

    /// Starts node `name`'s agent again after [`kill_agent`](Self::kill_agent).
    pub fn start_agent(&self, name: &str) {
        run(&["agent", &self.dir.to_string_lossy(), name]);
    }

    /// `patronictl switchover` from the leader `from` to `to`, at once.
    pub fn switchover(&self, from: &str, to: &str) {
        let config = self.node(from)["config"].as_str().expect("config");
        let out = Command::new("/usr/bin/patronictl")
            .args(["-c", config, "switchover", "--leader", from])
            .args(["--candidate", to, "--force"])
            .output()
            .expect("patronictl runs");
        assert!(
            out.status.success(),
            "patronictl switchover: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Cuts node `name`'s agent off etcd (its HAProxy port to etcd is
    /// disabled and its sessions shut): it can no longer renew a key.
    pub fn cut(&self, name: &str) {
        run(&["cut", &self.dir.to_string_lossy(), name, "etcd"]);
    }

    /// Gives node `name`'s agent its way to etcd back.
    pub fn heal(&self, name: &str) {
        run(&["heal", &self.dir.to_string_lossy(), name, "etcd"]);
    }

    /// Cuts node `name` off the other members (its `connect_address`, which
    /// they stream from): what it commits from now on reaches no replica,
    /// while clients still reach it through the write port.
    pub fn cut_replication(&self, name: &str) {
        run(&["cut", &self.dir.to_string_lossy(), name, "replication"]);
    }

    /// Lets the other members reach node `name` again.
    pub fn heal_replication(&self, name: &str) {
        run(&["heal", &self.dir.to_string_lossy(), name, "replication"]);
    }

    /// The directory with every log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn signal(signal: &str, pid: i32) {
    let _ = Command::new("kill")
        .args([signal, "--", &pid.to_string()])
        .status();
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("/usr/bin/python3")
            .arg(script())
            .args(["stop", &self.dir.to_string_lossy()])
            .output();
        if std::thread::panicking() {
            eprintln!("patroni cluster logs kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
