//! Output shared by every subcommand: a buffered writer with a fast JSON writer for rank lists
//! (a million-member group is written in a few milliseconds), text tables, group formatting and
//! the size limits of what the command prints.

use crate::error::Result;
use grid_core::Group;
use std::io::{self, Write};

/// The largest number of ranks whose every group a command will enumerate (about 150 MB of
/// JSON per family). Larger layouts can still be inspected one rank at a time (`--rank R`).
pub const MAX_ENUMERATED: usize = 1 << 24;

/// A group as text: `[0, 1, 4, 5]`, or abbreviated when long.
pub fn show_group(g: &Group) -> String {
    g.to_string()
}

/// A list of ranks as text, like [`show_group`].
pub fn show_list(v: &[usize]) -> String {
    Group::from_list(v.to_vec()).to_string()
}

/// The first groups of a family that fit in about `budget` characters (at least one), with
/// ` ...` when some are left out.
pub fn first_groups(
    n: usize,
    budget: usize,
    group: impl Fn(usize) -> Result<Group>,
) -> Result<String> {
    let mut s = String::new();
    let mut shown = 0;
    while shown < n {
        let g = show_group(&group(shown)?);
        if shown > 0 && s.len() + 1 + g.len() > budget {
            break;
        }
        if shown > 0 {
            s.push(' ');
        }
        s.push_str(&g);
        shown += 1;
    }
    if shown < n {
        s.push_str(" ...");
    }
    Ok(s)
}

/// Output is collected in a buffer and handed to the underlying writer in large chunks.
pub struct Out<'w> {
    buf: Vec<u8>,
    w: &'w mut dyn Write,
}

const CHUNK: usize = 1 << 20;

impl<'w> Out<'w> {
    /// Wraps a writer (usually locked stdout).
    pub fn new(w: &'w mut dyn Write) -> Out<'w> {
        Out {
            buf: Vec::with_capacity(64 * 1024),
            w,
        }
    }

    fn spill(&mut self) -> io::Result<()> {
        if self.buf.len() >= CHUNK {
            self.w.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }

    /// Hands everything buffered so far to the writer and flushes it.
    pub fn flush(&mut self) -> io::Result<()> {
        self.w.write_all(&self.buf)?;
        self.buf.clear();
        self.w.flush()
    }

    /// Writes the rest and flushes.
    pub fn finish(mut self) -> io::Result<()> {
        self.w.write_all(&self.buf)?;
        self.buf.clear();
        self.w.flush()
    }

    /// Raw text.
    pub fn raw(&mut self, s: &str) -> io::Result<()> {
        self.buf.extend_from_slice(s.as_bytes());
        self.spill()
    }

    /// A line of text.
    pub fn line(&mut self, s: &str) -> io::Result<()> {
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(b'\n');
        self.spill()
    }

    /// An unsigned integer (two digits per step into a 20-byte stack buffer, no allocation).
    pub fn num(&mut self, n: usize) -> io::Result<()> {
        push_num(&mut self.buf, n);
        Ok(())
    }

    /// A JSON string (escaped).
    pub fn string(&mut self, s: &str) -> io::Result<()> {
        serde_json::to_writer(&mut self.buf, s).map_err(io::Error::from)
    }

    /// `"key":` (after a comma unless `first`).
    pub fn key(&mut self, k: &str, first: bool) -> io::Result<()> {
        if !first {
            self.buf.push(b',');
        }
        self.string(k)?;
        self.buf.push(b':');
        Ok(())
    }

    /// A JSON boolean.
    pub fn boolean(&mut self, b: bool) -> io::Result<()> {
        self.raw(if b { "true" } else { "false" })
    }

    /// A JSON list of ranks. Runs of consecutive ranks (the common case: tensor parallelism
    /// varies fastest) are formatted by incrementing the previous decimal string.
    pub fn ranks(&mut self, ranks: &[usize]) -> io::Result<()> {
        self.buf.push(b'[');
        let mut dec = Decimal::default();
        for chunk in ranks.chunks(CHUNK / 32) {
            self.push_ranks(chunk, &mut dec);
            self.spill()?;
        }
        self.buf.push(b']');
        Ok(())
    }

    /// A JSON list of a group's members in Megatron's order, like [`Out::ranks`], written in
    /// chunks through one small reused buffer: a million-member group is never materialized
    /// (that costs more in page faults than formatting it).
    pub fn group(&mut self, g: &Group) -> io::Result<()> {
        const STEP: usize = 4096;
        self.buf.push(b'[');
        let mut dec = Decimal::default();
        let mut ranks = Vec::with_capacity(STEP.min(g.len()));
        let mut start = 0;
        while start < g.len() {
            let end = start.saturating_add(STEP);
            ranks.clear();
            g.extend_range_into(start..end, &mut ranks);
            self.push_ranks(&ranks, &mut dec);
            self.spill()?;
            start = end;
        }
        self.buf.push(b']');
        Ok(())
    }

    /// Appends `ranks` as comma-separated numbers (a comma first unless `dec` is still unused,
    /// i.e. these are the first numbers of the list).
    ///
    /// The numbers are assembled in a stack block and appended to the buffer a block at a
    /// time: each number is one fixed-size copy of [`Decimal`]'s 20 bytes (inline moves, no
    /// call) of which only its digits are kept, the next number overwriting the rest. Pushing
    /// digit by digit onto the vector (a length and capacity update per byte) was 60% of the
    /// million-rank view's time.
    fn push_ranks(&mut self, ranks: &[usize], dec: &mut Decimal) {
        const BLOCK: usize = 4096;
        // Room for one more number (a comma and 20 bytes copied) past any fill below BLOCK.
        let mut block = [0u8; BLOCK + 1 + DIGITS];
        let mut n = 0usize;
        for &r in ranks {
            if n >= BLOCK {
                self.buf.extend_from_slice(&block[..n]);
                n = 0;
            }
            if dec.value.is_some() {
                block[n] = b',';
                n += 1;
            }
            dec.set_next(r);
            block[n..n + DIGITS].copy_from_slice(&dec.buf);
            n += dec.len;
            block[n - 1] = dec.last;
        }
        self.buf.extend_from_slice(&block[..n]);
    }

    /// A JSON list of rank lists.
    pub fn groups<'a>(&mut self, groups: impl Iterator<Item = &'a [usize]>) -> io::Result<()> {
        self.buf.push(b'[');
        for (i, g) in groups.enumerate() {
            if i > 0 {
                self.buf.push(b',');
            }
            self.ranks(g)?;
        }
        self.buf.push(b']');
        self.spill()
    }

    /// A JSON list of booleans.
    pub fn bools(&mut self, v: &[bool]) -> io::Result<()> {
        self.buf.push(b'[');
        for (i, &b) in v.iter().enumerate() {
            if i > 0 {
                self.buf.push(b',');
            }
            self.boolean(b)?;
        }
        self.buf.push(b']');
        Ok(())
    }
}

/// Bytes written through [`Write`] go to the same buffer (for writers such as serde_json's
/// that stream a large document).
impl Write for Out<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(bytes);
        self.spill()?;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Out::flush(self)
    }
}

