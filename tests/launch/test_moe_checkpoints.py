"""Checkpoints of expert-parallel layouts: the experts saved once each, resumed under another ep size.

Launches of tests/launch/moe_checkpoint_matrix.py (the example MoE GPT, 4 experts top-2, the AdamW job of
tests/launch/reshard_matrix.py: 20 steps, the LR schedule over them, checkpoints at step 10). The default set runs one
2-rank launch: ep2 under ZeRO-1 saves a DCP directory and a layout without experts split (ZeRO-2 dp2) resumes it with
the losses of the uninterrupted ep2 run; its export into one file holds the tensors torch's own DCP reader gives. The
full set adds one process (the reference, and a one-file source), ep2 x expert_dp2 under ZeRO-3, dp2 x tp2 x ep2
under ZeRO-1, ep2 x expert_dp2 under ZeRO-1 and ZeRO-2 (the experts' own partitioner over expert_dp; also under
bf16-mixed, its fp32 masters saved) and pp2 x ep2 (1F1B) as sources, and their resumes into ep4, into ep2 without pp
and into one process, each matching the uninterrupted one-process run from its step (weights, AdamW's moments and
step, the schedule and the data position all move; two resume mid-epoch, from step 5), and the ``export --hf`` of
Hugging Face MoE models (qwen3_moe, mixtral) trained under tp2, and of qwen3_moe trained under ep2, with
``FromPretrained`` of the exported per-expert directory (tests/launch/moe_export_worker.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_par.plugins.checkpoint_export import main as export
from tests.conftest import EPOCH_STEPS, PARITY_STEPS
from tests.harness import Run, launch_matrix, max_rel_diff
from tests.launch.moe_checkpoint_matrix import CASES

RESUME_RTOL = 1e-6
#: the launches, in order; a case's source runs in an earlier launch (or its own)
LAUNCHES = [
    ["ep2_zero1", "ep2_zero1_to_zero2_dp2"],  # the default set's one 2-rank launch
    ["one_process"],
    ["one_process_to_ep2_zero0", "one_process_to_ep2_zero1", "ep2_pp2_to_ep2"],
    ["ep2_zero3_dp4", "ep2_tp2_zero1", "ep2_zero1_mid_to_ep4_zero3", "ep2_zero3_dp4_to_ep4_zero0"],
    ["ep2_zero1_dp4", "ep2_zero2_dp4", "ep2_pp2", "ep2_zero1_dp4_to_ep4_zero1", "ep2_zero2_dp4_to_ep4_zero2",
     "ep2_zero2_dp4_bf16"],
    ["ep2_zero1_mid_to_one_process", "ep2_tp2_zero1_to_one_process", "ep2_zero1_dp4_to_one_process",
     "ep2_zero2_dp4_to_one_process", "ep2_pp2_to_one_process"],
]
#: the 4-rank sources, each expert held by 2 ranks (expert_dp 2, tp 2 or a stage's dp 2)
FOUR_RANK_SOURCES = ("ep2_zero3_dp4", "ep2_tp2_zero1", "ep2_zero1_dp4", "ep2_zero2_dp4", "ep2_pp2")
BF16 = torch.bfloat16
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory, cache_dir):
    """``moe_ckpt(case)``: the Run of a case, its launch (and its sources' launches) made on first use."""
    root = tmp_path_factory.mktemp("moe_ckpt")
    out: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name in out:
            return out[name]
        names = next(group for group in LAUNCHES if name in group)
        sources = {CASES[n].source for n in names} - {None} - set(names)
        args = [arg for source in sorted(sources) for arg in ("--source", f"{source}={get(source).root}")]
        run = launch_matrix(root, cache_dir, "tests.launch.moe_checkpoint_matrix",
                            ["--root", str(root), "--cache", str(cache_dir), "--cases", *names, *args],
                            nproc=CASES[names[0]].devices).check()
        print(f"MoE checkpoint matrix: {len(names)} fits on {CASES[names[0]].devices} rank(s) in {run.seconds:.0f} s")
        out.update({n: Run(root / n, 0, run.log, run.seconds) for n in names})
        return out[name]

    return get


def _expert_chunks(path) -> dict[str, list[tuple[tuple[int, ...], str]]]:
    """Every expert entry of a DCP checkpoint (weights and their optimizer states) -> its stored chunks (offsets,
    and the file -- one per writing rank -- that holds it), from DCP's metadata."""
    metadata = FileSystemReader(str(path)).read_metadata()
    files = {(index.fqn, tuple(index.offset or ())): info.relative_path
             for index, info in metadata.storage_data.items()}
    return {key: sorted((tuple(c.offsets), files[key, tuple(c.offsets)]) for c in entry.chunks)
            for key, entry in metadata.state_dict_metadata.items()
            if any(f".mlp.{w}" in key for w in EXPERT_WEIGHTS) and len(getattr(entry, "size", ())) == 3}


def _expert_coverage(path) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """Every expert entry of a DCP checkpoint -> (its full shape, the fewest and the most stored chunks covering
    any of its elements): (1, 1) is each element saved exactly once."""
    metadata = FileSystemReader(str(path)).read_metadata()
    out = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not (any(f".mlp.{w}" in key for w in EXPERT_WEIGHTS) and len(getattr(entry, "size", ())) == 3):
            continue
        count = torch.zeros(tuple(entry.size), dtype=torch.int32)
        for chunk in entry.chunks:
            count[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))] += 1
        out[key] = (tuple(entry.size), int(count.min()), int(count.max()))
    return out


