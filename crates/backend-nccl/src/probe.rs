//! Finding the CUDA driver library and libnccl before cudarc touches them.
//!
//! cudarc loads both libraries lazily and **panics** when one is missing, so this backend checks
//! first and returns a clear [`grid_core::Error`] that says what was looked for and where.
//!
//! # How the libraries are located
//! cudarc (built with `dynamic-loading`) asks the dynamic loader (`dlopen`) for a fixed list of
//! names ([`Library::candidates`]): for the driver `libcuda.so`, ..., `libcuda.so.1`; for NCCL
//! `libnccl.so`, `libnccl.so.12`, `.11`, `.10`, `.9`, `.1`, ... The loader searches
//! `LD_LIBRARY_PATH`, then the directories in `/etc/ld.so.cache` (`/etc/ld.so.conf*`), then
//! `/lib` and `/usr/lib`.
//!
//! # The `libnccl.so.2` problem
//! NCCL's real soname is `libnccl.so.2`, which is **not** in cudarc 0.19's list. NVIDIA's Debian
//! package `libnccl-dev` also installs the `libnccl.so` link, but the Python wheels
//! (`nvidia-nccl-cu12`, `nvidia-nccl-cu13`) and `libnccl2` alone ship only `libnccl.so.2`. Since
//! `LD_LIBRARY_PATH` is read once at process start and cudarc passes bare names to `dlopen`,
//! the process cannot fix this itself; the fix is a symlink named `libnccl.so` in a directory on
//! `LD_LIBRARY_PATH`:
//! ```text
//! mkdir -p ~/.local/lib/nccl-link
//! ln -sf /path/to/libnccl.so.2 ~/.local/lib/nccl-link/libnccl.so
//! export LD_LIBRARY_PATH=~/.local/lib/nccl-link:$LD_LIBRARY_PATH
//! ```
//! [`check_libraries`] detects this case and prints those commands with the real path.

use crate::ffi;
use grid_core::Result;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// One of the two libraries this backend needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Library {
    /// Human name (`"CUDA driver"`, `"NCCL"`).
    pub what: &'static str,
    /// File-name stem every variant starts with (`"libcuda.so"`, `"libnccl.so"`).
    pub stem: &'static str,
    /// The library's real soname (`"libcuda.so.1"`, `"libnccl.so.2"`).
    pub soname: &'static str,
    /// The names cudarc asks the dynamic loader for, in its order.
    pub candidates: Vec<String>,
    /// What to install when nothing is found.
    pub install_hint: &'static str,
}

impl Library {
    /// The CUDA driver library (`libcuda.so.1`, installed with the NVIDIA driver).
    ///
    /// ```
    /// let lib = backend_nccl::probe::Library::driver();
    /// assert!(lib.candidates.iter().any(|n| n == "libcuda.so.1"));
    /// ```
    pub fn driver() -> Library {
        Library {
            what: "CUDA driver",
            stem: "libcuda.so",
            soname: "libcuda.so.1",
            candidates: dedup(cudarc::get_lib_name_candidates("cuda")),
            install_hint:
                "install the NVIDIA driver (it provides libcuda.so.1; inside a container \
                           run with the NVIDIA container toolkit, e.g. `docker run --gpus all`)",
        }
    }

    /// libnccl.
    ///
    /// ```
    /// let lib = backend_nccl::probe::Library::nccl();
    /// assert!(lib.candidates.iter().any(|n| n == "libnccl.so"));
    /// assert!(!lib.candidates.iter().any(|n| n == "libnccl.so.2")); // the cudarc 0.19 gap
    /// ```
    pub fn nccl() -> Library {
        Library {
            what: "NCCL",
            stem: "libnccl.so",
            soname: "libnccl.so.2",
            candidates: dedup(cudarc::get_lib_name_candidates("nccl")),
            install_hint: "install NCCL >= 2.18 (NVIDIA's `libnccl2` + `libnccl-dev` packages, or \
                           `pip install nvidia-nccl-cu12`) and put its lib directory on LD_LIBRARY_PATH",
        }
    }
}

