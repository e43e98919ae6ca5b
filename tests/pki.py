"""Test certificates made with the ``openssl`` CLI: CAs and certificates they sign.

Shared by the etcd (tests/integration/test_etcd_auth.py) and RabbitMQ
(tests/integration/test_amqp_tls.py) TLS tests.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from partq.kernel.local import EtcdTLS

__all__ = ["issue", "make_ca"]


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA ``name.crt``/``name.key`` in ``directory``."""
    _openssl(
        directory, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-days", "2", "-subj", f"/CN=partq test {name}",
        "-keyout", f"{name}.key", "-out", f"{name}.crt",
    )  # fmt: skip
    return directory / f"{name}.crt", directory / f"{name}.key"


def issue(directory: Path, ca: str, name: str, cn: str, san: str) -> tuple[Path, Path]:
    """A certificate ``name.crt``/``name.key`` signed by the CA ``ca`` (a name from
    :func:`make_ca`), with subject ``CN=cn`` and subjectAltName ``san``, for server and
    client auth."""
    _openssl(
        directory, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-subj", f"/CN={cn}", "-keyout", f"{name}.key", "-out", f"{name}.csr",
    )  # fmt: skip
    (directory / f"{name}.ext").write_text(
        f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        directory, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey",
        f"{ca}.key", "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
        "-out", f"{name}.crt",
    )  # fmt: skip
    return directory / f"{name}.crt", directory / f"{name}.key"


def loopback_server_tls(directory: Path) -> EtcdTLS:
    """A CA ``ca`` in ``directory`` and a server certificate it signed for 127.0.0.1 and
    localhost: what a private TLS etcd needs."""
    ca, _ = make_ca(directory, "ca")
    cert, key = issue(directory, "ca", "server", "localhost", "IP:127.0.0.1,DNS:localhost")
    return EtcdTLS(cert, key, ca)
