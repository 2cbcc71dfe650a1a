//! In-process coalescing of duplicates.
//!
//! When two requests with one scope reach the same process, the second does
//! not need a database connection to learn that the first is still running:
//! it waits here, without holding a pooled connection, until the first has
//! answered (bounded by the in-flight wait), and only then goes to the
//! ledger, where it normally finds the stored answer. Correctness never
//! rests on this map: the database's unique constraint still decides every
//! claim, across processes too. The map only keeps a duplicate storm from
//! pinning the connection pool.
//!
//! Where asked (the claim-at-commit mode), it also remembers the last
//! [`FINISHED`] distinct scopes whose leader finished here (as 64-bit
//! hashes, keyed per layer), so that a later retry of one is known to be a
//! duplicate and reads the ledger before running the handler. A hint
//! only: a hash that collides, or a scope that ended with nothing
//! recorded, costs one read, after which the request runs as any other.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;

use crate::store::Scope;

/// How many finished scopes a layer remembers (under 32 KiB of hashes).
pub(crate) const FINISHED: usize = 1024;

/// The scopes whose first request is running in this process, and the
/// last ones that finished here.
#[derive(Debug, Default)]
pub(crate) struct LocalClaims {
    state: Mutex<State>,
    hasher: RandomState,
}

#[derive(Debug, Default)]
struct State {
    running: HashMap<Hashed, watch::Receiver<()>, ByHash>,
    /// Hashes of finished scopes in the order each first finished, each
    /// once, at most [`FINISHED`]; `finished_set` holds the same hashes.
    finished: VecDeque<u64>,
    finished_set: HashSet<u64, ByHash>,
}

/// A scope's key with its hash (the layer's keyed hash, so a client
/// cannot choose keys that collide): every look-up of a request reuses
/// the one hash, where each hashed the key anew.
#[derive(Debug, Clone)]
struct Hashed {
    hash: u64,
    key: String,
}

impl PartialEq for Hashed {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.key == other.key
    }
}

impl Eq for Hashed {}

