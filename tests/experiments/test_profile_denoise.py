"""experiments/profile_denoise.py: the graph timeline's critical-path summary on hand-made spans, the tile
sets, and the round-robin timing on the tiny policy (CPU)."""

import statistics

import pytest
import torch

from experiments import profile_denoise


def test_timeline_summary_splits_the_span_into_chain_shares_and_idle():
    # a: 0-10, b launched early at 2 (PDL) and done at 15, a gap, a again 20-25 with c inside it
    spans = [(20.0, 25.0, "a"), (0.0, 10.0, "a"), (2.0, 15.0, "b"), (21.0, 24.0, "c")]
    out = profile_denoise.timeline_summary(spans)
    assert out["kernels"] == 4 and out["span_us"] == 25.0 and out["idle_us"] == 5.0
    assert out["overlap_us"] == (10 + 13 + 5 + 3) - (25 - 5)
    rows = {r["kernel"]: r for r in out["top"]}
    assert [r["kernel"] for r in out["top"]] == ["a", "b", "c"]  # by share of the critical path
    assert (rows["a"]["chain_us"], rows["a"]["us"], rows["a"]["calls"]) == (15.0, 15.0, 2)
    assert (rows["b"]["chain_us"], rows["b"]["us"]) == (5.0, 13.0)  # only its end past a's counts
    assert (rows["c"]["chain_us"], rows["c"]["mean_us"]) == (0.0, 3.0)  # hidden inside a
    assert sum(r["chain_us"] for r in out["top"]) == out["span_us"] - out["idle_us"]
    assert len(profile_denoise.timeline_summary(spans, top=1)["top"]) == 1


def test_chain_by_role_names_the_projections_and_the_norms_before_them():
    step = ["add_norm_kernel", "skinny_kernel", "rope_scatter_kernel", "skinny_kernel", "add_norm_kernel",
            "skinny_kernel", "skinny_kernel"]
    names = step * 2 + ["add_norm_kernel"]  # a trailing norm with no projection after it has no role
    shares = [float(i) for i in range(len(names))]
    out = profile_denoise.chain_by_role(names, shares)
    assert out["qkv"] == {"calls": 2, "mean_chain_us": (1 + 8) / 2}
    assert out["o"]["mean_chain_us"] == (3 + 10) / 2 and out["gate_up"]["mean_chain_us"] == (5 + 12) / 2
    assert out["down"]["mean_chain_us"] == (6 + 13) / 2
    assert out["norm_before_qkv"] == {"calls": 2, "mean_chain_us": (0 + 7) / 2}
    assert out["norm_before_gate_up"]["mean_chain_us"] == (4 + 11) / 2
    assert out["rope"] == {"calls": 2, "mean_chain_us": (2 + 9) / 2}
    assert set(out) == {"qkv", "o", "gate_up", "down", "rope", "norm_before_qkv", "norm_before_gate_up"}
    assert profile_denoise.chain_by_role(["a", "b"], [1.0, 2.0]) == {}


def test_chain_by_role_with_the_fused_mlp():
    """fused_mlp_kernel is gate_up+down, and the skinny call after it a qkv again."""
    step = ["add_norm_kernel", "skinny_kernel", "skinny_kernel", "add_norm_kernel", "fused_mlp_kernel"]
    out = profile_denoise.chain_by_role(step * 2, [float(i) for i in range(10)])
    assert out["qkv"]["mean_chain_us"] == (1 + 6) / 2 and out["o"]["mean_chain_us"] == (2 + 7) / 2
    assert out["gate_up+down"] == {"calls": 2, "mean_chain_us": (4 + 9) / 2}
    assert out["norm_before_gate_up+down"]["mean_chain_us"] == (3 + 8) / 2


