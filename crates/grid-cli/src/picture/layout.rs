//! [`LayoutPicture`]: the ranks of a layout as cells, coloured by the groups of one family.

use super::{clip, colour, document, hex, ink_on, rect, round, text, text_width, NO_GROUP};
use crate::error::{usage, Result};
use crate::out::show_group;
use grid_core::{FamilyLevel, LayoutPlan};
use svg::node::element::{Group as SvgGroup, Line};

/// The most ranks a picture draws (about 10 MB of SVG); larger layouts are an error that says
/// to use the text output or `--rank R`.
pub const MAX_RANKS: usize = 1 << 16;

/// Largest and smallest cell side, in pixels.
const MAX_CELL: f64 = 48.0;
const MIN_CELL: f64 = 5.0;
/// The grid of cells fits in about this many pixels each way.
const TARGET: f64 = 1600.0;
/// Cells at least this large carry their rank; at least [`GROUP_LABEL_CELL`], their group too.
const RANK_LABEL_CELL: f64 = 20.0;
const GROUP_LABEL_CELL: f64 = 36.0;
/// Margins and text sizes.
const MARGIN: f64 = 16.0;
const TITLE: f64 = 16.0;
const SMALL: f64 = 12.0;
/// How many groups the legend lists.
const LEGEND_GROUPS: usize = 8;

/// One rank's cell.
#[derive(Debug, Clone, Copy)]
struct Cell {
    rank: usize,
    x: f64,
    y: f64,
    /// Block (pipeline stage and band of dp rows), row and column inside it.
    block: usize,
    row: usize,
    col: usize,
    group: Option<usize>,
}

/// The picture of a layout: one block of cells per pipeline stage (left to right), one row per
/// data-parallel index, one column per (context-parallel, tensor-parallel) pair (tp fastest).
/// When the data-parallel size is large, a stage's rows are cut into bands placed side by side,
/// so the picture stays about square. Cells are coloured by their group in one family
/// ([`super::colour`] of the group's index in Megatron's order); with ranks per node, thick
/// lines separate cells on different nodes.
#[derive(Debug, Clone)]
pub struct LayoutPicture {
    cells: Vec<Cell>,
    cell: f64,
    width: f64,
    height: f64,
    svg: String,
    groups: usize,
    crossing: Option<usize>,
}

