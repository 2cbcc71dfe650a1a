#!/usr/bin/python3
"""A three-node PostgreSQL cluster run by Patroni on one machine.

One etcd (the DCS), three Patroni agents each with its own PostgreSQL data
directory and ports, and one HAProxy with a write port (the node whose
Patroni REST API answers 200 to /primary), a read port (/replica), and
one etcd port per agent, through which that agent alone reaches etcd (so
one agent can be cut off from the DCS: `cut DIR NODE etcd`), and one
PostgreSQL port per node that is the node's `connect_address`, through
which replicas stream from it and pg_rewind reads it (so a leader can be
cut off from its replicas while clients still reach it:
`cut DIR NODE replication`). Debian packages: patroni,
etcd-server, haproxy, postgresql (.ci/run installs the first three).

    tests/patroni/cluster.py start DIR [--mode sync|async] [--timeout S]
    tests/patroni/cluster.py status DIR
    tests/patroni/cluster.py cut DIR NODE [etcd|replication]
    tests/patroni/cluster.py heal DIR NODE [etcd|replication]
    tests/patroni/cluster.py agent DIR NODE    # start NODE's agent again
    tests/patroni/cluster.py stop DIR
    tests/patroni/cluster.py run DIR [--mode …]  # start, wait for Ctrl-C, stop

`start` makes DIR (it must be absent or empty), starts everything on free
loopback ports, creates database `test`, and returns once one leader and
two streaming replicas are up (in sync mode, one of them the synchronous
standby) and the write port reaches the leader: within --timeout seconds
(default 120), or it stops what it started, prints what was missing and
the end of the log that says why, and exits 1. It prints the cluster as
JSON (also in DIR/cluster.json): ports, the process ids, and the Patroni
configuration file of each node (`patronictl -c DIR/n0/patroni.yml list`).
`stop` ends every process `start` made (agents first, then each
PostgreSQL, HAProxy and etcd; SIGKILL after a grace period); it leaves
DIR for its logs. Run as root, the agents and servers run as `postgres`.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

NODES = 3
SCOPE = "tower-idempotency"


def die(msg):
    print(f"cluster.py: {msg}", file=sys.stderr)
    sys.exit(1)


def pg_bin():
    """The newest PostgreSQL under /usr/lib/postgresql (Debian)."""
    root = "/usr/lib/postgresql"
    try:
        versions = sorted(os.listdir(root), key=lambda v: int(v) if v.isdigit() else 0)
    except FileNotFoundError:
        die("PostgreSQL is not installed (no /usr/lib/postgresql)")
    for v in reversed(versions):
        b = os.path.join(root, v, "bin")
        if os.path.exists(os.path.join(b, "postgres")):
            return b
    die("no postgres binary under /usr/lib/postgresql/*/bin")


def need(path, package):
    if not shutil.which(path) and not os.path.exists(path):
        die(f"{path} is missing: apt-get install {package}")


def free_ports(n):
    """n distinct loopback ports nobody listens on now."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def as_postgres():
    """Process credentials for the agents and servers (root cannot run them)."""
    if os.geteuid() != 0:
        return {}
    return {"user": "postgres", "group": "postgres", "extra_groups": []}


def chown_postgres(path):
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


def spawn(argv, log, **kw):
    """Starts argv in its own session (its process group is its pid)."""
    out = open(log, "ab")
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        start_new_session=True, close_fds=True, **kw
    ).pid


def http_json(url, timeout=2):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read().decode())
    except Exception:
        return None


def tail(path, lines=25):
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return "(no log)"


