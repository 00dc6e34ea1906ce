"""Pipeline parallel on models that declare nothing: Hugging Face Llama, Qwen2 and Mistral from their own
``base_model_pp_plan``, and a plain model keeping its blocks in an ``nn.ModuleList``.

One 2-rank launch of ``tests/launch/pipeline_any_model.py`` trains every case for 20 fp32 steps next to one process on
the same batches (at the runtime level, as the engine builds it, and through ``Trainer.fit``); the tests here read its
numbers. The rest runs in this process: stage surgery, parameter names, batch forms and their errors.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_par.parallel.blocks import find_blocks
from lightning_par.parallel.pipeline.adapter import stage_forward, stage_io
from lightning_par.parallel.pipeline.batches import split_batch
from lightning_par.parallel.pipeline.split import KeptModuleList, RemovedUnit, plan_stages, split_model
from lightning_par.topology import LayoutError
from tests.harness import launch_matrix, max_rel_diff
from tests.launch.pipeline_any_model import CASES, FIT_CASES, STEPS

pytest.importorskip("transformers")

PARITY_RTOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory, cache_dir) -> dict:
    root = tmp_path_factory.mktemp("pipeline_any_model")
    out = root / "results.json"
    run = launch_matrix(root, cache_dir, "tests.launch.pipeline_any_model",
                        ["--out", str(out), "--cache", str(cache_dir)], nproc=2, timeout=300).check()
    print(f"pipeline_any_model launch: {run.seconds:.1f} s")
    return json.loads(out.read_text())


# -- parity with one process (2 ranks) -----------------------------------------------------------------------------
@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process(results, name):
    result = results[name]
    diff = max_rel_diff(result["pipeline"], result["reference"])
    print(f"{name}: max relative per-step train loss difference {diff:.2e} over {STEPS} steps "
          f"({result['reference'][0]:.3f} -> {result['reference'][-1]:.3f}), {result['seconds']:.1f} s")
    assert len(result["pipeline"]) == STEPS and diff <= PARITY_RTOL
    assert result["reference"][-1] < result["reference"][0] - 1.0, "the model must learn for parity to mean much"


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("name", list(FIT_CASES))
def test_trainer_fit_through_the_engine_matches_one_process(results, name):
    """``Trainer.fit`` with ``PipelineStrategy(pp=2)``: the engine finds the units itself, splits dict batches from
    ``TextDataModule(batch_format="dict")``, and validates through the stages."""
    result = results[name]
    diff = max_rel_diff(result["pipeline"], result["reference"])
    val = max_rel_diff(result["val"], result["reference_val"])
    print(f"{name}: train {diff:.2e}, val {val:.2e} ({result['val']}), {result['seconds']:.1f} s")
    assert len(result["pipeline"]) == STEPS and diff <= PARITY_RTOL
    assert len(result["val"]) == 2 and val <= PARITY_RTOL


@pytest.mark.launch(ranks=2)
def test_stages_keep_the_unsplit_parameter_names(results):
    """What each rank holds, by name, is a partition of the unsplit model's parameters (the tied head and
    embedding are two names of one tensor, on different ranks)."""
    for name, result in results.items():
        if "rank_names" not in result:
            continue
        ranks = [set(names) for names in result["rank_names"]]
        assert ranks[0].isdisjoint(ranks[1]), name
        assert ranks[0] | ranks[1] == set(result["reference_names"]), name


@pytest.mark.launch(ranks=2)
def test_hugging_face_units_come_from_its_plan(results):
    result = results["llama_1f1b"]
    assert "base_model_pp_plan" in result["source"]
    assert result["units_by_stage"] == [["model.embed_tokens", "model.layers.0", "model.layers.1"],
                                        ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]]
    assert results["plain_interleaved_1f1b"]["units_by_stage"] == [["emb", "pos", "blocks.0"], ["blocks.1"],
                                                                   ["blocks.2"], ["blocks.3", "norm", "head"]]


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.evaluate])
def test_forward_only_matches_after_training(results, name):
    """Forward-only loss, and the LightningModule's own forward (``self.model(input_ids=...).logits`` for a
    Hugging Face model) through the pipeline, against the one-process model after the same 20 steps."""
    result = results[name]
    pipeline, reference = result["eval_loss"]
    assert abs(pipeline - reference) / reference <= PARITY_RTOL
    assert result["logits_shape"][0] == 8
    assert result["logits_max_abs_diff"] <= 1e-5 * max(1.0, result["logits_max_abs"])


@pytest.mark.launch(ranks=2)
def test_padded_batches_pass_the_mask_to_every_stage(results):
    """Left padding with a mask that matters (the loss without it differs by more than 1%), and parity at 1e-5: each
    stage's attention got its micro-batch of the mask."""
    result = results["qwen2_padded_interleaved_1f1b"]
    masked, _ = result["eval_loss"]
    assert abs(result["eval_loss_unmasked"] - masked) / masked > 0.01
    assert max_rel_diff(result["pipeline"], result["reference"]) <= PARITY_RTOL


