//! The fuzz targets, and the corpus they start from.

pub mod config;
pub mod identity;
pub mod jwt;
pub mod path;
pub mod wire;

use crate::Target;

/// Every target, in run order.
pub fn all() -> Vec<Box<dyn Target>> {
    let corpus = config::Corpus::load();
    vec![
        Box::new(config::Yaml(corpus.clone())),
        Box::new(config::Json(corpus.clone())),
        Box::new(config::Forms(corpus)),
        Box::new(path::Normalise),
        Box::new(path::Spellings),
        Box::new(identity::Identities::new()),
        Box::new(jwt::Claims),
        Box::new(wire::Answers),
        Box::new(wire::Callouts),
    ]
}
