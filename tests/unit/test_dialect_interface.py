"""The store's dialects: one typed interface, each class implementing all of it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from celery_fenced.store import types
from celery_fenced.store.dialects import VENDORS, ORMDialect
from celery_fenced.store.dialects.interface import Dialect

OPERATIONS = sorted(name for name in vars(Dialect) if not name.startswith("_"))
CLASSES = [*VENDORS.values(), ORMDialect]
VALUE_TYPES = [v for v in vars(types).values() if dataclasses.is_dataclass(v)]


def summary(obj: object) -> str:
    """The first paragraph of ``obj``'s docstring."""
    return (inspect.getdoc(obj) or "").split("\n\n")[0]


@pytest.mark.parametrize("name", OPERATIONS)
def test_dialect_interface__each_operation_has_a_one_line_summary(name: str) -> None:
    said = summary(getattr(Dialect, name))
    assert said, name
    assert "\n" not in said, name


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_dialect_interface__every_class_implements_every_operation(cls: type) -> None:
    missing = [name for name in OPERATIONS if name != "alias" and not hasattr(cls, name)]
    assert not missing
    assert isinstance(cls("default"), Dialect)


@pytest.mark.parametrize("value_type", VALUE_TYPES, ids=lambda t: t.__name__)
def test_store_types__each_has_a_one_line_summary(value_type: type) -> None:
    said = summary(value_type)
    assert "\n" not in said
    assert not said.startswith(value_type.__name__ + "(")  # the dataclass default
