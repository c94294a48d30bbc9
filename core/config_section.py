"""The shared base of every config section: closed (unknown keys fail) and immutable once parsed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: closed (unknown keys fail) and immutable once parsed."""

    model_config = ConfigDict(extra="forbid", frozen=True)
