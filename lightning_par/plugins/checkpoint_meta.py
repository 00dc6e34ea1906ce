"""The entries of Lightning's checkpoint that are not sharded states, stored so that reading them runs no code.

``meta.json`` holds the structure -- epoch, loop counters, callback and LR-scheduler states, hyper-parameters -- as
JSON, readable with any text tool. What JSON cannot hold is listed in ``meta_values.pt`` and referenced from the
JSON: tensors (RNG states, callback scores), numpy arrays (kept as tensors, since ``weights_only`` refuses numpy),
and anything else. That file is read with ``torch.load(weights_only=True)`` unless the caller passes
``weights_only=False``, so an object that could run code when unpickled loads only on request.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_par.plugins.checkpoint_files import CheckpointError, refused, write_synced

META_JSON = "meta.json"
META_VALUES = "meta_values.pt"

# JSON objects that stand for what JSON lacks; a dict using one of these keys is itself stored as "__items__"
_TUPLE, _ITEMS, _VALUE, _NUMPY = "__tuple__", "__items__", "__value__", "__numpy__"
_TAGS = {_TUPLE, _ITEMS, _VALUE, _NUMPY}
_JSON_TYPES = (type(None), bool, int, float, str)


def encode(obj: Any) -> tuple[Any, list[Any], list[dict[str, str]]]:
    """``obj`` as a JSON-able tree, the values the tree refers to, and where each value is and of what type."""
    values: list[Any] = []
    index: list[dict[str, str]] = []

    def value(x: Any, where: str, tag: str = _VALUE) -> dict[str, int]:
        values.append(x)
        index.append({"where": where, "type": f"{type(x).__module__}.{type(x).__qualname__}"})
        return {tag: len(values) - 1}

    def walk(x: Any, where: str) -> Any:
        if type(x) in _JSON_TYPES:
            return x
        if type(x) is list:
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if type(x) is tuple:
            return {_TUPLE: [walk(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, dict):  # OrderedDict, AttributeDict: read back as plain dicts
            if all(type(k) is str for k in x) and not _TAGS & x.keys():
                return {k: walk(v, f"{where}.{k}" if where else k) for k, v in x.items()}
            return {_ITEMS: [[walk(k, where), walk(v, f"{where}[{k!r}]")] for k, v in x.items()]}
        numpy = sys.modules.get("numpy")  # only objects of an imported numpy can be numpy arrays
        if numpy is not None and isinstance(x, numpy.ndarray | numpy.generic) and x.dtype != object:
            return value(torch.from_numpy(numpy.array(x, ndmin=1)), where, _NUMPY) | {"scalar": x.ndim == 0}
        return value(x, where)

    return walk(obj, ""), values, index


def decode(tree: Any, values: list[Any]) -> Any:
    """The object :func:`encode` made ``tree`` and ``values`` of."""
    if isinstance(tree, list):
        return [decode(v, values) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if _TUPLE in tree:
        return tuple(decode(v, values) for v in tree[_TUPLE])
    if _ITEMS in tree:
        return {decode(k, values): decode(v, values) for k, v in tree[_ITEMS]}
    if _VALUE in tree:
        return values[tree[_VALUE]]
    if _NUMPY in tree:
        array = values[tree[_NUMPY]].numpy()
        return array[0] if tree["scalar"] else array
    return {k: decode(v, values) for k, v in tree.items()}


def write(checkpoint: dict[str, Any], root: Path) -> None:
    """Write ``checkpoint`` (Lightning's dict without its sharded states) into the directory ``root``, synced."""
    tree, values, index = encode(checkpoint)
    write_synced(root / META_JSON, json.dumps({"checkpoint": tree, "values": index}, indent=1).encode())
    buffer = io.BytesIO()
    torch.save(values, buffer)
    write_synced(root / META_VALUES, buffer.getvalue())


def read(root: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's checkpoint dict written by :func:`write`. ``weights_only`` (``None`` means ``True``, as in
    ``torch.load``): unpickle only tensors and plain values; ``False`` also other objects -- only for a trusted
    checkpoint."""
    body = json.loads((root / META_JSON).read_text())
    file = root / META_VALUES
    try:
        values = torch.load(file, map_location="cpu", weights_only=weights_only is not False)
    except pickle.UnpicklingError as err:
        objects = [f"{v['where']} ({v['type']})" for v in body["values"] if v["type"] != "torch.Tensor"]
        raise CheckpointError(
            f"{file} holds objects that loading with weights_only=True refuses, since unpickling them can run code: "
            f"{', '.join(objects) or refused(err)}. Load with weights_only=False "
            "(e.g. trainer.fit(..., weights_only=False)) only if you trust this checkpoint."
        ) from err
    return decode(body["checkpoint"], values)
