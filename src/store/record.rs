//! What a ledger row holds, as the layer reads it, and its decoding from
//! the rows the backends fetch.

use super::{Fence, Scope};

/// The state of a ledger row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordStatus {
    /// Claimed; the first request is running. In the layer's transaction
    /// mode the row is only ever `PROCESSING` inside its own transaction: a
    /// committed `PROCESSING` row means the handler ended that transaction
    /// itself, and the key answers "outcome unknown".
    Processing,
    /// The operation succeeded; the response is stored.
    Succeeded,
    /// The operation ended in a final business error; the error is stored.
    FailedFinal,
    /// Retention ended; the response was dropped, the key stays refused.
    Expired,
    /// The outcome is not known (the handler ended the claimed transaction
    /// itself); never executed again until an operator resolves it (see
    /// [`Reconciler`](crate::Reconciler)).
    NeedsReconciliation,
}

impl RecordStatus {
    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Processing => "PROCESSING",
            Self::Succeeded => "SUCCEEDED",
            Self::FailedFinal => "FAILED_FINAL",
            Self::Expired => "EXPIRED",
            Self::NeedsReconciliation => "NEEDS_RECONCILIATION",
        }
    }

    /// Parses the `status` column.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "PROCESSING" => Self::Processing,
            "SUCCEEDED" => Self::Succeeded,
            "FAILED_FINAL" => Self::FailedFinal,
            "EXPIRED" => Self::Expired,
            "NEEDS_RECONCILIATION" => Self::NeedsReconciliation,
            _ => return None,
        })
    }

    /// `SUCCEEDED` and `FAILED_FINAL`: a stored answer that is replayed.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::FailedFinal)
    }
}

/// A ledger row as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The row's state.
    pub status: RecordStatus,
    /// The fingerprint of the request that claimed the scope.
    pub fingerprint: Vec<u8>,
    /// The recorded response status, for terminal rows.
    pub response_status: Option<i32>,
    /// The recorded, allow-listed response headers, for terminal rows.
    pub response_headers: Option<Vec<u8>>,
    /// The recorded response body, for terminal rows.
    pub response_body: Option<Vec<u8>>,
    /// The id of the resource the request created, when the handler named it.
    pub resource_id: Option<String>,
    /// End of retention, Unix epoch milliseconds (database clock).
    pub expires_at: i64,
    /// Whether `expires_at` had passed on the database's clock when read.
    pub past_expiry: bool,
    /// The lease state, for a row claimed in lease mode.
    pub lease: Option<LeaseState>,
}

impl Record {
    /// The answer this committed record holds, `status` being its
    /// recorded response status.
    pub(crate) fn stored_response(&self, status: i32) -> crate::replay::StoredResponse {
        crate::replay::StoredResponse {
            status: u16::try_from(status).unwrap_or(500),
            headers: self.response_headers.clone().unwrap_or_default(),
            body: bytes::Bytes::from(self.response_body.clone().unwrap_or_default()),
        }
    }
}

/// Where a lease-mode row stands (see [`lease`](crate::lease)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseState {
    /// The fencing token: 1 at the claim, one more at each takeover.
    pub generation: i64,
    /// Whether the lease was still running on the database's clock when
    /// read (`locked_until` in the future).
    pub live: bool,
    /// The last committed recovery point.
    pub recovery_point: Option<String>,
    /// What the phases and steps saved: a JSON object by point name.
    pub recovery_data: Option<Vec<u8>>,
    /// An external step that may have run and whose outcome is not
    /// recorded.
    pub pending_step: Option<String>,
    /// The id of the claim that made the row (`None` for rows
    /// claimed before the ledger stored it): with the generation, what
    /// every fenced write names.
    pub claim_id: Option<String>,
    /// How often the row was parked (completer passes back off by it).
    pub parks: i64,
}

impl LeaseState {
    /// The fence of the attempt that holds this state.
    pub fn fence(&self) -> Fence<'_> {
        Fence {
            generation: self.generation,
            claim: self.claim_id.as_deref(),
        }
    }
}

/// The terminal state written on the claimed row before commit.
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a> {
    /// `Succeeded` or `FailedFinal`.
    pub status: RecordStatus,
    /// The response status code.
    pub response_status: i32,
    /// The allow-listed response headers, encoded.
    pub response_headers: &'a [u8],
    /// The response body.
    pub response_body: &'a [u8],
    /// The created resource's id, if the handler named one.
    pub resource_id: Option<&'a str>,
}

