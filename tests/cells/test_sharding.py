"""Sharded-cell layout checks (pure): errors name the field and the sizes, before any actor."""

from __future__ import annotations

import pytest

from ray_xlong.cells.sharding import (ShardingError, ShardingSettings, check_model_fits,
                                      model_num_params, rank_placements, ranks_per_bundle)


def test_cuda_on_bundles_without_gpus_names_the_field():
    with pytest.raises(ShardingError, match=r"ShardingSettings.device.*gpus_per_node=0"):
        ranks_per_bundle(ShardingSettings(ranks_per_cell=2, device="cuda"), nodes_per_cell=2,
                         gpus_per_node=0)


@pytest.mark.parametrize("ranks,nodes,gpus,device,per", [
    pytest.param(2, 2, 0, "cpu", 1, id="one-rank-per-cpu-bundle"),
    pytest.param(4, 1, 0, "cpu", 4, id="four-cpu-ranks-one-bundle"),
    pytest.param(32, 4, 8, "cuda", 8, id="4-nodes-x-8-gpus"),
    pytest.param(8, 4, 8, "cuda", 2, id="2-ranks-of-4-gpus-per-node"),
    # the default: one unsharded Learner (on the first bundle) fits a cell of any size
    pytest.param(1, 2, 0, "cpu", 1, id="unsharded-on-a-2-node-cell"),
    pytest.param(1, 4, 8, "cuda", 1, id="unsharded-on-a-4-node-gpu-cell"),
])
def test_ranks_split_over_bundles(ranks, nodes, gpus, device, per):
    settings = ShardingSettings(ranks_per_cell=ranks, device=device)
    assert ranks_per_bundle(settings, nodes_per_cell=nodes, gpus_per_node=gpus) == per


@pytest.mark.parametrize("ranks,nodes,gpus,match", [
    pytest.param(3, 2, 8, r"ranks_per_cell=3 does not split over .*nodes_per_cell=2", id="odd"),
    pytest.param(12, 1, 8, r"puts 12 ranks on a bundle of .*gpus_per_node=8", id="too-many"),
    pytest.param(3, 1, 8, r"puts 3 ranks on a bundle", id="not-a-divisor"),
])
def test_a_layout_that_does_not_divide_is_an_error(ranks, nodes, gpus, match):
    with pytest.raises(ShardingError, match=match):
        ranks_per_bundle(ShardingSettings(ranks_per_cell=ranks, device="cuda"),
                         nodes_per_cell=nodes, gpus_per_node=gpus)


def test_a_model_too_large_for_the_cell_names_the_sizes():
    # 7e9 params × 16 B / 8 ranks = 14 GB per rank > 10 GB; 12 ranks → 9.3 GB fits.
    settings = ShardingSettings(ranks_per_cell=8, memory_per_rank_gb=10.0)
    with pytest.raises(ShardingError, match=r"7 B parameters needs 14 GB per rank.*"
                                            r"ranks_per_cell=8.*memory_per_rank_gb=10.*≥ 12"):
        check_model_fits(settings, num_params=7_000_000_000)
    fits = ShardingSettings(ranks_per_cell=12, memory_per_rank_gb=10.0)
    assert check_model_fits(fits, num_params=7_000_000_000) == pytest.approx(9.333, rel=1e-3)


@pytest.mark.parametrize("field,value", [("ranks_per_cell", 0), ("device", "tpu"),
                                         ("mixed_precision", "fp16"),
                                         ("memory_per_rank_gb", 0.0), ("timeout_s", 0)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ShardingError, match=f"ShardingSettings.{field}"):
        ShardingSettings(**{field: value})


def test_model_size_is_counted_without_weights(tmp_path):
    from ray_xlong.models import build_tiny_model_dir, load_model

    path = build_tiny_model_dir(tmp_path / "m", seed=0)
    want = sum(p.numel() for p in load_model(path).parameters())
    assert model_num_params(str(path)) == want


@pytest.mark.parametrize("ranks,nodes,gpus,ids,want", [
    # CPU: ranks split over bundles, each holding its bundle's 8 / 2 GPUs in Ray (gloo on CPU)
    pytest.param(4, 2, 8, (), [(0, 4.0, None), (0, 4.0, None), (1, 4.0, None), (1, 4.0, None)],
                 id="cpu-2-bundles"),
    # CUDA, engine actors hold bundle 0's 4 GPUs, 2 ranks: pinned to GPUs 4 and 6 (stride 4/2)
    pytest.param(2, 1, 4, [("4", "5", "6", "7")], [(0, 0.0, "4"), (0, 0.0, "6")],
                 id="cuda-bundle0"),
    # CUDA, 2 bundles × 2 GPUs, 4 ranks: bundle 0 pinned, bundle 1 one whole Ray GPU each
    pytest.param(4, 2, 2, [("0", "1")], [(0, 0.0, "0"), (0, 0.0, "1"), (1, 1.0, None),
                                         (1, 1.0, None)], id="cuda-2-bundles"),
    # CUDA, engine actors hold both bundles' GPUs: every rank pinned to its bundle's, none
    # asks Ray for a GPU
    pytest.param(4, 2, 2, [("0", "1"), ("2", "3")], [(0, 0.0, "0"), (0, 0.0, "1"),
                                                     (1, 0.0, "2"), (1, 0.0, "3")],
                 id="cuda-engine-actors"),
    # CUDA, one unsharded rank on an 8-GPU bundle: the bundle's first GPU
    pytest.param(1, 2, 8, [tuple(map(str, range(8)))], [(0, 0.0, "0")], id="cuda-one-rank"),
])
def test_rank_placements(ranks, nodes, gpus, ids, want):
    device = "cuda" if ids else "cpu"
    got = rank_placements(ShardingSettings(ranks_per_cell=ranks, device=device),
                          nodes_per_cell=nodes, gpus_per_node=gpus, held_gpu_ids=ids)
    assert [(p.bundle, p.num_gpus, p.visible_devices) for p in got] == want
    assert [p.rank for p in got] == list(range(ranks))


@pytest.mark.parametrize("device,ranks,nodes,gpus,want", [
    # the runner hosts the engines: the ranks hold their bundle's GPUs, on CPU as on CUDA
    pytest.param("cpu", 2, 1, 2, [(0, 1.0), (0, 1.0)], id="cpu-one-gpu-each"),
    pytest.param("cpu", 2, 1, 1, [(0, 0.5), (0, 0.5)], id="cpu-half-a-gpu-each"),
    pytest.param("cuda", 2, 1, 4, [(0, 2.0), (0, 2.0)], id="cuda-two-gpus-each"),
    pytest.param("cuda", 2, 2, 1, [(0, 1.0), (1, 1.0)], id="cuda-2-bundles"),
    pytest.param("cpu", 1, 1, 0, [(0, 0.0)], id="no-gpus"),
])
def test_ranks_hold_their_bundles_gpus(device, ranks, nodes, gpus, want):
    got = rank_placements(ShardingSettings(ranks_per_cell=ranks, device=device),
                          nodes_per_cell=nodes, gpus_per_node=gpus)
    assert [(p.bundle, p.num_gpus) for p in got] == want
    assert all(p.visible_devices is None for p in got)       # Ray pins what it gives


def test_cuda_placement_needs_the_bundles_gpu_ids():
    with pytest.raises(ShardingError, match=r"ShardingSettings.device='cuda'.*gpus_per_node=4"):
        rank_placements(ShardingSettings(ranks_per_cell=2, device="cuda"), nodes_per_cell=1,
                        gpus_per_node=4, held_gpu_ids=[("0",)])
