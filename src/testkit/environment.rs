//! The caller's environments the conformance cases run in (issue 33).
//!
//! One environment is an isolation level for the claimed transaction, a
//! session setting every pooled connection gets when it connects (what an
//! application's `after_connect`, its role or its `DATABASE_URL` options
//! set), and what the test handler does first on the claimed transaction
//! (a savepoint of its own, a `SET LOCAL search_path`, a temporary table).
//! Every case still judges by the rows committed.
//!
//! The whole product of the three dimensions, times every case and store,
//! is too large to run on every CI build, so each case gets one value of
//! each dimension, rotated by a seed: value `(hash(case, dimension) + seed)
//! mod n`. Seed `s` gives every case one environment; the seeds `0..n`
//! give every case every value of a dimension of `n` values (and so every
//! case meets every setting once over [`SEEDS`] seeds). The seed is read
//! from `TOWER_IDEMPOTENCY_MATRIX_SEED` (default 0), and each case prints
//! its environment, so a failure names what to re-run:
//!
//! ```text
//! TOWER_IDEMPOTENCY_MATRIX_SEED=3 cargo test --all-features --test environment_matrix -- postgres::some_case
//! ```

use std::hash::{Hash, Hasher};

use crate::IsolationLevel;

/// The number of seeds after which every case has met every value of
/// every dimension on every store (the largest dimension's size).
pub const SEEDS: u64 = 9;

/// One value of a dimension: statements, and a name to print.
#[derive(Debug, Clone, Copy)]
pub struct Setting {
    /// What the environment is called when a case prints it.
    pub name: &'static str,
    /// Run once on the case's database before the case (a tenant schema).
    pub setup: &'static [&'static str],
    /// Run on every pooled connection when it connects (session settings),
    /// or by the handler on the claimed transaction before its writes.
    pub statements: &'static [&'static str],
}

const NOTHING: Setting = Setting {
    name: "default",
    setup: &[],
    statements: &[],
};

/// A caller's environment: see the [module docs](self).
#[derive(Debug, Clone, Copy)]
pub struct Environment {
    /// The claimed transaction's isolation level.
    pub isolation: IsolationLevel,
    /// Session settings of every pooled connection.
    pub session: Setting,
    /// What the handler runs first on the claimed transaction.
    pub handler: Setting,
}

impl Default for Environment {
    /// `READ COMMITTED`, the server's defaults, a handler that only writes.
    fn default() -> Self {
        Self {
            isolation: IsolationLevel::ReadCommitted,
            session: NOTHING,
            handler: NOTHING,
        }
    }
}

impl std::fmt::Display for Environment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "isolation {}, session {}, handler {}",
            self.isolation.as_sql(),
            self.session.name,
            self.handler.name
        )
    }
}

const ISOLATION: &[IsolationLevel] = &[
    IsolationLevel::ReadCommitted,
    IsolationLevel::RepeatableRead,
    IsolationLevel::Serializable,
];

/// Handler values every store has: savepoints of its own, one named as
/// the layer's once was.
const SAVEPOINTS: [Setting; 2] = [
    Setting {
        name: "savepoint named as the layer's was",
        setup: &[],
        statements: &["SAVEPOINT tower_idempotency_claimed"],
    },
    Setting {
        name: "a savepoint of its own, released",
        setup: &[],
        statements: &["SAVEPOINT handler_1", "RELEASE SAVEPOINT handler_1"],
    },
];

const PG_SESSION: &[Setting] = &[
    NOTHING,
    Setting {
        name: "standard_conforming_strings off",
        setup: &[],
        statements: &["SET standard_conforming_strings = off"],
    },
    Setting {
        name: "bytea_output escape",
        setup: &[],
        statements: &["SET bytea_output = 'escape'"],
    },
    Setting {
        name: "client_encoding SJIS",
        setup: &[],
        statements: &["SET client_encoding = 'SJIS'"],
    },
    Setting {
        name: "DateStyle and TimeZone",
        setup: &[],
        statements: &[
            "SET DateStyle = 'SQL, DMY'",
            "SET TimeZone = 'Pacific/Chatham'",
        ],
    },
    Setting {
        name: "lock_timeout 200ms",
        setup: &[],
        statements: &["SET lock_timeout = '200ms'"],
    },
    Setting {
        name: "statement_timeout 3s",
        setup: &[],
        statements: &["SET statement_timeout = '3s'"],
    },
];

const PG_HANDLER: &[Setting] = &[
    NOTHING,
    SAVEPOINTS[0],
    SAVEPOINTS[1],
    Setting {
        name: "SET LOCAL search_path to a tenant schema with its own ledger",
        setup: &[
            "CREATE SCHEMA IF NOT EXISTS tenant_7",
            "CREATE TABLE tenant_7.idempotency_records (LIKE public.idempotency_records INCLUDING ALL)",
        ],
        statements: &["SET LOCAL search_path TO tenant_7, public"],
    },
    Setting {
        name: "pg_advisory_unlock_all()",
        setup: &[],
        statements: &["SELECT pg_advisory_unlock_all()"],
    },
];

