#!/usr/bin/env bash
# The cgx guest image from Debian's packages: Debian's cloud kernel (and the modules the agent
# needs from the same package) and the guest agent, built statically, in an initrd whose bytes
# depend only on these inputs (`cgx image build`).
#
#   image/build.sh OUT [--sim] -- AGENT-ARGUMENTS…
#
# OUT receives vmlinuz, initrd.img, cmdline and image.json; `cgx measure snp|tdx` (or
# `cgx measure launch host.toml`) over them gives the reference values. --sim builds the agent
# with the simulator (a VM without a TEE: tests); a production image is built without it.
# The kernel package is the one `linux-image-cloud-amd64` depends on in this machine's apt
# sources; set CGX_KERNEL_DEB to a .deb to pin one. Two runs with the same inputs give the same
# bytes (the agent is built with its paths remapped, so the checkout's place does not matter).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: image/build.sh OUT [--sim] -- AGENT-ARGUMENTS…}"
shift
features=(--no-default-features)
if [ "${1:-}" = "--sim" ]; then
  features=(--features sim)
  shift
fi
[ "${1:-}" = "--" ] && shift
cache="${XDG_CACHE_HOME:-$HOME/.cache}/cgx/kernel"
mkdir -p "$cache"
root="$cache/root"
if [ -n "${CGX_KERNEL_DEB:-}" ] || [ ! -d "$root/lib/modules" ]; then
  deb="${CGX_KERNEL_DEB:-}"
  if [ -z "$deb" ]; then
    pkg="$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image/ {print $2; exit}')"
    (cd "$cache" && rm -f ./*.deb && apt-get download -q "$pkg" >/dev/null)
    deb="$(ls "$cache"/linux-image-*.deb | head -1)"
  fi
  rm -rf "$root" && mkdir -p "$root"
  dpkg-deb -x "$deb" "$root"
fi
kernel="$(ls "$root"/boot/vmlinuz-* | head -1)"
modules="$(ls -d "$root"/lib/modules/* | head -1)"
echo "kernel: $kernel" >&2
target=x86_64-unknown-linux-gnu
tdir="${CARGO_TARGET_DIR:-target}"
RUSTFLAGS="-C target-feature=+crt-static --remap-path-prefix=$PWD=/cgx --remap-path-prefix=${CARGO_HOME:-$HOME/.cargo}=/cargo" \
  cargo build -q --release -p cgx-guest-agent "${features[@]}" --target "$target"
mkdir -p "$out"
# Line tables stay out of the image (strip is deterministic: the same binary, the same bytes).
strip -o "$out/cgx-guest-agent" "$tdir/$target/release/cgx-guest-agent"
# CGX: a built `cgx` to use instead of building one here.
${CGX:-cargo run -q -p cgx-cli --} image build --kernel "$kernel" --modules "$modules" \
  --agent "$out/cgx-guest-agent" --out "$out" -- "$@"
