"""Real data: TextDataModule with a user's own Hugging Face tokenizer on local JSON-lines files (made here with the
``tokenizers`` library: no download) -- packing with EOS, the tokenized cache, streaming, the model's vocabulary, a
2-rank ZeRO-3 CLI run that resumes mid-epoch exactly, and ``export --hf`` writing the tokenizer beside the model."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import lightning_par.data as data_module
from lightning_par.data import TextDataModule, padded_vocab_size, write_tokenizer_files
from tests.harness import launch_cli

WORDS = ("the quick brown fox jumps over lazy dog while seven wizards quietly brew potent elixirs near an old "
         "stone bridge under silver moonlight and every river sings").split()
SEQ = 16


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) + "." for _ in range(n)]


def make_tokenizer(folder: Path, texts: list[str], vocab: int = 300, eos: bool = True) -> Path:
    """A byte-level BPE trained on ``texts``, saved as a transformers tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    kwargs = {"eos_token": "<eos>"} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **kwargs).save_pretrained(folder)
    return folder


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A JSON-lines corpus of 400 documents and a 300-token BPE tokenizer trained on it."""
    root = tmp_path_factory.mktemp("real_data")
    texts = documents(400)
    return SimpleNamespace(root=root, texts=texts, jsonl=write_jsonl(root / "corpus.jsonl", texts),
                           tokenizer=make_tokenizer(root / "tokenizer", texts))


def _stream_of(dataset) -> list[int]:
    """The packed token stream back from (inputs, targets) pairs: each block's inputs plus its last target."""
    out: list[int] = []
    for i in range(len(dataset)):
        inputs, targets = dataset[i]
        out += inputs.tolist() + [int(targets[-1])]
    return out


def test_documents_are_tokenized_ended_with_eos_and_packed(corpus, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(corpus.tokenizer)
    dm = TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(corpus.tokenizer), seq_len=SEQ,
                        val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    dm.setup("fit")
    assert (dm.token_vocab_size, dm.vocab_size) == (len(tok), padded_vocab_size(len(tok), 64)) == (300, 320)
    expected = {"train": corpus.texts[:360], "validation": corpus.texts[360:]}  # the last 10% of documents held out
    for split, dataset in (("train", dm.train_dataset), ("validation", dm.val_dataset)):
        stream = [i for text in expected[split] for i in tok(text)["input_ids"] + [tok.eos_token_id]]
        usable = len(stream) // (SEQ + 1) * (SEQ + 1)
        assert _stream_of(dataset) == stream[:usable], split
        inputs, targets = dataset[0]
        assert inputs.dtype == torch.int64 and inputs.shape == targets.shape == (SEQ,)
        assert torch.equal(inputs[1:], targets[:-1])
    assert dm.tokenizer.decode(dm.train_dataset[0][0]).startswith(corpus.texts[0][:20])
    stored = dm.train_dataset.blocks.with_format(None)[0]["input_ids"]
    assert dm.train_dataset.blocks.features["input_ids"].feature.dtype == "uint16" and len(stored) == SEQ + 1


def test_the_tokenized_cache_is_keyed_by_files_tokenizer_and_seq_len(corpus, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    first = TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(corpus.tokenizer), seq_len=SEQ, cache_dir=cache)
    first.prepare_data()
    first.setup()

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again: the cache was not used")

    monkeypatch.setattr(data_module, "_pack_tokens", refuse)
    again = TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(corpus.tokenizer), seq_len=SEQ, cache_dir=cache)
    again.setup()  # another rank after prepare_data: reads the cache, tokenizes nothing
    assert _stream_of(again.train_dataset) == _stream_of(first.train_dataset)
    other_tok = make_tokenizer(tmp_path / "other", corpus.texts, vocab=280)
    for changed in ({"seq_len": SEQ + 1}, {"tokenizer": str(other_tok)}):
        kwargs = {"data_files": str(corpus.jsonl), "tokenizer": str(corpus.tokenizer), "seq_len": SEQ,
                  "cache_dir": cache, **changed}
        with pytest.raises(AssertionError, match="tokenized again"):
            TextDataModule(**kwargs).setup()
    copied = tmp_path / "copy"
    copied.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the key is what it does, not where it was loaded from
        (copied / name).write_bytes((corpus.tokenizer / name).read_bytes())
    TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(copied), seq_len=SEQ, cache_dir=cache).setup()


