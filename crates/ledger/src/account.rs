//! Accounts: who holds money, in which role, and the limit each role keeps.
//!
//! An account's balance is four running sums of the transfers it took part in (TigerBeetle's
//! model): debits and credits, each pending (reserved by a two-phase transfer not yet resolved)
//! and posted. They are a cache of the transfers, which are immutable: an auditor replays the
//! transfers and must find the same sums.

use serde::{Deserialize, Serialize};

use crate::LedgerError;

/// An account's role. Its id is `<role>/<owner>` (`tenant/acme`, `escrow/l-…`,
/// `provider/op-1`), or the role alone for the marketplace's own accounts (`fee`, `slashed`,
/// `world`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Money outside the marketplace: deposits are debited here, withdrawals credited. The
    /// only account that may go negative (it mirrors the bank or the chain).
    World,
    /// A tenant's balance: what it deposited, less what its leases hold and spent.
    Tenant,
    /// One lease's escrow: the job's budget, reserved (pending) from the tenant's balance
    /// window by window, and passed through to the provider and the fee as windows are paid.
    Escrow,
    /// What the marketplace owes an operator for proven windows.
    Provider,
    /// The marketplace's fee on each paid window.
    Fee,
    /// An operator's stake: what a proven cheat forfeits.
    Stake,
    /// Forfeited stake on its way to the tenant it is owed to.
    Slashed,
}

impl Role {
    pub const ALL: [Role; 7] = [
        Role::World,
        Role::Tenant,
        Role::Escrow,
        Role::Provider,
        Role::Fee,
        Role::Stake,
        Role::Slashed,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            Role::World => "world",
            Role::Tenant => "tenant",
            Role::Escrow => "escrow",
            Role::Provider => "provider",
            Role::Fee => "fee",
            Role::Stake => "stake",
            Role::Slashed => "slashed",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// Whether the role's accounts are owned by someone (a tenant, a lease, an operator).
    pub const fn owned(self) -> bool {
        matches!(
            self,
            Role::Tenant | Role::Escrow | Role::Provider | Role::Stake
        )
    }

    /// Every role but the world holds money it owes someone: its debits may never exceed its
    /// credits (counting pending debits), so it never goes negative.
    pub const fn must_not_go_negative(self) -> bool {
        !matches!(self, Role::World)
    }
}

/// The longest owner name (a tenant, operator or lease id) an account takes.
pub const MAX_OWNER: usize = 128;

/// An account's id: its role and, for owned roles, its owner.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AccountId {
    role: Role,
    /// Shared, not copied: a book clones ids on every transfer it applies (its maps, its
    /// changes, its undo log).
    owner: std::sync::Arc<str>,
}

impl AccountId {
    /// An owned role's account for `owner`: 1–128 bytes of `[A-Za-z0-9._:@-]`.
    pub fn new(role: Role, owner: &str) -> Result<AccountId, LedgerError> {
        if !role.owned() {
            return Err(LedgerError::Account(format!(
                "{} accounts have no owner",
                role.as_str()
            )));
        }
        let ok = !owner.is_empty()
            && owner.len() <= MAX_OWNER
            && owner
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._:@-".contains(&b));
        if !ok {
            return Err(LedgerError::Account(format!(
                "owner {:?} of a {} account: 1–{MAX_OWNER} of [A-Za-z0-9._:@-]",
                owner.chars().take(40).collect::<String>(),
                role.as_str()
            )));
        }
        Ok(AccountId {
            role,
            owner: owner.into(),
        })
    }

    /// One of the marketplace's own accounts (`world`, `fee`, `slashed`).
    pub fn shared(role: Role) -> Result<AccountId, LedgerError> {
        if role.owned() {
            return Err(LedgerError::Account(format!(
                "{} accounts have an owner",
                role.as_str()
            )));
        }
        Ok(AccountId {
            role,
            owner: "".into(),
        })
    }

    pub fn world() -> AccountId {
        AccountId {
            role: Role::World,
            owner: "".into(),
        }
    }

    pub fn fee() -> AccountId {
        AccountId {
            role: Role::Fee,
            owner: "".into(),
        }
    }

    pub fn slashed() -> AccountId {
        AccountId {
            role: Role::Slashed,
            owner: "".into(),
        }
    }

    pub fn role(&self) -> Role {
        self.role
    }

    /// The owner ("" for the marketplace's own accounts).
    pub fn owner(&self) -> &str {
        &self.owner
    }
}

impl std::fmt::Display for AccountId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.owner.is_empty() {
            f.write_str(self.role.as_str())
        } else {
            write!(f, "{}/{}", self.role.as_str(), self.owner)
        }
    }
}

impl std::str::FromStr for AccountId {
    type Err = LedgerError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (role, owner) = s.split_once('/').unwrap_or((s, ""));
        let role = Role::parse(role).ok_or_else(|| {
            LedgerError::Account(format!(
                "no account role {:?}",
                role.chars().take(40).collect::<String>()
            ))
        })?;
        if role.owned() {
            AccountId::new(role, owner)
        } else if owner.is_empty() {
            AccountId::shared(role)
        } else {
            Err(LedgerError::Account(format!(
                "{} accounts have no owner",
                role.as_str()
            )))
        }
    }
}

impl TryFrom<String> for AccountId {
    type Error = LedgerError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<AccountId> for String {
    fn from(a: AccountId) -> String {
        a.to_string()
    }
}

/// An account's running sums, in micros.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Balance {
    pub debits_pending: u64,
    pub debits_posted: u64,
    pub credits_pending: u64,
    pub credits_posted: u64,
}

impl Balance {
    /// Posted credits less posted debits: what the account holds now (negative only for the
    /// world).
    pub fn net_posted(&self) -> i128 {
        i128::from(self.credits_posted) - i128::from(self.debits_posted)
    }

    /// What the account could still send: posted credits less every debit, pending included.
    pub fn available(&self) -> i128 {
        i128::from(self.credits_posted)
            - i128::from(self.debits_posted)
            - i128::from(self.debits_pending)
    }
}

/// An account: its id and its running sums.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Account {
    pub id: AccountId,
    pub balance: Balance,
}

impl Account {
    pub fn new(id: AccountId) -> Account {
        Account {
            id,
            balance: Balance::default(),
        }
    }

    /// Whether the account keeps its limit: debits (pending and posted) never exceed posted
    /// credits, for every role but the world.
    pub fn within_limit(&self) -> bool {
        !self.id.role().must_not_go_negative() || self.balance.available() >= 0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ids_round_trip_and_bad_ones_are_refused_with_their_reason() {
        for s in [
            "tenant/acme",
            "escrow/l-1",
            "provider/op.1",
            "fee",
            "world",
            "slashed",
        ] {
            let id: AccountId = s.parse().unwrap();
            assert_eq!(id.to_string(), s);
        }
        for (s, why) in [
            ("tenant", "owner \"\""),
            ("fee/x", "no owner"),
            ("bank/x", "no account role"),
            ("tenant/a b", "of [A-Za-z0-9"),
            ("tenant/a/b", "of [A-Za-z0-9"),
        ] {
            let e = s.parse::<AccountId>().unwrap_err().to_string();
            assert!(e.contains(why), "{s}: {e}");
        }
        let long = format!("tenant/{}", "a".repeat(MAX_OWNER + 1));
        assert!(long.parse::<AccountId>().is_err());
    }
}
