//! Configuration files: TOML (`.toml`) or JSON (anything else, as deployments already write
//! them), then environment overrides, then the service's own checks.
//!
//! An override names a key path under the service's prefix with `__` between levels:
//! `CGX_KBS__LISTEN=0.0.0.0:8443`, `CGX_KBS__COLLATERAL__ONLINE=true`. A value that parses as
//! JSON (`true`, `300`, `["*"]`) is taken as that; anything else as a string.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::ServiceError;

/// Largest configuration file read.
const MAX_CONFIG: u64 = 1 << 20;

/// Read `path`, apply `env` overrides for `prefix` (e.g. `CGX_KBS`), and deserialize.
pub fn load<T: DeserializeOwned>(
    path: &Path,
    prefix: &str,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<T, ServiceError> {
    let bad = |e: &dyn std::fmt::Display| ServiceError::Config(format!("{}: {e}", path.display()));
    let len = std::fs::metadata(path).map_err(|e| bad(&e))?.len();
    if len > MAX_CONFIG {
        return Err(bad(&format!("{len} bytes, more than {MAX_CONFIG}")));
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(&e))?;
    let mut value: Value = if path.extension().is_some_and(|e| e == "toml") {
        toml::from_str(&text).map_err(|e| bad(&e))?
    } else {
        serde_json::from_str(&text).map_err(|e| bad(&e))?
    };
    let base = value.clone();
    let overridden = apply_env(&mut value, prefix, env)?;
    serde_json::from_value(value).map_err(|e| {
        if overridden.is_empty() || serde_json::from_value::<T>(base).is_err() {
            return bad(&e);
        }
        // The file alone fits and an override broke it: name the overrides, never their values
        // (one may be a secret set in the wrong variable).
        ServiceError::Config(format!(
            "{}: environment overrides {} do not fit the configuration (wrong key or type)",
            path.display(),
            overridden.join(", ")
        ))
    })
}

/// What the service skeleton needs of a service's configuration: where its environment
/// overrides live, its own checks, and its listener. The KBS's and the broker's configurations
/// implement it; [`load_service`] reads one, [`crate::server::serve_until_signal`] runs it.
pub trait ServiceConfig: DeserializeOwned {
    /// The prefix of its environment overrides (`CGX_KBS`: `CGX_KBS__LISTEN=…`).
    const ENV_PREFIX: &'static str;
    /// The service's error, which a configuration error becomes.
    type Error: From<ServiceError>;
    /// Its own rules, checked once the file, the environment and the caller's adjustments are in.
    fn check(&self) -> Result<(), Self::Error>;
    /// Plain HTTP for development (`--insecure-dev`): TLS off; the listener still refuses any
    /// address but loopback.
    fn set_insecure_dev(&mut self);
    /// The listener it asks for.
    fn listener(&self) -> crate::ListenerConfig;
}

/// Read a service's configuration: `path` (TOML or JSON), the environment's overrides under its
/// prefix, `adjust` (the command line's flags), then its checks.
pub fn load_service<C: ServiceConfig>(
    path: &Path,
    adjust: impl FnOnce(&mut C),
) -> Result<C, C::Error> {
    let env = env_vars(C::ENV_PREFIX)?;
    let mut c: C = load(path, C::ENV_PREFIX, env)?;
    adjust(&mut c);
    c.check()?;
    Ok(c)
}

/// `(name, value)` pairs of the process environment under `prefix`, for [`load`]. A variable
/// under the prefix whose name or value is not UTF-8 is an error; others are not looked at.
pub fn env_vars(prefix: &str) -> Result<Vec<(String, String)>, ServiceError> {
    let start = format!("{prefix}__");
    let mut out = Vec::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(&start) {
            continue;
        }
        let value = value
            .into_string()
            .map_err(|_| ServiceError::Config(format!("{name}: value is not UTF-8")))?;
        out.push((name.to_string(), value));
    }
    Ok(out)
}

