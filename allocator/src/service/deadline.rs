//! The caller's deadline, from gRPC's `grpc-timeout` request header, so that work whose caller
//! has stopped waiting is dropped unprocessed (issue 9 item 3).

use std::time::Duration;
use tokio::time::Instant;
use tonic::Request;

/// Name of gRPC's timeout header.
const GRPC_TIMEOUT: &str = "grpc-timeout";

/// When the caller of `r` stops waiting: now plus its `grpc-timeout`. `None` without the
/// header, for a malformed one (it is then ignored, as the gRPC server also does), or when the
/// deadline lies beyond what the clock can represent.
pub fn deadline_of<T>(r: &Request<T>) -> Option<Instant> {
    let v = r.metadata().get(GRPC_TIMEOUT)?.to_str().ok()?;
    Instant::now().checked_add(parse_grpc_timeout(v)?)
}

/// Parses a `grpc-timeout` value: 1 to 8 ASCII digits and a unit, `H` hours, `M` minutes, `S`
/// seconds, `m` milliseconds, `u` microseconds or `n` nanoseconds (gRPC over HTTP/2). `None`
/// when malformed.
pub fn parse_grpc_timeout(v: &str) -> Option<Duration> {
    let b = v.as_bytes();
    let (&unit, digits) = b.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    // At most 8 digits: the value fits a u64 and every product below fits too.
    let n = digits
        .iter()
        .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
    Some(match unit {
        b'H' => Duration::from_secs(n * 3_600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_parse_in_every_unit_and_at_the_extremes() {
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("1S"), Some(Duration::from_secs(1)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_grpc_timeout("9n"), Some(Duration::from_nanos(9)));
        assert_eq!(parse_grpc_timeout("0m"), Some(Duration::ZERO));
        assert_eq!(
            parse_grpc_timeout("99999999H"),
            Some(Duration::from_secs(99_999_999 * 3_600))
        );
        for bad in ["", "m", "123", "123456789m", "12x", "-1m", "1.5S", "１m"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_request_carries_its_deadline() {
        let mut r = Request::new(());
        assert_eq!(deadline_of(&r), None);
        r.set_timeout(Duration::from_secs(5));
        let d = deadline_of(&r).expect("a deadline");
        assert!(d <= Instant::now() + Duration::from_secs(5));
        let mut huge = Request::new(());
        huge.metadata_mut()
            .insert(GRPC_TIMEOUT, "99999999H".parse().expect("ascii"));
        // 11,400 years from now may not be representable; either way it never panics.
        let _ = deadline_of(&huge);
    }
}
