//! Money: exact integers of a stated minor unit, wherever money flows (offers, job specs,
//! budgets, node views, signed node records, and — as they arrive — metering and the ledger).
//!
//! The unit is the micro: a millionth of the marketplace's currency unit. On the wire an
//! amount is a JSON integer in a field whose name ends `_micros`; no float is read or written.
//! The float fields of before (`price_per_gpu_hour`, `max_price_per_gpu_hour`, `budget`) are
//! refused at the API with an error that names the field to send instead. Job specs stored by
//! a broker from before keep their text (the job's seal covers it) and are read with
//! [`Micros::from_stored_float`], the rounding the broker of then applied when it placed them.

use serde::{Deserialize, Serialize};

/// An amount of money in micros (10⁻⁶ of the currency unit).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(transparent)]
pub struct Micros(pub u64);

/// Why a decimal amount was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MoneyError {
    #[error("{0:?} is not an amount: digits, optionally a point and up to 6 more digits")]
    Syntax(String),
    #[error("{0:?} has more than 6 decimals (the smallest amount is 0.000001)")]
    TooPrecise(String),
    #[error("{0:?} is more than {max}", max = Micros::MAX)]
    TooLarge(String),
}

impl Micros {
    /// Micros per currency unit.
    pub const PER_UNIT: u64 = 1_000_000;
    /// The largest amount any API takes: 10⁹ currency units.
    pub const MAX: Micros = Micros(1_000_000_000 * Self::PER_UNIT);

    /// The amount in micros.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Whether the amount is at most [`Micros::MAX`] (what every API checks).
    pub const fn in_range(self) -> bool {
        self.0 <= Self::MAX.0
    }

    /// An exact decimal amount in currency units (`2`, `2.5`, `0.000001`): no sign, no
    /// exponent, at most six decimals, at most [`Micros::MAX`]. For people (the CLI's flags);
    /// the wire carries integers.
    pub fn parse_decimal(text: &str) -> Result<Micros, MoneyError> {
        let syntax = || MoneyError::Syntax(text.chars().take(40).collect());
        let (units, frac) = text.split_once('.').unwrap_or((text, ""));
        let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if units.is_empty() || !digits(units) || !digits(frac) || text.ends_with('.') {
            return Err(syntax());
        }
        if frac.len() > 6 {
            return Err(MoneyError::TooPrecise(text.chars().take(40).collect()));
        }
        let too_large = || MoneyError::TooLarge(text.chars().take(40).collect());
        // All digits by now: parsing fails only on overflow ("" is a run of zeros).
        let units = match units.trim_start_matches('0') {
            "" => 0,
            digits => digits.parse::<u64>().map_err(|_| too_large())?,
        };
        let frac_micros = if frac.is_empty() {
            0
        } else {
            format!("{frac:0<6}").parse::<u64>().map_err(|_| syntax())?
        };
        let m = units
            .checked_mul(Self::PER_UNIT)
            .and_then(|u| u.checked_add(frac_micros))
            .map(Micros)
            .ok_or_else(too_large)?;
        if m.in_range() {
            Ok(m)
        } else {
            Err(too_large())
        }
    }

    /// A float amount from a job spec stored by a broker from before integer money, read as
    /// that broker read it when it placed the job: finite, 0 to 10⁹ units, rounded to the
    /// nearest micro. Never for input from the API.
    pub fn from_stored_float(v: f64) -> Option<Micros> {
        (v.is_finite() && (0.0..=1e9).contains(&v)).then(|| Micros((v * 1e6).round() as u64))
    }

    /// `self × n`, or `None` on overflow.
    pub fn checked_mul(self, n: u64) -> Option<Micros> {
        self.0.checked_mul(n).map(Micros)
    }
}

/// The most a job can cost: `price` per GPU-hour × `gpus` × `secs`, in micros rounded up (what
/// a budget must cover). `None` past u128 (only absurd inputs: callers bound them first).
pub fn max_cost(price: Micros, gpus: u32, secs: u64) -> Option<u128> {
    u128::from(price.0)
        .checked_mul(u128::from(gpus))?
        .checked_mul(u128::from(secs))
        .map(|c| c.div_ceil(3600))
}

