//! Why an API call was refused, and the gRPC status that says so.

use crate::inflight::InFlightError;
use allot_common::descriptor::RequestError;

/// Why a gateway call was refused. Nothing is spent for any of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed (sizes, emptiness, costs, unknown domain).
    #[error("{0}")]
    Invalid(#[from] RequestError),
    /// A field could not be read (wire-format problem), with the field named.
    #[error("{0}")]
    Malformed(String),
    /// Reservations and in-flight tracking.
    #[error(transparent)]
    InFlight(#[from] InFlightError),
}

impl ApiError {
    /// Whether the caller sent something invalid (INVALID_ARGUMENT / HTTP 400).
    pub fn is_invalid_argument(&self) -> bool {
        matches!(
            self,
            ApiError::Invalid(_)
                | ApiError::Malformed(_)
                | ApiError::InFlight(InFlightError::NotAReservation(_))
        )
    }
}

impl From<ApiError> for tonic::Status {
    fn from(e: ApiError) -> Self {
        let msg = e.to_string();
        match e {
            _ if e.is_invalid_argument() => tonic::Status::invalid_argument(msg),
            ApiError::InFlight(InFlightError::NotFound(_)) => tonic::Status::not_found(msg),
            ApiError::InFlight(InFlightError::Expired(_)) => {
                tonic::Status::failed_precondition(msg)
            }
            ApiError::InFlight(InFlightError::InProgress(_)) => tonic::Status::aborted(msg),
            ApiError::InFlight(InFlightError::TooMany { .. }) => {
                tonic::Status::resource_exhausted(msg)
            }
            _ => tonic::Status::internal(msg),
        }
    }
}
