"""Who reads an exported draft, and what each one's loader takes: one module per consumer, registered here.

An export (`python -m dspark_jax.export --for=...`) is a directory in DeepSpec's layout that DeepSpec, vLLM,
SGLang, TensorRT-LLM and sglang-jax read as it is (a draft vocabulary in vLLM's `d2t` convention), plus a
directory of their own below it for the consumers whose loaders want another config: SpecForge
(`specforge/`) and speculators (`speculators/`). Each module's docstring cites the code its rules come from;
`tests/interop/` runs the consumers' own released code on exports. A consumer is its `Consumer` record: one
added with `register` is exported for, checked and named by every command with no other edit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from dspark_jax.interop import deepspec_layout as layout
from dspark_jax.interop.consumers import deepspec, sglang, sglang_jax, specforge, speculators, trtllm, vllm
from dspark_jax.interop.consumers.base import (
    Calibration,
    Consumer,
    DraftFacts,
    Problems,
    RunFile,
    SideSources,
    Tensors,
)
from dspark_jax.interop.consumers.side_files import write_side_files

CONSUMERS: dict[str, Consumer] = {}
__all__ = [
    "CONSUMERS",
    "Calibration",
    "Consumer",
    "DraftFacts",
    "RunFile",
    "SideSources",
    "as_deepspec",
    "check_directory",
    "choose",
    "last_layer_readers",
    "parse",
    "refusal",
    "register",
    "with_draft_vocabulary",
    "write_own",
]


def register(consumer: Consumer) -> Consumer:
    """Adds a consumer; its name must be new."""
    if consumer.name in CONSUMERS:
        raise ValueError(f"consumer {consumer.name!r} is already registered")
    CONSUMERS[consumer.name] = consumer
    return consumer


for _module in (deepspec, vllm, sglang, trtllm, sglang_jax, specforge, speculators):
    register(_module.CONSUMER)


def parse(text: str) -> tuple[str, ...]:
    """`'all'` or a comma list of consumer names, as a tuple; a one-line error naming a wrong one."""
    names = (
        tuple(CONSUMERS) if text.strip() == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    )
    wrong = [n for n in names if n not in CONSUMERS]
    if wrong or not names:
        raise ValueError(
            f"unknown consumer {', '.join(wrong) or repr(text)}: choose 'all' or of {tuple(CONSUMERS)}"
        )
    return tuple(dict.fromkeys(names))


def directory_of(export: Path, name: str) -> Path:
    """The directory consumer `name` reads: its own below `export` where there is one, else `export`."""
    own = CONSUMERS[name].subdir
    return export / own if own and (export / own).is_dir() else export


def check_directory(export: str | Path, names: Sequence[str] | None = None) -> list[str]:
    """Every problem each consumer's loader would have with the exported directory, one line each
    (`'<consumer>: <file>: <problem> [<source tag>]'`); empty when each of `names` (None: every registered
    consumer) can load it."""
    out = []
    for name in tuple(CONSUMERS) if names is None else names:
        directory = directory_of(Path(export), name)
        problems = Problems(name, CONSUMERS[name].last_layer)
        try:
            config, specs = layout.read_config(directory), layout.tensor_specs(directory)
        except (FileNotFoundError, ValueError) as e:
            problems.add(str(directory), str(e))
        else:
            CONSUMERS[name].check(config, specs, problems, directory)
        out += problems
    return out


def write_own(
    export: Path, names: Sequence[str], config_json: dict, tensors: Tensors, sources: SideSources
) -> None:
    """Below the export's main directory (`config_json`, `tensors`), each of `names`' own: its directory
    (`form`) and its side files."""
    for name in names:
        consumer = CONSUMERS[name]
        if consumer.form is not None:
            layout.write_directory(export / consumer.subdir, *consumer.form(config_json, tensors))
        if consumer.side_files is not None:
            write_side_files(export / consumer.subdir, consumer.side_files(sources))


def as_deepspec(config: Mapping) -> tuple[str, dict]:
    """`(consumer, DeepSpec config.json)` of a draft directory's config.json in any consumer's own form (a
    SpecForge or speculators checkpoint read back; DeepSpec's as it is)."""
    for consumer in CONSUMERS.values():
        if consumer.reads is not None and consumer.reads(config):
            return consumer.name, consumer.read(config)
    return deepspec.CONSUMER.name, dict(config)


def refusal(name: str, facts: DraftFacts) -> str | None:
    """Why consumer `name` cannot run the draft `facts` describes and what would make it work, else None."""
    consumer, last = CONSUMERS[name], facts.num_target_layers - 1
    if consumer.last_layer and facts.target_layer_ids and facts.target_layer_ids[-1] == last:
        return (
            f"target_layer_ids {list(facts.target_layer_ids)} tap the target's last layer "
            f"{last}, whose output {consumer.last_layer}: retrain on inner layers "
            "(data.aux_layer_ids)"
        )
    return consumer.refuse(facts)


def last_layer_readers() -> str:
    """One line: who cannot serve or train a draft that taps the target's last layer, and why."""
    return "; ".join(f"{c.name}: {c.last_layer}" for c in CONSUMERS.values() if c.last_layer)


def choose(text: str, facts: DraftFacts) -> tuple[tuple[str, ...], dict[str, str]]:
    """The consumers to export for (`'all'` or a comma list) and `{name: refusal}` of those left out.

    Named ones must all run the draft (else a one-line error naming each refusal); `'all'` keeps those that
    can, and fails only when none can."""
    names = parse(text)
    refused = {n: why for n in names if (why := refusal(n, facts))}
    if refused and (text.strip() != "all" or len(refused) == len(names)):
        raise ValueError("; ".join(f"{n} cannot run this draft: {why}" for n, why in refused.items()))
    return tuple(n for n in names if n not in refused), refused


def with_draft_vocabulary(config: dict, tensors: Tensors, ids_K: np.ndarray) -> tuple[dict, Tensors]:
    """The main directory of a draft proposing from the target tokens `ids_K` (sorted) only, in vLLM's
    EAGLE-3 convention (`vllm.SOURCES`): `draft_vocab_size` K, `lm_head` and `markov_w2` over the K
    proposals, `d2t` int64 with target id = i + d2t[i]; `markov_w1` and `embed_tokens` keep the whole
    vocabulary (a predecessor is a target token)."""
    ids_K = np.asarray(ids_K, np.int64)
    if np.any(np.diff(ids_K) <= 0):
        raise ValueError("a draft vocabulary's ids must strictly increase")
    out = dict(tensors)
    for name in ("lm_head.weight", "markov_head.markov_w2.weight"):
        out[name] = np.ascontiguousarray(tensors[name][ids_K])
    out["d2t"] = ids_K - np.arange(len(ids_K), dtype=np.int64)
    return config | {"draft_vocab_size": len(ids_K)}, out