@pytest.mark.launch(ranks=2)
def test_dict_batches_train_the_same_targets_as_tuples(results):
    """A dict batch's labels are shifted like Hugging Face's loss shifts them: the same run as tuple batches."""
    assert max_rel_diff(results["llama_dict_1f1b"]["reference"], results["llama_1f1b"]["reference"]) <= PARITY_RTOL


@pytest.mark.launch(ranks=2)
def test_runtime_errors_are_clear(results):
    padded, unknown_kwarg = results["plain_1f1b"]["errors"]
    assert padded.startswith("LayoutError: this batch has an attention_mask with zeros (padding), but "
                             "PlainLM.forward takes no `attention_mask`")
    assert unknown_kwarg.startswith("TypeError: the pipeline's forward takes the model's inputs") \
        and "['position_ids']" in unknown_kwarg


# -- in this process: the stages themselves ------------------------------------------------------------------------
def hf_model(arch: str, tied: bool = False, n_layers: int = 4) -> nn.Module:
    import transformers

    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM")}[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(vocab_size=64, hidden_size=32, num_hidden_layers=n_layers,
                                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                               max_position_embeddings=64, tie_word_embeddings=tied)
    return getattr(transformers, model_cls)(config).eval()


def run_in_sequence(model: nn.Module, stages: list[nn.Module], plan: list[list[str]], ids: torch.Tensor,
                    mask=None) -> torch.Tensor:
    io, x = stage_io(model), ids
    for i, stage in enumerate(stages):
        stage.forward = stage_forward(stage, io, first=i == 0, entry=stage.get_submodule(plan[i][0]))
        kwargs = {} if mask is None else {"attention_mask": mask}
        x = stage(x, **kwargs, **({"model_inputs": ids} if io.inject else {}))
    return x


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("n_stages", [2, 7])
def test_hugging_face_stage_names_are_the_unsplit_names(arch, n_stages):
    """Each stage's state_dict keys are the unsplit model's (what ``from_pretrained`` reads), with the same values,
    and together the stages hold every parameter once; the stages in sequence give the model's logits."""
    model = hf_model(arch)
    units = list(find_blocks(model).units)
    assert units == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3",
                     "model.norm", "lm_head"]
    plan = plan_stages(model, n_stages, units=units)
    stages = split_model(model, n_stages, list(range(n_stages)), units_by_stage=plan, units=units)
    full = model.state_dict()
    held: list[str] = []
    for stage in stages:
        state = stage.state_dict()
        assert set(state) <= set(full)
        assert all(torch.equal(state[k], full[k]) for k in state)
        held += [n for n, _ in stage.named_parameters()]
    assert sorted(held) == sorted(n for n, _ in model.named_parameters())
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(run_in_sequence(model, stages, plan, ids), model(input_ids=ids).logits)