impl<'a> Completion<'a> {
    /// The completion recording `stored` with `status`, naming the
    /// resource the handler put in `extensions` (an id the ledger's column
    /// cannot hold, over 255 bytes or with a NUL, is not recorded: the
    /// answer still is).
    pub(crate) fn of(
        status: RecordStatus,
        stored: &'a crate::replay::StoredResponse,
        extensions: &'a http::Extensions,
    ) -> Self {
        let resource_id = extensions
            .get::<crate::ResourceId>()
            .map(crate::ResourceId::as_str)
            .filter(|id| id.len() <= 255 && !id.contains('\0'));
        Self {
            status,
            response_status: i32::from(stored.status),
            response_headers: &stored.headers,
            response_body: &stored.body,
            resource_id,
        }
    }
}

/// A committed record whose outcome is unknown, as listed for operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnresolvedRecord {
    /// The stored principal (hashed when it was long, see the scope docs).
    pub principal: String,
    /// The stored operation.
    pub operation: String,
    /// The stored key (hashed with `with_hashed_keys`).
    pub key: String,
    /// `PROCESSING` (stranded: the default mode's handler ended its
    /// transaction, or a lease lapsed with a step pending or long ago) or
    /// `NEEDS_RECONCILIATION`.
    pub status: RecordStatus,
    /// The status the handler answered when the layer found that it had
    /// ended its transaction itself (a default-mode record): never sent,
    /// the client was answered `500`. `None` otherwise.
    pub response_status: Option<i32>,
    /// When the key was claimed, epoch milliseconds (database clock).
    pub created_at: i64,
    /// Lease mode: the record's generation (0 for the default mode).
    pub generation: i64,
    /// Lease mode: the external step whose outcome is unknown.
    pub pending_step: Option<String>,
    /// Lease mode: the last committed recovery point.
    pub recovery_point: Option<String>,
    /// Lease mode: the claim's id (what a verdict names with the
    /// generation).
    pub claim_id: Option<String>,
    /// Lease mode: when the lease ends or ended (for a parked record, when
    /// a completer may retry it), epoch milliseconds (database clock).
    pub locked_until: Option<i64>,
    /// How often the record was parked (`NEEDS_RECONCILIATION`, by a
    /// lease-mode step or by the layer when a handler ended its
    /// transaction; at least 1 while it is parked). A verdict names it, so
    /// a completer pass that acted on the record since the listing (or the
    /// layer parking a record listed as `PROCESSING`) makes the verdict
    /// [`Changed`](crate::ResolveError::Changed).
    pub parks: i64,
}

impl UnresolvedRecord {
    /// The fence a verdict on the record as listed names.
    pub fn fence(&self) -> Fence<'_> {
        Fence {
            generation: self.generation,
            claim: self.claim_id.as_deref(),
        }
    }

    /// The record's scope.
    pub fn scope(&self) -> Scope<'_> {
        Scope {
            principal: &self.principal,
            operation: &self.operation,
            key: &self.key,
        }
    }
}

pub(crate) type RecordRow = (
    String,
    Vec<u8>,
    Option<i32>,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Option<String>,
    i64,
    i64,
    i64,
    i64,
    Option<String>,
    Option<Vec<u8>>,
    Option<String>,
    Option<String>,
    i64,
);

pub(crate) fn record_from_row(row: RecordRow) -> Result<Record, sqlx::Error> {
    let (
        status,
        fingerprint,
        response_status,
        response_headers,
        response_body,
        resource_id,
        expires_at,
        past_expiry,
        generation,
        live,
        recovery_point,
        recovery_data,
        pending_step,
        claim_id,
        parks,
    ) = row;
    let lease = (generation > 0).then_some(LeaseState {
        generation,
        live: live != 0,
        recovery_point,
        recovery_data,
        pending_step,
        claim_id,
        parks,
    });
    Ok(Record {
        status: parse_status(&status)?,
        fingerprint,
        response_status,
        response_headers,
        response_body,
        resource_id,
        expires_at,
        past_expiry: past_expiry != 0,
        lease,
    })
}

pub(crate) fn parse_status(status: &str) -> Result<RecordStatus, sqlx::Error> {
    RecordStatus::parse(status)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown ledger status {status:?}").into()))
}

pub(crate) type UnresolvedRow = (
    String,
    String,
    String,
    String,
    Option<i32>,
    i64,
    i64,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
    i64,
);

pub(crate) fn unresolved_from_row(row: UnresolvedRow) -> Result<UnresolvedRecord, sqlx::Error> {
    let (
        principal,
        operation,
        key,
        status,
        response_status,
        created_at,
        generation,
        pending_step,
        recovery_point,
        claim_id,
        locked_until,
        parks,
    ) = row;
    Ok(UnresolvedRecord {
        principal,
        operation,
        key,
        status: parse_status(&status)?,
        response_status,
        created_at,
        generation,
        pending_step,
        recovery_point,
        claim_id,
        locked_until,
        parks,
    })
}
