"""Peak memory of one token log-prob pass (forward + backward), full logits vs chunked.

    python benchmarks/logprob_chunk_memory.py [--vocab 151936] [--rows 2] [--length 1024]
        [--chunks 0 1024 256] [--device cpu|cuda]

A one-layer Llama of width 128 with a Qwen-size vocabulary (random weights: the memory of
the LM head's pass does not depend on them) scores ``rows x length`` tokens with
``salvage.lm.token_logprobs`` and backpropagates; each chunk size runs in a fresh process.
Peak: ``torch.cuda.max_memory_allocated`` on a GPU; on CPU the rise of the process's peak
resident set (``ru_maxrss``) over what it held before the pass. Prints one line per chunk.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one(vocab: int, rows: int, length: int, chunk: int, device: str) -> dict[str, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from salvage.lm import token_logprobs

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(2048, length),
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).to(device)
    ids = torch.randint(0, vocab, (rows, length), device=device)
    mask = torch.ones_like(ids)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    lp = token_logprobs(model, ids, mask, 1.0, chunk_size=chunk)
    lp.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {
        "chunk": chunk,
        "peak_gb": peak / 1e9,
        "seconds": time.perf_counter() - t0,
        "logprob_sum": float(lp.sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 256])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.vocab, a.rows, a.length, a.one, a.device)))
        return
    logits_gb = a.rows * a.length * a.vocab * 4 / 1e9
    print(f"vocab {a.vocab}, {a.rows} x {a.length} tokens: fp32 logits {logits_gb:.2f} GB")
    for chunk in a.chunks:
        cmd = [sys.executable, __file__, "--one", str(chunk)]
        cmd += ["--vocab", str(a.vocab), "--rows", str(a.rows), "--length", str(a.length)]
        cmd += ["--device", a.device]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"chunk {r['chunk']:>5}: peak +{r['peak_gb']:.2f} GB, {r['seconds']:.1f} s, "
            f"sum of log-probs {r['logprob_sum']:.4f}"
        )


if __name__ == "__main__":
    main()