@pytest.mark.parametrize("tied", [False, True])
def test_hugging_face_stages_with_padding_mask_and_tied_embeddings(tied):
    model = hf_model("qwen2", tied=tied)
    units = list(find_blocks(model).units)
    plan = plan_stages(model, 3, units=units)
    stages = split_model(model, 3, [0, 1, 2], units_by_stage=plan, units=units)
    if tied:
        assert stages[0].model.embed_tokens.weight is not stages[2].lm_head.weight, "each stage its own copy"
        assert torch.equal(stages[0].model.embed_tokens.weight, stages[2].lm_head.weight)
    ids = torch.randint(1, 64, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(run_in_sequence(model, stages, plan, ids, mask), expected)
        assert not torch.allclose(run_in_sequence(model, stages, plan, ids), expected), "the mask must matter"


def test_removed_units_of_a_hugging_face_model():
    model = hf_model("llama")
    units = list(find_blocks(model).units)
    middle = split_model(model, 4, 1, units=units)  # holds model.layers.1 only
    assert isinstance(middle.model.embed_tokens, RemovedUnit) and isinstance(middle.lm_head, RemovedUnit)
    assert isinstance(middle.model.layers, KeptModuleList)
    assert middle.model.layers.kept_indices() == [1]
    assert middle.model.rotary_emb is not None, "modules outside every unit stay on every stage"
    names = [n for n, _ in middle.named_parameters()]
    assert names[0] == "model.layers.1.self_attn.q_proj.weight" and all(n.startswith("model.layers.1.") for n in names)
    assert model.model.layers.__class__ is nn.ModuleList, "the model itself is left unchanged"


def test_kept_module_list_keeps_indices():
    blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(5)])
    items = list(blocks)
    kept = KeptModuleList.convert(blocks)
    del kept[0]
    del kept[3]
    assert list(kept._modules) == ["1", "2", "4"] and list(kept) == [items[1], items[2], items[4]]
    assert len(kept) == 3 and kept[4] is items[4] and kept[-1] is items[4]
    assert kept[:5] is kept and kept[: len(items)] is kept, "a slice covering every kept item is the list itself"
    part = kept[:3]
    assert list(part._modules) == ["1", "2"] and part[2] is items[2]
    with pytest.raises(IndexError, match=r"index 3 is not held by this pipeline stage.*indices \[1, 2, 4\]"):
        kept[3]
    assert [n for n, _ in kept.named_parameters()][0] == "1.weight"
    kept.append(nn.Linear(2, 2))
    assert list(kept._modules) == ["1", "2", "4", "5"]
    with pytest.raises(TypeError, match="cannot insert"):
        kept.insert(0, nn.Linear(2, 2))
    assert repr(kept).startswith("KeptModuleList(of 6\n  (1): Linear")


