"""CloudWatch Logs retention from a number of days (the config speaks days; CDK wants an enum)."""

from __future__ import annotations

from aws_cdk import aws_logs as logs

# The values CloudWatch Logs accepts (PutRetentionPolicy), mapped to CDK's enum members.
_BY_DAYS: dict[int, logs.RetentionDays] = {
    1: logs.RetentionDays.ONE_DAY,
    3: logs.RetentionDays.THREE_DAYS,
    5: logs.RetentionDays.FIVE_DAYS,
    7: logs.RetentionDays.ONE_WEEK,
    14: logs.RetentionDays.TWO_WEEKS,
    30: logs.RetentionDays.ONE_MONTH,
    60: logs.RetentionDays.TWO_MONTHS,
    90: logs.RetentionDays.THREE_MONTHS,
    120: logs.RetentionDays.FOUR_MONTHS,
    150: logs.RetentionDays.FIVE_MONTHS,
    180: logs.RetentionDays.SIX_MONTHS,
    365: logs.RetentionDays.ONE_YEAR,
    400: logs.RetentionDays.THIRTEEN_MONTHS,
    545: logs.RetentionDays.EIGHTEEN_MONTHS,
    731: logs.RetentionDays.TWO_YEARS,
    1827: logs.RetentionDays.FIVE_YEARS,
    3653: logs.RetentionDays.TEN_YEARS,
}


def retention_days(days: int) -> logs.RetentionDays:
    """The enum member for `days`; ValueError naming the valid values otherwise."""
    if days not in _BY_DAYS:
        raise ValueError(f"Log retention of {days} days is not a CloudWatch Logs value; use one of {sorted(_BY_DAYS)}.")
    return _BY_DAYS[days]
