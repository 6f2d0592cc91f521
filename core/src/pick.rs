//! Which transport to use: the host's prerequisites ([`Probe`]), the user's
//! wish ([`Preference`]), and the choice with its reasons ([`pick`]).

use core::fmt::{self, Write};

/// The transports, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Kind {
    /// RDMA verbs into GPU device memory (DMA-buf or peermem).
    Gpudirect,
    /// RDMA verbs into pinned host memory.
    Rdma,
    /// TCP into CUDA managed memory.
    Uma,
    /// TCP whose peers on this host move to shared-memory rings.
    Shm,
    /// Plain TCP into host memory; always there.
    Tcp,
    /// The in-memory mock link; only when asked for.
    Mock,
}

impl Kind {
    /// Every kind, fastest first.
    pub const ALL: [Kind; 6] = [
        Kind::Gpudirect,
        Kind::Rdma,
        Kind::Uma,
        Kind::Shm,
        Kind::Tcp,
        Kind::Mock,
    ];
    /// The order automatic choice tries.
    pub const AUTO_ORDER: [Kind; 5] =
        [Kind::Gpudirect, Kind::Rdma, Kind::Uma, Kind::Shm, Kind::Tcp];

    /// Lower-case name, as `ZEROHOP_TRANSPORT` spells it.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Gpudirect => "gpudirect",
            Kind::Rdma => "rdma",
            Kind::Uma => "uma",
            Kind::Shm => "shm",
            Kind::Tcp => "tcp",
            Kind::Mock => "mock",
        }
    }

    /// The cargo feature of zerohop-backends that builds it (`None`: always built).
    pub const fn feature(self) -> Option<&'static str> {
        match self {
            Kind::Gpudirect | Kind::Rdma => Some("gpudirect-verbs"),
            Kind::Uma => Some("cuda-uma"),
            Kind::Shm | Kind::Tcp => None,
            Kind::Mock => Some("mock"),
        }
    }

    /// The prerequisites it cannot run without (see [`Probe::missing_for`] for gpudirect's alternatives).
    pub const fn requires(self) -> PrereqSet {
        match self {
            Kind::Gpudirect => PrereqSet::of(&[
                Prereq::CudaDriver,
                Prereq::CudaDevice,
                Prereq::IbverbsDevice,
                Prereq::HcaLive,
            ]),
            Kind::Rdma => PrereqSet::of(&[Prereq::IbverbsDevice, Prereq::HcaLive]),
            Kind::Uma => PrereqSet::of(&[Prereq::CudaDriver, Prereq::CudaDevice]),
            Kind::Shm => PrereqSet::of(&[Prereq::Memfd]),
            Kind::Tcp | Kind::Mock => PrereqSet::EMPTY,
        }
    }

    const fn bit(self) -> u8 {
        1 << self as u8
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of kinds (e.g. those compiled in).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct KindSet(u8);

impl KindSet {
    /// No kind.
    pub const EMPTY: KindSet = KindSet(0);

    /// The set holding `kinds`.
    pub const fn of(kinds: &[Kind]) -> KindSet {
        let mut bits = 0;
        let mut i = 0;
        while i < kinds.len() {
            bits |= kinds[i].bit();
            i += 1;
        }
        KindSet(bits)
    }

    /// Whether `kind` is in the set.
    pub const fn contains(self, kind: Kind) -> bool {
        self.0 & kind.bit() != 0
    }

    /// The set with `kind` added.
    pub const fn with(self, kind: Kind) -> KindSet {
        KindSet(self.0 | kind.bit())
    }
}

/// What the user asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Preference {
    /// The fastest transport the host supports.
    Auto,
    /// Exactly this one, or an error saying why not.
    Only(Kind),
}

/// A preference string that names no transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct UnknownPreference;

impl fmt::Display for UnknownPreference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "expected one of: auto, gpudirect, rdma, uma, shm, tcp, mock (or empty for auto)",
        )
    }
}

impl core::error::Error for UnknownPreference {}

