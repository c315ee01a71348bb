//! The host agent's configuration: one small TOML file.
//!
//! ```toml
//! [agent]                          # what the guest agent is told
//! broker = "https://broker.example"
//! broker_key = "<base64 Ed25519>"  # the broker's lease-signing key
//! kbs = "https://kbs.example"
//! operator = "op1"
//! region = "eu-west"
//! price_micros = 2100000           # per GPU-hour
//! token_file = "/etc/cgx/operator.token"   # the operator's API token (rotate it in place)
//! # ca = "/etc/cgx/ca.pem"
//!
//! [launcher]
//! kind = "qemu"                    # qemu | sim
//! state_file = "/run/cgx/host-agent.json"
//! restart_min_ms = 500             # back-off after the VM exits, doubling…
//! restart_max_ms = 60000           # …up to this; reset once it ran a minute
//!
//! [sim]                            # kind = "sim": the guest agent as a local process
//! guest_agent = ["/usr/bin/cgx-guest-agent"]
//! machine = "/var/lib/cgx/sim-machine.json"   # the simulated machine, made once (0600)
//! gpus = 8
//! store = "/var/lib/cgx/weights"
//! work = "/run/cgx/work"
//!
//! [qemu]                           # kind = "qemu"
//! binary = "qemu-system-x86_64"
//! socket = "/run/cgx/vm.sock"      # the guest's channel to this agent
//! [qemu.launch]                    # the launch description `cgx measure launch` reads too
//! tee = "snp"
//! # …
//!
//! [channel]                        # kind = "qemu": what the guest reaches through this agent
//! # broker = "10.0.0.5:443"        # default: [agent].broker's host and port
//! # kbs = "10.0.0.6:443"           # default: [agent].kbs's
//! store = "/var/lib/cgx/weights"   # encrypted weights the guest may fetch (store/<file>)
//! # sim_machine = "…"              # a simulated machine for a VM without a TEE (tests)
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::launch::Launch;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostConfig {
    pub agent: AgentConfig,
    pub launcher: LauncherConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sim: Option<SimConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qemu: Option<QemuConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<ChannelConfig>,
}

/// What the host serves its VM over the channel (`kind = "qemu"`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChannelConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kbs: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sim_machine: Option<PathBuf>,
}

/// `host:port` of a service URL (the scheme's port when it names none).
pub fn url_address(url: &str) -> Result<String, ConfigError> {
    let bad = || ConfigError::Invalid(format!("{url}: not an http(s) URL with a host"));
    let (scheme, rest) = url.split_once("://").ok_or_else(bad)?;
    let authority = rest.split('/').next().unwrap_or("");
    if authority.is_empty() || authority.contains('@') {
        return Err(bad());
    }
    let has_port = match authority.rfind(']') {
        Some(close) => authority[close..].contains(':'),
        None => authority.contains(':'),
    };
    if has_port {
        return Ok(authority.to_string());
    }
    match scheme.to_ascii_lowercase().as_str() {
        "https" => Ok(format!("{authority}:443")),
        "http" => Ok(format!("{authority}:80")),
        _ => Err(bad()),
    }
}

