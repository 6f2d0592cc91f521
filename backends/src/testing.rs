//! What the tests of more than one crate use (feature `testing`); the
//! crates above re-export it (`zerohop_std::testing`).

use std::process::Child;

/// A helper process, killed and reaped when dropped: a test that fails
/// with one running leaves none behind (it would hold the test's output
/// open, and a pipe read to its end would wait for ever).
#[derive(Debug)]
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Reaped {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}
