"""One error tree: every Ember exception is importable from ``ember.errors`` and drawn there."""

from __future__ import annotations

import importlib
import pkgutil
import re

import ember
from ember import errors


def _all_subclasses(cls: type[errors.EmberError]) -> set[type[errors.EmberError]]:
    found: set[type[errors.EmberError]] = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_all_subclasses(sub)}
    return found


def _import_every_module() -> None:
    # A class defined in a module nobody imported yet would escape the walk below.
    for info in pkgutil.walk_packages(ember.__path__, "ember."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)


def test_every_ember_error_is_exported_and_drawn() -> None:
    _import_every_module()
    classes = {c for c in _all_subclasses(errors.EmberError) if c.__module__.startswith("ember")}
    drawn = set(re.findall(r"[├└]── (\w+)", errors.__doc__ or ""))
    for cls in sorted(classes, key=lambda c: c.__name__):
        assert getattr(errors, cls.__name__, None) is cls, f"{cls.__name__} not in ember.errors"
        assert cls.__name__ in errors.__all__, cls.__name__
        assert cls.__name__ in drawn, f"{cls.__name__} is not drawn in ember.errors' docstring"
    assert drawn == {c.__name__ for c in classes}


def test_the_drawing_matches_the_inheritance() -> None:
    # Each drawn child sits under its real parent: the drawing cannot drift from the code.
    doc = (errors.__doc__ or "").split("::", 1)[1]
    stack: list[tuple[int, str]] = []
    checked = 0
    for line in doc.splitlines():
        match = re.match(r"^(\s*)(?:[│ ]*[├└]── )?(\w+) \(|^(\s*)[│ ]*[├└]── (\w+)", line)
        if not match:
            continue
        name = match.group(2) or match.group(4)
        depth = line.find(name)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            parent = getattr(errors, stack[-1][1])
            assert issubclass(getattr(errors, name), parent), f"{name} drawn under {parent}"
            checked += 1
        stack.append((depth, name))
    assert checked == len(errors.__all__) - 1  # every class but the root has a parent


def test_errors_cross_processes_unchanged() -> None:
    # A replica raises, the edge answers: the message is not templated twice and keyword-only
    # fields survive.
    import pickle

    for err in (errors.InvalidBody("text must not be empty"),
                errors.QueueFull(deployment="m", queued=3, limit=2, retry_after_s=4)):
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), str(back), back.fields) == (type(err), str(err), err.fields)
        assert back.headers() == err.headers()
