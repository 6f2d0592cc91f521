//! A software NIC: what a real HCA checks, without the hardware.

use zerohop_core::{Access, Error, MemKind, MrHandle, Region, RegisterError, Registrar};

const MAX_MRS: usize = 64;

/// Register/deregister counters of a [`MockNic`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct NicStats {
    /// Successful registrations, ever.
    pub registers: u64,
    /// Successful deregistrations, ever.
    pub deregisters: u64,
    /// Registrations refused (bad range, table full, fault).
    pub refused: u64,
    /// Registrations alive now.
    pub live: usize,
}

#[derive(Debug)]
struct State {
    mrs: [Option<(MrHandle, MemKind)>; MAX_MRS],
    next_id: u32,
    refuse: bool,
    stats: NicStats,
}

/// A software NIC with a 64-entry registration table. It refuses what real
/// NICs refuse: empty or wrapping ranges, memory outside its bounds, CUDA
/// managed memory, remote write without local write.
#[derive(Debug)]
pub struct MockNic {
    bounds: Option<Region>,
    state: spin::Mutex<State>,
}

impl MockNic {
    /// A NIC that may touch `bounds` (e.g. an [`Arena`](super::Arena)'s region), or
    /// any host address with `None`. `const`, so it can live in a `static`.
    pub const fn new(bounds: Option<Region>) -> MockNic {
        MockNic {
            bounds,
            state: spin::Mutex::new(State {
                mrs: [None; MAX_MRS],
                next_id: 1,
                refuse: false,
                stats: NicStats {
                    registers: 0,
                    deregisters: 0,
                    refused: 0,
                    live: 0,
                },
            }),
        }
    }

    /// Fault switch: while on, every registration is refused with [`RegisterError::Refused`].
    pub fn refuse_registrations(&self, refuse: bool) {
        self.state.lock().refuse = refuse;
    }

    /// The counters.
    pub fn stats(&self) -> NicStats {
        self.state.lock().stats
    }

    /// What the NIC checks before it DMAs: `lkey` names a live registration
    /// covering `[addr, addr+len)` with at least `access`.
    pub fn check(&self, lkey: u32, addr: u64, len: usize, access: Access) -> Result<(), Error> {
        let st = self.state.lock();
        let mr = st
            .mrs
            .iter()
            .flatten()
            .find(|(h, _)| h.lkey == lkey)
            .ok_or(Error::Backend("mock NIC: unknown lkey"))?;
        if mr.0.covers(addr, len, access) {
            Ok(())
        } else {
            Err(Error::Backend("mock NIC: access outside the registration"))
        }
    }

    fn refuse(st: &mut State, e: RegisterError) -> Result<MrHandle, Error> {
        st.stats.refused += 1;
        Err(Error::Register(e))
    }
}

impl Registrar for MockNic {
    fn register(&self, region: Region, access: Access) -> Result<MrHandle, Error> {
        let mut st = self.state.lock();
        if st.refuse {
            return Self::refuse(&mut st, RegisterError::Refused);
        }
        if let Err(e) = region.validate() {
            return Self::refuse(&mut st, e);
        }
        if region.kind == MemKind::Managed || region.kind == MemKind::Device {
            return Self::refuse(&mut st, RegisterError::Unsupported(region.kind));
        }
        if self
            .bounds
            .is_some_and(|b| !b.covers(region.addr, region.len))
        {
            return Self::refuse(&mut st, RegisterError::OutOfBounds);
        }
        if access.contains(Access::REMOTE_WRITE) && !access.contains(Access::LOCAL_WRITE) {
            // ibv_reg_mr answers EINVAL for this combination too.
            return Err(Error::Backend(
                "mock NIC: remote write requires local write",
            ));
        }
        let id = st.next_id;
        let Some(slot) = st.mrs.iter_mut().find(|m| m.is_none()) else {
            return Self::refuse(&mut st, RegisterError::NicFull);
        };
        let handle = MrHandle {
            addr: region.addr,
            len: region.len,
            lkey: 0x1000_0000 | id,
            rkey: 0x2000_0000 | id,
            access,
            id,
        };
        *slot = Some((handle, region.kind));
        st.next_id = st.next_id.wrapping_add(1).max(1);
        st.stats.registers += 1;
        st.stats.live += 1;
        Ok(handle)
    }

    fn deregister(&self, handle: MrHandle) -> Result<(), Error> {
        let mut st = self.state.lock();
        let slot = st
            .mrs
            .iter_mut()
            .find(|m| m.is_some_and(|(h, _)| h.id == handle.id && h.lkey == handle.lkey))
            .ok_or(Error::Backend(
                "mock NIC: deregister of an unknown registration",
            ))?;
        *slot = None;
        st.stats.deregisters += 1;
        st.stats.live -= 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(addr: u64, len: usize, kind: MemKind) -> Region {
        Region { addr, len, kind }
    }

    #[test]
    fn checks_bounds_kinds_and_access() {
        let nic = MockNic::new(Some(r(0x1000, 0x1000, MemKind::Host)));
        assert_eq!(
            nic.register(r(0x1000, 0, MemKind::Host), Access::NONE),
            Err(Error::Register(RegisterError::ZeroLength))
        );
        assert_eq!(
            nic.register(r(0x1800, 0x1000, MemKind::Host), Access::NONE),
            Err(Error::Register(RegisterError::OutOfBounds))
        );
        assert_eq!(
            nic.register(r(0x1000, 16, MemKind::Managed), Access::NONE),
            Err(Error::Register(RegisterError::Unsupported(
                MemKind::Managed
            )))
        );
        assert!(nic
            .register(r(0x1000, 16, MemKind::Host), Access::REMOTE_WRITE)
            .is_err());
        let h = nic
            .register(r(0x1000, 0x100, MemKind::Host), Access::LOCAL_WRITE)
            .unwrap();
        assert!(nic.check(h.lkey, 0x1010, 0x10, Access::LOCAL_WRITE).is_ok());
        assert!(nic.check(h.lkey, 0x10f0, 0x20, Access::NONE).is_err());
        assert!(nic
            .check(h.lkey, 0x1010, 0x10, Access::REMOTE_READ)
            .is_err());
        nic.deregister(h).unwrap();
        assert!(
            nic.check(h.lkey, 0x1010, 0x10, Access::NONE).is_err(),
            "a dead key is refused"
        );
        assert!(nic.deregister(h).is_err(), "double deregister is an error");
        assert_eq!(
            nic.stats(),
            NicStats {
                registers: 1,
                deregisters: 1,
                refused: 3,
                live: 0
            }
        );
    }

    #[test]
    fn a_full_table_and_the_fault_switch_refuse_with_types() {
        let nic = MockNic::new(None);
        for i in 0..MAX_MRS as u64 {
            nic.register(r(0x1000 * (i + 1), 16, MemKind::Host), Access::NONE)
                .unwrap();
        }
        assert_eq!(
            nic.register(r(0x100_0000, 16, MemKind::Host), Access::NONE),
            Err(Error::Register(RegisterError::NicFull))
        );
        nic.refuse_registrations(true);
        assert_eq!(
            nic.register(r(0x100_0000, 16, MemKind::Host), Access::NONE),
            Err(Error::Register(RegisterError::Refused))
        );
    }
}
