"""The requests ``tune`` and ``plan`` take: the job (:class:`TuneJob`), how to search
(:class:`SearchOptions`) and what to write (:class:`OutputOptions`).

Each field is written once, with its help text in its metadata: the command-line flags of
``paratune tune`` and ``paratune plan`` (:func:`add_flags`), the requests built from parsed
flags (:func:`from_flags`), the library names that errors are renamed from (``field_flags``)
and the MLflow params of a run (:meth:`SearchOptions.params`) all come from them, as
torchtitan's ``JobConfig`` does.
"""

# ruff: noqa: RUF009 (the fields are dataclasses.field()s made by option(), not shared defaults)
from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError

if TYPE_CHECKING:
    from paratune.hardware import HardwareSpec
    from paratune.space import ConfigSpace
    from paratune.spec import ModelSpec
    from paratune.tuner._verify_refit import VerifyOptions

__all__ = ["SEARCH_MODES", "OutputOptions", "SearchOptions", "TuneJob", "add_flags",
           "from_flags", "option", "request_params"]

SEARCH_MODES = ("optuna", "exhaustive")


def option(default: Any = MISSING, *, help: str, flag: str | None = None,
           param: str | bool | None = True, **cli: Any) -> Any:
    """A request field: its default, help text and command-line flag.

    Args:
        default: The library default, which the flag has too unless :func:`add_flags` is
            given another (its ``defaults``).
        help: What the field means, shown by ``--help``.
        flag: The flag (``None``: the field is the library's only, e.g. a callback).
        param: Its MLflow param name (``True``: the field's name; ``False``: not logged).
        **cli: More ``add_argument`` keywords (``type``, ``choices``, ``metavar``,
            ``action``, ``aliases``, ``required``), and ``from_cli`` (the field's value
            from the flag's).
    """
    return field(default=default, metadata={"help": help, "flag": flag, "param": param,
                                            "cli": cli})


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(name, value, "must be a positive integer")


def _int_like(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int)


