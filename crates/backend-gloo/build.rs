//! Compiles the C++ shim over the system libgloo and generates its Rust declarations.
//!
//! Needs (Debian): `libgloo-dev` (headers, libgloo.so in /usr/lib, pulls libhiredis-dev) and
//! `libclang-dev` (for bindgen). `GLOO_INCLUDE_DIR` / `GLOO_LIB_DIR` override the locations.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=shim/gloo_shim.h");
    println!("cargo:rerun-if-changed=shim/gloo_shim.cc");
    println!("cargo:rerun-if-env-changed=GLOO_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=GLOO_LIB_DIR");

    let include = env::var_os("GLOO_INCLUDE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/include"));
    if !include.join("gloo/config.h").is_file() {
        // A build script reports a missing system dependency by failing the build.
        eprintln!(
            "backend-gloo: {} not found. Install the Gloo headers and library \
             (Debian/Ubuntu: `apt-get install libgloo-dev libclang-dev`) or set GLOO_INCLUDE_DIR \
             and GLOO_LIB_DIR.",
            include.join("gloo/config.h").display()
        );
        std::process::exit(1);
    }

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .file("shim/gloo_shim.cc")
        .include(&include)
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-sign-compare")
        .flag_if_supported("-Wno-deprecated-declarations");
    // Gloo's algorithm templates are instantiated in the shim: keep them optimised even in
    // debug builds (the element-wise reductions themselves are grid-core's Rust kernels).
    build.opt_level(2);
    build.compile("gloo_shim");

    if let Some(dir) = env::var_os("GLOO_LIB_DIR") {
        println!(
            "cargo:rustc-link-search=native={}",
            PathBuf::from(dir).display()
        );
    } else {
        // Debian installs libgloo.so in /usr/lib (not the multiarch directory).
        println!("cargo:rustc-link-search=native=/usr/lib");
    }
    println!("cargo:rustc-link-lib=dylib=gloo");
    // The shim removes rendezvous keys from Redis itself (DEL through Gloo's connection).
    println!("cargo:rustc-link-lib=dylib=hiredis");
    println!("cargo:rustc-link-lib=dylib=pthread");

    let bindings = bindgen::Builder::default()
        .header("shim/gloo_shim.h")
        .allowlist_function("gloo_shim_.*")
        .allowlist_type("gloo_shim_.*")
        .allowlist_var("GLOO_SHIM_.*")
        .derive_default(false)
        .layout_tests(false)
        .generate();
    let bindings = match bindings {
        Ok(b) => b,
        Err(e) => {
            eprintln!("backend-gloo: bindgen failed on shim/gloo_shim.h: {e} (is libclang-dev installed?)");
            std::process::exit(1);
        }
    };
    let out = PathBuf::from(env::var("OUT_DIR").unwrap_or_else(|_| ".".into()));
    if let Err(e) = bindings.write_to_file(out.join("bindings.rs")) {
        eprintln!("backend-gloo: cannot write bindings: {e}");
        std::process::exit(1);
    }
}
