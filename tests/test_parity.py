"""Numerical parity with torch.nn.MultiheadAttention through the real server and client (fp32, <= 1e-5)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from attnserve import Client
from attnserve_server.edge.payload import LARGE_MESSAGE_BYTES
from attnserve_server.settings import WeightsSettings

from conftest import TEST_DEVICE, Running, model, running, settings

E, H = 32, 4
TOL = 1e-5


def random_mha(seed: int, **kw) -> torch.nn.MultiheadAttention:
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True, **kw).eval()
    with torch.no_grad():
        for p in mha.parameters():  # non-zero biases, so they are exercised too
            p.normal_(0, 0.3)
    return mha


def write(tmp: Path, name: str, state: dict[str, torch.Tensor]) -> str:
    path = tmp / f"{name}.safetensors"
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path))
    return str(path)


@pytest.fixture(scope="module")
def parity(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Running, dict[str, torch.nn.MultiheadAttention]]]:
    tmp = tmp_path_factory.mktemp("weights")
    refs = {
        "self": random_mha(1),
        "cross": random_mha(2, kdim=24, vdim=40),
        "nobias": random_mha(3, bias=False),
    }
    models = [
        model(
            name,
            embed_dim=E,
            num_heads=H,
            kdim=m.kdim,
            vdim=m.vdim,
            bias=m.in_proj_bias is not None,
            weights=WeightsSettings(format="torch", path=write(tmp, name, m.state_dict())),
        )
        for name, m in refs.items()
    ]
    # The same weights as the "self" model, stored as a Hugging Face BERT attention block.
    ref = refs["self"]
    w, b = ref.in_proj_weight.chunk(3), ref.in_proj_bias.chunk(3)
    prefix = "bert.encoder.layer.0.attention"
    bert = {f"{prefix}.self.{n}.weight": w[i] for i, n in enumerate(("query", "key", "value"))}
    bert |= {f"{prefix}.self.{n}.bias": b[i] for i, n in enumerate(("query", "key", "value"))}
    bert |= {
        f"{prefix}.output.dense.weight": ref.out_proj.weight,
        f"{prefix}.output.dense.bias": ref.out_proj.bias,
    }
    models.append(
        model(
            "bert",
            embed_dim=E,
            num_heads=H,
            weights=WeightsSettings(format="bert", path=write(tmp, "bert", bert), prefix=prefix),
        )
    )
    with running(settings(*models)) as handle:
        yield handle, refs


def rand(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


def reference(mha, q, k, v, *, causal=False, lengths=None, mask=None, need_weights=False, average=True):
    q, k, v = (torch.from_numpy(np.asarray(a)) for a in (q, k, v))
    s = k.shape[1]
    padding = None
    if lengths is not None:
        padding = torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]
    if mask is not None:
        padding = torch.from_numpy(mask)
    attn_mask = torch.ones(q.shape[1], s, dtype=torch.bool).triu(1) if causal else None
    with torch.no_grad():
        y, a = mha(
            q,
            k,
            v,
            key_padding_mask=padding,
            attn_mask=attn_mask,
            need_weights=need_weights,
            average_attn_weights=average,
        )
    return y.numpy(), None if a is None else a.numpy()


def close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert float(np.abs(actual - expected).max()) <= TOL


@pytest.mark.parametrize("name", ["self", "nobias", "bert"])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention(parity, name: str, causal: bool) -> None:
    handle, refs = parity
    x = rand(3, 7, E)
    with Client(handle.target) as c:
        got = c.attend(x, model=name, causal=causal)
    close(got.output, reference(refs["self" if name == "bert" else name], x, x, x, causal=causal)[0])


def test_self_attention_with_key_lengths_and_weights_per_head(parity) -> None:
    handle, refs = parity
    x = rand(3, 9, E)
    with Client(handle.target) as c:
        got = c.attend(x, model="self", key_lengths=[9, 4, 1], causal=True, need_weights=True, average_weights=False)
    y, a = reference(refs["self"], x, x, x, causal=True, lengths=[9, 4, 1], need_weights=True, average=False)
    close(got.output, y)
    close(got.attention_weights, a)
    assert got.attention_weights.shape == (3, H, 9, 9)


def test_boolean_key_padding_mask_and_averaged_weights(parity) -> None:
    handle, refs = parity
    x = rand(2, 6, E)
    mask = np.zeros((2, 6), bool)
    mask[0, [1, 4]] = True
    mask[1, 5] = True
    with Client(handle.target) as c:
        got = c.attend(x, model="self", key_padding_mask=mask, need_weights=True)
    y, a = reference(refs["self"], x, x, x, mask=mask, need_weights=True, average=True)
    close(got.output, y)
    close(got.attention_weights, a)


def test_torchs_float_key_padding_mask_of_zeros_and_minus_infinity(parity) -> None:
    # torch adds a float mask to the scores: 0 and -inf are the boolean mask, and are taken as it.
    handle, refs = parity
    x = rand(2, 6, E)
    mask = np.zeros((2, 6), np.float32)
    mask[0, [1, 4]] = -np.inf
    mask[1, 5] = -np.inf
    with Client(handle.target) as c:
        got = c.attend(x, model="self", key_padding_mask=mask, need_weights=True)
    y, a = reference(refs["self"], x, x, x, mask=mask, need_weights=True, average=True)
    close(got.output, y)
    close(got.attention_weights, a)


def test_cross_attention_with_kdim_and_vdim(parity) -> None:
    handle, refs = parity
    q, k, v = rand(2, 5, E), rand(2, 11, 24), rand(2, 11, 40)
    with Client(handle.target) as c:
        got = c.attend(q, key=k, value=v, model="cross", key_lengths=[11, 3], need_weights=True)
    y, a = reference(refs["cross"], q, k, v, lengths=[11, 3], need_weights=True)
    close(got.output, y)
    close(got.attention_weights, a)


def _large_cross_request() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    q, k, v = rand(4, 300, E), rand(4, 280, 24), rand(4, 280, 40)  # 430 KiB in all
    assert q.nbytes + k.nbytes + v.nbytes >= LARGE_MESSAGE_BYTES
    return q, k, v, np.array([280, 3, 100, 1], dtype=np.int64)


def test_a_large_request_is_exact(parity) -> None:
    """Over payload.LARGE_MESSAGE_BYTES a request's tensors are read as views of the bytes received
    (edge/payload.py): here three inputs and a small one, each in its own Tensor message."""
    handle, refs = parity
    q, k, v, lengths = _large_cross_request()
    with Client(handle.target) as c:
        got = c.attend(q, key=k, value=v, model="cross", key_lengths=lengths)
    close(got.output, reference(refs["cross"], q, k, v, lengths=lengths)[0])


def test_a_large_kserve_request_is_exact(parity) -> None:
    """The same through KServe v2: the inputs as entries of raw_input_contents."""
    tc = pytest.importorskip("tritonclient.grpc")  # not on the GPU machine (scripts/gpu_check.sh)
    handle, refs = parity
    q, k, v, lengths = _large_cross_request()
    inputs = []
    for name, array, datatype in (
        ("query", q, "FP32"),
        ("key", k, "FP32"),
        ("value", v, "FP32"),
        ("key_lengths", lengths, "INT64"),
    ):
        tensor = tc.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client = tc.InferenceServerClient(handle.target)
    try:
        got = client.infer("cross", inputs).as_numpy("output")
    finally:
        client.close()
    close(got, reference(refs["cross"], q, k, v, lengths=lengths)[0])


def test_requests_of_one_shape_are_each_answered_from_their_own_bytes(parity) -> None:
    """Their heads repeat (edge/payload.py's Parser), so all but the first two are not validated
    again: each answer is still its own request's, on both APIs, and a mask is checked every time."""
    tc = pytest.importorskip("tritonclient.grpc")
    handle, refs = parity
    client = tc.InferenceServerClient(handle.target)

    def kserve(q: np.ndarray, request_id: str = "", **named: np.ndarray) -> np.ndarray:
        inputs = []
        for name, array in {"query": q, **named}.items():
            tensor = tc.InferInput(name, list(array.shape), "BOOL" if array.dtype == bool else "FP32")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer("cross" if "key" in named else "self", inputs, request_id=request_id)
        assert result.get_response().id == request_id  # its own id, whatever its length
        return result.as_numpy("output")

    try:
        with Client(handle.target) as c:
            for seed in range(4):
                rng = np.random.default_rng(seed)
                q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 5, E), (2, 3, 24), (2, 3, 40)))
                request_id = "r" * (1 + 100 * seed)  # ids of other lengths do not hide a repeated head
                close(kserve(q), reference(refs["self"], q, q, q)[0])
                close(kserve(q, request_id), reference(refs["self"], q, q, q)[0])
                got = c.attend(q, model="self", request_id=request_id)
                assert got.request_id == request_id
                close(got.output, reference(refs["self"], q, q, q)[0])
                close(kserve(q, key=k, value=v), reference(refs["cross"], q, k, v)[0])
                close(c.attend(q, model="cross", key=k, value=v).output, reference(refs["cross"], q, k, v)[0])
            mask = np.zeros((2, 5), dtype=bool)
            for _ in range(3):
                close(kserve(q, key_padding_mask=mask), reference(refs["self"], q, q, q, mask=mask)[0])
            mask[1, :] = True
            with pytest.raises(tc.InferenceServerException, match="masks every key"):
                kserve(q, key_padding_mask=mask)
    finally:
        client.close()


