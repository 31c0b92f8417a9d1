//! Pictures (`--svg FILE`): a layout's ranks as a grid of cells coloured by the groups of one
//! family ([`LayoutPicture`]) and a multi-module pipeline as boxes and arrows
//! ([`PipelinePicture`]).
//!
//! The SVG is built with the `svg` crate's document model (it escapes text and attributes) and is
//! self-contained: no scripts, no images, no external fonts or style sheets (text uses the
//! generic font list [`FONT`], so a viewer picks a local font).
//!
//! ```
//! use grid_core::{Family, LayoutConfig, LayoutPlan};
//! let plan = LayoutPlan::new(LayoutConfig { tp: 2, pp: 2, ..LayoutConfig::new(8) }).unwrap();
//! let pic = grid_cli::picture::LayoutPicture::new(&plan, Family::Tp.into(), Some(4)).unwrap();
//! // Ranks 0 and 1 form one tp group, 2 and 3 another.
//! assert_eq!(pic.group_of(0), pic.group_of(1));
//! assert_ne!(pic.group_of(1), pic.group_of(2));
//! assert!(pic.to_svg().starts_with("<svg"));
//! ```

mod layout;
mod pipeline;

pub use layout::{LayoutPicture, MAX_RANKS};
pub use pipeline::PipelinePicture;

use crate::error::{usage, Result};
use svg::node::element::{Rectangle, Text};

/// The font list of every text: generic families only, nothing to download.
pub const FONT: &str = "DejaVu Sans, Verdana, Arial, Helvetica, sans-serif";

/// The fill of cells that are in no group of the chosen family (embedding groups).
pub const NO_GROUP: [u8; 3] = [0xd0, 0xd0, 0xd0];

/// The colour of group `index`: the hue turns by the golden angle (about 137.5°) from one group
/// to the next, so neighbouring groups are far apart on the colour wheel, and the lightness
/// cycles through three levels, so groups whose hues come close again (every 8 or 13 groups)
/// still differ. Any number of groups gets colours; past a few dozen, two groups far apart
/// may look alike, which is why cells also carry their rank and, when large enough, their
/// group number.
///
/// ```
/// use grid_cli::picture::colour;
/// assert_ne!(colour(0), colour(1));
/// assert_eq!(colour(5), colour(5));
/// ```
pub fn colour(index: usize) -> [u8; 3] {
    const GOLDEN_ANGLE: f64 = 137.507_764_050_037_85;
    let hue = ((index as f64) * GOLDEN_ANGLE) % 360.0;
    let lightness = [0.62, 0.48, 0.74][index % 3];
    hsl_to_rgb(hue, 0.68, lightness)
}

/// HSL (hue in degrees, saturation and lightness in 0..=1) to 8-bit RGB.
fn hsl_to_rgb(h: f64, s: f64, l: f64) -> [u8; 3] {
    let c = (1.0 - (2.0 * l - 1.0).abs()) * s;
    let hp = h / 60.0;
    let x = c * (1.0 - (hp % 2.0 - 1.0).abs());
    let (r, g, b) = match hp as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let m = l - c / 2.0;
    let to8 = |v: f64| ((v + m) * 255.0).round().clamp(0.0, 255.0) as u8;
    [to8(r), to8(g), to8(b)]
}

/// `#rrggbb`.
pub(crate) fn hex(c: [u8; 3]) -> String {
    format!("#{:02x}{:02x}{:02x}", c[0], c[1], c[2])
}

/// Black or white, whichever reads better on `c`.
pub(crate) fn ink_on(c: [u8; 3]) -> &'static str {
    let lum = 0.299 * f64::from(c[0]) + 0.587 * f64::from(c[1]) + 0.114 * f64::from(c[2]);
    if lum > 140.0 {
        "#111111"
    } else {
        "#ffffff"
    }
}

/// A text element at (x, y) (the baseline's start, or its middle with `anchor` "middle").
pub(crate) fn text(x: f64, y: f64, size: f64, anchor: &str, content: &str) -> Text {
    Text::new(content)
        .set("x", round(x))
        .set("y", round(y))
        .set("font-size", round(size))
        .set("font-family", FONT)
        .set("text-anchor", anchor)
}

/// A rectangle.
pub(crate) fn rect(x: f64, y: f64, w: f64, h: f64, fill: &str) -> Rectangle {
    Rectangle::new()
        .set("x", round(x))
        .set("y", round(y))
        .set("width", round(w))
        .set("height", round(h))
        .set("fill", fill)
}

/// Two decimals at most: smaller files, same picture.
pub(crate) fn round(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

/// About how wide `s` is in a font of `size` (DejaVu Sans averages 0.6 em per character).
pub(crate) fn text_width(s: &str, size: f64) -> f64 {
    s.chars().count() as f64 * size * 0.6
}

/// `s` cut to `max` characters, with `...` when cut.
pub(crate) fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let head: String = s.chars().take(max.saturating_sub(3)).collect();
        format!("{head}...")
    }
}

/// The whole document: white background, the given size, `nodes` inside.
pub(crate) fn document(width: f64, height: f64, title: &str) -> svg::Document {
    let (w, h) = (width.ceil(), height.ceil());
    svg::Document::new()
        .set("width", w)
        .set("height", h)
        .set("viewBox", (0, 0, w, h))
        .add(svg::node::element::Title::new(title))
        .add(rect(0.0, 0.0, w, h, "#ffffff"))
}

/// Writes `doc` to `path` (the command's `--svg FILE`); a failure is a usage error naming the
/// file, so an unwritable path exits with status 2 and one line.
pub(crate) fn write_file(command: &str, path: &str, svg_text: &str) -> Result<()> {
    if path.is_empty() {
        return Err(usage!(
            "grid {command}: --svg needs a file name, got an empty one"
        ));
    }
    std::fs::write(path, svg_text)
        .map_err(|e| usage!("grid {command}: cannot write the picture to '{path}': {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbouring_groups_get_distinct_colours() {
        for i in 0..256 {
            assert_ne!(colour(i), colour(i + 1), "groups {i} and {}", i + 1);
            assert_ne!(colour(i), colour(i + 2), "groups {i} and {}", i + 2);
        }
        // Primary hues convert exactly.
        assert_eq!(hsl_to_rgb(0.0, 1.0, 0.5), [255, 0, 0]);
        assert_eq!(hsl_to_rgb(120.0, 1.0, 0.5), [0, 255, 0]);
        assert_eq!(hsl_to_rgb(240.0, 1.0, 0.5), [0, 0, 255]);
        assert_eq!(hex([1, 2, 255]), "#0102ff");
    }

    #[test]
    fn clipping_and_ink() {
        assert_eq!(clip("abcdef", 10), "abcdef");
        assert_eq!(clip("abcdefghijkl", 8), "abcde...");
        assert_eq!(ink_on([255, 255, 255]), "#111111");
        assert_eq!(ink_on([0, 0, 0]), "#ffffff");
    }
}
