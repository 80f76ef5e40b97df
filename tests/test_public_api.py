"""Public names keep working where users import them.

``tests/data/public_api.json`` lists each public module's ``__all__`` as released (and, for
``dlspass.distributed``, which had no ``__all__``, the names its docs named). A name may move,
but its old module must still give it, with a DeprecationWarning naming the new module; a name
that disappears fails here. A name added to a module's ``__all__`` belongs in the snapshot too
(regenerate the entry when you add one), so the snapshot keeps up with the API.
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import pytest

SNAPSHOT = json.loads((Path(__file__).parent / "data" / "public_api.json").read_text())


@pytest.mark.parametrize("module_name", sorted(SNAPSHOT))
def test_every_released_name_is_still_importable_from_its_module(module_name: str) -> None:
    module = importlib.import_module(module_name)
    current = set(getattr(module, "__all__", ()))
    for name in SNAPSHOT[module_name]:
        if name in current or name in vars(module):  # still public, or still defined there
            getattr(module, name)
            continue
        # moved: still there, with a warning that says where it went
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                value = getattr(module, name)
            except AttributeError:
                pytest.fail(f"{module_name}.{name} disappeared without a deprecation shim")
        moved = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert moved, f"{module_name}.{name} left __all__ but warns nothing"
        new_home = str(moved[0].message)
        owner = getattr(value, "__module__", None) or ""
        assert "dlspass." in new_home and (not owner.startswith("dlspass") or owner in new_home), \
            (module_name, name, new_home)


@pytest.mark.parametrize("module_name", sorted(m for m in SNAPSHOT if m != "dlspass.distributed"))
def test_the_snapshot_lists_every_current_public_name(module_name: str) -> None:
    current = set(importlib.import_module(module_name).__all__)
    assert current <= set(SNAPSHOT[module_name]), \
        f"new public names {sorted(current - set(SNAPSHOT[module_name]))}: add them to tests/data/public_api.json"


def test_the_four_scaler_checkpoint_names_import_from_distributed_again() -> None:
    from dlspass import checkpoint

    for name in ("load_scaler", "save_scaler", "dcp_state_dict", "load_dcp_state_dict"):
        with pytest.warns(DeprecationWarning, match=rf"dlspass\.checkpoint\.{name}"):
            exec(f"from dlspass.distributed import {name} as got", namespace := {})
        assert namespace["got"] is getattr(checkpoint, name)


def test_the_float8_recipe_names_alias_moved_and_the_class_keeps_the_name() -> None:
    """``dlspass.config.Float8Recipe`` (the recipe names) became ``Float8RecipeName``, so that
    ``Float8Recipe`` means one thing, the recipe of ``dlspass.float8_policy``; the old import
    still works, with a warning naming the new name."""
    from typing import get_args

    from dlspass import config, float8_policy

    with pytest.warns(DeprecationWarning, match=r"dlspass\.config\.Float8RecipeName"):
        old = config.Float8Recipe
    assert old is config.Float8RecipeName
    assert get_args(old) == config.FLOAT8_RECIPES == tuple(float8_policy.RECIPES)
    assert isinstance(float8_policy.RECIPES["tensorwise"], float8_policy.Float8Recipe)
    with pytest.raises(AttributeError):
        config.NoSuchName  # noqa: B018  (the shim answers only the moved name)