impl Preference {
    /// Parses a transport name: trimmed, case-insensitive; `""` and `auto` mean automatic.
    pub fn parse(s: &str) -> Result<Preference, UnknownPreference> {
        let s = s.trim();
        if s.is_empty() || s.eq_ignore_ascii_case("auto") {
            return Ok(Preference::Auto);
        }
        Kind::ALL
            .iter()
            .find(|k| s.eq_ignore_ascii_case(k.name()))
            .map(|&k| Preference::Only(k))
            .ok_or(UnknownPreference)
    }
}

/// A named prerequisite of the fast transports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Prereq {
    /// libcuda loads and `cuInit` succeeds.
    CudaDriver,
    /// At least one CUDA device.
    CudaDevice,
    /// The GPU can export device memory as a DMA-buf.
    GpuDmabuf,
    /// An RDMA device is listed.
    IbverbsDevice,
    /// The RDMA device opens and a protection domain allocates.
    HcaLive,
    /// The NIC registers DMA-buf memory (`ibv_reg_dmabuf_mr`).
    NicDmabuf,
    /// nvidia-peermem (or nv_peer_mem) is loaded.
    Peermem,
    /// Sealed anonymous memory (`memfd_create`) maps, for same-host lanes.
    Memfd,
}

impl Prereq {
    /// Every prerequisite, in report order.
    pub const ALL: [Prereq; 8] = [
        Prereq::CudaDriver,
        Prereq::CudaDevice,
        Prereq::GpuDmabuf,
        Prereq::IbverbsDevice,
        Prereq::HcaLive,
        Prereq::NicDmabuf,
        Prereq::Peermem,
        Prereq::Memfd,
    ];

    /// Its name in reports.
    pub const fn name(self) -> &'static str {
        match self {
            Prereq::CudaDriver => "cuda-driver",
            Prereq::CudaDevice => "cuda-device",
            Prereq::GpuDmabuf => "gpu-dmabuf",
            Prereq::IbverbsDevice => "ibverbs-device",
            Prereq::HcaLive => "hca-live",
            Prereq::NicDmabuf => "nic-dmabuf",
            Prereq::Peermem => "peermem",
            Prereq::Memfd => "memfd",
        }
    }
}

impl fmt::Display for Prereq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of prerequisites.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PrereqSet(u8);

impl PrereqSet {
    /// None.
    pub const EMPTY: PrereqSet = PrereqSet(0);

    /// The set holding `items`.
    pub const fn of(items: &[Prereq]) -> PrereqSet {
        let mut bits = 0;
        let mut i = 0;
        while i < items.len() {
            bits |= 1 << items[i] as u8;
            i += 1;
        }
        PrereqSet(bits)
    }

    /// Whether `p` is in the set.
    pub const fn contains(self, p: Prereq) -> bool {
        self.0 & (1 << p as u8) != 0
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The set with `p` added.
    pub const fn with(self, p: Prereq) -> PrereqSet {
        PrereqSet(self.0 | (1 << p as u8))
    }

    /// The members, in report order.
    pub fn iter(self) -> impl Iterator<Item = Prereq> {
        Prereq::ALL.into_iter().filter(move |&p| self.contains(p))
    }
}

impl fmt::Display for PrereqSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(p.name())?;
        }
        Ok(())
    }
}

/// A short explanation (device name, errno, path), held inline: at most
/// [`Detail::CAPACITY`] bytes, longer text is cut at a character boundary.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Detail {
    buf: [u8; Detail::CAPACITY],
    len: u8,
}

impl Detail {
    /// Bytes a detail holds.
    pub const CAPACITY: usize = 120;

    /// An empty detail.
    pub const fn new() -> Detail {
        Detail {
            buf: [0; Detail::CAPACITY],
            len: 0,
        }
    }

    /// A detail holding `s` (cut if too long).
    pub fn of(s: &str) -> Detail {
        let mut d = Detail::new();
        let _ = d.write_str(s);
        d
    }

