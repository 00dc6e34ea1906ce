"""Export a checkpoint to safetensors / a Hugging Face directory, and start a run from such weights under a layout.

(a) In-process (no process group): checkpoints in both formats -- a single-file Lightning checkpoint, and a sharded
    DCP directory written by the engine's own ``sharded_checkpoint.save`` -- of the GPT (tied) and of a tiny HF
    Llama, exported and loaded back with ``safetensors.torch.load_file`` + ``load_state_dict`` or
    ``AutoModelForCausalLM.from_pretrained``: the same logits.
(b) ``load_pretrained`` in one process, and its errors.
(c) Launched: a run started from a locally saved tiny HF model (``FromPretrained``) under a sharded layout; its
    first two steps' losses equal one process's started from the same weights (zero3 in the default run; tp2,
    pp2 with tied embeddings, zero1 and tp2 x pp2 in the full run).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from lightning_par.cli import main as cli_main
from lightning_par.data import TextDataModule
from lightning_par.examples import GPTLightningModule, HFLlamaLightningModule
from lightning_par.plugins import sharded_checkpoint
from lightning_par.plugins.checkpoint_export import (
    export_safetensors,
    load_pretrained,
    parse_size,
    read_hyperparameters,
    read_model_state,
)
from lightning_par.plugins.checkpoint_files import CheckpointError
from tests.harness import TINY_JOB, launch_cli, launch_cli_group, max_rel_diff

HF_CLASS = "lightning_par.examples.HFLlamaLightningModule"
TINY_HF = {"n_layers": 2}  # in-process models: 2 decoder layers of the default width
# the checkpoints here are written by one process without a process group, which DCP warns about
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _built(cls, seed: int, **kwargs):
    torch.manual_seed(seed)
    lm = cls(**kwargs)
    lm.configure_model()
    return lm.eval()


def _save_single_file(lm, path):
    """What Lightning's one-process save holds for the model: state_dict (tied tensors share storage) + hparams."""
    torch.save({"state_dict": lm.state_dict(), "hyper_parameters": dict(lm.hparams), "epoch": 0}, path)


def _save_dcp(lm, path, class_path: str | None = None):
    """The engine's sharded format (DCP + meta.json + manifest), written by one process without a process group."""
    hparams = {**dict(lm.hparams), **({"_class_path": class_path} if class_path else {})}
    checkpoint = {"state_dict": lm.state_dict(), "hyper_parameters": hparams, "epoch": 0, "global_step": 3}
    sharded_checkpoint.save(checkpoint, path, is_writer=True, barrier=lambda: None)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# -- (a) export ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["single_file", "dcp"])
def test_export_gpt_to_safetensors_loads_with_the_same_logits(tmp_path, fmt):
    lm = _built(GPTLightningModule, 0, preset="tiny", n_layers=2, tie_embeddings=True)
    ckpt = tmp_path / "step=3.ckpt"
    (_save_single_file if fmt == "single_file" else _save_dcp)(lm, ckpt)
    report = export_safetensors(ckpt, tmp_path / "gpt.safetensors")
    assert report.prefix == "model"
    state = load_file(tmp_path / "gpt.safetensors")
    assert set(state) == set(lm.model.state_dict())  # the plain model's names, the tied alias kept
    if fmt == "single_file":  # torch.load keeps the tie as shared storage, which safetensors refuses: cloned
        assert report.tied == [["embed.weight", "head.weight"]]
    fresh = _built(GPTLightningModule, 1, preset="tiny", n_layers=2, tie_embeddings=True)
    assert _max_diff(fresh(TOKENS), lm(TOKENS)) > 1e-2  # another init: the comparison below can fail
    fresh.model.load_state_dict(state)  # strict
    assert fresh.model.head.weight is fresh.model.embed.weight  # still tied after loading both names
    assert _max_diff(fresh(TOKENS), lm(TOKENS)) == 0.0


