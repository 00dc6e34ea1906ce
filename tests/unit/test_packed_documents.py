"""Packed documents in one process: what ``TextDataModule(pack_documents=True)`` yields, the batch forms the layouts
cut, the setup refusal, and Hugging Face Llama's own packed-sequence path at parity with the documents unpacked.
The layouts (tp2, pp2, cp2) are in tests/launch/test_packed_documents.py."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_par.data import TextDataModule, collate_packed_hf_dict, document_positions
from lightning_par.examples.gpt2 import GPT2LightningModule
from lightning_par.parallel.pipeline.batches import shard_sequence, split_batch
from tests.launch.packed_documents_worker import documents, packed, unpacked


def test_the_data_module_restarts_positions_per_document_and_masks_the_crossing_target(tmp_path):
    docs = ["abc", "defgh", "ij", "klmnopq", "rs", "tuvwxyz", "held out"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    data = TextDataModule(data_files=str(tmp_path / "d.jsonl"), seq_len=8, batch_size=2, shuffle=False,
                          val_fraction=0.1, pack_documents=True, cache_dir=str(tmp_path / "cache"))
    data.setup()
    inputs, targets, positions = next(iter(data.train_dataloader()))
    assert bytes(inputs[0].tolist()) == b"abc\0defg"
    assert positions[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert targets[0].tolist() == [ord("b"), ord("c"), 0, -100, *b"efgh"]  # "\0" -> "d" crosses: not counted
    assert positions[1].tolist() == [0, 0, 1, 2, 0, 1, 2, 3]  # "\0ij\0klmn": a block starts a fragment at 0


def test_the_batch_forms_carry_the_positions():
    inputs, targets, positions = packed(documents()[0])
    model_inputs, got = split_batch((inputs, targets, positions))
    assert torch.equal(model_inputs["position_ids"], positions) and torch.equal(got, targets)
    cut = shard_sequence((inputs, targets, positions), 2, 1)
    assert torch.equal(cut.batch[2], cut.positions) and cut.positions.shape == (2, 16)
    rows = [torch.cat(documents()[0][:3])]
    batch = collate_packed_hf_dict([(rows[0], document_positions(rows[0], 0))])
    assert "attention_mask" not in batch  # transformers finds the documents from the positions only without one
    assert split_batch(batch)[0]["position_ids"].shape == batch["input_ids"].shape


def test_a_model_that_cannot_keep_to_documents_is_refused_at_setup(tmp_path):
    data = TextDataModule(seq_len=16, batch_size=2, max_corpus_bytes=20_000, pack_documents=True,
                          cache_dir=str(tmp_path / "cache"))
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"GPT2LightningModule does not declare that its model gets them "
                                         r"\(takes_position_ids = True\).*--data.pack_documents=false"):
        trainer.fit(GPT2LightningModule(n_embd=32, n_layers=1, n_heads=2), datamodule=data)


def test_hugging_face_llama_packed_equals_the_documents_unpacked():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    docs = documents()[0]
    rows = [torch.cat(docs[i:i + 3]) for i in range(0, len(docs), 3)]
    batch = collate_packed_hf_dict([(row, document_positions(row, 0)) for row in rows])
    inputs, targets = unpacked(docs)
    one = torch.nn.functional.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), targets.flatten())
    got = model(**batch, use_cache=False).loss  # (with a cache, transformers does not look for packed sequences)
    crossing = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
    print(f"Llama packed {got.item():.7f}, unpacked {one.item():.7f}, across documents {crossing.item():.7f}")
    assert abs(got.item() - one.item()) <= 1e-5 * one.item() and abs(crossing.item() - one.item()) > 1e-4


def test_packed_documents_turn_a_hugging_face_models_cache_off():
    """transformers keeps packed documents apart (from restarting position_ids) only without a cache; a step that
    calls the model without use_cache=False would get one and attend across documents."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_par.data import TextDataModule

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert model.config.use_cache
    module = SimpleNamespace(model=model, takes_position_ids=True)
    dm = TextDataModule(pack_documents=True)
    dm.trainer = SimpleNamespace(lightning_module=module)
    dm._check_position_ids_taken()
    assert model.config.use_cache is False
