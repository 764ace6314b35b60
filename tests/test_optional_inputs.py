"""A model's optional_inputs: the optional inputs its requests may carry. Those left out are refused on
both APIs with INVALID_ARGUMENT naming the input, and KServe's metadata and config leave them out (a
model with none is what perf_analyzer's --shared-memory needs: tests/test_process.py drives it). KServe is
spoken through our own stubs, so that this runs at the dependency floors too (no tritonclient there)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from attnserve import AttnServeError, Client
from attnserve_server.protocol import open_inference_pb2 as v2
from attnserve_server.protocol import open_inference_pb2_grpc as v2_grpc

from conftest import Running, model, running, settings

E, H, L = 32, 4, 6


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    models = (
        model("full", embed_dim=E, num_heads=H),
        model("self", embed_dim=E, num_heads=H, optional_inputs=()),
        model("masked", embed_dim=E, num_heads=H, optional_inputs=("key_padding_mask", "key_lengths")),
        model("bare", kind="sdpa", embed_dim=E, num_heads=H, optional_inputs=("none",)),
    )
    with running(settings(*models)) as handle:
        yield handle


def x(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


def test_metadata_lists_only_the_inputs_a_model_takes(server: Running) -> None:
    with Client(server.target) as c:
        listed = {m.name: m.inputs for m in c.models()}
    assert listed == {
        "full": ("query", "key_value", "key", "value", "key_padding_mask", "key_lengths"),
        "self": ("query",),
        "masked": ("query", "key_padding_mask", "key_lengths"),
        "bare": ("query", "key", "value"),
    }
    with grpc.insecure_channel(server.target) as channel:
        kserve = v2_grpc.GRPCInferenceServiceStub(channel)
        for name, inputs in listed.items():
            metadata = kserve.ModelMetadata(v2.ModelMetadataRequest(name=name), timeout=10)
            assert [t.name for t in metadata.inputs] == list(inputs)
            config = kserve.ModelConfig(v2.ModelConfigRequest(name=name), timeout=10).config
            assert [i.name for i in config.input] == list(inputs)
            # None optional left in "self" and "bare": nothing for perf_analyzer's shared memory mode to refuse.
            assert any(i.optional for i in config.input) == (name in ("full", "masked"))


def test_an_input_left_out_is_refused_by_name_on_both_apis_and_the_rest_is_served(server: Running) -> None:
    q, kv = x(1, L, E), x(1, 4, E)
    with Client(server.target) as c:
        expected = c.attend(q, model="full").output
        with pytest.raises(AttnServeError) as err:
            c.attend(q, kv, model="self")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.message == "key_value: model 'self' does not take it (its optional_inputs: none)"
        with pytest.raises(AttnServeError) as err:
            c.attend(q, model="masked", key=kv, value=kv)
        assert err.value.message == (
            "key: model 'masked' does not take it (its optional_inputs: key_padding_mask, key_lengths)"
        )
        np.testing.assert_array_equal(c.attend(q, model="self").output, expected)
        lengths = c.attend(q, model="masked", key_lengths=np.array([4])).output
        masked = c.attend(q, model="full", key_lengths=np.array([4])).output
        np.testing.assert_array_equal(lengths, masked)
        with pytest.raises(AttnServeError) as err:
            c.attend(q, model="bare", key=kv, value=kv, key_lengths=np.array([2]))
        assert err.value.message == "key_lengths: model 'bare' does not take it (its optional_inputs: none)"

    request = v2.ModelInferRequest(model_name="self", raw_input_contents=[q.tobytes(), kv.tobytes()])
    request.inputs.add(name="query", datatype="FP32", shape=q.shape)
    request.inputs.add(name="key_value", datatype="FP32", shape=kv.shape)
    with grpc.insecure_channel(server.target) as channel:
        kserve = v2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as rpc:
            kserve.ModelInfer(request, timeout=10)
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert rpc.value.details() == "key_value: model 'self' does not take it (its optional_inputs: none)"
        del request.inputs[1], request.raw_input_contents[1]
        answer = kserve.ModelInfer(request, timeout=10)
    np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], np.float32).reshape(q.shape), expected)
