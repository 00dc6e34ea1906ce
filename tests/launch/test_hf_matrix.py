"""A sample of the conformance matrix (``benchmarks/hf_matrix.py``, docs/models-matrix.md): Hugging Face causal LMs
the other tests never name, built from their config defaults shrunk by one rule, trained through ``Trainer.fit`` under
a layout and compared with one process (plain SGD, per-step losses within 1e-5).

The default set: one 2-rank launch under pp2 of architectures whose causal-LM forward does something after the head
-- Cohere scales the logits, Gemma-2 soft-caps them -- which the last stage runs (their pipeline was refused before,
as "not the chain of its pipeline units"), and whose forward picks each layer's attention by its index in the loop
(Gemma-2 and -3: ``config.layer_types[i]``), which a later stage now iterates with every index kept (Gemma-3 trained
5e-5 off one process before, silently). The full set: a sample of every layout, one launch per layout.
"""

from __future__ import annotations

import json

import pytest

from tests.harness import launch_matrix

transformers = pytest.importorskip("transformers")
hf_matrix = pytest.importorskip("benchmarks.hf_matrix")

#: (layout, architectures): each cell must be at parity
DEFAULT_SAMPLE = {"pp2": ["cohere", "gemma2", "gemma3_text"]}
#: cells that must be refused, with the start of the reason
REFUSED = {("cp2", "llama4_text"): "refused: context parallel: Llama4ForCausalLM uses chunked attention"}
FULL_SAMPLE = {
    "zero3": ["olmo2", "phi3", "starcoder2", "electra", "bert"],  # (ELECTRA and BERT: tied across FSDP2 groups)
    "tp2": ["glm4_moe_lite", "minicpm3", "gemma2", "qwen3_next",  # (MLA; a conv weight read by its parent)
            "mimo_v2_flash", "hy_v4"],  # (local_params: attention sinks split with the heads; with MLA)
    "pp2": ["cohere2", "gpt_oss", "qwen3_next", "deepseek_v3", "phi3"],  # (settings picked by loop index)
    "ep2": ["glm4_moe", "glm4_moe_lite", "gpt_oss"],
    "cp2": ["qwen3", "olmo2", "llama4_text"],
}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, cache_dir):
    """``matrix(layout, archs)``: ``{arch: cell}`` of one launch of the matrix's worker over ``archs``."""
    done: dict[tuple, dict[str, str]] = {}

    def get(layout: str, archs: list[str]) -> dict[str, str]:
        key = (layout, *archs)
        if key not in done:
            root = tmp_path_factory.mktemp(f"hf_matrix_{layout}")  # (a number is appended per launch)
            out = root / "cells.jsonl"
            run = launch_matrix(root, cache_dir, "benchmarks.hf_matrix",
                                ["--worker", layout, "--out", str(out), "--archs", *archs],
                                nproc=hf_matrix.WORLD[layout], timeout=900).check()
            cells = {}
            for line in out.read_text().splitlines():
                record = json.loads(line)
                if not record.get("started"):
                    cells[record["arch"]] = hf_matrix.classify(record, hf_matrix.reference(record["arch"]))
            print(f"{layout}: {len(archs)} architectures in {run.seconds:.1f} s: {cells}")
            done[key] = cells
        return done[key]

    return get


def _cases(sample: dict[str, list[str]], full: bool):
    return [pytest.param(layout, arch, marks=pytest.mark.launch(ranks=hf_matrix.WORLD[layout], full=full),
                         id=f"{layout}-{arch}") for layout, archs in sample.items() for arch in archs]


@pytest.mark.parametrize(("layout", "arch"), _cases(DEFAULT_SAMPLE, False) + _cases(FULL_SAMPLE, True))
def test_an_architecture_no_test_names_trains_as_one_process(matrix, layout, arch):
    sample = DEFAULT_SAMPLE if arch in DEFAULT_SAMPLE.get(layout, ()) else FULL_SAMPLE
    cell = matrix(layout, sample[layout])[arch]
    assert cell.startswith(REFUSED.get((layout, arch), "parity")), cell


@pytest.mark.full
def test_the_tiny_rule_builds_most_causal_lms_and_names_why_not():
    """One rule for every architecture (nothing per architecture): the models it cannot build are listed with the
    reason, not skipped silently. Builds on the meta device only (no memory, no compute)."""
    import torch

    built, not_built = 0, {}
    for model_type, head in sorted(hf_matrix.causal_lms().items()):
        try:
            config = hf_matrix.tiny_config(model_type)
            cls = getattr(transformers, head)
            if not isinstance(config, cls.config_class):
                config = config.get_text_config()
            with torch.device("meta"):
                count = sum(p.numel() for p in cls(config).parameters())
            assert count <= hf_matrix.MAX_PARAMETERS, f"{count} parameters"
            built += 1
        except Exception as err:  # noqa: BLE001 -- the reason is the result
            not_built[model_type] = f"{type(err).__name__}: {err}"[:120]
    print(f"{built} of {built + len(not_built)} causal LMs built tiny; not: {not_built}")
    assert built >= 0.75 * (built + len(not_built)), not_built
