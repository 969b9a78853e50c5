//! Buffers whose size comes from a caller, reserved fallibly: a size the
//! process cannot hold is an `OutOfMemory` error naming the buffer, where
//! `vec![..; n]` would abort the whole host process.

use crate::{Error, ErrorKind, Result};

/// An empty vector with room for exactly `len` elements.
pub fn try_with_capacity<T>(len: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|e| {
        Error::new(
            ErrorKind::OutOfMemory,
            format!(
                "cannot allocate {what} ({len} elements of {} bytes): {e}",
                size_of::<T>()
            ),
        )
    })?;
    Ok(v)
}

/// `len` zeroed f32 values.
pub fn zeroed_f32(len: usize, what: &str) -> Result<Vec<f32>> {
    let mut v = try_with_capacity(len, what)?;
    v.resize(len, 0.0);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors_naming_the_buffer() {
        let e = zeroed_f32(usize::MAX / 2, "the test rows").unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        assert!(e.message.contains("the test rows"), "{}", e.message);
        assert_eq!(zeroed_f32(3, "x").unwrap(), vec![0.0; 3]);
        assert!(try_with_capacity::<u64>(1 << 61, "x").is_err());
    }
}
