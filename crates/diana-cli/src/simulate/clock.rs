//! Timestamps of a request log: RFC 3339 text or decimal epoch seconds, to nanoseconds
//! since the epoch (exactly, digit by digit: no float rounding), and back to text.

use diana_core::time::{Instant, NANOS_PER_SECOND};

const SECONDS_PER_DAY: u64 = 86_400;

/// Nanoseconds in a second, as the raw number the parsing works in.
const SECOND: u64 = NANOS_PER_SECOND.get();

/// Days from 1970-01-01 to the given civil date (proleptic Gregorian), or `None` before
/// 1970. Howard Hinnant's `days_from_civil`.
fn days_from_civil(year: u64, month: u64, day: u64) -> Option<u64> {
    let year = if month <= 2 {
        year.checked_sub(1)?
    } else {
        year
    };
    let era = year / 400;
    let yoe = year - era * 400;
    let shifted_month = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * shifted_month + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).checked_sub(719_468)
}

/// The civil date of a day count since 1970-01-01.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

fn days_in_month(year: u64, month: u64) -> u64 {
    match month {
        4 | 6 | 9 | 11 => 30,
        2 if year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400)) => {
            29
        }
        2 => 28,
        _ => 31,
    }
}

/// A run of exactly `count` ASCII digits at the start of `text`, and the rest.
fn digits(text: &str, count: usize) -> Option<(u64, &str)> {
    let head = text.get(..count)?;
    if !head.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((head.parse().ok()?, text.get(count..)?))
}

/// Nanoseconds of a fraction written after the decimal point (digits beyond the ninth
/// are dropped), or `None` when it is not all digits.
fn fraction_nanos(fraction: &str) -> Option<u64> {
    if fraction.is_empty() || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mut nanos = 0;
    for (place, byte) in fraction.bytes().take(9).enumerate() {
        nanos += u64::from(byte - b'0') * 10u64.pow(8 - place as u32);
    }
    Some(nanos)
}

/// A log time that cannot be read, as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimeError {
    #[error("{text:?} is not an RFC 3339 time (like 2026-11-22T10:00:00.250Z) at or after 1970")]
    NotRfc3339 { text: String },
    /// Not decimal epoch seconds, or out of range (before 1970, past what nanoseconds hold).
    #[error("{text} is not a time in seconds since the epoch (1970) or later")]
    NotEpochSeconds { text: String },
}

/// Parses an RFC 3339 date-time (`2026-11-22T10:00:00.123Z`, `...+01:00`; a space or a
/// lower-case `t`/`z` is accepted as well) into an instant.
pub fn parse_rfc3339(text: &str) -> Result<Instant, TimeError> {
    parse_rfc3339_parts(text.trim()).ok_or_else(|| TimeError::NotRfc3339 {
        text: text.to_string(),
    })
}

fn parse_rfc3339_parts(text: &str) -> Option<Instant> {
    let (year, rest) = digits(text, 4)?;
    let rest = rest.strip_prefix('-')?;
    let (month, rest) = digits(rest, 2)?;
    let rest = rest.strip_prefix('-')?;
    let (day, rest) = digits(rest, 2)?;
    let rest = rest.strip_prefix(['T', 't', ' '])?;
    let (hour, rest) = digits(rest, 2)?;
    let rest = rest.strip_prefix(':')?;
    let (minute, rest) = digits(rest, 2)?;
    let rest = rest.strip_prefix(':')?;
    let (second, rest) = digits(rest, 2)?;
    if !(1..=12).contains(&month)
        || day == 0
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let (nanos, rest) = match rest.strip_prefix('.') {
        Some(after) => {
            let end = after
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(after.len());
            (fraction_nanos(after.get(..end)?)?, after.get(end..)?)
        }
        None => (0, rest),
    };
    let offset: i64 = match rest {
        "Z" | "z" => 0,
        _ => {
            let sign = match rest.get(..1)? {
                "+" => 1,
                "-" => -1,
                _ => return None,
            };
            let (hours, after) = digits(rest.get(1..)?, 2)?;
            let after = after.strip_prefix(':').unwrap_or(after);
            let (minutes, after) = digits(after, 2)?;
            if !after.is_empty() || hours > 23 || minutes > 59 {
                return None;
            }
            sign * i64::try_from(hours * 3_600 + minutes * 60).ok()?
        }
    };
    let days = days_from_civil(year, month, day)?;
    // A leap second (:60) is read as the first instant of the next minute.
    let local = days * SECONDS_PER_DAY + hour * 3_600 + minute * 60 + second;
    let utc = i64::try_from(local).ok()?.checked_sub(offset)?;
    let utc = u64::try_from(utc).ok()?;
    utc.checked_mul(SECOND)?
        .checked_add(nanos)
        .map(Instant::from_unix_nanos)
}

