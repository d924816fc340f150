"""The verifier contract and the registry that finds verifiers as entry-point plugins.

A verifier is a token-level selection rule (``../docs`` notation: q = target, p = draft):
given the target law ``q`` and K draft candidates ``x_k ~ p_k`` at one position, it outputs
one token. Plugins register a :class:`Verifier` subclass under the entry-point group
``specdec.verifiers``; its constructor's keyword arguments are its parameters.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from stevedore import driver

from .errors import UsageError
from .sampling import sample

ENTRY_POINT_GROUP = "specdec.verifiers"


class VerifierParameterError(UsageError, TypeError):
    """An unknown or ill-typed verifier parameter (a TypeError too, as Python callers expect)."""


class Verifier(ABC):
    """Base class of every verifier. All methods are batched over leading dimensions ``[...]``.

    Subclasses set ``name``, ``lossless`` and ``max_drafts`` (``None`` = any number), optionally
    ``identical_drafts``, and take their parameters as keyword-only constructor arguments with defaults.
    """

    name: ClassVar[str]
    lossless: ClassVar[bool]
    max_drafts: ClassVar[int | None]
    identical_drafts: ClassVar[bool] = False
    """True for schemes defined only for K samples of one draft law (SpecTr)."""

    def __new__(cls, *args: Any, **params: Any) -> "Verifier":
        # Checked here, not in __init__, so that every construction path (stevedore's
        # invoke_kwds included) names the valid parameters instead of Python's bare TypeError.
        valid = parameter_defaults(cls)
        unknown = sorted(set(params) - set(valid))
        if args or unknown:
            given = ", ".join(unknown) if unknown else "positional arguments"
            accepted = ", ".join(valid) if valid else "none"
            raise VerifierParameterError(
                f"verifier '{cls.name}' got unknown parameter(s) {given}; valid parameters: {accepted}"
            )
        return super().__new__(cls)

    @abstractmethod
    def conditional(
        self, target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor
    ) -> torch.Tensor:
        """The exact law of the output token given the candidates.

        target_probs ``[..., V]``, draft_probs ``[..., K, V]``, draft_tokens ``[..., K]`` → ``[..., V]``.
        """

    def select(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sample from :meth:`conditional` → (token ``[...]``, accepted ``[...]``).

        ``accepted`` says whether the token equals one of the candidates. This default samples
        the conditional law; verifiers override it with a cheaper equivalent.
        """
        token = sample(self.conditional(target_probs, draft_probs, draft_tokens), generator)  # [...]
        accepted = (draft_tokens == token.unsqueeze(-1)).any(-1)  # [...]
        return token, accepted

    def prepare(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> None:
        """Optional: called once per block with every position's laws, before ``select`` walks them.

        target_probs ``[L, V]``, draft_probs ``[L, K, V]`` (all drafts alive). Schemes that solve a
        problem per position (the importance-sampling LPs) solve them here in one batched call;
        the default does nothing.
        """

    @abstractmethod
    def acceptance_probability(self, target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
        """P(output ∈ candidates) when ``x_k ~ draft_probs[..., k, :]`` independently → ``[...]``."""


def parameter_defaults(cls: type) -> dict[str, Any]:
    """A verifier class's parameters and their defaults, from its constructor's signature."""
    signature = inspect.signature(cls.__init__)
    return {
        name: p.default
        for name, p in signature.parameters.items()
        if name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


class VerifierRegistry:
    """Finds verifiers by entry-point name (case-insensitive) through stevedore.

    :meth:`load_class` is the one place plugins are loaded; tests and embedders override it.
    """

    group = ENTRY_POINT_GROUP

    def names(self) -> list[str]:
        return sorted({ep.name for ep in importlib.metadata.entry_points(group=self.group)})

    def load_class(self, name: str) -> type[Verifier]:
        manager = driver.DriverManager(self.group, name, invoke_on_load=False)
        return manager.driver

    def canonical(self, name: str) -> str:
        """The installed verifier's entry-point name for ``name`` (case-insensitive), or a UsageError."""
        key = name.strip().lower()
        if key not in self.names():
            installed = ", ".join(self.names()) or "none"
            raise UsageError(f"unknown verifier '{name}'; installed verifiers: {installed} (see `specdec verifiers`)")
        return key

    def create(self, name: str, params: dict[str, Any] | None = None) -> Verifier:
        return self.load_class(self.canonical(name))(**(params or {}))


def load_verifier(name: str, params: dict[str, Any] | None = None) -> Verifier:
    """An instance of the installed verifier ``name`` with ``params``."""
    return VerifierRegistry().create(name, params)
