"""A model's optional_inputs: the optional inputs its requests may carry. Those left out are refused on
both APIs with INVALID_ARGUMENT naming the input, and KServe's metadata and config leave them out (a
model with none is what perf_analyzer's --shared-memory needs: tests/test_process.py drives it)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from attnserve import AttnServeError, Client

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
    kserve = tc.InferenceServerClient(server.target)
    try:
        for name, inputs in listed.items():
            assert [t.name for t in kserve.get_model_metadata(name).inputs] == list(inputs)
            config = kserve.get_model_config(name).config
            assert [i.name for i in config.input] == list(inputs)
        # No optional input left: nothing for perf_analyzer's shared memory mode to refuse.
        assert not any(i.optional for i in kserve.get_model_config("self").config.input)
        assert not any(i.optional for i in kserve.get_model_config("bare").config.input)
    finally:
        kserve.close()


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

    kserve = tc.InferenceServerClient(server.target)
    try:
        inputs = [tc.InferInput("query", list(q.shape), "FP32"), tc.InferInput("key_value", list(kv.shape), "FP32")]
        inputs[0].set_data_from_numpy(q)
        inputs[1].set_data_from_numpy(kv)
        with pytest.raises(InferenceServerException) as kerr:
            kserve.infer("self", inputs)
        assert kerr.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "key_value: model 'self' does not take it" in kerr.value.message()
        np.testing.assert_array_equal(kserve.infer("self", inputs[:1]).as_numpy("output"), expected)
    finally:
        kserve.close()
