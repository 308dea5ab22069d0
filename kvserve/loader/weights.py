"""Reading safetensors checkpoints and loading tensors into a model by name, strictly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from torch import nn


class WeightLoadError(ValueError):
    pass


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's safetensors files (from the index when there is one)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise WeightLoadError(
                f"Weight file(s) {missing} listed in {index} are missing from {folder}."
            )
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(
            f"No *.safetensors weight files found in {folder}. kvserve loads Hugging Face "
            "checkpoints saved as safetensors."
        )
    return files


def iterate_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class WeightLoader:
    """Copies checkpoint tensors into parameters; fused params take shards
    (``stacked_params``: checkpoint sub-name -> (fused sub-name, shard index)).
    ``finish()`` raises on anything missing, unexpected or mis-shaped, naming the tensors."""

    def __init__(self, model: nn.Module, stacked_params: dict[str, tuple[str, int]]):
        self.model = model
        self.params = dict(model.named_parameters())
        self.stacked = stacked_params
        self.loaded: set[tuple[str, int]] = set()
        self.unexpected: list[str] = []
        self.misshaped: list[str] = []

    def _shard_sizes(self, param_name: str) -> list[int]:
        module = self.model.get_submodule(param_name.rsplit(".", 1)[0])
        return list(module.shard_sizes)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        target, shard = name, -1
        for sub, (fused, idx) in self.stacked.items():
            if f".{sub}." in name:
                target, shard = name.replace(f".{sub}.", f".{fused}."), idx
                break
        param = self.params.get(target)
        if param is None:
            self.unexpected.append(name)
            return
        dest = param.data
        if shard >= 0:
            sizes = self._shard_sizes(target)
            offset = sum(sizes[:shard])
            dest = dest.narrow(0, offset, sizes[shard])
        if tuple(tensor.shape) != tuple(dest.shape):
            self.misshaped.append(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(dest.shape)}"
            )
            return
        dest.copy_(tensor.to(dest.dtype))
        self.loaded.add((target, shard))

    def _checkpoint_names(self, pname: str, shards: list[int]) -> list[str]:
        """The checkpoint tensor names that fill ``shards`` of a (possibly fused) parameter."""
        if shards == [-1]:
            return [pname]
        names = []
        for sub, (fused, idx) in self.stacked.items():
            if idx in shards and f".{fused}." in pname:
                names.append(pname.replace(f".{fused}.", f".{sub}."))
        return names

    def finish(self) -> None:
        missing: list[str] = []
        reported = {m.split(":", 1)[0] for m in self.misshaped}
        for pname in self.params:
            shards = [s for (t, s) in self.loaded if t == pname]
            if hasattr(self.model.get_submodule(pname.rsplit(".", 1)[0]), "shard_sizes") and pname.endswith(
                (".weight", ".bias")
            ) and shards != [-1]:
                n = len(self._shard_sizes(pname))
                absent = sorted(set(range(n)) - set(shards))
            else:
                absent = [] if shards else [-1]
            missing += [m for m in self._checkpoint_names(pname, absent) if m not in reported]
        problems = []
        if self.misshaped:
            problems.append("mis-shaped tensors: " + "; ".join(self.misshaped[:10]))
        if self.unexpected:
            problems.append(f"unexpected tensors (not in the model): {self.unexpected[:10]}")
        if missing:
            problems.append(f"missing tensors: {missing[:10]}")
        if problems:
            arch = type(self.model).__name__
            raise WeightLoadError(f"Checkpoint does not match {arch}: " + " | ".join(problems))
