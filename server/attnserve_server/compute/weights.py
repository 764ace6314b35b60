"""Loads attention weights: seeded random, a torch MHA state_dict, or a BERT attention block."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from attnserve_server.domain import ModelKind, ModelSpec
from attnserve_server.errors import ConfigError
from attnserve_server.settings import WeightsSettings


@dataclass(frozen=True)
class Projections:
    """W_Q, W_K, W_V, W_O in torch.nn.Linear layout ([out, in]) and their biases.

    `packed` is [W_Q; W_K; W_V] when the three share input width, so self attention
    projects with one matrix product; q_weight/k_weight/v_weight are then views of it.
    """

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    v_weight: torch.Tensor
    out_weight: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    out_bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    packed_bias: torch.Tensor | None = None

    def to(self, device: torch.device, dtype: torch.dtype) -> Projections:
        if self.packed is not None:
            packed = self.packed.to(device, dtype)
            bias = None if self.packed_bias is None else self.packed_bias.to(device, dtype)
            return _split_packed(packed, bias, self.out_weight.to(device, dtype), _to(self.out_bias, device, dtype))
        values = {f.name: _to(getattr(self, f.name), device, dtype) for f in fields(self)}
        return Projections(**values)


def _to(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(device, dtype)


def _split_packed(
    packed: torch.Tensor, bias: torch.Tensor | None, out_w: torch.Tensor, out_b: torch.Tensor | None
) -> Projections:
    q, k, v = packed.chunk(3)
    qb, kb, vb = bias.chunk(3) if bias is not None else (None, None, None)
    return Projections(q, k, v, out_w, qb, kb, vb, out_b, packed=packed, packed_bias=bias)


def _expect(
    state: dict[str, torch.Tensor], key: str, shape: tuple[int, ...], source: str, spec: ModelSpec
) -> torch.Tensor:
    """The tensor `key`, checked: its shape, a float, every value finite and within the model's dtype
    (a NaN or an infinity in a weight makes every answer NaN, and so does a value past float16's range
    on a float16 model: refused at start-up rather than served)."""
    if key not in state:
        raise ConfigError(f"{source}: missing key {key!r} (expected shape {list(shape)})")
    tensor = state[key]
    if tuple(tensor.shape) != shape:
        raise ConfigError(f"{source}: key {key!r} has shape {list(tensor.shape)}, the config needs {list(shape)}")
    if not tensor.is_floating_point():
        raise ConfigError(f"{source}: key {key!r} has dtype {tensor.dtype}, expected a floating point tensor")
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise ConfigError(f"{source}: key {key!r} holds {bad:,} values that are not finite (NaN or infinity)")
    largest = torch.finfo(getattr(torch, spec.dtype.setting or "float32")).max
    top = float(tensor.abs().max()) if tensor.numel() else 0.0
    if top > largest:
        raise ConfigError(
            f"{source}: key {key!r} holds values up to {top:.6g}, past {spec.dtype.setting}'s largest ({largest:.6g}): "
            "they would be infinite; serve the model as bfloat16 or float32"
        )
    return tensor


def from_torch_state_dict(state: dict[str, torch.Tensor], spec: ModelSpec, source: str = "state_dict") -> Projections:
    """torch.nn.MultiheadAttention's layout: in_proj_weight, or q/k/v_proj_weight when kdim/vdim differ."""
    e = spec.embed_dim
    expected: dict[str, tuple[int, ...]] = {"out_proj.weight": (e, e)}
    same_width = spec.kdim == e and spec.vdim == e
    packed_layout = same_width and "in_proj_weight" in state
    if packed_layout:
        expected["in_proj_weight"] = (3 * e, e)
    else:
        expected.update({"q_proj_weight": (e, e), "k_proj_weight": (e, spec.kdim), "v_proj_weight": (e, spec.vdim)})
    if spec.bias:
        expected.update({"in_proj_bias": (3 * e,), "out_proj.bias": (e,)})
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ConfigError(
            f"{source}: unexpected key {unexpected[0]!r}; for this config (embed_dim {e}, kdim {spec.kdim}, "
            f"vdim {spec.vdim}, bias {spec.bias}) the keys are {sorted(expected)}"
        )
    t = {key: _expect(state, key, shape, source, spec) for key, shape in expected.items()}
    in_bias = t.get("in_proj_bias")
    if packed_layout:
        return _split_packed(t["in_proj_weight"], in_bias, t["out_proj.weight"], t.get("out_proj.bias"))
    qb, kb, vb = in_bias.chunk(3) if in_bias is not None else (None, None, None)
    q, k, v = t["q_proj_weight"], t["k_proj_weight"], t["v_proj_weight"]
    if same_width:
        # Same widths given as separate matrices: pack them for the one-product self attention path.
        packed = torch.cat([q, k, v])
        return _split_packed(packed, in_bias, t["out_proj.weight"], t.get("out_proj.bias"))
    return Projections(q, k, v, t["out_proj.weight"], qb, kb, vb, t.get("out_proj.bias"))