impl Hash for Hashed {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// The maps' hasher: passes on the hash already taken ([`Hashed`], or a
/// finished scope's), which the keyed hash made unpredictable.
type ByHash = BuildHasherDefault<Passed>;

#[derive(Default)]
struct Passed(u64);

impl Hasher for Passed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64`s are written; anything else is folded in, not lost.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
}

impl State {
    fn finish(&mut self, hash: u64) {
        if self.finished_set.contains(&hash) {
            return;
        }
        if self.finished.len() >= FINISHED
            && let Some(oldest) = self.finished.pop_front()
        {
            self.finished_set.remove(&oldest);
        }
        self.finished.push_back(hash);
        self.finished_set.insert(hash);
    }
}

/// What [`LocalClaims::lead_or_wait`] found.
pub(crate) enum Local {
    /// This request is the scope's first in this process now; the token
    /// is held (for its `Drop`) until the answer is settled. `finished`:
    /// where finished scopes are remembered, a request of the scope
    /// finished here before (among the last [`FINISHED`]).
    Leader { _token: Leader, finished: bool },
    /// Another request of the scope ran here and has answered.
    Finished,
    /// Another request of the scope is still running after the wait.
    StillRunning,
}

/// Held by the first request of a scope; dropping it (answered, failed,
/// cancelled or panicked alike) releases the waiters.
pub(crate) struct Leader {
    claims: Arc<LocalClaims>,
    key: Hashed,
    /// Whether the scope is remembered once it finishes.
    remember: bool,
    _done: watch::Sender<()>,
}

impl Drop for Leader {
    fn drop(&mut self) {
        let mut state = self.claims.lock();
        state.running.remove(&self.key);
        if self.remember {
            state.finish(self.key.hash);
        }
    }
}

impl LocalClaims {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state holds no invariant a panic could break.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a request of `scope` is running in this process now.
    pub(crate) fn is_running(&self, scope: &Scope<'_>) -> bool {
        let key = self.key(scope);
        self.lock().running.contains_key(&key)
    }

    fn key(&self, scope: &Scope<'_>) -> Hashed {
        let parts = [scope.principal, "\0", scope.operation, "\0", scope.key];
        let mut key = String::with_capacity(parts.iter().map(|p| p.len()).sum());
        parts.iter().for_each(|p| key.push_str(p));
        Hashed {
            hash: self.hasher.hash_one(&key),
            key,
        }
    }

    /// Becomes the scope's leader, or waits (at most `wait`) for the
    /// current leader to finish. With `remember`, a leader's scope is
    /// remembered once it finishes, and a new leader is told whether its
    /// scope was.
    pub(crate) async fn lead_or_wait(
        self: &Arc<Self>,
        scope: &Scope<'_>,
        wait: Duration,
        remember: bool,
    ) -> Local {
        let key = self.key(scope);
        let mut running = {
            let mut state = self.lock();
            match state.running.get(&key) {
                Some(rx) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(());
                    let finished = remember && state.finished_set.contains(&key.hash);
                    state.running.insert(key.clone(), rx);
                    return Local::Leader {
                        _token: Leader {
                            claims: Arc::clone(self),
                            key,
                            remember,
                            _done: tx,
                        },
                        finished,
                    };
                }
            }
        };
        // Resolves when the leader drops its sender.
        match tokio::time::timeout(wait, running.changed()).await {
            Ok(_) => Local::Finished,
            Err(_) => Local::StillRunning,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope() -> Scope<'static> {
        Scope {
            principal: "p",
            operation: "op",
            key: "k",
        }
    }

    #[tokio::test]
    async fn second_waits_for_the_first_and_the_map_empties() {
        let claims = Arc::new(LocalClaims::default());
        let leader = claims
            .lead_or_wait(&scope(), Duration::from_secs(5), false)
            .await;
        assert!(matches!(leader, Local::Leader { .. }));
        let waiter = {
            let claims = Arc::clone(&claims);
            tokio::spawn(async move {
                matches!(
                    claims
                        .lead_or_wait(&scope(), Duration::from_secs(5), false)
                        .await,
                    Local::Finished
                )
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "waits while the leader runs");
        drop(leader);
        assert!(waiter.await.unwrap());
        assert!(claims.lock().running.is_empty());
        assert!(claims.lock().finished.is_empty(), "not asked to remember");
        // The wait is bounded.
        let _leader = claims
            .lead_or_wait(&scope(), Duration::from_secs(5), false)
            .await;
        let started = std::time::Instant::now();
        assert!(matches!(
            claims
                .lead_or_wait(&scope(), Duration::from_millis(50), false)
                .await,
            Local::StillRunning
        ));
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn keys_that_share_a_hash_stay_apart() {
        let mut running: HashMap<Hashed, u8, ByHash> = HashMap::default();
        let key = |key: &str| Hashed {
            hash: 7,
            key: key.to_owned(),
        };
        running.insert(key("a"), 1);
        running.insert(key("b"), 2);
        assert_eq!(running.len(), 2);
        assert_eq!(running.get(&key("a")), Some(&1));
        assert_eq!(running.remove(&key("b")), Some(2));
        assert!(!running.contains_key(&key("b")));
        assert!(running.contains_key(&key("a")));
    }

    #[tokio::test]
    async fn a_scope_that_finished_here_is_known_to_the_next_leader() {
        let claims = Arc::new(LocalClaims::default());
        let wait = Duration::from_secs(5);
        let first = claims.lead_or_wait(&scope(), wait, true).await;
        assert!(matches!(
            first,
            Local::Leader {
                finished: false,
                ..
            }
        ));
        drop(first);
        let again = claims.lead_or_wait(&scope(), wait, true).await;
        assert!(matches!(again, Local::Leader { finished: true, .. }));
        drop(again);
        // Bounded: the oldest is forgotten once FINISHED others finished.
        for i in 0..FINISHED {
            let key = format!("other-{i}");
            let other = Scope {
                principal: "p",
                operation: "op",
                key: &key,
            };
            let leader = claims.lead_or_wait(&other, wait, true).await;
            assert!(matches!(
                leader,
                Local::Leader {
                    finished: false,
                    ..
                }
            ));
        }
        {
            let state = claims.lock();
            assert_eq!(state.finished.len(), FINISHED);
            assert_eq!(state.finished_set.len(), FINISHED);
            assert!(state.running.is_empty());
        }
        let forgotten = claims.lead_or_wait(&scope(), wait, true).await;
        assert!(matches!(
            forgotten,
            Local::Leader {
                finished: false,
                ..
            }
        ));
    }
}
