"""Weight loading: torch MHA state_dicts (packed and separate), BERT blocks, and start-up errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from attnserve_server.compute.weights import check_weights_fit, load_projections, random_projections
from attnserve_server.errors import ConfigError
from attnserve_server.model import spec_from_settings
from attnserve_server.settings import ModelSettings, WeightsSettings


def spec(**kw):
    return spec_from_settings(ModelSettings(embed_dim=16, num_heads=2, **kw))


def save(tmp_path: Path, state: dict[str, torch.Tensor]) -> str:
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return str(path)


def test_random_weights_are_seeded_and_reproducible() -> None:
    a, b, c = random_projections(spec(), 1), random_projections(spec(), 1), random_projections(spec(), 2)
    assert torch.equal(a.packed, b.packed) and not torch.equal(a.packed, c.packed)


def test_packed_state_dict_loads_as_given(tmp_path: Path) -> None:
    mha = torch.nn.MultiheadAttention(16, 2)
    path = save(tmp_path, mha.state_dict())
    p = load_projections(spec(), WeightsSettings(format="torch", path=path))
    assert torch.equal(p.packed, mha.in_proj_weight.detach())
    assert torch.equal(p.k_weight, mha.in_proj_weight.detach()[16:32])
    assert torch.equal(p.out_bias, mha.out_proj.bias.detach())


def test_separate_projections_when_kdim_and_vdim_differ(tmp_path: Path) -> None:
    mha = torch.nn.MultiheadAttention(16, 2, kdim=8, vdim=12)
    path = save(tmp_path, mha.state_dict())
    p = load_projections(spec(kdim=8, vdim=12), WeightsSettings(format="torch", path=path))
    assert p.packed is None and p.k_weight.shape == (16, 8) and p.v_weight.shape == (16, 12)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.pop("out_proj.bias"), "missing key 'out_proj.bias' \\(expected shape \\[16\\]\\)"),
        (lambda s: s.update(extra=torch.zeros(1)), "unexpected key 'extra'"),
        (
            lambda s: s.update(in_proj_weight=torch.zeros(48, 15)),
            "'in_proj_weight' has shape \\[48, 15\\], the config needs \\[48, 16\\]",
        ),
    ],
)
def test_a_state_dict_that_does_not_fit_is_a_clear_start_up_error(tmp_path: Path, mutate, message: str) -> None:
    state = dict(torch.nn.MultiheadAttention(16, 2).state_dict())
    mutate(state)
    path = save(tmp_path, state)
    with pytest.raises(ConfigError, match=message):
        load_projections(spec(), WeightsSettings(format="torch", path=path))


def poisoned(value: float) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in torch.nn.MultiheadAttention(16, 2).state_dict().items()}
    state["in_proj_weight"][3, 5] = value
    state["in_proj_weight"][7, 1] = value
    return state


def test_weights_that_make_every_answer_nan_are_refused_at_start_up(tmp_path: Path) -> None:
    # Before: loaded and served, every answer NaN (or infinite).
    for value in (float("nan"), float("inf")):
        path = save(tmp_path, poisoned(value))
        with pytest.raises(ConfigError, match="key 'in_proj_weight' holds 2 values that are not finite"):
            load_projections(spec(), WeightsSettings(format="torch", path=path))
    # Finite in float32, infinite once a float16 model casts them.
    path = save(tmp_path, poisoned(1e5))
    with pytest.raises(ConfigError, match="values up to 100000, past float16's largest \\(65504\\)"):
        load_projections(spec(dtype="float16"), WeightsSettings(format="torch", path=path))
    assert load_projections(spec(dtype="bfloat16"), WeightsSettings(format="torch", path=path)) is not None


def test_bias_false_expects_no_biases(tmp_path: Path) -> None:
    path = save(tmp_path, torch.nn.MultiheadAttention(16, 2).state_dict())
    with pytest.raises(ConfigError, match="unexpected key 'in_proj_bias'"):
        load_projections(spec(bias=False), WeightsSettings(format="torch", path=path))


def bert_state(prefix: str, e: int = 16) -> dict[str, torch.Tensor]:
    state = {}
    for name in ("self.query", "self.key", "self.value", "output.dense"):
        state[f"{prefix}.{name}.weight"] = torch.randn(e, e)
        state[f"{prefix}.{name}.bias"] = torch.randn(e)
    state[f"{prefix}.output.LayerNorm.weight"] = torch.ones(e)  # present in real checkpoints, not ours to use
    return state


def test_bert_block_is_found_under_its_prefix(tmp_path: Path) -> None:
    state = bert_state("bert.encoder.layer.3.attention")
    path = save(tmp_path, state)
    p = load_projections(spec(), WeightsSettings(format="bert", path=path, prefix="bert.encoder.layer.3.attention"))
    assert torch.equal(p.q_weight, state["bert.encoder.layer.3.attention.self.query.weight"])
    assert torch.equal(p.v_bias, state["bert.encoder.layer.3.attention.self.value.bias"])
    assert torch.equal(p.out_weight, state["bert.encoder.layer.3.attention.output.dense.weight"])
    with pytest.raises(ConfigError, match=r"missing key 'encoder\.layer\.0\.attention\.self\.query\.weight'"):
        load_projections(spec(), WeightsSettings(format="bert", path=path, prefix="encoder.layer.0.attention"))


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not safetensors")
    with pytest.raises(ConfigError, match="cannot read"):
        load_projections(spec(), WeightsSettings(format="torch", path=str(bad)))


def test_weights_larger_than_the_host_are_refused_before_they_are_allocated() -> None:
    # Before: torch's allocator raised a RuntimeError traceback (E=65536 wanted 64 GiB on a 24 GiB host).
    big = spec_from_settings(ModelSettings(embed_dim=1 << 20, num_heads=1))  # 16 TiB: more than any host here
    with pytest.raises(ConfigError, match=r"model 'default': its weights take 16,384\.0 GiB as float32 \(embed_dim"):
        load_projections(big, WeightsSettings(format="random"))
    check_weights_fit(spec(kdim=8, vdim=4), 4 * (16 * (16 + 8 + 4) + 16 * 16 + 4 * 16))  # exactly fits
    with pytest.raises(ConfigError, match=r"more than this host's memory \(0\.0 GiB\)"):
        check_weights_fit(spec(kdim=8, vdim=4), 4 * (16 * (16 + 8 + 4) + 16 * 16 + 4 * 16) - 1)
