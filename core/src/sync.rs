//! The one lock core uses: a spin lock (no_std, no OS), or loom's mutex when
//! the crate is built with `--cfg loom` so the model checker sees every
//! interleaving of the pool's lease and release.

#[cfg(not(loom))]
pub(crate) use spin::Mutex;

#[cfg(loom)]
pub(crate) use self::model::Mutex;

/// Waits a moment for another thread (loom must be told, or it explores the spin forever).
pub(crate) fn backoff() {
    #[cfg(not(loom))]
    core::hint::spin_loop();
    #[cfg(loom)]
    loom::thread::yield_now();
}

#[cfg(loom)]
mod model {
    /// loom's mutex behind spin's method names.
    #[derive(Debug)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

    impl<T> Mutex<T> {
        pub(crate) fn new(t: T) -> Self {
            Mutex(loom::sync::Mutex::new(t))
        }
        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }
        pub(crate) fn get_mut(&mut self) -> &mut T {
            self.0.get_mut().unwrap_or_else(|e| e.into_inner())
        }
    }
}
