//! A small, tolerant reader of nginx's configuration syntax, for `diana check-nginx`.
//!
//! It reads what nginx's own tokenizer (`ngx_conf_read_token`) reads: directives are words
//! ended by `;` or followed by a `{ }` block, `#` starts a comment where a word could
//! start, words may be single- or double-quoted, and a backslash escapes the next
//! character (`\"`, `\'`, `\\` lose the backslash, `\n`, `\r`, `\t` become the control
//! character, anything else is kept as written, as nginx does). `include` directives are
//! replaced by the directives of the files they name: a relative path is relative to the
//! main file's directory (nginx's configuration prefix), `*`, `?` and `[...]` match as in
//! glob(3), and includes nest at most [`MAX_INCLUDE_DEPTH`] deep.
//!
//! It checks no directive's meaning: whatever nginx would refuse beyond the syntax,
//! `nginx -t` still says.

use std::path::{Component, Path, PathBuf};

/// Includes nest at most this deep (a file that includes itself stops here).
pub const MAX_INCLUDE_DEPTH: usize = 16;

/// One directive: its name, its arguments (unquoted and unescaped, as nginx passes them
/// on), where it starts, and its block if it has one.
#[derive(Debug, Clone)]
pub struct Directive {
    pub name: String,
    pub args: Vec<String>,
    /// Index into [`Config::files`].
    pub file: usize,
    pub line: usize,
    pub block: Option<Vec<Directive>>,
}

impl Directive {
    /// The directives of its block (none for a simple directive).
    pub fn children(&self) -> &[Directive] {
        self.block.as_deref().unwrap_or(&[])
    }
}

/// A configuration with its includes expanded.
#[derive(Debug)]
pub struct Config {
    /// Every file read, the main file first, as they were named (joined to the main
    /// file's directory when relative).
    pub files: Vec<PathBuf>,
    pub directives: Vec<Directive>,
}

impl Config {
    /// `file:line` of a directive.
    pub fn at(&self, directive: &Directive) -> String {
        self.at_line(directive.file, directive.line)
    }

    pub fn at_line(&self, file: usize, line: usize) -> String {
        match self.files.get(file) {
            Some(path) => format!("{}:{line}", path.display()),
            None => format!("?:{line}"),
        }
    }
}

/// Why the configuration could not be read: `file:line: message`, or an I/O error.
#[derive(Debug)]
pub struct ReadError {
    pub message: String,
}

/// Reads `path` and every file it includes.
pub fn load(path: &Path) -> Result<Config, ReadError> {
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut config = Config {
        files: Vec::new(),
        directives: Vec::new(),
    };
    let directives = load_file(path, &base, 0, &mut config, None)?;
    config.directives = directives;
    Ok(config)
}

fn load_file(
    path: &Path,
    base: &Path,
    depth: usize,
    config: &mut Config,
    included_at: Option<String>,
) -> Result<Vec<Directive>, ReadError> {
    let text = std::fs::read(path).map_err(|err| ReadError {
        message: match &included_at {
            Some(at) => format!("{at}: cannot read included file {}: {err}", path.display()),
            None => format!("diana: cannot read {}: {err}", path.display()),
        },
    })?;
    // nginx reads bytes; a document must be UTF-8 anyway, so invalid bytes (in comments,
    // say) are replaced rather than refused.
    let text = String::from_utf8_lossy(&text);
    let file = config.files.len();
    config.files.push(path.to_path_buf());
    let tokens = tokenize(&text).map_err(|(line, message)| ReadError {
        message: format!("{}: {message}", config.at_line(file, line)),
    })?;
    let mut parser = Parser {
        tokens: &tokens,
        next: 0,
        file,
    };
    let directives = parser.block(None).map_err(|(line, message)| ReadError {
        message: format!("{}: {message}", config.at_line(file, line)),
    })?;
    expand_includes(directives, base, depth, config)
}

