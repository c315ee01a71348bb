//! `cgx console login`: the web console's sign-in, answered with an API key where the key is
//! (the browser never sees the key).

use std::process::ExitCode;

use cgx_protocol::records::ConsoleLogin;

use crate::broker::Conn;
use crate::output::CliResult;

/// How long the printed token may be pasted.
const TOKEN_TTL: i64 = 120;

/// `cgx console login --key FILE --challenge C [--broker URL]`.
pub fn login(conn: &Conn, challenge: &str) -> CliResult {
    let exp = check_challenge(challenge)?;
    let key = conn
        .key
        .as_ref()
        .ok_or("--key (or CGX_BROKER_KEY): the API key to sign in with")?;
    let der = std::fs::read(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let der = crate::kbs::pem_or_der(&der, "PRIVATE KEY");
    let signer = cgx_protocol::signed::Signer::from_pkcs8(&der).map_err(|e| e.to_string())?;
    let now = crate::kbs::now();
    if now > exp {
        return Err("the challenge has expired: open the sign-in page again for a new one".into());
    }
    let token = signer
        .sign(
            &ConsoleLogin {
                challenge: challenge.to_string(),
            },
            now,
            now + TOKEN_TTL,
        )
        .map_err(|e| e.to_string())?;
    println!("{token}");
    eprintln!(
        "paste it into the sign-in page of {} that showed this challenge, within {TOKEN_TTL} s.\n\
         Answer only a challenge your own browser shows: whoever pastes this token is signed in as you.",
        conn.broker.trim_end_matches('/')
    );
    Ok(ExitCode::SUCCESS)
}

/// A challenge as the sign-in page shows it: `<expiry>.<64 hex digits>`; its expiry.
fn check_challenge(c: &str) -> Result<i64, String> {
    let bad =
        || "--challenge: not a sign-in challenge (copy it whole from the sign-in page)".to_string();
    let (exp, mac) = c.split_once('.').ok_or_else(bad)?;
    if mac.len() != 64 || !mac.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    exp.parse().map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::check_challenge;

    #[test]
    fn only_a_challenge_as_the_page_shows_it_is_signed() {
        let mac = "ab".repeat(32);
        assert_eq!(
            check_challenge(&format!("1700000000.{mac}")),
            Ok(1_700_000_000)
        );
        for bad in [
            "",
            "123",
            "x.ab",
            &format!("12.{}", &mac[2..]),
            &format!("a.{mac}"),
        ] {
            assert!(check_challenge(bad).is_err(), "{bad}");
        }
    }
}
