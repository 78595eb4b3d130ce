//! Envoy's `RateLimitRequest` in its proto3 JSON form (as in replay traces), parsed strictly:
//! a malformed field is an invalid-argument error naming the field, never a panic.

pub use allot_common::descriptor::OwnedRequest;
use serde_json::Value;

/// proto3 JSON integers may be numbers or decimal strings.
fn uint(v: &Value, field: &str, max: u64) -> Result<u64, String> {
    let n = match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.parse::<u64>().ok(),
        _ => None,
    };
    match n {
        Some(n) if n <= max => Ok(n),
        Some(n) => Err(format!("{field} is {n}; at most {max} is accepted")),
        None => Err(format!(
            "{field} must be a whole number from 0 to {max}, got {v}"
        )),
    }
}

fn field<'a>(
    obj: &'a serde_json::Map<String, Value>,
    snake: &str,
    camel: &str,
) -> Option<&'a Value> {
    obj.get(snake)
        .or_else(|| obj.get(camel))
        .filter(|v| !v.is_null())
}

fn string(v: Option<&Value>, field: &str) -> Result<String, String> {
    match v {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("{field} must be a string, got {other}")),
    }
}

/// Parses a `RateLimitRequest` JSON value.
///
/// # Errors
/// A message naming the malformed field. Emptiness and size limits are checked later by
/// [`Request::validate`].
pub fn parse_request(v: &Value) -> Result<OwnedRequest, String> {
    let obj = v.as_object().ok_or("request must be a JSON object")?;
    let domain = string(obj.get("domain"), "domain")?;
    let hits_addend = field(obj, "hits_addend", "hitsAddend")
        .map(|h| uint(h, "hits_addend", u32::MAX as u64))
        .transpose()?;
    let mut descriptors = Vec::new();
    if let Some(ds) = obj.get("descriptors") {
        let ds = ds.as_array().ok_or("descriptors must be an array")?;
        for (i, d) in ds.iter().enumerate() {
            let d = d
                .as_object()
                .ok_or_else(|| format!("descriptors[{i}] must be an object"))?;
            let mut entries = Vec::new();
            if let Some(es) = d.get("entries") {
                let es = es
                    .as_array()
                    .ok_or_else(|| format!("descriptors[{i}].entries must be an array"))?;
                for (j, e) in es.iter().enumerate() {
                    let e = e.as_object().ok_or_else(|| {
                        format!("descriptors[{i}].entries[{j}] must be an object")
                    })?;
                    let key = string(e.get("key"), &format!("descriptors[{i}].entries[{j}].key"))?;
                    let value = string(
                        e.get("value"),
                        &format!("descriptors[{i}].entries[{j}].value"),
                    )?;
                    entries.push((key, value));
                }
            }
            // UInt64Value: a bare number or string in proto3 JSON; {"value": n} is accepted too.
            let h = match field(d, "hits_addend", "hitsAddend") {
                None => None,
                Some(Value::Object(w)) => w
                    .get("value")
                    .map(|x| uint(x, &format!("descriptors[{i}].hits_addend"), u64::MAX))
                    .transpose()?,
                Some(x) => Some(uint(x, &format!("descriptors[{i}].hits_addend"), u64::MAX)?),
            };
            descriptors.push((entries, h));
        }
    }
    Ok(OwnedRequest {
        domain,
        descriptors,
        hits_addend,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_proto3_json_forms() {
        let r = parse_request(&json!({"domain": "d", "hitsAddend": "3", "descriptors": [
            {"entries": [{"key": "k", "value": "v"}], "hits_addend": 0}]}))
        .unwrap();
        assert_eq!(r.hits_addend, Some(3));
        assert_eq!(r.descriptors[0].1, Some(0));
        assert_eq!(r.descriptors[0].0, vec![("k".into(), "v".into())]);
    }

    #[test]
    fn malformed_fields_are_named() {
        let e = parse_request(&json!({"domain": 3})).unwrap_err();
        assert!(e.contains("domain"), "{e}");
        let e = parse_request(&json!({"domain": "d", "hits_addend": -1})).unwrap_err();
        assert!(e.contains("hits_addend"), "{e}");
        let e = parse_request(&json!({"domain": "d", "hits_addend": 4294967296u64})).unwrap_err();
        assert!(e.contains("4294967295"), "{e}");
        let e = parse_request(&json!({"domain": "d", "descriptors": [{"entries": [{"key": 1}]}]}))
            .unwrap_err();
        assert!(e.contains("descriptors[0].entries[0].key"), "{e}");
        assert!(parse_request(&json!([1, 2])).is_err());
    }
}
