//! Reputation's storage (the formula is `server/reputation.rs`'s): one row of decayed counts
//! per subject (`node:<id>`, `operator:<name>`), bumped in the transaction of the event it
//! counts (a verdict, a failover, a slash) or by the uptime pass; each bump writes the
//! subject's rank to `nodes.reputation` / `operators.reputation`, which every replica's index
//! syncs from.

use sqlx::Row;

use super::super::reputation::{Delta, Signals};
use super::{Outcome, Tx};

/// Migration 11 (issue 32), the same on both backends.
pub(super) const REPUTATION_V11: &str = "CREATE TABLE reputation (
        subject TEXT PRIMARY KEY, up_h DOUBLE PRECISION NOT NULL, down_h DOUBLE PRECISION NOT NULL,
        passed DOUBLE PRECISION NOT NULL, missed DOUBLE PRECISION NOT NULL,
        failovers DOUBLE PRECISION NOT NULL, cheats DOUBLE PRECISION NOT NULL,
        decayed_at BIGINT NOT NULL, uptime_at BIGINT NOT NULL, score BIGINT NOT NULL)";

/// The uptime pass's nodes per write (it shares the single writer with everything else).
pub(crate) const UPTIME_CHUNK: usize = 1000;

#[derive(Debug)]
pub(crate) enum ReputationWrite {
    /// Credit each (node, operator, up now) with the time since its last credit.
    Uptime {
        nodes: Vec<(String, String, bool)>,
        at: i64,
        half_life: i64,
        now_ms: i64,
    },
}

/// A subject's row: its counts decayed to `at`, and when its uptime was last credited.
async fn load(
    tx: &mut Tx,
    subject: &str,
    at: i64,
    half_life: i64,
) -> Result<(Signals, Option<i64>), sqlx::Error> {
    let row = sqlx::query(
        "SELECT up_h, down_h, passed, missed, failovers, cheats, decayed_at, uptime_at FROM reputation WHERE subject = $1",
    )
    .bind(subject)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(match row {
        None => (Signals::default(), None),
        Some(r) => {
            let s = Signals {
                up_h: r.try_get("up_h")?,
                down_h: r.try_get("down_h")?,
                passed: r.try_get("passed")?,
                missed: r.try_get("missed")?,
                failovers: r.try_get("failovers")?,
                cheats: r.try_get("cheats")?,
            };
            let decayed_at: i64 = r.try_get("decayed_at")?;
            (
                s.decayed(at - decayed_at, half_life),
                Some(r.try_get("uptime_at")?),
            )
        }
    })
}

async fn save(
    tx: &mut Tx,
    subject: &str,
    s: &Signals,
    at: i64,
    uptime_at: i64,
    now_ms: i64,
) -> Result<(), sqlx::Error> {
    let score = s.score();
    sqlx::query(
        "INSERT INTO reputation (subject, up_h, down_h, passed, missed, failovers, cheats, decayed_at, uptime_at, score)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
         ON CONFLICT (subject) DO UPDATE SET up_h = excluded.up_h, down_h = excluded.down_h,
           passed = excluded.passed, missed = excluded.missed, failovers = excluded.failovers,
           cheats = excluded.cheats, decayed_at = excluded.decayed_at,
           uptime_at = excluded.uptime_at, score = excluded.score",
    )
    .bind(subject)
    .bind(s.up_h)
    .bind(s.down_h)
    .bind(s.passed)
    .bind(s.missed)
    .bind(s.failovers)
    .bind(s.cheats)
    .bind(at)
    .bind(uptime_at)
    .bind(score)
    .execute(&mut **tx)
    .await?;
    let rank = s.rank();
    if let Some(node) = subject.strip_prefix("node:") {
        sqlx::query(
            "UPDATE nodes SET reputation = $1, updated_ms = $2 WHERE id = $3 AND reputation <> $1",
        )
        .bind(rank)
        .bind(now_ms)
        .bind(node)
        .execute(&mut **tx)
        .await?;
    } else if let Some(op) = subject.strip_prefix("operator:") {
        sqlx::query(
            "INSERT INTO operators (name, reputation) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET reputation = excluded.reputation",
        )
        .bind(op)
        .bind(rank)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// Add `d` to node `node` and its operator, in the caller's transaction.
pub(super) async fn bump_in(
    tx: &mut Tx,
    node: &str,
    d: Delta,
    at: i64,
    half_life: i64,
    now_ms: i64,
) -> Result<(), sqlx::Error> {
    let operator: Option<String> = sqlx::query("SELECT operator FROM nodes WHERE id = $1")
        .bind(node)
        .fetch_optional(&mut **tx)
        .await?
        .map(|r| r.try_get("operator"))
        .transpose()?;
    let mut subjects = vec![format!("node:{node}")];
    if let Some(op) = operator {
        subjects.push(format!("operator:{op}"));
    }
    for subject in subjects {
        let (s, uptime_at) = load(tx, &subject, at, half_life).await?;
        save(tx, &subject, &s.add(d), at, uptime_at.unwrap_or(at), now_ms).await?;
    }
    Ok(())
}

pub(super) async fn apply(tx: &mut Tx, w: &ReputationWrite) -> Result<Outcome, sqlx::Error> {
    match w {
        ReputationWrite::Uptime {
            nodes,
            at,
            half_life,
            now_ms,
        } => {
            let mut operators: std::collections::BTreeMap<&str, Delta> = Default::default();
            for (node, operator, up) in nodes {
                let subject = format!("node:{node}");
                let (s, uptime_at) = load(tx, &subject, *at, *half_life).await?;
                // The span since the last credit (none for a node seen the first time: it
                // starts being counted now).
                let span = uptime_at.map_or(0, |u| (*at - u).max(0)) as f64 / 3600.0;
                let d = if *up {
                    Delta {
                        up_h: span,
                        ..Delta::default()
                    }
                } else {
                    Delta {
                        down_h: span,
                        ..Delta::default()
                    }
                };
                save(tx, &subject, &s.add(d), *at, *at, *now_ms).await?;
                let o = operators.entry(operator.as_str()).or_default();
                o.up_h += d.up_h;
                o.down_h += d.down_h;
            }
            for (op, d) in operators {
                let subject = format!("operator:{op}");
                let (s, _) = load(tx, &subject, *at, *half_life).await?;
                save(tx, &subject, &s.add(d), *at, *at, *now_ms).await?;
            }
            Ok(Outcome::Done)
        }
    }
}