    /// A detail formatted from `args` (e.g. `format_args!("errno {}", e)`).
    pub fn from_fmt(args: fmt::Arguments<'_>) -> Detail {
        let mut d = Detail::new();
        let _ = d.write_fmt(args);
        d
    }

    /// The text.
    pub fn as_str(&self) -> &str {
        // Only whole characters are ever copied in, so this cannot fail.
        core::str::from_utf8(&self.buf[..self.len as usize]).unwrap_or("")
    }
}

impl Default for Detail {
    fn default() -> Self {
        Detail::new()
    }
}

impl Write for Detail {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = Detail::CAPACITY - self.len as usize;
        let mut take = s.len().min(room);
        while !s.is_char_boundary(take) {
            take -= 1;
        }
        let at = self.len as usize;
        self.buf[at..at + take].copy_from_slice(&s.as_bytes()[..take]);
        self.len += take as u8;
        Ok(())
    }
}

impl fmt::Debug for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Detail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(feature = "defmt")]
impl defmt::Format for Detail {
    fn format(&self, f: defmt::Formatter<'_>) {
        defmt::write!(f, "{=str}", self.as_str())
    }
}

/// One prerequisite's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Status {
    /// Not looked at (its backend is not compiled in, or the probe stopped earlier).
    Unknown,
    /// There, with what was found (a device name, a driver version).
    Present(Detail),
    /// Missing, with why.
    Missing(Detail),
}

impl Status {
    /// Whether present.
    pub const fn is_present(&self) -> bool {
        matches!(self, Status::Present(_))
    }
}

/// What a host has: each prerequisite's state, and which backends are compiled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Probe {
    status: [Status; 8],
    compiled: KindSet,
}

impl Probe {
    /// Nothing probed; tcp compiled in (it always is).
    pub const fn new() -> Probe {
        Probe {
            status: [Status::Unknown; 8],
            compiled: KindSet::of(&[Kind::Tcp]),
        }
    }

    /// Records that a backend giving `kind` is compiled in.
    pub fn set_compiled(&mut self, kind: Kind) {
        self.compiled = self.compiled.with(kind);
    }

    /// The kinds compiled in.
    pub const fn compiled(&self) -> KindSet {
        self.compiled
    }

    /// Records a prerequisite's state.
    pub fn set(&mut self, p: Prereq, status: Status) {
        self.status[p as usize] = status;
    }

    /// Records a prerequisite as present, with a detail.
    pub fn present(&mut self, p: Prereq, detail: &str) {
        self.set(p, Status::Present(Detail::of(detail)));
    }

    /// Records a prerequisite as missing, with why.
    pub fn missing(&mut self, p: Prereq, why: &str) {
        self.set(p, Status::Missing(Detail::of(why)));
    }

    /// A prerequisite's state.
    pub fn get(&self, p: Prereq) -> &Status {
        &self.status[p as usize]
    }

    /// Whether a prerequisite is present.
    pub fn has(&self, p: Prereq) -> bool {
        self.get(p).is_present()
    }

    /// Every prerequisite with its state, in report order.
    pub fn iter(&self) -> impl Iterator<Item = (Prereq, &Status)> {
        Prereq::ALL.into_iter().map(move |p| (p, self.get(p)))
    }

    /// What `kind` lacks on this host (empty: it can run). Gpudirect needs,
    /// beyond CUDA and a live HCA, a way for the NIC to reach GPU memory:
    /// DMA-buf on both sides, or peermem. When neither path is whole, every
    /// missing member of both paths is named.
    pub fn missing_for(&self, kind: Kind) -> PrereqSet {
        let mut missing = PrereqSet::EMPTY;
        for p in kind.requires().iter() {
            if !self.has(p) {
                missing = missing.with(p);
            }
        }
        if kind == Kind::Gpudirect {
            let dmabuf = self.has(Prereq::GpuDmabuf) && self.has(Prereq::NicDmabuf);
            if !dmabuf && !self.has(Prereq::Peermem) {
                for p in [Prereq::GpuDmabuf, Prereq::NicDmabuf, Prereq::Peermem] {
                    if !self.has(p) {
                        missing = missing.with(p);
                    }
                }
            }
        }
        missing
    }
}

