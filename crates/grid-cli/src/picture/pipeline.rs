//! [`PipelinePicture`]: a multi-module pipeline as boxes (modules, by stage) and arrows
//! (bridges).

use super::{clip, colour, document, hex, rect, round, text, text_width, MAX_RANKS};
use crate::error::{usage, Result};
use crate::out::show_list;
use multimodule::PipelinePlan;
use svg::node::element::{Definitions, Group as SvgGroup, Marker, Path};

/// Width of one pipeline-stage column, the gap between columns, and text sizes.
const STAGE_W: f64 = 200.0;
const GAP_X: f64 = 150.0;
const GAP_Y: f64 = 40.0;
const MARGIN: f64 = 16.0;
const TITLE: f64 = 16.0;
const NAME: f64 = 14.0;
const SMALL: f64 = 11.5;
const LINE: f64 = 16.0;
/// The most stages and modules a picture draws (it stays under about 20,000 pixels wide).
const MAX_STAGES: usize = 64;
const MAX_MODULES: usize = 256;

/// Where one module's box is.
#[derive(Debug, Clone)]
struct ModuleBox {
    name: String,
    first_stage: usize,
    stages: usize,
    slot: usize,
    x: f64,
    y: f64,
    w: f64,
    h: f64,
}

/// The picture of a pipeline plan: one column per pipeline stage, each module a box spanning its
/// stages (with its grid sizes, rank range, and the ranks of each of its stages), each bridge an
/// arrow from the source's last stage to the destination's first, labelled with its lanes
/// (fan-in or fan-out) and leader ranks. Colocated modules get a dashed outline and a note.
#[derive(Debug, Clone)]
pub struct PipelinePicture {
    boxes: Vec<ModuleBox>,
    bridges: usize,
    stages: usize,
    width: f64,
    height: f64,
    svg: String,
}