fn dedup(v: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(v.len());
    for s in v {
        if !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

/// Where a directory in the search list comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Origin {
    /// An entry of `LD_LIBRARY_PATH` (searched by the loader).
    LdLibraryPath,
    /// A directory listed in `/etc/ld.so.conf*` (searched through the loader cache).
    LdSoConf,
    /// A default directory of the loader (`/lib`, `/usr/lib`, multiarch dirs).
    Default,
    /// A usual install location that the loader does **not** search unless configured
    /// (CUDA toolkit, `NCCL_HOME`, Python wheels, conda).
    Usual,
}

impl Origin {
    /// True if `dlopen` of a bare name looks here.
    pub fn searched_by_loader(self) -> bool {
        self != Origin::Usual
    }
    fn label(self) -> &'static str {
        match self {
            Origin::LdLibraryPath => "LD_LIBRARY_PATH",
            Origin::LdSoConf => "ld.so.conf",
            Origin::Default => "loader default",
            Origin::Usual => "not searched by the loader",
        }
    }
}

/// The directories looked at for diagnostics, in order, each with its [`Origin`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SearchPath {
    /// Directories and where they come from.
    pub dirs: Vec<(PathBuf, Origin)>,
}

impl SearchPath {
    /// Directories from the environment of this process: `LD_LIBRARY_PATH`, `/etc/ld.so.conf*`,
    /// the loader defaults, then usual CUDA / NCCL / Python-wheel / conda locations.
    ///
    /// ```
    /// let sp = backend_nccl::probe::SearchPath::from_env();
    /// assert!(sp.dirs.iter().any(|(d, _)| d == std::path::Path::new("/usr/lib")));
    /// ```
    pub fn from_env() -> SearchPath {
        let mut sp = SearchPath::default();
        if let Some(v) = std::env::var_os("LD_LIBRARY_PATH") {
            for d in std::env::split_paths(&v) {
                if !d.as_os_str().is_empty() {
                    sp.push(d, Origin::LdLibraryPath);
                }
            }
        }
        for d in ld_so_conf_dirs(Path::new("/etc/ld.so.conf"), 0) {
            sp.push(d, Origin::LdSoConf);
        }
        let multiarch = format!("{}-linux-gnu", std::env::consts::ARCH);
        for d in ["/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib"] {
            sp.push(PathBuf::from(d), Origin::Default);
        }
        sp.push(Path::new("/lib").join(&multiarch), Origin::Default);
        sp.push(Path::new("/usr/lib").join(&multiarch), Origin::Default);
        for var in [
            "CUDA_HOME",
            "CUDA_PATH",
            "NCCL_HOME",
            "NCCL_ROOT",
            "CONDA_PREFIX",
        ] {
            if let Some(v) = std::env::var_os(var) {
                let base = PathBuf::from(v);
                sp.push(base.join("lib64"), Origin::Usual);
                sp.push(base.join("lib"), Origin::Usual);
            }
        }
        sp.push(PathBuf::from("/usr/local/cuda/lib64"), Origin::Usual);
        sp.push(
            PathBuf::from(format!(
                "/usr/local/cuda/targets/{}-linux/lib",
                std::env::consts::ARCH
            )),
            Origin::Usual,
        );
        // Python wheels: <prefix>/lib/python3.X/{site,dist}-packages/nvidia/nccl/lib
        let mut prefixes = vec![PathBuf::from("/usr/local"), PathBuf::from("/usr")];
        for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
            if let Some(v) = std::env::var_os(var) {
                prefixes.push(PathBuf::from(v));
            }
        }
        if let Some(h) = std::env::var_os("HOME") {
            prefixes.push(Path::new(&h).join(".local"));
        }
        for p in prefixes {
            for py in python_dirs(&p.join("lib")) {
                for pk in ["site-packages", "dist-packages"] {
                    sp.push(py.join(pk).join("nvidia/nccl/lib"), Origin::Usual);
                }
            }
        }
        sp.push(
            PathBuf::from("/usr/lib/python3/dist-packages/nvidia/nccl/lib"),
            Origin::Usual,
        );
        sp
    }

    /// Adds a directory once (the first origin wins).
    pub fn push(&mut self, dir: PathBuf, origin: Origin) {
        if !self.dirs.iter().any(|(d, _)| *d == dir) {
            self.dirs.push((dir, origin));
        }
    }
}

fn python_dirs(lib: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(lib) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with("python3") {
                out.push(e.path());
            }
        }
    }
    out.sort();
    out
}