impl Default for Probe {
    fn default() -> Self {
        Probe::new()
    }
}

/// Why a faster transport was passed over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Skipped {
    /// Its backend is not compiled into this binary.
    NotCompiled(Kind),
    /// These prerequisites are missing.
    Missing(Kind, PrereqSet),
}

impl fmt::Display for Skipped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Skipped::NotCompiled(k) => match k.feature() {
                Some(feat) => write!(f, "{k}: not compiled in (cargo feature `{feat}`)"),
                None => write!(f, "{k}: not compiled in"),
            },
            Skipped::Missing(k, m) => write!(f, "{k}: missing {m}"),
        }
    }
}

/// The transport chosen, and why each faster one was not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct Choice {
    /// The transport to use.
    pub kind: Kind,
    skipped: [Option<Skipped>; 5],
}

impl Choice {
    /// The faster transports passed over, fastest first.
    pub fn skipped(&self) -> impl Iterator<Item = &Skipped> {
        self.skipped.iter().flatten()
    }
}

/// An explicit preference that cannot be honoured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct PickError(pub Skipped);

impl fmt::Display for PickError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "transport unavailable: {}", self.0)
    }
}

impl core::error::Error for PickError {}

fn why_not(probe: &Probe, kind: Kind) -> Option<Skipped> {
    if !probe.compiled.contains(kind) {
        return Some(Skipped::NotCompiled(kind));
    }
    let missing = probe.missing_for(kind);
    (!missing.is_empty()).then_some(Skipped::Missing(kind, missing))
}

