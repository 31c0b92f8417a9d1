pub mod check;
pub mod scenarios;
pub mod threads;
pub mod vectors;