def test_cross_attention_with_one_key_value_sequence_and_an_unbatched_query(parity) -> None:
    handle, refs = parity
    q, kv = rand(4, E), rand(10, E)
    with Client(handle.target) as c:
        got = c.attend(q, kv, model="self", causal=True)
    y, _ = reference(refs["self"], q[None], kv[None], kv[None], causal=True)
    close(got.output, y[0])


@pytest.mark.parametrize("need_weights", [True, False])  # either way one call into torch (compute/scripted.py)
def test_bare_operation_matches_scaled_dot_product_attention(default_server: Running, need_weights: bool) -> None:
    q, k, v = rand(2, 5, 32), rand(2, 8, 32), rand(2, 8, 16)
    with Client(default_server.target) as c:
        got = c.attend(
            q, key=k, value=v, model="bare", key_lengths=[8, 2], need_weights=need_weights, average_weights=False
        )
    tq, tk, tv = (torch.from_numpy(a).unflatten(-1, (4, -1)).transpose(1, 2) for a in (q, k, v))
    allowed = (torch.arange(8)[None, :] < torch.tensor([8, 2])[:, None])[:, None, None, :]
    expected = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=allowed).transpose(1, 2).flatten(2)
    weights = torch.softmax((tq @ tk.transpose(-2, -1) / np.sqrt(8)).masked_fill(~allowed, -torch.inf), -1)
    close(got.output, expected.numpy())
    if need_weights:
        close(got.attention_weights, weights.numpy())
    else:
        assert got.attention_weights is None