def from_bert(state: dict[str, torch.Tensor], spec: ModelSpec, prefix: str, source: str) -> Projections:
    """A Hugging Face BERT attention block: <prefix>.self.{query,key,value} and <prefix>.output.dense."""
    e = spec.embed_dim
    if spec.kdim != e or spec.vdim != e:
        raise ConfigError(f"{source}: a BERT attention block has kdim == vdim == embed_dim ({e})")
    prefix = prefix.rstrip(".")
    names = {"q": "self.query", "k": "self.key", "v": "self.value", "out": "output.dense"}
    w = {n: _expect(state, f"{prefix}.{path}.weight", (e, e), source, spec) for n, path in names.items()}
    b: dict[str, torch.Tensor | None] = {
        n: (_expect(state, f"{prefix}.{path}.bias", (e,), source, spec) if spec.bias else None)
        for n, path in names.items()
    }
    packed = torch.cat([w["q"], w["k"], w["v"]])
    packed_bias = torch.cat([b["q"], b["k"], b["v"]]) if spec.bias else None  # type: ignore[list-item]
    return _split_packed(packed, packed_bias, w["out"], b["out"])


def random_projections(spec: ModelSpec, seed: int) -> Projections:
    """The weights a freshly built torch.nn.MultiheadAttention gets under torch.manual_seed(seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = torch.nn.MultiheadAttention(
            spec.embed_dim, spec.num_heads, bias=spec.bias, kdim=spec.kdim, vdim=spec.vdim, batch_first=True
        )
    return from_torch_state_dict({k: v.detach() for k, v in module.state_dict().items()}, spec, f"seed {seed}")


def host_memory_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_weights_fit(spec: ModelSpec, memory_bytes: int) -> None:
    """Refuses a model whose weights, as float32 while they load, take more than the host's memory:
    torch's allocator failed with a traceback (or, under overcommit, the kernel killed the server later)."""
    e, k, v = spec.embed_dim, spec.kdim, spec.vdim
    need = 4 * (e * (e + k + v) + e * e + (4 * e if spec.bias else 0))
    if need > memory_bytes:
        raise ConfigError(
            f"model {spec.name!r}: its weights take {need / 2**30:,.1f} GiB as float32 (embed_dim {e}, kdim {k}, "
            f"vdim {v}), more than this host's memory ({memory_bytes / 2**30:,.1f} GiB)"
        )


def load_projections(spec: ModelSpec, settings: WeightsSettings) -> Projections | None:
    """The model's weights on the CPU, as stored; None for the bare operation."""
    if spec.kind is ModelKind.SDPA:
        return None
    check_weights_fit(spec, host_memory_bytes())
    if settings.format == "random":
        return random_projections(spec, settings.seed)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    source = f"weights file {settings.path}"
    try:
        state = load_file(settings.path)
    except (OSError, SafetensorError) as exc:
        raise ConfigError(f"{source}: cannot read: {exc}") from None
    if settings.format == "bert":
        return from_bert(state, spec, settings.prefix, source)
    return from_torch_state_dict(state, spec, source)
