//! A persistent thread pool for data-parallel kernels.
//!
//! `run(n, f)` calls `f(i)` for every `i < n`, spread over the calling thread
//! and the workers, and returns when all calls have finished. Workers spin
//! briefly after a job (the next op of a decode step follows within
//! microseconds) and then park, so an idle pool costs no CPU.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::turns::{ForwardTurns, Turn};
use crate::{Error, ErrorKind, Result};

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Incremented once per job; workers wait for it to change.
    generation: AtomicU64,
    /// The job of the current generation. Written only by `run` while no
    /// worker can read it (between generations), read by workers during one.
    job: UnsafeCell<Option<*const Job>>,
    n_items: AtomicUsize,
    next_item: AtomicUsize,
    /// Workers still inside the current generation.
    busy_workers: AtomicUsize,
    shutdown: AtomicBool,
    worker_panicked: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written by the thread holding `ThreadPool::run_lock`
// while every worker is idle (busy_workers == 0), and only read by workers
// after they observe the new generation (Acquire) and before they decrement
// `busy_workers` (Release). The pointee is `Sync`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    run_lock: Mutex<()>,
    /// Forward passes of the sessions sharing this pool take turns.
    turns: ForwardTurns,
}

const SPIN_BEFORE_PARK: Duration = Duration::from_micros(200);

impl ThreadPool {
    /// A pool using `threads` threads in total (the caller counts as one).
    /// Panics when a worker cannot be spawned: for fixed small pools (tests,
    /// tools); a count from a caller goes through [`ThreadPool::try_new`].
    pub fn new(threads: usize) -> ThreadPool {
        ThreadPool::try_new(threads).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A pool using `threads` threads in total (the caller counts as one).
    /// When the system refuses a thread (RLIMIT_NPROC, memory for its
    /// stack), the workers already started are stopped and joined, and the
    /// error says how many threads were asked for. The count is the
    /// caller's to bound (`crate::limits::resolve_threads`).
    pub fn try_new(threads: usize) -> Result<ThreadPool> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            n_items: AtomicUsize::new(0),
            next_item: AtomicUsize::new(0),
            busy_workers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            worker_panicked: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut pool = ThreadPool {
            shared,
            workers: Vec::new(),
            run_lock: Mutex::new(()),
            turns: ForwardTurns::default(),
        };
        if pool.workers.try_reserve_exact(threads - 1).is_err() {
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                format!("no memory for the handles of {threads} kernel threads"),
            ));
        }
        for i in 1..threads {
            let shared = pool.shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("nanoinfer-worker-{i}"))
                .spawn(move || worker_loop(&shared));
            match spawned {
                Ok(handle) => pool.workers.push(handle),
                // Dropping `pool` shuts down and joins the workers started so far.
                Err(e) => {
                    return Err(Error::new(
                        ErrorKind::OutOfMemory,
                        format!(
                            "cannot start kernel thread {i} of {threads} ({e}); lower n_threads"
                        ),
                    ))
                }
            }
        }
        Ok(pool)
    }

    /// Waits for the caller's turn to run a whole forward pass on this pool
    /// (first come, first served; see `turns`), or `None` once `give_up`,
    /// polled while waiting, returns true.
    pub fn take_turn(&self, give_up: &dyn Fn() -> bool) -> Option<Turn<'_>> {
        self.turns.take(give_up)
    }

    /// Total threads including the caller.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `f(i)` for each `i in 0..n_items`, in parallel, and waits for all.
    pub fn run(&self, n_items: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_items == 0 {
            return;
        }
        if self.workers.is_empty() || n_items == 1 {
            (0..n_items).for_each(f);
            return;
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY: we hold run_lock and the previous run waited for
        // busy_workers == 0, so no worker reads `job` now. The lifetime is
        // erased, but `run` does not return before every worker is done with it.
        unsafe {
            let erased: *const Job = std::mem::transmute::<&(dyn Fn(usize) + Sync), *const Job>(f);
            *s.job.get() = Some(erased);
        }
        s.n_items.store(n_items, Ordering::Relaxed);
        s.next_item.store(0, Ordering::Relaxed);
        s.busy_workers.store(self.workers.len(), Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Release);
        {
            let _g = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let caller_result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drain(s, f)));
        let mut spins = 0u32;
        while s.busy_workers.load(Ordering::Acquire) != 0 {
            spin_or_yield(&mut spins);
        }
        if let Err(panic) = caller_result {
            std::panic::resume_unwind(panic);
        }
        if s.worker_panicked.swap(false, Ordering::Relaxed) {
            panic!("a kernel panicked on a worker thread");
        }
    }

    /// Calls `f` once on every thread of the pool, the caller included (to
    /// prepare thread-local state such as kernel scratch).
    pub fn broadcast(&self, f: &(dyn Fn() + Sync)) {
        let threads = self.threads();
        let arrived = AtomicUsize::new(0);
        // One item per thread: each item waits until all have started, so no
        // thread can take a second one.
        self.run(threads, &|_| {
            arrived.fetch_add(1, Ordering::AcqRel);
            let mut spins = 0u32;
            while arrived.load(Ordering::Acquire) < threads {
                spin_or_yield(&mut spins);
            }
            f();
        });
    }
}

