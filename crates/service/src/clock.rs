//! The clock a service reads, injected: handlers, stores and token checks ask a [`Clock`], so
//! tests move time forward instead of sleeping, and logic below them takes `now` as an argument.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// Wall-clock time as a service sees it.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Unix seconds now.
    fn unix(&self) -> i64;

    /// Unix milliseconds now (deadlines of a few seconds); a manual clock's whole seconds.
    fn unix_ms(&self) -> i64 {
        self.unix().saturating_mul(1000)
    }

    /// Now as a date-time (verification and result times).
    fn now(&self) -> time::OffsetDateTime {
        time::OffsetDateTime::from_unix_timestamp(self.unix())
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
    }
}

/// A shared clock.
pub type SharedClock = Arc<dyn Clock>;

/// The system clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn unix(&self) -> i64 {
        time::OffsetDateTime::now_utc().unix_timestamp()
    }

    fn now(&self) -> time::OffsetDateTime {
        time::OffsetDateTime::now_utc()
    }

    fn unix_ms(&self) -> i64 {
        i64::try_from(time::OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000)
            .unwrap_or(i64::MAX)
    }
}

/// The system clock, shared.
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}

/// A clock that moves only when told (tests): starts at the system time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicI64>);

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock(Arc::new(AtomicI64::new(SystemClock.unix())))
    }
}

impl ManualClock {
    /// Move the clock forward by `secs`.
    pub fn advance(&self, secs: i64) {
        self.0.fetch_add(secs, Ordering::SeqCst);
    }

    /// Set the clock to Unix time `t`.
    pub fn set(&self, t: i64) {
        self.0.store(t, Ordering::SeqCst);
    }

    pub fn shared(&self) -> SharedClock {
        Arc::new(self.clone())
    }
}

impl Clock for ManualClock {
    fn unix(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let c = ManualClock::default();
        let t = c.unix();
        assert_eq!(c.unix(), t);
        c.advance(90);
        assert_eq!(c.shared().unix(), t + 90);
        c.set(1_000);
        assert_eq!(c.now().unix_timestamp(), 1_000);
        assert!((SystemClock.unix() - time::OffsetDateTime::now_utc().unix_timestamp()).abs() < 2);
    }
}
