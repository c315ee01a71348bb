//! The page frame, and the small pieces every page uses: times, money, pagers, tables.
//!
//! Every splice goes through maud, which escapes it: the one place markup is made from a
//! string is [`super::chart`]'s numbers (formatted here, never text a user wrote).

use maud::{DOCTYPE, Markup, html};

use super::Viewer;

/// A page: its title, the viewer (for the navigation and the sign-out form) and its body.
/// `live`: the page refreshes its `main` without a reload (`console.js`).
pub(crate) fn page(title: &str, viewer: Option<&Viewer>, live: bool, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · cgx console" }
                link rel="stylesheet" href="/console/assets/console.css";
                script src="/console/assets/console.js" defer {}
            }
            body {
                header {
                    a.brand href="/console/" { "cgx console" }
                    @if let Some(v) = viewer {
                        nav aria-label="Sections" {
                            ul {
                                @if v.is_tenant() || v.is_auditor() {
                                    li { a href="/console/jobs" { "Jobs" } }
                                }
                                @if v.is_tenant() {
                                    li { a href="/console/statement" { "Spend" } }
                                }
                                @if v.is_operator() || v.is_auditor() {
                                    li { a href="/console/nodes" { "Nodes" } }
                                }
                                @if v.is_operator() {
                                    li { a href="/console/statement" { "Earnings" } }
                                }
                                @if v.is_auditor() {
                                    li { a href="/console/log" { "Log" } }
                                }
                            }
                        }
                        form.signout method="post" action="/console/logout" {
                            input type="hidden" name="csrf" value=(v.csrf);
                            span.who { (v.who()) }
                            " "
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                main id="main" data-live=[live.then_some("1")] {
                    (body)
                }
                footer {
                    p { "Every figure here is read from the broker's API state; the log's "
                        "entries verify offline with " code { "cgx audit verify" } "." }
                }
            }
        }
    }
}

/// Unix seconds as UTC, `YYYY-MM-DD HH:MM:SS`, in a `<time>` element.
pub(crate) fn when(unix: i64) -> Markup {
    use time::macros::format_description;
    if unix <= 0 {
        return html! { "—" };
    }
    let Ok(t) = time::OffsetDateTime::from_unix_timestamp(unix) else {
        return html! { (unix) };
    };
    let text = t
        .format(format_description!(
            "[year]-[month]-[day] [hour]:[minute]:[second]"
        ))
        .unwrap_or_default();
    let iso = t
        .format(format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second]Z"
        ))
        .unwrap_or_default();
    html! { time datetime=(iso) { (text) " UTC" } }
}

/// A span of seconds as `1h 02m`, `3m 05s`, `42s`.
pub(crate) fn span(secs: i64) -> String {
    let s = secs.unsigned_abs();
    let sign = if secs < 0 { "−" } else { "" };
    if s >= 3600 {
        format!("{sign}{}h {:02}m", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{sign}{}m {:02}s", s / 60, s % 60)
    } else {
        format!("{sign}{s}s")
    }
}

/// Micros as a decimal amount.
pub(crate) fn money(micros: u64) -> String {
    cgx_protocol::money::Micros(micros).to_string()
}

/// "Next page" link carrying the keyset cursor, when there is one, and the list's own query
/// (`keep`: a filter, kept on every page).
pub(crate) fn pager(base: &str, keep: &[(&str, &str)], next: Option<&str>) -> Markup {
    let mut query = String::new();
    for (k, v) in keep {
        query.push_str(&format!("{k}={}&", urlencode(v)));
    }
    html! {
        @if let Some(after) = next {
            nav.pager aria-label="Pages" {
                a href=(format!("{base}?{query}after={}", urlencode(after))) rel="next" { "Next page →" }
            }
        }
    }
}

/// Percent-encode a query value (ids are `[A-Za-z0-9._-]`; anything else is encoded).
pub(crate) fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A state as a badge (the class names a fixed set; the text is escaped).
pub(crate) fn badge(state: &str) -> Markup {
    let class = match state {
        "running" | "placed" | "passed" | "affirming" | "placeable" | "completed" => "ok",
        "pending" | "issued" | "answered" | "warning" => "wait",
        _ => "bad",
    };
    html! { span class=(format!("badge {class}")) { (state) } }
}

/// A definition list of (term, value) rows.
pub(crate) fn facts(rows: &[(&str, Markup)]) -> Markup {
    html! {
        dl.facts {
            @for (k, v) in rows {
                dt { (k) }
                dd { (v) }
            }
        }
    }
}
