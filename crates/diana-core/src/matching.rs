//! Which resource blocks apply to a request path.
//!
//! A block's `Url` is a path prefix matched on segment boundaries: `/sample` matches
//! `/sample` and `/sample/x`, not `/samples`; `/` matches every path. Both sides are
//! normalised ([`crate::path::normalize`]): the policy's urls when the document is parsed,
//! the request path by the caller. Every matching block applies, least specific first
//! (the order of [`Policy::resources`]).
//!
//! A block's `path` options ([`PathOptions`]) loosen its own comparison, for a backend that
//! reads paths more loosely than Diana spells them: `strip_parameters` compares the path
//! without its segments' `;parameters` ([`crate::path::strip_parameters`]),
//! `case_insensitive` compares letters in any case. Each block says for itself: a block
//! below it compares as it says. The walk allocates nothing, except the path without its
//! parameters, once per request, when a block strips them and the path has a `;`.

use crate::config::{PathOptions, Policy, Resource, Rule};
use crate::path::{prefix_matches_ignoring_case, strip_parameters};
use std::borrow::Cow;
use std::iter::Enumerate;
use std::slice;

pub use crate::path::prefix_matches;

/// The resource blocks of `policy` that apply to the normalised `path`, least specific
/// first, each with its index in [`Policy::resources`].
pub fn matching<'p, 'q>(policy: &'p Policy, path: &'q [u8]) -> Matches<'p, 'q> {
    matching_in(&policy.resources, path)
}

/// [`matching`] over a slice of resources (already in evaluation order).
pub fn matching_in<'p, 'q>(resources: &'p [Resource], path: &'q [u8]) -> Matches<'p, 'q> {
    Matches {
        resources: resources.iter().enumerate(),
        path,
        stripped: None,
    }
}

/// Whether `resource` applies to the normalised `path`, by its own [`PathOptions`].
pub fn covers(resource: &Resource, path: &[u8]) -> bool {
    let stripped = if resource.path.strip_parameters {
        strip_parameters(path)
    } else {
        Cow::Borrowed(path)
    };
    compares(resource, &stripped)
}

/// `resource`'s Url against `path` (already without parameters if it strips them).
fn compares(resource: &Resource, path: &[u8]) -> bool {
    let url = resource.url.as_bytes();
    match resource.path {
        PathOptions {
            case_insensitive: true,
            ..
        } => prefix_matches_ignoring_case(url, path),
        PathOptions { .. } => prefix_matches(url, path),
    }
}

/// The rules that apply to the normalised `path`, in evaluation order: blocks least
/// specific first, rules in document order within a block.
pub fn matching_rules<'p, 'q>(
    policy: &'p Policy,
    path: &'q [u8],
) -> impl Iterator<Item = (&'p Resource, &'p Rule)> + use<'p, 'q> {
    matching(policy, path)
        .flat_map(|(_, resource)| resource.rules.iter().map(move |rule| (resource, rule)))
}

/// Iterator returned by [`matching`]: `(index in Policy::resources, resource)`.
#[derive(Debug, Clone)]
pub struct Matches<'p, 'q> {
    resources: Enumerate<slice::Iter<'p, Resource>>,
    path: &'q [u8],
    /// The path without its segments' parameters, once a block that strips them asked.
    stripped: Option<Cow<'q, [u8]>>,
}

