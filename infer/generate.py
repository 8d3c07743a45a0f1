"""python -m infer.generate: generate text with a model (default: the embedded SmolLM2-135M-Instruct).

Human mode streams text as tokens commit and prints stats to stderr; --json prints one JSON object per
prompt on stdout. All logic lives in `spd_jax`; this file only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import sys
from pathlib import Path

# spd_jax imports JAX but does not start its backend: the device set-up in main still precedes that
import spd_jax
from spd_jax import distributed
from spd_jax.datasets import PROMPT_FIELDS, prompt_field
from spd_jax.decode.pipelined import PSM_PLACEMENTS
from spd_jax.decode.sampling import Sampling
from spd_jax.methods import METHODS

DEFAULT_PROMPT = "Write a short story about a robot who learns to paint."


def read_prompt_file(path: str) -> list[str]:
    """One prompt per line, or JSON lines with a `prompt`, `text`, `question` or `turns` field
    (so the MT-Bench, GSM8K and HumanEval files under data/ read directly)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--prompt-file {path} does not exist")
    opener = gzip.open if p.suffix == ".gz" else open
    prompts = []
    with opener(p, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if p.suffix in (".jsonl", ".gz") or line.lstrip().startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n} is not valid JSON ({e})") from None
                text = prompt_field(obj)
                if text is None:
                    raise ValueError(f"{path}:{n} has none of the fields {', '.join(PROMPT_FIELDS)}")
                prompts.append(text)
            else:
                prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompt-file {path} holds no prompts")
    return prompts


def csv_of(kind, flag: str, example: str):
    """An argparse type: comma-separated values -> [kind(value)], or a usage error naming flag and an example."""
    def parse(s: str) -> list:
        try:
            return [kind(t.strip()) for t in s.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated {kind.__name__} values (e.g. {example}), "
                                             f"got {s!r}")
    return parse


def _placement(v: str):
    if v in PSM_PLACEMENTS:
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--psm-placement takes auto, last, own or a stage index, got {v!r}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m infer.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="a known default (smollm2-135m-instruct) or an HF checkpoint directory")
    ap.add_argument("--mode", choices=list(METHODS), default="spd",
                    help="spd: speculative pipeline decoding; ppsd: the same pipeline drafting from an early exit "
                         "(PPSD); pipeline: the same n stages, one token in flight; tp: autoregressive, "
                         "tensor-parallel over n devices; ar: plain autoregressive on one device; eagle3: chain "
                         "speculative decoding on one device with the EAGLE-3-style drafter")
    ap.add_argument("--n", type=int, default=8, help="devices: pipeline stages (spd, pipeline) or the tensor-parallel "
                                                     "width (tp)")
    ap.add_argument("--tp", type=int, default=1,
                    help="devices per pipeline stage (spd, ppsd, pipeline): each stage tensor-parallel over them, "
                         "n x tp devices in all (heads and MLP columns split as --mode tp splits them)")
    ap.add_argument("--stages", type=csv_of(int, "--stages", "4,4,3,4"), default=None,
                    help="explicit per-stage layer counts, e.g. 4,4,3,4 (default: uniform or cost-balanced)")
    psm = ap.add_mutually_exclusive_group()
    psm.add_argument("--spec", default=None, help="PSM checkpoint directory (spd; default: the trained PSM shipped "
                                                  "for the default model at this n and stage plan)")
    psm.add_argument("--random-psm", action="store_true",
                     help="spd with a randomly initialised PSM (lossless, few drafts accepted: for testing); "
                          "needed where no trained PSM ships")
    ap.add_argument("--psm-layers", type=int, default=2, help="decoder layers of a random PSM")
    ap.add_argument("--psm-placement", type=_placement, default="auto",
                    help="where the PSM body runs (spd): auto (the stage the cost model predicts makes the shortest "
                         "cycle), last, a stage index, or own (a device of its own: n + 1 devices)")
    ap.add_argument("--k", type=int, default=3, help="eagle3: drafts per verification round (chain length)")
    ap.add_argument("--drafter", default=None,
                    help="eagle3 and ppsd: the method's drafter checkpoint directory (train.main method=eagle3 or "
                         "method=ppsd), or 'random' (default: the one shipped for the default model (and n); else "
                         "eagle3 runs a random one, ppsd only when asked for)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    src.add_argument("--prompt-file", help="one prompt per line, or .jsonl/.jsonl.gz with a prompt field")
    src.add_argument("--prompt-ids", type=csv_of(int, "--prompt-ids", "1,2,3"),
                     help="comma-separated token ids, used as is")
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="wrap text prompts in the tokenizer's chat template (default: when it has one)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=None, help="context limit (default: the model's)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--no-eos", action="store_true", help="do not stop at the end-of-sequence token")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not use the persistent compilation cache ($SPD_JAX_CACHE/xla, default ~/.cache/spd_jax/xla)")
    distributed.add_arguments(ap)
    return ap


class _TextStream:
    """Prints the text of committed tokens as they arrive (decoding the whole tail so multi-byte
    characters split over tokens print correctly)."""

    def __init__(self, model):
        self.model, self.ids, self.printed = model, [], ""

    def __call__(self, tok: int) -> None:
        self.ids.append(tok)
        text = self.model.decode(self.ids)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.printed):])
            sys.stdout.flush()
            self.printed = text