/// Directories named in an `ld.so.conf` file, following `include` lines (glob `*` in the last
/// path component only, as Debian uses it), at most 4 levels deep.
fn ld_so_conf_dirs(file: &Path, depth: usize) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(text) = std::fs::read_to_string(file) else {
        return out;
    };
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        if let Some(pat) = line.strip_prefix("include") {
            if depth >= 4 {
                continue;
            }
            let pat = Path::new(pat.trim());
            let (dir, name) = (pat.parent().unwrap_or(Path::new("/")), pat.file_name());
            let name = name
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let (pre, suf) = name.split_once('*').unwrap_or((name.as_str(), ""));
            let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                .map(|rd| {
                    rd.flatten()
                        .map(|e| e.path())
                        .filter(|p| {
                            let n = p
                                .file_name()
                                .map(|n| n.to_string_lossy().into_owned())
                                .unwrap_or_default();
                            if name.contains('*') {
                                n.starts_with(pre) && n.ends_with(suf)
                            } else {
                                n == name
                            }
                        })
                        .collect()
                })
                .unwrap_or_default();
            files.sort();
            for f in files {
                out.extend(ld_so_conf_dirs(&f, depth + 1));
            }
        } else if line.starts_with('/') {
            out.push(PathBuf::from(line));
        }
    }
    out
}

/// A file found on disk whose name starts with the library's stem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Full path.
    pub path: PathBuf,
    /// Where its directory comes from.
    pub origin: Origin,
    /// True if its file name is one that cudarc asks for.
    pub cudarc_name: bool,
}

/// Every file named `<stem>*` in the search path.
pub fn find_files(lib: &Library, search: &SearchPath) -> Vec<Found> {
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for (dir, origin) in &search.dirs {
        let Ok(rd) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut names: Vec<String> = rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(lib.stem))
            .collect();
        names.sort();
        for n in names {
            let path = dir.join(&n);
            if seen.insert(path.clone()) {
                let cudarc_name = lib.candidates.contains(&n);
                out.push(Found {
                    path,
                    origin: *origin,
                    cudarc_name,
                });
            }
        }
    }
    out
}

/// The message for a library that the loader could not open under any of cudarc's names:
/// what was looked for, where, what was found instead and what to do.
///
/// `try_load` is called on found files to quote the loader's reason when one is present but
/// does not load.
pub fn diagnose(
    lib: &Library,
    search: &SearchPath,
    try_load: &dyn Fn(&Path) -> std::result::Result<(), String>,
) -> String {
    let found = find_files(lib, search);
    let ld = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let mut msg = format!(
        "the {} library could not be loaded: cudarc asks the dynamic loader for {:?} and none of \
         them loaded (the loader searches LD_LIBRARY_PATH={:?}, the ld.so cache from \
         /etc/ld.so.conf, then /lib and /usr/lib).",
        lib.what, lib.candidates, ld
    );
    let loadable_dirs: Vec<String> = search
        .dirs
        .iter()
        .map(|(d, o)| format!("{} ({})", d.display(), o.label()))
        .collect();
    if found.is_empty() {
        msg.push_str(&format!(
            " No file named {}* exists in any of: {}. To fix: {}.",
            lib.stem,
            loadable_dirs.join(", "),
            lib.install_hint
        ));
        return msg;
    }
    let listed: Vec<String> = found
        .iter()
        .map(|f| format!("{} ({})", f.path.display(), f.origin.label()))
        .collect();
    msg.push_str(&format!(" Found on disk: {}.", listed.join(", ")));
    // A file cudarc would accept by name, but in a directory the loader does not search.
    if let Some(f) = found
        .iter()
        .find(|f| f.cudarc_name && !f.origin.searched_by_loader())
    {
        let dir = f
            .path
            .parent()
            .map(|d| d.display().to_string())
            .unwrap_or_default();
        msg.push_str(&format!(
            " {} has a name cudarc looks for but its directory is not searched by the loader: \
             `export LD_LIBRARY_PATH={dir}:$LD_LIBRARY_PATH` before starting the program.",
            f.path.display()
        ));
        return msg;
    }
    // A file cudarc would accept, in a searched directory, that still does not load.
    if let Some(f) = found.iter().find(|f| f.cudarc_name) {
        let why = try_load(&f.path)
            .err()
            .unwrap_or_else(|| "it loads by full path, so check the name and permissions".into());
        msg.push_str(&format!(
            " {} is present but loading it failed: {why}.",
            f.path.display()
        ));
        return msg;
    }
    // Only other names (typically the real soname libnccl.so.2, as the Python wheels ship it).
    let f = found
        .iter()
        .find(|f| f.path.file_name().is_some_and(|n| n == lib.soname))
        .unwrap_or(&found[0]);
    let target = f.path.display();
    let loads = match try_load(&f.path) {
        Ok(()) => String::from("it loads when opened by full path"),
        Err(e) => format!("note: opening it by full path also failed: {e}"),
    };
    let wanted = lib
        .candidates
        .first()
        .map(String::as_str)
        .unwrap_or(lib.stem);
    msg.push_str(&format!(
        " {target} exists ({loads}), but cudarc 0.19 does not try the name {} (present only \
         under that name, as NVIDIA's Python wheels and the libnccl2 package ship it). Workaround: \
         create a symlink named {wanted} in a directory on LD_LIBRARY_PATH and restart: \
         `mkdir -p $HOME/.local/lib/nccl-link && ln -sf {target} $HOME/.local/lib/nccl-link/{wanted} \
         && export LD_LIBRARY_PATH=$HOME/.local/lib/nccl-link:$LD_LIBRARY_PATH`.",
        f.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
    ));
    msg
}