/// Replaces each `include` by the directives of the files it names, in every block.
fn expand_includes(
    directives: Vec<Directive>,
    base: &Path,
    depth: usize,
    config: &mut Config,
) -> Result<Vec<Directive>, ReadError> {
    let mut out = Vec::with_capacity(directives.len());
    for mut directive in directives {
        if directive.name == "include" && directive.block.is_none() {
            let at = config.at(&directive);
            let [pattern] = directive.args.as_slice() else {
                return Err(ReadError {
                    message: format!("{at}: `include` takes one file name"),
                });
            };
            if depth + 1 > MAX_INCLUDE_DEPTH {
                return Err(ReadError {
                    message: format!(
                        "{at}: includes nest deeper than {MAX_INCLUDE_DEPTH} files (does a file include itself?)"
                    ),
                });
            }
            let pattern = base.join(pattern);
            let paths = if has_wildcard(&pattern) {
                glob(&pattern)
            } else {
                vec![pattern]
            };
            for path in paths {
                let included = load_file(&path, base, depth + 1, config, Some(at.clone()))?;
                out.extend(included);
            }
            continue;
        }
        if let Some(block) = directive.block.take() {
            directive.block = Some(expand_includes(block, base, depth, config)?);
        }
        out.push(directive);
    }
    Ok(out)
}

#[derive(Debug, PartialEq)]
enum Token {
    Word(String, usize),
    Semicolon(usize),
    Open(usize),
    Close(usize),
}

/// nginx's tokens of `text`; on error the line and what is wrong.
fn tokenize(text: &str) -> Result<Vec<Token>, (usize, String)> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while let Some(&c) = chars.get(i) {
        i += 1;
        match c {
            '\n' => line += 1,
            c if c.is_whitespace() => {}
            '#' => {
                while let Some(&c) = chars.get(i) {
                    if c == '\n' {
                        break;
                    }
                    i += 1;
                }
            }
            ';' => tokens.push(Token::Semicolon(line)),
            '{' => tokens.push(Token::Open(line)),
            '}' => tokens.push(Token::Close(line)),
            '"' | '\'' => {
                let start = line;
                let mut raw = String::new();
                loop {
                    let Some(&next) = chars.get(i) else {
                        return Err((
                            start,
                            format!(
                                "unterminated quoted string: the {c} opened here is never closed"
                            ),
                        ));
                    };
                    i += 1;
                    if next == c {
                        break;
                    }
                    if next == '\n' {
                        line += 1;
                    }
                    raw.push(next);
                    if next == '\\' {
                        if let Some(&escaped) = chars.get(i) {
                            i += 1;
                            if escaped == '\n' {
                                line += 1;
                            }
                            raw.push(escaped);
                        }
                    }
                }
                tokens.push(Token::Word(unescape(&raw), start));
            }
            _ => {
                let start = line;
                let mut raw = String::from(c);
                let mut escaped = c == '\\';
                let mut variable = c == '$' && chars.get(i) == Some(&'{');
                while let Some(&next) = chars.get(i) {
                    if escaped {
                        escaped = false;
                    } else if variable {
                        // `${name}`: nginx reads the braces as part of the word.
                        if next == '}' {
                            variable = false;
                        }
                    } else if next.is_whitespace() || matches!(next, ';' | '{' | '}') {
                        break;
                    } else if next == '\\' {
                        escaped = true;
                    } else if next == '$' && chars.get(i + 1) == Some(&'{') {
                        variable = true;
                    }
                    if next == '\n' {
                        line += 1;
                    }
                    raw.push(next);
                    i += 1;
                }
                tokens.push(Token::Word(unescape(&raw), start));
            }
        }
    }
    Ok(tokens)
}

/// A word as nginx passes it on: `\"`, `\'` and `\\` lose their backslash, `\n`, `\r`
/// and `\t` are the control characters, any other backslash stays.
fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.peek() {
                Some(&next @ ('"' | '\'' | '\\')) => {
                    out.push(next);
                    chars.next();
                    continue;
                }
                Some('n') => {
                    out.push('\n');
                    chars.next();
                    continue;
                }
                Some('r') => {
                    out.push('\r');
                    chars.next();
                    continue;
                }
                Some('t') => {
                    out.push('\t');
                    chars.next();
                    continue;
                }
                _ => {}
            }
        }
        out.push(c);
    }
    out
}