def node_yaml(state, i, sync):
    d = state["dir"]
    n = state["nodes"][i]
    nd = os.path.join(d, f"n{i}")
    # JSON is YAML: no dependency on a YAML writer.
    conf = {
        "scope": SCOPE,
        "namespace": f"/{state['namespace']}/",
        "name": f"n{i}",
        "restapi": {"listen": f"127.0.0.1:{n['rest']}", "connect_address": f"127.0.0.1:{n['rest']}"},
        "etcd3": {"hosts": [f"127.0.0.1:{n['etcd']}"], "use_proxies": True},
        "bootstrap": {
            "dcs": {
                "ttl": 10,
                "loop_wait": 1,
                "retry_timeout": 3,
                "maximum_lag_on_failover": 1048576,
                "primary_start_timeout": 0,
                "synchronous_mode": sync,
                "postgresql": {
                    "use_pg_rewind": True,
                    "use_slots": True,
                    "parameters": {
                        "wal_level": "replica",
                        "hot_standby": "on",
                        "max_wal_senders": 8,
                        "max_replication_slots": 8,
                        "wal_keep_size": "128MB",
                        "max_connections": 100,
                    },
                },
            },
            "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
        },
        "postgresql": {
            "listen": f"127.0.0.1:{n['pg']}",
            # What the other members connect to (streaming, pg_rewind).
            "connect_address": f"127.0.0.1:{n['peer']}",
            "data_dir": os.path.join(nd, "data"),
            "bin_dir": state["bin_dir"],
            "pgpass": os.path.join(nd, "pgpass"),
            # A replica's base backup starts at once (not after a spread
            # checkpoint, which takes minutes on an idle server).
            "basebackup": [{"checkpoint": "fast"}],
            "authentication": {
                "superuser": {"username": "postgres", "password": "postgres"},
                "replication": {"username": "replicator", "password": "replicator"},
            },
            "parameters": {
                "unix_socket_directories": nd,
                "shared_buffers": "32MB",
                # Only processes are killed here, never the machine: what a
                # killed server wrote is in the page cache.
                "fsync": "off",
            },
            "pg_hba": [
                "local all all trust",
                "host all all 127.0.0.1/32 trust",
                "host replication all 127.0.0.1/32 trust",
            ],
        },
        "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
    }
    path = os.path.join(nd, "patroni.yml")
    with open(path, "w") as f:
        json.dump(conf, f, indent=2)
    chown_postgres(path)
    return path


def haproxy_cfg(state):
    lines = [
        "global",
        "  maxconn 1000",
        f"  stats socket ipv4@127.0.0.1:{state['haproxy_admin']} level admin",
        "defaults",
        "  mode tcp",
        "  timeout connect 2s",
        "  timeout queue 1s",
        # Pooled connections sit idle between requests.
        "  timeout client 30m",
        "  timeout server 30m",
        "  timeout check 1s",
    ]
    for name, check in (("write", "/primary"), ("read", "/replica")):
        lines += [
            f"listen {name}",
            f"  bind 127.0.0.1:{state[name]}",
            f"  option httpchk GET {check}",
            "  http-check expect status 200",
            "  default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions",
        ]
        for i, n in enumerate(state["nodes"]):
            lines.append(f"  server n{i} 127.0.0.1:{n['pg']} maxconn 100 check port {n['rest']}")
    for i, n in enumerate(state["nodes"]):
        lines += [
            f"listen peer_n{i}",
            f"  bind 127.0.0.1:{n['peer']}",
            f"  server pg 127.0.0.1:{n['pg']}",
            f"listen etcd_n{i}",
            f"  bind 127.0.0.1:{n['etcd']}",
            f"  server etcd 127.0.0.1:{state['etcd_client']}",
        ]
    path = os.path.join(state["dir"], "haproxy.cfg")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def save(state):
    with open(os.path.join(state["dir"], "cluster.json"), "w") as f:
        json.dump(state, f, indent=2)


def load(d):
    try:
        with open(os.path.join(d, "cluster.json")) as f:
            return json.load(f)
    except OSError:
        die(f"{d} holds no cluster (no cluster.json)")


def members(state):
    """The cluster as the first agent that answers sees it."""
    for n in state["nodes"]:
        got = http_json(f"http://127.0.0.1:{n['rest']}/cluster")
        if got and "members" in got:
            return got["members"]
    return None


def psql(state, port, sql, db="postgres"):
    r = subprocess.run(
        [os.path.join(state["bin_dir"], "psql"), "-h", "127.0.0.1", "-p", str(port),
         "-U", "postgres", "-d", db, "-XAtq", "-c", sql],
        capture_output=True, text=True, timeout=10,
    )
    return r.stdout.strip() if r.returncode == 0 else None


