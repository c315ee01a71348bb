//! Quotes (issue 32): the offers a job would get now — the nodes placement would rank for it,
//! best first, with their price, reputation, region and the escrow the job would lock — and
//! why the other nodes would not get it. Nothing is placed or held. A job submitted with one
//! of the offers (`JobSpec::offer`) is placed on that node at that price or refused with the
//! reason the offer no longer holds (`placement.rs`).

use cgx_protocol::broker::JobSpec;
use cgx_protocol::ledger::{QuoteAnswer, QuoteExclusion, QuoteOffer};
use cgx_protocol::money::{Micros, max_cost};
use cgx_service::auth::Admin;

use super::index::Misfit;
use super::jobs::tenant_of;
use super::{Broker, BrokerError, random_id};

/// Offers one quote lists.
const MAX_OFFERS: usize = 20;
/// Excluded nodes one quote names (the rest are counted).
const MAX_EXCLUDED: usize = 100;

impl Broker {
    /// `POST /v1/quotes`.
    pub(crate) async fn quote(
        &self,
        admin: &Admin,
        spec: JobSpec,
    ) -> Result<QuoteAnswer, BrokerError> {
        let tenant = tenant_of(admin, spec.tenant.as_deref())?;
        if spec.duration_secs == 0 || spec.duration_secs > 30 * 86_400 {
            return Err(BrokerError::BadRequest(
                "duration_secs must be 1 to 2592000 (30 days)".into(),
            ));
        }
        // The policy compiled and probed as at submission, under a name of its own that
        // leaves nothing cached behind.
        let probe = random_id("q")?;
        let req = self.requirements(&probe, &tenant, &spec).await;
        if let Ok(mut p) = self.policies.lock() {
            p.remove(&probe);
        }
        let req = req?;
        let now = self.clock.unix();
        let candidates = self.index().best(&req, now, MAX_OFFERS);
        let mut excluded = Vec::new();
        let mut offers = Vec::new();
        let denied: Vec<Option<Vec<String>>> = match &req.policy {
            None => vec![None; candidates.len()],
            Some(policy) if !candidates.is_empty() => {
                let inputs = candidates
                    .iter()
                    .map(|c| c.input.clone().unwrap_or_default())
                    .collect();
                policy
                    .refusals_many(inputs)
                    .await
                    .map_err(|e| match e {
                        cgx_policies::Error::Busy => BrokerError::Unavailable(
                            "the placement policy evaluators are busy; try again".into(),
                        ),
                        e => BrokerError::PlacementPolicy(e.to_string()),
                    })?
                    .into_iter()
                    .map(|r| match r {
                        Ok(r) if r.is_empty() => Ok(None),
                        Ok(r) => Ok(Some(r)),
                        Err(e) => Err(BrokerError::PlacementPolicy(e.to_string())),
                    })
                    .collect::<Result<_, _>>()?
            }
            Some(_) => Vec::new(),
        };
        for (c, denial) in candidates.into_iter().zip(denied) {
            if let Some(reasons) = denial {
                let m = Misfit::Policy(reasons);
                excluded.push(QuoteExclusion {
                    node: c.choice.node_id,
                    code: m.code().into(),
                    reason: m.to_string(),
                });
                continue;
            }
            let reputation = self.index().reputation(&c.choice.node_id).unwrap_or(0);
            let cost = max_cost(c.record.price, req.gpu_count, spec.duration_secs)
                .and_then(|c| u64::try_from(c).ok())
                .unwrap_or(u64::MAX);
            offers.push(QuoteOffer {
                rank: u32::try_from(offers.len() + 1).unwrap_or(u32::MAX),
                node: c.choice.node_id,
                operator: c.record.operator.clone(),
                region: c.record.region.clone(),
                gpus: c.choice.gpus,
                price_per_gpu_hour: c.record.price,
                reputation,
                // Placement reserves the job's whole budget (less what earlier leases of
                // the same job spent or hold: none for a new job).
                escrow: spec.budget_micros,
                cost: Micros(cost),
            });
        }
        let (misfits, more) = self.index().misfits(&req, now, MAX_EXCLUDED);
        excluded.extend(misfits.into_iter().map(|(node, m)| QuoteExclusion {
            node,
            code: m.code().into(),
            reason: m.to_string(),
        }));
        self.metrics.event("quote", "answered");
        Ok(QuoteAnswer {
            offers,
            excluded,
            excluded_more: more,
            at: now,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::testing::{FUNDS, Harness, Role};
    use super::*;
    use cgx_protocol::ledger::ChosenOffer;

    /// A quote ranks the nodes placement would, says why the others are out, and places
    /// nothing; a job held to an offer goes to that node at that price, or is refused with
    /// why the offer no longer holds.
    #[tokio::test]
    async fn quotes_rank_offers_explain_exclusions_and_hold_a_chosen_offer() {
        let h = Harness::new("quotes").await;
        let cheap = h.node(2);
        let mut dear = h.node(2);
        dear.offer.price_per_gpu_hour_micros = Micros(2_500_000);
        let small = h.node(1);
        for n in [&cheap, &dear, &small] {
            h.register(n).await.unwrap();
        }
        let tenant = h.admin(Role::Tenant);
        let spec = Harness::job(2, 3600);
        let q = h.broker.quote(&tenant, spec.clone()).await.unwrap();
        let offered: Vec<&str> = q.offers.iter().map(|o| o.node.as_str()).collect();
        assert_eq!(offered, [cheap.id.as_str(), dear.id.as_str()]);
        assert_eq!(q.offers[0].rank, 1);
        assert_eq!(q.offers[0].price_per_gpu_hour, Micros(2_000_000));
        assert_eq!(q.offers[0].cost, Micros(4_000_000));
        assert_eq!(q.offers[1].cost, Micros(5_000_000));
        assert_eq!(q.offers[0].escrow, spec.budget_micros);
        let out = q.excluded.iter().find(|x| x.node == small.id).unwrap();
        assert_eq!(out.code, "full", "{out:?}");
        assert!(out.reason.contains("the job needs 2"), "{out:?}");
        // Nothing placed, nothing held.
        assert!(h.broker.jobs(&tenant, None).await.unwrap().is_empty());
        let acme = cgx_ledger::AccountId::new(cgx_ledger::Role::Tenant, "acme").unwrap();
        assert_eq!(
            h.broker.store.account(&acme).await.unwrap().debits_pending,
            0
        );
        // Another tenant's quote is its own; a token with no tenant gets none.
        assert!(
            h.broker
                .quote(&h.admin(Role::Operator), spec.clone())
                .await
                .is_err()
        );

        // Held to the second offer: placed there, not on the cheaper node.
        let mut held = spec.clone();
        held.offer = Some(ChosenOffer {
            node: dear.id.clone(),
            price_per_gpu_hour_micros: Micros(2_500_000),
        });
        let job = h.broker.submit(&tenant, held.clone()).await.unwrap();
        assert_eq!(job.node_id.as_deref(), Some(dear.id.as_str()), "{job:?}");
        // The same offer again: the node is full now. A price that is not the node's: refused.
        let e = h.broker.submit(&tenant, held.clone()).await.unwrap_err();
        assert!(matches!(e, BrokerError::OfferGone(_)), "{e}");
        assert!(e.to_string().contains("no longer fits"), "{e}");
        let mut wrong = spec.clone();
        wrong.offer = Some(ChosenOffer {
            node: cheap.id.clone(),
            price_per_gpu_hour_micros: Micros(1_000_000),
        });
        let e = h.broker.submit(&tenant, wrong).await.unwrap_err();
        assert!(
            e.to_string().contains("price is now 2.000000 per GPU-hour"),
            "{e}"
        );
        let mut gone = spec;
        gone.offer = Some(ChosenOffer {
            node: "nnosuchnode".into(),
            price_per_gpu_hour_micros: Micros(1),
        });
        let e = h.broker.submit(&tenant, gone).await.unwrap_err();
        assert!(e.to_string().contains("no longer registered"), "{e}");
        // Refused offers stored nothing: one job, its budget held once.
        assert_eq!(h.broker.jobs(&tenant, None).await.unwrap().len(), 1);
        assert_eq!(
            h.broker.store.account(&acme).await.unwrap().available(),
            i128::from(FUNDS - 6_000_000)
        );
    }
}
