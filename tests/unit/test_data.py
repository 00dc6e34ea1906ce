"""Tests for the byte-level text data module (fast: small corpora, everything cached under tmp dirs)."""

import os
import sysconfig
from pathlib import Path

import pytest
import torch

from lightning_par.data import (
    DOC_SEPARATOR,
    ByteTokenizer,
    TextDataModule,
    _import_datasets,
    default_corpus_files,
)

SEQ_LEN = 32
SMALL_CORPUS = 150_000  # bytes of stdlib source: enough documents for a split, quick to pack


def _blocks_to_bytes(dataset) -> bytes:
    """Rebuild the packed byte stream from (inputs, targets) pairs: inputs plus the final target byte."""
    out = bytearray()
    for i in range(len(dataset)):
        inputs, targets = dataset[i]
        out += bytes(inputs.tolist()) + bytes([int(targets[-1])])
    return bytes(out)


@pytest.fixture(scope="module")
def stdlib_dm(tmp_path_factory):
    dm = TextDataModule(
        seq_len=SEQ_LEN, batch_size=4, max_corpus_bytes=SMALL_CORPUS, cache_dir=str(tmp_path_factory.mktemp("cache"))
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.fixture
def local_files(tmp_path):
    """Three tiny documents with disjoint alphabets, so any leak between splits is visible."""
    contents = {"a.txt": "abcab" * 7, "b.txt": "cabca\n" * 5, "c.txt": "xyz\u00e9\u4e16" * 6}
    for name, text in contents.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path, contents


def test_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    text = "héllo wörld — 世界 🚀\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised


def test_default_corpus_is_real_python_source():
    files = default_corpus_files(2_000_000)
    stdlib = sysconfig.get_paths()["stdlib"]
    assert len(files) > 10
    assert [os.path.basename(f) for f in files] == sorted(os.path.basename(f) for f in files)
    assert all(os.path.dirname(f) == stdlib and f.endswith(".py") for f in files)
    total = sum(os.path.getsize(f) for f in files)
    assert total >= 2_000_000
    assert total - os.path.getsize(files[-1]) < 2_000_000  # stops at the file that reaches the budget
    text = "".join(Path(f).read_text(encoding="utf-8") for f in files)
    assert "def " in text and "import " in text and "class " in text
    assert len(default_corpus_files(1)) == 1
    with pytest.raises(ValueError, match="max_bytes"):
        default_corpus_files(0)


def test_packing_gives_shifted_fixed_length_pairs(stdlib_dm):
    assert stdlib_dm.vocab_size == 256
    assert stdlib_dm.tokens_per_batch == 4 * SEQ_LEN
    inputs, targets = stdlib_dm.train_dataset[0]
    assert inputs.shape == targets.shape == (SEQ_LEN,)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[1:], targets[:-1])
    batch = next(iter(stdlib_dm.train_dataloader()))
    assert isinstance(batch, tuple) and len(batch) == 2
    assert batch[0].shape == batch[1].shape == (4, SEQ_LEN)
    assert torch.equal(batch[0][:, 1:], batch[1][:, :-1])
    # The packed stream is the corpus text itself (Python source), with documents joined by the separator.
    stream = _blocks_to_bytes(stdlib_dm.train_dataset)
    first_doc = Path(stdlib_dm.files[0]).read_text(encoding="utf-8").encode("utf-8")
    assert stream.startswith(first_doc[: len(stream)])


