//! The NICs a pool can register its chunks with.

use zerohop_core::{Access, Error, MrHandle, Region, Registrar};

/// A NIC from whichever backends are compiled in.
#[derive(Debug)]
#[non_exhaustive]
pub enum Nic {
    /// The software NIC, shared by reference (no_std friendly).
    #[cfg(feature = "mock")]
    Mock(&'static crate::mock::MockNic),
    /// The software NIC, shared by `Arc`.
    #[cfg(all(feature = "mock", feature = "std"))]
    MockShared(std::sync::Arc<crate::mock::MockNic>),
    /// A verbs protection domain.
    #[cfg(feature = "gpudirect-verbs")]
    Verbs(crate::verbs::Registry),
}

impl Registrar for Nic {
    fn register(&self, region: Region, access: Access) -> Result<MrHandle, Error> {
        match self {
            #[cfg(feature = "mock")]
            Nic::Mock(n) => n.register(region, access),
            #[cfg(all(feature = "mock", feature = "std"))]
            Nic::MockShared(n) => n.register(region, access),
            #[cfg(feature = "gpudirect-verbs")]
            Nic::Verbs(n) => n.register(region, access),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = (region, access);
                Err(Error::Backend("no NIC compiled in"))
            }
        }
    }

    fn deregister(&self, handle: MrHandle) -> Result<(), Error> {
        match self {
            #[cfg(feature = "mock")]
            Nic::Mock(n) => n.deregister(handle),
            #[cfg(all(feature = "mock", feature = "std"))]
            Nic::MockShared(n) => n.deregister(handle),
            #[cfg(feature = "gpudirect-verbs")]
            Nic::Verbs(n) => n.deregister(handle),
            #[allow(unreachable_patterns)]
            _ => {
                let _ = handle;
                Err(Error::Backend("no NIC compiled in"))
            }
        }
    }
}
