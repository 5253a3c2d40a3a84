//! Host property values as the hosts really return them: Envoy gives `source.address` as
//! `ip:port` (IPv6 as `[ip]:port`), nginx gives the bare IP. Both become the bare IP.

/// The client IP from a `source.address` property value, with any port removed.
pub fn client_ip_from_address(value: &[u8]) -> Option<Vec<u8>> {
    let value = value.trim_ascii();
    if value.is_empty() {
        return None;
    }
    if let Some(rest) = value.strip_prefix(b"[") {
        let end = rest.iter().position(|&b| b == b']')?;
        return rest.get(..end).map(<[u8]>::to_vec);
    }
    let colons = value.iter().filter(|&&b| b == b':').count();
    if colons == 1 {
        let end = value.iter().position(|&b| b == b':')?;
        return value.get(..end).map(<[u8]>::to_vec);
    }
    Some(value.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_and_nginx_spellings_give_the_bare_ip() {
        let cases: [(&[u8], Option<&[u8]>); 7] = [
            (b"127.0.0.1:54321", Some(b"127.0.0.1")),
            (b"127.0.0.1", Some(b"127.0.0.1")),
            (b"[::1]:8080", Some(b"::1")),
            (b"::1", Some(b"::1")),
            (b"2001:db8::7", Some(b"2001:db8::7")),
            (b"", None),
            (b"[broken", None),
        ];
        for (input, expected) in cases {
            assert_eq!(
                client_ip_from_address(input).as_deref(),
                expected,
                "{input:?}"
            );
        }
    }
}
