//! `--svg`: the pictures of `grid layout` and `grid pipeline`, rendered to pixels with resvg
//! (pure Rust) and checked: they parse and render, have the size they claim, and the cells of
//! two ranks of one group have one colour while two groups differ.

mod common;

use grid_cli::picture::{colour, LayoutPicture, PipelinePicture};
use grid_core::{Family, FamilyLevel, LayoutConfig, LayoutPlan};
use resvg::tiny_skia::{Pixmap, Transform};
use resvg::usvg;
use std::path::{Path, PathBuf};

/// Runs the built `grid` binary.
fn grid(args: &[&str]) -> common::Run {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    common::grid(&args)
}

/// The demo's pipeline spec (crates/grid-programs/examples/multimodule-demo.rs), as committed.
fn demo_spec() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/pictures/demo-pipeline.json")
}

/// A fresh directory for this test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("grid-pictures-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Parses and renders an SVG document; panics (the test fails) if either step fails.
fn render(svg: &str) -> Pixmap {
    let mut opt = usvg::Options::default();
    opt.fontdb_mut().load_system_fonts();
    let tree = usvg::Tree::from_str(svg, &opt).unwrap_or_else(|e| panic!("invalid SVG: {e}"));
    let size = tree.size().to_int_size();
    let mut pixmap = Pixmap::new(size.width(), size.height()).expect("a non-empty picture");
    resvg::render(&tree, Transform::default(), &mut pixmap.as_mut());
    pixmap
}

/// The RGB of the pixel at (x, y).
fn pixel(p: &Pixmap, x: f64, y: f64) -> [u8; 3] {
    let c = p.pixel(x as u32, y as u32).unwrap_or_else(|| {
        panic!(
            "({x}, {y}) is outside the {}×{} picture",
            p.width(),
            p.height()
        )
    });
    let c = c.demultiply();
    [c.red(), c.green(), c.blue()]
}

/// The colour of `rank`'s cell, sampled near its top-left corner (away from the label).
fn cell_colour(pic: &LayoutPicture, p: &Pixmap, rank: usize) -> [u8; 3] {
    let (x, y, side) = pic
        .cell(rank)
        .unwrap_or_else(|| panic!("rank {rank} has no cell"));
    pixel(p, x + side * 0.2, y + side * 0.15)
}

fn plan(world: usize, tp: usize, pp: usize, cp: usize, ep: usize, etp: usize) -> LayoutPlan {
    let mut cfg = LayoutConfig::new(world);
    cfg.tp = tp;
    cfg.pp = pp;
    cfg.cp = cp;
    cfg.ep = ep;
    cfg.etp = Some(etp);
    LayoutPlan::new(cfg).unwrap()
}

/// Same colour within a group, different colours across groups, for every pair of ranks whose
/// cells are checked.
fn check_colours(plan: &LayoutPlan, family: Family, pic: &LayoutPicture, p: &Pixmap) {
    let fl = FamilyLevel::from(family);
    let world = plan.world_size();
    let mut seen = 0;
    for a in 0..world {
        let b = (a * 7 + 3) % world;
        let (ga, gb) = (
            plan.group_index_of(fl, a).unwrap(),
            plan.group_index_of(fl, b).unwrap(),
        );
        assert_eq!(pic.group_of(a), ga);
        let (ca, cb) = (cell_colour(pic, p, a), cell_colour(pic, p, b));
        assert_eq!(
            ca,
            ga.map_or(grid_cli::picture::NO_GROUP, colour),
            "rank {a}"
        );
        if ga == gb {
            assert_eq!(ca, cb, "ranks {a} and {b} share {family} group {ga:?}");
        } else {
            assert_ne!(
                ca, cb,
                "ranks {a} ({ga:?}) and {b} ({gb:?}) are in different {family} groups"
            );
            seen += 1;
        }
    }
    assert!(seen > 0, "no pair of different groups was compared");
}

#[test]
fn the_issue_layout_renders_with_dp_colours_and_nodes() {
    let plan = plan(64, 2, 2, 2, 4, 1);
    let pic = LayoutPicture::new(&plan, Family::Dp.into(), Some(8)).unwrap();
    let p = render(&pic.to_svg());
    assert_eq!((p.width(), p.height()), pic.size());
    assert_eq!(pic.groups(), 8);
    // tp·cp = 4 consecutive ranks share a dp index; dp groups (stride 4) span 32 ranks, so every
    // one of them crosses 8-rank nodes.
    assert_eq!(pic.groups_crossing_nodes(), Some(8));
    // Ranks 0 and 4 are in dp group 0, rank 1 in dp group 1.
    assert_eq!(cell_colour(&pic, &p, 0), cell_colour(&pic, &p, 4));
    assert_ne!(cell_colour(&pic, &p, 0), cell_colour(&pic, &p, 1));
    check_colours(&plan, Family::Dp, &pic, &p);
    let svg = pic.to_svg();
    assert!(svg.contains("thick black lines: node boundaries (8 ranks per node, 8 nodes)"));
    assert!(svg.contains("8 of 8 dp groups cross nodes"));
}

