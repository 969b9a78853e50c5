//! `HostSlice<T>`: an immutable slice that is either owned or a zero-copy view
//! into a shared owner (an mmapped weight file), kept alive by an `Arc`.

use std::any::Any;
use std::ops::Deref;
use std::sync::Arc;

pub struct HostSlice<T: Copy + 'static> {
    /// Keeps the memory behind `ptr` alive (a `Vec<T>` or an mmap).
    _owner: Arc<dyn Any + Send + Sync>,
    ptr: *const T,
    len: usize,
}

// SAFETY: the data is immutable for the slice's whole life and the owner is
// Send + Sync, so sharing the pointer across threads is sound.
unsafe impl<T: Copy + Send + Sync> Send for HostSlice<T> {}
unsafe impl<T: Copy + Send + Sync> Sync for HostSlice<T> {}

impl<T: Copy + Send + Sync + 'static> HostSlice<T> {
    pub fn from_vec(v: Vec<T>) -> Self {
        let owner: Arc<Vec<T>> = Arc::new(v);
        let (ptr, len) = (owner.as_ptr(), owner.len());
        HostSlice {
            _owner: owner,
            ptr,
            len,
        }
    }

    /// A view of `slice`, whose memory `owner` keeps alive and never mutates.
    ///
    /// # Safety
    /// `slice` must point into memory owned by `owner` that stays valid and
    /// unmodified for as long as `owner` lives.
    pub unsafe fn borrowed_from(owner: Arc<dyn Any + Send + Sync>, slice: &[T]) -> Self {
        HostSlice {
            _owner: owner,
            ptr: slice.as_ptr(),
            len: slice.len(),
        }
    }

    /// True when the data lives in the owner given at construction rather than a copy.
    pub fn is_view_of(&self, base: *const u8, len_bytes: usize) -> bool {
        let p = self.ptr as usize;
        p >= base as usize && p < base as usize + len_bytes
    }
}

impl<T: Copy + 'static> Deref for HostSlice<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr/len describe memory kept alive and immutable by `_owner`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_slices_read_back_and_cross_threads() {
        let s = HostSlice::from_vec(vec![1.5f32, -2.0, 3.25]);
        assert_eq!(&*s, &[1.5, -2.0, 3.25]);
        let s = Arc::new(s);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let s = Arc::clone(&s);
                std::thread::spawn(move || s.iter().sum::<f32>())
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 2.75);
        }
        let empty = HostSlice::<u16>::from_vec(vec![]);
        assert!(empty.is_empty());
    }

    #[test]
    fn views_outlive_their_creator_through_the_owner() {
        let backing: Arc<Vec<u32>> = Arc::new((0..16).collect());
        let (base, bytes) = (backing.as_ptr().cast::<u8>(), backing.len() * 4);
        // SAFETY: the slice points into `backing`, which the view keeps alive
        // and nobody mutates.
        let view = unsafe { HostSlice::borrowed_from(backing.clone(), &backing[4..8]) };
        drop(backing);
        assert_eq!(&*view, &[4, 5, 6, 7]);
        assert!(view.is_view_of(base, bytes));
        let copy = HostSlice::from_vec(view.to_vec());
        assert!(!copy.is_view_of(base, bytes));
        assert_eq!(&*copy, &*view);
    }
}