/// Busy-waits briefly, then yields the core: when the machine has more
/// runnable threads than cores, a pure spin would steal the time slice of
/// the very thread being waited for.
#[inline]
fn spin_or_yield(spins: &mut u32) {
    *spins += 1;
    if *spins < SPINS_BEFORE_YIELD {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

const SPINS_BEFORE_YIELD: u32 = 2000;

fn drain(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let n = s.n_items.load(Ordering::Relaxed);
    loop {
        let i = s.next_item.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        f(i);
    }
}

fn worker_loop(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let spin_start = Instant::now();
        let mut spins = 0u32;
        let mut gen = s.generation.load(Ordering::Acquire);
        while gen == seen && !s.shutdown.load(Ordering::Relaxed) {
            if spin_start.elapsed() < SPIN_BEFORE_PARK {
                spin_or_yield(&mut spins);
            } else {
                let guard = s.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
                if s.generation.load(Ordering::Acquire) == seen
                    && !s.shutdown.load(Ordering::Relaxed)
                {
                    drop(s.wake.wait_timeout(guard, Duration::from_millis(50)));
                }
            }
            gen = s.generation.load(Ordering::Acquire);
        }
        if s.shutdown.load(Ordering::Relaxed) {
            return;
        }
        seen = gen;
        // SAFETY: the generation changed, so `run` has published a job that
        // stays valid until busy_workers reaches 0 (decremented below).
        let job = unsafe { (*s.job.get()).expect("job published with generation") };
        // SAFETY: see above; the pointer came from a live `&dyn Fn`.
        let f = unsafe { &*job };
        // A panicking kernel must not kill the worker or hang `run`; `run`
        // re-raises it on the calling thread.
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drain(s, f))).is_err() {
            s.worker_panicked.store(true, Ordering::Relaxed);
        }
        s.busy_workers.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Relaxed);
        {
            let _g = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_once() {
        let pool = ThreadPool::new(3);
        for n in [0usize, 1, 2, 7, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn survives_idle_park_and_reuse() {
        let pool = ThreadPool::new(2);
        let sum = AtomicUsize::new(0);
        pool.run(10, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        std::thread::sleep(Duration::from_millis(5));
        pool.run(10, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 90);
    }

    #[test]
    fn broadcast_reaches_every_thread_once() {
        for threads in [1usize, 2, 4] {
            let pool = ThreadPool::new(threads);
            let seen = Mutex::new(Vec::new());
            pool.broadcast(&|| seen.lock().unwrap().push(std::thread::current().id()));
            let ids = seen.into_inner().unwrap();
            assert!(
                ids.contains(&std::thread::current().id()),
                "the caller runs it"
            );
            assert_eq!(ids.len(), threads);
            let distinct: std::collections::HashSet<_> = ids.into_iter().collect();
            assert_eq!(distinct.len(), threads, "once per thread");
        }
    }

    #[test]
    fn an_impossible_count_is_an_error() {
        let pool = ThreadPool::try_new(3).unwrap();
        assert_eq!(pool.threads(), 3);
        // Fails reserving the handles, before any spawn.
        let e = ThreadPool::try_new(usize::MAX).err().unwrap();
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
    }
}