#[test]
fn tp_groups_inside_a_node_do_not_cross() {
    let plan = plan(16, 4, 1, 1, 1, 4);
    let pic = LayoutPicture::new(&plan, Family::Tp.into(), Some(8)).unwrap();
    assert_eq!(pic.groups_crossing_nodes(), Some(0));
    let p = render(&pic.to_svg());
    check_colours(&plan, Family::Tp, &pic, &p);
}

#[test]
fn small_and_large_layouts_render_at_their_size() {
    for (plan, family) in [
        (plan(8, 2, 1, 1, 1, 2), Family::Tp),
        (plan(1024, 8, 4, 1, 8, 1), Family::Pp),
        (plan(1024, 4, 2, 1, 1, 4), Family::Dp),
        (plan(1024, 1, 2, 1, 1, 1), Family::Dp),
        (plan(1024, 2, 2, 2, 2, 1), Family::Ep),
    ] {
        let pic = LayoutPicture::new(&plan, family.into(), Some(8)).unwrap();
        let (w, h) = pic.size();
        assert!(w <= 2400 && h <= 2400, "{w}×{h}");
        let p = render(&pic.to_svg());
        assert_eq!((p.width(), p.height()), (w, h));
        check_colours(&plan, family, &pic, &p);
    }
}

#[test]
fn ranks_in_no_group_are_grey() {
    // Embedding groups hold the first and last stage only.
    let plan = plan(8, 1, 4, 1, 1, 1);
    let pic = LayoutPicture::new(&plan, Family::Embd.into(), None).unwrap();
    let p = render(&pic.to_svg());
    check_colours(&plan, Family::Embd, &pic, &p);
    assert_eq!(pic.group_of(2), None);
    assert_eq!(cell_colour(&pic, &p, 2), grid_cli::picture::NO_GROUP);
}

#[test]
fn too_many_ranks_is_an_error() {
    let plan = plan(1 << 17, 1, 1, 1, 1, 1);
    let err = LayoutPicture::new(&plan, Family::Tp.into(), None).unwrap_err();
    assert!(err.to_string().contains("at most 65536 ranks"), "{err}");
}

#[test]
fn the_demo_pipeline_renders() {
    let plan = multimodule::PipelinePlan::from_spec_file(demo_spec()).unwrap();
    let pic = PipelinePicture::new(&plan, "demo-pipeline.json").unwrap();
    let p = render(&pic.to_svg());
    assert_eq!((p.width(), p.height()), pic.size());
    // Encoders in stage 0, the llm over stages 1 and 2, the generator in stage 3.
    assert_eq!(pic.module_stages("image_encoder"), Some((0, 1)));
    assert_eq!(pic.module_stages("audio_encoder"), Some((0, 1)));
    assert_eq!(pic.module_stages("llm"), Some((1, 2)));
    assert_eq!(pic.module_stages("generator"), Some((3, 1)));
    let (ix, iy, _, ih) = pic.module_box("image_encoder").unwrap();
    let (ax, ay, _, _) = pic.module_box("audio_encoder").unwrap();
    let (lx, _, lw, _) = pic.module_box("llm").unwrap();
    let (gx, ..) = pic.module_box("generator").unwrap();
    assert_eq!(ix, ax);
    assert!(ay >= iy + ih, "the two encoders do not overlap");
    assert!(lx > ix && gx >= lx + lw);
    // Each box is drawn in its module's colour (its frame), on white.
    let frame = pixel(&p, lx + lw / 2.0, pic.module_box("llm").unwrap().1);
    assert_eq!(frame, colour(2));
    assert_ne!(pixel(&p, 2.0, 2.0), frame);
    let svg = pic.to_svg();
    assert!(
        svg.contains("2 → 1 lanes, fan-in 2"),
        "image encoder dp 2 into llm dp 1"
    );
    assert!(svg.contains("leaders [0, 1] → [3]"));
    assert!(!svg.contains("<script") && !svg.contains("@font-face") && !svg.contains("href"));
}

