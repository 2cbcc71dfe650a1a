//! A three-node MariaDB Galera cluster on loopback, made for one test and
//! torn down after it: `mariadbd` from Debian's `mariadb-server` with the
//! `galera-4` provider (`.ci/run` installs both, and `rsync` for the state
//! transfer, when missing).

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The Galera provider library from Debian's `galera-4`.
pub const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";

/// A running cluster; dropped, every node is killed and its files removed.
pub struct Cluster {
    dir: PathBuf,
    nodes: Vec<Node>,
}

struct Node {
    port: u16,
    gcomm: u16,
    ist: u16,
    sst: u16,
    child: Option<Child>,
}

/// A port nobody listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl Cluster {
    /// Bootstraps node 1, then joins the others one by one (each by a full
    /// state transfer from a synced node); returns once all are synced.
    pub fn start(size: usize) -> Self {
        assert!(
            Path::new(PROVIDER).exists(),
            "{PROVIDER} is missing: apt-get install galera-4 (.ci/run does)"
        );
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-galera-{}-{stamp}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        // mariadbd runs as `mysql`; the joiner's rsync writes as that user.
        chown_mysql(&dir);
        let nodes = (0..size)
            .map(|_| Node {
                port: free_port(),
                gcomm: free_port(),
                ist: free_port(),
                sst: free_port(),
                child: None,
            })
            .collect();
        let mut cluster = Self { dir, nodes };
        for i in 0..size {
            cluster.install(i);
            cluster.launch(i, i == 0);
            cluster.wait_synced(i, i + 1);
        }
        cluster
    }

    fn node_dir(&self, i: usize) -> PathBuf {
        self.dir.join(format!("n{i}"))
    }

    fn install(&self, i: usize) {
        let data = self.node_dir(i).join("data");
        std::fs::create_dir_all(&data).unwrap();
        chown_mysql(&self.node_dir(i));
        let out = Command::new("mariadb-install-db")
            .args([
                "--no-defaults",
                "--user=mysql",
                "--auth-root-authentication-method=normal",
            ])
            .arg(format!("--datadir={}", data.display()))
            .output()
            .expect("mariadb-install-db runs");
        assert!(
            out.status.success(),
            "mariadb-install-db: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn launch(&mut self, i: usize, bootstrap: bool) {
        let dir = self.node_dir(i);
        let peers: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.gcomm))
            .collect();
        let n = &self.nodes[i];
        let mut cmd = Command::new("/usr/sbin/mariadbd");
        cmd.arg("--no-defaults")
            .arg("--user=mysql")
            .arg(format!("--datadir={}", dir.join("data").display()))
            .arg(format!("--socket={}", dir.join("sock").display()))
            .arg(format!("--pid-file={}", dir.join("pid").display()))
            .arg(format!("--log-error={}", dir.join("error.log").display()))
            .arg(format!("--port={}", n.port))
            .args([
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--skip-log-bin",
                "--binlog-format=ROW",
                "--default-storage-engine=InnoDB",
                "--innodb-autoinc-lock-mode=2",
                "--innodb-buffer-pool-size=64M",
                "--innodb-log-file-size=32M",
                "--max-connections=200",
                "--wsrep-on=ON",
                "--wsrep-cluster-name=tower-idempotency",
                "--wsrep-sst-method=rsync",
            ])
            .arg(format!("--wsrep-provider={PROVIDER}"))
            .arg(format!("--wsrep-node-name=n{i}"))
            .arg(format!("--wsrep-cluster-address=gcomm://{}", peers.join(",")))
            .arg(format!("--wsrep-node-address=127.0.0.1:{}", n.gcomm))
            .arg(format!("--wsrep-sst-receive-address=127.0.0.1:{}", n.sst))
            .arg(format!(
                "--wsrep-provider-options=gmcast.listen_addr=tcp://127.0.0.1:{};ist.recv_addr=127.0.0.1:{};gcache.size=32M",
                n.gcomm, n.ist
            ))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if bootstrap {
            cmd.arg("--wsrep-new-cluster");
        }
        self.nodes[i].child = Some(cmd.spawn().expect("mariadbd starts"));
    }

    /// Waits until node `i` answers, is synced, and sees `size` members.
    fn wait_synced(&self, i: usize, size: usize) {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let state = self.query(
                i,
                "SELECT (SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
                 WHERE VARIABLE_NAME = 'WSREP_LOCAL_STATE_COMMENT'), \
                 (SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
                 WHERE VARIABLE_NAME = 'WSREP_CLUSTER_SIZE')",
            );
            if state.as_deref() == Some(&format!("Synced\t{size}")) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "galera node {i} not synced in 90 s (last: {state:?}); see {}",
                self.node_dir(i).join("error.log").display()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// One query through the `mariadb` client; its output, `None` on error.
    pub fn query(&self, i: usize, sql: &str) -> Option<String> {
        let out = Command::new("mariadb")
            .args(["-h", "127.0.0.1", "-u", "root", "-N", "-B"])
            .arg(format!("-P{}", self.nodes[i].port))
            .args(["-e", sql])
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// The `mysql://` URL of database `db` on node `i`.
    pub fn url(&self, i: usize, db: &str) -> String {
        format!("mysql://root@127.0.0.1:{}/{db}", self.nodes[i].port)
    }

    /// Creates database `db` (on every node, by replication).
    pub fn create_database(&self, db: &str) {
        self.query(0, &format!("CREATE DATABASE {db}"))
            .expect("CREATE DATABASE");
    }

    /// SIGKILLs node `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts node `i` again after [`kill`](Self::kill), and waits until
    /// it has rejoined the `size` members.
    pub fn restart(&mut self, i: usize, size: usize) {
        self.launch(i, false);
        self.wait_synced(i, size);
    }

    /// How many local transactions node `i` has had aborted by
    /// certification or by a replicated writer since it started.
    pub fn conflicts(&self, i: usize) -> i64 {
        let sql = "SELECT SUM(VARIABLE_VALUE) FROM information_schema.GLOBAL_STATUS \
                   WHERE VARIABLE_NAME IN ('WSREP_LOCAL_CERT_FAILURES', 'WSREP_LOCAL_BF_ABORTS')";
        self.query(i, sql)
            .and_then(|v| v.parse().ok())
            .unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn chown_mysql(path: &Path) {
    let ok = Command::new("chown")
        .arg("mysql:mysql")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "chown mysql {}", path.display());
}
