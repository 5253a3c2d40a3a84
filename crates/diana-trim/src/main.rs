//! `diana-trim IN OUT`: writes IN without the proxy-wasm callbacks Diana does not
//! implement (see the library docs); `diana-trim --bodies IN OUT` keeps the callbacks of
//! answers' bodies (for documents that read usage from them). `diana-trim --list FILE`:
//! prints FILE's exports.

use diana_trim::{Keep, TrimError};
use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Why the command failed; printed after `diana-trim: `.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error("usage: diana-trim [--bodies] IN OUT | diana-trim --list FILE")]
    Usage,
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// `--list` of a module that cannot be read.
    #[error(transparent)]
    List(#[from] TrimError),
    /// A module that cannot be trimmed, with its path.
    #[error("{}: {source}", input.display())]
    Trim {
        input: PathBuf,
        #[source]
        source: TrimError,
    },
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot move {} to {}: {source}", from.display(), to.display())]
    Move {
        from: PathBuf,
        to: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.as_slice() {
        [flag, file] if flag == "--list" => list(Path::new(file)),
        [flag, input, output] if flag == "--bodies" => {
            trim(Path::new(input), Path::new(output), Keep::Bodies)
        }
        [input, output] => trim(Path::new(input), Path::new(output), Keep::Headers),
        _ => Err(Failure::Usage),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("diana-trim: {failure}");
            ExitCode::FAILURE
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, Failure> {
    std::fs::read(path).map_err(|source| Failure::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn list(path: &Path) -> Result<(), Failure> {
    for name in diana_trim::exports(&read(path)?)? {
        println!("{name}");
    }
    Ok(())
}

fn trim(input: &Path, output: &Path, keep: Keep) -> Result<(), Failure> {
    let before = read(input)?;
    let trimmed = diana_trim::trim(&before, keep).map_err(|source| Failure::Trim {
        input: input.to_path_buf(),
        source,
    })?;
    // Written beside the target and renamed over it, so a reader never sees half a module.
    let partial = output.with_extension("wasm.partial");
    std::fs::write(&partial, &trimmed.wasm).map_err(|source| Failure::Write {
        path: partial.clone(),
        source,
    })?;
    std::fs::rename(&partial, output).map_err(|source| Failure::Move {
        from: partial.clone(),
        to: output.to_path_buf(),
        source,
    })?;
    println!(
        "{} -> {}: {} -> {} bytes; removed {}",
        input.display(),
        output.display(),
        before.len(),
        trimmed.wasm.len(),
        if trimmed.removed.is_empty() {
            "nothing".to_string()
        } else {
            trimmed.removed.join(", ")
        }
    );
    Ok(())
}