def _dotted(tree: dict, prefix: str = "") -> dict:
    """A nested state dict's leaves under their dotted keys."""
    out = {}
    for key, value in tree.items():
        out.update(_dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


@pytest.mark.launch(ranks=2)
def test_an_ep2_checkpoint_resumes_without_expert_parallel(moe_ckpt):
    """ep2 under ZeRO-1 (expert_dp 1: the experts' own partitioner holds each rank's experts in one chunk): each
    rank writes its own experts' weights and AdamW moments, the DCP directory says the layout, and ZeRO-2 over the
    same 2 ranks with every expert on each rank continues with the uninterrupted run's losses."""
    source = moe_ckpt("ep2_zero1")
    path = source.checkpoint(EPOCH_STEPS)
    layout = json.loads((path / "meta.json").read_text())["checkpoint"]["lightning_par_layout"]
    assert layout == {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 2, "zero_stage": 1}
    chunks = _expert_chunks(path)
    # 4 layers x 3 weights x (the weight, exp_avg, exp_avg_sq), each as 2 chunks of 2 experts, written by the rank
    # holding them (rank r's file is __r_0.distcp)
    assert len(chunks) == 4 * 3 * 3, sorted(chunks)
    for key, entry in chunks.items():
        assert entry == [((0, 0, 0), "__0_0.distcp"), ((2, 0, 0), "__1_0.distcp")], (key, entry)
    # exported into one process's state dict: torch's own reader of DCP directories gives the same tensors
    export_dir = path.parent.parent / "export"
    assert export([str(path), str(export_dir / "ep2.ckpt")]) == 0
    dcp_to_torch_save(path, export_dir / "dcp.pt")
    exported = torch.load(export_dir / "ep2.ckpt", weights_only=True)["state_dict"]
    expected = torch.load(export_dir / "dcp.pt", weights_only=False)["state_dict"]
    assert exported.keys() == expected.keys() and all(torch.equal(v, expected[k]) for k, v in exported.items())
    assert exported["model.layers.0.mlp.w_gate"].shape == (4, 64, 96)
    resumed = moe_ckpt("ep2_zero1_to_zero2_dp2").losses()
    diff = max_rel_diff(resumed, source.losses()[EPOCH_STEPS:])
    print(f"ep2 ZeRO-1 -> ZeRO-2 dp2: steps {EPOCH_STEPS}-{PARITY_STEPS - 1} within {diff:.2e} of the uninterrupted "
          "run")
    assert len(resumed) == PARITY_STEPS - EPOCH_STEPS and diff <= RESUME_RTOL


@pytest.mark.launch(ranks=4, full=True)
def test_each_expert_is_saved_once_per_replica_group(moe_ckpt):
    """Every expert entry (weights and both AdamW moments) is saved by name in its full shape, each element exactly
    once, by the ranks that hold it. dp2 x tp2 x ep2 (ZeRO-1): the (ep, tp) mesh's tp replicas write each rank's 2
    experts once. ep2 x expert_dp2 under ZeRO-3: each expert module an FSDP2 group on expert_dp, so each rank writes
    1 expert (its rows of its ep rank's 2). Under ZeRO-1/2 with expert_dp 2, and pp2 x ep2 (ZeRO-1), the experts'
    own partitioner cuts each rank's experts into flat chunks over their 2 replicas: saved as those chunks' blocks."""
    chunks = _expert_chunks(moe_ckpt("ep2_tp2_zero1").checkpoint(EPOCH_STEPS))
    assert len(chunks) == 4 * 3 * 3, sorted(chunks)
    for key, entry in chunks.items():
        assert [offsets for offsets, _ in entry] == [(0, 0, 0), (2, 0, 0)], (key, entry)
    chunks = _expert_chunks(moe_ckpt("ep2_zero3_dp4").checkpoint(EPOCH_STEPS))
    for key, entry in chunks.items():  # ranks (expert_dp, ep): rank 1 is expert_dp 0 of ep 1 (experts 2 and 3)
        assert entry == [((e, 0, 0), f"__{rank}_0.distcp") for e, rank in enumerate((0, 2, 1, 3))], (key, entry)
    for name in FOUR_RANK_SOURCES:
        coverage = _expert_coverage(moe_ckpt(name).checkpoint(EPOCH_STEPS))
        # 4 layers x 3 weights x (the weight, exp_avg, exp_avg_sq), 4 experts of 64 x 96 (w_down 96 x 64)
        assert len(coverage) == 4 * 3 * 3, (name, sorted(coverage))
        for key, (shape, least, most) in coverage.items():
            assert shape[0] == 4 and sorted(shape[1:]) == [64, 96] and (least, most) == (1, 1), (name, key, shape)


@pytest.mark.launch(ranks=4, full=True)
def test_the_experts_fp32_masters_are_saved_under_bf16(moe_ckpt, tmp_path):
    """ep2 x expert_dp2, ZeRO-2, bf16-mixed: the experts' partitioner holds fp32 masters apart from its bf16 buckets;
    the checkpoint holds the masters (fp32 values bf16 cannot represent) and their fp32 AdamW moments, each element
    once, in the full shape."""
    path = moe_ckpt("ep2_zero2_dp4_bf16").checkpoint(EPOCH_STEPS)
    coverage = _expert_coverage(path)
    assert len(coverage) == 4 * 3 * 3 and {c[1:] for c in coverage.values()} == {(1, 1)}, coverage
    dcp_to_torch_save(path, tmp_path / "bf16.pt")
    saved = _dotted(torch.load(tmp_path / "bf16.pt", weights_only=False))
    weights = {k: v for k, v in saved.items() if k.startswith("state_dict.") and k.split(".")[-1] in EXPERT_WEIGHTS}
    moments = {k: v for k, v in saved.items() if any(f".mlp.{w}.exp_avg" in k for w in EXPERT_WEIGHTS)}
    assert len(weights) == 4 * 3 and len(moments) == 4 * 3 * 2, (sorted(weights), sorted(saved))
    for name, value in weights.items():
        assert value.dtype == torch.float32 and value.shape[0] == 4, (name, value.dtype, value.shape)
        assert not torch.equal(value, value.to(BF16).float()), name  # a master, not its bf16 bucket
    assert all(value.dtype == torch.float32 and value.shape[0] == 4 for value in moments.values())


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", ["ep2_zero1", *FOUR_RANK_SOURCES])
def test_the_sources_match_one_process(moe_ckpt, name):
    diff = max_rel_diff(moe_ckpt(name).losses(), moe_ckpt("one_process").losses())
    print(f"{name}: 20 steps within {diff:.2e} of one process")
    assert len(moe_ckpt(name).losses()) == PARITY_STEPS and diff <= 1e-5


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case.source is not None
                                  and n != "ep2_zero1_to_zero2_dp2"])
