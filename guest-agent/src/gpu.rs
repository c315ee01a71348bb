//! GPUs from inside the VM, through NVIDIA's driver library (NVML, loaded at run time by
//! `nvml-wrapper`: a machine without `libnvidia-ml.so` runs, and says so): what each GPU is
//! (model and memory for the registration's offer, never flags), its confidential-computing
//! attestation report — the SPDM GET_MEASUREMENTS request ‖ response, signed by the GPU over the
//! 32-byte nonce the binding prescribes — and its device certificate chain.
//!
//! [`GpuDriver`] is the library boundary, one method per NVML call the guest makes: the
//! production [`Nvml`] and, in tests only, a double that returns real recorded evidence
//! (`../shared/vectors/nvidia`). Everything above it ([`Gpus`]) is the path the binary takes.

/// Why the driver gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No NVIDIA driver library on this machine, or the driver is not running.
    #[error("NVIDIA's driver library could not be used ({0}): no GPUs on this machine")]
    NoDriver(String),
    /// The call failed for GPU `index`.
    #[error("GPU {index}: {call}: {detail}")]
    Call {
        index: u32,
        call: &'static str,
        detail: String,
    },
}

/// The NVML calls the guest makes (the boundary a test double stands at).
pub trait GpuDriver: Send + Sync {
    fn count(&self) -> Result<u32, GpuError>;
    /// The product name, e.g. `NVIDIA H100 80GB HBM3`.
    fn name(&self, index: u32) -> Result<String, GpuError>;
    /// Total framebuffer memory, bytes.
    fn memory_bytes(&self, index: u32) -> Result<u64, GpuError>;
    /// The confidential-computing attestation report over `nonce`.
    fn attestation_report(&self, index: u32, nonce: [u8; 32]) -> Result<Vec<u8>, GpuError>;
    /// The attestation certificate chain, as the driver gives it (PEM, or DER certificates
    /// one after another).
    fn certificate_chain(&self, index: u32) -> Result<Vec<u8>, GpuError>;
    /// Usage and health now (NVML): utilization, memory, temperature, power, the volatile ECC
    /// totals (corrected, uncorrected) and the throttle reasons. `index` in the result is the
    /// device's; the meter renumbers and takes ECC deltas.
    fn usage(&self, index: u32) -> Result<cgx_protocol::metering::GpuUsage, GpuError>;
}

/// The production driver: `libnvidia-ml.so`, loaded at run time.
pub struct Nvml {
    nvml: nvml_wrapper::Nvml,
}

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nvml")
    }
}

impl Nvml {
    /// Load and initialise NVML.
    pub fn load() -> Result<Nvml, GpuError> {
        nvml_wrapper::Nvml::init()
            .map(|nvml| Nvml { nvml })
            .map_err(|e| GpuError::NoDriver(e.to_string()))
    }

    fn call<T>(
        &self,
        index: u32,
        call: &'static str,
        f: impl FnOnce(&nvml_wrapper::Device<'_>) -> Result<T, nvml_wrapper::error::NvmlError>,
    ) -> Result<T, GpuError> {
        let err = |detail: String| GpuError::Call {
            index,
            call,
            detail,
        };
        let device = self
            .nvml
            .device_by_index(index)
            .map_err(|e| err(e.to_string()))?;
        // nvml-wrapper slices the report and chain buffers by the sizes the driver returns,
        // unchecked: a driver that reports more than the buffer holds would panic there. The
        // call is contained, and such an answer is an error like any other.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&device)))
            .map_err(|_| err("the driver reported a size past its buffer".into()))?
            .map_err(|e| err(e.to_string()))
    }
}

impl GpuDriver for Nvml {
    fn count(&self) -> Result<u32, GpuError> {
        self.nvml.device_count().map_err(|e| GpuError::Call {
            index: 0,
            call: "device count",
            detail: e.to_string(),
        })
    }

    fn name(&self, index: u32) -> Result<String, GpuError> {
        self.call(index, "name", |d| d.name())
    }

