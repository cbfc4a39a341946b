"""Cost arithmetic: job time x nodes x hourly price, unknown prices, the GPU comparison."""

from __future__ import annotations

import json

import boto3
import pytest
from botocore.stub import Stubber

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


# ---- the AWS Price List API (botocore Stubber: the real client, canned responses) -------------------
def _product(instance_type: str, region: str, usd: str) -> str:
    """One GetProducts PriceList entry, in the API's shape (a JSON string per product)."""
    return json.dumps({
        "product": {"productFamily": "Compute Instance",
                    "attributes": {"instanceType": instance_type, "regionCode": region, "operatingSystem": "Linux"}},
        "terms": {"OnDemand": {"ABC.JRTCKXETXF": {"priceDimensions": {"ABC.JRTCKXETXF.6YS6EN2CT7": {
            "unit": "Hrs", "pricePerUnit": {"USD": usd}}}}},
                  "Reserved": {"ABC.4NA7Y494T4": {"priceDimensions": {"ABC.4NA7Y494T4.2TG2D8R56U": {
                      "unit": "Hrs", "pricePerUnit": {"USD": "9.999"}}}}}},
    })


@pytest.fixture
def pricing():
    client = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    with Stubber(client) as stubber:
        yield client, stubber


def _expect(stubber, price_list, region: str, instance_type: str, response: list[str]) -> None:
    stubber.add_response("get_products", {"PriceList": response, "FormatVersion": "aws_v1"},
                         {"ServiceCode": "AmazonEC2", "FormatVersion": "aws_v1", "MaxResults": 10,
                          "Filters": price_list.filters(region, instance_type)})


def test_any_region_and_type_is_priced_from_the_price_list_api_and_says_so(pricing):
    client, stubber = pricing
    price_list = cost.PriceList(client)
    filters = {f["Field"]: f["Value"] for f in price_list.filters("eu-north-1", "trn1.2xlarge")}
    assert filters == {"instanceType": "trn1.2xlarge", "regionCode": "eu-north-1", "operatingSystem": "Linux",
                       "tenancy": "Shared", "preInstalledSw": "NA", "licenseModel": "No License required",
                       "capacitystatus": "Used"}
    _expect(stubber, price_list, "eu-north-1", "trn1.2xlarge", [_product("trn1.2xlarge", "eu-north-1", "1.4500")])
    prices = cost.PriceTable("eu-north-1", price_list=price_list)  # not in the committed table
    step = cost.step_cost("Prepare", instance_type="trn1.2xlarge", nodes=1, started_at=0.0, stopped_at=3600.0,
                          prices=prices)
    assert step.cost_usd == pytest.approx(1.45)  # the on-demand term, not the reserved one
    assert step.as_dict()["price_source"] == cost.SOURCE_PRICE_LIST
    assert cost.run_cost([step])["price_sources"] == [cost.SOURCE_PRICE_LIST]
    assert prices.price("trn1.2xlarge") == pytest.approx(1.45)  # asked once, then remembered
    stubber.assert_no_pending_responses()


@pytest.mark.parametrize("failure", ["AccessDeniedException", "offline", "ambiguous"])
def test_the_committed_table_is_the_fallback_and_says_so(pricing, failure):
    client, stubber = pricing
    price_list = cost.PriceList(client)
    if failure == "offline":  # a client without the stubber, whose request never leaves the machine
        client = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
        client.meta.events.register("before-send.pricing.GetProducts", _no_network)
        price_list = cost.PriceList(client)
    elif failure == "ambiguous":
        _expect(stubber, price_list, "us-east-1", "trn1.32xlarge",
                [_product("trn1.32xlarge", "us-east-1", "21.50"), _product("trn1.32xlarge", "us-east-1", "7.00")])
    else:
        stubber.add_client_error("get_products", service_error_code=failure, http_status_code=400)
    price, source = cost.PriceTable("us-east-1", price_list=price_list).quote("trn1.32xlarge")
    assert price == 21.50 and source.startswith("committed table (AWS Price List API, AmazonEC2 us-east-1")


def _no_network(**_):
    from botocore.exceptions import EndpointConnectionError

    raise EndpointConnectionError(endpoint_url="https://api.pricing.us-east-1.amazonaws.com")


def test_overrides_win_without_asking_the_api(pricing):
    client, stubber = pricing  # no response queued: a call would fail the stubber
    prices = cost.PriceTable("us-east-1", overrides={"trn1.32xlarge": 20.0}, price_list=cost.PriceList(client))
    assert prices.quote("trn1.32xlarge") == (20.0, cost.SOURCE_OVERRIDE)
    assert cost.PriceTable("us-east-1").quote("trn1.32xlarge")[1].startswith("committed table")
    assert cost.local_cost([("train", 5.0)])["price_sources"] == [cost.SOURCE_LOCAL]
