//! What the descriptor-limit tests share: the process's soft limit on
//! descriptors, and the highest one open.

/// The soft limit on descriptors, read.
pub fn nofile() -> libc::rlimit {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer to an rlimit.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    lim
}

/// The soft limit on descriptors, set.
pub fn set_nofile(lim: libc::rlimit) {
    // SAFETY: a valid pointer to an rlimit; lowering the soft limit, or
    // putting it back, is always allowed.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}

/// The highest descriptor number open in this process.
pub fn highest_descriptor() -> u64 {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .max()
        .unwrap()
}