impl LayoutPicture {
    /// Draws `plan` coloured by the groups of `family`; `ranks_per_node` (node `n` holds ranks
    /// `n·N .. (n+1)·N`) adds node boundaries and the count of groups that cross them.
    ///
    /// Errors: a family the layout does not have, a zero `ranks_per_node`, or more than
    /// [`MAX_RANKS`] ranks.
    pub fn new(
        plan: &LayoutPlan,
        family: FamilyLevel,
        ranks_per_node: Option<usize>,
    ) -> Result<LayoutPicture> {
        let world = plan.world_size();
        if world > MAX_RANKS {
            return Err(usage!(
                "grid layout: --svg draws at most {MAX_RANKS} ranks, this layout has {world}; use the text output or --rank R"
            ));
        }
        if ranks_per_node == Some(0) {
            return Err(usage!(
                "grid layout: --ranks-per-node must be a positive integer, got 0"
            ));
        }
        let groups = plan
            .num_groups(family)
            .map_err(|e| usage!("grid layout: --color-by {family}: {e}"))?;
        let cfg = plan.config();
        let (tp, cp, pp) = (cfg.tp, cfg.cp, cfg.pp);
        let dp = plan.dp();
        let cols = tp * cp;
        // Bands: cut the dp rows of each stage so that the grid is about square.
        let mut best = (f64::INFINITY, 1usize);
        for k in 1..=dp {
            let rows = dp.div_ceil(k) as f64;
            let width = (pp * k * cols) as f64 + (pp * k - 1) as f64 * 0.5;
            let cell = (TARGET / width).min(TARGET / rows).min(MAX_CELL);
            // Prefer large cells; among equal sizes, fewer bands.
            let score = -cell + k as f64 * 1e-3;
            if score < best.0 {
                best = (score, k);
            }
            if rows <= 1.0 {
                break;
            }
        }
        let bands = best.1;
        let band_rows = dp.div_ceil(bands);
        let blocks = pp * bands;
        let grid_w_cells = (blocks * cols) as f64 + (blocks - 1) as f64 * 0.5;
        let cell = (TARGET / grid_w_cells)
            .min(TARGET / band_rows as f64)
            .min(MAX_CELL)
            .floor();
        if cell < MIN_CELL {
            return Err(usage!(
                "grid layout: --svg: {world} ranks in {blocks} blocks of {band_rows} rows × {cols} columns would need cells smaller than {MIN_CELL} pixels; use the text output or --rank R"
            ));
        }
        let gap = (cell * 0.5).max(6.0);
        let block_w = cols as f64 * cell;
        let row_labels = bands == 1 && cell >= 10.0;
        let left = MARGIN + if row_labels { 48.0 } else { 0.0 };
        let title_lines = 2.0;
        let top = MARGIN + title_lines * (TITLE + 6.0) + 22.0;

        let mut cells = Vec::with_capacity(world);
        for rank in plan.rank_offset()..plan.rank_offset() + world {
            let view = plan.rank_view(rank)?;
            let c = view.coords;
            let band = c.dp / band_rows;
            let block = c.pp * bands + band;
            let row = c.dp % band_rows;
            let col = c.cp * tp + c.tp;
            let group = plan.group_index_of(family, rank)?;
            cells.push(Cell {
                rank,
                x: left + block as f64 * (block_w + gap) + col as f64 * cell,
                y: top + row as f64 * cell,
                block,
                row,
                col,
                group,
            });
        }

        // Which groups hold ranks of more than one node.
        let node = |r: usize| ranks_per_node.map(|n| r / n);
        let crossing = ranks_per_node.map(|_| {
            let mut first: Vec<Option<usize>> = vec![None; groups];
            let mut crosses = vec![false; groups];
            for c in &cells {
                if let (Some(g), Some(n)) = (c.group, node(c.rank)) {
                    if g < groups {
                        match first[g] {
                            None => first[g] = Some(n),
                            Some(f) if f != n => crosses[g] = true,
                            Some(_) => {}
                        }
                    }
                }
            }
            crosses.iter().filter(|&&x| x).count()
        });

        let grid_w = blocks as f64 * block_w + (blocks - 1) as f64 * gap;
        let grid_h = band_rows as f64 * cell;

        // Title and subtitle.
        let sizes = format!(
            "tp {tp} · cp {cp} · dp {dp} · pp {pp} · ep {} · expert tp {} · expert dp {}",
            cfg.ep,
            plan.expert_tp(),
            plan.expert_dp()
        );
        let title = format!(
            "grid layout: {world} ranks ({}..={}), {sizes}, order {}",
            plan.rank_offset(),
            plan.rank_offset() + world - 1,
            cfg.order
        );
        let mut arrangement = format!(
            "blocks: pipeline stages, left to right{}; rows: dp index; columns: {}",
            if bands > 1 {
                format!(" (each cut into {bands} bands of {band_rows} dp rows)")
            } else {
                String::new()
            },
            if cp > 1 {
                "cp × tp (tp fastest)"
            } else {
                "tp"
            }
        );
        if cell < RANK_LABEL_CELL {
            arrangement.push_str("; cells too small for rank labels");
        }

        // Legend lines.
        let mut legend: Vec<(Option<[u8; 3]>, String)> = Vec::new();
        let size = plan.group_at(family, 0).map(|g| g.len()).unwrap_or(0);
        legend.push((
            None,
            format!(
                "colour: {family} groups ({groups} group{} of {size} rank{}; one colour per group, numbered in Megatron's order)",
                if groups == 1 { "" } else { "s" },
                if size == 1 { "" } else { "s" }
            ),
        ));
        for g in 0..groups.min(LEGEND_GROUPS) {
            let members = show_group(&plan.group_at(family, g)?);
            legend.push((
                Some(colour(g)),
                clip(&format!("{family} group {g}: {members}"), 90),
            ));
        }
        if groups > LEGEND_GROUPS {
            legend.push((None, format!("... and {} more", groups - LEGEND_GROUPS)));
        }
        if cells.iter().any(|c| c.group.is_none()) {
            legend.push((Some(NO_GROUP), format!("in no {family} group")));
        }
        if let (Some(n), Some(x)) = (ranks_per_node, crossing) {
            legend.push((
                None,
                format!(
                    "thick black lines: node boundaries ({n} ranks per node, {} node{}); {x} of {groups} {family} groups cross nodes",
                    world.div_ceil(n),
                    if world.div_ceil(n) == 1 { "" } else { "s" }
                ),
            ));
        }
        let legend_top = top + grid_h + 24.0;
        let line_h = SMALL + 8.0;
        let legend_w = legend
            .iter()
            .map(|(_, s)| 22.0 + text_width(s, SMALL))
            .fold(0.0, f64::max);
        let width = (left + grid_w + MARGIN)
            .max(MARGIN * 2.0 + text_width(&title, TITLE))
            .max(MARGIN * 2.0 + text_width(&arrangement, SMALL))
            .max(MARGIN * 2.0 + legend_w);
        let height = legend_top + legend.len() as f64 * line_h + MARGIN;

        let mut doc = document(width, height, &title);
        doc = doc
            .add(text(MARGIN, MARGIN + TITLE, TITLE, "start", &title).set("font-weight", "bold"));
        doc = doc.add(text(
            MARGIN,
            MARGIN + TITLE + 6.0 + SMALL + 4.0,
            SMALL,
            "start",
            &arrangement,
        ));

        // Block headers.
        let mut headers = SvgGroup::new().set("id", "blocks");
        for b in 0..blocks {
            let (stage, band) = (b / bands, b % bands);
            let x = left + b as f64 * (block_w + gap);
            let label = if bands > 1 {
                let lo = band * band_rows;
                let hi = ((band + 1) * band_rows).min(dp) - 1;
                format!("pp {stage}, dp {lo}-{hi}")
            } else {
                format!("pp stage {stage}")
            };
            let size = SMALL.min(block_w / (0.6 * label.chars().count() as f64).max(1.0));
            if size >= 6.0 {
                headers = headers.add(text(x, top - 8.0, size, "start", &label));
            }
            headers = headers.add(
                rect(x - 1.0, top - 1.0, block_w + 2.0, grid_h + 2.0, "none")
                    .set("stroke", "#555555")
                    .set("stroke-width", 1),
            );
        }
        doc = doc.add(headers);
        if row_labels {
            let step = (14.0 / cell).ceil().max(1.0) as usize;
            let mut labels = SvgGroup::new().set("id", "rows");
            for r in (0..band_rows).step_by(step) {
                let y = top + r as f64 * cell + cell / 2.0 + SMALL * 0.35;
                labels = labels.add(text(
                    left - 8.0,
                    y,
                    SMALL.min(cell * 0.8),
                    "end",
                    &format!("dp {r}"),
                ));
            }
            doc = doc.add(labels);
        }

        // Cells.
        let mut layer = SvgGroup::new()
            .set("id", "cells")
            .set("stroke", "#ffffff")
            .set("stroke-width", if cell >= 12.0 { 1.0 } else { 0.5 });
        let mut labels = SvgGroup::new()
            .set("id", "labels")
            .set("font-family", super::FONT)
            .set("text-anchor", "middle");
        for c in &cells {
            let fill = c.group.map_or(NO_GROUP, colour);
            layer = layer.add(rect(c.x, c.y, cell, cell, &hex(fill)));
            if cell >= RANK_LABEL_CELL {
                let rank = c.rank.to_string();
                let size = (cell * 0.36).min(cell * 0.9 / (0.6 * rank.len() as f64));
                let two = cell >= GROUP_LABEL_CELL && c.group.is_some();
                let y = if two {
                    c.y + cell * 0.45
                } else {
                    c.y + cell / 2.0 + size * 0.35
                };
                labels = labels.add(
                    svg::node::element::Text::new(rank)
                        .set("x", round(c.x + cell / 2.0))
                        .set("y", round(y))
                        .set("font-size", round(size))
                        .set("fill", ink_on(fill)),
                );
                if let (true, Some(g)) = (two, c.group) {
                    let tag = format!("g{g}");
                    let small = (cell * 0.24).min(cell * 0.9 / (0.6 * tag.len() as f64));
                    labels = labels.add(
                        svg::node::element::Text::new(tag)
                            .set("x", round(c.x + cell / 2.0))
                            .set("y", round(c.y + cell * 0.8))
                            .set("font-size", round(small))
                            .set("fill", ink_on(fill)),
                    );
                }
            }
        }
        doc = doc.add(layer).add(labels);

        // Node boundaries: an edge between neighbouring cells on different nodes.
        if let Some(n) = ranks_per_node {
            let mut at: std::collections::HashMap<(usize, usize, usize), usize> =
                std::collections::HashMap::with_capacity(cells.len());
            for (i, c) in cells.iter().enumerate() {
                at.insert((c.block, c.row, c.col), i);
            }
            let width_line = (cell * 0.12).clamp(1.5, 3.0);
            let mut lines = SvgGroup::new()
                .set("id", "nodes")
                .set("stroke", "#000000")
                .set("stroke-width", width_line)
                .set("stroke-linecap", "square");
            for c in &cells {
                let here = c.rank / n;
                if let Some(&j) = at.get(&(c.block, c.row, c.col + 1)) {
                    if cells[j].rank / n != here {
                        let x = c.x + cell;
                        lines = lines.add(segment(x, c.y, x, c.y + cell));
                    }
                }
                if let Some(&j) = at.get(&(c.block, c.row + 1, c.col)) {
                    if cells[j].rank / n != here {
                        let y = c.y + cell;
                        lines = lines.add(segment(c.x, y, c.x + cell, y));
                    }
                }
            }
            doc = doc.add(lines);
        }

        // Legend.
        let mut lg = SvgGroup::new().set("id", "legend");
        for (i, (swatch, line)) in legend.iter().enumerate() {
            let y = legend_top + i as f64 * line_h;
            let x = match swatch {
                Some(c) => {
                    lg = lg.add(
                        rect(MARGIN, y, 14.0, 14.0, &hex(*c))
                            .set("stroke", "#555555")
                            .set("stroke-width", 0.5),
                    );
                    MARGIN + 22.0
                }
                None => MARGIN,
            };
            lg = lg.add(text(x, y + 11.5, SMALL, "start", line));
        }
        doc = doc.add(lg);

        Ok(LayoutPicture {
            cells,
            cell,
            width: width.ceil(),
            height: height.ceil(),
            svg: doc.to_string(),
            groups,
            crossing,
        })
    }

