//! Facts about the host the budgets need (Linux /proc and cgroupfs, POSIX
//! getrlimit; None elsewhere).
//!
//! "Memory" here is what this process may use, not what the machine has:
//! the smallest of the machine's figure (/proc/meminfo), the memory limit
//! of the process's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`, of
//! its cgroup and every ancestor) and its address-space limit (RLIMIT_AS).
//! A container or a `prlimit --as` caps an embedding host well below
//! `MemTotal`; sizing a KV cache by `MemTotal` there ends with the OOM
//! killer or an allocation failure long after the session was accepted.

/// Bytes this process may still allocate: the smallest of `MemAvailable`,
/// its cgroups' limits minus their usage (reclaimable page cache not
/// counted as used) and RLIMIT_AS minus its address space (`VmSize`).
pub fn available_memory_bytes() -> Option<usize> {
    let host = kib_field("/proc/meminfo", "MemAvailable:");
    let cgroup = cgroup_limits().map(|l| l.available);
    let rlimit = address_space_limit()
        .map(|limit| limit.saturating_sub(kib_field("/proc/self/status", "VmSize:").unwrap_or(0)));
    min_known([host, cgroup, rlimit])
}

/// The most memory this process could ever have: the smallest of
/// `MemTotal`, its cgroups' limits and RLIMIT_AS.
pub fn total_memory_bytes() -> Option<usize> {
    let host = kib_field("/proc/meminfo", "MemTotal:");
    min_known([
        host,
        cgroup_limits().map(|l| l.limit),
        address_space_limit(),
    ])
}

/// Peak resident set size of this process (VmHWM), in bytes.
pub fn peak_rss_bytes() -> Option<usize> {
    kib_field("/proc/self/status", "VmHWM:")
}

/// Current resident set size of this process (VmRSS), in bytes.
pub fn rss_bytes() -> Option<usize> {
    kib_field("/proc/self/status", "VmRSS:")
}

/// Threads of this process now (`/proc/self/task` entries).
pub fn thread_count() -> Option<usize> {
    std::fs::read_dir("/proc/self/task").ok().map(|d| d.count())
}

fn min_known<const N: usize>(values: [Option<usize>; N]) -> Option<usize> {
    values.into_iter().flatten().min()
}

/// RLIMIT_AS (the soft limit), when one is set.
#[cfg(unix)]
pub fn address_space_limit() -> Option<usize> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a valid pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut rl) } != 0
        || rl.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    Some(usize::try_from(rl.rlim_cur).unwrap_or(usize::MAX))
}

#[cfg(not(unix))]
pub fn address_space_limit() -> Option<usize> {
    None
}

/// The tightest cgroup memory limit over the process's cgroup and its
/// ancestors, and what is left under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CgroupLimit {
    limit: usize,
    available: usize,
}

fn cgroup_limits() -> Option<CgroupLimit> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut best: Option<CgroupLimit> = None;
    for dir in cgroup_dirs(&membership, &mounts) {
        let v2 = dir.version == 2;
        let (limit_file, usage_file, inactive_key) = if v2 {
            ("memory.max", "memory.current", "inactive_file")
        } else {
            (
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            )
        };
        let mut path = dir.path.clone();
        // Every ancestor's limit applies too, up to the mount point.
        loop {
            if let Some(limit) = read_number(&path.join(limit_file)) {
                // v1 writes "no limit" as a huge page-aligned number.
                if limit < (1usize << 62) {
                    let used = read_number(&path.join(usage_file)).unwrap_or(0);
                    let inactive = std::fs::read_to_string(path.join("memory.stat"))
                        .ok()
                        .and_then(|s| stat_field(&s, inactive_key))
                        .unwrap_or(0);
                    let available = limit.saturating_sub(used.saturating_sub(inactive));
                    let here = CgroupLimit { limit, available };
                    best = Some(match best {
                        None => here,
                        Some(b) => CgroupLimit {
                            limit: b.limit.min(here.limit),
                            available: b.available.min(here.available),
                        },
                    });
                }
            }
            if path == dir.mount || !path.pop() || !path.starts_with(&dir.mount) {
                break;
            }
        }
    }
    best
}

