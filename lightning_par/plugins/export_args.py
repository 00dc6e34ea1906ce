"""The ``lightning-par export`` command line: its parser and the sizes it reads, without torch, so that
``lightning-par export --help`` answers at once; the export itself is :mod:`lightning_par.plugins.checkpoint_export`."""

from __future__ import annotations

import argparse
import re

#: --dtype values (checkpoint_export.DTYPES maps them to torch dtypes)
DTYPE_NAMES = ("bf16", "fp16", "fp32")
HF_INDEX = "model.safetensors.index.json"
#: the default largest shard file of an --hf export: huggingface_hub's split_torch_state_dict_into_shards default,
#: which transformers 4's save_pretrained used (transformers 5's defaults to 50GB)
HF_MAX_SHARD_SIZE = "5GB"

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """Bytes of ``size``: an int, or a string of bytes (``"1000000"``) or with a unit: ``"500MB"``, ``"5GB"``
    (powers of 10, as Hugging Face counts), ``"2GiB"`` (powers of 2)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, re.IGNORECASE)
        if match is None:
            raise ValueError(f"{size!r} is not a size: bytes (1000000) or a number with a unit (500MB, 5GB, 2GiB)")
        value = int(float(match[1]) * _SIZE_UNITS[(match[2] or "").upper()])
    if value <= 0:
        raise ValueError(f"{size!r}: a size must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-par export",
        description="Export a lightning-par checkpoint (a sharded directory of any layout, or a single-file "
                    "checkpoint) to the plain model's weights: one .safetensors file, or with --hf a Hugging Face "
                    "save_pretrained directory (weights in shard files with an index). Runs in one process, one tensor "
                    "at a time: the memory is about the largest tensor, not the model.",
        epilog="Start a run from the result under any layout: lightning-par fit ... "
               "--trainer.callbacks+=lightning_par.plugins.checkpoint_export.FromPretrained "
               "--trainer.callbacks.path=OUT",
    )
    parser.add_argument("checkpoint", help="the checkpoint: a directory (sharded layouts) or a .ckpt file")
    parser.add_argument("out", help="OUT.safetensors; OUT.ckpt: one Lightning checkpoint file of the weights (for "
                        "load_from_checkpoint and any strategy's validate/test/predict); or with --hf the directory")
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face save_pretrained directory (config.json + model.safetensors) that "
                             "AutoModelForCausalLM.from_pretrained loads, and the tokenizer of the checkpoint's "
                             "TextDataModule(tokenizer=...) beside it; for a LightningModule holding one "
                             "transformers model")
    parser.add_argument("--prefix", default=None,
                        help="the LightningModule attribute to strip from the names (default: the one first name "
                             "component all entries share, e.g. 'model'); '' keeps the names. Without --hf only.")
    parser.add_argument("--model-class", default=None,
                        help="with --hf: the LightningModule class "
                             "(e.g. lightning_par.examples.HFLlamaLightningModule)")
    parser.add_argument("--trust-checkpoint-class", action="store_true",
                        help="with --hf and no --model-class: import the class the checkpoint names (the Lightning "
                             "CLI saves it with the hyper-parameters); importing a module runs its code, so only for "
                             "a checkpoint from a trusted source")
    parser.add_argument("--hf-original-format", action="store_true",
                        help="with --hf: write the weights as save_pretrained does by default, converted back to the "
                             "layout of the model's published checkpoints (e.g. one tensor per expert where the model "
                             "fuses its experts), the whole model held in memory; default: the model's own tensors "
                             "(fused experts), streamed one at a time, which transformers 5 loads as they are")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                        help="cast floating-point weights to this dtype (default: as saved)")
    parser.add_argument("--max-shard-size", type=_size_argument, default=None,
                        help=f"with --hf: the largest weight file, e.g. 5GB, 500MB, 2GiB or bytes (default: "
                             f"{HF_MAX_SHARD_SIZE}, as Hugging Face splits them); more than one file gets "
                             f"model-00001-of-0000N.safetensors and {HF_INDEX}")
    return parser


def _size_argument(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
