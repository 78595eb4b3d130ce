//! Why an API call was refused, and the gRPC status that says so.

use crate::tracked::TrackingError;
use allot_common::descriptor::RequestError;

/// Why a call of the [`Decider`](super::Decider) was refused. Nothing is spent for any of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed (sizes, emptiness, costs, unknown domain).
    #[error("{0}")]
    Invalid(#[from] RequestError),
    /// A field could not be read (wire-format problem), with the field named.
    #[error("{0}")]
    Malformed(String),
    /// Request tracking by id (reservations, held concurrency slots).
    #[error(transparent)]
    Tracking(#[from] TrackingError),
}

impl ApiError {
    /// Whether the caller sent something invalid (INVALID_ARGUMENT / HTTP 400).
    pub fn is_invalid_argument(&self) -> bool {
        matches!(
            self,
            ApiError::Invalid(_)
                | ApiError::Malformed(_)
                | ApiError::Tracking(TrackingError::NotAReservation(_))
        )
    }
}

impl From<ApiError> for tonic::Status {
    fn from(e: ApiError) -> Self {
        let msg = e.to_string();
        match e {
            _ if e.is_invalid_argument() => tonic::Status::invalid_argument(msg),
            ApiError::Tracking(TrackingError::NotFound(_)) => tonic::Status::not_found(msg),
            ApiError::Tracking(TrackingError::Expired(_)) => {
                tonic::Status::failed_precondition(msg)
            }
            ApiError::Tracking(TrackingError::InProgress(_)) => tonic::Status::aborted(msg),
            ApiError::Tracking(TrackingError::TooMany { .. }) => {
                tonic::Status::resource_exhausted(msg)
            }
            _ => tonic::Status::internal(msg),
        }
    }
}
