//! Ending a workload for good. A workload runs under a user id of its own (one per live
//! lease), so every process it left — forked, double-forked, in a session of its own — is
//! found by that uid and killed, before its folder and plaintext are removed and before the
//! uid serves another lease. Where the agent cannot change user (not root: development), the
//! workload's process group is killed instead.
//!
//! `kill(2)` is the one call here std has no safe form of.

/// Send `sig` to `pid` (a process, or `-pgid` for a group).
#[allow(unsafe_code)]
fn kill(pid: i32, sig: i32) -> bool {
    // SAFETY: kill(2) takes two integers and reads or writes no memory of this process.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// Every process with its real and effective uid (from `/proc/<pid>/status`), read once.
fn processes() -> Vec<(i32, [u32; 2])> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let line = status.lines().find(|l| l.starts_with("Uid:"))?;
            let mut ids = line
                .split_whitespace()
                .skip(1)
                .filter_map(|v| v.parse().ok());
            Some((pid, [ids.next()?, ids.next()?]))
        })
        .collect()
}

/// Processes whose real or effective uid is `uid`.
pub fn pids_of_uid(uid: u32) -> Vec<i32> {
    processes()
        .into_iter()
        .filter(|(_, ids)| ids.contains(&uid))
        .map(|(pid, _)| pid)
        .collect()
}

/// The uids in `range` some process runs as (one pass over `/proc`).
pub fn busy_uids(range: std::ops::Range<u32>) -> Vec<u32> {
    let mut busy: Vec<u32> = processes()
        .into_iter()
        .flat_map(|(_, ids)| ids)
        .filter(|u| range.contains(u))
        .collect();
    busy.sort_unstable();
    busy.dedup();
    busy
}

/// Kill every process of `uid` (SIGKILL), again while new ones appear (a fork racing the
/// kill); the number killed. Never the agent's own uid.
pub fn kill_uid(uid: u32) -> usize {
    kill_uids(uid..uid.saturating_add(1))
}

/// [`kill_uid`] for every uid in `range`, one pass over `/proc` a round.
pub fn kill_uids(range: std::ops::Range<u32>) -> usize {
    let own = own_uid();
    let mut killed = 0;
    for _ in 0..50 {
        let pids: Vec<i32> = processes()
            .into_iter()
            .filter(|(_, ids)| ids.iter().any(|u| *u != own && range.contains(u)))
            .map(|(pid, _)| pid)
            .collect();
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            if kill(pid, libc::SIGKILL) {
                killed += 1;
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    killed
}

/// Kill the process group `pgid` (SIGKILL).
pub fn kill_group(pgid: u32) {
    if let Ok(p) = i32::try_from(pgid)
        && p > 1
    {
        kill(-p, libc::SIGKILL);
    }
}

/// This process's uid.
pub fn own_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map_or(u32::MAX, |m| m.uid())
}

/// Remove the entries of `dir` (not recursing into others' folders) that `uid` owns: what a
/// workload left in a world-writable place.
pub fn remove_owned(dir: &std::path::Path, uid: u32) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten().take(100_000) {
        let path = e.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if meta.uid() != uid {
            continue;
        }
        let _ = if meta.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
    }
}
