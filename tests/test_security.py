"""TLS, mTLS and bearer tokens through the real server, the real client, tritonclient and the CLI.
Certificates are made at test time (trustme); nothing leaves loopback."""

from __future__ import annotations

import gzip
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import trustme
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from attnserve import AttnServeError, Client
from attnserve_server.errors import ConfigError
from attnserve_server.metrics_http import MIN_RENDER_INTERVAL_S, MetricsHTTPServer
from attnserve_server.security import token_hash

from conftest import model, run_cli, running, settings

Q = np.ones((3, 32), np.float32)


class Pki:
    """A CA, a server certificate for 127.0.0.1, and a client certificate, as PEM files."""

    def __init__(self, tmp: Path, ca: trustme.CA | None = None) -> None:
        self.ca = ca or trustme.CA()
        tmp.mkdir(parents=True, exist_ok=True)
        self.ca_pem = tmp / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_pem))
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        self.server_cert, self.server_key = tmp / "server.pem", tmp / "server.key"
        server.cert_chain_pems[0].write_to_path(str(self.server_cert))
        server.private_key_pem.write_to_path(str(self.server_key))
        client = self.ca.issue_cert("client.example")
        self.client_cert, self.client_key = tmp / "client.pem", tmp / "client.key"
        client.cert_chain_pems[0].write_to_path(str(self.client_cert))
        client.private_key_pem.write_to_path(str(self.client_key))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def tls_settings(pki: Pki, client_ca: bool = False, **fields):
    return settings(
        model(embed_dim=32, num_heads=4),
        model("other", embed_dim=32, num_heads=4),
        tls_cert=str(pki.server_cert),
        tls_key=str(pki.server_key),
        tls_client_ca=str(pki.ca_pem) if client_ca else None,
        **fields,
    )


def test_tls_works_and_plaintext_is_refused(pki: Pki, tmp_path: Path) -> None:
    with running(tls_settings(pki)) as handle:
        with Client(handle.target, ca=str(pki.ca_pem), timeout_s=10) as c:
            assert c.attend(Q).output.shape == (3, 32)
            assert c.health() == "SERVING"
        with Client(handle.target, timeout_s=3, retries=False) as plain, pytest.raises(AttnServeError) as err:
            plain.attend(Q)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        # A client trusting another CA refuses the server's certificate.
        other = Pki(tmp_path / "other")
        with (
            Client(handle.target, ca=str(other.ca_pem), timeout_s=3, retries=False) as c,
            pytest.raises(AttnServeError) as err,
        ):
            c.attend(Q)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_mtls_requires_a_client_certificate_from_the_ca(pki: Pki, tmp_path: Path) -> None:
    with running(tls_settings(pki, client_ca=True)) as handle:
        mine = {"ca": str(pki.ca_pem), "cert": str(pki.client_cert), "key": str(pki.client_key)}
        with Client(handle.target, timeout_s=10, **mine) as c:
            assert c.attend(Q).output.shape == (3, 32)
        with (
            Client(handle.target, ca=str(pki.ca_pem), timeout_s=3, retries=False) as c,
            pytest.raises(AttnServeError) as err,
        ):
            c.attend(Q)  # no client certificate
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        stranger = Pki(tmp_path / "stranger")  # a client certificate from a CA the server does not trust
        with Client(
            handle.target, ca=str(pki.ca_pem), cert=str(stranger.client_cert), key=str(stranger.client_key),
            timeout_s=3, retries=False,
        ) as c, pytest.raises(AttnServeError) as err:  # fmt: skip
            c.attend(Q)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_renewed_certificate_is_served_to_new_connections_while_open_ones_go_on(pki: Pki, tmp_path: Path) -> None:
    files = tmp_path / "live"
    live = Pki(files, ca=pki.ca)
    with running(tls_settings(live)) as handle, Client(handle.target, ca=str(pki.ca_pem), timeout_s=10) as before:
        assert before.attend(Q).output.shape == (3, 32)
        # Renew with a certificate from a new CA: new handshakes must present it.
        renewed = Pki(tmp_path / "renewed")
        live.server_cert.write_bytes(renewed.server_cert.read_bytes())
        live.server_key.write_bytes(renewed.server_key.read_bytes())
        handle.server.reload_tls()
        with Client(handle.target, ca=str(renewed.ca_pem), timeout_s=10) as after:
            assert after.attend(Q).output.shape == (3, 32)
        assert before.attend(Q).output.shape == (3, 32)  # the open connection was not dropped


