//! `ID=HOST:PORT`: how a cluster member is written on a command line (the allocator's `--peer`,
//! `allotctl cluster … --member`), parsed in one place so both say the same about a bad one.

use std::str::FromStr;

use crate::allot::v1::Member;

/// Why an argument is not an `ID=HOST:PORT` member.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemberParseError {
    /// There is no `=` between the id and the address.
    #[error("expected ID=HOST:PORT, got {0:?}")]
    NoEquals(String),
    /// The part before `=` is not a node id.
    #[error("node id {0:?} is not a whole number")]
    BadNodeId(String),
    /// The part after `=` is empty.
    #[error("member {0} has no address")]
    NoAddress(u64),
}

impl FromStr for Member {
    type Err = MemberParseError;

    /// Parses `ID=HOST:PORT`; white space around either part is ignored. The address is not
    /// resolved here (a name may only resolve where the node runs).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (id, addr) = s
            .split_once('=')
            .ok_or_else(|| MemberParseError::NoEquals(s.to_string()))?;
        let node_id = id
            .trim()
            .parse::<u64>()
            .map_err(|_| MemberParseError::BadNodeId(id.to_string()))?;
        let addr = addr.trim();
        if addr.is_empty() {
            return Err(MemberParseError::NoAddress(node_id));
        }
        Ok(Member {
            node_id,
            addr: addr.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_parses_and_a_bad_one_is_named() {
        assert_eq!(
            " 2 = 127.0.0.1:7702 ".parse::<Member>(),
            Ok(Member {
                node_id: 2,
                addr: "127.0.0.1:7702".into()
            })
        );
        assert_eq!(
            "2".parse::<Member>().map_err(|e| e.to_string()),
            Err("expected ID=HOST:PORT, got \"2\"".into())
        );
        assert_eq!(
            "x=a:1".parse::<Member>(),
            Err(MemberParseError::BadNodeId("x".into()))
        );
        assert_eq!("1= ".parse::<Member>(), Err(MemberParseError::NoAddress(1)));
    }
}
