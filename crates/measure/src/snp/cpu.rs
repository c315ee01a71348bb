//! vCPU signatures: CPUID Fn0000_0001_EAX (family, model, stepping) as AMD's CPUID
//! Specification (publication #25481, "CPUID Fn0000_0001_EAX Family, Model, Stepping
//! Identifiers") encodes them, and the EPYC types QEMU defines (`target/i386/cpu.c`,
//! `builtin_x86_defs`).

/// The 32-bit signature: extended family in bits 27:20, extended model 19:16, base family 11:8
/// (0xF once the family exceeds 15), base model 7:4, stepping 3:0.
pub fn cpu_signature(family: u32, model: u32, stepping: u32) -> u32 {
    let (family_low, family_high) = if family > 0xf {
        (0xf, (family - 0xf) & 0xff)
    } else {
        (family, 0)
    };
    (family_high << 20)
        | (((model >> 4) & 0xf) << 16)
        | (family_low << 8)
        | ((model & 0xf) << 4)
        | (stepping & 0xf)
}

/// QEMU's EPYC CPU models: (name, family, model, stepping).
pub const CPU_TYPES: &[(&str, u32, u32, u32)] = &[
    ("EPYC", 23, 1, 2),
    ("EPYC-v1", 23, 1, 2),
    ("EPYC-v2", 23, 1, 2),
    ("EPYC-IBPB", 23, 1, 2),
    ("EPYC-v3", 23, 1, 2),
    ("EPYC-v4", 23, 1, 2),
    ("EPYC-Rome", 23, 49, 0),
    ("EPYC-Rome-v1", 23, 49, 0),
    ("EPYC-Rome-v2", 23, 49, 0),
    ("EPYC-Rome-v3", 23, 49, 0),
    ("EPYC-Milan", 25, 1, 1),
    ("EPYC-Milan-v1", 25, 1, 1),
    ("EPYC-Milan-v2", 25, 1, 1),
    ("EPYC-Genoa", 25, 17, 0),
    ("EPYC-Genoa-v1", 25, 17, 0),
    ("EPYC-Turin", 26, 0, 0),
];

/// The signature of a QEMU CPU model, by name.
pub fn cpu_type(name: &str) -> Option<u32> {
    CPU_TYPES
        .iter()
        .find(|(n, ..)| *n == name)
        .map(|(_, f, m, s)| cpu_signature(*f, *m, *s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures() {
        // Milan (family 19h, model 01h, stepping 1): 0x00A00F11.
        assert_eq!(cpu_type("EPYC-Milan"), Some(0x00A0_0F11));
        // Naples/EPYC (17h, 01h, 2): 0x00800F12.
        assert_eq!(cpu_type("EPYC-v4"), Some(0x0080_0F12));
        // Genoa (19h, 11h, 0): 0x00A10F10.
        assert_eq!(cpu_type("EPYC-Genoa"), Some(0x00A1_0F10));
        assert_eq!(cpu_type("Skylake"), None);
        assert_eq!(cpu_signature(6, 0x55, 4), 0x0005_0654);
    }
}
