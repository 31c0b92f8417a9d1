pub mod threads;
pub mod vectors;
