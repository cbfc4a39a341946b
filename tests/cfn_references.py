"""One resolver of CloudFormation intrinsic functions for the tests: Ref, Fn::GetAtt,
Fn::ImportValue, Fn::Join and Fn::Sub (of a string) turned into plain values, recursively through
lists and dicts. The caller says what a Ref, an attribute and an export are; a reference it does not
know raises KeyError (never a silent guess)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


def resolve_references(token: Any, *, ref: Callable[[str], Any], get_att: Callable[[str, str], Any],
                       import_value: Callable[[str], Any]) -> Any:
    """`token` with every intrinsic function replaced: `ref(name)`, `get_att(logical id, attribute)`,
    `import_value(export name)` (the export's value, already resolved)."""

    def walk(value: Any) -> Any:
        if isinstance(value, list):
            return [walk(item) for item in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            (fn, arg), = value.items()
            if fn == "Ref":
                return ref(arg)
            if fn == "Fn::GetAtt":
                logical_id, attribute = arg if isinstance(arg, list) else arg.split(".", 1)
                return get_att(logical_id, attribute)
            if fn == "Fn::ImportValue":
                return import_value(walk(arg))
            if fn == "Fn::Join":
                separator, parts = arg
                return separator.join(str(walk(part)) for part in parts)
            if fn == "Fn::Sub" and isinstance(arg, str):
                return re.sub(r"\$\{([^}]+)\}", lambda m: str(walk({"Ref": m.group(1)})), arg)
        return {key: walk(item) for key, item in value.items()}

    return walk(token)
