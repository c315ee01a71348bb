#!/usr/bin/env python3
"""An RCAR client written apart from both servers, for `cgx bench coco --client python`.

It speaks the Confidential Containers KBS protocol (KBS protocol 0.4.0) from the published
description, not from cgx's or Trustee's code: one full flow is a new TCP connection carrying

  POST /kbs/v0/auth      {"version": "0.4.0", "tee": "sample", "extra-params": {}}
  POST /kbs/v0/attest    runtime data {nonce, tee-pubkey} and sample evidence whose report_data
                         is SHA-384 of the JCS text of {"additional-evidence", "nonce",
                         "tee-pubkey"} (RFC 8785; every value here is a string or an object of
                         strings, so sorting keys and dropping whitespace is the canonical form),
                         the 48 bytes themselves, as CoCo's sample attester sends them
  GET  /kbs/v0/resource/{path}  with the token the attest answer carries as a bearer

and the resource's JWE (ECDH-ES+A256KW on P-256, A256GCM; RFC 7516/7518) is opened with the
flow's own fresh key and compared with the expected value. A flow that does not release exactly
that value fails the run.

Usage: rcar.py URL RESOURCE_PATH EXPECTED_HEX FLOWS
Prints one JSON line: {"flows": N}. Needs the `cryptography` package.
"""

import base64
import hashlib
import http.client
import json
import sys
import urllib.parse

from cryptography.hazmat.primitives import hashes, keywrap
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64u(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def jcs(value) -> str:
    # Strings and objects only (see the module's doc): sorted keys, no whitespace.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def concat_kdf(z: bytes, alg: str) -> bytes:
    """RFC 7518 §4.6.2: one SHA-256 round, 256-bit key, empty PartyUInfo/PartyVInfo."""
    alg_b = alg.encode()
    other = (
        len(alg_b).to_bytes(4, "big") + alg_b
        + (0).to_bytes(4, "big") + (0).to_bytes(4, "big")
        + (256).to_bytes(4, "big")
    )
    return hashlib.sha256((1).to_bytes(4, "big") + z + other).digest()


class Refused(Exception):
    pass


def request(conn, method, path, body=None, headers=None):
    headers = dict(headers or {})
    if body is not None:
        body = json.dumps(body).encode()
        headers["content-type"] = "application/json"
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise Refused(f"{method} {path}: HTTP {resp.status}: {data[:300]!r}")
    return resp, data


def flow(url, resource, expected):
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http":
        raise SystemExit("rcar.py speaks plain HTTP only (the bench's loopback servers)")
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
    try:
        resp, data = request(
            conn, "POST", "/kbs/v0/auth",
            {"version": "0.4.0", "tee": "sample", "extra-params": {}},
        )
        cookie = resp.getheader("set-cookie", "").split(";", 1)[0]
        if not cookie:
            raise Refused("auth: no session cookie")
        nonce = json.loads(data)["nonce"]

        key = ec.generate_private_key(ec.SECP256R1())
        pub = key.public_key().public_numbers()
        tee_pubkey = {
            "kty": "EC", "crv": "P-256", "alg": "ECDH-ES+A256KW",
            "x": b64u(pub.x.to_bytes(32, "big")), "y": b64u(pub.y.to_bytes(32, "big")),
        }
        digest = hashlib.sha384(jcs({
            "additional-evidence": "", "nonce": nonce, "tee-pubkey": tee_pubkey,
        }).encode()).digest()
        evidence = {
            "svn": "1",
            "report_data": base64.b64encode(digest).decode(),
        }
        _, data = request(
            conn, "POST", "/kbs/v0/attest",
            {
                "init-data": None,
                "runtime-data": {"nonce": nonce, "tee-pubkey": tee_pubkey},
                "tee-evidence": {"primary_evidence": evidence, "additional_evidence": ""},
            },
            {"cookie": cookie},
        )
        token = json.loads(data)["token"]

        _, data = request(
            conn, "GET", f"/kbs/v0/resource/{resource}",
            headers={"authorization": f"Bearer {token}", "cookie": cookie},
        )
        jwe = json.loads(data)
        header = json.loads(unb64u(jwe["protected"]))
        if header.get("alg") != "ECDH-ES+A256KW" or header.get("enc") != "A256GCM":
            raise Refused(f"resource: unexpected JWE header {header}")
        epk = header["epk"]
        peer = ec.EllipticCurvePublicNumbers(
            int.from_bytes(unb64u(epk["x"]), "big"),
            int.from_bytes(unb64u(epk["y"]), "big"),
            ec.SECP256R1(),
        ).public_key()
        kek = concat_kdf(key.exchange(ec.ECDH(), peer), "ECDH-ES+A256KW")
        cek = keywrap.aes_key_unwrap(kek, unb64u(jwe["encrypted_key"]))
        plain = AESGCM(cek).decrypt(
            unb64u(jwe["iv"]),
            unb64u(jwe["ciphertext"]) + unb64u(jwe["tag"]),
            jwe["protected"].encode(),
        )
        if plain != expected:
            raise Refused("resource: released another value")
    finally:
        conn.close()


def main(argv):
    if len(argv) != 5:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    url, resource, expected, flows = argv[1], argv[2], bytes.fromhex(argv[3]), int(argv[4])
    for _ in range(flows):
        try:
            flow(url, resource, expected)
        except (Refused, OSError, KeyError, ValueError) as e:
            print(f"rcar.py: {url}: {e}", file=sys.stderr)
            return 1
    print(json.dumps({"flows": flows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
