"""benchmarks/profile_gpu.py's arguments: the flags it takes for one scenario reach the others'
own parsers (an S4 profile "with graphs" once ran eagerly because they did not)."""

from __future__ import annotations

from benchmarks import profile_gpu


def test_shared_flags_reach_the_other_scenarios() -> None:
    args = profile_gpu.parse_args(["s4", "--batch", "1", "--cuda-graphs", "--overlap", "--fused-kernels"])
    assert sorted(args.scenario_args) == ["--cuda-graphs", "--fused-kernels", "--overlap"]
    s10 = profile_gpu.parse_args(["s10", "--cuda-graphs"])
    assert s10.cuda_graphs and s10.scenario_args == []
    s7 = profile_gpu.parse_args(["s7", "--fused-kernels", "--batch", "4"])
    assert s7.fused_kernels and s7.batch == 4 and s7.scenario_args == []
