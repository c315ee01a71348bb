//! `cgx broker serve|reference-values`, `cgx job submit|status|cancel|ls`, `cgx node ls|show`: run the broker,
//! and speak to it as a tenant, an operator or an auditor. Human tables by default, `--json`
//! for scripts; a refusal prints the broker's stable code and exits 1.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use cgx_broker::client::{BrokerClient, ClientError};
use cgx_broker::server::config::BrokerConfig;
use cgx_protocol::broker::{JobSpec, JobView, NodeView};
use cgx_protocol::money::Micros;
use cgx_protocol::records::TeeKind;

use crate::output::{CliResult, print_json, read_text};

/// Where the broker is and who is asking.
#[derive(clap::Args, Debug, Clone)]
pub struct Conn {
    /// Broker base URL.
    #[arg(
        long,
        global = true,
        env = "CGX_BROKER",
        default_value = "https://127.0.0.1:8444"
    )]
    pub broker: String,
    /// Ed25519 PKCS#8 key (DER or PEM) of an API key the broker knows (its scopes decide).
    #[arg(long, global = true, env = "CGX_BROKER_KEY")]
    pub key: Option<PathBuf>,
    /// CA certificate(s) of the broker (PEM); default: WebPKI roots.
    #[arg(long, global = true)]
    pub ca: Option<PathBuf>,
    /// Print JSON.
    #[arg(long, global = true)]
    pub json: bool,
}

impl Conn {
    pub(crate) fn client(&self) -> Result<BrokerClient, String> {
        let token = match &self.key {
            Some(k) => Some(crate::kbs::bearer_token(
                k,
                cgx_service::auth::BearerKind::BrokerApi,
                300,
            )?),
            None => None,
        };
        let ca = match &self.ca {
            Some(p) => Some(std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?),
            None => None,
        };
        BrokerClient::new(&self.broker, ca.as_deref(), token).map_err(|e| e.to_string())
    }
}

/// `cgx broker serve --config F`.
pub fn serve(config: &Path, insecure_dev: bool) -> CliResult {
    crate::kbs::serve_service::<BrokerConfig, _, _>(
        "cgx broker",
        config,
        insecure_dev,
        |cfg, stop, on_listen| async move { cgx_broker::server::run(&cfg, stop, on_listen).await },
    )
}

