//! The one HTTP client set-up of cgx: every client — the KBS and broker clients (the guest, the
//! CLI, the dev network), the collateral fetcher, the system tests — builds its agent here, so
//! the TLS stack (rustls on aws-lc-rs, one crypto provider for the whole build), the trust
//! roots and the rules below are chosen in one place.
//!
//! What a caller states ([`Client`]): which roots it trusts, whether a proxy from the
//! environment may carry its requests, how long a request may take in all, and how many
//! redirects it follows. Error statuses come back as responses (their bodies carry CoCo and
//! RFC 9457 problem details, which the callers read).

use std::sync::Arc;
use std::time::Duration;

pub use ureq;

/// Why roots could not be read (no request has been made).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SetupError {
    /// The CA file named no certificate.
    #[error("no certificate in the CA file")]
    NoCaCertificate,
}

/// Whose certificates a server's chain must end in.
#[derive(Debug, Clone)]
pub enum Roots {
    /// The WebPKI roots (public services: AMD KDS, Intel PCS, NVIDIA).
    WebPki,
    /// The certificates of a CA file ([`Roots::from_pem`]).
    Certificates(Arc<Vec<ureq::tls::Certificate<'static>>>),
}

impl Roots {
    /// The certificates of a PEM file (a KBS or broker under its own CA). Other PEM items are
    /// ignored; a file with no certificate is refused, so a client never starts trusting
    /// nothing (or, worse, something else) by mistake.
    pub fn from_pem(pem: &[u8]) -> Result<Roots, SetupError> {
        let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(pem)
            .filter_map(|i| match i {
                Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                _ => None,
            })
            .collect();
        if certs.is_empty() {
            return Err(SetupError::NoCaCertificate);
        }
        Ok(Roots::Certificates(Arc::new(certs)))
    }
}

/// How an agent behaves. [`Client::service`] and [`Client::vendor`] are the two kinds cgx makes.
#[derive(Debug, Clone)]
pub struct Client {
    pub roots: Roots,
    /// Whether a proxy named in the environment (`HTTPS_PROXY`, …) may carry the requests.
    pub proxy_from_env: bool,
    /// The most one request may take, from connecting to the last byte of the body.
    pub timeout: Duration,
    /// Redirects followed (0: none; a 3xx is then returned as the response).
    pub max_redirects: u32,
    /// Services (host name or literal without brackets, port) connected to at a fixed address
    /// instead of resolved (a guest without a network reaches its services through the host
    /// channel's local forwarders). TLS still verifies the server's name, so a pin moves where
    /// bytes go, never whom they are for.
    pub pins: Vec<Pin>,
}

impl Client {
    /// A client of a cgx service (a KBS, a broker): reached directly — a proxy taken from the
    /// environment would see a plain-HTTP loopback KBS's cookie and lease tokens —, 30 s per
    /// request, no redirects (a service never sends one; following it would carry a lease
    /// token in a query, or the request's other headers, elsewhere).
    pub fn service(roots: Roots) -> Self {
        Client {
            roots,
            proxy_from_env: false,
            timeout: Duration::from_secs(30),
            max_redirects: 0,
            pins: Vec::new(),
        }
    }

    /// A fetcher of vendor collateral: the WebPKI roots, the environment's proxy (a provider's
    /// egress may require one; the answers are signed, so a proxy cannot forge them), two
    /// redirects (the vendors' CDNs use them), `timeout` per request.
    pub fn vendor(timeout: Duration) -> Self {
        Client {
            roots: Roots::WebPki,
            proxy_from_env: true,
            timeout,
            max_redirects: 2,
            pins: Vec::new(),
        }
    }

    /// The agent (building one cannot fail: the roots were read already).
    pub fn agent(&self) -> ureq::Agent {
        let roots = match &self.roots {
            Roots::WebPki => ureq::tls::RootCerts::WebPki,
            Roots::Certificates(certs) => ureq::tls::RootCerts::Specific(certs.clone()),
        };
        let tls = ureq::tls::TlsConfig::builder()
            .provider(ureq::tls::TlsProvider::Rustls)
            .root_certs(roots)
            .unversioned_rustls_crypto_provider(Arc::new(
                rustls::crypto::aws_lc_rs::default_provider(),
            ))
            .build();
        let mut config = ureq::Agent::config_builder()
            .timeout_global(Some(self.timeout))
            .http_status_as_error(false)
            .max_redirects(self.max_redirects)
            .tls_config(tls);
        if !self.proxy_from_env {
            config = config.proxy(None);
        }
        if self.pins.is_empty() {
            return ureq::Agent::new_with_config(config.build());
        }
        ureq::Agent::with_parts(
            config.build(),
            ureq::unversioned::transport::DefaultConnector::new(),
            Pinned {
                pins: self.pins.clone(),
                fallback: ureq::unversioned::resolver::DefaultResolver::default(),
            },
        )
    }
}

/// One pinned service: `host:port` is connected to at `addr`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin {
    pub host: String,
    pub port: u16,
    pub addr: std::net::SocketAddr,
}

