//! UTC dates without a date crate: RFC 3339 stamps for the audit log and the UTC day that
//! quotas count in (days since 1970-01-01).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

const DAY: u64 = 86_400;

/// `t` as `2026-11-26T10:31:02.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (y, m, day) = civil(secs / DAY);
    let s = secs % DAY;
    format!("{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z", s / 3600, s / 60 % 60, s % 60, d.subsec_millis())
}

/// The UTC day of `t`, in days since 1970-01-01.
pub fn day_of(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs() / DAY
}

/// How long from `t` to the next UTC midnight.
pub fn seconds_to_next_day(t: SystemTime) -> Duration {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    Duration::from_secs((d.as_secs() / DAY + 1) * DAY).saturating_sub(d)
}

/// Year, month, day of a day number (Howard Hinnant's `civil_from_days`).
fn civil(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + u64::from(m <= 2), m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64, ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(secs * 1000 + ms)
    }

    #[test]
    fn stamps_are_utc_rfc3339() {
        assert_eq!(rfc3339(at(0, 0)), "1970-01-01T00:00:00.000Z");
        // 2024-02-29 (a leap day) 23:59:59.999
        assert_eq!(rfc3339(at(1_709_251_199, 999)), "2024-02-29T23:59:59.999Z");
        assert_eq!(rfc3339(at(1_709_251_200, 0)), "2024-03-01T00:00:00.000Z");
        assert_eq!(rfc3339(at(1_798_761_600, 5)), "2027-01-01T00:00:00.005Z");
    }

    #[test]
    fn the_day_turns_at_utc_midnight() {
        let before = at(1_709_251_199, 999);
        let after = at(1_709_251_200, 0);
        assert_eq!(day_of(after), day_of(before) + 1);
        assert_eq!(seconds_to_next_day(before), Duration::from_millis(1));
        assert_eq!(seconds_to_next_day(after), Duration::from_secs(DAY));
    }
}
