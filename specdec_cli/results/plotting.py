"""What every plot shares: a colour per verifier name that does not change when plugins come or go, and a
title that says what was run."""

from __future__ import annotations

import hashlib
from pathlib import Path

# Tableau's ten colours, then their lighter halves: distinguishable, and readable in greyscale by shade.
_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#c7c7c7",
)
_FIXED = {
    "optimum": "#000000",
    "none": "#555555",
    "threshold": "#d62728",
    "fly": "#8c564b",
    "cactus": "#ff7f0e",
    "traversal": "#e377c2",
}
"""Rows that are not verifiers (the theoretical optimum and the target alone), and the shipped verifiers whose
name's hash gives a colour another shipped one has (is-lp's, speculative's, threshold's, ensemble's): fixed, so every
shipped one differs."""


def verifier_colour(name: str) -> str:
    """The colour of verifier ``name`` in every plot: from a hash of the name, so installing a plugin
    never recolours the others."""
    if name in _FIXED:
        return _FIXED[name]
    digest = hashlib.md5(name.encode(), usedforsecurity=False).hexdigest()  # a spread, not a secret
    return _PALETTE[int(digest, 16) % len(_PALETTE)]


def describe_run(recipe: dict, what: str, conditions: list[dict]) -> str:
    """A plot's title, so the picture says what was run: ``what`` (the task and its examples, or the
    prompts), the token limit, the models (``recipe`` as its dict), and the machine of each set of
    ``conditions`` (:func:`~specdec_cli.results.provenance.run_conditions`: device and threads)."""
    target = recipe["target"]
    drafts = ", ".join(_model_name(draft, target) for draft in recipe.get("drafts", ())) or "none"
    # Several sets of conditions (a resume under others): each value once, 'threads 1 / 2'.
    devices, threads = (
        " / ".join(dict.fromkeys(str(c.get(name, "?")) for c in conditions)) for name in ("device", "threads")
    )
    machine = f"{devices}, threads {threads}" if conditions else "device and threads not recorded"
    return (
        f"{what}, at most {recipe['generation']['max_new_tokens']} new tokens\n"
        f"target {_model_name(target, target)}, draft {drafts}\n{machine}"
    )


def _model_name(model: dict, target: dict) -> str:
    """A model's short name: the last part of its hub id or path (and GGUF file), or the target's layers it
    uses; with its dtype unless 'auto' (a draft is often the target's checkpoint in another dtype). A draft
    entry whose drafter takes no model is named by its drafter."""
    layers = model.get("early_exit") or (model.get("params") or {}).get("layers")
    if layers and model.get("drafter") in (None, "early-exit"):
        return f"{_model_name(target, target)}'s first {layers} layers"
    if model.get("model") is None and model.get("drafter"):  # a drafter without a model: its name and parameters
        params = ", ".join(f"{key}={value}" for key, value in (model.get("params") or {}).items())
        return model["drafter"] + (f" ({params})" if params else "")
    name = Path(str(model.get("model"))).name + (f"/{model['gguf_file']}" if model.get("gguf_file") else "")
    return name if model.get("dtype", "auto") == "auto" else f"{name} ({model['dtype']})"


LABEL_GAP_PX = 2.0
"""Pixels kept between two point labels that :func:`separate_labels` moved apart (their pale ground reaches past
the text by about one)."""
LABEL_TRIES = 12
"""Rows above and below its point that :func:`separate_labels` tries for a label before leaving it where it is."""


def separate_labels(axis) -> None:
    """Move the point labels (annotations in offset points) of ``axis`` apart where their boxes overlap: each in the
    order drawn takes the nearest free row of its own height above or below where it was put (points at one
    divergence, or a sweep that saturates, would otherwise print their labels over one another). Call it after the
    figure's layout: the boxes are the renderer's."""
    from matplotlib.text import Annotation

    renderer = axis.figure.canvas.get_renderer()
    placed = []
    for label in [text for text in axis.texts if isinstance(text, Annotation)]:
        x, y = label.xyann
        box = label.get_window_extent(renderer)
        step = (box.height + LABEL_GAP_PX) * 72 / axis.figure.dpi  # a row, in points
        for row in _nearest_rows(LABEL_TRIES):
            label.xyann = (x, y + row * step)
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
        else:
            label.xyann = (x, y)  # no free row near it: where it was drawn
            box = label.get_window_extent(renderer)
        placed.append(box)


def _nearest_rows(count: int) -> list[int]:
    """0, 1, -1, 2, -2, … up to ``count`` either way: the label's own place first, then the nearest."""
    return [0] + [sign * distance for distance in range(1, count + 1) for sign in (1, -1)]


def save(figure, path: Path) -> None:
    """Write ``figure`` to ``path`` (the suffix picks the format) and free it."""
    import matplotlib.pyplot as plt

    try:
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)
