"""Deprecated names: one warning and one module ``__getattr__``.

Names renamed or moved in 0.2.0 work until 0.3 and warn with
``DeprecationWarning`` (CHANGELOG.md lists them).
"""

import importlib
import warnings

REMOVED_IN = "0.3"


def warn(old: str, new: str, *, stacklevel: int = 2) -> None:
  """Warns that ``old`` is deprecated in favour of ``new``.

  ``stacklevel`` counts from the caller of ``warn`` as ``warnings.warn``
  counts from its own caller: 2 (the default) points at whoever called the
  deprecated function.
  """
  warnings.warn(
    f"{old} is deprecated (removed in {REMOVED_IN}); use {new}",
    DeprecationWarning,
    stacklevel=stacklevel + 1,
  )


def moved(module: str, table: dict[str, str]):
  """A module ``__getattr__`` serving old names that moved, with a warning.

  Args:
    module: the module's dotted name (``jaxtopk.kernels``).
    table: old attribute name -> new dotted path relative to ``module``
      (``"stats.BlockSizes"``), imported on first use.
  """

  def __getattr__(name):
    if name not in table:
      raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = f"{module}.{table[name]}"
    warn(f"{module}.{name}", new)
    where, _, attr = new.rpartition(".")
    return getattr(importlib.import_module(where), attr)

  return __getattr__