/// The float money fields of before and the integer field each became.
pub const RETIRED_FLOAT_FIELDS: [(&str, &str); 3] = [
    ("price_per_gpu_hour", "price_per_gpu_hour_micros"),
    ("max_price_per_gpu_hour", "max_price_per_gpu_hour_micros"),
    ("budget", "budget_micros"),
];

/// For a body refused as naming an unknown field: if that field is a retired float money
/// field, the refusal that says what to send instead (`None`: it is not one).
pub fn retired_field_refusal(serde_error: &str) -> Option<String> {
    RETIRED_FLOAT_FIELDS.iter().find_map(|(old, new)| {
        serde_error
            .contains(&format!("unknown field `{old}`"))
            .then(|| {
                format!(
                    "{old} (a float) is no longer read: send {new}, an integer number of micros (10^-6 of the currency unit; 2.5 is 2500000)"
                )
            })
    })
}

impl std::fmt::Display for Micros {
    /// Currency units with all six decimals (`2.500000`): exact, unlike a float's.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}.{:06}",
            self.0 / Self::PER_UNIT,
            self.0 % Self::PER_UNIT
        )
    }
}

impl std::str::FromStr for Micros {
    type Err = MoneyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Micros::parse_decimal(s)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn decimals_parse_exactly_and_refuse_with_reasons() {
        for (text, micros) in [
            ("0", 0),
            ("2", 2_000_000),
            ("2.5", 2_500_000),
            ("0.000001", 1),
            ("007.10", 7_100_000),
            ("1000000000", 1_000_000_000_000_000),
            // 0.1 + 0.2 is not 0.3 in floats; in micros it is.
            ("0.3", 300_000),
        ] {
            assert_eq!(Micros::parse_decimal(text), Ok(Micros(micros)), "{text}");
        }
        for (text, why) in [
            ("", "not an amount"),
            ("-1", "not an amount"),
            ("+1", "not an amount"),
            ("1e3", "not an amount"),
            ("1.", "not an amount"),
            (".5", "not an amount"),
            ("1.2.3", "not an amount"),
            (" 1", "not an amount"),
            ("NaN", "not an amount"),
            ("0.0000001", "more than 6 decimals"),
            ("1000000000.000001", "more than 1000000000.000000"),
            ("99999999999999999999999", "more than"),
        ] {
            let e = Micros::parse_decimal(text).unwrap_err().to_string();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn display_is_exact_and_round_trips() {
        for m in [0, 1, 999_999, 1_000_000, 2_500_000, Micros::MAX.0] {
            let shown = Micros(m).to_string();
            assert_eq!(shown.parse::<Micros>(), Ok(Micros(m)), "{shown}");
        }
        assert_eq!(Micros(2_500_000).to_string(), "2.500000");
    }

    #[test]
    fn stored_floats_read_as_the_broker_of_then_did() {
        assert_eq!(Micros::from_stored_float(2.0), Some(Micros(2_000_000)));
        assert_eq!(Micros::from_stored_float(0.1 + 0.2), Some(Micros(300_000)));
        assert_eq!(
            Micros::from_stored_float(1.0000005),
            Some(Micros(1_000_001))
        );
        for bad in [f64::NAN, f64::INFINITY, -1.0, 1e9 + 1.0] {
            assert_eq!(Micros::from_stored_float(bad), None, "{bad}");
        }
    }

    #[test]
    fn retired_float_fields_are_refused_naming_their_successor() {
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Spec {
            budget_micros: Micros,
        }
        let e = serde_json::from_str::<Spec>(r#"{"budget": 2.5}"#)
            .unwrap_err()
            .to_string();
        let said = retired_field_refusal(&e).unwrap();
        assert!(said.contains("send budget_micros"), "{said}");
        assert_eq!(retired_field_refusal("unknown field `region2`"), None);
    }

    #[test]
    fn on_the_wire_an_integer_and_nothing_else() {
        assert_eq!(
            serde_json::to_string(&Micros(1_500_000)).unwrap(),
            "1500000"
        );
        assert_eq!(
            serde_json::from_str::<Micros>("1500000").unwrap(),
            Micros(1_500_000)
        );
        for bad in ["1.5", "\"1.5\"", "-1", "1e6"] {
            assert!(serde_json::from_str::<Micros>(bad).is_err(), "{bad}");
        }
    }
}