def test_tile_set_replaces_the_row_table_for_the_shapes_it_names(monkeypatch):
    """A set's tile runs at every row count, also where it equals TUNED's (s4's gate_up)."""
    from policies.fast import skinny

    shapes = {"qkv": (2560, 1024, False), "o": (1024, 2048, False), "gate_up": (8192, 1024, True),
              "down": (1024, 4096, False)}
    monkeypatch.setattr(profile_denoise, "expert_shapes", lambda policy: shapes)
    tuned, by_rows = profile_denoise.tuned_for(None, "s4")
    assert tuned[shapes["gate_up"]] == profile_denoise.TILE_SETS["s4"]["gate_up"] and shapes["gate_up"] not in by_rows
    tuned, by_rows = profile_denoise.tuned_for(None, "down32")
    assert shapes["down"] not in by_rows and tuned[shapes["down"]] == profile_denoise.TILE_SETS["down32"]["down"]
    tuned, by_rows = profile_denoise.tuned_for(None, "qkv32")
    assert shapes["qkv"] not in by_rows and tuned[shapes["qkv"]] == profile_denoise.TILE_SETS["qkv32"]["qkv"]
    assert profile_denoise.tuned_for(None, None) == (skinny.TUNED, skinny.TUNED_BY_ROWS)


def test_nopreload_keeps_the_row_tables_with_preload_off(monkeypatch):
    """"nopreload" times the tuned tiles as they were before SkinnyTile.preload; "nopreload_o" only o's."""
    from policies.fast import skinny

    shapes = {"qkv": (2560, 1024, False), "o": (1024, 2048, False), "gate_up": (8192, 1024, True),
              "down": (1024, 4096, False)}
    monkeypatch.setattr(profile_denoise, "expert_shapes", lambda policy: shapes)
    assert any(t.preload for rows in skinny.TUNED_BY_ROWS.values() for _, _, t in rows)
    tuned, by_rows = profile_denoise.tuned_for(None, "nopreload")
    assert not any(t.preload for rows in by_rows.values() for _, _, t in rows)
    ranges = [(a, b) for a, b, _ in skinny.TUNED_BY_ROWS[shapes["down"]]]
    assert [(a, b) for a, b, _ in by_rows[shapes["down"]]] == ranges
    assert tuned == skinny.TUNED
    _, by_rows = profile_denoise.tuned_for(None, "nopreload_o")
    assert not any(t.preload for _, _, t in by_rows[shapes["o"]])
    assert by_rows[shapes["down"]] == skinny.TUNED_BY_ROWS[shapes["down"]]
    with pytest.raises(ValueError, match="unknown projection 'up'"):
        profile_denoise.tuned_for(None, "nopreload_up")


def test_every_tile_set_fits_the_expert_at_the_goal_row_counts():
    """The sets are timed on the H200 only: a tile that cannot run pi0.5's expert shape would end the
    call there. PhyAI b1 (50 rows) and LIBERO b1 (10)."""
    shapes = {"qkv": (2560, 1024, False), "o": (1024, 2048, False), "gate_up": (8192, 1024, True),
              "down": (1024, 4096, False)}
    for name, tiles in profile_denoise.TILE_SETS.items():
        for projection, tile in tiles.items():
            n, k, gelu_mul = shapes[projection]
            for rows in (10, 50):
                assert tile.fits(rows, n, k, gelu_mul) is None, (name, projection, rows)


def test_rounds_time_every_variant_round_robin():
    """--rounds 2 on the tiny policy (CPU): two timings per variant, `ms` their median, chains compared
    against the first variant's."""
    from experiments import bench_predict_common as common
    from policies.config import PolicyConfig
    from policies.policy import build_policy

    args = profile_denoise.parse_args(["--policy", "tiny", "--variants", "cublas/sdpa/off", "skinny/sdpa/off",
                                       "skinny/sdpa/off/fused", "--rounds", "2", "--iters", "1"])
    policy = build_policy(PolicyConfig.preset("tiny"), device="cpu")
    out = profile_denoise.profile_stage(policy, common.CONFIGURATIONS["libero_rl"], 1, torch.device("cpu"), args)
    assert list(out) == ["cublas/sdpa/off", "skinny/sdpa/off", "skinny/sdpa/off/fused"]
    assert out["skinny/sdpa/off/fused"]["chains_rel_l2_vs_first"] == out["skinny/sdpa/off"]["chains_rel_l2_vs_first"]
    for variant in out.values():
        assert len(variant["ms_rounds"]) == 2 and variant["ms"] == statistics.median(variant["ms_rounds"])
    assert out["cublas/sdpa/off"]["chains_rel_l2_vs_first"] == 0.0
    assert out["skinny/sdpa/off"]["chains_rel_l2_vs_first"] < 1e-3
    with pytest.raises(SystemExit):
        profile_denoise.parse_args(["--rounds", "0"])


