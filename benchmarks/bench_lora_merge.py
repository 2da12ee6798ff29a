"""Spoken-LM decode step with the LoRA adapters on the side vs merged into the weights (one run).

At batch 1 on a GPU a decode step costs its kernel launches (our H100 notes, docs/GPU.md), so the figure that
transfers from this CPU machine is the number of operators one step dispatches (each is at least
one kernel on CUDA; views are not counted). Also printed: CPU ms per token (eager growing cache)
and how close each is to the float32 model (unmerged), teacher-forced with its greedy ids.

    python benchmarks/bench_lora_merge.py --size full --dtype bfloat16 --steps 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engines import full_model  # noqa: E402

# operators that only make a new view (no kernel on any device)
VIEWS = {"view", "_unsafe_view", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "t",
         "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "reshape", "_reshape_alias",
         "lift_fresh"}


# operators that read a tensor's values back to the host: .item() / int() / bool() of a tensor, a mask
# used as indices (nonzero), unique
HOST_COPY = "_to_copy (to the host)"
READS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "_unique2", "unique_dim",
         "unique_consecutive", HOST_COPY}


def _to_the_host(tensor, kwargs) -> bool:
    """A ``_to_copy`` that only moves values to the host (not a dtype conversion that names the device)."""
    return str(kwargs.get("device")) == "cpu" and kwargs.get("dtype") in (None, tensor.dtype)


class OperatorCount(TorchDispatchMode):
    """Counts the non-view ATen operators dispatched inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_to_copy" and _to_the_host(args[0], kwargs or {}):
            name = HOST_COPY  # counted as a read (on a CPU it reads nothing, on a GPU it waits)
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def reads(self) -> int:
        """Operators that read a tensor's values back to the host (on CUDA each waits for the GPU),
        copies to the host included (``device_copies.read_back``)."""
        return sum(self.ops[name] for name in READS)


def load_model(size: str, dtype: str | None):
    if size == "full":
        return full_model(dtype=dtype)
    from taste_speech.modeling_taste import TasteForCausalLM
    from taste_speech.tiny import default_tiny_checkpoint

    return TasteForCausalLM.from_pretrained(default_tiny_checkpoint(), torch_dtype=dtype).eval()


@torch.inference_mode()
def measure(model, context: int, steps: int, ids: list[int] | None) -> dict:
    """Prefill ``context`` random rows, then ``steps`` decode steps (greedy, or forced to ``ids``)."""
    lm, rvq = model.spoken_lm, model.rvq
    rows = torch.randn(1, context, lm.causal_lm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    state = lm.new_decode_state(cache=lm.new_cache("dynamic"))
    lm.feed(state, rows)
    chosen, logits, seconds, ops = [], [], [], None
    for i in range(steps):
        t0 = time.perf_counter()
        heads = lm.heads(state.last_hidden, rvq)
        token = int(heads.text_logits.argmax()) if ids is None else ids[i]
        row = lm.next_row(state, token)
        if i == 1:
            with OperatorCount() as count:
                lm.feed(state, row)
            ops = count
        else:
            lm.feed(state, row)
        seconds.append(time.perf_counter() - t0)
        chosen.append(int(heads.text_logits.argmax()))
        logits.append(heads.text_logits.float())
    return {"ids": chosen, "logits": logits, "ms_per_token": 1000 * statistics.median(seconds[2:] or seconds),
            "ops_per_step": ops.total, "matmuls": ops.ops["mm"] + ops.ops["addmm"] + ops.ops["linear"]
            + ops.ops["bmm"] + ops.ops["matmul"], "casts": ops.ops["_to_copy"] + ops.ops["to"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--dtype", default="bfloat16", help="the Llama's dtype (adapters stay float32)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = load_model(args.size, None)
    lm = model.spoken_lm
    # the float32 model's greedy ids force every run, so each step compares like with like
    reference = measure(model, args.context, args.steps, None)
    if args.dtype != "float32":
        model.set_run_dtypes(args.dtype, "cpu")
    side = measure(model, args.context, args.steps, reference["ids"])
    if not lm.merge_lora():
        raise SystemExit("this model has no LoRA adapters to merge")
    merged = measure(model, args.context, args.steps, reference["ids"])
    print(f"spoken LM decode step, {args.size} size, Llama {lm.lm_dtype}, context {args.context}, "
          f"{len(lm.lora_layers())} LoRA projections, CPU ({torch.get_num_threads()} threads)")
    print("| | adapters on the side | merged | merged / side |")
    print("| --- | --- | --- | --- |")
    for key, label in (("ops_per_step", "operators per decode step"), ("matmuls", "of which matmuls"),
                       ("casts", "of which dtype casts")):
        ratio = f"{merged[key] / side[key]:.2f}" if side[key] else "-"
        print(f"| {label} | {side[key]} | {merged[key]} | {ratio} |")
    print(f"| CPU ms per token (median of {args.steps - 2}) | {side['ms_per_token']:.1f} | "
          f"{merged['ms_per_token']:.1f} | {merged['ms_per_token'] / side['ms_per_token']:.2f} |")
    for name, run in (("side", side), ("merged", merged)):
        same = sum(a == b for a, b in zip(reference["ids"], run["ids"]))
        diff = max(float((a - b).abs().max()) for a, b in zip(reference["logits"], run["logits"]))
        print(f"| vs float32, same greedy id ({args.steps} steps teacher-forced) / largest text-logit difference: "
              f"{name} | {same}/{args.steps} / {diff:.3g} |")
    print(f"(float32 logits up to {max(float(a.abs().max()) for a in reference['logits']):.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
