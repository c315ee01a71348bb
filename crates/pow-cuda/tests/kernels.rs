//! The device code on the CPU: kernels.cu compiled by the host's C++ compiler with a shim that
//! runs each kernel's threads in a loop, checked byte for byte against the Rust CPU backend —
//! Philox generation against `cgx_pow::challenge`, the row leaves against `cgx_pow::cpu`. So what the GPU runs is tested on every machine with a C++
//! compiler, GPU or not (skipped, visibly, without one).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::process::{Command, Stdio};

use cgx_pow::challenge::{Matrix, matrix, seed};

const SHIM: &str = r#"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __constant__
struct Idx { unsigned int x, y, z; };
static Idx threadIdx, blockIdx, blockDim;
"#;

const DRIVER: &str = r#"
template <typename F> static void launch(unsigned long long items, F f) {
  blockDim.x = 256;
  for (unsigned long long i = 0; i < (items + 255) / 256 * 256; i++) {
    blockIdx.x = (unsigned int)(i / 256);
    threadIdx.x = (unsigned int)(i % 256);
    f();
  }
}
static std::vector<unsigned char> read_all() {
  std::vector<unsigned char> in;
  unsigned char buf[65536];
  size_t got;
  while ((got = fread(buf, 1, sizeof buf, stdin)) > 0) in.insert(in.end(), buf, buf + got);
  return in;
}
int main(int argc, char **argv) {
  if (argc < 3) return 2;
  unsigned int n = (unsigned int)strtoul(argv[2], 0, 10);
  if (!strcmp(argv[1], "philox")) {
    unsigned int k0 = strtoul(argv[3], 0, 10), k1 = strtoul(argv[4], 0, 10),
                 c2 = strtoul(argv[5], 0, 10), c3 = strtoul(argv[6], 0, 10);
    int transposed = atoi(argv[7]);
    unsigned long long blocks = (unsigned long long)n * n / 16;
    std::vector<signed char> out(n * n);
    launch(blocks, [&] { philox_fill(out.data(), blocks, n, transposed, k0, k1, c2, c3); });
    fwrite(out.data(), 1, out.size(), stdout);
  } else if (!strcmp(argv[1], "leaves")) {
    std::vector<unsigned char> in = read_all();
    std::vector<unsigned char> out(32 * n);
    launch(n, [&] { row_leaves((const int *)in.data(), n, out.data()); });
    fwrite(out.data(), 1, out.size(), stdout);
  }
  return 0;
}
"#;

fn compiler() -> Option<String> {
    ["g++", "clang++", "c++"]
        .into_iter()
        .map(String::from)
        .find(|c| {
            Command::new(c)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
}

fn run(exe: &std::path::Path, args: &[String], input: &[u8]) -> Vec<u8> {
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    assert!(out.status.success());
    out.stdout
}

#[test]
fn the_kernels_compute_the_cpu_backends_bytes() {
    let Some(cxx) = compiler() else {
        eprintln!("SKIPPED: no C++ compiler to run kernels.cu on the CPU");
        return;
    };
    let dir = std::env::temp_dir().join(format!("cgx-kernels-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("kernels.cpp");
    std::fs::write(&src, format!("{SHIM}\n{}\n{DRIVER}", cgx_pow_cuda::KERNELS)).unwrap();
    let exe = dir.join("kernels");
    let out = Command::new(&cxx)
        .args(["-O2", "-std=c++17", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for n in [16u32, 48, 256] {
        let s = seed(b"nonce", "lease", 3, b"node key", n);
        let w = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
        for m in [Matrix::A, Matrix::B] {
            for transposed in [false, true] {
                let args: Vec<String> = [
                    "philox".to_string(),
                    n.to_string(),
                    w(0).to_string(),
                    w(4).to_string(),
                    (w(8) ^ m as u32).to_string(),
                    w(12).to_string(),
                    u8::from(transposed).to_string(),
                ]
                .into();
                let got = run(&exe, &args, &[]);
                let full = matrix(&s, m, n);
                let nu = n as usize;
                let want: Vec<u8> = if transposed {
                    (0..nu * nu)
                        .map(|e| full[(e % nu) * nu + e / nu] as u8)
                        .collect()
                } else {
                    full.iter().map(|&x| x as u8).collect()
                };
                assert_eq!(got, want, "Philox n = {n}, {m:?}, transposed {transposed}");
            }
        }
        let (a, b) = (matrix(&s, Matrix::A, n), matrix(&s, Matrix::B, n));
        let mut c = cgx_pow::cpu::product(&a, &b, n as usize, 1);
        // The extremes of int32 too (the leaves must hash any row).
        c[0] = i32::MIN;
        c[1] = i32::MAX;
        c[2] = -1;
        let bytes: Vec<u8> = c.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got = run(&exe, &["leaves".into(), n.to_string()], &bytes);
        let want: Vec<u8> = cgx_pow::cpu::leaves(&c, n as usize, 1).concat();
        assert_eq!(got, want, "leaves n = {n}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
