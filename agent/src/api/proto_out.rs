//! Protobuf fields written straight into a buffer, as prost writes them (proto3: a scalar of 0
//! and an empty string are omitted), for answers encoded without building their message
//! (issue 13 item 5): each helper writes or measures one field.

use prost::bytes::BufMut;
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, WireType};

fn key_len(tag: u32) -> usize {
    encoded_len_varint(u64::from(tag << 3))
}

pub(crate) fn varint(tag: u32, v: u64, buf: &mut impl BufMut) {
    encode_key(tag, WireType::Varint, buf);
    encode_varint(v, buf);
}

pub(crate) fn varint_len(tag: u32, v: u64) -> usize {
    key_len(tag) + encoded_len_varint(v)
}

/// A proto3 scalar: omitted when 0.
pub(crate) fn opt_varint(tag: u32, v: u64, buf: &mut impl BufMut) {
    if v != 0 {
        varint(tag, v, buf);
    }
}

pub(crate) fn opt_varint_len(tag: u32, v: u64) -> usize {
    if v == 0 {
        0
    } else {
        varint_len(tag, v)
    }
}

/// A proto3 string: omitted when empty.
pub(crate) fn opt_str(tag: u32, s: &str, buf: &mut impl BufMut) {
    if !s.is_empty() {
        message_header(tag, s.len(), buf);
        buf.put_slice(s.as_bytes());
    }
}

pub(crate) fn str_len(tag: u32, s: &str) -> usize {
    if s.is_empty() {
        0
    } else {
        message_len(tag, s.len())
    }
}

/// The key and length of a length-delimited field of `len` bytes.
pub(crate) fn message_header(tag: u32, len: usize, buf: &mut impl BufMut) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(len as u64, buf);
}

pub(crate) fn message_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// A proto3 `optional` scalar: written whenever present, 0 included.
pub(crate) fn some_varint(tag: u32, v: Option<u64>, buf: &mut impl BufMut) {
    if let Some(v) = v {
        varint(tag, v, buf);
    }
}

pub(crate) fn some_varint_len(tag: u32, v: Option<u64>) -> usize {
    v.map_or(0, |v| varint_len(tag, v))
}