impl Pin {
    /// The pin of `url`'s service (its port, or the scheme's) to `addr`.
    pub fn of_url(url: &str, addr: std::net::SocketAddr) -> Option<Pin> {
        let uri: ureq::http::Uri = url.parse().ok()?;
        Some(Pin {
            host: bare(uri.host()?).to_string(),
            port: port_of(&uri)?,
            addr,
        })
    }
}

fn bare(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

fn port_of(uri: &ureq::http::Uri) -> Option<u16> {
    uri.port_u16().or(match uri.scheme_str() {
        Some(s) if s.eq_ignore_ascii_case("https") => Some(443),
        Some(s) if s.eq_ignore_ascii_case("http") => Some(80),
        _ => None,
    })
}

/// A resolver that answers pinned services itself and asks the system for the others.
#[derive(Debug)]
struct Pinned {
    pins: Vec<Pin>,
    fallback: ureq::unversioned::resolver::DefaultResolver,
}

impl ureq::unversioned::resolver::Resolver for Pinned {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: ureq::unversioned::transport::NextTimeout,
    ) -> Result<ureq::unversioned::resolver::ResolvedSocketAddrs, ureq::Error> {
        let host = bare(uri.host().unwrap_or(""));
        let port = port_of(uri);
        match self
            .pins
            .iter()
            .find(|p| p.host.eq_ignore_ascii_case(host) && Some(p.port) == port)
        {
            Some(p) => {
                let mut v = self.empty();
                v.push(p.addr);
                Ok(v)
            }
            None => self.fallback.resolve(uri, config, timeout),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_ca_file_without_a_certificate_is_refused() {
        let key_only = b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
        for pem in [&b""[..], &b"not pem"[..], &key_only[..]] {
            assert_eq!(
                Roots::from_pem(pem).err(),
                Some(SetupError::NoCaCertificate)
            );
        }
    }

    /// A pinned service is connected to at its pin, by host and port (another port of the
    /// same name is not pinned), and TLS still checks the URL's name.
    #[test]
    fn pins_move_connections_by_host_and_port() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).unwrap();
            let req = String::from_utf8_lossy(&buf[..n]).to_string();
            s.write_all(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
                .unwrap();
            req
        });
        let mut c = Client::service(Roots::WebPki);
        c.pins = vec![
            Pin::of_url("http://broker.cgx.test:8080", addr).unwrap(),
            Pin::of_url("http://[::1]", addr).unwrap(),
        ];
        assert_eq!(c.pins[1].host, "::1");
        assert_eq!(c.pins[1].port, 80);
        let agent = c.agent();
        let r = agent.get("http://broker.cgx.test:8080/x").call().unwrap();
        assert_eq!(r.status().as_u16(), 204);
        let req = server.join().unwrap();
        assert!(
            req.contains("host: broker.cgx.test:8080")
                || req.contains("Host: broker.cgx.test:8080"),
            "{req}"
        );
        // Another port of the pinned name resolves as usual (and .test names do not).
        assert!(agent.get("http://broker.cgx.test:8081/x").call().is_err());
    }

    /// What the agent was told is what it does: a service client follows no redirect and
    /// returns an error status as a response (served on loopback by a one-shot listener).
    #[test]
    fn a_service_client_returns_statuses_and_follows_no_redirect() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            for answer in [
                "HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:1/elsewhere\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                "HTTP/1.1 401 Unauthorized\r\nContent-Length: 5\r\nConnection: close\r\n\r\nnope!",
            ] {
                let (mut s, _) = listener.accept().unwrap();
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).unwrap();
                s.write_all(answer.as_bytes()).unwrap();
            }
        });
        let agent = Client::service(Roots::WebPki).agent();
        let r = agent.get(&format!("http://{addr}/a")).call().unwrap();
        assert_eq!(r.status().as_u16(), 302, "the redirect was followed");
        let mut r = agent.get(&format!("http://{addr}/b")).call().unwrap();
        assert_eq!(r.status().as_u16(), 401);
        assert_eq!(r.body_mut().read_to_string().unwrap(), "nope!");
        server.join().unwrap();
    }
}