    /// The picture as an SVG document.
    pub fn to_svg(&self) -> String {
        self.svg.clone()
    }

    /// Width and height in pixels (the SVG's `width` and `height`).
    pub fn size(&self) -> (u32, u32) {
        (self.width as u32, self.height as u32)
    }

    /// The cell of `rank`: left, top and side, in pixels (`None` for a rank outside the layout).
    pub fn cell(&self, rank: usize) -> Option<(f64, f64, f64)> {
        self.find(rank).map(|c| (c.x, c.y, self.cell))
    }

    /// The index of the group (of the chosen family) that colours `rank`'s cell; `None` for a
    /// rank outside the layout or in no group.
    pub fn group_of(&self, rank: usize) -> Option<usize> {
        self.find(rank).and_then(|c| c.group)
    }

    /// The number of groups of the chosen family.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// With ranks per node: how many groups hold ranks of more than one node.
    pub fn groups_crossing_nodes(&self) -> Option<usize> {
        self.crossing
    }

    /// One line for the command's stdout: what was drawn.
    pub fn summary(&self, path: &str, family: FamilyLevel) -> String {
        let (w, h) = self.size();
        format!(
            "grid layout: wrote {path} ({w}×{h} pixels, {} ranks, coloured by {family}: {} groups{})",
            self.cells.len(),
            self.groups,
            match self.crossing {
                Some(x) => format!(", {x} crossing nodes"),
                None => String::new(),
            }
        )
    }

    fn find(&self, rank: usize) -> Option<&Cell> {
        let first = self.cells.first()?.rank;
        let c = self.cells.get(rank.checked_sub(first)?)?;
        (c.rank == rank).then_some(c)
    }
}

fn segment(x1: f64, y1: f64, x2: f64, y2: f64) -> Line {
    Line::new()
        .set("x1", round(x1))
        .set("y1", round(y1))
        .set("x2", round(x2))
        .set("y2", round(y2))
}