def test_the_checkpoint_state_carries_the_tokenizer(corpus, tmp_path):
    from transformers import AutoTokenizer

    dm = TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(corpus.tokenizer), seq_len=SEQ)
    state = dm.state_dict()
    assert sorted(state["tokenizer_files"]) == ["tokenizer.json", "tokenizer_config.json"]
    write_tokenizer_files(state["tokenizer_files"], tmp_path / "out")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "out")
    text = corpus.texts[7]
    assert loaded(text)["input_ids"] == dm.tokenizer(text)["input_ids"] and loaded.eos_token == "<eos>"
    assert dm.hparams.tokenizer == str(corpus.tokenizer)
    assert TextDataModule(seq_len=SEQ).state_dict() == {}  # byte-level: as before, nothing in the checkpoint
    with pytest.raises(ValueError, match="plain relative name"):
        write_tokenizer_files({"../escape.json": "{}"}, tmp_path / "out")


def test_bad_inputs_fail_at_construction(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no eos_token"):
        TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(make_tokenizer(tmp_path / "noeos", corpus.texts,
                                                                                   eos=False)))
    (tmp_path / "notes.txt").write_text("plain text")
    with pytest.raises(ValueError, match="mixes formats"):
        TextDataModule(data_files=[str(corpus.jsonl), str(tmp_path / "notes.txt")]).setup()
    with pytest.raises(ValueError, match="no field 'body'"):
        TextDataModule(data_files=str(corpus.jsonl), text_field="body", cache_dir=str(tmp_path / "c")).setup()
    with pytest.raises(ValueError, match="at least two files"):
        TextDataModule(data_files=str(corpus.jsonl), streaming=True)


def test_a_tokenizer_directory_without_transformers_says_which_extra(corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as in an install without the hf extra
    with pytest.raises(ImportError, match=r"not installed: pip install 'lightning-par\[hf\]'"):
        TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(corpus.tokenizer))


def test_streaming_shards_the_blocks_over_data_parallel_ranks(corpus, tmp_path):
    from transformers import AutoTokenizer

    files = [write_jsonl(tmp_path / f"part{i}.jsonl", corpus.texts[i * 100:(i + 1) * 100]) for i in range(3)]
    kwargs = {"data_files": [str(f) for f in files], "tokenizer": str(corpus.tokenizer), "seq_len": SEQ,
              "shuffle": False, "val_fraction": 0.3}

    def blocks(world: int, rank: int) -> list[list[int]]:
        dm = TextDataModule(**kwargs, streaming=True)
        dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": world, "rank": rank},
                                     current_epoch=0)
        dm.setup()
        return [torch.cat([x, y[-1:]]).tolist() for x, y in dm.train_dataset]

    tok = AutoTokenizer.from_pretrained(corpus.tokenizer)

    def packed(texts: list[str]) -> list[list[int]]:
        stream = [i for text in texts for i in tok(text)["input_ids"] + [tok.eos_token_id]]
        return [stream[i:i + SEQ + 1] for i in range(0, len(stream) - SEQ, SEQ + 1)]

    train = corpus.texts[:200]  # the first two files; the last one is the validation split
    assert blocks(1, 0) == packed(train)
    # two files over two ranks: a file each
    assert [blocks(2, r) for r in range(2)] == [packed(train[:100]), packed(train[100:])]
    # over three ranks (two files): every rank reads both and keeps every third block
    assert [blocks(3, r) for r in range(3)] == [packed(train)[r::3] for r in range(3)]

    import lightning.pytorch as pl

    from lightning_par.examples import GPTLightningModule

    model = GPTLightningModule(preset="tiny", n_layers=1)  # a fit reads the stream: no length, max_steps ends it
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, limit_val_batches=1, val_check_interval=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, datamodule=TextDataModule(**kwargs, streaming=True, batch_size=2))
    assert trainer.global_step == 3 and model.model.embed.num_embeddings == 320


