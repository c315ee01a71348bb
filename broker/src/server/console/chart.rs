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
    lines(title, std::slice::from_ref(s))
}

/// Several series on one chart (each its own colour, a legend, one data table each); the
/// first series' limit is drawn.
pub(crate) fn lines(title: &str, all: &[Series]) -> Markup {
    let points = || all.iter().flat_map(|s| s.points.iter());
    if points().next().is_none() {
        return html! { p.empty { (title) ": nothing yet." } };
    }
    let t0 = points().map(|p| p.0).min().unwrap_or(0);
    let t1 = points().map(|p| p.0).max().unwrap_or(1).max(t0 + 1);
    let limit = all.first().and_then(|s| s.limit.as_ref());
    let vmax = points()
        .map(|p| p.1)
        .chain(limit.map(|l| l.1))
        .fold(0.0_f64, f64::max)
        .max(1e-9);
    let x = |t: i64| PAD + (t - t0) as f64 / (t1 - t0) as f64 * (W - 2.0 * PAD);
    let y = |v: f64| H - PAD - v / vmax * (H - 2.0 * PAD);
    // A step line: each value holds until the next point.
    let polyline = |s: &Series| {
        let mut pts = String::new();
        let mut last_y = y(0.0);
        for (t, v) in &s.points {
            let (px, py) = (x(*t), y(*v));
            pts.push_str(&format!("{px:.1},{last_y:.1} {px:.1},{py:.1} "));
            last_y = py;
        }
        pts.trim_end().to_string()
    };
    let limit_y = limit.map(|l| format!("{:.1}", y(l.1)));
    let unit = all.first().map_or("", |s| s.unit);
    html! {
        figure.chart {
            svg role="img" aria-label=(title) viewBox=(format!("0 0 {W} {H}"))
                width="100%" height="200" preserveAspectRatio="none" {
                title { (title) }
                rect x="0" y="0" width=(W) height=(H) class="bg" {}
                @if let Some(ly) = &limit_y {
                    line x1="0" x2=(W) y1=(ly) y2=(ly) class="limit" {}
                }
                @for (i, s) in all.iter().enumerate() {
                    polyline points=(polyline(s)) class=(format!("series s{}", i % 8)) {}
                }
            }
            figcaption {
                (title)
                @if let Some((name, v)) = limit { " — " (name) ": " (fmt(*v, unit)) }
                @if all.len() > 1 {
                    ul.legend { @for (i, s) in all.iter().enumerate() {
                        li { span class=(format!("key s{}", i % 8)) aria-hidden="true" { "■" } " " (s.label) }
                    } }
                }
            }
            details {
                summary { "Data" }
                @for s in all {
                    table {
                        caption { (s.label) }
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
}

fn fmt(v: f64, unit: &str) -> String {
    if unit == "micros" {
        layout::money(v.max(0.0) as u64)
    } else {
        format!("{v:.1}{unit}")
    }
}