const MYSQL_SESSION: &[Setting] = &[
    NOTHING,
    Setting {
        name: "sql_mode ANSI_QUOTES",
        setup: &[],
        statements: &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',ANSI_QUOTES')"],
    },
    Setting {
        name: "sql_mode NO_BACKSLASH_ESCAPES",
        setup: &[],
        statements: &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',NO_BACKSLASH_ESCAPES')"],
    },
    Setting {
        name: "sql_mode PAD_CHAR_TO_FULL_LENGTH",
        setup: &[],
        statements: &["SET SESSION sql_mode = CONCAT(@@sql_mode, ',PAD_CHAR_TO_FULL_LENGTH')"],
    },
    Setting {
        name: "time_zone +13:00",
        setup: &[],
        statements: &["SET time_zone = '+13:00'"],
    },
    Setting {
        name: "character_set_client latin1",
        setup: &[],
        statements: &["SET character_set_client = latin1"],
    },
    Setting {
        name: "SET NAMES latin1",
        setup: &[],
        statements: &["SET NAMES latin1"],
    },
    Setting {
        name: "innodb_lock_wait_timeout 1",
        setup: &[],
        statements: &["SET SESSION innodb_lock_wait_timeout = 1"],
    },
];

const MYSQL_HANDLER: &[Setting] = &[
    NOTHING,
    SAVEPOINTS[0],
    SAVEPOINTS[1],
    Setting {
        name: "a TEMPORARY table named idempotency_records",
        setup: &[],
        statements: &["CREATE TEMPORARY TABLE IF NOT EXISTS idempotency_records \
             SELECT * FROM idempotency_records WHERE 0 = 1"],
    },
];

const SQLITE_ISOLATION: &[IsolationLevel] = &[IsolationLevel::ReadCommitted];

const SQLITE_SESSION: &[Setting] = &[
    NOTHING,
    Setting {
        name: "case_sensitive_like",
        setup: &[],
        statements: &["PRAGMA case_sensitive_like = ON"],
    },
    Setting {
        name: "foreign_keys and recursive_triggers",
        setup: &[],
        statements: &["PRAGMA foreign_keys = ON", "PRAGMA recursive_triggers = ON"],
    },
    Setting {
        name: "reverse_unordered_selects",
        setup: &[],
        statements: &["PRAGMA reverse_unordered_selects = ON"],
    },
    Setting {
        name: "temp_store memory, synchronous off, small cache",
        setup: &[],
        statements: &[
            "PRAGMA temp_store = MEMORY",
            "PRAGMA synchronous = OFF",
            "PRAGMA cache_size = 16",
        ],
    },
];

const SQLITE_HANDLER: &[Setting] = &[
    NOTHING,
    SAVEPOINTS[0],
    SAVEPOINTS[1],
    Setting {
        name: "a TEMP table named idempotency_records",
        setup: &[],
        statements: &["CREATE TEMP TABLE IF NOT EXISTS idempotency_records \
             AS SELECT * FROM main.idempotency_records WHERE 0"],
    },
];

/// The dimensions of a store (`ConformanceDb::LABEL`).
fn dimensions(
    store: &str,
) -> (
    &'static [IsolationLevel],
    &'static [Setting],
    &'static [Setting],
) {
    match store {
        "postgres" => (ISOLATION, PG_SESSION, PG_HANDLER),
        "mysql" => (ISOLATION, MYSQL_SESSION, MYSQL_HANDLER),
        "sqlite" => (SQLITE_ISOLATION, SQLITE_SESSION, SQLITE_HANDLER),
        _ => (&ISOLATION[..1], &[NOTHING], &[NOTHING]),
    }
}

/// The seed of this run: `TOWER_IDEMPOTENCY_MATRIX_SEED`, 0 by default.
pub fn seed() -> u64 {
    std::env::var("TOWER_IDEMPOTENCY_MATRIX_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

impl Environment {
    /// The environment of `case` on `store` under `seed`.
    pub fn of(store: &str, case: &str, seed: u64) -> Self {
        let (isolation, session, handler) = dimensions(store);
        let pick = |dimension: &str, n: usize| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (case, dimension).hash(&mut h);
            (h.finish().wrapping_add(seed) % n as u64) as usize
        };
        Self {
            isolation: isolation[pick("isolation", isolation.len())],
            session: session[pick("session", session.len())],
            handler: handler[pick("handler", handler.len())],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over `SEEDS` seeds every case meets every value of every dimension.
    #[test]
    fn the_seeds_cover_every_value_for_every_case() {
        for store in ["postgres", "mysql", "sqlite"] {
            let (isolation, session, handler) = dimensions(store);
            assert!(session.len() as u64 <= SEEDS && handler.len() as u64 <= SEEDS);
            for case in ["a", "first_request_commits_order_and_succeeded_row"] {
                let envs: Vec<_> = (0..SEEDS)
                    .map(|s| Environment::of(store, case, s))
                    .collect();
                for value in session {
                    assert!(envs.iter().any(|e| e.session.name == value.name));
                }
                for value in handler {
                    assert!(envs.iter().any(|e| e.handler.name == value.name));
                }
                for level in isolation {
                    assert!(envs.iter().any(|e| e.isolation == *level));
                }
            }
        }
    }
}
