"""benchmarks/choose_preset.py: the search finds a known optimum, candidates are valid recipes,
and the selection paragraphs are not fit paragraphs."""

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "choose_preset.py"
_SPEC = importlib.util.spec_from_file_location("choose_preset", _PATH)
choose_preset = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(choose_preset)


def _scorer(target: dict[str, float], gptq_gain: float = 0.0, searched: float | None = None):
    """A score with its minimum at `target` (read back through the parsed recipe)."""
    seen = []

    def score(data):
        recipe = choose_preset.recipe_of(data)
        sq = recipe.smoothquant
        if sq.alphas:
            value = searched if searched is not None else 99.0
        else:
            value = sum((sq.group_alpha.get(g, sq.alpha) - a) ** 2 for g, a in target.items())
            value -= gptq_gain if recipe.method == "gptq" else 0.0
        seen.append(data)
        return {"recipe": data, "increase_pct": value}
    return score, seen


def test_search_finds_a_separable_optimum_on_the_grid():
    target = {"qkv": 0.5, "o": 0.7, "gate_up": 0.9, "down": 0.3}
    score, seen = _scorer(target)
    best = choose_preset.choose(score)
    sq = choose_preset.recipe_of(best["recipe"]).smoothquant
    assert {g: sq.group_alpha.get(g, sq.alpha) for g in target} == target
    assert best["recipe"]["method"] == "minmax" and best["increase_pct"] == pytest.approx(0.0)
    assert choose_preset.PREVIOUS in seen            # the old preset was scored, and lost


def test_gptq_and_the_alpha_search_win_only_when_they_score_lower():
    target = {"qkv": 0.7, "o": 0.7, "gate_up": 0.7, "down": 0.5}
    best = choose_preset.choose(_scorer(target, gptq_gain=0.01)[0])
    assert best["recipe"]["method"] == "gptq"
    best = choose_preset.choose(_scorer(target, searched=-1.0)[0])
    assert choose_preset.recipe_of(best["recipe"]).smoothquant.alphas == choose_preset.SEARCH


def test_split_keeps_selection_paragraphs_out_of_the_fit_part():
    texts = [f"paragraph {i}" for i in range(10)]
    fit, select = choose_preset.split_texts(texts)
    assert fit + select == texts and len(select) == 2 and not set(fit) & set(select)
    with pytest.raises(ValueError):
        choose_preset.split_texts(["only one"])