def test_local_files_pack_exactly_and_split_by_document(local_files):
    folder, contents = local_files
    dm = TextDataModule(
        data_files=str(folder / "*.txt"), seq_len=4, batch_size=2, val_fraction=0.3, cache_dir=str(folder / "cache")
    )
    assert dm.files == sorted(str(folder / name) for name in contents)
    dm.setup()
    sep = bytes([DOC_SEPARATOR])
    train_stream = contents["a.txt"].encode() + sep + contents["b.txt"].encode() + sep
    val_stream = contents["c.txt"].encode() + sep
    got_train, got_val = _blocks_to_bytes(dm.train_dataset), _blocks_to_bytes(dm.val_dataset)
    # Exact packing: blocks of seq_len + 1 bytes, remainder dropped.
    assert got_train == train_stream[: len(train_stream) // 5 * 5]
    assert got_val == val_stream[: len(val_stream) // 5 * 5]
    # The held-out document (last in sorted order) shares no byte with the training documents.
    assert not (set(got_train) - {DOC_SEPARATOR}) & (set(got_val) - {DOC_SEPARATOR})
    # Validation-style loaders keep order and the remainder; predict gives a single batch.
    val_batches = list(dm.val_dataloader())
    assert sum(len(b[0]) for b in val_batches) == len(dm.val_dataset)
    assert torch.equal(next(iter(dm.test_dataloader()))[0], val_batches[0][0])
    assert len(list(dm.predict_dataloader())) == 1


def test_explicit_file_list_and_directory(local_files):
    folder, contents = local_files
    by_list = TextDataModule(data_files=[str(folder / "c.txt"), str(folder / "a.txt")], cache_dir=str(folder / "c1"))
    assert by_list.files == [str(folder / "a.txt"), str(folder / "c.txt")]
    by_dir = TextDataModule(data_files=str(folder), cache_dir=str(folder / "c2"))
    assert by_dir.files == sorted(str(folder / name) for name in contents)


def test_single_document_is_split_by_blocks(tmp_path):
    doc = tmp_path / "one.txt"
    doc.write_text("".join(chr(ord("a") + i % 26) for i in range(1000)), encoding="utf-8")
    dm = TextDataModule(data_files=str(doc), seq_len=9, val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    dm.setup()
    assert len(dm.train_dataset) == 90 and len(dm.val_dataset) == 10
    stream = _blocks_to_bytes(dm.train_dataset) + _blocks_to_bytes(dm.val_dataset)
    assert stream == doc.read_bytes()  # 1000 bytes + separator, cut to 100 blocks of 10: no overlap


def test_deterministic_first_batch(tmp_path):
    def first_batch(cache: str, shuffle: bool):
        dm = TextDataModule(
            seq_len=SEQ_LEN, batch_size=4, max_corpus_bytes=SMALL_CORPUS, shuffle=shuffle, cache_dir=cache
        )
        dm.prepare_data()
        dm.setup("fit")
        torch.manual_seed(123)  # the shuffle order follows the global seed, as under seed_everything
        return next(iter(dm.train_dataloader()))

    # A fresh cache and a second, cached load build the same data.
    a = first_batch(str(tmp_path / "c1"), shuffle=False)
    b = first_batch(str(tmp_path / "c2"), shuffle=False)
    c = first_batch(str(tmp_path / "c2"), shuffle=False)
    assert torch.equal(a[0], b[0]) and torch.equal(b[0], c[0]) and torch.equal(a[1], c[1])
    s1 = first_batch(str(tmp_path / "c2"), shuffle=True)
    s2 = first_batch(str(tmp_path / "c2"), shuffle=True)
    assert torch.equal(s1[0], s2[0])
    assert not torch.equal(s1[0], a[0])


def test_global_rng_untouched(tmp_path):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    dm = TextDataModule(seq_len=SEQ_LEN, max_corpus_bytes=SMALL_CORPUS, cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    dm.setup("fit")
    dm.train_dataloader()
    dm.val_dataloader()
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"data_files": "x.txt", "dataset_name": "some/dataset"}, ValueError, "either data_files or dataset_name"),
        ({"seq_len": 0}, ValueError, "seq_len"),
        ({"seq_len": -3}, ValueError, "seq_len"),
        ({"val_fraction": 0.0}, ValueError, "val_fraction"),
        ({"val_fraction": 1.0}, ValueError, "val_fraction"),
        ({"val_fraction": 1.5}, ValueError, "val_fraction"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"data_files": "/nonexistent/dir/file.txt"}, FileNotFoundError, "matches no file"),
        ({"data_files": ["/nonexistent/*.txt"]}, FileNotFoundError, "matches no file"),
    ],
)
def test_invalid_arguments_raise_clearly(kwargs, error, match):
    with pytest.raises(error, match=match):
        TextDataModule(**kwargs)