struct Parser<'t> {
    tokens: &'t [Token],
    next: usize,
    file: usize,
}

impl Parser<'_> {
    /// The directives up to the end of the file (`opened` None) or to the `}` closing the
    /// block opened on line `opened`.
    fn block(&mut self, opened: Option<usize>) -> Result<Vec<Directive>, (usize, String)> {
        let mut directives = Vec::new();
        let mut words: Vec<(String, usize)> = Vec::new();
        loop {
            let token = self.tokens.get(self.next);
            self.next += 1;
            match token {
                None => {
                    if let Some((name, line)) = words.first() {
                        return Err((
                            *line,
                            format!("`{name}` is not ended by `;` before the end of the file"),
                        ));
                    }
                    return match opened {
                        Some(line) => Err((
                            line,
                            "the block opened here is not closed by `}` before the end of the file"
                                .into(),
                        )),
                        None => Ok(directives),
                    };
                }
                Some(Token::Word(word, line)) => words.push((word.clone(), *line)),
                Some(Token::Semicolon(line)) => {
                    let directive = self.directive(&mut words, *line, ";")?;
                    directives.push(directive);
                }
                Some(Token::Open(line)) => {
                    let mut directive = self.directive(&mut words, *line, "{")?;
                    directive.block = Some(self.block(Some(directive.line))?);
                    directives.push(directive);
                }
                Some(Token::Close(line)) => {
                    if let Some((name, line)) = words.first() {
                        return Err((*line, format!("`{name}` is not ended by `;`")));
                    }
                    return match opened {
                        Some(_) => Ok(directives),
                        None => Err((*line, "unexpected `}` (no block is open)".into())),
                    };
                }
            }
        }
    }

    fn directive(
        &self,
        words: &mut Vec<(String, usize)>,
        line: usize,
        ended_by: &str,
    ) -> Result<Directive, (usize, String)> {
        let mut taken = std::mem::take(words).into_iter();
        let Some((name, start)) = taken.next() else {
            return Err((
                line,
                format!("unexpected `{ended_by}` (no directive before it)"),
            ));
        };
        Ok(Directive {
            name,
            args: taken.map(|(word, _)| word).collect(),
            file: self.file,
            line: start,
            block: None,
        })
    }
}

fn has_wildcard(path: &Path) -> bool {
    path.to_string_lossy().contains(['*', '?', '['])
}

/// The files matching `pattern`, sorted as glob(3) sorts them; none is not an error (as
/// in nginx).
fn glob(pattern: &Path) -> Vec<PathBuf> {
    let mut found = vec![PathBuf::new()];
    for component in pattern.components() {
        let part = component.as_os_str().to_string_lossy();
        let wild = matches!(component, Component::Normal(_)) && part.contains(['*', '?', '[']);
        if !wild {
            for path in &mut found {
                path.push(component.as_os_str());
            }
            continue;
        }
        let mut next = Vec::new();
        for dir in &found {
            let read = if dir.as_os_str().is_empty() {
                std::fs::read_dir(".")
            } else {
                std::fs::read_dir(dir)
            };
            let Ok(entries) = read else { continue };
            let mut names: Vec<String> = entries
                .filter_map(Result::ok)
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| {
                    (part.starts_with('.') || !name.starts_with('.')) && wildcard_match(&part, name)
                })
                .collect();
            names.sort();
            next.extend(names.into_iter().map(|name| dir.join(name)));
        }
        found = next;
    }
    found.retain(|path| path.is_file());
    found
}

