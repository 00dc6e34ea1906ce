"""A mixture of experts' fused tensors read from a ``save_pretrained`` directory that holds them one per expert.

transformers 5 holds a MoE layer's experts fused (``mlp.experts.gate_up_proj [E, 2f, d]``, ``down_proj [E, d, f]``)
while ``save_pretrained`` and the published checkpoints keep one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight [f, d]``; Mixtral: ``block_sparse_moe.experts.3.w1.weight``). transformers converts
on load by the model's own declared conversions (``conversion_mapping``); here the same declarations map each fused
tensor to the file's tensors, so that :class:`~lightning_par.plugins.pretrained.PretrainedWeights` reads a rank's
slice of a fused tensor -- the experts it holds (``Shard(0)`` over the ep mesh), its rows of each projection
(tensor parallel's ``packed_colwise``) -- from the per-expert tensors alone, reading nothing else.

Only the conversions that stack experts (``MergeModulelist(dim=0)``), then possibly concatenate projections
(``Concatenate(dim=1)``), and those that only rename, are read this way; a file needing any other conversion is left
to the name check, which refuses it naming the tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class FusedTensor:
    """A model tensor ``[E, *rest]`` held by the file as ``parts[p][e]`` (part p of expert e, each ``rest`` with
    dimension 0 -- the fused dimension 1 -- divided by the number of parts)."""

    parts: list[list[str]]
    shape: tuple[int, ...]
    dtype: torch.dtype | None

    def files(self) -> list[str]:
        return [name for part in self.parts for name in part]

    def read(self, piece: Callable[[str, tuple[slice, ...] | None], Tensor],
             slices: tuple[slice, ...] | None) -> Tensor:
        """The fused tensor's part ``slices`` (``None``: all of it) from ``piece(file_name, slices)``, reading only the
        experts and rows in it."""
        slices = slices or tuple(slice(None) for _ in self.shape)
        experts = range(*slices[0].indices(self.shape[0]))
        rows = range(*slices[1].indices(self.shape[1])) if len(self.shape) > 1 else None
        width = self.shape[1] // len(self.parts) if len(self.shape) > 1 else 0
        out = []
        for expert in experts:
            chunks = []
            for index, part in enumerate(self.parts):
                if rows is None:
                    chunks.append(piece(part[expert], None))
                    continue
                lo, hi = max(rows.start, index * width), min(rows.stop, (index + 1) * width)
                if lo < hi:  # this projection's rows within the slice
                    chunks.append(piece(part[expert], (slice(lo - index * width, hi - index * width), *slices[2:])))
            out.append(torch.cat(chunks) if len(chunks) > 1 else chunks[0])
        return torch.stack(out)


def converted_tensors(hf_model: nn.Module, file_names: Iterable[str], shapes: Callable[[str], tuple[int, ...]],
                      dtypes: Callable[[str], torch.dtype | None]) -> dict[str, FusedTensor | str]:
    """The tensors of ``hf_model`` (names relative to it) that the file holds under another name (-> that name) or one
    per expert (-> a :class:`FusedTensor`), by the model's own conversions; empty when transformers declares none for
    it (or is older than 5)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return {}
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    found: dict[str, dict[tuple[int, int], str]] = {}  # target -> (part, expert) -> file name
    sizes: dict[str, int] = {}
    out: dict[str, FusedTensor | str] = {}
    for name in file_names:
        target, pattern = rename_source_key(name, renamings, converters)
        if pattern is None:
            if target != name:  # only renamed (Mixtral's block_sparse_moe.gate -> mlp.gate)
                out[target] = name
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
        if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
            continue  # another conversion: not read here
        renamed = name
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), renamed)
        if match is None:
            continue
        found.setdefault(target, {})[converter.source_patterns.index(pattern), int(match.group(1))] = name
        sizes[target] = len(converter.source_patterns)
    for target, by_index in found.items():
        parts, experts = sizes[target], 1 + max(e for _, e in by_index)
        if set(by_index) != {(p, e) for p in range(parts) for e in range(experts)}:
            continue  # some experts missing: the name check names the fused tensor
        grid = [[by_index[p, e] for e in range(experts)] for p in range(parts)]
        first = shapes(grid[0][0])
        if any(shapes(n) != first for part in grid for n in part):
            continue
        shape = (experts, *first) if not first else (experts, first[0] * parts, *first[1:])
        out[target] = FusedTensor(grid, shape, dtypes(grid[0][0]))
    return out
