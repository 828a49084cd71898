"""A Learner's own checkpoint (``cells/shard_checkpoint.py``: DCP, async) and the Hugging Face
export from it (``models/export.py``), in one plain process on a tiny HF model — no Ray, no
process group: the async save is a snapshot (updates after it do not leak in), the load gives
the weights and Adam state back bit for bit, another model's shapes and a newer format are
refused naming both, the export loads in transformers with the same tensors (one file or
several with an index), and a checkpoint_dir that cannot be written is refused naming it."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from ray_xlong.cells import checkpoint
from ray_xlong.cells.shard_checkpoint import ShardCheckpointer, exists
from ray_xlong.models import build_tiny_model_dir, load_model
from ray_xlong.models.export import META_FILE, export_checkpoint
from ray_xlong.models.tiny import TinyModelConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("m") / "policy", seed=0)


def trained(model_dir, steps: int = 1):
    model = load_model(model_dir).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.arange(3, 40).unsqueeze(0)
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_async_save_is_a_snapshot_and_loads_back_bit_for_bit(model_dir, tmp_path):
    model, opt = trained(model_dir)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    ck = ShardCheckpointer()
    path = ck.save(tmp_path / "ckpt" / "learner-v1", model, opt, version=1,
                   meta={"model_dir": str(model_dir)}, files={"records.bin": b"r"})
    with torch.no_grad():                       # the step goes on while it is written
        for p in model.parameters():
            p.add_(1.0)
    assert ck.wait() == path and exists(path)
    assert (tmp_path / "ckpt" / "records.bin").read_bytes() == b"r"
    assert json.loads((pathlib.Path(path) / META_FILE).read_text())["version"] == 1

    fresh, fresh_opt = trained(model_dir, steps=0)
    assert ShardCheckpointer().load(path, fresh, fresh_opt, reset_optimizer=None) == 1
    got = fresh.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert all(torch.equal(m, fresh_opt.state[p]["exp_avg"])
               for m, p in zip(moments, fresh.parameters()))


def test_a_checkpoint_before_any_step_has_no_optimizer_state(model_dir, tmp_path):
    model, opt = trained(model_dir, steps=0)
    ck = ShardCheckpointer()
    ck.save(tmp_path / "v0", model, opt, version=0, meta={}, block=True)
    other, other_opt = trained(model_dir, steps=1)
    reset = []
    assert ck.load(tmp_path / "v0", other, other_opt,
                   reset_optimizer=lambda: reset.append(1)) == 0
    assert reset == [1]


def test_another_model_shape_and_a_newer_format_are_refused(model_dir, tmp_path):
    model, opt = trained(model_dir, steps=0)
    ck = ShardCheckpointer()
    ck.save(tmp_path / "v0", model, opt, version=0, meta={}, block=True)
    wider = build_tiny_model_dir(tmp_path / "wide", config=TinyModelConfig(num_layers=3))
    other = load_model(wider)
    with pytest.raises(ValueError, match=r"another model shape: .*checkpoint .* vs model"):
        ck.load(tmp_path / "v0", other, torch.optim.Adam(other.parameters()),
                reset_optimizer=lambda: None)
    meta = tmp_path / "v0" / META_FILE
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": 99}))
    with pytest.raises(ValueError, match="format 99 is newer than this version reads"):
        ck.load(tmp_path / "v0", model, opt, reset_optimizer=lambda: None)


@pytest.mark.parametrize("shard_bytes", [2 * 1024 ** 3, 200_000])
def test_export_from_the_checkpoint_loads_in_transformers(model_dir, tmp_path, shard_bytes):
    from transformers import AutoModelForCausalLM

    model, opt = trained(model_dir)
    ShardCheckpointer().save(tmp_path / "v1", model, opt, version=1,
                             meta={"model_dir": str(model_dir)}, block=True)
    out = export_checkpoint(tmp_path / "v1", tmp_path / "hf", max_shard_bytes=shard_bytes)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if shard_bytes < 1024 ** 2:
        assert len(files) > 1 and (out / "model.safetensors.index.json").exists()
    else:
        assert files == ["model.safetensors"]
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    want = model.state_dict()
    assert loaded.keys() == want.keys()
    assert all(torch.equal(want[k], loaded[k]) for k in want)


def test_a_checkpoint_dir_that_cannot_be_written_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=f"checkpoint_dir '{blocker}/ckpt' is not writable"):
        checkpoint.check_dir(blocker / "ckpt")
    assert checkpoint.check_dir(tmp_path / "ok").is_dir()


def test_cli_export_names_what_is_not_a_checkpoint(tmp_path, capsys):
    from ray_xlong.cli import main

    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
