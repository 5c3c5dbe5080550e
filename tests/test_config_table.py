"""docs/CONFIG.md's table maps every name that configures ODC onto the ``odc`` block: each key of the block (as
``python -m ds_odc`` lists them), each keyword that one of the four trainers adds to its stock constructor, and each
flag of the SFT command line (``ds_odc.recipes.sft.sft_argument_parser``) has a row; no row names a key, keyword,
flag or ``TrainingArguments`` / TRL config field that does not exist. And the stock loop's ``balancer`` block takes
no value that the trainers' keywords of the same key refuse.

In-process, no ranks; the four trainers are imported (transformers and TRL) to read their constructors.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "CONFIG.md"

# The table's columns, by their headers, and what each holds.
KEY, KEYWORD, FIELD, FLAG = ("`odc` key", "trainer keyword", "`TrainingArguments` / TRL config field",
                             "`examples/sft.py` flag")
NOT_A_KEY = "not an `odc` key"  # a row for names that set no key starts its key cell so
IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]*$")  # a keyword or field; `OdcGRPOTrainer`, `SFTConfig` are notes

# Each ds_odc trainer and the stock class whose constructor it extends.
TRAINERS = {
    "OdcTrainer": ("ds_odc.integrations.transformers", "transformers", "Trainer"),
    "OdcSFTTrainer": ("ds_odc.integrations.trl_sft", "trl", "SFTTrainer"),
    "OdcDPOTrainer": ("ds_odc.integrations.trl_dpo", "trl", "DPOTrainer"),
    "OdcGRPOTrainer": ("ds_odc.integrations.trl_grpo", "trl", "GRPOTrainer"),
}
CONFIG_CLASSES = (("transformers", "TrainingArguments"), ("trl", "SFTConfig"), ("trl", "DPOConfig"),
                  ("trl", "GRPOConfig"))


def _attribute(module: str, name: str):
    import importlib
    return getattr(importlib.import_module(module), name)


def table(text: str) -> dict[str, list[list[str]]]:
    """Each column of the table whose first header is ``KEY``: per row, the names written in backticks in its cell
    (the key cell of a row that sets no key: nothing)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {KEY} |"))
    headers = [h.strip() for h in lines[start].strip().strip("|").split("|")]
    columns: dict[str, list[list[str]]] = {h: [] for h in headers}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(headers), f"a row of docs/CONFIG.md's table has {len(cells)} cells: {line}"
        for header, cell in zip(headers, cells):
            named = re.findall(r"`([^`]+)`", cell)
            columns[header].append([] if header == KEY and cell.startswith(NOT_A_KEY) else named)
    return columns


def gaps(text: str, keys: set[str], keywords: set[str], flags: set[str], fields: set[str]) -> list[str]:
    """What the table lacks (a key, keyword or flag with no row) or names in vain (one that does not exist)."""
    columns = table(text)

    def named(column: str, keep=lambda name: True) -> set[str]:
        return {n for row in columns[column] for n in row if keep(n)}

    found = []
    for what, column, known, keep in (("odc key", KEY, keys, lambda n: True),
                                      ("trainer keyword", KEYWORD, keywords, IDENTIFIER.match),
                                      ("examples/sft.py flag", FLAG, flags, lambda n: n.startswith("--"))):
        written = named(column, keep)
        found += [f"no row for the {what} {n}" for n in sorted(known - written)]
        found += [f"the table names the {what} {n}, which does not exist" for n in sorted(written - known)]
    found += [f"the table names the field {n}, which TrainingArguments and TRL's configs lack"
              for n in sorted(named(FIELD, IDENTIFIER.match) - fields)]
    return found


@functools.cache
def odc_keys() -> set[str]:
    from ds_odc.cli.report import odc_defaults
    return {key for key, _, _ in odc_defaults()}


