//! Labels and Markdown tables for the programs' reports.

use std::time::Duration;

/// A byte count as the tables show it: `8 B`, `2 KiB`, `64 MiB` (whole units, rounded down).
///
/// ```
/// use grid_programs::table::bytes_label;
/// assert_eq!(bytes_label(8), "8 B");
/// assert_eq!(bytes_label(2048), "2 KiB");
/// assert_eq!(bytes_label(64 << 20), "64 MiB");
/// ```
pub fn bytes_label(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

/// A duration with a unit that suits it and two decimals: `1.50 s`, `2.00 ms`, `3.25 µs`.
///
/// ```
/// use grid_programs::table::duration_label;
/// use std::time::Duration;
/// assert_eq!(duration_label(Duration::from_millis(1500)), "1.50 s");
/// assert_eq!(duration_label(Duration::from_micros(2000)), "2.00 ms");
/// assert_eq!(duration_label(Duration::from_nanos(3250)), "3.25 µs");
/// ```
pub fn duration_label(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.2} µs", s * 1e6)
    }
}

/// An integer with thousands separators: `1,048,576`.
///
/// ```
/// assert_eq!(grid_programs::table::thousands(1 << 20), "1,048,576");
/// assert_eq!(grid_programs::table::thousands(999), "999");
/// ```
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The two header lines of a Markdown table. A column whose name starts with `>` is
/// right-aligned (numbers); the `>` is not printed.
///
/// ```
/// use grid_programs::table::header;
/// assert_eq!(header(&["op", ">bytes", ">µs"]), "| op | bytes | µs |\n|---|---:|---:|");
/// ```
pub fn header(columns: &[&str]) -> String {
    let names: Vec<&str> = columns.iter().map(|c| c.trim_start_matches('>')).collect();
    let rules: Vec<&str> = columns
        .iter()
        .map(|c| if c.starts_with('>') { "---:" } else { "---" })
        .collect();
    format!("| {} |\n|{}|", names.join(" | "), rules.join("|"))
}

/// One Markdown table row.
///
/// ```
/// assert_eq!(grid_programs::table::row(&["tp".into(), "2".into()]), "| tp | 2 |");
/// ```
pub fn row(cells: &[String]) -> String {
    format!("| {} |", cells.join(" | "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(bytes_label(0), "0 B");
        assert_eq!(bytes_label(1023), "1023 B");
        assert_eq!(bytes_label((1 << 20) - 1), "1023 KiB");
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(123_456_789), "123,456,789");
        assert_eq!(duration_label(Duration::ZERO), "0.00 µs");
    }

    #[test]
    fn headers() {
        assert_eq!(header(&["a"]), "| a |\n|---|");
    }
}