impl PipelinePicture {
    /// Draws `plan`; `name` (usually the spec file) goes in the title.
    ///
    /// Errors: more than 64 stages, 256 modules or [`MAX_RANKS`] ranks in all.
    pub fn new(plan: &PipelinePlan, name: &str) -> Result<PipelinePicture> {
        let spec = plan.spec();
        let stages = plan.total_stages();
        let modules = spec.modules();
        let ranks: usize = modules.iter().map(|m| m.grid.size()).sum();
        if stages > MAX_STAGES || modules.len() > MAX_MODULES || ranks > MAX_RANKS {
            return Err(usage!(
                "grid pipeline: --svg draws at most {MAX_STAGES} stages, {MAX_MODULES} modules and {MAX_RANKS} module ranks; {name} has {stages}, {} and {ranks}; use the text output",
                modules.len()
            ));
        }

        // Each module's stages, from any of its ranks: stages_through = first stage + pp rank + 1.
        let mut boxes: Vec<ModuleBox> = Vec::with_capacity(modules.len());
        for m in modules {
            let (lo, _) = m.rank_range();
            let ms = plan
                .rank(lo)
                .and_then(|rp| rp.modules.get(&m.name))
                .ok_or_else(|| {
                    usage!(
                        "grid pipeline: {name}: rank {lo} of module {} has no stage in the plan",
                        m.name
                    )
                })?;
            let first_stage = (ms.stages_through - 1).saturating_sub(ms.pp_rank);
            boxes.push(ModuleBox {
                name: m.name.clone(),
                first_stage,
                stages: m.pp_size(),
                slot: 0,
                x: 0.0,
                y: 0.0,
                w: 0.0,
                h: 0.0,
            });
        }

        // The text of each box: name, grid sizes, ranks, then one line per stage.
        let colocated = spec.colocated();
        let partners = |module: &str| -> Vec<String> {
            colocated
                .iter()
                .filter(|set| set.iter().any(|n| n == module))
                .flat_map(|set| set.iter().filter(|n| *n != module).cloned())
                .collect()
        };
        let mut lines: Vec<Vec<String>> = Vec::with_capacity(modules.len());
        for m in modules {
            let g = &m.grid;
            let sizes = g
                .dim_names()
                .iter()
                .zip(g.shape())
                .map(|(n, s)| format!("{n} {s}"))
                .collect::<Vec<_>>()
                .join(" × ");
            let (lo, hi) = m.rank_range();
            let mut l = vec![
                sizes,
                format!(
                    "ranks {lo}..={} ({} rank{})",
                    hi - 1,
                    hi - lo,
                    if hi - lo == 1 { "" } else { "s" }
                ),
            ];
            let with = partners(&m.name);
            if !with.is_empty() {
                l.push(format!("colocated with {}", with.join(", ")));
            }
            if spec.language_model() == Some(m.name.as_str()) {
                l.push("language model".to_string());
            }
            lines.push(l);
        }
        let stage_lines = |m: &multimodule::ModuleSpec, s: usize| -> String {
            let (lo, hi) = m.rank_range();
            let members: Vec<usize> = (lo..hi).filter(|&r| m.pp_rank(r) == Some(s)).collect();
            show_list(&members)
        };

        // Slots: in topological order, the first slot free over the module's stages.
        let mut used: Vec<Vec<usize>> = vec![Vec::new(); stages.max(1)];
        for &i in spec.topological_order() {
            let b = &boxes[i];
            let span = b.first_stage..(b.first_stage + b.stages).min(stages.max(1));
            let mut slot = 0;
            while span.clone().any(|s| used[s].contains(&slot)) {
                slot += 1;
            }
            for s in span {
                used[s].push(slot);
            }
            boxes[i].slot = slot;
        }
        let slots = boxes.iter().map(|b| b.slot + 1).max().unwrap_or(1);
        let box_h =
            |i: usize| 8.0 + NAME + 6.0 + lines[i].len() as f64 * LINE + 8.0 + 2.0 * LINE + 8.0;
        let mut slot_h = vec![0.0f64; slots];
        for (i, b) in boxes.iter().enumerate() {
            slot_h[b.slot] = slot_h[b.slot].max(box_h(i));
        }
        let top = MARGIN + TITLE + 8.0 + SMALL + 30.0;
        let slot_y: Vec<f64> = slot_h
            .iter()
            .scan(top, |y, h| {
                let here = *y;
                *y += h + GAP_Y;
                Some(here)
            })
            .collect();
        for (i, b) in boxes.iter_mut().enumerate() {
            b.x = MARGIN + b.first_stage as f64 * (STAGE_W + GAP_X);
            b.w = b.stages as f64 * STAGE_W + (b.stages - 1) as f64 * GAP_X;
            b.y = slot_y[b.slot];
            b.h = box_h(i);
        }

        let title = format!(
            "grid pipeline: {name}: {} module{}, {stages} stage{}, {} bridge{}{}",
            modules.len(),
            if modules.len() == 1 { "" } else { "s" },
            if stages == 1 { "" } else { "s" },
            plan.bridges().len(),
            if plan.bridges().len() == 1 { "" } else { "s" },
            spec.world_size()
                .map_or(String::new(), |w| format!(", world size {w}"))
        );
        let subtitle = "columns: pipeline stages; boxes: modules (grid sizes, ranks, ranks of each stage); arrows: bridges (lanes, leaders)";
        let grid_w =
            MARGIN + stages.max(1) as f64 * STAGE_W + (stages.max(1) - 1) as f64 * GAP_X + MARGIN;
        let grid_bottom =
            slot_y.last().copied().unwrap_or(top) + slot_h.last().copied().unwrap_or(0.0);
        let width = grid_w
            .max(2.0 * MARGIN + text_width(&title, TITLE))
            .max(2.0 * MARGIN + text_width(subtitle, SMALL));
        let height = grid_bottom + 8.0 + MARGIN;

        let mut doc = document(width, height, &title);
        doc = doc
            .add(text(MARGIN, MARGIN + TITLE, TITLE, "start", &title).set("font-weight", "bold"))
            .add(text(
                MARGIN,
                MARGIN + TITLE + 8.0 + SMALL,
                SMALL,
                "start",
                subtitle,
            ));
        doc = doc.add(
            Definitions::new().add(
                Marker::new()
                    .set("id", "arrow")
                    .set("viewBox", (0, 0, 10, 10))
                    .set("refX", 9)
                    .set("refY", 5)
                    .set("markerWidth", 8)
                    .set("markerHeight", 8)
                    .set("orient", "auto")
                    .add(
                        Path::new()
                            .set("d", "M 0 0 L 10 5 L 0 10 z")
                            .set("fill", "#333333"),
                    ),
            ),
        );

        // Stage columns.
        let mut cols = SvgGroup::new().set("id", "stages");
        for s in 0..stages {
            let x = MARGIN + s as f64 * (STAGE_W + GAP_X);
            cols = cols
                .add(rect(
                    x,
                    top - 22.0,
                    STAGE_W,
                    grid_bottom - top + 30.0,
                    "#f4f4f4",
                ))
                .add(
                    text(
                        x + STAGE_W / 2.0,
                        top - 8.0,
                        SMALL,
                        "middle",
                        &format!("stage {s}"),
                    )
                    .set("fill", "#555555"),
                );
        }
        doc = doc.add(cols);

        // Module boxes.
        let mut layer = SvgGroup::new().set("id", "modules");
        for (i, (b, m)) in boxes.iter().zip(modules).enumerate() {
            let c = colour(i);
            let pale = [
                (u16::from(c[0]) + 3 * 255) / 4,
                (u16::from(c[1]) + 3 * 255) / 4,
                (u16::from(c[2]) + 3 * 255) / 4,
            ]
            .map(|v| v as u8);
            let mut frame = rect(b.x, b.y, b.w, b.h, &hex(pale))
                .set("rx", 6)
                .set("stroke", hex(c))
                .set("stroke-width", 2);
            if !partners(&b.name).is_empty() {
                frame = frame.set("stroke-dasharray", "6 3").set("stroke-width", 3);
            }
            let chars = (b.w / (0.6 * SMALL)) as usize;
            let mut g = SvgGroup::new()
                .set("id", format!("module-{}", b.name))
                .add(frame);
            g = g.add(
                text(
                    b.x + 10.0,
                    b.y + 8.0 + NAME,
                    NAME,
                    "start",
                    &clip(&b.name, (b.w / (0.6 * NAME)) as usize),
                )
                .set("font-weight", "bold"),
            );
            let mut y = b.y + 8.0 + NAME + 6.0;
            for l in &lines[i] {
                y += LINE;
                g = g.add(text(b.x + 10.0, y, SMALL, "start", &clip(l, chars)));
            }
            // One panel per stage of the module.
            let py = y + 8.0;
            for s in 0..b.stages {
                let px = b.x + s as f64 * (STAGE_W + GAP_X);
                let stage = b.first_stage + s;
                let pw = STAGE_W - 12.0;
                g = g
                    .add(
                        rect(px + 6.0, py, pw, 2.0 * LINE + 2.0, "#ffffff")
                            .set("stroke", hex(c))
                            .set("stroke-width", 1),
                    )
                    .add(text(
                        px + 12.0,
                        py + LINE - 2.0,
                        SMALL,
                        "start",
                        &format!("stage {stage} (pp rank {s})"),
                    ))
                    .add(text(
                        px + 12.0,
                        py + 2.0 * LINE - 2.0,
                        SMALL,
                        "start",
                        &clip(
                            &format!("ranks {}", stage_lines(m, s)),
                            (pw / (0.6 * SMALL)) as usize,
                        ),
                    ));
            }
            layer = layer.add(g);
        }
        doc = doc.add(layer);

        // Bridges.
        let mut arrows = SvgGroup::new().set("id", "bridges");
        for br in plan.bridges() {
            let (Ok(si), Ok(di)) = (spec.module_index(&br.src), spec.module_index(&br.dst)) else {
                continue;
            };
            let (s, d) = (&boxes[si], &boxes[di]);
            let (x1, y1, x2, y2, path) = if d.x >= s.x + s.w {
                let (x1, y1) = (s.x + s.w, s.y + s.h / 2.0);
                let (x2, y2) = (d.x - 2.0, d.y + d.h / 2.0);
                let mid = (x1 + x2) / 2.0;
                (
                    x1,
                    y1,
                    x2,
                    y2,
                    format!(
                        "M {} {} C {} {} {} {} {} {}",
                        round(x1),
                        round(y1),
                        round(mid),
                        round(y1),
                        round(mid),
                        round(y2),
                        round(x2),
                        round(y2)
                    ),
                )
            } else {
                // The destination starts in a stage the source reaches (colocated modules): a
                // vertical arrow.
                let (x1, y1) = (s.x + s.w - 30.0, if d.y > s.y { s.y + s.h } else { s.y });
                let (x2, y2) = (
                    d.x + 30.0,
                    if d.y > s.y {
                        d.y - 2.0
                    } else {
                        d.y + d.h + 2.0
                    },
                );
                let my = (y1 + y2) / 2.0;
                (
                    x1,
                    y1,
                    x2,
                    y2,
                    format!(
                        "M {} {} C {} {} {} {} {} {}",
                        round(x1),
                        round(y1),
                        round(x1),
                        round(my),
                        round(x2),
                        round(my),
                        round(x2),
                        round(y2)
                    ),
                )
            };
            let (ns, nd) = (br.src_leaders.len(), br.dst_leaders.len());
            let lanes = if ns > nd {
                format!("{ns} → {nd} lanes, fan-in {}", ns.div_ceil(nd.max(1)))
            } else if nd > ns {
                format!("{ns} → {nd} lanes, fan-out {}", nd.div_ceil(ns.max(1)))
            } else {
                format!("{ns} → {nd} lane{}, 1:1", if nd == 1 { "" } else { "s" })
            };
            let leaders = format!(
                "leaders {} → {}",
                clip(&show_list(&br.src_leaders), 24),
                clip(&show_list(&br.dst_leaders), 24)
            );
            // The label sits just above the arrow's middle.
            let (lx, ly) = ((x1 + x2) / 2.0, (y1 + y2) / 2.0 - 14.0);
            arrows = arrows
                .add(
                    Path::new()
                        .set("d", path)
                        .set("fill", "none")
                        .set("stroke", "#333333")
                        .set("stroke-width", 2)
                        .set("marker-end", "url(#arrow)"),
                )
                .add(halo(text(lx, ly - 12.0, 10.0, "middle", &lanes)))
                .add(halo(text(lx, ly + 1.0, 10.0, "middle", &leaders)));
        }
        doc = doc.add(arrows);

        Ok(PipelinePicture {
            boxes,
            bridges: plan.bridges().len(),
            stages,
            width: width.ceil(),
            height: height.ceil(),
            svg: doc.to_string(),
        })
    }

