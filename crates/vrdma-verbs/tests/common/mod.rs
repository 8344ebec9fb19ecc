//! The process harness these tests share with the other drop-in
//! libraries' (`vrdma_it::harness`).

#![allow(unused_imports)] // each test file uses a different part

pub use vrdma_it::harness::*;