    fn memory_bytes(&self, index: u32) -> Result<u64, GpuError> {
        self.call(index, "memory", |d| d.memory_info().map(|m| m.total))
    }

    fn attestation_report(&self, index: u32, nonce: [u8; 32]) -> Result<Vec<u8>, GpuError> {
        self.call(index, "attestation report", |d| {
            d.confidential_compute_gpu_attestation_report(nonce)
                .map(|r| r.attestation_report)
        })
    }

    fn certificate_chain(&self, index: u32) -> Result<Vec<u8>, GpuError> {
        self.call(index, "certificate chain", |d| {
            d.confidential_compute_gpu_certificate()
                .map(|c| c.attestation_cert_chain)
        })
    }

    fn usage(&self, index: u32) -> Result<cgx_protocol::metering::GpuUsage, GpuError> {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
        self.call(index, "usage", |d| {
            Ok(cgx_protocol::metering::GpuUsage {
                index,
                utilization_pct: u8::try_from(d.utilization_rates()?.gpu.min(100)).unwrap_or(100),
                memory_used_mib: d.memory_info()?.used >> 20,
                temperature_c: i16::try_from(d.temperature(TemperatureSensor::Gpu)?)
                    .unwrap_or(i16::MAX),
                power_mw: d.power_usage()?,
                ecc_corrected: d
                    .total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
                    .unwrap_or(0),
                ecc_uncorrected: d
                    .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
                    .unwrap_or(0),
                throttle_reasons: d.current_throttle_reasons()?.bits(),
            })
        })
    }
}

/// The most GPUs a node reports (the broker takes at most this many reports).
pub const MAX_GPUS: u32 = 64;

/// The GPUs behind a driver.
pub struct Gpus {
    driver: Box<dyn GpuDriver>,
}

impl std::fmt::Debug for Gpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gpus")
    }
}

impl Gpus {
    pub fn new(driver: Box<dyn GpuDriver>) -> Gpus {
        Gpus { driver }
    }

    /// How many GPUs the driver reports (at most [`MAX_GPUS`]).
    pub fn count(&self) -> Result<u32, GpuError> {
        let n = self.driver.count()?;
        if n > MAX_GPUS {
            return Err(GpuError::Call {
                index: n,
                call: "device count",
                detail: format!("more than {MAX_GPUS} GPUs"),
            });
        }
        Ok(n)
    }

    /// Each GPU's model and memory, in index order.
    pub fn inventory(&self) -> Result<Vec<crate::machine::GpuInfo>, GpuError> {
        (0..self.count()?)
            .map(|i| {
                let name = self.driver.name(i)?;
                let model = model_of(&name).ok_or_else(|| GpuError::Call {
                    index: i,
                    call: "name",
                    detail: format!("'{name}' names no model this marketplace knows"),
                })?;
                let bytes = self.driver.memory_bytes(i)?;
                Ok(crate::machine::GpuInfo {
                    model,
                    // Rounded to the nearest GiB: an "80 GB" H100 reports 79.6 GiB.
                    memory_gib: u32::try_from(bytes.saturating_add(1 << 29) >> 30)
                        .unwrap_or(u32::MAX),
                })
            })
            .collect()
    }

    /// GPU `index`'s usage and health now.
    pub fn usage(&self, index: u32) -> Result<cgx_protocol::metering::GpuUsage, GpuError> {
        self.driver.usage(index)
    }

    /// GPU `index`'s report over `nonce` and its chain as PEM.
    pub fn evidence(&self, index: u32, nonce: [u8; 32]) -> Result<(Vec<u8>, Vec<u8>), GpuError> {
        let report = self.driver.attestation_report(index, nonce)?;
        let chain = self.driver.certificate_chain(index)?;
        let pem = chain_pem(&chain).ok_or_else(|| GpuError::Call {
            index,
            call: "certificate chain",
            detail: "neither PEM nor DER certificates".into(),
        })?;
        Ok((report, pem))
    }
}