def test_the_example_models_take_the_data_modules_vocabulary(corpus, tmp_path):
    from lightning_par.examples import (
        GPT2LightningModule,
        GPTLightningModule,
        HFLlamaLightningModule,
        PlainLMLightningModule,
    )

    dm = TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(corpus.tokenizer), seq_len=SEQ)
    trainer = SimpleNamespace(datamodule=dm)
    gpt = GPTLightningModule(preset="tiny")
    gpt._trainer = trainer
    gpt.configure_model()
    assert gpt.model.embed.num_embeddings == gpt.model.head.out_features == gpt.hparams.vocab_size == 320
    hf = HFLlamaLightningModule(hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64)
    hf._trainer = trainer
    hf.configure_model()
    assert hf.model.config.vocab_size == hf.hparams.vocab_size == 320
    small = GPTLightningModule(preset="tiny", vocab_size=256)
    small._trainer = trainer
    with pytest.raises(ValueError, match="smaller than the data's vocabulary"):
        small.configure_model()
    alone = GPTLightningModule(preset="tiny")  # no trainer (the planner, an export): the preset's 256
    alone.configure_model()
    assert alone.model.embed.num_embeddings == 256
    gpt2, plain = GPT2LightningModule(n_embd=32, n_layers=1), PlainLMLightningModule(dim=32, n_layers=1)
    for module in (gpt2, plain):
        module._trainer = trainer
        module.configure_model()
    assert gpt2.model.wte.num_embeddings == gpt2.model.lm_head.out_features == gpt2.hparams.vocab_size == 320
    assert plain.model.tok_emb.num_embeddings == plain.model.head.out_features == plain.hparams.vocab_size == 320
    small = PlainLMLightningModule(vocab_size=128)  # below the tokenizer's ids: refused, not truncated
    small._trainer = trainer
    with pytest.raises(ValueError, match="smaller than the data's vocabulary"):
        small.configure_model()
    for alone in (GPT2LightningModule(n_embd=32, n_layers=1), PlainLMLightningModule(dim=32, n_layers=1)):
        alone.configure_model()  # no data module: bytes
        assert alone.hparams.vocab_size == 256


def test_plan_reads_the_vocabulary_of_the_configs_tokenizer(corpus, tmp_path, capsys):
    """``lightning-par plan --config`` gives the model the tokenizer's (padded) vocabulary, as a fit does; the
    corpus is not read (its file here does not even exist, which a TextDataModule would refuse)."""
    from lightning_par.fit_config import read_fit_config
    from lightning_par.plan_cli import main as plan_main
    from lightning_par.planner.model import build_model
    from lightning_par.topology import LayoutError

    def config(model_args: str = "") -> Path:
        path = tmp_path / f"fit{len(model_args)}.yaml"
        path.write_text("trainer:\n  accelerator: cpu\n  devices: 1\n"
                        "model:\n  class_path: lightning_par.examples.GPTLightningModule\n"
                        f"  init_args:\n    preset: tiny\n    n_layers: 2\n{model_args}"
                        "data:\n  class_path: lightning_par.data.TextDataModule\n"
                        f"  init_args:\n    data_files: {tmp_path / 'absent.jsonl'}\n"
                        f"    tokenizer: {corpus.tokenizer}\n    seq_len: {SEQ}\n")
        return path

    fit = read_fit_config(config())
    assert fit.vocab_size == 320 and fit.model_args["vocab_size"] == 320
    assert build_model(fit.model, fit.model_args).model.embed.num_embeddings == 320
    assert read_fit_config(config("    vocab_size: 512\n")).model_args["vocab_size"] == 512  # the config's own wins
    assert plan_main(["--config", str(config())]) == 0
    assert "vocabulary 320 (the data's tokenizer)" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(config().read_text().replace(str(corpus.tokenizer), str(tmp_path / "nope")))
    with pytest.raises(LayoutError, match=r"bad.yaml: data.init_args.tokenizer=.*nope.* is not a directory"):
        read_fit_config(bad)