def test_an_expert_checkpoint_resumes_under_another_ep_size(moe_ckpt, name):
    """ep2 -> ep4 (ZeRO-3 from mid-epoch, step 5; ZeRO-0), ep2 (mid-epoch) and dp2 x tp2 x ep2 -> one process, one
    file -> ep2; ep2 x expert_dp2 at ZeRO-1 and ZeRO-2 -> ep4 (same stage) and -> one process; pp2 x ep2 (1F1B) ->
    one process and -> ep2 without pp: the losses from the checkpoint's step on are those of the uninterrupted
    one-process run."""
    at = CASES[name].at
    resumed = moe_ckpt(name).losses()
    diff = max_rel_diff(resumed, moe_ckpt("one_process").losses()[at:])
    print(f"{name}: steps {at}-{PARITY_STEPS - 1} within {diff:.2e} of one process")
    assert len(resumed) == PARITY_STEPS - at and diff <= RESUME_RTOL


@pytest.mark.launch(ranks=2, full=True)
def test_hf_moe_export_loads_in_transformers_with_equal_logits(tmp_path, cache_dir):
    """``export --hf`` of a tp2 checkpoint of qwen3_moe and mixtral writes the model's own fused expert tensors (by
    default) or save_pretrained's one tensor per expert (``--hf-original-format``); ``from_pretrained`` of either
    holds exactly the checkpoint's weights, and its logits are those of one process trained on the same batches.
    ``FromPretrained`` of the per-expert directory starts tp2 and ZeRO-3 runs with one process's losses."""
    archs = ["qwen3_moe", "mixtral"]
    run = launch_matrix(tmp_path, cache_dir, "tests.launch.moe_export_worker", [str(tmp_path), *archs],
                        nproc=2).check()
    print(f"export --hf of {archs} from tp2: {run.seconds:.0f} s")
    for arch in archs:
        result = json.loads((tmp_path / f"{arch}.json").read_text())
        fused, original = result["names"]["fused"], result["names"]["original"]
        # 4 experts of 2 x 32 gate/up rows and 32 down columns on 64 features, as the model holds them
        assert fused["model.layers.0.mlp.experts.gate_up_proj"] == [4, 64, 64], (arch, sorted(fused))
        assert fused["model.layers.0.mlp.experts.down_proj"] == [4, 64, 32]
        assert not any(".experts.0." in name for name in fused)
        per_expert = [name for name in original if ".layers.0." in name and ".experts.3." in name]
        assert len(per_expert) == 3 and not any("gate_up_proj" in name for name in original), (arch, per_expert)
        assert result["weights_not_equal"] == {"fused": [], "original": []}, (arch, result["weights_not_equal"])
        for style, diffs in result["logits"].items():
            print(f"{arch} {style}: logits within {diffs['vs_dcp_reader']:.1e} of the checkpoint's weights, "
                  f"{diffs['vs_one_process']:.1e} of one process (logits up to {result['logit_scale']:.2f})")
            assert diffs["vs_dcp_reader"] <= 1e-6 and diffs["vs_one_process"] <= 1e-5, (arch, style, diffs)
        # fine-tuning from the per-expert directory: FromPretrained under tp2 and ZeRO-3 reads the fused experts
        losses = json.loads((tmp_path / f"{arch}_pretrained.json").read_text())
        for layout in ("tp2", "zero3"):
            diff = max_rel_diff(losses[layout], losses["one_process"])
            print(f"{arch} from the per-expert directory under {layout}: losses within {diff:.1e} of one process "
                  f"(from its own init: {max_rel_diff(losses['not_loaded'], losses['one_process']):.1e})")
            assert diff <= 1e-5, (arch, layout, losses)
        assert max_rel_diff(losses["not_loaded"], losses["one_process"]) > 1e-3  # the weights were read


