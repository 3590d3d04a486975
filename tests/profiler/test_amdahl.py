import math
import subprocess
import sys

import pytest

from profiler.amdahl import ideal_projection, ideal_step_time, ideal_table, main


def test_phyai_projection_by_hand():
    p = ideal_projection(955.8, 152.4, 2.55)
    assert p.step_s == pytest.approx(955.8 - 152.4 + 152.4 / 2.55)  # 863.165
    assert round(p.step_s, 1) == 863.2
    assert p.end_to_end == pytest.approx(955.8 / 863.1647, rel=1e-6)
    assert round(-p.saving * 100, 1) == -9.7


def test_table_limits():
    rows = {r.speedup: r for r in ideal_table(100.0, 40.0)}
    assert rows[1.5].step_s == pytest.approx(60 + 40 / 1.5)
    assert rows[2.0].step_s == pytest.approx(80.0)
    assert rows[math.inf].step_s == pytest.approx(60.0) and rows[math.inf].end_to_end == pytest.approx(100 / 60)
    assert ideal_step_time(100.0, 40.0, 1.0) == 100.0


@pytest.mark.parametrize("step, phase, s, message", [
    (10.0, 11.0, 2.0, "phase time must be within"), (0.0, 0.0, 2.0, "step time must be > 0"),
    (10.0, 1.0, 0.5, "speed-up must be >= 1"),
])
def test_invalid_inputs(step, phase, s, message):
    with pytest.raises(ValueError, match=message):
        ideal_step_time(step, phase, s)


def test_cli_prints_the_projected_step_last(capsys):
    assert main(["--step", "955.8", "--predict", "152.4", "--speedup", "2.55"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "863.2 s" in last and "1.107x" in last and "-9.7%" in last


def test_cli_as_a_module():
    out = subprocess.run([sys.executable, "-m", "profiler.amdahl", "--step", "955.8", "--predict", "152.4",
                          "--speedup", "2.55"], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1].startswith("projected step time: 863.2 s")
