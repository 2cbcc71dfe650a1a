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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;

use crate::store::Scope;

/// The scopes whose first request is running in this process.
#[derive(Debug, Default)]
pub(crate) struct LocalClaims {
    running: Mutex<HashMap<String, watch::Receiver<()>>>,
}

/// What [`LocalClaims::lead_or_wait`] found.
pub(crate) enum Local {
    /// This request is the scope's first in this process; the token is
    /// held (for its `Drop`) until the answer is settled.
    Leader { _token: Leader },
    /// Another request of the scope ran here and has answered.
    Finished,
    /// Another request of the scope is still running after the wait.
    StillRunning,
}

/// Held by the first request of a scope; dropping it (answered, failed,
/// cancelled or panicked alike) releases the waiters.
pub(crate) struct Leader {
    claims: Arc<LocalClaims>,
    key: String,
    _done: watch::Sender<()>,
}

impl Drop for Leader {
    fn drop(&mut self) {
        self.claims.lock().remove(&self.key);
    }
}

impl LocalClaims {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, watch::Receiver<()>>> {
        // The map holds no invariant a panic could break.
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a request of `scope` is running in this process now.
    pub(crate) fn is_running(&self, scope: &Scope<'_>) -> bool {
        self.lock().contains_key(&Self::key(scope))
    }

    fn key(scope: &Scope<'_>) -> String {
        format!("{}\0{}\0{}", scope.principal, scope.operation, scope.key)
    }

    /// Becomes the scope's leader, or waits (at most `wait`) for the
    /// current leader to finish.
    pub(crate) async fn lead_or_wait(self: &Arc<Self>, scope: &Scope<'_>, wait: Duration) -> Local {
        let key = Self::key(scope);
        let mut running = {
            let mut map = self.lock();
            match map.get(&key) {
                Some(rx) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(());
                    map.insert(key.clone(), rx);
                    return Local::Leader {
                        _token: Leader {
                            claims: Arc::clone(self),
                            key,
                            _done: tx,
                        },
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
        let leader = claims.lead_or_wait(&scope(), Duration::from_secs(5)).await;
        assert!(matches!(leader, Local::Leader { .. }));
        let waiter = {
            let claims = Arc::clone(&claims);
            tokio::spawn(async move {
                matches!(
                    claims.lead_or_wait(&scope(), Duration::from_secs(5)).await,
                    Local::Finished
                )
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "waits while the leader runs");
        drop(leader);
        assert!(waiter.await.unwrap());
        assert!(claims.lock().is_empty());
        // The wait is bounded.
        let _leader = claims.lead_or_wait(&scope(), Duration::from_secs(5)).await;
        let started = std::time::Instant::now();
        assert!(matches!(
            claims
                .lead_or_wait(&scope(), Duration::from_millis(50))
                .await,
            Local::StillRunning
        ));
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
