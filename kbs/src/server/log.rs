//! The KBS's own transparency log (issue 33): every audit row it commits — releases,
//! refusals of authenticated sessions, administrators' changes — is a leaf of a log under its
//! own origin and key (`[log]`), written by `cgx_service::logwriter` over its `audit` table.
//! Why its own and not the broker's: ARCHITECTURE.md ("The KBS keeps its own log"). Served at
//! `GET /kbs/v0/log/checkpoint` and `GET /kbs/v0/log/tile/…` (entry bundles to unscoped
//! administrators: they name tenants' resources).

use super::Kbs;
use super::error::KbsError;

impl Kbs {
    /// One integration pass: what it did, if anything was appended.
    pub(crate) async fn integrate_log_pass(
        &self,
    ) -> Result<Option<cgx_service::tlog::Integrated>, KbsError> {
        let Some(log) = &self.log else {
            return Ok(None);
        };
        let at = self.clock.unix();
        log.pass(|pin| self.store.integrate_log(log.key(), at, pin))
            .await
    }

    /// Submit the newest checkpoint to the witnesses: how many cosigned it.
    pub(crate) async fn witness_round(&self) -> Result<usize, KbsError> {
        match &self.log {
            Some(log) => Ok(log.witness_round(self.store.pool()).await?),
            None => Ok(0),
        }
    }

    /// The newest published checkpoint.
    pub(crate) async fn log_checkpoint(&self) -> Result<Vec<u8>, KbsError> {
        let Some(log) = &self.log else {
            return Err(KbsError::NotFound("this KBS keeps no log".into()));
        };
        log.published(self.store.pool())
            .await?
            .ok_or_else(|| KbsError::NotFound("no checkpoint published yet".into()))
    }

    /// A tile (`tile/…`) of the newest checkpoint's tree; entry bundles only when `entries`.
    pub(crate) async fn log_tile(&self, path: &str, entries: bool) -> Result<Vec<u8>, KbsError> {
        if self.log.is_none() || path.len() > 64 {
            return Err(KbsError::NotFound("no such tile".into()));
        }
        match cgx_service::tlog::tile(self.store.pool(), path, entries).await {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err(KbsError::NotFound(format!("no tile {path} (yet)"))),
            Err(cgx_service::tlog::LogStoreError::Log(cgx_tlog::LogError::Path(p)))
                if p.starts_with("entry bundles") =>
            {
                Err(KbsError::AdminAuth(p))
            }
            Err(cgx_service::tlog::LogStoreError::Log(e)) => Err(KbsError::NotFound(e.to_string())),
            Err(e) => Err(e.into()),
        }
    }
}
