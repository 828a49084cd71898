"""A sharded cell's own checkpoint and export (2 FSDP2 ranks, gloo, real Ray actors): after 2
steps every rank writes its shards with ``dcp.async_save`` (over a gloo group of their own);
another 2-rank cell loads them back to the same weights and Adam state bit for bit; the
Hugging Face directory rank 0 writes (gathering one tensor at a time) and the one
``models.export`` reads from the shards in a plain process hold the cell's weights bit for bit
and load in transformers."""

from __future__ import annotations

import pytest
import torch

import tests.cells.test_learner_group as lg
from ray_xlong.cells.learner_group import ElasticLearnerGroup
from ray_xlong.models.export import export_checkpoint
from tests.cells.test_learner_group import model_dir, ray_local, train  # noqa: F401
from tests.cells.test_sharded import WIDE_MICRO_TOKENS, start_cells

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_a_2_rank_cell_saves_loads_and_exports_its_shards(ray_local, model_dir, tmp_path,
                                                          monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(lg, "MICRO_TOKENS", WIDE_MICRO_TOKENS)
    a, b = start_cells(model_dir, 2)
    try:
        group = ElasticLearnerGroup([a])
        train(ray_local, group, [lambda i: 0, lambda i: 0], chunks=1)
        path = str(tmp_path / "learner-v000002")
        ray_local.get(a.save_checkpoint.remote(path, {"records.bin": b"r"}, False))
        assert ray_local.get(a.wait_checkpoint.remote()) == path
        assert (tmp_path / "records.bin").read_bytes() == b"r"      # rank 0, once all wrote
        want = ray_local.get(a.get_xlong_state.remote())

        assert ray_local.get(b.load_checkpoint.remote(path)) == 2
        got = ray_local.get(b.get_xlong_state.remote())
        assert got["version"] == 2
        assert all(torch.equal(want["weights"][k], got["weights"][k]) for k in want["weights"])
        sa, sb = want["optimizer"]["state"], got["optimizer"]["state"]
        assert sa.keys() == sb.keys() and all(
            torch.equal(sa[k][m], sb[k][m]) for k in sa for m in ("exp_avg", "exp_avg_sq"))

        out = tmp_path / "hf"
        ray_local.get(a.export_hf.remote(str(out)))
        exported = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
        assert all(torch.equal(want["weights"][k], exported[k]) for k in want["weights"])
        from_shards = export_checkpoint(path, tmp_path / "hf2")
        x, y = (load_file(str(d / "model.safetensors")) for d in (out, from_shards))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    finally:
        a.kill()
        b.kill()