impl<'p> Iterator for Matches<'p, '_> {
    type Item = (usize, &'p Resource);

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let (index, resource) = self.resources.next()?;
            let path: &[u8] = if resource.path.strip_parameters {
                let path = self.path;
                self.stripped.get_or_insert_with(|| strip_parameters(path))
            } else {
                self.path
            };
            if compares(resource, path) {
                return Some((index, resource));
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, self.resources.size_hint().1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{GlobalSpec, ResponseSpec};
    use crate::path::normalize;

    #[test]
    fn prefix_table() {
        let table: &[(&str, &str, bool)] = &[
            ("/", "/", true),
            ("/", "/anything/at/all", true),
            ("/sample", "/sample", true),
            ("/sample", "/sample/x", true),
            ("/sample", "/sample/x/y", true),
            ("/sample", "/samples", false),
            ("/sample", "/sample-x", false),
            ("/sample", "/sampl", false),
            ("/sample", "/", false),
            ("/sample", "/other/sample", false),
            ("/sample/x", "/sample", false),
            ("/sample/x", "/sample/x", true),
            ("/sample/x", "/sample/xy", false),
            ("/sample/x", "/sample/x/1", true),
            ("/a%2Fb", "/a%2Fb/c", true),
            ("/a%2Fb", "/a/b", false),
        ];
        for (prefix, path, want) in table {
            assert_eq!(
                prefix_matches(prefix.as_bytes(), path.as_bytes()),
                *want,
                "{prefix} vs {path}"
            );
        }
    }

    fn policy(urls: &[&str]) -> Policy {
        Policy {
            resources: urls
                .iter()
                .map(|url| Resource {
                    url: url.to_string(),
                    rules: Vec::new(),
                    breaker: None,
                    path: PathOptions::default(),
                })
                .collect(),
            response: ResponseSpec::default(),
            global: GlobalSpec::default(),
            metrics: None,
            remote: None,
            dry_run: false,
            on_invalid_config: Default::default(),
        }
    }

    fn urls(policy: &Policy, raw: &[u8]) -> Vec<(usize, String)> {
        let path = normalize(raw);
        matching(policy, &path)
            .map(|(index, resource)| (index, resource.url.clone()))
            .collect()
    }

    /// A raw request path, and the blocks that apply to it: `(index, url)`.
    type Case<'a> = (&'a [u8], &'a [(usize, &'a str)]);

    fn assert_matches(policy: &Policy, table: &[Case]) {
        for (raw, want) in table {
            let want: Vec<(usize, String)> =
                want.iter().map(|(i, url)| (*i, url.to_string())).collect();
            assert_eq!(
                urls(policy, raw),
                want,
                "{:?}",
                String::from_utf8_lossy(raw)
            );
        }
    }

    #[test]
    fn matching_table() {
        // Least specific first, as the parser orders them.
        let policy = policy(&["/", "/sample", "/other", "/sample/x"]);
        let table: &[Case] = &[
            (b"/", &[(0, "/")]),
            (b"/sample", &[(0, "/"), (1, "/sample")]),
            (b"//sample", &[(0, "/"), (1, "/sample")]),
            (b"/%73ample?x=1", &[(0, "/"), (1, "/sample")]),
            (b"/x/../sample/./", &[(0, "/"), (1, "/sample")]),
            (b"/samples", &[(0, "/")]),
            (
                b"/sample/x/1",
                &[(0, "/"), (1, "/sample"), (3, "/sample/x")],
            ),
            (b"/sample/x/..", &[(0, "/"), (1, "/sample")]),
            (b"/other", &[(0, "/"), (2, "/other")]),
            (b"/sample%2Fx", &[(0, "/")]),
            (b"\xff\xfe", &[(0, "/")]),
        ];
        assert_matches(&policy, table);
    }

    /// `path` options loosen each block's own comparison: `;jsessionid` and upper case
    /// (issue 41, item 6).
    #[test]
    fn a_block_may_ignore_parameters_and_case() {
        let mut policy = policy(&["/", "/admin", "/api", "/api/keys"]);
        let options = |strip_parameters, case_insensitive| PathOptions {
            strip_parameters,
            case_insensitive,
        };
        policy.resources[1].path = options(true, true);
        policy.resources[2].path = options(false, true);
        policy.resources[3].path = options(true, false);
        let table: &[Case] = &[
            (b"/admin;jsessionid=1A2B/users", &[(0, "/"), (1, "/admin")]),
            (b"/ADMIN/users", &[(0, "/"), (1, "/admin")]),
            (b"/Admin;jsessionid=1", &[(0, "/"), (1, "/admin")]),
            (b"/public/..;/admin", &[(0, "/"), (1, "/admin")]),
            (b"/%41dmin", &[(0, "/"), (1, "/admin")]),
            (b"/admins", &[(0, "/")]),
            (b"/API/Keys", &[(0, "/"), (2, "/api")]),
            // `/api/keys` strips parameters but compares case: it says so for itself.
            (b"/api;v=1/keys;x", &[(0, "/"), (3, "/api/keys")]),
            (b"/api/keys;x", &[(0, "/"), (2, "/api"), (3, "/api/keys")]),
            (b"/Api/KEYS", &[(0, "/"), (2, "/api")]),
        ];
        assert_matches(&policy, table);
        // Without options, both spellings escape the block: what the options are for.
        let plain = self::policy(&["/admin"]);
        assert!(urls(&plain, b"/admin;jsessionid=1").is_empty());
        assert!(urls(&plain, b"/ADMIN").is_empty());
        assert!(covers(&policy.resources[1], b"/ADMIN;x/y"));
        assert!(!covers(&plain.resources[0], b"/ADMIN;x/y"));
    }

    #[test]
    fn no_root_block() {
        let policy = policy(&["/sample"]);
        assert!(urls(&policy, b"/").is_empty());
        assert!(urls(&policy, b"/samples").is_empty());
        assert_eq!(
            urls(&policy, b"/sample/1"),
            vec![(0, "/sample".to_string())]
        );
        assert_eq!(matching_rules(&policy, b"/sample").count(), 0);
    }
}
