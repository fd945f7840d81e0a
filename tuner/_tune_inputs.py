"""What a tuning reads before it searches: the default global batches, the gradient noise
scale (a number, a trajectory file or a law), the predictor, and what the search asks of
it beyond its training runs."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratune.errors import ConfigError
from paratune.measurement import family_of
from paratune.predictor import Predictor
from paratune.spec import ModelSpec
from paratune.tuner._space import check_gpus

if TYPE_CHECKING:
    from paratune.tuner._space import SearchSpace

__all__ = ["default_global_batch", "extrapolation_warnings", "goodput_global_batches",
           "load_predictor", "predictor_params", "resolve_gns"]


def default_global_batch(model: ModelSpec, gpus: int) -> int:
    """A global batch for a job that does not name one: about 2**20 tokens (the order of
    published Llama-scale recipes), rounded to a power of two and at least one sequence per
    device.

    Raises:
        ConfigError: ``gpus`` is not a positive integer.
    """
    gpus = check_gpus(gpus)
    sequences = max(1, 2**20 // model.seq_len)
    sequences = 1 << round(math.log2(sequences))
    return max(sequences, 1 << math.ceil(math.log2(gpus)))


def goodput_global_batches(model: ModelSpec, gpus: int, b_noise: float) -> list[int]:
    """Global batch sizes for a goodput search that names none: the powers of two from a
    quarter of the smaller to four times the larger of :func:`default_global_batch` and
    ``B_noise`` (where statistical efficiency trades against throughput; ``B_noise`` counts
    as at most 2**10 default batches), at most 12.

    Raises:
        ConfigError: ``gpus`` is not a positive integer, or ``b_noise`` is not positive.
    """
    if not (math.isfinite(b_noise) and b_noise > 0):
        raise ConfigError("gns", b_noise, "must be a positive number of sequences")
    center = default_global_batch(model, gpus)
    low = max(1.0, min(center, b_noise) / 4)
    # a B_noise far beyond any batch a job runs (efficiency ~1 everywhere) does not send the
    # search to absurd batches: at most 2**10 times the default batch (~2**30 tokens)
    high = min(max(center, b_noise), center * 2**10) * 4
    batches = [1 << k for k in range(math.ceil(math.log2(low)), math.floor(math.log2(high)) + 1)]
    if len(batches) > 12:  # keep the 12 nearest B_noise (in log)
        batches = sorted(sorted(batches, key=lambda b: abs(math.log2(b / b_noise)))[:12])
    return batches


def extrapolation_warnings(predictor: Predictor, space: SearchSpace, *,
                           factor: float = 4.0) -> list[str]:
    """What a search asks of a performance model beyond the runs it was fitted on (by more
    than ``factor``): a framework it has no measurement of, another device kind, more or
    fewer devices, larger or smaller steps in tokens. Its predictions there are
    extrapolations; empty where it interpolates or the predictor records neither its
    families nor its training ranges."""
    hardware = space.hardware.name
    out = []
    known = getattr(predictor, "measured_families_", None)
    if space.framework and known is not None and space.framework not in known:
        # a family whose source names the framework (ultrascale_playbook_nanotron: nanotron)
        named = sorted({family_of(source) for source in getattr(predictor, "sources_", [])
                        if space.framework in re.split(r"[^a-z0-9.-]+", str(source).lower())}
                       & set(known))
        hint = (f"; the source of its {' and '.join(named)} runs names {space.framework}: "
                f"--framework {named[0]} predicts from them" if named else "")
        out.append(f"the performance model has no measurement of framework "
                   f"{space.framework} (it measured {', '.join(known) or 'none'}): its configs "
                   f"are predicted as a well-tuned framework on {hardware}, from the other "
                   "families' runs without their stalled pipelines, with a wider interval "
                   f"(paratune calibrate with a few of its runs calibrates it){hint}")
    ranges = getattr(predictor, "training_ranges_", None)
    if not ranges:
        return out
    if hardware not in ranges:
        return [*out, f"the performance model has no measured runs on {hardware} (only "
                f"{', '.join(sorted(ranges))}): its predictions for {hardware} transfer from "
                "those devices"]
    seen = ranges[hardware]
    batches = space.global_batch_sizes
    asked = {"world_size": (space.world_size, space.world_size),
             "tokens_per_step": (min(batches) * space.model.seq_len,
                                 max(batches) * space.model.seq_len)}
    what = {"world_size": ("devices", "--gpus"),
            "tokens_per_step": ("tokens per step (global batch x sequence length)",
                                "--global-batch or --seq-len")}
    for key, (low, high) in asked.items():
        if key not in seen:
            continue
        lo, hi = seen[key]
        if high > factor * hi or low * factor < lo:
            name, flags = what[key]
            shown = f"{low}" if low == high else f"{low} to {high}"
            out.append(f"this search asks for {shown} {name} on {hardware}; the performance "
                       f"model was fitted on {lo} to {hi}: its predictions there are "
                       f"extrapolations ({flags} to stay closer, or profile such runs and "
                       "refit)")
    return out


def load_predictor(predictor: Predictor | str | Path) -> Predictor:
    """A predictor object, or one loaded from a saved model directory."""
    if isinstance(predictor, (str, Path)):
        from paratune.models import load_model

        return load_model(predictor)
    if not hasattr(predictor, "predict"):
        raise ConfigError("predictor", type(predictor).__name__, "has no predict(frame) method")
    return predictor


def resolve_gns(gns: float | str | Path | None, *, seq_len: int,
                trajectory_seq_len: int | None = None,
                num_params: float | None = None) -> float | None:
    """``B_noise`` in sequences of the planned model, from a number or a trajectory file.

    A number is taken as already in sequences of ``seq_len`` tokens. A trajectory's
    ``b_simple`` is in sequences of the run that measured it; the noise scale is assumed to
    be a number of tokens, so it is converted as ``b_simple * seq_len_measured / seq_len``
    and then reduced to the single value that ranks fixed configs exactly as the whole run
    would (the progress-weighted harmonic mean, see
    :func:`paratune.tuner.effective_b_noise`).

    Args:
        gns: ``B_noise`` (number or numeric string), a trajectory file, or ``None``.
        seq_len: Tokens per sequence of the planned model.
        trajectory_seq_len: Tokens per sequence of the run that measured a trajectory file
            without a ``seq_len`` column.
        num_params: Parameters of the planned model, for a critical-batch law named as
            ``gns`` (``kaplan2020``, ``minicpm2024``, ``constant:TOKENS``): its ``B_noise``
            along the model's Chinchilla loss curve from 0.2B to 200B tokens, reduced like a
            trajectory's.

    Returns:
        ``B_noise`` in sequences of ``seq_len`` tokens, or ``None``.

    Raises:
        ConfigError: the trajectory is unreadable, or its measuring run's ``seq_len`` is
            neither in the file nor given.
    """
    if gns is None:
        return None
    if isinstance(gns, bool):  # an int to Python, not a noise scale
        raise ConfigError("gns", gns, "must be a number (B_noise) or a trajectory file")
    if isinstance(gns, (int, float)):
        return float(gns)
    if not isinstance(gns, Path):
        try:
            return float(gns)
        except ValueError:
            pass
    from paratune.tuner._plan import effective_b_noise
    from paratune.tuner.gns_trajectory import NOISE_LAWS

    text = str(gns).strip().lower()
    if not isinstance(gns, Path) and (text in NOISE_LAWS or text.startswith("constant:")):
        from paratune.tuner.gns_trajectory import chinchilla_loss_curve, law_trajectory

        if num_params is None:
            raise ConfigError("gns", gns, "a critical-batch law needs the model's parameter "
                              "count (num_params) for its Chinchilla loss curve")
        trajectory = law_trajectory(text, chinchilla_loss_curve(num_params), seq_len=seq_len)
        return effective_b_noise(trajectory, seq_len=seq_len)
    from paratune.tuner.gns_trajectory import load_trajectory

    trajectory = load_trajectory(gns, seq_len=trajectory_seq_len)
    return effective_b_noise(trajectory, seq_len=seq_len)


def predictor_params(predictor: Predictor | str | Path, loaded: Predictor | None = None
                     ) -> dict[str, Any]:
    """What identifies the predictor: its directory (or class) and, for a performance model,
    the fingerprint of its training data (``loaded``: the predictor already loaded from
    ``predictor``, else ``predictor`` itself)."""
    loaded = predictor if loaded is None else loaded
    name = (str(Path(predictor).resolve()) if isinstance(predictor, (str, Path))
            else type(predictor).__name__)
    fingerprint = getattr(loaded, "fingerprint_", None)
    return {"predictor": name, **({"predictor_fingerprint": fingerprint} if fingerprint else {})}


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
