"""A model of SmolLM2-135M's shape with random weights and the real model's tokenizer, as a Hugging Face folder.

For a machine the bundled weights cannot travel to (a GPU machine that reaches no registry and takes
64 MiB of files; the GGUF file alone is 98 MB): throughput depends on the shape, not on the values,
and a served benchmark needs the tokenizer to build its prompts and to detokenize what comes back.

    here:   python -m benchmarks.random_model export-tokenizer .whl/smollm2-tokenizer   # ~2 MB
    there:  python -m benchmarks.random_model save /tmp/model --tokenizer .whl/smollm2-tokenizer
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

SMOLLM2_135M: dict[str, Any] = dict(  # noqa: C408
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_random_model(path: Path, tokenizer_dir: Path | None = None) -> None:
    """Random bf16 weights of SmolLM2-135M's shape into `path`, plus the tokenizer files of `tokenizer_dir`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2_135M, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    model: Any = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, path / name)


def export_tokenizer(gguf_path: str, dest: Path) -> None:
    """The GGUF file's tokenizer as tokenizer.json + tokenizer_config.json (what hf_loader reads back)."""
    from engine_native.model.gguf_file import read_gguf
    from engine_native.model.gguf_tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(read_gguf(gguf_path).meta)
    dest.mkdir(parents=True, exist_ok=True)
    tok.backend.save(str(dest / "tokenizer.json"))
    config = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "add_bos_token": tok.add_bos_token,
              "chat_template": tok.chat_template}
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export-tokenizer", help="write the bundled (or a given) GGUF's tokenizer to DEST")
    exp.add_argument("dest", type=Path)
    exp.add_argument("--gguf", default=None, help="GGUF file; default: the bundled model")
    save = sub.add_parser("save", help="write a random-weight model of SmolLM2-135M's shape to DEST")
    save.add_argument("dest", type=Path)
    save.add_argument("--tokenizer", type=Path, default=None, help="a folder export-tokenizer wrote")
    args = p.parse_args(argv)
    if args.command == "export-tokenizer":
        from engine_native.model.bundled import bundled_model_path

        export_tokenizer(args.gguf or bundled_model_path(), args.dest)
    else:
        save_random_model(args.dest, args.tokenizer)
    print(args.dest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
