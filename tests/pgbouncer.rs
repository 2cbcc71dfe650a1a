//! The conformance suite through Debian's PgBouncer in transaction pooling
//! mode, the way large PostgreSQL deployments share a database among many
//! application instances. The test starts its own PgBouncer on a free port
//! (`.ci/run` installs the package), pointed at `PG_URL`'s server, and
//! stops it when the test process ends.
//!
//! What the application's pool needs there: before PgBouncer 1.21 (Debian
//! 12 ships 1.18), no named prepared statements, so the pool's statement
//! cache is off (`PgConnectOptions::statement_cache_capacity(0)`, or
//! `?statement-cache-capacity=0` in the URL, as here). The ledger's
//! prepared statements outside a claimed transaction then run in a
//! transaction of their own, so each statement's parse and execution stay
//! on one server connection. PgBouncer 1.21 and later track prepared
//! statements with `max_prepared_statements`, and the cache can stay on.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// Starts PgBouncer once per process and routes the cases through it.
fn pgbouncer() {
    static URL: OnceLock<String> = OnceLock::new();
    let url = URL.get_or_init(start);
    tower_idempotency::testkit::use_postgres_url(url.clone());
}

fn start() -> String {
    assert!(
        std::path::Path::new(PGBOUNCER).exists(),
        "{PGBOUNCER} is missing: apt-get install pgbouncer (.ci/run does)"
    );
    let upstream = tower_idempotency::testkit::pg_admin_url();
    // postgres://user@host:port/db
    let (scheme_user, rest) = upstream.split_once('@').expect("PG_URL has a user");
    let (hostport, db) = rest.split_once('/').expect("PG_URL has a database");
    let user = scheme_user.rsplit('/').next().unwrap_or("postgres");
    let user = user.split(':').next().unwrap_or(user);
    let (host, port) = hostport.split_once(':').unwrap_or((hostport, "5432"));
    let listen = {
        let probe = TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let dir = std::env::temp_dir().join(format!("ti_pgbouncer_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let users = dir.join("users.txt");
    std::fs::write(&users, format!("\"{user}\" \"\"\n")).unwrap();
    let ini = dir.join("pgbouncer.ini");
    std::fs::write(
        &ini,
        format!(
            "[databases]\n* = host={host} port={port}\n\
             [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {listen}\n\
             auth_type = trust\nauth_file = {}\npool_mode = transaction\n\
             max_client_conn = 2000\ndefault_pool_size = 20\n\
             ignore_startup_parameters = extra_float_digits,options\n\
             unix_socket_dir =\nlogfile = {}\npidfile = {}\n",
            users.display(),
            dir.join("pgbouncer.log").display(),
            dir.join("pgbouncer.pid").display(),
        ),
    )
    .unwrap();
    // PgBouncer refuses to run as root; it switches to `postgres` itself.
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0"));
    if root {
        let _ = Command::new("chmod")
            .arg("-R")
            .arg("a+rwX")
            .arg(&dir)
            .status();
    }
    let run_as = if root { "-u postgres" } else { "" };
    // A watchdog shell stops PgBouncer when this test process is gone.
    let script = format!(
        "{PGBOUNCER} {run_as} {ini} & p=$!; \
         while kill -0 {me} 2>/dev/null && kill -0 $p 2>/dev/null; do sleep 1; done; kill $p 2>/dev/null",
        ini = ini.display(),
        me = std::process::id(),
    );
    let mut watchdog = Command::new("sh")
        .args(["-c", &script])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::spawn(move || watchdog.wait());
    let addr: SocketAddr = ([127, 0, 0, 1], listen).into();
    let started = Instant::now();
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "PgBouncer did not start; see {}",
            dir.join("pgbouncer.log").display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    format!("postgres://{user}@127.0.0.1:{listen}/{db}?statement-cache-capacity=0")
}

tower_idempotency::conformance_suite!(through_pgbouncer, sqlx::Postgres, setup = crate::pgbouncer);
