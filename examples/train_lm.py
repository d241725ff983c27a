"""Train a small decoder-only transformer on the LM demo corpus, fed by colo-data.

The data is `configs/lm.toml`'s pipeline (three text components mixed by weight, tokenized
and packed), at a shorter row and a smaller batch so that it trains on 2 CPU cores in a
minute. Attention stays within each packed row's segments (`segment_ids`), and positions
are the packed `positions`. One Orbax `CheckpointManager` step holds the model, the
optimizer and the loader's state. On SIGTERM or SIGINT the job saves at the step it is on
and exits 0; run again with the same arguments, it resumes where it stopped, on the same
batches (docs/training.md).

    python examples/train_lm.py          # 200 steps, checkpoints and log in .train/
    python examples/train_lm.py --steps 400 --checkpoint-dir ckpt --log log.jsonl --backend sidecar

`--log` appends one JSON line a step: `step` (1 for the first), `loss`, `input_wait_s` (the
seconds this step waited in `next(loader)`), `step_s` and `fill` (the share of the
batch's tokens that are data, not padding).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tokenizers import Tokenizer

import colo_data as cd
from colo_data.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "lm.toml"
PRINT_EVERY = 20  # steps between the lines printed (every step is in the log)
# the printed loss is a moving average of the steps' losses, each weighted by this to the power of
# its age in steps (about the last 50 count): one step's loss is too noisy to show the fall
SMOOTHING = 0.98


class Block(nnx.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs) -> None:
        self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class Decoder(nnx.Module):
    """Token and position embeddings, `layers` blocks, and a projection back to the vocabulary."""

    def __init__(self, vocab: int, length: int, width: int, layers: int, heads: int, rngs: nnx.Rngs) -> None:
        self.tokens = nnx.Embed(vocab, width, rngs=rngs)
        self.positions = nnx.Embed(length, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.out = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array, segments: jax.Array, positions: jax.Array) -> jax.Array:
        x: jax.Array = self.tokens(tokens) + self.positions(positions)
        mask = packed_causal_mask(segments)
        for block in self.blocks:
            x = block(x, mask)
        return self.out(self.norm(x))


def packed_causal_mask(segments: jax.Array) -> jax.Array:
    """(batch, 1, length, length): a token attends to itself and the tokens before it in its
    own segment, never across the records packed into one row, nor to padding (segment 0)."""
    same = segments[:, :, None] == segments[:, None, :]
    causal = jnp.tril(jnp.ones((segments.shape[1], segments.shape[1]), bool))
    return (same & causal & (segments[:, :, None] > 0))[:, None]


def loss_fn(model: Decoder, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy over the tokens whose next token is in the same segment."""
    tokens, segments = batch["tokens"], batch["segment_ids"]
    logits = model(tokens, segments, batch["positions"])[:, :-1]
    targets = tokens[:, 1:]
    valid = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * valid) / jnp.maximum(jnp.sum(valid), 1)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="train steps in all (a resumed run goes on to this)")
    parser.add_argument("--checkpoint-dir", default=".train/checkpoints", help="the CheckpointManager's directory (resumed from)")
    parser.add_argument("--log", default=".train/log.jsonl", help="a JSON line a step is appended here")
    parser.add_argument("--backend", choices=["inprocess", "sidecar"], default="inprocess")
    parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens a packed row")
    parser.add_argument("--batch-size", type=int, default=8, help="rows a global batch")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    args = parser.parse_args(argv)
    for name in ("steps", "save_every", "seq_len", "batch_size", "width", "layers", "heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def lm_pipeline(seq_len: int, batch_size: int) -> cd.Pipeline:
    """`configs/lm.toml`'s pipeline, with `seq_len` tokens a row and `batch_size` rows a batch."""
    config = load_config(CONFIG)
    pipeline = dataclasses.replace(config, args={**config.args, "seq_len": seq_len, "global_batch_size": batch_size}).build()
    assert isinstance(pipeline, cd.Pipeline)
    return pipeline


def vocabulary(pipeline: cd.Pipeline) -> int:
    """The vocabulary size of the pipeline's tokenizer (the model's embedding rows)."""
    assert pipeline.pack is not None
    tokenize = next(step for step in pipeline.pack.prepare if isinstance(step, cd.tokenize))
    return Tokenizer.from_file(tokenize.tokenizer).get_vocab_size()


class Stop:
    """Set by SIGTERM or SIGINT: the loop saves at the step it is on and ends."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, self._set)

    def _set(self, number: int, frame: FrameType | None) -> None:
        del frame
        self.signal = number


def train(args: argparse.Namespace) -> int:
    """Train to `args.steps`, from the latest checkpoint in `args.checkpoint_dir` if any;
    the last step reached (the one saved on a signal)."""
    stop = Stop()
    pipeline = lm_pipeline(args.seq_len, args.batch_size)
    model = Decoder(vocabulary(pipeline), args.seq_len, args.width, args.layers, args.heads, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(args.learning_rate), wrt=nnx.Param)
    graph, state = nnx.split((model, optimizer))
    # data parallel: the batch split over every device on the "data" axis, the state replicated
    mesh = Mesh(np.array(jax.devices()), ("data",))
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))

    @jax.jit
    def train_step(state: nnx.State, batch: dict[str, jax.Array]) -> tuple[nnx.State, jax.Array]:
        model, optimizer = nnx.merge(graph, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    manager = ocp.CheckpointManager(os.path.abspath(args.checkpoint_dir), options=ocp.CheckpointManagerOptions(max_to_keep=2))
    step = manager.latest_step() or 0
    data_state = None
    if step:
        restored = manager.restore(
            step,
            args=ocp.args.Composite(model=ocp.args.StandardRestore(state), data=cd.checkpoint.restore_args(pipeline)),
        )
        state, data_state = restored["model"], restored["data"]
        print(f"resumed at step {step} from {args.checkpoint_dir}", file=sys.stderr)
    if step >= args.steps:
        manager.close()
        print(
            f"nothing to do: the run already trained its {args.steps} steps (checkpoints in {args.checkpoint_dir}); "
            f"give --steps N (more than {step}) to train on, or remove {args.checkpoint_dir} to start over",
            file=sys.stderr,
        )
        return step

    def save() -> None:
        manager.save(step, args=ocp.args.Composite(model=ocp.args.StandardSave(state), data=cd.checkpoint.save_args(loader)))

    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    waits: list[float] = []  # the input waits of the steps since the last printed line
    smoothed = [0.0, 0.0]  # the losses' moving average (weights `SMOOTHING`**age) and its weights' sum
    with cd.Loader(pipeline, backend=args.backend, mesh=mesh, state=data_state) as loader, open(args.log, "a") as log:
        while step < args.steps and stop.signal is None:
            started = time.perf_counter()
            batch = next(loader)
            waited = time.perf_counter() - started
            state, loss = train_step(state, batch)
            step += 1
            fill = float(jnp.mean(batch["segment_ids"] > 0))
            line: dict[str, Any] = {"step": step, "loss": float(loss), "input_wait_s": waited}
            line |= {"step_s": time.perf_counter() - started, "fill": fill}
            log.write(json.dumps(line) + "\n")
            log.flush()
            waits.append(waited)
            smoothed = [SMOOTHING * smoothed[0] + line["loss"], SMOOTHING * smoothed[1] + 1.0]
            if step % PRINT_EVERY == 0 or step == args.steps:
                wait_ms = 1000 * sum(waits) / len(waits)
                print(
                    f"step {step}/{args.steps}: loss {smoothed[0] / smoothed[1]:.3f} (smoothed), "
                    f"input wait {wait_ms:.1f} ms a step",
                    flush=True,
                )
                waits.clear()
            if step % args.save_every == 0 or step == args.steps or stop.signal is not None:
                save()
        if stop.signal is not None and manager.latest_step() != step:
            save()
    manager.wait_until_finished()
    manager.close()
    if stop.signal is not None:
        print(
            f"stopped by signal {stop.signal} at step {step}; saved: run again to resume "
            f"(checkpoints in {args.checkpoint_dir}): {this_command(args.steps)}",
            file=sys.stderr,
        )
    else:
        print(f"trained {step} steps; checkpoints in {args.checkpoint_dir}, a line a step in {args.log}", flush=True)
        print(f"to train on from step {step}: {this_command(2 * step)}", flush=True)
    return step


def this_command(steps: int) -> str:
    """This job's command line, for `steps` steps in all: the one that resumes it."""
    given, rest = sys.argv[1:], []
    while given:
        option = given.pop(0)
        if option == "--steps":
            given = given[1:]
        elif not option.startswith("--steps="):
            rest.append(option)
    return shlex.join(["python", os.path.relpath(__file__), "--steps", str(steps), *rest])


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and train."""
    train(parse(argv))


if __name__ == "__main__":
    main()
