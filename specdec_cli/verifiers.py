"""The verifier contract, where plugin authors import it.

This module only keeps the public import path; the names live in:

- :mod:`specdec_cli.plugins.verifiers`
- :mod:`specdec_cli.plugins.registry`
- :mod:`specdec_cli.plugins.parameters`
"""

from .plugins.parameters import parameter_defaults
from .plugins.registry import (
    VerifierFault,
    VerifierParameterError,
    VerifierParameterValueError,
    VerifierRegistry,
    load_verifier,
)
from .plugins.single_draft import SingleDraftRule
from .plugins.verifiers import *  # noqa: F403 (the names of that module's __all__)
from .plugins.verifiers import __all__ as _contract

__all__ = [
    *_contract,
    "SingleDraftRule",
    "VerifierFault",
    "VerifierParameterError",
    "VerifierParameterValueError",
    "VerifierRegistry",
    "load_verifier",
    "parameter_defaults",
]