def test_too_short_for_seq_len(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("tiny", encoding="utf-8")
    dm = TextDataModule(data_files=str(tmp_path / "*.txt"), seq_len=64, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="holds no block"):
        dm.setup()


def test_offline_mode_set_only_if_unset(monkeypatch):
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    _import_datasets(offline=True)
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    _import_datasets(offline=True)
    assert os.environ["HF_DATASETS_OFFLINE"] == "0"


@pytest.mark.parametrize("config", ["demo.yaml", "zero.yaml"])
def test_the_configs_validate_on_a_corpus_of_fewer_batches_than_their_interval(config, tmp_path):
    """The configs' validation settings on 21 training batches an epoch (Lightning alone refuses
    val_check_interval=100 there): validation runs after every 100 training batches of the run, across epochs."""
    import lightning.pytorch as pl
    import yaml

    trainer_config = yaml.safe_load((Path(__file__).parents[2] / "configs" / config).read_text())["trainer"]
    keys = ("val_check_interval", "check_val_every_n_epoch", "limit_val_batches")
    every = trainer_config["val_check_interval"]

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)
            self.validated_at = []

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            pass

        def on_validation_start(self):
            self.validated_at.append(self.global_step)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(21, 1)), batch_size=1)
    model = Linear()
    given = {k: trainer_config[k] for k in keys if k in trainer_config}
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2 * every + 10, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, default_root_dir=tmp_path, **given)
    trainer.fit(model, data, data)
    assert model.validated_at == [every, 2 * every]


def test_unreadable_json_lines_name_the_file(tmp_path):
    """An empty .jsonl (datasets: a bare StopIteration) and one with a Latin-1 byte (a UnicodeDecodeError naming
    no file): one line naming the file, and the line and column of the byte."""
    good = tmp_path / "good.jsonl"
    good.write_text("".join(f'{{"text": "document {i} holds some text"}}\n' for i in range(8)), encoding="utf-8")
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n')
    for files, match in (([empty], rf"^{empty} is empty: it holds no record; remove it from data_files or fill it$"),
                         ([good, latin], rf"^{latin}, line 2, column 14: byte 0xe9 is not UTF-8, which JSON and CSV "
                                         r"files must be; convert the file")):
        module = TextDataModule(data_files=[str(f) for f in files], seq_len=8, cache_dir=str(tmp_path / "cache"))
        with pytest.raises(ValueError, match=match) as failure:
            module.prepare_data()
        assert failure.value.__suppress_context__  # datasets' traceback is not printed above it
    module = TextDataModule(data_files=str(good), seq_len=8, batch_size=2, cache_dir=str(tmp_path / "cache"))
    module.setup()  # a good file alone loads: nothing of it read twice
    assert len(module.train_dataset) > 0


def test_a_batch_larger_than_the_training_split_is_refused(tmp_path):
    """Lightning alone says "No training batches" and exits 0 (the loader drops the incomplete batch)."""
    (tmp_path / "a.txt").write_text("abcdefgh" * 40, encoding="utf-8")
    (tmp_path / "b.txt").write_text("ijklmnop" * 40, encoding="utf-8")
    module = TextDataModule(data_files=str(tmp_path / "*.txt"), seq_len=8, batch_size=64,
                            cache_dir=str(tmp_path / "cache"))
    module.setup()
    blocks = len(module.train_dataset)
    assert 0 < blocks < 64
    with pytest.raises(ValueError, match=rf"^the training split has {blocks} blocks of 9 tokens, fewer than "
                                         r"batch_size=64: no full batch to train on\. Use a smaller --data\.batch"):
        module.train_dataloader()
    module.batch_size = blocks
    assert len(module.train_dataloader()) == 1