def test_export_through_the_command_casts_and_checks_the_manifest(tmp_path, capsys):
    lm = _built(GPTLightningModule, 0, preset="tiny", n_layers=2)
    ckpt = tmp_path / "last.ckpt"
    _save_dcp(lm, ckpt)
    assert read_hyperparameters(ckpt)["n_layers"] == 2
    with pytest.raises(SystemExit) as err:
        cli_main(["export", str(ckpt), str(tmp_path / "bad.pt")])
    assert err.value.code == 2 and "must end in .safetensors" in capsys.readouterr().out
    cli_main(["export", str(ckpt), str(tmp_path / "bf16.safetensors"), "--dtype", "bf16"])
    state = load_file(tmp_path / "bf16.safetensors")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert _max_diff(state["layers.0.attn.q_proj.weight"], lm.model.get_parameter("layers.0.attn.q_proj.weight")) < 1e-2
    # a shard flipped on disk: refused before anything is read, naming the file
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        read_model_state(ckpt)


@pytest.mark.parametrize("tied", [False, True])
def test_export_hf_directory_loads_with_from_pretrained(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    lm = _built(HFLlamaLightningModule, 0, tie_embeddings=tied, **TINY_HF)
    ckpt = tmp_path / "hf.ckpt"
    _save_dcp(lm, ckpt, class_path=HF_CLASS)  # the Lightning CLI saves the class with the hyper-parameters
    cli_main(["export", str(ckpt), str(tmp_path / "hf_out"), "--hf", "--trust-checkpoint-class"])
    config = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():
        assert _max_diff(model(TOKENS).logits, lm(TOKENS)) <= 1e-6


def test_export_hf_needs_the_model_class_and_casts(tmp_path, capsys):
    lm = _built(HFLlamaLightningModule, 0, **TINY_HF)
    _save_single_file(lm, tmp_path / "one.ckpt")
    with pytest.raises(SystemExit):
        cli_main(["export", str(tmp_path / "one.ckpt"), str(tmp_path / "out"), "--hf"])
    assert "--model-class" in capsys.readouterr().out
    cli_main(["export", str(tmp_path / "one.ckpt"), str(tmp_path / "out"), "--hf", "--model-class", HF_CLASS,
              "--dtype", "bf16"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "out" / "model.safetensors").values()} == {torch.bfloat16}


def _shard_names(directory) -> dict[str, list[str]]:
    """Each weight file of a save_pretrained directory -> the tensor names it holds (read from its header)."""
    from safetensors import safe_open

    names = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names[file.name] = list(handle.keys())  # noqa: SIM118 (a safe_open handle)
    return names


@pytest.mark.parametrize(("fmt", "tied"), [("dcp", False), ("single_file", True)])
def test_export_hf_in_shards_with_the_index_save_pretrained_writes(tmp_path, fmt, tied):
    from transformers import AutoModelForCausalLM

    lm = _built(HFLlamaLightningModule, 0, tie_embeddings=tied, **TINY_HF)
    ckpt = tmp_path / "hf.ckpt"
    if fmt == "dcp":
        _save_dcp(lm, ckpt, class_path=HF_CLASS)
    else:
        _save_single_file(lm, ckpt)
    out = tmp_path / "hf_out"
    command = ["export", str(ckpt), str(out), "--hf", "--model-class", HF_CLASS]
    cli_main(command)  # the default 5GB: one model.safetensors, no index, as save_pretrained writes a small model
    assert sorted(_shard_names(out)) == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
    cli_main([*command, "--max-shard-size", "100KB"])  # into the same directory: the former weight file goes
    files = _shard_names(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    # Hugging Face's own save_pretrained of the same model, split at the same size: the same files and index
    lm.model.save_pretrained(tmp_path / "reference", max_shard_size="100KB")
    reference = json.loads((tmp_path / "reference" / "model.safetensors.index.json").read_text())
    assert index == reference
    assert files == _shard_names(tmp_path / "reference")
    n = len(files)
    assert n >= 4 and sorted(files) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    # every tensor once, in the file the index names; total_size is the tensor bytes of all files
    held = [name for names in files.values() for name in names]
    assert sorted(held) == sorted(index["weight_map"]) and len(held) == len(set(held))
    assert all(name in files[file] for name, file in index["weight_map"].items())
    saved = {k: v for k, v in lm.model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert set(held) == set(saved)  # a tied head is left out, as save_pretrained leaves it out
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in saved.values())
    for file, names in files.items():
        shard = load_file(out / file)
        assert len(names) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= 100_000
        assert all(torch.equal(shard[name], saved[name]) for name in names)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():
        assert _max_diff(model(TOKENS).logits, lm(TOKENS)) <= 1e-6


def test_max_shard_size_values_and_where_the_option_applies(tmp_path, capsys):
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1000") == 1000 and parse_size(" 1.5 kb ") == 1500 and parse_size(123) == 123
    for bad in ("5XB", "-1MB", "0", "MB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    lm = _built(GPTLightningModule, 0, preset="tiny", n_layers=2)
    _save_dcp(lm, tmp_path / "gpt.ckpt")
    with pytest.raises(SystemExit) as err:
        cli_main(["export", str(tmp_path / "gpt.ckpt"), str(tmp_path / "gpt.safetensors"), "--max-shard-size", "1MB"])
    assert err.value.code == 2 and "--max-shard-size applies with --hf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["export", str(tmp_path / "gpt.ckpt"), str(tmp_path / "hf"), "--hf", "--max-shard-size", "5XB"])
    assert "not a size" in capsys.readouterr().err


#: ~35M parameters (132 MiB in fp32) in 75 tensors, the largest 8 MiB: the memory test's model
MEMORY_MODEL = {"vocab_size": 4096, "hidden_size": 512, "intermediate_size": 2048, "n_layers": 8, "n_heads": 16,
                "n_kv_heads": 4, "max_position_embeddings": 256}


@pytest.mark.parametrize(("fmt", "export"), [("dcp", ["--hf", "--model-class", HF_CLASS, "--max-shard-size", "40MB"]),
                                             ("single_file", [])])
def test_export_memory_is_about_the_largest_tensor_not_the_model(tmp_path, fmt, export):
    """The exporter, in a subprocess of its own, measured from after its imports to its peak RSS: it reads, casts and
    writes one tensor at a time, so its extra memory is a fraction of the model's bytes (the export that held the
    whole model took 1.0-1.1x of them)."""
    from benchmarks.export_memory import build_checkpoint, measure_export

    size = build_checkpoint(tmp_path / "ckpt", fmt, MEMORY_MODEL)
    out = tmp_path / ("hf" if "--hf" in export else "model.safetensors")
    result = measure_export([str(tmp_path / "ckpt"), str(out), *export])
    extra = result["extra_bytes"]
    print(f"{fmt} {export}: extra {extra / 2**20:.1f} MiB for a model of {size['model_bytes'] / 2**20:.0f} MiB "
          f"(largest tensor {size['largest_tensor_bytes'] / 2**20:.0f} MiB), {result['seconds']:.1f} s")
    assert result["code"] == 0
    assert extra <= 0.3 * size["model_bytes"], result
    assert extra <= 2 * size["largest_tensor_bytes"] + 24 * 2**20, result
    if "--hf" in export:
        assert len(list(out.glob("model-*-of-*.safetensors"))) == 4  # 132 MiB in files of at most 40 MB


# -- (b) import in one process ---------------------------------------------------------------------------------------
def test_load_pretrained_fills_a_tied_head_and_refuses_a_mismatch(tmp_path):
    source = _built(HFLlamaLightningModule, 0, tie_embeddings=True, **TINY_HF)
    source.model.save_pretrained(tmp_path / "hf")  # a tied model's file lacks lm_head.weight
    target = _built(HFLlamaLightningModule, 1, tie_embeddings=True, **TINY_HF)
    assert load_pretrained(target, tmp_path / "hf") == len(target.model.state_dict())
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    deeper = _built(HFLlamaLightningModule, 1, tie_embeddings=True, n_layers=3)
    before = deeper.model.model.embed_tokens.weight.clone()
    with pytest.raises(CheckpointError, match=r"9 of the model's tensors are not in the file.*layers\.2\."):
        load_pretrained(deeper, tmp_path / "hf")
    assert torch.equal(deeper.model.model.embed_tokens.weight, before)  # checked before anything was copied
    _save_dcp(source, tmp_path / "run.ckpt")
    with pytest.raises(ValueError, match="lightning-par export"):
        load_pretrained(target, tmp_path / "run.ckpt")


# -- (c) a run started from a Hugging Face directory, under a layout ---------------------------------------------
#: layout -> (devices, per-rank batch, strategy arguments, tied embeddings)
LAYOUTS = {
    "zero3": (2, 4, ["--trainer.strategy=zero3"], False),
    "tp2": (2, 8, ["--trainer.strategy=megatron_tp2"], False),
    "pp2_tied": (2, 8, ["--trainer.strategy=pipeline2_1f1b"], True),
    "zero1": (2, 4, ["--trainer.strategy=zero1"], False),
    "tp2_pp2": (4, 8, ["--trainer.strategy=hybrid3d_tp2_pp2"], False),
}
HF_JOB = ["--model=lightning_par.examples.HFLlamaLightningModule", "--model.n_layers=4", "--model.n_kv_heads=2",
          "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--sample_tokens=0"]
STEPS_RTOL = 1e-5


def _pretrained_dir(root, tied: bool):
    """A 'pretrained' tiny Llama saved locally: another seed than the run's, and weights moved off the init."""
    lm = _built(HFLlamaLightningModule, 7, tie_embeddings=tied, n_layers=4, n_kv_heads=2)
    with torch.no_grad():
        for param in lm.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    # in several safetensors shards with their index, as large models are published
    lm.model.save_pretrained(root / "pretrained", max_shard_size="150KB")
    assert (root / "pretrained" / "model.safetensors.index.json").is_file()
    return root / "pretrained"


def _job_value(option: str) -> int:
    """A data setting of the launches' job (``harness.TINY_JOB``), so the reference reads the same batches."""
    return int(next(arg.split("=", 1)[1] for arg in TINY_JOB if arg.startswith(option + "=")))


def _one_process(pretrained, cache_dir, tied: bool) -> tuple[list[float], HFLlamaLightningModule]:
    """The first two steps of one process started from ``pretrained``, on the whole global batch of 8: the losses,
    and the module after them."""
    data = TextDataModule(seq_len=_job_value("--data.seq_len"), max_corpus_bytes=_job_value("--data.max_corpus_bytes"),
                          shuffle=False, batch_size=8, cache_dir=str(cache_dir))
    data.setup("fit")
    batches = iter(data.train_dataloader())
    lm = _built(HFLlamaLightningModule, 0, tie_embeddings=tied, n_layers=4, n_kv_heads=2).train()
    load_pretrained(lm, pretrained)
    optimizer = lm.configure_optimizers()
    losses = []
    for _ in range(2):
        loss = lm.compute_loss(next(batches))
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses, lm.eval()


def _fine_tune_args(layout: str, root) -> list[str]:
    """The fine-tune of ``layout`` from a HF directory made in ``root``, saving its checkpoint into ``root/ckpt``."""
    _, batch, strategy, tied = LAYOUTS[layout]
    tie = ["--model.tie_embeddings=true"] if tied else []
    return [*HF_JOB, *tie, *strategy, f"--data.batch_size={batch}",
            "--trainer.callbacks+=lightning_par.plugins.checkpoint_export.FromPretrained",
            f"--trainer.callbacks.path={_pretrained_dir(root, tied)}",
            "--trainer.enable_checkpointing=true", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            f"--trainer.callbacks.dirpath={root / 'ckpt'}"]


def _check_fine_tune(layout: str, root, run, cache_dir) -> None:
    """The fine-tune's losses are one process's from the same directory; its checkpoint exports with --hf to a
    directory transformers loads, with that process's logits after the same steps."""
    from transformers import AutoModelForCausalLM

    # read into the shards while the layout was applied (not loaded over a random initialisation afterwards)
    assert "pretrained weights: rank 0 read its slices" in run.log
    reference, trained = _one_process(root / "pretrained", cache_dir, LAYOUTS[layout][3])
    losses = run.losses()
    # the run's own init (seed 1234) gives losses 1.6e-2 away: this fails if the weights were not loaded
    assert max_rel_diff(losses, reference) < STEPS_RTOL, (losses, reference)
    (checkpoint,) = (root / "ckpt").glob("*.ckpt")  # the layout's own format, sharded or one file
    # the class the CLI saved with the hyper-parameters, trusted
    cli_main(["export", str(checkpoint), str(root / "exported"), "--hf", "--trust-checkpoint-class"])
    model = AutoModelForCausalLM.from_pretrained(root / "exported").eval()
    with torch.no_grad():
        logits_diff = _max_diff(model(TOKENS).logits, trained(TOKENS))
    print(f"{layout}: losses {losses}, one process {reference}, max rel diff {max_rel_diff(losses, reference):.2e}; "
          f"exported checkpoint's logits vs one process's after 2 steps: {logits_diff:.2e}; launch {run.seconds:.1f} s")
    assert logits_diff < 1e-4


@pytest.mark.launch(ranks=2)
def test_start_from_a_hf_directory_under_zero3(tmp_path, cache_dir):
    run = launch_cli(tmp_path / "run", cache_dir, _fine_tune_args("zero3", tmp_path), devices=2).check()
    _check_fine_tune("zero3", tmp_path, run, cache_dir)


@pytest.fixture(scope="module")
def fine_tunes(tmp_path_factory, cache_dir):
    """``get(layout)``: (its folder, its run) for the full run's layouts, each rank count's in one launch."""
    done: dict[str, tuple] = {}

    def get(layout: str):
        if layout not in done:
            devices = LAYOUTS[layout][0]
            group = tmp_path_factory.mktemp(f"fine_tunes_{devices}")
            names = [n for n in OTHER_LAYOUTS if LAYOUTS[n][0] == devices]
            runs = launch_cli_group(group, cache_dir, {n: _fine_tune_args(n, group / n) for n in names}, devices)
            done.update((n, (group / n, runs[n])) for n in names)
        return done[layout]

    return get


OTHER_LAYOUTS = ["tp2", "pp2_tied", "zero1", "tp2_pp2"]


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("layout", OTHER_LAYOUTS)
def test_start_from_a_hf_directory_under_other_layouts(fine_tunes, cache_dir, layout):
    root, run = fine_tunes(layout)
    _check_fine_tune(layout, root, run, cache_dir)


def test_export_hf_imports_no_class_the_checkpoint_names_unless_told(tmp_path, capsys):
    """A checkpoint naming a module to import (here one whose import would leave a marker) is not imported on its
    word: the error names the class and both ways on; --model-class or --trust-checkpoint-class proceed."""
    lm = _built(HFLlamaLightningModule, 0, **TINY_HF)
    ckpt = tmp_path / "named.ckpt"
    _save_dcp(lm, ckpt, class_path="planted_module.Evil")
    (tmp_path / "planted_module.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(SystemExit) as err:
            cli_main(["export", str(ckpt), str(tmp_path / "out"), "--hf"])
        out = capsys.readouterr().out
        assert err.value.code == 2 and not (tmp_path / "imported").exists()
        assert "'planted_module.Evil'" in out and "--model-class planted_module.Evil" in out
        assert "--trust-checkpoint-class" in out
        cli_main(["export", str(ckpt), str(tmp_path / "out"), "--hf", "--model-class", HF_CLASS])  # the user's class
        assert (tmp_path / "out" / "config.json").is_file() and not (tmp_path / "imported").exists()
        with pytest.raises(SystemExit):  # trusted: imported (the planted class is no LightningModule)
            cli_main(["export", str(ckpt), str(tmp_path / "out"), "--hf", "--trust-checkpoint-class"])
        assert (tmp_path / "imported").exists()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("planted_module", None)


def test_export_refuses_a_one_file_checkpoint_with_one_flipped_byte_naming_it(tmp_path, capsys):
    """A one-file checkpoint saved by lightning-par (AtomicCheckpointIO: its CRC-32 beside it) with one byte of a
    weight flipped: the export stops before writing, naming the file."""
    from lightning_par.plugins.checkpoint_io import AtomicCheckpointIO

    lm = _built(GPTLightningModule, 0, preset="tiny", n_layers=2)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    AtomicCheckpointIO().save_checkpoint({"state_dict": lm.state_dict(), "hyper_parameters": dict(lm.hparams)}, ckpt)
    cli_main(["export", str(ckpt), str(tmp_path / "good.safetensors")])
    weight = lm.state_dict()["model.layers.0.attn.q_proj.weight"]
    data = bytearray(ckpt.read_bytes())
    data[data.find(weight.numpy().tobytes()) + 7] ^= 0x01
    ckpt.write_bytes(bytes(data))
    with pytest.raises(SystemExit) as err:
        cli_main(["export", str(ckpt), str(tmp_path / "bad.safetensors")])
    out = capsys.readouterr().out
    assert err.value.code == 2 and f"{ckpt} is corrupted: its CRC-32 differs" in out
    assert not (tmp_path / "bad.safetensors").exists()
    with pytest.raises(CheckpointError, match=r"epoch=0-step=3\.ckpt is corrupted"):
        read_model_state(ckpt)