@pytest.mark.launch(ranks=2, full=True)
def test_an_ep2_hf_moe_checkpoint_exports_and_fine_tunes_under_ep2(tmp_path, cache_dir):
    """qwen3_moe trained under ep2 (ZeRO-1: each rank 2 of the 4 experts, their AdamW state in the experts' own
    partitioner): ``export --hf`` of its DCP checkpoint loads in ``from_pretrained`` with the checkpoint's weights and
    logits (1e-6), those of one process trained on the same batches; ``FromPretrained`` of the per-expert directory
    into ep2 reads on each rank only its experts' tensors and starts at one process's losses."""
    arch = "qwen3_moe"
    run = launch_matrix(tmp_path, cache_dir, "tests.launch.moe_export_worker", [str(tmp_path), "--ep2", arch],
                        nproc=2).check()
    print(f"export --hf of {arch} from ep2: {run.seconds:.0f} s")
    result = json.loads((tmp_path / f"{arch}_ep2.json").read_text())
    assert result["names"]["fused"]["model.layers.0.mlp.experts.gate_up_proj"] == [4, 64, 64]
    assert result["weights_not_equal"] == {"fused": [], "original": []}, result["weights_not_equal"]
    for style, diffs in result["logits"].items():
        print(f"{arch} ep2 {style}: logits within {diffs['vs_dcp_reader']:.1e} of the checkpoint's weights, "
              f"{diffs['vs_one_process']:.1e} of one process (logits up to {result['logit_scale']:.2f})")
        assert diffs["vs_dcp_reader"] <= 1e-6 and diffs["vs_one_process"] <= 1e-5, (style, diffs)
    losses = json.loads((tmp_path / f"{arch}_ep2_pretrained.json").read_text())
    diff = max_rel_diff(losses["ep2"], losses["one_process"])
    print(f"{arch} from the per-expert directory under ep2: losses within {diff:.1e} of one process")
    assert len(losses["ep2"]) == len(losses["one_process"]) and diff <= 1e-5, losses
    assert max_rel_diff(losses["not_loaded"], losses["one_process"]) > 1e-3  # the weights were read
    # 2 layers x 3 projections per expert, one tensor each in save_pretrained's format: rank r read experts 2r, 2r + 1
    per_expert = 64 * 32 * 4  # (gate, up: 32 x 64; down: 64 x 32) fp32
    for rank in (0, 1):
        reads = json.loads((tmp_path / f"{arch}_ep2_reads_rank{rank}.json").read_text())
        experts = {int(name.split(".experts.")[1].split(".")[0]) for name in reads}
        assert experts == {2 * rank, 2 * rank + 1}, (rank, sorted(reads))
        assert len(reads) == 2 * 3 * 2 and set(reads.values()) == {per_expert}, (rank, reads)


def test_hf_original_format_applies_with_hf_only(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        export([str(tmp_path / "ckpt"), str(tmp_path / "out.ckpt"), "--hf-original-format"])
    assert exit_.value.code == 2 and "--hf-original-format applies with --hf" in capsys.readouterr().err