def test_export_hf_writes_the_tokenizer_beside_the_model(corpus, tmp_path):
    """A Hugging Face Llama trained one step on the tokenized corpus in one process: ``lightning-par export --hf``
    writes a directory that AutoTokenizer and AutoModelForCausalLM load, the vocabulary the tokenizer's (padded)."""
    import lightning.pytorch as pl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_par.examples import HFLlamaLightningModule
    from lightning_par.plugins.checkpoint_export import main as export

    pl.seed_everything(0)
    dm = TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(corpus.tokenizer), seq_len=SEQ, batch_size=2,
                        cache_dir=str(tmp_path / "cache"))
    model = HFLlamaLightningModule(hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    trainer.save_checkpoint(tmp_path / "hf.ckpt")
    out = tmp_path / "export"
    assert export([str(tmp_path / "hf.ckpt"), str(out), "--hf", "--model-class",
                   "lightning_par.examples.HFLlamaLightningModule"]) == 0
    tok = AutoTokenizer.from_pretrained(out)
    text = corpus.texts[3]
    assert tok(text)["input_ids"] == dm.tokenizer(text)["input_ids"] and tok.eos_token_id == dm.tokenizer.eos_token_id
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == dm.vocab_size == 320
    plain = TextDataModule(seq_len=SEQ, batch_size=2, max_corpus_bytes=60_000, cache_dir=str(tmp_path / "cache"))
    byte_model = HFLlamaLightningModule(hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=64)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(byte_model, datamodule=plain)
    trainer.save_checkpoint(tmp_path / "bytes.ckpt")
    assert export([str(tmp_path / "bytes.ckpt"), str(tmp_path / "bytes"), "--hf", "--model-class",
                   "lightning_par.examples.HFLlamaLightningModule"]) == 0
    assert not (tmp_path / "bytes" / "tokenizer.json").exists()  # byte-level data: no tokenizer to write
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bytes").config.vocab_size == 256


class OwnQwen2(__import__("lightning").pytorch.LightningModule):
    """A module of one's own, as a user writes it: a Qwen2 whose vocabulary is the data's, read in configure_model
    and stored in no hyper-parameter; plain SGD."""

    def __init__(self, hidden_size: int = 32):
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def configure_model(self):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        if self.model is None:
            config = Qwen2Config(vocab_size=self.trainer.datamodule.vocab_size, hidden_size=self.hparams.hidden_size,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=64, max_position_embeddings=64)
            self.model = Qwen2ForCausalLM(config)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.model(inputs).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_export_round_trip_keeps_the_vocabulary_and_the_tokenizer(corpus, tmp_path, capsys):
    """export --hf of a user's Qwen2 trained one step on the tokenized corpus: the vocabulary comes from the
    checkpoint (no hyper-parameter holds it), the exported model gives the trained logits, and the tokenizer loaded
    back -- by lightning-par's --data.tokenizer and by PreTrainedTokenizerFast -- gives the trained ids on the corpus;
    where AutoTokenizer builds the Qwen2 family's own tokenizer, which does not, the export says so."""
    import lightning.pytorch as pl
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from lightning_par.data import TOKENIZER_PROBE
    from lightning_par.plugins.checkpoint_export import main as export

    pl.seed_everything(0)
    # a BPE that has also seen numbers and contractions: GPT-2's pre-tokenizer keeps " 2024" whole, Qwen2's splits
    # every digit off, so the two tokenizers differ on such lines
    numbers = [f"in {y} it's {y % 97}.{y % 10} x**{y % 5} -- costs ${y * 3}, isn't it?" for y in range(1900, 2100)]
    tokenizer = make_tokenizer(tmp_path / "tokenizer", [*corpus.texts, *numbers], vocab=1000)
    dm = TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(tokenizer), seq_len=SEQ, batch_size=2,
                        cache_dir=str(tmp_path / "cache"))
    model = OwnQwen2()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=dm)
    trainer.save_checkpoint(tmp_path / "own.ckpt")
    assert "vocab_size" not in model.hparams and dm.vocab_size == 1024
    out = tmp_path / "export"
    capsys.readouterr()
    assert export([str(tmp_path / "own.ckpt"), str(out), "--hf", "--model-class", f"{__name__}.OwnQwen2"]) == 0
    printed = capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.config.vocab_size == 1024
    ids = torch.tensor([dm.tokenizer(corpus.texts[0])["input_ids"][:SEQ]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, model.model.eval()(ids).logits, rtol=0, atol=1e-5)
    lines = [*corpus.texts[:100], *numbers[::10], *TOKENIZER_PROBE]
    trained = [dm.tokenizer(line)["input_ids"] for line in lines]
    again = TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(out), seq_len=SEQ, batch_size=2,
                           cache_dir=str(tmp_path / "cache2"))
    for tok in (again.tokenizer, PreTrainedTokenizerFast.from_pretrained(out)):
        assert [tok(line)["input_ids"] for line in lines] == trained and len(tok) == len(dm.tokenizer)
    auto = AutoTokenizer.from_pretrained(out)  # transformers 5's rule for a qwen2 directory: what the export notes
    differ = sum(auto(line)["input_ids"] != ids for line, ids in zip(lines, trained, strict=True))
    assert type(auto).__name__ == "Qwen2Tokenizer" and len(auto) == len(dm.tokenizer) + 1 and differ > 0
    probe = sum(auto(line)["input_ids"] != dm.tokenizer(line)["input_ids"] for line in TOKENIZER_PROBE)
    assert (f"builds Qwen2Tokenizer, transformers' own class for this model family, which re-derives the splitting "
            f"rules instead of reading tokenizer.json: {len(auto)} tokens (trained: {len(dm.tokenizer)}), other ids "
            f"on {probe} of {len(TOKENIZER_PROBE)} probe lines") in " ".join(printed.split()), printed
    print(f"AutoTokenizer differs on {differ} of {len(lines)} lines, {probe} of the probe lines")