    /// The picture as an SVG document.
    pub fn to_svg(&self) -> String {
        self.svg.clone()
    }

    /// Width and height in pixels.
    pub fn size(&self) -> (u32, u32) {
        (self.width as u32, self.height as u32)
    }

    /// The box of `module`: left, top, width and height in pixels.
    pub fn module_box(&self, module: &str) -> Option<(f64, f64, f64, f64)> {
        self.boxes
            .iter()
            .find(|b| b.name == module)
            .map(|b| (b.x, b.y, b.w, b.h))
    }

    /// The first stage of `module` and how many stages it spans.
    pub fn module_stages(&self, module: &str) -> Option<(usize, usize)> {
        self.boxes
            .iter()
            .find(|b| b.name == module)
            .map(|b| (b.first_stage, b.stages))
    }

    /// One line for the command's stdout: what was drawn.
    pub fn summary(&self, path: &str) -> String {
        let (w, h) = self.size();
        format!(
            "grid pipeline: wrote {path} ({w}×{h} pixels, {} modules over {} stages, {} bridges)",
            self.boxes.len(),
            self.stages,
            self.bridges
        )
    }
}

/// A white outline under the glyphs, so that a label stays readable where it crosses an arrow.
fn halo(t: svg::node::element::Text) -> svg::node::element::Text {
    t.set("stroke", "#ffffff")
        .set("stroke-width", 3)
        .set("stroke-linejoin", "round")
        .set("paint-order", "stroke")
}