def _run_as_processes(processes: int, argv: list[str]) -> int:
    """This run as `processes` local workers of one device each, said on stderr (`distributed.processes_for_size`)."""
    print(f"infer.generate: {processes} host devices in one process deadlock XLA:CPU at this model's size (from "
          f"{distributed.ONE_PROCESS_MAX_PARAMS / 1e9:.1f} B parameters): running {processes} processes of one "
          f"device each instead (--processes {processes}; docs/scale.md)", file=sys.stderr, flush=True)
    return distributed.launch(processes, "infer.generate", distributed.worker_argv(argv), None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    if args.processes is not None and not METHODS[args.mode].multi_process:
        print(f"error: --mode {args.mode} runs on one device in one process; --processes is for "
              + ", ".join(m.name for m in METHODS.values() if m.multi_process), file=sys.stderr)
        return 2
    if distributed.launching(args):
        return distributed.launch(args.processes, "infer.generate", distributed.worker_argv(argv), args.local_devices)
    spec = "random" if args.random_psm else args.spec
    try:
        if args.tp != 1 and not METHODS[args.mode].staged:
            raise ValueError(f"--tp is for the pipelined modes ({', '.join(m.name for m in METHODS.values() if m.staged)})"
                             f"; --mode {args.mode} takes none (its devices, if several, are --n)")
        # the mode's options from the flags it takes: the one value that reaches the engine
        method = METHODS[args.mode].taking(n=args.n, stage_layers=args.stages, spec=spec, psm_layers=args.psm_layers,
                                           psm_placement=args.psm_placement, k=args.k, drafter_spec=args.drafter,
                                           tp=args.tp)
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        routed = distributed.processes_for_size(args, args.model, method.devices()) if method.multi_process else None
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if routed:
        return _run_as_processes(routed, argv)
    try:
        # On a CPU-only host the devices are host devices (split over the processes of a multi-process
        # job); this must precede JAX's initialisation.
        cluster = distributed.setup(args, method.devices())
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.no_compile_cache:
        spd_jax.enable_persistent_cache()
    # in a multi-process job every process computes the same result; process 0 alone prints it
    leader = cluster is None or distributed.is_leader()

    try:
        texts = None if args.prompt_ids is not None else (
            args.prompt or (read_prompt_file(args.prompt_file) if args.prompt_file else [DEFAULT_PROMPT]))
        placement = method.load_placement(cluster is not None)
        mesh, rules = placement if placement else (None, None)
        model = spd_jax.load_model(args.model, dtype=args.dtype, mesh=mesh, rules=rules)
        if texts is None:
            jobs = [(None, args.prompt_ids)]
        else:
            jobs = [(t, model.encode(t, chat=args.chat)) for t in texts]
        if method.random_drafter_on_request and method.drafter_ref() is None:  # random only when asked for
            found, why = method.drafter_source(model)
            if found is None:
                k = method.drafter_kind
                raise ValueError(f"no trained {k.label} to run: {why}; pass {k.flag} DIR ({k.a_label} train.main "
                                 f"exported for this model, n and stage plan) or {k.random_flag} (output still exact, "
                                 "few drafts accepted)")
        for text, ids in jobs:
            stream = None if args.json or not method.streams or cluster else _TextStream(model)
            if leader and not args.json:
                print(f"\n>>> {text if text is not None else ids}\n", file=sys.stderr)
            res = spd_jax.generate(model, ids, args.max_new_tokens, sampling=sampling, method=method,
                                   stop_at_eos=not args.no_eos, max_len=args.max_len, stream=stream)
            out_text = model.decode(res.token_ids)
            if not leader:
                continue
            if args.json:
                print(json.dumps(dict(prompt=text, prompt_ids=list(map(int, ids)), token_ids=res.token_ids,
                                      text=out_text, stats=res.stats)), flush=True)
            else:
                s = res.stats
                if stream is None:
                    print(out_text, end="")
                print(f"\n\n[{args.mode}] {s['tokens']} tokens in {s['wall_s']:.2f} s: {s['tokens_per_s']:.1f} tok/s "
                      f"({method.summary(s)}; compile {s['compile_s']:.1f} s ({s['compile_from']}), backend "
                      f"{s['backend']})", file=sys.stderr)
    except (ValueError, FileNotFoundError, KeyError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
