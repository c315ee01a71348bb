//! Keep the VM running: start it, and when it exits start it again after a back-off that
//! doubles from `restart_min_ms` to `restart_max_ms` and resets once a run lasted a minute.
//! The state (starting, running, backing off, stopped; restarts; the last exit) goes to the
//! log and, when configured, to a JSON state file. SIGTERM or SIGINT stops the VM (SIGTERM to
//! it, SIGKILL after a grace period) and then the agent.
//!
//! [`Backoff`] is the policy alone (tests drive it on their own clock); [`supervise`] is the
//! loop with processes.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

/// A run that lasted this long resets the back-off.
pub const HEALTHY_RUN_MS: u64 = 60_000;

/// The restart policy.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: u64,
    max: u64,
    next: u64,
}

impl Backoff {
    pub fn new(min_ms: u64, max_ms: u64) -> Backoff {
        Backoff {
            min: min_ms,
            max: max_ms,
            next: min_ms,
        }
    }

    /// The VM exited after running `ran_ms`: how long to wait before the next start.
    pub fn after_exit(&mut self, ran_ms: u64) -> u64 {
        if ran_ms >= HEALTHY_RUN_MS {
            self.next = self.min;
        }
        let wait = self.next;
        self.next = (self.next.saturating_mul(2)).min(self.max);
        wait
    }
}

/// What the host agent says of its VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum VmState {
    Starting,
    Running { pid: u32 },
    BackingOff { until_ms: u64, last_exit: String },
    Stopped { last_exit: String },
}

#[derive(Debug, Clone, Serialize)]
struct StateFile<'a> {
    #[serde(flatten)]
    state: &'a VmState,
    launcher: &'a str,
    restarts: u64,
    at: i64,
}

/// How the supervisor reports.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub state_file: Option<PathBuf>,
    pub launcher: String,
    /// Not to standard error (the state file only).
    pub quiet: bool,
}

/// The wall clock, Unix seconds.
pub(crate) fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

impl Report {
    fn say(&self, state: &VmState, restarts: u64) {
        if !self.quiet {
            eprintln!("cgx-host-agent: VM {state:?} (restarts: {restarts})");
        }
        if let Some(p) = &self.state_file {
            let body = StateFile {
                state,
                launcher: &self.launcher,
                restarts,
                at: unix_now(),
            };
            if let Ok(text) = serde_json::to_vec_pretty(&body) {
                let tmp = p.with_extension("tmp");
                let _ = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, p));
            }
        }
    }
}

fn describe(status: std::process::ExitStatus) -> String {
    match status.code() {
        Some(c) => format!("exited with status {c}"),
        None => {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt;
                if let Some(s) = status.signal() {
                    return format!("killed by signal {s}");
                }
            }
            "ended".into()
        }
    }
}

/// Ask `child` to stop (SIGTERM), and kill it after `grace`.
fn stop_child(child: &mut Child, grace: Duration) -> String {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let t = Instant::now();
    while t.elapsed() < grace {
        if let Ok(Some(s)) = child.try_wait() {
            return describe(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child
        .wait()
        .map(describe)
        .unwrap_or_else(|e| format!("not reaped: {e}"))
}

/// Run `make()`'s command until `stop`, restarting it by `backoff`. The number of restarts.
pub fn supervise(
    mut make: impl FnMut() -> Result<Command, String>,
    backoff: &mut Backoff,
    report: &Report,
    stop: &AtomicBool,
    grace: Duration,
) -> Result<u64, String> {
    let mut restarts = 0u64;
    let mut last_exit = String::from("not started");
    loop {
        if stop.load(Ordering::SeqCst) {
            report.say(&VmState::Stopped { last_exit }, restarts);
            return Ok(restarts);
        }
        report.say(&VmState::Starting, restarts);
        let started = Instant::now();
        let spawned = make().and_then(|mut c| c.spawn().map_err(|e| e.to_string()));
        let exit = match spawned {
            Ok(mut child) => {
                report.say(&VmState::Running { pid: child.id() }, restarts);
                loop {
                    if stop.load(Ordering::SeqCst) {
                        let why = stop_child(&mut child, grace);
                        report.say(&VmState::Stopped { last_exit: why }, restarts);
                        return Ok(restarts);
                    }
                    match child.try_wait() {
                        Ok(Some(s)) => break describe(s),
                        Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                        Err(e) => break format!("wait: {e}"),
                    }
                }
            }
            Err(e) => format!("could not start: {e}"),
        };
        let ran = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let wait = backoff.after_exit(ran);
        last_exit = exit;
        report.say(
            &VmState::BackingOff {
                until_ms: wait,
                last_exit: last_exit.clone(),
            },
            restarts,
        );
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(wait) {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        restarts += 1;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn back_off_doubles_caps_and_resets_after_a_healthy_run() {
        let mut b = Backoff::new(500, 4_000);
        let waits: Vec<u64> = (0..5).map(|_| b.after_exit(10)).collect();
        assert_eq!(waits, [500, 1_000, 2_000, 4_000, 4_000]);
        assert_eq!(b.after_exit(HEALTHY_RUN_MS), 500);
        assert_eq!(b.after_exit(5), 1_000);
    }

    /// A VM that keeps dying is restarted with back-off, each exit reported; stop ends it.
    #[test]
    fn a_dying_vm_is_restarted_and_a_stop_stops_it() {
        let dir = std::env::temp_dir().join(format!("cgx-supervise-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let report = Report {
            state_file: Some(dir.join("state.json")),
            launcher: "test".into(),
            quiet: true,
        };
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let starts = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let n = starts.clone();
        let t = std::thread::spawn(move || {
            let mut b = Backoff::new(10, 40);
            supervise(
                || {
                    n.fetch_add(1, Ordering::SeqCst);
                    let mut c = Command::new("sh");
                    c.args(["-c", "exit 7"]);
                    Ok(c)
                },
                &mut b,
                &report,
                &s,
                Duration::from_millis(200),
            )
            .unwrap()
        });
        while starts.load(Ordering::SeqCst) < 4 {
            std::thread::sleep(Duration::from_millis(10));
        }
        stop.store(true, Ordering::SeqCst);
        let restarts = t.join().unwrap();
        assert!(restarts >= 3, "{restarts}");
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("state.json")).unwrap()).unwrap();
        assert_eq!(state["state"], "stopped");
        assert_eq!(state["last_exit"], "exited with status 7");
        // A long-running VM is stopped with SIGTERM (not killed after the grace period).
        let stop = AtomicBool::new(false);
        let report = Report {
            state_file: Some(dir.join("term.json")),
            launcher: "test".into(),
            quiet: true,
        };
        let flag = &stop;
        std::thread::scope(|sc| {
            sc.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                flag.store(true, Ordering::SeqCst);
            });
            let mut b = Backoff::new(10, 40);
            let r = supervise(
                || {
                    let mut c = Command::new("sleep");
                    c.arg("30");
                    Ok(c)
                },
                &mut b,
                &report,
                flag,
                Duration::from_secs(5),
            )
            .unwrap();
            assert_eq!(r, 0);
        });
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("term.json")).unwrap()).unwrap();
        assert_eq!(state["last_exit"], "killed by signal 15");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
