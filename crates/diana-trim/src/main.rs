//! `diana-trim IN OUT`: writes IN without the proxy-wasm callbacks Diana does not
//! implement (see the library docs). `diana-trim --list FILE`: prints FILE's exports.

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.as_slice() {
        [flag, file] if flag == "--list" => list(Path::new(file)),
        [input, output] => trim(Path::new(input), Path::new(output)),
        _ => Err("usage: diana-trim IN OUT | diana-trim --list FILE".to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("diana-trim: {message}");
            ExitCode::FAILURE
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn list(path: &Path) -> Result<(), String> {
    for name in diana_trim::exports(&read(path)?)? {
        println!("{name}");
    }
    Ok(())
}

fn trim(input: &Path, output: &Path) -> Result<(), String> {
    let before = read(input)?;
    let trimmed = diana_trim::trim(&before).map_err(|e| format!("{}: {e}", input.display()))?;
    // Written beside the target and renamed over it, so a reader never sees half a module.
    let partial = output.with_extension("wasm.partial");
    std::fs::write(&partial, &trimmed.wasm)
        .map_err(|e| format!("cannot write {}: {e}", partial.display()))?;
    std::fs::rename(&partial, output).map_err(|e| {
        format!(
            "cannot move {} to {}: {e}",
            partial.display(),
            output.display()
        )
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