def wait(what, deadline, check, log):
    while True:
        try:
            if check():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in time; the end of {log}:\n{tail(log)}")
        time.sleep(0.3)


def start(d, sync, timeout):
    need("/usr/bin/patroni", "patroni")
    need("/usr/bin/etcd", "etcd-server")
    need("/usr/sbin/haproxy", "haproxy")
    if os.path.exists(d) and os.listdir(d):
        die(f"{d} is not empty")
    os.makedirs(d, exist_ok=True)
    d = os.path.abspath(d)
    os.chmod(d, 0o755)
    ports = free_ports(5 + 4 * NODES)
    state = {
        "dir": d,
        "mode": "sync" if sync else "async",
        "namespace": f"ti-{os.getpid()}-{int(time.time())}",
        "bin_dir": pg_bin(),
        "etcd_client": ports[0],
        "etcd_peer": ports[1],
        "write": ports[2],
        "read": ports[3],
        "haproxy_admin": ports[4],
        "nodes": [],
        "pids": {},
    }
    for i in range(NODES):
        p = ports[5 + 4 * i: 9 + 4 * i]
        state["nodes"].append({"pg": p[0], "rest": p[1], "etcd": p[2], "peer": p[3],
                               "config": os.path.join(d, f"n{i}", "patroni.yml")})
    deadline = time.monotonic() + timeout
    try:
        etcd_log = os.path.join(d, "etcd.log")
        state["pids"]["etcd"] = spawn([
            "/usr/bin/etcd", "--name", "e0", "--data-dir", os.path.join(d, "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{state['etcd_client']}",
            "--advertise-client-urls", f"http://127.0.0.1:{state['etcd_client']}",
            "--listen-peer-urls", f"http://127.0.0.1:{state['etcd_peer']}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{state['etcd_peer']}",
            "--initial-cluster", f"e0=http://127.0.0.1:{state['etcd_peer']}",
            "--listen-metrics-urls", "",
        ], etcd_log)
        save(state)
        wait("etcd answering", deadline,
             lambda: (http_json(f"http://127.0.0.1:{state['etcd_client']}/health") or {}).get("health") == "true",
             etcd_log)
        ha_log = os.path.join(d, "haproxy.log")
        state["pids"]["haproxy"] = spawn(["/usr/sbin/haproxy", "-db", "-f", haproxy_cfg(state)], ha_log)
        save(state)
        for i in range(NODES):
            nd = os.path.join(d, f"n{i}")
            os.makedirs(nd)
            os.chmod(nd, 0o700)
            chown_postgres(nd)
            conf = node_yaml(state, i, sync)
            log = os.path.join(nd, "patroni.log")
            state["pids"][f"patroni_n{i}"] = spawn(["/usr/bin/patroni", conf], log, cwd=nd, **as_postgres())
            save(state)
            if i == 0:
                # The first agent bootstraps (initdb) and takes the leader key.
                wait("node n0 leading", deadline,
                     lambda: any(m["name"] == "n0" and m["role"] == "leader" and m["state"] == "running"
                                 for m in members(state) or []), log)
                wait("database test", deadline,
                     lambda: psql(state, state["nodes"][0]["pg"], "CREATE DATABASE test") is not None
                     or psql(state, state["nodes"][0]["pg"], "SELECT 1", "test") == "1", log)

        def ready():
            ms = members(state) or []
            leaders = [m for m in ms if m["role"] == "leader" and m["state"] == "running"]
            replicas = [m for m in ms if m["role"] in ("replica", "sync_standby")
                        and m["state"] in ("running", "streaming")]
            syncs = [m for m in ms if m["role"] == "sync_standby"]
            return len(leaders) == 1 and len(replicas) == NODES - 1 and (len(syncs) == 1 or not sync)

        wait("one leader and two streaming replicas" + (" (one synchronous)" if sync else ""),
             deadline, ready, os.path.join(d, f"n{NODES - 1}", "patroni.log"))
        wait("the write port reaching the leader", deadline,
             lambda: psql(state, state["write"], "SELECT pg_is_in_recovery()", "test") == "f", ha_log)
        # Each replica streams from the leader (pg_stat_replication).
        wait("both replicas streaming", deadline,
             lambda: psql(state, state["write"],
                          "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'") == str(NODES - 1),
             ha_log)
    except (TimeoutError, OSError) as e:
        stop(state)
        die(f"start-up failed in {d}: {e}")
    save(state)
    print(json.dumps(state))


def postmaster_pid(state, i):
    try:
        with open(os.path.join(state["dir"], f"n{i}", "data", "postmaster.pid")) as f:
            return int(f.readline().strip())
    except (OSError, ValueError):
        return None


def alive(pid):
    """Whether pid runs (a zombie nobody reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def children(pid):
    """The pids whose parent is pid."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, IndexError, ValueError):
            pass
    return found


def kill_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop(state):
    """Ends the agents (they stop their servers), then whatever is left."""
    pids = state.get("pids", {})
    agents = [p for k, p in pids.items() if k.startswith("patroni_")]
    for p in agents:
        kill_group(p, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in agents) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in agents:
        kill_group(p, signal.SIGKILL)
    # A server outlives its agent (Patroni starts it in a session of its
    # own): kill each by its postmaster.pid, and its group.
    for i in range(len(state.get("nodes", []))):
        pm = postmaster_pid(state, i)
        if pm and alive(pm):
            for pid in [pm] + children(pm):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    for k in ("haproxy", "etcd"):
        if k in pids:
            kill_group(pids[k], signal.SIGKILL)


def admin(state, command):
    """One command on HAProxy's admin socket; its answer."""
    with socket.create_connection(("127.0.0.1", state["haproxy_admin"]), timeout=5) as s:
        s.sendall(command.encode() + b"\n")
        out = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            out += chunk
    return out.decode(errors="replace").strip()


def main():
    args = sys.argv[1:]
    if len(args) < 2 or args[0] not in ("start", "stop", "status", "cut", "heal", "agent", "run"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    cmd, d = args[0], args[1]
    if cmd in ("start", "run"):
        mode, timeout, rest = "sync", 120.0, args[2:]
        while rest:
            flag, value, rest = rest[0], (rest[1] if len(rest) > 1 else None), rest[2:]
            if flag == "--mode" and value in ("sync", "async"):
                mode = value
            elif flag == "--timeout" and value:
                timeout = float(value)
            else:
                die(f"unknown or incomplete flag {flag}")
        start(d, mode == "sync", timeout)
        if cmd == "run":
            state = load(d)
            print(f"write port {state['write']}, read port {state['read']}; Ctrl-C stops", file=sys.stderr)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            try:
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
            finally:
                stop(state)
        return
    state = load(d)
    if cmd == "stop":
        stop(state)
    elif cmd == "status":
        print(json.dumps(members(state)))
    elif len(args) < 3 or args[2] not in [f"n{i}" for i in range(NODES)]:
        die(f"{cmd} needs a node: n0, n1 or n2")
    elif cmd == "agent":
        # After a SIGKILL of the agent: the server it left running (or a
        # data directory it left) is taken over, rewound if needed.
        name = args[2]
        old = state["pids"].get(f"patroni_{name}")
        if old and alive(old):
            die(f"the agent of {name} is running (pid {old})")
        nd = os.path.join(state["dir"], name)
        state["pids"][f"patroni_{name}"] = spawn(
            ["/usr/bin/patroni", os.path.join(nd, "patroni.yml")],
            os.path.join(nd, "patroni.log"), cwd=nd, **as_postgres())
        save(state)
        print(state["pids"][f"patroni_{name}"])
    elif cmd in ("cut", "heal"):
        what = args[3] if len(args) > 3 else "etcd"
        if what not in ("etcd", "replication"):
            die(f"{cmd} cuts etcd or replication, not {what}")
        server = f"etcd_{args[2]}/etcd" if what == "etcd" else f"peer_{args[2]}/pg"
        if cmd == "cut":
            print(admin(state, f"disable server {server}"))
            print(admin(state, f"shutdown sessions server {server}"))
        else:
            print(admin(state, f"enable server {server}"))


if __name__ == "__main__":
    main()