fn check_one(lib: &Library, loadable: bool) -> Result<()> {
    if loadable {
        return Ok(());
    }
    Err(crate::error::lib(
        if lib.what == "NCCL" {
            "load libnccl"
        } else {
            "load the CUDA driver"
        },
        diagnose(lib, &SearchPath::from_env(), &ffi::try_dlopen),
    ))
}

/// Checks that the CUDA driver library and libnccl load, without letting cudarc panic.
/// The result is computed once per process.
///
/// ```
/// // On a machine without CUDA this is an error naming what was looked for and where.
/// if let Err(e) = backend_nccl::probe::check_libraries() {
///     assert!(e.to_string().contains("could not be loaded"));
/// }
/// ```
pub fn check_libraries() -> Result<()> {
    static CHECKED: OnceLock<Result<()>> = OnceLock::new();
    CHECKED
        .get_or_init(|| {
            check_one(&Library::driver(), ffi::driver_library_loadable())?;
            check_one(&Library::nccl(), ffi::nccl_library_loadable())
        })
        .clone()
}

/// Checks the libraries, then asks the driver how many GPUs there are. `Err` explains why no GPU
/// can be used (missing driver, missing libnccl, no device); used by GPU tests to skip.
///
/// ```
/// match backend_nccl::probe::gpu_count() {
///     Ok(n) => println!("{n} GPUs"),
///     Err(e) => println!("SKIPPED: {e}"),
/// }
/// ```
pub fn gpu_count() -> Result<usize> {
    check_libraries()?;
    let n = crate::error::cuda(
        "cuDeviceGetCount",
        cudarc::driver::CudaContext::device_count,
    )?;
    if n <= 0 {
        return Err(crate::error::lib(
            "cuDeviceGetCount",
            "the CUDA driver reports no GPU",
        ));
    }
    Ok(n as usize)
}

/// The loaded NCCL version as `(major, minor, patch)`.
pub fn nccl_version() -> Result<(u32, u32, u32)> {
    check_libraries()?;
    let v = ffi::nccl_version()?.max(0) as u32;
    Ok(decode_version(v))
}