def in_one_batch(parity, name: str, seed: int, inputs: list[tuple[np.ndarray, ...]], masked: bool = True):
    """Serves a model of its own whose batch closes at len(inputs) requests (and never by delay),
    sends every input at once (with causal masking and weights unless not `masked`), and returns the
    reference module, the results and the batch's padding share."""
    mha = random_mha(seed)
    tmp = Path(parity[0].server.settings.models[0].weights.path).parent
    m = model(
        name,
        embed_dim=E,
        num_heads=H,
        max_batch_size=len(inputs),
        max_queue_delay_ms=60_000,
        weights=WeightsSettings(format="torch", path=write(tmp, name, mha.state_dict())),
    )
    with running(settings(m)) as handle, Client(handle.target) as c:
        with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
            futures = [pool.submit(c.attend, *args, causal=masked, need_weights=masked) for args in inputs]
            results = [f.result(timeout=60) for f in futures]
        padding = handle.sample("attnserve_batch_padding_ratio_sum", model=name)
    for got in results:
        assert got.timing.batch_size == len(inputs)
    return mha, results, padding


def test_requests_of_different_lengths_share_one_batch_and_stay_exact(parity) -> None:
    """Three requests of different L and S, padded into one batch (max_batch_size=3 closes it)."""
    inputs = [(rand(1, 3, E), rand(1, 5, E)), (rand(1, 8, E), rand(1, 2, E)), (rand(1, 6, E), rand(1, 9, E))]
    mha, results, padding = in_one_batch(parity, "mixed", 4, inputs)
    for (q, kv), got in zip(inputs, results, strict=True):
        y, a = reference(mha, q, kv, kv, causal=True, need_weights=True)
        close(got.output, y)
        close(got.attention_weights, a)
    # (3+5 + 8+2 + 6+9) real positions of 3 x (8+9) padded ones.
    assert padding == pytest.approx(1 - 33 / 51)


@pytest.mark.parametrize("masked", [False, True], ids=["fused", "causal-with-weights"])
def test_a_request_of_nan_and_inf_leaves_the_requests_batched_with_it_exact(parity, masked: bool) -> None:
    """Non-finite inputs are the client's to send (its answer is what torch makes of them), but they stay
    in that request's rows: the others in its batch, one of them padded to its length, are exact."""
    bad = rand(1, 6, E) - 1
    bad[0, 2, 5] = np.nan
    bad[0, 4, :] = np.inf
    inputs = [(rand(1, 6, E),), (bad,), (rand(1, 4, E),), (rand(1, 6, E) + 1,)]
    mha, results, _ = in_one_batch(parity, f"nonfinite-{masked}", 6, inputs, masked=masked)
    for (q,), got in zip(inputs, results, strict=True):
        if q is bad:
            assert got.output.shape == (1, 6, E) and not np.isfinite(got.output).all()
            continue
        y, a = reference(mha, q, q, q, causal=masked, need_weights=masked)
        close(got.output, y)
        if masked:
            close(got.attention_weights, a)


def test_far_apart_lengths_share_a_batch_and_compute_in_groups(parity) -> None:
    """Lengths 2, 200 and 5 in one batch: on the CPU 2 and 5 run padded to 5, 200 on its own (compute/groups.py)."""
    queries = [rand(1, 2, E), rand(1, 200, E), rand(1, 5, E)]
    mha, results, padding = in_one_batch(parity, "apart", 5, [(q,) for q in queries])
    for q, got in zip(queries, results, strict=True):
        y, a = reference(mha, q, q, q, causal=True, need_weights=True)
        close(got.output, y)
        close(got.attention_weights, a)
    # 2+2 + 200+200 + 5+5 = 414 real positions of 200+200 + 2 x (5+5) = 420 computed; on CUDA a batch
    # stays one group, all three padded to 200: 3 x (200+200).
    assert padding == pytest.approx(1 - 414 / (420 if TEST_DEVICE == "cpu" else 1200))
