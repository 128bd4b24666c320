"""Restricted types that LightningCLI checks while it parses a config, and that mypy sees as the plain types.

jsonargparse's restricted types are module variables (built at import), which mypy cannot use as types; values of
them are subclasses of ``int``, ``float`` and ``str``, which the package turns back into the plain types on
construction so that they pickle, save to YAML and compare as users expect.
"""

from typing import TYPE_CHECKING

__all__ = ["NonNegativeFloat", "NotEmptyStr", "PositiveInt"]

if TYPE_CHECKING:
    NonNegativeFloat = float
    NotEmptyStr = str
    PositiveInt = int
else:
    from jsonargparse.typing import NonNegativeFloat, NotEmptyStr, PositiveInt