# -- launched: a 2-rank ZeRO-3 CLI run of the example GPT on the JSON-lines corpus with the tokenizer directory, and
#    the same run resumed from its mid-epoch checkpoint (about 60 s on 2 cores) -----------------------------------
STEPS, EPOCH, SAVE = 8, 6, 3  # a checkpoint at step 3 of a 6-step epoch: mid-epoch


def _zero3_args(corpus, root: Path) -> list[str]:
    return ["--model.n_layers=2", "--model.optimizer=sgd", "--model.lr=0.2", f"--data.data_files={corpus.jsonl}",
            f"--data.tokenizer={corpus.tokenizer}", "--data.batch_size=4", "--data.shuffle=true",
            "--trainer.strategy=zero3", f"--trainer.max_steps={STEPS}", f"--trainer.limit_train_batches={EPOCH}",
            "--trainer.limit_val_batches=1", "--sample_tokens=0", "--trainer.enable_checkpointing=true",
            "--tokens_per_sec.window=4",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint", "--trainer.callbacks.save_top_k=-1",
            f"--trainer.callbacks.every_n_train_steps={SAVE}", f"--trainer.callbacks.dirpath={root / 'ckpt'}"]


@pytest.fixture(scope="module")
def zero3_run(corpus, tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("zero3_tokenizer")
    full = launch_cli(root / "full", cache_dir, _zero3_args(corpus, root / "full"), devices=2).check()
    print(f"zero3 with a tokenizer: {full.seconds:.0f} s")
    return full


@pytest.fixture(scope="module")
def zero3_runs(corpus, zero3_run, cache_dir):
    """The run and its resume from step SAVE (the resume: the full set; the default set resumes mid-epoch in
    tests/launch/test_resume.py)."""
    root = zero3_run.root.parent
    resumed = launch_cli(root / "resumed", cache_dir,
                         [*_zero3_args(corpus, root / "resumed"), f"--ckpt_path={zero3_run.checkpoint(SAVE)}"],
                         devices=2).check()
    print(f"resumed from step {SAVE}: {resumed.seconds:.0f} s")
    return zero3_run, resumed


@pytest.mark.launch(ranks=2)
def test_zero3_cli_run_trains_the_tokenizers_vocabulary(corpus, zero3_run, tmp_path):
    from transformers import AutoTokenizer

    from lightning_par.plugins.checkpoint_export import CheckpointTensors, read_hyperparameters, read_tokenizer_files

    full = zero3_run
    losses = full.scalars()["train/loss"]
    assert sorted(losses) == list(range(STEPS)) and all(0 < v < 10 for v in losses.values())  # within 10 steps
    mfu = full.scalars()["train/mfu"]  # model FLOPs utilisation with the tokenizer's vocabulary, every 4 steps
    assert sorted(mfu) == [4, 8] and all(0 < v < 1 for v in mfu.values()), mfu
    ckpt = full.checkpoint(SAVE)
    tok = AutoTokenizer.from_pretrained(corpus.tokenizer)
    vocab = padded_vocab_size(len(tok), 64)
    assert read_hyperparameters(ckpt)["vocab_size"] == vocab == 320
    shapes = CheckpointTensors(ckpt).entries
    assert shapes["model.embed.weight"][0] == shapes["model.head.weight"][0] == (vocab, 64)
    write_tokenizer_files(read_tokenizer_files(ckpt), tmp_path / "tok")  # the sharded checkpoint carries it too
    assert AutoTokenizer.from_pretrained(tmp_path / "tok")(corpus.texts[0])["input_ids"] == tok(corpus.texts[0])[
        "input_ids"]


@pytest.mark.launch(ranks=2, full=True)
def test_zero3_cli_run_resumes_mid_epoch_exactly(zero3_runs):
    full, resumed = zero3_runs
    before, after = full.scalars()["train/loss"], resumed.scalars()["train/loss"]
    assert sorted(after) == list(range(SAVE, STEPS))
    diff = max(abs(after[s] - before[s]) for s in after)
    print(f"resumed at step {SAVE} of a {EPOCH}-step epoch: steps {SAVE}-{STEPS - 1} within {diff:.1e}")
    assert diff <= 1e-6
    assert len({round(before[s], 4) for s in before}) > STEPS // 2  # the losses move: the comparison can fail


def test_a_tokenizer_with_custom_code_is_refused_unless_asked_for(corpus, tmp_path):
    """A tokenizer directory naming its own Python class (``auto_map``): transformers alone asks "[y/N]" on every
    rank; here it is refused in one line naming the file and the option, and its code does not run."""
    import shutil

    folder = shutil.copytree(corpus.tokenizer, tmp_path / "custom")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MarkedTokenizer", auto_map={"AutoTokenizer": [None, "marked.MarkedTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ran = tmp_path / "code-ran"
    (folder / "marked.py").write_text(f"open({str(ran)!r}, 'w').close()\n"
                                      "from transformers import PreTrainedTokenizerFast\n"
                                      "class MarkedTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    with pytest.raises(ValueError) as refused:
        TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(folder))
    message = str(refused.value)
    assert "\n" not in message and f"{folder / 'tokenizer_config.json'} names custom code" in message
    assert "marked.MarkedTokenizer" in message and "--data.trust_remote_code=true" in message
    assert not ran.exists()
    module = TextDataModule(data_files=str(corpus.jsonl), tokenizer=str(folder), trust_remote_code=True)
    assert ran.exists() and type(module.tokenizer).__name__ == "MarkedTokenizer"  # asked for: it runs