impl HostConfig {
    /// What the channel serves (`kind = "qemu"`).
    pub fn channel_table(&self) -> Result<crate::channel::Table, ConfigError> {
        let c = self.channel.clone().unwrap_or_default();
        Ok(crate::channel::Table {
            broker: match c.broker {
                Some(a) => a,
                None => url_address(&self.agent.broker)?,
            },
            kbs: match c.kbs {
                Some(a) => a,
                None => url_address(&self.agent.kbs)?,
            },
            token_file: self.agent.token_file.clone(),
            sim_machine: c.sim_machine,
            store: c.store,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub broker: String,
    /// The broker's lease-signing public key (Ed25519, base64): the guest verifies every lease
    /// under it.
    pub broker_key: String,
    pub kbs: String,
    pub operator: String,
    pub region: String,
    pub price_micros: u64,
    pub token_file: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LauncherKind {
    Sim,
    Qemu,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LauncherConfig {
    pub kind: LauncherKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_file: Option<PathBuf>,
    #[serde(default = "restart_min")]
    pub restart_min_ms: u64,
    #[serde(default = "restart_max")]
    pub restart_max_ms: u64,
}

fn restart_min() -> u64 {
    500
}

fn restart_max() -> u64 {
    60_000
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    /// The guest agent's command (a program and leading arguments).
    pub guest_agent: Vec<String>,
    pub machine: PathBuf,
    #[serde(default = "one")]
    pub gpus: usize,
    pub store: PathBuf,
    pub work: PathBuf,
    /// The guest agent's first workload user id (`--workload-uid`): hosts sharing one OS (the
    /// sim launcher's) need ranges apart, since an agent clears its range at start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_uid: Option<u32>,
}

fn one() -> usize {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QemuConfig {
    #[serde(default = "qemu_binary")]
    pub binary: String,
    pub socket: PathBuf,
    /// No KVM (tests on TCG).
    #[serde(default)]
    pub tcg: bool,
    pub launch: Launch,
}

fn qemu_binary() -> String {
    "qemu-system-x86_64".into()
}

/// Why a configuration is refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("{path}: {detail}")]
    Read { path: String, detail: String },
    #[error("{0}")]
    Invalid(String),
}

/// The most a configuration file may be (it is a few lines).
pub const MAX_CONFIG_BYTES: u64 = 64 * 1024;

impl HostConfig {
    /// Read and check `path`.
    pub fn load(path: &Path) -> Result<HostConfig, ConfigError> {
        let read = |detail: String| ConfigError::Read {
            path: path.display().to_string(),
            detail,
        };
        let meta = std::fs::metadata(path).map_err(|e| read(e.to_string()))?;
        if meta.len() > MAX_CONFIG_BYTES {
            return Err(read(format!("over {MAX_CONFIG_BYTES} bytes")));
        }
        let text = std::fs::read_to_string(path).map_err(|e| read(e.to_string()))?;
        let c = Self::parse(&text).map_err(|e| match e {
            ConfigError::Invalid(d) => read(d),
            other => other,
        })?;
        Ok(c)
    }

    /// Parse and check a configuration's text.
    pub fn parse(text: &str) -> Result<HostConfig, ConfigError> {
        let c: HostConfig =
            toml::from_str(text).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<(), ConfigError> {
        let bad = |s: String| Err(ConfigError::Invalid(s));
        if self.launcher.restart_min_ms == 0
            || self.launcher.restart_min_ms > self.launcher.restart_max_ms
        {
            return bad("launcher.restart_min_ms: above 0 and at most restart_max_ms".into());
        }
        match self.launcher.kind {
            LauncherKind::Sim => match &self.sim {
                None => return bad("launcher.kind = \"sim\" needs a [sim] table".into()),
                Some(s) if s.guest_agent.is_empty() => {
                    return bad("sim.guest_agent: the guest agent's command".into());
                }
                Some(s) if s.gpus == 0 || s.gpus > 64 => {
                    return bad("sim.gpus: 1 to 64".into());
                }
                Some(_) => {}
            },
            LauncherKind::Qemu => match &self.qemu {
                None => return bad("launcher.kind = \"qemu\" needs a [qemu] table".into()),
                Some(q) => {
                    q.launch
                        .check()
                        .map_err(|e| ConfigError::Invalid(e.to_string()))?;
                    self.channel_table()?;
                }
            },
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const SIM: &str = r#"
        [agent]
        broker = "http://127.0.0.1:1"
        broker_key = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"
        kbs = "http://127.0.0.1:2"
        operator = "op1"
        region = "eu-west"
        price_micros = 1000000
        token_file = "/t"
        [launcher]
        kind = "sim"
        [sim]
        guest_agent = ["cgx-guest-agent"]
        machine = "/m.json"
        store = "/s"
        work = "/w"
    "#;

    #[test]
    fn a_sim_host_and_refusals_by_field() {
        let c = HostConfig::parse(SIM).unwrap();
        assert_eq!(c.launcher.kind, LauncherKind::Sim);
        assert_eq!((c.launcher.restart_min_ms, c.sim.unwrap().gpus), (500, 1));
        for (edit, why) in [
            (SIM.replace("kind = \"sim\"", "kind = \"qemu\""), "[qemu]"),
            (SIM.replace("[sim]", "[other]"), "unknown field"),
            (
                SIM.replace("[\"cgx-guest-agent\"]", "[]"),
                "sim.guest_agent",
            ),
            (
                SIM.replace("kind = \"sim\"", "kind = \"sim\"\nrestart_min_ms = 0"),
                "restart_min_ms",
            ),
            (
                SIM.replace("price_micros = 1000000", "price_micros = -1"),
                "price_micros",
            ),
        ] {
            let e = HostConfig::parse(&edit).unwrap_err().to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
    }

    #[test]
    fn the_channel_reaches_the_agents_services_unless_told_otherwise() {
        for (url, want) in [
            ("https://broker.example", "broker.example:443"),
            ("https://broker.example:8443/", "broker.example:8443"),
            ("http://127.0.0.1:9/x", "127.0.0.1:9"),
            ("https://[::1]/", "[::1]:443"),
            ("https://[::1]:7", "[::1]:7"),
        ] {
            assert_eq!(url_address(url).unwrap(), want, "{url}");
        }
        for url in ["broker.example", "ftp://b", "https://", "https://u@b/"] {
            assert!(url_address(url).is_err(), "{url}");
        }
        let mut c = HostConfig::parse(SIM).unwrap();
        assert_eq!(c.channel_table().unwrap().kbs, "127.0.0.1:2");
        c.channel = Some(ChannelConfig {
            kbs: Some("10.0.0.6:443".into()),
            ..Default::default()
        });
        let t = c.channel_table().unwrap();
        assert_eq!(
            (t.broker.as_str(), t.kbs.as_str()),
            ("127.0.0.1:1", "10.0.0.6:443")
        );
    }
}
