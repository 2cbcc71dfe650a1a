//! The ledger at a glance.

use serde_json::{Value, json};

use crate::store::RecordStatus;

/// Rows of one status and operation.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatusCount {
    /// The status.
    pub status: RecordStatus,
    /// The stored operation.
    pub operation: String,
    /// How many rows (exact, from a scan of the ledger).
    pub rows: i64,
    /// The oldest row's `created_at`, epoch ms.
    pub oldest_created_at: i64,
}

/// The ledger's size on disk, where the store can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DiskSize {
    /// Bytes.
    pub bytes: i64,
    /// Whether the store only estimates it (MySQL's `information_schema`).
    pub estimate: bool,
    /// What the figure covers.
    pub what: &'static str,
}

/// The ledger at a glance (see [`Ledger::status`](super::Ledger::status)).
///
/// Counts are exact at the moment each statement ran (three statements,
/// not one snapshot: a row may move between them). The size on disk may
/// be an estimate; [`estimates`](Self::estimates) names every figure that
/// is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LedgerStatus {
    /// Rows by status and operation.
    pub counts: Vec<StatusCount>,
    /// Every row.
    pub total: i64,
    /// `NEEDS_RECONCILIATION` rows.
    pub parked: i64,
    /// `EXPIRED` tombstones.
    pub tombstones: i64,
    /// The oldest `PROCESSING` row's `created_at`, epoch ms.
    pub oldest_processing: Option<i64>,
    /// Lease-mode `PROCESSING` rows whose lease has lapsed.
    pub leased_past_lease: i64,
    /// Records whose outcome is not settled (the operators' listing, with
    /// the ledger's stranded age, [`Ledger::with_stranded_after`](super::Ledger::with_stranded_after)).
    pub unresolved: i64,
    /// The oldest of them's `created_at`, epoch ms.
    pub oldest_unresolved: Option<i64>,
    /// Size on disk, where the store can tell.
    pub size: Option<DiskSize>,
    /// The database clock when read, epoch ms.
    pub read_at: i64,
}

impl LedgerStatus {
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlite", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn new(
        counts: Vec<StatusCount>,
        leased_past_lease: i64,
        unresolved: i64,
        oldest_unresolved: Option<i64>,
        size: Option<DiskSize>,
        read_at: i64,
    ) -> Self {
        let sum = |s: RecordStatus| {
            counts
                .iter()
                .filter(|c| c.status == s)
                .map(|c| c.rows)
                .sum::<i64>()
        };
        let oldest_processing = counts
            .iter()
            .filter(|c| c.status == RecordStatus::Processing)
            .map(|c| c.oldest_created_at)
            .min();
        Self {
            total: counts.iter().map(|c| c.rows).sum(),
            parked: sum(RecordStatus::NeedsReconciliation),
            tombstones: sum(RecordStatus::Expired),
            oldest_processing,
            leased_past_lease,
            unresolved,
            oldest_unresolved,
            size,
            read_at,
            counts,
        }
    }

    /// The age of the oldest `PROCESSING` row, milliseconds.
    pub fn oldest_processing_age_ms(&self) -> Option<i64> {
        self.oldest_processing
            .map(|t| self.read_at.saturating_sub(t))
    }

    /// The age of the oldest unresolved record, milliseconds.
    pub fn oldest_unresolved_age_ms(&self) -> Option<i64> {
        self.oldest_unresolved
            .map(|t| self.read_at.saturating_sub(t))
    }

    /// The names of the figures that are estimates (`size_bytes` on
    /// MySQL/MariaDB); empty when every figure is exact.
    pub fn estimates(&self) -> Vec<&'static str> {
        match &self.size {
            Some(size) if size.estimate => vec!["size_bytes"],
            _ => Vec::new(),
        }
    }

    /// The status as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "counts": self.counts.iter().map(|c| json!({
                "status": c.status.as_str(),
                "operation": c.operation,
                "rows": c.rows,
                "oldest_created_at": c.oldest_created_at,
            })).collect::<Vec<_>>(),
            "total": self.total,
            "parked": self.parked,
            "tombstones": self.tombstones,
            "oldest_processing_age_ms": self.oldest_processing_age_ms(),
            "leased_past_lease": self.leased_past_lease,
            "unresolved": self.unresolved,
            "oldest_unresolved_age_ms": self.oldest_unresolved_age_ms(),
            "size_bytes": self.size.as_ref().map(|s| s.bytes),
            "size_covers": self.size.as_ref().map(|s| s.what),
            "estimates": self.estimates(),
            "read_at": self.read_at,
        })
    }
}

/// What a sweep would do now (see [`Ledger::sweep_preview`](super::Ledger::sweep_preview)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct SweepPreview {
    /// Terminal rows past retention: a sweep turns them into tombstones.
    pub expirable: i64,
    /// Tombstones past their purge time: a sweep deletes them.
    pub purgeable: i64,
}
