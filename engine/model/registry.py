"""The model families ringpipe trains, by name: the one place a new family is registered.

    recipe = recipe_named("gpt")       # a ModelRecipe (engine/model/recipe.py)
    names_of(lambda r: "pipe" in r.axes)   # "gpt": the families that offer something, for messages
"""
from __future__ import annotations

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.gpt import GPT_RECIPE
from ringpipe.engine.model.llama import LLAMA_RECIPE
from ringpipe.engine.model.mlp import MLP_RECIPE
from ringpipe.engine.model.recipe import ModelRecipe

RECIPES: dict[str, ModelRecipe] = {recipe.name: recipe for recipe in (GPT_RECIPE, LLAMA_RECIPE, MLP_RECIPE)}


def recipe_named(name: str) -> ModelRecipe:
    """The recipe of <model> `name`; a ConfigError naming the families for any other."""
    recipe = RECIPES.get(name)
    if recipe is None:
        raise ConfigError(f"unknown <model> {name!r}: use one of {', '.join(sorted(RECIPES))}")
    return recipe


def names_of(offers) -> str:
    """The families for which `offers(recipe)` holds, as a message names them ("gpt", "gpt or mlp")."""
    return " or ".join(name for name, recipe in sorted(RECIPES.items()) if offers(recipe))
