"""TLS on the public and admin ports and mutual TLS on router <-> worker channels."""
import datetime
import ipaddress
import json

import grpc
import pytest

from protos.specpool.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc
from settings.schema import ConfigError, config_from_dict
from tests.conftest import service_config


def make_certs(directory, with_ip: bool = True):
    """A CA and one certificate for 127.0.0.1/localhost (`with_ip` False: localhost only), usable as server and as
    client."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("specpool test CA")).issuer_name(name("specpool test CA"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(2).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")] + (
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))] if with_ip else [])), False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           False)
            .sign(ca_key, hashes.SHA256()))
    paths = {"ca": directory / "ca.pem", "cert": directory / "cert.pem", "key": directory / "key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def service(start_service, byte_pair, certs):
    config = service_config(byte_pair, speculation={"hand_off": True, "overlap": False}, http={"port": 0})
    config["tls"] = {**certs, "client_auth": True, "internal": True}
    return start_service(config)


def tls_channel(service, certs, with_client_cert=True, address=None):
    read = lambda key: open(certs[key], "rb").read()  # noqa: E731
    credentials = grpc.ssl_channel_credentials(read("ca"), read("key") if with_client_cert else None,
                                               read("cert") if with_client_cert else None)
    return grpc.secure_channel(address or service.address, credentials)


REQUEST = generation_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_new_tokens=8)


def test_mutual_tls_end_to_end(service, certs, reference_generate):
    with tls_channel(service, certs) as channel:
        response = generation_pb2_grpc.GenerationStub(channel).Generate(REQUEST, timeout=60)
    assert list(response.token_ids) == reference_generate([1, 2, 3], 8)   # through TLS workers too
    # speculation.hand_off: the draft worker reaches the target over mutual TLS too (its drafts, not the router's
    # copy, were verified; the first may lose to the copy while the draft's connection to the target opens)
    assert response.stats.handed_off_rounds > 0


@pytest.mark.parametrize("client", ["plaintext", "no client certificate"])
def test_clients_without_credentials_are_refused(service, certs, client):
    channel = grpc.insecure_channel(service.address) if client == "plaintext" else \
        tls_channel(service, certs, with_client_cert=False)
    with channel, pytest.raises(grpc.RpcError) as info:
        generation_pb2_grpc.GenerationStub(channel).Generate(REQUEST, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("client", ["mutual TLS", "plaintext", "no client certificate"])
def test_the_admin_port_speaks_what_the_public_port_speaks(service, certs, client):
    """Admin's own port (router.admin_port) takes the public port's TLS: only a client certificate reaches it."""
    address = service.admin_address
    channel = (grpc.insecure_channel(address) if client == "plaintext" else
               tls_channel(service, certs, with_client_cert=client == "mutual TLS", address=address))
    with channel:
        call = admin_pb2_grpc.AdminStub(channel).GetStatus
        if client == "mutual TLS":
            assert "target" in json.loads(call(admin_pb2.GetStatusRequest(), timeout=30).stats_json)["workers"]
            return
        with pytest.raises(grpc.RpcError) as info:
            call(admin_pb2.GetStatusRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_admin_commands_over_tls_and_what_a_failed_handshake_says(service, certs, capsys):
    """`specpool status` reaches the TLS admin port with the client flags, --tls-server-name included; a plaintext
    client, or a server name the certificate lacks, fails with a hint about TLS (it blamed the server for not
    running: gRPC says 'failed to connect' for both)."""
    from router.cli import main
    tls = ["--tls-ca", certs["ca"], "--tls-cert", certs["cert"], "--tls-key", certs["key"]]
    address = ["--address", service.admin_address]
    assert main(["status", *address, *tls]) == 0
    assert main(["status", *address, *tls, "--tls-server-name", "localhost"]) == 0
    capsys.readouterr()
    for client in ([], [*tls, "--tls-server-name", "elsewhere.example"]):   # plaintext; a name not in the cert
        assert main(["status", *address, *client]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: UNAVAILABLE: ") and f"(the TLS handshake with {service.admin_address} " \
            "failed: where the server's tls.cert is set give --tls-ca" in err, err
    import os
    import subprocess
    import sys
    env = {key: value for key, value in os.environ.items() if key != "GRPC_VERBOSITY"}   # as a user's shell has it
    done = subprocess.run([sys.executable, "-m", "router.cli", "generate", "--address", service.address, *tls,
                           "--tls-server-name", "elsewhere.example", "--max-new-tokens", "2", "x"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: UNAVAILABLE: ") and "(the TLS handshake with" in done.stderr


def test_tls_config_errors_name_the_key(certs):
    with pytest.raises(ConfigError, match=r"tls\.key:"):
        config_from_dict({"tls": {"cert": certs["cert"]}})
    with pytest.raises(ConfigError, match=r"tls\.ca:"):
        config_from_dict({"tls": {"cert": certs["cert"], "key": certs["key"]}})
    with pytest.raises(ConfigError, match=r"tls\.cert: no such file"):
        config_from_dict({"tls": {"cert": "/nonexistent.pem", "key": certs["key"], "ca": certs["ca"]}})


def test_the_http_api_speaks_https_and_asks_for_a_client_certificate(service, certs):
    """With tls.cert set the OpenAI API is HTTPS, under tls.client_auth mutual TLS, as the gRPC ports are (it stayed
    plain HTTP and served a client with no certificate while the gRPC ports refused it)."""
    import ssl

    import httpx
    url = f"https://127.0.0.1:{service.service.http_port}/v1/models"
    mutual = ssl.create_default_context(cafile=certs["ca"])
    mutual.load_cert_chain(certs["cert"], certs["key"])
    assert httpx.get(url, verify=mutual, timeout=30).status_code == 200
    for refused in ({"verify": ssl.create_default_context(cafile=certs["ca"])}, {"url": url.replace("https:", "http:")}):
        with pytest.raises(httpx.HTTPError):
            httpx.get(refused.pop("url", url), timeout=30, **refused).raise_for_status()


def test_workers_whose_certificate_does_not_name_their_address_fail_the_start_in_one_line(ray_local, byte_pair,
                                                                                          tmp_path):
    """The router dials the workers at 127.0.0.1, which this certificate does not name: every request failed with
    UNAUTHENTICATED while health said SERVING and nothing was logged. A first call to each target now fails the
    start, naming the replica and what the certificate needs."""
    from benchmarks.service import LoopThread
    from router.cli import StartFailed, start_service
    config = service_config(byte_pair)
    config["tls"] = {**make_certs(tmp_path, with_ip=False), "internal": True}
    background = LoopThread()
    try:
        with pytest.raises(StartFailed) as failed:
            background.run(start_service(config_from_dict(config)), 600)
    finally:
        background.close()
    message = str(failed.value)
    assert message.startswith("WorkerUnreachable: target 0 at 127.0.0.1:") and "subjectAltName" in message, message
    assert "\n" not in message
