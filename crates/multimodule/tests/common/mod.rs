pub mod check;
pub mod threads;
pub mod vectors;
