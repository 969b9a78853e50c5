//! Compute backends: the ops a decoder needs.

pub mod cpu;