/// Parses decimal epoch seconds (`1763805600`, `1763805600.25`) exactly; an exponent
/// (`1.7638056e9`) is read through a float.
pub fn parse_epoch_seconds(text: &str) -> Result<Instant, TimeError> {
    let text = text.trim();
    let bad = || TimeError::NotEpochSeconds {
        text: text.to_string(),
    };
    if text.contains(['e', 'E']) {
        let value: f64 = text.parse().map_err(|_| bad())?;
        if !(0.0..1.8e10).contains(&value) {
            return Err(bad());
        }
        // In range: at most 1.8e19 ns, below u64::MAX.
        return Ok(Instant::from_unix_nanos(
            (value * SECOND as f64).round() as u64
        ));
    }
    let (whole, fraction) = match text.split_once('.') {
        Some((whole, fraction)) => (whole, Some(fraction)),
        None => (text, None),
    };
    if whole.is_empty() || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let seconds: u64 = whole.parse().map_err(|_| bad())?;
    let nanos = match fraction {
        Some(fraction) => fraction_nanos(fraction).ok_or_else(bad)?,
        None => 0,
    };
    seconds
        .checked_mul(SECOND)
        .and_then(|n| n.checked_add(nanos))
        .map(Instant::from_unix_nanos)
        .ok_or_else(bad)
}

/// `2026-11-22T10:00:00Z` for a whole number of seconds since the epoch.
pub fn format_seconds(seconds: u64) -> String {
    let (year, month, day) = civil_from_days(seconds / SECONDS_PER_DAY);
    let in_day = seconds % SECONDS_PER_DAY;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        in_day / 3_600,
        in_day % 3_600 / 60,
        in_day % 60
    )
}

/// `2026-11-22T10:00:00.250Z`: an instant to the millisecond.
pub fn format_millis(instant: Instant) -> String {
    let nanos = instant.unix_nanos();
    let seconds = format_seconds(nanos / 1_000_000_000);
    let millis = nanos % 1_000_000_000 / 1_000_000;
    format!("{}.{millis:03}Z", seconds.trim_end_matches('Z'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = SECOND;

    fn at(nanos: u64) -> Instant {
        Instant::from_unix_nanos(nanos)
    }

    #[test]
    fn rfc3339_times_in_every_accepted_spelling() {
        for (text, expected) in [
            ("1970-01-01T00:00:00Z", 0),
            ("2016-04-15T20:17:00.310Z", 1_460_751_420 * S + 310_000_000),
            ("2026-01-01T00:00:01Z", 1_767_225_601 * S),
            ("2026-01-01t00:00:01.000000001z", 1_767_225_601 * S + 1),
            ("2026-01-01 01:00:01+01:00", 1_767_225_601 * S),
            ("2025-12-31T23:00:01-0100", 1_767_225_601 * S),
            (
                "2024-02-29T12:00:00.1234567891234Z",
                1_709_208_000 * S + 123_456_789,
            ),
        ] {
            assert_eq!(parse_rfc3339(text), Ok(at(expected)), "{text}");
        }
        for text in [
            "",
            "2026-13-01T00:00:00Z",
            "2025-02-29T00:00:00Z",
            "2026-01-01T24:00:00Z",
            "2026-01-01T00:00:00",
            "2026-01-01T00:00:00.Z",
            "1969-12-31T23:59:59Z",
            "2026-01-01T00:00:00+1",
            "yesterday",
        ] {
            assert_eq!(
                parse_rfc3339(text),
                Err(TimeError::NotRfc3339 { text: text.into() }),
                "{text}"
            );
        }
        assert_eq!(
            parse_rfc3339(" noon").map_err(|err| err.to_string()),
            Err("\" noon\" is not an RFC 3339 time (like 2026-11-22T10:00:00.250Z) at or after 1970".into())
        );
    }

    #[test]
    fn epoch_seconds_are_read_digit_by_digit() {
        assert_eq!(parse_epoch_seconds("1767225601"), Ok(at(1_767_225_601 * S)));
        assert_eq!(
            parse_epoch_seconds("1767225601.123456789"),
            Ok(at(1_767_225_601 * S + 123_456_789))
        );
        assert_eq!(parse_epoch_seconds("0.5"), Ok(at(S / 2)));
        assert_eq!(parse_epoch_seconds("1.5e9"), Ok(at(1_500_000_000 * S)));
        for text in ["-1", "", ".5", "1.", "1e30", "12a", "99999999999999999999"] {
            assert_eq!(
                parse_epoch_seconds(text),
                Err(TimeError::NotEpochSeconds { text: text.into() }),
                "{text}"
            );
        }
        assert_eq!(
            parse_epoch_seconds(" -5 ").map_err(|err| err.to_string()),
            Err("-5 is not a time in seconds since the epoch (1970) or later".into())
        );
    }

    #[test]
    fn seconds_format_back() {
        assert_eq!(format_seconds(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_seconds(1_460_751_420), "2016-04-15T20:17:00Z");
        assert_eq!(format_seconds(1_709_208_000), "2024-02-29T12:00:00Z");
        for seconds in [951_782_400, 4_102_444_799, 1_767_225_601] {
            let text = format_seconds(seconds);
            assert_eq!(parse_rfc3339(&text), Ok(at(seconds * S)), "{text}");
        }
    }
}