#[test]
fn colocated_modules_are_marked() {
    let spec = r#"{"modules": {"vision": {"tp": 2}, "llm": {"tp": 2, "pp": 2}},
                   "topology": {"vision": ["llm"]}, "colocated": [["vision", "llm"]]}"#;
    let dir = scratch("colocated");
    let path = dir.join("spec.json");
    std::fs::write(&path, spec).unwrap();
    let plan = match multimodule::PipelinePlan::from_spec_file(&path) {
        Ok(p) => p,
        Err(e) => panic!("the colocated spec is valid: {e}"),
    };
    let pic = PipelinePicture::new(&plan, "spec.json").unwrap();
    let svg = pic.to_svg();
    assert!(svg.contains("colocated with llm"));
    assert!(svg.contains("stroke-dasharray"));
    render(&svg);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_command_writes_the_pictures_and_says_so() {
    let dir = scratch("command");
    let out = dir.join("out.svg");
    let o = grid(&[
        "layout",
        "--world-size",
        "64",
        "--tp",
        "2",
        "--pp",
        "2",
        "--cp",
        "2",
        "--ep",
        "4",
        "--etp",
        "1",
        "--svg",
        out.to_str().unwrap(),
        "--color-by",
        "dp",
        "--ranks-per-node",
        "8",
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert_eq!(o.stdout.lines().count(), 1, "{}", o.stdout);
    assert!(o
        .stdout
        .starts_with(&format!("grid layout: wrote {}", out.display())));
    assert!(o
        .stdout
        .contains("coloured by dp: 8 groups, 8 crossing nodes"));
    render(&std::fs::read_to_string(&out).unwrap());

    let p = dir.join("p.svg");
    let spec = demo_spec();
    let o = grid(&[
        "pipeline",
        spec.to_str().unwrap(),
        "--svg",
        p.to_str().unwrap(),
    ]);
    assert_eq!(o.code, 0, "{}", o.stderr);
    assert!(
        o.stdout.contains("4 modules over 4 stages, 3 bridges"),
        "{}",
        o.stdout
    );
    render(&std::fs::read_to_string(&p).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_picture_arguments_exit_2_with_one_line() {
    let dir = scratch("bad");
    let ok = dir.join("x.svg");
    let ok = ok.to_str().unwrap();
    let spec = demo_spec();
    let spec = spec.to_str().unwrap();
    let missing = dir.join("no/such/dir/x.svg");
    let missing = missing.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "layout",
                "--world-size",
                "8",
                "--svg",
                ok,
                "--color-by",
                "frob",
            ],
            "unknown --color-by family 'frob': valid families are tp, pp,",
        ),
        (
            vec![
                "layout",
                "--world-size",
                "8",
                "--svg",
                ok,
                "--color-by",
                "inter_dist_opt",
            ],
            "this layout has no inter_dist_opt groups",
        ),
        (
            vec![
                "layout",
                "--world-size",
                "8",
                "--svg",
                ok,
                "--color-by",
                "hcp[0]",
            ],
            "this layout has no hcp[0] groups",
        ),
        (
            vec!["layout", "--world-size", "8", "--svg", missing],
            "cannot write the picture to",
        ),
        (
            vec!["layout", "--world-size", "8", "--svg", ""],
            "--svg needs a file name",
        ),
        (
            vec![
                "layout",
                "--world-size",
                "8",
                "--svg",
                ok,
                "--ranks-per-node",
                "0",
            ],
            "--ranks-per-node",
        ),
        (
            vec!["layout", "--world-size", "8", "--color-by", "dp"],
            "--svg",
        ),
        (
            vec!["layout", "--world-size", "8", "--svg", ok, "--rank", "1"],
            "cannot be used with",
        ),
        (
            vec![
                "layout",
                "--world-size",
                "8",
                "--svg",
                ok,
                "--format",
                "json",
            ],
            "cannot be used with",
        ),
        (
            vec!["pipeline", spec, "--svg", missing],
            "cannot write the picture to",
        ),
        (
            vec!["pipeline", spec, "--svg", ok, "--format", "json"],
            "cannot be used with",
        ),
    ];
    for (args, want) in cases {
        let o = grid(&args);
        assert_eq!(o.code, 2, "{args:?}: {}", o.stderr);
        assert_eq!(o.stdout, "", "{args:?}");
        assert_eq!(o.stderr.lines().count(), 1, "{args:?}: {}", o.stderr);
        assert!(o.stderr.contains(want), "{args:?}: {}", o.stderr);
    }
    assert!(!Path::new(ok).exists(), "no picture is written on an error");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Not a test of the pictures but the way the README's PNGs are made: with GRID_WRITE_PNGS set,
/// renders the two documented commands' SVGs to docs/pictures/*.png.
#[test]
fn write_the_documentation_pngs_when_asked() {
    if std::env::var_os("GRID_WRITE_PNGS").is_none() {
        return;
    }
    // Run from the workspace root, as the documentation shows the commands.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let docs = root.join("docs/pictures");
    let dir = scratch("pngs");
    let layout = dir.join("layout.svg");
    let pipeline = dir.join("pipeline.svg");
    let layout_args = [
        "layout",
        "--world-size",
        "64",
        "--tp",
        "2",
        "--pp",
        "2",
        "--cp",
        "2",
        "--ep",
        "4",
        "--etp",
        "1",
        "--svg",
        layout.to_str().unwrap(),
        "--color-by",
        "dp",
        "--ranks-per-node",
        "8",
    ];
    let pipeline_args = [
        "pipeline",
        "docs/pictures/demo-pipeline.json",
        "--svg",
        pipeline.to_str().unwrap(),
    ];
    for args in [&layout_args[..], &pipeline_args[..]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_grid"))
            .args(args)
            .current_dir(&root)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for (svg, png) in [(layout, "layout-64.png"), (pipeline, "demo-pipeline.png")] {
        let p = render(&std::fs::read_to_string(svg).unwrap());
        p.save_png(docs.join(png)).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