def test_expert_attention_options_parse_and_are_restored_after_a_variant():
    """"triton@<options>" sets TritonSplitKVAttention.EXPERT_OPTIONS while the variant's sampler is built,
    and the class's defaults come back afterwards (also when the build fails)."""
    from experiments import bench_predict_common as common
    from policies.config import PolicyConfig
    from policies.fast.triton_attention import TritonSplitKVAttention
    from policies.policy import build_policy

    defaults = dict(TritonSplitKVAttention.EXPERT_OPTIONS)
    assert profile_denoise.expert_attention_options("") == defaults
    assert profile_denoise.expert_attention_options("w8_m16_n64_s3") == {
        **defaults, "warps": 8, "block_m": 16, "block_n": 64, "stages": 3}
    assert profile_denoise.expert_attention_options("m16_t25_x1") == {
        **defaults, "block_m": 16, "target_blocks": 25, "tma": True}
    assert profile_denoise.expert_attention_options("x0")["tma"] is False
    for bad in ("x8", "q4", "tbig"):
        with pytest.raises(ValueError, match=f"'{bad}'"):
            profile_denoise.expert_attention_options(f"w8_{bad}")
    policy = build_policy(PolicyConfig.preset("tiny"), device="cpu")
    spec, cpu = common.CONFIGURATIONS["libero_rl"], torch.device("cpu")
    inputs, noise = common.make_inputs(policy.cfg, 1, spec["prompt_len"], cpu, seed=1)
    stoch = torch.zeros(1, policy.cfg.sampling.num_steps, dtype=torch.bool)
    profile_denoise._variant_sampler(policy, "skinny/sdpa@m16_w8/off", 1, spec, inputs, noise, stoch, graphs=False)
    assert TritonSplitKVAttention.EXPERT_OPTIONS == defaults
    with pytest.raises(RuntimeError, match="triton"):  # no Triton attention on CPU: the build fails
        profile_denoise._variant_sampler(policy, "skinny/triton@w8/off", 1, spec, inputs, noise, stoch, graphs=False)
    assert TritonSplitKVAttention.EXPERT_OPTIONS == defaults


def test_a_variant_that_fails_is_recorded_and_the_others_still_run():
    from experiments import bench_predict_common as common
    from policies.config import PolicyConfig
    from policies.policy import build_policy

    args = profile_denoise.parse_args(["--policy", "tiny", "--variants", "skinny/sdpa/off", "skinny/triton/off",
                                       "cublas/sdpa/off", "--iters", "1"])
    policy = build_policy(PolicyConfig.preset("tiny"), device="cpu")
    out = profile_denoise.profile_stage(policy, common.CONFIGURATIONS["libero_rl"], 1, torch.device("cpu"), args)
    assert list(out) == args.variants  # the command line's order, the failed variant in its place
    assert "not usable" in out["skinny/triton/off"]["error"]  # no Triton attention on CPU
    assert out["cublas/sdpa/off"]["ms"] > 0 and out["skinny/sdpa/off"]["attention_layout"] is None
    args.variants = ["skinny/triton/off", "skinny/sdpa/off"]
    with pytest.raises(RuntimeError, match="reference variant"):
        profile_denoise.profile_stage(policy, common.CONFIGURATIONS["libero_rl"], 1, torch.device("cpu"), args)
