"""The offloaded optimizer's auto / True / False switches (``pipeline``,
``reduce_on_device``), decided by one rule: False never; True always, or a ValueError that
says why it cannot; ``"auto"`` where it pays and may. What makes a switch impossible is
its module's ``refusal`` (``buckets``, ``device_comm``); whether it pays is the caller's."""

from __future__ import annotations

from typing import Any


def check_switch(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is "auto", True or False."""
    if not isinstance(value, bool) and value != "auto":
        raise ValueError(f"{name}={value!r}: use 'auto', True or False")


def decide(name: str, requested: Any, why_not: str | None, *, pays: bool) -> bool:
    """Whether switch ``name`` is on: ``requested`` False or True as given (True raising
    ``why_not``, the reason it cannot be, when there is one), ``"auto"`` when it may
    (``why_not`` is None) and ``pays``."""
    check_switch(name, requested)
    if requested is False:
        return False
    if requested is True:
        if why_not is not None:
            raise ValueError(f"{name}=True cannot be used: {why_not}")
        return True
    return why_not is None and pays