/// Ask the broker (`call`), then print the answer: JSON with `--json`, else `text`. A refusal
/// prints its code and detail (JSON with `--json`) and exits 1; transport problems are usage
/// errors (exit 2).
pub(crate) fn show<T: serde::Serialize>(
    conn: &Conn,
    call: impl FnOnce(&BrokerClient) -> Result<T, ClientError>,
    text: impl FnOnce(&T),
) -> CliResult {
    match call(&conn.client()?) {
        Ok(v) => {
            if conn.json {
                print_json(&v)?;
            } else {
                text(&v);
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(ClientError::Refused {
            status,
            code,
            detail,
        }) => {
            if conn.json {
                print_json(
                    &serde_json::json!({"error": {"code": code, "status": status, "detail": detail}}),
                )?;
            } else {
                eprintln!("refused ({code}, HTTP {status}): {detail}");
            }
            Ok(ExitCode::from(1))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Duration `90`, `90s`, `15m`, `2h`, `1d` → seconds.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    let (num, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("duration '{s}': a number then s, m, h or d"))?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("duration '{s}': unit must be s, m, h or d")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("duration '{s}' is too long"))
}

/// What `cgx job submit` asks for.
#[derive(clap::Args, Debug, Clone)]
pub struct SubmitArgs {
    /// The whole job as JSON (the broker's JobSpec); flags below are ignored with it.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    #[arg(long, default_value = "H100")]
    pub gpu_model: String,
    #[arg(long, default_value_t = 1)]
    pub gpus: u32,
    /// Minimum memory per GPU, GiB.
    #[arg(long, default_value_t = 0)]
    pub min_memory: u32,
    /// TEE kinds allowed (snp, tdx); repeat or comma-separate. Default: any.
    #[arg(long, value_delimiter = ',', value_parser = parse_tee)]
    pub tee: Vec<TeeKind>,
    /// Regions allowed, in order of preference; repeat or comma-separate. Default: any.
    #[arg(long = "region", value_delimiter = ',')]
    pub regions: Vec<String>,
    /// Highest price per GPU-hour, in currency units (exact decimal, up to 6 decimals: 2.5).
    #[arg(long)]
    pub max_price: Option<Micros>,
    /// How long the job runs: 90s, 15m, 2h, 1d.
    #[arg(long, default_value = "1h")]
    pub duration: String,
    /// Escrowed budget, in currency units (exact decimal); default: exactly max price × GPUs ×
    /// hours, rounded up to the micro.
    #[arg(long)]
    pub budget: Option<Micros>,
    /// KBS resources the lease covers (repo/type/tag); repeat.
    #[arg(long = "resource")]
    pub resources: Vec<String>,
    /// Placement policy (Rego, package placement).
    #[arg(long)]
    pub placement_policy: Option<PathBuf>,
    /// Tenant (default: the key's only tenant).
    #[arg(long)]
    pub tenant: Option<String>,
    /// The workload: an absolute path of a program in the node's image.
    #[arg(long)]
    pub command: Option<String>,
    /// One of the workload's arguments; repeat.
    #[arg(long = "arg", requires = "command", allow_hyphen_values = true)]
    pub args: Vec<String>,
    /// The weights the workload reads: RESOURCE=FILE (the key's KBS resource, one of
    /// --resource; the age file's name in the node's weights store).
    #[arg(long, requires = "command")]
    pub weights: Option<String>,
    /// Hold the job to an offer from `cgx job quote`: NODE=PRICE (per GPU-hour, currency
    /// units). Placed on that node at that price, or refused with why the offer no longer holds.
    #[arg(long)]
    pub offer: Option<String>,
}

impl SubmitArgs {
    pub(crate) fn spec(&self) -> Result<JobSpec, String> {
        if let Some(p) = &self.spec {
            let mut spec: JobSpec = serde_json::from_str(&read_text(p)?).map_err(|e| {
                let e = e.to_string();
                let e = cgx_protocol::money::retired_field_refusal(&e).unwrap_or(e);
                format!("{}: {e}", p.display())
            })?;
            if self.offer.is_some() {
                spec.offer = self.offer()?;
            }
            return Ok(spec);
        }
        let max_price = self
            .max_price
            .ok_or("--max-price is required (or --spec FILE)")?;
        let duration_secs = parse_duration(&self.duration)?;
        let budget = match self.budget {
            Some(b) => b,
            // What the broker requires: max price × GPUs × hours, rounded up to the micro.
            None => {
                let needed = cgx_protocol::money::max_cost(max_price, self.gpus, duration_secs)
                    .ok_or("--max-price × --gpus × --duration is too large")?;
                u64::try_from(needed)
                    .map(Micros)
                    .map_err(|_| "--max-price × --gpus × --duration is too large".to_string())?
            }
        };
        Ok(JobSpec {
            tenant: self.tenant.clone(),
            gpu_model: self.gpu_model.clone(),
            gpu_count: self.gpus,
            min_gpu_memory_gib: self.min_memory,
            tee: self.tee.clone(),
            regions: self.regions.clone(),
            max_price_per_gpu_hour_micros: max_price,
            duration_secs,
            budget_micros: budget,
            resources: self.resources.clone(),
            placement_policy: self
                .placement_policy
                .as_deref()
                .map(read_text)
                .transpose()?,
            workload: self.workload()?,
            offer: self.offer()?,
        })
    }

    fn offer(&self) -> Result<Option<cgx_protocol::ledger::ChosenOffer>, String> {
        let Some(o) = &self.offer else {
            return Ok(None);
        };
        let (node, price) = o
            .split_once('=')
            .ok_or("--offer: NODE=PRICE, as `cgx job quote` prints it")?;
        let price = Micros::parse_decimal(price).map_err(|e| format!("--offer: {e}"))?;
        Ok(Some(cgx_protocol::ledger::ChosenOffer {
            node: node.to_string(),
            price_per_gpu_hour_micros: price,
        }))
    }

    fn workload(&self) -> Result<Option<cgx_protocol::broker::Workload>, String> {
        let Some(command) = &self.command else {
            return Ok(None);
        };
        let weights = match &self.weights {
            Some(w) => {
                let (resource, file) = w
                    .split_once('=')
                    .ok_or("--weights: RESOURCE=FILE (e.g. acme/weights/llama=llama.age)")?;
                Some(cgx_protocol::broker::WorkloadWeights {
                    resource: resource.to_string(),
                    file: file.to_string(),
                })
            }
            None => None,
        };
        let w = cgx_protocol::broker::Workload {
            command: command.clone(),
            args: self.args.clone(),
            weights,
        };
        w.check(&self.resources).map_err(|e| e.to_string())?;
        Ok(Some(w))
    }
}

pub(crate) fn time_of(t: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(t)
        .ok()
        .and_then(|d| {
            d.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| t.to_string())
}

fn print_job(j: &JobView) {
    println!("job      {}", j.id);
    println!("tenant   {}", j.tenant);
    println!("state    {}", j.state.as_str().to_uppercase());
    println!("reason   {}", j.reason);
    if j.metered_windows > 0 {
        println!(
            "metered  {} windows of its lease (signed records accepted)",
            j.metered_windows
        );
    }
    println!(
        "asks     {} × {} (≥ {} GiB), ≤ {}/GPU-h, {} s, TEE {}, regions {}",
        j.spec.gpu_count,
        j.spec.gpu_model,
        j.spec.min_gpu_memory_gib,
        j.spec.max_price_per_gpu_hour_micros,
        j.spec.duration_secs,
        if j.spec.tee.is_empty() {
            "any".into()
        } else {
            j.spec
                .tee
                .iter()
                .map(|t| t.as_str())
                .collect::<Vec<_>>()
                .join(",")
        },
        if j.spec.regions.is_empty() {
            "any".into()
        } else {
            j.spec.regions.join(",")
        },
    );
    if let Some(n) = &j.node_id {
        println!("node     {n} (GPUs {:?})", j.gpus);
    }
    if let Some(l) = &j.lease_id {
        println!("lease    {l}");
    }
    for e in &j.events {
        println!(
            "  {}  {} → {}  {}",
            time_of(e.at),
            e.from.map_or("-", |f| f.as_str()),
            e.to,
            e.reason
        );
    }
}

pub fn job_submit(conn: &Conn, args: &SubmitArgs) -> CliResult {
    let spec = args.spec()?;
    show(conn, |c| c.submit(&spec), print_job)
}

pub fn job_status(conn: &Conn, id: &str) -> CliResult {
    show(conn, |c| c.job(id), print_job)
}

pub fn job_cancel(conn: &Conn, id: &str) -> CliResult {
    show(
        conn,
        |c| c.cancel(id),
        |j| println!("{} {}", j.id, j.state.as_str().to_uppercase()),
    )
}

pub fn job_ls(conn: &Conn, tenant: Option<&str>) -> CliResult {
    show(
        conn,
        |c| c.jobs(tenant),
        |jobs| {
            println!(
                "{:<26} {:<10} {:<10} {:>4} {:<34} REASON",
                "JOB", "TENANT", "STATE", "GPUS", "NODE"
            );
            for j in jobs {
                println!(
                    "{:<26} {:<10} {:<10} {:>4} {:<34} {}",
                    j.id,
                    j.tenant,
                    j.state,
                    j.spec.gpu_count,
                    j.node_id.as_deref().unwrap_or("-"),
                    j.reason
                );
            }
        },
    )
}

/// One line per node: the table `cgx node ls` prints.
pub fn node_table(nodes: &[NodeView]) -> Vec<String> {
    let mut out = vec![format!(
        "{:<34} {:<10} {:<9} {:<4} {:<9} {:>9} {:>14} {:<15} WHY NOT",
        "NODE", "OPERATOR", "REGION", "TEE", "GPUS", "FREE", "PRICE", "STATUS"
    )];
    for n in nodes {
        out.push(format!(
            "{:<34} {:<10} {:<9} {:<4} {:<9} {:>9} {:>14} {:<15} {}",
            n.id,
            n.operator,
            n.region,
            n.tee,
            format!("{}×{}", n.gpu_count, n.gpu_model),
            n.free_gpus,
            n.price_per_gpu_hour_micros.to_string(),
            if n.placeable {
                "placeable".to_string()
            } else {
                n.status.to_string()
            },
            if n.placeable { "" } else { n.reason.as_str() }
        ));
    }
    out
}

pub fn node_ls(conn: &Conn) -> CliResult {
    show(
        conn,
        |c| c.nodes(),
        |nodes| {
            for l in node_table(nodes) {
                println!("{l}");
            }
        },
    )
}

pub fn node_reattest(conn: &Conn, id: &str) -> CliResult {
    show(
        conn,
        |c| c.reattest(id),
        |n| println!("{} asked to re-attest at its next heartbeat", n.id),
    )
}

/// `cgx broker reference-values set FILE --replaces N`: at most 1 MiB, a JSON object (the
/// broker checks the rest), in place of version N.
pub fn reference_values_set(conn: &Conn, file: &Path, replaces: i64) -> CliResult {
    let bytes = crate::measure::read_limited(file, "reference values", 1 << 20)?;
    let doc: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", file.display()))?;
    show(
        conn,
        |c| c.set_reference_values(&doc, replaces),
        |v| println!("reference values in force: version {}", v["version"]),
    )
}

pub fn reference_values_show(conn: &Conn) -> CliResult {
    show(
        conn,
        |c| c.reference_values(),
        |v| {
            println!("version {}", v["version"]);
            println!(
                "{}",
                serde_json::to_string_pretty(&v["reference_values"]).unwrap_or_default()
            );
        },
    )
}

pub fn node_show(conn: &Conn, id: &str) -> CliResult {
    show(conn, |c| c.node(id), print_node)
}

fn print_node(n: &NodeView) {
    println!("node         {}", n.id);
    println!("operator     {}  region {}", n.operator, n.region);
    println!(
        "hardware     {} × {} ({}, {} GiB), TEE {}{}",
        n.gpu_count,
        n.gpu_model,
        n.gpu_chip,
        n.gpu_memory_gib,
        n.tee,
        if n.sim { " [SIMULATED]" } else { "" }
    );
    println!("free GPUs    {}", n.free_gpus);
    println!(
        "price        {} per GPU-hour; reputation {}",
        n.price_per_gpu_hour_micros, n.reputation
    );
    println!("appraisal    {}", n.status.as_str().to_uppercase());
    for v in &n.violations {
        println!("  {v}");
    }
    println!("attested     {}", time_of(n.attested_at));
    println!("fresh until  {}", time_of(n.fresh_until));
    println!("heartbeat    {}", time_of(n.last_heartbeat));
    if n.reattest_asked {
        println!("re-attest    asked (the next heartbeat answer says so)");
    }
    if n.placeable {
        println!("placeable    yes");
    } else {
        println!("placeable    NO: {}", n.reason);
    }
    for line in proof_lines(n) {
        println!("{line}");
    }
}

/// A node's latest proofs of work, a line each.
pub fn proof_lines(n: &NodeView) -> Vec<String> {
    n.proofs
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "{}{} lease {} GPU {} n={} {}{}{}",
                if i == 0 {
                    "proofs       "
                } else {
                    "             "
                },
                p.challenge,
                p.lease,
                p.gpu,
                p.n,
                p.state.to_uppercase(),
                p.gpu_us
                    .map(|us| format!(" ({:.1} ms on the device)", us as f64 / 1e3))
                    .unwrap_or_default(),
                if p.reason.is_empty() {
                    String::new()
                } else {
                    format!(": {}", p.reason)
                }
            )
        })
        .collect()
}

/// `--tee`: a TEE kind by its wire name.
fn parse_tee(text: &str) -> Result<TeeKind, String> {
    TeeKind::parse(text).ok_or_else(|| format!("{text:?} is not a TEE kind (snp, tdx)"))
}
