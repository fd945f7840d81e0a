"""The ``paratune profile`` command: a profiling campaign over a grid and world sizes."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from paratune.cli import at_least, world_sizes
from paratune.tracking import add_track_flag

__all__ = ["register"]

# The library's name -> the flag, for values the library checks under another name (see
# paratune.cli.flag_message).
_FIELD_FLAGS = {
    "path": "--model",  # a config.json that cannot be read
    "warmup_steps": "--warmup",
    "measured_steps": "--steps",
    "timeout_s": "--timeout",
    "gpu": "--hardware",  # not in the hardware catalogue
    "device": "--device",  # CUDA asked for where none is visible
    "seq_len": "--seq-len",  # a resume that differs from the campaign's
    "nproc_per_node": "--nproc-per-node",  # a node layout that cannot hold a world size
    "nnodes": "--nnodes",
    "devices_per_node": "--devices-per-node",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile", help="measure training steps of every valid parallel config",
        description="Profile every valid configuration of a grid for each world size: "
                    "real training steps in one worker group per world size (gloo on CPU, "
                    "NCCL on CUDA). Finished configs are journaled durably; --resume "
                    "continues a killed campaign. The result is a dataset in --out.")
    parser.add_argument("--model", default=None,
                        help="model preset (tiny, small, llama3-8b, ...) or a Hugging Face "
                             "config.json path (default tiny)")
    parser.add_argument("--seq-len", type=at_least(1), default=None, metavar="TOKENS",
                        help="training sequence length (default: the preset's, or a "
                             "config.json's max_position_embeddings, with a warning; "
                             "resuming: the campaign's)")
    parser.add_argument("--world-sizes", type=world_sizes, default=None, metavar="N,N,...",
                        help="world sizes to profile (default 1,2,4)")
    parser.add_argument("--grid", default=None, metavar="FILE",
                        help="configuration space (YAML/TOML/JSON): global_batch_sizes, "
                             "micro_batch_sizes, schedules, shardings, recomputes, ... "
                             "(default: a grid sized for the model)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="campaign directory (default runs/profile-<model>)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 10)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="per-config timeout (default 300; resuming: the campaign's)")
    parser.add_argument("--seed", type=int, default=None, help="seed (default 0)")
    parser.add_argument("--data", choices=("synthetic", "text"), default=None,
                        help="training tokens: random (default) or real text (Python's own "
                             "sources, byte-level; needs a byte-level vocabulary)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the campaign in --out; options not given are taken "
                             "from it")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="device (default: cuda when available)")
    parser.add_argument("--hardware", default=None, metavar="NAME",
                        help="hardware catalogue name (default: cpu, or the detected GPU)")
    parser.add_argument("--devices-per-node", type=at_least(1), default=None,
                        help="devices per node (keeps tp inside a node; default: "
                             "--nproc-per-node, else one node)")
    parser.add_argument("--launcher", choices=("local", "torchrun"), default="local",
                        help="local: supervised worker groups on this machine; torchrun: "
                             "torchrun per world size (with --print-command: for a cluster)")
    parser.add_argument("--print-command", action="store_true",
                        help="prepare --out and print the command per world size instead of "
                             "running")
    parser.add_argument("--nnodes", type=at_least(1), default=None,
                        help="nodes (--print-command)")
    parser.add_argument("--nproc-per-node", type=at_least(1), default=None,
                        help="processes per node (--print-command)")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="rendezvous endpoint (--print-command; default "
                             "$MASTER_ADDR:29500)")
    parser.add_argument("--slurm", action="store_true",
                        help="print srun command lines for a SLURM allocation")
    add_track_flag(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_profile, field_flags=_FIELD_FLAGS)


def build_spec(args: argparse.Namespace):  # -> CampaignSpec (heavy import kept lazy)
    """The campaign spec from command-line options (and, resuming, the stored campaign)."""
    from paratune.errors import ConfigError
    from paratune.profiler.campaign import CampaignSpec, detect_device, detect_hardware
    from paratune.space import ConfigSpace
    from paratune.spec import ModelSpec, get_model

    stored: dict = {}
    meta: dict = {}
    out = Path(args.out) if args.out else None
    if args.resume:
        if out is None:
            raise ConfigError("out", None, "--resume needs --out DIR")
        campaign = out / "campaign.json"
        if not campaign.exists():
            raise ConfigError("out", str(out), "holds no campaign.json: nothing to resume")
        meta = json.loads(campaign.read_text())
        stored = meta.get("identity", {})
    seq_len = getattr(args, "seq_len", None)
    if args.model is not None:
        model = get_model(args.model, seq_len=seq_len)
    elif stored:
        model = ModelSpec.from_dict(stored["model"])
        if seq_len is not None:
            model = model.replace(seq_len=seq_len)
    else:
        model = get_model("tiny", seq_len=seq_len)
    if args.grid is not None:
        space = ConfigSpace.from_file(args.grid)
    elif stored:
        space = ConfigSpace.from_dict(stored["grid"])
    else:
        space = None
    device = args.device or stored.get("device") or detect_device()
    hardware = args.hardware or stored.get("hardware") or detect_hardware(device)

    def pick(value, name, default):
        if value is not None:
            return value
        return stored.get(name, default)

    timeout_s = args.timeout if args.timeout is not None else meta.get("timeout_s", 300.0)
    if isinstance(timeout_s, (int, float)) and math.isinf(timeout_s):
        # NaN, 0 and negatives are refused by the campaign itself
        raise ConfigError("timeout_s", timeout_s, "must be a finite positive number of "
                          "seconds (a config that hangs must be stopped)")
    try:
        return CampaignSpec(
            model=model, space=space,
            world_sizes=tuple(pick(args.world_sizes, "world_sizes", (1, 2, 4))),
            warmup_steps=pick(args.warmup, "warmup_steps", 3),
            measured_steps=pick(args.steps, "measured_steps", 10),
            # The timeout is not part of the identity (it may be changed on resume) but is
            # kept in campaign.json beside it.
            timeout_s=timeout_s,
            seed=pick(args.seed, "seed", 0), device=device,
            hardware=hardware,
            devices_per_node=pick(args.devices_per_node or args.nproc_per_node,
                                  "devices_per_node", None),
            data=pick(args.data, "data", "synthetic"))
    except ConfigError as exc:
        # a node size given as --nproc-per-node is named so
        if (exc.field == "devices_per_node" and args.devices_per_node is None
                and args.nproc_per_node):
            raise ConfigError("nproc_per_node", exc.value, exc.rule) from None
        raise


def _profile(args: argparse.Namespace) -> int:
    from paratune.errors import ConfigError
    from paratune.profiler.campaign import LaunchOptions, run_campaign, torchrun_commands

    if not args.print_command:  # a cluster's flags, given for a run here, would do nothing
        for flag, value in (("--slurm", args.slurm or None), ("--nnodes", args.nnodes),
                            ("--rdzv-endpoint", args.rdzv_endpoint)):
            if value is not None:
                raise ConfigError(flag, value, "only goes with --print-command, which "
                                  "prepares the campaign for a cluster; without it the "
                                  "campaign runs here")
    spec = build_spec(args)
    out = Path(args.out or f"runs/profile-{spec.model.name}")
    if args.print_command:
        commands = torchrun_commands(spec, out, nnodes=args.nnodes,
                                     nproc_per_node=args.nproc_per_node,
                                     rdzv_endpoint=args.rdzv_endpoint, slurm=args.slurm,
                                     resume=args.resume)
        print(f"# campaign prepared in {out}; run on every node, one world size after "
              f"another:")
        for world_size, command in zip(spec.world_sizes, commands):
            print(f"# world size {world_size}")
            print(command)
        print(f"# each job leaves the dataset in {out} when it finishes "
              f"(paratune datasets show {out})")
        return 0
    result = run_campaign(spec, out, resume=args.resume, track=not args.no_track,
                          progress=not args.no_progress,
                          launch=LaunchOptions(launcher=args.launcher))
    print(result.summary())
    if result.run_id:
        from paratune.tracking import ui_command

        print(f"MLflow run {result.run_id}: {ui_command()}")
    return 0