struct CgroupDir {
    version: u8,
    mount: std::path::PathBuf,
    path: std::path::PathBuf,
}

/// The memory cgroup directories of the process: its v2 cgroup (`0::/path`
/// in /proc/self/cgroup, under the cgroup2 mount) and its v1 memory cgroup
/// (`N:memory:/path`, under the mount whose options include `memory`).
fn cgroup_dirs(membership: &str, mountinfo: &str) -> Vec<CgroupDir> {
    let mut out = Vec::new();
    for line in membership.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let version = if id == "0" && controllers.is_empty() {
            2
        } else if controllers.split(',').any(|c| c == "memory") {
            1
        } else {
            continue;
        };
        for m in mountinfo.lines() {
            // ID PARENT MAJ:MIN ROOT MOUNT OPTIONS... - FSTYPE SOURCE SUPER_OPTIONS
            let Some((left, right)) = m.split_once(" - ") else {
                continue;
            };
            let fields: Vec<&str> = left.split(' ').collect();
            let tail: Vec<&str> = right.split(' ').collect();
            if fields.len() < 5 || tail.len() < 3 {
                continue;
            }
            let matches = if version == 2 {
                tail[0] == "cgroup2"
            } else {
                tail[0] == "cgroup" && tail[2].split(',').any(|o| o == "memory")
            };
            let root = fields[3];
            let Some(rel) = path.strip_prefix(root) else {
                continue;
            };
            if !matches {
                continue;
            }
            let mount = std::path::PathBuf::from(fields[4]);
            let rel = rel.trim_start_matches('/');
            let full = if rel.is_empty() {
                mount.clone()
            } else {
                mount.join(rel)
            };
            out.push(CgroupDir {
                version,
                mount,
                path: full,
            });
            break;
        }
    }
    out
}

fn read_number(path: &std::path::Path) -> Option<usize> {
    // "max" (v2: no limit) does not parse: treated as no limit.
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn stat_field(stat: &str, key: &str) -> Option<usize> {
    stat.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
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
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_dirs_follow_the_mounts() {
        let membership = "4:memory:/app/job\n0::/svc/one\n1:cpu:/\n";
        let mounts = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
                      41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        let dirs = cgroup_dirs(membership, mounts);
        let got: Vec<(u8, String)> = dirs
            .iter()
            .map(|d| (d.version, d.path.display().to_string()))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, "/sys/fs/cgroup/memory/app/job".to_string()),
                (2, "/sys/fs/cgroup/unified/svc/one".to_string()),
            ]
        );
        // A namespaced cgroup whose mount root is the cgroup itself.
        let ns = "0::/\n";
        let m = "30 20 0:26 /svc/one /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert!(cgroup_dirs(ns, m).is_empty(), "path outside the mount root");
        let m = "30 20 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup_dirs(ns, m)[0].path,
            std::path::Path::new("/sys/fs/cgroup")
        );
    }

    #[test]
    fn stat_fields_and_limits_parse() {
        let stat = "cache 10\ninactive_file 4096\ntotal_inactive_file 8192\n";
        assert_eq!(stat_field(stat, "inactive_file"), Some(4096));
        assert_eq!(stat_field(stat, "total_inactive_file"), Some(8192));
        assert_eq!(stat_field(stat, "missing"), None);
        assert_eq!(min_known([None, Some(3), Some(2)]), Some(2));
        assert_eq!(min_known::<2>([None, None]), None);
    }

    #[test]
    fn available_never_exceeds_total() {
        if let (Some(a), Some(t)) = (available_memory_bytes(), total_memory_bytes()) {
            assert!(a <= t, "available {a} > total {t}");
        }
        assert!(thread_count().is_none_or(|n| n >= 1));
    }
}