/// Apply `PREFIX__A__B=value` overrides to `value`; returns the variables applied.
fn apply_env(
    value: &mut Value,
    prefix: &str,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Vec<String>, ServiceError> {
    let start = format!("{prefix}__");
    let mut vars: Vec<(String, String)> = env
        .into_iter()
        .filter(|(k, _)| k.starts_with(&start))
        .collect();
    vars.sort();
    let mut applied = Vec::with_capacity(vars.len());
    for (name, raw) in vars {
        let path: Vec<String> = name[start.len()..]
            .split("__")
            .map(str::to_ascii_lowercase)
            .collect();
        if path.iter().any(String::is_empty) {
            return Err(ServiceError::Config(format!("{name}: empty key")));
        }
        let parsed = serde_json::from_str(&raw).unwrap_or(Value::String(raw));
        let mut at = &mut *value;
        for key in &path {
            if !at.is_object() {
                return Err(ServiceError::Config(format!(
                    "{name}: {key} is inside a value that is not a table"
                )));
            }
            let Value::Object(map) = at else {
                return Err(ServiceError::Config(format!("{name}: not a table")));
            };
            at = map
                .entry(key.clone())
                .or_insert(Value::Object(Default::default()));
        }
        *at = parsed;
        applied.push(name);
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct C {
        listen: String,
        #[serde(default)]
        ttl: i64,
        #[serde(default)]
        inner: Inner,
    }
    #[derive(Debug, Default, serde::Deserialize, PartialEq)]
    struct Inner {
        #[serde(default)]
        online: bool,
        #[serde(default)]
        keys: Vec<String>,
    }

    fn file(name: &str, text: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("cgx-config-{}-{name}", std::process::id()));
        std::fs::write(&d, text).unwrap();
        d
    }

    #[test]
    fn toml_and_json_read_alike_and_env_overrides_win() {
        let t = file(
            "a.toml",
            "listen = \"127.0.0.1:1\"\nttl = 5\n[inner]\nonline = false\n",
        );
        let j = file(
            "a.json",
            r#"{"listen": "127.0.0.1:1", "ttl": 5, "inner": {"online": false}}"#,
        );
        let a: C = load(&t, "X", []).unwrap();
        let b: C = load(&j, "X", []).unwrap();
        assert_eq!(a, b);
        let env = [
            ("X__TTL".to_string(), "60".to_string()),
            ("X__INNER__ONLINE".to_string(), "true".to_string()),
            ("X__INNER__KEYS".to_string(), r#"["k1"]"#.to_string()),
            ("X__LISTEN".to_string(), "0.0.0.0:9".to_string()),
            ("OTHER__TTL".to_string(), "1".to_string()),
        ];
        let c: C = load(&t, "X", env).unwrap();
        assert_eq!(c.ttl, 60);
        assert!(c.inner.online);
        assert_eq!(c.inner.keys, ["k1"]);
        assert_eq!(c.listen, "0.0.0.0:9");
        // Unknown keys, from a file or the environment, are refused.
        let e = load::<C>(&t, "X", [("X__NOPE".into(), "1".into())]).unwrap_err();
        assert!(e.to_string().contains("X__NOPE"), "{e}");
        // A secret put in the wrong variable is named by key, never printed.
        let e = load::<C>(&t, "X", [("X__TTL".into(), "\"s3cr3t-kek\"".into())]).unwrap_err();
        assert!(e.to_string().contains("X__TTL"), "{e}");
        assert!(!e.to_string().contains("s3cr3t"), "{e}");
        // An unknown key in the file itself is refused with its name.
        let unknown = file("u.toml", "listen = \"x\"\nlisen = 1\n");
        let e = load::<C>(&unknown, "X", []).unwrap_err();
        assert!(e.to_string().contains("lisen"), "{e}");
        let e = load::<C>(&t, "X", [("X__TTL__DEEP".into(), "1".into())]).unwrap_err();
        assert!(e.to_string().contains("not a table"), "{e}");
        let bad = file("bad.toml", "listen = ");
        assert!(load::<C>(&bad, "X", []).is_err());
        assert!(load::<C>(Path::new("/nonexistent/cgx.toml"), "X", []).is_err());
    }
}