/// The model in an NVML product name: the first word of capitals then digits after `NVIDIA`
/// (`NVIDIA H100 80GB HBM3` → `H100`, `NVIDIA GH200 480GB` → `GH200`).
pub fn model_of(name: &str) -> Option<String> {
    name.split_whitespace()
        .filter(|w| *w != "NVIDIA")
        .find(|w| {
            let letters = w.bytes().take_while(u8::is_ascii_uppercase).count();
            letters > 0 && letters < w.len() && w.bytes().skip(letters).all(|b| b.is_ascii_digit())
        })
        .map(str::to_string)
}

/// A chain as PEM: PEM passes through (trailing NULs the driver pads with cut); DER
/// certificates one after another become PEM blocks. `None`: neither.
pub fn chain_pem(chain: &[u8]) -> Option<Vec<u8>> {
    if chain.starts_with(b"-----BEGIN") {
        let end = chain.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
        return Some(chain[..end].to_vec());
    }
    let mut out = String::new();
    let mut rest = chain;
    // DER certificates until only the buffer's zero padding is left (a certificate may itself
    // end in a zero byte, so the padding is not cut first).
    while rest.iter().any(|&b| b != 0) {
        let len = der_len(rest)?;
        let (cert, tail) = rest.split_at(len);
        out.push_str(&crate::evidence::pem_certificate(cert));
        rest = tail;
    }
    (!out.is_empty()).then(|| out.into_bytes())
}

/// The length of the DER SEQUENCE at the start of `b` (tag and length included).
fn der_len(b: &[u8]) -> Option<usize> {
    if b.first() != Some(&0x30) {
        return None;
    }
    let first = *b.get(1)?;
    let (len, head) = if first < 0x80 {
        (usize::from(first), 2)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for i in 0..n {
            len = (len << 8) | usize::from(*b.get(2 + i)?);
        }
        (len, 2 + n)
    };
    let total = head.checked_add(len)?;
    (total <= b.len()).then_some(total)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn models_from_nvml_names() {
        for (name, model) in [
            ("NVIDIA H100 80GB HBM3", Some("H100")),
            ("NVIDIA H100 PCIe", Some("H100")),
            ("NVIDIA H200", Some("H200")),
            ("NVIDIA H100 NVL", Some("H100")),
            ("NVIDIA GH200 480GB", Some("GH200")),
            ("NVIDIA B200", Some("B200")),
            ("NVIDIA", None),
            ("", None),
            ("Tesla", None),
        ] {
            assert_eq!(model_of(name).as_deref(), model, "{name}");
        }
    }

    #[test]
    fn chains_become_pem() {
        let pem = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n\0\0\0";
        assert_eq!(chain_pem(pem).unwrap(), &pem[..pem.len() - 3]);
        // Two DER "certificates" (SEQUENCEs, short and long form lengths).
        let mut der = vec![0x30, 0x03, 1, 2, 0];
        der.extend([0x30, 0x81, 0x80]);
        der.extend([7u8; 0x7f]);
        der.extend([0u8; 1 + 16]);
        let out = String::from_utf8(chain_pem(&der).unwrap()).unwrap();
        assert_eq!(out.matches("BEGIN CERTIFICATE").count(), 2);
        for bad in [
            &b""[..],
            b"\0\0",
            b"\x30\x05\x01",
            b"\x31\x01\x00",
            b"\x30\x85\0\0\0\0\0",
        ] {
            assert!(chain_pem(bad).is_none(), "{bad:?}");
        }
    }

    /// On this machine (no NVIDIA driver, or one without GPUs in CC mode) loading says so
    /// plainly, or answers; it never panics.
    #[test]
    fn loading_nvml_answers_or_says_why_not() {
        match Nvml::load() {
            Err(e) => assert!(e.to_string().contains("no GPUs on this machine"), "{e}"),
            Ok(n) => {
                let _ = Gpus::new(Box::new(n)).inventory();
            }
        }
    }
}
