//! bincode 2 (standard configuration, serde) for everything this layer writes to disk or wire.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Most bytes one decoded value may claim, 1 GiB: far above any Raft message (the transport caps
/// those at 64 MiB) or snapshot this allocator produces.
pub(crate) const DECODE_LIMIT_BYTES: usize = 1 << 30;

/// Encodes `value` with bincode 2's standard configuration.
pub(crate) fn encode<T: Serialize + ?Sized>(
    value: &T,
) -> Result<Vec<u8>, bincode::error::EncodeError> {
    bincode::serde::encode_to_vec(value, bincode::config::standard())
}

/// Decodes a value written by [`encode`]; trailing bytes are an error because they mean the
/// bytes were not written by [`encode`] for this type.
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, bincode::error::DecodeError> {
    // The limit makes a forged length prefix (from a peer or a damaged file) an error instead of
    // an attempt to allocate it. Same wire format as `standard()`: the limit only bounds decoding.
    let config = bincode::config::standard().with_limit::<DECODE_LIMIT_BYTES>();
    let (value, read) = bincode::serde::decode_from_slice(bytes, config)?;
    if read != bytes.len() {
        return Err(bincode::error::DecodeError::OtherString(format!(
            "{} trailing bytes after a {}-byte value",
            bytes.len() - read,
            read
        )));
    }
    Ok(value)
}

/// Decodes a value written by [`encode`] at the start of `bytes`; returns it with the number of
/// bytes it took (what follows is the caller's).
pub(crate) fn decode_prefix<T: DeserializeOwned>(
    bytes: &[u8],
) -> Result<(T, usize), bincode::error::DecodeError> {
    let config = bincode::config::standard().with_limit::<DECODE_LIMIT_BYTES>();
    bincode::serde::decode_from_slice(bytes, config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_trailing_bytes() {
        let bytes = encode(&(7u64, "x".to_string())).expect("encode");
        assert_eq!(decode::<(u64, String)>(&bytes).ok(), Some((7, "x".into())));
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode::<(u64, String)>(&longer).is_err());
    }

    #[test]
    fn forged_length_is_an_error_not_an_allocation() {
        // Varint 0xFD = u64 follows: a string claiming 2^62 bytes.
        let mut forged = vec![0xFD];
        forged.extend_from_slice(&(1u64 << 62).to_le_bytes());
        assert!(decode::<String>(&forged).is_err());
        assert!(decode::<Vec<u64>>(&forged).is_err());
    }
}
