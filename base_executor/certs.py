"""`base-executor certs`: what a provider hands out for gRPC with mutual TLS — a CA, the server's
certificate (for the host names and addresses tenants dial), and per tenant a client
certificate whose common name is the tenant's name plus a random credential token.

Writes into OUT: ca.pem and ca.key (keep ca.key offline), server.pem and server.key, and per
tenant NAME.pem, NAME.key and NAME.token (give these three and ca.pem to that tenant); `tokens`
lists every tenant's `NAME TOKEN` for `serve --tls-dir OUT`. Keys are ECDSA P-256, written 0600.
Needs the `cryptography` package (`pip install symbiont[tls]`)."""
from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
import re
import secrets

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _write(path: pathlib.Path, data: bytes, secret: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _cert(subject: str, key, issuer_name, issuer_key, *, ca: bool, days: float, hosts=(), client: bool = False,
          not_before: datetime.datetime | None = None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    start = not_before or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                                          encipher_only=False, decipher_only=False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if hosts:
        alt = []
        for h in hosts:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                alt.append(x509.DNSName(h))
        b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
    cert = b.sign(issuer_key or key, hashes.SHA256())
    return cert, cert.public_bytes(serialization.Encoding.PEM)


def make_ca(out: pathlib.Path, days: float = 3650):
    """Writes ca.pem and ca.key into out; returns (certificate, key)."""
    key = _key()
    cert, pem = _cert("symbiont CA", key, None, None, ca=True, days=days)
    _write(out / "ca.pem", pem)
    _write(out / "ca.key", _pem_key(key), secret=True)
    return cert, key


def load_ca(out: pathlib.Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), password=None)
    return cert, key


def make_server(out: pathlib.Path, ca, hosts, days: float = 825) -> None:
    key = _key()
    _, pem = _cert(hosts[0], key, ca[0].subject, ca[1], ca=False, days=days, hosts=hosts)
    _write(out / "server.pem", pem)
    _write(out / "server.key", _pem_key(key), secret=True)


def make_tenant(out: pathlib.Path, ca, name: str, days: float = 365, not_before: datetime.datetime | None = None) -> str:
    """Writes NAME.pem, NAME.key and NAME.token and adds the tenant to `tokens`; returns the token."""
    if not _NAME.match(name):
        raise ValueError(f"tenant name {name!r}: 1-64 letters, digits, '_', '.', '-'")
    key = _key()
    _, pem = _cert(name, key, ca[0].subject, ca[1], ca=False, days=days, client=True, not_before=not_before)
    token = secrets.token_urlsafe(32)
    _write(out / f"{name}.pem", pem)
    _write(out / f"{name}.key", _pem_key(key), secret=True)
    _write(out / f"{name}.token", token.encode(), secret=True)
    tokens = out / "tokens"
    lines = [ln for ln in (tokens.read_text().splitlines() if tokens.exists() else []) if ln.split()[:1] != [name]]
    _write(tokens, ("\n".join([*lines, f"{name} {token}"]) + "\n").encode(), secret=True)
    return token


def main(out: str, hosts: list[str], tenants: list[str], days: float) -> int:
    d = pathlib.Path(out)
    d.mkdir(parents=True, exist_ok=True)
    ca = load_ca(d) if (d / "ca.pem").exists() and (d / "ca.key").exists() else make_ca(d)
    if hosts or not (d / "server.pem").exists():
        make_server(d, ca, hosts or ["localhost", "127.0.0.1"])
    for name in tenants:
        make_tenant(d, ca, name, days)
    print(f"wrote {d}: ca.pem, server.pem/.key, tokens; tenants: {', '.join(tenants) or 'none'}")
    print(f"serve:  base-executor serve --listen grpc://0.0.0.0:PORT --tls-dir {d}")
    print(f"tenant: connect('grpc://HOST:PORT', tls_dir='{d}', tenant='NAME')  (needs ca.pem, NAME.pem, NAME.key, NAME.token)")
    return 0
