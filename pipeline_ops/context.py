"""The AWS side of one `trainium-runs` call: the session and clients, the stage's stacks and
their outputs, the state machine of the team acted on, and the instance types jobs are priced by."""

from __future__ import annotations

import argparse
import copy
from typing import Any

from pipeline_contract import (
    DEFAULT_SINGLE_NODE_INSTANCE_TYPE,
    DEFAULT_TRAINING_INSTANCE_TYPE,
    SINGLE_NODE_INSTANCE_TYPE_OUTPUT,
    STATE_MACHINE_OUTPUT,
    TRAINING_INSTANCE_TYPE_OUTPUT,
    TeamPaths,
    stack_name,
)
from pipeline_steps import cost as cost_lib

from .errors import ConfigError


class Context:
    """Clients, the resolved state machine and the price table for one CLI call."""

    def __init__(self, args: argparse.Namespace) -> None:
        import boto3

        self.args = args
        self.session = boto3.Session(profile_name=args.profile, region_name=args.region)
        if not self.session.region_name:
            raise ConfigError("no AWS region: pass --region or set AWS_REGION / AWS_DEFAULT_REGION.")
        self.region = self.session.region_name
        self.stack_name = self.stack_of("Pipeline")
        self.team: str | None = args.team or None
        self.paths = TeamPaths(self.team)
        self._clients: dict[str, Any] = {}
        self._outputs: dict[str, dict[str, str]] = {}
        self._arn: str | None = None
        self.prices = cost_lib.PriceTable(
            self.region, overrides=cost_lib.parse_overrides(args.price),
            price_list=None if args.offline_prices else cost_lib.PriceList.from_session(self.session))

    def client(self, name: str) -> Any:
        if name not in self._clients:
            self._clients[name] = self.session.client(name)
        return self._clients[name]

    def stack_of(self, role: str) -> str:
        return stack_name(self.args.project, self.args.stage, role)

    def outputs(self, role: str = "Pipeline") -> dict[str, str]:
        """The outputs of the stage's stack `role` ("Pipeline", "Storage"), read once."""
        if role not in self._outputs:
            from botocore.exceptions import ClientError

            stack_name = self.stack_of(role)
            try:
                stacks = self.client("cloudformation").describe_stacks(StackName=stack_name)["Stacks"]
            except ClientError as exc:
                if "does not exist" in str(exc):
                    raise ConfigError(
                        f"stage {self.args.stage!r}: no stack {stack_name} in {self.region}. Is the stage "
                        f"deployed there (cdk deploy -c stage={self.args.stage})? Otherwise pass --stage, "
                        "--project, --region or --state-machine-arn.") from None
                raise
            self._outputs[role] = {o["OutputKey"]: o["OutputValue"] for o in stacks[0].get("Outputs", [])}
        return self._outputs[role]

    def bucket(self, output: str) -> str:
        """A bucket name from the Storage stack's outputs ("DataBucketName", "ArtifactsBucketName")."""
        name = self.outputs("Storage").get(output)
        if not name:
            raise ConfigError(f"stack {self.stack_of('Storage')} has no {output} output; redeploy the stage "
                                "(cdk deploy) to add it.")
        return name

    @property
    def state_machine_arn(self) -> str:
        if self._arn is None:
            if self.args.state_machine_arn:
                arn = self.args.state_machine_arn
                sfn = self.client("stepfunctions")
                try:
                    sfn.describe_state_machine(stateMachineArn=arn)
                except (sfn.exceptions.StateMachineDoesNotExist, sfn.exceptions.InvalidArn):
                    raise ConfigError(f"no state machine {arn} in {self.region}.") from None
            else:
                arn = self.team_state_machines().get(self.team)
                if not arn:
                    raise ConfigError(self._no_pipeline())
            self._arn = arn
        return self._arn

    def for_team(self, team: str | None, arn: str) -> Context:
        """The same clients and prices, acting on another team's pipeline (`arn`)."""
        other = copy.copy(self)
        other.team, other.paths, other._arn = team, TeamPaths(team), arn
        return other

    def team_state_machines(self) -> dict[str | None, str]:
        """Team (None: the default team of a stage without teams) -> its pipeline's state machine
        ARN, from the Pipeline stack's outputs `StateMachineArn` / `<Team>StateMachineArn`."""
        found = {}
        for key, value in self.outputs().items():
            if key.endswith(STATE_MACHINE_OUTPUT):
                name = key.removesuffix(STATE_MACHINE_OUTPUT).lower()
                found[name or None] = value
        return found

    def _no_pipeline(self) -> str:
        teams = sorted(t for t in self.team_state_machines() if t)
        if self.team is None and teams:
            return f"stage {self.args.stage!r} has teams: pass --team <one of {', '.join(teams)}> (or TRAINIUM_TEAM)."
        if self.team is not None:
            known = f"its teams are {', '.join(teams)}" if teams else "it has no teams (drop --team)"
            return f"stack {self.stack_name} has no pipeline for team {self.team!r}: {known}."
        return f"stack {self.stack_name} has no {STATE_MACHINE_OUTPUT} output; pass --state-machine-arn."

    def instance_types(self) -> tuple[str, str]:
        """(training, single-node) instance types: flags, then stack outputs, then defaults."""
        outputs = self.outputs() if not self.args.state_machine_arn else {}
        training = (self.args.training_instance_type or outputs.get(TRAINING_INSTANCE_TYPE_OUTPUT)
                    or DEFAULT_TRAINING_INSTANCE_TYPE)
        single = (self.args.single_node_instance_type or outputs.get(SINGLE_NODE_INSTANCE_TYPE_OUTPUT)
                  or DEFAULT_SINGLE_NODE_INSTANCE_TYPE)
        return training, single