def test_a_certificate_and_key_that_do_not_load_are_named_at_start_up_and_never_replace_good_ones(
    pki: Pki, tmp_path: Path
) -> None:
    # Before: gRPC only failed to add the port, read as "cannot bind (in use, or not an address of this
    # host)"; and a renewal with a broken pair replaced the good one, failing every new handshake.
    other = Pki(tmp_path / "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    for cert, key, ca in (
        (garbage, garbage, None),
        (pki.server_cert, other.server_key, None),  # a key for another certificate
        (pki.server_cert, pki.server_key, garbage),
    ):
        fields = {"tls_cert": str(cert), "tls_key": str(key), "tls_client_ca": str(ca) if ca else None}
        refused = pytest.raises(ConfigError, match=r"tls_(cert, tls_key|client_ca): cannot load")
        with refused, running(settings(model(embed_dim=32, num_heads=4), **fields)):
            pass
    live = Pki(tmp_path / "live", ca=pki.ca)
    with running(tls_settings(live)) as handle:
        live.server_cert.write_text("half written\n")
        handle.server.reload_tls()
        with Client(handle.target, ca=str(pki.ca_pem), timeout_s=10) as c:  # a new connection, the good pair
            assert c.attend(Q).output.shape == (3, 32)


def test_tokens_authenticate_and_authorise_per_model(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# hashes only\n{token_hash('s3cret')} default\n{token_hash('admin')} *\n")
    with running(settings(model(embed_dim=32, num_heads=4), model("other", embed_dim=32, num_heads=4),
                          auth_tokens_file=str(tokens))) as handle:  # fmt: skip
        with Client(handle.target, timeout_s=10, retries=False) as c:
            with pytest.raises(AttnServeError) as err:
                c.attend(Q)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert c.health() == "SERVING"  # health stays open for probes
        with Client(handle.target, token="wrong", timeout_s=10) as c, pytest.raises(AttnServeError) as err:
            c.attend(Q)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and "wrong" not in err.value.message
        with Client(handle.target, token="s3cret", timeout_s=10) as c:
            assert c.attend(Q).output.shape == (3, 32)
            with pytest.raises(AttnServeError) as err:
                c.attend(Q, model="other")
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(AttnServeError) as err:
                c.model("other")
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        with Client(handle.target, token="admin", timeout_s=10) as c:
            assert c.attend(Q, model="other").output.shape == (3, 32)
        # tritonclient sends the token as a header.
        import tritonclient.grpc as tc

        client = tc.InferenceServerClient(handle.target)
        q = tc.InferInput("query", [1, 3, 32], "FP32")
        q.set_data_from_numpy(Q[None])
        assert client.infer("default", [q], headers={"authorization": "Bearer s3cret"}).as_numpy("output").shape == (
            1, 3, 32,
        )  # fmt: skip
        with pytest.raises(tc.InferenceServerException) as err:
            client.infer("default", [q])
        assert "UNAUTHENTICATED" in str(err.value.status())
        assert "s3cret" not in handle.metrics_text()


def test_the_cli_speaks_tls_and_tokens(pki: Pki, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    fields = {"auth_tokens": f"{token_hash('s3cret')} *"}
    with running(tls_settings(pki, **fields)) as handle:
        base = [sys.executable, "-m", "attnserve_server"]
        r = subprocess.run([*base, "infer", "--target", handle.target, "--tls-ca", str(pki.ca_pem), "--token-file",
                            str(token), "--seq-len", "4"], capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "output: shape [1, 4, 32]" in r.stdout
        r = subprocess.run([*base, "health", "--target", handle.target, "--tls-ca", str(pki.ca_pem)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert (r.returncode, r.stdout.strip()) == (0, "SERVING")


def _get(url: str, context=None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_metrics_port_answers_metrics_only_on_its_own_host() -> None:
    # gRPC on 127.0.0.1, metrics on 127.0.0.2 (both loopback).
    with running(settings(model(embed_dim=32, num_heads=4), metrics_host="127.0.0.2")) as handle:
        port = handle.server.metrics_port
        status, text = _get(f"http://127.0.0.2:{port}/metrics")
        assert status == 200 and "attnserve_queue_depth" in text
        assert _get(f"http://127.0.0.2:{port}/")[0] == 404
        assert _get(f"http://127.0.0.2:{port}/debug")[0] == 404
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_the_metrics_port_speaks_tls_and_can_require_a_client_certificate(pki: Pki) -> None:
    fields = {
        "metrics_tls_cert": str(pki.server_cert),
        "metrics_tls_key": str(pki.server_key),
        "metrics_tls_client_ca": str(pki.ca_pem),
    }
    with running(settings(model(embed_dim=32, num_heads=4), **fields)) as handle:
        url = f"https://127.0.0.1:{handle.server.metrics_port}/metrics"
        scraper = ssl.create_default_context(cafile=str(pki.ca_pem))
        scraper.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        status, text = _get(url, scraper)
        assert status == 200 and "attnserve_queue_depth" in text
        anonymous = ssl.create_default_context(cafile=str(pki.ca_pem))  # no client certificate
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, timeout=5, context=anonymous).read()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url.replace("https", "http"), timeout=5).read()


def _silent_connection(port: int) -> socket.socket:
    """A connection to the port that sends nothing; its reads wait 10 s at most."""
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_a_connection_that_sends_nothing_holds_no_scrape_and_is_closed(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With TLS the handshake ran inside accept(), on the one thread that accepts: one client that connected
    # and sent nothing held every scrape after it (each timed out); without TLS such a connection held a
    # thread for good.
    monkeypatch.setattr(MetricsHTTPServer, "connection_timeout_s", 0.5)
    fields = {"metrics_tls_cert": str(pki.server_cert), "metrics_tls_key": str(pki.server_key)}
    with running(settings(model(embed_dim=32, num_heads=4), **fields)) as handle:
        port = handle.server.metrics_port
        scraper = ssl.create_default_context(cafile=str(pki.ca_pem))
        with _silent_connection(port) as silent:
            status, text = _get(f"https://127.0.0.1:{port}/metrics", scraper)
            assert status == 200 and "attnserve_queue_depth" in text
            assert silent.recv(1) == b""  # closed by the server at its timeout, not by our 10 s
    with running(settings(model(embed_dim=32, num_heads=4))) as handle:
        port = handle.server.metrics_port
        with _silent_connection(port) as silent, _silent_connection(port) as half:
            half.sendall(b"GET /metr")
            assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 200
            assert silent.recv(1) == b"" and half.recv(1) == b""


def test_connections_past_the_cap_are_closed_at_once_and_the_cap_frees_as_connections_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before, every connection got a thread of its own for as long as it stayed (15 s silent): a client that
    # opened thousands held thousands of threads.
    monkeypatch.setattr(MetricsHTTPServer, "max_connections", 3)
    monkeypatch.setattr(MetricsHTTPServer, "connection_timeout_s", 60.0)  # longer than any wait below
    with running(settings(model(embed_dim=32, num_heads=4))) as handle:
        port = handle.server.metrics_port
        held = [_silent_connection(port) for _ in range(3)]
        try:
            for _ in range(5):
                with _silent_connection(port) as extra:
                    assert extra.recv(1) == b""  # closed by the server at once (our reads wait 10 s)
            held.pop().close()
            # The slot frees when the server's thread sees the close: until then a scrape is refused.
            for _ in range(200):
                try:
                    status, text = _get(f"http://127.0.0.1:{port}/metrics")
                    break
                except (urllib.error.URLError, ConnectionError):
                    continue
            assert status == 200 and "attnserve_queue_depth" in text
        finally:
            for connection in held:
                connection.close()


class _Renders(Collector):
    """A family whose value is the number of times the registry was rendered, and one the test sets."""

    def __init__(self) -> None:
        self.renders, self.mark = 0, 0

    def collect(self):
        self.renders += 1
        yield GaugeMetricFamily("probe_mark", "set by the test", value=self.mark)


def _scrape(port: int, gzipped: bool) -> tuple[int, float]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if gzipped:
        request.add_header("Accept-Encoding", "gzip")
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
        assert (response.headers.get("Content-Encoding") == "gzip") == gzipped
    text = (gzip.decompress(body) if gzipped else body).decode()
    (value,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "probe_mark"]
    return response.status, value


def test_a_scrape_flood_renders_at_most_once_an_interval_and_no_scrape_sees_an_older_render() -> None:
    # Each render reads every collector under the GIL the event loop needs: four processes scraping flat
    # out took W1 at concurrency 32 from 1,251 to 273 req/s, every scrape a render of its own.
    with running(settings(model(embed_dim=32, num_heads=4))) as handle:
        probe = _Renders()
        handle.server.metrics.registry.register(probe)
        port = handle.server.metrics_port
        for mark in range(1, 11):  # what was done before a scrape was sent, the scrape shows
            probe.mark = mark
            assert _scrape(port, gzipped=mark % 2 == 0) == (200, mark)

        def flood(gzipped: bool) -> list[tuple[int, float]]:
            return [_scrape(port, gzipped) for _ in range(20)]

        before, started = probe.renders, time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            answers = [a for batch in pool.map(flood, [i % 2 == 0 for i in range(8)]) for a in batch]
        took, renders = time.monotonic() - started, probe.renders - before
        assert answers == [(200, 10)] * 160
        assert renders <= took / MIN_RENDER_INTERVAL_S + 2, (renders, took)


def test_a_plaintext_health_port_answers_probes_while_the_grpc_port_speaks_tls(pki: Pki) -> None:
    with running(tls_settings(pki, health_port=0)) as handle:
        health = f"127.0.0.1:{handle.server.health_port}"
        with Client(health, timeout_s=5, retries=False) as probe:
            assert probe.health() == "SERVING" and probe.health("default") == "SERVING"
            with pytest.raises(AttnServeError) as err:
                probe.attend(Q)  # health only: nothing else is served in plaintext
            assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
        with Client(handle.target, timeout_s=3, retries=False) as plain, pytest.raises(AttnServeError):
            plain.health()  # the gRPC port itself still refuses plaintext
        handle.call(handle.server.stop(5))
        with Client(health, timeout_s=3, retries=False) as probe, pytest.raises(AttnServeError):
            probe.health()  # gone with the server


def test_bench_measures_a_server_behind_tls_and_a_token(pki: Pki, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret")
    with running(tls_settings(pki, auth_tokens=f"{token_hash('s3cret')} *")) as handle:
        r = run_cli(
            "bench", "--target", handle.target, "--tls-ca", str(pki.ca_pem), "--token-file", str(token),
            "--concurrency", "2", "--duration-s", "0.5", "--warmup-s", "0.2", "--processes", "1",
            "--inprocess-s", "0.2", "--seq-len", "8",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        lines = r.stdout.strip().splitlines()
        header = next(line.split() for line in lines if line.startswith("server"))
        row = lines[-1].split()
        assert header[-1] == "errors" and row[-1] == "0", r.stdout  # every call got through TLS and the token
        assert handle.sample("attnserve_requests_total", model="default", method="Attend", code="OK") > 0


def test_health_and_reflection_can_require_tokens_too(tmp_path: Path) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    served = settings(model(embed_dim=32, num_heads=4), auth_tokens=f"{token_hash('s3cret')} *", auth_open="")

    def list_services(target: str, metadata=None) -> list[str]:
        with grpc.insecure_channel(target) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            (answer,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=metadata))
            return [s.name for s in answer.list_services_response.service]

    with running(served) as handle:
        with Client(handle.target, timeout_s=5, retries=False) as c, pytest.raises(AttnServeError) as err:
            c.health()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        with Client(handle.target, timeout_s=5, token="s3cret") as c:
            assert c.health() == "SERVING"
        with pytest.raises(grpc.RpcError) as rpc_err:
            list_services(handle.target)
        assert rpc_err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "attnserve.v1.AttentionService" in list_services(handle.target, (("authorization", "Bearer s3cret"),))
