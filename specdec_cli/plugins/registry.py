"""Finding plugins: verifiers (entry-point group ``specdec.verifiers``) and drafters (``specdec.drafters``).

This module keeps the registry's import path; its parts each have a module:

- :mod:`.discovery`: the group's entry points with stevedore, who gets each name, loading the one that holds it;
- :mod:`.descriptions`: what a listing shows of a plugin class, and the cache that keeps it;
- :mod:`.plugin_registry`: :class:`PluginRegistry`, a kind's names, classes, instances and descriptions, and
  :meth:`PluginRegistry.add`, the seam through which a test or an embedder adds a class;
- :mod:`.verifier_registry`: :class:`VerifierRegistry`, and what core asks of verifiers;
- :mod:`.drafter_registry`: ``DrafterRegistry``, and what core asks of drafters.

Nothing here imports torch or a plugin until a plugin class is asked for, and asking for one imports that plugin
alone. Plugins are third-party code, and a broken one must not take the command down with it: whatever a module
raises on import (``sys.exit`` included), a class that breaks the contract, or two packages claiming one name
becomes a load failure that ``specdec verifiers`` lists and that using the name reports in one line.
"""

from __future__ import annotations

from .descriptions import REQUIRED, SETTLE_NS, class_summary, parameter_docs, plain_parameters
from .discovery import BUILT_IN_DISTRIBUTION, PluginEntry
from .parameters import PluginParameterError, PluginParameterValueError
from .plugin_registry import PluginFault, PluginRegistry, class_problem, error_line
from .verifier_registry import (
    DESCRIPTION_TYPES,
    ENTRY_POINT_GROUP,
    VerifierFault,
    VerifierParameterError,
    VerifierParameterValueError,
    VerifierRegistry,
    load_verifier,
)

__all__ = [
    "BUILT_IN_DISTRIBUTION",
    "DESCRIPTION_TYPES",
    "ENTRY_POINT_GROUP",
    "REQUIRED",
    "SETTLE_NS",
    "PluginEntry",
    "PluginFault",
    "PluginParameterError",
    "PluginParameterValueError",
    "PluginRegistry",
    "VerifierFault",
    "VerifierParameterError",
    "VerifierParameterValueError",
    "VerifierRegistry",
    "class_problem",
    "class_summary",
    "error_line",
    "load_verifier",
    "parameter_docs",
    "plain_parameters",
]
