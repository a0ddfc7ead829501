"""Throwaway certificates for mutual TLS (the TLS benchmark and tests), made with the
``cryptography`` package (an optional dependency, imported here only): elliptic-curve keys, a CA's
self-signed certificate, and leaves it signs (the runtime does not check host names)."""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    return builder.sign(issuer_key, hashes.SHA256())


def _write(folder, name: str, cert, key) -> tuple[str, str]:
    c, k = folder / f"{name}.crt", folder / f"{name}.key"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return str(c), str(k)


def make_pki(folder) -> dict:
    """Two CAs in ``folder``; stage and driver certificates (and keys) of the first, a stranger's of
    the second: ``{"ca": path, "other-ca": path, "stage": (cert, key), ...}``."""
    out = {}
    for ca_name in ("ca", "other-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
        out[ca_name] = _write(folder, ca_name, ca_cert, ca_key)[0]
        for leaf in (("stage", "driver") if ca_name == "ca" else ("stranger",)):
            key = ec.generate_private_key(ec.SECP256R1())
            out[leaf] = _write(folder, leaf, _cert(leaf, key, ca_name, ca_key, ca=False), key)
    return out
