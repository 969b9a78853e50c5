//! Facts about the host the budgets need (Linux /proc; None elsewhere).

/// `MemAvailable` from /proc/meminfo, in bytes.
pub fn available_memory_bytes() -> Option<usize> {
    kib_field("/proc/meminfo", "MemAvailable:")
}

/// `MemTotal` from /proc/meminfo, in bytes.
pub fn total_memory_bytes() -> Option<usize> {
    kib_field("/proc/meminfo", "MemTotal:")
}

/// Peak resident set size of this process (VmHWM), in bytes.
pub fn peak_rss_bytes() -> Option<usize> {
    kib_field("/proc/self/status", "VmHWM:")
}

/// Current resident set size of this process (VmRSS), in bytes.
pub fn rss_bytes() -> Option<usize> {
    kib_field("/proc/self/status", "VmRSS:")
}

/// Reads a `Key:   1234 kB` line of a /proc file.
fn kib_field(path: &str, key: &str) -> Option<usize> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: usize = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}
