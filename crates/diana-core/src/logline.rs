//! One `diana:` per log line, on every host.
//!
//! The hosts put their own prefix before a plugin's message:
//! - Envoy: `wasm log <root_id> <vm_id>: <message>`, each of `root_id` and `vm_id` only
//!   when it is configured (with `root_id: diana` and `vm_id: diana`, as in every Envoy
//!   configuration of this repository: `wasm log diana diana: <message>`; the filter's
//!   `name` does not appear). The word before the colon already says `diana:`.
//! - ngx_wasm_module (nginx, Kong): `[proxy-wasm]["<filter name>" #<id>] <message>`: the
//!   filter's name, in quotes and brackets, never `diana:`.
//!
//! So the filter's logger adds `diana: ` to a message unless the host's prefix already
//! ends in `diana:`. Messages are written with a leading `diana: ` (so that they read well
//! wherever they surface); [`line()`] removes it or keeps it, never doubles it.

use std::borrow::Cow;

/// What a log line starts with when the host does not name Diana itself.
pub const PREFIX: &str = "diana: ";

/// ngx_wasm_module answers `plugin_root_id` with `"0"` (see the filter's host detection).
pub fn is_nginx_root_id(root_id: Option<&[u8]>) -> bool {
    root_id == Some(b"0".as_slice())
}

/// True when the host's own prefix ends in `diana:`: Envoy, whose prefix ends with the
/// VM id (or, without one, the root id) and a colon, when that word is `diana`.
pub fn host_says_diana(root_id: Option<&[u8]>, vm_id: Option<&[u8]>) -> bool {
    if is_nginx_root_id(root_id) {
        return false;
    }
    non_empty(vm_id).or(non_empty(root_id)) == Some(b"diana".as_slice())
}

fn non_empty(value: Option<&[u8]>) -> Option<&[u8]> {
    value.filter(|value| !value.is_empty())
}

/// `message` with exactly one leading `diana: ` when the host does not say it, none when it
/// does.
pub fn line(message: &str, host_says_diana: bool) -> Cow<'_, str> {
    let bare = message.strip_prefix(PREFIX).unwrap_or(message);
    if host_says_diana {
        Cow::Borrowed(bare)
    } else if bare.len() == message.len() {
        Cow::Owned(format!("{PREFIX}{message}"))
    } else {
        Cow::Borrowed(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn who_names_diana() {
        /// (`plugin_root_id`, `plugin_vm_id`, the host's prefix ends in `diana:`).
        type Case = (Option<&'static [u8]>, Option<&'static [u8]>, bool);
        let cases: [Case; 8] = [
            // Every Envoy configuration of this repository: `wasm log diana diana: `.
            (Some(b"diana"), Some(b"diana"), true),
            // `wasm log r1 diana: `
            (Some(b"r1"), Some(b"diana"), true),
            // `wasm log diana v1: `: the word before the colon is the VM id.
            (Some(b"diana"), Some(b"v1"), false),
            // No VM id: `wasm log diana: `
            (Some(b"diana"), Some(b""), true),
            (Some(b"diana"), None, true),
            // Nothing configured: `wasm log: `
            (Some(b""), Some(b""), false),
            // ngx_wasm_module: `[proxy-wasm]["diana" #0] `
            (Some(b"0"), None, false),
            (Some(b"0"), Some(b"diana"), false),
        ];
        for (root_id, vm_id, expected) in cases {
            assert_eq!(
                host_says_diana(root_id, vm_id),
                expected,
                "{root_id:?} {vm_id:?}"
            );
        }
    }

    #[test]
    fn exactly_one_prefix() {
        for (message, host_says, expected) in [
            (
                "diana: configuration rejected: x",
                true,
                "configuration rejected: x",
            ),
            (
                "diana: configuration rejected: x",
                false,
                "diana: configuration rejected: x",
            ),
            ("panicked at src/x.rs", false, "diana: panicked at src/x.rs"),
            ("panicked at src/x.rs", true, "panicked at src/x.rs"),
            // Only a leading prefix is Diana's; one inside the message stays.
            ("rule diana: 5", true, "rule diana: 5"),
            ("diana: diana: twice", true, "diana: twice"),
            ("", false, "diana: "),
        ] {
            assert_eq!(
                line(message, host_says),
                expected,
                "{message:?} {host_says}"
            );
        }
        // As the hosts print them.
        for message in [
            "diana: configuration rejected: rpu",
            "quota service is back",
        ] {
            for (host, says) in [
                ("wasm log diana diana: ", true),
                ("wasm log r1 v1: ", false),
                ("[proxy-wasm][\"diana\" #0] ", false),
            ] {
                let printed = format!("{host}{}", line(message, says));
                assert_eq!(printed.matches("diana:").count(), 1, "{printed}");
            }
        }
    }
}
