"""Teams sharing one stage: who they are, their fair share, their FSx quota and who acts for them.

A stage with no teams has one default team with the layout it always had (pipeline_steps.contract
TeamPaths(None)). A stage with teams runs one pipeline per team, each in its own prefixes and FSx
directory (docs/operations.md, "Teams"). `check_teams` gathers every problem of the team list into
one fix-it ValueError, so a reviewer fixes the table once.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline_steps.contract import TeamPaths

TEAM_NAME_RE = re.compile(r"^[a-z][a-z0-9]{1,23}$")
# An IAM role ARN (https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_identifiers.html#identifiers-arns).
ROLE_ARN_RE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]{1,512}$")
# Lustre project ids are 32-bit; this range keeps clear of 0 (no project) and small ids a site may use.
PROJECT_ID_BASE, PROJECT_ID_SPAN = 100_000, 1_000_000_000
MIN_QUOTA_GIB = 1 / 1024  # 1 MiB: Lustre grants quota to the storage servers in units of about this size


@dataclass(frozen=True, kw_only=True)
class TeamConfig:
    """One team of a stage."""

    name: str
    """2-24 lowercase letters and digits, starting with a letter: its share identifier, S3 prefixes
    (incoming/<name>/, runs/<name>/, models/<name>/), FSx directory (/fsx/runs/<name>), job tag
    and resource names all derive from it."""
    weight: float = 1.0
    """Fair-share weight of the team's share identifier (Batch weightFactor 0.0001..999.9999; a
    lower weight is a larger share of the queues)."""
    compute_reservation: int | None = None
    """Percent (0..99) of the training environment's vCPUs Batch holds back for share identifiers
    that are idle, so this team's first job starts without waiting for busy teams' jobs to end.
    Batch's fair-share policy has one such value for all shares (FairsharePolicy
    computeReservation, reserved ratio (value/100)^active shares), so the stage uses the largest any
    team asks for, or ComputeConfig.compute_reservation when none does."""
    fsx_quota_gib: float
    """Hard limit of the team's Lustre project quota on its FSx runs directory: a job that would
    write past it fails with "Disk quota exceeded" (failure class storage_error)."""
    principals: tuple[str, ...]
    """IAM role ARNs that may assume the team's role (trainium-runs, uploads, reads)."""

    @property
    def share_identifier(self) -> str:
        return self.name

    @property
    def paths(self) -> TeamPaths:
        return TeamPaths(self.name)

    @property
    def project_id(self) -> int:
        """The team's Lustre project id: derived from the name, so it never changes with the order
        of the team list (check_teams refuses two teams whose ids collide)."""
        return PROJECT_ID_BASE + zlib.crc32(self.name.encode()) % PROJECT_ID_SPAN

    @property
    def fsx_quota_kib(self) -> int:
        """The quota as `lfs setquota -B` takes it (KiB)."""
        return int(self.fsx_quota_gib * 1024 * 1024)

    @property
    def construct_name(self) -> str:
        """Prefix of the team's construct ids and stack outputs ("search" -> "Search")."""
        return self.name.capitalize()


def _team_problems(team: TeamConfig) -> list[str]:
    problems = []
    if not TEAM_NAME_RE.match(team.name):
        problems.append(f"name {team.name!r}: use 2-24 lowercase letters and digits, starting with a letter "
                        "(it becomes an S3 prefix, a share identifier and resource names)")
    if not 0.0001 <= team.weight <= 999.9999:
        problems.append(f"{team.name}: weight={team.weight}: Batch accepts 0.0001..999.9999")
    if team.compute_reservation is not None and not 0 <= team.compute_reservation <= 99:
        problems.append(f"{team.name}: compute_reservation={team.compute_reservation}: a percentage 0..99")
    if not team.fsx_quota_gib >= MIN_QUOTA_GIB:
        problems.append(f"{team.name}: fsx_quota_gib={team.fsx_quota_gib}: at least {MIN_QUOTA_GIB:.6f} (1 MiB)")
    if not team.principals:
        problems.append(f"{team.name}: principals: name at least one IAM role ARN that acts for the team")
    problems += [f"{team.name}: principal {arn!r} is not an IAM role ARN (arn:aws:iam::<account>:role/<name>)"
                 for arn in team.principals if not ROLE_ARN_RE.match(arn)]
    return problems


def check_teams(teams: Sequence[TeamConfig], *, fsx_capacity_gib: int, admin_principals: Sequence[str]) -> None:
    """Every problem of the team list in one ValueError: names, weights, reservations, quotas that
    together exceed the file system (one team could then still fill the disk), principals."""
    problems = [p for team in teams for p in _team_problems(team)]
    names = [team.name for team in teams]
    problems += [f"team {name!r} is defined {names.count(name)} times" for name in sorted(set(names))
                 if names.count(name) > 1]
    ids: dict[int, str] = {}
    for team in teams:
        other = ids.setdefault(team.project_id, team.name)
        if other != team.name:
            problems.append(f"teams {other!r} and {team.name!r} derive the same Lustre project id "
                            f"{team.project_id}; rename one")
    total = sum(team.fsx_quota_gib for team in teams)
    if total > fsx_capacity_gib:
        problems.append(f"the FSx quotas add up to {total:g} GiB, more than the file system's {fsx_capacity_gib} "
                        "GiB: the disk would fill before a team reached its quota; lower the quotas or raise "
                        "StorageConfig.fsx_storage_capacity_gib")
    problems += [f"admin principal {arn!r} is not an IAM role ARN" for arn in admin_principals
                 if not ROLE_ARN_RE.match(arn)]
    if admin_principals and not teams:
        problems.append("admin_principals without teams: the admin role exists only in a stage with teams")
    if problems:
        raise ValueError("StageConfig.teams: fix these and synthesize again:\n  - " + "\n  - ".join(problems))