/// Decodes NCCL's version integer (`major·10000 + minor·100 + patch` since 2.9, `major·1000 +
/// minor·100 + patch` before).
///
/// ```
/// assert_eq!(backend_nccl::probe::decode_version(21805), (2, 18, 5));
/// assert_eq!(backend_nccl::probe::decode_version(2804), (2, 8, 4));
/// ```
pub fn decode_version(v: u32) -> (u32, u32, u32) {
    if v >= 10000 {
        (v / 10000, (v / 100) % 100, v % 100)
    } else {
        (v / 1000, (v / 100) % 10, v % 100)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn temp_dir(tag: &str) -> PathBuf {
        static N: AtomicUsize = AtomicUsize::new(0);
        let d = std::env::temp_dir().join(format!(
            "backend-nccl-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn no_load(_: &Path) -> std::result::Result<(), String> {
        Err("invalid ELF header".into())
    }

    #[test]
    fn candidates_miss_the_real_soname() {
        let lib = Library::nccl();
        assert_eq!(lib.candidates[0], "libnccl.so");
        assert!(lib.candidates.contains(&"libnccl.so.12".to_string()));
        assert!(!lib.candidates.contains(&"libnccl.so.2".to_string()));
        assert!(Library::driver()
            .candidates
            .contains(&"libcuda.so.1".to_string()));
    }

    #[test]
    fn only_so2_present_explains_the_symlink() {
        let d = temp_dir("so2");
        std::fs::write(d.join("libnccl.so.2"), b"").unwrap();
        let sp = SearchPath {
            dirs: vec![(d.clone(), Origin::LdLibraryPath)],
        };
        let msg = diagnose(&Library::nccl(), &sp, &no_load);
        let path = d.join("libnccl.so.2");
        assert!(msg.starts_with("the NCCL library could not be loaded: cudarc asks the dynamic loader for [\"libnccl.so\""), "{msg}");
        assert!(
            msg.contains(&format!(
                "Found on disk: {} (LD_LIBRARY_PATH).",
                path.display()
            )),
            "{msg}"
        );
        assert!(
            msg.contains("cudarc 0.19 does not try the name libnccl.so.2"),
            "{msg}"
        );
        assert!(
            msg.contains(&format!(
                "ln -sf {} $HOME/.local/lib/nccl-link/libnccl.so",
                path.display()
            )),
            "{msg}"
        );
        assert!(
            msg.contains("opening it by full path also failed: invalid ELF header"),
            "{msg}"
        );
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn nothing_found_lists_the_directories() {
        let d = temp_dir("none");
        let sp = SearchPath {
            dirs: vec![
                (d.clone(), Origin::Default),
                (PathBuf::from("/nonexistent-x"), Origin::Usual),
            ],
        };
        let msg = diagnose(&Library::nccl(), &sp, &no_load);
        assert!(
            msg.contains(&format!(
                "No file named libnccl.so* exists in any of: {} (loader default), /nonexistent-x (not searched by the loader). To fix: install NCCL >= 2.18",
                d.display()
            )),
            "{msg}"
        );
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn right_name_wrong_directory() {
        let d = temp_dir("wheel");
        std::fs::write(d.join("libnccl.so"), b"").unwrap();
        let sp = SearchPath {
            dirs: vec![(d.clone(), Origin::Usual)],
        };
        let msg = diagnose(&Library::nccl(), &sp, &no_load);
        assert!(
            msg.contains(&format!(
                "`export LD_LIBRARY_PATH={}:$LD_LIBRARY_PATH`",
                d.display()
            )),
            "{msg}"
        );
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn right_name_does_not_load() {
        let d = temp_dir("broken");
        std::fs::write(d.join("libcuda.so.1"), b"").unwrap();
        let sp = SearchPath {
            dirs: vec![(d.clone(), Origin::LdLibraryPath)],
        };
        let msg = diagnose(&Library::driver(), &sp, &ffi::try_dlopen);
        assert!(
            msg.starts_with("the CUDA driver library could not be loaded"),
            "{msg}"
        );
        assert!(
            msg.contains(&format!(
                "{} is present but loading it failed:",
                d.join("libcuda.so.1").display()
            )),
            "{msg}"
        );
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn ld_so_conf_includes_are_followed() {
        let d = temp_dir("conf");
        std::fs::create_dir_all(d.join("conf.d")).unwrap();
        std::fs::write(
            d.join("ld.so.conf"),
            format!("include {}/conf.d/*.conf\n/opt/a # comment\n", d.display()),
        )
        .unwrap();
        std::fs::write(d.join("conf.d/x.conf"), "/opt/nccl/lib\n").unwrap();
        std::fs::write(d.join("conf.d/ignored.txt"), "/opt/no\n").unwrap();
        assert_eq!(
            ld_so_conf_dirs(&d.join("ld.so.conf"), 0),
            vec![PathBuf::from("/opt/nccl/lib"), PathBuf::from("/opt/a")]
        );
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn versions() {
        assert_eq!(decode_version(22807), (2, 28, 7));
        assert_eq!(decode_version(21800), (2, 18, 0));
    }
}
