//! Facts about the host the budgets need.

/// `MemAvailable` from /proc/meminfo, in bytes (Linux); None elsewhere.
pub fn available_memory_bytes() -> Option<usize> {
    meminfo_field("MemAvailable:")
}

/// `MemTotal` from /proc/meminfo, in bytes.
pub fn total_memory_bytes() -> Option<usize> {
    meminfo_field("MemTotal:")
}

fn meminfo_field(key: &str) -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: usize = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Peak resident set size of this process (VmHWM), in bytes.
pub fn peak_rss_bytes() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: usize = line["VmHWM:".len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}
