//! Charts drawn on the server as SVG (no script, no library): a step line of points over time
//! with an optional horizontal limit (a budget), and the same points as a table for screen
//! readers and for reading exact values.

use maud::{Markup, html};

use super::layout;

const W: f64 = 640.0;
const H: f64 = 200.0;
const PAD: f64 = 8.0;

/// A series: `(unix seconds, value)` in time order.
#[derive(Debug, Default)]
pub(crate) struct Series {
    pub label: String,
    pub points: Vec<(i64, f64)>,
    /// A limit drawn across (a budget, 100 %).
    pub limit: Option<(String, f64)>,
    /// How a value reads in the table.
    pub unit: &'static str,
}

/// The chart and its data table.
pub(crate) fn line(title: &str, s: &Series) -> Markup {
    if s.points.is_empty() {
        return html! { p.empty { (title) ": nothing yet." } };
    }
    let t0 = s.points.first().map_or(0, |p| p.0);
    let t1 = s.points.last().map_or(1, |p| p.0).max(t0 + 1);
    let vmax = s
        .points
        .iter()
        .map(|p| p.1)
        .chain(s.limit.as_ref().map(|l| l.1))
        .fold(0.0_f64, f64::max)
        .max(1e-9);
    let x = |t: i64| PAD + (t - t0) as f64 / (t1 - t0) as f64 * (W - 2.0 * PAD);
    let y = |v: f64| H - PAD - v / vmax * (H - 2.0 * PAD);
    // A step line: each value holds until the next point.
    let mut pts = String::new();
    let mut last_y = y(0.0);
    for (t, v) in &s.points {
        let (px, py) = (x(*t), y(*v));
        pts.push_str(&format!("{px:.1},{last_y:.1} {px:.1},{py:.1} "));
        last_y = py;
    }
    let limit_y = s.limit.as_ref().map(|l| format!("{:.1}", y(l.1)));
    html! {
        figure.chart {
            svg role="img" aria-labelledby="chart-title" viewBox=(format!("0 0 {W} {H}"))
                width="100%" height="200" preserveAspectRatio="none" {
                title id="chart-title" { (title) }
                rect x="0" y="0" width=(W) height=(H) class="bg" {}
                @if let Some(ly) = &limit_y {
                    line x1="0" x2=(W) y1=(ly) y2=(ly) class="limit" {}
                }
                polyline points=(pts.trim_end()) class="series" {}
            }
            figcaption {
                (title)
                @if let Some((name, v)) = &s.limit { " — " (name) ": " (fmt(*v, s.unit)) }
            }
            details {
                summary { "Data" }
                table {
                    thead { tr { th scope="col" { "Time" } th scope="col" { (s.label) } } }
                    tbody {
                        @for (t, v) in s.points.iter().rev().take(200) {
                            tr { td { (layout::when(*t)) } td.num { (fmt(*v, s.unit)) } }
                        }
                    }
                }
            }
        }
    }
}

fn fmt(v: f64, unit: &str) -> String {
    if unit == "micros" {
        layout::money(v.max(0.0) as u64)
    } else {
        format!("{v:.1}{unit}")
    }
}