class PositionalLM(nn.Module):
    """Token and learned position embeddings summed inside the forward, as nanoGPT / GPT-2 do: not a chain."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(16, 8), nn.Embedding(16, 8)
        self.drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.head = nn.Linear(8, 16)

    def forward(self, tokens):
        h = self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.size(1))) * 2.0)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


@pytest.mark.parametrize("n_stages", [2, 3, 6])
def test_a_plain_model_whose_embeddings_are_not_a_chain(n_stages):
    """A later stage runs the forward on the tokens, the embeddings before it give zeros of their shapes, and its
    first unit gets the received activation instead: the stages in sequence give the model's output."""
    torch.manual_seed(0)
    model = PositionalLM()
    units = list(find_blocks(model).units)
    assert units == ["wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    plan = plan_stages(model, n_stages, units=units)
    stages = split_model(model, n_stages, list(range(n_stages)), units_by_stage=plan, units=units)
    last = stages[-1]
    assert isinstance(last.wpe, RemovedUnit) and last.wpe.mode == "shape" and not list(last.wpe.parameters())
    assert isinstance(stages[0].head, RemovedUnit) and stages[0].head.mode == "pass"
    ids = torch.randint(0, 16, (3, 5))
    with torch.no_grad():
        torch.testing.assert_close(run_in_sequence(model, stages, plan, ids), model(ids))


def test_a_removed_unit_after_the_stage_called_on_integers_fails_clearly():
    with pytest.raises(LayoutError, match=r"pipeline unit 'head' is held by another stage but was called here with a "
                                          r"torch.int64 tensor.*as a chain"):
        RemovedUnit("head")(torch.zeros(2, 5, dtype=torch.long))


def test_explicit_units_in_a_sequential_keep_their_indices():
    """Units found in an nn.Sequential (``block_types=``): a removed item is replaced in its slot, so the kept ones
    keep their names and the Sequential still runs them in order; a ``pipeline_units()`` declaration still needs an
    nn.ModuleDict."""
    model = nn.Module()
    model.blocks = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    first, second = (split_model(model, 2, i, units=["blocks.0", "blocks.1"]) for i in (0, 1))
    assert [n for n, _ in first.named_parameters()] == ["blocks.0.weight", "blocks.0.bias"]
    assert [n for n, _ in second.named_parameters()] == ["blocks.1.weight", "blocks.1.bias"]
    x = torch.randn(3, 2)
    assert torch.equal(first.blocks(x), model.blocks[0](x))  # the removed item after it passes its input through
    assert torch.equal(second.blocks[1](first.blocks(x)), model.blocks(x))  # (stage 1 is fed at its first unit)
    model.pipeline_units = lambda: ["blocks.0", "blocks.1"]
    with pytest.raises(LayoutError, match=r"'blocks.0' sits in an Sequential.*nn.ModuleDict"):
        split_model(model, 2, 0)


# -- batches -------------------------------------------------------------------------------------------------------
def test_split_batch_forms():
    ids = torch.arange(12).view(2, 6)
    inputs, targets = split_batch((ids, ids + 1))
    assert inputs is ids and torch.equal(targets, ids + 1)
    labels = ids.clone()
    labels[0, :2] = -100
    inputs, targets = split_batch({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    assert inputs is ids, "an all-ones mask is dropped"
    assert targets.tolist() == [[-100, 2, 3, 4, 5, -100], [7, 8, 9, 10, 11, -100]], "Hugging Face's label shift"
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    inputs, _ = split_batch({"input_ids": ids, "labels": labels, "attention_mask": mask})
    assert set(inputs) == {"input_ids", "attention_mask"} and inputs["attention_mask"] is mask


@pytest.mark.parametrize(
    "batch,match",
    [
        (torch.zeros(2, 3), r"cannot split a batch of type Tensor into micro-batches: it accepts a tuple \(inputs, "
                            r"targets\) of two tensors, or \(inputs, targets, position_ids\) of packed documents or a "
                            r"dict with 'input_ids' and 'labels'"),
        ((torch.zeros(2), torch.zeros(2), torch.zeros(2)), r"position_ids \(\(2,\)\) must be integer positions shaped "
                                                           r"like its token ids"),
        ((torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(2)), r"cannot split a tuple of 4"),
        ({"input_ids": torch.zeros(2, 3)}, r"a dict batch without 'labels' tensors \(its keys: \['input_ids'\]\)"),
        ({"text": ["a"]}, r"without 'input_ids' and 'labels'"),
        ({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2, 3), "token_type_ids": torch.zeros(2, 3)},
         r"also has \['token_type_ids'\]"),
        ({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2, 4)},
         r"labels has shape \(2, 4\) but its input_ids \(2, 3\)"),
    ],
)
def test_a_batch_the_pipeline_cannot_split_fails_clearly(batch, match):
    with pytest.raises(LayoutError, match=match):
        split_batch(batch)


def test_text_data_module_dict_batches_and_the_hugging_face_module_takes_both():
    from lightning_par.data import TextDataModule, collate_hf_dict, collate_pairs
    from lightning_par.examples import HFCausalLMLightningModule, HFLlamaLightningModule

    blocks = torch.randint(0, 256, (4, 17))
    pairs = [(b[:-1], b[1:]) for b in blocks]
    batch = collate_hf_dict(pairs)
    assert torch.equal(batch["input_ids"], blocks) and torch.equal(batch["labels"], blocks)
    assert batch["attention_mask"].all()
    with pytest.raises(ValueError, match=r"batch_format must be one of \['dict', 'tuple'\]"):
        TextDataModule(batch_format="list")
    torch.manual_seed(0)
    lm = HFCausalLMLightningModule(arch="mistral", n_layers=2)
    lm.configure_model()
    with torch.no_grad():
        torch.testing.assert_close(lm.compute_loss(batch), lm.compute_loss(collate_pairs(pairs)))
    assert "arch" not in HFLlamaLightningModule(optimizer="sgd").hparams, "rebuilt from its hparams as before"
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        HFCausalLMLightningModule(arch="gpt2")
