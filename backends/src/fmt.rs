//! The log facade: `trace!`..`error!` forward to `defmt`, to `log`, or to
//! nothing. This crate's own copy: a `#[cfg]` inside an exported macro would be
//! judged in the calling crate, so these macros stay private to this crate and whole
//! definitions are cfg-gated instead.
#![allow(unused_macros)]

#[cfg(all(feature = "defmt", feature = "log"))]
compile_error!("zerohop-backends: enable at most one of the `defmt` and `log` features");

macro_rules! define_level {
    ($d:tt $name:ident) => {
        #[cfg(feature = "defmt")]
        #[collapse_debuginfo(yes)]
        macro_rules! $name {
                    ($d s:literal $d(, $d x:expr)* $d(,)?) => { ::defmt::$name!($d s $d(, $d x)*) };
                }
        #[cfg(feature = "log")]
        #[collapse_debuginfo(yes)]
        macro_rules! $name {
                    ($d s:literal $d(, $d x:expr)* $d(,)?) => { ::log::$name!($d s $d(, $d x)*) };
                }
        #[cfg(not(any(feature = "defmt", feature = "log")))]
        #[collapse_debuginfo(yes)]
        macro_rules! $name {
                    ($d s:literal $d(, $d x:expr)* $d(,)?) => {{ let _ = ($d(&$d x),*); }};
                }
    };
}

define_level!($ trace);
define_level!($ debug);
define_level!($ info);
define_level!($ warn);
define_level!($ error);