@dataclass(frozen=True, kw_only=True)
class TuneJob:
    """The job to plan: a model on a number of devices of one kind, the options searched
    and the rule for what fits. Shared by :func:`~paratune.tuner.tune` and
    :func:`~paratune.tuner.plan`."""

    model: ModelSpec | str = option(
        flag="--model", required=True, param=False,
        help="model preset (llama3-8b, ...) or a Hugging Face config.json")
    gpus: int = option(flag="--gpus", type=int, required=True, param=False,
                       help="devices in the job")
    hardware: HardwareSpec | str = option(
        flag="--gpu", aliases=("--hardware",), required=True, metavar="NAME", param=False,
        action="aliases",
        help="hardware catalogue name of the devices (H100, A100, cpu, ...); --hardware is "
             "the same flag, spelt as in paratune profile")
    seq_len: int | None = option(
        None, flag="--seq-len", type="positive", metavar="TOKENS", param=False,
        help="training sequence length (default: the preset's, or a config.json's "
             "max_position_embeddings, with a warning)")
    global_batch_sizes: Any = option(
        None, flag="--global-batch", param=False,
        help="global batch sizes in sequences: 512, 256,512,1024, or a range 256:4096 "
             "(powers of two), 256:4096:x2, 256:1024:256; at most 64 sizes (default: "
             "{default_batch})")
    space: ConfigSpace | str | Path | None = option(
        None, flag="--space", type=Path, param=False,
        help="YAML/TOML/JSON file of the options to search (ConfigSpace fields)")
    devices_per_node: int | None = option(
        None, flag="--devices-per-node", type="positive", param=False,
        help="devices per node (default: the device kind's catalogue value)")
    tp_within_node: bool | None = option(
        None, flag="--tp-across-nodes", action="store_true", param=False,
        from_cli=lambda across: False if across else None,
        help="allow tensor parallelism across nodes (off by default)")
    framework: str | None = option(
        None, flag="--framework", metavar="NAME", param=False,
        help="framework the job runs in, as the performance model names its measurement "
             "families (a source's first word: ultrascale, vtrain, ...); one it has no "
             "measurement of (megatron-lm, torchtitan) is predicted as a well-tuned "
             "framework on the device, with a wider interval (default: the family that "
             "measured the device kind)")
    min_feasible_prob: float = option(
        0.5, flag="--min-feasible-prob", type=float, param=False,
        help="feasibility threshold on the predicted probability of running")
    memory_limit_gb: float | None = option(
        None, flag="--memory-limit-gb", type=float, param=False,
        help="memory limit per device (default 95%% of the device's)")

    def __post_init__(self) -> None:
        from paratune.tuner._space import check_gpus

        object.__setattr__(self, "gpus", check_gpus(self.gpus))
        if self.seq_len is not None:
            _positive_int("seq_len", self.seq_len)
        if self.devices_per_node is not None:
            _positive_int("devices_per_node", self.devices_per_node)
        if not (isinstance(self.min_feasible_prob, (int, float))
                and 0.0 <= self.min_feasible_prob <= 1.0):
            raise ConfigError("min_feasible_prob", self.min_feasible_prob,
                              "must be a probability in [0, 1]")
        if self.memory_limit_gb is not None and not (
                isinstance(self.memory_limit_gb, (int, float))
                and math.isfinite(self.memory_limit_gb) and self.memory_limit_gb > 0):
            raise ConfigError("memory_limit_gb", self.memory_limit_gb,
                              "must be a positive number of GB")

    def spec(self) -> ModelSpec:
        """The model (a preset or ``config.json`` loaded, ``seq_len`` applied)."""
        from paratune.spec import ModelSpec, get_model

        if isinstance(self.model, ModelSpec):
            return self.model if self.seq_len is None else self.model.replace(
                seq_len=self.seq_len)
        return get_model(self.model, seq_len=self.seq_len)

    def device(self) -> HardwareSpec:
        from paratune.hardware import get_hardware

        return get_hardware(self.hardware) if isinstance(self.hardware, str) else self.hardware

    def config_space(self) -> ConfigSpace | None:
        """The options searched: the space given (a file loaded), ``tp_within_node``
        applied; ``None`` where neither is given (the library's defaults apply)."""
        from paratune.space import ConfigSpace

        space = self.space
        if isinstance(space, (str, Path)):
            space = ConfigSpace.from_file(space)
        if self.tp_within_node is not None:
            space = (space or ConfigSpace()).replace(tp_within_node=self.tp_within_node)
        return space


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What :func:`~paratune.tuner.tune` maximises and how it searches."""

    objective: str = option(
        "throughput", flag="--objective", choices=("throughput", "goodput"), param=False,
        help="throughput: tokens/s at one global batch; goodput: tokens/s times statistical "
             "efficiency (needs --gns); either times the predicted probability of running, "
             "as a run that fails delivers nothing (default: %(default)s)")
    gns: float | str | Path | None = option(
        None, flag="--gns", param=False,
        help="gradient noise scale B_noise in sequences of MODEL, a trajectory file "
             "(CSV/JSON with step, tokens, b_simple in the measuring run's sequences, "
             "seq_len), or a critical-batch law (kaplan2020, minicpm2024, constant:TOKENS) "
             "along MODEL's Chinchilla loss curve")
    trajectory_seq_len: int | None = option(
        None, flag="--trajectory-seq-len", type=int, metavar="TOKENS", param=False,
        help="tokens per sequence of the run that measured the trajectory, for files "
             "without a seq_len column (b_simple is in that run's sequences and is "
             "converted to MODEL's)")
    b0: float | None = option(
        None, flag="--b0", type=float, param=False,
        help="reference batch of the Pollux efficiency (default: smallest batch)")
    risk_quantile: str | None = option(
        None, flag="--risk", metavar="QUANTILE", param=False,
        help="rank by a lower quantile of predicted throughput, e.g. q10")
    risk_aware: bool | None = option(
        None, param=False,
        help="rank by the risk-aware expectation; None: where the search asks the model "
             "beyond its training data and no risk_quantile is given")
    search: str = option(
        "optuna", flag="--search", choices=SEARCH_MODES,
        help="optuna: sample --trials configs; exhaustive: predict every valid config "
             "(default: %(default)s)")
    n_trials: int = option(
        200, flag="--trials", type=int,
        help="finished trials the study should hold (all workers together)")
    sampler: Any = option(
        "tpe", flag="--sampler",
        help="tpe (default), random, gp, qmc, nsga2")
    seed: int | None = option(0, flag="--seed", type=int,
                              help="sampler seed (default: %(default)s)")
    storage: str | Path | None = option(
        None, flag="--storage", param=False,
        help="Optuna storage: a journal file path, or an RDB URL such as sqlite:///study.db "
             "or postgresql://user@host/db (default: OUTPUT/study.journal)")
    study_name: str | None = option(
        None, flag="--study-name", param=False,
        help="study to create or join (default: derived from the problem)")
    batch_size: int = option(8, flag="--batch-size", type=int,
                             help="trials asked and predicted together")
    refine_fraction: float = option(
        0.5, param=False,
        help="share of the trials, at the end, spent on a local search around the leaders "
             "(see optuna_search)")
    refine_beam: int = option(4, param=False,
                              help="how many of the best layouts the local search starts from")
    timeout_s: float | None = option(None, param=False,
                                     help="stop asking for trials after this many seconds")
    verify: int = option(
        0, flag="--verify", type="positive", metavar="K",
        help="verify K configs for real (a layout already in the list counts 5%% less, so "
             "others nearly as good come first), add them to the dataset, "
             "refit and report predicted vs measured: profiled here where this machine has "
             "the job's hardware, else their torchrun and SLURM commands are printed and "
             "written under OUTPUT/verify, and the same command run again after them reads "
             "their results and refits")
    verify_on: str = option(
        "auto", flag="--verify-on", choices=("auto", "here", "cluster"), param=False,
        help="where --verify measures: auto (here if this machine has the job's hardware, "
             "else the cluster), here, or cluster (default: %(default)s)")
    verify_options: VerifyOptions | dict[str, Any] | None = option(
        None, param=False,
        help="how verify measures, refits and where it writes: a VerifyOptions, or its "
             "fields (and those of its runs) by name, made into one when the request is built")

    def __post_init__(self) -> None:
        if self.search not in SEARCH_MODES:
            raise ConfigError("search", self.search,
                              f"must be one of {', '.join(SEARCH_MODES)}")
        if self.search == "optuna":  # an exhaustive search counts no trials
            _positive_int("n_trials", self.n_trials)
            _positive_int("batch_size", self.batch_size)
            if not 0.0 <= self.refine_fraction <= 1.0:
                raise ConfigError("refine_fraction", self.refine_fraction, "must be in [0, 1]")
            if isinstance(self.sampler, str):
                from paratune.tuner._samplers import check_sampler

                check_sampler(self.sampler)
        if not _int_like(self.verify) or self.verify < 0:
            raise ConfigError("verify", self.verify, "must be a number of configs >= 0")
        if self.verify_options is not None:
            from paratune.tuner._verify_refit import VerifyOptions

            given = self.verify_options
            if isinstance(given, dict):
                given = VerifyOptions.build(**given)
            elif not isinstance(given, VerifyOptions):
                raise ConfigError("verify_options", given,
                                  "must be a VerifyOptions or a dict of its fields")
            object.__setattr__(self, "verify_options", given)

    def params(self) -> dict[str, Any]:
        """The MLflow params of these options (see :func:`request_params`); the sampler by
        its name (``""`` for an exhaustive search)."""
        from paratune.tuner._samplers import sampler_name

        out = request_params(self)
        out["sampler"] = sampler_name(self.sampler) if self.search == "optuna" else ""
        return out


@dataclass(frozen=True, kw_only=True)
class OutputOptions:
    """What :func:`~paratune.tuner.tune` and :func:`~paratune.tuner.plan` write, show and
    track."""

    output_dir: str | Path | None = option(
        None, flag="--output", type=Path, param=False,
        help="output directory (default: tune-MODEL-GPUSxGPU)")
    top_k: int = option(10, flag="--top-k", type="positive",
                        help="configs shown and kept in the recommendation "
                             "(default: %(default)s)")
    export_infeasible: bool = option(
        False, flag="--export-infeasible", action="store_true", param=False,
        help="write the launch files even when the winner is predicted not to run (each "
             "then opens with a line saying so); without it such a winner gets only "
             "recommendation.json/.yaml and the exit status is 1")
    progress: bool = option(
        False, flag="--no-progress", action="store_true", param=False,
        from_cli=lambda off: not off, help="no progress bar of the trials (on stderr)")
    track: bool = option(True, param=False, help="record an MLflow run")
    tracking_uri: str | None = option(
        None, param=False,
        help="MLflow store (default: MLFLOW_TRACKING_URI or ./mlflow.db)")
    on_ranked: Callable[[Any], None] | None = option(
        None, param=False,
        help="called with the result once ranked, written and logged, before any "
             "verification")

    def __post_init__(self) -> None:
        _positive_int("top_k", self.top_k)

    @property
    def path(self) -> Path | None:
        return Path(self.output_dir) if self.output_dir is not None else None

    def params(self) -> dict[str, Any]:
        """The MLflow params of these options (see :func:`request_params`)."""
        return request_params(self)


def request_params(request: Any) -> dict[str, Any]:
    """The MLflow params of a request: each field logged (``param`` not ``False``) under its
    name or the ``param`` its metadata gives."""
    out = {}
    for item in fields(request):
        name = item.metadata.get("param", True)
        if name is not False:
            out[item.name if name is True else name] = getattr(request, item.name)
    return out


def _argparse_type(kind: Any) -> Any:
    if kind == "positive":
        from paratune.cli import at_least

        return at_least(1)
    return kind


def add_flags(parser: argparse.ArgumentParser, request: type, *, only: tuple[str, ...] = (),
              skip: tuple[str, ...] = (), help_values: dict[str, str] | None = None,
              defaults: dict[str, Any] | None = None) -> dict[str, str]:
    """Add the flags of ``request``'s fields (those with a flag; ``only`` or not ``skip``)
    to ``parser``.

    Args:
        parser: The subcommand's parser.
        request: :class:`TuneJob`, :class:`SearchOptions` or :class:`OutputOptions`.
        only: Only these fields.
        skip: Not these fields.
        help_values: Values of ``{name}`` placeholders in help texts.
        defaults: The flag's default where it is not the field's (``{field: value}``).

    Returns:
        ``{field: flag}`` of the flags added whose value is the field's (the library names
        errors are renamed from, see :func:`paratune.cli.flag_message`).
    """
    from paratune.cli import StoreWithAliases

    named: dict[str, str] = {}
    for item in fields(request):
        flag = item.metadata.get("flag")
        if flag is None or (only and item.name not in only) or item.name in skip:
            continue
        cli = dict(item.metadata["cli"])
        cli.pop("from_cli", None)
        aliases = cli.pop("aliases", ())
        help_text = item.metadata["help"].format(**(help_values or {}))
        kwargs: dict[str, Any] = {"help": help_text}
        action = cli.pop("action", None)
        if action == "aliases":  # the spelling typed is named in errors
            kwargs.update(action=StoreWithAliases, dest=item.name)
        elif action is not None:
            kwargs["action"] = action
        if "type" in cli:
            kwargs["type"] = _argparse_type(cli.pop("type"))
        kwargs.update(cli)
        if kwargs.get("action") != "store_true" and not kwargs.get("required"):
            default = (defaults or {}).get(item.name, item.default)
            kwargs["default"] = None if default is MISSING else default
        parser.add_argument(flag, *aliases, **kwargs)
        if "from_cli" in item.metadata["cli"]:
            continue  # the field's value is not the flag's: an error keeps the field's name
        # of a flag with aliases, the one spelt as the field (its dest, see flag_message)
        own = "--" + item.name.replace("_", "-")
        named[item.name] = own if own in aliases else flag
    return named


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def from_flags(request: type, args: argparse.Namespace, **values: Any) -> Any:
    """A ``request`` from parsed flags (each field with a flag that was added), with
    ``values`` for the fields the command computes itself."""
    given: dict[str, Any] = {}
    for item in fields(request):
        flag = item.metadata.get("flag")
        if item.name in values or flag is None:
            continue
        aliased = item.metadata["cli"].get("action") == "aliases"
        dest = item.name if aliased else _dest(flag)
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        convert = item.metadata["cli"].get("from_cli")
        given[item.name] = convert(value) if convert is not None else value
    return request(**given, **values)
