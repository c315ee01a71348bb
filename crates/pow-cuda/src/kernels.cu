// The proof-of-work's device code, compiled at run time by NVRTC. Every function computes the
// bytes the CPU backend computes (cgx_pow::challenge, cgx_pow::cpu, cgx_pow::proof): the
// suite compiles this file with the host's C++ compiler too (tests/kernels.rs) and checks it
// against the Rust code, so a GPU-less machine still tests what the GPU runs.

// Philox4x32-10 (Random123): block b of matrix m is philox(counter (b lo, b hi, c2, c3),
// key (k0, k1)), its four words little-endian: elements 16b … 16b + 15 of the n × n matrix,
// row-major. One thread per 16-byte block. With `transposed`, element (i, j) is written at
// j·n + i instead (the matrix's transpose, row-major).
extern "C" __global__ void philox_fill(signed char *out, unsigned long long blocks,
                                       unsigned int n, int transposed, unsigned int k0,
                                       unsigned int k1, unsigned int c2, unsigned int c3) {
  unsigned long long b = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= blocks) return;
  unsigned int c0 = (unsigned int)b, c1 = (unsigned int)(b >> 32);
  unsigned int key0 = k0, key1 = k1;
  for (int r = 0; r < 10; r++) {
    if (r > 0) {
      key0 += 0x9E3779B9u;
      key1 += 0xBB67AE85u;
    }
    unsigned long long p0 = (unsigned long long)0xD2511F53u * c0;
    unsigned long long p1 = (unsigned long long)0xCD9E8D57u * c2;
    unsigned int n0 = (unsigned int)(p1 >> 32) ^ c1 ^ key0;
    unsigned int n1 = (unsigned int)p1;
    unsigned int n2 = (unsigned int)(p0 >> 32) ^ c3 ^ key1;
    unsigned int n3 = (unsigned int)p0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
  }
  unsigned int w[4] = {c0, c1, c2, c3};
  unsigned long long row = (b * 16) / n, col = (b * 16) % n;
  for (int i = 0; i < 16; i++) {
    signed char v = (signed char)((w[i / 4] >> (8 * (i % 4))) & 0xff);
    if (transposed)
      out[(col + i) * n + row] = v;
    else
      out[b * 16 + i] = v;
  }
}

__device__ __forceinline__ unsigned int rotr(unsigned int x, int n) {
  return (x >> n) | (x << (32 - n));
}

__constant__ unsigned int K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

__device__ void sha256_block(unsigned int *h, const unsigned int *m) {
  unsigned int w[64];
  for (int i = 0; i < 16; i++) w[i] = m[i];
  for (int i = 16; i < 64; i++) {
    unsigned int s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    unsigned int s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  unsigned int a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
  for (int i = 0; i < 64; i++) {
    unsigned int S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
    unsigned int ch = (e & f) ^ (~e & g);
    unsigned int t1 = hh + S1 + ch + K256[i] + w[i];
    unsigned int S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
    unsigned int mj = (a & b) ^ (a & c) ^ (b & c);
    unsigned int t2 = S0 + mj;
    hh = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h[0] += a;
  h[1] += b;
  h[2] += c;
  h[3] += d;
  h[4] += e;
  h[5] += f;
  h[6] += g;
  h[7] += hh;
}

// The RFC 6962 leaf hash of each row: SHA-256(0x00 ‖ the row's int32 values little-endian).
// One thread per row. n is a multiple of 16, so the message (4n + 1 bytes) ends in the block
// after the row's last full one: message word j (big-endian) is the high byte of value j − 1
// then the low three bytes of value j; word n is value n − 1's high byte then 0x80.
extern "C" __global__ void row_leaves(const int *c, unsigned int n, unsigned char *leaves) {
  unsigned int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= n) return;
  const unsigned int *v = (const unsigned int *)(c + (unsigned long long)row * n);
  unsigned int h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                       0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  unsigned int words = n + 1;  // data words, the last one holding 0x80
  unsigned int blocks = (4 * n) / 64 + 1;
  unsigned int m[16];
  for (unsigned int blk = 0; blk < blocks; blk++) {
    for (int i = 0; i < 16; i++) {
      unsigned int j = blk * 16 + i;
      unsigned int word = 0;
      if (j < words) {
        unsigned int prev = j == 0 ? 0 : (v[j - 1] >> 24);
        if (j < n) {
          unsigned int u = v[j];
          word = (prev << 24) | ((u & 0xff) << 16) | (((u >> 8) & 0xff) << 8) | ((u >> 16) & 0xff);
        } else {
          word = (prev << 24) | 0x800000u;
        }
      }
      m[i] = word;
    }
    if (blk + 1 == blocks) {
      unsigned long long bits = 8ull * (4ull * n + 1ull);
      m[14] = (unsigned int)(bits >> 32);
      m[15] = (unsigned int)bits;
    }
    sha256_block(h, m);
  }
  for (int i = 0; i < 8; i++)
    for (int b = 0; b < 4; b++) leaves[(unsigned long long)row * 32 + i * 4 + b] = (unsigned char)(h[i] >> (24 - 8 * b));
}
