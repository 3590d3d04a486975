"""experiments/profile_denoise.py's graph timeline: its critical-path summary on hand-made spans."""

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