/// Chooses a transport. An explicit preference gets exactly that transport or
/// an error naming what it lacks; `Auto` tries gpudirect > rdma > uma > shm > tcp and
/// records why each faster one was skipped. Mock is never chosen automatically.
pub fn pick(pref: Preference, probe: &Probe) -> Result<Choice, PickError> {
    match pref {
        Preference::Only(kind) => match why_not(probe, kind) {
            Some(why) => Err(PickError(why)),
            None => Ok(Choice {
                kind,
                skipped: [None; 5],
            }),
        },
        Preference::Auto => {
            let mut skipped = [None; 5];
            for (i, kind) in Kind::AUTO_ORDER.into_iter().enumerate() {
                match why_not(probe, kind) {
                    None => return Ok(Choice { kind, skipped }),
                    Some(why) => skipped[i] = Some(why),
                }
            }
            // tcp is always compiled in and needs nothing; reaching here means
            // the probe was built without it.
            Err(PickError(Skipped::NotCompiled(Kind::Tcp)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe_with(compiled: &[Kind], present: &[Prereq]) -> Probe {
        let mut p = Probe::new();
        for &k in compiled {
            p.set_compiled(k);
        }
        for &q in present {
            p.present(q, "yes");
        }
        p
    }

    #[test]
    fn every_spelling_parses() {
        for (s, want) in [
            ("", Preference::Auto),
            ("  ", Preference::Auto),
            ("auto", Preference::Auto),
            (" AuTo\n", Preference::Auto),
            ("gpudirect", Preference::Only(Kind::Gpudirect)),
            ("GPUDIRECT", Preference::Only(Kind::Gpudirect)),
            ("rdma", Preference::Only(Kind::Rdma)),
            ("\tRdMa ", Preference::Only(Kind::Rdma)),
            ("uma", Preference::Only(Kind::Uma)),
            ("Tcp", Preference::Only(Kind::Tcp)),
            (" SHM", Preference::Only(Kind::Shm)),
            ("mock", Preference::Only(Kind::Mock)),
        ] {
            assert_eq!(Preference::parse(s), Ok(want), "{s:?}");
        }
        for bad in ["tcpp", "rdma,tcp", "gpu direct", "0", "autotcp", "ｔｃｐ"] {
            assert_eq!(Preference::parse(bad), Err(UnknownPreference), "{bad:?}");
        }
    }

    #[test]
    fn auto_falls_through_to_tcp_with_reasons() {
        let p = probe_with(&[Kind::Gpudirect, Kind::Rdma], &[Prereq::IbverbsDevice]);
        let c = pick(Preference::Auto, &p).unwrap();
        assert_eq!(c.kind, Kind::Tcp);
        let reasons: [Skipped; 4] = [
            Skipped::Missing(
                Kind::Gpudirect,
                PrereqSet::of(&[
                    Prereq::CudaDriver,
                    Prereq::CudaDevice,
                    Prereq::HcaLive,
                    Prereq::GpuDmabuf,
                    Prereq::NicDmabuf,
                    Prereq::Peermem,
                ]),
            ),
            Skipped::Missing(Kind::Rdma, PrereqSet::of(&[Prereq::HcaLive])),
            Skipped::NotCompiled(Kind::Uma),
            Skipped::NotCompiled(Kind::Shm),
        ];
        assert!(c.skipped().eq(reasons.iter()));
    }

    #[test]
    fn auto_prefers_rdma_when_the_nic_cannot_take_gpu_memory() {
        let p = probe_with(
            &[Kind::Gpudirect, Kind::Rdma, Kind::Uma],
            &[
                Prereq::CudaDriver,
                Prereq::CudaDevice,
                Prereq::GpuDmabuf,
                Prereq::IbverbsDevice,
                Prereq::HcaLive,
            ],
        );
        let c = pick(Preference::Auto, &p).unwrap();
        assert_eq!(c.kind, Kind::Rdma);
        assert_eq!(
            c.skipped().next(),
            Some(&Skipped::Missing(
                Kind::Gpudirect,
                PrereqSet::of(&[Prereq::NicDmabuf, Prereq::Peermem])
            ))
        );
    }

    #[test]
    fn gpudirect_takes_either_dmabuf_or_peermem() {
        let base = [
            Prereq::CudaDriver,
            Prereq::CudaDevice,
            Prereq::IbverbsDevice,
            Prereq::HcaLive,
        ];
        let mut p = probe_with(&[Kind::Gpudirect], &base);
        p.present(Prereq::Peermem, "nvidia_peermem");
        assert_eq!(pick(Preference::Auto, &p).unwrap().kind, Kind::Gpudirect);
        let mut p = probe_with(&[Kind::Gpudirect], &base);
        p.present(Prereq::GpuDmabuf, "");
        p.present(Prereq::NicDmabuf, "");
        assert_eq!(
            pick(Preference::Only(Kind::Gpudirect), &p).unwrap().kind,
            Kind::Gpudirect
        );
    }

    #[test]
    fn explicit_preference_names_what_is_missing() {
        let p = probe_with(&[Kind::Uma], &[Prereq::CudaDriver]);
        let e = pick(Preference::Only(Kind::Uma), &p).unwrap_err();
        assert_eq!(
            e,
            PickError(Skipped::Missing(
                Kind::Uma,
                PrereqSet::of(&[Prereq::CudaDevice])
            ))
        );
        let mut s = Detail::new();
        write!(s, "{e}").unwrap();
        assert_eq!(
            s.as_str(),
            "transport unavailable: uma: missing cuda-device"
        );
        let e = pick(Preference::Only(Kind::Rdma), &Probe::new()).unwrap_err();
        assert_eq!(e, PickError(Skipped::NotCompiled(Kind::Rdma)));
    }

    #[test]
    fn shm_comes_after_uma_and_needs_sealed_memory() {
        let p = probe_with(&[Kind::Shm], &[Prereq::Memfd]);
        assert_eq!(pick(Preference::Auto, &p).unwrap().kind, Kind::Shm);
        let p = probe_with(
            &[Kind::Shm, Kind::Uma],
            &[Prereq::Memfd, Prereq::CudaDriver, Prereq::CudaDevice],
        );
        assert_eq!(pick(Preference::Auto, &p).unwrap().kind, Kind::Uma);
        let p = probe_with(&[Kind::Shm], &[]);
        let c = pick(Preference::Auto, &p).unwrap();
        assert_eq!(c.kind, Kind::Tcp);
        assert!(c
            .skipped()
            .any(|s| *s == Skipped::Missing(Kind::Shm, PrereqSet::of(&[Prereq::Memfd]))));
        assert_eq!(
            pick(Preference::Only(Kind::Shm), &p),
            Err(PickError(Skipped::Missing(
                Kind::Shm,
                PrereqSet::of(&[Prereq::Memfd])
            )))
        );
        assert_eq!(std::format!("{}", Prereq::Memfd), "memfd");
    }

    #[test]
    fn mock_only_when_asked() {
        let p = probe_with(&[Kind::Mock], &[]);
        assert_eq!(pick(Preference::Auto, &p).unwrap().kind, Kind::Tcp);
        assert_eq!(
            pick(Preference::Only(Kind::Mock), &p).unwrap().kind,
            Kind::Mock
        );
    }

    #[test]
    fn detail_cuts_long_text_at_a_char_boundary() {
        let long = "é".repeat(100); // 200 bytes
        let d = Detail::of(&long);
        assert_eq!(d.as_str().len(), Detail::CAPACITY);
        assert!(d.as_str().chars().all(|c| c == 'é'));
        // Byte 120 falls inside an 'é': the cut goes back to 119.
        let odd = std::format!("a{long}");
        assert_eq!(Detail::of(&odd).as_str().len(), Detail::CAPACITY - 1);
        // Written in pieces, it fills up and stops at the capacity.
        let mut d = Detail::of(&"x".repeat(100));
        d.write_str(&"y".repeat(100)).unwrap();
        assert_eq!(d.as_str().len(), Detail::CAPACITY);
        assert!(d.as_str().ends_with("yyyy"));
        let d = Detail::from_fmt(format_args!("errno {}", 19));
        assert_eq!(std::format!("{d} {d:?}"), "errno 19 \"errno 19\"");
    }

    #[test]
    fn kinds_sets_and_prerequisites_say_what_they_are() {
        let features = Kind::ALL.map(Kind::feature);
        assert_eq!(
            features,
            [
                Some("gpudirect-verbs"),
                Some("gpudirect-verbs"),
                Some("cuda-uma"),
                None,
                None,
                Some("mock"),
            ]
        );
        assert_eq!(
            Kind::ALL.map(Kind::name),
            ["gpudirect", "rdma", "uma", "shm", "tcp", "mock"]
        );
        // Adding a member twice keeps it.
        let k = KindSet::EMPTY.with(Kind::Uma).with(Kind::Uma);
        assert!(k.contains(Kind::Uma));
        let p = PrereqSet::default()
            .with(Prereq::Peermem)
            .with(Prereq::CudaDriver)
            .with(Prereq::Peermem);
        assert!(p.contains(Prereq::Peermem));
        assert_eq!(std::format!("{p}"), "cuda-driver, peermem");
        assert_eq!(std::format!("{}", Prereq::HcaLive), "hca-live");
        assert!(std::format!("{UnknownPreference}").starts_with("expected one of: auto,"));
        let mut probe = Probe::new();
        probe.missing(Prereq::IbverbsDevice, "no device");
        probe.present(Prereq::CudaDriver, "13.0");
        let seen: std::vec::Vec<_> = probe
            .iter()
            .filter(|(_, s)| **s != Status::Unknown)
            .map(|(p, s)| (p, s.is_present()))
            .collect();
        assert_eq!(
            seen,
            [(Prereq::CudaDriver, true), (Prereq::IbverbsDevice, false)]
        );
        assert_eq!(
            probe.get(Prereq::IbverbsDevice),
            &Status::Missing(Detail::of("no device"))
        );
    }
}
