"""A minimal `torch` for importing slime's modules where torch is not installed: numpy arrays behind
`torch.Tensor`, and only what the tests call through slime (`tensor`, `as_tensor`, `cat`, `frombuffer`,
`is_tensor`, dtypes, a tensor's `numel`, `reshape`, `new_full`, `std`, `detach().cpu().tolist()`,
`to(...)`). Tensor semantics beyond those are not promised."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

__all__ = ["TORCH_PATH", "fill_torch", "install_torch_standin", "real_slime", "slime_dir_or_skip"]

# A folder holding an importable `torch` package (the stand-in), for the PYTHONPATH of processes a tier test
# starts (the server running slime's generator example); never on the test process's own path.
TORCH_PATH = Path(__file__).parent / "torch_path"


class Tensor(np.ndarray):
    """A numpy array that answers the tensor methods slime calls."""

    def numel(self) -> int:
        return int(self.size)

    def detach(self) -> "Tensor":
        return self

    def cpu(self) -> "Tensor":
        return self

    def contiguous(self) -> "Tensor":
        return self

    def to(self, device: Any = None, dtype: Any = None) -> "Tensor":
        return self if dtype is None else _tensor(self, dtype)

    def new_full(self, shape: tuple[int, ...], value: Any) -> "Tensor":
        return np.full(shape, value, dtype=self.dtype).view(Tensor)

    def std(self, *args: Any, **kwargs: Any) -> Any:  # torch's default is the unbiased estimate
        return np.asarray(self).std(ddof=1)


def _tensor(data: Any, dtype: Any = None, **_: Any) -> Tensor:
    return np.array(np.asarray(data), dtype=dtype).view(Tensor)


def _as_tensor(data: Any, dtype: Any = None, **_: Any) -> Tensor:
    return np.asarray(data, dtype=dtype).view(Tensor)


def _cat(tensors: Any, dim: int = 0) -> Tensor:
    return np.concatenate([np.asarray(t) for t in tensors], axis=dim).view(Tensor)


def _frombuffer(buffer: Any, dtype: Any) -> Tensor:
    return np.frombuffer(buffer, dtype=dtype).view(Tensor)


def install_torch_standin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Put the stand-in at `sys.modules["torch"]` (undone by `monkeypatch`), unless a real torch is there."""
    if "torch" in sys.modules and not getattr(sys.modules["torch"], "IS_STANDIN", False):
        return sys.modules["torch"]
    torch = fill_torch(types.ModuleType("torch"))
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def fill_torch(torch: types.ModuleType) -> types.ModuleType:
    """Give a module the stand-in's names (also the body of `torch_path/torch`, for child processes)."""
    torch.IS_STANDIN = True  # type: ignore[attr-defined]
    torch.Tensor = Tensor  # type: ignore[attr-defined]
    torch.Size = tuple  # type: ignore[attr-defined]
    torch.dtype = np.dtype  # type: ignore[attr-defined]
    for name, kind in (("int32", np.int32), ("int64", np.int64), ("long", np.int64), ("int", np.int32),
                       ("float32", np.float32), ("float64", np.float64), ("float", np.float32), ("bool", np.bool_)):
        setattr(torch, name, kind)
    torch.tensor, torch.as_tensor, torch.cat = _tensor, _as_tensor, _cat  # type: ignore[attr-defined]
    torch.frombuffer = _frombuffer  # type: ignore[attr-defined]
    torch.is_tensor = lambda value: isinstance(value, Tensor)  # type: ignore[attr-defined]
    return torch


def slime_dir_or_skip() -> str:
    """`$SLIME_DIR` (a checkout of slime's repository), or skip the test saying why."""
    import os

    path = os.environ.get("SLIME_DIR")
    if not path or not os.path.isdir(os.path.join(path, "slime")):
        pytest.skip("SLIME_DIR is not set to a checkout of slime's repository (slime is not on PyPI); the "
                    "always-on contract tests cover the same fields")
    return path


def real_slime(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fixture body: slime's `Sample` and output classes from `$SLIME_DIR` (the test is skipped without
    it), torch stood in; slime's modules are forgotten again afterwards."""
    from types import SimpleNamespace

    path = slime_dir_or_skip()
    install_torch_standin(monkeypatch)
    monkeypatch.syspath_prepend(path)
    import slime.rollout.base_types as base_types
    import slime.utils.types as types_module

    yield SimpleNamespace(Sample=types_module.Sample, base_types=base_types)
    for name in [n for n in sys.modules if n == "slime" or n.startswith(("slime.", "slime_plugins"))]:
        del sys.modules[name]