/// `name` matches the glob `pattern` (`*`, `?`, `[abc]`, `[a-z]`, `[!x]`).
fn wildcard_match(pattern: &str, name: &str) -> bool {
    let pattern: Vec<char> = pattern.chars().collect();
    let name: Vec<char> = name.chars().collect();
    matches_from(&pattern, &name)
}

fn matches_from(pattern: &[char], name: &[char]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some(('*', rest)) => {
            (0..=name.len()).any(|skip| matches_from(rest, name.get(skip..).unwrap_or(&[])))
        }
        Some(('?', rest)) => name
            .split_first()
            .is_some_and(|(_, name)| matches_from(rest, name)),
        Some(('[', rest)) => {
            let Some(close) = rest.iter().skip(1).position(|&c| c == ']').map(|at| at + 1) else {
                // No closing bracket: a literal `[`.
                return name
                    .split_first()
                    .is_some_and(|(&c, name)| c == '[' && matches_from(rest, name));
            };
            let (class, after) = rest.split_at(close);
            let after = after.get(1..).unwrap_or(&[]);
            let (negated, class) = match class.split_first() {
                Some(('!' | '^', class)) => (true, class),
                _ => (false, class),
            };
            let Some((&c, name)) = name.split_first() else {
                return false;
            };
            let mut hit = false;
            let mut k = 0;
            while let Some(&low) = class.get(k) {
                if class.get(k + 1) == Some(&'-') {
                    if let Some(&high) = class.get(k + 2) {
                        hit |= low <= c && c <= high;
                        k += 3;
                        continue;
                    }
                }
                hit |= low == c;
                k += 1;
            }
            hit != negated && matches_from(after, name)
        }
        Some((&literal, rest)) => name
            .split_first()
            .is_some_and(|(&c, name)| c == literal && matches_from(rest, name)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Vec<String> {
        tokenize(text)
            .unwrap()
            .into_iter()
            .map(|token| match token {
                Token::Word(word, line) => format!("{line}:{word}"),
                Token::Semicolon(line) => format!("{line}:;"),
                Token::Open(line) => format!("{line}:{{"),
                Token::Close(line) => format!("{line}:}}"),
            })
            .collect()
    }

    #[test]
    fn tokens_as_nginx_reads_them() {
        assert_eq!(
            words("a 'b c'; # comment ;{\nd\"e {x \"f\\\"g\\n\" ${h}i;}"),
            ["1:a", "1:b c", "1:;", "2:d\"e", "2:{", "2:x", "2:f\"g\n", "2:${h}i", "2:;", "2:}"]
        );
        assert_eq!(words("p 'a\\\\n\\x';"), ["1:p", "1:a\\n\\x", "1:;"]);
        assert_eq!(
            words("p '{\n  \"a\": 1\n}'\n;"),
            ["1:p", "1:{\n  \"a\": 1\n}", "4:;"]
        );
        assert_eq!(tokenize("a 'b;\n\n").unwrap_err().0, 1);
    }

    #[test]
    fn every_truncation_of_the_example_is_read_or_refused_never_a_panic() {
        let text = include_str!("../../../nginx/nginx.conf");
        let mut refused = 0;
        for (at, _) in text.char_indices() {
            let Some(prefix) = text.get(..at) else {
                continue;
            };
            let parsed = tokenize(prefix).and_then(|tokens| {
                Parser {
                    tokens: &tokens,
                    next: 0,
                    file: 0,
                }
                .block(None)
            });
            if let Err((line, _)) = parsed {
                assert!(line >= 1 && line <= prefix.lines().count().max(1), "{at}");
                refused += 1;
            }
        }
        assert!(refused > 0);
    }

    #[test]
    fn globs_match_like_glob3() {
        for (pattern, name, ok) in [
            ("*.conf", "a.conf", true),
            ("*.conf", "a.conf~", false),
            ("a?.conf", "ab.conf", true),
            ("[a-c]*", "b", true),
            ("[!a-c]*", "b", false),
            ("x[", "x[", true),
        ] {
            assert_eq!(wildcard_match(pattern, name), ok, "{pattern} {name}");
        }
    }
}
