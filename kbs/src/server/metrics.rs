//! Prometheus metrics in the text exposition format, kept with atomics and one small map: no
//! metrics crate, nothing on the hot path heavier than a mutex around a counter bump.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds (seconds) of the request-duration histogram buckets.
const BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

#[derive(Debug, Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    durations: Mutex<BTreeMap<&'static str, Histogram>>,
    events: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

impl Metrics {
    pub fn request(&self, endpoint: &'static str, status: u16, took: Duration) {
        if let Ok(mut r) = self.requests.lock() {
            *r.entry((endpoint, status)).or_default() += 1;
        }
        if let Ok(mut d) = self.durations.lock() {
            let h = d.entry(endpoint).or_default();
            let s = took.as_secs_f64();
            for (i, b) in BUCKETS.iter().enumerate() {
                if s <= *b {
                    h.counts[i] += 1;
                }
            }
            h.sum += s;
            h.count += 1;
        }
    }

    /// Count an outcome, e.g. `("attestation", "affirming")`, `("release", "denied")`.
    pub fn event(&self, what: &'static str, outcome: &'static str) {
        if let Ok(mut e) = self.events.lock() {
            *e.entry((what, outcome)).or_default() += 1;
        }
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str("# HELP cgx_kbs_requests_total HTTP requests by endpoint and status.\n");
        out.push_str("# TYPE cgx_kbs_requests_total counter\n");
        if let Ok(r) = self.requests.lock() {
            for ((e, s), n) in r.iter() {
                out.push_str(&format!(
                    "cgx_kbs_requests_total{{endpoint=\"{e}\",status=\"{s}\"}} {n}\n"
                ));
            }
        }
        out.push_str("# HELP cgx_kbs_request_duration_seconds Request latency by endpoint.\n");
        out.push_str("# TYPE cgx_kbs_request_duration_seconds histogram\n");
        if let Ok(d) = self.durations.lock() {
            for (e, h) in d.iter() {
                for (i, b) in BUCKETS.iter().enumerate() {
                    out.push_str(&format!(
                        "cgx_kbs_request_duration_seconds_bucket{{endpoint=\"{e}\",le=\"{b}\"}} {}\n",
                        h.counts[i]
                    ));
                }
                out.push_str(&format!(
                    "cgx_kbs_request_duration_seconds_bucket{{endpoint=\"{e}\",le=\"+Inf\"}} {}\n",
                    h.count
                ));
                out.push_str(&format!(
                    "cgx_kbs_request_duration_seconds_sum{{endpoint=\"{e}\"}} {}\n",
                    h.sum
                ));
                out.push_str(&format!(
                    "cgx_kbs_request_duration_seconds_count{{endpoint=\"{e}\"}} {}\n",
                    h.count
                ));
            }
        }
        out.push_str("# HELP cgx_kbs_events_total Attestation and release outcomes.\n");
        out.push_str("# TYPE cgx_kbs_events_total counter\n");
        if let Ok(e) = self.events.lock() {
            for ((w, o), n) in e.iter() {
                out.push_str(&format!(
                    "cgx_kbs_events_total{{event=\"{w}\",outcome=\"{o}\"}} {n}\n"
                ));
            }
        }
        out
    }
}
