"""What both CLIs (`pipeline-steps`, `trainium-runs`) share at their edge: the version line and
shell completion.

Completion uses argcomplete (https://kislyuk.github.io/argcomplete/): the shell runs the command
with _ARGCOMPLETE set, `autocomplete` prints the candidates and exits; otherwise it returns at
once. Enable it per command with `eval "$(register-python-argcomplete trainium-runs)"`.
"""

from __future__ import annotations

import argparse
import os

from . import __version__


def version_line(prog: str) -> str:
    return f"{prog} {__version__} (trainium-embeddings)"


def asked_to_complete() -> bool:
    return "_ARGCOMPLETE" in os.environ


def autocomplete(parser: argparse.ArgumentParser) -> None:
    """Answer the shell's completion request, if this is one."""
    if not asked_to_complete():
        return
    # Only reached under the shell's completion hook: argcomplete is in the `ops` and `local`
    # extras, and the training image, which never completes, does not need it.
    import argcomplete

    argcomplete.autocomplete(parser)
