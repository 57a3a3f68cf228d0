"""tools/bench_growth.py: the growth exponent of each table and its Markdown."""

from types import ModuleType

import pytest

from tests.support.tools import load_tool


@pytest.fixture(scope="module")
def growth() -> ModuleType:
    return load_tool("bench_growth")


def test_the_exponent_says_how_cost_grows_between_neighbouring_sizes(growth: ModuleType) -> None:
    ks = growth.exponents([1, 2, 8, 16], [3.0, 6.0, 12.0, 48.0])
    assert ks[0] is None
    assert ks[1:] == pytest.approx([1.0, 0.5, 2.0])  # linear, absorbed (x4 work, x2 cost), quadratic


def test_sizes_and_costs_must_pair_up(growth: ModuleType) -> None:
    with pytest.raises(ValueError, match="3 sizes but 2 costs"):
        growth.exponents([1, 2, 4], [1.0, 2.0])


def test_a_table_carries_its_exponents_and_prints_as_markdown(growth: ModuleType) -> None:
    rows = growth.table(
        [{"tokens": 512, "step_time_s": 0.5}, {"tokens": 1024, "step_time_s": 0.75}], "tokens", "step_time_s"
    )
    assert rows[0]["growth_k"] is None
    assert rows[1]["growth_k"] == pytest.approx(0.5849625)  # log2(1.5)
    assert growth.markdown({"train": rows}).splitlines() == [
        "train:",
        "| tokens | step_time_s | growth_k |",
        "|---|---|---|",
        "| 512 | 0.5 | – |",
        "| 1024 | 0.75 | 0.585 |",
    ]
