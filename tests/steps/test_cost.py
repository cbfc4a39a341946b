"""Cost arithmetic: job time x nodes x hourly price, unknown prices, the GPU comparison."""

from __future__ import annotations

import pytest

from pipeline_steps import cost


def test_step_cost_is_hours_times_nodes_times_price():
    prices = cost.PriceTable("us-east-1")
    step = cost.step_cost("Train", instance_type="trn1.32xlarge", nodes=4, started_at=1000.0,
                          stopped_at=1000.0 + 1800, prices=prices)
    # half an hour on 4 nodes at 21.50 $/h
    assert step.cost_usd == pytest.approx(0.5 * 4 * 21.50)
    assert step.as_dict()["cost_usd"] == 43.0 and not step.running


def test_running_job_is_priced_up_to_now():
    step = cost.step_cost("Train", instance_type="trn1n.32xlarge", nodes=2, started_at=0.0, stopped_at=None,
                          prices=cost.PriceTable("us-east-1"), now=3600.0)
    assert step.running and step.cost_usd == pytest.approx(2 * 24.78)


def test_unknown_price_is_none_not_a_guess_and_overrides_win():
    no_price = cost.PriceTable("eu-west-1")
    step = cost.step_cost("Prepare", instance_type="trn1.2xlarge", nodes=1, started_at=0.0, stopped_at=60.0,
                          prices=no_price)
    assert step.cost_usd is None
    total = cost.run_cost([step])
    assert total["unpriced"] == ["Prepare"] and total["total_usd"] == 0.0
    priced = cost.PriceTable("eu-west-1", overrides=cost.parse_overrides(["trn1.2xlarge=1.5"]))
    assert cost.step_cost("Prepare", instance_type="trn1.2xlarge", nodes=1, started_at=0.0, stopped_at=3600.0,
                          prices=priced).cost_usd == pytest.approx(1.5)


@pytest.mark.parametrize("bad", ["trn1.2xlarge", "trn1.2xlarge=abc", "=3", "x=-1"])
def test_bad_price_override_says_the_expected_form(bad):
    with pytest.raises(ValueError, match="INSTANCE_TYPE=USD_PER_HOUR"):
        cost.parse_overrides([bad])


def test_gpu_comparison_defaults_are_the_seed_benchmark():
    cmp = cost.GpuComparison()
    # (24.725 / 6.64) / (37.69 / 5.44) = 3.7236 / 6.9283
    assert cmp.cost_ratio == pytest.approx(0.53745, abs=1e-4)
    out = cmp.compare(100.0)
    assert out["gpu_cost_usd"] == pytest.approx(100.0 / 0.53745, rel=1e-3)
    assert out["saving_usd"] == pytest.approx(out["gpu_cost_usd"] - 100.0)


def test_run_cost_totals_and_compares_only_training():
    prices = cost.PriceTable("us-east-1", overrides={"trn1.2xlarge": 1.0})
    steps = [cost.step_cost("Prepare", instance_type="trn1.2xlarge", nodes=1, started_at=0, stopped_at=3600,
                            prices=prices),
             cost.step_cost("Train", instance_type="trn1.32xlarge", nodes=2, started_at=0, stopped_at=3600,
                            prices=prices)]
    out = cost.run_cost(steps, comparison=cost.GpuComparison())
    assert out["total_usd"] == pytest.approx(1.0 + 43.0)
    assert out["node_hours"] == pytest.approx(3.0)
    assert out["gpu_comparison"]["trainium_cost_usd"] == pytest.approx(43.0)


def test_local_cost_has_real_durations_and_zero_price():
    out = cost.local_cost([("prepare", 2.5), ("train", 10.0)])
    assert out["total_usd"] == 0.0 and out["seconds"] == 12.5 and out["unpriced"] == []
    assert [s["step"] for s in out["steps"]] == ["prepare", "train"]
