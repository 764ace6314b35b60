"""The one table of tensor datatypes: wire names, sizes and the numpy type that holds their bytes.

Names are KServe v2's (FP32, BF16, ...), which the native API's enum maps onto one to one. Float
types also carry the name used in settings, which is torch's attribute name (float32, bfloat16), so
the compute layer finds its torch dtype from here without a table of its own. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # the wire name: FP32, FP16, BF16, BOOL, INT32, INT64
    itemsize: int
    storage: np.dtype  # holds the little-endian bytes; BF16 as its uint16 bit patterns (numpy has no bf16)
    setting: str | None = None  # float types: the settings name and torch attribute (float32, bfloat16)


FP32 = DType("FP32", 4, np.dtype("<f4"), "float32")
FP16 = DType("FP16", 2, np.dtype("<f2"), "float16")
BF16 = DType("BF16", 2, np.dtype("<u2"), "bfloat16")
BOOL = DType("BOOL", 1, np.dtype("?"))
INT32 = DType("INT32", 4, np.dtype("<i4"))
INT64 = DType("INT64", 8, np.dtype("<i8"))

BY_NAME: dict[str, DType] = {d.name: d for d in (FP32, FP16, BF16, BOOL, INT32, INT64)}
FLOATS: dict[str, DType] = {d.setting: d for d in (FP32, FP16, BF16) if d.setting}  # by settings name
LENGTH_TYPES = ("INT32", "INT64")
