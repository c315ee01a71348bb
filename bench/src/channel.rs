//! `cgx bench channel`: bytes per second through the host–guest channel (one stream, and four
//! at once, as a guest fetches encrypted weights or talks TLS through its host) against the
//! bound it chases — the same bytes copied over the same kind of link (a Unix socket pair, as
//! QEMU's chardev is on the host) without the channel, in the same run. The channel adds a
//! frame header per 16 KiB, a credit frame per consumed buffer, and two threads per stream.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cgx_channel::mux::{self, Handler, Mux};
use serde_json::json;

use crate::{CliResult, median};

/// A sink that counts and drops.
struct Count(std::sync::mpsc::Sender<Result<u64, String>>, u64);

impl cgx_channel::Sink for Count {
    fn write(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.1 += b.len() as u64;
        Ok(())
    }
    fn finish(&mut self, outcome: Result<(), String>) {
        let _ = self.0.send(outcome.map(|()| self.1));
    }
}

/// The raw link: `len` bytes written into one end of a socket pair and read out of the other.
fn raw(len: u64) -> Result<f64, String> {
    let (mut a, mut b) = UnixStream::pair().map_err(|e| e.to_string())?;
    let t = Instant::now();
    let w = std::thread::spawn(move || {
        let buf = vec![7u8; 64 * 1024];
        let mut left = len;
        while left > 0 {
            let n = left.min(buf.len() as u64) as usize;
            if a.write_all(&buf[..n]).is_err() {
                return;
            }
            left -= n as u64;
        }
    });
    let mut buf = vec![0u8; 64 * 1024];
    let mut got = 0u64;
    while got < len {
        match b.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n as u64,
        }
    }
    let _ = w.join();
    Ok(got as f64 / t.elapsed().as_secs_f64())
}

/// Through the channel: `streams` files of `len / streams` bytes fetched at once.
fn through(file: &std::path::Path, len: u64, streams: usize) -> Result<f64, String> {
    let (g, h) = UnixStream::pair().map_err(|e| e.to_string())?;
    let host = Mux::new(Box::new(h.try_clone().map_err(|e| e.to_string())?));
    let guest = Mux::new(Box::new(g.try_clone().map_err(|e| e.to_string())?));
    let path = file.to_path_buf();
    let handler: Handler = Arc::new(move |_: &str| mux::file_target(&path, u64::MAX));
    let hm = host.clone();
    std::thread::spawn(move || hm.run(h, Some(handler)));
    let gm = guest.clone();
    std::thread::spawn(move || gm.run(g, None));
    let t = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    for _ in 0..streams {
        guest
            .open("weights", None, Box::new(Count(tx.clone(), 0)))
            .map_err(|e| e.to_string())?;
    }
    let mut got = 0;
    for _ in 0..streams {
        got += rx
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| "a stream did not end".to_string())??;
    }
    let rate = got as f64 / t.elapsed().as_secs_f64();
    if got != len / streams as u64 * streams as u64 {
        return Err(format!("{got} bytes arrived of {len}"));
    }
    guest.close("done");
    host.close("done");
    Ok(rate)
}

pub fn bench(mib: u64, rounds: usize, json: bool) -> CliResult {
    let len = mib << 20;
    let dir = std::env::temp_dir().join(format!("cgx-bench-channel-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut results = serde_json::Map::new();
    let mut lines = Vec::new();
    for streams in [1usize, 4] {
        let file = dir.join(format!("weights-{streams}"));
        std::fs::write(&file, vec![0x5a; (len / streams as u64) as usize])
            .map_err(|e| e.to_string())?;
        let (mut r, mut c) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            r.push(raw(len)?);
            c.push(through(&file, len, streams)?);
        }
        let (r, c) = (median(r), median(c));
        lines.push(format!(
            "{streams} stream(s): {:.0} MB/s through the channel, raw socket pair {:.0} MB/s, ratio {:.2}",
            c / 1e6,
            r / 1e6,
            c / r
        ));
        results.insert(
            format!("streams_{streams}"),
            json!({"channel_bytes_per_s": c, "raw_bytes_per_s": r, "ratio": c / r}),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    if json {
        crate::print_json(&json!({ "mib": mib, "rounds": rounds, "results": results }))?;
    } else {
        println!("channel: {mib} MiB per round, median of {rounds} rounds");
        for l in lines {
            println!("  {l}");
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