const PAIRS: &[u8; 200] = b"\
0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// The decimal form of the last number written, so that `n + 1` costs a digit increment.
struct Decimal {
    /// The digits but the last, left-aligned: `buf[..len - 1]`; the bytes after them are
    /// copied along and overwritten ([`Out::push_ranks`]).
    buf: [u8; DIGITS],
    /// The last digit, kept apart: the next of a run of consecutive numbers changes only it,
    /// nine times in ten, so `buf` is rewritten once per ten numbers. (Rewriting a byte of
    /// `buf` just before the 16-byte load that copies it stalls the load until the store
    /// retires: that stall was most of [`Out::push_ranks`]'s time.)
    last: u8,
    len: usize,
    value: Option<usize>,
}

/// The digits of `usize::MAX`.
const DIGITS: usize = 20;

impl Default for Decimal {
    fn default() -> Self {
        Decimal {
            buf: [b'0'; DIGITS],
            last: b'0',
            len: 1,
            value: None,
        }
    }
}

impl Decimal {
    fn set_next(&mut self, n: usize) {
        if self.value.and_then(|v| v.checked_add(1)) == Some(n) {
            self.value = Some(n);
            if self.last != b'9' {
                self.last += 1;
                return;
            }
            self.last = b'0';
            let mut i = self.len - 1;
            while i > 0 {
                i -= 1;
                if self.buf[i] == b'9' {
                    self.buf[i] = b'0';
                } else {
                    self.buf[i] += 1;
                    return;
                }
            }
            // Every digit was 9: one more digit, a 1 followed by zeros (n <= usize::MAX has
            // at most DIGITS digits, so len < DIGITS here).
            self.buf[self.len - 1] = b'0';
            self.buf[0] = b'1';
            self.len += 1;
            return;
        }
        self.len = write_num(&mut self.buf, n);
        self.last = self.buf[self.len - 1];
        self.value = Some(n);
    }
}

/// Appends the decimal digits of `n`.
fn push_num(buf: &mut Vec<u8>, n: usize) {
    let mut digits = [0u8; DIGITS];
    let len = write_num(&mut digits, n);
    buf.extend_from_slice(&digits[..len]);
}