@functools.cache
def trainer_keywords() -> set[str]:
    """The keywords each ds_odc trainer takes beyond its stock constructor's."""
    found = set()
    for name, (module, stock_module, stock) in TRAINERS.items():
        ours = inspect.signature(_attribute(module, name).__init__).parameters
        theirs = inspect.signature(_attribute(stock_module, stock).__init__).parameters
        found |= {n for n, p in ours.items()
                  if n not in theirs and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return found


@functools.cache
def sft_flags() -> set[str]:
    from ds_odc.recipes.sft import sft_argument_parser
    return {option for action in sft_argument_parser()._actions for option in action.option_strings
            if option.startswith("--") and option != "--help"}


@functools.cache
def config_fields() -> set[str]:
    return {f.name for module, name in CONFIG_CLASSES for f in dataclasses.fields(_attribute(module, name))}


def test_the_table_maps_every_key_keyword_and_flag():
    found = gaps(DOC.read_text(), odc_keys(), trainer_keywords(), sft_flags(), config_fields())
    assert not found, f"docs/CONFIG.md's table: {found}"


def test_the_table_check_sees_a_removed_row_and_a_name_in_vain():
    text = DOC.read_text()
    args = (odc_keys(), trainer_keywords(), sft_flags(), config_fields())
    rows = [line for line in text.splitlines() if "`max_tokens_per_microbatch`" in line and line.startswith("|")]
    assert len(rows) == 1
    removed = gaps(text.replace(rows[0] + "\n", ""), *args)
    assert removed == ["no row for the odc key balancer.max_tokens",
                       "no row for the trainer keyword max_tokens_per_microbatch",
                       "no row for the examples/sft.py flag --max-tokens"]
    stale = rows[0].replace("`--max-tokens`", "`--max-tokens`, `--max-tokenz`").replace(
        "`max_tokens_per_microbatch`", "`max_tokens_per_microbatch`, `max_tokenz`").replace("| — |", "| `max_tokenz` |", 1)
    assert gaps(text.replace(rows[0], stale), *args) == [
        "the table names the trainer keyword max_tokenz, which does not exist",
        "the table names the examples/sft.py flag --max-tokenz, which does not exist",
        "the table names the field max_tokenz, which TrainingArguments and TRL's configs lack"]
    # A keyword a trainer gains without a row fails the check too.
    assert gaps(text, args[0], args[1] | {"balancer_new_option"}, *args[2:]) == [
        "no row for the trainer keyword balancer_new_option"]


def test_the_enumerations_see_the_options():
    """The enumerations behind the table check: the trainers' own keywords (not the stock constructors'), the
    flags, the block's sub-keys."""
    assert {"balancer_planner", "max_tokens_per_microbatch", "balancer_cost", "oversize", "length_column",
            "split_policy", "balancer", "generation_residency", "padding_free"} <= trainer_keywords()
    assert not {"model", "args", "train_dataset", "data_collator", "ref_model", "reward_funcs"} & trainer_keywords()
    assert {"--balancer", "--max-tokens", "--cost", "--oversize", "--minibatch-size", "--deepspeed"} <= sft_flags()
    assert {"transport", "balancer", "balancer.planner", "balancer.max_tokens"} <= odc_keys()


def test_the_balancer_block_takes_no_value_the_trainer_keywords_refuse():
    """One key, one meaning: each value the stock loop's ``odc.balancer`` block accepts is accepted by the trainers'
    keyword for the same key (which may take more: ``lb-mini-sp``, cost objects), and the trainers' ``balancer``
    record names its fields as the block names its keys."""
    from ds_odc.balancer.cost import COST_MODELS
    from ds_odc.balancer.options import BalancerOptions
    from ds_odc.balancer.plan import OVERSIZE_POLICIES
    from ds_odc.balancer.planners import PLANNERS
    from ds_odc.config import BalancerConfig

    def values(key: str) -> set[str]:
        return set(typing.get_args(BalancerConfig.model_fields[key].annotation))

    assert values("planner") <= set(PLANNERS)
    assert values("cost") <= set(COST_MODELS)
    assert values("oversize") == set(OVERSIZE_POLICIES)
    for key in ("planner", "cost", "oversize"):
        for value in values(key):
            BalancerOptions(**{key: value})  # raises for a value the keywords refuse
    record = {f.name for f in dataclasses.fields(BalancerOptions)} - {"split"}  # split: lb-mini-sp's, no key
    assert record <= set(BalancerConfig.model_fields), record - set(BalancerConfig.model_fields)


def test_the_budget_and_the_oversize_policy_follow_one_rule_at_every_door(capsys):
    """``max_tokens`` and ``oversize`` are checked by one rule (``ds_odc.balancer.plan``) however they come in, and
    each error names what the user wrote: the record's field and the sampler's and planners' arguments alike, the
    ds_config key, the SFT flag (the trainer keywords: tests/integrations/test_runner.py)."""
    import numpy as np
    import pydantic
    import pytest
    from ds_odc.balancer import BalancedBatchSampler, BalancerOptions, plan_minibatch
    from ds_odc.config import odc_config_from_ds_config
    from ds_odc.recipes.sft import sft_argument_parser

    doors = {"BalancerOptions": BalancerOptions,
             "BalancedBatchSampler": lambda **kw: BalancedBatchSampler(
                 [4] * 4, world_size=2, rank=0, minibatch_size=2, cost="tokens", **{"max_tokens": None, **kw}),
             "plan_minibatch": lambda **kw: plan_minibatch([4] * 4, 2, **kw)}
    for door, call in doors.items():
        for good in (None, 8, np.int64(8)):
            call(max_tokens=good)
        for bad in (0, -1, 2.5, 8.0, True, "8"):
            with pytest.raises(ValueError, match=f"^max_tokens must be a positive int or None, got {re.escape(repr(bad))}$"):
                call(max_tokens=bad)
        with pytest.raises(ValueError, match=r"^unknown oversize policy 'drop'; choose one of \('error', 'truncate', 'skip'\)$"):
            call(oversize="drop")

    def config(**balancer):
        return odc_config_from_ds_config({"zero_optimization": {"stage": 3, "odc": {"balancer": balancer}}}).balancer

    assert config(max_tokens=8).max_tokens == 8 and config(oversize="skip").oversize == "skip"
    for key, value, said in (("max_tokens", 0, "Value error, max_tokens must be a positive int or None, got 0"),
                             ("oversize", "drop", "Input should be 'error', 'truncate' or 'skip'")):
        with pytest.raises(pydantic.ValidationError) as err:
            config(**{key: value})
        assert f"zero_optimization.odc.balancer.{key}\n  {said}" in str(err.value), str(err.value)

    parser = sft_argument_parser(deepspeed_config=False)
    assert parser.parse_args(["--max-tokens", "8"]).max_tokens == 8
    for flags, said in ((["--max-tokens", "0"], "argument --max-tokens: max_tokens must be a positive int or None, got 0"),
                        (["--max-tokens", "x"], "argument --max-tokens: max_tokens must be a positive int or None, got 'x'"),
                        (["--oversize", "drop"], "argument --oversize: invalid choice: 'drop'")):
        with pytest.raises(SystemExit):
            parser.parse_args(flags)
        assert said in capsys.readouterr().err, flags
