"""``ray-xlong``: the command line (also ``python -m ray_xlong.cli``).

    ray-xlong synth    --out runs.jsonl [--paper] [--groups G --runs-per-group R]
    ray-xlong inspect  runs.jsonl [--run RUN] [--max-trajectories 5] [--tree-tokens 8]
                       [--html OUT.html [--tokenizer DIR]]
    ray-xlong sim      [--preset paper-2.4t] [--seed 0] [--steps N] [--events-dir DIR]
    ray-xlong bench    [--backend sim|ray] [--modes ...] [--forecast] [--json PATH]
                       sim: [--preset paper-2.4t] [--steps N]   ray: [--size smoke|quick|full]
                       [--address auto] [--model-dir DIR] [--events-dir DIR]
    ray-xlong timeline events.jsonl [more.jsonl ...] --out timeline.png [--time-unit seconds]
    ray-xlong train    [--config FILE.yaml] [--set section.field=value ...] [--print-config]
                       [--mode elastic] [--engine vllm|hf] [--steps 25] [--seed 1] [--out DIR]
                       [--tracker wandb|mlflow ...]
    ray-xlong serve    --model-dir DIR [--engine hf|vllm] [--host H] [--port P]
    ray-xlong export   CHECKPOINT OUT_DIR [--model-dir DIR] [--max-shard-mb 2048]

Files: runs are JSONL (schema in ``ray_xlong/trajectory/recording.py``); event logs are JSONL
of ``ray_xlong.scheduling.events.Event`` (schema in ``ray_xlong/scheduling/events.py``; the
simulator writes them in hours, the Ray driver — ``train --out``, ``bench --backend ray
--events-dir`` — in wall seconds).
Every command validates its arguments before it starts Ray or builds a model (``cli_args.py``;
exit status 2, the message names the argument) and says what to change when it cannot proceed.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Sequence

from ray_xlong.cli_args import (CliError, existing_dir, existing_file, int_at_least, key_value,
                                output_dir, output_file, port_number)
from ray_xlong.cli_modes import cmd_bench, cmd_sim
from ray_xlong.scheduling.modes import CELL_MODES  # the one registry


def cmd_synth(args: argparse.Namespace) -> int:
    from ray_xlong.trajectory.recording import write_runs
    from ray_xlong.trajectory.synthetic import SyntheticConfig, synthetic_runs

    config = SyntheticConfig.paper() if args.paper else SyntheticConfig()
    runs = synthetic_runs(args.seed, groups=args.groups, runs_per_group=args.runs_per_group,
                          config=config)
    write_runs(args.out, runs)
    calls = sum(len(r.calls) for r in runs)
    print(f"wrote {len(runs)} runs ({calls} calls) to {args.out}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ray_xlong.trajectory import ProcessorConfig, TrajectoryProcessor
    from ray_xlong.trajectory.recording import read_runs

    runs = read_runs(_existing(args.runs))
    if args.run:
        runs = [r for r in runs if r.run_id in args.run]
        missing = set(args.run) - {r.run_id for r in runs}
        if missing:
            raise CliError(f"no run {sorted(missing)} in {args.runs}")
    start = time.perf_counter()
    batch = TrajectoryProcessor(ProcessorConfig(max_trajectories_per_run=args.max_trajectories,
                                                pack="none")).process(runs)
    elapsed = time.perf_counter() - start
    for run in runs:
        _print_run(run, batch, args)
    s = batch.stats
    print(f"\n{len(runs)} runs processed in {elapsed:.3f} s: {s.trajectories_kept} trajectories "
          f"kept, {s.trajectories_dropped} dropped; tokens Σ {s.total_tokens:,} → unique "
          f"{s.unique_tokens:,} (dedup {s.dedup_ratio:.2f}×), trainable {s.trainable_tokens:,}; "
          f"timeouts {s.runs_timeout}, failed {s.runs_failed}")
    if args.html:
        from ray_xlong.viewer import write_page

        write_page(args.html, runs, batch, title=pathlib.Path(args.runs).name,
                   tokenizer=args.tokenizer)
        print(f"wrote {args.html} (open it in a browser)")
    return 0


def _print_run(run, batch, args: argparse.Namespace) -> None:
    print(f"\n# run {run.run_id} (group {run.group_id}): {len(run.calls)} calls, "
          f"status {run.status}, reward {run.reward:g}")
    if run.status == "failed":
        print("  failed: not trained, not in its group's baseline")
        return
    kept = [t for t in batch.trajectories if t.run_id == run.run_id]
    dropped = [t for t in batch.dropped if t.run_id == run.run_id]
    kinds = {k: sum(t.kind == k for t in kept) for k in dict.fromkeys(t.kind for t in kept)}
    print(f"  trajectories: {len(kept)} kept ("
          + ", ".join(f"{k} {n}" for k, n in kinds.items()) + f"), {len(dropped)} dropped")
    print("  | # | kind | agent | origin | calls | tokens | generated | weighted |")
    print("  |---|---|---|---|---|---|---|---|")
    for i, t in enumerate(kept):
        print(f"  | {i} | {t.kind} | {t.agent_id} | {t.origin} | {len(t.call_indices)} | "
              f"{t.num_tokens:,} | {t.num_generated:,} | {int(t.loss_weights.sum()):,} |")
    for t in dropped:
        print(f"  | dropped | {t.kind} | {t.agent_id} | {t.origin} | {len(t.call_indices)} | "
              f"{t.num_tokens:,} | {t.num_generated:,} | 0 |")
    if not args.no_tree:
        tree_text = batch.trees[run.run_id].pretty_print(max_tokens=args.tree_tokens, file=False)
        print("\n".join("  " + line for line in tree_text.splitlines()))


def cmd_timeline(args: argparse.Namespace) -> int:
    from ray_xlong.scheduling.events import from_jsonl
    from ray_xlong.sim.timeline import plot_timelines

    logs = {}
    for name in args.events:
        path = pathlib.Path(_existing(name))
        try:
            events = from_jsonl(path.read_text())
        except (ValueError, KeyError, TypeError) as exc:
            raise CliError(f"{path} is not an event log (JSONL of Event records): {exc}") from exc
        if not events:
            raise CliError(f"{path} holds no events")
        logs[path.stem] = events
    plot_timelines(logs, args.out, title=args.title, time_unit=args.time_unit)
    print(f"wrote {args.out} ({len(logs)} panel{'s' if len(logs) > 1 else ''})")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """RL on the lookup task on a local Ray (the README main job; see examples/)."""
    from ray_xlong.train_config import dump, load_spec

    spec = load_spec(args.config, sets=args.set or (), flags=_train_flags(args))
    if args.groups is not None:     # groups × the effective runs per group; --set still wins
        runs = {"training.train_batch_size_per_learner": args.groups * spec.xlong.runs_per_group}
        spec = load_spec(sets=args.set or (), flags=runs, base=spec)
    if args.print_config:
        print(dump(spec), end="")
        return 0
    return _train(spec)


def _train_flags(args: argparse.Namespace) -> dict:
    """The train flags given on the command line, as ``section.field`` overrides."""
    flags = {"xlong.mode": args.mode, "xlong.engine": args.engine, "run.steps": args.steps,
             "run.seed": args.seed, "run.workdir": args.workdir, "run.out": args.out,
             "xlong.runs_per_group": args.runs_per_group,
             "run.trackers": tuple(args.tracker) if args.tracker else None}
    return {k: v for k, v in flags.items() if v is not None}


def _train(spec) -> int:
    from ray_xlong.rllib.trackers import TrackerSession, cli_trackers, tracker_callbacks
    from ray_xlong.jobs.train import HEADER, row, run_training
    from ray_xlong.scheduling.events import to_jsonl
    from ray_xlong.sim.timeline import plot_timelines
    from ray_xlong.train_config import dump

    import ray

    out = pathlib.Path(spec.run.out)
    callbacks = tracker_callbacks(cli_trackers(spec.run.trackers), project=spec.run.project,
                                  out_dir=out / "trackers")     # checked before Ray starts
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump(spec))
    print(HEADER, flush=True)
    sessions: list = []               # Ray is up once the first result arrives

    def track(result: dict) -> None:
        if not sessions:
            sessions.append(TrackerSession(callbacks, project=spec.run.project,
                                           out_dir=out / "trackers", config=spec.as_dict()))
        sessions[0].log(result)

    owned = not ray.is_initialized()          # the embedded Ray run_training starts goes after
    failed = True
    try:
        run = run_training(mode=spec.xlong.mode, steps=spec.run.steps, seed=spec.run.seed,
                           engine=spec.xlong.engine, workdir=spec.run.workdir, spec=spec,
                           on_step=lambda r: print(row(r), flush=True), on_result=track)
        failed = False
    finally:
        for session in sessions:
            session.close(failed=failed)
        if owned:
            ray.shutdown()
    (out / "events.jsonl").write_text(to_jsonl(run.events))
    plot_timelines({f"{run.mode} ({run.engine})": run.events}, str(out / "timeline.png"),
                   time_unit="seconds")
    print(f"reward {run.rewards[0]:.3f} -> {run.rewards[-1]:.3f}; cells up {run.startup_s:.0f}"
          f" s, training {run.train_s:.0f} s; wrote {out / 'timeline.png'} and "
          f"{out / 'events.jsonl'} (ray-xlong timeline ... --time-unit seconds)")
    if sessions:
        print(f"trackers ({', '.join(cli_trackers(spec.run.trackers))}): {out / 'trackers'}")
    return 0


def _existing(path: str) -> str:
    if not pathlib.Path(path).is_file():
        raise CliError(f"{path}: no such file")
    return path


def cmd_serve(args: argparse.Namespace) -> int:
    """Embedded Ray, one rollout cell and its OpenAI-compatible endpoint (Ctrl-C stops)."""
    from ray_xlong.serving.cell import serve_forever

    if not (pathlib.Path(args.model_dir) / "config.json").is_file():
        raise CliError(f"--model-dir {args.model_dir!r} is not a HF model directory "
                       f"(no config.json)")
    return serve_forever(args.model_dir, engine=args.engine, host=args.host, port=args.port)


def learner_checkpoint(path: str) -> pathlib.Path:
    """The Learner DCP checkpoint a CHECKPOINT argument names: that directory itself, an
    ``XLongAlgorithm.save_to_path`` directory (its ``learner``), or a job's ``checkpoint_dir``
    (or its ``driver_checkpoint.pt``: the last completed checkpoint)."""
    from ray_xlong.cells.shard_checkpoint import exists, latest

    p = pathlib.Path(path)
    if p.is_file():
        p = p.parent
    if exists(p):
        return p
    if exists(p / "learner"):
        return p / "learner"
    done = latest(p)
    if done is not None and exists(done[1]):
        return done[1]
    raise CliError(f"{path}: not a checkpoint (no Learner checkpoint there, no 'learner' "
                   f"directory, no latest.json of a job's checkpoint_dir)")


def cmd_export(args: argparse.Namespace) -> int:
    """A Hugging Face directory (safetensors, config, tokenizer, generation config) from a
    checkpoint, read tensor group by tensor group (``models/export.py``)."""
    from ray_xlong.models.export import export_checkpoint, learner_meta

    src = learner_checkpoint(args.checkpoint)
    model_dir = args.model_dir or learner_meta(src).get("model_dir")
    if not model_dir or not (pathlib.Path(model_dir) / "config.json").is_file():
        raise CliError(f"the model directory {model_dir!r} the checkpoint names has no "
                       f"config.json here; pass --model-dir (the policy directory it was "
                       f"trained from: config and tokenizer)")
    t = time.perf_counter()
    out = export_checkpoint(src, args.out_dir, model_dir=model_dir,
                            max_shard_bytes=int(args.max_shard_mb * 1024 ** 2))
    version = learner_meta(src).get("version")
    print(f"wrote {out} (version {version}) from {src} in {time.perf_counter() - t:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-xlong", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("synth", help="write seeded synthetic agent runs as JSONL")
    p.add_argument("--out", required=True, type=output_file(".jsonl", ".jsonl.gz"),
                   help="output .jsonl (or .jsonl.gz)")
    p.add_argument("--paper", action="store_true", help="paper scale: 636 calls, ~700k context")
    p.add_argument("--groups", type=int_at_least(1), default=1)
    p.add_argument("--runs-per-group", type=int_at_least(1), default=1)
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.set_defaults(fn=cmd_synth)

    p = sub.add_parser("inspect", help="recorded runs → trajectories, trees, dedup stats")
    p.add_argument("runs", type=existing_file,
                   help="runs JSONL written by ray_xlong (see recording.py)")
    p.add_argument("--run", action="append", help="only this run id (repeatable)")
    p.add_argument("--max-trajectories", type=int_at_least(1), default=5, help="K kept per run")
    p.add_argument("--tree-tokens", type=int_at_least(1), default=8,
                   help="tokens shown per tree node")
    p.add_argument("--html", type=output_file(".html"), default=None,
                   help="also write a self-contained HTML viewer of the runs here")
    p.add_argument("--tokenizer", type=existing_dir, default=None,
                   help="HF tokenizer directory: the viewer shows decoded text, not ids")
    p.add_argument("--no-tree", action="store_true", help="skip the tree drawing")
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser("sim", help="scheduler simulator: every mode on a preset")
    p.add_argument("--preset", default="paper-2.4t")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--steps", type=int_at_least(1), default=None,
                   help="override the preset's steps")
    p.add_argument("--modes", nargs="*", default=None, help="subset of modes")
    p.add_argument("--events-dir", type=output_dir, default=None,
                   help="write each mode's event log here")
    p.set_defaults(fn=cmd_sim)

    p = sub.add_parser(
        "bench", help="the mode comparison (colocated / async / elastic [/ forecast]), "
        "in the simulator or on Ray cells", description=cmd_bench.__doc__ + " The table "
        "gives each mode's makespan ÷ elastic's (< 1: faster than elastic).")
    p.add_argument("--backend", default="sim", choices=["sim", "ray"],
                   help="sim: the discrete-event simulator on a preset (seconds); ray: real "
                   "cells on Ray, each mode beside the simulator on the same workload (minutes)")
    p.add_argument("--modes", nargs="+", default=None,
                   help="modes to run (default colocated async elastic; must include elastic)")
    p.add_argument("--forecast", action="store_true",
                   help="also run our forecast mode")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--preset", default=None, help="sim: preset (default paper-2.4t)")
    p.add_argument("--steps", type=int_at_least(1), default=None,
                   help="sim: override the preset's steps")
    p.add_argument("--size", default=None, choices=["smoke", "quick", "full"],
                   help="ray: job size (default quick; smoke ~1 min on 2 CPUs)")
    p.add_argument("--address", default=None,
                   help="ray: join this cluster (e.g. auto after `ray start`) instead of an "
                   "embedded local Ray")
    p.add_argument("--model-dir", default=None,
                   help="ray: policy model (HF directory every node can read; default: a tiny "
                   "one built locally, fine on one machine)")
    p.add_argument("--json", type=output_file(".json"), default=None,
                   help="write the rows and settings as JSON here")
    p.add_argument("--events-dir", type=output_dir, default=None,
                   help="write each mode's event log here")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("timeline", help="event log(s) → per-cell Gantt PNG")
    p.add_argument("events", nargs="+", type=existing_file,
                   help="event log JSONL file(s), one panel each")
    p.add_argument("--out", required=True, type=output_file(".png"), help="output PNG")
    p.add_argument("--title", default="")
    p.add_argument("--time-unit", default="hours", choices=["hours", "seconds"],
                   help="axis label: the simulator logs hours, the Ray driver wall seconds")
    p.set_defaults(fn=cmd_timeline)

    p = sub.add_parser("train", help="RL on the lookup task on cells of a local Ray",
                       description="Settings: the recipe's defaults, then --config FILE, then "
                       "the flags below, then --set (later wins); see examples/configs/.")
    p.add_argument("--config", type=existing_file, default=None,
                   help="YAML config file (sections run, training, xlong)")
    p.add_argument("--set", action="append", type=key_value, metavar="SECTION.FIELD=VALUE",
                   help="override one config field (value read as YAML; repeatable)")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective config as YAML and exit (starts nothing)")
    p.add_argument("--mode", default=None, choices=list(CELL_MODES),
                   help="xlong.mode (default elastic)")
    p.add_argument("--engine", default=None, choices=["hf", "vllm"],
                   help="xlong.engine (default vllm)")
    p.add_argument("--steps", type=int_at_least(1), default=None, help="run.steps (25)")
    p.add_argument("--seed", type=int_at_least(0), default=None, help="run.seed (1)")
    p.add_argument("--groups", type=int_at_least(1), default=None,
                   help="groups per step (16): training.train_batch_size_per_learner = "
                   "groups × runs per group")
    p.add_argument("--runs-per-group", type=int_at_least(1), default=None,
                   help="xlong.runs_per_group (8)")
    p.add_argument("--workdir", type=output_dir, default=None,
                   help="run.workdir: model cache (.cache/ray_xlong)")
    p.add_argument("--out", type=output_dir, default=None,
                   help="run.out: timeline PNG, events, config.yaml, trackers (out/train)")
    p.add_argument("--tracker", action="append", choices=["wandb", "mlflow"],
                   help="run.trackers: also log to W&B / MLflow (repeatable; TensorBoard "
                   "files are always written)")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("serve", help="an OpenAI-compatible endpoint on one rollout cell")
    p.add_argument("--model-dir", required=True, type=existing_dir,
                   help="HF model directory (chat template)")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000, help="0: any free port")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("export", help="a checkpoint → a Hugging Face model directory",
                       description=cmd_export.__doc__)
    p.add_argument("checkpoint", help="a save_to_path directory, a job's checkpoint_dir, or a "
                   "Learner checkpoint directory")
    p.add_argument("out_dir", type=output_dir, help="the Hugging Face directory to write")
    p.add_argument("--model-dir", type=existing_dir, default=None,
                   help="config + tokenizer source (default: the one the checkpoint names)")
    p.add_argument("--max-shard-mb", type=int_at_least(1), default=2048,
                   help="safetensors file size cap (bigger models: several files + index)")
    p.set_defaults(fn=cmd_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:       # a bad argument: argparse printed usage + the message
        if exc.code in (0, None):   # --help
            raise
        return int(exc.code)
    try:
        return args.fn(args)
    except CliError as exc:
        print(f"ray-xlong {args.command}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:                       # validation errors name the field
        print(f"ray-xlong {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