/// Writes the decimal digits of `n` at the start of `out` and returns how many there are.
fn write_num(out: &mut [u8; DIGITS], mut n: usize) -> usize {
    let digits = n.checked_ilog10().map_or(1, |l| l as usize + 1);
    let mut i = digits;
    while n >= 100 {
        let r = (n % 100) * 2;
        n /= 100;
        i -= 2;
        out[i..i + 2].copy_from_slice(&PAIRS[r..r + 2]);
    }
    if n >= 10 {
        out[..2].copy_from_slice(&PAIRS[n * 2..n * 2 + 2]);
    } else {
        out[0] = b'0' + n as u8;
    }
    digits
}

/// Renders a table with left-aligned text columns and right-aligned numeric columns.
pub struct Table {
    header: Vec<String>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles; `right[i]` aligns column i to the right.
    pub fn new(header: &[&str], right: &[bool]) -> Table {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            right: right.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Writes the table, two spaces between columns, the last column unpadded.
    pub fn write(&self, out: &mut Out<'_>, indent: &str) -> io::Result<()> {
        let n = self.header.len();
        let mut width = vec![0usize; n];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(n) {
                width[i] = width[i].max(c.chars().count());
            }
        }
        for r in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::from(indent);
            for (i, c) in r.iter().enumerate().take(n) {
                let pad = width[i].saturating_sub(c.chars().count());
                if i + 1 == n {
                    line.push_str(c);
                } else if self.right.get(i).copied().unwrap_or(false) {
                    line.push_str(&" ".repeat(pad));
                    line.push_str(c);
                    line.push_str("  ");
                } else {
                    line.push_str(c);
                    line.push_str(&" ".repeat(pad + 2));
                }
            }
            out.line(line.trim_end())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_pieces() {
        let mut v = Vec::new();
        let mut o = Out::new(&mut v);
        o.raw("{").unwrap();
        o.key("a\"b", true).unwrap();
        o.groups([&[0usize, 10, 1234567890][..], &[][..]].into_iter())
            .unwrap();
        o.key("m", false).unwrap();
        o.bools(&[true, false]).unwrap();
        o.raw("}").unwrap();
        o.finish().unwrap();
        assert_eq!(
            String::from_utf8(v).unwrap(),
            r#"{"a\"b":[[0,10,1234567890],[]],"m":[true,false]}"#
        );
    }

    #[test]
    fn numbers() {
        let mut v = Vec::new();
        for n in [0usize, 7, 10, 99, 100, 101, 12345, 1_000_000, usize::MAX] {
            v.clear();
            push_num(&mut v, n);
            assert_eq!(String::from_utf8(v.clone()).unwrap(), n.to_string());
        }
    }

    /// `Out::ranks` writes `ranks` as a JSON list, each number as `to_string` writes it.
    fn assert_ranks_as_std_formats_them(ranks: &[usize]) {
        let mut v = Vec::new();
        let mut o = Out::new(&mut v);
        o.ranks(ranks).unwrap();
        o.finish().unwrap();
        let want: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        assert_eq!(
            String::from_utf8(v).unwrap(),
            format!("[{}]", want.join(","))
        );
    }

    #[test]
    fn consecutive_runs() {
        let ranks: Vec<usize> = (0..1200)
            .chain(9990..10010)
            .chain([5, 99, 100, 999_999, 1_000_000])
            .chain(usize::MAX - 2..=usize::MAX)
            .collect();
        assert_ranks_as_std_formats_them(&ranks);
    }

    #[test]
    fn long_lists_cross_blocks() {
        // Strided (not consecutive) numbers of every length, over many blocks, then runs that
        // grow by a digit inside a block.
        let ranks: Vec<usize> = (0..20_000usize)
            .map(|i| i.wrapping_mul(2_654_435_761) % 10usize.pow((i % 20) as u32).max(1))
            .chain(99_990..100_020)
            .chain(9_999_999_999..10_000_000_003)
            .collect();
        assert_ranks_as_std_formats_them(&ranks);
    }

    #[test]
    fn table_alignment() {
        let mut t = Table::new(&["name", "n", "what"], &[false, true, false]);
        t.row(vec!["tp".into(), "8".into(), "[0, 1]".into()]);
        t.row(vec!["dp_cp".into(), "128".into(), "".into()]);
        let mut v = Vec::new();
        let mut o = Out::new(&mut v);
        t.write(&mut o, "  ").unwrap();
        o.finish().unwrap();
        assert_eq!(
            String::from_utf8(v).unwrap(),
            "  name     n  what\n  tp       8  [0, 1]\n  dp_cp  128\n"
        );
    }
}
