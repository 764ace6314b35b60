"""compute/linear.py: oneDNN's packed products against torch's F.linear, and the fall-backs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnserve_server.compute import linear, scripted
from attnserve_server.compute.linear import Linear


def product(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """x W^T + b as the attention paths make it: the layer's operand for x's rows, by compute/scripted.py."""
    weight, onednn = layer.operand(x.numel() // x.shape[-1])
    return scripted._linear(x, weight, layer.bias, onednn)


def onednn_here() -> bool:
    return linear._onednn_ops() is not None


def onednn_multiplies(dtype: torch.dtype) -> bool:
    """Whether this CPU has oneDNN's kernels for `dtype` (bfloat16: AVX512-BW/VL/DQ or AVX-NE-CONVERT)."""
    return dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_products_match_torch_on_any_leading_shape(dtype: torch.dtype, bias: bool) -> None:
    if not onednn_here():
        pytest.skip("this torch build has no oneDNN linear ops")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype) if bias else None
    layer = Linear(w, b)
    assert layer.takes(linear.ONEDNN_MIN_ROWS)
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (0.1, 0.02)
    for shape in [(64, 32), (3, 70, 32), (2, 4, 9, 32)]:  # from ONEDNN_MIN_ROWS rows
        x = torch.randn(*shape, generator=g).to(dtype)
        y = product(layer, x)
        assert y.shape == (*shape[:-1], 48) and y.dtype == dtype
        torch.testing.assert_close(y, F.linear(x, w, b), atol=atol, rtol=rtol)
    # a view with strides (the tiled path's transposed heads, reshaped) gives the same
    x = torch.randn(4, 32, 20, generator=g).to(dtype).transpose(1, 2)
    torch.testing.assert_close(product(layer, x), F.linear(x, w, b), atol=atol, rtol=rtol)
    if onednn_multiplies(dtype):
        assert layer._packed is not None  # packed once, at the first product
    else:  # an AVX2-only CPU (AMD EPYC Zen 2): the first product found out, F.linear from then on
        assert layer._packed is None and not layer.takes(linear.ONEDNN_MIN_ROWS)


def test_aten_and_cuda_weights_multiply_with_torch_and_pack_nothing() -> None:
    w, b = torch.randn(8, 4), torch.randn(8)
    layer = Linear(w, b, "aten")
    x = torch.randn(3, 4)
    assert not layer.takes(linear.ONEDNN_MIN_ROWS)
    torch.testing.assert_close(product(layer, x), F.linear(x, w, b))
    assert layer._packed is None
    with pytest.raises(ValueError, match="cpu_matmul: expected one of auto, onednn, aten, got 'mkl'"):
        Linear(w, b, "mkl")


@pytest.mark.parametrize(
    ("family", "capability", "products"),
    [
        (("AuthenticAMD", 25), "AVX2", "aten"),  # the Zen 3
        (("AuthenticAMD", 25), "AVX512", "onednn"),  # the Zen 4
        (("AuthenticAMD", 23), "AVX2", "onednn"),  # the Zen 2
        (("GenuineIntel", 6), "AVX2", "onednn"),
        (("GenuineIntel", 6), "AVX512", "onednn"),
        (None, "DEFAULT", "onednn"),
    ],
)
def test_auto_multiplies_as_measured_on_each_cpu(
    monkeypatch: pytest.MonkeyPatch, family: tuple[str, int] | None, capability: str, products: str
) -> None:
    """`cpu_matmul: auto` is torch's F.linear where it was measured faster (AMD family 25 without AVX-512, the
    Zen 3) and oneDNN elsewhere; a choice made explicitly stands on any CPU."""
    monkeypatch.setattr(linear, "cpu_family", lambda: family)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert linear.resolve_cpu_matmul("auto") == products
    assert [linear.resolve_cpu_matmul(c) for c in ("onednn", "aten")] == ["onednn", "aten"]
    w, b = torch.randn(8, 4), torch.randn(8)
    assert Linear(w, b, "auto").takes(linear.ONEDNN_MIN_ROWS) == (products == "onednn" and onednn_here())
    assert not Linear(w, b, "aten").takes(linear.ONEDNN_MIN_ROWS)
    assert Linear(w, b, "onednn").takes(linear.ONEDNN_MIN_ROWS) == onednn_here()


def test_a_dtype_onednn_cannot_multiply_here_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuses(weight: torch.Tensor, batch: object) -> torch.Tensor:
        raise RuntimeError("fp16 path needs the cpu support avx_ne_convert or avx512_fp16")

    monkeypatch.setattr(linear, "_onednn_ops", lambda: (refuses, None))
    w, b = torch.randn(8, 4), torch.randn(8)
    layer = Linear(w, b)
    assert layer.takes(linear.ONEDNN_MIN_ROWS)  # until its first product finds out
    x = torch.randn(2, 40, 4)
    torch.testing.assert_close(product(layer, x), F.linear(x, w, b))
    assert not layer.takes(linear.ONEDNN_MIN_ROWS) and layer._packed is None


def test_a_product_of_few_rows_multiplies_with_torch_and_packs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def unused(*args: object) -> torch.Tensor:
        raise AssertionError("oneDNN called for a product of few rows")

    monkeypatch.setattr(linear, "_onednn_ops", lambda: (unused, unused))
    w, b = torch.randn(8, 4), torch.randn(8)
    layer = Linear(w, b)
    assert layer.takes(linear.ONEDNN_MIN_ROWS) and not layer.takes(linear.ONEDNN_MIN_ROWS - 1)
    x = torch.randn(3, 21, 4)  # 63 rows
    torch.testing.assert_close(product(layer, x), F.linear(x, w, b))
    assert layer._packed is None


def test_a_torch_build_without_the_ops_multiplies_with_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    layer = Linear(torch.randn(8, 4), None)
    assert not layer.takes(linear.ONEDNN_MIN_ROWS)
    x = torch.randn(5, 4)
    torch.testing.assert_close(product(layer, x), F.linear(x, layer.weight))
